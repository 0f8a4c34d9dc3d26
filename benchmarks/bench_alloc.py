# SPDX-License-Identifier: Apache-2.0
"""Cost of one device allocation + free, for one allocator, in this (fresh) process.

    python3 benchmarks/bench_alloc.py --framework torch --config bridge --json r.json

torch configurations (``torch.empty(n, dtype=torch.uint8, device='cuda')``, dropped):
  native   torch's caching allocator
  async    ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`` (run_all.py sets the
           variable; this script checks that torch really uses that backend)
  rmm      RMM's CUDAPluggableAllocator over ``rmm.mr.CudaAsyncMemoryResource``
  bridge   ``bridge.unify(cupy=False, torch=True)``
  bridge-nocache, bridge-carve, bridge-noslot, bridge-ipc
           the same with the cache off, with carving, without the thread slots
           (``BRIDGE_CACHE_THREAD_SLOT=0``: the shared lists alone), from the
           exportable pool (``BRIDGE_IPC=1``, as ``unify(ipc=True)``)
cupy configurations (``cupy.empty(n, dtype=cupy.uint8)``, dropped):
  native   CuPy's default ``MemoryPool``
  async    ``cupy.cuda.MemoryAsyncPool`` (the device's default pool)
  rmm      ``rmm.allocators.cupy.rmm_cupy_allocator`` over ``CudaAsyncMemoryResource``
  bridge   ``bridge.unify(cupy=True, torch=False)``
  all      every CuPy allocator above in ONE process, switched with
           ``cupy.cuda.set_allocator`` round-robin: a same-process cross-check
           of the ratios (figures move up to 2x between processes).

Result: ns per alloc+free pair for each size, the best of ``--repeats``
timed loops of ``--iters`` pairs each (the sizes take turns), after
``--warmup`` pairs. A loop ends with a device synchronize (included in its
time: one per loop). ``floor_ns``: the best loop of an op that allocates
nothing, timed before and after: how fast this process ran. ``--cpu`` pins
the timing thread to one CPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    Skip,
    add_pair_args,
    check_pair_args,
    pin_cpu,
    rotated,
    run_guarded,
)

FRAMEWORKS = ("torch", "cupy")
#: the configurations setup_torch knows
TORCH_CONFIGS = ("native", "async", "rmm", "bridge", "bridge-nocache", "bridge-carve",
                 "bridge-noslot", "bridge-ipc")
#: every configuration (bench_turns.py takes any but "all"); bridge-unowned is CuPy's alone
CONFIGS = (*TORCH_CONFIGS, "bridge-unowned", "all")


_KEEP: list = []  # objects that must outlive the timed loops (RMM's memory resource)


# ---- setting up one allocator, before the framework touches the device ----

def _rmm_resource() -> object:
    try:
        import rmm
        import rmm.mr
    except ImportError as exc:
        if exc.name != "rmm":
            raise  # installed but broken: an error, not a skip
        raise Skip(f"RMM is not installed ({exc})") from exc
    mr = rmm.mr.CudaAsyncMemoryResource()
    rmm.mr.set_current_device_resource(mr)
    _KEEP.append(mr)
    return mr


def setup_torch(config: str, info: dict) -> Callable[[int, int], None]:
    """Install the torch allocator of config; return loop(n, iters)."""
    if config.startswith("bridge"):
        import bridge

        bridge.unify(cupy=False, torch=True)
    import torch

    if config == "rmm":
        _rmm_resource()
        from rmm.allocators.torch import rmm_torch_allocator

        if rmm_torch_allocator is None:
            raise Skip("rmm.allocators.torch.rmm_torch_allocator is None "
                       "(torch.cuda.is_available() was False when RMM looked)")
        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
    elif config == "async":
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        if "cudaMallocAsync" not in conf:
            raise RuntimeError("config async needs PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync "
                               f"in the environment (it is {conf!r}); run_all.py sets it")
    elif config not in TORCH_CONFIGS:
        raise ValueError(f"torch has no configuration {config!r}")
    torch.empty(1, device="cuda")  # start CUDA and the allocator
    torch.cuda.synchronize()
    info["torch"] = torch.__version__
    try:
        info["backend"] = torch.cuda.get_allocator_backend()
    except Exception as exc:  # noqa: BLE001 - informative only
        info["backend"] = f"unknown ({exc})"
    if config == "async" and info["backend"] != "cudaMallocAsync":
        raise RuntimeError(f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF')!r}"
                           f" but torch reports backend {info['backend']!r}")
    empty, u8, sync = torch.empty, torch.uint8, torch.cuda.synchronize

    def loop(n: int, iters: int) -> None:
        for _ in range(iters):
            empty(n, dtype=u8, device="cuda")
        sync()

    return loop


def torch_floor() -> Callable[[int, int], None]:
    """A tensor op that allocates nothing (x.add_(1)): how fast this process runs."""
    import torch

    x = torch.zeros(1, device="cuda")
    add_, sync = x.add_, torch.cuda.synchronize

    def loop(_n: int, iters: int) -> None:
        for _ in range(iters):
            add_(1)
        sync()

    return loop


def cupy_floor() -> Callable[[int, int], None]:
    """An array op that allocates nothing (cupy.add(x, 1, out=x)): this process's speed."""
    import cupy

    x = cupy.zeros(1, dtype=cupy.float32)
    add, sync = cupy.add, cupy.cuda.Device().synchronize

    def loop(_n: int, iters: int) -> None:
        for _ in range(iters):
            add(x, 1, out=x)
        sync()

    return loop


def _cupy_allocators(configs: tuple[str, ...], info: dict) -> dict:
    """{config: allocator callable} for CuPy; bridge first (it must see a fresh CuPy)."""
    out: dict = {}
    mine = [c for c in configs if c.startswith("bridge")]
    if mine:
        import bridge

        bridge.unify(cupy=True, torch=False)
        import cupy

        out[mine[0]] = cupy.cuda.get_allocator()
    import cupy

    info["cupy"] = cupy.__version__
    for config in configs:
        if config == "native":
            out[config] = cupy.get_default_memory_pool().malloc
        elif config == "async":
            out[config] = cupy.cuda.MemoryAsyncPool().malloc
        elif config == "rmm":
            try:
                _rmm_resource()
                from rmm.allocators.cupy import rmm_cupy_allocator
            except Exception as exc:  # noqa: BLE001 - the cross-check goes on without RMM
                if len(configs) == 1:
                    raise
                info.setdefault("skipped", {})["rmm"] = f"{type(exc).__name__}: {exc}"
                continue
            out[config] = rmm_cupy_allocator
        elif not config.startswith("bridge"):
            raise ValueError(f"cupy has no configuration {config!r}")
    return out


def setup(framework: str, config: str,
          info: dict) -> tuple[Callable[[int, int], None], Callable[[int, int], None]]:
    """Install one allocator in this process; return (loop, floor): its timed loop and the
    no-allocation op. Both bench_alloc.py and bench_turns.py's workers start here."""
    if framework == "torch":
        return setup_torch(config, info), torch_floor()
    import cupy

    allocs = _cupy_allocators((config,), info)
    cupy.cuda.set_allocator(allocs[config])
    cupy.empty(1, dtype=cupy.uint8)
    return cupy_loop(), cupy_floor()


def cupy_loop() -> Callable[[int, int], None]:
    import cupy

    empty, u8 = cupy.empty, cupy.uint8
    sync = cupy.cuda.Device().synchronize

    def loop(n: int, iters: int) -> None:
        for _ in range(iters):
            empty(n, dtype=u8)
        sync()

    return loop


# ---- timing ----

def time_loop(loop: Callable[[int, int], None], n: int, iters: int) -> float:
    """ns per pair of one timed loop of iters pairs."""
    t0 = time.perf_counter_ns()
    loop(n, iters)
    return (time.perf_counter_ns() - t0) / iters


def measure(loop: Callable[[int, int], None], sizes: list[int], args: argparse.Namespace,
            result: dict) -> None:
    """Fill result['ns_per_pair'] / ['ns_samples']; a failing size is recorded, the rest go on.

    The sizes take turns (one timed loop each per repeat), so that a slow spell
    of the machine falls on every size rather than on one.
    """
    result.setdefault("ns_per_pair", {})
    samples: dict[int, list[float]] = {}
    for n in sizes:
        try:
            loop(n, args.warmup)
            samples[n] = []
        except Exception as exc:  # noqa: BLE001 - one size failing must not lose the others
            result.setdefault("size_errors", {})[str(n)] = f"{type(exc).__name__}: {exc}"[:1000]
            result["status"] = "partial"
    for _ in range(args.repeats):
        for n in list(samples):
            try:
                samples[n].append(time_loop(loop, n, args.iters))
            except Exception as exc:  # noqa: BLE001
                result.setdefault("size_errors", {})[str(n)] = \
                    f"{type(exc).__name__}: {exc}"[:1000]
                result["status"] = "partial"
                del samples[n]
    result["ns_samples"] = {str(n): [round(s, 1) for s in v] for n, v in samples.items()}
    for n, v in samples.items():
        result["ns_per_pair"][str(n)] = round(min(v), 1)  # best loop, as timeit does


def measure_floor(floor: Callable[[int, int], None], args: argparse.Namespace,
                  result: dict) -> None:
    """ns of the no-allocation op (best loop): the process's own speed, for reading ratios."""
    iters = max(1, args.iters // 4)
    floor(0, max(1, args.warmup // 4))
    samples = [time_loop(floor, 0, iters) for _ in range(args.repeats)]
    result.setdefault("floor_samples", []).extend(round(s, 1) for s in samples)
    result["floor_ns"] = round(min(result["floor_samples"]), 1)


def measure_interleaved(allocs: dict, sizes: list[int], args: argparse.Namespace,
                        result: dict) -> None:
    """All CuPy allocators in one process: round-robin per repeat, rotating the order."""
    import cupy

    loop = cupy_loop()
    names = list(allocs)
    samples: dict = {c: {str(n): [] for n in sizes} for c in names}
    for c in names:  # warm every allocator at every size
        cupy.cuda.set_allocator(allocs[c])
        for n in sizes:
            loop(n, args.warmup)
    for r in range(args.repeats):
        for n in sizes:
            for c in rotated(names, r):
                cupy.cuda.set_allocator(allocs[c])
                loop(n, max(1, args.warmup // 10))
                samples[c][str(n)].append(round(time_loop(loop, n, args.iters), 1))
    result["configs"] = {c: {"ns_per_pair": {k: round(min(v), 1) for k, v in s.items()},
                             "ns_samples": s} for c, s in samples.items()}
    cupy.cuda.set_allocator(allocs.get("bridge", cupy.get_default_memory_pool().malloc))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--framework", choices=FRAMEWORKS, required=True)
    p.add_argument("--config", choices=CONFIGS, required=True)
    add_pair_args(p, iters=20000, repeats=7, repeats_help="timed loops per size (best)")
    args = p.parse_args(argv)
    if args.config == "all" and args.framework != "cupy":
        p.error("--config all is for --framework cupy only (torch cannot switch allocators)")
    check_pair_args(p, args)
    base = {"bench": "alloc", "framework": args.framework, "config": args.config,
            "sizes": args.sizes, "iters": args.iters, "repeats": args.repeats,
            "warmup": args.warmup,
            "env": {"PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}}

    def body(result: dict) -> None:
        info = result.setdefault("info", {})
        try:
            if args.config == "all":
                allocs = _cupy_allocators(("bridge", "native", "async", "rmm"), info)
                pin_cpu(args.cpu, result)
                gc.disable()
                measure_interleaved(allocs, args.sizes, args, result)
            else:
                loop, floor = setup(args.framework, args.config, info)
                pin_cpu(args.cpu, result)
                gc.disable()
                measure_floor(floor, args, result)
                measure(loop, args.sizes, args, result)
                measure_floor(floor, args, result)
        except Skip as exc:
            result["status"] = "skipped"
            result["reason"] = str(exc)
        finally:
            gc.enable()

    return run_guarded(args.json, base, body)


if __name__ == "__main__":
    sys.exit(main())
