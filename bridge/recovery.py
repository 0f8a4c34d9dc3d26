# SPDX-License-Identifier: Apache-2.0
"""What runs before an allocation fails: release caches, collect garbage, ask the user.

The compiled core first synchronizes the stream and retries; then it calls
:func:`relieve` (through a hook that takes the GIL) and retries once more.
A thread that will wait for memory (``bridge.waiting``) runs the chain in two
parts: the framework caches and the callbacks before its wait, the garbage
collection only when the wait goes on past 100 ms or is about to fail.  A full
``gc.collect()`` holds the GIL for about 0.1 s in a process with torch and
CuPy loaded, stopping every Python thread, the one that would free included;
the partner's free usually comes sooner.
"""

from __future__ import annotations

__all__ = ["on_pressure", "remove_pressure_callback", "register_releaser", "relieve"]

import atexit
import gc
import logging
import threading
from collections.abc import Callable

from bridge._runtime import core, on_reset

log = logging.getLogger("bridge")

PressureCallback = Callable[[int, int], object]  # (device, bytes wanted) -> anything
Releaser = Callable[[int, int], object]  # (device, tag of the request) -> anything

_lock = threading.Lock()
_callbacks: list[PressureCallback] = []
_releasers: dict[str, tuple[Releaser, bool]] = {}  # name -> (fn, it collects garbage itself)
_installed = False
_in_progress = threading.local()
_reliever: threading.Thread | None = None


def on_pressure(fn: PressureCallback) -> PressureCallback:
    """Call ``fn(device, nbytes)`` before the bridge refuses an allocation.

    The callback may free memory (drop caches, move tensors to the host);
    the allocation is retried after it. Usable as a decorator.

    Parameters
    ----------
    fn : callable
        ``fn(device: int, nbytes: int)``; its return value is ignored and an
        exception it raises is logged, never propagated into the allocation.

    Returns
    -------
    callable
        ``fn`` itself.
    """
    if not callable(fn):
        raise TypeError(f"on_pressure needs a callable, got {type(fn).__name__}")
    with _lock:
        if fn not in _callbacks:
            _callbacks.append(fn)
    install()
    return fn


def remove_pressure_callback(fn: PressureCallback) -> None:
    """Forget a callback given to :func:`on_pressure` (no error if unknown)."""
    with _lock:
        if fn in _callbacks:
            _callbacks.remove(fn)


def register_releaser(name: str, fn: Releaser, *, collects: bool = False) -> None:
    """An adapter's way to drop its framework's caches under pressure.

    ``collects``: releasing runs a full garbage collection itself (CuPy's FFT
    plan cache): it runs with the chain's collection, not before a wait.
    """
    with _lock:
        _releasers[name] = (fn, collects)
    install()


def relieve(device: int, nbytes: int, tag: int = 0, stage: int = core.RELIEVE_ALL) -> bool:
    """Run the recovery chain once; True when a retry is worth it.

    ``stage`` says which part: ``core.RELIEVE_ALL`` (framework caches, garbage
    collection, callbacks), ``RELIEVE_CACHES`` (before a wait: the caches whose
    release collects no garbage, and the callbacks) or ``RELIEVE_COLLECT``
    (during a wait: the caches whose release collects, and the collection).
    """
    if getattr(_in_progress, "active", False):
        return False  # an allocation made by a callback: no recursion
    _in_progress.active = True
    try:
        collect = stage != core.RELIEVE_CACHES  # gc.collect() and the releasers that collect
        plain = stage != core.RELIEVE_COLLECT  # the other releasers and the callbacks
        with _lock:
            releasers = [
                (name, fn)
                for name, (fn, collects) in _releasers.items()
                if (collect if collects else plain)
            ]
            callbacks = list(_callbacks) if plain else []
        for name, release in releasers:
            try:
                release(device, tag)
            except Exception:  # noqa: BLE001 - recovery never raises into an allocation
                log.exception("bridge: releasing %s's caches failed", name)
        if collect:
            gc.collect()
        for fn in callbacks:
            try:
                fn(device, nbytes)
            except Exception:  # noqa: BLE001
                log.exception("bridge: on_pressure callback %r failed", fn)
        return True
    finally:
        _in_progress.active = False


def _start_reliever() -> None:
    """The thread that runs :func:`relieve` for torch's C++ threads (autograd).

    Those threads never take the GIL themselves (they may hold torch locks a
    Python thread waits for): they ask this thread and wait a bounded time.
    """
    global _reliever
    if _reliever is not None and _reliever.is_alive():
        return
    _reliever = threading.Thread(target=core.relief_loop, name="bridge-reliever", daemon=True)
    _reliever.start()


def install() -> None:
    """Connect :func:`relieve` to the core (idempotent)."""
    global _installed
    if not _installed:
        core.set_pressure_callback(relieve)
        _start_reliever()
        _installed = True


@on_reset
def _forget() -> None:
    """The core's callback is set again by the next install()."""
    global _installed
    _installed = False


atexit.register(core.stop_relief)
