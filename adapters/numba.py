# SPDX-License-Identifier: Apache-2.0
"""Numba on the shared pool: an External Memory Management (EMM) plugin.

``bridge.unify(numba=True)`` calls ``numba.cuda.set_memory_manager`` with
:class:`BridgeNumbaManager`; ``NUMBA_CUDA_MEMORY_MANAGER=bridge.adapters.numba``
does the same from the environment (Numba imports this module and takes its
``_numba_memory_manager``). Either way it must happen before Numba creates its
first CUDA context: a context keeps the manager it was made with.

Device memory (``cuda.device_array``, ``to_device``, the copies a kernel
launch makes of host arrays) comes from the core through one C call
(``alloc_block``, no GIL held, tag ``numba``). The block is owned by a C
object kept by Numba's ``AutoFreePointer``: when Numba's finalizer drops the
pointer (its last array or view is gone), the block is freed on the legacy
default stream, after the work of every blocking stream (Numba's) queued so far.
Inside ``numba.cuda.defer_cleanup()`` frees wait until the block ends. Past
the budget, :class:`OutOfMemoryError` is raised: Numba's ``CudaAPIError``
with code ``CUDA_ERROR_OUT_OF_MEMORY`` (what Numba raises for a failed
``cuMemAlloc``), and a ``MemoryError`` too.

Numba's EMM interface passes no stream: memory is allocated and freed on the
legacy default stream, which Numba's streams (blocking, and the per-thread
default streams) are ordered with both ways; Numba's freed blocks skip the
bridge's per-stream cache for that reason. An array used on a non-blocking
stream (a CuPy or torch stream) must be synchronized with before it is dropped.

Pinned host memory (``cuda.pinned_array``) comes from the bridge's pinned
pool; mapped and write-combined host memory, managed memory, ``mempin`` and
IPC stay Numba's own (docs/numba.md lists what Numba allocates outside).
"""

from __future__ import annotations

__all__ = ["BridgeNumbaManager", "OutOfMemoryError", "install", "installed"]

import contextlib
import functools
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from numba import cuda
from numba.cuda.cudadrv import driver as _drv

from bridge import _runtime, recovery, views
from bridge._errors import OOM_STATUSES, BridgeError, Status, check, oom_message
from bridge._runtime import core
from bridge.pool import stats

try:  # numba-cuda (on CUDA Python); the CUDA target that came with numba itself has no EMM
    _OOM_CODE = _drv.binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    _NOT_SUPPORTED = _drv.binding.CUresult.CUDA_ERROR_NOT_SUPPORTED
    _ = (_drv.HostOnlyCUDAMemoryManager, _drv.GetIpcHandleMixin, _drv.AutoFreePointer)
except AttributeError as exc:  # pragma: no cover - depends on the numba installed
    raise ImportError(
        f"bridge.adapters.numba needs numba-cuda 0.30 or newer (pip install numba-cuda): {exc}",
        name="numba",
    ) from exc
# Numba's arrays are allocated and freed on the legacy default stream, which
# every blocking stream (Numba's own, and the per-thread default streams of
# CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM=1) is ordered with, both ways.
LEGACY_STREAM = 0


class OutOfMemoryError(_drv.CudaAPIError, MemoryError):
    """Numba's ``CudaAPIError`` (code ``CUDA_ERROR_OUT_OF_MEMORY``) with the bridge's message."""

    def __init__(self, message: str, *, device: int = 0, size: int = 0, limit: int = 0) -> None:
        super().__init__(_OOM_CODE, f"CUDA_ERROR_OUT_OF_MEMORY: {message}")
        self.device = device
        self.size = size
        self.limit = limit

    def __reduce__(self) -> tuple:
        return (_rebuild, (self.msg, self.device, self.size, self.limit))


def _rebuild(msg: str, device: int, size: int, limit: int) -> OutOfMemoryError:
    e = OutOfMemoryError("", device=device, size=size, limit=limit)
    e.msg = msg
    e.args = (_OOM_CODE, msg)
    return e


def _uncached() -> None:
    """Numba's freed blocks go back to the pool on the legacy stream, never to the cache.

    The cache hands a block to the next request on the same stream without a
    driver call; Numba's next array may be used on another of its streams,
    which only the driver's free on the legacy stream orders after the last
    user. Set once per process (the environment route sets it too).
    """
    check(core.set_tag_cached(core.TAG_NUMBA, False), what="setting up Numba's blocks")


def _oom(device: int, size: int, rc: int) -> OutOfMemoryError:
    raw_rc, raw = core.stats(device)
    limit = int(raw["limit"]) if raw_rc == Status.OK else 0
    msg = oom_message(device, size, rc, framework="numba")
    return OutOfMemoryError(msg, device=device, size=size, limit=limit)


def _record_and_drop(buf: Any) -> None:
    """A pinned block's finalizer: no reuse before the default stream's queued work.

    The legacy default stream waits for every blocking stream (Numba's), so
    an asynchronous copy still reading the block finishes first. Never raises.
    """
    try:
        buf.record(0)
    except Exception:  # noqa: BLE001 - a finalizer must not raise
        pass


class BridgeNumbaManager(_drv.GetIpcHandleMixin, _drv.HostOnlyCUDAMemoryManager):
    """Numba's memory manager on the shared pool: device memory counted as ``numba``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        ctx = self.context  # None for the instance set_memory_manager checks
        self._device = int(ctx.device.id) if ctx is not None else 0
        self._stream = LEGACY_STREAM
        self._held: list[Any] = []  # pointers whose free waits for defer_cleanup to end
        self._ready = False

    def initialize(self) -> None:
        """Set the device's pool up (budget from the environment) once."""
        if self._ready:
            return
        _runtime.ensure_device(self._device)
        _uncached()
        recovery.install()
        if self.deallocations.memory_capacity == _drv._SizeNotSet:
            self.deallocations.memory_capacity = self.get_memory_info().total
        self._ready = True

    def memalloc(self, size: int) -> Any:
        """Device memory from the shared pool (Numba's ``MemoryPointer``, owned)."""
        ctx = weakref.proxy(self.context)
        if size == 0:
            return _drv.MemoryPointer(ctx, _drv.binding.CUdeviceptr(0), 0)
        rc, block = core.alloc_block(self._device, size, self._stream, core.TAG_NUMBA)
        if rc != Status.OK or block is None:
            block = self._slow_alloc(size, rc)
        ptr = block.ptr
        mem = _drv.AutoFreePointer(
            ctx,
            _drv.binding.CUdeviceptr(ptr),
            size,
            finalizer=functools.partial(self._release, ptr),
        )
        mem._bridge_block = block  # freed (C dealloc) when the pointer goes
        self.allocations[ptr] = mem
        return mem.own()

    def _slow_alloc(self, size: int, rc: int) -> Any:
        """Set up a device first used now, or raise Numba's OOM error."""
        if rc in (Status.DEVICE, Status.NOTINIT):
            _runtime.ensure_device(self._device)
            rc, block = core.alloc_block(self._device, size, self._stream, core.TAG_NUMBA)
            if rc == Status.OK:
                return block
        if rc in OOM_STATUSES:
            raise _oom(self._device, size, rc)
        check(rc, what=f"numba allocation of {size} bytes", device=self._device)
        raise BridgeError(f"numba allocation of {size} bytes failed with status {rc}")

    def _release(self, ptr: int) -> None:
        """Numba's finalizer of a device pointer: drop it (its block is freed with it).

        Numba uses an array on any of its streams, so the block is freed on
        the legacy default stream, after every blocking stream's queued work
        (Numba's streams are blocking); Numba's blocks are never kept by the
        bridge's per-stream cache, whose reuse would skip that wait
        (``_uncached``).
        """
        mem = self.allocations.pop(ptr, None)
        if mem is not None and self.deallocations.is_disabled:
            self._held.append(mem)  # inside defer_cleanup(): freed when it ends

    def memhostalloc(
        self, size: int, mapped: bool = False, portable: bool = False, wc: bool = False
    ) -> Any:
        """Pinned host memory from the bridge's pinned pool (mapped or write-combined: Numba's)."""
        if mapped or wc:
            return super().memhostalloc(size, mapped, portable, wc)
        from bridge._errors import OutOfMemoryError as BridgeOOM
        from bridge.pinned import pinned_buffer

        try:
            buf = pinned_buffer(size)
        except BridgeOOM as exc:
            raise OutOfMemoryError(str(exc), device=self._device, size=size) from exc
        return _drv.PinnedMemory(
            weakref.proxy(self.context),
            buf.ptr,
            size,
            owner=buf,
            finalizer=functools.partial(_record_and_drop, buf),
        )

    def get_memory_info(self) -> Any:
        """``(free, total)`` within the budget: the bytes an allocation could still get.

        Under a budget (a share's included) the answer of :func:`bridge.mem_get_info`, which
        torch's and CuPy's queries give too: it counts what the budget counts (managed
        memory, a share's other members); without one the device's free memory plus the
        pool's idle memory.
        """
        s = stats(self._device)
        if s.limit:
            free, total = views.mem_get_info(self._device)
            return _drv.MemoryInfo(free=free, total=total)
        free, total = _drv.driver.cuMemGetInfo()
        free = int(free) + max(0, s.reserved - s.used)  # idle pool memory is free to us
        return _drv.MemoryInfo(free=free, total=int(total))

    def get_ipc_handle(self, memory: Any) -> Any:
        """Numba's IPC handle (``DeviceNDArray.get_ipc_handle()``): refused, saying why.

        Numba's handles come from ``cuIpcGetMemHandle``, which the driver refuses for
        memory of a stream-ordered pool, as every block of the plugin is; its bare
        ``CudaAPIError`` said nothing of why or what to do.
        """
        raise _drv.CudaAPIError(
            _NOT_SUPPORTED,
            "bridge: a Numba array on the shared pool has no CUDA IPC handle: Numba's "
            "handles come from cuIpcGetMemHandle, which the driver refuses for memory of a "
            "stream-ordered pool. Share the array through the host (copy_to_host), or "
            "allocate it with Numba's own memory manager in a process without "
            "unify(numba=True).",
        )

    def reset(self) -> None:
        """Free every allocation of the context (Numba's ``Context.reset``)."""
        super().reset()
        self._held.clear()

    @contextlib.contextmanager
    def defer_cleanup(self) -> Iterator[None]:
        """Hold frees (device and host) back until the outermost block ends."""
        try:
            with super().defer_cleanup():
                yield
        finally:
            if not self.deallocations.is_disabled:
                held, self._held = self._held, []
                del held

    @property
    def interface_version(self) -> int:
        return 1


def installed() -> bool:
    """Whether Numba creates its contexts with the bridge's memory manager."""
    return _drv._memory_manager is BridgeNumbaManager


def _check_contexts() -> None:
    for dev in list(_drv.driver.devices.values()):
        ctx = getattr(dev, "primary_context", None)
        if ctx is not None and not isinstance(ctx.memory_manager, BridgeNumbaManager):
            raise BridgeError(
                "call bridge.unify(numba=True) before Numba's first CUDA call: Numba has "
                f"already created a context on device {dev.id} with its own memory manager, "
                "and a context keeps it. Move bridge.unify() to the top of your program, "
                "call numba.cuda.close() first (it invalidates existing Numba arrays), or set "
                "NUMBA_CUDA_MEMORY_MANAGER=bridge.adapters.numba in the environment."
            )


def install(devices: Iterable[int]) -> None:
    """Make Numba's future contexts allocate through the bridge. Before Numba's first CUDA call."""
    for d in devices:
        _runtime.ensure_device(d)
    _check_contexts()
    _uncached()
    if not installed():
        cuda.set_memory_manager(BridgeNumbaManager)


# NUMBA_CUDA_MEMORY_MANAGER=bridge.adapters.numba: what Numba takes from this module
_numba_memory_manager = BridgeNumbaManager
