# SPDX-License-Identifier: Apache-2.0
"""Run every benchmark, each configuration in a fresh process, and write the report.

    python3 benchmarks/run_all.py --out DIR [--quick]

Writes DIR/results.json (everything, with versions and the GPU), DIR/results.md
(tables and the verdict on each target), DIR/results.png (ratios against their
targets), and DIR/raw/ (each child's JSON and log). results.json and
results.md are rewritten after every child, so a run cut short still leaves
what it measured. A child that fails, hangs or crashes is recorded and the run
goes on; work left when the time budget (--budget-s; default 450 s, 150 s with
--quick) runs out is recorded as skipped. The order puts the allocators
taking turns first (bench_turns.py: the verdict on allocation), then one round
of every measurement; the second rounds (and the same-process CuPy
cross-check) come after.
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
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import report  # noqa: E402
from _common import ALLOCATOR_ENV, ASYNC_ENV, error_record, parse_sizes, write_json  # noqa: E402

SIZES = "512,1MiB,64MiB"
DISTRIBUTIONS = ("torch", "cupy-cuda13x", "cupy-cuda12x", "cupy", "jax", "jaxlib",
                 "jax-cuda13-plugin", "jax-cuda13-pjrt", "rmm-cu13", "librmm-cu13",
                 "rapids-logger", "numpy", "cuda-bindings", "cuda-core", "cuda-pathfinder",
                 "matplotlib", "bridge")


@dataclass
class Params:
    iters: int
    warmup: int
    repeats: int
    alloc_rounds: int
    turns_repeats: int  # rounds of bench_turns.py (the verdict on allocation)
    e2e_steps: int
    e2e_repeats: int
    e2e_warmup: int
    e2e_rounds: int  # separate processes, one after the other (context)
    e2e_turns: int  # rounds of native and bridge taking turns (the verdict)
    mixed_fraction: float
    budget_s: float


FULL = Params(iters=5000, warmup=2000, repeats=15, alloc_rounds=1, turns_repeats=61,
              e2e_steps=100, e2e_repeats=5, e2e_warmup=20, e2e_rounds=1, e2e_turns=16,
              mixed_fraction=0.572, budget_s=450)
QUICK = Params(iters=4000, warmup=500, repeats=5, alloc_rounds=1, turns_repeats=9, e2e_steps=30,
               e2e_repeats=3, e2e_warmup=10, e2e_rounds=1, e2e_turns=4, mixed_fraction=0.15,
               budget_s=150)


@dataclass
class Task:
    name: str
    section: str  # alloc, alloc_same_process, mixed, e2e, pinned
    argv: list[str]
    timeout: float
    env: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # copied into the result (round, ...)
    pin: bool = False  # pass --cpu: the CPU found fastest just before the child starts


def plan(p: Params, python: str, quick: bool, mixed_gib: float | None) -> list[Task]:
    """The children in the order they run: the most important first."""
    alloc_py = os.path.join(HERE, "bench_alloc.py")
    common = ["--sizes", SIZES, "--iters", str(p.iters), "--warmup", str(p.warmup),
              "--repeats", str(p.repeats)]
    order = [("torch", "native"), ("torch", "bridge"), ("torch", "async"), ("torch", "rmm"),
             ("cupy", "native"), ("cupy", "bridge"), ("cupy", "async"), ("cupy", "rmm")]

    def alloc_round(r: int, configs: list) -> list[Task]:
        return [Task(f"alloc-{fw}-{c}-r{r}", "alloc",
                     [python, alloc_py, "--framework", fw, "--config", c] + common, 150,
                     env=ASYNC_ENV if (fw, c) == ("torch", "async") else {},
                     extra={"round": r, "framework": fw, "config": c}, pin=True)
                for fw, c in configs]

    def e2e_round(r: int, modes: tuple) -> list[Task]:
        return [Task(f"e2e-{m}-r{r}", "e2e",
                     [python, os.path.join(HERE, "bench_e2e.py"), "--mode", m,
                      "--steps", str(p.e2e_steps), "--repeats", str(p.e2e_repeats),
                      "--warmup", str(p.e2e_warmup)], 180, extra={"round": r, "mode": m},
                     pin=True)
                for m in modes]

    size = ["--gib", str(mixed_gib)] if mixed_gib else ["--fraction", str(p.mixed_fraction)]
    tasks = [Task(f"alloc-turns-{fw}", "alloc_turns",
                  [python, os.path.join(HERE, "bench_turns.py"), "--framework", fw,
                   "--configs", "native,async,rmm,bridge", "--sizes", SIZES,
                   "--iters", str(p.iters), "--warmup", str(p.warmup),
                   "--repeats", str(p.turns_repeats)], 240, extra={"framework": fw}, pin=True)
             for fw in ("torch", "cupy")]
    tasks += alloc_round(1, order)
    tasks += [Task(f"mixed-{m}", "mixed",
                   [python, os.path.join(HERE, "bench_mixed.py"), "--mode", m] + size, 240,
                   extra={"mode": m}) for m in ("native", "bridge")]
    tasks.append(Task("e2e-turns", "e2e_turns",
                      [python, os.path.join(HERE, "bench_e2e.py"), "--turns", "native,bridge",
                       "--steps", str(p.e2e_steps), "--repeats", str(p.e2e_turns),
                       "--warmup", str(p.e2e_warmup)], 240, pin=True))
    tasks += e2e_round(1, ("native", "bridge"))
    pinned = os.path.join(HERE, "bench_pinned.py")
    if os.path.exists(pinned):
        # its --out is where it writes its JSON (run_task adds it); --quick or, failing
        # that, fewer --repeats when it takes them
        argv = [python, pinned]
        if quick:
            flags = _flags(python, pinned)
            argv += ["--quick"] if "--quick" in flags else \
                ["--repeats", "3"] if "--repeats" in flags else []
        tasks.append(Task("pinned", "pinned", argv, 300))
    tasks.append(Task("alloc-cupy-all", "alloc_same_process",
                      [python, alloc_py, "--framework", "cupy", "--config", "all"] + common, 150,
                      extra={"framework": "cupy", "config": "all"}, pin=True))
    for r in range(2, p.alloc_rounds + 1):
        tasks += alloc_round(r, order[::-1] if r % 2 == 0 else order)
    for r in range(2, p.e2e_rounds + 1):
        tasks += e2e_round(r, ("bridge", "native") if r % 2 == 0 else ("native", "bridge"))
    return tasks


def _flags(python: str, script: str) -> set[str]:
    """The --options that script's --help lists (empty if it cannot say)."""
    try:
        h = subprocess.run([python, script, "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return set()
    return {w.strip("[],") for w in h.stdout.split() if w.startswith(("--", "[--"))}


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
    # bench_pinned.py (written separately) names its result file --out; the others --json
    argv = list(task.argv) + ["--out" if task.section == "pinned" else "--json", json_path]
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
    if task.section == "pinned" and os.path.isdir(json_path):  # an --out that was a folder
        return {**base, **collect_pinned(json_path, rc), "elapsed_s": elapsed,
                "log_tail": _tail(log_path, 1500)}
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
    """A child's JSON as a result: bench_pinned.py's own schema is kept whole under "data"."""
    if task.section != "pinned":
        return obj
    return {"status": obj.get("status", "ok"), "data": obj,
            "files": [os.path.join(os.path.basename(raw_dir), task.name + ".json")],
            **({"error": obj["error"]} if obj.get("error") else {})}


def collect_pinned(pinned_dir: str, rc: int) -> dict:
    """The JSON files a bench_pinned.py that took --out as a folder left there."""
    files = []
    for root, _, names in os.walk(pinned_dir):
        files += [os.path.join(root, n) for n in sorted(names) if n.endswith(".json")]
    files.sort(key=lambda f: (os.path.basename(f) != "results.json", f))
    out: dict = {"rc": rc, "files": [os.path.relpath(f, os.path.dirname(pinned_dir))
                                     for f in files]}
    if not files:
        return {**out, "status": "error",
                "error": f"bench_pinned.py (rc={rc}) left no JSON file in {pinned_dir}"}
    try:
        with open(files[0]) as f:
            out["data"] = json.load(f)
    except (OSError, ValueError) as exc:
        return {**out, "status": "error", "error": f"{files[0]}: {exc}"}
    out["status"] = "ok" if rc == 0 else "error"
    if rc != 0:
        out["error"] = f"bench_pinned.py exited {rc}"
    return out


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
    else:  # alloc_same_process, e2e_turns, pinned: one result each
        results[task.section] = result
    if result.get("status") not in ("ok", "partial", "skipped"):
        results["problems"].append(f"{task.name}: {result.get('error', result.get('status'))}"
                                   [:300])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="directory for results.json, results.md, results.png, raw/")
    ap.add_argument("--quick", action="store_true", help="fewer iterations and rounds; smaller N")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting children after this many seconds (450; --quick 150)")
    ap.add_argument("--only", default=None,
                    help="comma list of sections: alloc_turns,alloc,alloc_same_process,mixed,"
                         "e2e_turns,e2e,pinned")
    ap.add_argument("--mixed-gib", type=float, default=None,
                    help="N for the mixed phases in GiB (default: 57%% of the device, 15%% quick)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the children")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("--probe", metavar="JSON", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe:
        return probe(args.probe)
    if not args.out:
        ap.error("--out DIR is required")
    p = QUICK if args.quick else FULL
    budget = args.budget_s if args.budget_s is not None else p.budget_s
    out = os.path.abspath(args.out)
    raw = os.path.join(out, "raw")
    tasks = plan(p, args.python, args.quick, args.mixed_gib)
    sections = ("alloc_turns", "alloc", "alloc_same_process", "mixed", "e2e_turns", "e2e",
                "pinned")
    if args.only:
        wanted = {s.strip() for s in args.only.split(",") if s.strip()}
        bad = wanted - set(sections)
        if bad:
            ap.error(f"--only: unknown section(s) {sorted(bad)}; choose from {sections}")
        tasks = [t for t in tasks if t.section in wanted]
    if args.dry_run:
        for t in tasks:
            env = " ".join(f"{k}={v}" for k, v in t.env.items())
            flag = "--out" if t.section == "pinned" else "--json"
            print(f"{t.name:24} {env + ' ' if env else ''}{' '.join(t.argv[1:])} "
                  f"{flag} {os.path.join(raw, t.name + '.json')}")
        return 0
    os.makedirs(raw, exist_ok=True)
    t_start = time.perf_counter()
    _, removed = child_env({})
    results: dict = {
        "meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                 "quick": args.quick, "budget_s": budget, "python": platform.python_version(),
                 "platform": platform.platform(), "git": _git(), "env_removed": removed,
                 "params": p.__dict__},
        "alloc": {"sizes": parse_sizes(SIZES), "runs": []},
        "mixed": {"runs": []}, "e2e": {"runs": []},
        "pinned": {"status": "skipped", "reason": "benchmarks/bench_pinned.py does not exist"},
        "problems": [],
    }
    if args.only and "pinned" not in wanted:
        results["pinned"] = {"status": "skipped", "reason": "not in --only"}
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
    report.write_all(results, out, png=True)
    v = results["verdict"]
    print(f"done in {results['meta']['wall_s']:.0f} s: {v['pass']} pass, {v['fail']} fail, "
          f"{v['missing']} missing -> {os.path.join(out, 'results.md')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
