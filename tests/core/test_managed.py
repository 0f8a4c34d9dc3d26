# SPDX-License-Identifier: Apache-2.0
"""Managed memory on the budget (bridge.malloc_managed), on the stand-in driver."""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys

import pytest

import bridge
from bridge import managed
from bridge._runtime import core

MIB = 1 << 20


@pytest.fixture
def no_cupy(standin, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    standin.standin_managed_bytes.restype = ctypes.c_uint64
    standin.standin_managed_bytes.argtypes = [ctypes.c_int]
    gc.collect()  # blocks an earlier test's traceback kept
    yield standin
    gc.collect()


def _tag(name: str) -> dict:
    return next(t for t in bridge.stats(0).tags if t["name"] == name)


def test_managed_memory_counts_under_its_framework_and_is_freed_like_the_rest(no_cupy):
    before = _tag("other")["current"]
    s0 = bridge.stats(0)
    block = bridge.malloc_managed(4 * MIB)
    try:
        assert block.size == 4 * MIB and block.ptr and block.device == 0
        assert no_cupy.standin_managed_bytes(0) == 4 * MIB  # the driver's managed memory
        assert _tag("other")["current"] == before + 4 * MIB
        s = bridge.stats(0)
        assert s.ledger == s0.ledger + 4 * MIB
        assert managed.managed_stats(0) == (4 * MIB, 1)
        # outside the stream-ordered pool: the pool's figures do not move
        assert (s.reserved, s.used) == (s0.reserved, s0.used)
        ctypes.memset(block.ptr, 7, 16)  # host-accessible, as managed memory is
    finally:
        del block
    gc.collect()
    assert no_cupy.standin_managed_bytes(0) == 0
    assert _tag("other")["current"] == before
    assert managed.managed_stats(0) == (0, 0)


def test_the_budget_refuses_managed_memory_past_it_naming_the_budget(no_cupy):
    bridge.pool(0).set_limit(size="8MiB")
    kept = bridge.malloc_managed(6 * MIB)
    with pytest.raises(bridge.OutOfMemoryError) as info:
        bridge.malloc_managed(4 * MIB)
    msg = str(info.value)
    del info  # its traceback would keep this frame, and `kept`, alive
    assert "managed memory" in msg and "8.00 MiB" in msg and "device 0" in msg
    assert no_cupy.standin_managed_bytes(0) == 6 * MIB  # the driver was not asked
    assert bridge.stats(0).num_ooms >= 1
    del kept
    again = bridge.malloc_managed(8 * MIB)  # the freed bytes are the budget's again
    assert again.size == 8 * MIB


def test_managed_and_pool_memory_share_one_budget(no_cupy):
    bridge.pool(0).set_limit(size="8MiB")
    rc, pooled = core.alloc_block(0, 6 * MIB, 0, core.TAG_OTHER, None)
    assert rc == 0
    with pytest.raises(bridge.OutOfMemoryError):
        bridge.malloc_managed(4 * MIB)
    del pooled
    assert bridge.malloc_managed(4 * MIB).size == 4 * MIB


def test_a_driver_refusal_gives_the_budget_back(no_cupy):
    no_cupy.standin_fail(b"cuMemAllocManaged", 2, 2)  # CUDA_ERROR_OUT_OF_MEMORY, twice
    before = bridge.stats(0).ledger
    with pytest.raises(bridge.OutOfMemoryError):
        bridge.malloc_managed(MIB)
    assert bridge.stats(0).ledger == before


def test_bad_sizes_and_zero(no_cupy):
    with pytest.raises(ValueError, match="size"):
        bridge.malloc_managed(-1)
    with pytest.raises(ValueError, match="size"):
        bridge.malloc_managed(1.5)  # type: ignore[arg-type]
    assert managed.allocate(0, 0, core.TAG_OTHER) is None
    assert core.alloc_managed(0, MIB, 99)[0] != 0  # a bad tag


@pytest.mark.parametrize("device", [2, 5, -1, 64])
def test_the_figures_of_a_device_that_is_not_there_are_refused(no_cupy, device):
    """managed_stats(5) on a machine of 2 GPUs answered (0, 0), as for a GPU without
    managed memory; allocating there says there is no such device, and so does it."""
    with pytest.raises(ValueError, match=rf"device={device}: no such CUDA device \(there are 2\)"):
        managed.managed_stats(device)
    assert managed.managed_stats(1) == (0, 0)


# A stand-in cupy for the child below: CuPy's memory classes as plain Python (UnownedMemory
# keeps ptr, size, owner and device_id; MemoryPointer its mem), its runtime recording the
# prefetches and advice it is asked for.
_STANDIN_CUPY_MANAGED = """
import sys, types
calls = []
cupy = types.ModuleType("cupy")
cuda = types.ModuleType("cupy.cuda")
memory = types.ModuleType("cupy.cuda.memory")
class OutOfMemoryError(MemoryError):
    def __init__(self, size, total, limit=0):
        super().__init__(size, total, limit)
class UnownedMemory:
    def __init__(self, ptr, size, owner, device_id=-1):
        self.ptr, self.size, self._owner, self.device_id = ptr, size, owner, device_id
class MemoryPointer:
    def __init__(self, mem, offset):
        self.mem, self.ptr = mem, mem.ptr + offset
memory.OutOfMemoryError, memory.UnownedMemory, memory.MemoryPointer = (
    OutOfMemoryError, UnownedMemory, MemoryPointer)
cuda.memory = memory
cuda.device = types.SimpleNamespace(get_device_id=lambda: 0)
cuda.runtime = types.SimpleNamespace(
    getDevice=lambda: 0,
    memPrefetchAsync=lambda *a: calls.append(("prefetch",) + a),
    memAdvise=lambda *a: calls.append(("advise",) + a),
)
cupy.cuda = cuda
sys.modules.update({"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.memory": memory})

import bridge
p = bridge.malloc_managed(1 << 20)
stream, dev1 = types.SimpleNamespace(ptr=77), types.SimpleNamespace(id=1)
p.mem.prefetch(stream)                # to the block's device, as ManagedMemory.prefetch
p.mem.prefetch(stream, device_id=-1)  # to the host (cudaCpuDeviceId)
p.mem.advise(3, dev1)                 # cudaMemAdviseSetPreferredLocation for device 1
assert calls == [
    ("prefetch", p.ptr, 1 << 20, 0, 77),
    ("prefetch", p.ptr, 1 << 20, -1, 77),
    ("advise", p.ptr, 1 << 20, 3, 1),
], calls
print("ok")
"""


def test_cupys_managed_memory_methods_prefetch_and_advise_the_block(standin):
    """cupy.cuda.malloc_managed's MemoryPointer.mem is CuPy's ManagedMemory, whose
    prefetch(stream) and advise(advice, device) code written for CuPy calls; the bridge's
    malloc_managed gave a plain UnownedMemory, and both raised AttributeError.
    tests/gpu/test_gpu_managed.py runs them on CuPy."""
    r = subprocess.run(
        [sys.executable, "-c", _STANDIN_CUPY_MANAGED],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


_LARGER_THAN_THE_DEVICE = """
import sys
sys.modules["cupy"] = None  # the block itself
import bridge
from bridge import managed
total = bridge.stats(0).total
assert total == 64 << 20, total
block = bridge.malloc_managed(total + (32 << 20))  # no budget: only the driver decides
assert block.size == total + (32 << 20)
assert managed.managed_stats(0) == (total + (32 << 20), 1)
assert bridge.stats(0).by_framework["other"] == total + (32 << 20)
del block
bridge.pool(0).set_limit(size="48MiB")  # a budget still refuses it
try:
    bridge.malloc_managed(total)
except bridge.OutOfMemoryError as e:
    assert "48.00 MiB" in str(e), e
else:
    raise AssertionError("the budget let it through")
print("ok")
"""


def test_managed_memory_larger_than_the_device_is_the_drivers_to_refuse(standin):
    """cudaMallocManaged gives a block larger than the GPU (the driver pages it in and
    out: oversubscription, what managed memory is for); the bridge's malloc_managed
    refused any block larger than the device, without a budget, saying the device was
    full with nothing in use."""
    r = subprocess.run(
        [sys.executable, "-c", _LARGER_THAN_THE_DEVICE],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, BRIDGE_STANDIN_TOTAL=str(64 << 20)),
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
