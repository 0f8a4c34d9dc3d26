# SPDX-License-Identifier: Apache-2.0
"""The pinned pool's start-up: the backend and the limit from the environment, its errors.

:func:`ensure` sets the pool up once (driver, ``BRIDGE_PINNED_BACKEND``,
``BRIDGE_PINNED_MEMORY_LIMIT``); :func:`set_backend` switches the base of new
blocks; :func:`raise_alloc` turns a refused allocation into the error that
says what to do.
"""

from __future__ import annotations

__all__ = [
    "BACKEND_ENV",
    "BACKENDS",
    "BACKEND_NAMES",
    "host_memory_total",
    "backend_from_env",
    "ensure",
    "ready",
    "set_backend",
    "raise_alloc",
    "raw_stats",
]

import os
import threading

from bridge import _runtime
from bridge._errors import BridgeError, OutOfMemoryError, Status, check, format_bytes
from bridge._runtime import core
from bridge.budget import HOST_MEMORY, PINNED_LIMIT_ENV, size_from_env

BACKEND_ENV = "BRIDGE_PINNED_BACKEND"
# the names BRIDGE_PINNED_BACKEND and set_backend accept; "cached" is the default
BACKENDS = {"cached": core.PINNED_CACHED, "mempool": core.PINNED_MEMPOOL, "auto": core.PINNED_AUTO}
BACKEND_NAMES = {core.PINNED_CACHED: "cached", core.PINNED_MEMPOOL: "mempool"}

_lock = threading.Lock()
_ready = False


def _new_lock_in_child() -> None:
    # A fork while another thread is in ensure() copies _lock held, by a thread the
    # child has not: a fresh one lets the child's first pinned call reach the core,
    # which tells it that it was forked (as CPython's own modules renew their locks).
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def host_memory_total() -> int | None:
    """Physical memory of this host in bytes (what fractions of the pinned limit are of).

    ``os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")``; None where unknown.
    """
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return pages * page if pages > 0 and page > 0 else None


def backend_from_env() -> int:
    """The backend ``BRIDGE_PINNED_BACKEND`` names (``cached`` when unset or empty).

    Raises
    ------
    ValueError
        For a name that is not a backend, naming the variable and the choices.
    """
    raw = os.environ.get(BACKEND_ENV, "").strip().lower() or "cached"
    if raw not in BACKENDS:
        raise ValueError(
            f"{BACKEND_ENV}={os.environ.get(BACKEND_ENV)!r} is not a pinned "
            f"backend: use one of {', '.join(sorted(BACKENDS))}"
        )
    return BACKENDS[raw]


def _setup(backend: int) -> int:
    rc, chosen = core.pinned_setup(backend)
    if rc == Status.NOPOOLS:
        raise BridgeError(
            "the CUDA driver cannot create a host-located memory pool "
            f"(cuMemPoolCreate with CU_MEM_LOCATION_TYPE_HOST); set {BACKEND_ENV}"
            "=cached or auto, or update the NVIDIA driver"
        )
    if rc == Status.INVALID:
        src, raw = core.pinned_stats()
        held = (
            f" (now {raw['n_live_blocks']} lent, {raw['n_pending_blocks']} awaited by a copy)"
            if src == Status.OK
            else ""
        )
        raise BridgeError(
            "the pinned backend can change only while no pinned block is lent "
            f"or awaited by a copy{held}: drop every pinned view and synchronize first"
        )
    if rc == Status.DEVICE:
        raise BridgeError(
            "pinned memory needs a CUDA device, and the driver reports none. "
            "Check CUDA_VISIBLE_DEVICES and `nvidia-smi`."
        )
    check(rc, what="setting up the pinned memory pool")
    return chosen


def ready() -> bool:
    """Whether the pool is set up."""
    return _ready


def ensure() -> None:
    """Load the driver and set the pool up (once): backend and limit from the environment.

    A bad variable raises every time, not only the first: the pool counts as
    set up only once both were applied.
    """
    global _ready
    if ready():  # the fast path: no lock once set up
        return
    with _lock:
        if _ready:
            return
        _runtime.ensure_driver()
        backend = backend_from_env()
        limit = size_from_env(PINNED_LIMIT_ENV, total=host_memory_total(), of=HOST_MEMORY)
        _setup(backend)
        if limit is not None:
            check(core.pinned_set_limit(limit), what="setting the pinned memory limit")
        _ready = True


def set_backend(name: str) -> str:
    """Switch the base of new blocks (tests, benchmarks); returns the one chosen.

    Only while no block is lent or awaited (BridgeError otherwise).
    """
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r}: use one of {', '.join(sorted(BACKENDS))}")
    ensure()
    return BACKEND_NAMES[_setup(BACKENDS[name])]


def raw_stats() -> dict:
    """The core's pinned figures as a plain dict."""
    rc, raw = core.pinned_stats()
    check(rc, what="reading the pinned pool figures")
    return dict(raw)


def raise_alloc(rc: int, size: int) -> None:
    """Raise the error a refused pinned allocation of ``size`` bytes stands for."""
    if rc in (Status.BUDGET, Status.OOM):
        s = raw_stats()
        held = (
            f"the pool holds {format_bytes(s['total'])} ({format_bytes(s['used'])} in use, "
            f"{format_bytes(s['free'])} free, {s['n_pending_blocks']} blocks awaiting copies)"
        )
        if rc == Status.BUDGET:
            why = (
                f"the pinned memory limit is {format_bytes(s['limit'])} ({s['limit']} bytes, "
                f"set by {PINNED_LIMIT_ENV} or bridge.pinned_pool().set_limit)"
            )
            todo = (
                "drop views you no longer need, synchronize streams with pending copies, "
                "or raise the limit"
            )
        elif size > (host := host_memory_total() or size):
            why = f"that is more than this host's memory ({format_bytes(host)})"
            todo = "ask for less (check the shape and the dtype)"
        else:
            why = "the system could not page-lock more host memory (the driver is out of memory)"
            todo = "drop views you no longer need, or call bridge.pinned_pool().free_all_blocks()"
        raise OutOfMemoryError(
            f"pinned host memory: cannot allocate {format_bytes(size)} ({size} bytes): {why}; "
            f"{held}. To go on: {todo}.",
            device=-1,
            size=size,
            limit=int(s["limit"]),
            by_framework={"pinned": int(s["used"])},
        )
    if rc == Status.NOTINIT:
        raise BridgeError(
            "the pinned memory pool is not set up (internal error: ensure() was bypassed)"
        )
    check(rc, what=f"allocating {size} bytes of pinned host memory")
