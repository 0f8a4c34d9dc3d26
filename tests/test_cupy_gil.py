# SPDX-License-Identifier: Apache-2.0
"""The CuPy allocator keeps the GIL on a cache hit (issue #20 item 3), on the stand-in.

bridge._core.CupyAllocator asks the core's cache of freed blocks first, with
the GIL held (bridge_alloc_cached); only a miss releases the GIL around
bridge_alloc.  ``num_gil_releases`` counts the calls that released it.  CuPy's
types are stood in for as in tests/test_wait.py.
"""

from __future__ import annotations

import pathlib
import re
import threading

import pytest
from ledger_util import DEV, MIB, TAG_CUPY, stats

from bridge._errors import Status
from bridge._runtime import core

DEFAULT, PER_THREAD = 0, 2  # CuPy's default stream (legacy), the per-thread one
CAP = 0xC1000  # a stream a CuPy capture runs on


class Stream:
    """CuPy's current stream: only its ``.ptr`` is read."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class Refused(MemoryError):
    pass


def make_allocator(stream: int = DEFAULT, tag: int = TAG_CUPY):
    failures: list[int] = []

    def on_failure(size, device, stream, rc):
        failures.append(rc)
        raise Refused(f"refused: {Status(rc).name}")

    alloc = core.CupyAllocator(
        lambda: DEV,
        lambda: Stream(stream),
        lambda ptr, size, owner, dev: (ptr, size, owner),  # UnownedMemory
        lambda mem, offset: mem,  # MemoryPointer
        on_failure,
        tag,
    )
    return alloc, failures


@pytest.fixture
def cache(led):
    led.sd.standin_adopt_stream(CAP, DEV)
    core.set_cache(DEV, 64 * MIB)
    yield led
    core.set_cache(DEV, 0)  # cached bytes count as used: back to the pool before led's check


def hits() -> int:
    return stats()["num_cache_hits"]


def test_a_repeated_allocation_is_served_from_the_cache_with_the_gil_kept(cache):
    alloc, failures = make_allocator()
    assert alloc.num_gil_releases == 0
    mem = alloc(2 * MIB)  # nothing cached yet: a miss, made without the GIL
    p = mem[0]
    assert alloc.num_gil_releases == 1
    del mem  # the Block dies: cached for the next 2 MiB on DEFAULT
    assert stats()["cached"] == 2 * MIB
    h0, allocs = hits(), cache.counter(0)
    for _ in range(5):
        mem = alloc(2 * MIB)
        assert mem[0] == p and mem[1] == 2 * MIB  # the same block, reused
        del mem
    assert alloc.num_gil_releases == 1  # every hit kept the GIL
    assert hits() == h0 + 5
    assert cache.counter(0) == allocs  # no driver allocation
    assert failures == []


def test_a_miss_releases_the_gil(cache):
    alloc, _ = make_allocator()
    mem = alloc(2 * MIB)
    del mem
    other = alloc(3 * MIB)  # another size: nothing cached fits
    assert alloc.num_gil_releases == 2
    core.set_cache(DEV, 0)  # no cache: every call is a miss
    del other
    for n in range(3):
        mem = alloc(MIB)
        del mem
        assert alloc.num_gil_releases == 3 + n
    assert alloc(0)[0] == 0  # 0 bytes: a null pointer, the GIL kept
    assert alloc.num_gil_releases == 5


def test_the_counter_is_read_only(cache):
    alloc, _ = make_allocator()
    with pytest.raises(AttributeError):
        alloc.num_gil_releases = 5  # type: ignore[misc]


def test_a_cache_hit_stays_under_the_budget(cache):
    core.set_limit(DEV, 4 * MIB)
    try:
        alloc, failures = make_allocator()
        mem = alloc(3 * MIB)
        del mem
        assert stats()["cached"] == 3 * MIB and stats()["used"] == 3 * MIB
        held = alloc(3 * MIB)  # the cached block: already on the ledger
        assert alloc.num_gil_releases == 1
        s = stats()
        assert s["used"] == 3 * MIB and s["peak_used"] <= 4 * MIB
        with pytest.raises(Refused):
            alloc(3 * MIB)  # past the budget: the miss path refuses it
        assert failures == [Status.BUDGET]
        assert alloc.num_gil_releases == 2
        assert stats()["used"] == 3 * MIB
        del held
    finally:
        core.set_limit(DEV, 0)


def test_a_cached_block_past_the_tag_cap_is_a_miss_and_then_refused(cache):
    alloc, failures = make_allocator()
    mem = alloc(2 * MIB)
    del mem
    core.set_tag_limit(DEV, TAG_CUPY, MIB)
    try:
        # the core alone: adopting the block fails, it goes back to the pool
        assert core.alloc_cached(DEV, 2 * MIB, DEFAULT, TAG_CUPY) == (Status.MISS, 0)
        s = stats()
        assert s["cached"] == 0 and s["tags"][TAG_CUPY]["current"] == 0
        with pytest.raises(Refused):
            alloc(2 * MIB)
        assert failures == [Status.TAG_LIMIT]
        assert alloc.num_gil_releases == 2
        assert stats()["tags"][TAG_CUPY]["current"] == 0
    finally:
        core.set_tag_limit(DEV, TAG_CUPY, 0)


def test_per_thread_default_streams_of_two_threads_never_share_a_cached_block(cache):
    """A block freed on thread A's per-thread default stream is never handed to
    thread B (handle 2 names another stream there), with the GIL kept or not."""
    alloc, _ = make_allocator(stream=PER_THREAD)
    out: dict = {}

    def thread_a():
        mem = alloc(2 * MIB)
        out["p"] = mem[0]
        del mem  # cached for A's per-thread stream
        before = alloc.num_gil_releases
        mem = alloc(2 * MIB)  # A's own stream order: a hit, the GIL kept
        out["q"], out["kept"] = mem[0], alloc.num_gil_releases == before
        del mem  # cached for A again

    t = threading.Thread(target=thread_a)
    t.start()
    t.join(30)
    assert not t.is_alive()
    assert out["q"] == out["p"] and out["kept"]
    assert stats()["cached"] == 2 * MIB
    # this thread: the core alone misses, and the allocator gets another block
    assert core.alloc_cached(DEV, 2 * MIB, PER_THREAD, TAG_CUPY) == (Status.MISS, 0)
    before = alloc.num_gil_releases
    mem = alloc(2 * MIB)
    assert mem[0] != out["p"]
    assert alloc.num_gil_releases == before + 1
    del mem


def test_no_hit_while_frees_are_deferred_by_a_capture(cache):
    alloc, _ = make_allocator()
    mem = alloc(MIB)
    p = mem[0]
    del mem  # cached on DEFAULT
    assert core.capture(True, DEV) == Status.OK  # CuPy's Stream.begin_capture
    cache.sd.standin_set_capturing(CAP)
    try:
        rc, c = core.alloc(DEV, MIB, CAP, TAG_CUPY)
        assert rc == Status.OK
        core.free(c)  # held back: the capture runs
        assert stats()["num_deferred"] == 1
        # the cache only: a miss (completing deferred frees makes driver calls)
        assert core.alloc_cached(DEV, MIB, DEFAULT, TAG_CUPY) == (Status.MISS, 0)
        before = alloc.num_gil_releases
        mem = alloc(MIB)  # so the allocator goes to bridge_alloc, the GIL released
        assert alloc.num_gil_releases == before + 1
        assert mem[0] == p  # which serves the cached block all the same
        del mem
    finally:
        cache.sd.standin_set_capturing(None)
        assert core.capture(False, DEV) == Status.OK  # the deferred free is issued
    assert stats()["num_deferred"] == 0
    before = alloc.num_gil_releases
    mem = alloc(MIB)  # no frees deferred any more: a hit with the GIL kept
    assert mem[0] == p and alloc.num_gil_releases == before
    del mem


def test_a_cache_hit_is_recorded_in_the_history(cache):
    alloc, _ = make_allocator()
    mem = alloc(MIB)
    p = mem[0]
    del mem
    assert core.history(True, False, 0, True) == Status.OK
    try:
        mem = alloc(MIB)
        assert mem[0] == p and alloc.num_gil_releases == 1  # a hit
        del mem
        events = [(e[1], e[3], e[4], e[7]) for e in core.history_events()]
        assert events == [(core.EV_ALLOC, p, MIB, TAG_CUPY), (core.EV_FREE, p, MIB, TAG_CUPY)]
        # the core alone, too
        rc, q = core.alloc_cached(DEV, MIB, DEFAULT, TAG_CUPY)
        assert rc == Status.OK and q == p
        core.free(q)
        assert len(core.history_events()) == 4
        assert core.history_events()[2][1] == core.EV_ALLOC
        # a miss notes nothing (bridge_alloc, called next, notes the allocation)
        assert core.alloc_cached(DEV, 5 * MIB, DEFAULT, TAG_CUPY) == (Status.MISS, 0)
        assert len(core.history_events()) == 4
    finally:
        core.history(False, False, 0, True)


def test_alloc_cached_edge_cases(cache):
    assert core.alloc_cached(DEV, 0, DEFAULT, TAG_CUPY) == (Status.OK, 0)
    assert core.alloc_cached(DEV, MIB, DEFAULT, core.NTAGS) == (Status.INVALID, 0)
    assert core.alloc_cached(DEV, MIB, DEFAULT, -1) == (Status.INVALID, 0)
    assert core.alloc_cached(63, MIB, DEFAULT, TAG_CUPY) == (Status.MISS, 0)  # not set up
    assert core.alloc_cached(DEV, MIB, DEFAULT, TAG_CUPY) == (Status.MISS, 0)  # nothing cached


def test_the_status_codes_of_the_core_and_python_agree():
    header = pathlib.Path(__file__).parents[1] / "bridge" / "_native" / "bridge.h"
    enum = re.search(
        r"typedef enum bridge_status \{(.*?)\} bridge_status;", header.read_text(), re.S
    )
    assert enum
    codes = {
        ("OK" if name == "OK" else name[2:]): int(value)
        for name, value in re.findall(r"BRIDGE_(OK|E_\w+)\s*=\s*(\d+)", enum.group(1))
    }
    assert codes == {s.name: s.value for s in Status}
