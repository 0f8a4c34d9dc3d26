# SPDX-License-Identifier: Apache-2.0
"""A model of the cache of freed blocks over the driver's pool, judged on the traces (CPU).

    python benchmarks/model_cache.py [TRACES...]         (default: benchmarks/traces/*.json.gz)
    python benchmarks/model_cache.py --grid [TRACES...]  (the tiers' settings, searched)
    python benchmarks/model_cache.py --carve-grid        (the carved classes' settings)
    python benchmarks/model_cache.py --native [TRACES...]  (``default`` beside native torch)

With no option: ``default`` (the library's cache as it is by default) beside the model of
native torch on each trace, then every policy's figures.

Replays each trace as ``bench_trace.py replay`` does (five passes in one process, pool and
cache kept from pass to pass, the blocks still live at the end of a pass freed through the
cache, 0-byte allocations making none, the replay's ``torch.zeros(1)`` first) under each
policy of ``POLICIES``, and prints the cache hits, the driver calls and the pool's peak
reserved / peak live beside the H200's figures (``MEASURED``). ``replay(events, policy,
**settings)`` overrides any ``Settings`` field (the BRIDGE_CACHE_* settings).

The hits are exact: ``Cache`` follows bridge/_native/cache.c and ledger.c's ``bridge_free``
rule for rule (tests/benchmarks/test_model_cache.py holds its cached bytes after every event
of the three traces against cache.c's on the stand-in driver, and its hits against the
H200's). The pool is a model: memory mapped in 32 MiB chunks (measured:
``scripts/pool_growth_probe.py``), never unmapped, small (<= 1 MiB) and larger requests in
separate heaps; ``Heap`` (best fit over coalesced free ranges) reads low under churn,
``ChunkedHeap`` (no block of up to 32 MiB straddles a chunk) high, and the two bracket the
H200's figures of the cached policies. The figures: benchmarks/results/probes.md and
benchmarks/results/trace.md; the model's own, as first written: ``git show
b4c11eb:docs/design.md``, "A cache of carved small blocks: the model's figures".

The policy ``segments`` is issue 62's design (``Segments``: torch's mechanism, segments
with best fit, splitting and coalescing, over the driver's pool, one release rule);
``segments-core`` is what carve.c builds with BRIDGE_CACHE_SEGMENTS=1 (a large range split
whatever is left; held to it event by event on the stand-in driver).
``native()`` models what bench_trace.py's ``native`` replays (torch's caching allocator,
``TorchNative``; CuPy's MemoryPool, ``CupyNative``, for a mixed trace's CuPy events) and
reproduces the H200's native figures (``MEASURED_NATIVE``); ``--native`` prints
``default`` beside it on each trace. ``default`` is what the library does by default:
``segments-core``'s Settings (BRIDGE_CACHE_SEGMENTS=0 gives ``tiers`` back).
"""

from __future__ import annotations

import bisect
import glob
import gzip
import json
import os
import sys
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, replace
from typing import Any

MIB = 1 << 20
CHUNK = 32 * MIB
#: the H200's memory as the driver reports it (143,156 MiB: the replays' cache_limit,
#: 3,002,197,606, is 2% of it, ledger.c's default); no trace here reaches that limit
DEVICE = 143156 * MIB
HERE = os.path.dirname(os.path.abspath(__file__))


class Heap:
    """Memory mapped in CHUNK steps; best fit over coalesced free ranges."""

    def __init__(self) -> None:
        self.free: list[tuple[int, int]] = []  # (start, size), sorted by start
        self.top = 0  # bytes mapped

    def alloc(self, n: int) -> tuple[int, int]:
        n = -(-n // 512) * 512
        fits = [(z, i) for i, (_, z) in enumerate(self.free) if z >= n]
        if fits:
            _, i = min(fits)
            s, z = self.free.pop(i)
            if z > n:
                self.free.insert(i, (s + n, z - n))
            return s, n
        if self.free and sum(self.free[-1]) == self.top:  # grow the last free range
            s, z = self.free.pop()
        else:
            s, z = self.top, 0
        self.top += -(-(n - z) // CHUNK) * CHUNK
        if self.top > s + n:
            self.free.append((s + n, self.top - s - n))
        return s, n

    def release(self, s: int, n: int) -> None:
        i = bisect.bisect(self.free, (s, 0))
        if i and sum(self.free[i - 1]) == s:
            ps, pz = self.free.pop(i - 1)
            i, s, n = i - 1, ps, pz + n
        if i < len(self.free) and s + n == self.free[i][0]:
            n += self.free.pop(i)[1]
        self.free.insert(i, (s, n))


class ChunkedHeap(Heap):
    """Heap, but a request of up to one CHUNK never straddles a chunk boundary, and a larger
    one starts on a boundary (a pessimistic pool: the H200's figures for the cached
    policies lie between this one's and Heap's, see POOLS)."""

    def alloc(self, n: int) -> tuple[int, int]:
        n = -(-n // 512) * 512
        best: tuple[int, int, int] | None = None  # (piece size, free range index, start)
        for i, (s, z) in enumerate(self.free):
            if n <= CHUNK:  # the range's pieces between chunk boundaries
                p = s
                while p < s + z:
                    q = min(s + z, (p // CHUNK + 1) * CHUNK)
                    if q - p >= n and (best is None or q - p < best[0]):
                        best = (q - p, i, p)
                    p = q
            else:  # the range from its first chunk boundary
                p = -(-s // CHUNK) * CHUNK
                if s + z - p >= n and (best is None or s + z - p < best[0]):
                    best = (s + z - p, i, p)
        if best is not None:
            _, i, p = best
            s, z = self.free.pop(i)
            for j, piece in enumerate(x for x in ((s, p - s), (p + n, s + z - p - n)) if x[1]):
                self.free.insert(i + j, piece)
            return p, n
        p = self.top  # grow: a fresh chunk, or (larger requests) the free tail's chunks
        if n > CHUNK and self.free and sum(self.free[-1]) == self.top:
            s, z = self.free[-1]
            if -(-s // CHUNK) * CHUNK < self.top:
                p = -(-s // CHUNK) * CHUNK
                self.free.pop()
                if p > s:
                    self.free.append((s, p - s))
        top = -(-(p + n) // CHUNK) * CHUNK
        if top > p + n:
            self.free.append((p + n, top - p - n))
        self.top = max(self.top, top)
        return p, n


#: the pool models: Heap (best fit over coalesced ranges; fits the H200's figures with no
#: cache and with everything cached) and ChunkedHeap (a pessimistic one); the H200's figures
#: of the cached policies lie between the two (benchmarks/results/probes.md)
POOLS = {"heap": Heap, "chunked": ChunkedHeap}


class Pool:
    """Small requests (<= 1 MiB) and larger ones in separate heaps."""

    def __init__(self, heap: type[Heap] = Heap) -> None:
        self.heaps = (heap(), heap())
        self.calls = 0  # driver calls: cuMemAllocFromPoolAsync and cuMemFreeAsync
        self.before_alloc: list[Any] = []  # called before each allocation (lazy carvers)

    def reserved(self) -> int:
        return sum(h.top for h in self.heaps)

    def alloc(self, n: int) -> tuple[int, int, int]:
        for hook in self.before_alloc:
            hook()
        self.calls += 1
        k = int(n > MIB)
        return (k, *self.heaps[k].alloc(n))

    def release(self, block: tuple[int, int, int]) -> None:
        self.calls += 1
        self.heaps[block[0]].release(block[1], block[2])


class RecordingPool(Pool):
    """A Pool that also writes down the calls that reach it, so that the GPU's own pool can
    be given the same calls (probes/pool_sequence.py): ``ops`` gets the size of each
    allocation, ``-1 - k`` for the release of the k-th block allocated, and (replay) 0 at
    the end of each pass."""

    def __init__(self, heap: type[Heap], ops: list[int]) -> None:
        super().__init__(heap)
        self.ops, self.ids, self.n = ops, {}, 0

    def alloc(self, n: int) -> tuple[int, int, int]:
        block = super().alloc(n)
        self.ids[block] = self.n
        self.n += 1
        self.ops.append(n)
        return block

    def release(self, block: tuple[int, int, int]) -> None:
        super().release(block)
        self.ops.append(-1 - self.ids.pop(block))


@dataclass(frozen=True)
class Settings:
    """The cache's settings, as cache.c holds them (defaults: cache.h and ledger.c)."""

    limit: int = DEVICE // 50  # both tiers together; 0 = no cache (BRIDGE_CACHE_LIMIT)
    max_block: int = 256 * MIB  # larger blocks are never cached
    fraction: float = 1 / 16  # the small tier's share of the live bytes (BRIDGE_CACHE_FRACTION)
    floor: int = 64 * MIB  # the small tier's cap is at least this (BRIDGE_CACHE_FLOOR)
    small_max: int = MIB  # the largest block of the small tier (BRIDGE_CACHE_SMALL_MAX)
    large_cap: int = 64 * MIB  # the large tier's cap (BRIDGE_CACHE_LARGE_CAP)
    #: the large tier's cap is also at most this share of the live bytes, but never less
    #: than the block being cached (BRIDGE_CACHE_LARGE_FRACTION; 0: the fixed cap alone)
    large_fraction: float = 1 / 8
    depth: int = 64  # blocks a (stream, size) key (BRIDGE_CACHE_DEPTH)
    evict: bool = True  # False: a block that does not fit is declined (the first cache)
    #: the thread slot in front of the lists (cache.c since 2026-12-03;
    #: BRIDGE_CACHE_THREAD_SLOT); False: the lists alone, as the earlier caches were
    slot: bool = True
    #: carved classes (a model only, not in cache.c): (largest request, chunk bytes, empty
    #: chunk bytes kept) each; a request up to a class's largest (the first that takes it)
    #: is carved from that class's chunks (Carver), never reaching the two tiers
    carve: tuple[tuple[int, int, int], ...] = ()
    #: a model only: the large tier's cap is also at most this share of the live bytes,
    #: with no floor (set with large_fraction 0)
    large_live_min: float = 0.0
    #: a model only: the carved classes return an emptied chunk lazily (Carver's ``lazy``)
    carve_lazy: bool = False
    #: segments (issue 62's design; ``Segments``): every request carved from pool segments,
    #: best fit with splitting and coalescing, one release rule; the tiers and carved
    #: classes see nothing
    segments: bool = False
    seg_share: float = 1 / 16  # a large segment: this share of the live bytes, a power of two
    seg_min: int = 64 * MIB  # ... at least this
    seg_max: int = 512 * MIB  # ... at most this (a larger request: a segment of its own)
    #: on a miss, empty segments go back while held + the new segment > this x the HWM of
    #: the live bytes
    seg_slack: float = 1.05
    #: a large range is split when what is left is over this (0: whatever is left)
    seg_split: int = MIB
    #: the replaying thread's slot in front of the segments (``Segments``' ``slot``:
    #: carve.c's blocks in cache.c's thread slot, issue 62's fast path)
    seg_slot: bool = False


def live_chunk(share: float, low: int, high: int) -> Any:
    """A chunk size that follows the live bytes: ``share`` of them, rounded up to a power
    of two, within [low, high] (a carved class's ``chunk`` or ``keep``)."""

    def size(live: int) -> int:
        want = max(int(live * share), 1)
        return min(high, max(low, 1 << (want - 1).bit_length()))

    return size


POLICIES = {
    "none": Settings(limit=0),
    # the first cache: 2% of the device, never evicting, 16 blocks a key
    "old": Settings(floor=DEVICE // 50, fraction=0, small_max=DEVICE, depth=16, evict=False,
                    slot=False),
    # the cache of 2026-11-30: one order, max(64 MiB, live / 16), 16 blocks a key
    "lru": Settings(small_max=DEVICE, depth=16, slot=False),
    # cache.c as built: two tiers, 64 blocks a key, the large tier's cap
    # min(64 MiB, max(live / 8, the block cached)) (since 2026-12-02)
    "tiers": Settings(),
    # the tiers before: the large tier's cap a fixed 64 MiB (what MEASURED's "tiers-fixed"
    # rows ran)
    "tiers-fixed": Settings(large_fraction=0),
    # bench_trace.py's bridge-onetier (BRIDGE_CACHE_SMALL_MAX=100%)
    "onetier": Settings(small_max=DEVICE),
    # bench_trace.py's bridge-allhits (limit, floor, fraction 1, large cap: the device, no
    # share of live; lift_cache_max_block: the largest cached block the limit)
    "allhits": Settings(limit=DEVICE, max_block=DEVICE, fraction=1, floor=DEVICE, large_cap=DEVICE,
                        large_fraction=0),
    # the fixed tiers with the large tier's cap also at most 1/16 of live, no floor (a model
    # only: a loop of one large size would miss)
    "tiers-live16": Settings(large_fraction=0, large_live_min=1 / 16),
    # carved classes (git show b4c11eb:docs/design.md, "A cache of carved small blocks: the
    # model's figures"). carve-small: requests up to 1 MiB carved from 2 MiB chunks (every empty
    # chunk kept), larger ones in today's large tier
    "carve-small": Settings(carve=((MIB, 2 * MIB, DEVICE),), large_fraction=0),
    # torch's layout: also 1-10 MiB carved from 20 MiB chunks, every empty chunk kept
    "carve-torch": Settings(carve=((MIB, 2 * MIB, DEVICE), (10 * MIB, 20 * MIB, DEVICE)),
                            large_fraction=0),
    # the candidate: up to 1 MiB from 2 MiB chunks (kept), 1-10 MiB from 64 MiB chunks (an
    # empty one returned at once), larger ones in the large tier under min(64 MiB, live/16)
    "carve": Settings(carve=((MIB, 2 * MIB, DEVICE), (10 * MIB, 64 * MIB, 0)),
                      large_fraction=0, large_live_min=1 / 16),
    # every size carved (2026-12-02; git show b4c11eb:docs/design.md, "The model's frontier
    # on four traces"): up to 1 MiB from 2 MiB chunks (kept), the rest from 64 MiB chunks (a larger
    # request: a chunk of its own), at most 64 MiB of empty chunks kept
    # carving as built in carve.c (BRIDGE_CACHE_CARVE=1): up to 1 MiB from 2 MiB chunks,
    # larger requests from chunks of 1/8 of the live bytes (a power of two, 32 to 256 MiB),
    # no empty chunk kept (the best of the carved policies on the H200's pool:
    # probes/pool_sequence.py, benchmarks/results/probes.md)
    "carve-live": Settings(limit=0, carve=((MIB, 2 * MIB, 0),
                                           (DEVICE, live_chunk(1 / 8, 32 * MIB, 256 * MIB), 0))),
    # carve-live with an emptied chunk returned lazily (Carver's ``lazy``): a loop of one
    # large size keeps its chunk (a model only)
    "carve-lazy": Settings(limit=0, carve_lazy=True,
                           carve=((MIB, 2 * MIB, 0),
                                  (DEVICE, live_chunk(1 / 8, 32 * MIB, 256 * MIB), 0))),
    "carve-all": Settings(limit=0, carve=((MIB, 2 * MIB, DEVICE), (DEVICE, 64 * MIB, 64 * MIB)),
                          large_fraction=0),
    # torch's mechanism over the pool (``Segments``): 2 MiB segments for requests up to
    # 1 MiB, live/16 (a power of two, 64-512 MiB) for larger ones, best fit, splitting,
    # coalescing, per stream; empty segments kept, given back oldest first on a miss that
    # would hold more than 1.05 x the HWM of the live bytes
    "segments": Settings(limit=0, segments=True),
    # segments as carve.c builds them (BRIDGE_CACHE_SEGMENTS=1): a large range split
    # whatever is left (the same hits and memory on the committed traces:
    # tests/benchmarks/test_model_cache.py), the thread slot in front as the core has it
    "segments-core": Settings(limit=0, segments=True, seg_split=0, seg_slot=True),
}
#: what the library does by default (BRIDGE_CACHE_SEGMENTS unset): segments as carve.c
#: builds them, the very Settings of ``segments-core``, whatever they become; held to the
#: core event for event on every committed trace (tests/benchmarks/test_model_cache.py)
POLICIES["default"] = POLICIES["segments-core"]

EVICT_MAX = 16  # BRIDGE_CACHE_EVICT_MAX: blocks one put or trim hands back


class Cache:
    """cache.c's rules: exact (stream, size) keys, newest block taken first; two tiers,
    each with its own least-recently-cached order, evicting only its own blocks.

    ``put`` is ``cache_put`` (``evict`` False: ``cache_put_no_evict``), ``trim`` is
    ``cache_trim``; ``held`` is what ledger.c passes: the committed bytes (live and
    cached) less the block being freed, read once per free. ``slot``: the replaying
    thread's slot (cache.c's thread slots), the block it freed last, counted in its tier,
    the newest of its tier and key, beside the lists' ``depth`` per key."""

    def __init__(self, s: Settings) -> None:
        self.s = s
        self.q16 = int(s.fraction * 65536 + 0.5)  # ledger.c's rounding
        self.order: list[OrderedDict] = [OrderedDict(), OrderedDict()]  # serial -> block
        self.tier = [0, 0]  # cached bytes per tier
        self.keys: dict[tuple, list] = defaultdict(list)  # key -> [(tier, serial)], newest last
        self.serial = 0
        self.slot: tuple | None = None  # (key, block, size, tier)

    @property
    def bytes(self) -> int:
        return self.tier[0] + self.tier[1]

    def take(self, key: tuple) -> tuple | None:
        if self.slot is not None and self.slot[0] == key:
            block, size, t = self.slot[1:]
            self.slot = None
            self.tier[t] -= size
            return block
        if not self.keys[key]:
            return None
        t, i = self.keys[key].pop()
        block, size = self.order[t].pop(i)[1:]
        self.tier[t] -= size
        return block

    def cap_for(self, t: int, held: int, size: int = 0) -> int:
        """cache.c's cap_for; ``size``: the block being cached (0: a trim)."""
        room = max(self.s.limit - self.tier[1 - t], 0)
        live = max(held - self.bytes, 0)
        if t == 1:
            cap = self.s.large_cap
            if self.s.large_fraction:  # cache.c's share, in its 1/65536 steps
                q16 = int(self.s.large_fraction * 65536 + 0.5)
                cap = min(cap, max((live * q16) >> 16, size))
            if self.s.large_live_min:  # a model only: the large tier's cap also follows live
                cap = min(cap, int(live * self.s.large_live_min))
        else:
            share = (live * self.q16) >> 16
            cap = min(share, room) if share > self.s.floor else self.s.floor
        return min(cap, room)

    def evict(self, t: int, cap: int, extra: int, most: int) -> list:
        out = []
        while len(out) < most and self.order[t] and self.tier[t] + extra > cap:
            i, (key, block, size) = self.order[t].popitem(last=False)
            self.keys[key].remove((t, i))
            self.tier[t] -= size
            out.append(block)
        return out

    def put_cap(self, t: int, held: int, size: int) -> int:
        """cache.c's put_cap: the cap a block of ``size`` is held to in tier t."""
        if t == 0:  # under the floor (and the limit): under the cap, whatever live is
            low = min(self.s.floor, max(self.s.limit - self.tier[1], 0))
            if self.tier[0] + size <= low:
                return low
        return self.cap_for(t, held, size)

    def put(self, key: tuple, size: int, block: tuple, held: int) -> tuple[bool, list]:
        s = self.s
        if not s.limit or size > s.max_block:
            return False, []
        t = int(size > s.small_max)
        cap = self.put_cap(t, held, size)
        have = self.tier[t]
        if not s.slot:  # the lists alone: cache.c's put_listed
            fits = (s.evict or have + size <= cap) and size <= cap and len(self.keys[key]) < s.depth
            evicted = []
            if s.evict and have + size > cap:
                evicted = self.evict(t, cap, size if fits else 0, EVICT_MAX)
            if fits and self.tier[t] + size <= cap:
                self.serial += 1
                self.order[t][self.serial] = (key, block, size)
                self.keys[key].append((t, self.serial))
                self.tier[t] += size
                return True, evicted
            return False, evicted
        if self.slot is None and have + size <= cap:  # cache.c's path without the lock
            self.slot = (key, block, size, t)
            self.tier[t] += size
            return True, []
        old, self.slot = self.slot, None  # still counted in its tier
        want = (s.evict or have + size <= cap) and size <= cap
        evicted = []
        if s.evict and have + size > cap:
            extra = size if want else 0
            evicted = self.evict(t, cap, extra, EVICT_MAX)
            # the slot's block is the newest below this one: evicted last
            if old and old[3] == t and self.tier[t] + extra > cap and len(evicted) < EVICT_MAX:
                evicted.append(old[1])
                self.tier[t] -= old[2]
                old = None
        kept = False
        if want and self.tier[t] + size <= cap:
            kept = True
            if old and len(self.keys[old[0]]) < s.depth:  # into the lists, their newest
                self.serial += 1
                self.order[old[3]][self.serial] = old[:3]
                self.keys[old[0]].append((old[3], self.serial))
                old = None
            elif old and s.evict and len(evicted) < EVICT_MAX:
                evicted.append(old[1])
                self.tier[old[3]] -= old[2]
                old = None
            elif old:
                kept = False  # no room for the older block: this one is not kept
            if kept:
                self.slot = (key, block, size, t)
                self.tier[t] += size
        if old:
            self.slot = old
        return kept, evicted

    def trim(self, held: int) -> list:
        out: list = []
        for t in (0, 1):
            if len(out) < EVICT_MAX:
                out += self.evict(t, self.cap_for(t, held), 0, EVICT_MAX - len(out))
            if (len(out) < EVICT_MAX and self.slot is not None and self.slot[3] == t
                    and self.tier[t] > self.cap_for(t, held)):  # the slot last
                out.append(self.slot[1])
                self.tier[t] -= self.slot[2]
                self.slot = None
        return out


#: a request larger than its class's chunk gets a chunk of its own, rounded up to this
CARVE_ROUND = 2 * MIB


class Carver:
    """Requests up to ``largest`` carved from ``chunk``-byte pool blocks (a larger request:
    a chunk of its own size, rounded up to CARVE_ROUND), as torch's small pool carves its
    2 MiB segments: sizes rounded to 512 B, best fit (smallest free range
    that holds the request, then the oldest chunk, then the lowest offset) over the free
    ranges of the request's stream's chunks, the rest of the range split off; a freed
    block coalesces with its free neighbours. A chunk with nothing live is kept while the
    class's empty chunks stay within ``keep`` bytes, else the oldest empty one goes back
    to the pool at once; ``flush`` (pressure: an allocation that would fail, empty_cache)
    returns every empty chunk. ``mapped`` counts the chunks taken from the pool (each a
    driver call, the class's only misses), ``returned`` those given back. ``chunk`` and
    ``keep`` may also be functions of the bytes live when a chunk is taken or a block freed
    (``live_chunk``: chunks that follow the program's size).

    ``lazy``: the newest chunk to empty past ``keep`` is not returned at once but at the next
    call that takes memory from the pool (any class, the tiers too), unless the next
    request of its class is carved from it first and it is no larger than the chunk that
    request would take now: a loop of one large size reuses its chunk, and the pool never
    holds it beside a new one."""

    def __init__(self, pool: Pool, largest: int, chunk: Any, keep: Any,
                 lazy: bool = False) -> None:  # fmt: skip
        self.pool, self.largest, self.lazy = pool, largest, lazy
        self.pending: list[int] = []  # lazy: emptied chunks past keep, not yet returned
        if lazy:
            pool.before_alloc.append(self.settle)
        self.chunk_of = chunk if callable(chunk) else (lambda live, c=chunk: c)
        self.keep_of = keep if callable(keep) else (lambda live, k=keep: k)
        self.fits: dict[int, list] = defaultdict(list)  # stream -> sorted (size, no, offset)
        self.ranges: dict[int, list] = {}  # chunk no -> its free (offset, size), by offset
        self.info: dict[int, list] = {}  # chunk no -> [pool block, stream, blocks live, bytes]
        self.empty: OrderedDict = OrderedDict()  # empty chunk no -> its bytes, oldest first
        self.next_no = self.mapped = self.returned = 0

    def _unlink(self, stream: int, no: int, off: int, size: int) -> None:
        self.fits[stream].remove((size, no, off))
        self.ranges[no].remove((off, size))

    def _link(self, stream: int, no: int, off: int, size: int) -> None:
        bisect.insort(self.fits[stream], (size, no, off))
        bisect.insort(self.ranges[no], (off, size))

    def settle(self, target: int | None = None, most: int = 0) -> None:
        """Return the pending chunks, but ``target`` if it holds at most ``most`` bytes."""
        for no in self.pending:
            if no in self.empty and (no != target or self.info[no][3] > most):
                self._return(no)
        self.pending.clear()

    def alloc(self, n: int, stream: int, live: int = 0) -> tuple[tuple, bool]:
        """(the carved block, whether a new chunk was taken from the pool)."""
        n = max(512, -(-n // 512) * 512)
        fits = self.fits[stream]
        i = bisect.bisect_left(fits, (n, -1, -1))
        if self.pending:
            want = max(self.chunk_of(live), -(-n // CARVE_ROUND) * CARVE_ROUND)
            self.settle(fits[i][1] if i < len(fits) else None, want)
            i = bisect.bisect_left(fits, (n, -1, -1))
        new = i == len(fits)
        if new:
            no, self.next_no = self.next_no, self.next_no + 1
            size = max(self.chunk_of(live), -(-n // CARVE_ROUND) * CARVE_ROUND)
            self.info[no] = [self.pool.alloc(size), stream, 0, size]
            self.ranges[no] = []
            self._link(stream, no, 0, size)
            self.mapped += 1
            i = bisect.bisect_left(fits, (n, -1, -1))
        size, no, off = fits[i]
        self._unlink(stream, no, off, size)
        if size > n:
            self._link(stream, no, off + n, size - n)
        if self.info[no][2] == 0:
            self.empty.pop(no, None)
        self.info[no][2] += 1
        return ("carved", self, no, off, n), new

    def free(self, block: tuple, live: int = 0) -> None:
        """Give a carved block back to its chunk, coalesced with its free neighbours."""
        _, _, no, off, n = block
        stream = self.info[no][1]
        r = self.ranges[no]
        i = bisect.bisect(r, (off, 0))
        if i < len(r) and off + n == r[i][0]:  # the free range after it
            nxt = r[i]
            self._unlink(stream, no, *nxt)
            n += nxt[1]
        if i and sum(r[i - 1]) == off:  # the one before it (i is still its place)
            prv = r[i - 1]
            self._unlink(stream, no, *prv)
            off, n = prv[0], prv[1] + n
        self._link(stream, no, off, n)
        self.info[no][2] -= 1
        if self.info[no][2] == 0:
            self.empty[no] = self.info[no][3]
            keep = self.keep_of(live)
            while sum(self.empty.values()) > keep:
                oldest = next(iter(self.empty))
                if oldest == no and self.lazy:
                    self.pending.append(no)  # the next pool call or carve decides
                    break
                self._return(oldest)

    def _return(self, no: int) -> None:
        block, stream, _, size = self.info.pop(no)
        self._unlink(stream, no, 0, size)
        del self.ranges[no]
        self.empty.pop(no)
        self.pool.release(block)
        self.returned += 1

    def flush(self) -> None:
        self.pending.clear()
        for no in list(self.empty):
            self._return(no)

    @property
    def held(self) -> int:
        """Bytes of chunks this class holds (live blocks and free ranges)."""
        return sum(i[3] for i in self.info.values())


class Segments:
    """Issue 62's cache: every request served from segments taken from the pool, as
    torch's caching allocator serves from cudaMalloc'd segments.

    Sizes rounded up to 512 B (at least 512). A request of up to SMALL (1 MiB, after
    rounding) is served from the small segments (2 MiB each), a larger one from the
    large segments: ``share`` of the live bytes at the miss rounded up to a power of
    two, within [``low``, ``high``]; a request larger than that gets a segment of its
    own, rounded up to 2 MiB, whose rest later requests may take. Best fit over the free
    ranges of the request's stream and size class: the smallest range that holds it,
    then the oldest segment, then the lowest offset. The range is split when what is
    left is at least 512 B (small) or over 1 MiB (large); else the whole range is
    handed out. A freed block coalesces with its free neighbours; a segment with
    nothing handed out is kept (``empty``, in the order it emptied).

    ``split``: a large range is split when what is left is over this (torch: 1 MiB; 0:
    whatever is left, as carve.c does, which never changes a hit: a rest of at most 1 MiB
    holds no large request).

    The release rule: ``hwm`` is the high-water mark of the live bytes (``live``: the
    requested sizes of the blocks handed out). On a miss, before a new segment of S bytes
    is taken, while ``held`` + S > ``slack`` x ``hwm`` and a segment is empty, the one
    that emptied first goes back to the pool; a segment with anything handed out never
    does. ``flush`` (pressure, empty_cache) gives back every empty segment. ``taken``
    and ``returned`` count the segments (each one driver call).

    ``slot``: the replaying thread's slot in front (cache.c's thread slot, as carve.c's
    blocks use it since issue 62's fast path): ``put`` of the block the thread allocated
    last (and has not freed since) parks it, still handed out of its segment; the
    thread's next allocation takes it back when it asks for the same (stream, size) (a
    hit, nothing carved), and otherwise gives it back to its segment (coalescing then)
    before it looks for a range, as ``flush`` does first. Any other ``put`` is ``free``.
    A parked block's bytes are idle (``idle``) and stay in ``live`` (so in ``hwm``), as
    carve.c counts a parked block carved."""

    SMALL = MIB
    SMALL_SEGMENT = 2 * MIB
    ROUND = 2 * MIB  # a segment of its own is rounded up to this

    def __init__(self, pool: Pool, share: float = 1 / 16, low: int = 64 * MIB,
                 high: int = 512 * MIB, slack: float | None = 1.05,
                 split: int = MIB, slot: bool = False) -> None:  # fmt: skip
        self.pool, self.share, self.low, self.high = pool, share, low, high
        self.slot = slot
        self.last: tuple | None = None  # the block allocated last, not freed since
        self.parked: tuple | None = None  # the block in the slot
        # per mille, as carve.c holds it; None: nothing ever given back on a miss
        self.slack_pm = None if slack is None else round(slack * 1000)
        self.split = split
        self.fits: dict[tuple, list] = defaultdict(list)  # (stream, large) -> (size, no, off)
        self.ranges: dict[int, list] = {}  # segment no -> its free (offset, size), by offset
        #: segment no -> [pool block, stream, large, bytes, blocks handed out]
        self.info: dict[int, list] = {}
        self.empty: OrderedDict = OrderedDict()  # empty segment no -> None, as they emptied
        self.next_no = self.taken = self.returned = 0
        self.held = self.used = self.live = self.hwm = 0  # used: bytes handed out

    def segment_for(self, n: int, live: int) -> int:
        """The bytes of the segment a miss of ``n`` (rounded) bytes takes."""
        if n <= self.SMALL:
            return self.SMALL_SEGMENT
        want = max(int(live * self.share), 1)
        size = min(self.high, max(self.low, 1 << (want - 1).bit_length()))
        return size if n <= size else -(-n // self.ROUND) * self.ROUND

    def _unlink(self, key: tuple, no: int, off: int, size: int) -> None:
        self.fits[key].remove((size, no, off))
        self.ranges[no].remove((off, size))

    def _link(self, key: tuple, no: int, off: int, size: int) -> None:
        bisect.insort(self.fits[key], (size, no, off))
        bisect.insort(self.ranges[no], (off, size))

    def alloc(self, n: int, stream: int, live: int = 0) -> tuple[tuple, bool]:
        """(the block, whether a new segment was taken from the pool); ``live``: the
        device's live bytes (a large segment's size follows them)."""
        if self.parked is not None:
            p, self.parked = self.parked, None
            if (p[6], p[5]) == (stream, n):  # the slot's block, taken back: a hit
                self.last = p
                return p, False
            self.free(p)  # not this allocation's: back to its segment first
        req, n = n, max(512, -(-n // 512) * 512)
        large = n > self.SMALL
        key = (stream, large)
        fits = self.fits[key]
        i = bisect.bisect_left(fits, (n, -1, -1))
        new = i == len(fits)
        if new:
            size = self.segment_for(n, live)
            self.hwm = max(self.hwm, self.live + req)
            while (self.empty and self.slack_pm is not None
                   and (self.held + size) * 1000 > self.slack_pm * self.hwm):  # fmt: skip
                self._return(next(iter(self.empty)))
            no, self.next_no = self.next_no, self.next_no + 1
            self.info[no] = [self.pool.alloc(size), stream, large, size, 0]
            self.ranges[no] = []
            self._link(key, no, 0, size)
            self.empty[no] = None
            self.held += size
            self.taken += 1
            i = bisect.bisect_left(fits, (n, -1, -1))
        size, no, off = fits[i]
        self._unlink(key, no, off, size)
        rest = size - n
        if rest > self.split if large else rest >= 512:
            self._link(key, no, off + n, rest)
        else:
            n = size
        info = self.info[no]
        if info[4] == 0:
            del self.empty[no]
        info[4] += 1
        self.used += n
        self.live += req
        self.hwm = max(self.hwm, self.live)
        block = ("segment", self, no, off, n, req, stream)
        self.last = block
        return block, new

    def put(self, block: tuple) -> None:
        """The user's free: the block allocated last parks in the slot (``slot`` on),
        any other goes back to its segment."""
        if self.slot and block is self.last:
            self.parked, self.last = block, None
        else:
            if block is self.last:
                self.last = None
            self.free(block)

    def free(self, block: tuple) -> None:
        """Give a block back to its segment, coalesced with its free neighbours."""
        _, _, no, off, n, req, _ = block
        info = self.info[no]
        key = (info[1], info[2])
        self.used -= n
        self.live -= req
        r = self.ranges[no]
        i = bisect.bisect(r, (off, 0))
        if i < len(r) and off + n == r[i][0]:  # the free range after it
            nxt = r[i]
            self._unlink(key, no, *nxt)
            n += nxt[1]
        if i and sum(r[i - 1]) == off:  # the one before it
            prv = r[i - 1]
            self._unlink(key, no, *prv)
            off, n = prv[0], prv[1] + n
        self._link(key, no, off, n)
        info[4] -= 1
        if info[4] == 0:
            self.empty[no] = None

    def _return(self, no: int) -> None:
        block, stream, large, size, _ = self.info.pop(no)
        self._unlink((stream, large), no, 0, size)
        del self.ranges[no]
        del self.empty[no]
        self.pool.release(block)
        self.held -= size
        self.returned += 1

    def flush(self) -> None:
        if self.parked is not None:  # the slot's block first: its segment may empty
            p, self.parked = self.parked, None
            self.free(p)
        for no in list(self.empty):
            self._return(no)

    @property
    def idle(self) -> int:
        """Bytes the segments hold that no live block asked for (carve.c's carve_idle),
        the parked block's included (cache.c's parked_carved)."""
        return self.held - self.live + (self.parked[5] if self.parked is not None else 0)


class TorchNative(Segments):
    """A model of native torch's caching allocator (CUDACachingAllocator, no settings):
    ``Segments``' best fit, splitting and coalescing over cudaMalloc'd segments, with
    torch's segment sizes (a request of up to 1 MiB: 2 MiB; up to 10 MiB: 20 MiB; larger:
    its own size rounded up to 2 MiB) and nothing ever given back (no allocation is
    refused in a replay). Its reserved is ``held``, its driver calls ``taken``. Where
    torch breaks a tie between free blocks of one size by address, this takes the oldest
    segment, then the lowest offset."""

    def __init__(self) -> None:
        super().__init__(Pool(), slack=None)

    def segment_for(self, n: int, live: int) -> int:
        if n <= self.SMALL:
            return self.SMALL_SEGMENT
        if n < 10 * MIB:
            return 20 * MIB
        return -(-n // self.ROUND) * self.ROUND


class CupyNative(Segments):
    """A model of CuPy's default MemoryPool: sizes rounded up to 512 B, one arena per
    stream (no size classes), the smallest free chunk that holds the request, split
    whatever is left, coalesced on free; a miss cudaMallocs the rounded request itself;
    nothing given back (``free_all_blocks`` runs only after a refused cudaMalloc)."""

    SMALL = 1 << 62  # one arena: every request "small", split down to 512 B

    def __init__(self) -> None:
        super().__init__(Pool(), slack=None)

    def segment_for(self, n: int, live: int) -> int:
        return n


def native(events: list, passes: int = 5, warmup: bool = True) -> dict:
    """The trace replayed as bench_trace.py's ``native`` does: torch's caching allocator
    (TorchNative), CuPy's MemoryPool (CupyNative) for a mixed trace's CuPy events; its
    reserved is theirs together (both only grow: bench_trace.py reads the sum at the
    end). The H200's figures: MEASURED_NATIVE."""
    torch, cupy = TorchNative(), CupyNative()
    live: dict[int, tuple | None] = {}
    live_bytes = peak_live = hits = allocs = 0
    first = (0, 0)

    def alloc(e: list) -> tuple:
        nonlocal live_bytes, peak_live, hits, allocs
        allocs += 1
        a = cupy if len(e) > 4 and e[4] == 1 else torch
        block, new = a.alloc(e[2], e[3])
        hits += not new
        live_bytes += e[2]
        peak_live = max(peak_live, live_bytes)
        return (a, block, e[2])

    def free(item: tuple) -> None:
        nonlocal live_bytes
        item[0].free(item[1])
        live_bytes -= item[2]

    if warmup:  # torch.zeros(1)
        free(alloc([0, -1, 4, 0]))
        peak_live = 0
    for k in range(passes):
        for e in events:
            if e[0] == 0:
                live[e[1]] = alloc(e) if e[2] else None
            elif (item := live.pop(e[1])) is not None:
                free(item)
        for item in live.values():
            if item is not None:
                free(item)
        live.clear()
        if k == 0:
            first = (hits, allocs)
    steady = allocs - first[1]
    reserved = torch.held + cupy.held
    return {
        "hits": hits / allocs,
        "steady_hits": (hits - first[0]) / steady if steady else None,
        "allocs": allocs,
        "cache_hits": hits,
        "peak_reserved": reserved,
        "peak_live": peak_live,
        "reserved_over_live": reserved / peak_live,
        "driver_calls": torch.taken + cupy.taken,  # cudaMalloc calls
    }


def replay(events: list, policy: str = "tiers", passes: int = 5, depth: int | None = None,
           warmup: bool = False, record: list | None = None, pool_model: str = "heap",
           ops: list | None = None, **settings: Any) -> dict:  # fmt: skip
    """Replay the trace ``passes`` times as bench_trace.py's replay does, under a policy
    (a POLICIES name; ``depth`` and ``settings``: Settings fields that override it).

    As on the GPU: the pool and the cache carry over from pass to pass; the blocks
    still live at the end of a pass are freed through the cache (``live.clear()``);
    0-byte allocations make no allocation; ``warmup``: the replay's ``torch.zeros(1)``
    (4 bytes, freed into the cache) comes first, counted as an allocation as the
    bridge counts it. ``record``: a list that gets the cached bytes (the carved chunks' idle
    bytes included; with the segments' slot on, a pair: those and the bytes parked in the
    slot, requested sizes) after every event
    and after each pass's last frees (to hold against cache.c's on the stand-in driver).
    ``pool_model``: a POOLS name. ``ops``: a list that gets the calls reaching the pool
    (RecordingPool), and 0 after each pass."""
    s = POLICIES[policy]
    if depth is not None:
        settings["depth"] = depth
    s = replace(s, **settings)
    if s.carve:  # the tiers see only what no class carves: the large tier takes all of it
        s = replace(s, small_max=max(c[0] for c in s.carve))
    pool = Pool(POOLS[pool_model]) if ops is None else RecordingPool(POOLS[pool_model], ops)
    cache = Cache(s)
    carvers = [Carver(pool, *c, lazy=s.carve_lazy) for c in s.carve]
    segs = (Segments(pool, s.seg_share, s.seg_min, s.seg_max, s.seg_slack, s.seg_split,
                     s.seg_slot) if s.segments else None)  # fmt: skip
    live: dict[int, tuple | None] = {}
    live_bytes = peak_live = hits = allocs = peak_reserved = carved_live = peak_held = 0

    def kept() -> int:  # the bytes kept for reuse: cached blocks, chunks' idle bytes
        idle = segs.idle if segs is not None else 0
        return cache.bytes + sum(c.held for c in carvers) - carved_live + idle

    def recorded() -> Any:  # with the segments' slot: the kept bytes and the slot's
        if segs is None or not segs.slot:
            return kept()
        return (kept(), segs.parked[5] if segs.parked is not None else 0)

    def alloc(size: int, stream: int) -> tuple:
        nonlocal live_bytes, peak_live, hits, allocs, peak_reserved, carved_live, peak_held
        allocs += 1
        carver = next((c for c in carvers if size <= c.largest), None)
        if segs is not None:
            block, new = segs.alloc(size, stream, live_bytes)
            hits += not new
        elif carver is not None:
            block, new = carver.alloc(size, stream, live_bytes)
            hits += not new
            carved_live += size
        elif (block := cache.take((stream, size))) is None:
            block = pool.alloc(size)
        else:
            hits += 1
        live_bytes += size
        peak_live = max(peak_live, live_bytes)
        peak_reserved = max(peak_reserved, pool.reserved())
        if segs is not None:
            peak_held = max(peak_held, segs.held)
        return (block, size, stream)

    def free(item: tuple) -> None:
        nonlocal live_bytes, carved_live
        block, size, stream = item
        live_bytes -= size
        if block[0] == "segment":
            block[1].put(block)
            return
        if block[0] == "carved":
            carved_live -= size
            block[1].free(block, live_bytes)
            return
        held = live_bytes + cache.bytes  # ledger.c's cache_held: committed - size
        kept, evicted = cache.put((stream, size), size, block, held)
        while evicted:  # ledger.c's release_evicted
            for b in evicted:
                pool.release(b)
            evicted = cache.trim(held) if len(evicted) == EVICT_MAX else []
        if not kept:
            pool.release(block)

    if warmup:
        free(alloc(4, 0))
        peak_live = 0
    first = (0, 0)  # (hits, allocations) at the end of the first pass
    for k in range(passes):
        for e in events:
            if e[0] == 0:
                live[e[1]] = alloc(e[2], e[3]) if e[2] else None
            else:
                item = live.pop(e[1])
                if item is not None:
                    free(item)
            if record is not None:
                record.append(recorded())
        for item in live.values():  # bench_trace.py's live.clear(): freed in order
            if item is not None:
                free(item)
        live.clear()
        if record is not None:
            record.append(recorded())
        if ops is not None:
            ops.append(0)  # the end of a pass (bench_trace.py synchronizes there)
        if k == 0:
            first = (hits, allocs)
    assert peak_reserved == pool.reserved()  # the pool never unmaps
    steady = allocs - first[1]
    return {
        "hits": hits / allocs,
        # the passes after the first: what a program that runs on sees
        "steady_hits": (hits - first[0]) / steady if steady else None,
        "reserved_over_live": pool.reserved() / peak_live,
        "allocs": allocs,
        "cache_hits": hits,
        "peak_reserved": pool.reserved(),
        "peak_live": peak_live,
        "driver_calls": pool.calls,  # allocations and frees that reached the pool
        "chunks": [{"largest": c.largest, "chunk": c.chunk_of(peak_live), "mapped": c.mapped,
                    "returned": c.returned, "held": c.held} for c in carvers],  # fmt: skip
        # the segments: taken and given back (each a driver call), the most bytes they
        # held at once beside the HWM of the live bytes they served
        "segments": None if segs is None else {
            "taken": segs.taken, "returned": segs.returned, "held": segs.held,
            "peak_held": peak_held, "hwm": segs.hwm},  # fmt: skip
    }


#: the H200's replays (bench_trace.py, five passes, warm-up included): peak reserved /
#: peak live, cache hits, allocations. none / old / lru: benchmarks/results of
#: 2026-11-30; tiers-fixed / onetier / allhits: the two tiers at 64 blocks a key, the large
#: tier's cap a fixed 64 MiB (main, fd3da62).
MEASURED = {
    ("gpt2", "none"): (1.008, None, None),
    ("gpt2", "old"): (1.464, None, None),
    ("gpt2", "lru"): (1.027, 5578, 16686),
    ("gpt2", "tiers-fixed"): (1.069, 9724, 16686),
    ("gpt2", "onetier"): (1.021, 5591, 16686),
    ("gpt2", "allhits"): (2.473, 15079, 16686),
    ("resnet50", "none"): (1.060, None, None),
    ("resnet50", "old"): (1.511, None, None),
    ("resnet50", "lru"): (1.189, 4749, 14541),
    ("resnet50", "tiers-fixed"): (1.119, 8529, 14541),
    ("resnet50", "onetier"): (1.201, 4932, 14541),
    ("resnet50", "allhits"): (1.722, 14034, 14541),
    ("cupy-fft", "tiers-fixed"): (1.898, 703, 1041),
    ("cupy-fft", "allhits"): (3.497, None, None),
}

#: native torch on the H200 (bench_trace.py's ``native``: torch's caching allocator, CuPy's
#: MemoryPool beside it on mixed): peak reserved / peak live, benchmarks/results/trace.md
#: (the run of 2026-12-03); ``native()`` models it
MEASURED_NATIVE = {"gpt2": 1.185, "resnet50": 1.210, "cupy-fft": 1.799, "mixed": 2.425}

KIB = 1 << 10
#: the settings a user has without a rebuild, searched by ``--grid``
GRID = {
    "small_max": ((256 * KIB, "256 KiB"), (MIB, "1 MiB"), (4 * MIB, "4 MiB"), (DEVICE, "100%")),
    "large_cap": ((0, "0"), (64 * MIB, "64 MiB"), (256 * MIB, "256 MiB")),
    "fraction": ((1 / 8, "1/8"), (1 / 16, "1/16"), (1 / 32, "1/32")),
}


def load(path: str) -> dict:
    with gzip.open(path) as f:
        return json.load(f)


def compare(traces: list[dict]) -> None:
    """Each policy's hits, driver calls and reserved / live under both pool models, beside
    the H200's figures where measured; each trace's floor last."""
    print(f"{'trace':<10} {'policy':<13} {'cache hits':>16} {'calls/alloc':>11} "
          f"{'r/l heap':>9} {'r/l chunked':>11} {'H200 hits':>16} {'H200 r/l':>9}")  # fmt: skip
    for trace in traces:
        for policy in POLICIES:
            r = replay(trace["events"], policy, warmup=True)
            c = replay(trace["events"], policy, warmup=True, pool_model="chunked")
            gpu, gh, ga = MEASURED.get((trace["name"], policy), (None, None, None))
            print(
                f"{trace['name']:<10} {policy:<13} {r['cache_hits']:>7,} of {r['allocs']:>6,} "
                f"{r['driver_calls'] / r['allocs']:>11.2f} {r['reserved_over_live']:>9.3f} "
                f"{c['reserved_over_live']:>11.3f} "
                f"{f'{gh:,} of {ga:,}' if gh else '':>16} {f'{gpu:.3f}' if gpu else '':>9}"
            )
        n = native(trace["events"])
        gpu = MEASURED_NATIVE.get(trace["name"])
        print(f"{trace['name']:<10} {'(native)':<13} {n['cache_hits']:>7,} of {n['allocs']:>6,} "
              f"{n['driver_calls'] / n['allocs']:>11.2f} {n['reserved_over_live']:>9.3f} "
              f"{'':>11} {'':>16} {f'{gpu:.3f}' if gpu else '':>9}")  # fmt: skip
        print(f"{trace['name']:<10} {'(floor)':<13} {'':>16} {'':>11} "
              f"{floor(trace['events']):>9.3f}")  # fmt: skip


def beside_native(traces: list[dict], policy: str = "default") -> list[dict]:
    """A policy beside native torch on each trace: its hits (all five passes, warm-up
    included, and the four after the first), its driver calls, its segments' peak over
    peak live and the pool's reserved over live under both pool models; native's hits,
    reserved over live (the model's, and the H200's where measured)."""
    rows = []
    for trace in traces:
        ev = trace["events"]
        r, c = (replay(ev, policy, warmup=True, pool_model=m) for m in ("heap", "chunked"))
        n = native(ev)
        seg = r["segments"]
        rows.append({
            "trace": trace["name"], "hits": r["hits"], "steady_hits": r["steady_hits"],
            "driver_calls": r["driver_calls"],
            "held": seg["peak_held"] / r["peak_live"] if seg else None,
            "heap": r["reserved_over_live"], "chunked": c["reserved_over_live"],
            "native_hits": n["hits"], "native_steady_hits": n["steady_hits"],
            "native_calls": n["driver_calls"], "native": n["reserved_over_live"],
            "native_h200": MEASURED_NATIVE.get(trace["name"]),
        })  # fmt: skip
    return rows


def print_beside_native(traces: list[dict], policy: str = "default") -> None:
    print(f"{policy} beside native torch (five passes, warm-up included; hits: all passes / "
          f"after the first; r/l: peak reserved / peak live)")  # fmt: skip
    print(f"{'trace':<10} {'hits':>7} {'steady':>7} {'calls':>6} {'held/l':>7} "
          f"{'r/l heap':>9} {'chunked':>8} | {'native hits':>11} {'steady':>7} {'calls':>6} "
          f"{'r/l':>6} {'H200 r/l':>8}")  # fmt: skip
    for w in beside_native(traces, policy):
        h200 = f"{w['native_h200']:.3f}" if w["native_h200"] else ""
        held = f"{w['held']:.3f}" if w["held"] else ""
        print(f"{w['trace']:<10} {w['hits']:>7.1%} {w['steady_hits']:>7.1%} "
              f"{w['driver_calls']:>6,} {held:>7} {w['heap']:>9.3f} {w['chunked']:>8.3f} | "
              f"{w['native_hits']:>11.1%} {w['native_steady_hits']:>7.1%} "
              f"{w['native_calls']:>6,} {w['native']:>6.3f} {h200:>8}")  # fmt: skip


def floor(events: list) -> float:
    """The least peak reserved / peak live of any allocator on a pool that maps CHUNK steps:
    the peak of live bytes rounded up to a whole chunk (the pool never maps less)."""
    peak = replay(events, "none", passes=1)["peak_live"]
    return -(-peak // CHUNK) * CHUNK / peak


def grid(traces: list[dict]) -> list[dict]:
    """The two tiers under every setting of GRID (the others at their defaults)."""
    rows = []
    for sm, sm_name in GRID["small_max"]:
        for lc, lc_name in GRID["large_cap"]:
            for fr, fr_name in GRID["fraction"]:
                row = {"small_max": sm_name, "large_cap": lc_name, "fraction": fr_name}
                for trace in traces:
                    r = replay(trace["events"], "tiers", warmup=True, small_max=sm,
                               large_cap=lc, fraction=fr)  # fmt: skip
                    row[trace["name"]] = (r["hits"], r["reserved_over_live"])
                rows.append(row)
    return rows


#: the carved classes' settings searched by ``--carve-grid`` (the small class fixed: up to
#: 1 MiB from 2 MiB chunks, every empty one kept)
CARVE_GRID = {
    "medium": ((0, "none"), (4 * MIB, "4 MiB"), (10 * MIB, "10 MiB")),
    "chunk": ((20 * MIB, "20 MiB"), (32 * MIB, "32 MiB"), (64 * MIB, "64 MiB")),
    "keep": ((0, "0"), (1, "1 chunk")),
    "large": ((0, 0.0, "0"), (64 * MIB, 0.0, "64 MiB"), (64 * MIB, 1 / 16, "64M, live/16")),
}


def carve_grid(traces: list[dict]) -> list[dict]:
    """The carved classes under every setting of CARVE_GRID: the medium class's largest
    request, its chunk and the empty chunks it keeps, and the large tier's cap."""
    rows = []
    for (med, med_name), (chunk, chunk_name), (keep, keep_name), (cap, frac, cap_name) in (
            (m, c, k, lg) for m in CARVE_GRID["medium"] for c in CARVE_GRID["chunk"]
            for k in CARVE_GRID["keep"] for lg in CARVE_GRID["large"]):  # fmt: skip
        if not med and (chunk, keep) != (20 * MIB, 0):
            continue  # no medium class: its chunk and keep mean nothing
        carve = ((MIB, 2 * MIB, DEVICE),) + (((med, chunk, keep * chunk),) if med else ())
        row: dict[str, Any] = {"medium": med_name, "chunk": chunk_name if med else "-",
                               "keep": keep_name if med else "-", "large": cap_name}
        for trace in traces:
            r, c = (replay(trace["events"], "tiers", warmup=True, carve=carve, large_cap=cap,
                           large_fraction=0, large_live_min=frac, pool_model=m)
                    for m in ("heap", "chunked"))
            row[trace["name"]] = (r["hits"], r["reserved_over_live"], c["reserved_over_live"])
        rows.append(row)
    return rows


def main(argv: list[str]) -> None:
    show_grid, show_carve = "--grid" in argv, "--carve-grid" in argv
    show_native = "--native" in argv
    paths = [a for a in argv if a not in ("--grid", "--carve-grid", "--native")]
    paths = paths or sorted(glob.glob(os.path.join(HERE, "traces", "*.json.gz")))
    traces = [load(p) for p in paths]
    names = [t["name"] for t in traces]
    if show_native:
        print_beside_native(traces)
        return
    if show_carve:
        print(f"{'MEDIUM':>7} {'CHUNK':>7} {'KEEP':>8} {'LARGE TIER':>13} "
              + " ".join(f"{n + ': hits, r/l heap/chunked':>30}" for n in names))  # fmt: skip
        for row in carve_grid(traces):
            cells = " ".join(f"{row[n][0]:>16.1%} {row[n][1]:>6.3f}/{row[n][2]:.3f}"
                             for n in names)  # fmt: skip
            print(f"{row['medium']:>7} {row['chunk']:>7} {row['keep']:>8} {row['large']:>13} "
                  f"{cells}")  # fmt: skip
        return
    if not show_grid:
        print_beside_native(traces)
        print()
        compare(traces)
        return
    print(f"{'SMALL_MAX':>9} {'LARGE_CAP':>9} {'FRACTION':>8} "
          + " ".join(f"{n + ' hits, r/l':>20}" for n in names))  # fmt: skip
    for row in grid(traces):
        cells = " ".join(f"{row[n][0]:>12.1%} {row[n][1]:>7.3f}" for n in names)
        print(f"{row['small_max']:>9} {row['large_cap']:>9} {row['fraction']:>8} {cells}")


if __name__ == "__main__":
    main(sys.argv[1:])
