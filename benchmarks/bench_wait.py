# SPDX-License-Identifier: Apache-2.0
"""Throughput of a producer/trainer pipeline at a tight budget with waiting vs an unlimited budget.

    python benchmarks/bench_wait.py [--rounds 3] [--steps 300] [--out FILE]     (GPU)

A CuPy thread fills 512 MiB batches (an elementwise kernel, in place) into a queue of four; a
torch thread trains a small MLP on them (from_dlpack, zero copy) and drops each batch after
its step. Both on the bridge, in fresh processes that take turns: ``unlimited`` (no budget)
and ``tight`` (what a step holds with its batch, measured in a warm-up step, plus one batch
and 64 MiB, with ``wait=30``: the producer waits for the trainer to free).

Prints (and with ``--out`` writes) JSON: steps per second per configuration and round, the
round-by-round ratios of tight to unlimited and their median (the verdict), the best rounds'
ratio; per run the waits and OOMs, steps per second by tenth of the run, the steps in which
a wait began, the first ten steps' times, the calls and time of the recovery chain's Python
part (``bridge.recovery.relieve``) and the explicit ``gc.collect()`` calls (a collection
before each wait once cost a run 0.15-0.36 s; see Note [Recovery chain] in docs/design.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ALLOCATOR_ENV, median, write_json  # noqa: E402

WORKER = r"""
import json, queue, sys, threading, time
mode, steps = sys.argv[1], int(sys.argv[2])
import bridge
bridge.unify(cupy=True, torch=True, wait=30 if mode == "tight" else 0)
from bridge._runtime import core
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
if mode == "tight":
    budget = bridge.stats(0).ledger_peak + BATCH + (64 << 20)
    bridge.pool(0).set_limit(budget)
import gc
from bridge import recovery
relief = {"calls": 0, "seconds": 0.0, "collections": 0}  # the recovery chain's Python part
def timed_relieve(*args):
    t = time.perf_counter()
    try:
        return recovery.relieve(*args)
    finally:
        relief["calls"] += 1
        relief["seconds"] += time.perf_counter() - t
core.set_pressure_callback(timed_relieve)
real_collect = gc.collect
def counted_collect(*a, **k):  # the bridge's and CuPy's (PlanCache.clear) explicit ones
    relief["collections"] += 1
    return real_collect(*a, **k)
gc.collect = counted_collect
s0 = bridge.stats(0)
q = queue.Queue(maxsize=4)
errors = []
def producer():
    try:
        for k in range(steps):
            q.put(make_batch(k))
    except Exception as e:
        errors.append(repr(e)[:300])
    finally:
        q.put(None)
stamps, waits_at = [], []  # each step's end; the steps during which a wait began
def consumer():
    try:
        while (item := q.get()) is not None:
            w0 = core.stats(0)[1]["num_waits"]
            step(*item)
            del item
            stamps.append(time.perf_counter())
            if core.stats(0)[1]["num_waits"] != w0:
                waits_at.append(len(stamps))
    except Exception as e:
        errors.append(repr(e)[:300])
        while q.get() is not None:
            pass
t0 = time.perf_counter()
ts = [threading.Thread(target=producer), threading.Thread(target=consumer)]
for t in ts: t.start()
for t in ts: t.join()
torch.cuda.synchronize()
dt = time.perf_counter() - t0
s = bridge.stats(0)
tenth = max(1, len(stamps) // 10)  # steps per second in each tenth of the run
windows = [tenth / (stamps[i + tenth - 1] - (stamps[i - 1] if i else t0))
           for i in range(0, len(stamps) - tenth + 1, tenth)]
print(json.dumps(dict(steps_per_s=steps / dt, seconds=dt, errors=errors, budget=budget,
                      steps_per_s_by_tenth=windows, waits_began_at_steps=waits_at,
                      first_steps_ms=[round((b - a) * 1e3, 2) for a, b in
                                      zip([t0] + stamps[:9], stamps[:10])],
                      relief_calls=relief["calls"], relief_seconds=relief["seconds"],
                      collections=relief["collections"],
                      batch=BATCH, num_waits=s.num_waits - s0.num_waits,
                      wait_seconds=s.wait_seconds - s0.wait_seconds,
                      num_ooms=s.num_ooms - s0.num_ooms, ledger_peak=s.ledger_peak)))
"""


def run(mode: str, steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_ENV and k != "BRIDGE_WAIT"}
    out = subprocess.run(
        [sys.executable, "-c", WORKER, mode, str(steps)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    runs: dict[str, list[dict]] = {"unlimited": [], "tight": []}
    for r in range(args.rounds):
        order = ("unlimited", "tight") if r % 2 == 0 else ("tight", "unlimited")
        for mode in order:
            runs[mode].append(run(mode, args.steps))
    best = {m: max(x["steps_per_s"] for x in v) for m, v in runs.items()}
    # the two runs of a round took turns: their ratio, round by round, and its median
    ratios = [t["steps_per_s"] / u["steps_per_s"]
              for t, u in zip(runs["tight"], runs["unlimited"], strict=True)]
    result = {
        "benchmark": "wait",
        "steps": args.steps,
        "runs": runs,
        "best_steps_per_s": best,
        "ratio_tight_over_unlimited": best["tight"] / best["unlimited"],
        "round_ratios": ratios,
        "median_ratio_tight_over_unlimited": median(ratios),
        "target_ratio": 0.9,
        "errors": sum(len(x["errors"]) for v in runs.values() for x in v),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
