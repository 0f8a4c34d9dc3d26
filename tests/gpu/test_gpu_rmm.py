# SPDX-License-Identifier: Apache-2.0
"""RMM on the shared pool, on a real GPU. (scripts/gpu-test)

RMM is not on the GPU machine's Python: the run puts its wheels on PYTHONPATH
(rmm-cu13, librmm-cu13, rapids-logger); these tests install nothing and skip
without it. Each scenario runs in fresh processes with RMM's default resource
(the power check) and on the bridge; the pool's figures come from cuda.bindings.
"""

from __future__ import annotations

import pytest
from gpu_util import POOL_USED_SNIPPET, SLOW_COPY_SNIPPET, run_mode

pytestmark = pytest.mark.gpu
MODES = ("native", "bridge")

ORACLE = POOL_USED_SNIPPET  # pool_used(): the driver's figure, in the scenario

BUFFERS = (
    ORACLE
    + """
import numpy as np
import rmm
if MODE == "bridge":
    import bridge
    bridge.unify(cupy=False, torch=False, rmm=True, budget="2GiB")
def rmm_bytes():
    return bridge.stats(0).by_framework["rmm"] if MODE == "bridge" else 0
warm = rmm.DeviceBuffer(size=1)  # the runtime's context exists from here
del warm
used0 = pool_used()
b = rmm.DeviceBuffer(size=256 << 20)
data = np.arange(1 << 20, dtype=np.uint32)
c = rmm.DeviceBuffer.to_device(data.tobytes())
back = np.frombuffer(c.copy_to_host(), dtype=np.uint32)
held, delta = rmm_bytes(), pool_used() - used0
del b, c
freed = rmm_bytes()
def oom(nbytes):
    before = rmm_bytes()
    try:
        x = rmm.DeviceBuffer(size=nbytes)
        del x
        return None
    except MemoryError as e:
        held_after = rmm_bytes() - before
        return {"type": type(e).__name__, "message": str(e)[:400], "held_after": held_after}
report(checksum_ok=bool(np.array_equal(back, data)), held=held, delta=delta, freed=freed,
       past_budget=oom(3 << 30), past_device=oom(1 << 40))
"""
)


@pytest.mark.parametrize("mode", MODES)
def test_device_buffers_are_counted_as_rmm_and_budgeted(mode):
    """rmm.DeviceBuffer comes from the pool as ``rmm``; past the budget RMM's own
    MemoryError is raised and nothing is held."""
    pytest.importorskip("rmm")
    r = run_mode(BUFFERS, mode)
    assert r["checksum_ok"]
    assert r["past_device"]["type"] == "MemoryError"  # what RMM raises, both ways
    if mode == "native":
        assert r["delta"] < (256 << 20)  # cudaMalloc, not the pool: power check
        assert r["past_budget"] is None
        return
    size = (256 << 20) + 4 * (1 << 20)
    assert r["held"] == size and r["delta"] >= size
    assert r["freed"] == 0
    oom = r["past_budget"]
    assert oom["type"] == "MemoryError" and oom["held_after"] == 0
    assert "for rmm on device 0" in oom["message"] and "budget is 2.00 GiB" in oom["message"]
    assert r["past_device"]["held_after"] == 0


CUPY = (
    ORACLE
    + """
import cupy as cp
import rmm
from rmm.allocators.cupy import rmm_cupy_allocator
if MODE == "bridge":
    import bridge
    bridge.unify(cupy=False, torch=False, rmm=True, budget="2GiB")
cp.cuda.set_allocator(rmm_cupy_allocator)
cp.empty(1)
used0 = pool_used()
a = cp.arange(1 << 26, dtype=cp.float32)  # 256 MiB
total = float(a.sum(dtype=cp.float64))
by = bridge.stats(0).by_framework if MODE == "bridge" else {}
delta = pool_used() - used0
try:
    big = cp.empty(3 << 30, dtype=cp.uint8)
    refused = None
except MemoryError as e:
    refused = type(e).__name__  # MemoryError, or CuPy's OutOfMemoryError (a MemoryError)
report(total=total, rmm=by.get("rmm", 0), cupy=by.get("cupy", 0), delta=delta, refused=refused)
"""
)


@pytest.mark.parametrize("mode", MODES)
def test_a_cupy_array_on_rmm_is_counted_as_rmm(mode):
    """cupy.cuda.set_allocator(rmm_cupy_allocator): CuPy arrays come from RMM's
    resource, so from the pool as ``rmm``, under the budget."""
    pytest.importorskip("rmm")
    pytest.importorskip("cupy")
    r = run_mode(CUPY, mode)
    n = 1 << 26
    assert r["total"] == float(n * (n - 1) // 2)
    if mode == "native":
        assert r["delta"] < (256 << 20) and r["refused"] is None
        return
    assert r["rmm"] >= 256 << 20 and r["cupy"] == 0 and r["delta"] >= 256 << 20
    assert r["refused"] in ("MemoryError", "OutOfMemoryError")


STREAMS = """
import cupy as cp
import rmm
from rmm.pylibrmm.stream import Stream
if MODE == "bridge":
    import bridge
    bridge.unify(cupy=False, torch=False, rmm=True)
#SLOW_COPY
N = 50_000_000
s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
def as_array(buf):
    mem = cp.cuda.UnownedMemory(buf.ptr, buf.size, buf)
    return cp.ndarray((N,), cp.float32, cp.cuda.MemoryPointer(mem, 0))
buf = rmm.DeviceBuffer(size=N * 4, stream=Stream(s1))
with s1:
    as_array(buf).fill(3.0)
    out = cp.empty(N, dtype=cp.float32)
s1.synchronize()
with s1:
    slow_copy((264,), (256,), (as_array(buf), out, cp.int64(N), cp.int64(1_500_000_000)))
del buf  # freed on s1 while the kernel still reads it
buf2 = rmm.DeviceBuffer(size=N * 4, stream=Stream(s2))  # the same size, on another stream
with s2:
    as_array(buf2).fill(9.0)
s2.synchronize()
s1.synchronize()
report(corrupted=int((out != 3.0).sum()))
""".replace("#SLOW_COPY\n", SLOW_COPY_SNIPPET)


@pytest.mark.parametrize("mode", MODES)
def test_a_buffer_freed_on_one_stream_is_not_reused_early_on_another(mode):
    """A DeviceBuffer freed on stream s1 while a kernel reads it, then a buffer of the
    same size made and written on s2: the kernel's result is intact."""
    pytest.importorskip("rmm")
    pytest.importorskip("cupy")
    r = run_mode(STREAMS, mode)
    assert r == {"corrupted": 0}
