# SPDX-License-Identifier: Apache-2.0
"""benchmarks/model_cache.py: the pool model and the cache policies (CPU)."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
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


TRACES = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "traces"
SETTINGS = {
    "defaults": {},
    "one tier, 1/8": {"small_max": mc.DEVICE, "fraction": 1 / 8},
    "4 MiB, large 256 MiB": {"small_max": 4 * MIB, "large_cap": 256 * MIB},
    "a limit that binds": {"limit": 100 * MIB, "floor": 16 * MIB},
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
