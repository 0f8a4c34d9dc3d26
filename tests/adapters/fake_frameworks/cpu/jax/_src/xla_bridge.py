# SPDX-License-Identifier: Apache-2.0
"""jax._src.xla_bridge's backend table, as bridge.adapters.jax reads and clears it."""

_backends: dict = {}


def backends_are_initialized() -> bool:
    return len(_backends) != 0


def _clear_backends() -> None:
    _backends.clear()
