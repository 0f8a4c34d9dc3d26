# SPDX-License-Identifier: Apache-2.0
"""RMM on the shared pool: every device's RMM resource allocates through the ledger.

``install`` gives each visible device an ``rmm.mr.CallbackMemoryResource``
(``rmm.mr.set_per_device_resource``) whose two callables are C functions of
the core: ``bridge._core.StreamAllocator`` (one per device, tag ``rmm``)
allocates on the stream RMM passes, and ``bridge._core.stream_free`` frees
on the stream RMM frees on, as RMM's own stream-ordered resources do: RMM
keeps that stream alive while the buffer lives (``DeviceBuffer`` holds a
reference to it), so the core may give it to the driver at the free, also
for a stream of its own that the bridge does not know (tag ``rmm`` holds its
streams: ``set_tag_holds_streams``). No Python frame runs per
allocation; RMM's own wrapper takes the GIL and builds a ``Stream`` object for
each call, which is what this path costs over RMM's ``CudaAsyncMemoryResource``
(benchmarks/bench_rmm.py measures it).

Everything built on RMM's current device resource follows: ``rmm.DeviceBuffer``,
``rmm.allocators.cupy.rmm_cupy_allocator`` (CuPy arrays then count as ``rmm``),
cuDF, cuML, XGBoost. An allocation past the budget raises ``MemoryError``, as
RMM's own resources do (RMM turns the callback's ``MemoryError`` into
``rmm::out_of_memory``, and that into ``MemoryError`` at the Python surface).

``rmm.reinitialize()`` or ``rmm.mr.set_current_device_resource(...)`` after
``bridge.unify(rmm=True)`` replaces the bridge's resource: call unify after them.
"""

from __future__ import annotations

__all__ = ["install", "installed", "resource"]

from collections.abc import Iterable
from typing import Any

import rmm
import rmm.mr

from bridge import _runtime
from bridge._errors import OOM_STATUSES, OutOfMemoryError, Status, check, oom_message
from bridge._runtime import core

_resources: dict[int, Any] = {}  # device -> the CallbackMemoryResource set for it


def installed(device: int | None = None) -> bool:
    """Whether RMM's resource of a device (the current one when None) is the bridge's."""
    d = _runtime.current_device() if device is None else device
    mr = _resources.get(d)
    return mr is not None and rmm.mr.get_per_device_resource(d) is mr


def resource(device: int) -> Any:
    """The bridge's RMM resource of a device (a new one the first time)."""
    mr = _resources.get(device)
    if mr is None:
        alloc = core.StreamAllocator(device, core.TAG_RMM, _on_failure)
        mr = rmm.mr.CallbackMemoryResource(alloc, core.stream_free)
        _resources[device] = mr
    return mr


def _on_failure(size: int, device: int, stream: int, rc: int) -> int:
    """The slow path: set up a device first used now, or raise RMM's OOM (MemoryError)."""
    if rc in (Status.DEVICE, Status.NOTINIT):
        _runtime.ensure_device(device)
        rc, ptr = core.alloc(device, size, stream, core.TAG_RMM)
        if rc == Status.OK:
            return int(ptr)
    if rc in OOM_STATUSES:
        raw_rc, raw = core.stats(device)
        raise OutOfMemoryError(
            oom_message(device, size, rc, framework="rmm"),
            device=device,
            size=size,
            limit=int(raw["limit"]) if raw_rc == Status.OK else 0,
        )
    check(rc, what=f"rmm allocation of {size} bytes", device=device)
    raise MemoryError(f"rmm allocation of {size} bytes failed with status {rc}")


def install(devices: Iterable[int]) -> None:
    """Make RMM's resource of every visible device allocate from the shared pool.

    The devices named are set up now (budget, pool); the others are set up by
    their first RMM allocation, as for the other frameworks.
    """
    # A free's stream is alive during the free (RMM's contract): issue it there.
    check(core.set_tag_holds_streams(core.TAG_RMM, True), what="rmm's streams")
    for d in devices:
        _runtime.ensure_device(d)
    for d in range(_runtime.device_count()):
        mr = resource(d)
        if rmm.mr.get_per_device_resource(d) is not mr:
            rmm.mr.set_per_device_resource(d, mr)


@_runtime.on_reset
def _forget() -> None:
    """A fork child (or a test) starts without the parent's resources."""
    _resources.clear()
