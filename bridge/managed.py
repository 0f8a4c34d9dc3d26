# SPDX-License-Identifier: Apache-2.0
"""Managed (unified) memory on the budget: ``cupy.cuda.set_allocator(bridge.malloc_managed)``.

CuPy users who choose ``cupy.cuda.malloc_managed`` leave the bridge's budget;
:func:`malloc_managed` is the same allocator on it. Managed memory is outside
the stream-ordered pool (``cuMemAllocManaged`` / ``cuMemFree``, in the compiled
core's ``bridge/_native/managed.c``): never cached, freed when its last
reference is gone (the free waits for the device's work on it). Its bytes count
against the budget under their framework (``cupy`` for CuPy's arrays), in
``bridge.stats().by_framework`` and ``Stats.ledger``; they are not in the pool's
``used`` and ``reserved``, and a share (``unify(share=...)``), which follows the
pools, does not see them.
"""

from __future__ import annotations

__all__ = ["malloc_managed", "managed_stats"]

import importlib
from typing import Any

from bridge import _errors, _runtime, frameworks, recovery
from bridge._errors import OOM_STATUSES, check
from bridge._runtime import core


def allocate(device: int, size: int, tag: int) -> Any:
    """A ``bridge._core.ManagedBlock`` of ``size`` bytes on ``device`` for ``tag``, or
    None for 0 bytes; before giving up on the budget it returns the pool's idle memory
    and runs the recovery chain once. Raises ``bridge.OutOfMemoryError`` when refused."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"size={size!r}: pass a number of bytes >= 0")
    _runtime.ensure_device(device)
    rc, block = core.alloc_managed(device, size, tag)
    if rc in OOM_STATUSES:  # idle pool memory and caches count in the budget: free them once
        check(core.trim(device, 0), what="returning idle memory", device=device)
        recovery.relieve(device, size, tag)
        rc, block = core.alloc_managed(device, size, tag)
    if rc in OOM_STATUSES:
        framework = _tag_names().get(tag, "other")
        s = _errors_figures(device)
        raise _errors.OutOfMemoryError(
            _errors.oom_message(device, size, rc, framework=framework).replace(
                " bytes (", " bytes of managed memory (", 1
            ),
            device=device,
            size=size,
            limit=s[0],
            by_framework=s[1],
        )
    check(rc, what=f"allocating {size} bytes of managed memory", device=device)
    return block


def _tag_names() -> dict[int, str]:
    from bridge.pool import TAG_NAMES

    return TAG_NAMES


def _errors_figures(device: int) -> tuple[int, dict[str, int]]:
    from bridge.pool import stats

    s = stats(device)
    return s.limit, s.by_framework


def malloc_managed(size: int) -> Any:
    """Allocate ``size`` bytes of managed memory on the current device, under the budget.

    The bridge's ``cupy.cuda.malloc_managed``: pass it to
    ``cupy.cuda.set_allocator`` (or call it) where CuPy would allocate managed
    memory.

    Parameters
    ----------
    size : int
        Bytes (>= 0).

    Returns
    -------
    cupy.cuda.MemoryPointer or bridge._core.ManagedBlock
        With CuPy installed, a ``MemoryPointer`` on CuPy's current device
        (counted as ``cupy``); without it, the block (``ptr``, ``size``,
        ``device``; counted as ``other``). The memory goes back, and the
        budget with it, when the object is gone.

    Raises
    ------
    OutOfMemoryError
        CuPy's ``OutOfMemoryError`` with CuPy, else ``bridge.OutOfMemoryError``,
        when the budget (or the device) refuses, naming the budget and every
        framework's bytes.
    ValueError
        For a size that is not an int >= 0.
    BridgeError
        When there is no CUDA driver or device, or the driver has no managed memory.
    """
    fw = frameworks.pointers()
    try:
        importlib.import_module(fw.name)
    except ImportError:
        return allocate(_runtime.current_device(), size, core.TAG_OTHER)
    return importlib.import_module(fw.adapter).malloc_managed(size)


def managed_stats(device: int | None = None) -> tuple[int, int]:
    """(bytes, blocks) of managed memory live on a device (the current one when None).

    Raises
    ------
    ValueError
        For a device this process does not see (as :func:`malloc_managed` would).
    """
    d = _runtime.current_device() if device is None else device
    if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < _runtime.device_count():
        raise ValueError(f"device={d!r}: no such CUDA device (there are {_runtime.device_count()})")
    rc, nbytes, blocks = core.managed_stats(d)
    check(rc, what="reading the managed memory", device=d)
    return int(nbytes), int(blocks)
