# SPDX-License-Identifier: Apache-2.0
"""The ledger against a model, over random sequences of calls (hypothesis).

A ``RuleBasedStateMachine`` drives ``bridge._runtime.core`` on the stand-in
driver with allocations, frees, double frees, unknown pointers, budget and
tag caps, bytes held by others in the pool, queued frees, stream syncs, the
cache of freed blocks (cache.c: its cap, its largest block, caching on any
stream) and one-shot driver faults, and keeps a model of what the core must
report. The core is single-threaded here, so the model is exact: after every
step each framework's figure equals the sum of its live sizes, and each
device's ledger the live plus the cached bytes; the peaks are exactly the
highest ledger the budget checks let through; the budget never lets the
ledger pass it; every status and every pointer reused from the cache is the
one the model predicts. The core is process-global: figures are compared
with those read at the start of each example, and each example frees what it
allocated and empties the cache.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from bridge._errors import Status
from bridge._runtime import core

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
DEVICES = (0, 1)
TAGS = (core.TAG_OTHER, core.TAG_CUPY, core.TAG_TORCH)
NULL_STREAM = 0  # syncing it completes every queued free of the device
LEGACY_STREAM = 1  # CU_STREAM_LEGACY: where a free the driver refused goes
STREAMS = (NULL_STREAM, 0xB1000, 0xB2000)
TOTAL = 16 * GIB  # the stand-in's device memory (BRIDGE_STANDIN_TOTAL unset)
DRIVER_UNKNOWN = 999  # a driver error that is not out-of-memory
DRIVER_OOM = 2
CACHE_DEPTH = 64  # blocks kept per (stream, size) in cache.c (core.CACHE_DEPTH)
MAX_BLOCK = 256 * MIB  # cache.c's default largest cached block
# cache.c's two tiers, each with its own order of caching and cap (the limit
# bounds both together: each has the room under it that the other leaves):
#   small (size <= SMALL_MAX): min(limit - large, max(FLOOR, live * FRACTION_Q16 / 65536))
#   large:                     min(limit - small, LARGE_CAP)
CACHE_FLOOR = 64 * MIB
CACHE_FRACTION_Q16 = 65536 // 16
CACHE_SMALL_MAX = MIB
CACHE_LARGE_CAP = 64 * MIB
CACHE_EVICT_MAX = 16  # blocks one cache_put evicts (then cache_trim goes on)

sizes = st.one_of(
    st.integers(1, 64 * KIB),
    st.integers(64 * KIB, 3 * MIB),
    st.sampled_from([0, 1, MIB, 4 * MIB, TOTAL, TOTAL + 1, 2**40, 2**63 - 1]),
)
# a few sizes on the default and one user stream: the cache serves them again
small_sizes = st.sampled_from([256, 4 * KIB, 64 * KIB])
cache_streams = st.sampled_from([NULL_STREAM, 2, 0xB1000])
limits = st.one_of(st.just(0), st.sampled_from([256 * KIB, MIB, 4 * MIB]), st.integers(1, 8 * MIB))
devices = st.sampled_from(DEVICES)
tags = st.sampled_from(TAGS)
streams = st.sampled_from(STREAMS)


@dataclass
class Block:
    ptr: int
    dev: int
    tag: int
    size: int
    stream: int
    recorded: bool = False  # another stream was recorded against it: never cached


@dataclass
class Dev:
    """What the model knows of one device (figures relative to the start)."""

    base_used: int
    base_tag: list[int]
    base_pool: int
    base_others: int
    limit: int = 0
    tag_limit: list[int] = field(default_factory=lambda: [0, 0, 0])
    capacity: int = TOTAL
    foreign: int = 0
    pending: dict[int, int] = field(default_factory=dict)  # stream -> bytes of queued frees
    peak: int = 0
    tag_peak: list[int] = field(default_factory=lambda: [0, 0, 0])
    num_allocs: int = 0
    num_frees: int = 0
    num_ooms: int = 0
    num_retries: int = 0
    num_driver_errors: int = 0
    tag_allocs: list[int] = field(default_factory=lambda: [0, 0, 0])
    tag_frees: list[int] = field(default_factory=lambda: [0, 0, 0])
    tag_allocated: list[int] = field(default_factory=lambda: [0, 0, 0])
    tag_freed: list[int] = field(default_factory=lambda: [0, 0, 0])
    tag_ooms: list[int] = field(default_factory=lambda: [0, 0, 0])
    base_count: list[int] = field(default_factory=lambda: [0, 0, 0])  # live blocks before
    cache_limit: int = 0  # the conftest fixture turns the cache off
    cache_max_block: int = MAX_BLOCK
    cache: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # LIFO per key
    # (stream, size, ptr) of the cached blocks, the least recently cached first
    # (both tiers: a tier's order is this list's entries of its sizes)
    order: list[tuple[int, int, int]] = field(default_factory=list)

    def cached(self) -> int:
        return sum(size * len(ptrs) for (_, size), ptrs in self.cache.items())

    def tier_bytes(self, large: bool) -> int:
        return sum(e[1] for e in self.order if (e[1] > CACHE_SMALL_MAX) == large)


class LedgerMachine(RuleBasedStateMachine):
    standin: ctypes.CDLL  # set by the test below

    blocks = Bundle("blocks")  # live blocks
    freed = Bundle("freed")  # pointers already freed (double-free material)

    def __init__(self) -> None:
        super().__init__()
        self.sd = type(self).standin
        self.live: dict[int, Block] = {}
        self.alloc_fault = 0  # code of the armed cuMemAllocFromPoolAsync fault, 0 = none
        self.free_fault = False
        self.registered: set[int] = set()  # user streams registered as long-lived
        self.dev: dict[int, Dev] = {}

    # ---- set-up and tear-down of one example ----
    @initialize(
        cache=st.sampled_from([0, MIB, GIB]),
        limit=limits,
        tag_cap=st.one_of(st.none(), st.tuples(tags, limits)),
    )
    def start(self, cache: int, limit: int, tag_cap: tuple[int, int] | None) -> None:
        """Reset the core, then start from a drawn cache, budget and framework cap."""
        self.sd.standin_clear_faults()
        for d in DEVICES:
            self.sd.standin_sync_all(d)
            self.sd.standin_set_capacity(d, TOTAL)
            assert core.set_limit(d, 0) == Status.OK
            for t in TAGS:
                assert core.set_tag_limit(d, t, 0) == Status.OK
            assert core.reset_peak(d, -1) == Status.OK
            assert core.reset_accumulated(d, -1) == Status.OK
            assert core.set_cache(d, 0) == Status.OK
            self.sd.standin_sync_all(d)
            s = self.raw(d)
            used = s["used"]
            tag_cur = [t["current"] for t in s["tags"]]
            rc, base_others = core.others(d)
            assert rc == Status.OK
            self.dev[d] = Dev(
                base_used=used,
                base_tag=tag_cur,
                base_pool=s["pool_used"],
                base_others=base_others,
                peak=used,
                tag_peak=list(tag_cur),
            )
            d_ = self.dev[d]
            d_.base_count = [t["count"] for t in s["tags"]]
            d_.num_allocs, d_.num_frees = s["num_allocs"], s["num_frees"]
            d_.num_ooms, d_.num_retries = s["num_ooms"], s["num_retries"]
            d_.num_driver_errors = s["num_driver_errors"]
        self.sd.standin_adopt_stream.argtypes = [ctypes.c_void_p, ctypes.c_int]
        for s_ in STREAMS:
            assert core.forget_stream(s_) == Status.OK
            if s_:
                self.sd.standin_adopt_stream(s_, 0)  # a stream the driver knows
        for d in DEVICES:
            assert core.set_cache(d, cache, MAX_BLOCK) == Status.OK
            self.dev[d].cache_limit = cache
        self._set_limit(0, limit)
        if tag_cap is not None:
            self._set_tag_limit(0, *tag_cap)
        self.bad_frees = self.raw(0)["num_bad_frees"]
        self.records = core.live_records()

    def teardown(self) -> None:
        self.sd.standin_clear_faults()
        for b in list(self.live.values()):
            core.free(b.ptr)
        for s_ in STREAMS:
            core.forget_stream(s_)
        for d, m in self.dev.items():
            core.set_cache(d, 0)  # empties it
            if m.foreign:
                self.sd.standin_add_foreign(d, -m.foreign)
            self.sd.standin_set_capacity(d, TOTAL)
            self.sd.standin_sync_all(d)
            core.set_limit(d, 0)
            for t in TAGS:
                core.set_tag_limit(d, t, 0)

    # ---- helpers ----
    @staticmethod
    def raw(d: int) -> dict:
        rc, s = core.stats(d)
        assert rc == Status.OK
        return s

    def live_bytes(self, d: int) -> int:
        return sum(b.size for b in self.live.values() if b.dev == d)

    def used(self, d: int) -> int:
        """The ledger: live and cached bytes (a cached block stays on the budget)."""
        return self.dev[d].base_used + self.live_bytes(d) + self.dev[d].cached()

    def tag_used(self, d: int, t: int) -> int:
        m = self.dev[d]
        return m.base_tag[t] + sum(b.size for b in self.live.values() if b.dev == d and b.tag == t)

    def others(self, d: int) -> int:
        m = self.dev[d]
        return m.base_others + m.foreign + sum(m.pending.values())

    def pool_used(self, d: int) -> int:
        m = self.dev[d]
        return m.base_pool + self.live_bytes(d) + m.cached() + m.foreign + sum(m.pending.values())

    def sync(self, d: int, stream: int) -> None:
        m = self.dev[d]
        if stream == NULL_STREAM:
            m.pending.clear()
        else:
            m.pending.pop(stream, None)

    def release(self, d: int, size: int, stream: int) -> None:
        """The driver free of a block (release_block): queued on its stream."""
        m = self.dev[d]
        if self.free_fault:
            # the driver refused the free: the core frees on the legacy stream
            # instead (handle 1: after every blocking stream), with no host wait
            self.free_fault = False
            m.num_driver_errors += 1
            stream = LEGACY_STREAM
        m.pending[stream] = m.pending.get(stream, 0) + size

    def flush_cache(self, d: int) -> None:
        m = self.dev[d]
        for (stream, size), ptrs in m.cache.items():
            for _ in ptrs:
                self.release(d, size, stream)
        m.cache.clear()
        m.order.clear()

    def evict_oldest(self, d: int, large: bool) -> bool:
        """The tier's least recently cached block goes back to the pool on its
        stream; False when the tier is empty."""
        m = self.dev[d]
        e = next((e for e in m.order if (e[1] > CACHE_SMALL_MAX) == large), None)
        if e is None:
            return False
        m.order.remove(e)
        stream, size, ptr = e
        ptrs = m.cache[(stream, size)]
        ptrs.remove(ptr)
        if not ptrs:
            del m.cache[(stream, size)]
        self.release(d, size, stream)
        return True

    def cache_cap(self, d: int, large: bool, live: int) -> int:
        m = self.dev[d]
        room = max(0, m.cache_limit - m.tier_bytes(not large))
        if large:
            return min(room, CACHE_LARGE_CAP)
        return min(room, max(CACHE_FLOOR, live * CACHE_FRACTION_Q16 >> 16))

    def cache_put(self, b: Block) -> bool:
        """Whether bridge_free keeps the block in the cache (and keep it)."""
        m = self.dev[b.dev]
        if b.recorded or not (b.stream <= 2 or b.stream in self.registered):
            return False  # user streams may die; recorded streams need the driver's order
        if not m.cache_limit or b.size > m.cache_max_block:
            return False
        live = m.base_used + self.live_bytes(b.dev)  # b already left out
        large = b.size > CACHE_SMALL_MAX
        cap = self.cache_cap(b.dev, large, live)
        room = b.size <= cap and len(m.cache.get((b.stream, b.size), [])) < CACHE_DEPTH
        n = 0  # the block's own tier only: the other keeps its blocks
        while (
            n < CACHE_EVICT_MAX
            and m.tier_bytes(large) + (b.size if room else 0) > cap
            and self.evict_oldest(b.dev, large)
        ):
            n += 1
        keep = room and m.tier_bytes(large) + b.size <= cap
        if keep:
            m.cache.setdefault((b.stream, b.size), []).append(b.ptr)
            m.order.append((b.stream, b.size, b.ptr))
        while n == CACHE_EVICT_MAX:  # a full batch: cache_trim, the small tier first
            n = 0
            for tier in (False, True):
                cap = self.cache_cap(b.dev, tier, live)
                while (
                    n < CACHE_EVICT_MAX
                    and m.tier_bytes(tier) > cap
                    and self.evict_oldest(b.dev, tier)
                ):
                    n += 1
        return keep

    def attempt(self, d: int, size: int, tag: int) -> int:
        """One try_alloc of the core, as the model sees it: the status."""
        m = self.dev[d]
        if size > TOTAL:
            return Status.OOM  # larger than the device: refused before any sum
        tcur = self.tag_used(d, tag) + size
        if m.tag_limit[tag] and tcur > m.tag_limit[tag]:
            return Status.TAG_LIMIT
        r = self.used(d) + size
        if m.limit and (r > m.limit or self.others(d) > m.limit - r):
            return Status.BUDGET
        # the check passed: the device's peak sees the reservation even if the driver
        # refuses; the tag's (torch's max_memory_allocated) only a block it granted
        assert not m.limit or r <= m.limit
        m.peak = max(m.peak, r)
        if self.alloc_fault:
            code, self.alloc_fault = self.alloc_fault, 0
            return Status.OOM if code == DRIVER_OOM else Status.DRIVER
        if self.pool_used(d) + size > m.capacity:
            return Status.OOM
        m.tag_peak[tag] = max(m.tag_peak[tag], tcur)
        return Status.OK

    # ---- rules ----
    # Hypothesis picks rules evenly: allocations and frees get several rules
    # so that most steps move bytes.
    @rule(target=blocks, d=devices, size=sizes, tag=tags, stream=streams)
    def allocate(self, d: int, size: int, tag: int, stream: int) -> object:
        return self.alloc(d, size, tag, stream)

    @rule(target=blocks, d=devices, size=small_sizes, tag=tags, stream=cache_streams)
    def allocate_small(self, d: int, size: int, tag: int, stream: int) -> object:
        return self.alloc(d, size, tag, stream)

    @rule(target=blocks, size=small_sizes, tag=tags, stream=cache_streams)
    def allocate_small_on_0(self, size: int, tag: int, stream: int) -> object:
        return self.alloc(0, size, tag, stream)

    def alloc(self, d: int, size: int, tag: int, stream: int) -> object:
        m = self.dev[d]
        rc, ptr = core.alloc(d, size, stream, tag)
        if size == 0:
            assert (rc, ptr) == (Status.OK, 0)
            return multiple()
        cached = m.cache.get((stream, size))
        if cached:
            # a block of this size freed on this stream: served again, already
            # on the ledger, unless the framework's cap refuses it (then it
            # goes back to the driver and the request takes the usual path)
            hit = cached.pop()
            m.order.remove((stream, size, hit))
            if not cached:
                del m.cache[(stream, size)]
            tcur = self.tag_used(d, tag) + size
            if not m.tag_limit[tag] or tcur <= m.tag_limit[tag]:
                assert (rc, ptr) == (Status.OK, hit), "the cached block was not served"
                m.tag_peak[tag] = max(m.tag_peak[tag], tcur)
                m.num_allocs += 1
                m.tag_allocs[tag] += 1
                m.tag_allocated[tag] += size
                b = Block(ptr, d, tag, size, stream)
                self.live[ptr] = b
                return b
            self.release(d, size, stream)
        want = self.attempt(d, size, tag)
        retried = False
        if want in (Status.BUDGET, Status.OOM):
            # the core returns the cache to the driver, syncs the stream and
            # the legacy stream (queued frees land: the legacy stream waits for
            # every blocking stream, which every stream of this model is) and
            # tries once more
            self.flush_cache(d)
            self.sync(d, NULL_STREAM)
            want = self.attempt(d, size, tag)
            retried = True
        assert rc == want, f"alloc({size}) on device {d}: {Status(rc).name}, model {want.name}"
        if rc != Status.OK:
            assert ptr == 0
            if rc != Status.DRIVER:  # refusals count as OOMs; driver errors do not
                m.num_ooms += 1
                m.tag_ooms[tag] += 1
            return multiple()
        assert ptr != 0 and ptr not in self.live
        if m.limit:
            assert self.used(d) + size <= m.limit, "the budget let the ledger pass it"
        assert ptr not in {p for ptrs in m.cache.values() for p in ptrs}
        m.num_allocs += 1
        m.num_retries += retried
        m.tag_allocs[tag] += 1
        m.tag_allocated[tag] += size
        b = Block(ptr, d, tag, size, stream)
        self.live[ptr] = b
        return b

    @rule(target=freed, b=consumes(blocks))
    def free(self, b: Block) -> int:
        return self.free_block(b)

    @rule(target=freed, b=consumes(blocks))
    def free_another(self, b: Block) -> int:
        return self.free_block(b)

    def free_block(self, b: Block) -> int:
        m = self.dev[b.dev]
        core.free(b.ptr)
        del self.live[b.ptr]
        m.num_frees += 1
        m.tag_frees[b.tag] += 1
        m.tag_freed[b.tag] += b.size
        if not self.cache_put(b):
            self.release(b.dev, b.size, self.free_stream(b))
        return b.ptr

    def free_stream(self, b: Block) -> int:
        """Where the core issues a block's free: its own stream when it can prove
        that stream alive (default streams, registered ones, CuPy's blocks, which
        hold their stream), else the legacy stream (issue 30, item 4)."""
        alive = b.stream <= 2 or b.stream in self.registered or b.tag == core.TAG_CUPY
        return b.stream if alive else LEGACY_STREAM

    # Misuse and inspection: one rule per kind of pointer, the call drawn.
    @rule(ptr=freed, what=st.sampled_from(["free", "record", "lookup"]), stream=streams)
    def use_a_freed_pointer(self, ptr: int, what: str, stream: int) -> None:
        if what == "free":
            self._double_free(ptr)
        elif what == "record":
            self._record_stream_freed(ptr, stream)
        else:
            self._lookup_freed(ptr)

    @rule(
        b=blocks,
        what=st.sampled_from(["record", "lookup", "inside"]),
        stream=streams,
        offset=st.integers(1, 511),
    )  # blocks lie >= 1024 bytes apart
    def use_a_live_block(self, b: Block, what: str, stream: int, offset: int) -> None:
        if what == "record":
            self._record_stream(b, stream)
        elif what == "lookup":
            self._lookup(b)
        else:
            self._free_inside_a_block(b, offset)

    @rule(ptr=st.one_of(st.just(0), st.integers(2, 2**64 - 1)))
    def free_a_foreign_pointer(self, ptr: int) -> None:
        if ptr == 0:
            self._free_null()
        else:
            self._free_unknown(ptr)

    # Everything else that changes the setting: one rule, the change drawn.
    @rule(data=st.data())
    def configure(self, data: st.DataObject) -> None:
        op = data.draw(
            st.sampled_from(
                [
                    "limit",
                    "tag_limit",
                    "others",
                    "capacity",
                    "sync",
                    "trim",
                    "cache",
                    "register_stream",
                    "reset_peak",
                    "fail_alloc",
                    "fail_free",
                ]
            ),
            label="op",
        )
        if op == "limit":
            self._set_limit(data.draw(devices), data.draw(limits))
        elif op == "tag_limit":
            self._set_tag_limit(data.draw(devices), data.draw(tags), data.draw(limits))
        elif op == "others":
            self._others_in_the_pool(data.draw(devices), data)
        elif op == "capacity":
            self._device_capacity(
                data.draw(devices), data.draw(st.sampled_from([TOTAL, 8 * MIB, 2 * MIB]))
            )
        elif op == "sync":
            self._synchronize_device(data.draw(devices))
        elif op == "trim":
            self._trim(data.draw(devices))
        elif op == "cache" and not self.free_fault:  # a flush's order of frees is not modelled
            self._set_cache(
                data.draw(devices),
                data.draw(st.sampled_from([0, 64 * KIB, MIB, GIB])),
                data.draw(st.sampled_from([8 * KIB, MAX_BLOCK])),
            )
        elif op == "register_stream":
            self._register_stream(data.draw(st.sampled_from(STREAMS[1:])), data.draw(st.booleans()))
        elif op == "reset_peak":
            self._reset_peak(data.draw(devices), data.draw(st.sampled_from((-1, *TAGS))))
        elif op == "fail_alloc" and not self.alloc_fault:
            self._fail_next_driver_alloc(data.draw(st.sampled_from([DRIVER_OOM, DRIVER_UNKNOWN])))
        elif (
            op == "fail_free"
            and not self.free_fault
            and not self.alloc_fault
            and not any(m.cache_limit or m.cache for m in self.dev.values())
        ):
            self._fail_next_driver_free()

    # ---- the calls behind the rules above ----
    def _double_free(self, ptr: int) -> None:
        if ptr in self.live:
            return  # the cache served it again: no longer a freed pointer
        core.free(ptr)  # cached or gone: either way not the caller's to free
        self.bad_frees += 1

    def _free_unknown(self, ptr: int) -> None:
        if ptr in self.live:
            return
        core.free(ptr)
        self.bad_frees += 1

    def _free_inside_a_block(self, b: Block, offset: int) -> None:
        if b.ptr + offset in self.live:
            return
        core.free(b.ptr + offset)
        self.bad_frees += 1

    def _free_null(self) -> None:
        core.free(0)  # a no-op, not a bad free

    def _record_stream(self, b: Block, stream: int) -> None:
        assert core.record_stream(b.ptr, stream) == Status.OK
        b.recorded |= stream != b.stream

    def _record_stream_freed(self, ptr: int, stream: int) -> None:
        if ptr not in self.live:
            assert core.record_stream(ptr, stream) == Status.INVALID

    def _lookup(self, b: Block) -> None:
        assert core.lookup(b.ptr) == (Status.OK, b.size, b.dev, b.tag)

    def _lookup_freed(self, ptr: int) -> None:
        if ptr not in self.live:
            assert core.lookup(ptr)[0] == Status.INVALID

    def _set_limit(self, d: int, limit: int) -> None:
        assert core.set_limit(d, limit) == Status.OK
        self.dev[d].limit = limit

    def _set_tag_limit(self, d: int, tag: int, limit: int) -> None:
        assert core.set_tag_limit(d, tag, limit) == Status.OK
        self.dev[d].tag_limit[tag] = limit

    def _others_in_the_pool(self, d: int, data: st.DataObject) -> None:
        m = self.dev[d]
        delta = data.draw(st.integers(-m.foreign, 2 * MIB))
        self.sd.standin_add_foreign(d, delta)
        m.foreign += delta

    def _device_capacity(self, d: int, capacity: int) -> None:
        self.sd.standin_set_capacity(d, capacity)
        self.dev[d].capacity = capacity

    def _synchronize_device(self, d: int) -> None:
        self.sd.standin_sync_all(d)
        self.sync(d, NULL_STREAM)

    def _trim(self, d: int) -> None:
        assert core.trim(d, 0) == Status.OK  # empties the cache, synchronizes the device
        self.flush_cache(d)
        self.sync(d, NULL_STREAM)

    def _set_cache(self, d: int, limit: int, max_block: int) -> None:
        assert core.set_cache(d, limit, max_block) == Status.OK
        m = self.dev[d]
        m.cache_limit, m.cache_max_block = limit, max_block
        if not limit:
            self.flush_cache(d)  # off: emptied

    def _register_stream(self, stream: int, on: bool) -> None:
        if on:
            assert core.register_stream(stream) == Status.OK
            self.registered.add(stream)
        else:
            # forgotten: its cached blocks go back to the pool on it
            assert core.forget_stream(stream) == Status.OK
            self.registered.discard(stream)
            for d in DEVICES:
                m = self.dev[d]
                for key in [k for k in m.cache if k[0] == stream]:
                    for _ in m.cache.pop(key):
                        self.release(d, key[1], stream)
                m.order = [e for e in m.order if e[0] != stream]

    def _reset_peak(self, d: int, tag: int) -> None:
        assert core.reset_peak(d, tag) == Status.OK
        m = self.dev[d]
        for t in TAGS:
            if tag in (-1, t):
                m.tag_peak[t] = self.tag_used(d, t)
        if tag == -1:
            m.peak = self.used(d)

    def _fail_next_driver_alloc(self, code: int) -> None:
        self.sd.standin_fail(b"cuMemAllocFromPoolAsync", code, 1)
        self.alloc_fault = code

    def _fail_next_driver_free(self) -> None:
        self.sd.standin_fail(b"cuMemFreeAsync", DRIVER_UNKNOWN, 1)
        self.free_fault = True

    # ---- invariants ----
    @invariant()
    def figures_match_the_model(self) -> None:
        if not self.dev:
            return
        for d, m in self.dev.items():
            s = self.raw(d)
            used = self.used(d)
            assert s["used"] == used, f"device {d}: ledger {s['used']}, model {used}"
            assert s["cached"] == m.cached()
            assert s["cache_limit"] == m.cache_limit
            assert s["peak_used"] == m.peak >= used
            for t in TAGS:
                ts = s["tags"][t]
                assert ts["current"] == self.tag_used(d, t), f"device {d} tag {t}"
                assert ts["peak"] == m.tag_peak[t] >= ts["current"]
                assert ts["num_allocs"] == m.tag_allocs[t]
                assert ts["num_frees"] == m.tag_frees[t]
                assert ts["allocated"] == m.tag_allocated[t]
                assert ts["freed"] == m.tag_freed[t]
                assert ts["num_ooms"] == m.tag_ooms[t]
                assert ts["limit"] == m.tag_limit[t]
                # live blocks (what torch's allocation.current reads): never reset
                live = sum(1 for b in self.live.values() if b.dev == d and b.tag == t)
                assert ts["count"] == m.base_count[t] + live, f"device {d} tag {t}"
                assert ts["count_peak"] >= ts["count"]
            assert s["limit"] == m.limit
            assert (s["num_allocs"], s["num_frees"]) == (m.num_allocs, m.num_frees)
            assert (s["num_ooms"], s["num_retries"]) == (m.num_ooms, m.num_retries)
            assert s["num_driver_errors"] == m.num_driver_errors
            assert s["pool_used"] == self.pool_used(d)
            assert core.others(d) == (Status.OK, self.others(d))
        assert self.raw(0)["num_bad_frees"] == self.bad_frees
        assert core.live_records() == self.records + len(self.live)


def test_ledger_matches_the_model(standin: ctypes.CDLL) -> None:
    """Random call sequences keep the ledger exact and under the budget."""
    standin.standin_set_capacity.argtypes = [ctypes.c_int, ctypes.c_uint64]
    standin.standin_add_foreign.argtypes = [ctypes.c_int, ctypes.c_int64]
    LedgerMachine.standin = standin
    run_state_machine_as_test(
        LedgerMachine,
        settings=settings(
            # BRIDGE_PROPERTY_EXAMPLES=2000 for a longer search
            max_examples=int(os.environ.get("BRIDGE_PROPERTY_EXAMPLES", "100")),
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
            database=None,
        ),
    )


@pytest.mark.parametrize("size", [TOTAL + 1, 2**63 - 1])
def test_requests_larger_than_the_device_change_nothing(standin: ctypes.CDLL, size: int) -> None:
    """A request no device can hold is refused as OOM before any figure moves."""
    before = LedgerMachine.raw(0)
    assert core.alloc(0, size, 0, core.TAG_TORCH) == (Status.OOM, 0)
    after = LedgerMachine.raw(0)
    assert after["used"] == before["used"]
    assert after["peak_used"] == before["peak_used"]
    assert after["tags"][core.TAG_TORCH]["current"] == before["tags"][core.TAG_TORCH]["current"]
