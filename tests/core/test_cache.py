# SPDX-License-Identifier: Apache-2.0
"""The cache of freed blocks in front of the pool (stand-in driver)."""

from __future__ import annotations

import pytest

from bridge._runtime import core

MIB = 1 << 20
OTHER, CUPY, TORCH = 0, 1, 2
SIDE = 0x5000  # a user stream handle (the stand-in accepts any)


@pytest.fixture
def cache(standin):
    core.set_cache(0, 64 * MIB)
    core.set_cache_fraction(0, 1 / 16, 64 * MIB)  # the defaults
    core.set_cache_tiers(0, MIB, 64 * MIB)
    core.forget_stream(SIDE)
    yield standin
    core.set_cache(0, 0)
    core.set_cache_fraction(0, 1 / 16, 64 * MIB)
    core.set_cache_tiers(0, MIB, 64 * MIB)
    core.forget_stream(SIDE)


def stats():
    return core.stats(0)[1]


def test_same_size_same_stream_reuses_the_block(cache):
    rc, p = core.alloc(0, 3 * MIB, 0, CUPY)
    allocs = cache.standin_counter(0)
    core.free(p)
    assert stats()["cached"] == 3 * MIB
    assert stats()["tags"][CUPY]["current"] == 0
    rc, q = core.alloc(0, 3 * MIB, 0, TORCH)
    assert rc == 0 and q == p
    assert cache.standin_counter(0) == allocs  # no driver call
    assert stats()["cached"] == 0 and stats()["tags"][TORCH]["current"] == 3 * MIB
    core.free(q)


def test_other_size_or_stream_misses(cache):
    rc, p = core.alloc(0, 3 * MIB, 0, CUPY)
    core.free(p)
    rc, q = core.alloc(0, 3 * MIB + 1, 0, CUPY)
    assert q != p
    rc, r = core.alloc(0, 3 * MIB, SIDE, TORCH)
    assert r != p
    for x in (q, r):
        core.free(x)


def test_user_streams_are_not_cached_unless_registered_as_long_lived(cache):
    rc, p = core.alloc(0, MIB, SIDE, TORCH)
    core.free(p)
    assert stats()["cached"] == 0  # a user stream (ExternalStream) may be destroyed
    core.register_stream(SIDE)
    rc, p = core.alloc(0, MIB, SIDE, TORCH)
    core.free(p)
    assert stats()["cached"] == MIB  # torch's pooled streams live on
    rc, q = core.alloc(0, MIB, SIDE, TORCH)
    assert q == p
    core.free(q)


def test_cached_bytes_count_in_the_budget_and_go_back_under_pressure(cache):
    core.set_limit(0, 10 * MIB)
    rc, p = core.alloc(0, 6 * MIB, 0, CUPY)
    core.free(p)
    assert stats()["cached"] == 6 * MIB and stats()["used"] == 6 * MIB
    rc, q = core.alloc(0, 8 * MIB, 0, TORCH)  # fits only once the cache is emptied
    assert rc == 0
    s = stats()
    assert s["cached"] == 0 and s["used"] == 8 * MIB and s["peak_used"] <= 10 * MIB
    core.free(q)
    core.set_limit(0, 0)


def test_a_graph_allocation_gives_the_cached_blocks_back_under_the_budget(cache):
    # A capture's allocation (torch's graph pool, a CuPy capture) that meets the budget while
    # the cache holds blocks: they go back to the pool and it is tried again, as an ordinary
    # allocation's are (on the H200 a CuPy capture was refused with the cache still full).
    # The stand-in lands a stream-ordered free only when its stream is synchronized, which
    # no step may do during a capture: here the retry still meets the free in flight, and
    # the next try, after the stream got there, fits.
    g = (0x5A, 0x5B)
    core.register_stream(SIDE)  # a stream that lives on (torch's pooled ones, CuPy's)
    core.set_limit(0, 10 * MIB)
    rc, p = core.alloc(0, 6 * MIB, SIDE, CUPY)
    core.free(p)
    assert stats()["cached"] == 6 * MIB
    assert core.graph(0, 0, *g) == 0  # GRAPH_BEGIN
    q = 0
    try:
        assert core.alloc_graph(0, 8 * MIB, TORCH, *g)[0] == 1  # BUDGET: the free in flight
        s = stats()
        assert s["cached"] == 0 and s["used"] == 0  # the cache's block went back
        cache.standin_sync_all(0)  # the stream reached the free
        rc, q = core.alloc_graph(0, 8 * MIB, TORCH, *g)
        assert rc == 0 and q and stats()["used"] == 8 * MIB
    finally:
        core.free(q)
        core.graph(1, 0, *g)  # GRAPH_END
        core.graph(2, 0, *g)  # GRAPH_RELEASE
        core.set_limit(0, 0)
    assert core.trim(0, 0) == 0  # the pool's block waits for a device-wide sync: made here
    assert stats()["used"] == 0


def test_cap_and_largest_block(cache):
    core.set_cache(0, 4 * MIB, 2 * MIB)
    ptrs = [core.alloc(0, MIB, 0, CUPY)[1] for _ in range(6)]
    big = core.alloc(0, 3 * MIB, 0, CUPY)[1]
    for p in ptrs + [big]:
        core.free(p)
    assert stats()["cached"] == 4 * MIB  # four of the six, not the 3 MiB block


def test_trim_and_turning_off_empty_the_cache(cache):
    rc, p = core.alloc(0, MIB, 0, CUPY)
    core.free(p)
    assert stats()["cached"] == MIB
    assert core.trim(0, 0) == 0
    assert stats()["cached"] == 0 and stats()["used"] == 0
    rc, p = core.alloc(0, MIB, 0, CUPY)
    core.free(p)
    core.set_cache(0, 0)
    assert stats()["cached"] == 0 and stats()["used"] == 0


def test_recorded_blocks_are_not_cached(cache):
    rc, p = core.alloc(0, MIB, 0, CUPY)
    assert core.record_stream(p, SIDE) == 0
    core.free(p)
    assert stats()["cached"] == 0


def test_tag_cap_holds_on_a_cache_hit(cache):
    rc, p = core.alloc(0, 2 * MIB, 0, CUPY)
    core.free(p)
    core.set_tag_limit(0, TORCH, MIB)
    rc, q = core.alloc(0, 2 * MIB, 0, TORCH)
    assert rc == 8 and q == 0  # TAG_LIMIT
    assert stats()["tags"][TORCH]["current"] == 0
    core.set_tag_limit(0, TORCH, 0)


def test_a_table_full_of_emptied_keys_still_caches_new_sizes(cache):
    """Once 2048 (stream, size) keys had all been taken again, no new size was
    ever cached: the table was only reset by a flush with bytes cached (found
    while modelling the cache for tests/core/test_ledger_property.py)."""
    held = []
    for i in range(2100):  # more distinct sizes than the table keeps keys
        size = 512 * (i + 1)
        rc, p = core.alloc(0, size, 0, CUPY)
        assert rc == 0
        core.free(p)
        assert stats()["cached"] == size, f"size {size} (key {i}) was not cached"
        rc, q = core.alloc(0, size, 0, CUPY)  # taken again: nothing cached
        assert rc == 0 and q == p
        held.append(q)
    for q in held:
        core.free(q)


def test_stale_keys_are_dropped_while_other_blocks_stay_cached(cache):
    """Keys whose blocks were all reused make room for new sizes; cached blocks survive."""
    kept = [core.alloc(0, 7 * 4096 + i, 0, CUPY)[1] for i in range(3)]
    for p in kept:
        core.free(p)  # three blocks stay cached throughout
    base = stats()["cached"]
    held = []
    for i in range(3000):  # more distinct sizes than the table keeps keys
        size = 1_000_000 + 512 * i
        rc, p = core.alloc(0, size, 0, CUPY)
        core.free(p)
        assert stats()["cached"] == base + size, f"size {size} (key {i}) was not cached"
        rc, q = core.alloc(0, size, 0, CUPY)  # taken again: its key is now stale
        assert q == p
        held.append(q)
    again = [core.alloc(0, 7 * 4096 + i, 0, CUPY)[1] for i in range(3)]
    assert again == kept  # the cached blocks survived every compaction
    for q in held + again:
        core.free(q)


def _device_1_stats(env: dict, what: str) -> str:
    """What `print(what)` shows in a fresh process on the stand-in, `s` being device 1's
    core stats after its set-up, with the caller's BRIDGE_CACHE_* variables only."""
    import os
    import subprocess
    import sys

    e = {k: v for k, v in os.environ.items() if not k.startswith("BRIDGE_CACHE_")}
    e.update(env)
    code = (
        "from bridge import _runtime\n"
        "_runtime.ensure_device(1)\n"
        "s = _runtime.core.stats(1)[1]\n"
        f"print({what})\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize(
    ("total", "env", "expect"),
    [
        (16 << 30, None, 1 << 30),  # at least 1 GiB
        (140 << 30, None, (140 << 30) // 50),  # 2% of a large device: 2.8 GiB
        (140 << 30, "512MiB", 512 * MIB),  # BRIDGE_CACHE_LIMIT wins
        (140 << 30, "0", 0),  # off
    ],
)
def test_default_cache_limit_scales_with_the_device(standin, total, env, expect):
    """A fresh process on the stand-in: the cache limit each device gets at set-up."""
    extra = {"BRIDGE_STANDIN_TOTAL": str(total)}
    if env is not None:
        extra["BRIDGE_CACHE_LIMIT"] = env
    assert int(_device_1_stats(extra, "s['cache_limit']")) == expect


def test_many_sizes_that_are_multiples_of_a_mib_are_all_cached_and_found(cache):
    """Such sizes have all-zero low bits: the table must spread them (issue: they
    piled onto a few slots)."""
    core.set_cache(0, 8 << 30)
    core.set_cache_fraction(0, 1 / 16, 8 << 30)  # a floor above the 5 GiB: nothing evicted
    core.set_cache_tiers(0, MIB, 8 << 30)  # and a large tier's cap above it
    ptrs = {}
    for i in range(1, 101):  # 5 GiB of the stand-in's 16
        rc, p = core.alloc(0, i * MIB, 0, CUPY)
        assert rc == 0
        ptrs[i] = p
    for p in ptrs.values():
        core.free(p)
    assert stats()["cached"] == sum(i * MIB for i in ptrs)
    for i, p in ptrs.items():
        assert core.alloc(0, i * MIB, 0, CUPY) == (0, p)
    for p in ptrs.values():
        core.free(p)


def test_the_tables_hold_many_aligned_keys(tmp_path):
    """benchmarks/bench_tables.c checks every insert, take, put and take it times:
    64 MiB-strided pointers and sizes in MiB (its speed is a benchmark, not a test)."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    r = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "bench_tables.py"), "--n", "20000"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "64 MiB stride" in r.stdout and "multiples of 1 MiB" in r.stdout


def test_an_uncached_tag_frees_to_the_pool_and_others_still_cache(cache):
    """Numba's blocks (used on any stream, ordered by the legacy stream's free) are
    never kept; the other frameworks' blocks still are."""
    assert core.set_tag_cached(core.TAG_NUMBA, False) == 0
    frees = cache.standin_counter(1)
    rc, p = core.alloc(0, 3 * MIB, 0, core.TAG_NUMBA)
    core.free(p)
    assert stats()["cached"] == 0 and cache.standin_counter(1) == frees + 1  # a driver free
    rc, q = core.alloc(0, 3 * MIB, 0, CUPY)
    core.free(q)
    assert stats()["cached"] == 3 * MIB
    assert core.set_tag_cached(core.TAG_NUMBA, True) == 0
    rc, p = core.alloc(0, 5 * MIB, 0, core.TAG_NUMBA)
    core.free(p)
    assert stats()["cached"] == 8 * MIB
    assert core.set_tag_cached(core.NTAGS, False) == 7  # INVALID
    assert core.set_tag_cached(-1, True) == 7


# ---- eviction: the least recently cached blocks go first; the cap follows live bytes ----


def allocs(standin):
    return standin.standin_counter(0)


def frees(standin):
    return standin.standin_counter(1)


def test_the_oldest_cached_block_is_evicted_first(cache):
    """cap = 64 MiB (the floor; nothing live): a free past it gives back the oldest."""
    core.set_cache(0, 1 << 30)
    a, b, c, d = (core.alloc(0, n * MIB, 0, CUPY)[1] for n in (16, 17, 18, 19))
    for p in (a, b, c):
        core.free(p)
    assert stats()["cached"] == 51 * MIB
    before = frees(cache)
    core.free(d)  # 70 MiB > 64: a (16 MiB, the oldest) goes to the driver
    assert frees(cache) == before + 1
    assert stats()["cached"] == 54 * MIB and stats()["used"] == 54 * MIB
    n = allocs(cache)
    assert core.alloc(0, 17 * MIB, 0, CUPY) == (0, b)  # b, c, d are still cached
    assert core.alloc(0, 19 * MIB, 0, CUPY) == (0, d)
    assert allocs(cache) == n
    rc, a2 = core.alloc(0, 16 * MIB, 0, CUPY)  # a is gone: a driver allocation
    assert rc == 0 and allocs(cache) == n + 1
    for p in (a2, b, d):
        core.free(p)


def test_a_block_taken_and_freed_again_is_the_newest(cache):
    core.set_cache(0, 1 << 30)
    a, b = (core.alloc(0, n * MIB, 0, CUPY)[1] for n in (30, 31))
    core.free(a)
    core.free(b)
    assert core.alloc(0, 30 * MIB, 0, CUPY) == (0, a)
    core.free(a)  # a is now newer than b
    rc, c = core.alloc(0, 4 * MIB, 0, CUPY)
    core.free(c)  # 65 MiB > 64: b goes, not a
    assert stats()["cached"] == 34 * MIB
    assert core.alloc(0, 30 * MIB, 0, CUPY) == (0, a)
    core.free(a)


def test_the_cap_follows_the_live_bytes(cache):
    """The small tier's cap = max(floor, live / 16): freeing most memory shrinks it
    at its next put (a large block's put evicts only large blocks)."""
    core.set_cache(0, 1 << 30)
    core.set_cache_fraction(0, 1 / 16, MIB)
    rc, big = core.alloc(0, 160 * MIB, 0, TORCH)  # live 160 MiB: cap 10 MiB
    small = [core.alloc(0, MIB, 0, CUPY)[1] for _ in range(12)]
    last = core.alloc(0, 4096, 0, CUPY)[1]
    before = frees(cache)
    for p in small:
        core.free(p)
    assert stats()["cached"] == 10 * MIB  # the two oldest went back
    assert frees(cache) == before + 2
    core.free(big)  # live 4 KiB: 160 MiB is above the large tier's cap, not kept
    assert frees(cache) == before + 3
    assert stats()["cached"] == stats()["cached_small"] == 10 * MIB  # the small tier stays
    core.free(last)  # a small put: its tier's cap is now 1 MiB (the floor)
    assert stats()["cached"] == 4096
    assert frees(cache) == before + 3 + 10
    rc, p = core.alloc(0, MIB, 0, CUPY)
    assert rc == 0 and p not in small
    core.free(p)


def test_the_floor_keeps_single_size_loops_hitting(cache):
    """Nothing else live: 512 B, 1 MiB and 64 MiB loops hit every time after the first."""
    core.set_cache(0, 1 << 30)
    for size in (512, MIB, 64 * MIB):
        n = allocs(cache)
        hits = stats()["num_cache_hits"]
        for _ in range(20):
            rc, p = core.alloc(0, size, 0, CUPY)
            assert rc == 0
            core.free(p)
        assert allocs(cache) == n + 1, size
        assert stats()["num_cache_hits"] == hits + 19
    cached = stats()["cached"]
    assert stats()["cached_large"] == 64 * MIB
    rc, p = core.alloc(0, 65 * MIB, 0, CUPY)  # above the large tier's cap: not kept
    core.free(p)
    assert stats()["cached"] == cached  # and it evicted nothing


def test_the_hard_limit_wins_over_the_floor_and_the_share(cache):
    core.set_cache(0, 2 * MIB)
    core.set_cache_fraction(0, 1.0, 1 << 30)
    ptrs = [core.alloc(0, MIB, 0, CUPY)[1] for _ in range(3)]
    for p in ptrs:
        core.free(p)
    assert stats()["cached"] == 2 * MIB
    assert core.alloc(0, MIB, 0, CUPY) == (0, ptrs[2])
    assert core.alloc(0, MIB, 0, CUPY) == (0, ptrs[1])
    assert stats()["cached"] == 0
    for p in ptrs[1:]:
        core.free(p)


def test_flush_and_flush_stream_release_every_block_once(cache):
    core.set_cache(0, 1 << 30)
    core.register_stream(SIDE)
    on0 = [core.alloc(0, n * MIB, 0, CUPY)[1] for n in (1, 2, 3, 3)]
    onside = [core.alloc(0, n * MIB, SIDE, TORCH)[1] for n in (1, 2, 2, 5)]
    for p in on0 + onside:
        core.free(p)
    assert stats()["cached"] == 19 * MIB
    before = frees(cache)
    core.forget_stream(SIDE)  # its blocks go back; the others stay
    assert frees(cache) == before + 4
    assert stats()["cached"] == 9 * MIB
    assert core.alloc(0, 3 * MIB, 0, CUPY) == (0, on0[3])
    core.free(on0[3])
    assert core.trim(0, 0) == 0
    assert frees(cache) == before + 8
    assert stats()["cached"] == 0 and stats()["used"] == 0
    assert core.trim(0, 0) == 0
    assert frees(cache) == before + 8  # nothing twice


def test_depth_per_key(cache):
    depth = core.CACHE_DEPTH
    assert depth == 64
    size = MIB // 2  # depth + 4 of them fit under the fixture's 64 MiB cap
    ptrs = [core.alloc(0, size, 0, CUPY)[1] for _ in range(depth + 4)]
    before = frees(cache)
    for p in ptrs:
        core.free(p)
    # `depth` per (stream, size) in the lists, the oldest ones, and beside them the thread's
    # newest freed block in its slot; the blocks between went back to the pool
    assert stats()["cached"] == (depth + 1) * size
    assert frees(cache) == before + 3
    assert core.alloc(0, size, 0, CUPY) == (0, ptrs[-1])  # the most recent of the key
    assert core.alloc(0, size, 0, CUPY) == (0, ptrs[depth - 1])  # then the lists' newest
    core.free(ptrs[depth - 1])
    core.free(ptrs[-1])


def test_depth_per_key_with_the_thread_slots_off(cache):
    core.set_cache_thread_slots(0, False)
    try:
        depth = core.CACHE_DEPTH
        size = MIB // 2
        ptrs = [core.alloc(0, size, 0, CUPY)[1] for _ in range(depth + 4)]
        before = frees(cache)
        for p in ptrs:
            core.free(p)
        assert stats()["cached"] == depth * size  # `depth` per (stream, size), no more
        assert frees(cache) == before + 4
        assert core.alloc(0, size, 0, CUPY) == (0, ptrs[depth - 1])
        core.free(ptrs[depth - 1])
    finally:
        core.set_cache_thread_slots(0, True)


# ---- the thread slots: each thread's newest freed block (cache.c) ----
def _in_thread(fn):
    """fn() on a new thread; returns once that thread has ended in full, its pthread key
    destructors run: the core's (cache.c: slots_thread_ended) leaves the thread's slots
    unowned there, for the next thread to take over.  Thread.join alone may return before
    (CPython 3.11 wakes it as the thread's Python state is deleted; the thread runs its key
    destructors after that, as it exits): on a loaded machine the next thread then found the
    slot still owned.  The thread's entry under /proc/self/task goes only after they ran."""
    import os
    import threading
    import time

    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    task = f"/proc/self/task/{t.native_id}"
    deadline = time.monotonic() + 60
    while os.path.exists(task):
        assert time.monotonic() < deadline, f"{task} still there 60 s after its thread's join"
        time.sleep(0.001)
    return out[0]


def test_a_thread_s_newest_free_is_its_next_allocation_without_a_driver_call(cache):
    rc, p = core.alloc(0, 2 * MIB, 0, TORCH)
    calls = (cache.standin_counter(0), frees(cache))
    core.free(p)
    s = stats()
    assert (s["cached"], s["cached_large"], s["tags"][TORCH]["current"]) == (2 * MIB, 2 * MIB, 0)
    for _ in range(1000):  # the turns' loop: every pair from the slot
        rc, q = core.alloc(0, 2 * MIB, 0, TORCH)
        assert (rc, q) == (0, p)
        assert stats()["cached"] == 0 and stats()["tags"][TORCH]["current"] == 2 * MIB
        core.free(q)
    assert (cache.standin_counter(0), frees(cache)) == calls
    assert stats()["num_cache_hits"] >= 1000


def test_a_block_in_another_thread_s_slot_is_found_by_a_miss(cache):
    """A block another thread freed last (in its slot) serves this thread's allocation of
    its key, as the shared lists would: no driver call, the figures moved once."""
    p = _in_thread(lambda: core.alloc(0, 3 * MIB, 0, CUPY)[1])
    _in_thread(lambda: core.free(p))  # that thread's slot; the thread has ended

    def slot_of_a_live_thread():
        rc, q = core.alloc(0, 5 * MIB, 0, CUPY)
        core.free(q)  # parked in this (live) thread's slot
        return q

    import threading

    parked, go = [], threading.Event()

    def keep_alive():
        parked.append(slot_of_a_live_thread())
        go.wait(10)

    t = threading.Thread(target=keep_alive)
    t.start()
    while not parked:
        pass
    try:
        assert stats()["cached"] == 8 * MIB
        allocs = cache.standin_counter(0)
        assert core.alloc(0, 3 * MIB, 0, TORCH) == (0, p)  # an ended thread's slot
        assert core.alloc(0, 5 * MIB, 0, TORCH) == (0, parked[0])  # a live thread's
        assert cache.standin_counter(0) == allocs
        assert stats()["cached"] == 0 and stats()["tags"][TORCH]["current"] == 8 * MIB
    finally:
        go.set()
        t.join()
    core.free(p)
    core.free(parked[0])


def test_a_new_thread_takes_over_an_ended_thread_s_slot_and_its_block(cache):
    p = _in_thread(lambda: core.alloc(0, MIB, 0, CUPY)[1])
    _in_thread(lambda: core.free(p))
    assert stats()["cached"] == MIB
    # a new thread frees another block: the ended thread's slot is taken over, its block
    # moved into the lists as the newest below this one (nothing lost, nothing freed)
    before = frees(cache)
    q = core.alloc(0, 2 * MIB, 0, CUPY)[1]
    _in_thread(lambda: core.free(q))
    assert stats()["cached"] == 3 * MIB and frees(cache) == before
    assert core.alloc(0, MIB, 0, CUPY) == (0, p)
    assert core.alloc(0, 2 * MIB, 0, CUPY) == (0, q)
    core.free(p)
    core.free(q)


def test_the_oldest_block_is_evicted_first_when_the_threads_that_freed_them_ended(cache):
    """An ended thread gives up its slot: the next thread to free takes it over and moves
    the older block into the lists, so a free past the cap gives back the oldest block,
    as it does within one thread. (A slot kept by its dead owner would hold the older
    blocks as if they were the newest, and the newest free would go to the driver.)"""
    core.set_cache(0, 1 << 30)  # the large tier's cap: 64 MiB
    a, b = (core.alloc(0, n * MIB, 0, CUPY)[1] for n in (30, 31))
    _in_thread(lambda: core.free(a))  # a in that thread's slot; the thread ends
    _in_thread(lambda: core.free(b))  # the slot taken over: a to the lists, b in the slot
    assert stats()["cached"] == 61 * MIB
    rc, c = core.alloc(0, 4 * MIB, 0, CUPY)
    before = frees(cache)
    core.free(c)  # 65 MiB > 64: a, the oldest, goes to the driver
    assert frees(cache) == before + 1
    assert stats()["cached"] == 35 * MIB
    n = allocs(cache)
    assert core.alloc(0, 31 * MIB, 0, CUPY) == (0, b)
    assert core.alloc(0, 4 * MIB, 0, CUPY) == (0, c)
    assert allocs(cache) == n
    core.free(b)
    core.free(c)


def test_flush_trim_and_a_stream_s_end_reach_every_thread_s_slot(cache):
    core.register_stream(SIDE)
    on_side = _in_thread(lambda: core.alloc(0, MIB, SIDE, TORCH)[1])
    _in_thread(lambda: core.free(on_side))
    on_legacy = _in_thread(lambda: core.alloc(0, 2 * MIB, 0, TORCH)[1])
    _in_thread(lambda: core.free(on_legacy))
    rc, mine = core.alloc(0, 4 * MIB, 0, TORCH)
    core.free(mine)
    assert stats()["cached"] == 7 * MIB
    before = frees(cache)
    core.forget_stream(SIDE)  # the side stream's block, in an ended thread's slot
    assert frees(cache) == before + 1 and stats()["cached"] == 6 * MIB
    assert core.trim(0, 0) == 0  # the rest: another thread's slot and this thread's
    assert frees(cache) == before + 3
    s = stats()
    assert s["cached"] == s["cached_small"] == s["cached_large"] == s["used"] == 0
    assert core.trim(0, 0) == 0 and frees(cache) == before + 3  # nothing twice


def test_the_slot_s_bytes_are_in_the_tier_caps_and_the_budget(cache):
    core.set_cache(0, 4 * MIB)  # the limit: both tiers, the slots included
    rc, a = core.alloc(0, 3 * MIB, 0, CUPY)
    rc, b = core.alloc(0, 3 * MIB, 0, CUPY)
    core.free(a)  # in the slot
    core.free(b)  # a into the lists would pass the limit: a goes back, b takes the slot
    s = stats()
    assert s["cached"] == 3 * MIB and s["used"] == 3 * MIB
    assert core.alloc(0, 3 * MIB, 0, CUPY) == (0, b)
    core.set_limit(0, 10 * MIB)
    core.free(b)
    rc, c = core.alloc(0, 8 * MIB, 0, TORCH)  # fits only with the slot's block given back
    assert rc == 0 and stats()["cached"] == 0 and stats()["used"] == 8 * MIB
    core.free(c)
    core.set_limit(0, 0)


def test_a_block_alone_in_its_thread_s_slot_stays_within_the_limit(cache):
    """The large tier is empty, but the small one leaves too little of the limit: a block
    the thread allocated last and frees is not parked past the limit, it goes back."""
    core.set_cache(0, 4 * MIB)
    small = core.alloc(0, MIB, 0, CUPY)[1]
    _in_thread(lambda: core.free(small))  # 1 MiB in the small tier (an ended thread's slot)
    rc, big = core.alloc(0, 3 * MIB + MIB // 2, 0, CUPY)  # this thread's memo names it
    before = frees(cache)
    core.free(big)  # 1 MiB + 3.5 MiB > 4 MiB: not kept
    assert frees(cache) == before + 1
    s = stats()
    assert s["cached"] == s["cached_small"] == MIB and s["cached_large"] == 0
    assert core.alloc(0, MIB, 0, CUPY) == (0, small)
    core.free(small)


def test_many_sizes_on_many_streams(cache):
    """Sizes that are multiples of 1 MiB on 8 long-lived streams: all found while the
    cap allows; past a small cap, the most recently cached survive."""
    streams = [0x10000 * (k + 1) for k in range(8)]
    for st in streams:
        core.register_stream(st)
    try:
        core.set_cache(0, 8 << 30)
        core.set_cache_fraction(0, 1 / 16, 8 << 30)
        core.set_cache_tiers(0, MIB, 8 << 30)
        keys = [(st, i * MIB) for st in streams for i in range(1, 33)]  # 256 keys, 4.1 GiB
        ptrs = {}
        for st, size in keys:
            rc, ptrs[st, size] = core.alloc(0, size, st, CUPY)
            assert rc == 0
        for k in keys:
            core.free(ptrs[k])
        assert stats()["cached"] == sum(size for _, size in keys)
        n = allocs(cache)
        for k in keys:
            assert core.alloc(0, k[1], k[0], CUPY) == (0, ptrs[k])
        assert allocs(cache) == n
        core.set_cache_fraction(0, 0.0, 4 * MIB)  # caps 4 and 64 MiB from the next put on
        core.set_cache_tiers(0, MIB, 64 * MIB)
        for k in keys:
            core.free(ptrs[k])
        s = stats()
        assert s["cached_small"] == 4 * MIB  # four of the eight 1 MiB blocks
        assert 0 < s["cached_large"] <= 64 * MIB
        assert s["cached"] == s["cached_small"] + s["cached_large"]
        n = allocs(cache)
        for tier, cached in ((MIB, s["cached_small"]), (None, s["cached_large"])):
            kept = [k for k in keys[::-1] if (k[1] == MIB) == (tier == MIB)]
            total = 0
            for k in kept:  # each tier's newest first, until its bytes are accounted for
                if total + k[1] > cached:
                    break
                assert core.alloc(0, k[1], k[0], CUPY) == (0, ptrs[k])
                total += k[1]
                core.free(ptrs[k])
            assert total == cached
        assert allocs(cache) == n
    finally:
        core.set_cache(0, 0)
        for st in streams:
            core.forget_stream(st)


def test_cache_fraction_and_floor_are_set_and_reported(cache):
    assert core.set_cache_fraction(0, 0.25, 32 * MIB) == 0
    s = stats()
    assert s["cache_fraction"] == 0.25 and s["cache_floor"] == 32 * MIB
    assert core.set_cache_fraction(0, -1.0) == 7  # INVALID
    assert core.set_cache_fraction(0, float("nan")) == 7
    assert core.set_cache_fraction(0, 1 / 16) == 0
    s = stats()
    assert s["cache_fraction"] == 1 / 16 and s["cache_floor"] == 64 * MIB


def test_a_fork_child_forgets_the_cached_blocks(cache):
    import os

    core.set_cache(0, 1 << 30)
    rc, p = core.alloc(0, 2 * MIB, 0, CUPY)
    core.free(p)
    assert stats()["cached"] == 2 * MIB
    pid = os.fork()
    if pid == 0:
        os._exit(0 if stats()["cached"] == 0 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert core.alloc(0, 2 * MIB, 0, CUPY) == (0, p)  # the parent's cache is intact
    core.free(p)


@pytest.mark.parametrize(
    ("env", "expect"),
    [
        ({}, (1 / 16, 64 * MIB)),
        ({"BRIDGE_CACHE_FRACTION": "0.25", "BRIDGE_CACHE_FLOOR": "16MiB"}, (0.25, 16 * MIB)),
        ({"BRIDGE_CACHE_FRACTION": "10%"}, (0.1, 64 * MIB)),
    ],
)
def test_cache_fraction_and_floor_from_the_environment(standin, env, expect):
    fraction, floor = _device_1_stats(env, "s['cache_fraction'], s['cache_floor']").split()
    assert abs(float(fraction) - expect[0]) < 1e-4 and int(floor) == expect[1]


# ---- two tiers: blocks <= small_max (1 MiB) under the live-bytes cap, larger ones
# under a fixed cap (64 MiB); each tier evicts only its own least recently cached ----


def test_a_large_block_cached_does_not_evict_small_ones(cache):
    """The small tier is at its cap (the floor, 8 MiB, nothing live): a 40 MiB
    block is cached beside it, and every small block stays."""
    core.set_cache(0, 1 << 30)
    core.set_cache_fraction(0, 1 / 16, 8 * MIB)
    small = [core.alloc(0, MIB, 0, CUPY)[1] for _ in range(8)]
    rc, big = core.alloc(0, 40 * MIB, 0, TORCH)
    for p in small:
        core.free(p)
    before = frees(cache)
    core.free(big)
    s = stats()
    assert (s["cached_small"], s["cached_large"]) == (8 * MIB, 40 * MIB)
    assert s["cached"] == 48 * MIB and frees(cache) == before
    n = allocs(cache)
    for p in reversed(small):
        assert core.alloc(0, MIB, 0, CUPY) == (0, p)
    assert core.alloc(0, 40 * MIB, 0, TORCH) == (0, big)
    assert allocs(cache) == n
    for p in small + [big]:
        core.free(p)


def test_small_blocks_do_not_evict_large_ones(cache):
    """The small tier past its cap evicts its own oldest; the large blocks cached
    before them stay."""
    core.set_cache(0, 1 << 30)
    core.set_cache_fraction(0, 1 / 16, 4 * MIB)
    large = [core.alloc(0, n * MIB, 0, TORCH)[1] for n in (20, 30)]
    small = [core.alloc(0, 512 * 1024, 0, CUPY)[1] for _ in range(12)]
    for p in large + small:
        core.free(p)
    s = stats()
    assert s["cached_large"] == 50 * MIB
    assert s["cached_small"] == 4 * MIB  # the 8 newest of the 12
    assert core.alloc(0, 20 * MIB, 0, TORCH) == (0, large[0])  # the oldest block cached
    assert core.alloc(0, 512 * 1024, 0, CUPY) == (0, small[-1])
    core.free(large[0])
    core.free(small[-1])


def test_the_large_tiers_cap_is_fixed(cache):
    """64 MiB whatever the live bytes: a 64 MiB loop keeps hitting, a second 64 MiB
    block evicts the first, a 128 MiB block is not kept."""
    core.set_cache(0, 4 << 30)
    rc, live = core.alloc(0, 8 << 30, 0, TORCH)  # live / 16 = 512 MiB: not the large cap
    n, hits = allocs(cache), stats()["num_cache_hits"]
    for _ in range(10):
        rc, p = core.alloc(0, 64 * MIB, 0, CUPY)
        assert rc == 0
        core.free(p)
    assert allocs(cache) == n + 1 and stats()["num_cache_hits"] == hits + 9
    a = core.alloc(0, 64 * MIB, 0, CUPY)[1]
    b = core.alloc(0, 64 * MIB, 0, CUPY)[1]
    before = frees(cache)
    core.free(a)
    core.free(b)  # a (the older) goes back to the pool
    assert frees(cache) == before + 1 and stats()["cached_large"] == 64 * MIB
    assert core.alloc(0, 64 * MIB, 0, CUPY) == (0, b)
    core.free(b)
    rc, c = core.alloc(0, 128 * MIB, 0, CUPY)
    before = frees(cache)
    core.free(c)  # above the cap: not kept, and b stays
    assert frees(cache) == before + 1 and stats()["cached_large"] == 64 * MIB
    core.free(live)


def test_the_small_tier_follows_the_live_bytes_and_the_limit(cache):
    core.set_cache(0, 1 << 30)
    core.set_cache_fraction(0, 1 / 16, MIB)
    rc, live = core.alloc(0, 64 * MIB, 0, TORCH)  # cap 4 MiB
    small = [core.alloc(0, MIB, 0, CUPY)[1] for _ in range(6)]
    for p in small:
        core.free(p)
    assert stats()["cached_small"] == 4 * MIB
    core.set_cache(0, 2 * MIB)  # the limit wins from the next put on
    rc, p = core.alloc(0, 4096, 0, CUPY)
    core.free(p)
    assert stats()["cached_small"] == MIB + 4096  # the limit leaves room for it
    core.set_cache(0, 64 * MIB)
    core.set_cache_tiers(0, MIB, 64 * MIB)
    rc, big = core.alloc(0, 63 * MIB, 0, CUPY)
    core.free(big)  # the large tier's room under the limit: 64 MiB - the small tier's
    assert stats()["cached_large"] == 0
    core.free(live)


def test_the_limit_bounds_both_tiers_together(cache):
    core.set_cache(0, 48 * MIB)
    core.set_cache_fraction(0, 1 / 16, 64 * MIB)
    rc, big = core.alloc(0, 40 * MIB, 0, TORCH)
    core.free(big)
    assert stats()["cached_large"] == 40 * MIB
    small = [core.alloc(0, MIB, 0, CUPY)[1] for _ in range(12)]
    for p in small:
        core.free(p)
    s = stats()
    assert s["cached_small"] == 8 * MIB and s["cached_large"] == 40 * MIB  # the small tier's room
    assert s["cached"] <= 48 * MIB


def test_cache_tiers_are_set_and_reported(cache):
    s = stats()
    assert (s["cache_small_max"], s["cache_large_cap"]) == (MIB, 64 * MIB)
    assert s["cached_small"] == s["cached_large"] == 0
    assert core.set_cache_tiers(0, 4 * MIB, 128 * MIB) == 0
    s = stats()
    assert (s["cache_small_max"], s["cache_large_cap"]) == (4 * MIB, 128 * MIB)
    core.set_cache(0, 1 << 30)
    rc, p = core.alloc(0, 3 * MIB, 0, CUPY)  # small now
    core.free(p)
    assert (stats()["cached_small"], stats()["cached_large"]) == (3 * MIB, 0)
    assert core.set_cache_tiers(0) == 0  # the defaults; the block stays in its tier
    s = stats()
    assert (s["cache_small_max"], s["cache_large_cap"]) == (MIB, 64 * MIB)
    assert (s["cached_small"], s["cached_large"]) == (3 * MIB, 0)
    assert core.alloc(0, 3 * MIB, 0, CUPY) == (0, p)
    assert stats()["cached"] == stats()["cached_small"] == 0
    core.free(p)
    assert (stats()["cached_small"], stats()["cached_large"]) == (0, 3 * MIB)
    assert core.set_cache_tiers(5) == 6  # DEVICE: no such device


def test_flush_trim_and_fork_empty_both_tiers(cache):
    import os

    core.set_cache(0, 1 << 30)
    core.register_stream(SIDE)
    ptrs = [core.alloc(0, n, st, CUPY)[1] for n in (4096, MIB, 8 * MIB) for st in (0, SIDE)]
    for p in ptrs:
        core.free(p)
    assert stats()["cached_small"] == 2 * (MIB + 4096) and stats()["cached_large"] == 16 * MIB
    pid = os.fork()
    if pid == 0:
        s = stats()
        os._exit(0 if s["cached"] == s["cached_small"] == s["cached_large"] == 0 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    before = frees(cache)
    core.forget_stream(SIDE)  # both tiers' blocks of the stream go back
    assert frees(cache) == before + 3
    assert stats()["cached_small"] == MIB + 4096 and stats()["cached_large"] == 8 * MIB
    assert core.trim(0, 0) == 0
    assert frees(cache) == before + 6
    s = stats()
    assert s["cached"] == s["cached_small"] == s["cached_large"] == s["used"] == 0


def test_trim_after_a_full_batch_trims_both_tiers(cache):
    """cache_trim (after a put evicted a full batch) takes each tier down to its cap."""
    core.set_cache(0, 1 << 30)
    core.set_cache_fraction(0, 1 / 16, 64 * MIB)
    small = [core.alloc(0, 4096 * (i + 1), 0, CUPY)[1] for i in range(40)]
    large = [core.alloc(0, 2 * MIB, 0, CUPY)[1] for _ in range(16)]
    for p in small + large:
        core.free(p)
    assert stats()["cached_large"] == 32 * MIB
    core.set_cache_fraction(0, 0.0, 4096)  # the small tier's cap: 4 KiB at its next put
    core.set_cache_tiers(0, MIB, 4 * MIB)
    rc, p = core.alloc(0, 3 * MIB, 0, CUPY)
    core.free(p)  # evicts 16 large blocks (a full batch): cache_trim goes on
    s = stats()
    assert s["cached_large"] <= 4 * MIB and s["cached_small"] <= 4096


@pytest.mark.parametrize(
    ("env", "expect"),
    [
        ({}, (MIB, 64 * MIB)),
        (
            {"BRIDGE_CACHE_SMALL_MAX": "4MiB", "BRIDGE_CACHE_LARGE_CAP": "256MiB"},
            (4 * MIB, 256 * MIB),
        ),
        ({"BRIDGE_CACHE_LARGE_CAP": "0"}, (MIB, 0)),
    ],
)
def test_cache_tiers_from_the_environment(standin, env, expect):
    out = _device_1_stats(env, "s['cache_small_max'], s['cache_large_cap']")
    assert tuple(int(x) for x in out.split()) == expect


# ---- the large tier's share of the live bytes (BRIDGE_CACHE_LARGE_FRACTION) ----
def test_the_large_tier_keeps_one_block_where_little_is_live(cache):
    """With little live, the large tier's cap is the block being cached: each free
    evicts the older large blocks, and a loop of one large size still hits."""
    core.set_cache(0, 1 << 30)
    core.set_cache_large_fraction(0, 1 / 8)
    blocks = [core.alloc(0, 16 * MIB, 0, TORCH)[1] for _ in range(4)]
    before = frees(cache)
    for p in blocks:
        core.free(p)
    assert stats()["cached_large"] == 16 * MIB  # the newest alone
    assert frees(cache) == before + 3  # the three older ones went back to the pool
    allocs = cache.standin_counter(0)
    for _ in range(3):  # one size in a loop: served from the cache every time
        rc, p = core.alloc(0, 16 * MIB, 0, TORCH)
        assert rc == 0 and p == blocks[-1]
        core.free(p)
    assert cache.standin_counter(0) == allocs
    # a 64 MiB block (the large cap) with nothing else live is kept too
    rc, big = core.alloc(0, 64 * MIB, 0, TORCH)
    core.free(big)
    assert stats()["cached_large"] == 64 * MIB
    assert core.alloc(0, 64 * MIB, 0, TORCH) == (0, big)
    core.free(big)


def test_the_large_tier_follows_the_live_bytes_up_to_its_cap(cache):
    core.set_cache(0, 1 << 30)
    core.set_cache_large_fraction(0, 1 / 8)
    rc, held = core.alloc(0, 256 * MIB, 0, OTHER)  # live: 256 MiB -> a share of 32 MiB
    blocks = [core.alloc(0, 8 * MIB, 0, TORCH)[1] for _ in range(6)]
    for p in blocks:
        core.free(p)
    assert stats()["cached_large"] == 32 * MIB  # four of the six
    more = [core.alloc(0, 8 * MIB, 0, TORCH)[1] for _ in range(6)]
    core.free(held)
    rc, held = core.alloc(0, 1 << 30, 0, OTHER)  # live 1 GiB: 128 MiB, above the cap
    for p in more:
        core.free(p)
    assert stats()["cached_large"] == 48 * MIB  # all six: under the 64 MiB cap
    core.free(held)


def test_a_large_fraction_of_zero_is_the_fixed_cap(cache):
    core.set_cache(0, 1 << 30)
    assert core.set_cache_large_fraction(0, 0) == 0
    blocks = [core.alloc(0, 16 * MIB, 0, TORCH)[1] for _ in range(4)]
    for p in blocks:
        core.free(p)
    assert stats()["cached_large"] == 64 * MIB  # all four, whatever is live
    assert stats()["cache_large_fraction"] == 0


def test_the_large_fraction_is_set_checked_and_reported(cache):
    assert core.set_cache_large_fraction(0, 0.25) == 0
    assert stats()["cache_large_fraction"] == 0.25
    from bridge._errors import Status

    assert core.set_cache_large_fraction(0, -0.5) == Status.INVALID  # nothing changed
    assert core.set_cache_large_fraction(0, float("nan")) == Status.INVALID
    assert stats()["cache_large_fraction"] == 0.25
    assert core.set_cache_large_fraction(5, 0.5) == Status.DEVICE


@pytest.mark.parametrize(
    ("env", "expect"),
    [
        ({}, 0.125),
        ({"BRIDGE_CACHE_LARGE_FRACTION": "25%"}, 0.25),
        ({"BRIDGE_CACHE_LARGE_FRACTION": "0"}, 0.0),
    ],
)
def test_the_large_fraction_from_the_environment(standin, env, expect):
    out = _device_1_stats(env, "s['cache_large_fraction']")
    assert float(out) == expect


def test_a_bad_large_fraction_in_the_environment_names_the_variable(standin, monkeypatch):
    from bridge import _runtime

    monkeypatch.setenv("BRIDGE_CACHE_LARGE_FRACTION", "half")
    with pytest.raises(ValueError, match="BRIDGE_CACHE_LARGE_FRACTION='half'"):
        _runtime.cache_large_fraction_from_env()


# ---- a block parked with its record (park.h): the table left out of the cycle ----
# A block the thread allocated last and frees goes to the thread's slot with its record
# still in the table.  Every table reader (a lookup too) drops the thread's copy of the
# record, so these tests read the table only after a free, or where they mean to.
def _cycled(size, tag, stream=0):
    """A block that has been through this thread's slot once, allocated again: the
    thread's next free of it parks it with its record."""
    rc, p = core.alloc(0, size, stream, tag)
    core.free(p)  # the thread's slot (made now if it had none)
    rc, q = core.alloc(0, size, stream, tag)
    assert (rc, q) == (0, p)
    return p


def test_a_block_parked_with_its_record_is_unknown_to_every_reader(cache):
    """The thread's own free parks the block with its record still in the table: lookups,
    the live blocks, the count and a second free must all see a freed block."""
    records, bad, parked = core.live_records(), stats()["num_bad_frees"], core.parked_records()
    p = _cycled(2 * MIB, TORCH)
    core.free(p)
    assert core.parked_records() == parked + 1  # the table kept its record
    assert core.lookup(p)[0] != 0
    assert p not in [b[0] for b in core.live_blocks()]
    assert core.live_records() == records
    assert stats()["cached"] == 2 * MIB and stats()["tags"][TORCH]["current"] == 0
    core.free(p)  # a double free: counted, nothing else changes
    assert stats()["num_bad_frees"] == bad + 1
    assert stats()["cached"] == 2 * MIB and stats()["tags"][TORCH]["current"] == 0
    assert core.free_cached(p) != 0  # the cache-only free misses it too
    assert core.record_stream(p, SIDE) != 0
    rc, q = core.alloc(0, 2 * MIB, 0, TORCH)  # back live, its record as it was
    assert core.parked_records() == parked
    assert (rc, q) == (0, p) and core.lookup(p) == (0, 2 * MIB, 0, TORCH)
    assert core.live_records() == records + 1
    core.free(p)
    assert core.live_records() == records


def test_a_parked_block_taken_by_another_tag_or_thread_has_that_owner_s_record(cache):
    records, parked = core.live_records(), core.parked_records()
    p = _cycled(3 * MIB, TORCH)
    core.free(p)  # parked with torch's record
    assert core.parked_records() == parked + 1
    assert core.alloc(0, 3 * MIB, 0, CUPY) == (0, p)  # the same thread, another tag
    assert core.parked_records() == parked
    assert stats()["tags"][CUPY]["current"] == 3 * MIB
    assert stats()["tags"][TORCH]["current"] == 0
    core.free(p)  # parked again, now with CuPy's record
    assert core.parked_records() == parked + 1 and core.lookup(p)[0] != 0
    got = _in_thread(lambda: (core.alloc(0, 3 * MIB, 0, OTHER), core.lookup(p)))
    assert got == ((0, p), (0, 3 * MIB, 0, OTHER))  # claimed from this thread's slot
    assert core.parked_records() == parked
    assert core.live_records() == records + 1
    s = stats()
    assert s["tags"][CUPY]["current"] == 0 and s["tags"][OTHER]["current"] == 3 * MIB
    core.free(p)
    assert core.live_records() == records and core.lookup(p)[0] != 0


def test_a_stream_recorded_after_the_allocation_is_not_forgotten_by_the_free(cache):
    """record_stream changes the table's record: the allocating thread's copy of it
    must not be what its free goes by (the block would be cached without waiting)."""
    parked = core.parked_records()
    p = _cycled(2 * MIB, TORCH)
    assert core.record_stream(p, SIDE) == 0
    before = frees(cache)
    core.free(p)
    assert core.parked_records() == parked
    assert stats()["cached"] == 0  # a recorded block is never cached
    assert frees(cache) == before + 1 and core.lookup(p)[0] != 0


def test_flush_trim_and_the_next_free_take_a_parked_block_s_record_out(cache):
    records, parked = core.live_records(), core.parked_records()
    p = _cycled(MIB, TORCH)
    core.free(p)
    assert core.parked_records() == parked + 1
    before = frees(cache)
    assert core.trim(0, 0) == 0  # back to the pool: its record too
    assert frees(cache) == before + 1 and core.live_records() == records
    assert core.parked_records() == parked
    assert core.lookup(p)[0] != 0
    rc, p = core.alloc(0, MIB, 0, TORCH)  # from the pool: a record of its own
    assert core.lookup(p) == (0, MIB, 0, TORCH) and core.live_records() == records + 1
    core.free(p)
    # the next free moves the parked block out of the slot into the lists
    rc, q = core.alloc(0, 4 * MIB, 0, TORCH)
    rc, p = core.alloc(0, MIB, 0, TORCH)
    core.free(p)  # parked with its record
    assert core.parked_records() == parked + 1
    core.free(q)  # q takes the slot; p goes to the lists without its record
    assert core.parked_records() == parked
    assert core.live_records() == records and core.lookup(p)[0] != 0
    assert stats()["cached"] == 5 * MIB
    assert core.alloc(0, MIB, 0, CUPY) == (0, p) and core.lookup(p) == (0, MIB, 0, CUPY)
    assert core.alloc(0, 4 * MIB, 0, CUPY) == (0, q)
    core.free(p)
    core.free(q)
    assert core.live_records() == records


def test_the_cache_only_calls_park_and_take_back_a_block_with_its_record(cache):
    records, parked = core.live_records(), core.parked_records()
    p = _cycled(MIB, CUPY)
    allocs = cache.standin_counter(0)
    for _ in range(100):  # CuPy's pair, no table reader between
        assert core.free_cached(p) == 0
        assert core.alloc_cached(0, MIB, 0, CUPY) == (0, p)
    assert core.free_cached(p) == 0
    assert core.parked_records() == parked + 1
    assert core.lookup(p)[0] != 0 and core.live_records() == records
    assert cache.standin_counter(0) == allocs
    assert core.alloc_cached(0, MIB, 0, CUPY) == (0, p)
    assert core.lookup(p) == (0, MIB, 0, CUPY) and core.live_records() == records + 1
    core.free(p)
    assert core.live_records() == records


# A parked block stays in its tag's live bytes and allocations (park.h: neither its park nor
# its owner's take back changes a shared figure); every reader of those figures, the peaks
# and the tag's cap take the parked blocks out.
TAG_LIMIT = 8


def _tag(tag=TORCH):
    return stats()["tags"][tag]


def test_a_parked_block_is_out_of_the_figures_the_peaks_and_a_peak_reset(cache):
    p = _cycled(4 * MIB, TORCH)
    core.free(p)  # parked with its record
    t = _tag()
    assert (t["current"], t["count"]) == (0, 0)
    assert core.reset_peak(0, TORCH) == 0
    t = _tag()
    assert (t["peak"], t["count_peak"]) == (0, 0)  # what is live, the parked block out
    rc, q = core.alloc(0, MIB, 0, TORCH)  # another size: p stays parked
    assert rc == 0 and q != p
    t = _tag()
    assert (t["current"], t["peak"], t["count"], t["count_peak"]) == (MIB, MIB, 1, 1)
    core.free(q)  # q takes the slot; p goes to the lists, out of the tag's figures
    t = _tag()
    assert (t["current"], t["count"], t["peak"], t["count_peak"]) == (0, 0, MIB, 1)
    assert stats()["cached"] == 5 * MIB


def test_a_parked_block_taken_back_after_a_peak_reset_raises_the_peaks(cache):
    p = _cycled(4 * MIB, TORCH)
    core.free(p)
    assert core.reset_peak(0, TORCH) == 0
    allocs = _tag()["num_allocs"]
    assert core.alloc(0, 4 * MIB, 0, TORCH) == (0, p)  # back live, no shared figure changed
    t = _tag()
    assert (t["current"], t["peak"], t["count"], t["count_peak"]) == (4 * MIB, 4 * MIB, 1, 1)
    assert t["num_allocs"] == allocs + 1
    core.free(p)
    t = _tag()
    assert (t["current"], t["count"], t["peak"]) == (0, 0, 4 * MIB)
    assert t["num_frees"] == t["num_allocs"]


def test_the_tag_s_cap_leaves_a_parked_block_out_and_counts_it_when_it_comes_back(cache):
    p = _cycled(4 * MIB, TORCH)
    core.free(p)  # parked: 4 MiB still in torch's `current`, not live
    assert core.set_tag_limit(0, TORCH, 4 * MIB) == 0
    try:
        rc, q = core.alloc(0, 4 * MIB, SIDE, TORCH)  # another stream: up to the cap
        assert rc == 0 and q != p
        assert _tag()["current"] == 4 * MIB
        core.free(q)
    finally:
        core.set_tag_limit(0, TORCH, 0)
    t = _tag()
    assert (t["current"], t["count"]) == (0, 0)


def test_a_parked_block_past_a_lowered_cap_is_refused_at_its_take_back(cache):
    p = _cycled(4 * MIB, TORCH)
    core.free(p)  # parked with its record
    assert core.set_tag_limit(0, TORCH, 2 * MIB) == 0
    try:
        assert core.alloc(0, 4 * MIB, 0, TORCH) == (TAG_LIMIT, 0)
        t = _tag()
        assert (t["current"], t["count"], t["num_ooms"]) == (0, 0, 1)
        assert core.lookup(p)[0] != 0  # its record out of the table, the block to the pool
    finally:
        core.set_tag_limit(0, TORCH, 0)
    rc, q = core.alloc(0, 4 * MIB, 0, TORCH)
    assert rc == 0 and core.lookup(q) == (0, 4 * MIB, 0, TORCH)
    core.free(q)


def test_reserved_peak_survives_a_flush_of_the_cache_until_a_peak_reset(cache):
    # torch's max_memory_reserved: the live bytes, graph blocks and the cache
    core.reset_peak(0, TORCH)
    rc, a = core.alloc(0, 8 * MIB, 0, TORCH)
    core.free(a)  # 8 MiB cached
    rc, b = core.alloc(0, 4 * MIB, 0, TORCH)  # another size: 4 MiB live
    assert core.trim(0) == 0  # empty_cache, with no read of the figures before it
    t = stats()["tags"][TORCH]
    assert stats()["cached"] == 0 and t["current"] == 4 * MIB
    assert t["peak"] == 8 * MIB and t["reserved_peak"] == 12 * MIB
    assert core.reset_peak(0, TORCH) == 0
    assert stats()["tags"][TORCH]["reserved_peak"] == 4 * MIB  # what is reserved now
    core.free(b)


def test_reserved_peak_is_raised_where_the_figures_are_read(cache):
    core.reset_peak(0, TORCH)
    rc, a = core.alloc(0, 8 * MIB, 0, TORCH)
    core.free(a)
    rc, b = core.alloc(0, 4 * MIB, 0, TORCH)
    assert stats()["tags"][TORCH]["reserved_peak"] == 12 * MIB
    core.free(b)  # 12 MiB cached, 0 live
    core.set_cache(0, 0)  # the cache off: flushed
    assert stats()["tags"][TORCH]["reserved_peak"] == 12 * MIB
