# SPDX-License-Identifier: Apache-2.0
"""Managed memory on the budget with CuPy, on a real GPU. (Run by scripts/gpu-test.)

Small sizes only (a few MiB): managed memory is never asked for beyond what the
card has free, so the shared machine is never oversubscribed.
"""

from __future__ import annotations

import gc

import pytest
from gpu_util import MIB

pytestmark = pytest.mark.gpu
CU_MEMORYTYPE_MANAGED = 3  # cudaMemoryTypeManaged (pointerGetAttributes().type)


def _pool_allocator():
    import importlib

    return importlib.import_module("bridge.adapters.cupy")._allocator


@pytest.fixture(scope="module")
def cupy():
    cupy = pytest.importorskip("cupy")
    import bridge

    b = bridge.unify(cupy=True, torch=False)
    assert "cupy" in b.frameworks
    free, _ = cupy.cuda.runtime.memGetInfo()
    assert free > 256 * MIB, "the card has too little free memory for this test"
    yield cupy
    bridge.pool(0).set_limit(0)


@pytest.fixture
def fresh(cupy):
    import bridge

    bridge.pool(0).set_limit(0)
    gc.collect()
    cupy.cuda.Device().synchronize()
    yield cupy
    gc.collect()
    cupy.cuda.Device().synchronize()
    bridge.pool(0).set_limit(0)
    cupy.cuda.set_allocator(_pool_allocator())  # the pool again


def test_a_managed_array_is_managed_memory_counted_as_cupy(fresh):
    import bridge
    from bridge import managed

    cupy = fresh
    before = bridge.stats(0).by_framework["cupy"]
    cupy.cuda.set_allocator(bridge.malloc_managed)
    a = cupy.ones(MIB, dtype=cupy.float32)  # 4 MiB
    cupy.cuda.set_allocator(_pool_allocator())
    attrs = cupy.cuda.runtime.pointerGetAttributes(a.data.ptr)
    assert attrs.type == CU_MEMORYTYPE_MANAGED
    assert bridge.stats(0).by_framework["cupy"] == before + 4 * MIB
    assert managed.managed_stats(0) == (4 * MIB, 1)
    assert float(a.sum()) == float(MIB)  # written on the GPU, read back
    assert float(a[:8].get().sum()) == 8.0
    del a
    gc.collect()
    assert managed.managed_stats(0) == (0, 0)
    assert bridge.stats(0).by_framework["cupy"] == before


def test_the_budget_refuses_managed_memory_with_cupys_oom(fresh):
    import bridge

    cupy = fresh
    bridge.pool(0).free_all_blocks()  # nothing idle: the recovery chain would give it back
    held = bridge.stats(0).ledger
    bridge.pool(0).set_limit(size=held + 8 * MIB)
    kept = bridge.malloc_managed(6 * MIB)
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError) as info:
        bridge.malloc_managed(4 * MIB)  # refused by the budget: the driver is not asked
    assert "managed memory" in str(info.value)
    del info, kept
    gc.collect()
    again = bridge.malloc_managed(8 * MIB)
    assert again.mem.size == 8 * MIB


@pytest.mark.parametrize("which", ["native", "bridge"])
def test_a_managed_arrays_memory_prefetches_and_takes_advice(fresh, which):
    """CuPy's ManagedMemory methods on the array's ``data.mem``: with CuPy's own
    malloc_managed (the native half) and with the bridge's, which gave a plain
    UnownedMemory without them (AttributeError)."""
    import bridge

    cupy = fresh
    alloc = cupy.cuda.malloc_managed if which == "native" else bridge.malloc_managed
    cupy.cuda.set_allocator(alloc)
    try:
        a = cupy.ones(MIB, dtype=cupy.float32)  # 4 MiB
    finally:
        cupy.cuda.set_allocator(_pool_allocator())
    stream = cupy.cuda.Stream(non_blocking=True)
    mem = a.data.mem
    mem.advise(1, cupy.cuda.Device(0))  # cudaMemAdviseSetReadMostly
    mem.prefetch(stream)  # to the array's device
    stream.synchronize()
    with stream:
        total = float(a.sum())
    mem.prefetch(stream, device_id=0)  # to device 0, named
    stream.synchronize()
    assert total == float(MIB)
    del a, mem
    gc.collect()


@pytest.mark.parametrize("which", ["native", "bridge"])
def test_a_managed_block_larger_than_the_card(fresh, which):
    """Managed memory may be larger than the card (the driver pages it in and out):
    CuPy's malloc_managed gives it (the native half); the bridge's refused any block
    larger than the device without a budget ("the device is full").  Only a few pages
    are touched: the host's memory is not used up."""
    import bridge

    cupy = fresh
    n = bridge.stats(0).total + 64 * MIB
    alloc = cupy.cuda.malloc_managed if which == "native" else bridge.malloc_managed
    p = alloc(n)
    a = cupy.ndarray((n,), dtype=cupy.uint8, memptr=p)
    a[:4096].fill(1)
    a[-4096:].fill(2)
    assert int(a[:4096].sum()) + int(a[-4096:].sum()) == 3 * 4096
    del a, p
    gc.collect()
