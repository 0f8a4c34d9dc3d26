# SPDX-License-Identifier: Apache-2.0
"""One RMM allocation on the bridge's resources against RMM's own CudaAsyncMemoryResource.

    python3 benchmarks/bench_rmm.py --out rmm.json [--sizes 512,1MiB,64MiB] [--cpu 2]

RMM is not a dependency: put its wheels on PYTHONPATH (rmm-cu13, librmm-cu13,
rapids-logger: ``pip install --no-deps --target DIR *.whl``). Without RMM the
result has ``status: "skipped"``.

Everything is measured in ONE process, configurations taking turns round by
round (absolute figures move up to 2x between processes; compare the ratios),
with the timed thread pinned to one CPU (``--cpu``). Per size, ns per
allocate + free pair, median of ``--repeats`` rounds of ``--iters`` pairs:

  buffer_async    ``rmm.DeviceBuffer(size=n, mr=CudaAsyncMemoryResource())`` + drop
  buffer_bridge   the same with the resource ``bridge.unify(rmm=True)`` installs: the
                  bridge's C++ resource (``BridgeResource``; ``path`` says which ran:
                  "bridge", or "callback" with ``path_reason`` where it did not build)
  buffer_callback the same with the fallback: RMM's CallbackMemoryResource on the
                  core's C callables (``BRIDGE_RMM_CALLBACK=1``)
  mr_async        ``mr.allocate(n)`` + ``mr.deallocate(p, n)`` on RMM's async resource
  mr_bridge       the same on unify's resource (RMM's Python wrapper, no buffer)
  mr_callback     the same on the callback resource

``ratio`` = buffer_bridge / buffer_async per size (1.0: as fast as RMM's own; the
target is <= 1.05), ``callback_ratio`` = buffer_callback / buffer_async;
``worst_ratio`` and ``worst_callback_ratio`` their largest. All on the default
stream, where the bridge's cache of freed blocks serves a same-size request
without a driver call (as it does for any repeated allocation on one stream).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median, parse_sizes, pin_cpu, run_guarded, size_label  # noqa: E402


def _pairs(fn: Callable[[], None], iters: int) -> float:
    """ns per call of fn, over iters calls (fn does one allocate + free pair)."""
    t0 = time.perf_counter_ns()
    for _ in range(iters):
        fn()
    return (time.perf_counter_ns() - t0) / iters


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", "--json", dest="out", default=None,
                    help="write the JSON result to this file (default: stdout)")
    ap.add_argument("--sizes", default="512,1MiB,64MiB", help="allocation sizes")
    ap.add_argument("--iters", type=int, default=2000, help="pairs per round")
    ap.add_argument("--repeats", type=int, default=7, help="rounds; the median is reported")
    ap.add_argument("--cpu", type=int, default=None, help="pin the timed thread to this CPU")
    ap.add_argument("--quick", action="store_true", help="fewer pairs and rounds")
    args = ap.parse_args(argv)
    if args.quick:
        args.iters, args.repeats = min(args.iters, 300), min(args.repeats, 3)

    def body(result: dict) -> None:
        try:
            import rmm
            import rmm.mr
        except ImportError as exc:
            result.update(status="skipped", reason=f"RMM is not installed: {exc}")
            return
        import bridge
        from bridge.adapters import rmm as adapter

        pin_cpu(args.cpu, result)
        bridge.unify(cupy=False, torch=False, rmm=True)
        mine = adapter.resource(0)
        callback = adapter.callback_resource(0)
        theirs = rmm.mr.CudaAsyncMemoryResource()
        result.update({"rmm": rmm.__version__, "bridge": bridge.__version__,
                       "iters": args.iters, "repeats": args.repeats,
                       "path": adapter.path(), "path_reason": adapter.path_reason(),
                       "resource": type(mine).__name__})

        def buffer(mr, n):
            def one() -> None:
                b = rmm.DeviceBuffer(size=n, mr=mr)
                del b
            return one

        def resource(mr, n):
            def one() -> None:
                mr.deallocate(mr.allocate(n), n)
            return one

        configs = {"buffer_async": (buffer, theirs), "buffer_bridge": (buffer, mine),
                   "buffer_callback": (buffer, callback), "mr_async": (resource, theirs),
                   "mr_bridge": (resource, mine), "mr_callback": (resource, callback)}
        sizes = parse_sizes(args.sizes)
        per_size: dict[str, dict] = {}
        for n in sizes:
            fns = {name: make(mr, n) for name, (make, mr) in configs.items()}
            for fn in fns.values():  # warm up: pools grown, caches filled
                _pairs(fn, 50)
            rounds: dict[str, list[float]] = {name: [] for name in fns}
            gc.disable()
            try:
                for r in range(args.repeats):
                    names = list(fns)
                    names = names[r % len(names):] + names[: r % len(names)]
                    for name in names:
                        rounds[name].append(_pairs(fns[name], args.iters))
            finally:
                gc.enable()
            entry = {name: round(median(v), 1) for name, v in rounds.items()}
            entry["ratio"] = round(entry["buffer_bridge"] / entry["buffer_async"], 3)
            entry["callback_ratio"] = round(entry["buffer_callback"] / entry["buffer_async"], 3)
            entry["mr_ratio"] = round(entry["mr_bridge"] / entry["mr_async"], 3)
            entry["mr_callback_ratio"] = round(entry["mr_callback"] / entry["mr_async"], 3)
            per_size[size_label(n)] = entry
        rmm.mr.get_current_device_resource()  # still the bridge's after the runs
        result["ns_per_pair"] = per_size
        result["worst_ratio"] = max(e["ratio"] for e in per_size.values())
        result["worst_callback_ratio"] = max(e["callback_ratio"] for e in per_size.values())
        result["stats"] = bridge.stats(0).as_dict()

    return run_guarded(args.out, {"benchmark": "rmm"}, body)


if __name__ == "__main__":
    sys.exit(main())
