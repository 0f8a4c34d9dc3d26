# SPDX-License-Identifier: Apache-2.0
"""PyTorch on the shared pool, on a real GPU. (Run by scripts/gpu-test.)"""

from __future__ import annotations

import gc
import subprocess
import sys
import threading

import pytest
from gpu_util import GIB, MIB, RESERVED, driver_pool_attr, run_mode

pytestmark = pytest.mark.gpu
TAG_TORCH = 2


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    import bridge

    b = bridge.unify(cupy=False, torch=True)
    assert "torch" in b.frameworks
    from bridge.adapters import torch as adapter

    assert adapter.installed()
    yield torch
    bridge.pool(0).set_limit(0)


@pytest.fixture
def fresh(torch):
    import bridge

    bridge.pool(0).set_limit(0)
    gc.collect()  # tensors held by earlier tests' tracebacks go now, not mid-test
    torch.cuda.synchronize()
    yield torch
    bridge.pool(0).set_limit(0)
    torch.cuda.set_per_process_memory_fraction(1.0)
    gc.collect()
    torch.cuda.synchronize()


def test_unify_after_cuda_started_says_before():
    code = (
        "import torch, bridge\n"
        "torch.zeros(1, device='cuda')\n"
        "try:\n"
        "    bridge.unify(cupy=False, torch=True)\n"
        "except bridge.BridgeError as e:\n"
        "    print('ERR', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ERR ")
    assert "before" in r.stdout and "unify(torch=True)" in r.stdout


def test_tensors_come_from_the_ledger(fresh):
    import bridge
    from bridge._runtime import core

    torch = fresh
    before = bridge.stats(0).by_framework["torch"]
    t = torch.empty(5 * MIB, dtype=torch.uint8, device="cuda")
    rc, size, dev, tag = core.lookup(t.data_ptr())
    assert (rc, size, dev, tag) == (0, 5 * MIB, 0, TAG_TORCH)
    assert bridge.stats(0).by_framework["torch"] == before + 5 * MIB
    t.fill_(3)
    assert int(t.sum().item()) == 15 * MIB
    del t
    torch.cuda.synchronize()
    assert bridge.stats(0).by_framework["torch"] == before


def test_zero_size_tensor(fresh):
    torch = fresh
    t = torch.empty(0, device="cuda")
    assert t.numel() == 0
    assert torch.cat([t, torch.ones(3, device="cuda")]).sum().item() == 3


def test_training_with_backward(fresh):
    torch = fresh
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1)
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(512, 32, device="cuda")
    y = (x[:, :1] * 2 - x[:, 1:2]).detach()
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0]


def test_record_stream_blocks_reuse_until_the_stream_is_done(fresh):
    torch = fresh
    n = 64 * MIB  # floats: 256 MiB
    side = torch.cuda.Stream()
    x = torch.ones(n, device="cuda")
    out = torch.empty(n, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_500_000_000)  # ~0.75 s of queued work
        out.copy_(x)
    x.record_stream(side)
    out.record_stream(side)
    old = x.data_ptr()
    del x
    # the same size again on the default stream, written at once
    y = torch.full((n,), 7.0, device="cuda")
    torch.cuda.synchronize()
    assert int((out != 1).sum().item()) == 0, "the side stream read reused memory"
    assert int((y != 7).sum().item()) == 0
    assert y.data_ptr() != 0 and old != 0


def test_many_streams_and_threads(fresh):
    torch = fresh
    torch._C._cuda_clearCublasWorkspaces()
    base = torch.cuda.memory_allocated()
    errors = []

    def work(k):
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for i in range(40):
                    a = torch.full((256, 256), float(k + 1), device="cuda")
                    b = a @ torch.eye(256, device="cuda")
                    if float(b.sum().item()) != (k + 1) * 256 * 256:
                        errors.append((k, i))
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert errors == []
    # each new stream got a cuBLAS workspace that torch caches; drop them
    torch._C._cuda_clearCublasWorkspaces()
    assert torch.cuda.memory_allocated() == base


def test_cuda_graph_capture_and_replay_match_eager(fresh):
    import bridge

    torch = fresh
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)
    ).cuda()
    static_in = torch.randn(32, 64, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            model(static_in)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = model(static_in)
    for _ in range(5):
        static_in.copy_(torch.randn(32, 64, device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        with torch.no_grad():
            expected = model(static_in)
        assert torch.allclose(static_out, expected, atol=1e-5)
    del g
    torch.cuda.synchronize()
    assert bridge.stats(0).as_dict()["by_framework"]["torch"] >= 0


def test_cuda_graph_whole_training_step(fresh):
    torch = fresh
    torch.manual_seed(2)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    static_x = torch.randn(256, 16, device="cuda")
    static_y = static_x.sum(dim=1, keepdim=True) * 0.1
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(static_x), static_y).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        static_loss = torch.nn.functional.mse_loss(model(static_x), static_y)
        static_loss.backward()
        opt.step()
    losses = []
    for _ in range(40):
        g.replay()
        torch.cuda.synchronize()
        losses.append(float(static_loss.item()))
    assert losses[-1] < losses[0]


def test_graph_memory_is_returned_when_the_graph_goes(fresh):
    import bridge

    torch = fresh
    x = torch.randn(1024, 1024, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        (x @ x).relu()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    bridge.pool(0).free_all_blocks()
    s = bridge.stats(0)
    before = s.ledger - s.cached  # carving: x's chunk keeps idle bytes while x lives
    allocated = torch.cuda.memory_allocated()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = (x @ x).relu() * 2
    g.replay()
    torch.cuda.synchronize()
    s = bridge.stats(0)
    assert s.ledger - s.cached >= before + 4 * MIB  # y and the intermediate stay for replays
    del y
    g.reset()
    del g
    torch.cuda.synchronize()
    # a released graph pool's blocks wait for a device-wide synchronization the core makes
    # itself (a replay may run on a stream it cannot name), as native torch's private pools
    # wait for empty_cache's cudaFree: torch's figures no longer count them
    assert torch.cuda.memory_allocated() == allocated
    torch.cuda.empty_cache()
    s = bridge.stats(0)
    assert s.ledger - s.cached == before
    assert s.num_bad_frees == 0


def test_oom_is_torch_oom_with_breakdown(fresh):
    import bridge

    torch = fresh
    accelerate_memory = pytest.importorskip("accelerate.utils.memory")
    bridge.pool(0).set_limit(bridge.stats(0).used + 1 * GIB)
    with pytest.raises((torch.cuda.OutOfMemoryError, RuntimeError)) as info:
        torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    msg = str(info.value)
    assert msg.startswith("CUDA out of memory.")
    for word in ("device 0", "budget", "torch", "cupy", "jax"):
        assert word in msg
    assert isinstance(info.value, RuntimeError) and len(info.value.args) == 1, info.value.args
    assert accelerate_memory.should_reduce_batch_size(info.value), repr(info.value)
    # torch keeps working, and smaller requests pass
    t = torch.ones(256 * MIB, dtype=torch.uint8, device="cuda")
    assert t.numel() == 256 * MIB and int(t[-4096:].sum().item()) == 4096


def test_find_executable_batch_size_recovers(fresh):
    import bridge

    torch = fresh
    accelerate_memory = pytest.importorskip("accelerate.utils.memory")
    bridge.pool(0).set_limit(bridge.stats(0).used + 1 * GIB)
    tried = []

    @accelerate_memory.find_executable_batch_size(starting_batch_size=4096)
    def step(batch_size):
        tried.append(batch_size)
        t = torch.empty(batch_size * MIB, dtype=torch.uint8, device="cuda")
        return batch_size, int(t.numel())

    bs, n = step()
    assert tried[0] == 4096 and len(tried) > 1 and tried == sorted(tried, reverse=True)
    assert n == bs * MIB and bs < 4096


def test_empty_cache_returns_idle_pool_memory(fresh):
    torch = fresh
    t = torch.empty(768 * MIB, dtype=torch.uint8, device="cuda")
    del t
    torch.cuda.synchronize()
    before = driver_pool_attr(RESERVED)
    assert before >= 768 * MIB
    torch.cuda.empty_cache()
    assert driver_pool_attr(RESERVED) <= before - 768 * MIB


def test_per_process_memory_fraction_caps_torch(fresh):
    torch = fresh
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.01)
    with pytest.raises(RuntimeError) as info:
        torch.empty(int(total * 0.02), dtype=torch.uint8, device="cuda")
    assert str(info.value).startswith("CUDA out of memory.")
    assert "set_per_process_memory_fraction" in str(info.value)
    t = torch.empty(int(total * 0.005), dtype=torch.uint8, device="cuda")
    del t
    torch.cuda.set_per_process_memory_fraction(1.0)
    t = torch.empty(int(total * 0.02), dtype=torch.uint8, device="cuda")
    assert t.numel() == int(total * 0.02)


def test_memory_stats_answered_from_the_ledger(fresh):
    torch = fresh
    base = torch.cuda.memory_allocated()
    t = torch.empty(10 * MIB, dtype=torch.uint8, device="cuda")
    assert torch.cuda.memory_allocated() == base + 10 * MIB
    assert torch.cuda.max_memory_allocated() >= base + 10 * MIB
    assert torch.cuda.memory_reserved() >= torch.cuda.memory_allocated()
    stats = torch.cuda.memory_stats()
    assert stats["allocated_bytes.all.current"] == base + 10 * MIB
    del t
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated() == base
    summary = torch.cuda.memory_summary()
    assert "Allocated memory" in summary


def test_other_devices(fresh):
    torch = fresh
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU: the non-default device path needs two")
    with torch.cuda.device(1):
        t = torch.ones(MIB, device="cuda")
        assert t.device.index == 1 and float(t.sum().item()) == MIB


_STARTED_BEFORE_UNIFY = """
import torch
x = torch.zeros(1, device="cuda")  # torch starts CUDA on its own allocator
started = torch.cuda.is_initialized()
if MODE == "bridge":
    import bridge
    try:
        bridge.unify(cupy=False, torch=True, budget="4GiB", share=f"late-{os.getpid()}")
        error = None
    except bridge.BridgeError as exc:
        error = str(exc)
    figures = dict(share=bridge.stats(0).share, limit=bridge.pool(0).get_limit())
else:
    error, figures = None, {}
y = torch.ones(1 << 20, device="cuda")  # torch goes on, on its own allocator
report(started=started, error=error, sum=int(y.sum().item()), **figures)
"""


@pytest.mark.parametrize("mode", ["native", "bridge"])
def test_unify_after_torch_started_cuda_is_refused_before_joining_a_share(mode):
    """unify(torch=True, share=...) after a CUDA tensor: a BridgeError, and no share
    joined and no budget set (the share was joined first and stayed joined). Native: torch
    has started CUDA (torch.cuda.is_initialized(), what the bridge reads) and goes on."""
    r = run_mode(_STARTED_BEFORE_UNIFY, mode)
    assert r["started"] is True and r["sum"] == 1 << 20
    if mode == "bridge":
        assert r["error"].startswith("call bridge.unify(torch=True) before the first CUDA tensor")
        assert r["share"] is None and r["limit"] == 0
