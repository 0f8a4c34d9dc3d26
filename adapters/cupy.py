# SPDX-License-Identifier: Apache-2.0
"""CuPy on the shared pool: ``cupy.cuda.set_allocator`` with the core's C allocator.

The allocator is a C callable (``bridge._core.CupyAllocator``): it asks CuPy
for the current device and stream, allocates from the pool (a block the
core's cache of freed blocks holds is taken with the GIL held; anything else
is allocated without it), and wraps the block in a ``BridgeMemory``, a
``BaseMemory`` of CuPy's made in C, inside CuPy's ``MemoryPointer``
(:mod:`bridge.adapters.cupy_memory`; CuPy's ``UnownedMemory`` where CuPy's
layout does not check out). The block is owned by a C object whose deallocation frees
it on the allocating stream (into the core's cache with the GIL held when
that needs no driver call; otherwise without the GIL): no Python ``__del__``
is involved. Failures go
to :func:`_on_failure`, which raises CuPy's own ``OutOfMemoryError``.
"""

from __future__ import annotations

__all__ = [
    "install",
    "installed",
    "malloc",
    "malloc_managed",
    "new_allocator",
    "pinned_allocator",
    "OutOfMemoryError",
    "install_views",
    "remove_views",
]

import logging
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import cupy
from cupy.cuda import memory as _cmem

from bridge import _runtime, recovery, views
from bridge._errors import OOM_STATUSES, BridgeError, Status, check, oom_message
from bridge._runtime import core
from bridge.pinned._buffer import pinned_buffer

from .cupy_memory import unowned_from_env


class OutOfMemoryError(_cmem.OutOfMemoryError):
    """CuPy's ``OutOfMemoryError``, with the bridge's message (device, budget, frameworks)."""

    def __init__(self, size: int, total: int, limit: int = 0, message: str = "") -> None:
        super().__init__(size, total, limit)
        if message:
            self.args = (message,)
        self._message = message

    def __reduce__(self) -> tuple:
        return (type(self), (self._size, self._total, self._limit, self._message))


_allocator: Any = None


def installed() -> bool:
    """Whether CuPy allocates from the shared pool."""
    return _allocator is not None and cupy.cuda.get_allocator() is _allocator


def _current_stream_fn() -> Callable[[], Any]:
    # The Stream object, not its handle: the block keeps it alive until the
    # free is queued on it (a destroyed stream must never reach the driver).
    return cupy.cuda.get_current_stream


def _current_device_fn() -> Callable[[], int]:
    return getattr(cupy.cuda.device, "get_device_id", None) or cupy.cuda.runtime.getDevice


def _capsules() -> dict[str, Any]:
    """CuPy's own C functions for the device and its stream, as Cython exports them
    (``__pyx_capi__``): the allocator calls them directly when their signatures are the
    ones it knows (``direct_lookups``), and the Python callables otherwise."""
    import importlib

    out = {}
    for key, module, name in (
        ("device_capsule", "cupy.cuda.device", "get_device_id"),
        ("stream_capsule", "cupy.cuda.stream", "get_current_stream"),
    ):
        try:
            out[key] = getattr(importlib.import_module(module), "__pyx_capi__", {}).get(name)
        except ImportError:
            out[key] = None
    return out


def new_allocator(direct: bool = True) -> Any:
    """A ``bridge._core.CupyAllocator`` as :func:`install` makes it (``direct``: with
    CuPy's C functions for the device and stream where their signatures are known; its
    blocks wrapped in ``BridgeMemory`` where CuPy's layout checks out, ``cupy_memory``)."""
    return core.CupyAllocator(
        _current_device_fn(),
        _current_stream_fn(),
        _cmem.UnownedMemory,
        _cmem.MemoryPointer,
        _on_failure,
        core.TAG_CUPY,
        **(_capsules() if direct else {}),
        base_memory=None if unowned_from_env() else _cmem.BaseMemory,
    )


def _on_failure(size: int, device: int, stream: int, rc: int) -> Any:
    """The slow path: set up a device first used now, or raise CuPy's OOM error."""
    if rc in (Status.DEVICE, Status.NOTINIT):
        _runtime.ensure_device(device)
        rc, block = core.alloc_block(
            device, size, stream, core.TAG_CUPY, cupy.cuda.get_current_stream(device)
        )
        if rc == Status.OK:
            return _allocator.wrap(block)
    if rc in OOM_STATUSES and _collect():
        # a CuPy graph died since the core's own collect: its pool is free now
        rc, block = core.alloc_block(
            device, size, stream, core.TAG_CUPY, cupy.cuda.get_current_stream(device)
        )
        if rc == Status.OK:
            return _allocator.wrap(block)
    if rc in OOM_STATUSES:
        raw_rc, raw = core.stats(device)
        total = raw["tags"][core.TAG_CUPY]["current"] if raw_rc == 0 else 0
        limit = raw["limit"] if raw_rc == 0 else 0
        raise OutOfMemoryError(size, total, limit, oom_message(device, size, rc, framework="cupy"))
    check(rc, what=f"cupy allocation of {size} bytes", device=device)
    raise BridgeError(f"cupy allocation of {size} bytes failed with status {rc}")


def malloc(device: int, size: int) -> Any:
    """``bridge.pool(device).malloc(size)``: a CuPy ``MemoryPointer`` on CuPy's current
    stream of ``device`` (whichever device is current), from the shared pool and counted
    as ``cupy``, freed when it is gone."""
    stream = cupy.cuda.get_current_stream(device)
    rc, block = core.alloc_block(device, size, stream.ptr, core.TAG_CUPY, stream)
    if rc != Status.OK or block is None:
        return _on_failure(size, device, stream.ptr, rc)
    return _cmem.MemoryPointer(_cmem.UnownedMemory(block.ptr, block.size, block, device), 0)


_managed_memory: Any = None  # _managed_memory_type's class, made at the first use


def _managed_memory_type() -> Any:
    """CuPy's ``UnownedMemory`` with the two methods of CuPy's ``ManagedMemory`` (what
    ``cupy.cuda.malloc_managed`` gives as ``MemoryPointer.mem``): ``prefetch`` and
    ``advise`` on the block's device. Made at the first managed allocation."""
    global _managed_memory
    if _managed_memory is not None:
        return _managed_memory

    class ManagedMemory(_cmem.UnownedMemory):
        """A managed block of the budget, as CuPy's ``ManagedMemory`` shows one."""

        __slots__ = ()

        def prefetch(self, stream: Any, *, device_id: int = -2) -> None:
            """Prefetch the block to ``device_id`` (-1: the host; by default its own
            device) on ``stream`` (``cudaMemPrefetchAsync``)."""
            if device_id == -2:  # cudaInvalidDeviceId: CuPy's default
                device_id = self.device_id
            cupy.cuda.runtime.memPrefetchAsync(self.ptr, self.size, device_id, stream.ptr)

        def advise(self, advise: int, dev: Any) -> None:
            """Advise the driver about the block's use by ``dev`` (``cudaMemAdvise``)."""
            cupy.cuda.runtime.memAdvise(self.ptr, self.size, advise, dev.id)

    _managed_memory = ManagedMemory
    return ManagedMemory


def malloc_managed(size: int) -> Any:
    """``bridge.malloc_managed``: CuPy's ``malloc_managed`` on the budget, counted as ``cupy``
    (managed memory is outside the pool: see bridge.managed); its ``mem`` has
    ``ManagedMemory``'s ``prefetch`` and ``advise``."""
    from bridge import managed
    from bridge._errors import OutOfMemoryError as BridgeOOM

    device = int(_current_device_fn()())
    try:
        block = managed.allocate(device, size, core.TAG_CUPY)
    except BridgeOOM as exc:
        raise OutOfMemoryError(size, exc.by_framework.get("cupy", 0), exc.limit, str(exc)) from None
    managed_memory = _managed_memory_type()
    if block is None:  # 0 bytes, as CuPy's
        return _cmem.MemoryPointer(managed_memory(0, 0, None, device), 0)
    return _cmem.MemoryPointer(managed_memory(block.ptr, block.size, block, device), 0)


def _release_pool(device: int, tag: int) -> None:
    """Under pressure: the blocks cached by CuPy's own MemoryPool (from before unify)."""
    cupy.get_default_memory_pool().free_all_blocks()


def _release_fft_plans(device: int, tag: int) -> None:
    """Under pressure: this thread's FFT plans for ``device`` (their work areas).

    Registered as collecting garbage: ``PlanCache.clear()`` runs a full
    ``gc.collect()``, even on an empty cache, and asking for the cache
    creates one in a thread that has none (on the H200 one more collection
    followed in such a thread, most likely when it ended).  So it is cleared
    only when it holds plans, and with the chain's own collection (never
    before a wait: the partner's free usually comes sooner).
    """
    try:
        with cupy.cuda.Device(device):
            cache = cupy.fft.config.get_plan_cache()
            if cache.get_curr_size():
                cache.clear()
    except Exception:  # noqa: BLE001 - no cache for this thread/device
        pass


def _stream_device(stream: Any) -> int:
    """The device of a CuPy stream; -1 (an ExternalStream's default) is the current one."""
    dev = int(stream.device_id)
    return dev if dev >= 0 else int(cupy.cuda.runtime.getDevice())


class _GraphPool:
    """The bridge's pool of one CuPy capture, released when its graph is gone.

    Arrays allocated on a stream while CuPy captures it come from a graph
    pool of their own (graph.c), as torch's graphs' do: the temporaries the
    capture frees stay with the graph, which reads and writes them at every
    ``Graph.launch()``.  CuPy's Graph cannot say when it dies (CuPy 14.2's is
    a Cython class with neither ``_add_ref`` nor weak references), the driver
    can: before CuPy ends the capture, the core gives the graph being
    captured a CUDA user object (``core.bind_graph``), whose destructor runs
    once the graph and every exec made from it are destroyed and their
    launches have completed.  The next collect (:func:`_collect`: captures,
    figures, trims, OOM retries, and the core's own refusal path) releases
    the pool, and this holder is dropped then (``bound``: the release is the
    core's).  Only when the driver refuses the user object does the holder
    go to the Graph's ``_add_ref`` or a weak reference, if the Graph has
    either, and otherwise stays for good (``_unreleased``).
    """

    __slots__ = ("device", "pool", "stream", "bound")

    def __init__(self, device: int, pool: int, stream: Any) -> None:
        # The capture's Stream is kept (and registered) as long as the graph: its
        # launches there are what the pool's blocks wait for when it is released,
        # and the core orders after a stream only while it can prove it alive.
        self.device, self.pool, self.stream = device, pool, stream
        self.bound = False
        _hold_stream(int(stream.ptr))

    def release(self) -> None:
        """Release the pool (a failed capture, a fallback's end of the Graph).

        A bound pool's release is the core's (it follows the graph's user
        object): nothing is released twice."""
        if self.pool and not self.bound:
            pool, self.pool = self.pool, 0
            core.graph(_RELEASE, self.device, core.CUPY_POOL, pool)
            self._drop()

    def released(self) -> None:
        """The core released the pool (its graph is gone): the Stream goes too."""
        self.pool = 0
        self._drop()

    def _drop(self) -> None:
        if self.stream is not None:
            _drop_stream(int(self.stream.ptr))
            self.stream = None

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - at interpreter exit the core may be gone
            pass


_RELEASE = 2  # core.graph's op: release a pool
_held: dict[int, int] = {}  # stream handle -> graphs holding it (registered while > 0)


def _hold_stream(handle: int) -> None:
    if handle and not _held.get(handle):
        core.register_stream(handle)
    if handle:
        _held[handle] = _held.get(handle, 0) + 1


def _drop_stream(handle: int) -> None:
    if handle and handle in _held:
        _held[handle] -= 1
        if not _held[handle]:
            del _held[handle]
            core.forget_stream(handle)  # it may be destroyed once nothing holds it


_unreleased: list[_GraphPool] = []  # graphs nothing can tell us the end of: kept
_capturing: dict[tuple[int, int], _GraphPool] = {}  # (device, stream handle) -> its pool
_bound: dict[tuple[int, int], _GraphPool] = {}  # (device, pool): the core releases it


@_runtime.on_graph_collect
def _collect() -> int:
    """Drop the holders of the pools the core released (their graphs are gone); how many."""
    released = core.graph_collect()
    for device, pool in released:
        holder = _bound.pop((device, pool), None)
        if holder is not None:
            holder.released()
    return len(released)


@_runtime.on_reset
def _forget_graphs() -> None:
    """A fork child (or a test's fresh core): the core forgot these pools; so does Python."""
    _bound.clear()
    _capturing.clear()


def _bind_to_capture(holder: _GraphPool, stream: Any) -> bool:
    """While ``stream`` still captures: the graph's end (a user object) releases the pool."""
    if core.bind_graph(holder.device, holder.pool, int(stream.ptr)) != Status.OK:
        return False  # an older driver, or the capture was invalidated: CuPy's hooks then
    holder.bound = True
    _bound[(holder.device, holder.pool)] = holder
    return True


def _bind_pool(graph: Any, holder: _GraphPool) -> None:
    """The fallbacks when the driver would not bind the pool to the captured graph:
    CuPy's ``_add_ref``, a weak reference, or the pool kept for good."""
    add_ref = getattr(graph, "_add_ref", None) or getattr(graph, "add_ref", None)
    if add_ref is not None:
        add_ref(holder)
        return
    try:
        weakref.finalize(graph, holder.release)
    except TypeError:  # no weak reference either: the memory stays, never reused under it
        _unreleased.append(holder)


def _tell_captures() -> None:
    """Let the core see CuPy's stream captures (``Stream.begin_capture`` .. ``end_capture``).

    While a stream is captured, nothing may be freed, synchronized or
    allocated on it (each would invalidate the capture or become a node of
    the user's graph): the core defers frees, and allocates the captured
    arrays in a graph pool of the capture's own (outside the capture), as it
    does for torch's graphs; the pool lives until the captured graph (and
    every exec of it) is gone, as the driver tells the core (_GraphPool).
    """
    for cls in (cupy.cuda.Stream, cupy.cuda.ExternalStream):
        begin, end = cls.begin_capture, cls.end_capture
        if getattr(begin, "_bridge", False):
            continue

        def begin_capture(self: Any, mode: Any = None, _begin: Any = begin) -> None:
            _collect()
            dev = _stream_device(self)
            rc, pool = core.capture_stream(True, dev, int(self.ptr))
            check(rc, what="starting a CuPy capture", device=dev)
            holder = _capturing[(dev, int(self.ptr))] = _GraphPool(dev, pool, self)
            try:
                _begin(self, mode)
            except BaseException:
                del _capturing[(dev, int(self.ptr))]
                core.capture_stream(False, dev, pool)
                holder.release()
                raise

        def end_capture(self: Any, _end: Any = end) -> Any:
            holder = _capturing.pop((_stream_device(self), int(self.ptr)), None)
            # before CuPy ends the capture: the graph is still the stream's to name
            bound = holder is not None and _bind_to_capture(holder, self)
            graph = None
            try:
                graph = _end(self)
                return graph
            finally:
                if holder is not None:
                    core.capture_stream(False, holder.device, holder.pool)
                    if bound:
                        pass  # the graph's end releases it (a failed capture's: at once)
                    elif graph is None:
                        holder.release()  # the capture failed: nothing will launch it
                    else:
                        _bind_pool(graph, holder)
                else:
                    core.capture(False, _stream_device(self))
                _collect()

        begin_capture._bridge = True  # type: ignore[attr-defined]
        begin_capture.__doc__, end_capture.__doc__ = begin.__doc__, end.__doc__
        cls.begin_capture, cls.end_capture = begin_capture, end_capture


def pinned_allocator() -> Callable[[int], Any]:
    """The allocator for ``cupy.cuda.set_pinned_memory_allocator``: size -> PinnedMemoryPointer.

    CuPy stages host-to-device copies (``cupy.asarray(numpy_array)``) and
    ``cupyx.empty_pinned`` through it; CuPy keeps the pointer (and so the
    block of the bridge's pinned pool) alive until the copies it recorded
    have completed.  ``bridge.pinned.cupy_pinned_allocator()`` returns it too.
    """
    from cupy.cuda.pinned_memory import PinnedMemoryPointer

    def allocate(size: int) -> Any:
        return PinnedMemoryPointer(pinned_buffer(size), 0)

    return allocate


_native: dict[str, Any] = {}  # what install_views replaced: the originals


def _mem_get_info() -> tuple[int, int]:
    """``cupy.cuda.runtime.memGetInfo()`` within the budget (bridge.views)."""
    view = views.budget_view(int(cupy.cuda.runtime.getDevice()))
    return view if view is not None else _native["memGetInfo"]()


def _device_class(base: type) -> type:
    """CuPy's ``Device`` with ``mem_info`` within the budget.

    ``Device`` is a Cython class whose ``mem_info`` calls the runtime's
    ``memGetInfo`` at the C level (a ``cimport``), past the module attribute,
    and whose attributes cannot be set: the view is a subclass that takes
    the name ``cupy.cuda.Device``.  Devices CuPy makes itself (``arr.device``)
    stay the base class; ``isinstance(arr.device, cupy.cuda.Device)`` still
    holds (the metaclass answers for the base).
    """

    class _Meta(type(base)):  # type: ignore[misc]
        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, base)

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, base)

    class Device(base, metaclass=_Meta):
        __doc__ = base.__doc__

        @property
        def mem_info(self) -> tuple[int, int]:
            """The free and total memory of the device (within the budget)."""
            view = views.budget_view(int(self.id))
            return view if view is not None else super().mem_info

    Device.__module__, Device.__qualname__ = base.__module__, base.__qualname__
    return Device


def install_views() -> None:
    """Make CuPy's free-memory queries answer within the budget (bridge.views):
    ``cupy.cuda.runtime.memGetInfo()`` and ``cupy.cuda.Device().mem_info``."""
    runtime = cupy.cuda.runtime
    if "memGetInfo" not in _native:
        _native["memGetInfo"] = runtime.memGetInfo
        runtime.memGetInfo = _mem_get_info
    if "Device" not in _native:
        base = cupy.cuda.Device
        try:
            view = _device_class(base)
        except TypeError as exc:  # a CuPy whose Device cannot be subclassed
            logging.getLogger("bridge").warning(
                "cupy.cuda.Device().mem_info keeps CuPy's own figures: %s", exc
            )
            return
        _native["Device"] = base
        cupy.cuda.Device = view
        cupy.cuda.device.Device = view


def remove_views() -> None:
    """Give CuPy its own free-memory answers back."""
    if "memGetInfo" in _native:
        cupy.cuda.runtime.memGetInfo = _native.pop("memGetInfo")
    if "Device" in _native:
        base = _native.pop("Device")
        cupy.cuda.Device = base
        cupy.cuda.device.Device = base


def install(devices: Iterable[int]) -> None:
    """Point CuPy's device (and pinned) allocators at the shared pool."""
    global _allocator
    for d in devices:
        _runtime.ensure_device(d)
    if _allocator is None:
        _allocator = new_allocator()
        if _allocator.memory_objects != "BridgeMemory" and not unowned_from_env():
            logging.getLogger("bridge").info(
                "CuPy's blocks are wrapped in CuPy's UnownedMemory (about 0.25 us more per "
                "allocation than the bridge's BridgeMemory): %s",
                _allocator.memory_problem,
            )
    cupy.cuda.set_allocator(_allocator)
    _tell_captures()
    cupy.cuda.set_pinned_memory_allocator(pinned_allocator())
    recovery.register_releaser("cupy", _release_pool)
    recovery.register_releaser("cupy-fft-plans", _release_fft_plans, collects=True)
