# SPDX-License-Identifier: Apache-2.0
"""Streams and addresses as users hand them to the pinned pool, and recording a copy."""

from __future__ import annotations

__all__ = ["stream_handle", "address", "record"]

from typing import Any, TypeGuard

import numpy

from bridge._errors import Status, check
from bridge._runtime import core


def _is_int(value: Any) -> TypeGuard[int | numpy.integer]:
    return isinstance(value, (int, numpy.integer)) and not isinstance(value, bool)


def stream_handle(stream: Any) -> int:
    """The driver handle of a stream given as an int, a framework's stream or a protocol object.

    ``None`` and 0 are the legacy default stream. Objects are read through
    ``__cuda_stream__`` (the CUDA stream protocol, cuda.core) or a
    ``cuda_stream`` / ``ptr`` / ``handle`` attribute (torch, CuPy, others).

    Raises
    ------
    ValueError
        For a negative handle.
    TypeError
        When no handle can be read from the object.
    """
    if stream is None:
        return 0
    if _is_int(stream):
        if stream < 0:
            raise ValueError(f"stream={stream!r}: a handle is >= 0")
        return int(stream)
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:  # cuda.core and the CUDA stream protocol
        value = proto() if callable(proto) else proto
        return int(value[1])
    for attr in ("cuda_stream", "ptr", "handle"):  # torch, cupy, others
        value = getattr(stream, attr, None)
        if _is_int(value):
            return int(value)
    raise TypeError(
        f"stream={stream!r}: pass a stream handle (int), a torch.cuda.Stream, a "
        "cupy.cuda.Stream, or an object with __cuda_stream__"
    )


def address(obj: Any) -> int:
    """The host address of an object's memory (or of an address given as an int).

    Raises
    ------
    TypeError
        When the object offers no address the bridge knows how to read.
    """
    if isinstance(obj, core.PinnedBufferBase):
        return int(obj.ptr)
    if _is_int(obj):
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


def record(addr: int, stream: Any) -> None:
    """Keep the block holding ``addr`` from reuse until ``stream``'s queued work has completed.

    Raises
    ------
    ValueError
        When the address is not in a block lent by the pool, or the stream
        is not one the driver knows.
    """
    rc = core.pinned_record(addr, stream_handle(stream))
    if rc == Status.INVALID:
        rc2, _, _ = core.pinned_lookup(addr)
        if rc2 != Status.OK:
            raise ValueError(
                f"0x{addr:x} is not in pinned memory lent by bridge's pool "
                "(allocate it with bridge.empty_pinned / bridge.pinned_buffer)"
            )
        raise ValueError(f"stream={stream!r} is not a stream the CUDA driver knows")
    check(rc, what="recording a stream against pinned memory")
