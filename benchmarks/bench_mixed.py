# SPDX-License-Identifier: Apache-2.0
"""Mixed phases: CuPy holds N GiB and frees it, then torch asks for N GiB.

    python3 benchmarks/bench_mixed.py --mode bridge --fraction 0.572 --json r.json

native: CuPy's MemoryPool and torch's caching allocator (CuPy's pool keeps the
freed N GiB cached, so torch may run out of memory: at N = 80 on a 140 GiB
card it should: that is recorded as the outcome, not a failure of the run).
bridge: ``bridge.unify(cupy=True, torch=True)``: both on the default pool.

Device memory used is ``total - free`` of ``torch.cuda.mem_get_info`` (the
whole device, contexts included). Each phase records ``used`` and ``live``
(bytes of arrays alive then); ``used_over_live`` is ``(used - baseline) / live``
where ``baseline`` is ``used`` after both frameworks started CUDA and before
the first large array, and ``raw_used_over_live`` is ``used / live``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import GIB, error_record, run_guarded  # noqa: E402

MODES = ("native", "bridge")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=MODES, required=True)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--gib", type=float, default=None, help="N, in GiB")
    g.add_argument("--fraction", type=float, default=0.572,
                   help="N as a fraction of the device's memory (default 0.572: 80 GiB of 139.8)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.gib is not None and args.gib <= 0 or not 0 < args.fraction < 1:
        p.error("--gib must be > 0 and --fraction in (0, 1)")
    base = {"bench": "mixed", "mode": args.mode}

    def body(result: dict) -> None:
        if args.mode == "bridge":
            import bridge

            bridge.unify(cupy=True, torch=True)
        import cupy
        import torch

        result["info"] = {"torch": torch.__version__, "cupy": cupy.__version__}
        torch.zeros(1, device="cuda")  # both contexts and allocators up
        cupy.zeros(1, dtype=cupy.uint8)

        def sync() -> None:
            cupy.cuda.Device().synchronize()
            torch.cuda.synchronize()

        def used() -> int:
            free, total = torch.cuda.mem_get_info()
            return int(total - free)

        sync()
        free, total = torch.cuda.mem_get_info()
        nbytes = int((args.gib * GIB) if args.gib is not None else round(total * args.fraction
                                                                            / GIB) * GIB)
        baseline = used()
        result.update(total=int(total), n_bytes=nbytes, n_gib=nbytes / GIB, baseline_used=baseline,
                      phases=[])

        def phase(name: str, live: int) -> dict:
            sync()
            u = used()
            ph = {"phase": name, "used": u, "live": live,
                  "used_gib": round(u / GIB, 3), "live_gib": round(live / GIB, 3)}
            if live:
                ph["used_over_live"] = round((u - baseline) / live, 4)
                ph["raw_used_over_live"] = round(u / live, 4)
            result["phases"].append(ph)
            return ph

        a = cupy.empty(nbytes, dtype=cupy.uint8)
        a.fill(1)
        phase("cupy holds N", nbytes)
        del a
        phase("cupy freed", 0)
        try:
            t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            t.fill_(2)
        except Exception as exc:  # noqa: BLE001 - OOM is an outcome here
            result["outcome"] = "oom"
            result["oom"] = error_record(exc)["error"][:600]
            try:
                result["used_at_oom"] = used()
            except Exception:  # noqa: BLE001
                pass
            return
        final = phase("torch holds N", nbytes)
        result["outcome"] = "ok"
        result["used_over_live"] = final["used_over_live"]
        result["raw_used_over_live"] = final["raw_used_over_live"]
        if args.mode == "bridge":
            try:
                import bridge

                s = bridge.stats(0)
                result["bridge_stats"] = {"used": s.used, "reserved": s.reserved,
                                          "by_framework": s.by_framework}
            except Exception as exc:  # noqa: BLE001 - informative only
                result["bridge_stats"] = str(exc)
        del t
        phase("torch freed", 0)

    return run_guarded(args.json, base, body)


if __name__ == "__main__":
    sys.exit(main())
