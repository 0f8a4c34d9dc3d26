# SPDX-License-Identifier: Apache-2.0
"""Every environment variable the library reads, in one table, with the library's own reader.

``bridge doctor`` walks this table and calls each variable's reader, the very
function the library calls, so that the doctor refuses exactly what the
library refuses (a ``ValueError`` naming the variable) and cannot drift from
it; ``tests/core/test_env.py`` walks it too, and checks that no variable read in the
code is missing from it.
"""

from __future__ import annotations

__all__ = ["Totals", "Variable", "VARIABLES", "NAMES", "variable"]

import dataclasses
import importlib
import os
from collections.abc import Callable
from typing import Any

from bridge import _runtime, _wait, frameworks, share
from bridge._errors import format_bytes
from bridge.budget import DEVICE_MEMORY, GPU_LIMIT_ENV, HOST_MEMORY, PINNED_LIMIT_ENV, size_from_env
from bridge.pinned._backend import BACKEND_ENV, backend_from_env


@dataclasses.dataclass(frozen=True)
class Totals:
    """The memory that shares and percentages are of, where known."""

    device: int | None = None  # the smallest GPU's memory
    host: int | None = None
    devices: tuple[int, ...] = ()  # every GPU's memory


@dataclasses.dataclass(frozen=True)
class Variable:
    """One variable: its name, who reads it, and how.

    ``read(totals)`` is what the library calls (it reads ``os.environ``):
    the value, or a ``ValueError`` naming the variable and the value.
    ``describe(value, totals)`` says in words what a valid value does, as
    ``(level, text)``.
    """

    name: str
    who: str  # what a bad value does ("bridge.unify() and bridge.pool() raise ValueError on it")
    read: Callable[[Totals], object]
    describe: Callable[[Any, Totals], tuple[str, str]]


def _valid(text: str) -> tuple[str, str]:
    return "ok", f"valid: {text}."


def _budget(size: Any, t: Totals) -> tuple[str, str]:
    if t.devices and size and size > max(t.devices):
        return "warn", (
            f"{format_bytes(size)} is above the GPUs' memory ({format_bytes(max(t.devices))}): "
            "it limits nothing. Use a size below it or a percentage such as 90%."
        )
    if not t.devices:
        return _valid(format_bytes(size) if size else "no limit")
    return _valid(f"a budget of {format_bytes(size)} per device" if size else "no limit")


def _device_size(name: str) -> Callable[[Totals], object]:
    # without a GPU a share of the device is still checked for its form
    return lambda t: size_from_env(name, total=t.device or 1 << 40, of=DEVICE_MEMORY)


def _bytes(size: Any, t: Totals) -> tuple[str, str]:
    return _valid(format_bytes(size) if size else "no limit")


def _cache(size: Any, t: Totals) -> tuple[str, str]:
    return _valid(f"a cache of {format_bytes(size)} per device" if size else "no cache")


def _share_dir(t: Totals) -> str:
    path = share.share_dir()
    if not os.path.isdir(path):
        raise ValueError(
            f"{share.SHARE_DIR_ENV}={os.environ.get(share.SHARE_DIR_ENV)!r} is not a directory: "
            "a share cannot be joined. Create it or unset the variable."
        )
    return path


POOL = "bridge.unify() and bridge.pool() raise ValueError on it"
PINNED = "bridge's pinned-memory functions raise ValueError on it"
UNIFY = "bridge.unify() raises ValueError on it"
VARIABLES: tuple[Variable, ...] = (
    Variable(GPU_LIMIT_ENV, POOL, _device_size(GPU_LIMIT_ENV), _budget),
    Variable(_runtime.CACHE_LIMIT_ENV, POOL, _device_size(_runtime.CACHE_LIMIT_ENV), _cache),
    Variable(
        _runtime.CACHE_FRACTION_ENV,
        POOL,
        lambda t: _runtime.cache_fraction_from_env(),
        lambda v, t: _valid(f"the cache's cap is {v:g} of the live bytes"),
    ),
    Variable(_runtime.CACHE_FLOOR_ENV, POOL, _device_size(_runtime.CACHE_FLOOR_ENV), _bytes),
    Variable(
        _runtime.CACHE_SMALL_MAX_ENV, POOL, _device_size(_runtime.CACHE_SMALL_MAX_ENV), _bytes
    ),
    Variable(
        _runtime.CACHE_LARGE_CAP_ENV, POOL, _device_size(_runtime.CACHE_LARGE_CAP_ENV), _bytes
    ),
    Variable(
        _runtime.CACHE_LARGE_FRACTION_ENV,
        POOL,
        lambda t: _runtime.cache_large_fraction_from_env(),
        lambda v, t: _valid(f"the large tier's cap is at most {v:g} of the live bytes"),
    ),
    Variable(
        _runtime.CACHE_CARVE_ENV,
        POOL,
        lambda t: _runtime.cache_carve_from_env(),
        lambda v, t: _valid(
            "the cache carves its blocks from pool chunks" if v else "carving is off"
        ),
    ),
    Variable(
        _runtime.CACHE_SEGMENTS_ENV,
        POOL,
        lambda t: _runtime.cache_segments_from_env(),
        lambda v, t: _valid(
            "the cache serves its requests from pool segments" if v else "segments are off"
        ),
    ),
    Variable(
        _runtime.CACHE_THREAD_SLOT_ENV,
        POOL,
        lambda t: _runtime.cache_thread_slot_from_env(),
        lambda v, t: _valid(
            "each thread's newest freed block waits in a slot of its own"
            if v
            else "freed blocks go to the shared cache alone"
        ),
    ),
    Variable(
        PINNED_LIMIT_ENV,
        PINNED,
        lambda t: size_from_env(PINNED_LIMIT_ENV, total=t.host, of=HOST_MEMORY),
        _bytes,
    ),
    Variable(
        BACKEND_ENV,
        PINNED,
        lambda t: backend_from_env(),
        lambda v, t: ("ok", "valid."),
    ),
    Variable(
        _runtime.DRIVER_LIBRARY_ENV,
        UNIFY,
        lambda t: os.environ.get(_runtime.DRIVER_LIBRARY_ENV),
        lambda v, t: ("info", "the bridge loads this library instead of libcuda.so.1."),
    ),
    Variable(
        _wait.WAIT_ENV,
        UNIFY,
        lambda t: _wait.wait_from_env(),
        lambda v, t: _valid(
            f"an allocation the budget refuses waits up to {v:g} s for memory others free"
            if v
            else "an allocation the budget refuses fails at once"
        ),
    ),
    Variable(
        share.SHARE_ENV,
        UNIFY,
        lambda t: share.share_name(None),
        lambda v, t: _valid(
            f"bridge.unify() joins the share {v!r} (one budget for every process that uses it "
            "on a GPU)"
        ),
    ),
    Variable(
        _runtime.IPC_ENV,
        UNIFY,
        lambda t: _runtime.ipc_from_env(),
        lambda v, t: _valid(
            "bridge.unify() allocates from pools whose blocks other processes of this user can "
            "import (torch.multiprocessing)"
            if v
            else "the driver's default pools (blocks cannot be sent to other processes)"
        ),
    ),
    Variable(
        share.SHARE_DIR_ENV,
        "bridge.unify(share=...) cannot join a share with it",
        _share_dir,
        lambda v, t: _valid(f"share files live in {v}"),
    ),
    Variable(
        share.SHARE_GROWTH_ENV,
        UNIFY,
        lambda t: share.share_growth_from_env(),
        lambda v, t: _valid(
            f"a share member claims {int(v) >> 20} MiB chunks for an allocation in flight"
        ),
    ),
)


def _adapters_variables() -> tuple[Variable, ...]:
    """The variables only an adapter reads, from its own rows (the registry says where)."""
    rows = []
    for f in frameworks.REGISTRY:
        if f.variables:  # a module of the adapter that imports no framework
            rows += [Variable(*row) for row in importlib.import_module(f.variables).VARIABLES]
    return tuple(rows)


VARIABLES += _adapters_variables()
NAMES: tuple[str, ...] = tuple(v.name for v in VARIABLES)


def variable(name: str) -> Variable:
    """The table's entry for a variable (KeyError when the library reads no such one)."""
    for v in VARIABLES:
        if v.name == name:
            return v
    raise KeyError(name)
