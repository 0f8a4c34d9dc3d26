# SPDX-License-Identifier: Apache-2.0
"""Pinned staging memory: copy bandwidth and allocation cost, bridge's pool against the rest.

    python3 benchmarks/bench_pinned.py --out pinned.json [--quick] [--sizes 1MiB,16MiB,256MiB]

Result: ``ratio`` = the smallest bridge / torch-pinned bandwidth ratio over
directions and sizes (1.0: as fast as torch's own pinned memory), the
per-case ratios under ``bridge_over_torch_pinned``, and the figures below.

Everything below is measured in ONE process, configurations interleaved
round by round, so ratios compare like with like (absolute figures move up to
2x between processes).

Copy bandwidth (GB/s, 1e9 bytes/s), ``dst.copy_(src, non_blocking=True)`` on
torch's current stream, ``--iters`` copies timed with CUDA events, median of
``--repeats`` rounds:
  h2d  host -> device from: a bridge buffer (``torch.from_dlpack(buf)``), a
       torch pinned tensor (``torch.empty(n, pin_memory=True)``), pageable
       memory; plus a bridge buffer of the ``mempool`` backend where the driver
       offers host-located pools.
  d2h  device -> host into the same kinds of memory.

Allocation cost (ns per allocate + drop pair, median of rounds):
  bridge_pool          ``bridge.pinned_buffer(n)`` + drop (steady state: a free-list hit)
  bridge_empty_pinned  ``bridge.empty_pinned(n, uint8)`` + drop (numpy view included)
  bridge_cold          the same plus ``free_all_blocks()``: a driver allocation each time
  cuMemHostAlloc       ``cuMemHostAlloc`` + ``cuMemFreeHost`` through cuda.bindings
  torch_pin_memory     ``torch.empty(n, pin_memory=True)`` + drop (torch's caching host allocator)
  cupy_default         ``cupy.cuda.alloc_pinned_memory(n)`` + drop, CuPy's PinnedMemoryPool
  cupy_bridge          the same with ``bridge.pinned.cupy_pinned_allocator()``
  mempool_pool / mempool_cold   bridge_pool / bridge_cold on the mempool backend
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import MIB, median, parse_sizes, run_guarded, size_label  # noqa: E402


def _guard(result: dict, key: str, fn: Callable[[], object]) -> None:
    """result[key] = fn(), or the error it raised (one section never loses the others)."""
    try:
        result[key] = fn()
    except Exception as exc:  # noqa: BLE001 - recorded
        result.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}"[:1000]


# ---- bandwidth ----
def _copy_gbps(torch, dst, src, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return dst.numel() * iters / (start.elapsed_time(end) * 1e-3) / 1e9


def _bandwidth(torch, bridge, sizes: list[int], iters: int, repeats: int,
               mempool: bool) -> dict:
    out: dict = {"h2d": {}, "d2h": {}}
    for n in sizes:
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        buf = bridge.pinned_buffer(n)
        hosts = {
            "bridge": torch.from_dlpack(buf),
            "torch_pinned": torch.empty(n, dtype=torch.uint8, pin_memory=True),
            "pageable": torch.empty(n, dtype=torch.uint8),
        }
        same = hosts["bridge"].data_ptr() == buf.ptr
        pinned_seen = bool(hosts["bridge"].is_pinned())
        for h in hosts.values():
            h.fill_(1)
        k = max(1, min(iters, (4 << 30) // n))  # about 4 GiB moved per round at most
        for h in hosts.values():               # warm-up
            _copy_gbps(torch, dev, h, 1)
            _copy_gbps(torch, h, dev, 1)
        h2d: dict[str, list[float]] = {name: [] for name in hosts}
        d2h: dict[str, list[float]] = {name: [] for name in hosts}
        for _ in range(repeats):
            for name, h in hosts.items():
                h2d[name].append(_copy_gbps(torch, dev, h, k))
                d2h[name].append(_copy_gbps(torch, h, dev, k))
        label = size_label(n)
        out["h2d"][label] = {f"{name}_GBps": round(median(v), 2) for name, v in h2d.items()}
        out["d2h"][label] = {f"{name}_GBps": round(median(v), 2) for name, v in d2h.items()}
        out["h2d"][label].update(iters=k, bridge_same_address=same,
                                 bridge_is_pinned=pinned_seen)
        del hosts, buf, dev
        gc.collect()
    if mempool:
        out["mempool"] = _mempool_bandwidth(torch, bridge, sizes, iters, repeats)
    return out


def _mempool_bandwidth(torch, bridge, sizes: list[int], iters: int, repeats: int) -> dict:
    from bridge import pinned

    gc.collect()
    torch.cuda.synchronize()
    try:
        pinned._set_backend("mempool")
    except bridge.BridgeError as exc:
        return {"skipped": str(exc)}
    out: dict = {}
    try:
        for n in sizes:
            dev = torch.empty(n, dtype=torch.uint8, device="cuda")
            buf = bridge.pinned_buffer(n)
            h = torch.from_dlpack(buf)
            h.fill_(1)
            k = max(1, min(iters, (4 << 30) // n))
            _copy_gbps(torch, dev, h, 1)
            h2d = [_copy_gbps(torch, dev, h, k) for _ in range(repeats)]
            d2h = [_copy_gbps(torch, h, dev, k) for _ in range(repeats)]
            out[size_label(n)] = {"h2d_GBps": round(median(h2d), 2),
                                  "d2h_GBps": round(median(d2h), 2),
                                  "is_pinned": bool(h.is_pinned())}
            del h, buf, dev
            gc.collect()
    finally:
        gc.collect()
        torch.cuda.synchronize()
        bridge.pinned_pool().free_all_blocks()
        pinned._set_backend("cached")
    return out


# ---- allocation cost ----
def _ns_per_pair(fn: Callable[[], None], iters: int, repeats: int) -> float:
    fn()  # warm: the first call may set things up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter_ns() - t0) / iters)
    return round(median(times), 1)


def _alloc_costs(torch, bridge, sizes: list[int], iters: int, repeats: int) -> dict:
    import numpy

    pool = bridge.pinned_pool()
    cfgs: dict[str, Callable[[int], Callable[[], None]]] = {
        "bridge_pool": lambda n: lambda: bridge.pinned_buffer(n).size and None,
        "bridge_empty_pinned": lambda n: lambda: bridge.empty_pinned(n, numpy.uint8).size and None,
        "bridge_cold": lambda n: lambda: (bridge.pinned_buffer(n).size, pool.free_all_blocks())
        and None,
        "torch_pin_memory": lambda n: lambda: torch.empty(n, dtype=torch.uint8,
                                                         pin_memory=True).numel() and None,
    }
    try:
        from cuda.bindings import driver as cu

        (err,) = cu.cuInit(0)

        def raw(n: int) -> Callable[[], None]:
            def pair() -> None:
                err, ptr = cu.cuMemHostAlloc(n, 1)  # CU_MEMHOSTALLOC_PORTABLE
                assert err == cu.CUresult.CUDA_SUCCESS, err
                (err,) = cu.cuMemFreeHost(ptr)
                assert err == cu.CUresult.CUDA_SUCCESS, err
            return pair

        cfgs["cuMemHostAlloc"] = raw
    except ImportError:
        pass
    try:
        import cupy

        from bridge import pinned

        def cupy_cfg(alloc) -> Callable[[int], Callable[[], None]]:
            def make(n: int) -> Callable[[], None]:
                cupy.cuda.set_pinned_memory_allocator(alloc)  # once, before the timing
                return lambda: cupy.cuda.alloc_pinned_memory(n) and None
            return make

        cfgs["cupy_default"] = cupy_cfg(cupy.get_default_pinned_memory_pool().malloc)
        cfgs["cupy_bridge"] = cupy_cfg(pinned.cupy_pinned_allocator())
    except ImportError:
        pass

    out: dict = {}
    for n in sizes:
        k = iters if n <= MIB else max(10, iters // 20)
        kc = max(5, k // 20)  # driver allocations: slow for big sizes
        row: dict = {}
        for name, make in cfgs.items():
            cold = name in ("bridge_cold", "cuMemHostAlloc")
            try:
                row[name] = _ns_per_pair(make(n), kc if cold else k, repeats)
            except Exception as exc:  # noqa: BLE001 - recorded
                row[name] = f"{type(exc).__name__}: {exc}"[:300]
        out[size_label(n)] = row
    try:
        import cupy

        cupy.cuda.set_pinned_memory_allocator(cupy.get_default_pinned_memory_pool().malloc)
    except ImportError:
        pass
    return out


def _mempool_alloc_costs(bridge, sizes: list[int], iters: int, repeats: int) -> dict:
    from bridge import pinned

    gc.collect()
    try:
        pinned._set_backend("mempool")
    except bridge.BridgeError as exc:
        return {"skipped": str(exc)}
    pool = bridge.pinned_pool()
    out: dict = {}
    try:
        for n in sizes:
            k = iters if n <= MIB else max(10, iters // 20)
            def warm(n: int = n) -> None:
                bridge.pinned_buffer(n)

            def cold(n: int = n) -> None:
                bridge.pinned_buffer(n)
                pool.free_all_blocks()

            out[size_label(n)] = {"mempool_pool": _ns_per_pair(warm, k, repeats),
                                  "mempool_cold": _ns_per_pair(cold, max(5, k // 20), repeats)}
    finally:
        gc.collect()
        pool.free_all_blocks()
        pinned._set_backend("cached")
    return out


def _out_path(out: str | None) -> str | None:
    """--out: a .json file, or a folder that gets results.json."""
    if out is None or out.endswith(".json"):
        return out
    return os.path.join(out, "results.json")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", "--json", dest="out", default=None,
                    help="write the JSON result to this .json file, or to results.json in this "
                         "folder (default: stdout)")
    ap.add_argument("--sizes", default="1MiB,16MiB,256MiB", help="copy sizes")
    ap.add_argument("--alloc-sizes", default="4KiB,1MiB,64MiB", help="allocation sizes")
    ap.add_argument("--iters", type=int, default=200, help="copies or pairs per round")
    ap.add_argument("--repeats", type=int, default=5, help="rounds; the median is reported")
    ap.add_argument("--no-mempool", action="store_true", help="skip the mempool backend")
    ap.add_argument("--quick", action="store_true",
                    help="fewer sizes and rounds (1MiB,64MiB copies; 4KiB,1MiB allocations)")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.alloc_sizes = "1MiB,64MiB", "4KiB,1MiB"
        args.iters, args.repeats = min(args.iters, 50), min(args.repeats, 3)

    def body(result: dict) -> None:
        import torch

        import bridge

        sizes = parse_sizes(args.sizes)
        alloc_sizes = parse_sizes(args.alloc_sizes)
        bridge.pinned_buffer(0)
        result.update({
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0),
            "backend": bridge.pinned_pool().backend,
        })
        torch.cuda.init()
        _guard(result, "bandwidth", lambda: _bandwidth(torch, bridge, sizes, args.iters,
                                                       args.repeats, not args.no_mempool))
        _guard(result, "alloc_ns", lambda: _alloc_costs(torch, bridge, alloc_sizes,
                                                        args.iters * 10, args.repeats))
        if not args.no_mempool:
            _guard(result, "mempool_alloc_ns",
                   lambda: _mempool_alloc_costs(bridge, alloc_sizes, args.iters * 10,
                                                args.repeats))
        result["pool"] = bridge.pinned_pool().stats()
        # bridge / torch pinned GB/s per direction and size; "ratio" is the smallest
        bw = result.get("bandwidth", {})
        by: dict = {}
        for direction in ("h2d", "d2h"):
            for label, row in bw.get(direction, {}).items():
                if row.get("torch_pinned_GBps"):
                    by[f"{direction} {label}"] = round(
                        row["bridge_GBps"] / row["torch_pinned_GBps"], 3)
        result["bridge_over_torch_pinned"] = by
        if by:
            result["ratio"] = min(by.values())
        if "errors" in result:
            result["status"] = "partial"

    return run_guarded(_out_path(args.out), {"bench": "pinned", "argv": sys.argv[1:]}, body)


if __name__ == "__main__":
    sys.exit(main())
