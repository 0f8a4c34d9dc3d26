# SPDX-License-Identifier: Apache-2.0
# gpu-test: alone (sizes its work by the device's free memory)
"""CuPy on the shared pool, on a real GPU. (Run by scripts/gpu-test.)"""

from __future__ import annotations

import gc

import pytest
from gpu_util import GIB, MIB, RESERVED, USED, driver_pool_attr

pytestmark = pytest.mark.gpu
TAG_CUPY = 1


@pytest.fixture(scope="module")
def cupy():
    cupy = pytest.importorskip("cupy")
    import bridge

    b = bridge.unify(cupy=True, torch=False)
    assert "cupy" in b.frameworks
    yield cupy
    bridge.pool(0).set_limit(0)


@pytest.fixture
def fresh(cupy):
    import bridge

    bridge.pool(0).set_limit(0)
    gc.collect()
    cupy.cuda.Device().synchronize()
    yield cupy
    bridge.pool(0).set_limit(0)
    cupy.cuda.Device().synchronize()


def test_arrays_come_from_the_ledger(fresh):
    import bridge
    from bridge._runtime import core

    cupy = fresh
    before = bridge.stats(0).by_framework["cupy"]
    a = cupy.empty(3 * MIB, dtype=cupy.uint8)
    rc, size, dev, tag = core.lookup(a.data.ptr)
    assert (rc, size, dev, tag) == (0, 3 * MIB, 0, TAG_CUPY)
    assert isinstance(
        a.data.mem.owner if hasattr(a.data.mem, "owner") else None, (core.Block, type(None))
    )
    assert bridge.stats(0).by_framework["cupy"] == before + 3 * MIB
    a[:] = 5
    assert int(a.sum()) == 15 * MIB
    del a
    cupy.cuda.Device().synchronize()
    assert bridge.stats(0).by_framework["cupy"] == before


def test_streams_reuse_is_correct(fresh):
    cupy = fresh
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(4)]
    sums = []
    for rep in range(20):
        for k, s in enumerate(streams):
            with s:
                a = cupy.full(1 << 20, rep * 4 + k, dtype=cupy.int64)
                b = a * 2
                sums.append((rep * 4 + k, b.sum()))
                del a, b
    for s in streams:
        s.synchronize()
    for v, total in sums:
        assert int(total) == v * 2 * (1 << 20)


def test_seed_lifecycle_on_the_shared_pool(fresh):
    import bridge

    cupy = fresh
    pool = bridge.pool()
    used0 = pool.used_bytes()
    a = cupy.ones(256 * MIB, dtype=cupy.uint8)
    cupy.cuda.Device().synchronize()
    assert pool.used_bytes() >= used0 + 256 * MIB
    assert pool.total_bytes() >= pool.used_bytes()
    del a
    cupy.cuda.Device().synchronize()
    assert pool.used_bytes() == used0
    assert pool.used_bytes() + bridge.stats().cached == driver_pool_attr(USED)
    assert pool.total_bytes() >= used0 + 256 * MIB  # kept in the pool
    pool.free_all_blocks()
    assert pool.total_bytes() < used0 + 256 * MIB
    assert pool.total_bytes() == driver_pool_attr(RESERVED)


def test_oom_is_cupys_with_breakdown(fresh):
    import bridge

    cupy = fresh
    bridge.pool().set_limit(bridge.stats().used + 256 * MIB)
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError) as info:
        cupy.empty(512 * MIB, dtype=cupy.uint8)
    msg = str(info.value)
    for word in ("512", "device 0", "budget", "cupy", "torch", "jax"):
        assert word in msg
    a = cupy.ones(128 * MIB, dtype=cupy.uint8)
    assert int(a.sum()) == 128 * MIB


def test_fft_plan_cache_is_released_under_pressure(fresh):
    import bridge

    cupy = fresh
    cache = cupy.fft.config.get_plan_cache()
    cache.clear()
    x = cupy.random.random(1 << 22).astype(cupy.complex64)
    cupy.fft.fft(x)
    assert cache.get_curr_size() > 0
    bridge.pool().set_limit(bridge.stats().used + 64 * MIB)
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
        cupy.empty(512 * MIB, dtype=cupy.uint8)
    assert cache.get_curr_size() == 0


def test_garbage_is_collected_before_failing(fresh):
    import bridge

    cupy = fresh

    class Holder:
        pass

    gc.disable()
    try:
        h = Holder()
        h.me = h
        h.array = cupy.ones(768 * MIB, dtype=cupy.uint8)
        del h
        bridge.pool().set_limit(bridge.stats().used + 256 * MIB)
        retries = bridge.stats().num_retries
        a = cupy.empty(512 * MIB, dtype=cupy.uint8)  # fits only once the cycle is gone
        assert a.nbytes == 512 * MIB
        assert bridge.stats().num_retries == retries + 1
    finally:
        gc.enable()


def test_cupys_own_memory_pool_is_emptied_when_the_device_is_full(fresh):
    """Blocks cached by CuPy's previous MemoryPool are returned before an OOM."""
    import bridge

    cupy = fresh
    old = cupy.get_default_memory_pool()
    free, total = cupy.cuda.runtime.memGetInfo()
    hold = free - 20 * GIB
    mem = old.malloc(hold)  # CuPy's own pool, outside the shared pool
    del mem
    assert old.total_bytes() >= hold
    bridge.pool().free_all_blocks()
    a = cupy.empty(40 * GIB, dtype=cupy.uint8)  # needs what CuPy's pool caches
    assert a.nbytes == 40 * GIB
    assert old.total_bytes() == 0
    del a


def test_current_device_picks_the_pool(fresh):
    cupy = fresh
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("one GPU: per-device pools need two")
    from bridge._runtime import core

    with cupy.cuda.Device(1):
        a = cupy.ones(MIB, dtype=cupy.uint8)
        assert core.lookup(a.data.ptr)[2] == 1


def _stream_keyed_reuse(cupy) -> tuple[int, int, int]:
    """A block freed on the legacy default stream is reused there, not on the per-thread one."""
    n = 5 * MIB + 512
    a = cupy.empty(n, dtype=cupy.uint8)
    a[:] = 1
    p = a.data.ptr
    del a  # kept for the legacy stream (the bridge's cache; CuPy's pool: its free list)
    with cupy.cuda.Stream.ptds:
        b = cupy.empty(n, dtype=cupy.uint8)  # another stream: never the block just freed
        b[:] = 3
        cupy.cuda.Stream.ptds.synchronize()
    c = cupy.empty(n, dtype=cupy.uint8)
    c[:] = 2
    assert int(c.sum()) == 2 * n and int(b.sum()) == 3 * n
    out = (p, b.data.ptr, c.data.ptr)
    del b, c
    cupy.cuda.Device().synchronize()
    return out


@pytest.mark.parametrize("allocator", ["native", "bridge"])
def test_the_allocation_stream_is_cupys_current_one(fresh, allocator):
    """CuPy's device and stream, read through CuPy's own C functions on the bridge
    (``direct_lookups``): a block is reused on the stream CuPy allocated it on and on no
    other. The native half runs the same steps on a CuPy ``MemoryPool`` of its own."""
    from bridge.adapters import cupy as adapter

    cupy = fresh
    if allocator == "native":
        pool = cupy.cuda.MemoryPool()
        cupy.cuda.set_allocator(pool.malloc)
        try:
            p, other, again = _stream_keyed_reuse(cupy)
        finally:
            cupy.cuda.set_allocator(adapter._allocator)
            pool.free_all_blocks()
    else:
        assert adapter.installed()
        assert adapter._allocator.direct_lookups is True  # CuPy's signatures as this file knows
        p, other, again = _stream_keyed_reuse(cupy)
    assert again == p and other != p


def _views_and_pointers(cupy) -> tuple[int, list[int], int]:
    """A view that outlives its array, pointer arithmetic and DLPack on the array's memory:
    (the view's sum, a slice read back, whether DLPack's array shares the address)."""
    a = cupy.arange(1 << 20, dtype=cupy.int32)
    view = a[10:20]
    del a  # the view keeps the memory: its values stay
    shifted = view.data + 8  # two int32 on: the same memory object
    assert shifted.mem is view.data.mem and shifted.ptr == view.data.ptr + 8
    back = cupy.from_dlpack(view)
    shared = int(back.data.ptr == view.data.ptr)
    out = int(view.sum()), cupy.asnumpy(back[:3]).tolist(), shared
    del view, shifted, back
    return out


@pytest.mark.parametrize("allocator", ["native", "bridge"])
def test_blocks_are_bridge_memory_in_cupys_memory_pointer(fresh, allocator):
    """CuPy's blocks on the bridge are BridgeMemory, a BaseMemory made in C, inside CuPy's
    own MemoryPointer (CuPy 14's layout checks out); views, pointer arithmetic and DLPack
    read them as CuPy's own. The native half runs the same steps on a CuPy MemoryPool."""
    from cupy.cuda import memory as cmem

    import bridge
    from bridge.adapters import cupy as adapter

    cupy = fresh
    if allocator == "native":
        pool = cupy.cuda.MemoryPool()
        cupy.cuda.set_allocator(pool.malloc)
        try:
            got = _views_and_pointers(cupy)
        finally:
            cupy.cuda.set_allocator(adapter._allocator)
            pool.free_all_blocks()
    else:
        alloc = adapter._allocator
        assert alloc.memory_objects == "BridgeMemory", alloc.memory_problem
        before = bridge.stats(0).by_framework["cupy"]
        a = cupy.empty(3 * MIB, dtype=cupy.uint8)
        mem = a.data.mem
        assert type(mem).__name__ == "BridgeMemory" and isinstance(mem, cmem.BaseMemory)
        assert isinstance(a.data, cmem.MemoryPointer)
        assert (mem.ptr, mem.size, mem.device_id) == (a.data.ptr, 3 * MIB, 0)
        assert a.data.device_id == 0 and int(a.data) == mem.ptr
        assert bridge.stats(0).by_framework["cupy"] == before + 3 * MIB
        del a, mem
        assert bridge.stats(0).by_framework["cupy"] == before  # its end freed the block
        got = _views_and_pointers(cupy)
        cupy.cuda.Device().synchronize()
        assert bridge.stats(0).by_framework["cupy"] == before
    assert got == (sum(range(10, 20)), [10, 11, 12], 1)


def test_cupy_unowned_keeps_cupys_unowned_memory():
    """BRIDGE_CUPY_UNOWNED=1: the blocks are CuPy's UnownedMemory with a Block as owner."""
    import os
    import subprocess
    import sys

    code = (
        "import bridge, cupy\n"
        "bridge.unify(cupy=True, torch=False)\n"
        "from bridge.adapters import cupy as adapter\n"
        "a = cupy.arange(1000, dtype=cupy.int64)\n"
        "print(adapter._allocator.memory_objects, type(a.data.mem).__name__,\n"
        "      type(a.data.mem._owner).__name__, int(a.sum()))\n"
    )
    env = dict(os.environ, BRIDGE_CUPY_UNOWNED="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["UnownedMemory", "UnownedMemory", "Block", str(sum(range(1000)))]
