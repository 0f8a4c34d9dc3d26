# SPDX-License-Identifier: Apache-2.0
"""CuPy's pinned-memory allocator on the pinned pool (installed by ``unify(cupy=True)``).

Framework knowledge: it belongs with the CuPy adapter (``bridge.adapters.cupy``),
which reaches it through ``bridge.pinned.cupy_pinned_allocator``.
"""

from __future__ import annotations

__all__ = ["cupy_pinned_allocator"]

from collections.abc import Callable
from typing import Any

from bridge._pinned_buffer import pinned_buffer


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
