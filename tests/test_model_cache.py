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
