# SPDX-License-Identifier: Apache-2.0
"""Helpers shared by the benchmark scripts: result files, error capture, sizes.

Every ``bench_*.py`` script runs one configuration in its own process and
writes one JSON object to the path given by ``--json``; it never raises out of
``main``: a failure becomes ``{"status": "error", "error": ..., "traceback": ...}``
so that ``run_all.py`` records it and goes on. Nothing here imports a GPU
framework.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from statistics import median
from typing import Any

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30

#: What torch's cudaMallocAsync configuration needs in its process's environment.
ASYNC_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
# "bridge-nocache": the bridge with its cache of freed blocks off, as under jax=True
NOCACHE_ENV = {"BRIDGE_CACHE_LIMIT": "0"}
# "bridge-allhits": the cache as large as the environment makes it (both tiers'
# caps = the whole device whatever the live bytes); bench_trace.py also lifts its
# largest cached block (256 MiB by default) once the bridge is set up
ALLHITS_ENV = {"BRIDGE_CACHE_LIMIT": "100%", "BRIDGE_CACHE_FLOOR": "100%",
               "BRIDGE_CACHE_FRACTION": "1", "BRIDGE_CACHE_LARGE_CAP": "100%",
               "BRIDGE_CACHE_LARGE_FRACTION": "0"}  # fmt: skip
#: One order of caching for every size (the small tier reaches the whole device):
#: the cache as it was before the two tiers, for comparison.
ONETIER_ENV = {"BRIDGE_CACHE_SMALL_MAX": "100%"}
#: "bridge-fixedlarge": the large tier under its fixed 64 MiB cap alone, whatever is live
#: (the cache before 2026-12-02), for comparison.
FIXEDLARGE_ENV = {"BRIDGE_CACHE_LARGE_FRACTION": "0"}
#: "bridge-carve": blocks carved from pool chunks (carve.c; off by default)
CARVE_ENV = {"BRIDGE_CACHE_CARVE": "1"}
#: "bridge-segments": segments of the pool under one release rule (carve.c; the default,
#: named here so that a shell's BRIDGE_CACHE_SEGMENTS=0 cannot turn it off)
SEGMENTS_ENV = {"BRIDGE_CACHE_SEGMENTS": "1"}
#: "bridge-tiers": the exact-size tiers alone (cache.c), the default before segments, for
#: comparison
TIERS_ENV = {"BRIDGE_CACHE_SEGMENTS": "0"}
#: "bridge-unowned": CuPy's blocks in CuPy's UnownedMemory, not BridgeMemory
#: (adapters/cupy_memory.py)
UNOWNED_ENV = {"BRIDGE_CUPY_UNOWNED": "1"}
#: "bridge-pluggable": torch through its CUDAPluggableAllocator over the core (the fallback
#: where the C++ allocator cannot be built), the same core and cache behind it.
PLUGGABLE_ENV = {"BRIDGE_TORCH_PLUGGABLE": "1"}
#: the cache without its thread slots (cache.c), the shared lists alone, for comparison.
NOSLOT_ENV = {"BRIDGE_CACHE_THREAD_SLOT": "0"}
#: "bridge-ipc": unify(ipc=True) through its variable: every block from the exportable pool
#: (POSIX file descriptors, what CUDA tensors sent to other processes need), the tiers as
#: the cache (a block carved from a segment cannot be exported), for the allocation pair
#: against the default pool's.
IPC_ENV = {"BRIDGE_IPC": "1"}


def config_env(framework: str, config: str) -> dict[str, str]:
    """The environment a configuration's process needs beside the caller's."""
    if framework == "torch" and config == "async":
        return dict(ASYNC_ENV)
    if config == "bridge-nocache":
        return dict(NOCACHE_ENV)
    if config == "bridge-allhits":
        return dict(ALLHITS_ENV)
    if config == "bridge-onetier":
        return dict(ONETIER_ENV)
    if config == "bridge-fixedlarge":
        return dict(FIXEDLARGE_ENV)
    if config == "bridge-pluggable":
        return dict(PLUGGABLE_ENV)
    if config == "bridge-carve":
        return dict(CARVE_ENV)
    if config == "bridge-segments":
        return dict(SEGMENTS_ENV)
    if config == "bridge-tiers":
        return dict(TIERS_ENV)
    if config == "bridge-unowned":
        return dict(UNOWNED_ENV)
    if config == "bridge-noslot":
        return dict(NOSLOT_ENV)
    if config == "bridge-ipc":
        return dict(IPC_ENV)
    return {}


#: Environment variables that change an allocator's behaviour. run_all.py
#: removes them from every child's environment (and sets the one a
#: configuration needs), so that the shell the benchmarks start from does not
#: change what is measured.
ALLOCATOR_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUPY_GPU_MEMORY_LIMIT",
                 "BRIDGE_GPU_MEMORY_LIMIT", "BRIDGE_PINNED_MEMORY_LIMIT")


def error_record(exc: BaseException) -> dict:
    """What a failure looks like in a result: type, message and traceback tail."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {"error": f"{type(exc).__name__}: {str(exc)[:2000]}", "traceback": tb[-4000:]}


def write_json(path: str | None, obj: Any) -> None:
    """Write obj as JSON to path (atomically), or to stdout when path is None."""
    text = json.dumps(obj, indent=1, sort_keys=True, default=str)
    if path is None:
        sys.stdout.write(text + "\n")
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


def run_guarded(path: str | None, base: dict, body: Callable[[dict], None]) -> int:
    """Run body(result) and write result to path whatever happens; returns the exit code.

    body fills the dict it is given; an exception becomes an "error" status
    with what had been measured so far kept.
    """
    result = dict(base)
    result.setdefault("status", "ok")
    result["pid"] = os.getpid()
    t0 = time.perf_counter()
    rc = 0
    try:
        body(result)
    except BaseException as exc:  # noqa: BLE001 - recorded, never lost
        result["status"] = "error"
        result.update(error_record(exc))
        rc = 1 if not isinstance(exc, KeyboardInterrupt) else 130
    result["wall_s"] = round(time.perf_counter() - t0, 3)
    write_json(path, result)
    return rc


def add_pair_args(p: Any, *, iters: int, repeats: int, repeats_help: str) -> None:
    """The options of the benchmarks that time alloc+free pairs, one size at a time."""
    p.add_argument("--sizes", default="512,1MiB,64MiB", type=parse_sizes)
    p.add_argument("--iters", type=int, default=iters, help="pairs per timed loop")
    p.add_argument("--warmup", type=int, default=2000, help="untimed pairs per size first")
    p.add_argument("--repeats", type=int, default=repeats, help=repeats_help)
    p.add_argument("--cpu", type=int, default=None,
                   help="the CPU the timed thread runs on (pinned after the setup)")  # fmt: skip
    p.add_argument("--json", default=None, help="result file (stdout when absent)")


def check_pair_args(p: Any, args: Any) -> None:
    """Refuse pair-loop options that would time nothing (argparse's error: exit 2)."""
    if min(args.iters, args.repeats) < 1 or args.warmup < 0:
        p.error("--iters and --repeats must be >= 1, --warmup >= 0")


def pin_cpu(cpu: int | None, result: dict) -> None:
    """Pin the calling thread (the timed one) to one CPU; threads started earlier keep theirs.

    Timing on a VM moves between CPUs (up to 2x); pinning the timed thread of
    every configuration to the same CPU keeps processes comparable. Recorded in
    result["cpu"].
    """
    if cpu is None:
        return
    if not hasattr(os, "sched_setaffinity"):
        result["cpu"] = f"not pinned: no sched_setaffinity on {sys.platform}"
        return
    os.sched_setaffinity(0, {cpu})  # pid 0: the calling thread only
    result["cpu"] = cpu


# ---- configurations taking turns: one worker process each, driven over pipes ----


class Skip(Exception):
    """The configuration cannot run here (such as RMM not installed): not a failure."""


def serve(setup: Callable[[dict], dict[str, Callable[..., Any]]]) -> int:
    """The worker side: set up, answer "ready", then one answer line per command line.

    setup(info) prepares the configuration (filling info) and returns the
    commands: name -> function of int arguments. A command line is
    "name arg ..."; the answer "ok <json>" or "error <json>". stdout carries
    the answers only (the frameworks' own output goes to stderr). A worker
    waits blocked on its stdin, so it takes no CPU from the one timing.
    """
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def say(kind: str, obj: object) -> None:
        proto.write(f"{kind} {json.dumps(obj)}\n")

    info: dict = {}
    try:
        commands = setup(info)
    except Skip as exc:
        say("skip", str(exc))
        return 0
    except Exception as exc:  # noqa: BLE001 - reported to the coordinator
        say("error", f"{type(exc).__name__}: {exc}"[:1000])
        return 1
    say("ready", info)
    for line in sys.stdin:
        name, *rest = line.split() or ["quit"]
        if name == "quit":
            break
        try:
            if name not in commands:
                raise KeyError(f"unknown command {name!r}")
            say("ok", commands[name](*map(int, rest)))
        except Exception as exc:  # noqa: BLE001
            say("error", f"{type(exc).__name__}: {exc}"[:1000])
    return 0


class Worker:
    """The coordinator's handle on one worker process (see serve)."""

    def __init__(self, name: str, argv: list[str], env: dict) -> None:
        self.name = name
        self.log = tempfile.TemporaryFile(mode="w+")  # a file: a full pipe would block it
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=env, text=True, bufsize=1)

    def ask(self, command: str | None) -> tuple[str, Any]:
        """Send command (None: only read) and return (kind, value) of the answer line."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            if command is not None:
                self.proc.stdin.write(command + "\n")
                self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except OSError as exc:
            line, why = "", str(exc)
        else:
            why = ""
        if not line:
            self.proc.wait(timeout=60)
            self.log.seek(0)
            return "error", (f"worker exited (rc={self.proc.returncode}) {why}: "
                             f"{self.log.read()[-800:]}")
        kind, _, payload = line.rstrip("\n").partition(" ")
        return kind, json.loads(payload) if payload else None

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def start_workers(specs: dict[str, tuple[list[str], dict]], status: dict) -> dict[str, Worker]:
    """Start every worker together (their start-up is not timed); wait for each to be ready.

    status[name] gets {"status": "ok", "info": ...}, or "skipped" with the
    reason, or "error" with the error; returns the workers that are ready.
    """
    workers = {name: Worker(name, argv, env) for name, (argv, env) in specs.items()}
    for name in list(workers):
        kind, value = workers[name].ask(None)
        if kind == "ready":
            status[name] = {"status": "ok", "info": value}
            continue
        status[name] = ({"status": "skipped", "reason": value} if kind == "skip"
                        else {"status": "error", "error": value})
        workers.pop(name).close()
    return workers


def take_turns(workers: dict, configs: dict, sizes: list[int], warmup: int, iters: int,
               repeats: int, floor_iters: int | None = None) -> tuple[dict, dict]:
    """Warm every worker, then time each size on each in turn, the order rotating
    every round; a worker that fails leaves the turns (its status says why).
    Returns (samples {config: {size: [ns]}}, floors {config: [ns]}); the floor
    (a loop with no allocation) is timed each round when floor_iters is given.
    The workers are closed at the end."""
    live = list(workers)
    samples: dict = {c: {str(n): [] for n in sizes} for c in live}
    floors: dict = {c: [] for c in live}

    def ask(c: str, command: str) -> float | None:
        if c not in live:
            return None
        kind, value = workers[c].ask(command)
        if kind == "ok":
            return float(value or 0.0)
        configs[c].update(status="error", error=f"{command}: {value}")
        live.remove(c)
        return None

    try:
        for c in list(live):
            for n in sizes:
                ask(c, f"warm {n} {warmup}")
        for r in range(repeats):
            order = rotated(live, r)
            if floor_iters:
                for c in order:
                    if (v := ask(c, f"floor {floor_iters}")) is not None:
                        floors[c].append(v)
            for n in sizes:
                for c in order:
                    if (v := ask(c, f"time {n} {iters}")) is not None:
                        samples[c][str(n)].append(v)
    finally:
        for w in workers.values():
            w.close()
    return samples, floors


def rotated(names: list[str], r: int) -> list[str]:
    """names in the order of round r: each round starts one further along."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def end_of_turns(entries: dict, result: dict, figure: str) -> None:
    """After the turns: raise when no configuration has its figure; mark the result partial
    when one failed. entries: {name: {"status": ..., "error" or "reason": ..., figure: ...}}."""
    if not any(v.get(figure) for v in entries.values()):
        raise RuntimeError("no configuration ran: " + "; ".join(
            f"{c}: {v.get('error') or v.get('reason')}" for c, v in entries.items())[:2000])
    if any(v["status"] == "error" for v in entries.values()):
        result["status"] = "partial"


def spread(values: list[float], digits: int = 4) -> dict:
    """median, min, max and n of values."""
    return {"median": round(median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits), "n": len(values)}


def parse_sizes(text: str) -> list[int]:
    """'512,1MiB,64MiB' -> [512, 1048576, 67108864]."""
    units = {"": 1, "b": 1, "k": KIB, "kib": KIB, "m": MIB, "mib": MIB, "g": GIB, "gib": GIB}
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        digits = part.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = part[len(digits):]
        if unit not in units or not digits:
            raise ValueError(f"bad size {part!r}: use bytes or a unit such as 512, 1MiB, 64MiB")
        out.append(int(float(digits) * units[unit]))
    if not out:
        raise ValueError("no sizes given")
    return out


def parse_fractions(text: str) -> list[float]:
    """'0.45,0.5,0.55' -> [0.45, 0.5, 0.55]: shares strictly between 0 and 1 (ValueError)."""
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or not all(0.0 < x < 1.0 for x in out):
        raise ValueError("fractions between 0 and 1, comma-separated, e.g. 0.45,0.5,0.55 "
                         f"(got {text!r})")
    return out


def size_label(n: int) -> str:
    """512 -> '512 B', 1048576 -> '1 MiB'."""
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"
