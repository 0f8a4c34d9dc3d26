# SPDX-License-Identifier: Apache-2.0
"""bench_trace.py's replays in turns: warm workers, rounds, generations, the verdict.

``run_trace`` starts one ``bench_trace.py worker`` process per configuration (all
together; each sets its allocator up, loads the trace, pins its timing thread and waits,
blocked on a pipe), then asks each in turn for a round of passes, the order rotating every
round, over ``processes`` generations of fresh workers. ``turns_summary`` turns the rounds'
best passes into the figures: ``round_ratios`` against the first configuration, their
``ratio_spread`` and ``median_ratio_to_<first>``, the verdict (over at least MIN_ROUNDS
rounds: checks.py). No framework is imported here: the workers do that.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import config_env, median, rotated, start_workers  # noqa: E402

#: the script the workers run
BENCH_TRACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_trace.py")
#: A round-by-round ratio is a verdict only over this many rounds (issue 34).
MIN_ROUNDS = 9


def worker_specs(path: str, configs: list[str], cpu: int | None) -> dict:
    """{config: (argv, env)} of one generation of workers (bench_trace.py worker ...)."""
    specs = {}
    for config in configs:
        env = dict(os.environ)
        env.update(config_env("torch", config))
        argv = [sys.executable, BENCH_TRACE, "worker", path, "--config", config]
        specs[config] = (argv + (["--cpu", str(cpu)] if cpu is not None else []), env)
    return specs


def take_trace_turns(workers: dict, status: dict, rounds: int, passes: int,
                     warmup: int, first_round: int = 0) -> dict:  # fmt: skip
    """Warm every worker, then ``rounds`` rounds: each worker in turn replays the trace
    ``passes`` times, the order rotating every round. Returns {config: [ns per event of
    the round's best pass, None where it did not run]}; the workers' stats land in
    status[config]["process"]. A worker that fails leaves the turns (status says why).
    The workers are closed at the end."""
    live = list(workers)
    best: dict[str, list[float | None]] = {c: [] for c in live}

    def ask(c: str, command: str) -> Any:
        kind, value = workers[c].ask(command)
        if kind == "ok":
            return value
        status[c].update(status="error", error=f"{command}: {value}"[:2000])
        live.remove(c)
        return None

    try:
        for c in list(live):
            if warmup:
                ask(c, f"warm {warmup}")
        for r in range(rounds):
            got: dict[str, float] = {}
            for c in rotated(list(live), first_round + r):
                v = ask(c, f"time {passes}")
                if v:
                    got[c] = min(v)
            for c in best:
                best[c].append(got.get(c))
        for c in list(live):
            st = ask(c, "stats")
            if st is not None:
                status[c]["process"] = st
    finally:
        for w in workers.values():
            w.close()
    return best


def quartile_spread(values: list[float], digits: int = 4) -> dict:
    """median, the quartiles (the medians of the lower and upper halves), min, max, n."""
    v = sorted(values)
    if not v:
        raise ValueError("spread of nothing")
    half = len(v) // 2
    low, high = v[:half] or v, v[len(v) - half:] or v
    return {"median": round(median(v), digits), "q1": round(median(low), digits),
            "q3": round(median(high), digits), "min": round(v[0], digits),
            "max": round(v[-1], digits), "n": len(v)}  # fmt: skip


def turns_summary(per_round: dict[str, list[float | None]], base: str) -> dict:
    """From each configuration's best pass of every round (None: not run) to its figures:
    ``ns_per_event`` (best of all rounds), ``ns_per_round``, and against ``base`` (the
    first configuration) ``round_ratios`` (rounds both ran), their ``ratio_spread`` and
    ``median_ratio_to_<base>``, the verdict. One slow round (or one slow process of
    several) moves the median by at most one place in the sorted ratios."""
    out: dict[str, dict] = {}
    base_ns = per_round.get(base, [])
    for config, ns in per_round.items():
        done = [x for x in ns if x]
        entry: dict[str, Any] = {"ns_per_round": ns}
        if done:
            entry["ns_per_event"] = min(done)
        if config != base:
            ratios = [a / b for a, b in zip(ns, base_ns, strict=False) if a and b]
            entry["round_ratios"] = ratios
            if ratios:
                entry[f"median_ratio_to_{base}"] = median(ratios)
                entry["ratio_spread"] = quartile_spread(ratios)
        out[config] = entry
    return out


def run_trace(path: str, configs: list[str], rounds: int, passes: int, processes: int = 3,
              warmup: int = 1, cpu: int | None = None,
              specs: Callable[[str, list[str], int | None, int], dict] | None = None) -> dict:
    """One trace under every configuration in turns: ``processes`` generations of fresh
    workers (one per configuration, all started together), ``rounds`` rounds split
    among them, each round every worker's best of ``passes`` passes in rotating order.

    ``specs(path, configs, cpu, generation)`` gives a generation's workers
    ({config: (argv, env)}; worker_specs by default). Memory (peak reserved, the
    cache's counters) is each process's own after all its passes; a configuration's
    figure is its largest over the processes, every process's kept in ``processes``."""
    make = specs or (lambda p, c, cpu, g: worker_specs(p, c, cpu))
    processes = max(1, min(processes, rounds))
    per_round: dict[str, list[float | None]] = {c: [] for c in configs}
    status: dict[str, dict] = {c: {"status": "ok", "processes": []} for c in configs}
    done = 0
    bounds = [0]  # where each generation's rounds start in per_round
    for g in range(processes):
        n = (rounds - done) // (processes - g)  # rounds split as evenly as they go
        bounds.append(done + n)
        st: dict[str, dict] = {}
        active = [c for c in configs if status[c]["status"] != "skipped"]
        workers = start_workers(make(path, active, cpu, g), st) if active else {}
        for c in active:
            if c not in workers:  # skipped or failed at setup: no rounds this generation
                status[c].update({k: v for k, v in st[c].items() if k != "info"})
        live = {c: {"status": "ok"} for c in workers}
        got = take_trace_turns(workers, live, n, passes, warmup, first_round=done)
        for c in configs:
            per_round[c] += got.get(c, [None] * n)
            if c in live:
                if live[c]["status"] != "ok":
                    status[c].update(status="error", error=live[c].get("error"))
                if "process" in live[c]:
                    status[c]["processes"].append({**live[c]["process"], "generation": g,
                                                   "info": st[c].get("info")})  # fmt: skip
        done += n
    summary = turns_summary(per_round, base=configs[0])
    out: dict[str, dict] = {}
    for c in configs:
        procs = status[c].pop("processes")
        if c != configs[0]:  # each generation's own median: a slow process shows here
            summary[c]["median_ratio_by_process"] = [
                _median_ratio(per_round[c][lo:hi], per_round[configs[0]][lo:hi])
                for lo, hi in zip(bounds, bounds[1:], strict=False)]  # fmt: skip
        entry = {**status[c], **summary[c], "config": c, "rounds": rounds,
                 "passes_per_round": passes, "warmup_passes": warmup, "processes": procs,
                 "cpu": cpu}  # fmt: skip
        if procs:
            worst = max(procs, key=lambda p: p.get("peak_reserved") or 0)
            for k in ("peak_reserved", "peak_live", "reserved_over_live", "torch", "allocs",
                      "cache_hits", "cache_limit", "passes", "null_alloc", "cache_max_block"):
                if k in worst:
                    entry[k] = worst[k]
        if entry["status"] == "ok" and "ns_per_event" not in entry:
            entry.update(status="error", error="no round ran")
        if entry["status"] == "error" and "ns_per_event" in entry:
            entry["status"] = "partial"  # some rounds ran, then it failed
        out[c] = entry
    return out


def _median_ratio(ns: list[float | None], base: list[float | None]) -> float | None:
    """The median of ns / base over the rounds both ran (None when there is none)."""
    ratios = [a / b for a, b in zip(ns, base, strict=True) if a and b]
    return median(ratios) if ratios else None
