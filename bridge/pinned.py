"""Pinned (page-locked) host memory from one pool, shared zero-copy through DLPack.

>>> import bridge, numpy, torch
>>> a = bridge.empty_pinned((1024, 1024), dtype=numpy.float32)   # numpy view
>>> buf = bridge.pinned_buffer(1 << 20)                         # DLPack exporter
>>> t = torch.from_dlpack(buf)          # CPU tensor, is_pinned() True, same address
>>> t.to("cuda", non_blocking=True); bridge.pinned_record(buf, torch.cuda.current_stream())

The pool lives in the compiled core (bridge/_native/pinned.c, which also says
why it is not cuda.core's PinnedMemoryResource).  A block returns to the pool
when its last view is gone (every view and DLPack export holds a reference),
and is reused only once every copy recorded against it
(:meth:`PinnedBuffer.record`, :func:`pinned_record`) has completed.

Where blocks come from (``BRIDGE_PINNED_BACKEND``):

``cached`` (default)
    ``cuMemHostAlloc`` (portable) blocks kept in free lists.  Never blocks the
    host: a block still read by a copy is skipped, not waited for.
``mempool``
    A stream-ordered pool located on the host (``cuMemPoolCreate`` with
    ``CU_MEM_LOCATION_TYPE_HOST``); each new block costs a synchronization of
    the pool's private stream (the host writes at once), and blocks still
    awaited by copies are freed on the stream without waiting.
``auto``
    ``mempool`` where the driver offers it, else ``cached``.
"""

from __future__ import annotations

__all__ = [
    "PinnedBuffer",
    "PinnedPool",
    "empty_pinned",
    "zeros_pinned",
    "pinned_buffer",
    "pinned_pool",
    "pinned_record",
    "cupy_pinned_allocator",
    "host_memory_total",
    "BACKEND_ENV",
]

import math
import operator
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, Union, cast

import numpy

from bridge import _runtime
from bridge._errors import BridgeError, OutOfMemoryError, Status, check, format_bytes
from bridge._runtime import core
from bridge.budget import PINNED_LIMIT_ENV, limit_from, size_from_env

BACKEND_ENV = "BRIDGE_PINNED_BACKEND"
_BACKENDS = {"cached": core.PINNED_CACHED, "mempool": core.PINNED_MEMPOOL, "auto": core.PINNED_AUTO}
_BACKEND_NAMES = {core.PINNED_CACHED: "cached", core.PINNED_MEMPOOL: "mempool"}

_lock = threading.Lock()
_ready = False

ShapeLike = Union[int, Sequence[int]]  # noqa: UP007 - a runtime alias on 3.10


# ---- start-up ----
def host_memory_total() -> int | None:
    """Physical memory of this host in bytes (what fractions of the pinned limit are of).

    ``os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")``; None where unknown.
    """
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return pages * page if pages > 0 and page > 0 else None


def _backend_from_env() -> int:
    raw = os.environ.get(BACKEND_ENV, "").strip().lower() or "cached"
    if raw not in _BACKENDS:
        raise ValueError(
            f"{BACKEND_ENV}={os.environ.get(BACKEND_ENV)!r} is not a pinned "
            f"backend: use one of {', '.join(sorted(_BACKENDS))}"
        )
    return _BACKENDS[raw]


def _setup(backend: int) -> int:
    rc, chosen = core.pinned_setup(backend)
    if rc == Status.NOPOOLS:
        raise BridgeError(
            "the CUDA driver cannot create a host-located memory pool "
            f"(cuMemPoolCreate with CU_MEM_LOCATION_TYPE_HOST); set {BACKEND_ENV}"
            "=cached or auto, or update the NVIDIA driver"
        )
    if rc == Status.INVALID:
        raise BridgeError(
            "the pinned backend can change only while no pinned block is lent "
            "or awaited by a copy: drop every pinned view and synchronize first"
        )
    if rc == Status.DEVICE:
        raise BridgeError(
            "pinned memory needs a CUDA device, and the driver reports none. "
            "Check CUDA_VISIBLE_DEVICES and `nvidia-smi`."
        )
    check(rc, what="setting up the pinned memory pool")
    return chosen


def _ensure() -> None:
    """Load the driver and set the pool up (once): backend and limit from the environment."""
    global _ready
    with _lock:
        if _ready:
            return
        _runtime.ensure_driver()
        backend = _backend_from_env()
        limit = size_from_env(PINNED_LIMIT_ENV, total=host_memory_total())
        _setup(backend)
        if limit is not None:
            check(core.pinned_set_limit(limit), what="setting the pinned memory limit")
        _ready = True


def _set_backend(name: str) -> str:
    """Switch the base of new blocks (tests, benchmarks); returns the one chosen.

    Only while no block is lent or awaited (BridgeError otherwise).
    """
    if name not in _BACKENDS:
        raise ValueError(f"backend={name!r}: use one of {', '.join(sorted(_BACKENDS))}")
    if not _ready:
        _ensure()
    return _BACKEND_NAMES[_setup(_BACKENDS[name])]


# ---- errors ----
def _raise_alloc(rc: int, size: int) -> None:
    if rc in (Status.BUDGET, Status.OOM):
        s = _stats()
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
            "the pinned memory pool is not set up (internal error: _ensure was bypassed)"
        )
    check(rc, what=f"allocating {size} bytes of pinned host memory")


def _stats() -> dict:
    rc, raw = core.pinned_stats()
    check(rc, what="reading the pinned pool figures")
    return dict(raw)


# ---- buffers ----
class PinnedBuffer(core.PinnedBufferBase):
    """One block of pinned host memory, shared zero-copy through DLPack.

    Made by :func:`pinned_buffer`.  ``ptr`` is the host address (0 for 0
    bytes), ``size`` / ``nbytes`` the bytes asked for.  It supports the
    buffer protocol (``memoryview(buf)``, ``numpy.frombuffer``) and DLPack:

    ``__dlpack__(stream=None, max_version=None, dl_device=None, copy=None)``
        A versioned capsule (``"dltensor_versioned"``) when ``max_version``
        >= (1, 0), else a legacy one (``"dltensor"``); a 1-D ``uint8`` tensor
        of ``size`` bytes at ``ptr``.  Device type kDLCUDAHost (3) for numpy
        and JAX (``jax.dlpack.from_dlpack`` gives a ``pinned_host`` array);
        kDLCPU (1) when the consumer asks with ``dl_device=(1, 0)``, when it
        is torch (``torch.from_dlpack``, which refuses 3: it gets a CPU tensor
        with ``is_pinned()`` True) and when it passes no argument at all.
        ``copy=True`` exports a copy in a new pinned block.  ``stream`` is
        accepted and ignored: host memory has nothing to synchronize.
    ``__dlpack_device__()``
        ``(3, 0)``.

    The block returns to the pool when this object and every view and
    export of it are gone.
    """

    __slots__ = ()

    def record(self, stream: Any) -> None:
        """Keep the block from reuse until ``stream``'s work queued so far has completed.

        Call it after enqueuing an asynchronous copy that reads or writes this
        memory (``tensor.to("cuda", non_blocking=True)``, ``cupy`` ``set``/``get``
        with a stream, ``cuMemcpyAsync``).

        Parameters
        ----------
        stream : int, torch.cuda.Stream, cupy.cuda.Stream or any object with ``__cuda_stream__``
            ``None`` or 0: the legacy default stream of the current context.

        Raises
        ------
        ValueError
            When the stream handle is not a stream the driver knows.
        """
        if self.ptr:
            _record(self.ptr, stream)

    def numpy(
        self, dtype: Any = numpy.uint8, shape: ShapeLike | None = None, order: str = "C"
    ) -> numpy.ndarray:
        """A numpy view of the block (same address); ``shape`` defaults to as many as fit."""
        dt = numpy.dtype(dtype)
        if shape is None:
            shape = (self.size // dt.itemsize,)
        return numpy.ndarray(_shape(shape), dt, buffer=_buffer(self), order=_order(order))

    def as_torch(self, dtype: Any = None, shape: ShapeLike | None = None) -> Any:
        """A torch CPU tensor on the block (same address, ``is_pinned()`` True).

        ``dtype``: a ``torch.dtype`` (default ``torch.uint8``); ``shape``:
        default as many elements as fit.
        """
        import torch

        # a legacy capsule with kDLCPU: what every torch version takes
        t = torch.utils.dlpack.from_dlpack(self.__dlpack__(dl_device=(1, 0)))
        if dtype is not None and dtype != torch.uint8:
            itemsize = torch.empty((), dtype=dtype).element_size()
            t = t[: self.size - self.size % itemsize].view(dtype)
        return t if shape is None else t.reshape(_shape(shape))

    def __repr__(self) -> str:
        return f"<bridge.PinnedBuffer 0x{self.ptr:x}, {self.size} bytes>"


def _dim(d: Any) -> int:
    if isinstance(d, bool):
        raise TypeError("a bool is not a dimension")
    return operator.index(d)


def _shape(shape: ShapeLike) -> tuple:
    dims: tuple[int, ...]
    try:
        dims = (_dim(shape),)
    except TypeError:
        try:
            dims = tuple(_dim(d) for d in shape)  # type: ignore[union-attr]
        except TypeError:
            raise ValueError(f"shape={shape!r}: pass an int or a sequence of ints") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"shape={shape!r}: dimensions must be >= 0")
    return dims


def _buffer(buf: PinnedBuffer) -> Any:
    """The buffer itself, typed for numpy (whose stubs list the builtin buffer types only):
    arrays made on it keep it as their ``base``."""
    return cast(Any, buf)


def _order(order: str) -> Literal["C", "F"]:
    if order == "C":
        return "C"
    if order == "F":
        return "F"
    raise ValueError(f"order={order!r}: use 'C' or 'F'")


def pinned_buffer(nbytes: int) -> PinnedBuffer:
    """A block of pinned host memory from the pool.

    Parameters
    ----------
    nbytes : int
        Bytes (>= 0).  The block is rounded up to a size class (4 KiB, then
        at most 12.5 %); ``size`` reports ``nbytes``.

    Returns
    -------
    PinnedBuffer

    Raises
    ------
    bridge.OutOfMemoryError
        Past the pinned limit (``BRIDGE_PINNED_MEMORY_LIMIT``,
        :meth:`PinnedPool.set_limit`) or when the system cannot pin more.
    ValueError
        For a negative or non-integer size.
    BridgeError
        When there is no CUDA driver or device.
    """
    if not _ready:
        _ensure()
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, numpy.integer)):
        raise ValueError(f"nbytes={nbytes!r}: pass an int >= 0")
    if nbytes < 0:
        raise ValueError(f"nbytes={nbytes}: must be >= 0")
    rc, buf = core.pinned_alloc(PinnedBuffer, int(nbytes))
    if rc:
        _raise_alloc(rc, int(nbytes))
    return buf


def empty_pinned(shape: ShapeLike, dtype: Any = float, order: str = "C") -> numpy.ndarray:
    """A numpy array in pinned host memory from the pool, uninitialized (cupyx.empty_pinned).

    Parameters
    ----------
    shape : int or sequence of int
    dtype : numpy dtype-like
    order : {"C", "F"}

    Returns
    -------
    numpy.ndarray
        Its memory is a :class:`PinnedBuffer` (``array.base``), returned to
        the pool when the array and every view of it are gone.

    Raises
    ------
    bridge.OutOfMemoryError, ValueError, BridgeError
        As :func:`pinned_buffer`.
    """
    dims = _shape(shape)
    dt = numpy.dtype(dtype)
    order = _order(order)
    buf = pinned_buffer(math.prod(dims) * dt.itemsize)
    return numpy.ndarray(dims, dt, buffer=_buffer(buf), order=order)


def zeros_pinned(shape: ShapeLike, dtype: Any = float, order: str = "C") -> numpy.ndarray:
    """As :func:`empty_pinned`, filled with zeros (cupyx.zeros_pinned)."""
    dims = _shape(shape)
    dt = numpy.dtype(dtype)
    order = _order(order)
    buf = pinned_buffer(math.prod(dims) * dt.itemsize)
    if buf.size:
        numpy.frombuffer(_buffer(buf), numpy.uint8).fill(0)
    return numpy.ndarray(dims, dt, buffer=_buffer(buf), order=order)


# ---- streams and recording ----
def _stream_handle(stream: Any) -> int:
    if stream is None:
        return 0
    if isinstance(stream, (int, numpy.integer)) and not isinstance(stream, bool):
        if stream < 0:
            raise ValueError(f"stream={stream!r}: a handle is >= 0")
        return int(stream)
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:  # cuda.core and the CUDA stream protocol
        value = proto() if callable(proto) else proto
        return int(value[1])
    for attr in ("cuda_stream", "ptr", "handle"):  # torch, cupy, others
        value = getattr(stream, attr, None)
        if isinstance(value, (int, numpy.integer)) and not isinstance(value, bool):
            return int(value)
    raise TypeError(
        f"stream={stream!r}: pass a stream handle (int), a torch.cuda.Stream, a "
        "cupy.cuda.Stream, or an object with __cuda_stream__"
    )


def _record(addr: int, stream: Any) -> None:
    rc = core.pinned_record(addr, _stream_handle(stream))
    if rc == Status.INVALID:
        rc2, _, _ = core.pinned_lookup(addr)
        if rc2 != Status.OK:
            raise ValueError(
                f"0x{addr:x} is not in pinned memory lent by bridge's pool "
                "(allocate it with bridge.empty_pinned / bridge.pinned_buffer)"
            )
        raise ValueError(f"stream={stream!r} is not a stream the CUDA driver knows")
    check(rc, what="recording a stream against pinned memory")


def _address(obj: Any) -> int:
    if isinstance(obj, core.PinnedBufferBase):
        return int(obj.ptr)
    if isinstance(obj, (int, numpy.integer)) and not isinstance(obj, bool):
        return int(obj)
    if isinstance(obj, numpy.ndarray):
        return int(obj.__array_interface__["data"][0])
    for name in ("data_ptr", "unsafe_buffer_pointer"):  # torch, JAX
        fn = getattr(obj, name, None)
        if callable(fn):
            return int(fn())
    ptr = getattr(obj, "ptr", None)  # cupy's PinnedMemoryPointer
    if isinstance(ptr, int):
        return ptr
    if hasattr(obj, "__array_interface__"):
        return int(obj.__array_interface__["data"][0])
    raise TypeError(
        f"cannot find the address of a {type(obj).__name__}: pass a PinnedBuffer, a "
        "numpy array, a torch tensor, a JAX array or an address"
    )


def pinned_record(obj: Any, stream: Any) -> None:
    """Keep the pinned block holding ``obj`` from reuse until ``stream``'s queued work completed.

    Parameters
    ----------
    obj : PinnedBuffer, numpy.ndarray, torch.Tensor, jax.Array, cupy PinnedMemoryPointer or int
        Anything whose memory is in a block lent by the pool (a view or
        slice of it is enough), or an address in one.
    stream : int, torch.cuda.Stream, cupy.cuda.Stream or any object with ``__cuda_stream__``
        The stream an asynchronous copy of that memory was enqueued on.

    Raises
    ------
    ValueError
        When the memory is not from the pool, or the stream is unknown to the driver.
    TypeError
        When neither the address nor the stream can be read from the objects.
    """
    if not _ready:
        _ensure()
    if getattr(obj, "nbytes", None) == 0:
        return  # an empty view: no memory to protect
    addr = _address(obj)
    if addr:
        _record(addr, stream)


# ---- the pool ----
class PinnedPool:
    """The process's pinned host memory pool, with CuPy's PinnedMemoryPool figures.

    Figures (bytes are class sizes, what the pool holds from the driver):

    ``used`` lent blocks; ``free`` free blocks, including ``n_pending_blocks``
    still awaited by a recorded copy; ``total`` = used + free; ``limit`` (0 =
    none) which ``total`` never passes; ``peak_used``; ``n_free_blocks``;
    ``n_live_blocks``; ``num_allocs`` (of which ``num_reuses`` from the free
    lists); ``num_base_allocs`` / ``num_base_frees`` (driver calls);
    ``num_ooms``; ``num_records``; ``num_driver_errors``; ``backend``.
    """

    def stats(self) -> dict:
        """A snapshot of the figures above (plain data)."""
        if not _ready:
            _ensure()
        s = dict(_stats())
        s["backend"] = _BACKEND_NAMES.get(s["backend"], "none")
        s["mempool_available"] = bool(s["mempool_available"])
        return s

    def used_bytes(self) -> int:
        """Bytes of blocks lent (class sizes)."""
        return int(self.stats()["used"])

    def free_bytes(self) -> int:
        """Bytes of free blocks kept for reuse."""
        return int(self.stats()["free"])

    def total_bytes(self) -> int:
        """Bytes held from the driver: used + free."""
        return int(self.stats()["total"])

    def n_free_blocks(self) -> int:
        """Free blocks kept for reuse (including those awaiting a copy)."""
        return int(self.stats()["n_free_blocks"])

    @property
    def backend(self) -> str:
        """``"cached"`` or ``"mempool"``: where new blocks come from."""
        return str(self.stats()["backend"])

    def free_all_blocks(self) -> None:
        """Give every free block back to the system.

        Blocks still awaited by a recorded copy stay until the copy completed
        (``cached``) or are freed on the stream (``mempool``).
        """
        if not _ready:
            _ensure()
        check(core.pinned_trim(), what="freeing pinned blocks")

    def set_limit(self, size: int | str | None = None, fraction: float | None = None) -> None:
        """Limit the pinned memory the pool holds.

        Parameters
        ----------
        size : int or str, optional
            Bytes, or a size such as ``"8GiB"`` or ``"25%"`` (of the host's memory).
        fraction : float, optional
            Fraction in [0, 1] of the host's physical memory
            (:func:`host_memory_total`).

        Raises
        ------
        ValueError
            When both are given, or either is out of range.  0 or neither
            removes the limit.  Free blocks beyond a new limit are given back.
        """
        limit = limit_from(size, fraction, total=host_memory_total())
        if not _ready:
            _ensure()
        check(core.pinned_set_limit(limit), what="setting the pinned memory limit")

    def get_limit(self) -> int:
        """The limit in bytes; 0 = none."""
        return int(self.stats()["limit"])

    def reset_peak(self) -> None:
        """Start ``peak_used`` again from ``used``."""
        if not _ready:
            _ensure()
        core.pinned_reset_peak()

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"<bridge.PinnedPool {s['backend']} used={format_bytes(s['used'])} "
            f"total={format_bytes(s['total'])} limit={s['limit'] or 'none'}>"
        )


_pool = PinnedPool()


def pinned_pool() -> PinnedPool:
    """The process's pinned host memory pool."""
    return _pool


# ---- CuPy ----
def cupy_pinned_allocator() -> Callable[[int], Any]:
    """The allocator for ``cupy.cuda.set_pinned_memory_allocator``: size -> PinnedMemoryPointer.

    CuPy stages host-to-device copies (``cupy.asarray(numpy_array)``) and
    ``cupyx.empty_pinned`` through it; CuPy keeps the pointer (and so the
    block) alive until the copies it recorded have completed.

    Raises
    ------
    ImportError
        When CuPy is not installed.
    """
    from cupy.cuda.pinned_memory import PinnedMemoryPointer

    def allocate(size: int) -> Any:
        return PinnedMemoryPointer(pinned_buffer(size), 0)

    return allocate
