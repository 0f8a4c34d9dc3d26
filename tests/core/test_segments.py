# SPDX-License-Identifier: Apache-2.0
"""Segments of the pool (carve.c with the release rule; BRIDGE_CACHE_SEGMENTS=1), on the
stand-in driver.

The rules (best fit, splitting, coalescing, the segments' sizes, the release rule) are
held against the model (policy segments-core) event by event on the committed traces in
tests/benchmarks/test_model_cache.py; these tests hold what a user relies on around them:
loops that hit, driver calls, stream order, the budget with two frameworks."""

from __future__ import annotations

import threading
import time

import pytest
from ledger_util import alloc, at_budget, stats

from bridge._errors import Status
from bridge._runtime import core

MIB = 1 << 20
DEV = 0
OTHER, CUPY, TORCH = 0, 1, 2
SIDE = 0x5000  # a stream handle the stand-in accepts
C_ALLOC, C_FREE, C_WAIT, C_RECORD, C_UNORDERED = 0, 1, 3, 4, 15


@pytest.fixture
def segs(standin):
    core.set_cache(DEV, 1 << 30)
    assert core.set_cache_segments(DEV, True) == Status.OK
    live = core.live_records()
    yield standin
    assert core.live_records() == live
    assert core.set_cache_segments(DEV, False) == Status.OK
    core.set_cache(DEV, 0)
    core.forget_stream(SIDE)
    assert stats()["carve_held"] == 0


def test_segments_on_and_off_show_in_the_figures(segs):
    s = stats()
    assert (s["carve_on"], s["carve_slack"]) == (1, 1050)
    assert core.set_cache_segments(DEV, False) == Status.OK
    s = stats()
    assert (s["carve_on"], s["carve_slack"]) == (0, 0)
    assert core.set_cache_segments(DEV, True) == Status.OK
    assert core.set_cache_segments(99, True) == Status.DEVICE


@pytest.mark.parametrize(("size", "segment"), [(512, 2 * MIB), (MIB, 2 * MIB),
                                               (64 * MIB, 64 * MIB)])  # fmt: skip
def test_a_loop_of_one_size_hits_after_its_first_allocation(segs, size, segment):
    calls, hits = segs.standin_counter(C_ALLOC), stats()["num_cache_hits"]
    first = alloc(size)
    core.free(first)
    for _ in range(100):
        p = alloc(size)
        assert p == first  # the same bytes of the same segment, every time
        core.free(p)
    s = stats()
    assert segs.standin_counter(C_ALLOC) == calls + 1  # one segment, taken once
    assert s["num_cache_hits"] - hits == 100
    assert s["carve_held"] == segment and s["cached"] == segment  # kept, idle
    assert s["used"] == segment  # idle segments count in the bytes reserved


def test_an_emptied_segment_is_kept_and_the_rule_gives_back_the_first_emptied(segs):
    a = alloc(64 * MIB)
    b = alloc(64 * MIB)
    assert stats()["carve_hwm"] == 128 * MIB
    frees = segs.standin_counter(C_FREE)
    # b, the block this thread allocated last, waits in its slot (still carved) until
    # the thread's next allocation, which gives it back to its segment: a's segment
    # empties first
    core.free(b)
    core.free(a)
    assert segs.standin_counter(C_FREE) == frees and stats()["carve_held"] == 128 * MIB
    assert stats()["carve_parked"] == 64 * MIB and stats()["cached"] == 128 * MIB
    # 2 MiB segments on new streams, kept while held + 2 MiB <= 1.05 x 128 MiB
    streams = [SIDE + 0x100 * k for k in range(1, 5)]
    small = []
    for k, st in enumerate(streams):
        segs.standin_adopt_stream(st, DEV)
        core.register_stream(st)
        small.append(alloc(4096, st))
        assert segs.standin_counter(C_FREE) == frees + (k == 3)
    # 136 MiB > 134.4 MiB: a's segment went back, b's stays and serves b again
    assert stats()["carve_held"] == 64 * MIB + 4 * 2 * MIB
    assert alloc(64 * MIB) == b
    core.free(b)
    for p in small:
        core.free(p)
    for st in streams:
        core.forget_stream(st)


def test_a_segment_of_another_stream_is_never_handed_out(segs):
    segs.standin_adopt_stream(SIDE, DEV)
    core.register_stream(SIDE)
    keep = alloc(4096, SIDE)  # SIDE's segment, from its start
    p = alloc(8192, SIDE)
    core.free(p)  # a free range of SIDE's segment that would fit
    calls = segs.standin_counter(C_ALLOC)
    q = alloc(8192)  # the default stream: a segment of its own
    assert segs.standin_counter(C_ALLOC) == calls + 1
    assert not (keep <= q < keep + 2 * MIB) and stats()["carve_held"] == 4 * MIB
    core.free(q)
    assert alloc(8192, SIDE) == p  # SIDE's own segment serves SIDE again
    core.free(p)
    core.free(keep)


def test_a_piece_freed_with_a_recorded_stream_is_handed_out_after_that_streams_work(segs):
    segs.standin_adopt_stream(SIDE, DEV)
    core.register_stream(SIDE)
    keep = alloc(4096)  # keeps the segment from emptying
    p = alloc(8192)
    assert core.record_stream(p, SIDE) == Status.OK
    records, waits = segs.standin_counter(C_RECORD), segs.standin_counter(C_WAIT)
    core.free(p)
    # the segment's stream waits for SIDE's queued work (one event, one wait) before
    # its range may be carved again
    assert segs.standin_counter(C_RECORD) == records + 1
    assert segs.standin_counter(C_WAIT) == waits + 1
    assert alloc(8192) == p
    core.free(p)
    core.free(keep)


def test_two_frameworks_at_a_tight_budget_idle_segments_go_back_before_a_refusal(segs):
    # CuPy's blocks leave four empty 64 MiB segments behind, all kept
    blocks = [alloc(64 * MIB, 0, CUPY) for _ in range(4)]
    for p in blocks:
        core.free(p)
    assert stats()["carve_held"] == stats()["cached"] == 256 * MIB
    with at_budget(100 * MIB):
        retries, ooms = stats()["num_retries"], stats()["num_ooms"]
        # torch's 80 MiB: the rule gives back two of them; a segment of 80 MiB does not
        # fit the room the budget leaves beside the other two, so every empty one goes
        # back first (and the stream is synchronized, so that the frees land): the
        # request is served from a segment of its own size, with no refusal to retry
        p = alloc(80 * MIB, 0, TORCH)
        s = stats()
        assert s["carve_held"] == s["used"] == 80 * MIB and s["cached"] == 0
        assert s["tags"][TORCH]["current"] == 80 * MIB and s["tags"][CUPY]["current"] == 0
        assert (s["num_retries"], s["num_ooms"]) == (retries, ooms)
        core.free(p)
        # and a request over what is left after everything goes back is still refused
        q = alloc(90 * MIB, 0, CUPY)
        rc, r = core.alloc(DEV, 20 * MIB, 0, TORCH)
        assert rc == Status.BUDGET and not r
        core.free(q)


def test_under_a_budget_a_segment_is_larger_than_its_request_only_within_half_the_room(segs):
    # a segment's idle bytes go back only once every block of it is freed: 40 MiB at a
    # budget of 100 MiB takes a segment of 40 MiB (64 MiB would be more than half the
    # room), and 60 MiB on another stream, the rest of the budget, is served
    segs.standin_adopt_stream(SIDE, DEV)
    core.register_stream(SIDE)
    with at_budget(100 * MIB):
        p = alloc(40 * MIB)
        assert stats()["carve_held"] == 40 * MIB
        q = alloc(60 * MIB, SIDE)
        s = stats()
        assert s["carve_held"] == s["used"] == 100 * MIB and s["cached"] == 0
        rc, r = core.alloc(DEV, 2 * MIB, 0, TORCH)
        assert rc == Status.BUDGET and not r
        core.free(q)
        core.free(p)
    # with room to spare: the segment of 64 MiB, whose rest serves the next request
    with at_budget(1 << 30):
        calls = segs.standin_counter(C_ALLOC)
        p, q = alloc(40 * MIB), alloc(20 * MIB)
        assert segs.standin_counter(C_ALLOC) == calls + 1
        assert stats()["carve_held"] == 64 * MIB
        core.free(q)
        core.free(p)


def served_after_waiting(size: int, seconds: float, free) -> tuple[int, int]:
    """(status, ptr) of a thread's allocation of `size` on the default stream that waits up
    to `seconds`, once it waits and `free` has run."""
    out: dict = {}

    def wait():
        core.set_thread_wait(True, seconds, 0)
        try:
            out["r"] = core.alloc(DEV, size, 0, TORCH)
        finally:
            core.set_thread_wait(False, 0.0, 0)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    end = time.monotonic() + 10
    while not stats()["waiting"]:
        assert time.monotonic() < end, "the allocation did not wait"
        time.sleep(0.002)
    free()
    t.join(30)
    assert not t.is_alive()
    return out["r"]


def test_a_waiter_is_served_when_a_segment_empties(segs):
    # 40 + 50 MiB live at a budget of 100 MiB: another 50 MiB waits; the free of the
    # 40 MiB empties its segment, which goes back at once (no segment is kept while a
    # thread waits), and the waiter is served
    segs.standin_adopt_stream(SIDE, DEV)
    core.register_stream(SIDE)
    with at_budget(100 * MIB):
        p, q = alloc(40 * MIB), alloc(50 * MIB, SIDE)
        rc, r = served_after_waiting(50 * MIB, 20.0, lambda: core.free(p))
        assert rc == Status.OK and r
        s = stats()
        # p's segment went back; the waiter's block is the pool's (a wait retries there)
        assert s["used"] == 100 * MIB and s["carve_held"] == 50 * MIB and s["cached"] == 0
        core.free(r)
        core.free(q)


def test_a_request_past_its_frameworks_cap_takes_no_segment(segs):
    assert core.set_tag_limit(DEV, TORCH, 50 * MIB) == Status.OK
    try:
        p = alloc(40 * MIB)
        held, calls = stats()["carve_held"], segs.standin_counter(C_ALLOC)
        rc, r = core.alloc(DEV, 20 * MIB, 0, TORCH)
        assert rc == Status.TAG_LIMIT and not r
        assert stats()["carve_held"] == held and segs.standin_counter(C_ALLOC) == calls
        core.free(alloc(10 * MIB))  # within the cap: served from the segment's rest
        assert segs.standin_counter(C_ALLOC) == calls
        core.free(p)
    finally:
        core.set_tag_limit(DEV, TORCH, 0)
        core.trim(DEV, 0)


def test_empty_segments_go_back_on_a_trim_and_when_segments_are_turned_off(segs):
    a, b = alloc(4096), alloc(3 * MIB)
    core.free(a)
    core.free(b)
    assert stats()["carve_held"] == 2 * MIB + 64 * MIB  # both kept, empty
    assert core.trim(DEV, 0) == Status.OK  # torch.cuda.empty_cache()
    assert stats()["carve_held"] == 0 and stats()["used"] == 0
    p = alloc(4096)
    core.free(alloc(4096, 0, CUPY))
    assert core.set_cache_segments(DEV, False) == Status.OK
    assert stats()["carve_held"] == 2 * MIB  # p's segment is not empty
    core.free(p)  # carving off: it goes back as it empties
    assert stats()["carve_held"] == 0


# ---- the thread slot in front of the segments (issue 62's fast path) ----


def test_a_carved_block_freed_and_allocated_again_on_one_thread_is_served_from_its_slot(segs):
    """The block a thread allocated last and frees waits in its slot with its record,
    still carved; the thread's next allocation of its (stream, size) takes it back: the
    same address, a cache hit, no driver call, the record never out of the table."""
    p = alloc(3 * MIB)
    calls, hits = segs.standin_counter(C_ALLOC), stats()["num_cache_hits"]
    for _ in range(10):
        core.free(p)
        s = stats()
        # parked: in the figures' idle bytes (cached), not in any free range
        assert s["carve_parked"] == 3 * MIB and s["cached"] == 64 * MIB
        assert core.parked_records() == 1 and s["tags"][TORCH]["current"] == 0
        q = alloc(3 * MIB)
        assert q == p
        assert core.parked_records() == 0 and stats()["carve_parked"] == 0
    s = stats()
    assert s["num_cache_hits"] - hits == 10 and segs.standin_counter(C_ALLOC) == calls
    assert s["tags"][TORCH]["current"] == 3 * MIB and s["cached"] == 61 * MIB
    core.free(p)


def test_a_parked_block_is_never_handed_to_another_stream_or_another_thread(segs):
    segs.standin_adopt_stream(SIDE, DEV)
    core.register_stream(SIDE)
    p = alloc(8192, SIDE)
    core.free(p)  # parked in this thread's slot, SIDE's
    assert stats()["carve_parked"] == 8192
    # another thread asks for the same (stream, size): the parked block is not its
    out: dict = {}

    def other():
        out["r"] = core.alloc(DEV, 8192, SIDE, TORCH)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    rc, r = out["r"]
    assert rc == Status.OK and r != p
    assert stats()["carve_parked"] == 8192  # still this thread's
    # this thread on the default stream: a segment of that stream's own; the parked
    # block went back to SIDE's segment first (its next allocation did not take it)
    q = alloc(8192)
    assert q != p and not (p <= q < p + 2 * MIB - 8192)
    assert stats()["carve_parked"] == 0
    core.free(q)
    core.free(r)
    assert alloc(8192, SIDE) == p  # back in SIDE's segment, best fit
    core.free(p)


@pytest.mark.parametrize("how", ["trim", "cache off", "segments off", "forget stream"])
def test_a_parked_block_goes_back_to_its_segment_on_a_flush(segs, how):
    segs.standin_adopt_stream(SIDE, DEV)
    core.register_stream(SIDE)
    p = alloc(3 * MIB, SIDE)
    core.free(p)
    assert stats()["carve_parked"] == 3 * MIB and stats()["carve_held"] == 64 * MIB
    frees = segs.standin_counter(C_FREE)
    if how == "trim":  # torch.cuda.empty_cache(), a share's ask
        assert core.trim(DEV, 0) == Status.OK
    elif how == "cache off":
        core.set_cache(DEV, 0)
    elif how == "segments off":
        assert core.set_cache_segments(DEV, False) == Status.OK
    else:
        core.forget_stream(SIDE)
    s = stats()
    # back in its segment, which emptied and went back to the pool
    assert s["carve_parked"] == 0 and s["carve_held"] == 0 and s["cached"] == 0
    assert segs.standin_counter(C_FREE) == frees + 1 and core.parked_records() == 0
    core.set_cache(DEV, 1 << 30)
    assert core.set_cache_segments(DEV, True) == Status.OK


def test_at_a_tight_budget_a_parked_block_goes_back_before_a_refusal(segs):
    """48 MiB freed and parked holds its whole 48 MiB segment; 40 MiB more at a budget
    of 64 MiB is served all the same: the parked block goes back to its segment, the
    segment (empty) to the pool, and the request gets a segment of its own, with no
    refusal."""
    with at_budget(64 * MIB):
        p = alloc(48 * MIB)
        assert stats()["carve_held"] == 48 * MIB
        core.free(p)
        assert stats()["carve_parked"] == 48 * MIB
        ooms = stats()["num_ooms"]
        q = alloc(40 * MIB, 0, CUPY)
        s = stats()
        assert s["carve_parked"] == 0 and s["num_ooms"] == ooms
        assert s["used"] <= 64 * MIB and s["tags"][CUPY]["current"] == 40 * MIB
        core.free(q)


def test_a_thread_that_ends_leaves_nothing_parked(segs):
    def work():
        core.free(alloc(3 * MIB))
        assert stats()["carve_parked"] == 3 * MIB

    t = threading.Thread(target=work)
    t.start()
    t.join()
    # the OS thread's exit (its thread-local destructors) may come a moment after
    # join() returns: Python lets go of the thread before then
    end = time.monotonic() + 10
    while stats()["carve_parked"] and time.monotonic() < end:
        time.sleep(0.001)
    s = stats()
    # its block back in its segment: the segment empty, every byte of it idle
    assert s["carve_parked"] == 0 and core.parked_records() == 0
    assert s["carve_held"] == 64 * MIB and s["cached"] == 64 * MIB
    assert s["tags"][TORCH]["current"] == 0
    assert core.trim(DEV, 0) == Status.OK and stats()["carve_held"] == 0


def test_cupys_free_parks_a_carved_block_and_its_next_allocation_takes_it_back(segs):
    """CuPy's free (bridge_free_cached, with the GIL held) of the carved block its
    thread allocated last: OK, no slow path; CuPy's cache-only allocation takes it back.
    A carved block that is not the thread's last is still bridge_free's (MISS)."""
    p = alloc(4096, 0, CUPY)
    hits = stats()["num_cache_hits"]
    for _ in range(5):
        assert core.free_cached(p) == Status.OK
        assert stats()["carve_parked"] == 4096 and core.parked_records() == 1
        rc, q = core.alloc_cached(DEV, 4096, 0, CUPY)
        assert rc == Status.OK and q == p
    assert stats()["num_cache_hits"] - hits == 5
    a = alloc(8192, 0, CUPY)
    assert core.free_cached(p) == Status.MISS  # carved, not the thread's last
    core.free(p)
    assert stats()["carve_parked"] == 0
    assert core.free_cached(a) == Status.OK and stats()["carve_parked"] == 8192
    rc, b = core.alloc_cached(DEV, 4096, 0, CUPY)  # another size: a back to its segment
    assert rc == Status.OK and stats()["carve_parked"] == 0 and b == p
    assert core.free_cached(b) == Status.OK and stats()["carve_parked"] == 4096
    assert core.trim(DEV, 0) == Status.OK
    assert stats()["carve_parked"] == 0 and stats()["carve_held"] == 0


# ---- a review of the segments' paths (2026-12-05): each test failed on 9a0afa4 ----


def test_a_request_larger_than_the_device_is_refused_not_carved(segs):
    """A C caller's request of SIZE_MAX (or near it) is refused as the pool path refuses it
    (ledger_reserve: larger than the device), never rounded around to a few bytes of a
    segment: rounded up to 512 B, 2**64 - 1 wrapped to 512 B and was carved from the free
    range beside `keep`; 2**64 - 2 MiB + 1, rounded up to 2 MiB, wrapped to a segment of
    64 MiB. Both came back OK with the request's size in torch's live bytes."""
    import ctypes

    from ledger_util import bridge_alloc_fn

    keep = alloc(4096)  # a segment with a free range beside it
    fn = bridge_alloc_fn(False)
    lib = ctypes.CDLL(core.__file__)
    cached = lib.bridge_alloc_cached
    cached.argtypes = fn.argtypes
    cached.restype = ctypes.c_int
    held = stats()["carve_held"]
    for size in (2**64 - 1, 2**64 - 512, 2**64 - 2 * MIB + 1, 2**63):
        for call, refused in ((fn, Status.OOM), (cached, Status.MISS)):
            out = ctypes.c_void_p()
            assert call(DEV, size, None, TORCH, ctypes.byref(out)) == refused
            assert not out.value
    s = stats()
    assert s["tags"][TORCH]["current"] == 4096 and s["carve_held"] == held
    core.free(keep)


def test_with_the_cache_turned_off_an_emptied_segment_goes_back_at_once(segs):
    """unify(jax=True) turns the cache off (XLA allocates from the pool itself and cannot
    ask the bridge to flush): what torch and CuPy free must go back to the pool at once.
    Blocks carved before that keep their segments while they live; as each segment
    empties it goes back (it was kept, idle, until a trim)."""
    p, q = alloc(4096), alloc(3 * MIB)
    core.set_cache(DEV, 0)  # adapters/jax.py's _configure
    assert stats()["carve_held"] == 2 * MIB + 64 * MIB  # both live: their segments stay
    frees = segs.standin_counter(C_FREE)
    core.free(q)  # the thread's last allocation: no slot to park it in with the cache off
    core.free(p)
    s = stats()
    assert s["carve_held"] == 0 and s["cached"] == 0 and s["carve_parked"] == 0
    assert segs.standin_counter(C_FREE) == frees + 2
    core.set_cache(DEV, 1 << 30)


def test_at_a_tight_budget_a_range_of_the_streams_own_segment_serves_before_a_refusal(segs):
    """Another thread's carved block waits, parked, in its slot; the flush before a
    segment that does not fit the budget returns it to its segment (which stays in use):
    the request on that segment's stream is served from that range, not refused while
    those bytes are idle (it went to the pool alone, which the budget refused)."""
    segs.standin_adopt_stream(SIDE, DEV)
    core.register_stream(SIDE)
    parked, done = threading.Event(), threading.Event()
    out: dict = {}

    def other():
        out["a"] = alloc(30 * MIB)  # the start of a 64 MiB segment of the default stream
        core.free(out["a"])  # parked in this thread's slot, still carved
        parked.set()
        done.wait(30)

    t = threading.Thread(target=other)
    with at_budget(128 * MIB):
        t.start()
        assert parked.wait(30)
        b = alloc(30 * MIB)  # beside a, in the same segment
        c = alloc(60 * MIB, SIDE)  # a segment of its own size: 124 MiB reserved
        assert stats()["carve_held"] == 124 * MIB and stats()["carve_parked"] == 30 * MIB
        ooms = stats()["num_ooms"]
        rc, p = core.alloc(DEV, 30 * MIB, 0, TORCH)
        s = stats()
        assert rc == Status.OK and p == out["a"], Status(rc).name
        assert s["num_ooms"] == ooms and s["carve_held"] == 124 * MIB and s["used"] <= 128 * MIB
        assert s["tags"][TORCH]["current"] == 120 * MIB and s["carve_parked"] == 0
        for x in (p, b, c):
            core.free(x)
        done.set()
        t.join(30)


def test_a_waiter_is_served_from_a_range_freed_in_its_streams_segment(segs):
    """A thread waits for 30 MiB on the default stream at a budget the segments fill; the
    block freed beside a live one leaves a range of its segment free, which the waiter's
    next try takes (it retried the pool alone, refused until its wait ran out)."""
    segs.standin_adopt_stream(SIDE, DEV)
    core.register_stream(SIDE)
    with at_budget(128 * MIB):
        a, b = alloc(30 * MIB), alloc(30 * MIB)  # one 64 MiB segment
        c = alloc(60 * MIB, SIDE)
        # a: not this thread's last allocation, back to its segment at once
        rc, r = served_after_waiting(30 * MIB, 5.0, lambda: core.free(a))
        assert rc == Status.OK and r == a, Status(rc).name
        assert stats()["carve_held"] == 124 * MIB
        core.free(r)
        core.free(b)
        core.free(c)


def test_a_forgotten_streams_segment_goes_back_after_that_streams_work(segs):
    """CuPy's capture stream, non-blocking, is forgotten when its graph dies while an array
    allocated on it (after the capture) lives: its segment carves nothing more and goes
    back as it empties. That array's free (CuPy holds the stream until its free returns)
    empties it: the segment goes back on that stream, after the kernel still reading the
    array, not on the legacy stream, which a non-blocking stream's work does not precede."""
    import ctypes

    sd = segs
    sd.standin_new_stream_flags.restype = ctypes.c_void_p
    sd.standin_new_stream_flags.argtypes = [ctypes.c_int, ctypes.c_uint]
    s = sd.standin_new_stream_flags(DEV, 1)  # CU_STREAM_NON_BLOCKING
    core.register_stream(s)
    assert core.set_tag_holds_streams(CUPY, True) == Status.OK
    try:
        p = alloc(4096, s, CUPY)  # the segment's start
        sd.standin_launch(s, p, DEV)  # a kernel on s reads it, still queued
        core.forget_stream(s)
        unordered = sd.standin_counter(C_UNORDERED)
        core.free(p)
        assert stats()["carve_held"] == 0  # the orphaned segment went back as it emptied
        assert sd.standin_counter(C_UNORDERED) == unordered
    finally:
        core.set_tag_holds_streams(CUPY, False)
        sd.standin_sync_all(DEV)
