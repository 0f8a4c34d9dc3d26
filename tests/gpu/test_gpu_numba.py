# SPDX-License-Identifier: Apache-2.0
"""Numba on the shared pool, on a real GPU. (scripts/gpu-test)

Each scenario runs in fresh processes with Numba's own memory manager (the
power check: the same code, the same answers, and the pool untouched) and on
the bridge. The pool's figures are read with cuda.bindings, the oracle.
"""

from __future__ import annotations

import pytest
from gpu_util import POOL_USED_SNIPPET, run_mode

pytestmark = pytest.mark.gpu
MODES = ("native", "bridge")

# numba-cuda 0.30.4 registers an overload for np.row_stack when it compiles its
# first kernel; numpy 2.5 removed that alias (docs/numba.md), so kernels did not
# compile on the GPU machine, natively either
NUMPY_SHIM = """
import numpy as _np
if not hasattr(_np, "row_stack"):
    _np.row_stack = _np.vstack
"""
ORACLE = NUMPY_SHIM + POOL_USED_SNIPPET  # pool_used(): the driver's figure, in the scenario

ARRAYS = (
    ORACLE
    + """
import gc
import numpy as np
if MODE == "bridge":
    import bridge
    bridge.unify(cupy=False, torch=False, numba=True, budget="2GiB")
from numba import cuda
from numba.cuda.cudadrv.driver import CudaAPIError
from cuda.bindings.driver import CUresult

@cuda.jit
def axpy(a, x, y, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a * x[i] + y[i]

def numba_bytes():
    return bridge.stats(0).by_framework["numba"] if MODE == "bridge" else 0

def numba_allocs():
    if MODE != "bridge":
        return 0
    return bridge.stats(0).tags[bridge._runtime.core.TAG_NUMBA]["num_allocs"]

cuda.current_context()
used0 = pool_used()
n = 1 << 24  # 64 MiB of float32
x = np.arange(n, dtype=np.float32)
y = np.ones(n, dtype=np.float32)
dx, dy = cuda.to_device(x), cuda.to_device(y)
dout = cuda.device_array(n, dtype=np.float32)
axpy[(n + 255) // 256, 256](np.float32(2), dx, dy, dout)
ok_arrays = bool(np.array_equal(dout.copy_to_host(), 2 * x + y))
cuda.synchronize()
held = numba_bytes()
pool_delta = pool_used() - used0
view = dout[1024:]  # a view keeps its base's memory
del dout
gc.collect()
held_by_view = numba_bytes()
del view
# a kernel launched on host arrays: Numba copies them to the device itself
allocs0 = numba_allocs()
hx = np.ones(1 << 20, np.float32)
hout = np.zeros(1 << 20, np.float32)
axpy[4096, 256](np.float32(3), hx, hx, hout)
ok_host = bool((hout == 4).all())  # 3 * 1 + 1, copied back by Numba
launch_allocs = numba_allocs() - allocs0
del dx, dy
gc.collect()
after_free = numba_bytes()

def oom(nbytes):
    before = numba_bytes()
    try:
        a = cuda.device_array(nbytes, dtype=np.uint8)
        del a
        return None
    except CudaAPIError as e:
        return {"cudaapierror": True, "oom_code": e.code == CUresult.CUDA_ERROR_OUT_OF_MEMORY,
                "memoryerror": isinstance(e, MemoryError), "message": str(e)[:400],
                "held_after": numba_bytes() - before}

report(ok_arrays=ok_arrays, ok_host=ok_host, held=held, pool_delta=pool_delta,
       held_by_view=held_by_view, launch_allocs=launch_allocs, after_free=after_free,
       past_budget=oom(3 << 30), past_device=oom(1 << 40))
"""
)


@pytest.mark.parametrize("mode", MODES)
def test_arrays_to_device_and_kernels_are_counted_and_budgeted(mode):
    """device_array, to_device and a kernel's copies of host arrays come from the
    pool as ``numba``; past the budget Numba's own OOM (CudaAPIError) is raised."""
    pytest.importorskip("numba.cuda")
    r = run_mode(ARRAYS, mode)
    assert r["ok_arrays"] and r["ok_host"]
    mib64 = 64 << 20
    # a request larger than the device: Numba's CudaAPIError with the OOM code, both ways
    assert r["past_device"]["cudaapierror"] and r["past_device"]["oom_code"]
    if mode == "native":
        assert r["pool_delta"] < mib64  # Numba's cuMemAlloc is not the pool: power check
        assert r["past_budget"] is None  # no budget: 3 GiB fits
        return
    assert r["held"] == 3 * mib64
    assert r["pool_delta"] >= 3 * mib64  # the driver sees them in the default pool
    assert r["held_by_view"] == 3 * mib64
    # a launch on NumPy arrays: numba-cuda 0.30.4 made no allocation through the
    # plugin on the H200 (0 counted; docs/numba.md), so none is required here
    assert r["after_free"] == 0
    oom = r["past_budget"]
    assert oom["cudaapierror"] and oom["oom_code"] and oom["memoryerror"]
    assert "for numba on device 0" in oom["message"] and "budget is 2.00 GiB" in oom["message"]
    assert oom["held_after"] == 0
    assert r["past_device"]["memoryerror"] and r["past_device"]["held_after"] == 0


ENV = (
    ORACLE
    + """
import os
import numpy as np
from numba import cuda
from numba.cuda.cudadrv.driver import CudaAPIError
cuda.current_context()
used0 = pool_used()
a = cuda.device_array(256 << 20, dtype=np.uint8)
a.copy_to_device(np.full(256 << 20, 7, np.uint8))
checksum = int(a.copy_to_host().sum(dtype=np.int64))
delta = pool_used() - used0
figures = None
if MODE == "bridge":
    import bridge
    figures = bridge.stats(0).by_framework["numba"]
try:
    b = cuda.device_array(2 << 30, dtype=np.uint8)
    refused = False
except CudaAPIError:
    refused = True
report(checksum=checksum, delta=delta, numba=figures, refused=refused,
       manager=type(cuda.current_context().memory_manager).__name__)
"""
)


@pytest.mark.parametrize("mode", MODES)
def test_the_environment_variable_puts_numba_on_the_pool(mode):
    """NUMBA_CUDA_MEMORY_MANAGER=bridge.adapters.numba without unify(): the budget of
    BRIDGE_GPU_MEMORY_LIMIT holds, and arrays are counted as numba."""
    pytest.importorskip("numba.cuda")
    env = {}
    if mode == "bridge":
        env = {
            "NUMBA_CUDA_MEMORY_MANAGER": "bridge.adapters.numba",
            "BRIDGE_GPU_MEMORY_LIMIT": "1GiB",
        }
    r = run_mode(ENV, mode, env=env)
    assert r["checksum"] == 7 * (256 << 20)
    if mode == "native":
        assert r["delta"] < (256 << 20) and not r["refused"]
        return
    assert r["manager"] == "BridgeNumbaManager"
    assert r["numba"] == 256 << 20 and r["delta"] >= 256 << 20
    assert r["refused"]


STREAMS = (
    NUMPY_SHIM
    + """
import threading
import numpy as np
if MODE == "bridge":
    import bridge
    bridge.unify(cupy=False, torch=False, numba=True)
from numba import cuda

@cuda.jit
def slow_copy(x, out, naps):
    for _ in range(naps):
        cuda.nanosleep(1000000)  # about 1 ms each
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < out.size:
        out[i] = x[i]
        i += stride

@cuda.jit
def fill(y, v):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < y.size:
        y[i] = v
        i += stride

N = 50_000_000
s1, s2 = cuda.stream(), cuda.stream()
x = cuda.to_device(np.full(N, 3.0, np.float32))
out = cuda.device_array(N, np.float32)
cuda.synchronize()
slow_copy[264, 256, s1](x, out, 1500)
del x  # dropped while the kernel still reads it
y = cuda.device_array(N, np.float32)  # the same size, another stream
fill[264, 256, s2](y, np.float32(9.0))
s1.synchronize()
s2.synchronize()
host = out.copy_to_host()
pinned = cuda.pinned_array(1 << 20, np.float32)
pinned[:] = 5
d = cuda.to_device(pinned, stream=s1)
s1.synchronize()
pinned_ok = bool((d.copy_to_host() == 5).all())
pool = bridge.pinned_pool().used_bytes() if MODE == "bridge" else 0
report(corrupted=int((host != 3.0).sum()), pinned_ok=pinned_ok, pinned_pool=pool)
"""
)


@pytest.mark.parametrize("mode", MODES)
def test_a_dropped_array_is_not_reused_before_its_kernel_is_done(mode):
    """An array dropped while a kernel on a Numba stream reads it is freed in stream
    order: a new array written on another stream does not corrupt the result.
    cuda.pinned_array comes from the bridge's pinned pool."""
    pytest.importorskip("numba.cuda")
    r = run_mode(STREAMS, mode)
    assert r["corrupted"] == 0 and r["pinned_ok"]
    if mode == "bridge":
        assert r["pinned_pool"] >= 4 << 20


IPC = (
    ORACLE
    + """
import numpy as np
if MODE == "bridge":
    import bridge
    bridge.unify(cupy=False, torch=False, numba=True)
from numba import cuda
from numba.cuda.cudadrv.driver import CudaAPIError
from cuda.bindings import driver as cu
a = cuda.device_array(1 << 20, dtype=np.uint8)
try:
    a.get_ipc_handle()
    handle = {"ok": True}
except CudaAPIError as e:
    handle = {"ok": False, "code": int(e.code), "message": str(e)}
# the premise: the driver refuses an IPC handle for a block of the default pool
err, ptr = cu.cuMemAllocAsync(1 << 20, cu.CUstream(0))
assert err == cu.CUresult.CUDA_SUCCESS, err
pool_ipc = cu.cuIpcGetMemHandle(ptr)[0] == cu.CUresult.CUDA_SUCCESS
cu.cuMemFreeAsync(ptr, cu.CUstream(0))
report(handle=handle, pool_ipc=pool_ipc,
       not_supported=int(cu.CUresult.CUDA_ERROR_NOT_SUPPORTED))
"""
)


@pytest.mark.parametrize("mode", MODES)
def test_an_ipc_handle_of_a_pool_array_is_refused_saying_why(mode):
    """Numba's get_ipc_handle() uses cuIpcGetMemHandle, which the driver refuses for a block
    of the default pool (checked in both modes). Natively (cuMemAlloc) the handle is made;
    on the bridge Numba's CudaAPIError (CUDA_ERROR_NOT_SUPPORTED) says why and what to do."""
    pytest.importorskip("numba.cuda")
    r = run_mode(IPC, mode)
    assert r["pool_ipc"] is False
    if mode == "native":
        assert r["handle"] == {"ok": True}
        return
    h = r["handle"]
    assert h["ok"] is False and h["code"] == r["not_supported"]
    assert "no CUDA IPC handle" in h["message"] and "copy_to_host" in h["message"]
