# SPDX-License-Identifier: Apache-2.0
"""End to end: CuPy preprocessing handed to torch by DLPack, then a training step.

    python3 benchmarks/bench_e2e.py --mode bridge --json r.json
    python3 benchmarks/bench_e2e.py --turns native,bridge --repeats 15 --cpu 3 --json r.json

Each step: CuPy makes a batch of uint8 "decoded images" on the device,
converts to float, flips half of them, normalizes per channel and adds noise;
``torch.from_dlpack`` takes the batch and its labels without a copy; a small
conv net does forward, backward and an SGD step. Every step allocates and
frees in both frameworks. Reported: training steps per second, the median of
``--repeats`` timed runs of ``--steps`` steps (each bracketed by a device
synchronize), after ``--warmup`` steps.

native: CuPy's MemoryPool and torch's caching allocator;
bridge: ``bridge.unify(cupy=True, torch=True)``.

``--turns native,bridge``: one fresh worker process per mode, set up
together, then one timed run of each in turn, the order rotating every round
(``--repeats`` rounds), all on the same CPU: both see the same machine
within a second (see bench_turns.py for why). ``turn_ratios``: bridge /
native of every round, summarised.

After the timed runs, ``--probe-steps`` steps run one by one, each followed by
a synchronize: ``issue_ms`` is the time to issue a step (CPU side),
``synced_step_ms`` the time until it finished; issue close to the step time
means the step is bound by the CPU (Python and launches), not the GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    end_of_turns,
    median,
    pin_cpu,
    rotated,
    run_guarded,
    serve,
    spread,
    start_workers,
)

MODES = ("native", "bridge")


def build(batch: int, size: int) -> tuple:
    import cupy
    import torch
    from torch import nn
    from torch.nn import functional as F

    torch.manual_seed(0)
    cupy.random.seed(0)
    torch.backends.cudnn.benchmark = False  # the same kernels in every process
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10),
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    mean = cupy.asarray([0.485, 0.456, 0.406], dtype=cupy.float32).reshape(1, 3, 1, 1) * 255
    std = cupy.asarray([0.229, 0.224, 0.225], dtype=cupy.float32).reshape(1, 3, 1, 1) * 255
    shape = (batch, 3, size, size)

    def preprocess() -> tuple:
        raw = (cupy.random.random(shape, dtype=cupy.float32) * 255).astype(cupy.uint8)
        x = raw.astype(cupy.float32)
        flip = (cupy.random.random(batch, dtype=cupy.float32) < 0.5).reshape(batch, 1, 1, 1)
        x = cupy.where(flip, x[..., ::-1], x)
        x = (x - mean) / std
        x += cupy.random.standard_normal(shape, dtype=cupy.float32) * 0.01
        y = cupy.random.randint(0, 10, size=batch).astype(cupy.int64)
        return torch.from_dlpack(cupy.ascontiguousarray(x)), torch.from_dlpack(y)

    def step() -> object:
        x, y = preprocess()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    def sync() -> None:
        cupy.cuda.Device().synchronize()
        torch.cuda.synchronize()

    return step, sync


def counters(mode: str) -> dict:
    """Allocation counters, read around the timed steps (reported per step).

    bridge: allocations through the bridge and how many the per-stream cache
    served (the rest went to the driver's pool); native: torch's segment
    allocations (cudaMalloc calls) and CuPy's pool bytes.
    """
    if mode == "bridge":
        from bridge._runtime import core

        raw = core.stats(0)[1]
        return {"allocs": raw["num_allocs"], "cache_hits": raw["num_cache_hits"],
                "driver_allocs": raw["num_allocs"] - raw["num_cache_hits"],
                "retries": raw["num_retries"]}
    import cupy
    import torch

    st = torch.cuda.memory_stats()
    return {"torch_allocs": st.get("allocation.all.allocated", 0),
            "torch_cudamalloc": st.get("segment.all.allocated", 0),
            "torch_retries": st.get("num_alloc_retries", 0),
            "cupy_pool_bytes": cupy.get_default_memory_pool().total_bytes()}


class Session:
    """One mode set up in this process: timed runs, counters, the issue/finish probe."""

    def __init__(self, args: argparse.Namespace, mode: str, info: dict) -> None:
        if mode == "bridge":
            import bridge

            bridge.unify(cupy=True, torch=True)
        import cupy
        import torch

        info.update(torch=torch.__version__, cupy=cupy.__version__)
        self.mode = mode
        self.step, self.sync = build(args.batch, args.size)
        pin_cpu(args.cpu, info)
        for _ in range(args.warmup):
            self.loss = self.step()
        self.sync()
        self.before = counters(mode)
        self.timed_steps = 0

    def run(self, steps: int) -> float:
        """steps/s of one timed run of steps steps (ended by a synchronize)."""
        t0 = time.perf_counter()
        for _ in range(steps):
            self.loss = self.step()
        self.sync()
        self.timed_steps += steps
        return steps / (time.perf_counter() - t0)

    def report(self, probe_steps: int) -> dict:
        """Allocation counters per timed step, then probe_steps steps timed one by one."""
        after = counters(self.mode)
        out: dict = {"per_step": {k: round((after[k] - self.before[k]) / max(1, self.timed_steps),
                                           3) for k in after}}
        issue, total = [], []
        for _ in range(probe_steps):
            t0 = time.perf_counter()
            self.loss = self.step()
            t1 = time.perf_counter()
            self.sync()
            issue.append(t1 - t0)
            total.append(time.perf_counter() - t0)
        if issue:
            out["issue_ms"] = round(median(issue) * 1e3, 3)
            out["synced_step_ms"] = round(median(total) * 1e3, 3)
        out["final_loss"] = float(self.loss)
        if self.mode == "bridge":
            import bridge

            out["pool_peak_used"] = bridge.stats(0).peak_used
        return out


def take_turns(args: argparse.Namespace, result: dict) -> None:
    """--turns: one worker process per mode, timed runs in alternation (see bench_turns.py)."""
    modes: dict = {}
    result["modes"] = modes
    me = os.path.abspath(__file__)
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch",
              str(args.batch), "--size", str(args.size)]
    specs = {m: ([sys.executable, me, "--worker", "--mode", m] + common +
                 (["--cpu", str(args.cpu)] if args.cpu is not None else []), dict(os.environ))
             for m in args.turns}
    workers = start_workers(specs, modes)
    rates: dict = {m: [] for m in workers}
    try:
        live = list(workers)
        for r in range(args.repeats):
            for m in rotated(live, r):
                kind, value = workers[m].ask(f"run {args.steps}")
                if kind == "ok":
                    rates[m].append(float(value))
                else:
                    modes[m].update(status="error", error=f"run: {value}")
                    live.remove(m)
        for m in live:
            kind, value = workers[m].ask(f"report {args.probe_steps}")
            if kind == "ok":
                modes[m].update(value)
            else:
                modes[m]["report_error"] = str(value)[:500]
    finally:
        for w in workers.values():
            w.close()
    for m, v in rates.items():
        if v:
            modes[m].update(steps_per_s_samples=[round(x, 2) for x in v],
                            steps_per_s=round(median(v), 2), best_steps_per_s=round(max(v), 2))
    pairs = list(zip(rates.get("bridge", []), rates.get("native", []), strict=False))
    if pairs:
        result["turn_ratios"] = {"native": spread([b / n for b, n in pairs])}
    end_of_turns(modes, result, "steps_per_s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=MODES, default=None, help="one mode in this process")
    p.add_argument("--turns", default=None,
                   help="comma list of modes (such as native,bridge): one worker process each, "
                        "timed runs taking turns")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=100, help="steps per timed run")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed runs (with --turns: rounds, one run of every mode each)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=64, help="image side, pixels")
    p.add_argument("--probe-steps", type=int, default=20,
                   help="steps timed one by one afterwards (issue vs finish)")
    p.add_argument("--json", default=None)
    p.add_argument("--cpu", type=int, default=None,
                   help="pin the main thread to this CPU (after setup)")
    args = p.parse_args(argv)
    if min(args.steps, args.repeats, args.batch, args.size) < 1 or args.warmup < 0:
        p.error("--steps, --repeats, --batch and --size must be >= 1")
    if (args.mode is None) == (args.turns is None):
        p.error("give --mode MODE or --turns MODE,MODE")
    if args.worker:
        return serve(lambda info: _worker_commands(Session(args, args.mode, info)))
    if args.turns is not None:
        args.turns = [m.strip() for m in args.turns.split(",") if m.strip()]
        bad = [m for m in args.turns if m not in MODES]
        if bad or len(set(args.turns)) != len(args.turns) or len(args.turns) < 2:
            p.error(f"--turns: two or more distinct modes of {MODES} (got {args.turns})")
    base = {"bench": "e2e", "mode": args.mode, "turns": args.turns, "steps": args.steps,
            "repeats": args.repeats, "warmup": args.warmup, "batch": args.batch,
            "size": args.size, "cpu": args.cpu}

    def body(result: dict) -> None:
        info = result.setdefault("info", {})
        session = Session(args, args.mode, info)
        rates = [session.run(args.steps) for _ in range(args.repeats)]
        result["steps_per_s_samples"] = [round(r, 2) for r in rates]
        result["steps_per_s"] = round(median(rates), 2)
        result.update(session.report(args.probe_steps))

    if args.turns is not None:
        return run_guarded(args.json, base, lambda result: take_turns(args, result))
    return run_guarded(args.json, base, body)


def _worker_commands(session: Session) -> dict:
    return {"run": session.run, "report": session.report}


if __name__ == "__main__":
    sys.exit(main())
