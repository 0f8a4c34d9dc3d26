# SPDX-License-Identifier: Apache-2.0
"""Blocks carved from pool chunks (carve.c; BRIDGE_CACHE_CARVE=1), on the stand-in driver.

The rules themselves (best fit, coalescing, the chunks' sizes, the empty ones kept) are
held against the model event by event on the four traces in
tests/benchmarks/test_model_cache.py; these tests hold what a user relies on around them:
the driver calls made, stream order, captures, the budget, and bad frees."""

from __future__ import annotations

import pytest
from ledger_util import alloc, stats

from bridge._errors import Status
from bridge._runtime import core

MIB = 1 << 20
KIB = 1 << 10
DEV = 0
OTHER, CUPY, TORCH = 0, 1, 2
SIDE = 0x5000  # a stream handle the stand-in accepts
C_ALLOC, C_FREE, C_WAIT, C_RECORD = 0, 1, 3, 4
BEGIN, END, RELEASE = 0, 1, 2


@pytest.fixture
def carve(standin):
    core.set_cache(DEV, 1 << 30)
    assert core.set_cache_carve(DEV, 1 / 8, 32 * MIB, 256 * MIB, 0, 0) == Status.OK
    live = core.live_records()
    yield standin
    standin.standin_set_capturing(None)
    assert core.live_records() == live
    core.set_cache_carve(DEV, 0, 0, 0)
    core.set_cache(DEV, 0)
    core.forget_stream(SIDE)
    assert stats()["carve_held"] == 0


def test_small_blocks_are_carved_from_one_2_mib_chunk_in_512_byte_steps(carve):
    calls = carve.standin_counter(C_ALLOC)
    a = alloc(1000)
    assert carve.standin_counter(C_ALLOC) == calls + 1  # one chunk ...
    assert stats()["carve_held"] == 2 * MIB and stats()["carve_on"] == 1
    b = alloc(3000)
    assert b == a + 1024  # ... carved again, after the first block rounded up to 512 B
    assert carve.standin_counter(C_ALLOC) == calls + 1  # no driver call
    s = stats()
    assert s["tags"][TORCH]["current"] == 4000 and s["cached"] == 2 * MIB - 4000
    frees = carve.standin_counter(C_FREE)
    core.free(a)
    assert stats()["cached"] == 2 * MIB - 3000 and carve.standin_counter(C_FREE) == frees
    core.free(b)  # the chunk is empty, and none is kept: back to the pool at once
    assert carve.standin_counter(C_FREE) == frees + 1
    s = stats()
    assert s["carve_held"] == 0 and s["cached"] == 0 and s["used"] == 0


def test_a_large_requests_chunk_is_an_eighth_of_the_live_bytes_within_its_bounds(carve):
    small = alloc(2 * MIB)  # nothing live yet: the least chunk, 32 MiB
    assert stats()["carve_held"] == 32 * MIB
    big = [alloc(64 * MIB) for _ in range(4)]  # each a chunk of its own, rounded to 2 MiB
    assert stats()["carve_held"] == 32 * MIB + 4 * 64 * MIB
    held = stats()["carve_held"]
    live = stats()["tags"][TORCH]["current"]  # 258 MiB live: a chunk of 1/8, 64 MiB (2^k)
    extra = alloc(31 * MIB)  # the 32 MiB chunk has 30 MiB free: too little
    assert stats()["carve_held"] == held + 64 * MIB and live // 8 <= 64 * MIB
    for p in [small, extra, *big]:
        core.free(p)
    assert stats()["carve_held"] == 0


def test_the_best_fit_is_the_smallest_free_range_and_freed_neighbours_join(carve):
    a, b, c, d = (alloc(64 * KIB) for _ in range(4))
    assert (b - a, c - b, d - c) == (64 * KIB,) * 3
    core.free(b)  # a 64 KiB hole between a and c
    e = alloc(100 * KIB)
    assert e == d + 64 * KIB  # the hole is too small: the free tail
    f = alloc(60 * KIB)
    assert f == b  # the smallest range that holds it: the hole
    core.free(f)
    core.free(a)  # joins the hole after it: 128 KiB from a
    g = alloc(128 * KIB)
    assert g == a
    for p in (g, c, d, e):
        core.free(p)


def test_a_block_with_a_recorded_stream_is_carved_again_after_the_chunks_stream_waits(carve):
    carve.standin_adopt_stream(SIDE, DEV)
    core.register_stream(SIDE)
    keep = alloc(4096)  # keeps the chunk from emptying
    p = alloc(8192)
    assert core.record_stream(p, SIDE) == Status.OK
    records, waits = carve.standin_counter(C_RECORD), carve.standin_counter(C_WAIT)
    core.free(p)
    # the chunk's stream (the default one) waits for SIDE's queued work: one event, one wait
    assert carve.standin_counter(C_RECORD) == records + 1
    assert carve.standin_counter(C_WAIT) == waits + 1
    assert alloc(8192) == p  # then its range is carved again on the default stream
    core.free(p)
    core.free(keep)


def test_a_free_during_a_capture_of_its_stream_waits_for_the_capture_to_end(carve):
    carve.standin_adopt_stream(SIDE, DEV)
    core.register_stream(SIDE)
    keep = alloc(4096, SIDE)
    p = alloc(8192, SIDE)
    pool = (0x71, 0)
    core.graph(BEGIN, DEV, *pool)
    carve.standin_set_capturing(SIDE)
    idle = stats()["cached"]
    core.free(p)  # the captured work may still use it: not carved again yet
    s = stats()
    assert s["cached"] == idle and s["tags"][TORCH]["current"] == 4096
    carve.standin_set_capturing(None)
    core.graph(END, DEV, *pool)
    core.graph(RELEASE, DEV, *pool)
    q = alloc(8192, SIDE)  # the next carved allocation gives the held-back block back first
    assert q == p
    core.free(q)
    core.free(keep)


def test_a_chunk_the_budget_refuses_leaves_the_request_to_the_pool(carve):
    core.set_limit(DEV, 30 * MIB)
    try:
        p = alloc(20 * MIB)  # its chunk (32 MiB) is over the budget; the request is not
        s = stats()
        assert s["carve_held"] == 0 and s["tags"][TORCH]["current"] == 20 * MIB
        core.free(p)  # an ordinary block: the tiers cache it, as without carving
        s = stats()
        assert s["used"] == s["cached"] == s["cached_large"] == 20 * MIB
    finally:
        core.set_limit(DEV, 0)
        core.trim(DEV, 0)


def test_a_tags_cap_refuses_a_carved_block_and_the_chunk_goes_back(carve):
    core.set_tag_limit(DEV, TORCH, MIB)
    try:
        rc, p = core.alloc(DEV, 2 * MIB, 0, TORCH)
        assert rc == Status.TAG_LIMIT and not p
        s = stats()
        assert s["carve_held"] == 0 and s["used"] == 0 and s["tags"][TORCH]["current"] == 0
    finally:
        core.set_tag_limit(DEV, TORCH, 0)


def test_a_double_free_of_a_carved_block_is_counted_and_changes_nothing(carve):
    keep = alloc(4096)
    p = alloc(4096)
    core.free(p)
    before = stats()
    core.free(p)
    after = stats()
    assert after["num_bad_frees"] == before["num_bad_frees"] + 1
    assert (after["cached"], after["carve_held"], after["used"]) == (
        before["cached"], before["carve_held"], before["used"])  # fmt: skip
    core.free(keep)


def test_empty_chunks_kept_go_back_on_a_trim(carve):
    core.set_cache_carve(DEV, 1 / 8, 32 * MIB, 256 * MIB, 64 * MIB, 64 * MIB)
    core.free(alloc(4096))
    core.free(alloc(3 * MIB))
    assert stats()["carve_held"] == 2 * MIB + 32 * MIB  # both kept, empty
    assert stats()["cached"] == stats()["used"] == 34 * MIB
    assert core.trim(DEV, 0) == Status.OK  # torch.cuda.empty_cache()
    assert stats()["carve_held"] == 0 and stats()["used"] == 0


def test_a_forgotten_streams_chunk_carves_nothing_more_and_goes_back_when_empty(carve):
    core.register_stream(SIDE)
    p = alloc(4096, SIDE)
    q = alloc(4096, SIDE)
    core.free(q)
    core.forget_stream(SIDE)  # a stream being destroyed: its chunk carves nothing more
    core.register_stream(SIDE)  # a new stream with the same handle
    r = alloc(4096, SIDE)
    assert stats()["carve_held"] == 4 * MIB and r != q  # a chunk of its own
    frees = carve.standin_counter(C_FREE)
    core.free(p)  # the old chunk empties: back at once
    assert carve.standin_counter(C_FREE) == frees + 1 and stats()["carve_held"] == 2 * MIB
    core.free(r)


def test_cupys_cache_only_calls_take_a_carved_block_and_leave_its_free_to_the_full_path(carve):
    keep = alloc(4096, 0, CUPY)
    calls = carve.standin_counter(C_ALLOC)
    rc, p = core.alloc_cached(DEV, 4096, 0, CUPY)  # a free range: no driver call
    assert rc == Status.OK and p == keep + 4096
    rc, big = core.alloc_cached(DEV, 4 * MIB, 0, CUPY)
    assert rc == Status.MISS  # that needs a chunk: a driver call, the full path's
    assert core.free_cached(p) == Status.MISS  # carved: bridge_free gives it back
    core.free(p)
    assert carve.standin_counter(C_ALLOC) == calls
    assert alloc(4096, 0, CUPY) == p
    core.free(p)
    core.free(keep)


def test_carving_turned_off_still_takes_back_what_it_carved(carve):
    p = alloc(4096)
    core.set_cache_carve(DEV, 0, 0, 0)
    q = alloc(4096)  # not carved: a pool block of its own
    assert stats()["carve_held"] == 2 * MIB and stats()["carve_on"] == 0
    core.free(p)  # its chunk empties and goes back
    assert stats()["carve_held"] == 0
    core.free(q)


@pytest.mark.parametrize("args", [(1 / 8, 0, 256 * MIB), (1 / 8, 64 * MIB, 32 * MIB),
                                  (-1.0, 32 * MIB, 256 * MIB)])  # fmt: skip
def test_bad_carving_settings_are_refused_and_change_nothing(carve, args):
    assert core.set_cache_carve(DEV, *args) == Status.INVALID
    p = alloc(4096)
    assert stats()["carve_on"] == 1 and stats()["carve_held"] == 2 * MIB
    core.free(p)
