"""End to end: CuPy preprocessing handed to torch by DLPack, then a training step.

    python3 benchmarks/bench_e2e.py --mode bridge --json r.json

Each step: CuPy makes a batch of uint8 "decoded images" on the device,
converts to float, flips half of them, normalizes per channel and adds noise;
``torch.from_dlpack`` takes the batch and its labels without a copy; a small
conv net does forward, backward and an SGD step. Every step allocates and
frees in both frameworks. Reported: training steps per second, the median of
``--repeats`` timed runs of ``--steps`` steps (each bracketed by a device
synchronize), after ``--warmup`` steps.

native: CuPy's MemoryPool and torch's caching allocator;
bridge: ``bridge.unify(cupy=True, torch=True)``;
bridge-torch / bridge-cupy: only that framework on the bridge, the other
native (diagnostics: which side costs what).

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
from _common import median, pin_cpu, run_guarded  # noqa: E402

MODES = ("native", "bridge", "bridge-torch", "bridge-cupy")


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
    if mode.startswith("bridge"):
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--steps", type=int, default=100, help="steps per timed run")
    p.add_argument("--repeats", type=int, default=5, help="timed runs (median)")
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
    base = {"bench": "e2e", "mode": args.mode, "steps": args.steps, "repeats": args.repeats,
            "warmup": args.warmup, "batch": args.batch, "size": args.size}

    def body(result: dict) -> None:
        if args.mode.startswith("bridge"):
            import bridge

            bridge.unify(cupy=args.mode != "bridge-torch", torch=args.mode != "bridge-cupy")
        import cupy
        import torch

        result["info"] = {"torch": torch.__version__, "cupy": cupy.__version__}
        step, sync = build(args.batch, args.size)
        pin_cpu(args.cpu, result)
        for _ in range(args.warmup):
            loss = step()
        sync()
        before = counters(args.mode)
        rates = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for _ in range(args.steps):
                loss = step()
            sync()
            rates.append(args.steps / (time.perf_counter() - t0))
        result["steps_per_s_samples"] = [round(r, 2) for r in rates]
        result["steps_per_s"] = round(median(rates), 2)
        after = counters(args.mode)
        steps = args.steps * args.repeats
        result["per_step"] = {k: round((after[k] - before[k]) / steps, 3) for k in after}
        issue, total = [], []
        for _ in range(args.probe_steps):
            t0 = time.perf_counter()
            loss = step()
            t1 = time.perf_counter()
            sync()
            issue.append(t1 - t0)
            total.append(time.perf_counter() - t0)
        if issue:
            result["issue_ms"] = round(median(issue) * 1e3, 3)
            result["synced_step_ms"] = round(median(total) * 1e3, 3)
        result["final_loss"] = float(loss)
        if args.mode.startswith("bridge"):
            import bridge

            result["pool_peak_used"] = bridge.stats(0).peak_used

    return run_guarded(args.json, base, body)


if __name__ == "__main__":
    sys.exit(main())
