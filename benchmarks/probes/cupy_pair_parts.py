# SPDX-License-Identifier: Apache-2.0
"""Probe: where one CuPy allocation pair's time goes, on the bridge and on CuPy's MemoryPool.

    python benchmarks/probes/cupy_pair_parts.py [--cpu N] [--iters N] [--json FILE]   (GPU)

One process, the timing thread pinned, the collector off. Each line is the best of seven
loops of ``--iters`` calls, in ns per call: the pieces the bridge's allocator
(bridge._core.CupyAllocator) calls on every allocation (CuPy's current device and stream,
the stream's handle, CuPy's UnownedMemory and MemoryPointer around a block), the
allocators called directly (an allocation and its free, no array; the bridge's twice: with
CuPy's C functions for the device and stream, ``direct_lookups``, and with the Python calls
it made before), and ``cupy.empty`` + free under each. Issue 34 asks for the bridge at
<= 0.90 of MemoryPool; this says how much of a pair is CuPy's own object layer, which any
allocator that hands CuPy a MemoryPointer pays.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import warnings


def best_ns(fn, iters: int, loops: int = 7) -> float:
    out = []
    for _ in range(loops):
        t0 = time.perf_counter_ns()
        fn(iters)
        out.append((time.perf_counter_ns() - t0) / iters)
    return round(min(out), 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", type=int, default=None)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--native", action="store_true",
                    help="CuPy alone: no bridge in the process (its lines are left out)")
    args = ap.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    if not args.native:
        import bridge

        bridge.unify(cupy=True, torch=False)
    import cupy
    from cupy.cuda import memory as cmem

    pool = cupy.get_default_memory_pool()
    mine = pool.malloc if args.native else cupy.cuda.get_allocator()
    n, it = args.size, args.iters
    get_device = getattr(cupy.cuda.device, "get_device_id", None) or cupy.cuda.runtime.getDevice
    get_stream = cupy.cuda.get_current_stream
    stream = get_stream()
    dev = get_device()
    held = mine(n)  # a block to wrap (its address stays valid)
    ptr, owner = held.ptr, held.mem
    u8 = cupy.uint8
    sync = cupy.cuda.Device().synchronize
    gc.disable()

    def loop(body):
        def run(k: int) -> None:
            for _ in range(k):
                body()
        return run

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_device(), get_stream()
    parts = {
        "python call of a no-op (the loop's own cost)": loop(lambda: None),
        "CuPy's current device": loop(get_device),
        "cupy.cuda.runtime.getDevice": loop(cupy.cuda.runtime.getDevice),
        "CuPy's current stream": loop(get_stream),
        "the stream's .ptr": loop(lambda: stream.ptr),
        "UnownedMemory(ptr, size, owner, device) + its end": loop(
            lambda: cmem.UnownedMemory(ptr, n, owner, dev)),
        "MemoryPointer(mem, 0) + its end": loop(lambda: cmem.MemoryPointer(owner, 0)),
        "MemoryPool.malloc(n) + free (no array)": loop(lambda: pool.malloc(n)),
    }
    slow = None
    if not args.native:
        from bridge.adapters import cupy as adapter

        slow = adapter.new_allocator(direct=False)  # CuPy's device and stream by Python calls
        parts["bridge allocator(n) + free (no array)"] = loop(lambda: mine(n))
        parts["bridge allocator(n) + free, Python lookups"] = loop(lambda: slow(n))
    result: dict = {"bench": "cupy_pair_parts", "cupy": cupy.__version__,
                    "bridge": None if args.native else bridge.__version__, "size": n,
                    "iters": it, "cpu": args.cpu, "ns_per_call": {},
                    "warnings_of_device_and_stream": [str(w.message)[:200] for w in caught]}
    for name, fn in parts.items():
        fn(1000)  # warm
        result["ns_per_call"][name] = best_ns(fn, it)
    allocators = [("MemoryPool", pool.malloc)]
    if slow is not None:
        allocators += [("bridge", mine), ("bridge, Python lookups", slow)]
        result["direct_lookups"] = mine.direct_lookups
    for label, alloc in allocators:
        cupy.cuda.set_allocator(alloc)

        def empties(k: int) -> None:
            for _ in range(k):
                cupy.empty(n, dtype=u8)
            sync()

        empties(1000)
        result["ns_per_call"][f"cupy.empty(n) + free on {label}"] = best_ns(empties, it)
    cupy.cuda.set_allocator(mine)
    del held
    if not args.native:
        from bridge._runtime import core

        raw = core.stats(0)[1]
        result["cache_hits"], result["allocs"] = raw["num_cache_hits"], raw["num_allocs"]
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
