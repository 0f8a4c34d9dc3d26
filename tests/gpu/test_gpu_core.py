# SPDX-License-Identifier: Apache-2.0
"""The core on a real GPU, no framework: figures against the driver's own,
the budget under threads, no leaks. (Run by scripts/gpu-test.)"""

from __future__ import annotations

import random
import threading

import pytest
from gpu_util import (
    GIB,
    MIB,
    RESERVED,
    THRESHOLD,
    USED,
    carving,
    ctx_sync,
    device_bytes,
    driver_pool_attr,
    memset,
    segments,
)

pytestmark = pytest.mark.gpu

TAG_OTHER = 0


@pytest.fixture(scope="module")
def core():
    import bridge
    from bridge._runtime import core

    b = bridge.unify(cupy=False, torch=False)
    assert b.devices and b.frameworks == frozenset()
    # the primary context must be current for cuda.bindings calls in this thread
    rc, ptr = core.alloc(0, 1, 0, TAG_OTHER)
    core.free(ptr)
    yield core
    core.set_limit(0, 0)


@pytest.fixture
def clean(core):
    import bridge

    core.set_limit(0, 0)
    bridge.pool(0).free_all_blocks()  # empties the bridge's cache of freed blocks too
    ctx_sync()
    yield core
    core.set_limit(0, 0)


def test_pool_figures_equal_the_driver(clean):
    import bridge

    core = clean
    carved, segs = carving(), segments()
    base_ledger = bridge.stats(0).ledger
    assert bridge.stats(0).cached == 0  # the fixture emptied the cache
    sizes = [1 * MIB, 7 * MIB + 3, 48 * MIB]
    ptrs = []
    for n in sizes:
        rc, p = core.alloc(0, n, 0, TAG_OTHER)
        assert rc == 0 and p != 0
        ptrs.append(p)
    ctx_sync()
    pool = bridge.pool(0)
    s = bridge.stats(0)
    # the bridge's cache counts as free: carved blocks' chunks and segments hold idle
    # bytes (segments: 1 MiB of the 2 MiB one, the rest of the 64 MiB one the two larger
    # blocks share), the tiers nothing yet
    if segs:
        assert s.cached == 1 * MIB + 64 * MIB - (7 * MIB + 3) - 48 * MIB  # requested sizes
    else:
        assert s.cached > 0 if carved else s.cached == 0
    assert pool.used_bytes() == driver_pool_attr(USED) - s.cached
    assert pool.total_bytes() == driver_pool_attr(RESERVED)
    assert pool.free_bytes() == driver_pool_attr(RESERVED) - driver_pool_attr(USED) + s.cached
    assert s.ledger - s.cached - base_ledger == sum(sizes)
    assert s.used >= sum(sizes)
    for p in ptrs:
        core.free(p)
    ctx_sync()
    s = bridge.stats(0)
    # kept for the next allocation of the same size: the 1 MiB block under the small
    # tier's 64 MiB floor; of the two large ones, with nothing else live, the newest alone
    # (the large tier's cap: max(live / 8, the block being cached), at most 64 MiB).
    # Carving: every chunk emptied, and went back to the pool at once. Segments: both
    # emptied, both kept (2 MiB and 64 MiB).
    assert s.cached == (66 * MIB if segs else 0 if carved else 1 * MIB + 48 * MIB)
    assert s.ledger - s.cached == base_ledger
    assert pool.used_bytes() + s.cached == driver_pool_attr(USED)
    pool.free_all_blocks()
    assert bridge.stats(0).ledger == base_ledger
    assert pool.used_bytes() == driver_pool_attr(USED)


def test_default_cache_holds_a_training_steps_worth(clean):
    """The default cache limit is 2% of the device (2.8 GiB on an H200), at least 1 GiB,
    in two tiers. Blocks of at most 1 MiB are held under a cap that follows the live
    bytes (1/16 of them, at least 64 MiB): with 25 GiB live, 1.5 GiB of them (24 sizes,
    64 blocks each) stay cached and come back without a driver call. Larger blocks have
    their own 64 MiB, at most 1/8 of the live bytes but always room for the block being
    cached: with 25 GiB live, four 16 MiB blocks all stay; a freed 128 MiB block goes back
    to the pool."""
    core = clean
    # a test of the two tiers (BRIDGE_CACHE_SEGMENTS=0): what reaches them with carving
    # and segments off
    if segments():
        core.set_cache_segments(0, False)
    elif carving():
        core.set_cache_carve(0, 0, 0, 0)
    try:
        tiers_hold_a_training_steps_worth(core)
    finally:
        if segments():
            core.set_cache_segments(0, True)
        elif carving():
            core.set_cache_carve(0)


def tiers_hold_a_training_steps_worth(core) -> None:
    import bridge

    raw = core.stats(0)[1]
    assert raw["cache_limit"] == max(GIB, raw["total"] // 50)
    assert raw["cache_fraction"] == 1 / 16
    assert (raw["cache_small_max"], raw["cache_large_cap"]) == (MIB, 64 * MIB)
    assert raw["cache_large_fraction"] == 1 / 8
    rc, ballast = core.alloc(0, 25 * GIB, 0, TAG_OTHER)  # live: small cap 25/16 GiB
    assert rc == 0
    sizes = [MIB - 512 * k for k in range(24)] * core.CACHE_DEPTH  # ~1.5 GiB
    ptrs = []
    for size in sizes:
        rc, p = core.alloc(0, size, 0, TAG_OTHER)
        assert rc == 0 and p
        ptrs.append(p)
    for p in ptrs:
        core.free(p)
    assert bridge.stats(0).cached == sum(sizes) > GIB  # more than the old 1 GiB cap
    hits = core.stats(0)[1]["num_cache_hits"]
    again = []
    for size in sizes:
        rc, p = core.alloc(0, size, 0, TAG_OTHER)
        assert rc == 0
        again.append(p)
    assert sorted(again) == sorted(ptrs)  # the same blocks
    assert core.stats(0)[1]["num_cache_hits"] - hits == len(sizes)
    quads = [core.alloc(0, 16 * MIB, 0, TAG_OTHER)[1] for _ in range(4)]
    for p in quads:
        core.free(p)
    assert core.stats(0)[1]["cached_large"] == 64 * MIB  # 25 GiB / 8 is past the cap
    assert sorted(core.alloc(0, 16 * MIB, 0, TAG_OTHER)[1] for _ in range(4)) == sorted(quads)
    for p in quads:
        core.free(p)
    rc, big = core.alloc(0, 128 * MIB, 0, TAG_OTHER)
    assert rc == 0
    core.free(big)
    assert core.stats(0)[1]["cached_large"] == 64 * MIB  # 128 MiB: over the large cap
    for p in again:
        core.free(p)
    core.free(ballast)
    bridge.pool(0).free_all_blocks()
    assert bridge.stats(0).cached == 0


def test_memory_is_real_device_memory(clean):
    core = clean
    n = 3 * MIB + 17
    rc, p = core.alloc(0, n, 0, TAG_OTHER)
    assert rc == 0
    memset(p, 0xAB, n)
    assert device_bytes(p, n) == b"\xab" * n
    core.free(p)


def test_release_threshold_is_what_bridge_set(clean):
    import bridge

    assert driver_pool_attr(THRESHOLD) == bridge.pool(0).release_threshold == 2**64 - 1


def test_budget_holds_under_threads_on_real_memory(clean):
    import bridge

    core = clean
    s = bridge.stats(0)
    base = s.ledger - s.cached  # in use (carving: a live block's chunk holds idle bytes)
    limit = s.ledger + 1 * GIB
    core.set_limit(0, limit)
    core.reset_peak(0, -1)
    refused = [0] * 8
    errors: list[str] = []

    def work(k: int) -> None:
        rng = random.Random(k)
        live = []
        for _ in range(600):
            if live and (rng.random() < 0.45 or len(live) > 12):
                core.free(live.pop(rng.randrange(len(live))))
                continue
            rc, p = core.alloc(0, rng.randint(1, 96) * MIB, 0, TAG_OTHER)
            if rc == 0:
                live.append(p)
            elif rc == 1:  # BUDGET
                refused[k] += 1
            else:
                errors.append(f"status {rc}")
        for p in live:
            core.free(p)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = bridge.stats(0)
    assert not errors
    assert sum(refused) > 0, "the stress never reached the budget edge"
    assert s.ledger_peak <= limit
    assert s.ledger - s.cached == base


def test_budget_counts_other_users_of_the_pool(clean):
    """Bytes someone else (JAX, here cuda.bindings) holds in the pool count."""
    from cuda.bindings import driver as cu

    import bridge

    core = clean
    err, pool = cu.cuDeviceGetDefaultMemPool(0)
    err, foreign = cu.cuMemAllocFromPoolAsync(1 * GIB, pool, cu.CUstream(0))
    assert err == cu.CUresult.CUDA_SUCCESS
    ctx_sync()
    try:
        s = bridge.stats(0)
        assert s.by_framework["other"] >= 1 * GIB
        core.set_limit(0, s.used + 512 * MIB)
        rc, p = core.alloc(0, 768 * MIB, 0, TAG_OTHER)
        assert rc == 1 and p == 0  # refused: BUDGET
        rc, p = core.alloc(0, 256 * MIB, 0, TAG_OTHER)
        assert rc == 0 and p != 0
        core.free(p)
    finally:
        core.set_limit(0, 0)
        cu.cuMemFreeAsync(foreign, cu.CUstream(0))
        ctx_sync()


def test_thread_without_context_allocates(clean):
    """torch's autograd thread has no current context: the core makes one current."""
    core = clean
    out = {}

    def work():
        from cuda.bindings import driver as cu

        err, ctx = cu.cuCtxGetCurrent()
        out["had_context"] = int(ctx) != 0 if ctx is not None else False
        out["rc"], out["ptr"] = core.alloc(0, 4 * MIB, 0, TAG_OTHER)
        if out["rc"] == 0:
            memset(out["ptr"], 7, 4 * MIB)
            out["bytes"] = device_bytes(out["ptr"], 16)
            core.free(out["ptr"])

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert out["had_context"] is False
    assert out["rc"] == 0 and out["ptr"] != 0
    assert out["bytes"] == b"\x07" * 16


def test_no_leak_after_many_cycles(clean):
    import bridge

    core = clean
    ctx_sync()
    base_used = driver_pool_attr(USED)
    base_records = core.live_records()
    for i in range(20000):
        rc, p = core.alloc(0, (i % 97 + 1) * 4096, 0, TAG_OTHER)
        assert rc == 0
        core.free(p)
    ctx_sync()
    bridge.pool(0).free_all_blocks()
    assert driver_pool_attr(USED) == base_used
    assert core.live_records() == base_records
    assert bridge.stats(0).num_bad_frees == 0


def test_free_all_blocks_returns_idle_memory(clean):
    import bridge

    core = clean
    rc, p = core.alloc(0, 512 * MIB, 0, TAG_OTHER)
    assert rc == 0
    core.free(p)
    ctx_sync()
    before = driver_pool_attr(RESERVED)
    assert before >= 512 * MIB
    bridge.pool(0).free_all_blocks()
    after = driver_pool_attr(RESERVED)
    assert after <= before - 512 * MIB
    assert bridge.pool(0).total_bytes() == after


def test_double_free_is_counted_not_raised(clean):
    import bridge

    core = clean
    rc, p = core.alloc(0, MIB, 0, TAG_OTHER)
    before = bridge.stats(0)
    core.free(p)
    core.free(p)
    core.free(0xDEAD0000)
    after = bridge.stats(0)
    assert after.num_bad_frees == before.num_bad_frees + 2
    assert after.tags[0]["current"] == before.tags[0]["current"] - MIB
    # the block is cached, still on the ledger; carving: its 2 MiB chunk emptied, went back;
    # segments: its 2 MiB segment emptied, kept
    assert after.ledger == before.ledger - (2 * MIB if carving() else 0)
