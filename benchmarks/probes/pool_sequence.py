# SPDX-License-Identifier: Apache-2.0
"""Probe: a cache policy's calls to the pool, given to the GPU's own pool (its memory, measured).

    python benchmarks/probes/pool_sequence.py [--only NAME ...] [--json FILE] [TRACES...]  (GPU)

``model_cache.py`` knows exactly which calls a cache policy makes to the driver's pool on a
trace (its hits are exact), but only models where the pool places them. This probe takes
each policy's calls from the model (``replay(..., ops=...)``: every allocation's size and
every release, in order, five passes and the warm-up as ``bench_trace.py replay``) and
makes the same calls with ``cuMemAllocFromPoolAsync`` / ``cuMemFreeAsync`` on device 0's
default pool: on one stream (every committed trace has one; the legacy default stream, as
``bench_trace.py``'s replay runs on torch's, or ``--stream own``), synchronized at the end
of each pass as that replay is (without it the pool held 0.03-0.12 more on the H200), the
release threshold at its maximum as ``unify`` sets it, the pool trimmed to nothing before
each policy (``--fresh``: each policy in a process of its own). The pool's
``RESERVED_MEM_HIGH`` over the trace's peak of live bytes is then the policy's peak
reserved / peak live on the GPU without building the policy in the core: on the H200 it
gave the figures of ``bench_trace.py replay`` for every configuration built
(benchmarks/results/probes.md). No framework is imported; the driver through ``cuda.bindings``.

The policies: every ``model_cache.POLICIES`` entry (``tiers`` is the cache as built,
``carve-live`` carving as built), then variants of the carved classes (``variants``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import model_cache as mc  # noqa: E402

MIB = mc.MIB


def variants() -> dict[str, tuple[str, dict]]:
    """Carved classes beyond POLICIES: the small class (up to 1 MiB from 2 MiB chunks,
    every empty chunk kept, or none), and every larger request carved from chunks of
    CHUNK bytes (a larger request: a chunk of its own) with KEEP bytes of empty chunks
    kept, CHUNK fixed or a share of the bytes live when the chunk is taken (``live_chunk``,
    KEEP then one such chunk or none); or a medium class up to 10 MiB with the large tier
    above it."""
    out: dict[str, tuple[str, dict]] = {}
    for small_keep, sk in ((mc.DEVICE, "all"), (0, "0")):
        for chunk in (32, 64, 128, 256):
            for keep in (0, 1, 4):
                name = f"all-{chunk}M-keep{keep}-small{sk}"
                carve = ((MIB, 2 * MIB, small_keep), (mc.DEVICE, chunk * MIB, keep * chunk * MIB))
                out[name] = ("carve-all", {"carve": carve})
    for share, sn in ((1 / 8, "8"), (1 / 16, "16"), (1 / 32, "32")):
        for low in (16, 32):
            for high in (256, 512):
                for keep in (0, 1):
                    for small_keep, sk in ((mc.DEVICE, "all"), (0, "0")):
                        chunk = mc.live_chunk(share, low * MIB, high * MIB)
                        kept = chunk if keep else 0
                        name = f"live{sn}-{low}M-{high}M-keep{keep}-small{sk}"
                        carve = ((MIB, 2 * MIB, small_keep), (mc.DEVICE, chunk, kept))
                        out[name] = ("carve-all", {"carve": carve})
    # around the best of the above (live8-32M-256M-keep0-small0): no empty chunk kept
    for k in (4, 6, 8, 10, 12):
        for low in (16, 32, 64):
            for high in (128, 256):
                for small_keep, sk in ((mc.DEVICE, "all"), (0, "0")):
                    chunk = mc.live_chunk(1 / k, low * MIB, high * MIB)
                    name = f"r{k}-{low}M-{high}M-small{sk}"
                    carve = ((MIB, 2 * MIB, small_keep), (mc.DEVICE, chunk, 0))
                    out[name] = ("carve-all", {"carve": carve})
    for chunk in (20, 32, 64):
        for keep in (0, 1):
            for cap, frac, cn in ((64 * MIB, 0.0, "64M"), (64 * MIB, 1 / 16, "live16"),
                                  (0, 0.0, "0")):  # fmt: skip
                name = f"med10-{chunk}M-keep{keep}-large{cn}"
                carve = ((MIB, 2 * MIB, mc.DEVICE), (10 * MIB, chunk * MIB, keep * chunk * MIB))
                out[name] = ("tiers", {"carve": carve, "large_cap": cap, "large_fraction": 0,
                                       "large_live_min": frac})  # fmt: skip
    return out


class GpuPool:
    """Device 0's default pool through the driver API, on one stream of its own."""

    def __init__(self, own_stream: bool = False) -> None:
        from cuda.bindings import driver as cu

        self.cu = cu
        self._ok(cu.cuInit(0))
        dev = self._ok(cu.cuDeviceGet(0))
        ctx = self._ok(cu.cuDevicePrimaryCtxRetain(dev))
        self._ok(cu.cuCtxSetCurrent(ctx))
        self.pool = self._ok(cu.cuDeviceGetDefaultMemPool(dev))
        self.stream = cu.CUstream(0)  # the legacy default stream
        if own_stream:
            self.stream = self._ok(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        a = cu.CUmemPool_attribute
        self.HIGH = a.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH
        self.CUR = a.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT
        self._ok(cu.cuMemPoolSetAttribute(self.pool, a.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                                          cu.cuuint64_t(2**64 - 1)))  # fmt: skip

    def _ok(self, result: tuple) -> Any:
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"driver call failed: {err}")
        return rest[0] if len(rest) == 1 else rest

    def attr(self, a: Any) -> int:
        return int(self._ok(self.cu.cuMemPoolGetAttribute(self.pool, a)))

    def run(self, ops: list[int]) -> dict:
        """Make the calls; the pool's reserved high-water mark, and what was left reserved
        before (should be 0)."""
        cu = self.cu
        self._ok(cu.cuStreamSynchronize(self.stream))
        self._ok(cu.cuMemPoolTrimTo(self.pool, 0))
        before = self.attr(self.CUR)
        self._ok(cu.cuMemPoolSetAttribute(self.pool, self.HIGH, cu.cuuint64_t(0)))
        ptrs: list[Any] = []
        alloc, free, pool, s = cu.cuMemAllocFromPoolAsync, cu.cuMemFreeAsync, self.pool, self.stream
        sync = cu.cuStreamSynchronize
        t0 = time.perf_counter()
        for op in ops:
            if op == 0:  # the end of a pass
                self._ok(sync(s))
            elif op > 0:
                ptrs.append(self._ok(alloc(op, pool, s)))
            else:
                k = -1 - op
                self._ok(free(ptrs[k], s))
                ptrs[k] = None
        seconds = time.perf_counter() - t0
        high = self.attr(self.HIGH)
        for p in ptrs:  # what the cache still holds at the end
            if p is not None:
                self._ok(free(p, s))
        self._ok(cu.cuStreamSynchronize(self.stream))
        return {"reserved_high": high, "reserved_before": before, "seconds": round(seconds, 3)}


def run_fresh(ops: list[int], own_stream: bool) -> dict:
    """GpuPool.run in a process of its own (a pool that served nothing before)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ops.json")
        with open(path, "w") as f:
            json.dump(ops, f)
        cmd = [sys.executable, os.path.abspath(__file__), "--run-ops", path]
        cmd += ["--stream", "own"] if own_stream else []
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300)
        return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="*")
    ap.add_argument("--only", action="append", default=[], help="policy or variant names")
    ap.add_argument("--match", action="append", default=[], help="names containing this")
    ap.add_argument("--json", default=None)
    ap.add_argument("--stream", choices=("legacy", "own"), default="legacy")
    ap.add_argument("--fresh", action="store_true", help="each policy in a new process")
    ap.add_argument("--run-ops", default=None, help=argparse.SUPPRESS)  # --fresh's child
    args = ap.parse_args(argv)
    own = args.stream == "own"
    if args.run_ops:
        with open(args.run_ops) as f:
            print(json.dumps(GpuPool(own).run(json.load(f))))
        return 0
    traces = os.path.join(os.path.dirname(HERE), "traces", "*.json.gz")
    paths = args.traces or sorted(glob.glob(traces))
    specs = {name: (name, {}) for name in mc.POLICIES} | variants()
    if args.only or args.match:
        specs = {k: v for k, v in specs.items()
                 if k in args.only or any(m in k for m in args.match)}  # fmt: skip
    gpu = None if args.fresh else GpuPool(own)
    rows = []
    print(f"{'trace':<9} {'policy':<32} {'hits':>6} {'calls':>6} {'heap':>6} {'chunked':>7} "
          f"{'GPU':>6}")  # fmt: skip
    for path in paths:
        trace = mc.load(path)
        for name, (policy, settings) in specs.items():
            ops: list[int] = []
            r = mc.replay(trace["events"], policy, warmup=True, ops=ops, **settings)
            c = mc.replay(trace["events"], policy, warmup=True, pool_model="chunked", **settings)
            g = gpu.run(ops) if gpu else run_fresh(ops, own)
            row = {"trace": trace["name"], "name": name, "policy": policy,
                   "settings": {k: str(v) for k, v in settings.items()},
                   "hits": r["hits"], "allocs": r["allocs"], "driver_calls": r["driver_calls"],
                   "peak_live": r["peak_live"], "model_heap": r["reserved_over_live"],
                   "model_chunked": c["reserved_over_live"], **g,
                   "gpu_reserved_over_live": g["reserved_high"] / r["peak_live"]}  # fmt: skip
            rows.append(row)
            print(f"{row['trace']:<9} {name:<32} {r['hits']:>6.1%} {len(ops):>6} "
                  f"{row['model_heap']:>6.3f} {row['model_chunked']:>7.3f} "
                  f"{row['gpu_reserved_over_live']:>6.3f}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "stream": args.stream, "fresh": args.fresh}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
