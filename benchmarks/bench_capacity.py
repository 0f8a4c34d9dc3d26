# SPDX-License-Identifier: Apache-2.0
"""Capacity: the largest batch of a mixed pipeline that fits one memory budget.

Each step of the pipeline prepares a batch of images with CuPy (raw 512 x 512
uint8 to float, a low-pass filter through a 2-D FFT, a 4 x 4 mean down to
128 x 128, normalisation), hands it to torch through DLPack, and trains a
small convolutional network on it. CuPy's memory peaks in the first half of a
step, torch's in the second, and the two peaks are of one order (each child
reports both per image, measured at a batch of 512; on the bridge, the
ledger's peak in each half, both frameworks together): natively the budget must
be split between them, on the bridge each half can use all of it.

- native: CuPy's pool and torch's caching allocator each keep what they
  freed, so a budget B must be split: CuPy gets ``set_limit(split * B)`` and
  torch ``set_per_process_memory_fraction((1 - split) * B / total)``. Every
  split of ``--splits`` is searched, each in a fresh process; the best one
  counts.
- bridge: ``bridge.unify(cupy=True, torch=True, budget=B)``: both draw from
  one budget.

No tensor of a step may pass 2**31 elements (torch 2.11 kernels index some of
them in 32 bits, and an earlier model of this benchmark stopped at that wall,
not at the budget): the search's largest batch is capped there (``CAP``), and
a result at the cap says so (``capped``). The default budget, 24 GiB, keeps
both configurations under it on an H200.

For each configuration the batch is doubled from ``--start`` until a step
fails with an out-of-memory error, then bisected; a batch fits when
``--steps`` steps in a row run without one. The result is the bridge's batch
over the best native one (issue target: >= 1.8).

    python benchmarks/bench_capacity.py --budget 24GiB --out capacity.json     (GPU)
    python benchmarks/bench_capacity.py --dry-run                             (the plan)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ALLOCATOR_ENV, parse_fractions, parse_sizes, write_json  # noqa: E402

RAW = 512  # the side of the raw images CuPy filters
HW = 128  # the side of the images torch trains on (a 4 x 4 mean of the raw ones)
CHANNELS = 48  # the network's width: torch's peak per image near CuPy's
SPLITS = (0.2, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.7)
#: The largest batch whose every tensor stays under 2**31 elements: the raw
#: batch (3 x 512 x 512 a image) and each activation (48 x 128 x 128) are the
#: largest, 786,432 elements an image each.
PROBE = 512  # the batch each half's peak a image is measured at
CAP = (2**31 - 1) // max(3 * RAW * RAW, CHANNELS * HW * HW)


# ---- the search (no GPU) ----
def largest(fits: Callable[[int], bool], start: int = 8, limit: int = 1 << 16) -> int:
    """The largest batch n in [1, limit] with fits(n), assuming fits is monotone.

    Doubles from ``start`` until a batch does not fit (or ``limit``), then
    bisects between the last that fit and the first that did not. 0 when not
    even 1 fits.
    """
    lo, hi = 0, None  # lo fits (0: nothing yet); hi does not
    n = max(1, min(start, limit))
    while hi is None:
        if fits(n):
            lo = n
            if n >= limit:
                return n
            n = min(2 * n, limit)
        else:
            hi = n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def summarize(native: dict[str, int], bridge: int) -> dict[str, Any]:
    """The best native split, its batch, and the bridge's batch over it."""
    ok = {s: b for s, b in native.items() if b > 0}
    best = max(ok, key=lambda s: ok[s]) if ok else None
    nb = ok[best] if best is not None else 0
    return {
        "native_best_split": best,
        "native_batch": nb,
        "bridge_batch": bridge,
        "ratio": (bridge / nb) if nb else None,
    }


# ---- one configuration, in its own process (GPU) ----
def _child(mode: str, budget: int, split: float, steps: int, start: int, limit: int,
           free_plans: bool = False) -> dict:
    if mode == "bridge":
        import bridge

        bridge.unify(cupy=True, torch=True, budget=budget)
    import cupy as cp
    import torch

    torch.zeros(1, device="cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    pool = cp.get_default_memory_pool()
    if mode == "native":
        pool.set_limit(size=int(split * budget))
        torch.cuda.set_per_process_memory_fraction((1.0 - split) * budget / total)

    class Pool8(torch.nn.Module):
        """An 8 x 8 average pool as a reshape and a mean (torch 2.11's adaptive_avg_pool2d
        backward writes outside its buffer past 2**31 elements: pytorch/pytorch#188957)."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, c = x.shape[:2]
            return x.view(b, c, 8, HW // 8, 8, HW // 8).mean(dim=(3, 5))

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, CHANNELS, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1), torch.nn.ReLU(),
        Pool8(), torch.nn.Flatten(), torch.nn.Linear(CHANNELS * 64, 10),
    ).cuda()  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ky = cp.fft.fftfreq(RAW)[:, None]
    kx = cp.fft.rfftfreq(RAW)[None, :]
    mask = cp.exp(-(kx**2 + ky**2) * 40.0).astype(cp.complex64)
    k = RAW // HW
    peaks = {"cupy": 0, "torch": 0}  # the last step's peak of each half, in bytes
    if mode == "bridge":
        from bridge._runtime import core

    def half_done(name: str) -> None:
        """The peak of the half that ended: natively CuPy's pool (which keeps its
        peak) or torch's allocator; on the bridge the ledger (both frameworks)."""
        if mode == "bridge":
            peaks[name] = bridge.stats(0).ledger_peak
            core.reset_peak(0, -1)
        else:
            cupy_half = name == "cupy"
            peaks[name] = pool.total_bytes() if cupy_half else torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    def step(b: int) -> None:
        if mode == "bridge":
            core.reset_peak(0, -1)
        raw = cp.random.randint(0, 255, (b, 3, RAW, RAW), dtype=cp.uint8)
        x = raw.astype(cp.float32) / 255.0
        del raw
        f = cp.fft.rfft2(x)
        f *= mask
        x = cp.fft.irfft2(f, s=(RAW, RAW)).astype(cp.float32)
        del f
        x = x.reshape(b, 3, HW, k, HW, k).mean(axis=(3, 5))
        x = (x - x.mean()) / (x.std() + 1e-6)
        if free_plans:  # the FFT plans' work areas go back before torch's half
            cp.fft.config.get_plan_cache().clear()
        half_done("cupy")
        if mode == "bridge":
            peaks["into_torch"] = bridge.stats(0).ledger  # what goes into torch's half
        t = torch.from_dlpack(x)
        loss = model(t).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del t, x, loss
        torch.cuda.synchronize()
        half_done("torch")

    oom_types: tuple[type[BaseException], ...] = (
        cp.cuda.memory.OutOfMemoryError, torch.cuda.OutOfMemoryError,
    )  # fmt: skip
    tries: list[tuple[int, bool]] = []

    def fits(b: int) -> bool:
        ok = True
        try:
            for _ in range(steps):
                step(b)
        except oom_types:
            ok = False
        except RuntimeError as exc:  # torch's other OOM form, and cuFFT's plan failures
            if "out of memory" not in str(exc).lower() and "CUFFT_ALLOC_FAILED" not in str(exc):
                raise
            ok = False
        opt.zero_grad(set_to_none=True)
        cp.fft.config.get_plan_cache().clear()
        pool.free_all_blocks()
        torch.cuda.empty_cache()
        tries.append((b, ok))
        return ok

    t0 = time.perf_counter()
    limit = min(limit, CAP)
    batch = largest(fits, start, limit)
    seconds = round(time.perf_counter() - t0, 1)
    per_image = None
    if fits(PROBE):  # each half's peak a image (the pools start empty)
        per_image = {name: peak // PROBE for name, peak in peaks.items()}
        tries.pop()
    return {"mode": mode, "split": split if mode == "native" else None, "batch": batch,
            "capped": batch >= CAP, "tries": tries, "seconds": seconds,
            "per_image": per_image, "free_fft_plans": free_plans, "torch": torch.__version__,
            "cupy": cp.__version__}  # fmt: skip


def _run_child(argv: list[str], timeout: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_ENV}
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), *argv],
                           capture_output=True, text=True, env=env, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:  # one split that hangs leaves the others' figures
        return {"status": "error", "error": f"timed out after {timeout:.0f} s: {argv}"}
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"status": "error", "error": p.stderr[-2000:]}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", default="24GiB", help="the memory budget (a size)")
    ap.add_argument("--splits", default=",".join(str(s) for s in SPLITS),
                    help="CuPy's shares of the budget tried natively")  # fmt: skip
    ap.add_argument("--steps", type=int, default=2, help="steps in a row a batch must run")
    ap.add_argument("--start", type=int, default=16)
    ap.add_argument("--limit", type=int, default=1 << 14, help="the largest batch tried")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per process")
    ap.add_argument("--out", default=None)
    ap.add_argument("--free-fft-plans", action="store_true",
                    help="clear CuPy's FFT plan cache after each step's preprocessing, so that "
                    "its plans' work areas are not held through torch's half")  # fmt: skip
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("--child", choices=("native", "bridge"), help=argparse.SUPPRESS)
    ap.add_argument("--split", type=float, default=0.5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    (budget,) = parse_sizes(args.budget)
    try:
        splits = parse_fractions(args.splits)
    except ValueError as exc:
        ap.error(f"--splits: {exc}")
    if min(args.steps, args.start, args.limit) < 1:
        ap.error("--steps, --start and --limit must be at least 1")
    if args.child:
        print(json.dumps(_child(args.child, budget, args.split, args.steps, args.start,
                                args.limit, args.free_fft_plans)))  # fmt: skip
        return 0
    common = ["--budget", str(budget), "--steps", str(args.steps), "--start", str(args.start),
              "--limit", str(args.limit)]  # fmt: skip
    common += ["--free-fft-plans"] if args.free_fft_plans else []
    plan = [["--child", "native", "--split", str(s), *common] for s in splits]
    plan.append(["--child", "bridge", *common])
    if args.dry_run:
        for p in plan:
            print(" ".join([sys.executable, __file__, *p]))
        return 0
    runs = [_run_child(p, args.timeout) for p in plan]
    native = {str(r.get("split")): int(r.get("batch") or 0) for r in runs[:-1]}
    result = {"bench": "capacity", "budget": budget, "steps": args.steps, "runs": runs,
              "free_fft_plans": args.free_fft_plans,
              **summarize(native, int(runs[-1].get("batch") or 0))}  # fmt: skip
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
