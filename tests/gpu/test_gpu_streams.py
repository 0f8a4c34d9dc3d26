# SPDX-License-Identifier: Apache-2.0
# gpu-test: alone (sizes its work by the device's free memory)
"""Streams, threads, devices and fork on a real GPU. (scripts/gpu-test)

Every scenario runs in fresh processes with the native allocators (the power
check) and on the bridge, unless the native allocators cannot run it at all
(said where so).  Two-GPU scenarios skip on a one-GPU machine.
"""

from __future__ import annotations

import os

import pytest
from gpu_util import SLOW_COPY_SNIPPET, run_mode

pytestmark = pytest.mark.gpu
MODES = ("native", "bridge")


def _gpus() -> int:
    if os.environ.get("BRIDGE_TEST_GPU") != "1":
        return 0  # a CPU run: every test here skips anyway
    try:
        from bridge import _runtime

        return _runtime.device_count()
    except Exception:  # noqa: BLE001 - no usable driver: the gpu marker skips
        return 0


two_gpus = pytest.mark.skipif(_gpus() < 2, reason="needs two GPUs (nvidia-h200-x2)")

PTDS = """
import threading
import cupy as cp
if MODE == "bridge":
    import bridge
    bridge.unify(cupy=True, torch=False)
assert cp.cuda.get_current_stream().ptr == 2  # the per-thread default stream
#SLOW_COPY
N = 50_000_000
dropped, filled = threading.Event(), threading.Event()
result = {}
def thread_a():
    x = cp.full(N, 3.0, dtype=cp.float32)
    out = cp.empty(N, dtype=cp.float32)
    cp.cuda.get_current_stream().synchronize()
    slow_copy((264,), (256,), (x, out, cp.int64(N), cp.int64(1_500_000_000)))
    del x  # dropped while the kernel still reads it
    dropped.set()
    filled.wait(30)
    cp.cuda.get_current_stream().synchronize()
    result["corrupted"] = int((out != 3.0).sum())
def thread_b():
    dropped.wait(30)
    y = cp.empty(N, dtype=cp.float32)  # same size, another thread's default stream
    y.fill(9.0)
    cp.cuda.get_current_stream().synchronize()
    filled.set()
ts = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
for t in ts: t.start()
for t in ts: t.join()
report(**result)
""".replace("#SLOW_COPY\n", SLOW_COPY_SNIPPET)


@pytest.mark.parametrize("mode", MODES)
def test_per_thread_default_streams_are_different_streams(mode):
    """Issue: with CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1 thread B got the block
    thread A dropped while A's kernel read it (about 50 M corrupted elements)."""
    pytest.importorskip("cupy")
    r = run_mode(PTDS, mode, env={"CUPY_CUDA_PER_THREAD_DEFAULT_STREAM": "1"})
    assert r == {"corrupted": 0}


THREAD_SLOT = """
import contextlib
import threading
import torch
if MODE == "bridge":
    import bridge
    bridge.unify(torch=True)
N = 16_000_000  # 64 MB: a block the cache keeps (its large tier holds up to 64 MiB)
SIDE = SIDE_STREAM
dropped, reused = threading.Event(), threading.Event()
result = {}
def thread_a():
    x = torch.full((N,), 3.0, device="cuda")
    out = torch.empty(N, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second: the copy below waits behind it
    out.copy_(x)
    result["x"] = x.data_ptr()
    del x  # freed while the copy still waits to read it: on the bridge, this thread's slot
    dropped.set()
    reused.wait(60)
    torch.cuda.synchronize()
    result["corrupted"] = int((out != 3.0).sum())
def thread_b():
    dropped.wait(60)
    side = torch.cuda.Stream() if SIDE else None
    with torch.cuda.stream(side) if side else contextlib.nullcontext():
        y = torch.empty(N, device="cuda")  # the size x had, another thread
        y.fill_(9.0)
        result["same_block"] = y.data_ptr() == result["x"]
        torch.cuda.current_stream().synchronize()
    reused.set()
ts = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
for t in ts: t.start()
for t in ts: t.join()
report(**result)
"""


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("side", [False, True], ids=["same-stream", "another-stream"])
def test_a_block_another_thread_freed_last_is_reused_in_stream_order(mode, side):
    """Thread A frees x while a copy queued on the default stream still reads it; thread B
    then allocates x's size. On the default stream B gets x's block (on the bridge from A's
    thread slot, with no driver call) and its fill runs after the copy; on a stream of its
    own B never gets it. Natively torch's allocator gives the same answers."""
    r = run_mode(THREAD_SLOT.replace("SIDE_STREAM", str(side)), mode)
    assert r["corrupted"] == 0
    if side:
        assert r["same_block"] is False
    elif mode == "bridge":
        assert r["same_block"] is True


EXTERNAL_STREAM = """
import gc
import cupy as cp
if MODE == "bridge":
    import bridge
    bridge.unify(cupy=True, torch=True)
import torch
def figures():
    if MODE != "bridge":
        return 0, 0
    s = bridge.stats(0)
    return s.cached, s.num_driver_errors
cs = cp.cuda.Stream(non_blocking=True)
es = torch.cuda.ExternalStream(cs.ptr)
with torch.cuda.stream(es):
    t = torch.ones(1 << 20, device="cuda")
    t.mul_(2)
    total = t.sum().item()
cached0, errors0 = figures()
del t
cs.synchronize()
cached1, _ = figures()
del es, cs  # the CuPy stream is destroyed here
gc.collect()
torch.cuda.empty_cache()  # nothing may reach the driver with its handle now
cached2, errors2 = figures()
report(total=total, cached_growth=cached1 - cached0, errors=errors2 - errors0, cached=cached2)
"""


@pytest.mark.parametrize("mode", MODES)
def test_blocks_of_an_external_stream_are_not_kept_for_its_handle(mode):
    """Issue: blocks freed on torch.cuda.ExternalStream(cupy_stream.ptr) stayed cached
    after the stream was destroyed (a dangling handle reached the driver)."""
    pytest.importorskip("cupy")
    r = run_mode(EXTERNAL_STREAM, mode)
    assert r["total"] == 2.0 * (1 << 20)
    assert r["cached_growth"] == 0 and r["errors"] == 0 and r["cached"] == 0


FORK = """
import os, threading
import torch
if MODE == "bridge":
    import bridge
    bridge.unify(cupy=False, torch=True)
x = torch.ones(1 << 20, device="cuda")
stop = False
def churn():  # allocates while the parent forks
    while not stop:
        y = torch.empty(4096 + int(torch.randint(0, 64, (1,)).item()), device="cuda")
        del y
t = threading.Thread(target=churn)
t.start()
codes = []
for i in range(8):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        msg = "no error"
        try:
            if MODE == "bridge":
                bridge.empty_pinned(1024)  # a DataLoader worker staging a batch
            else:
                torch.empty(1024, device="cuda")
        except Exception as e:  # noqa: BLE001
            msg = str(e)
        os.write(w, msg.encode()[:2000])
        os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    msg = os.read(r, 4096).decode()
    os.close(r)
    codes.append((os.WEXITSTATUS(status), "fork" in msg and "spawn" in msg))
stop = True
t.join()
report(codes=codes, ok=bool((x == 1).all().item()))
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_fork_child_gets_a_clear_error_and_never_deadlocks(mode):
    r = run_mode(FORK, mode, timeout=240)
    assert r["ok"]
    assert r["codes"] == [[0, True]] * 8


BACKWARD_AT_THE_EDGE = """
import threading, time
import torch
GIB = 1 << 30
if MODE == "bridge":
    import bridge
    bridge.unify(cupy=False, torch=True)
    calls = []
    bridge.on_pressure(lambda device, nbytes: calls.append(nbytes))
model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()
x = torch.randn(2048, 4096, device="cuda", requires_grad=True)
torch.cuda.synchronize()
if MODE == "bridge":
    bridge.pool(0).set_limit(bridge.stats(0).used + 640 * (1 << 20))
else:
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = (torch.cuda.memory_allocated() + 640 * (1 << 20)) / total
    torch.cuda.set_per_process_memory_fraction(fraction)
stop = False
def other():  # a Python thread running torch ops all along
    while not stop:
        try:
            a = torch.randn(1 << 22, device="cuda")
            (a * 2).sum().item()
        except RuntimeError:
            pass
t = threading.Thread(target=other)
t.start()
done = ooms = 0
t0 = time.monotonic()
for step in range(30):
    try:
        model(x).square().mean().backward()
        done += 1
    except RuntimeError as e:
        assert "out of memory" in str(e), e
        ooms += 1
    model.zero_grad(set_to_none=True)
    x.grad = None
stop = True
t.join()
report(done=done, ooms=ooms, seconds=time.monotonic() - t0,
       hook_calls=len(calls) if MODE == "bridge" else None)
"""


@pytest.mark.parametrize("mode", MODES)
def test_backward_at_the_budget_edge_beside_a_python_thread_never_hangs(mode):
    """Issue: the pressure hook ran Python under the GIL from the autograd thread."""
    r = run_mode(BACKWARD_AT_THE_EDGE, mode, timeout=300)
    assert r["done"] + r["ooms"] == 30
    assert r["seconds"] < 240
    assert r["ooms"] >= 1  # the budget's edge was met
    if mode == "bridge":
        assert r["hook_calls"] >= 1  # the recovery chain ran for torch's threads


JAX_AFTER_CUPY = """
import cupy as cp
import bridge
bridge.unify(cupy=True, torch=False, jax=True)
import jax, jax.numpy as jnp
MIB, GIB = 1 << 20, 1 << 30
arrays = [cp.empty(128 * MIB, dtype=cp.uint8) for _ in range(400)]  # 50 GiB
del arrays
cp.cuda.Device().synchronize()
free, total = cp.cuda.runtime.memGetInfo()
want = free + 50 * GIB - 3 * GIB // 2  # all but 1.5 GiB of what is free or freed
try:
    z = jnp.zeros((want,), dtype=jnp.uint8)
    z.block_until_ready()
    ok, err = True, ""
    del z
except Exception as e:  # noqa: BLE001
    ok, err = False, str(e)[:200]
report(ok=ok, err=err, cached=bridge.stats(0).cached)
"""


def test_what_cupy_frees_jax_can_use():
    """Issue: JAX failed for all but 1.5 GiB after CuPy freed 50 GiB: the bridge kept
    2 GiB of freed blocks cached.  With jax=True the cache is off.  (No native run:
    CuPy's own pool would keep all 50 GiB.)"""
    pytest.importorskip("cupy")
    pytest.importorskip("jax")
    r = run_mode(JAX_AFTER_CUPY, "bridge", timeout=300)
    assert r["ok"], r["err"]
    assert r["cached"] == 0


CONTEXTLESS_THREAD = """
import threading
import torch
if MODE == "bridge":
    import bridge
    bridge.unify(cupy=False, torch=True)
big = torch.ones(300 << 20, dtype=torch.uint8, device="cuda:1")  # above the cache's block cap
torch.cuda.synchronize(1)
out = {}
def fresh_thread():  # a thread that never touched CUDA: no current context
    global big
    del big  # freed on cuda:1 from here
    out["device"] = torch.empty(10, device="cuda").device.index
t = threading.Thread(target=fresh_thread)
t.start()
t.join()
report(**out)
"""


CUPY_FRESH_THREAD = """
import threading
import cupy
from cuda.bindings import driver as cu
if MODE == "bridge":
    import bridge
    bridge.unify(cupy=True, torch=False)
out = {}
def fresh_thread():  # a thread that never touched CUDA: no current context
    out["before"] = int(cu.cuCtxGetCurrent()[1] or 0)
    a = cupy.empty((3 << 20) + 4096, dtype=cupy.uint8)  # a size nothing cached: a pool call
    # read before any kernel: CuPy's kernel launch binds a context of its own
    out["after"] = int(cu.cuCtxGetCurrent()[1] or 0)
    out["device"] = cupy.cuda.runtime.getDevice()
    a[:] = 7
    out["sum"] = int(a.sum())
    del a
(err,) = cu.cuInit(0)
err, primary = cu.cuDevicePrimaryCtxRetain(cu.CUdevice(0))
assert err == cu.CUresult.CUDA_SUCCESS, err
t = threading.Thread(target=fresh_thread)
t.start()
t.join()
report(primary=int(primary), **out)
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_fresh_threads_cupy_allocation_leaves_device_0s_context_current(mode):
    """Issue: on the bridge the thread was left with no current context, and every
    cudaGetDevice after (CuPy asks it twice per allocation) took the runtime's slow
    context-less path (about 1.15 us instead of 50 ns) until a runtime call bound one,
    as CuPy's own cudaMalloc does natively."""
    r = run_mode(CUPY_FRESH_THREAD, mode)
    assert r["before"] == 0
    assert r["primary"] != 0 and r["after"] == r["primary"]
    assert r["device"] == 0
    assert r["sum"] == 7 * ((3 << 20) + 4096)


@two_gpus
@pytest.mark.parametrize("mode", MODES)
def test_a_thread_without_context_stays_on_its_device(mode):
    """Issue: its next torch.empty(device='cuda') landed on cuda:1."""
    assert run_mode(CONTEXTLESS_THREAD, mode) == {"device": 0}


OTHER_DEVICE = """
import torch
if MODE == "bridge":
    import bridge
    bridge.unify(cupy=False, torch=True, device=0)
x = torch.arange(1 << 20, device="cuda:0", dtype=torch.float32)
y = x.to("cuda:1")
z = y * 2
torch.cuda.synchronize(1)
torch1 = bridge.stats(1).by_framework["torch"] if MODE == "bridge" else None
limit1 = bridge.stats(1).limit if MODE == "bridge" else 0
report(ok=bool((z.cpu() == x.cpu() * 2).all()), torch1=torch1, limit1=limit1)
"""


@two_gpus
@pytest.mark.parametrize("mode", MODES)
def test_a_device_outside_unify_is_served(mode):
    """Issue: 'bridge could not allocate 4194304 bytes on device 1 (CUDA_SUCCESS)'."""
    r = run_mode(OTHER_DEVICE, mode)
    assert r["ok"] and r["limit1"] == 0
    if mode == "bridge":
        assert r["torch1"] >= 8 << 20  # y and z, on the ledger of device 1


RECORD_OTHER_DEVICE = """
import torch
if MODE == "bridge":
    import bridge
    bridge.unify(cupy=False, torch=True)
N = 64 << 20
t = torch.full((N,), 3.0, device="cuda:0")
s1 = torch.cuda.Stream(device=1)
torch.cuda.synchronize(0)
with torch.cuda.stream(s1):
    torch.cuda._sleep(2_000_000_000)  # s1 is busy for about a second
    out = t.to("cuda:1", non_blocking=True)  # then reads t
t.record_stream(s1)
del t  # freed while s1 has not read it yet
news = [torch.full((N,), 9.0, device="cuda:0") for _ in range(3)]
torch.cuda.synchronize(0)
torch.cuda.synchronize(1)
if MODE == "bridge":
    from bridge._runtime import core
    fallbacks = core.stats(0)[1]["num_order_fallbacks"]
else:
    fallbacks = 0
report(corrupted=int((out != 3.0).sum().item()), fallbacks=fallbacks)
"""


@two_gpus
@pytest.mark.parametrize("mode", MODES)
def test_record_stream_of_another_device_orders_the_free(mode):
    """Issue: the event was created in the block's context, its record on a stream of
    another device failed, and the failure was ignored: the free went ahead."""
    assert run_mode(RECORD_OTHER_DEVICE, mode) == {"corrupted": 0, "fallbacks": 0}


# ---- frees ordered after non-blocking streams the core cannot name (issue 61, item 3) ----
NON_BLOCKING_REUSE = """
import gc
import cupy as cp
import torch
if MODE == "bridge":
    import bridge
    bridge.unify(torch=True, cupy=False)
#SLOW_COPY
N = 50_000_000
SPIN = 1_500_000_000  # about a second of clock64 before the copy starts
torch.cuda.init()
cs = cp.cuda.Stream(non_blocking=True)  # not one of torch's pooled streams
ts = torch.cuda.ExternalStream(cs.ptr)
results = {}

def reuse_on_the_default_stream():
    y = torch.empty(N, dtype=torch.float32, device="cuda")  # the default stream
    y.fill_(9.0)
    return y

# 1. a tensor allocated on the external stream, dropped while a kernel there reads it
with torch.cuda.stream(ts):
    x = torch.full((N,), 3.0, device="cuda")
out = cp.empty(N, dtype=cp.float32)
with cs:
    slow_copy((264,), (256,), (cp.from_dlpack(x), out, cp.int64(N), cp.int64(SPIN)))
del x  # freed by torch while slow_copy reads it
gc.collect()
y = reuse_on_the_default_stream()
cs.synchronize()
torch.cuda.synchronize()
results["tensor_corrupted"] = int((out != 3.0).sum())
del y

# 2. torch.cuda.caching_allocator_alloc(n, stream=...) (DGL's raw_alloc_with_stream)
ptr = torch.cuda.caching_allocator_alloc(N * 4, stream=ts)
raw = cp.ndarray((N,), dtype=cp.float32,
                 memptr=cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(ptr, N * 4, None), 0))
with cs:
    raw.fill(3.0)
    slow_copy((264,), (256,), (raw, out, cp.int64(N), cp.int64(SPIN)))
del raw
torch.cuda.caching_allocator_delete(ptr)
y = reuse_on_the_default_stream()
cs.synchronize()
torch.cuda.synchronize()
results["raw_corrupted"] = int((out != 3.0).sum())
del y
if MODE == "bridge":
    torch.cuda.empty_cache()
    from bridge._runtime import core
    s = core.stats(0)[1]
    results["deferred_after_empty_cache"] = s["num_deferred"]
report(**results)
""".replace("#SLOW_COPY\n", SLOW_COPY_SNIPPET)


@pytest.mark.parametrize("mode", MODES)
def test_a_block_freed_on_a_non_blocking_stream_is_not_reused_while_its_kernel_reads_it(mode):
    """Issue 61, item 3: a block freed on a stream the core could not prove alive
    went to the legacy stream, which does not wait for a non-blocking stream: the
    default stream's next allocation got it while the kernel still read it."""
    pytest.importorskip("cupy")
    pytest.importorskip("torch")
    r = run_mode(NON_BLOCKING_REUSE, mode)
    assert r["tensor_corrupted"] == 0 and r["raw_corrupted"] == 0, r
    if mode == "bridge":
        assert r["deferred_after_empty_cache"] == 0
