# SPDX-License-Identifier: Apache-2.0
"""Run every benchmark, each configuration in a fresh process, and write the report.

    python3 benchmarks/run_all.py --out DIR [--quick] [--only SECTIONS] [--dry-run]

Writes DIR/results.json, DIR/results.md, DIR/results.png and DIR/raw/ (each child's JSON
and log); results.json and results.md after every child, so that a run cut short keeps what
it measured. A child that fails, hangs or crashes is recorded and the run goes on; children
not started within --budget-s are recorded as skipped. The allocators taking turns run first
(they decide the allocation targets), then every other measurement, then the later sections
(trace, capacity, wait, share, rmm; rmm recorded as skipped when rmm does not import). A
run with --only merges into the results.json already in DIR, replacing only the sections it
runs (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import checks  # noqa: E402
import report  # noqa: E402
from _common import (  # noqa: E402
    ALLOCATOR_ENV,
    ASYNC_ENV,
    error_record,
    parse_fractions,
    parse_sizes,
    write_json,
)

SIZES = "512,1MiB,64MiB"
DISTRIBUTIONS = ("torch", "cupy-cuda13x", "cupy-cuda12x", "cupy", "jax", "jaxlib",
                 "jax-cuda13-plugin", "jax-cuda13-pjrt", "rmm-cu13", "librmm-cu13",
                 "rapids-logger", "numpy", "cuda-bindings", "cuda-core", "cuda-pathfinder",
                 "matplotlib", "gpumem-bridge")  # the bridge's own distribution
#: Every section (--only picks some), in the plan's order but alloc_same_process (after pinned).
SECTIONS = ("alloc_turns", "alloc", "alloc_same_process", "mixed", "e2e_turns", "e2e", "pinned",
            "trace", "capacity", "wait", "share", "rmm")
TRACES = checks.TRACES  # the committed traces bench_trace.py replays (traces/NAME.json.gz)


@dataclass
class Params:
    iters: int
    warmup: int
    repeats: int
    turns_repeats: int  # rounds of bench_turns.py per generation (the verdict on allocation)
    e2e_steps: int
    e2e_repeats: int
    e2e_warmup: int
    e2e_turns: int  # rounds of native and bridge taking turns (the verdict)
    mixed_fraction: float
    budget_s: float
    # generations of fresh workers in bench_turns.py (--processes): a process keeps a speed
    # offset of its own for its life, and the rounds of several generations average it out
    turns_processes: int = 9
    # bench_trace.py run: warm workers in turns, pinned to one CPU; the verdict is the median
    # of the round-by-round ratios (at least checks.TRACE_MIN_ROUNDS of them)
    trace_rounds: int = 21
    trace_passes: int = 3  # replays of the trace per worker per round (the round's best counts)
    trace_processes: int = 3  # fresh workers per configuration, the rounds split among them
    capacity_budget: str = "24GiB"
    # CuPy's shares tried natively (its peak a image is near torch's)
    capacity_splits: str = "0.2,0.3,0.35,0.4,0.45,0.5,0.55,0.6,0.7"
    capacity_steps: int = 2  # steps in a row a batch must run
    wait_rounds: int = 3
    wait_steps: int = 300
    share_repeats: int = 21
    rmm_quick: bool = False  # bench_rmm.py --quick


FULL = Params(iters=5000, warmup=2000, repeats=15, turns_repeats=21, e2e_steps=100,
              e2e_repeats=5, e2e_warmup=20, e2e_turns=16, mixed_fraction=0.572, budget_s=450)
QUICK = Params(iters=4000, warmup=500, repeats=5, turns_repeats=9, e2e_steps=30, e2e_repeats=3,
               e2e_warmup=10, e2e_turns=4, mixed_fraction=0.15, budget_s=150,
               turns_processes=1, trace_rounds=9,
               trace_passes=1, capacity_budget="8GiB", capacity_splits="0.3,0.5,0.7",
               capacity_steps=1, wait_rounds=1, wait_steps=60, share_repeats=7, rmm_quick=True)


@dataclass
class Task:
    name: str
    section: str  # one of SECTIONS
    argv: list[str]
    timeout: float
    env: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # copied into the result (round, ...)
    pin: bool = False  # pass --cpu: the CPU found fastest just before the child starts
    result_flag: str = "--json"  # the child's result-file option
    skip: str | None = None  # why it is recorded as skipped instead of run


#: Sections whose child JSON (the benchmark's own schema) is kept whole under "data".
WRAPPED = ("pinned", "trace", "capacity", "wait", "share", "rmm")


def plan(p: Params, python: str, quick: bool, mixed_gib: float | None,
         rmm_skip: str | None = None) -> list[Task]:
    """The children in the order they run: the most important first.

    rmm_skip: why RMM cannot be used (the rmm section is then recorded as skipped
    and the trace replays leave the rmm configuration out); None when it imports."""
    bench = lambda name: os.path.join(HERE, name)  # noqa: E731
    common = ["--sizes", SIZES, "--iters", str(p.iters), "--warmup", str(p.warmup),
              "--repeats", str(p.repeats)]
    e2e = ["--steps", str(p.e2e_steps), "--warmup", str(p.e2e_warmup)]
    size = ["--gib", str(mixed_gib)] if mixed_gib else ["--fraction", str(p.mixed_fraction)]
    tasks = [Task(f"alloc-turns-{fw}", "alloc_turns",
                  [python, bench("bench_turns.py"), "--framework", fw,
                   "--configs", "native,async,rmm,bridge", "--sizes", SIZES,
                   "--iters", str(p.iters), "--warmup", str(p.warmup),
                   "--repeats", str(p.turns_repeats), "--processes", str(p.turns_processes)],
                  300, extra={"framework": fw}, pin=True)
             for fw in ("torch", "cupy")]
    tasks += [Task(f"alloc-{fw}-{c}-r1", "alloc",
                   [python, bench("bench_alloc.py"), "--framework", fw, "--config", c] + common,
                   150, env=ASYNC_ENV if (fw, c) == ("torch", "async") else {},
                   extra={"round": 1, "framework": fw, "config": c}, pin=True)
              for fw in ("torch", "cupy") for c in ("native", "bridge", "async", "rmm")]
    tasks += [Task(f"mixed-{m}", "mixed", [python, bench("bench_mixed.py"), "--mode", m] + size,
                   240, extra={"mode": m}) for m in ("native", "bridge")]
    tasks.append(Task("e2e-turns", "e2e_turns",
                      [python, bench("bench_e2e.py"), "--turns", "native,bridge",
                       "--repeats", str(p.e2e_turns)] + e2e, 240, pin=True))
    tasks += [Task(f"e2e-{m}-r1", "e2e",
                   [python, bench("bench_e2e.py"), "--mode", m, "--repeats", str(p.e2e_repeats)]
                   + e2e, 180, extra={"round": 1, "mode": m}, pin=True)
              for m in ("native", "bridge")]
    tasks.append(Task("pinned", "pinned",
                      [python, bench("bench_pinned.py")] + (["--quick"] if quick else []), 300,
                      result_flag="--out"))
    tasks.append(Task("alloc-cupy-all", "alloc_same_process",
                      [python, bench("bench_alloc.py"), "--framework", "cupy", "--config", "all"]
                      + common, 150, extra={"framework": "cupy", "config": "all"}, pin=True))
    # the later sections, one child each (one per trace); each timeout leaves the child
    # inside a 450 s part run (--only SECTION) on a machine with a 10-minute command limit
    def trace_configs(name: str) -> str:  # RMM replays torch only; carving: off by default
        no_rmm = rmm_skip or name in checks.MIXED_TRACES
        return ",".join(["native", "async"] + ([] if no_rmm else ["rmm"])
                        + ["bridge", "bridge-carve"])

    tasks += [Task(f"trace-{name}", "trace",
                   [python, bench("bench_trace.py"), "run",
                    os.path.join(HERE, "traces", f"{name}.json.gz"), "--configs",
                    trace_configs(name),
                    "--rounds", str(p.trace_rounds), "--passes", str(p.trace_passes),
                    "--processes", str(p.trace_processes)],
                   120 if quick else 300, extra={"trace": name}, result_flag="--out", pin=True)
              for name in TRACES]
    tasks.append(Task("capacity", "capacity",
                      [python, bench("bench_capacity.py"), "--budget", p.capacity_budget,
                       "--splits", p.capacity_splits, "--steps", str(p.capacity_steps),
                       "--timeout", "60" if quick else "120"],
                      150 if quick else 420, result_flag="--out"))
    tasks.append(Task("wait", "wait",
                      [python, bench("bench_wait.py"), "--rounds", str(p.wait_rounds),
                       "--steps", str(p.wait_steps)],
                      120 if quick else 300, result_flag="--out"))
    tasks.append(Task("share-torch", "share",
                      [python, bench("bench_share.py"), "--framework", "torch",
                       "--sizes", SIZES, "--iters", str(p.iters), "--warmup", str(p.warmup),
                       "--repeats", str(p.share_repeats)],
                      90 if quick else 180, extra={"framework": "torch"}, pin=True))
    tasks.append(Task("rmm", "rmm",
                      [python, bench("bench_rmm.py"), "--sizes", SIZES]
                      + (["--quick"] if p.rmm_quick else []),
                      90 if quick else 180, pin=True, result_flag="--out",
                      skip=f"rmm is not importable: {rmm_skip}" if rmm_skip else None))
    return tasks


def rmm_missing(python: str) -> str | None:
    """Why the children's interpreter cannot import rmm, or None when it can."""
    try:
        p = subprocess.run([python, "-c", "import rmm, rmm.mr"], capture_output=True, text=True,
                           timeout=120, env=child_env({})[0])
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{type(exc).__name__}: {exc}"[:300]
    if p.returncode == 0:
        return None
    lines = (p.stderr or p.stdout).strip().splitlines()
    return (lines[-1] if lines else f"exit status {p.returncode}")[:300]


def child_env(extra: dict) -> tuple[dict, list[str]]:
    """This environment without the allocator settings, plus extra; and what was removed."""
    env = dict(os.environ)
    removed = [k for k in ALLOCATOR_ENV if k in env]
    for k in removed:
        del env[k]
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env, removed


def fastest_cpu(loops: int = 8) -> int | None:
    """The CPU of this machine's that runs a small Python loop fastest right now, or None.

    On a shared VM some CPUs lose speed to other tenants (measured: 4 to 9 of 16
    at half speed, a set that changes over minutes); a child pinned to the
    fastest one just before it starts is least disturbed. The calling thread's
    affinity is restored before returning (children inherit it).
    """
    if not hasattr(os, "sched_getaffinity"):
        return None
    mine = os.sched_getaffinity(0)
    best: tuple[float, int] | None = None
    try:
        for cpu in sorted(mine):
            os.sched_setaffinity(0, {cpu})
            t = min(_spin() for _ in range(loops))
            if best is None or t < best[0]:
                best = (t, cpu)
    finally:
        os.sched_setaffinity(0, mine)
    return best[1] if best else None


def _spin() -> float:
    t0 = time.perf_counter()
    sum(range(100_000))
    return time.perf_counter() - t0


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def run_task(task: Task, raw_dir: str, timeout: float) -> dict:
    """Run one child; its JSON result, or an error record saying what happened."""
    json_path = os.path.join(raw_dir, task.name + ".json")
    log_path = os.path.join(raw_dir, task.name + ".log")
    argv = list(task.argv) + [task.result_flag, json_path]
    if task.pin:
        cpu = fastest_cpu()
        if cpu is not None:
            argv += ["--cpu", str(cpu)]
    env, _ = child_env(task.env)
    t0 = time.perf_counter()
    base = {"task": task.name, **task.extra, "argv": argv[1:], "env_set": task.env}
    if os.path.isfile(json_path):
        os.remove(json_path)
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  timeout=timeout, cwd=os.path.dirname(HERE))
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        late = {"timed_out_after_s": round(timeout), "log_tail": _tail(log_path),
                "elapsed_s": round(time.perf_counter() - t0, 1)}
        try:  # a child that hung only at exit has written its figures
            with open(json_path) as f:
                return {**_as_result(task, json.load(f), raw_dir), **base, **late}
        except (OSError, ValueError):
            return {**base, "status": "error", "error": f"timed out after {timeout:.0f} s",
                    **late}
    except OSError as exc:
        return {**base, "status": "error", **error_record(exc)}
    elapsed = round(time.perf_counter() - t0, 1)
    try:
        with open(json_path) as f:
            result = json.load(f)
    except (OSError, ValueError) as exc:
        return {**base, "status": "error", "rc": rc, "elapsed_s": elapsed,
                "error": f"no result from the child (rc={rc}, {type(exc).__name__}); "
                         f"log: ...{_tail(log_path, 600)}", "log_tail": _tail(log_path)}
    result = _as_result(task, result, raw_dir)
    result.update(base, rc=rc, elapsed_s=elapsed)
    if rc != 0 and result.get("status") == "ok":
        result["status"] = "error"
        result["error"] = f"child exited {rc} after writing its result"
    return result


def _as_result(task: Task, obj: dict, raw_dir: str) -> dict:
    """A child's JSON as a result: the schemas of bench_pinned.py and the later sections'
    benchmarks (WRAPPED) are kept whole under "data"."""
    if task.section not in WRAPPED:
        return obj
    status = obj.get("status", "ok") if isinstance(obj, dict) else "error"
    return {"status": status, "data": obj,
            "files": [os.path.join(os.path.basename(raw_dir), task.name + ".json")],
            **{k: obj[k] for k in ("error", "reason") if isinstance(obj, dict) and obj.get(k)}}


# ---- what is on the machine (a child: it imports the frameworks) ----

def probe(path: str) -> int:
    from importlib import metadata

    info: dict = {"versions": {}}
    for dist in DISTRIBUTIONS:
        try:
            info["versions"][dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        if smi.returncode == 0 and smi.stdout.strip():
            line = smi.stdout.strip().splitlines()[0]
            info["nvidia_smi"] = line
            info["driver_version"] = line.split(",")[1].strip()
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        info["nvidia_smi"] = f"unavailable: {exc}"
    try:
        import bridge

        info["bridge_version"] = bridge.__version__
    except Exception as exc:  # noqa: BLE001 - every probe is optional
        info["bridge_version"] = f"not importable: {exc}"
    try:
        import torch

        info["versions"]["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        info["gpu_name"] = torch.cuda.get_device_name(0)
        info["gpu_total_bytes"] = torch.cuda.get_device_properties(0).total_memory
    except Exception as exc:  # noqa: BLE001
        info["torch_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import cupy

        info["versions"]["cupy"] = cupy.__version__
        v = cupy.cuda.runtime.driverGetVersion()
        info["cuda_driver_api"] = f"{v // 1000}.{v % 1000 // 10}"
    except Exception as exc:  # noqa: BLE001
        info["cupy_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import rmm

        info["rmm"] = f"rmm {rmm.__version__} importable"
    except Exception as exc:  # noqa: BLE001
        info["rmm"] = f"not available ({type(exc).__name__}: {exc}): RMM configs are skipped"
    write_json(path, info)
    return 0


def _git() -> str | None:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, cwd=os.path.dirname(HERE))
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                               timeout=10, cwd=os.path.dirname(HERE))
    except (OSError, subprocess.SubprocessError):
        return None
    if rev.returncode != 0:
        return None
    return rev.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def store(results: dict, task: Task, result: dict) -> None:
    """File one child's result under its section of results."""
    if task.section == "alloc":
        results["alloc"]["runs"].append(result)
    elif task.section == "alloc_turns":
        results.setdefault("alloc_turns", {})[task.extra["framework"]] = result
    elif task.section in ("mixed", "e2e"):
        results[task.section]["runs"].append(result)
    elif task.section == "trace":
        results.setdefault("trace", {})[task.extra["trace"]] = result
    else:  # alloc_same_process, e2e_turns, pinned, capacity, wait, share, rmm: one result each
        results[task.section] = result
    if result.get("status") not in ("ok", "partial", "skipped"):
        results["problems"].append(f"{task.name}: {result.get('error', result.get('status'))}"
                                   [:300])


def fresh_results(meta: dict) -> dict:
    """The skeleton of results.json: every section a run fills, empty."""
    return {
        "meta": meta,
        "alloc": {"sizes": parse_sizes(SIZES), "runs": []},
        "mixed": {"runs": []}, "e2e": {"runs": []},
        "problems": [],
    }


def merge_earlier(results: dict, earlier: dict, running: set[str], task_names: set[str]) -> dict:
    """results (this part run) with the sections of an earlier results.json that this run
    does not run kept as they were; its problems kept but those of the tasks run again;
    meta["parts"] lists every part run (earlier ones first)."""
    for section in SECTIONS:
        if section not in running and section in earlier:
            results[section] = earlier[section]
    results["problems"] = [p for p in earlier.get("problems", [])
                           if str(p).split(":", 1)[0] not in task_names
                           and not str(p).startswith("matplotlib missing")] + results["problems"]
    old = earlier.get("meta", {})
    parts = old.get("parts") or ([{k: old.get(k) for k in ("date", "command", "quick", "only",
                                                             "wall_s")}] if old else [])
    results["meta"]["parts"] = parts + results["meta"]["parts"]
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="directory for results.json, results.md, results.png, raw/")
    ap.add_argument("--quick", action="store_true", help="fewer iterations and rounds; smaller N")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting children after this many seconds (450; --quick 150)")
    ap.add_argument("--only", default=None,
                    help="comma list of sections: " + ",".join(SECTIONS) + "; the results are "
                         "merged into the results.json already in --out (the other sections "
                         "kept)")
    ap.add_argument("--mixed-gib", type=float, default=None,
                    help="N for the mixed phases in GiB (default: 57%% of the device, 15%% quick)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the children")
    ap.add_argument("--tables", metavar="DEST", default=None,
                    help="at the end, write one table per benchmark with figures in this run "
                         "into DEST (results_tables.py; e.g. benchmarks/results)")
    ap.add_argument("--trace-rounds", type=int, default=None,
                    help="rounds of each trace replay in turns (21; --quick 9; fewer than "
                         f"{checks.TRACE_MIN_ROUNDS} give no time verdict)")
    ap.add_argument("--capacity-splits", default=None,
                    help="CuPy's shares of the budget tried natively by the capacity search "
                         "(comma list of fractions; default 0.2,0.3,...,0.7)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("--probe", metavar="JSON", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe:
        return probe(args.probe)
    if not args.out:
        ap.error("--out DIR is required")
    p = QUICK if args.quick else FULL
    if args.trace_rounds is not None:
        if args.trace_rounds < checks.TRACE_MIN_ROUNDS:
            ap.error(f"--trace-rounds: at least {checks.TRACE_MIN_ROUNDS} rounds give the "
                     f"trace's time verdict (got {args.trace_rounds})")
        p = replace(p, trace_rounds=args.trace_rounds)
    if args.capacity_splits is not None:
        try:
            splits = parse_fractions(args.capacity_splits)
        except ValueError as exc:
            ap.error(f"--capacity-splits: {exc}")
        p = replace(p, capacity_splits=",".join(f"{x:g}" for x in splits))
    budget = args.budget_s if args.budget_s is not None else p.budget_s
    out = os.path.abspath(args.out)
    raw = os.path.join(out, "raw")
    running = set(SECTIONS)
    if args.only:
        running = {s.strip() for s in args.only.split(",") if s.strip()}
        bad = running - set(SECTIONS)
        if bad or not running:
            ap.error(f"--only: unknown section(s) {sorted(bad)}; choose from {','.join(SECTIONS)}")
    rmm_skip = rmm_missing(args.python) if running & {"trace", "rmm"} else None
    tasks = [t for t in plan(p, args.python, args.quick, args.mixed_gib, rmm_skip)
             if t.section in running]
    if args.dry_run:
        for t in tasks:
            if t.skip:
                print(f"{t.name:24} skipped: {t.skip}")
                continue
            env = " ".join(f"{k}={v}" for k, v in t.env.items())
            print(f"{t.name:24} {env + ' ' if env else ''}{' '.join(t.argv[1:])} "
                  f"{t.result_flag} {os.path.join(raw, t.name + '.json')}"
                  f"{' --cpu FASTEST' if t.pin else ''}  (timeout {t.timeout:.0f} s)")
        return 0
    os.makedirs(raw, exist_ok=True)
    t_start = time.perf_counter()
    _, removed = child_env({})
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    command = " ".join([os.path.basename(sys.executable)] + (sys.argv if argv is None
                                                             else [__file__] + list(argv)))
    results = fresh_results({
        "date": now, "command": command, "quick": args.quick, "budget_s": budget,
        "only": sorted(running, key=SECTIONS.index) if args.only else None,
        "python": platform.python_version(), "platform": platform.platform(), "git": _git(),
        "env_removed": removed, "params": p.__dict__,
        "parts": [{"date": now, "command": command, "quick": args.quick,
                   "only": args.only or None}],
    })
    if args.only:
        try:
            with open(os.path.join(out, "results.json")) as f:
                earlier = json.load(f)
        except FileNotFoundError:
            earlier = None
        except (OSError, ValueError) as exc:  # kept aside, never overwritten unread
            earlier = None
            os.replace(os.path.join(out, "results.json"),
                       os.path.join(out, f"results.unreadable-{int(time.time())}.json"))
            results["problems"].append(f"earlier results.json unreadable, set aside: {exc}"[:300])
        if earlier:
            merge_earlier(results, earlier, running, {t.name for t in tasks})
    probe_path = os.path.join(raw, "probe.json")
    try:
        subprocess.run([args.python, os.path.abspath(__file__), "--probe", probe_path],
                       env=child_env({})[0], timeout=120, capture_output=True)
        with open(probe_path) as f:
            results["meta"].update(json.load(f))
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        results["meta"]["probe_error"] = f"{type(exc).__name__}: {exc}"
    report.write_all(results, out, png=False)
    for i, task in enumerate(tasks):
        left = budget - (time.perf_counter() - t_start)
        if task.skip:
            store(results, task, {"task": task.name, **task.extra, "status": "skipped",
                                  "reason": task.skip})
            print(f"          {task.name}: skipped: {task.skip}", flush=True)
            continue
        if left < 20:
            result = {"task": task.name, **task.extra, "status": "skipped",
                      "reason": f"time budget of {budget:.0f} s spent"}
            store(results, task, result)
            results["problems"].append(f"{task.name}: not run, time budget spent")
            continue
        print(f"[{time.perf_counter() - t_start:6.1f}s] {i + 1}/{len(tasks)} {task.name}",
              flush=True)
        result = run_task(task, raw, min(task.timeout, left))
        why = "" if result.get("status") == "ok" else \
            ": " + str(result.get("error") or result.get("reason"))[:160]
        print(f"          -> {result.get('status')}{why}", flush=True)
        store(results, task, result)
        results["meta"]["wall_s"] = round(time.perf_counter() - t_start, 1)
        report.write_all(results, out, png=False)
    results["meta"]["wall_s"] = round(time.perf_counter() - t_start, 1)
    results["meta"]["parts"][-1]["wall_s"] = results["meta"]["wall_s"]
    report.write_all(results, out, png=True)
    if args.tables:
        import results_tables

        for name, what in results_tables.write_tables(
                results, args.tables, os.path.relpath(out, os.path.abspath(args.tables))).items():
            print(f"          table {name}: {what}", flush=True)
    v = results["verdict"]
    print(f"done in {results['meta']['wall_s']:.0f} s: {v['pass']} pass, {v['fail']} fail, "
          f"{v['missing']} missing -> {os.path.join(out, 'results.md')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
