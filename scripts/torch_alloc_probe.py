# SPDX-License-Identifier: Apache-2.0
"""Where does torch's alloc+free time go under the bridge? (GPU diagnostic)

    python scripts/torch_alloc_probe.py native|native-inductor|bridge|bridge-nocache

``native-inductor`` is native torch after importing inductor's config, as
``unify(torch=True)`` does (to turn CUDA graph trees off): whether that import
alone changes torch's per-op cost (the bridge / native ratio of the allocation
benchmark went from 0.88 to 1.05-1.16 between 2026-11-29 and 2026-11-30 while
the core's own cache-hit pair moved by 5 ns).
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    mode = sys.argv[1]
    if mode.startswith("bridge"):
        import bridge

        bridge.unify(cupy=False, torch=True)
        if mode == "bridge-nocache":
            from bridge._runtime import core

            core.set_cache(0, 0)
    import torch

    if mode == "native-inductor":
        from torch._inductor import config as inductor_config

        inductor_config.triton.cudagraph_trees = False
    out = {"mode": mode}
    for nbytes in (512, 1 << 20, 64 << 20):
        for _ in range(2000):
            torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        best = float("inf")
        for _ in range(5):
            n = 50000
            t = time.perf_counter()
            for _ in range(n):
                torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            best = min(best, (time.perf_counter() - t) / n * 1e9)
        out[f"ns_{nbytes}"] = round(best)
        if mode.startswith("bridge"):
            from bridge._runtime import core

            out[f"hits_after_{nbytes}"] = core.stats(0)[1]["num_cache_hits"]
    x = torch.empty(1, device="cuda")
    n = 50000
    t = time.perf_counter()
    for _ in range(n):
        x.add_(1)  # a tensor op with no allocation: the dispatch floor
    out["ns_add_"] = round((time.perf_counter() - t) / n * 1e9)
    if mode.startswith("bridge"):
        import bridge

        s = bridge.stats(0)
        out.update(num_allocs=s.num_allocs, cached=s.cached,
                   hits=bridge._runtime.core.stats(0)[1]["num_cache_hits"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
