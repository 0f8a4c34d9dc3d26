# SPDX-License-Identifier: Apache-2.0
"""The shared pool of a device, with the seed's CuPy pool API, and its figures."""

from __future__ import annotations

__all__ = ["Pool", "Stats", "pool", "stats", "register_attribution"]

import dataclasses
import importlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bridge import _errors, _runtime, frameworks
from bridge._errors import check, format_bytes
from bridge._runtime import core
from bridge.budget import DEVICE_MEMORY, as_int, limit_from, warn_if_above

if TYPE_CHECKING:
    from bridge._core import RawStats

# the frameworks and the ledger's tags by index, from the one table (bridge.frameworks)
FRAMEWORKS = frameworks.FRAMEWORKS
TAG_NAMES = frameworks.TAG_NAMES

# cuMemPoolGetAttribute's CU_MEMPOOL_ATTR_RELEASE_THRESHOLD (the driver API's enum)
POOL_ATTR_RELEASE_THRESHOLD = 4

# name -> fn(device) giving that framework's live bytes outside the ledger
# (JAX's memory_stats), or None when it cannot tell.
_attribution: dict[str, Callable[[int], int | None]] = {}
_attribution_lock = threading.Lock()


def register_attribution(name: str, fn: Callable[[int], int | None]) -> None:
    """An adapter's way to say how many pool bytes its framework holds."""
    with _attribution_lock:
        _attribution[name] = fn


@dataclasses.dataclass(frozen=True)
class Stats:
    """A snapshot of one device's shared pool.

    Attributes
    ----------
    device : int
    limit : int
        The budget in bytes that refuses first; 0 = no limit. In a share
        (``unify(share=...)``), the share's budget when it is the smaller.
    used : int
        Bytes in use in the pool by every framework: the driver's
        ``USED_MEM_CURRENT`` less the bridge's cache of freed blocks.
    reserved : int
        Bytes the pool holds from the driver (used + idle, ``RESERVED_MEM_CURRENT``).
    cached : int
        Idle bytes the bridge's cache keeps for reuse: by default the free
        ranges of its pool segments, empty segments included (served to later
        allocations on the same stream; with ``BRIDGE_CACHE_SEGMENTS=0``,
        freed blocks reused by the next allocation of the same size on the
        same stream). Counted in ``reserved`` and in the budget; returned to
        the pool before any allocation fails.
    peak_used : int
        Highest ``used`` seen by the driver (``USED_MEM_HIGH``).
    num_allocs : int
        Allocations made through the bridge.
    num_ooms : int
        Allocations the bridge refused (budget or device full).
    by_framework : dict[str, int]
        Live bytes per framework: ``cupy``, ``torch``, ``numba`` (Numba's
        memory manager) and ``rmm`` (RMM's device resource) from the ledger,
        ``jax`` from JAX's own figures (or, when JAX shares the pool and has
        none, what the pool holds beyond the ledger), ``other`` the rest.
    ledger : int
        Bytes the bridge counts against the budget itself (its allocations,
        graph blocks kept for replay, frees waiting for a capture to end, and
        ``cached``).
    ledger_peak : int
        Highest ``ledger`` since the last reset; never above the budget.
    total : int
        The device's memory.
    release_threshold : int
        Idle bytes the pool keeps across synchronizations.
    num_frees, num_retries, num_bad_frees, num_driver_errors : int
        Frees; allocations that succeeded after recovery; frees of unknown
        pointers or double frees (ignored); driver errors seen on free paths.
    num_waits : int
        Allocations that waited for memory others free (``wait=``,
        :func:`bridge.waiting`), however the wait ended.
    wait_seconds : float
        Time those allocations waited, in all.
    num_wait_timeouts : int
        Waits that ran out of time (the allocation then failed).
    num_wait_all_waiting : int
        Waits refused at once because every thread holding bridge memory on
        the device was waiting too.
    waiting : int
        Threads waiting for memory on the device now.
    share : dict or None
        This process's membership of a share (``unify(share=...)``), None
        when the device is in none: ``name``, ``budget`` (the share's),
        ``claim`` (what this process may hold: its pool, cached blocks
        included), ``group`` (every member's claim), ``members``, and counters
        (``num_refused``, ``num_asks``, ``num_trims_served``,
        ``num_reclaimed``, ``num_overshoots``, ``max_overshoot``, ``num_lost``).
    """

    device: int
    limit: int
    used: int
    reserved: int
    peak_used: int
    num_allocs: int
    num_ooms: int
    by_framework: dict[str, int]
    cached: int = 0
    ledger: int = 0
    ledger_peak: int = 0
    total: int = 0
    release_threshold: int = 0
    num_frees: int = 0
    num_retries: int = 0
    num_bad_frees: int = 0
    num_driver_errors: int = 0
    num_waits: int = 0
    wait_seconds: float = 0.0
    num_wait_timeouts: int = 0
    num_wait_all_waiting: int = 0
    waiting: int = 0
    tags: tuple = ()
    share: dict | None = None

    def as_dict(self) -> dict:
        """The snapshot as plain data (for JSON)."""
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        fw = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.by_framework.items())
        lim = format_bytes(self.limit) if self.limit else "none"
        return (
            f"device {self.device}: used {format_bytes(self.used)} of budget {lim} "
            f"(reserved {format_bytes(self.reserved)}, peak {format_bytes(self.peak_used)}, "
            f"total {format_bytes(self.total)}); {fw}"
        )


def _device(device: int | None) -> int:
    d = _runtime.current_device() if device is None else as_int(device)  # np.int64 too
    if isinstance(d, bool) or not isinstance(d, int):
        raise ValueError(f"device={device!r}: pass an int")
    _runtime.ensure_device(d)
    return d


def _raw(device: int) -> RawStats:
    _runtime.collect_graphs()  # a dead CuPy graph's pool is not counted
    rc, raw = core.stats(device)
    check(rc, what="reading the pool figures", device=device)
    return raw


def _snapshot(device: int) -> Stats:
    raw = _raw(device)
    tags = raw["tags"]
    rc, outside = core.others(device)
    check(rc, what="reading the pool figures", device=device)
    counted = {TAG_NAMES[i]: int(t["current"]) for i, t in enumerate(tags)}
    by = {name: counted.get(name, 0) for name in FRAMEWORKS}
    # outside the ledger: the pool's "others", each outside framework's part of them
    theirs = _outside_parts(device, outside)
    by.update(theirs)
    by["other"] = counted["other"] + max(0, outside - sum(theirs.values()))
    share = _share_of(device)
    return Stats(
        device=device,
        limit=effective_limit(int(raw["limit"]), share),
        used=max(0, raw["pool_used"] - raw["cached"]),
        cached=raw["cached"],
        reserved=raw["pool_reserved"],
        peak_used=raw["pool_used_high"],
        num_allocs=raw["num_allocs"],
        num_ooms=raw["num_ooms"],
        by_framework=by,
        ledger=raw["used"],
        ledger_peak=raw["peak_used"],
        total=raw["total"],
        release_threshold=raw["release_threshold"],
        num_frees=raw["num_frees"],
        num_retries=raw["num_retries"],
        num_bad_frees=raw["num_bad_frees"],
        num_driver_errors=raw["num_driver_errors"],
        num_waits=raw["num_waits"],
        wait_seconds=raw["wait_ns"] / 1e9,
        num_wait_timeouts=raw["num_wait_timeouts"],
        num_wait_all_waiting=raw["num_wait_all_waiting"],
        waiting=raw["waiting"],
        tags=tuple(dict(t, name=TAG_NAMES[i]) for i, t in enumerate(tags)),
        share=share,
    )


def _outside_parts(device: int, outside: int) -> dict[str, int]:
    """The pool's ``outside`` bytes (its "others") by the frameworks outside the ledger.

    An outside framework whose adapter registered no attribution
    (:func:`register_attribution`) holds none of them; one whose attribution tells gets what
    it tells, within what is left; the first one whose attribution cannot tell (None, or an
    exception) gets the rest.
    """
    with _attribution_lock:
        fns = {name: _attribution.get(name) for name in frameworks.OUTSIDES}
    parts = dict.fromkeys(fns, 0)
    silent = []
    left = outside
    for name, fn in fns.items():
        if fn is None:
            continue
        try:
            theirs = fn(device)
        except Exception:  # noqa: BLE001 - figures never fail because of a framework
            theirs = None
        if theirs is None:
            silent.append(name)
        else:
            parts[name] = min(int(theirs), left)
            left -= max(parts[name], 0)
    if silent:
        parts[silent[0]] = left
    return parts


def effective_limit(own: int, share: dict | None) -> int:
    """The budget that refuses first: this process's own, or its share's (0 = no limit)."""
    budgets = [b for b in (own, int(share["budget"]) if share else 0) if b]
    return min(budgets) if budgets else 0


def _share_of(device: int) -> dict | None:
    rc, info = core.share_stats(device)
    check(rc, what="reading the share", device=device)
    return dict(info) if info is not None else None


def stats(device: int | None = None) -> Stats:
    """A snapshot of a device's shared pool.

    Parameters
    ----------
    device : int, optional
        The device; the current one when None.

    Returns
    -------
    Stats

    Raises
    ------
    BridgeError
        When there is no CUDA driver or device.
    """
    return _snapshot(_device(device))


class Pool:
    """The shared (driver default) pool of one device, with CuPy's ``MemoryPool`` API.

    Method for method as ``cupy.cuda.MemoryPool``: ``malloc``, ``free_all_blocks``
    (``stream=`` taken), ``free_all_free``, ``n_free_blocks``, ``used_bytes``,
    ``free_bytes``, ``total_bytes``, ``set_limit``, ``get_limit``. Figures are
    pool-wide: they count every framework that allocates from it, not only
    CuPy, and the limit is the budget every framework shares.
    """

    def __init__(self, device: int) -> None:
        self._device = _device(device)

    @property
    def device(self) -> int:
        """The device this pool belongs to."""
        return self._device

    def used_bytes(self) -> int:
        """Bytes in use in the pool, every framework (the bridge's cache counts as free)."""
        raw = _raw(self._device)
        return max(0, int(raw["pool_used"]) - int(raw["cached"]))

    def total_bytes(self) -> int:
        """Bytes the pool holds from the driver (in use + idle)."""
        return int(_raw(self._device)["pool_reserved"])

    def free_bytes(self) -> int:
        """Idle bytes the pool holds (total - used)."""
        raw = _raw(self._device)
        return max(0, int(raw["pool_reserved"]) - int(raw["pool_used"]) + int(raw["cached"]))

    def n_free_blocks(self) -> int:
        """Freed blocks the exact-size tiers keep for reuse (the cache in front of the pool).

        With segments (the default cache) a freed block carved from a segment
        goes back to the segment's free ranges and is not counted here;
        ``bridge.stats(d).cached`` gives the idle bytes of both.
        The driver pool's own idle memory (``free_bytes``) is not kept as
        blocks and is not counted here.
        """
        rc, n = core.cached_blocks(self._device)
        check(rc, what="counting the cached blocks", device=self._device)
        return int(n)

    def malloc(self, size: int) -> Any:
        """Allocate ``size`` bytes from the shared pool on the current stream, under the budget.

        Returns
        -------
        cupy.cuda.MemoryPointer or bridge._core.Block
            With CuPy installed, a ``MemoryPointer`` (as ``MemoryPool.malloc``;
            counted as ``cupy``, on CuPy's current stream); without it, the
            block itself (``ptr``, ``size``, ``device``; counted as ``other``, on
            the legacy default stream). The memory goes back when the object
            is gone.

        Raises
        ------
        OutOfMemoryError
            CuPy's ``OutOfMemoryError`` with CuPy, else ``bridge.OutOfMemoryError``,
            naming the device, the request, the budget and every framework's bytes.
        ValueError
            For a size that is not an int >= 0.
        """
        size = as_int(size)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"size={size!r}: pass a number of bytes >= 0")
        fw = frameworks.pointers()
        try:
            importlib.import_module(fw.name)
        except ImportError:
            pass
        else:  # the adapter is the one place that knows the framework
            return importlib.import_module(fw.adapter).malloc(self._device, size)
        rc, block = core.alloc_block(self._device, size, 0, core.TAG_OTHER, None)
        if rc in _errors.OOM_STATUSES:
            s = _snapshot(self._device)
            raise _errors.OutOfMemoryError(
                _errors.oom_message(self._device, size, rc, framework="other"),
                device=self._device,
                size=size,
                limit=s.limit,
                by_framework=s.by_framework,
            )
        check(rc, what=f"allocating {size} bytes", device=self._device)
        return block

    def free_all_blocks(self, stream: Any = None) -> None:
        """Return the pool's idle memory to the driver (synchronizes the device).

        Parameters
        ----------
        stream : optional
            Taken as CuPy takes it. CuPy's pool keeps an arena per stream and
            empties only that one; the shared pool keeps none that could be
            emptied alone, so every idle block goes back, that stream's included.
        """
        _runtime.collect_graphs()  # dead CuPy graphs' pools first: theirs is idle too
        check(core.trim(self._device, 0), what="returning idle memory", device=self._device)

    def free_all_free(self) -> None:
        """The same as :meth:`free_all_blocks` (CuPy's older name, kept as CuPy keeps it)."""
        self.free_all_blocks()

    def set_limit(self, size: int | str | None = None, fraction: float | None = None) -> None:
        """Set the device's budget.

        Parameters
        ----------
        size : int or str, optional
            Bytes, or a size such as ``"40GiB"``, ``"80%"`` or ``"0.8"`` (of
            the device's memory).
        fraction : float, optional
            Fraction of the device's memory, in (0, 1] (0 removes the limit).

        Warns
        -----
        UserWarning
            When the budget is larger than the device's memory (it limits nothing).

        Raises
        ------
        ValueError
            When both are given, or either is out of range. 0 or neither
            removes the limit.
        """
        total = int(_raw(self._device)["total"])
        limit = limit_from(size, fraction, total=total)
        check(core.set_limit(self._device, limit), what="setting the budget", device=self._device)
        warn_if_above(limit, total, name=f"bridge.pool({self._device}).set_limit", of=DEVICE_MEMORY)

    def get_limit(self) -> int:
        """The budget in bytes that refuses first (this process's, or its share's when the
        device is in a share and that is smaller); 0 = no limit."""
        return effective_limit(int(_raw(self._device)["limit"]), _share_of(self._device))

    def stats(self) -> Stats:
        """A snapshot of this pool (see :func:`bridge.stats`)."""
        return _snapshot(self._device)

    def reassert(self) -> None:
        """Write the pool attributes the bridge owns again (after another user changed them)."""
        check(core.reassert(self._device), what="re-asserting the pool", device=self._device)

    @property
    def release_threshold(self) -> int:
        """The pool's release threshold as the driver reports it."""
        rc, v = core.pool_attribute(self._device, POOL_ATTR_RELEASE_THRESHOLD)
        check(rc, what="reading the release threshold", device=self._device)
        return int(v)

    def __repr__(self) -> str:
        return f"<bridge.Pool device={self._device}>"


_pools: dict[int, Pool] = {}


def pool(device: int | None = None) -> Pool:
    """The shared pool of a device (the current one when None).

    Raises
    ------
    BridgeError
        When there is no CUDA driver or device.
    """
    d = _device(device)
    p = _pools.get(d)
    if p is None:
        p = _pools.setdefault(d, Pool(d))
    return p


# OOM messages (bridge._errors.oom_message) read a device's figures from here.
_errors.set_figures(stats)
