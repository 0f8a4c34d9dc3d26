# SPDX-License-Identifier: Apache-2.0
"""The pinned pool's facade: CuPy's PinnedMemoryPool figures and limit, over the core."""

from __future__ import annotations

__all__ = ["PinnedPool", "pinned_pool"]

from bridge._errors import check, format_bytes
from bridge._runtime import core
from bridge.budget import HOST_MEMORY, limit_from, warn_if_above
from bridge.pinned import _backend as backend


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
        backend.ensure()
        s = backend.raw_stats()
        s["backend"] = backend.BACKEND_NAMES.get(s["backend"], "none")
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
        backend.ensure()
        check(core.pinned_trim(), what="freeing pinned blocks")

    def set_limit(self, size: int | str | None = None, fraction: float | None = None) -> None:
        """Limit the pinned memory the pool holds.

        Parameters
        ----------
        size : int or str, optional
            Bytes, or a size such as ``"8GiB"``, ``"25%"`` or ``"0.25"`` (of
            the host's memory).
        fraction : float, optional
            Fraction in [0, 1] of the host's physical memory
            (:func:`host_memory_total`).

        Warns
        -----
        UserWarning
            When the limit is larger than the host's memory (it limits nothing).

        Raises
        ------
        ValueError
            When both are given, or either is out of range.  0 or neither
            removes the limit.  Free blocks beyond a new limit are given back.
        """
        total = backend.host_memory_total()
        limit = limit_from(size, fraction, total=total, of=HOST_MEMORY)
        backend.ensure()
        check(core.pinned_set_limit(limit), what="setting the pinned memory limit")
        warn_if_above(limit, total, name="bridge.pinned_pool().set_limit", of=HOST_MEMORY)

    def get_limit(self) -> int:
        """The limit in bytes; 0 = none."""
        return int(self.stats()["limit"])

    def reset_peak(self) -> None:
        """Start ``peak_used`` again from ``used``."""
        backend.ensure()
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
