# SPDX-License-Identifier: Apache-2.0
"""The cache as the library sets it up by default (no BRIDGE_CACHE_* variable): segments of
the pool (carve.c with the release rule), on the stand-in driver.

tests/core/test_segments.py turns segments on by hand (core.set_cache_segments); these
tests set the device up as ``unify()`` and ``bridge.pool()`` do (``ensure_device``) and
hold what a user relies on by default: stream order for a piece split from a segment,
idle segments going back before a refusal or a wait of another framework and showing in
the figures before, loops that hit, and the variables that bound the cache or turn it off.
"""

from __future__ import annotations

import ctypes
import os
import threading

import pytest
from ledger_util import alloc
from ledger_util import stats as raw

import bridge
from bridge import _runtime, timeline
from bridge._errors import Status
from bridge._runtime import core

MIB = 1 << 20
DEV = 0
CUPY, TORCH = 1, 2
NON_BLOCKING = 1
C_ALLOC, C_WAIT, C_RECORD, C_UNORDERED = 0, 3, 4, 15


def set_up(monkeypatch, **env: str) -> None:
    """The device set up as the library does, with ``env`` and no other BRIDGE_CACHE_*."""
    for var in [v for v in os.environ if v.startswith("BRIDGE_CACHE_")]:
        monkeypatch.delenv(var)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    _runtime.reset_process_state()
    _runtime.ensure_device(DEV)


@pytest.fixture
def dflt(standin, monkeypatch):
    set_up(monkeypatch)
    live = core.live_records()
    yield standin
    assert core.live_records() == live
    core.set_limit(DEV, 0)
    assert core.trim(DEV, 0) == Status.OK
    assert raw()["carve_held"] == 0
    core.set_cache_segments(DEV, False)
    core.set_cache(DEV, 0)


def new_stream(sd) -> int:
    sd.standin_new_stream_flags.restype = ctypes.c_void_p
    sd.standin_new_stream_flags.argtypes = [ctypes.c_int, ctypes.c_uint]
    s = sd.standin_new_stream_flags(DEV, NON_BLOCKING)
    core.register_stream(s)
    return s


def test_segments_are_on_by_default(dflt):
    s = raw()
    assert s["carve_on"] == 1 and s["carve_slack"] == 1050  # 1.05 x the high-water mark
    assert s["cache_limit"] > 0


def test_a_piece_split_from_a_segment_another_stream_used_waits_for_that_streams_work(dflt):
    """torch's record_stream: a block of stream A's segment read by a kernel on stream B,
    freed on A. A smaller request on A is split from the same range; the driver saw A
    wait for B's work before the range was handed out, so that when the segment goes
    back to the pool, the kernel is ordered before that free (the stand-in counts every
    free that is not: C_UNORDERED)."""
    sd = dflt
    a, b = new_stream(sd), new_stream(sd)
    sd.standin_last_wait.argtypes = [ctypes.POINTER(ctypes.c_int)]
    sd.standin_last_wait.restype = ctypes.c_void_p
    try:
        p = alloc(8192, a)  # the start of A's 2 MiB segment
        keep = alloc(4096, a)  # keeps the segment from emptying
        sd.standin_launch(b, p, DEV)  # B's kernel reads p, still queued
        assert core.record_stream(p, b) == Status.OK
        records, waits = sd.standin_counter(C_RECORD), sd.standin_counter(C_WAIT)
        unordered = sd.standin_counter(C_UNORDERED)
        core.free(p)
        # before any reuse: an event on B, and A made to wait for it
        assert sd.standin_counter(C_RECORD) == records + 1
        assert sd.standin_counter(C_WAIT) == waits + 1
        dev = ctypes.c_int(-1)
        assert sd.standin_last_wait(ctypes.byref(dev)) == a and dev.value == DEV
        hits = raw()["num_cache_hits"]
        q = alloc(4096, a)  # best fit: a piece split from p's range
        assert q == p and raw()["num_cache_hits"] == hits + 1
        assert sd.standin_counter(C_WAIT) == waits + 1  # the wait was made once, at the free
        core.free(q)
        core.free(keep)
        assert core.trim(DEV, 0) == Status.OK  # the empty segment goes back to the pool
        assert raw()["carve_held"] == 0
        assert sd.standin_counter(C_UNORDERED) == unordered
    finally:
        core.forget_stream(a)
        core.forget_stream(b)
        sd.standin_sync_all(DEV)


def test_idle_segments_show_in_the_figures_and_go_back_before_another_frameworks_refusal(
    dflt,
):
    """CuPy frees four 64 MiB blocks: their segments stay, idle, in ``reserved`` and
    ``cached``. At a budget of 100 MiB, torch asks for 80 MiB (more than the budget less
    what is live would leave if the idle bytes stayed): served, with no refusal retried."""
    blocks = [alloc(64 * MIB, 0, CUPY) for _ in range(4)]
    for p in blocks:
        core.free(p)
    st = bridge.stats(DEV)
    assert st.cached == 256 * MIB and st.used == 0  # idle, in no framework's bytes
    assert st.reserved >= 256 * MIB and st.by_framework["cupy"] == 0
    row = timeline._read(DEV, 0.0, "idle")  # what a recording's sample shows
    assert row.reserved - row.used >= 256 * MIB and row.cupy == row.torch == 0
    bridge.pool(DEV).set_limit(100 * MIB)
    retries, ooms = raw()["num_retries"], raw()["num_ooms"]
    p = alloc(80 * MIB, 0, TORCH)
    st = bridge.stats(DEV)
    assert st.by_framework["torch"] == 80 * MIB and st.by_framework["cupy"] == 0
    # CuPy's segments went back (the driver's pool may keep the bytes until trimmed)
    assert st.cached == 0 and raw()["carve_held"] == 80 * MIB and st.ledger <= 100 * MIB
    assert (raw()["num_retries"], raw()["num_ooms"]) == (retries, ooms)
    core.free(p)


def test_idle_segments_go_back_before_another_framework_waits(dflt):
    """The same with waiting on (BRIDGE_WAIT's per-thread switch): torch's request is
    served at once, without waiting for memory the idle segments held."""
    for p in [alloc(64 * MIB, 0, CUPY) for _ in range(4)]:
        core.free(p)
    assert raw()["cached"] == 256 * MIB
    core.set_limit(DEV, 100 * MIB)
    waits = raw()["num_waits"]
    core.set_thread_wait(True, 5.0, 0)
    try:
        rc, p = core.alloc(DEV, 90 * MIB, 0, TORCH)
    finally:
        core.set_thread_wait(False, 0.0, 0)
    assert rc == Status.OK and p
    s = raw()
    assert s["num_waits"] == waits and s["cached"] == 0
    core.free(p)


@pytest.mark.parametrize(("size", "segment"), [(512, 2 * MIB), (MIB, 2 * MIB),
                                               (64 * MIB, 64 * MIB)])  # fmt: skip
def test_loops_of_one_size_hit_after_the_first_allocation(dflt, size, segment):
    sd = dflt
    calls, hits = sd.standin_counter(C_ALLOC), raw()["num_cache_hits"]
    first = alloc(size)
    core.free(first)
    for _ in range(50):
        p = alloc(size)
        assert p == first
        core.free(p)
    s = raw()
    assert sd.standin_counter(C_ALLOC) == calls + 1  # one segment, taken once
    assert s["num_cache_hits"] - hits == 50
    assert s["carve_held"] == segment == bridge.stats(DEV).cached


def test_empty_segments_go_back_on_free_all_blocks_and_empty_cache(dflt):
    a, b = alloc(4096, 0, CUPY), alloc(3 * MIB)
    core.free(a)
    core.free(b)
    assert raw()["carve_held"] == 2 * MIB + 64 * MIB
    before = bridge.stats(DEV).reserved
    bridge.pool(DEV).free_all_blocks()  # cupy's MemoryPool.free_all_blocks()
    assert raw()["carve_held"] == 0 and bridge.stats(DEV).cached == 0
    assert bridge.stats(DEV).reserved <= before - 66 * MIB
    core.free(alloc(4096))
    assert raw()["carve_held"] == 2 * MIB
    assert core.trim(DEV, 0) == Status.OK  # torch.cuda.empty_cache()
    assert raw()["carve_held"] == 0


def test_cache_limit_0_turns_the_cache_off(standin, monkeypatch):
    set_up(monkeypatch, BRIDGE_CACHE_LIMIT="0")
    calls = standin.standin_counter(C_ALLOC)
    for _ in range(5):
        core.free(alloc(4096))
    s = raw()
    assert standin.standin_counter(C_ALLOC) == calls + 5  # every allocation a driver call
    assert s["carve_held"] == 0 and s["cached"] == 0 and s["cache_limit"] == 0


def test_cache_segments_0_gives_the_exact_size_tiers_back(standin, monkeypatch):
    set_up(monkeypatch, BRIDGE_CACHE_SEGMENTS="0")
    try:
        s = raw()
        assert s["carve_on"] == 0 and s["cache_limit"] > 0
        p = alloc(4096)
        core.free(p)
        assert raw()["cached"] == 4096 and raw()["carve_held"] == 0  # a block of its size
        assert alloc(4096) == p
        core.free(p)
        q = alloc(2048)  # another size: not carved from p's bytes
        assert q != p
        core.free(q)
    finally:
        core.trim(DEV, 0)
        core.set_cache(DEV, 0)


def test_cache_carve_1_without_segments_set_carves_with_no_empty_chunk_kept(standin, monkeypatch):
    set_up(monkeypatch, BRIDGE_CACHE_CARVE="1")
    try:
        s = raw()
        assert s["carve_on"] == 1 and s["carve_slack"] == 0
        core.free(alloc(4096))
        assert raw()["carve_held"] == 0  # the emptied chunk went back at once
    finally:
        core.set_cache_carve(DEV, 0, 0, 0)
        core.trim(DEV, 0)
        core.set_cache(DEV, 0)


def three_segments_emptied() -> list[tuple[int, int]]:
    """Three 64 MiB blocks, a segment each (their sizes follow the live bytes), freed in
    order by another thread (a free parks only in the slot of the thread that allocated
    the block): [(block, its segment's bytes)]."""
    out = []
    for _ in range(3):
        held = raw()["carve_held"]
        p = alloc(64 * MIB)
        out.append((p, raw()["carve_held"] - held))
    t = threading.Thread(target=lambda: [core.free(p) for p, _ in out])
    t.start()
    t.join()
    return out


def test_cache_limit_bounds_the_empty_segments_kept(standin, monkeypatch):
    """BRIDGE_CACHE_LIMIT as big as the last segment: of three emptied segments only the one
    that emptied last is kept, the others go back to the pool as they empty; unset, all
    three stay (the release rule alone)."""
    bound = None
    for env in ({}, "bound"):
        set_up(monkeypatch, **({} if env == {} else {"BRIDGE_CACHE_LIMIT": str(bound)}))
        try:
            segs = three_segments_emptied()
            assert all(b >= 64 * MIB for _, b in segs)
            s = raw()
            if env == {}:
                assert s["carve_held"] == s["cached"] == sum(b for _, b in segs)
                bound = segs[-1][1]
            else:
                assert s["carve_held"] == s["cached"] == bound
                p = alloc(64 * MIB)
                assert p == segs[-1][0]  # the kept one serves again
                core.free(p)
        finally:
            core.set_limit(DEV, 0)
            core.trim(DEV, 0)
            core.set_cache_segments(DEV, False)
            core.set_cache(DEV, 0)


def test_bounding_the_empty_segments_gives_back_those_past_the_bound_at_once(dflt):
    segs = three_segments_emptied()
    assert raw()["carve_held"] == sum(b for _, b in segs)
    assert core.set_cache_segments_keep(DEV, segs[-1][1]) == Status.OK
    assert raw()["carve_held"] == segs[-1][1]  # the two that emptied first went back
    assert core.set_cache_segments_keep(DEV, 2**64 - 1) == Status.OK
    assert core.set_cache_segments_keep(99, 0) == Status.DEVICE


def test_the_figures_of_a_freed_carved_block_as_the_docs_give_them(dflt, monkeypatch):
    # the user guide's Stats table and Pool.n_free_blocks' docstring: the idle bytes of a
    # segment are `cached`, inside `ledger` and `reserved`, outside `used`; no block is
    # counted by n_free_blocks (a carved block goes back to its segment's free ranges)
    import sys

    monkeypatch.setitem(sys.modules, "cupy", None)  # pool(d).malloc hands out the block
    p = bridge.pool(DEV)
    block = p.malloc(3 * MIB)
    s = bridge.stats(DEV)
    assert s.by_framework["other"] == 3 * MIB and raw()["carve_held"] > 3 * MIB
    del block
    s = bridge.stats(DEV)
    assert s.cached == raw()["carve_held"] > 0
    assert s.ledger >= s.cached and s.reserved >= s.cached
    assert s.used == 0 and p.used_bytes() == 0
    assert p.n_free_blocks() == 0
    p.free_all_blocks()
    s = bridge.stats(DEV)
    assert s.cached == 0 and s.ledger == 0
