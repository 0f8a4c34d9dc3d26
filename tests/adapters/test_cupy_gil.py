# SPDX-License-Identifier: Apache-2.0
"""CuPy's allocations and frees keep the GIL on the cache (issue #20 item 3), on the stand-in.

bridge._core.CupyAllocator asks the core's cache of freed blocks first, with
the GIL held (bridge_alloc_cached); only a miss releases the GIL around
bridge_alloc.  ``num_gil_releases`` counts the calls that released it.  A
Block's free (the CuPy block's owner) likewise goes into the cache with the
GIL held when that needs no driver call (bridge_free_cached), and releases it
around bridge_free otherwise; ``core.block_gil_releases()`` counts those.
CuPy's types are stood in for as in tests/core/test_wait.py.
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
USER = 0xC2000  # a user's stream (cupy.cuda.Stream): short-lived unless registered
DRIVER_ALLOC, DRIVER_FREE = 0, 1  # the stand-in's counters


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
def cache(led):  # the shared one (conftest.py), with the capture stream adopted
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
    header = pathlib.Path(__file__).parents[2] / "bridge" / "_native" / "bridge.h"
    enum = re.search(
        r"typedef enum bridge_status \{(.*?)\} bridge_status;", header.read_text(), re.S
    )
    assert enum
    codes = {
        ("OK" if name == "OK" else name[2:]): int(value)
        for name, value in re.findall(r"BRIDGE_(OK|E_\w+)\s*=\s*(\d+)", enum.group(1))
    }
    assert codes == {s.name: s.value for s in Status}


# ---- the free half: Block's dealloc (bridge_free_cached, then bridge_free) ----


def releases() -> int:
    return core.block_gil_releases()


def test_an_alloc_free_pair_keeps_the_gil_on_both_halves_after_the_first_miss(cache):
    alloc, failures = make_allocator()
    f0 = releases()
    mem = alloc(2 * MIB)  # the first allocation: a miss, without the GIL
    p = mem[0]
    assert alloc.num_gil_releases == 1
    allocs, frees = cache.counter(DRIVER_ALLOC), cache.counter(DRIVER_FREE)
    del mem  # into the cache with the GIL held
    assert releases() == f0
    assert stats()["cached"] == 2 * MIB
    for _ in range(5):
        mem = alloc(2 * MIB)
        assert mem[0] == p
        del mem
    assert alloc.num_gil_releases == 1 and releases() == f0  # neither half released it
    assert cache.counter(DRIVER_ALLOC) == allocs and cache.counter(DRIVER_FREE) == frees
    s = stats()
    assert s["cached"] == 2 * MIB and s["tags"][TAG_CUPY]["current"] == 0
    assert s["tags"][TAG_CUPY]["num_frees"] == 6 and s["tags"][TAG_CUPY]["freed"] == 12 * MIB
    assert failures == []


def test_a_block_of_the_module_frees_into_the_cache_with_the_gil_kept(cache):
    f0 = releases()
    rc, block = core.alloc_block(DEV, MIB, DEFAULT, TAG_CUPY)
    assert rc == Status.OK and block is not None
    p = block.ptr
    del block
    assert releases() == f0 and stats()["cached"] == MIB
    assert core.alloc_cached(DEV, MIB, DEFAULT, TAG_CUPY) == (Status.OK, p)
    core.free(p)


# The cache has two tiers (blocks of at most 1 MiB under the cap that follows the
# live bytes, larger ones under a fixed cap), each evicting only its own oldest
# blocks: the no-evict free is judged against its block's tier.  (size, the
# other tier's size, the tier's stats key, how the tier is capped at 4 x size)
TIERS = {
    "small": (512 * 1024, 2 * MIB, "cached_small", lambda: core.set_cache_fraction(DEV, 0, MIB)),
    "large": (2 * MIB, 512 * 1024, "cached_large", lambda: core.set_cache_tiers(DEV, MIB, 4 * MIB)),
}


@pytest.mark.parametrize("tier", sorted(TIERS))
def test_a_free_that_would_evict_releases_the_gil(cache, tier):
    """The block's tier is full: the core declines (no eviction in that tier, nothing
    changed); bridge_free then evicts that tier's oldest block, never the other
    tier's, though a block of the other tier is the oldest cached of all."""
    size, other_size, key, cap_tier = TIERS[tier]
    cap_tier()  # room for two blocks of `size` in their tier
    alloc, _ = make_allocator()
    other = alloc(other_size)
    others = other[0]
    mems = [alloc(size) for _ in range(3)]
    oldest = mems[0][0]
    late = alloc(other_size)  # freed once the tier is full
    f0, frees = releases(), cache.counter(DRIVER_FREE)
    del other  # the oldest block cached, in the other tier
    del mems[0]
    del mems[0]
    assert releases() == f0 and stats()[key] == 2 * size  # both fit: the GIL kept
    assert cache.counter(DRIVER_FREE) == frees
    # the core alone declines and changes nothing
    p = mems[0][0]
    assert core.free_cached(p) == Status.MISS
    assert core.lookup(p)[0] == Status.OK  # still live
    assert stats()["tags"][TAG_CUPY]["current"] == size + other_size
    # the other tier has room: its block frees into the cache with the GIL kept
    del late
    assert releases() == f0 and stats()["cached"] == 2 * size + 2 * other_size
    del mems[0]  # the tier is full: bridge_free evicts its oldest, without the GIL
    assert releases() == f0 + 1
    assert cache.counter(DRIVER_FREE) == frees + 1
    assert stats()[key] == 2 * size and stats()["cached"] == 2 * size + 2 * other_size
    # the newest is served again; the tier's oldest went back to the pool
    assert core.alloc_cached(DEV, size, DEFAULT, TAG_CUPY) == (Status.OK, p)
    rc, q = core.alloc_cached(DEV, size, DEFAULT, TAG_CUPY)
    assert rc == Status.OK and q not in (p, oldest)
    # the other tier's blocks stayed, the oldest of all among them
    rc, r = core.alloc_cached(DEV, other_size, DEFAULT, TAG_CUPY)
    rc2, o = core.alloc_cached(DEV, other_size, DEFAULT, TAG_CUPY)
    assert rc == rc2 == Status.OK and o == others
    for x in (p, q, r, o):
        core.free(x)


def test_the_limit_bounds_both_tiers_for_a_free_with_the_gil_kept(cache):
    """The limit holds both tiers together: with a 2 MiB block in the large tier and
    a 4 MiB limit, the small tier has 2 MiB of room.  A small block past it is a
    miss for the core; bridge_free evicts the small tier's oldest, and the large
    block (the oldest of all) stays."""
    core.set_cache(DEV, 4 * MIB)
    alloc, _ = make_allocator()
    big = alloc(2 * MIB)
    b = big[0]
    mems = [alloc(MIB) for _ in range(3)]
    oldest = mems[0][0]
    f0, frees = releases(), cache.counter(DRIVER_FREE)
    del big
    del mems[0]
    del mems[0]
    s = stats()
    assert releases() == f0 and (s["cached_small"], s["cached_large"]) == (2 * MIB, 2 * MIB)
    p = mems[0][0]
    assert core.free_cached(p) == Status.MISS  # 2 + 2 + 1 MiB would pass the limit
    assert core.lookup(p)[0] == Status.OK
    del mems[0]
    assert releases() == f0 + 1 and cache.counter(DRIVER_FREE) == frees + 1
    s = stats()
    assert (s["cached_small"], s["cached_large"]) == (2 * MIB, 2 * MIB)
    assert core.alloc_cached(DEV, MIB, DEFAULT, TAG_CUPY) == (Status.OK, p)
    rc, q = core.alloc_cached(DEV, MIB, DEFAULT, TAG_CUPY)
    assert rc == Status.OK and q not in (p, oldest)
    assert core.alloc_cached(DEV, 2 * MIB, DEFAULT, TAG_CUPY) == (Status.OK, b)
    for x in (p, q, b):
        core.free(x)


def test_a_free_is_judged_by_the_tier_of_its_size_when_it_is_freed(cache):
    """The boundary moved after the block was allocated: the free goes to the tier
    its size falls in now (a 2 MiB block with small_max 4 MiB is small), so the
    large tier's cap (here 0: nothing large is kept) does not decline it."""
    core.set_cache_tiers(DEV, 4 * MIB, 0)
    alloc, _ = make_allocator()
    mem = alloc(2 * MIB)
    p = mem[0]
    f0 = releases()
    del mem
    s = stats()
    assert releases() == f0 and (s["cached_small"], s["cached_large"]) == (2 * MIB, 0)
    core.set_cache_tiers(DEV, MIB, 0)  # now 2 MiB is large: the cached block stays small
    mem = alloc(2 * MIB)
    assert mem[0] == p
    del mem  # the large tier keeps nothing: a miss, bridge_free hands it back
    assert releases() == f0 + 1 and stats()["cached"] == 0


def test_a_free_during_a_capture_releases_the_gil(cache):
    alloc, _ = make_allocator()
    cap_alloc, _ = make_allocator(stream=CAP)
    mem = alloc(MIB)
    f0 = releases()
    assert core.capture(True, DEV) == Status.OK
    cache.sd.standin_set_capturing(CAP)
    try:
        captured = cap_alloc(MIB)
        p = mem[0]
        assert core.free_cached(p) == Status.MISS  # any capture on the device: a miss
        del mem  # not the captured stream: bridge_free caches it as before
        assert releases() == f0 + 1 and stats()["cached"] == MIB
        del captured  # the captured stream's block: held back until the capture ends
        assert releases() == f0 + 2 and stats()["num_deferred"] == 1
    finally:
        cache.sd.standin_set_capturing(None)
        assert core.capture(False, DEV) == Status.OK
    assert stats()["num_deferred"] == 0


def test_a_free_with_deferred_frees_pending_releases_the_gil(cache):
    alloc, _ = make_allocator()
    mem = alloc(MIB)
    assert core.capture(True, DEV) == Status.OK
    cache.sd.standin_set_capturing(CAP)
    try:
        rc, c = core.alloc(DEV, MIB, CAP, TAG_CUPY)
        assert rc == Status.OK
        core.free(c)  # deferred
        # the capture ends for the core, but CAP still reports one (another
        # capture began on it): the deferred free stays pending
        assert core.capture(False, DEV) == Status.OK
        assert stats()["num_deferred"] == 1
        f0 = releases()
        p = mem[0]
        assert core.free_cached(p) == Status.MISS  # completing them makes driver calls
        del mem
        assert releases() == f0 + 1 and stats()["cached"] == MIB
    finally:
        cache.sd.standin_set_capturing(None)
    rc, q = core.alloc(DEV, MIB, DEFAULT, TAG_CUPY)  # completes the deferred free
    assert rc == Status.OK and q == p
    assert stats()["num_deferred"] == 0
    core.free(q)


def test_a_free_of_an_uncached_tag_releases_the_gil(cache):
    alloc, _ = make_allocator()
    mem = alloc(MIB)
    assert core.set_tag_cached(TAG_CUPY, False) == Status.OK
    try:
        f0, frees = releases(), cache.counter(DRIVER_FREE)
        del mem
        assert releases() == f0 + 1
        assert cache.counter(DRIVER_FREE) == frees + 1 and stats()["cached"] == 0
    finally:
        core.set_tag_cached(TAG_CUPY, True)
    mem = alloc(MIB)
    f0 = releases()
    del mem
    assert releases() == f0  # cached again: the GIL kept


def test_a_free_on_a_short_lived_stream_releases_the_gil(cache):
    cache.sd.standin_adopt_stream(USER, DEV)
    alloc, _ = make_allocator(stream=USER)
    mem = alloc(MIB)
    f0, frees = releases(), cache.counter(DRIVER_FREE)
    del mem  # the user's stream may be destroyed: the block goes to the pool
    assert releases() == f0 + 1
    assert cache.counter(DRIVER_FREE) == frees + 1 and stats()["cached"] == 0
    core.register_stream(USER)  # long-lived from now on
    try:
        mem = alloc(MIB)
        del mem
        assert releases() == f0 + 1 and stats()["cached"] == MIB
    finally:
        core.forget_stream(USER)  # its cached block back to the pool
    assert stats()["cached"] == 0


def test_a_block_with_a_recorded_stream_releases_the_gil(cache):
    cache.sd.standin_adopt_stream(USER, DEV)
    alloc, _ = make_allocator()
    mem = alloc(MIB)
    assert core.record_stream(mem[0], USER) == Status.OK
    f0 = releases()
    del mem  # its free is ordered after USER: the driver's business
    assert releases() == f0 + 1 and stats()["cached"] == 0


def test_double_frees_and_unknown_pointers_are_counted_as_before(cache):
    bad0 = stats()["num_bad_frees"]
    assert core.free_cached(0) == Status.OK  # nothing to free
    assert core.free_cached(0xDEADBEEF000) == Status.MISS  # unknown: left to bridge_free
    assert stats()["num_bad_frees"] == bad0
    core.free(0xDEADBEEF000)
    assert stats()["num_bad_frees"] == bad0 + 1
    rc, p = core.alloc(DEV, MIB, DEFAULT, TAG_CUPY)
    assert rc == Status.OK
    assert core.free_cached(p) == Status.OK and stats()["cached"] == MIB
    s0 = stats()
    assert core.free_cached(p) == Status.MISS  # a double free: nothing changes
    core.free(p)  # which bridge_free counts, as ever
    s1 = stats()
    assert s1["num_bad_frees"] == bad0 + 2
    assert s1["cached"] == s0["cached"] and s1["num_frees"] == s0["num_frees"]
    assert s1["tags"] == s0["tags"]


def test_frees_on_per_thread_default_streams_keep_the_gil(cache):
    """A block allocated on thread A's per-thread default stream is cached for
    A's stream, with the GIL kept, whichever thread frees it."""
    alloc, _ = make_allocator(stream=PER_THREAD)
    handed, again, done = threading.Event(), threading.Event(), threading.Event()
    out: dict = {}

    def thread_a():
        mem = alloc(2 * MIB)
        out["p"] = mem[0]
        f0 = releases()
        del mem  # cached for A's per-thread stream, the GIL kept
        mem = alloc(2 * MIB)  # a hit
        out["kept"] = releases() == f0 and mem[0] == out["p"]
        out["mem"] = mem  # for the main thread to free
        del mem
        handed.set()
        again.wait(30)
        mem = alloc(2 * MIB)  # what the main thread freed: cached on A's stream
        out["q"] = mem[0]
        del mem
        done.set()

    t = threading.Thread(target=thread_a)
    t.start()
    try:
        assert handed.wait(30) and out["kept"]
        f0 = releases()
        del out["mem"]  # freed on this thread: cached for A's stream, the GIL kept
        assert releases() == f0 and stats()["cached"] == 2 * MIB
        # this thread's per-thread stream is another: nothing cached for it
        assert core.alloc_cached(DEV, 2 * MIB, PER_THREAD, TAG_CUPY) == (Status.MISS, 0)
    finally:
        again.set()
        t.join(30)
    assert not t.is_alive() and done.is_set()
    assert out["q"] == out["p"]


def test_with_the_history_on_a_free_releases_the_gil_and_is_noted(cache):
    alloc, _ = make_allocator()
    mem = alloc(MIB)
    p = mem[0]
    assert core.history(True, False, 0, True) == Status.OK
    try:
        f0 = releases()
        assert core.free_cached(p) == Status.MISS  # bridge_free notes the free
        del mem
        assert releases() == f0 + 1
        events = [(e[1], e[3]) for e in core.history_events()]
        assert events == [(core.EV_FREE, p)]
    finally:
        core.history(False, False, 0, True)
