# SPDX-License-Identifier: Apache-2.0
"""Allocators taking turns: each configuration in its own fresh process, timed in alternation.

    python3 benchmarks/bench_turns.py --framework torch --configs native,async,rmm,bridge \\
        --cpu 3 --json r.json

One worker process per configuration (bench_alloc.py's setup) pins its timing thread to
``--cpu`` and waits, blocked on a pipe; the coordinator asks each in turn for one timed loop
(``--iters`` alloc+free pairs, ~10 ms) per size, the order rotating every round, so that
every configuration sees the same machine within milliseconds (why: benchmarks/README.md,
"How it measures"). Result, per configuration: ``ns_per_pair`` (best loop per size), every
sample, ``floor_ns`` (the best loop of an op that allocates nothing); ``turn_ratios``: for
each baseline, bridge / baseline round by round (median, min, max). A configuration that
cannot run (RMM not installed) is recorded as skipped with the reason.

``--processes N``: N generations of workers, one after another, each a fresh process per
configuration taking ``--repeats`` rounds. A process keeps a speed of its own for its whole
life (where its code and thread-local data landed), and one worker per configuration puts
that offset into every round; over generations ``turn_ratios`` also gives each
generation's median (``process_medians``) and their median (``process_median``), the
figure a slow or fast process moves least.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_alloc  # noqa: E402
from _common import (  # noqa: E402
    add_pair_args,
    check_pair_args,
    config_env,
    end_of_turns,
    median,
    pin_cpu,
    run_guarded,
    serve,
    spread,
    start_workers,
    take_turns,
)


def worker_setup(args: argparse.Namespace) -> Callable[[dict], dict]:
    """serve()'s setup for one allocator: warm, time and floor commands."""

    def setup(info: dict) -> dict:
        loop, floor = bench_alloc.setup(args.framework, args.config, info)
        pin_cpu(args.cpu, info)
        gc.disable()
        return {"warm": loop,
                "time": lambda n, iters: bench_alloc.time_loop(loop, n, iters),
                "floor": lambda iters: bench_alloc.time_loop(floor, 0, iters)}

    return setup


def coordinate(args: argparse.Namespace, result: dict) -> None:
    configs: dict = {}
    result["configs"] = configs
    me = os.path.abspath(__file__)
    specs = {}
    for c in args.configs:
        env = dict(os.environ)
        env.update(config_env(args.framework, c))
        argv = [sys.executable, me, "--worker", "--framework", args.framework, "--config", c]
        specs[c] = (argv + (["--cpu", str(args.cpu)] if args.cpu is not None else []), env)
    generations = []
    for g in range(args.processes):
        status = configs if g == 0 else {}  # the first generation's status and info stay
        workers = start_workers(specs, status)
        for c, st in status.items():
            if g and st["status"] != "ok":  # a later generation that could not start
                configs[c].update(status=st["status"], error=st.get("error") or st.get("reason"))
        generations.append(take_turns(workers, configs, args.sizes, args.warmup, args.iters,
                                      args.repeats, floor_iters=max(1, args.iters // 4)))
    timed = [c for c in configs if any(c in gs for gs, _ in generations)]
    samples = {c: {str(n): [v for gs, _ in generations for v in gs.get(c, {}).get(str(n), [])]
                   for n in args.sizes} for c in timed}  # fmt: skip
    floors = {c: [v for _, gf in generations for v in gf.get(c, [])] for c in timed}
    for c, per_size in samples.items():
        done = {s: v for s, v in per_size.items() if v}
        configs[c]["ns_samples"] = {s: [round(x, 1) for x in v] for s, v in done.items()}
        configs[c]["ns_per_pair"] = {s: round(min(v), 1) for s, v in done.items()}
        if floors[c]:
            configs[c]["floor_ns"] = round(min(floors[c]), 1)
    result["turn_ratios"] = turn_ratios([gs for gs, _ in generations])
    end_of_turns(configs, result, "ns_per_pair")


def turn_ratios(generations: list[dict]) -> dict:
    """{baseline: {size: spread of bridge / baseline, round by round}} over the rounds both
    ran in each generation of workers; with more than one generation, also each
    generation's median (``process_medians``) and their median (``process_median``)."""
    out: dict = {}
    for samples in generations:
        bridge = samples.get("bridge", {})
        for base, per_size in samples.items():
            if base == "bridge":
                continue
            for size, values in per_size.items():
                pairs = list(zip(bridge.get(size, []), values, strict=False))
                if pairs:
                    out.setdefault(base, {}).setdefault(size, []).append([b / v for b, v in pairs])
    result: dict = {}
    for base, per_size in out.items():
        for size, gens in per_size.items():
            r = spread([x for g in gens for x in g])
            if len(generations) > 1:
                r["process_medians"] = [round(median(g), 4) for g in gens]
                r["process_median"] = round(median(r["process_medians"]), 4)
            result.setdefault(base, {})[size] = r
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--framework", choices=bench_alloc.FRAMEWORKS, required=True)
    p.add_argument("--configs", default="native,async,rmm,bridge",
                   help="comma list; bridge is the one compared against the others")
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)  # worker only
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    add_pair_args(p, iters=5000, repeats=41, repeats_help="rounds (timed loops per size)")
    p.add_argument("--processes", type=int, default=1,
                   help="generations of workers, each a fresh process per configuration "
                        "taking --repeats rounds (default 1)")  # fmt: skip
    args = p.parse_args(argv)
    if args.worker:
        return serve(worker_setup(args))
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in bench_alloc.CONFIGS[:-1]]
    if bad or len(set(args.configs)) != len(args.configs) or "bridge" not in args.configs:
        p.error(f"--configs: distinct names from {', '.join(bench_alloc.CONFIGS[:-1])}, "
                f"with bridge (got {args.configs})")
    check_pair_args(p, args)
    if args.processes < 1:
        p.error(f"--processes must be >= 1 (got {args.processes})")
    base = {"bench": "alloc_turns", "framework": args.framework, "sizes": args.sizes,
            "iters": args.iters, "repeats": args.repeats, "warmup": args.warmup,
            "processes": args.processes, "cpu": args.cpu,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    return run_guarded(args.json, base, lambda result: coordinate(args, result))


if __name__ == "__main__":
    sys.exit(main())
