# SPDX-License-Identifier: Apache-2.0
"""Helpers for gpu tests: the driver's own figures (cuda.bindings), an oracle
independent of bridge."""

from __future__ import annotations

GIB = 1 << 30
MIB = 1 << 20

USED = "CU_MEMPOOL_ATTR_USED_MEM_CURRENT"
RESERVED = "CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT"
THRESHOLD = "CU_MEMPOOL_ATTR_RELEASE_THRESHOLD"


# For scenarios run by run_mode: pool_used(), device 0's default pool's used
# bytes, read with cuda.bindings (an oracle independent of bridge).
POOL_USED_SNIPPET = """
from cuda.bindings import driver as cu
def pool_used():
    err, pool = cu.cuDeviceGetDefaultMemPool(0)
    attr = cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_USED_MEM_CURRENT
    err2, v = cu.cuMemPoolGetAttribute(pool, attr)
    assert err == err2 == cu.CUresult.CUDA_SUCCESS, (err, err2)
    return int(v)
"""

# For scenarios run by run_mode (after `import cupy as cp`): slow_copy, a kernel that spins
# `spin` clock cycles, then copies n floats: it keeps a block in use on its stream long enough
# for a wrong reuse of it to show in the copy.
SLOW_COPY_SNIPPET = """slow_copy = cp.RawKernel(r'''
extern "C" __global__ void slow_copy(const float* x, float* out, long long n, long long spin) {
    long long t0 = clock64();
    while (clock64() - t0 < spin) {}
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = x[i];
}''', "slow_copy")
"""

# For torch scenarios run by run_mode (after `import torch`): replays counts CUDA graph
# replays (proof that graphs were captured), torch_bytes() is torch's live bytes as the
# bridge or torch's own allocator counts them (cuBLAS's per-stream workspaces dropped:
# graphs capture on new streams).
#: Defines ``doubled_by_device_1(cupy, src)``: a kernel of device 1 reads device 0's float32
#: array ``src`` through its address (peer access to the pool ``src`` came from) and writes
#: each value twice; whether device 1's result is right. Scenarios run in a fresh process
#: paste it; tests in this process call :func:`doubled_by_device_1`.
PEER_READ_SNIPPET = r'''
def doubled_by_device_1(cupy, src):
    kernel = cupy.RawKernel(
        """extern "C" __global__ void twice(const unsigned long long src, float* dst, int n) {
            const float* s = (const float*)src;
            int i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i < n) dst[i] = 2.0f * s[i];
        }""",
        "twice",
    )
    n = src.size
    with cupy.cuda.Device(1):
        dst = cupy.empty(n, dtype=cupy.float32)
        kernel(((n + 255) // 256,), (256,), (cupy.uint64(src.data.ptr), dst, cupy.int32(n)))
        cupy.cuda.Device(1).synchronize()
        return bool((dst == 2 * cupy.asarray(src.get())).all())
'''


def doubled_by_device_1(cupy, src) -> bool:
    """:data:`PEER_READ_SNIPPET`'s function, in this process."""
    scope: dict = {}
    exec(PEER_READ_SNIPPET, scope)
    return scope["doubled_by_device_1"](cupy, src)


TORCH_GRAPH_SNIPPET = """
replays = [0]
_replay = torch.cuda.CUDAGraph.replay
def counting_replay(self, *a, **k):
    replays[0] += 1
    return _replay(self, *a, **k)
torch.cuda.CUDAGraph.replay = counting_replay

def torch_bytes():
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    if MODE == "bridge":
        return bridge.stats(0).by_framework["torch"]
    return torch.cuda.memory_allocated()
"""


def _cu():
    from cuda.bindings import driver as cu

    (err,) = cu.cuInit(0)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    err, ctx = cu.cuCtxGetCurrent()
    if err == cu.CUresult.CUDA_SUCCESS and not int(ctx):
        # the bridge leaves a thread without a context as it found it: the
        # oracle makes device 0's primary context current for its own calls
        err, dev = cu.cuDeviceGet(0)
        err, ctx = cu.cuDevicePrimaryCtxRetain(dev)
        (err,) = cu.cuCtxSetCurrent(ctx)
        assert err == cu.CUresult.CUDA_SUCCESS, err
    return cu


def driver_pool_attr(name: str, device: int = 0) -> int:
    """An attribute of the device's default pool, read with cuda.bindings."""
    cu = _cu()
    err, pool = cu.cuDeviceGetDefaultMemPool(device)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    err, value = cu.cuMemPoolGetAttribute(pool, getattr(cu.CUmemPool_attribute, name))
    assert err == cu.CUresult.CUDA_SUCCESS, err
    return int(value)


def device_bytes(ptr: int, n: int) -> bytes:
    """Copy n bytes of device memory to the host with the driver (synchronous)."""
    cu = _cu()
    host = bytearray(n)
    (err,) = cu.cuMemcpyDtoH(host, ptr, n)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    return bytes(host)


def memset(ptr: int, value: int, n: int) -> None:
    cu = _cu()
    (err,) = cu.cuMemsetD8(ptr, value, n)
    assert err == cu.CUresult.CUDA_SUCCESS, err


def carving() -> bool:
    """Whether this run carves the cache's blocks from pool chunks with no empty chunk kept
    (BRIDGE_CACHE_CARVE=1, BRIDGE_CACHE_SEGMENTS unset). A carved block's chunk holds idle
    bytes while the block lives (counted as cached), and a chunk that empties goes back to
    the pool at once: tests of the tiers' figures read them accordingly."""
    from bridge._runtime import cache_carve_from_env, cache_segments_from_env

    return cache_carve_from_env() and not cache_segments_from_env()


def segments() -> bool:
    """Whether this run's cache is segments of the pool (the default; BRIDGE_CACHE_SEGMENTS=0
    gives the exact-size tiers): a block's segment holds idle bytes while the block lives,
    and every segment that empties is kept (counted as cached) until a flush."""
    from bridge._runtime import cache_segments_from_env

    return cache_segments_from_env()


def ctx_sync() -> None:
    cu = _cu()
    (err,) = cu.cuCtxSynchronize()
    assert err == cu.CUresult.CUDA_SUCCESS, err


def run_mode(code: str, mode: str, *, env: dict | None = None, timeout: int = 300) -> dict:
    """Run a scenario in a fresh process with the native allocators or on the bridge.

    ``code`` sees ``MODE`` ("native" or "bridge") and ``report(**figures)``; it
    sets its allocators up itself (``bridge.unify`` when MODE is "bridge").
    Returns what it reported; a crash or a hang fails with its output.
    """
    import json
    import os
    import subprocess
    import sys
    import textwrap

    prelude = (
        "import faulthandler, json, os, sys\n"
        f"faulthandler.dump_traceback_later({max(timeout - 15, 5)}, exit=True)\n"
        f"MODE = {mode!r}\n"
        "def report(**kw):\n"
        "    print('RESULT ' + json.dumps(kw), flush=True)\n"
    )
    full_env = dict(os.environ)
    full_env.update(env or {})
    r = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (
        f"{mode}: exit {r.returncode}\n--- stdout\n{r.stdout[-4000:]}"
        f"\n--- stderr\n{r.stderr[-6000:]}"
    )
    return json.loads(lines[-1][len("RESULT ") :])
