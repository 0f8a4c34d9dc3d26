# SPDX-License-Identifier: Apache-2.0
"""CUDA graphs as torch and CuPy users use them, on a real GPU. (scripts/gpu-test)

Every scenario runs twice, in fresh processes: with the native allocators
(the power check: the scenario is right and passes there) and on the bridge.
"""

from __future__ import annotations

import pytest
from gpu_util import TORCH_GRAPH_SNIPPET, carving, run_mode

pytestmark = pytest.mark.gpu
MODES = ("native", "bridge")

TORCH_SETUP = """
if MODE == "bridge":
    import bridge
    bridge.unify(cupy=False, torch=True)
import torch
"""

COMPILE = (
    TORCH_SETUP
    + """
import copy, gc
import torch.nn as nn
"""
    + TORCH_GRAPH_SNIPPET
    + """

def cycle(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).cuda()
    eager = copy.deepcopy(model)
    cm = torch.compile(model, mode="reduce-overhead")
    err = 0.0
    with torch.no_grad():
        for bs in (8, 16, 32, 8, 16, 32, 8, 16):  # several shapes: several graphs
            x = torch.randn(bs, 256, device="cuda")
            y = cm(x).clone()
            err = max(err, (y - eager(x)).abs().max().item())
    # a few training steps, compiled against eager
    opt_c = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
    losses_c, losses_e = [], []
    for step in range(6):
        x = torch.randn(32, 256, device="cuda")
        for m, opt, out in ((cm, opt_c, losses_c), (eager, opt_e, losses_e)):
            opt.zero_grad(set_to_none=True)
            loss = m(x).square().mean()
            loss.backward()
            opt.step()
            out.append(loss.item())
    loss_err = max(abs(a - b) for a, b in zip(losses_c, losses_e))
    del model, eager, cm, opt_c, opt_e, x, y, loss
    torch._dynamo.reset()
    gc.collect()
    return err, loss_err

base = torch_bytes()
err1, lerr1 = cycle(0)
after1 = torch_bytes()
err2, lerr2 = cycle(1)
after2 = torch_bytes()
report(err=max(err1, err2), loss_err=max(lerr1, lerr2), replays=replays[0],
       growth=after2 - after1, first=after1 - base)
"""
)


@pytest.mark.parametrize("mode", MODES)
def test_torch_compile_reduce_overhead_matches_eager_and_does_not_leak(mode):
    """Issue: under the bridge it raised 'pluggable does not yet support
    checkPoolLiveAllocations' (CUDA graph trees)."""
    r = run_mode(COMPILE, mode, timeout=540)
    assert r["replays"] > 0  # CUDA graphs were really captured and replayed
    assert r["err"] < 1e-4
    assert r["loss_err"] < 1e-4
    # compiling again holds (almost) no more than the first time: natively 0 (graph
    # trees); on the pluggable fallback, inductor's graphs without trees kept a few MiB
    # per recompile (6.4 MiB measured on an H200 with this model), see docs/design.md,
    # Note [CUDA graph pools]
    assert abs(r["growth"]) <= 16 << 20


SHARED_POOL = (
    TORCH_SETUP
    + """
N = 32 << 20  # elements: 128 MiB of float32
s = torch.cuda.Stream()
static_in = torch.ones(N, device="cuda")
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(2):
        (static_in * 3).add_(1)
torch.cuda.current_stream().wait_stream(s)
g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
with torch.cuda.graph(g1, stream=s):
    out1 = static_in * 3  # a static output: lives on after its graph
g1.replay()
torch.cuda.synchronize()
with torch.cuda.graph(g2, pool=g1.pool(), stream=s):
    tmp = static_in * 5  # a temporary of g2, freed inside its capture
    out2 = tmp + 1
    del tmp
del g1  # the first graph of the pool is released
torch.cuda.synchronize()
news = [torch.full((N,), 7.0, device="cuda") for _ in range(4)]
torch.cuda.synchronize()
g2.replay()
torch.cuda.synchronize()
corrupted = sum(int((t != 7.0).sum().item()) for t in news)
report(corrupted=corrupted, out2_ok=bool((out2 == 6.0).all().item()),
       out1_ok=bool((out1 == 3.0).all().item()))
"""
)


@pytest.mark.parametrize("mode", MODES)
def test_two_graphs_sharing_a_pool_the_first_released(mode):
    """Issue: after del g1, g2's temporaries went to new tensors and g2's replay
    overwrote about 84 million of their elements."""
    r = run_mode(SHARED_POOL, mode)
    assert r == {"corrupted": 0, "out2_ok": True, "out1_ok": True}


GRAPHED_CALLABLES = (
    TORCH_SETUP
    + """
torch.manual_seed(0)
torch.backends.cudnn.deterministic = True
model = torch.nn.Sequential(
    torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512), torch.nn.ReLU(),
    torch.nn.Linear(512, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x0 = torch.randn(64, 512, device="cuda")
graphed = torch.cuda.make_graphed_callables(model, (x0,))
g = torch.Generator(device="cuda").manual_seed(1)
losses = []
for step in range(20):
    x = torch.randn(64, 512, device="cuda", generator=g)
    target = torch.randint(0, 10, (64,), device="cuda", generator=g)
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(graphed(x), target)
    loss.backward()
    opt.step()
    losses.append(loss.item())
report(losses=losses)
"""
)


def test_make_graphed_callables_training_gives_the_native_losses():
    native = run_mode(GRAPHED_CALLABLES, "native")["losses"]
    bridged = run_mode(GRAPHED_CALLABLES, "bridge")["losses"]
    assert len(bridged) == 20
    assert max(abs(a - b) for a, b in zip(native, bridged, strict=True)) < 1e-5
    assert bridged[-1] < bridged[0]  # it trained


CAPTURED_LOOP = (
    TORCH_SETUP
    + """
def held():
    torch.cuda.synchronize()
    if MODE == "bridge":
        return bridge.stats(0).used
    return torch.cuda.memory_reserved()
x = torch.ones(16 << 20, device="cuda")  # 64 MiB
before = held()  # before the warm-up: what the warm-up keeps counts too
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for i in range(2):
        x.add_((x * 0).sum())
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s):
    for i in range(10):
        t = x * (i + 1)  # 64 MiB, freed at once
        x.add_(t.sum() * 0)
        del t
after = held()
g.replay()
torch.cuda.synchronize()
report(graph_bytes=after - before, ok=bool((x == 1).all().item()))
"""
)


def test_a_captured_allocate_free_loop_holds_what_native_holds():
    """Issue: the graph kept 10 x 64 MiB where torch's private pool keeps 64 MiB."""
    native = run_mode(CAPTURED_LOOP, "native")
    bridged = run_mode(CAPTURED_LOOP, "bridge")
    assert native["ok"] and bridged["ok"]
    assert native["graph_bytes"] >= 64 << 20
    assert bridged["graph_bytes"] <= 1.10 * native["graph_bytes"], (bridged, native)


CAPTURE_UNDER_PRESSURE = (
    TORCH_SETUP
    + """
import threading, time
GIB = 1 << 30
keep = torch.empty(GIB, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
if MODE == "bridge":
    bridge.pool(0).set_limit(bridge.stats(0).used + 3 * GIB)
else:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 3 * GIB) / total)
a = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(2):
        b = (a * 2 + 1).sum()
torch.cuda.current_stream().wait_stream(s)
started, done = threading.Event(), threading.Event()
errors, ooms = [], [0]
def pressure():
    if not started.wait(60):  # the capture failed before it began: do not hang
        done.set()
        return
    held = []
    try:
        for _ in range(8):  # to the budget's edge and past it
            try:
                held.append(torch.empty(GIB // 2, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                ooms[0] += 1
            except RuntimeError as e:
                if "out of memory" not in str(e):
                    raise
                ooms[0] += 1
        held.clear()
        torch.cuda.empty_cache()
    except BaseException as e:
        errors.append(repr(e))
    finally:
        done.set()
t = threading.Thread(target=pressure)
t.start()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
    c = a * 2
    started.set()
    done.wait(30)
    out = (c + 1).sum()
t.join()
g.replay()
torch.cuda.synchronize()
report(errors=errors, ooms=ooms[0], ok=abs(out.item() - float(((a * 2 + 1).sum()).item())) < 1.0)
"""
)


@pytest.mark.parametrize("mode", MODES)
def test_a_capture_while_another_thread_meets_the_budget_and_empties_the_cache(mode):
    r = run_mode(CAPTURE_UNDER_PRESSURE, mode, timeout=150)
    assert r["errors"] == []
    assert r["ooms"] >= 1  # the other thread did reach the budget
    assert r["ok"]


CUPY_CAPTURE = """
import cupy as cp
MIB = 1 << 20
if MODE == "bridge":
    import bridge
    bridge.unify(cupy=True, torch=False)
    pool = bridge.pool(0)
else:
    pool = cp.get_default_memory_pool()
a = cp.arange(16 * MIB // 4, dtype=cp.float32)  # 16 MiB
held = cp.empty(64 * MIB, dtype=cp.uint8)
cached = cp.empty(64 * MIB, dtype=cp.uint8)
del cached  # freed: kept by the allocator (its cache / CuPy's pool)
cp.cuda.Device().synchronize()
if MODE == "bridge":  # the cached block counts: the capture must get it back
    from bridge._runtime import core
    raw = core.stats(0)[1]
    # at most the freed 64 MiB go back: with segments (the default), the idle rest of a's
    # segment counts as cached too, but stays while a lives
    pool.set_limit(size=raw["used"] - min(raw["cached"], 64 * MIB) + 48 * MIB)
else:
    pool.set_limit(size=pool.total_bytes() + 16 * MIB)
s = cp.cuda.Stream(non_blocking=True)
with s:
    s.begin_capture()
    b = a * 2  # needs room: the allocator must make it without synchronizing
    c = b + 1
    del b
    g = s.end_capture()
    for _ in range(3):
        g.launch(s)
    s.synchronize()
# checked on the host: the budget leaves no room for the check's temporaries on the device
# (the graph keeps b's block for its launches, as CuPy's own pools do)
ok = bool((c.get() == a.get() * 2 + 1).all())
retries = bridge.stats(0).num_retries if MODE == "bridge" else None
report(ok=ok, pressure=retries)
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_cupy_capture_under_memory_pressure(mode):
    pytest.importorskip("cupy")
    r = run_mode(CUPY_CAPTURE, mode)
    assert r["ok"]
    if mode == "bridge" and not carving():
        assert r["pressure"] >= 1  # the capture's allocation met the budget and was retried
    # Carving: the freed 64 MiB block was a chunk of its own, back in the pool at once, so
    # the budget set from the cached bytes leaves the capture room and nothing is retried.
    # Segments: its emptied segment is kept until the capture's allocation meets the budget.


# ---- a capture that fails (issue 61, item 4) ----
FAILED_CAPTURE = (
    TORCH_SETUP
    + """
def figures():
    torch.cuda.synchronize()
    if MODE == "bridge":
        from bridge._runtime import core
        s = core.stats(0)[1]
        return {"used": s["used"] - s["cached"], "captures_active": s["captures_active"],
                "num_deferred": s["num_deferred"]}
    return {"used": torch.cuda.memory_allocated()}
x = torch.ones(1 << 20, device="cuda")
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(2):
        (x * 2).sum()
    kept = torch.ones(2 << 20, device="cuda")  # a block of the capture's stream
torch.cuda.current_stream().wait_stream(s)
torch.cuda.synchronize()
before = figures()
g = torch.cuda.CUDAGraph()
failed = ""
try:
    with torch.cuda.graph(g, stream=s):
        y = x * 2
        del kept  # freed during the capture (the bridge holds it back)
        y.sum().item()  # a host sync: the capture is invalidated
except RuntimeError as e:
    failed = type(e).__name__
# g stays: torch 2.11's allocators keep its capture's stream filter, which reads it
y = None
after = figures()
# empty_cache and a later capture and replay (native torch 2.11 may refuse the
# first after a failed capture: its allocator still counts the capture)
try:
    torch.cuda.empty_cache()
    empty_cache_ok = True
except RuntimeError:
    empty_cache_ok = False
g2 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g2, stream=s):
    z = x * 3
g2.replay()
torch.cuda.synchronize()
replay_ok = bool((z == 3).all().item())
waited = None
if MODE == "bridge":
    # a wait is not refused for a capture that is over
    from bridge._runtime import core
    bridge.pool(0).set_limit(size=bridge.stats(0).used + (64 << 20))
    with bridge.waiting(0.5):
        try:
            big = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            pass
    waited = core.last_wait()[1] != core.WAIT_CAPTURE
    bridge.pool(0).set_limit(size=0)
report(failed=failed, before=before, after=after, empty_cache_ok=empty_cache_ok,
       replay_ok=replay_ok, waited=waited)
"""
)


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_capture_leaves_nothing_behind(mode):
    """Issue 61, item 4: torch 2.11 sends neither the end hook nor the release after
    an invalidated capture; the core counted the capture active for good (deferred
    frees never issued, empty_cache and the OOM retry never synchronizing, waits
    refused, the ledger holding what torch freed)."""
    pytest.importorskip("torch")
    r = run_mode(FAILED_CAPTURE, mode)
    assert r["failed"], r  # the capture did fail
    assert r["replay_ok"], r
    if mode == "bridge":
        assert r["after"]["captures_active"] == 0 and r["after"]["num_deferred"] == 0, r
        assert r["after"]["used"] <= r["before"]["used"] - (8 << 20) + (1 << 20), r  # kept freed
        assert r["empty_cache_ok"] and r["waited"], r


# ---- a graph deleted while its replay runs on an external stream (issue 61) ----
EXTERNAL_REPLAY = (
    TORCH_SETUP
    + """
import ctypes
N, ITERS = 16 << 20, 400  # 64 MiB of float32; a replay of some tens of milliseconds
libcuda = ctypes.CDLL("libcuda.so.1")
static_in = torch.full((N,), 1.0, device="cuda")
torch.cuda.synchronize()  # the primary context is current on this thread now
raw = ctypes.c_void_p()
assert libcuda.cuStreamCreate(ctypes.byref(raw), 1) == 0  # CU_STREAM_NON_BLOCKING, not torch's
ext = torch.cuda.ExternalStream(raw.value)
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s):
    t = static_in * 3.0
    for _ in range(ITERS):
        t = t + 1.0  # temporaries of the pool, written by every replay
    out = t * 1.0
ext.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(ext):
    for _ in range(4):
        g.replay()  # still running when the graph goes
del g, t  # the pool is released; out outlives it
news = [torch.full((N,), 7.0, device="cuda") for _ in range(8)]  # new tensors, meanwhile
held = None
if MODE == "bridge":
    from bridge._runtime import core
    held = core.stats(0)[1]["num_deferred"]  # the pool's blocks wait for a device sync
torch.cuda.synchronize()
corrupted = sum(int((x != 7.0).sum().item()) for x in news)
out_ok = bool((out == 3.0 + ITERS).all().item())
del news, out
torch.cuda.empty_cache()
after = None
if MODE == "bridge":
    after = core.stats(0)[1]["num_deferred"]
assert libcuda.cuStreamDestroy_v2(raw) == 0
report(corrupted=corrupted, out_ok=out_ok, held=held, after=after)
"""
)


@pytest.mark.parametrize("mode", MODES)
def test_a_graph_deleted_while_it_replays_on_an_external_stream_keeps_its_memory(mode):
    """Issue 61: the release of a graph's pool waited (by events) for registered
    streams only; a replay on torch.cuda.ExternalStream still wrote the pool's memory
    while new tensors were made in it.  Native torch gives a private pool back through
    cudaFree (a device synchronization); the bridge holds the pool's blocks until a
    device-wide synchronization."""
    pytest.importorskip("torch")
    r = run_mode(EXTERNAL_REPLAY, mode)
    assert r["corrupted"] == 0 and r["out_ok"], r
    if mode == "bridge":
        assert r["held"] >= 1 and r["after"] == 0, r


# ---- a capture that fails before allocating into its pool (issue 61) ----
FAILED_BEFORE_ALLOCATING = (
    TORCH_SETUP
    + """
def figures():
    torch.cuda.synchronize()
    f = {"allocated": torch.cuda.memory_allocated()}
    if MODE == "bridge":
        from bridge._runtime import core
        s = core.stats(0)[1]
        f.update(captures_active=s["captures_active"], num_deferred=s["num_deferred"])
    return f
one = torch.ones(1, device="cuda")
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    kept = torch.empty(4 << 20, device="cuda")  # 16 MiB, a block of the capture's stream
torch.cuda.current_stream().wait_stream(s)
before = figures()
g = torch.cuda.CUDAGraph()
failed = ""
try:
    with torch.cuda.graph(g, stream=s):
        del kept  # freed during the capture, which allocates nothing into its pool
        one.item()  # a host sync: the capture is invalidated
except RuntimeError as e:
    failed = type(e).__name__
after = figures()  # g stays (torch 2.11's allocators keep its filter, which reads it)
a = torch.empty(4 << 20, device="cuda")
pa = a.data_ptr()
del a
b = torch.empty(4 << 20, device="cuda")
reused = b.data_ptr() == pa
del b
report(failed=failed, before=before, after=after, reused=reused)
"""
)


@pytest.mark.parametrize("mode", MODES)
def test_a_capture_that_fails_before_allocating_leaves_no_capture_behind(mode):
    """Issue 61: the core learned a capture's stream at its pool's first allocation
    only; a capture that failed before one stayed active: the block freed during it
    was never given back and the bridge's figures showed a capture."""
    pytest.importorskip("torch")
    r = run_mode(FAILED_BEFORE_ALLOCATING, mode)
    assert r["failed"], r  # the capture did fail
    # the 16 MiB block freed during the capture is no longer allocated (the failing
    # .item() leaves a few bytes of its own allocated: 1,536 B natively, 20 B on the
    # bridge on the H200 with torch 2.11)
    left = r["after"]["allocated"] - (r["before"]["allocated"] - (16 << 20))
    assert 0 <= left < 64 << 10, r
    assert r["reused"], r  # a freed block is handed out again at once
    if mode == "bridge":
        assert r["after"]["captures_active"] == 0 and r["after"]["num_deferred"] == 0, r


# ---- torch.cuda.graph captured inside torch.cuda.use_mem_pool ----
USE_MEM_POOL_AROUND_A_CAPTURE = (
    TORCH_SETUP
    + """
def in_pool(pool, ptr):
    return any(s["address"] <= ptr < s["address"] + s["total_size"] for s in pool.snapshot())
x = torch.ones(1 << 20, device="cuda")
pool = torch.cuda.MemPool()
g = torch.cuda.CUDAGraph()
with torch.cuda.use_mem_pool(pool):
    with torch.cuda.graph(g):
        y = x * 2
    torch.cuda.memory_allocated()  # figures read after the capture
    z = torch.empty(4 << 20, device="cuda")  # still inside use_mem_pool
z_in_pool = in_pool(pool, z.data_ptr())
g.replay()
torch.cuda.synchronize()
report(z_in_pool=z_in_pool, y_ok=bool((y == 2).all().item()))
"""
)


@pytest.mark.parametrize("mode", MODES)
def test_use_mem_pool_still_routes_after_a_graph_captured_inside_it(mode):
    """Issue: on the bridge the capture's end also ended the use_mem_pool routing around
    it (the core took the routing for a failed capture): later tensors of the block were
    not the MemPool's."""
    pytest.importorskip("torch")
    r = run_mode(USE_MEM_POOL_AROUND_A_CAPTURE, mode)
    assert r == {"z_in_pool": True, "y_ok": True}
