# SPDX-License-Identifier: Apache-2.0
"""bridge: one GPU memory pool and one budget for CuPy, PyTorch and JAX.

>>> import bridge
>>> b = bridge.unify(cupy=True, torch=True, jax=False, budget="80%")
>>> bridge.stats().by_framework
{'cupy': 0, 'torch': 0, 'jax': 0, 'numba': 0, 'rmm': 0, 'other': 0}
"""

import importlib
from typing import TYPE_CHECKING

from bridge._errors import BridgeError, OutOfMemoryError
from bridge._version import __version__
from bridge._wait import waiting
from bridge.budget import parse_size
from bridge.pool import Pool, Stats, pool, stats
from bridge.recovery import on_pressure, remove_pressure_callback
from bridge.unify import Bridge, unify

if TYPE_CHECKING:  # loaded on first use (below); typed as what they are
    from bridge.managed import malloc_managed
    from bridge.pinned import (
        PinnedBuffer,
        PinnedPool,
        empty_like_pinned,
        empty_pinned,
        pinned_buffer,
        pinned_pool,
        pinned_record,
        zeros_like_pinned,
        zeros_pinned,
    )
    from bridge.snapshot import dump_snapshot, memory_snapshot, record_memory_history
    from bridge.timeline import record
    from bridge.views import mem_get_info

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
    "empty_like_pinned",
    "zeros_like_pinned",
    "pinned_buffer",
    "pinned_pool",
    "pinned_record",
    "PinnedBuffer",
    "PinnedPool",
    "malloc_managed",
    "record",
    "mem_get_info",
    "record_memory_history",
    "memory_snapshot",
    "dump_snapshot",
    "__version__",
]

# Loaded on first use, so that importing bridge stays cheap: name -> (module, attribute)
_LAZY = {
    **{
        name: ("bridge.pinned", name)
        for name in (
            "empty_pinned",
            "zeros_pinned",
            "empty_like_pinned",
            "zeros_like_pinned",
            "pinned_buffer",
            "pinned_pool",
            "PinnedBuffer",
            "PinnedPool",
            "pinned_record",
        )
    },
    "malloc_managed": ("bridge.managed", "malloc_managed"),
    "record": ("bridge.timeline", "record"),
    "mem_get_info": ("bridge.views", "mem_get_info"),
    **{
        name: ("bridge.snapshot", name)
        for name in ("record_memory_history", "memory_snapshot", "dump_snapshot")
    },
    "cli": ("bridge.cli", ""),  # bridge.cli.main(["stats"]): the command line inside a program
    # the cluster plugins (optional extras: importing them imports distributed or ray)
    "dask": ("bridge.dask", ""),
    "ray": ("bridge.ray", ""),
}


if not TYPE_CHECKING:  # to a type checker the names are the imports above: a typo is an error

    def __getattr__(name: str) -> object:
        where = _LAZY.get(name)
        if where is None:
            raise AttributeError(f"module 'bridge' has no attribute {name!r}")
        module = importlib.import_module(where[0])
        return getattr(module, where[1]) if where[1] else module


def __dir__() -> list[str]:
    """The public names (the lazy ones included), not the module's helpers."""
    return sorted(set(__all__) | {"cli", "dask", "ray"})
