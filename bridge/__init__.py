# SPDX-License-Identifier: Apache-2.0
"""bridge: one GPU memory pool and one budget for CuPy, PyTorch and JAX.

>>> import bridge
>>> b = bridge.unify(cupy=True, torch=True, jax=False, budget="80%")
>>> bridge.stats().by_framework
{'cupy': 0, 'torch': 0, 'jax': 0, 'other': 0}
"""

from __future__ import annotations

from typing import Any

from bridge._errors import BridgeError, OutOfMemoryError
from bridge._version import __version__
from bridge._wait import waiting
from bridge.budget import parse_size
from bridge.pool import Pool, Stats, pool, stats
from bridge.recovery import on_pressure, remove_pressure_callback
from bridge.unify import Bridge, unify

__all__ = [
    "Bridge",
    "BridgeError",
    "OutOfMemoryError",
    "Pool",
    "Stats",
    "unify",
    "pool",
    "stats",
    "parse_size",
    "on_pressure",
    "remove_pressure_callback",
    "waiting",
    "empty_pinned",
    "zeros_pinned",
    "pinned_buffer",
    "pinned_pool",
    "pinned_record",
    "PinnedBuffer",
    "PinnedPool",
    "record",
    "mem_get_info",
    "record_memory_history",
    "memory_snapshot",
    "dump_snapshot",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # Pinned memory and the timeline load on first use: importing bridge stays cheap.
    if name in (
        "empty_pinned",
        "zeros_pinned",
        "pinned_buffer",
        "pinned_pool",
        "PinnedBuffer",
        "PinnedPool",
        "pinned_record",
    ):
        from bridge import pinned

        return getattr(pinned, name)
    if name == "record":
        from bridge import timeline

        return timeline.record
    if name == "mem_get_info":
        from bridge import views

        return views.mem_get_info
    if name in ("record_memory_history", "memory_snapshot", "dump_snapshot"):
        from bridge import snapshot

        return getattr(snapshot, name)
    if name == "cli":  # bridge.cli.main(["stats"]): the command line inside a program
        import importlib

        return importlib.import_module("bridge.cli")
    raise AttributeError(f"module 'bridge' has no attribute {name!r}")
