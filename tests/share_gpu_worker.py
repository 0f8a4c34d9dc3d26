# SPDX-License-Identifier: Apache-2.0
"""A process of the GPU share tests (tests/gpu/test_gpu_share.py): torch and CuPy.

Environment: MODE ("bridge": unify(cupy=True, torch=True, budget=BUDGET,
share=SHARE); "native": the frameworks' own allocators). It answers one JSON
line per command read on stdin (see OPS); the first line it prints is
{"ready": true, "pid": ...} once both frameworks have their CUDA context.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

MODE = os.environ.get("MODE", "bridge")
if MODE == "bridge":
    import bridge

    bridge.unify(cupy=True, torch=True, budget=os.environ["BUDGET"], share=os.environ["SHARE"])

import cupy  # noqa: E402
import torch  # noqa: E402

MIB = 1 << 20
held: list = []


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (torch.cuda.OutOfMemoryError, cupy.cuda.memory.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and str(exc).startswith("CUDA out of memory.")


def _alloc(size: int, fw: str):
    """A block of `size` bytes from torch or CuPy, written once (so it is real)."""
    if fw == "torch":
        t = torch.empty(size, dtype=torch.uint8, device="cuda")
        t.fill_(1)
        return t
    a = cupy.empty(size, dtype=cupy.uint8)
    a.fill(1)
    return a


def _sync() -> None:
    torch.cuda.synchronize()
    cupy.cuda.Device().synchronize()


def op_hold(size: int, fw: str) -> dict:
    try:
        held.append(_alloc(size, fw))
    except Exception as exc:  # noqa: BLE001
        if not _is_oom(exc):
            raise
        return {"ok": False}
    _sync()
    return {"ok": True}


def op_free() -> dict:
    held.clear()  # to the pool: the bridge keeps it until asked to trim
    _sync()
    return {"ok": True}


def op_alloc_until(size: int, fw: str, seconds: float) -> dict:
    t0 = time.monotonic()
    tries = 0
    while True:
        tries += 1
        try:
            held.append(_alloc(size, fw))
            _sync()
            return {"ok": True, "elapsed": time.monotonic() - t0, "tries": tries}
        except Exception as exc:  # noqa: BLE001
            if not _is_oom(exc):
                raise
        if time.monotonic() - t0 > seconds:
            return {"ok": False, "elapsed": time.monotonic() - t0, "tries": tries}
        time.sleep(0.01)


def op_edge(seconds: float, seed: int, low: int, high: int) -> dict:
    """Allocate (torch and CuPy in turn) until refused, free some, for `seconds`."""
    rng = random.Random(seed)
    mine: list = []
    ok = ooms = 0
    peak = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if mine and rng.random() < 0.4:
            mine.pop(rng.randrange(len(mine)))
            continue
        size = rng.randrange(low, high + 1) // MIB * MIB
        try:
            mine.append(_alloc(size, "torch" if rng.random() < 0.5 else "cupy"))
            ok += 1
            peak = max(peak, sum(int(x.nbytes) for x in mine))
        except Exception as exc:  # noqa: BLE001
            if not _is_oom(exc):
                raise
            ooms += 1
            if mine:
                mine.pop(rng.randrange(len(mine)))
    mine.clear()
    _sync()
    return {"ok": ok, "ooms": ooms, "peak": peak}


def op_stats() -> dict:
    if MODE != "bridge":
        return {}
    s = bridge.stats(0)
    return {"share": s.share, "by_framework": s.by_framework, "reserved": s.reserved}


def op_spin(size: int) -> dict:
    """torch blocks of `size` allocated and dropped until killed (answers once first)."""
    print(json.dumps({"ok": True}), flush=True)
    while True:
        try:
            _alloc(size, "torch")
        except Exception as exc:  # noqa: BLE001
            if not _is_oom(exc):
                raise


OPS = {
    "hold": op_hold,
    "free": op_free,
    "alloc_until": op_alloc_until,
    "edge": op_edge,
    "stats": op_stats,
    "spin": op_spin,
}


def main() -> None:
    # the contexts, and the kernels the commands use (loaded on first use:
    # memory outside the pool, measured by the test before it starts)
    _alloc(MIB, "torch")
    _alloc(MIB, "cupy")
    _sync()
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            res = OPS[op](**cmd)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            res = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
