# SPDX-License-Identifier: Apache-2.0
"""A stand-in for a CPU-only JAX in tests (see ../../README.md)."""

from jax._src import xla_bridge

__version__ = "0.10.2"


def devices(backend=None):
    """As the real one: starts the backends (the CPU's), then finds no GPU among them."""
    xla_bridge._backends.setdefault("cpu", object())
    if backend not in (None, "cpu"):
        raise RuntimeError(
            f"Unknown backend: '{backend}' requested, but no platforms that are instances "
            f"of {backend} are present. Platforms present are: cpu"
        )
    return ["cpu:0"]
