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
    core.forget_stream(SIDE)
    yield standin
    core.set_cache(0, 0)
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
    while modelling the cache for tests/test_ledger_property.py)."""
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
    import os
    import subprocess
    import sys

    e = {k: v for k, v in os.environ.items() if k != "BRIDGE_CACHE_LIMIT"}
    e["BRIDGE_STANDIN_TOTAL"] = str(total)
    if env is not None:
        e["BRIDGE_CACHE_LIMIT"] = env
    code = (
        "from bridge import _runtime\n"
        "_runtime.ensure_device(1)\n"
        "print(_runtime.core.stats(1)[1]['cache_limit'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == expect


def test_many_sizes_that_are_multiples_of_a_mib_are_all_cached_and_found(cache):
    """Such sizes have all-zero low bits: the table must spread them (issue: they
    piled onto a few slots)."""
    core.set_cache(0, 8 << 30)
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

    root = pathlib.Path(__file__).resolve().parent.parent
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
