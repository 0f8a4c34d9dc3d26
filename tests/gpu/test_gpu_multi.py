# SPDX-License-Identifier: Apache-2.0
"""Several GPUs: per-device pools and budgets, peer access, torchrun (two-GPU machine)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from gpu_util import GIB, MIB, PEER_READ_SNIPPET, doubled_by_device_1

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
    assert doubled_by_device_1(cupy, src)  # device 1 reads device 0's pool memory


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


JAX_ON_DEVICE_1 = """
import ctypes, os
GIB = 1 << 30
cu = ctypes.CDLL("libcuda.so.1")
dev, total, count = ctypes.c_int(), ctypes.c_size_t(), ctypes.c_int()
assert cu.cuInit(0) == 0 and cu.cuDeviceGetCount(ctypes.byref(count)) == 0
if count.value < 2:
    report(gpus=count.value)
    sys.exit(0)
assert cu.cuDeviceGet(ctypes.byref(dev), 1) == 0
assert cu.cuDeviceTotalMem_v2(ctypes.byref(total), dev) == 0
cache = limit = None
if MODE == "bridge":
    import bridge, torch
    if PARTITION:
        bridge.unify(cupy=False, torch=True, jax=True, device=0, jax_memory="4GiB")
    else:
        bridge.unify(cupy=False, torch=True, jax=True, device=0)
    t = torch.empty(GIB, dtype=torch.uint8, device="cuda:1")  # sets device 1 up now
    del t
    torch.cuda.synchronize(1)
    cache, limit = bridge.stats(1).cached, bridge.stats(1).limit
elif PARTITION:  # JAX alone with the fraction the bridge gives it
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{4 * GIB / total.value:.6f}"
else:
    os.environ.update(XLA_PYTHON_CLIENT_ALLOCATOR="cuda_async",
                      XLA_PYTHON_CLIENT_PREALLOCATE="false")
import jax, jax.numpy as jnp
gpus = jax.devices("gpu")
x = jnp.ones((GIB // 4,), dtype=jnp.float32, device=gpus[1])  # 1 GiB on device 1
x.block_until_ready()
report(gpus=len(gpus), cache=cache, limit=limit,
       jax_limit=gpus[1].memory_stats().get("bytes_limit"))
"""


@pytest.mark.parametrize("partition", [False, True], ids=["shared", "partition"])
@pytest.mark.parametrize("mode", ["native", "bridge"])
def test_jax_on_a_device_outside_unify_device(mode, partition):
    """JAX takes every visible GPU (the native half: an array on device 1; with a fraction,
    its arena there too). Under unify(jax=True, device=0) a device 1 set up later by torch
    keeps no cache (JAX could not have the cached blocks) or, with jax_memory, gives JAX's
    arena up from BRIDGE_GPU_MEMORY_LIMIT as device 0 does."""
    pytest.importorskip("jax")
    if mode == "bridge":
        pytest.importorskip("torch")
    from gpu_util import run_mode

    code = f"PARTITION = {partition}\n" + JAX_ON_DEVICE_1
    env = {"BRIDGE_GPU_MEMORY_LIMIT": "40GiB"} if mode == "bridge" else {}
    r = run_mode(code, mode, env=env)
    if r["gpus"] < 2:
        pytest.skip("needs two GPUs")
    if partition:
        assert abs(r["jax_limit"] - 4 * GIB) < 64 * MIB  # JAX's arena on device 1 too
    if mode == "native":
        return
    if partition:
        assert r["limit"] == 36 * GIB
    else:
        assert r["cache"] == 0


_ADDED_DEVICE = (
    PEER_READ_SNIPPET
    + r"""
import sys
import cupy
if sys.argv[1] == "bridge":
    import bridge
    bridge.unify(cupy=True, torch=False, device=0)
    assert bridge.unify(cupy=True, torch=False, device=1).devices == (0, 1)
else:  # CuPy's own pool: peer access as CuPy's users enable it
    with cupy.cuda.Device(1):
        cupy.cuda.runtime.deviceEnablePeerAccess(0)
with cupy.cuda.Device(0):
    src = cupy.arange(1 << 20, dtype=cupy.float32)
print(doubled_by_device_1(cupy, src))
"""
)


@pytest.mark.parametrize("make", ["native", "bridge"])
def test_a_device_added_by_a_later_call_reads_the_earlier_devices_pool(fw, make):
    """unify(device=0), then unify(device=1): a kernel of device 1 reads an array of
    device 0's pool, as after unify(device=[0, 1]) (it faulted: no call granted device 0's
    pool to device 1). Native: CuPy's own pool with peer access enabled."""
    r = subprocess.run(
        [sys.executable, "-c", _ADDED_DEVICE, make], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["True"]
