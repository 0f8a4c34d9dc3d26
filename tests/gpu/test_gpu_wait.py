# SPDX-License-Identifier: Apache-2.0
# gpu-test: alone (times its waits)
"""Waiting for memory others free, on a real GPU. (scripts/gpu-test)

A CuPy producer thread fills batches while a torch thread trains on them, at a
budget of about two batches (what one training step holds with its batch, plus
one more batch). Each run is a fresh process:

- ``native``: the native allocators, no budget; the reference results (the
  batches' checksums, the final loss) every other run must match;
- ``wait``: the bridge at the tight budget with ``wait=30``: 200 steps, no
  out-of-memory error, the native results;
- ``nowait``: the same budget with ``wait=0``: the power check, it meets an
  out-of-memory error (so the budget really is tight);
- ``wait+jax``: ``wait`` with a JAX thread computing beside them (its memory
  is in the same pool and counts against the budget).

Run: ``BRIDGE_GPU_TEST_FILES="tests/gpu/test_gpu_wait.py" scripts/gpu-test``.
"""

from __future__ import annotations

import pytest
from gpu_util import run_mode

pytestmark = pytest.mark.gpu

PIPELINE = """
import queue, threading, time
MODE_, _, EXTRA = MODE.partition("+")
WITH_JAX = EXTRA == "jax"
if MODE_ != "native":
    import bridge
    bridge.unify(cupy=True, torch=True, jax=WITH_JAX, wait=30 if MODE_ == "wait" else 0)
import cupy as cp
import torch
import torch.nn.functional as F

STEPS = 200
# one batch: 512 MiB of float32; a step's own memory (activations, gradients)
# is well under a batch, so the producer waiting for room cannot take what the
# trainer's next step needs (it would wait then too, and both would hold)
ROWS, COLS = 32768, 4096
BATCH = ROWS * COLS * 4
fill = cp.ElementwiseKernel(
    "float32 seed", "float32 x",
    "x = sinf((float)(i % 100003) * 0.001f + seed) + 0.01f * seed", "bridge_fill_batch")

def make_batch(k):
    # in place: no temporary as large as a batch
    x = cp.empty((ROWS, COLS), dtype=cp.float32)
    fill(cp.float32(k % 17), x)
    y = (x[:, 1] > x[:, 2]).astype(cp.int64)
    return x, y

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(COLS, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)

def step(x, y):
    xb, yb = torch.from_dlpack(x), torch.from_dlpack(y)
    loss = F.cross_entropy(model(xb), yb)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    # a checksum of the bytes the trainer got: a strided sample, summed in float64
    return loss, float(xb[::7, ::13].double().sum())

# a warm-up step sizes the budget: what a step holds with its batch, plus one
# batch the producer fills meanwhile, plus room for JAX's small arrays
x, y = make_batch(10_000)
step(x, y)
del x, y
torch.cuda.synchronize()
# a second warm-up step in every mode (the model must take the same steps
# natively): on the bridge its peak sizes the budget
budget = 0
if MODE_ != "native":
    from bridge._runtime import core
    bridge.pool(0).free_all_blocks()
    core.reset_peak(0, -1)
x, y = make_batch(10_001)
step(x, y)
del x, y
torch.cuda.synchronize()
if MODE_ != "native":
    budget = bridge.stats(0).ledger_peak + BATCH + (160 << 20 if WITH_JAX else 64 << 20)
    bridge.pool(0).set_limit(budget)

q = queue.Queue(maxsize=4)
ooms, sums, losses = [], [], []
stop = threading.Event()

def producer():
    try:
        for k in range(STEPS):
            if stop.is_set():
                break
            q.put(make_batch(k))
    except cp.cuda.memory.OutOfMemoryError as e:
        ooms.append("cupy: " + str(e)[:300])
    except Exception as e:
        ooms.append("producer error: " + repr(e)[:300])
    finally:
        q.put(None)

def consumer():
    try:
        while (item := q.get()) is not None:
            loss, s = step(*item)
            del item
            sums.append(s)
            losses.append(float(loss))
    except Exception as e:  # an OOM, or anything else: recorded, and no thread hangs
        oom = isinstance(e, RuntimeError) and str(e).startswith("CUDA out of memory.")
        ooms.append(("torch: " if oom else "consumer error: ") + str(e)[:300])
        stop.set()
        while q.get() is not None:
            pass

jax_result = {}
def jax_beside():
    import jax.numpy as jnp
    a = jnp.ones((512, 512), dtype=jnp.float32)
    total = 0.0
    n = 0
    while not stop.is_set():
        b = (a @ a) / 512.0          # every element 1.0
        total += float(b.sum())
        n += 1
    jax_result.update(n=n, mean=total / max(n, 1) / (512 * 512))

t0 = time.perf_counter()
threads = [threading.Thread(target=producer), threading.Thread(target=consumer)]
if WITH_JAX:
    threads.append(threading.Thread(target=jax_beside))
for t in threads: t.start()
threads[0].join(); threads[1].join()
stop.set()
for t in threads[2:]: t.join()
torch.cuda.synchronize()
elapsed = time.perf_counter() - t0
fig = {}
if MODE_ != "native":
    s = bridge.stats(0)
    fig = dict(num_waits=s.num_waits, wait_seconds=s.wait_seconds, num_ooms=s.num_ooms,
               peak=s.ledger_peak, timeouts=s.num_wait_timeouts)
report(steps=len(sums), ooms=ooms, sums=sums, final_loss=losses[-1] if losses else None,
       budget=budget, batch=BATCH, elapsed=elapsed, jax=jax_result, **fig)
"""


@pytest.fixture(scope="module")
def native():
    pytest.importorskip("cupy")
    pytest.importorskip("torch")
    r = run_mode(PIPELINE, "native")
    assert r["steps"] == 200 and r["ooms"] == []
    return r


def _same_results(r, ref):
    assert r["steps"] == 200, r["ooms"]
    assert r["sums"] == pytest.approx(ref["sums"], rel=1e-9)  # every batch, the same bytes
    assert r["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-3, abs=1e-4)


def test_a_producer_and_a_trainer_at_two_batches_wait_and_never_fail(native):
    r = run_mode(PIPELINE, "wait")
    assert r["ooms"] == [] and r["num_ooms"] == 0
    _same_results(r, native)
    assert r["num_waits"] > 0  # it ran at the budget's edge
    assert r["timeouts"] == 0
    assert r["peak"] <= r["budget"]


def test_the_same_run_without_waiting_meets_out_of_memory(native):
    """The power check: at this budget, without waiting, a stage fails."""
    r = run_mode(PIPELINE, "nowait")
    assert r["ooms"], "the budget was not tight: the waiting test proves nothing"
    assert r["num_ooms"] >= 1 and r["num_waits"] == 0


def test_jax_beside_them_does_not_break_it(native):
    pytest.importorskip("jax")
    r = run_mode(PIPELINE, "wait+jax")
    assert r["ooms"] == [] and r["num_ooms"] == 0
    _same_results(r, native)
    assert r["jax"]["n"] > 0 and r["jax"]["mean"] == pytest.approx(1.0)


CAPTURE = """
import time
import bridge
bridge.unify(cupy=True, torch=False, wait=30)
import cupy as cp
base = bridge.stats(0).used
bridge.pool(0).set_limit(base + (64 << 20))
keep = cp.ones(48 << 20, dtype=cp.uint8)        # the budget is nearly full
s = cp.cuda.Stream(non_blocking=True)
t0 = time.perf_counter()
err = ""
with s:
    s.begin_capture()
    try:
        keep += 1                                # captured work (in place: no allocation)
        cp.empty(32 << 20, dtype=cp.uint8)       # within the budget, not the room left
    except cp.cuda.memory.OutOfMemoryError as e:
        err = str(e)
    finally:
        s.end_capture()
took = time.perf_counter() - t0
st = bridge.stats(0)
from bridge._runtime import core
report(took=took, err=err, num_waits=st.num_waits, captures=core.stats(0)[1]["captures_active"])
"""


def test_an_allocation_during_a_capture_never_waits():
    """Bridge only: the native allocators have no budget to wait at."""
    pytest.importorskip("cupy")
    r = run_mode(CAPTURE, "bridge")
    assert r["err"], "the allocation was not refused"
    assert r["took"] < 5.0  # not its 30 s
    assert "a CUDA graph capture runs on this device" in r["err"]
    assert r["num_waits"] == 0 and r["captures"] == 0


CHAIN = """
import gc, threading, time
import bridge
bridge.unify(cupy=True, torch=True, wait=30)
import cupy as cp
import torch
from bridge._runtime import core
MIB = 1 << 20
collects = []
real_collect = gc.collect
def counting_collect(*a, **k):  # CuPy's plan cache and the bridge both call gc.collect()
    collects.append(threading.current_thread().name)
    return real_collect(*a, **k)
gc.collect = counting_collect
out = {}
for free_after in (0.02, 0.4):
    torch.cuda.synchronize()
    bridge.pool(0).set_limit(0)
    bridge.pool(0).free_all_blocks()
    bridge.pool(0).set_limit(bridge.stats(0).used + 600 * MIB)
    ready = threading.Event()
    def trainer():
        batch = torch.ones(512 * MIB, dtype=torch.uint8, device="cuda")  # its own
        torch.cuda.synchronize()
        ready.set()
        while core.stats(0)[1]["waiting"] == 0:
            time.sleep(0.001)
        time.sleep(free_after)
        del batch  # its step is done: the batch goes
    got = {}
    def producer():  # a thread of its own, that ends: CuPy's per-thread state goes with it
        a = cp.full(512 * MIB, 7, dtype=cp.uint8)  # waits for the trainer's free
        got.update(sum=int(a.sum(dtype=cp.uint64)), outcome=core.last_wait()[1])
    t = threading.Thread(target=trainer, name="trainer")
    p = threading.Thread(target=producer, name="producer")
    n0, w0 = len(collects), bridge.stats(0).num_waits
    t.start()
    ready.wait()
    p.start()
    p.join()
    t.join()
    out[str(free_after)] = dict(collects=collects[n0:], waits=bridge.stats(0).num_waits - w0,
                                **got)
report(ok=core.WAIT_OK, **out)
"""


def test_a_short_wait_runs_no_garbage_collection_and_a_long_one_runs_one():
    """Issue 18: the chain before each wait ran gc.collect() twice (the bridge's, and
    CuPy's PlanCache.clear() on an empty cache), and the waiting thread's end a
    third, about 0.1 s each with every Python thread stopped, for waits of
    milliseconds. Bridge only: natively nobody waits."""
    pytest.importorskip("cupy")
    pytest.importorskip("torch")
    r = run_mode(CHAIN, "bridge")
    short, long_ = r["0.02"], r["0.4"]
    for case in (short, long_):
        assert case["waits"] == 1 and case["outcome"] == r["ok"]
        assert case["sum"] == 7 * 512 * (1 << 20)  # the bytes the waiter got
    # the free came within the grace: no collection, before, during or after the
    # wait (asking CuPy for a thread's FFT plan cache makes one, whose end collects)
    assert short["collects"] == []
    assert long_["collects"][:1] == ["producer"]  # by the waiter, past the grace
