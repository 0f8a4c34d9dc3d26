# SPDX-License-Identifier: Apache-2.0
"""Several GPUs: per-device pools and budgets, peer access, torchrun (two-GPU machine)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from gpu_util import GIB, MIB

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def fw():
    cupy = pytest.importorskip("cupy")
    torch = pytest.importorskip("torch")
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    import bridge

    b = bridge.unify(cupy=True, torch=True)
    assert b.devices == (0, 1)
    yield cupy, torch
    for d in b.devices:
        bridge.pool(d).set_limit(0)


def test_each_device_has_its_own_pool_and_budget(fw):
    import bridge
    from bridge._runtime import core

    cupy, torch = fw
    bridge.pool(0).set_limit(bridge.stats(0).used + 2 * GIB)
    bridge.pool(1).set_limit(bridge.stats(1).used + 4 * GIB)
    assert bridge.stats(0).limit != bridge.stats(1).limit
    t1 = torch.empty(3 * GIB, dtype=torch.uint8, device="cuda:1")  # fits device 1's budget
    assert core.lookup(t1.data_ptr())[2] == 1
    with pytest.raises(RuntimeError, match="CUDA out of memory.*device 0"):
        torch.empty(3 * GIB, dtype=torch.uint8, device="cuda:0")
    with cupy.cuda.Device(1):
        a = cupy.ones(MIB, dtype=cupy.uint8)
        assert core.lookup(a.data.ptr)[2] == 1  # CuPy's current device picks the pool
    assert bridge.stats(1).by_framework["torch"] >= 3 * GIB
    assert bridge.stats(0).by_framework["torch"] < 3 * GIB
    del t1, a


def test_peer_copies_and_a_kernel_reading_a_peers_pool_memory(fw):
    cupy, torch = fw
    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda:0")
    y = x.to("cuda:1")
    assert torch.equal(y.cpu(), x.cpu())
    with cupy.cuda.Device(0):
        src = cupy.arange(1 << 20, dtype=cupy.float32)
    kernel = cupy.RawKernel(
        r"""
    extern "C" __global__ void twice(const unsigned long long src, float* dst, int n) {
        const float* s = (const float*)src;
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) dst[i] = 2.0f * s[i];
    }""",
        "twice",
    )
    with cupy.cuda.Device(1):
        dst = cupy.empty(1 << 20, dtype=cupy.float32)
        # device 1's kernel reads device 0's pool memory through its address
        kernel(((1 << 20) // 256,), (256,), (cupy.uint64(src.data.ptr), dst, cupy.int32(1 << 20)))
        cupy.cuda.Device(1).synchronize()
        assert bool((dst == 2 * cupy.asarray(src.get())).all())


def test_torchrun_two_ranks_allreduce_on_bridge_tensors(fw, tmp_path):
    torchrun = shutil.which("torchrun")
    cmd = ([torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]) + [
        "--nproc_per_node",
        "2",
        "tests/dist_allreduce.py",
        str(tmp_path),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["sum_ok"], res
        assert res["ledger"] == [0, 4 * MIB, rank, 2], res  # from the bridge, on its own GPU
        assert res["torch_bytes"] >= 4 * MIB
        assert res["bridge_devices"] == [rank]
        assert res["other_devices_active"] == [0], f"rank {rank} touched the other GPU"


def test_a_pools_malloc_orders_its_block_on_its_devices_stream(fw):
    """``bridge.pool(1).malloc`` while device 0 is current: the block is allocated on
    device 1's current stream (CuPy's ``get_current_stream(1)``), where a kernel writes it
    and the bytes read back are what it wrote. The same on a block of CuPy's own pool made
    with device 1 current (what ``pool(1).malloc`` stands for) is the power check."""
    import numpy as np

    import bridge
    from bridge._runtime import core

    cupy, _ = fw
    n = 64 * MIB
    src = np.arange(n // 4, dtype=np.uint32)
    with cupy.cuda.Device(1):
        side = cupy.cuda.Stream(non_blocking=True)
        before = cupy.cuda.get_current_stream()
        side.use()  # device 1's current stream
    try:
        for make in ("native", "bridge"):
            cupy.cuda.Device(0).use()
            if make == "native":
                with cupy.cuda.Device(1):
                    mem = cupy.cuda.MemoryPool().malloc(n)
            else:
                mem = bridge.pool(1).malloc(n)  # device 0 current
                assert core.lookup(mem.ptr)[2] == 1
                assert [b[2] for b in core.live_blocks() if b[0] == mem.ptr] == [side.ptr]
            with cupy.cuda.Device(1):
                arr = cupy.ndarray((n // 4,), dtype=cupy.uint32, memptr=mem)
                arr.set(src, stream=side)
                arr *= 3  # on device 1's current stream, `side`
                out = arr.get(stream=side)
                side.synchronize()
            assert np.array_equal(out, src * 3), make
            del arr, mem
    finally:
        with cupy.cuda.Device(1):
            before.use()
