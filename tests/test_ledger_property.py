"""The ledger against a model, over random sequences of calls (hypothesis).

A ``RuleBasedStateMachine`` drives ``bridge._runtime.core`` on the stand-in
driver with allocations, frees, double frees, unknown pointers, budget and
tag caps, bytes held by others in the pool, queued frees, stream syncs and
one-shot driver faults, and keeps a model of what the core must report. The
core is single-threaded here, so the model is exact: after every step each
device's ledger equals the sum of its live sizes, per tag and in all; the
peaks are exactly the highest ledger the budget checks let through; the
budget never lets the ledger pass it; every status is the one the model
predicts. The core is process-global: figures are compared with those read
at the start of each example, and each example frees what it allocated.
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
    precondition,
    rule,
    run_state_machine_as_test,
)

from bridge._errors import Status
from bridge._runtime import core

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
DEVICES = (0, 1)
TAGS = (core.TAG_OTHER, core.TAG_CUPY, core.TAG_TORCH)
NULL_STREAM = 0  # syncing it completes every queued free of the device
STREAMS = (NULL_STREAM, 0xB1000, 0xB2000)
TOTAL = 16 * GIB  # the stand-in's device memory (BRIDGE_STANDIN_TOTAL unset)
DRIVER_UNKNOWN = 999  # a driver error that is not out-of-memory
DRIVER_OOM = 2

sizes = st.one_of(
    st.integers(1, 64 * KIB),
    st.integers(64 * KIB, 3 * MIB),
    st.sampled_from([0, 1, MIB, 4 * MIB, TOTAL, TOTAL + 1, 2**40, 2**63 - 1]),
)
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
        self.dev: dict[int, Dev] = {}

    # ---- set-up and tear-down of one example ----
    @initialize()
    def start(self) -> None:
        self.sd.standin_clear_faults()
        for d in DEVICES:
            self.sd.standin_sync_all(d)
            self.sd.standin_set_capacity(d, TOTAL)
            assert core.set_limit(d, 0) == Status.OK
            for t in TAGS:
                assert core.set_tag_limit(d, t, 0) == Status.OK
            assert core.reset_peak(d, -1) == Status.OK
            assert core.reset_accumulated(d, -1) == Status.OK
            s = self.raw(d)
            used = s["used"]
            tag_cur = [t["current"] for t in s["tags"]]
            rc, base_others = core.others(d)
            assert rc == Status.OK
            self.dev[d] = Dev(base_used=used, base_tag=tag_cur, base_pool=s["pool_used"],
                              base_others=base_others, peak=used, tag_peak=list(tag_cur))
            d_ = self.dev[d]
            d_.num_allocs, d_.num_frees = s["num_allocs"], s["num_frees"]
            d_.num_ooms, d_.num_retries = s["num_ooms"], s["num_retries"]
            d_.num_driver_errors = s["num_driver_errors"]
        self.bad_frees = self.raw(0)["num_bad_frees"]
        self.records = core.live_records()

    def teardown(self) -> None:
        self.sd.standin_clear_faults()
        for b in list(self.live.values()):
            core.free(b.ptr)
        for d, m in self.dev.items():
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

    def used(self, d: int) -> int:
        return self.dev[d].base_used + sum(b.size for b in self.live.values() if b.dev == d)

    def tag_used(self, d: int, t: int) -> int:
        m = self.dev[d]
        return m.base_tag[t] + sum(b.size for b in self.live.values() if b.dev == d and b.tag == t)

    def others(self, d: int) -> int:
        m = self.dev[d]
        return m.base_others + m.foreign + sum(m.pending.values())

    def pool_used(self, d: int) -> int:
        m = self.dev[d]
        live = sum(b.size for b in self.live.values() if b.dev == d)
        return m.base_pool + live + m.foreign + sum(m.pending.values())

    def sync(self, d: int, stream: int) -> None:
        m = self.dev[d]
        if stream == NULL_STREAM:
            m.pending.clear()
        else:
            m.pending.pop(stream, None)

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
        # the check passed: the peaks see the reservation even if the driver refuses
        assert not m.limit or r <= m.limit
        m.peak = max(m.peak, r)
        m.tag_peak[tag] = max(m.tag_peak[tag], tcur)
        if self.alloc_fault:
            code, self.alloc_fault = self.alloc_fault, 0
            return Status.OOM if code == DRIVER_OOM else Status.DRIVER
        if self.pool_used(d) + size > m.capacity:
            return Status.OOM
        return Status.OK

    # ---- rules ----
    @rule(target=blocks, d=devices, size=sizes, tag=tags, stream=streams)
    def allocate(self, d: int, size: int, tag: int, stream: int) -> object:
        m = self.dev[d]
        rc, ptr = core.alloc(d, size, stream, tag)
        if size == 0:
            assert (rc, ptr) == (Status.OK, 0)
            return multiple()
        want = self.attempt(d, size, tag)
        retried = False
        if want in (Status.BUDGET, Status.OOM):
            # the core syncs the stream (queued frees land) and tries once more
            self.sync(d, stream)
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
        m.num_allocs += 1
        m.num_retries += retried
        m.tag_allocs[tag] += 1
        m.tag_allocated[tag] += size
        b = Block(ptr, d, tag, size, stream)
        self.live[ptr] = b
        return b

    @rule(target=freed, b=consumes(blocks))
    def free(self, b: Block) -> int:
        m = self.dev[b.dev]
        core.free(b.ptr)
        del self.live[b.ptr]
        m.num_frees += 1
        m.tag_frees[b.tag] += 1
        m.tag_freed[b.tag] += b.size
        if self.free_fault:
            # the driver refused the free: the core syncs the device and frees
            # on the legacy stream instead
            self.free_fault = False
            m.num_driver_errors += 1
            m.pending.clear()
            m.pending[NULL_STREAM] = b.size
        else:
            m.pending[b.stream] = m.pending.get(b.stream, 0) + b.size
        return b.ptr

    @rule(ptr=freed)
    def double_free(self, ptr: int) -> None:
        core.free(ptr)
        self.bad_frees += 1

    @rule(ptr=st.integers(2, 2**64 - 1))
    def free_unknown(self, ptr: int) -> None:
        if ptr in self.live:
            return
        core.free(ptr)
        self.bad_frees += 1

    @rule(b=blocks, offset=st.integers(1, 511))  # blocks lie >= 1024 bytes apart
    def free_inside_a_block(self, b: Block, offset: int) -> None:
        if b.ptr + offset in self.live:
            return
        core.free(b.ptr + offset)
        self.bad_frees += 1

    @rule()
    def free_null(self) -> None:
        core.free(0)  # a no-op, not a bad free

    @rule(b=blocks, stream=streams)
    def record_stream(self, b: Block, stream: int) -> None:
        assert core.record_stream(b.ptr, stream) == Status.OK

    @rule(ptr=freed, stream=streams)
    def record_stream_freed(self, ptr: int, stream: int) -> None:
        assert core.record_stream(ptr, stream) == Status.INVALID

    @rule(b=blocks)
    def lookup(self, b: Block) -> None:
        assert core.lookup(b.ptr) == (Status.OK, b.size, b.dev, b.tag)

    @rule(ptr=freed)
    def lookup_freed(self, ptr: int) -> None:
        assert core.lookup(ptr)[0] == Status.INVALID

    @rule(d=devices, limit=limits)
    def set_limit(self, d: int, limit: int) -> None:
        assert core.set_limit(d, limit) == Status.OK
        self.dev[d].limit = limit

    @rule(d=devices, tag=tags, limit=limits)
    def set_tag_limit(self, d: int, tag: int, limit: int) -> None:
        assert core.set_tag_limit(d, tag, limit) == Status.OK
        self.dev[d].tag_limit[tag] = limit

    @rule(d=devices, data=st.data())
    def others_in_the_pool(self, d: int, data: st.DataObject) -> None:
        m = self.dev[d]
        delta = data.draw(st.integers(-m.foreign, 2 * MIB))
        self.sd.standin_add_foreign(d, delta)
        m.foreign += delta

    @rule(d=devices, capacity=st.sampled_from([TOTAL, 8 * MIB, 2 * MIB]))
    def device_capacity(self, d: int, capacity: int) -> None:
        self.sd.standin_set_capacity(d, capacity)
        self.dev[d].capacity = capacity

    @rule(d=devices)
    def synchronize_device(self, d: int) -> None:
        self.sd.standin_sync_all(d)
        self.sync(d, NULL_STREAM)

    @rule(d=devices)
    def trim(self, d: int) -> None:
        assert core.trim(d, 0) == Status.OK  # synchronizes the device first
        self.sync(d, NULL_STREAM)

    @rule(d=devices, tag=st.sampled_from((-1, *TAGS)))
    def reset_peak(self, d: int, tag: int) -> None:
        assert core.reset_peak(d, tag) == Status.OK
        m = self.dev[d]
        for t in TAGS:
            if tag in (-1, t):
                m.tag_peak[t] = self.tag_used(d, t)
        if tag == -1:
            m.peak = self.used(d)

    @precondition(lambda self: not self.alloc_fault)
    @rule(code=st.sampled_from([DRIVER_OOM, DRIVER_UNKNOWN]))
    def fail_next_driver_alloc(self, code: int) -> None:
        self.sd.standin_fail(b"cuMemAllocFromPoolAsync", code, 1)
        self.alloc_fault = code

    @precondition(lambda self: not self.free_fault and not self.alloc_fault)
    @rule()
    def fail_next_driver_free(self) -> None:
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
            assert s["used"] == used, f"device {d}: ledger {s['used']}, live bytes {used}"
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
            stateful_step_count=40,
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
