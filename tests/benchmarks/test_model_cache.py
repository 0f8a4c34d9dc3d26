# SPDX-License-Identifier: Apache-2.0
"""benchmarks/model_cache.py: the pool model and the cache policies (CPU)."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import model_cache as mc  # noqa: E402

MIB = mc.MIB


def test_the_heap_maps_32_mib_chunks_and_reuses_coalesced_ranges():
    h = mc.Heap()
    a = h.alloc(512)
    assert h.top == 32 * MIB  # a 512 B request maps a whole chunk, as on the H200
    b = h.alloc(33 * MIB)  # the free tail of the first chunk, and one more chunk
    assert b[0] == 512 and h.top == 64 * MIB
    h.release(*a)
    h.release(*b)
    assert h.free == [(0, h.top)]  # everything coalesced into one range
    c = h.alloc(40 * MIB)
    assert c[0] == 0 and h.top == 64 * MIB  # reused, no new chunk


EVENTS = []
for k in range(4):  # a step: four sizes alive together, freed, then again
    EVENTS += [[0, 10 * k + i, (i + 1) * 256 * 1024, 0] for i in range(4)]
    EVENTS += [[1, 10 * k + i] for i in range(4)]


@pytest.mark.parametrize("policy", ["none", "old", "lru", "tiers"])
def test_hits_and_memory_of_each_policy(policy):
    r = mc.replay(EVENTS, policy, passes=2)
    total = 2 * 16
    if policy == "none":
        assert r["hits"] == 0
    else:  # every size comes back: all but the first four allocations hit
        assert r["hits"] == (total - 4) / total
    live = sum((i + 1) * 256 * 1024 for i in range(4))
    assert r["reserved_over_live"] == 32 * MIB / live  # one chunk holds the step


def test_the_large_tier_has_a_fixed_cap_and_keeps_small_blocks():
    big = 48 * MIB
    ev = [[0, 1, big, 0], [0, 2, big, 0], [0, 3, 4096, 0], [1, 3], [1, 1], [1, 2]]
    ev += [[0, 4, 4096, 0], [0, 5, big, 0], [0, 6, big, 0]]
    r = mc.replay(ev, "tiers", passes=1)
    # the 4 KiB block and one 48 MiB block come back (the second does not fit 64 MiB)
    assert r["hits"] == 2 / 6


def test_blocks_live_at_the_end_of_a_pass_are_freed_through_the_cache():
    # as bench_trace.py's live.clear(): the 8 MiB block left live comes back next pass
    ev = [[0, 1, 8 * MIB, 0], [0, 2, 4096, 0], [1, 2]]
    r = mc.replay(ev, "tiers", passes=3)
    assert (r["cache_hits"], r["allocs"]) == (4, 6)


def test_zero_byte_allocations_make_none():
    ev = [[0, 1, 0, 0], [0, 2, 4096, 0], [1, 1], [1, 2]]
    r = mc.replay(ev, "tiers", passes=2, warmup=True)
    assert (r["cache_hits"], r["allocs"]) == (1, 3)  # torch.zeros(1), then 4 KiB twice


def test_settings_override_the_policy():
    big = 48 * MIB
    ev = [[0, 1, big, 0], [1, 1]]
    assert mc.replay(ev, "tiers", passes=2)["cache_hits"] == 1
    assert mc.replay(ev, "tiers", passes=2, large_cap=0)["cache_hits"] == 0
    assert mc.replay(ev, "tiers", passes=2, small_max=64 * MIB, large_cap=0)["cache_hits"] == 1


TRACES = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "traces"
SETTINGS = {
    "defaults": {},
    "one tier, 1/8": {"small_max": mc.DEVICE, "fraction": 1 / 8},
    "4 MiB, large 256 MiB": {"small_max": 4 * MIB, "large_cap": 256 * MIB},
    "a limit that binds": {"limit": 100 * MIB, "floor": 16 * MIB},
    "the large tier's cap fixed": {"large_fraction": 0},
    "the large tier at 1/32 of live": {"large_fraction": 1 / 32, "large_cap": 256 * MIB},
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_the_model_caches_as_cache_c_does(standin, setting):
    """The cached bytes after every event of the traces, the model's and cache.c's."""
    import gzip
    import json

    from bridge._runtime import core

    s = mc.replace(mc.POLICIES["tiers"], **SETTINGS[setting])
    assert s.depth == core.CACHE_DEPTH
    standin.standin_set_capacity(0, 1 << 50)  # the stand-in's pool never refuses here
    for name, passes in (("gpt2", 1), ("resnet50", 2), ("cupy-fft", 5)):
        with gzip.open(TRACES / f"{name}.json.gz") as f:
            events = json.load(f)["events"]
        core.set_cache(0, s.limit, s.max_block)
        core.set_cache_fraction(0, s.fraction, s.floor)
        core.set_cache_tiers(0, s.small_max, s.large_cap)
        core.set_cache_large_fraction(0, s.large_fraction)
        before = core.stats(0)[1]
        got = []
        for _ in range(passes):
            live = {}
            for e in events:
                if e[0] == 0:
                    rc, live[e[1]] = core.alloc(0, e[2], 0, 2)
                    assert rc == 0
                elif live[e[1]]:
                    core.free(live.pop(e[1]))
                got.append(core.stats(0)[1]["cached"])
            for p in live.values():
                if p:
                    core.free(p)
            got.append(core.stats(0)[1]["cached"])
        after = core.stats(0)[1]
        core.set_cache(0, 0)  # empties it for the next trace
        want: list = []
        r = mc.replay(events, "tiers", passes=passes, record=want, **SETTINGS[setting])
        assert after["num_retries"] == before["num_retries"]  # no refusal flushed the cache
        assert after["num_cache_hits"] - before["num_cache_hits"] == r["cache_hits"], name
        assert got == want, name


# ---- the carved classes (a model only) ----


def test_a_carver_takes_a_chunk_and_carves_best_fit_in_512_byte_steps():
    pool = mc.Pool()
    c = mc.Carver(pool, largest=MIB, chunk=2 * MIB, keep=mc.DEVICE)
    a, new_a = c.alloc(1000, 0)  # rounded to 1024 B
    b, new_b = c.alloc(1, 0)  # 512 B, right after it
    assert (new_a, new_b) == (True, False) and c.mapped == 1
    assert (a[2:], b[2:]) == ((0, 0, 1024), (0, 1024, 512))
    assert pool.reserved() == 32 * MIB and pool.calls == 1  # one driver call for the chunk
    c.free(a)
    d, _ = c.alloc(2048, 0)  # the 1 KiB hole is too small: the range after b
    assert d[3] == 1536
    e, _ = c.alloc(600, 0)  # best fit: the 1 KiB hole, not the large tail
    assert e[3] == 0
    assert c.mapped == 1 and c.held == 2 * MIB


def test_freed_blocks_coalesce_and_an_empty_chunk_goes_back_past_keep():
    pool = mc.Pool()
    c = mc.Carver(pool, largest=MIB, chunk=2 * MIB, keep=0)
    blocks = [c.alloc(MIB // 2, 0)[0] for _ in range(4)]  # fills the chunk exactly
    assert c.ranges[0] == [] and c.mapped == 1
    for i in (1, 3, 0):  # neighbours on both sides join
        c.free(blocks[i])
    assert c.ranges[0] == [(0, MIB), (3 * MIB // 2, MIB // 2)]
    assert c.returned == 0
    c.free(blocks[2])  # the last live block: the chunk is empty, keep is 0
    assert c.returned == 1 and c.held == 0 and c.fits[0] == []
    assert pool.calls == 2  # the chunk's allocation and its free


def test_empty_chunks_are_kept_within_keep_and_flushed_under_pressure():
    pool = mc.Pool()
    c = mc.Carver(pool, largest=MIB, chunk=2 * MIB, keep=2 * MIB)  # one empty chunk kept
    first = [c.alloc(MIB, 0)[0] for _ in range(2)]
    second = [c.alloc(MIB, 0)[0] for _ in range(2)]
    assert c.mapped == 2
    for blk in first + second:
        c.free(blk)
    assert c.returned == 1 and list(c.empty) == [1]  # the older empty chunk went back
    blk, new = c.alloc(4096, 0)
    assert not new and blk[2] == 1 and not c.empty  # the kept chunk serves again
    c.free(blk)
    c.flush()
    assert c.returned == 2 and c.held == 0


def test_a_lazy_carver_keeps_an_emptied_chunk_until_the_next_pool_call_or_carve():
    pool = mc.Pool()
    c = mc.Carver(pool, largest=mc.DEVICE, chunk=32 * MIB, keep=0, lazy=True)
    for _ in range(100):  # a loop of one large size: one chunk, carved again each time
        blk, _new = c.alloc(64 * MIB, 0)
        c.free(blk)
    assert c.mapped == 1 and c.returned == 0 and c.pending == [0]
    assert pool.calls == 1
    # a request it does not fit (another stream): the pending chunk goes back before the
    # pool is asked, so the pool never holds both
    other, new = c.alloc(MIB, 1)
    assert new and c.returned == 1 and pool.reserved() == 64 * MIB  # not 96: never both
    c.free(other)
    # a request it fits but that would take a smaller chunk now: returned, a new one taken
    c2 = mc.Carver(mc.Pool(), largest=mc.DEVICE, chunk=32 * MIB, keep=0, lazy=True)
    c2.free(c2.alloc(128 * MIB, 0)[0])
    small, new = c2.alloc(MIB, 0)
    assert new and c2.returned == 1 and c2.held == 32 * MIB
    # the eager carver returns it at every free
    c3 = mc.Carver(mc.Pool(), largest=mc.DEVICE, chunk=32 * MIB, keep=0)
    for _ in range(100):
        c3.free(c3.alloc(64 * MIB, 0)[0])
    assert c3.mapped == c3.returned == 100


def test_each_stream_carves_its_own_chunks_and_a_large_request_gets_its_own():
    pool = mc.Pool()
    c = mc.Carver(pool, largest=mc.DEVICE, chunk=32 * MIB, keep=mc.DEVICE)
    a, _ = c.alloc(4096, 0)
    b, new = c.alloc(4096, 1)  # another stream: never the first stream's free range
    assert new and a[2] != b[2]
    big, new = c.alloc(40 * MIB + 1, 0)  # larger than a chunk: one of its own, 2 MiB steps
    assert new and c.info[big[2]][3] == 42 * MIB


def test_carved_requests_never_reach_the_tiers_and_hit_once_their_chunk_is_there():
    ev = []
    for k in range(3):
        ev += [[0, 10 * k + i, 1000 * (i + 1), 0] for i in range(5)]  # five sizes, one chunk
        ev += [[1, 10 * k + i] for i in range(5)]
    r = mc.replay(ev, "carve-small", passes=2)
    assert (r["cache_hits"], r["allocs"]) == (29, 30)  # only the first takes a chunk
    assert r["chunks"][0]["mapped"] == 1 and r["driver_calls"] == 1
    # today's tiers: exact sizes, the first of each size misses
    t = mc.replay(ev, "tiers", passes=2)
    assert (t["cache_hits"], t["driver_calls"]) == (25, 5)


def test_the_candidate_returns_an_empty_medium_chunk_and_caps_the_large_tier_by_live():
    ev = [[0, 1, 4 * MIB, 0], [1, 1], [0, 2, 4 * MIB, 0], [1, 2]]
    r = mc.replay(ev, "carve", passes=1)
    med = r["chunks"][1]
    assert (med["largest"], med["chunk"]) == (10 * MIB, 64 * MIB)
    assert med["mapped"] == med["returned"] == 2 and r["cache_hits"] == 0  # keep 0
    # 48 MiB blocks with 64 MiB live: the large tier's cap is live/16 = 4 MiB, not 64 MiB
    big = [[0, 1, 64 * MIB, 0], [0, 2, 48 * MIB, 0], [1, 2], [0, 3, 48 * MIB, 0], [1, 3]]
    assert mc.replay(big, "tiers", passes=1)["cache_hits"] == 1
    assert mc.replay(big, "tiers-live16", passes=1)["cache_hits"] == 0
    assert mc.replay(big, "carve", passes=1)["cache_hits"] == 0


def test_the_floor_is_the_peak_of_live_bytes_in_whole_pool_chunks():
    ev = [[0, 1, 40 * MIB, 0], [0, 2, 8 * MIB, 0], [1, 1], [1, 2]]
    assert mc.floor(ev) == 64 / 48
    for policy in mc.POLICIES:  # no policy maps less than the floor
        assert mc.replay(ev, policy, passes=2)["reserved_over_live"] >= mc.floor(ev)


@pytest.mark.parametrize("name", ["gpt2", "resnet50", "cupy-fft"])
def test_on_the_traces_the_candidate_holds_what_it_carves_and_the_pool_never_less(name):
    """The committed traces under the candidate: the model's own consistency (every
    allocation counted once, the carved chunks inside the pool's reserved bytes, a
    chunk taken only on a miss), not its figures (benchmarks/results/probes.md gives those)."""
    import gzip
    import json

    with gzip.open(TRACES / f"{name}.json.gz") as f:
        events = json.load(f)["events"]
    r = mc.replay(events, "carve", warmup=True)
    n_allocs = 1 + 5 * sum(1 for e in events if e[0] == 0 and e[2])
    assert r["allocs"] == n_allocs
    mapped = sum(c["mapped"] for c in r["chunks"])
    assert r["allocs"] - r["cache_hits"] >= mapped  # each chunk taken was a miss
    assert r["peak_reserved"] >= sum(c["held"] for c in r["chunks"])
    assert r["reserved_over_live"] >= mc.floor(events)
    assert r["peak_live"] == mc.replay(events, "none", warmup=True)["peak_live"]


def test_the_chunked_pool_never_lets_a_block_straddle_a_chunk():
    h = mc.ChunkedHeap()
    a = h.alloc(20 * MIB)
    b = h.alloc(20 * MIB)  # 12 MiB left in the first chunk: too small, a new chunk
    assert (a[0], b[0], h.top) == (0, 32 * MIB, 64 * MIB)
    c = h.alloc(12 * MIB)  # the first chunk's tail
    assert c[0] == 20 * MIB
    h.release(*a)
    h.release(*c)
    d = h.alloc(40 * MIB)  # larger than a chunk: from a chunk boundary, the first chunk free
    assert d[0] == 64 * MIB and h.top == 128 * MIB  # not at 0: 32 MiB free there only
    h.release(*b)
    e = h.alloc(64 * MIB)  # the first two chunks are free and coalesced: it fits there
    assert e[0] == 0 and h.top == 128 * MIB
    # Heap lets the same 20 MiB blocks share a boundary
    g = mc.Heap()
    assert [g.alloc(20 * MIB)[0] for _ in range(2)] == [0, 20 * MIB] and g.top == 64 * MIB


def test_the_pool_models_bracket_the_h200_where_the_cache_keeps_blocks():
    """Replaying the traces, Heap and ChunkedHeap hold the H200's measured reserved / live
    between them for today's cached policies on GPT-2 and ResNet-50
    (benchmarks/results/probes.md)."""
    import gzip
    import json

    inside = {}
    for (name, policy), (gpu, _, _) in mc.MEASURED.items():
        if name == "cupy-fft" or policy in ("none", "onetier"):
            continue
        with gzip.open(TRACES / f"{name}.json.gz") as f:
            events = json.load(f)["events"]
        low, high = (
            mc.replay(events, policy, warmup=True, pool_model=m)["reserved_over_live"]
            for m in ("heap", "chunked")
        )
        inside[(name, policy)] = low - 0.001 <= gpu <= high + 0.001
    assert all(inside.values()), inside


@pytest.mark.parametrize("policy", ["none", "tiers", "carve-all", "segments"])
def test_the_recorded_pool_calls_replay_to_the_same_pool(policy):
    """replay(ops=...) writes down every call that reaches the pool, in order
    (probes/pool_sequence.py gives them to the GPU's pool): as many as the model counts,
    each release of a block allocated before and not yet released, and the same calls
    made on a fresh pool model reach the same peak reserved."""
    events = mc.load(str(TRACES / "cupy-fft.json.gz"))["events"]
    ops: list[int] = []
    r = mc.replay(events, policy, warmup=True, ops=ops)
    assert ops.count(0) == 5 and ops[-1] == 0  # the end of each pass
    assert len(ops) - 5 == r["driver_calls"] > 0
    pool, blocks, peak = mc.Pool(mc.Heap), [], 0
    for op in ops:
        if op == 0:
            continue
        if op > 0:
            blocks.append(pool.alloc(op))
            peak = max(peak, pool.reserved())
        else:
            k = -1 - op
            assert 0 <= k < len(blocks) and blocks[k] is not None  # live, released once
            pool.release(blocks[k])
            blocks[k] = None
    assert peak == r["peak_reserved"]
    assert r == mc.replay(events, policy, warmup=True)  # recording changes nothing


def replay_on_core(core, events: list, passes: int, figure) -> list:
    """The trace's events on the core's device 0 (torch's tag, the legacy stream), ``passes``
    times, what is live freed after each pass: ``figure(stats)`` after every event and
    every pass's end, as the model's ``record`` holds them; no two live blocks overlap."""
    got = []
    for _ in range(passes):
        live: dict = {}
        spans: dict = {}
        for e in events:
            if e[0] == 0:
                rc, p = core.alloc(0, e[2], 0, 2)
                assert rc == 0
                live[e[1]] = p
                if p:
                    spans[p] = p + e[2]
            elif live[e[1]]:
                p = live.pop(e[1])
                del spans[p]
                core.free(p)
            got.append(figure(core.stats(0)[1]))
        starts = sorted(spans)
        ends = [spans[a] for a in starts]
        assert all(e <= b for e, b in zip(ends, starts[1:], strict=False))  # no overlap
        for p in live.values():
            if p:
                core.free(p)
        got.append(figure(core.stats(0)[1]))
    return got


CARVINGS = {  # core.set_cache_carve's arguments, and the model's policy with them
    "as built": ((1 / 8, 32 * MIB, 256 * MIB, 0, 0), "carve-live"),
    "64 MiB chunks, 64 MiB kept, small ones all kept": (
        (0, 64 * MIB, 64 * MIB, 64 * MIB, mc.DEVICE),
        "carve-all",
    ),
}


@pytest.mark.parametrize("carving", sorted(CARVINGS))
def test_the_model_carves_as_carve_c_does(standin, carving):
    """Carving on (carve.c): the bytes kept for reuse after every event of the traces (the
    chunks' idle bytes), the hits and the chunks' bytes at the end, the model's and the
    core's; every pointer the core hands out lies in one chunk, and no two live blocks
    overlap."""
    import gzip
    import json

    from bridge._runtime import core

    args, policy = CARVINGS[carving]
    standin.standin_set_capacity(0, 1 << 50)
    for name, passes in (("gpt2", 1), ("resnet50", 1), ("cupy-fft", 5), ("mixed", 2)):
        with gzip.open(TRACES / f"{name}.json.gz") as f:
            events = json.load(f)["events"]
        limit = core.stats(0)[1]["cache_limit"]
        core.set_cache(0, 1 << 30)  # carving is part of the cache: off with it
        assert core.set_cache_carve(0, *args) == 0
        before = core.stats(0)[1]
        got = replay_on_core(core, events, passes, lambda st: st["cached"])
        after = core.stats(0)[1]
        want: list = []
        r = mc.replay(events, policy, passes=passes, record=want)
        assert after["carve_on"] == 1 and after["num_retries"] == before["num_retries"]
        assert after["num_cache_hits"] - before["num_cache_hits"] == r["cache_hits"], name
        assert got == want, name
        assert after["carve_held"] == sum(c["held"] for c in r["chunks"]), name
        assert core.set_cache_carve(0, 0, 0, 0) == 0  # off: the empty chunks go back
        core.set_cache(0, 0)
        assert core.stats(0)[1]["carve_held"] == 0 and core.stats(0)[1]["cached"] == 0
        core.set_cache(0, limit)


# ---- segments (issue 62's design) and the models of the native allocators ----


def test_segments_carve_small_requests_from_2_mib_and_large_from_live_sized_segments():
    pool = mc.Pool()
    s = mc.Segments(pool)
    a, new = s.alloc(1, 0)  # 512 B at least, from a 2 MiB segment
    assert new and a[2:6] == (0, 0, 512, 1) and s.info[0][3] == 2 * MIB  # (no, off, n, asked)
    b, new = s.alloc(MIB, 0)  # 1 MiB is still small: the same segment, right after a
    assert not new and b[2:6] == (0, 512, MIB, MIB)
    c, new = s.alloc(MIB + 1, 0, live=0)  # large: live / 16 is under 64 MiB, so 64 MiB
    assert new and s.info[c[2]][3] == 64 * MIB
    d, new = s.alloc(2 * MIB, 0, live=4096 * MIB)  # fits the 64 MiB segment's rest
    assert not new and d[2] == c[2]
    e, new = s.alloc(2 * MIB, 1, live=4096 * MIB)  # another stream: 4 GiB / 16 = 256 MiB
    assert new and s.info[e[2]][3] == 256 * MIB
    f, new = s.alloc(9000 * MIB + 1, 1, live=1 << 40)  # over 512 MiB: its own, 2 MiB steps
    assert new and s.info[f[2]][3] == 9002 * MIB
    assert s.segment_for(3 * MIB, 3 << 30) == 256 * MIB  # 192 MiB, a power of two up
    assert s.segment_for(3 * MIB, 1 << 50) == 512 * MIB
    assert (c[4], f[4]) == (MIB + 512, 9000 * MIB + 512)  # rounded to 512 B, the rest split
    assert s.taken == pool.calls == 4 and s.used == sum(x[4] for x in (a, b, c, d, e, f))
    # every byte of each segment is either handed out or in a free range
    for no, (_, _, _, size, _) in s.info.items():
        out = sum(blk[4] for blk in (a, b, c, d, e, f) if blk[2] == no)
        assert out + sum(z for _, z in s.ranges[no]) == size


def test_a_large_rest_of_1_mib_is_not_split_off_a_small_rest_of_512_bytes_is():
    s = mc.Segments(mc.Pool())
    a, _ = s.alloc(63 * MIB, 0)  # 1 MiB left in the 64 MiB segment: not over 1 MiB
    assert a[4] == 64 * MIB and s.ranges[a[2]] == [] and s.used == 64 * MIB
    s.free(a)
    b, _ = s.alloc(63 * MIB - 512, 0)  # 1 MiB + 512 B left: split
    assert b[4] == 63 * MIB - 512 and s.ranges[b[2]] == [(b[4], MIB + 512)]
    c, _ = s.alloc(MIB, 0)  # small: a 2 MiB segment
    d, _ = s.alloc(MIB - 512, 0)  # its other half but 512 B, which is split off
    assert (c[2], d[2], d[4]) == (1, 1, MIB - 512) and s.ranges[1] == [(2 * MIB - 512, 512)]


def test_best_fit_takes_the_smallest_range_then_the_oldest_segment_and_coalesces():
    s = mc.Segments(mc.Pool())
    blocks = [s.alloc(256 * 1024, 0)[0] for _ in range(8)]  # fills segment 0
    more = [s.alloc(256 * 1024, 0)[0] for _ in range(8)]  # segment 1
    assert {b[2] for b in blocks} == {0} and {b[2] for b in more} == {1}
    s.free(more[2])  # a 256 KiB hole in the newer segment
    s.free(blocks[5])  # and one in the older
    s.free(blocks[1])
    s.free(blocks[2])  # coalesces with blocks[1]'s range: 512 KiB
    assert s.ranges[0] == [(256 * 1024, 512 * 1024), (5 * 256 * 1024, 256 * 1024)]
    x, new = s.alloc(200 * 1024, 0)  # two 256 KiB holes fit best: the older segment's
    assert not new and (x[2], x[3]) == (0, 5 * 256 * 1024)
    y, _ = s.alloc(300 * 1024, 0)  # only the 512 KiB range holds it
    assert (y[2], y[3]) == (0, 256 * 1024)
    for b in [x, y] + blocks[:1] + blocks[3:5] + blocks[6:]:
        s.free(b)
    assert s.ranges[0] == [(0, 2 * MIB)] and list(s.empty) == [0]  # whole again, empty


def test_an_emptied_segment_is_kept_and_the_release_rule_gives_back_the_first_emptied():
    pool = mc.Pool()
    s = mc.Segments(pool)
    a, _ = s.alloc(64 * MIB, 0)
    b, _ = s.alloc(64 * MIB, 0)
    assert s.hwm == 128 * MIB
    s.free(b)  # segment 1 empties first
    s.free(a)
    assert list(s.empty) == [1, 0] and s.returned == 0 and s.held == 128 * MIB
    # 4 KiB on new streams: a 2 MiB segment each, kept while held + 2 MiB <= 1.05 x hwm
    small = [s.alloc(4096, k)[0] for k in (1, 2, 3)]
    assert s.returned == 0 and s.held == 134 * MIB  # 134 <= 134.4
    small.append(s.alloc(4096, 4)[0])  # 136 MiB > 134.4: the first emptied goes back
    assert s.returned == 1 and list(s.empty) == [0] and 1 not in s.info
    assert s.held == 72 * MIB and pool.calls == 7
    # a request the empty 64 MiB segment fits (its stream): a hit, nothing returned
    c, new = s.alloc(64 * MIB, 0)
    assert not new and c[2] == 0 and not s.empty
    s.free(c)
    # a large request of its own: the empty segment goes, the partly used small ones stay
    d, new = s.alloc(1024 * MIB, 0)
    assert new and s.returned == 2 and set(s.info) == {2, 3, 4, 5, d[2]}
    s.free(d)
    for blk in small:
        s.free(blk)
    s.flush()  # pressure / empty_cache: every empty segment goes back
    assert s.held == 0 and s.info == {} and s.returned == s.taken == 7


@pytest.mark.parametrize(("size", "segment"), [(512, 2 * MIB), (MIB, 2 * MIB),
                                               (64 * MIB, 64 * MIB)])  # fmt: skip
def test_a_loop_of_one_size_hits_after_its_first_allocation(size, segment):
    ev = [[0, 0, 4096, 0]]  # something live through the loop
    for i in range(1, 101):
        ev += [[0, i, size, 0], [1, i]]
    r = mc.replay(ev, "segments", passes=1, warmup=True)
    # the warm-up's segment serves 4 KiB (and a small size); a large size takes one more
    assert (r["cache_hits"], r["allocs"]) == (101 - (segment > 2 * MIB), 102)
    taken = 1 + (segment > 2 * MIB)
    assert r["segments"]["taken"] == r["driver_calls"] == taken
    assert r["segments"]["peak_held"] == 2 * MIB + (segment if segment > 2 * MIB else 0)


def test_each_stream_is_served_from_its_own_segments():
    s = mc.Segments(mc.Pool())
    a, _ = s.alloc(4096, 0)
    s.free(a)
    b, new = s.alloc(4096, 1)  # segment 0 is empty, but stream 0's
    assert new and b[2] == 1 and s.info[1][1] == 1


def test_the_slot_parks_the_block_allocated_last_until_the_next_allocation():
    """Segments' slot (segments-core, as cache.c's thread slot holds a carved block): the
    block the thread allocated last parks at its free, still handed out of its segment
    (idle in the figures, live for the release rule's mark); the next allocation of its
    (stream, size) takes it back (a hit, nothing carved); any other next allocation gives
    it back to its segment first, coalescing; a block that is not the last is freed."""
    s = mc.Segments(mc.Pool(), slot=True)
    keep, _ = s.alloc(4096, 0)
    a, _ = s.alloc(3 * MIB, 0)
    s.put(a)
    assert s.parked is a and s.ranges[a[2]] == [(3 * MIB, 61 * MIB)]  # still carved
    assert s.idle == s.held - 4096 and s.live == 4096 + 3 * MIB
    b, new = s.alloc(3 * MIB, 0)
    assert b is a and not new and s.parked is None and s.taken == 2
    s.put(b)
    # another stream: a back to its segment first, which empties whole, and the release
    # rule gives it back before the new segment is taken
    c, new = s.alloc(3 * MIB, 1)
    assert new and s.parked is None and a[2] not in s.info and s.returned == 1
    assert s.live == 4096 + 3 * MIB
    s.put(keep)  # not the last allocated: freed at once
    assert s.parked is None and s.ranges[0] == [(0, 2 * MIB)]
    s.put(c)
    assert s.parked is c
    s.flush()  # the parked block first: its segment empties and goes back with the rest
    assert s.parked is None and s.held == 0 and s.live == 0


def test_the_torch_model_takes_torch_segment_sizes_and_gives_nothing_back():
    t = mc.TorchNative()
    sizes = [t.segment_for(n, 1 << 40) for n in (512, MIB, MIB + 512, 10 * MIB - 512,
                                                 10 * MIB, 10 * MIB + 512)]  # fmt: skip
    assert sizes == [2 * MIB, 2 * MIB, 20 * MIB, 20 * MIB, 10 * MIB, 12 * MIB]
    blocks = [t.alloc(12 * MIB, 0)[0] for _ in range(10)]
    for b in blocks:
        t.free(b)
    t.alloc(1 << 30, 0)  # a miss: torch releases nothing before cudaMalloc
    assert t.returned == 0 and t.held == 10 * 12 * MIB + (1 << 30)
    c = mc.CupyNative()  # CuPy: the rounded request itself, split down to 512 B
    x, _ = c.alloc(3 * MIB + 1, 0)
    assert c.held == 3 * MIB + 512
    c.free(x)
    y, new = c.alloc(3 * MIB - 1024, 0)
    assert not new and c.ranges[y[2]] == [(3 * MIB - 1024, 1536)]


@pytest.mark.parametrize("name", ["gpt2", "resnet50", "cupy-fft", "mixed"])
def test_the_native_model_reproduces_the_h200s_native_figures(name):
    events = mc.load(str(TRACES / f"{name}.json.gz"))["events"]
    got = mc.native(events)["reserved_over_live"]
    # torch alone within 0.005; beside CuPy's pool (mixed) within 0.035
    assert abs(got - mc.MEASURED_NATIVE[name]) <= (0.035 if name == "mixed" else 0.005)


@pytest.mark.parametrize("name", ["gpt2", "resnet50", "cupy-fft", "mixed"])
def test_segments_hit_98_percent_and_hold_no_more_than_native_on_each_trace(name):
    """Issue 62's bar on the committed traces: hits >= 98% (over all five passes, and
    over the four after the first) and reserved / live under both pool models at or
    below the model of native torch (and the H200's native figure)."""
    (row,) = mc.beside_native([mc.load(str(TRACES / f"{name}.json.gz"))])
    assert row["hits"] >= 0.98 and row["steady_hits"] >= 0.98, row
    assert max(row["heap"], row["chunked"]) <= min(row["native"], row["native_h200"]), row
    assert row["held"] <= row["heap"]  # the pool holds the segments and maps in chunks
    # no segment is taken or given back after the first pass but a handful
    assert row["driver_calls"] <= 60, row


def test_segments_on_a_trace_they_were_not_tuned_on():
    """attention.json.gz (variable-shape inference, recorded on an H200 2026-12-05 after the
    segments' parameters were chosen on the other four): hits >= 98% and reserved / live
    under both pool models at or below the model of native torch. Its driver calls are
    not held to the tuned traces' handful: shapes that change with every request empty
    and retake segments under the release rule (167 calls in five passes, native's 32)."""
    (row,) = mc.beside_native([mc.load(str(TRACES / "attention.json.gz"))])
    assert row["hits"] >= 0.98 and row["steady_hits"] >= 0.98, row
    assert max(row["heap"], row["chunked"]) <= row["native"], row
    assert row["held"] <= row["heap"]


@pytest.mark.parametrize("name", ["gpt2", "resnet50", "cupy-fft", "mixed", "attention"])
def test_splitting_whatever_is_left_changes_neither_hits_nor_memory(name):
    """segments-core (carve.c's splitting: a large range split whatever is left) against
    segments (torch's: only a rest over 1 MiB): a rest of at most 1 MiB holds no large
    request, so the hits, the driver calls and the pool's peaks agree."""
    events = mc.load(str(TRACES / f"{name}.json.gz"))["events"]
    for pool_model in ("heap", "chunked"):
        a, b = (
            mc.replay(events, p, warmup=True, pool_model=pool_model)
            for p in ("segments", "segments-core")
        )
        for k in ("cache_hits", "driver_calls", "peak_reserved", "peak_live", "segments"):
            assert a[k] == b[k], (k, pool_model)
    s = mc.Segments(mc.Pool(), split=0)
    x, _ = s.alloc(64 * MIB - 512, 0)  # 512 B left: split off all the same
    assert x[4] == 64 * MIB - 512 and s.ranges[x[2]] == [(x[4], 512)]


def test_the_default_policy_is_segments_as_the_core_builds_them():
    """``default`` follows ``segments-core`` (the same Settings), whatever those become."""
    assert mc.POLICIES["default"] is mc.POLICIES["segments-core"]
    assert mc.POLICIES["default"].segments


@pytest.mark.parametrize("name", ["gpt2", "resnet50", "cupy-fft", "mixed", "attention"])
def test_default_hits_98_percent_and_holds_no_more_than_native(name):
    """The library's default (policy ``default``) on every committed trace: hits >= 98%
    after the first pass (and over all five) and reserved / live under both pool models
    at or below the model of native torch on the same trace."""
    (row,) = mc.beside_native([mc.load(str(TRACES / f"{name}.json.gz"))], "default")
    assert row["hits"] >= 0.98 and row["steady_hits"] >= 0.98, row
    assert max(row["heap"], row["chunked"]) <= row["native"], row


@pytest.mark.parametrize("name", ["gpt2", "resnet50", "cupy-fft", "mixed", "attention"])
def test_the_model_serves_segments_as_the_core_does(standin, monkeypatch, name):
    """The device set up as the library sets it up by default (no BRIDGE_CACHE_*
    variable): segments on (carve.c); the idle bytes and the bytes parked in the thread's
    slot after every event of each committed trace, the hits, the segments' bytes and
    their high-water mark at the end, the model's (policy ``default``) and the core's; no
    two live blocks overlap."""
    from bridge import _runtime
    from bridge._runtime import core

    passes = {"gpt2": 2, "resnet50": 2, "cupy-fft": 5, "mixed": 3, "attention": 2}[name]
    events = mc.load(str(TRACES / f"{name}.json.gz"))["events"]
    standin.standin_set_capacity(0, 1 << 50)
    limit = core.stats(0)[1]["cache_limit"]
    for var in [v for v in os.environ if v.startswith("BRIDGE_CACHE_")]:
        monkeypatch.delenv(var)
    _runtime.reset_process_state()
    _runtime.ensure_device(0)  # the library's defaults: the cache on, segments on
    lim = core.stats(0)[1]["cache_limit"]
    core.set_cache(0, 0)  # empty: no plain block of an earlier test waits in this thread's slot
    core.set_cache(0, lim)
    assert core.set_cache_segments(0, True) == 0  # as ensure_device set it
    try:
        before = core.stats(0)[1]
        assert before["carve_on"] == 1 and before["carve_slack"] == 1050
        assert before["cache_limit"] > 0
        got = replay_on_core(core, events, passes, lambda st: (st["cached"], st["carve_parked"]))
        after = core.stats(0)[1]
        want: list = []
        r = mc.replay(events, "default", passes=passes, record=want)
        assert any(parked for _, parked in want)  # the slot served on this trace
        assert after["num_retries"] == before["num_retries"]
        assert after["num_cache_hits"] - before["num_cache_hits"] == r["cache_hits"]
        assert got == want
        assert after["carve_held"] == r["segments"]["held"]
        assert after["carve_hwm"] == r["segments"]["hwm"]
    finally:
        assert core.set_cache_segments(0, False) == 0  # off: the empty segments go back
        core.set_cache(0, 0)
        s = core.stats(0)[1]
        assert s["carve_held"] == 0 and s["cached"] == 0 and s["carve_on"] == 0
        core.set_cache(0, limit)
