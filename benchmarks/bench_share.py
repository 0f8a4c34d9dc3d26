# SPDX-License-Identifier: Apache-2.0
"""Allocation cost with a share (``unify(share=...)``) against without, processes in turns.

    python3 benchmarks/bench_share.py --framework torch --cpu 3 --json r.json
    python3 benchmarks/bench_share.py --framework core   # the C core on the stand-in driver

Four configurations, each in its own fresh worker process, timed in turns as
bench_turns.py does (one loop of ``--iters`` alloc+free pairs per size, the
order rotating every round; best loop against best loop):

  own           ``unify(budget=BUDGET)``: this process's own budget
  share         ``unify(budget=BUDGET, share=NAME)``: the same budget, shared (each
                share configuration has a share of its own, with this one member: what
                is timed is the check, not waiting for others)
  own-pool      ``own`` with the cache off (``BRIDGE_CACHE_LIMIT=0``): every
                allocation reaches the pool, so every one passes the budget check
  share-pool    ``share`` with the cache off: every allocation passes the share's check

``own`` vs ``share`` is the hot path (a freed block of the same size and
stream comes back from the cache: the share is not consulted); ``own-pool``
vs ``share-pool`` is what the share costs an allocation the pool serves (one
pool attribute read before and one after; no shared memory written while the
claim covers the pool). ``--framework``: ``torch`` (``torch.empty`` +
drop), ``cupy`` (``cupy.empty`` + drop), or ``core`` (``bridge._core.alloc``
+ ``free`` from Python; on the stand-in driver when ``BRIDGE_CUDA_LIBRARY``
names it, with no GPU).

Result: ``configs[c].ns_per_pair`` (best loop per size), every sample, and
``ratios``: share / own and share-pool / own-pool, round by round (median,
min, max).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import uuid
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_alloc  # noqa: E402
from _common import (  # noqa: E402
    add_pair_args,
    check_pair_args,
    end_of_turns,
    pin_cpu,
    run_guarded,
    serve,
    spread,
    start_workers,
    take_turns,
)

CONFIGS = ("own", "share", "own-pool", "share-pool")
FRAMEWORKS = ("torch", "cupy", "core")


def _core_loop() -> Callable[[int, int], None]:
    from bridge._runtime import core

    alloc, free, tag = core.alloc, core.free, core.TAG_CUPY

    def loop(n: int, iters: int) -> None:
        for _ in range(iters):
            rc, p = alloc(0, n, 0, tag)
            if rc:
                raise MemoryError(f"core.alloc({n}) refused: status {rc}")
            free(p)

    return loop


def worker_setup(args: argparse.Namespace) -> Callable[[dict], dict]:
    def setup(info: dict) -> dict:
        import bridge

        shared = args.config.startswith("share")
        fw = args.framework
        bridge.unify(
            cupy=fw == "cupy",
            torch=fw == "torch",
            budget=args.budget,
            device=0,
            share=args.share if shared else None,
        )
        info["share"] = bridge.stats(0).share
        info["cache_limit"] = os.environ.get("BRIDGE_CACHE_LIMIT")
        if fw == "core":
            loop = _core_loop()
        elif fw == "torch":
            loop = bench_alloc.setup_torch("native", info)  # unify above made it the bridge's
        else:
            import cupy

            cupy.empty(1, dtype=cupy.uint8)
            loop = bench_alloc.cupy_loop()
        pin_cpu(args.cpu, info)
        gc.disable()
        return {
            "warm": loop,
            "time": lambda n, iters: bench_alloc.time_loop(loop, n, iters),
        }

    return setup


def coordinate(args: argparse.Namespace, result: dict) -> None:
    configs: dict = {}
    result["configs"] = configs
    me = os.path.abspath(__file__)
    share = "bench-" + uuid.uuid4().hex[:8]
    specs = {}
    for c in CONFIGS:
        env = dict(os.environ)
        env.pop("BRIDGE_SHARE", None)
        env.pop("BRIDGE_GPU_MEMORY_LIMIT", None)
        if c.endswith("-pool"):
            env["BRIDGE_CACHE_LIMIT"] = "0"
        else:
            env.pop("BRIDGE_CACHE_LIMIT", None)
        argv = [sys.executable, me, "--worker", "--framework", args.framework, "--config", c,
                "--budget", args.budget, "--share", f"{share}-{c}"]  # fmt: skip
        specs[c] = (argv + (["--cpu", str(args.cpu)] if args.cpu is not None else []), env)
    workers = start_workers(specs, configs)
    samples, _ = take_turns(workers, configs, args.sizes, args.warmup, args.iters, args.repeats)
    for c, per_size in samples.items():
        done = {s: v for s, v in per_size.items() if v}
        configs[c]["ns_samples"] = {s: [round(x, 1) for x in v] for s, v in done.items()}
        configs[c]["ns_per_pair"] = {s: round(min(v), 1) for s, v in done.items()}
    ratios: dict = {}
    for shared, own in (("share", "own"), ("share-pool", "own-pool")):
        for size in map(str, args.sizes):
            a, b = samples.get(shared, {}).get(size, []), samples.get(own, {}).get(size, [])
            pairs = list(zip(a, b, strict=False))
            if pairs:
                ratios.setdefault(f"{shared}/{own}", {})[size] = spread([a / b for a, b in pairs])
    result["ratios"] = ratios
    end_of_turns(configs, result, "ns_per_pair")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--framework", choices=FRAMEWORKS, default="torch")
    p.add_argument("--config", choices=CONFIGS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--share", default="bench", help=argparse.SUPPRESS)
    p.add_argument("--budget", default="8GiB", help="the budget of every configuration")
    add_pair_args(p, iters=5000, repeats=21, repeats_help="rounds (timed loops per size)")
    args = p.parse_args(argv)
    if args.worker:
        return serve(worker_setup(args))
    check_pair_args(p, args)
    base = {"bench": "share", "framework": args.framework, "sizes": args.sizes,
            "iters": args.iters, "repeats": args.repeats, "warmup": args.warmup,
            "budget": args.budget, "cpu": args.cpu,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S")}  # fmt: skip
    return run_guarded(args.json, base, lambda result: coordinate(args, result))


if __name__ == "__main__":
    sys.exit(main())
