# SPDX-License-Identifier: Apache-2.0
"""Allocation traces of real work, recorded once and replayed under each allocator.

A trace is the sequence of allocations and frees (size, stream, order) that a
program made, recorded with the native allocators:

    python benchmarks/bench_trace.py record gpt2 --out traces/gpt2.json.gz    (GPU)
    python benchmarks/bench_trace.py record cupy-fft --out traces/cupy-fft.json.gz
    python benchmarks/bench_trace.py record resnet50 --out traces/resnet50.json.gz

``gpt2`` trains a 6-layer, width-768 GPT-2 for six steps at sequence lengths
64 to 512 (torch's memory history); ``resnet50`` runs ResNet-50 training steps
(needs torchvision); ``cupy-fft`` runs a CuPy preprocessing pipeline (FFT,
filter, inverse FFT, normalisation) at varying batch sizes, logged through a
CuPy allocator that wraps CuPy's own pool.

Replaying a trace in a fresh process per allocator (``torch.empty``/``del``
of uint8 tensors, each on its recorded stream):

    python benchmarks/bench_trace.py replay traces/gpt2.json.gz --config bridge --json out.json
    python benchmarks/bench_trace.py run traces/*.json.gz --rounds 5 --out results.json

reports the time per event (best pass) and the peak memory the allocator held
(its pool's or cache's reserved high-water mark) against the trace's peak of
live bytes: ``reserved / live`` is the fragmentation. Configurations: torch's
native caching allocator, ``async`` (torch's cudaMallocAsync backend), ``rmm``
(RMM's CudaAsyncMemoryResource, when installed) and ``bridge``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import config_env, run_guarded, write_json  # noqa: E402

ALLOC, FREE = 0, 1
CONFIGS = ("native", "async", "rmm", "bridge", "bridge-nocache")


# ---- traces ----
def make_trace(name: str, source: str, events: list[list[int]]) -> dict:
    """A trace: events are ``[ALLOC, id, size, stream]`` and ``[FREE, id]``."""
    streams = 1 + max((e[3] for e in events if e[0] == ALLOC), default=0)
    return {"name": name, "source": source, "streams": streams, "events": events}


def from_snapshot(snapshot: dict, name: str, device: int = 0) -> dict:
    """A trace from ``torch.cuda.memory._snapshot()``'s device trace.

    'alloc' starts a block, 'free_requested' ends it (when the program freed
    it; 'free_completed' comes later, when its streams allow reuse). Frees of
    blocks allocated before the recording began are dropped; streams are
    numbered in order of first use.
    """
    stream_ix: dict[int, int] = {}
    live: dict[int, int] = {}  # address -> id
    events: list[list[int]] = []
    next_id = 0
    for entry in snapshot["device_traces"][device]:
        action, addr = entry["action"], entry["addr"]
        if action == "alloc":
            s = stream_ix.setdefault(entry.get("stream", 0), len(stream_ix))
            live[addr] = next_id
            events.append([ALLOC, next_id, int(entry["size"]), s])
            next_id += 1
        elif action == "free_requested" and addr in live:
            events.append([FREE, live.pop(addr)])
    return make_trace(name, "torch memory history", events)


def peak_live(trace: dict) -> int:
    """The most bytes live at once in the trace."""
    live: dict[int, int] = {}
    cur = peak = 0
    for e in trace["events"]:
        if e[0] == ALLOC:
            live[e[1]] = e[2]
            cur += e[2]
            peak = max(peak, cur)
        else:
            cur -= live.pop(e[1])
    return peak


def save(trace: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump(trace, f, separators=(",", ":"))


def load(path: str) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def summary(trace: dict) -> dict:
    sizes = {e[2] for e in trace["events"] if e[0] == ALLOC}
    return {
        "name": trace["name"],
        "events": len(trace["events"]),
        "sizes": len(sizes),
        "streams": trace["streams"],
        "peak_live": peak_live(trace),
    }


# ---- recording (GPU, native allocators) ----
def record_gpt2(steps: int = 6) -> dict:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=6, n_embd=768, n_head=12, n_positions=512, vocab_size=50257)
    model = GPT2LMHeadModel(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lengths = [64, 512, 128, 384, 256, 96, 448, 192][:steps]
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    for n in lengths:
        ids = torch.randint(0, cfg.vocab_size, (8, n), device="cuda")
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return from_snapshot(snap, "gpt2")


def record_resnet50(steps: int = 4) -> dict:
    import torch
    import torchvision

    model = torchvision.models.resnet50().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    for _ in range(steps):
        x = torch.randn(64, 3, 224, 224, device="cuda")
        y = torch.randint(0, 1000, (64,), device="cuda")
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return from_snapshot(snap, "resnet50")


def record_cupy_fft(batches: Iterable[int] = (16, 32, 24, 64, 48, 32, 16, 64)) -> dict:
    import cupy as cp

    pool = cp.get_default_memory_pool()
    events: list[list[int]] = []
    streams: dict[int, int] = {}
    counter = [0]

    class Logged:  # owns the pool's block; its end is the free
        def __init__(self, mem: Any, i: int) -> None:
            self.mem, self.i = mem, i

        def __del__(self) -> None:
            events.append([FREE, self.i])

    def logging_alloc(size: int) -> Any:
        mem = pool.malloc(size)
        i = counter[0]
        counter[0] += 1
        s = streams.setdefault(cp.cuda.get_current_stream().ptr, len(streams))
        events.append([ALLOC, i, int(size), s])
        owner = Logged(mem, i)
        # the device named: CuPy refuses a null pointer (a 0-byte block) without it
        mem_view = cp.cuda.UnownedMemory(mem.ptr, size, owner, cp.cuda.Device().id)
        return cp.cuda.MemoryPointer(mem_view, 0)

    cp.cuda.set_allocator(logging_alloc)
    try:
        for b in batches:
            img = cp.random.random((b, 512, 512), dtype=cp.float32)
            f = cp.fft.rfft2(img)
            ky = cp.fft.fftfreq(512)[:, None]
            kx = cp.fft.rfftfreq(512)[None, :]
            f *= cp.exp(-(kx**2 + ky**2) * 40.0)
            out = cp.fft.irfft2(f, s=(512, 512))
            out = (out - out.mean(axis=(1, 2), keepdims=True)) / (
                out.std(axis=(1, 2), keepdims=True) + 1e-6
            )
            del img, f, ky, kx, out
        cp.cuda.Device().synchronize()
    finally:
        cp.cuda.set_allocator(pool.malloc)
    return make_trace("cupy-fft", "CuPy allocator log", events)


RECORDERS = {"gpt2": record_gpt2, "resnet50": record_resnet50, "cupy-fft": record_cupy_fft}


# ---- replay (one allocator per process) ----
def _setup(config: str) -> Any:
    """Install the configuration's allocator; returns a function giving the held peak."""
    if config.startswith("bridge"):
        import bridge

        if config == "bridge-nocache":
            os.environ.update(config_env("torch", config))

        bridge.unify(cupy=False, torch=True)
    elif config == "rmm":
        import rmm
        from rmm.allocators.torch import rmm_torch_allocator

        rmm.mr.set_current_device_resource(rmm.mr.CudaAsyncMemoryResource())
        import torch

        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
    import torch

    if config == "native":
        torch.cuda.reset_peak_memory_stats()
        return lambda: torch.cuda.max_memory_reserved()
    if config == "rmm":
        return lambda: None  # RMM's pool is its own, with no high-water mark here
    # async and bridge allocate from the device's default pool: its high-water mark
    from cuda.bindings import driver as cu

    cu.cuInit(0)
    err, pool = cu.cuDeviceGetDefaultMemPool(0)
    attr = cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH
    torch.zeros(1, device="cuda")  # the pool and the context exist

    def high() -> int:
        err, v = cu.cuMemPoolGetAttribute(pool, attr)
        return int(v)

    cu.cuMemPoolSetAttribute(pool, attr, cu.cuuint64_t(0))  # reset the mark
    return high


def replay_events(torch: Any, trace: dict, streams: list[Any], passes: int) -> list[float]:
    """Replay the trace ``passes`` times; ns per event of each pass."""
    events = trace["events"]
    times = []
    for _ in range(passes):
        live: dict[int, Any] = {}
        current = None
        t0 = time.perf_counter_ns()
        for e in events:
            if e[0] == ALLOC:
                s = streams[e[3]]
                if s is not current:
                    torch.cuda.set_stream(s)
                    current = s
                live[e[1]] = torch.empty(e[2], dtype=torch.uint8, device="cuda")
            else:
                del live[e[1]]
        live.clear()
        torch.cuda.synchronize()
        times.append((time.perf_counter_ns() - t0) / len(events))
    torch.cuda.set_stream(streams[0])
    return times


def replay(path: str, config: str, passes: int, json_path: str | None) -> int:
    trace = load(path)

    def body(result: dict) -> None:
        held = _setup(config)
        import torch

        streams = [torch.cuda.current_stream()]
        streams += [torch.cuda.Stream() for _ in range(trace["streams"] - 1)]
        times = replay_events(torch, trace, streams, passes)
        peak = held()
        live = peak_live(trace)
        result.update(
            ns_per_event=min(times),
            ns_per_pass=times,
            peak_reserved=peak,
            peak_live=live,
            reserved_over_live=(peak / live) if peak else None,
            torch=torch.__version__,
        )
        if config.startswith("bridge"):  # how often the cache served, over all passes
            from bridge._runtime import core

            raw = core.stats(0)[1]
            result.update(allocs=raw["num_allocs"], cache_hits=raw["num_cache_hits"],
                          cache_limit=raw["cache_limit"])

    base = {
        "bench": "trace",
        "trace": trace["name"],
        "config": config,
        "events": len(trace["events"]),
    }
    return run_guarded(json_path, base, body)


def run(paths: list[str], configs: list[str], rounds: int, passes: int,
        out_path: str | None = None) -> dict:
    """Every trace under every configuration, one process each, configurations in turns.

    With ``out_path`` the results so far are written after each trace (a run cut
    short keeps what it measured)."""
    out: dict[str, Any] = {}
    for path in paths:
        name = load(path)["name"]
        per: dict[str, list[dict]] = {c: [] for c in configs}
        for r in range(rounds):
            order = configs[r % len(configs) :] + configs[: r % len(configs)]
            for config in order:
                env = dict(os.environ)
                env.update(config_env("torch", config))
                cmd = [sys.executable, __file__, "replay", path, "--config", config,
                       "--passes", str(passes)]  # fmt: skip
                p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
                try:
                    per[config].append(json.loads(p.stdout))
                except json.JSONDecodeError:
                    per[config].append({"status": "error", "error": p.stderr[-2000:]})
        out[name] = {c: _best(v) for c, v in per.items()}
        if out_path:
            write_json(out_path, out)
    return out


def _best(results: list[dict]) -> dict:
    ok = [r for r in results if r.get("ns_per_event")]
    if not ok:
        return results[-1] if results else {}
    best = min(ok, key=lambda r: r["ns_per_event"])
    return {**best, "rounds": len(results)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="record a trace with the native allocators (GPU)")
    rec.add_argument("workload", choices=sorted(RECORDERS))
    rec.add_argument("--out", required=True)
    rep = sub.add_parser("replay", help="replay one trace under one allocator (GPU)")
    rep.add_argument("trace")
    rep.add_argument("--config", choices=CONFIGS, required=True)
    rep.add_argument("--passes", type=int, default=5)
    rep.add_argument("--json", default=None)
    rn = sub.add_parser("run", help="every trace under every configuration, in turns (GPU)")
    rn.add_argument("traces", nargs="+")
    rn.add_argument("--configs", default=",".join(CONFIGS))
    rn.add_argument("--rounds", type=int, default=3)
    rn.add_argument("--passes", type=int, default=5)
    rn.add_argument("--out", default=None)
    sm = sub.add_parser("summary", help="what a trace holds (CPU)")
    sm.add_argument("traces", nargs="+")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        trace = RECORDERS[args.workload]()
        save(trace, args.out)
        print(json.dumps(summary(trace)))
        return 0
    if args.cmd == "replay":
        return replay(args.trace, args.config, args.passes, args.json)
    if args.cmd == "summary":
        for path in args.traces:
            print(json.dumps(summary(load(path))))
        return 0
    result = run(args.traces, args.configs.split(","), args.rounds, args.passes, args.out)
    if not args.out:
        write_json(None, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
