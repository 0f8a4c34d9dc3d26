# SPDX-License-Identifier: Apache-2.0
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

The code is split by concern; every public name is importable from here and
from ``bridge``:

- ``bridge.pinned._backend``: set-up from the environment, backends, errors;
- ``bridge.pinned._buffer``: :class:`PinnedBuffer` and the array functions;
- ``bridge.pinned._shapes``: shapes, orders and byte counts;
- ``bridge.pinned._streams``: streams and addresses, recording copies;
- ``bridge.pinned._pool``: :class:`PinnedPool`, the figures and the limit;

CuPy's pinned allocator lives with the CuPy adapter
(``bridge.adapters.cupy.pinned_allocator``); :func:`cupy_pinned_allocator`
here returns it, for code that set it up by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "PinnedBuffer",
    "PinnedPool",
    "empty_pinned",
    "zeros_pinned",
    "empty_like_pinned",
    "zeros_like_pinned",
    "pinned_buffer",
    "pinned_pool",
    "pinned_record",
    "cupy_pinned_allocator",
    "host_memory_total",
    "BACKEND_ENV",
    "ShapeLike",
]

from bridge.pinned import _backend
from bridge.pinned._backend import BACKEND_ENV, host_memory_total
from bridge.pinned._buffer import (
    PinnedBuffer,
    empty_like_pinned,
    empty_pinned,
    pinned_buffer,
    pinned_record,
    zeros_like_pinned,
    zeros_pinned,
)
from bridge.pinned._pool import PinnedPool, pinned_pool
from bridge.pinned._shapes import ShapeLike


def cupy_pinned_allocator() -> Callable[[int], Any]:
    """CuPy's pinned allocator on the pinned pool (``bridge.adapters.cupy.pinned_allocator``).

    Raises
    ------
    ImportError
        When CuPy is not installed.
    """
    import importlib

    from bridge import frameworks

    # the adapter imports its framework; bridge.adapters is installed from adapters/
    adapter = importlib.import_module(frameworks.pointers().adapter)
    return adapter.pinned_allocator()


# Switch the base of new blocks while none is lent (tests and benchmarks).
_set_backend = _backend.set_backend
