# SPDX-License-Identifier: Apache-2.0
"""bridge.pool() / bridge.stats(): the shared pool's API, on the stand-in driver."""

from __future__ import annotations

import ctypes
import importlib
import sys

import pytest

import bridge
from bridge._errors import Status
from bridge._runtime import MAX_THRESHOLD, core

MIB = 1 << 20
GIB = 1 << 30
TOTAL = 16 * GIB  # the stand-in's device memory
pool_mod = importlib.import_module("bridge.pool")  # `bridge.pool` is the function
S1 = 0xB1000


@pytest.fixture
def sd(standin, monkeypatch):
    """The stand-in, with this thread on no context (so the current device is 0),
    an empty pool, no JAX attribution; undoes what the test adds."""
    for d in (0, 1):
        assert core.trim(d, 0) == Status.OK
    standin.standin_clear_current()
    monkeypatch.delitem(pool_mod._attribution, "jax", raising=False)
    live: list[int] = []
    foreign: dict[int, int] = {}

    class Helper:
        lib = standin

        @staticmethod
        def alloc(size, tag=core.TAG_CUPY, dev=0):
            rc, p = core.alloc(dev, size, S1, tag)
            assert rc == Status.OK
            live.append(p)
            return p

        @staticmethod
        def free(p):
            core.free(p)
            live.remove(p)

        @staticmethod
        def add_foreign(dev, n):
            standin.standin_add_foreign(dev, n)
            foreign[dev] = foreign.get(dev, 0) + n

    yield Helper
    for p in live:
        core.free(p)
    for dev, n in foreign.items():
        standin.standin_add_foreign(dev, -n)
    for d in (0, 1):
        standin.standin_sync_all(d)
        core.trim(d, 0)


# ---- getting a pool ----
def test_pool_per_device_is_one_object(sd):
    p0 = bridge.pool(0)
    assert p0 is bridge.pool(0)
    assert p0.device == 0
    assert bridge.pool(1).device == 1
    assert bridge.pool(1) is not p0
    assert "device=0" in repr(p0)


def test_pool_and_stats_default_to_the_current_device(sd):
    assert bridge.pool().device == 0  # no current context: device 0
    assert bridge.stats().device == 0
    # with device 1's context current (as after torch.cuda.set_device(1))
    ctx = ctypes.c_void_p()
    assert sd.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 1) == 0
    assert sd.lib.cuCtxSetCurrent(ctx) == 0
    try:
        assert core.current_device() == (Status.OK, 1)
        assert bridge.pool().device == 1
        assert bridge.stats().device == 1
    finally:
        sd.lib.standin_clear_current()


@pytest.mark.parametrize("device", [2, 64, -1, True, "0", 0.0])
def test_bad_device_raises_valueerror(sd, device):
    with pytest.raises(ValueError, match="device"):
        bridge.pool(device)
    with pytest.raises(ValueError, match="device"):
        bridge.stats(device)


# ---- limits ----
def test_set_limit_by_size(sd):
    p = bridge.pool(0)
    p.set_limit(size=GIB)
    assert p.get_limit() == GIB
    p.set_limit(size="512MiB")
    assert p.get_limit() == 512 * MIB
    p.set_limit(size="4GB")
    assert p.get_limit() == 4 * 1000**3
    p.set_limit(size="0.5")  # a fraction written as text
    assert p.get_limit() == TOTAL // 2
    p.set_limit(size="25%")
    assert p.get_limit() == TOTAL // 4
    p.set_limit(GIB)  # positional: size
    assert p.get_limit() == GIB
    assert bridge.stats(0).limit == GIB


def test_a_budget_above_the_device_warns_naming_both_sizes(sd):
    p = bridge.pool(0)
    with pytest.warns(UserWarning) as record:
        p.set_limit(size="40GB")  # the stand-in's devices have 16 GiB
    msg = str(record[0].message)
    assert msg.startswith("bridge.pool(0).set_limit: a limit of 37.25 GiB (40000000000 bytes)")
    assert "larger than the device's memory (16.00 GiB, 17179869184 bytes)" in msg
    assert "limits nothing" in msg
    assert record[0].filename == __file__  # it points at the call
    assert p.get_limit() == 40 * 1000**3  # applied all the same
    p.set_limit(0)


def test_set_limit_by_fraction(sd):
    p = bridge.pool(0)
    p.set_limit(fraction=0.5)
    assert p.get_limit() == TOTAL // 2
    p.set_limit(fraction=1)
    assert p.get_limit() == TOTAL
    p.set_limit(fraction=0.125)
    assert p.get_limit() == TOTAL // 8


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"size": 0},
        {"fraction": 0},
        {"fraction": 0.0},
        {"size": None, "fraction": None},
        {"size": "0"},
    ],
)
def test_zero_or_neither_removes_the_limit(sd, kwargs):
    p = bridge.pool(0)
    p.set_limit(size=GIB)
    p.set_limit(**kwargs)
    assert p.get_limit() == 0
    # and nothing is refused any more
    sd.free(sd.alloc(2 * GIB))


def test_size_and_fraction_together_is_refused(sd):
    p = bridge.pool(0)
    p.set_limit(size=GIB)
    with pytest.raises(ValueError, match="not both"):
        p.set_limit(size=2 * GIB, fraction=0.5)
    with pytest.raises(ValueError, match="not both"):
        p.set_limit(size=0, fraction=0)
    assert p.get_limit() == GIB  # unchanged


@pytest.mark.parametrize(
    "kwargs",
    [
        {"fraction": 1.5},
        {"fraction": -0.1},
        {"fraction": True},
        {"fraction": "0.5"},
        {"size": -1},
        {"size": "abc"},
        {"size": True},
        {"size": "150%"},
        {"size": 2**64},
    ],
)
def test_bad_limit_raises_valueerror_and_changes_nothing(sd, kwargs):
    p = bridge.pool(0)
    p.set_limit(size=GIB)
    with pytest.raises(ValueError):
        p.set_limit(**kwargs)
    assert p.get_limit() == GIB


def test_limit_applies_to_its_device_only(sd):
    bridge.pool(1).set_limit(size=GIB)
    bridge.pool(0).set_limit(size=MIB)
    assert bridge.pool(1).get_limit() == GIB
    assert bridge.pool(0).get_limit() == MIB
    assert core.alloc(0, MIB + 1, S1, core.TAG_CUPY) == (Status.BUDGET, 0)
    sd.free(sd.alloc(MIB + 1, dev=1))


def test_the_limit_is_enforced(sd):
    p = bridge.pool(0)
    p.set_limit(size="4MiB")
    s0 = bridge.stats(0)
    a = sd.alloc(4 * MIB)
    assert core.alloc(0, 1, S1, core.TAG_TORCH) == (Status.BUDGET, 0)
    s = bridge.stats(0)
    assert s.num_ooms == s0.num_ooms + 1
    assert s.num_allocs == s0.num_allocs + 1
    assert s.ledger == 4 * MIB and s.ledger_peak <= 4 * MIB
    sd.free(a)


# ---- pool figures ----
def test_used_free_total_bytes(sd):
    p = bridge.pool(0)
    assert (p.used_bytes(), p.free_bytes(), p.total_bytes()) == (0, 0, 0)
    a = sd.alloc(8 * MIB)
    b = sd.alloc(4 * MIB, tag=core.TAG_TORCH)
    assert (p.used_bytes(), p.free_bytes(), p.total_bytes()) == (12 * MIB, 0, 12 * MIB)
    sd.free(a)
    sd.lib.standin_sync_all(0)  # the free reaches its stream
    # the pool keeps what was freed (release threshold: all of it)
    assert (p.used_bytes(), p.free_bytes(), p.total_bytes()) == (4 * MIB, 8 * MIB, 12 * MIB)
    p.free_all_blocks()
    assert (p.used_bytes(), p.free_bytes(), p.total_bytes()) == (4 * MIB, 0, 4 * MIB)
    sd.free(b)


def test_free_all_blocks_returns_frees_still_queued(sd):
    p = bridge.pool(0)
    sd.free(sd.alloc(16 * MIB))
    assert sd.lib.standin_pending_bytes(0) == 16 * MIB
    assert p.used_bytes() == 16 * MIB  # queued on its stream: still in use
    p.free_all_blocks()
    assert sd.lib.standin_pending_bytes(0) == 0
    assert (p.used_bytes(), p.total_bytes()) == (0, 0)


def test_pool_figures_count_every_user_of_the_pool(sd):
    p = bridge.pool(0)
    sd.add_foreign(0, 6 * MIB)  # e.g. JAX's arrays in the same pool
    a = sd.alloc(2 * MIB)
    assert p.used_bytes() == 8 * MIB
    assert p.total_bytes() == 8 * MIB
    sd.free(a)


def test_release_threshold_is_reasserted(sd):
    p = bridge.pool(0)
    assert p.release_threshold == MAX_THRESHOLD
    # JAX writes 0 when its backend starts (docs/platform-notes.md)
    handle = ctypes.c_void_p()
    assert sd.lib.cuDeviceGetDefaultMemPool(ctypes.byref(handle), 0) == 0
    zero = ctypes.c_uint64(0)
    assert sd.lib.cuMemPoolSetAttribute(handle, 4, ctypes.byref(zero)) == 0
    assert p.release_threshold == 0
    p.reassert()
    assert p.release_threshold == MAX_THRESHOLD
    assert bridge.stats(0).release_threshold == MAX_THRESHOLD


# ---- stats ----
def test_stats_by_framework(sd):
    s = bridge.stats(0)
    assert set(s.by_framework) == {"cupy", "torch", "jax", "numba", "rmm", "other"}
    assert s.by_framework == {"cupy": 0, "torch": 0, "jax": 0, "numba": 0, "rmm": 0, "other": 0}
    c = sd.alloc(3 * MIB, tag=core.TAG_CUPY)
    t = sd.alloc(5 * MIB, tag=core.TAG_TORCH)
    o = sd.alloc(1 * MIB, tag=core.TAG_OTHER)
    s = bridge.stats(0)
    assert s.by_framework == {
        "cupy": 3 * MIB,
        "torch": 5 * MIB,
        "jax": 0,
        "numba": 0,
        "rmm": 0,
        "other": MIB,
    }
    assert s.used == 9 * MIB and s.ledger == 9 * MIB
    assert s.reserved == 9 * MIB
    assert s.peak_used >= 9 * MIB
    assert s.total == TOTAL
    assert [t_["name"] for t_ in s.tags] == ["other", "cupy", "torch", "numba", "rmm"]
    sd.free(t)
    s = bridge.stats(0)
    assert s.by_framework["torch"] == 0
    assert s.ledger == 4 * MIB
    for p in (c, o):
        sd.free(p)


def test_stats_bytes_outside_the_ledger(sd, monkeypatch):
    sd.add_foreign(0, 6 * MIB)
    # nobody claims them: "other"
    assert bridge.stats(0).by_framework == {
        "cupy": 0,
        "torch": 0,
        "jax": 0,
        "numba": 0,
        "rmm": 0,
        "other": 6 * MIB,
    }
    # JAX's adapter says how much is JAX's: the rest stays "other"
    monkeypatch.setitem(pool_mod._attribution, "jax", lambda d: 4 * MIB)
    assert bridge.stats(0).by_framework == {
        "cupy": 0,
        "torch": 0,
        "jax": 4 * MIB,
        "numba": 0,
        "rmm": 0,
        "other": 2 * MIB,
    }
    # JAX cannot tell: everything outside the ledger is counted as JAX's
    monkeypatch.setitem(pool_mod._attribution, "jax", lambda d: None)
    assert bridge.stats(0).by_framework["jax"] == 6 * MIB
    # never more than the pool holds beyond the ledger

    monkeypatch.setitem(pool_mod._attribution, "jax", lambda d: 100 * GIB)
    by = bridge.stats(0).by_framework
    assert by["jax"] == 6 * MIB and by["other"] == 0

    def broken(d):
        raise RuntimeError("jax is gone")

    monkeypatch.setitem(pool_mod._attribution, "jax", broken)
    assert bridge.stats(0).by_framework["jax"] == 6 * MIB  # figures never fail


def test_stats_counters(sd):
    bridge.pool(0).set_limit(size=MIB)
    s0 = bridge.stats(0)
    sd.free(sd.alloc(MIB))
    assert core.alloc(0, 2 * MIB, S1, core.TAG_CUPY) == (Status.BUDGET, 0)
    core.free(0x7E00DEAD0000)
    s = bridge.stats(0)
    assert s.limit == MIB
    assert s.num_allocs == s0.num_allocs + 1
    assert s.num_frees == s0.num_frees + 1
    assert s.num_ooms == s0.num_ooms + 1
    assert s.num_bad_frees == s0.num_bad_frees + 1
    d = s.as_dict()
    assert d["limit"] == MIB and d["by_framework"] == s.by_framework
    assert "device 0" in str(s) and "budget 1.00 MiB" in str(s)


def test_stats_is_a_snapshot(sd):
    s = bridge.stats(0)
    a = sd.alloc(MIB)
    assert s.by_framework["cupy"] == 0  # taken before the allocation
    with pytest.raises(AttributeError):
        s.limit = 5  # frozen
    sd.free(a)


def test_pool_stats_matches_bridge_stats(sd):
    a = sd.alloc(2 * MIB, dev=1)
    assert bridge.pool(1).stats().by_framework == bridge.stats(1).by_framework
    assert bridge.stats(1).by_framework["cupy"] == 2 * MIB
    assert bridge.stats(0).by_framework["cupy"] == 0
    sd.free(a)


# ---- the figures an OOM message carries ----
def test_oom_message_carries_the_pools_figures(sd):
    from bridge._errors import oom_message

    sd.alloc(3 * MIB, core.TAG_CUPY)
    sd.alloc(5 * MIB, core.TAG_TORCH)
    bridge.pool(0).set_limit(size=GIB)
    try:
        msg = oom_message(0, 2 * GIB, Status.BUDGET, framework="cupy")
    finally:
        bridge.pool(0).set_limit(0)
    assert msg.startswith("Out of memory allocating 2,147,483,648 bytes (2.00 GiB) for cupy")
    assert "on device 0: the bridge budget is 1.00 GiB" in msg
    assert "In use: cupy 3.00 MiB, torch 5.00 MiB, jax 0 B, numba 0 B, rmm 0 B, other 0 B" in msg
    assert "of 16.00 GiB" in msg and "raise the budget" in msg


def test_oom_message_names_the_frameworks_own_cap(sd):
    from bridge._errors import oom_message

    assert core.set_tag_limit(0, core.TAG_TORCH, 64 * MIB) == Status.OK
    try:
        msg = oom_message(0, GIB, Status.TAG_LIMIT, framework="torch")
    finally:
        core.set_tag_limit(0, core.TAG_TORCH, 0)
    assert "torch's share is capped at 64.00 MiB" in msg


def test_oom_message_never_fails(sd, monkeypatch):
    from bridge import _errors

    def broken(device):
        raise RuntimeError("no figures today")

    monkeypatch.setattr(_errors, "_figures", broken)
    msg = _errors.oom_message(0, MIB, Status.OOM, framework="cupy")
    assert "the device is full (bridge budget unknown)" in msg and "In use: unknown" in msg


# ---- CuPy's MemoryPool API, method for method ----
CUPY_MEMORYPOOL_METHODS = (
    "malloc",
    "free_all_blocks",
    "free_all_free",
    "n_free_blocks",
    "used_bytes",
    "free_bytes",
    "total_bytes",
    "set_limit",
    "get_limit",
)


def test_the_pool_has_every_method_of_cupys_memorypool(standin):
    p = bridge.pool(0)
    for name in CUPY_MEMORYPOOL_METHODS:
        assert callable(getattr(p, name)), name
        assert getattr(bridge.Pool, name).__doc__, name
    cupy = sys.modules.get("cupy")
    if cupy is not None:  # where CuPy is installed, nothing of its pool's API is missing
        ours = {n for n in dir(bridge.Pool) if not n.startswith("_")}
        theirs = {n for n in dir(cupy.cuda.MemoryPool) if not n.startswith("_")}
        assert theirs <= ours


def test_malloc_without_cupy_gives_a_block_on_the_budget_freed_when_dropped(standin, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    p = bridge.pool(0)

    def other() -> int:
        return next(t["current"] for t in bridge.stats(0).tags if t["name"] == "other")

    before = other()
    block = p.malloc(3 << 20)
    assert block.size == 3 << 20 and block.ptr and block.device == 0
    assert other() == before + (3 << 20)
    del block
    assert other() == before
    with pytest.raises(ValueError, match="size"):
        p.malloc(-1)


def test_numpys_integers_are_sizes_as_cupys_pool_takes_them(standin, monkeypatch):
    """``p.malloc(np.prod(shape) * 4)`` and ``p.set_limit(np.int64(n))``, as with CuPy's
    MemoryPool (size_t arguments): they were refused as "pass a number of bytes"."""
    np = pytest.importorskip("numpy")
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    p = bridge.pool(0)
    p.set_limit(np.int64(8 << 20))
    assert p.get_limit() == 8 << 20
    block = p.malloc(np.prod((256, 1024)) * np.int64(4))
    assert block.size == 1 << 20 and block.ptr
    del block
    with pytest.raises(ValueError, match="size"):
        p.malloc(np.int64(-1))
    p.set_limit(0)


def test_malloc_past_the_budget_is_an_oom_naming_the_budget(standin, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    p = bridge.pool(0)
    p.set_limit(size="64MiB")
    try:
        with pytest.raises(bridge.OutOfMemoryError) as info:
            p.malloc(128 << 20)
        assert "64.00 MiB" in str(info.value) and "device 0" in str(info.value)
    finally:
        p.set_limit(0)


def test_n_free_blocks_counts_the_blocks_kept_for_reuse_and_free_all_blocks_takes_a_stream(
    standin, monkeypatch
):
    monkeypatch.setitem(sys.modules, "cupy", None)
    p = bridge.pool(0)
    core.set_cache(0, 1 << 30)  # the stand-in's tests run without the cache unless they ask
    p.free_all_blocks()
    assert p.n_free_blocks() == 0
    blocks = [p.malloc(1 << 20) for _ in range(3)]
    del blocks  # freed into the bridge's cache of freed blocks
    assert p.n_free_blocks() == 3
    p.free_all_blocks(stream=None)
    assert p.n_free_blocks() == 0
    kept = p.malloc(1 << 20)
    del kept
    p.free_all_blocks(stream=object())  # CuPy's keyword: the shared pool empties every stream
    assert p.n_free_blocks() == 0
    p.free_all_free()
