# SPDX-License-Identifier: Apache-2.0
"""Probe: where one torch allocation pair's time goes, on the bridge and on torch's own allocator.

    python benchmarks/probes/torch_pair_parts.py [--cpu N] [--rounds N] [--json FILE]   (GPU)

`bench_turns.py` times ``torch.empty(n)`` + its free from Python: the allocator's part is a
share of a pair that torch's Python binding, dispatcher and tensor objects dominate. This
probe times the parts in C++ (a small extension built with torch's extension builder on
first use, cached in ``--build-dir``), in one worker process per allocator, the workers
taking turns as bench_turns.py's do, each best of seven loops of ``--iters`` calls, ns per
pair:

- ``raw_alloc + raw_delete``: the current allocator alone (torch's
  ``CUDACachingAllocator::get()``), no tensor;
- ``allocate + its deleter``: what a tensor's storage calls (``allocate`` returns the
  ``DataPtr`` whose deleter frees);
- ``at::empty + free``: a whole tensor from C++ (dispatcher, tensor and storage objects);
- ``torch.empty + free``: the same from Python, as bench_turns.py times it;
- ``current device + stream``: the two lookups every allocator makes per allocation.

So ``torch.empty`` less ``allocate + its deleter`` is what any allocator pays, and the
ratio issue 29 asks of bench_turns (bridge / native <= 0.90) needs the allocators'
difference to be a tenth of the Python pair. Worker: ``--worker native|bridge``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

SIZES = (512, 1 << 20, 64 << 20)

CPP = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <chrono>

namespace CCA = c10::cuda::CUDACachingAllocator;

static double now_ns()
{
    return std::chrono::duration<double, std::nano>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <class F> static double best(int64_t iters, int64_t loops, F body)
{
    double out = 1e30;
    for (int64_t l = 0; l < loops; l++) {
        double t0 = now_ns();
        for (int64_t i = 0; i < iters; i++)
            body();
        out = std::min(out, (now_ns() - t0) / double(iters));
    }
    return out;
}

// part: 0 raw_alloc + raw_delete, 1 allocate + deleter, 2 at::empty + free,
// 3 current device + stream
double pairs(int64_t part, int64_t size, int64_t iters, int64_t loops)
{
    pybind11::gil_scoped_release nogil;
    CCA::CUDAAllocator *a = CCA::get();
    auto opts = at::TensorOptions().dtype(at::kByte).device(at::kCUDA);
    switch (part) {
    case 0:
        return best(iters, loops, [&] { a->raw_delete(a->raw_alloc(size)); });
    case 1:
        return best(iters, loops, [&] { c10::DataPtr p = a->allocate(size); });
    case 2:
        return best(iters, loops, [&] { at::Tensor t = at::empty({size}, opts); });
    default:
        return best(iters, loops, [&] {
            c10::DeviceIndex d = c10::cuda::current_device();
            volatile cudaStream_t s = c10::cuda::getCurrentCUDAStream(d).stream();
            (void)s;
        });
    }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("pairs", &pairs); }
"""

PARTS = ("raw_alloc + raw_delete", "allocate + its deleter", "at::empty + free")


def load_ext(build_dir: str):
    from torch.utils.cpp_extension import load_inline

    os.makedirs(build_dir, exist_ok=True)
    return load_inline("bridge_torch_pair_parts", cpp_sources=[CPP], extra_cflags=["-O2"],
                       build_directory=build_dir, with_cuda=True)  # fmt: skip


def worker(args: argparse.Namespace) -> dict:
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    if args.worker == "bridge":
        import bridge

        bridge.unify(cupy=False, torch=True)
    import torch

    ext = load_ext(args.build_dir)
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    empty, u8, sync = torch.empty, torch.uint8, torch.cuda.synchronize
    gc.disable()
    out: dict = {"allocator": args.worker, "torch": torch.__version__, "ns_per_pair": {}}
    it, loops = args.iters, 7
    out["ns_per_pair"]["current device + stream"] = round(ext.pairs(3, 0, it, loops), 1)
    for n in SIZES:
        row = {}
        for k, name in enumerate(PARTS):
            ext.pairs(k, n, 1000, 1)  # warm: the block is cached
            row[name] = round(ext.pairs(k, n, it, loops), 1)

        def py(k: int, n: int = n) -> None:
            for _ in range(k):
                empty(n, dtype=u8, device="cuda")
            sync()

        py(1000)
        times = []
        for _ in range(loops):
            t0 = time.perf_counter_ns()
            py(it)
            times.append((time.perf_counter_ns() - t0) / it)
        row["torch.empty + free"] = round(min(times), 1)
        out["ns_per_pair"][str(n)] = row
    if args.worker == "bridge":
        out["backend"] = torch.cuda.get_allocator_backend()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", type=int, default=None)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--build-dir",
        default=os.path.join(
            os.path.expanduser("~"), ".cache", "bridge-probes", "torch_pair_parts"
        ),
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", choices=("native", "bridge"), default=None)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    pin = ["--cpu", str(args.cpu)] if args.cpu is not None else []
    me = [
        sys.executable,
        os.path.abspath(__file__),
        "--iters",
        str(args.iters),
        "--build-dir",
        args.build_dir,
        *pin,
    ]
    runs: dict = {"native": [], "bridge": []}
    for r in range(args.rounds):
        order = ("native", "bridge") if r % 2 == 0 else ("bridge", "native")
        for cfg in order:
            p = subprocess.run(me + ["--worker", cfg], capture_output=True, text=True, timeout=600)
            if p.returncode != 0:
                raise SystemExit(f"{cfg} worker failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
            runs[cfg].append(json.loads(p.stdout.strip().splitlines()[-1]))
    summary: dict = {}
    for cfg, rs in runs.items():
        keys = rs[0]["ns_per_pair"]
        summary[cfg] = {}
        for k, v in keys.items():
            if isinstance(v, dict):
                summary[cfg][k] = {
                    p: round(statistics.median(x["ns_per_pair"][k][p] for x in rs), 1) for p in v
                }
            else:
                summary[cfg][k] = round(statistics.median(x["ns_per_pair"][k] for x in rs), 1)
    result = {
        "bench": "torch_pair_parts",
        "rounds": args.rounds,
        "iters": args.iters,
        "cpu": args.cpu,
        "median_of_processes": summary,
        "runs": runs,
    }
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
