# SPDX-License-Identifier: Apache-2.0
# The profile worker of this session's runs 1-2 (and of run 5, whose 3-argument wrapper of the
# 4-argument hook failed): bench_wait.py's pipeline, one mode per process. A record, not a tool.
import json, queue, sys, threading, time, gc as _gc
mode, steps = sys.argv[1], int(sys.argv[2])
import bridge
bridge.unify(cupy=True, torch=True, wait=30 if mode.startswith("tight") else 0)
from bridge._runtime import core
from bridge import recovery
import cupy as cp
import torch
import torch.nn.functional as F
ROWS, COLS = 32768, 4096
BATCH = ROWS * COLS * 4
fill = cp.ElementwiseKernel("float32 seed", "float32 x",
    "x = sinf((float)(i % 100003) * 0.001f + seed)", "bench_wait_fill")
def make_batch(k):
    x = cp.empty((ROWS, COLS), dtype=cp.float32)
    fill(cp.float32(k % 17), x)
    return x, (x[:, 1] > x[:, 2]).astype(cp.int64)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(COLS, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 2)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
def step(x, y):
    loss = F.cross_entropy(model(torch.from_dlpack(x)), torch.from_dlpack(y))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss
for k in range(3):
    step(*make_batch(k))
torch.cuda.synchronize()
bridge.pool(0).free_all_blocks()
core.reset_peak(0, -1)
step(*make_batch(3))
torch.cuda.synchronize()
budget = 0
if mode.startswith("tight"):
    budget = bridge.stats(0).ledger_peak + BATCH + (64 << 20)
    bridge.pool(0).set_limit(budget)
gct = []
class G:
    def collect(self, *a):
        t = time.perf_counter()
        n = 0 if mode == "tight-nogc" else _gc.collect(*a)
        gct.append((t, time.perf_counter() - t))
        return n
recovery.gc = G()
import traceback
stacks = []
_real = _gc.collect
def _rec(*a, **k):
    t = time.perf_counter()
    st = "".join(traceback.format_stack(limit=8))
    r = _real(*a, **k)
    stacks.append((round(t - T0[0], 4) if T0 else None, round(time.perf_counter() - t, 4), threading.current_thread().name, st[-1500:]))
    return r
T0 = []
_gc.collect = _rec
if mode == "tight-noplan":
    import cupy as _cp
    def _pool_only(device, tag):
        _cp.get_default_memory_pool().free_all_blocks()
    recovery._releasers["cupy"] = _pool_only
reltimes = []
def wrap(name, fn):
    def w(device, tag):
        t = time.perf_counter()
        try:
            return None if mode == "tight-norel" else fn(device, tag)
        finally:
            reltimes.append((name, round(time.perf_counter() - t, 5)))
    return w
for name, fn in list(recovery._releasers.items()):
    recovery._releasers[name] = wrap(name, fn)
iso = []
for name, fn in list(recovery._releasers.items()):
    for _ in range(2):
        t = time.perf_counter(); fn(0, 1); iso.append((name, round(time.perf_counter() - t, 5)))
t = time.perf_counter(); _gc.collect(); iso.append(("gc", round(time.perf_counter() - t, 5)))
reltimes.clear()
reliefs = []
def timed_relieve(device, nbytes, tag=0):
    t = time.perf_counter()
    try:
        return recovery.relieve(device, nbytes, tag)
    finally:
        reliefs.append((t, time.perf_counter() - t, threading.current_thread().name, nbytes))
core.set_pressure_callback(None if mode == "tight-nohook" else timed_relieve)
s0 = bridge.stats(0)
q = queue.Queue(maxsize=4)
errors = []
prod = []
def producer():
    try:
        for k in range(steps):
            a = time.perf_counter(); r0 = core.stats(0)[1]["num_retries"]
            b = make_batch(k)
            prod.append((a, time.perf_counter(), core.stats(0)[1]["num_retries"] - r0))
            q.put(b)
    except Exception as e:
        errors.append(repr(e)[:300])
    finally:
        q.put(None)
cons, evs = [], []
def consumer():
    try:
        while (item := q.get()) is not None:
            a = time.perf_counter(); w0 = core.stats(0)[1]["num_waits"]
            step(*item)
            del item
            ev = torch.cuda.Event(enable_timing=True); ev.record(); evs.append(ev)
            cons.append((a, time.perf_counter(), core.stats(0)[1]["num_waits"] - w0))
    except Exception as e:
        errors.append(repr(e)[:300])
        while q.get() is not None:
            pass
start = torch.cuda.Event(enable_timing=True); start.record()
t0 = time.perf_counter()
T0.append(t0)
ts = [threading.Thread(target=producer, name="producer"), threading.Thread(target=consumer, name="consumer")]
for t in ts: t.start()
for t in ts: t.join()
torch.cuda.synchronize()
dt = time.perf_counter() - t0
s = bridge.stats(0)
gpu = [start.elapsed_time(e) / 1e3 for e in evs]
rel = lambda xs: [[round(v - t0, 5) if i < 2 else v for i, v in enumerate(x)] for x in xs]
print(json.dumps(dict(mode=mode, steps_per_s=steps / dt, seconds=dt, errors=errors, budget=budget,
    num_waits=s.num_waits - s0.num_waits, wait_seconds=s.wait_seconds - s0.wait_seconds,
    num_retries=s.num_retries - s0.num_retries, num_ooms=s.num_ooms - s0.num_ooms,
    prod=rel(prod), cons=rel(cons), gpu=[round(g, 5) for g in gpu],
    reliefs=[[round(a - t0, 5), round(b, 5), c, d] for a, b, c, d in reliefs],
    gc=[[round(a - t0, 5), round(b, 5)] for a, b in gct], releasers=reltimes, isolated=iso, switch=sys.getswitchinterval(), stacks=stacks)))
