# SPDX-License-Identifier: Apache-2.0
"""Pinned buffers: the block owner (DLPack, buffer protocol), numpy arrays on it, recording."""

from __future__ import annotations

__all__ = [
    "PinnedBuffer",
    "pinned_buffer",
    "empty_pinned",
    "zeros_pinned",
    "empty_like_pinned",
    "zeros_like_pinned",
    "pinned_record",
]

import math
from typing import Any

import numpy

from bridge import frameworks
from bridge._runtime import core
from bridge.pinned import _backend as backend
from bridge.pinned import _shapes as shapes
from bridge.pinned import _streams as streams
from bridge.pinned._shapes import ShapeLike


class PinnedBuffer(core.PinnedBufferBase):
    """One block of pinned host memory, shared zero-copy through DLPack.

    Made by :func:`pinned_buffer`.  ``ptr`` is the host address (0 for 0
    bytes), ``size`` / ``nbytes`` the bytes asked for.  It supports the
    buffer protocol (``memoryview(buf)``, ``numpy.frombuffer``) and DLPack:

    ``__dlpack__(stream=None, max_version=None, dl_device=None, copy=None)``
        A versioned capsule (``"dltensor_versioned"``) when ``max_version``
        >= (1, 0), else a legacy one (``"dltensor"``); a 1-D ``uint8`` tensor
        of ``size`` bytes at ``ptr``.  Its device type follows the call's
        arguments: ``dl_device`` when given ((1, 0) kDLCPU or (3, 0)
        kDLCUDAHost); else kDLCUDAHost (3) when a ``stream`` is passed (JAX
        does: ``jax.dlpack.from_dlpack`` gives a ``pinned_host`` array), and
        kDLCPU (1) when none is (numpy; torch, whose ``torch.from_dlpack``
        refuses 3 and gets a CPU tensor with ``is_pinned()`` True; a call
        without arguments).  ``copy=True`` exports a copy in a new pinned
        block.  The stream itself is not waited on: host memory has nothing
        to synchronize.
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
            streams.record(self.ptr, stream)

    def numpy(
        self, dtype: Any = numpy.uint8, shape: ShapeLike | None = None, order: str = "C"
    ) -> numpy.ndarray:
        """A numpy view of the block (same address); ``shape`` defaults to as many as fit."""
        dt = numpy.dtype(dtype)
        if shape is None:
            shape = (self.size // dt.itemsize,)
        return numpy.ndarray(
            shapes.shape(shape), dt, buffer=shapes.as_buffer(self), order=shapes.order(order)
        )

    def as_torch(self, dtype: Any = None, shape: ShapeLike | None = None) -> Any:
        """A torch CPU tensor on the block (same address, ``is_pinned()`` True).

        ``dtype``: a ``torch.dtype`` (default ``torch.uint8``); ``shape``:
        default as many elements as fit.
        """
        # its adapter makes it (bridge.adapters.torch.pinned_array, the registry's row)
        return frameworks.pinned_view("as_torch")(self, dtype, shape)

    def __repr__(self) -> str:
        return f"<bridge.PinnedBuffer 0x{self.ptr:x}, {self.size} bytes>"


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
        :meth:`PinnedPool.set_limit`), when the system cannot pin more, or
        for more than the host's memory (refused without asking the driver).
    ValueError
        For a negative or non-integer size.
    BridgeError
        When there is no CUDA driver or device.
    """
    backend.ensure()
    size = shapes.nbytes(nbytes)
    rc, buf = core.pinned_alloc(PinnedBuffer, size)
    if rc:
        backend.raise_alloc(rc, size)
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
    dims = shapes.shape(shape)
    dt = numpy.dtype(dtype)
    order = shapes.order(order)
    buf = pinned_buffer(math.prod(dims) * dt.itemsize)
    return numpy.ndarray(dims, dt, buffer=shapes.as_buffer(buf), order=order)


def zeros_pinned(shape: ShapeLike, dtype: Any = float, order: str = "C") -> numpy.ndarray:
    """As :func:`empty_pinned`, filled with zeros (cupyx.zeros_pinned)."""
    dims = shapes.shape(shape)
    dt = numpy.dtype(dtype)
    order = shapes.order(order)
    buf = pinned_buffer(math.prod(dims) * dt.itemsize)
    if buf.size:
        numpy.frombuffer(shapes.as_buffer(buf), numpy.uint8).fill(0)
    return numpy.ndarray(dims, dt, buffer=shapes.as_buffer(buf), order=order)


def _like(
    a: Any, dtype: Any, order: str, subok: Any, shape: ShapeLike | None, *, zero: bool
) -> numpy.ndarray:
    """The ``*_like_pinned`` functions, with cupyx's rules for the layout."""
    if subok is not None:  # as cupyx refuses it
        raise TypeError("subok is not supported yet")
    dt = numpy.dtype(a.dtype if dtype is None else dtype)
    dims = tuple(a.shape) if shape is None else shapes.shape(shape)
    how = order.upper() if isinstance(order, str) else order
    if how not in ("C", "F", "K", "A"):
        raise ValueError(f"order={order!r}: use 'C', 'F', 'A' or 'K'")
    strides = None
    if how in ("K", "A"):
        c, f = bool(a.flags.c_contiguous), bool(a.flags.f_contiguous)
        if how == "K" and shape is not None and len(dims) != a.ndim:
            how = "C"  # a new number of dimensions has no layout to keep
        elif c:
            how = "C"
        elif f:
            how = "F"
        elif how == "A":
            how = "C"
        else:  # 'K' of a strided array: its axes in the order of its strides, packed
            strides = _strides_like(a.strides, dims, dt.itemsize)
            how = "C"
    buf = pinned_buffer(math.prod(dims) * dt.itemsize)
    if zero and buf.size:
        numpy.frombuffer(shapes.as_buffer(buf), numpy.uint8).fill(0)
    return numpy.ndarray(
        dims, dt, buffer=shapes.as_buffer(buf), order=shapes.order(how), strides=strides
    )


def _strides_like(strides: tuple[int, ...], dims: tuple[int, ...], itemsize: int) -> list[int]:
    """Packed strides that keep the order of ``strides`` (cupy's order='K')."""
    ranked = sorted((abs(s), -i) for i, s in enumerate(strides))
    out = [0] * len(dims)
    step = itemsize
    for _, i in ranked:
        out[-i] = step
        step *= dims[-i]
    return out


def empty_like_pinned(
    a: Any, dtype: Any = None, order: str = "K", subok: Any = None, shape: ShapeLike | None = None
) -> numpy.ndarray:
    """A pinned numpy array from the pool shaped like ``a``, uninitialized
    (cupyx.empty_like_pinned, with its arguments).

    Parameters
    ----------
    a : numpy.ndarray, cupy.ndarray or any array with shape, dtype, strides and flags
    dtype : numpy dtype-like, optional
        ``a``'s when None.
    order : {"K", "C", "F", "A"}
        ``"K"`` keeps ``a``'s layout (C, F, or the order of its strides for
        any other layout); ``"A"``: F when ``a`` is F-contiguous only, else C.
    subok : None
        Refused unless None, as cupyx refuses it (TypeError).
    shape : int or sequence of int, optional
        Another shape (with another number of dimensions, ``"K"`` gives C).

    Returns
    -------
    numpy.ndarray
        On a :class:`PinnedBuffer`, as :func:`empty_pinned`.

    Raises
    ------
    TypeError
        For ``subok`` other than None.
    bridge.OutOfMemoryError, ValueError, BridgeError
        As :func:`pinned_buffer`; ValueError for an unknown order.
    """
    return _like(a, dtype, order, subok, shape, zero=False)


def zeros_like_pinned(
    a: Any, dtype: Any = None, order: str = "K", subok: Any = None, shape: ShapeLike | None = None
) -> numpy.ndarray:
    """As :func:`empty_like_pinned`, filled with zeros (cupyx.zeros_like_pinned)."""
    return _like(a, dtype, order, subok, shape, zero=True)


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
    backend.ensure()
    if getattr(obj, "nbytes", None) == 0:
        return  # an empty view: no memory to protect
    addr = streams.address(obj)
    if addr:
        streams.record(addr, stream)
