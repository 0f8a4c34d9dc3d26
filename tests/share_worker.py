# SPDX-License-Identifier: Apache-2.0
"""A member process for the share tests (tests/core/test_share.py), on the stand-in.

It reads one JSON command per line on stdin and answers one JSON line on
stdout: ``{"op": "join", "name": ..., "budget": ...}``, ``alloc``, ``free``,
``trim``, ``stats``, ``mem_info``, ``unify`` (bridge.unify(share=...), its framework
refusing or not), ``hammer`` (allocate and free at the budget's edge for a
while, checking an oracle counter), ``spin`` (allocate and free until killed).
WORKER_DEVICE picks the device (default 0).
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import struct
import sys
import time

from bridge import _runtime, share
from bridge._errors import BridgeError, Status
from bridge._runtime import core

DEV = int(os.environ.get("WORKER_DEVICE", "0"))
STREAM = 0  # the legacy default stream: its frees may be cached
live: dict[int, int] = {}


def counter_add(path: str, delta: int) -> int:
    """Add to the oracle: bytes the members hold as their allocations returned
    (added after an allocation succeeded, taken off before the free).  Under
    flock, so the figure is exact across the processes."""
    with open(path, "r+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        raw = f.read(8)
        value = (struct.unpack("<q", raw)[0] if len(raw) == 8 else 0) + delta
        f.seek(0)
        f.write(struct.pack("<q", value))
        f.flush()
        fcntl.flock(f, fcntl.LOCK_UN)
    return value


def op_join(name: str, budget: int = 0) -> dict:
    share.join(DEV, name, budget)
    return {"ok": True, "pid": os.getpid()}


def op_alloc(size: int) -> dict:
    rc, p = core.alloc(DEV, size, STREAM, core.TAG_CUPY)
    if rc == Status.OK:
        live[p] = size
    return {"rc": rc, "ptr": p}


def op_free(ptr: int | None = None) -> dict:
    for p in [ptr] if ptr is not None else list(live):
        core.free(p)
        live.pop(p, None)
    return {"ok": True}


def op_trim() -> dict:
    return {"rc": core.trim(DEV, 0)}


def op_stats() -> dict:
    rc, raw = core.stats(DEV)
    return {
        "share": share.membership(DEV),
        "pool_reserved": raw["pool_reserved"],
        "carve_on": raw["carve_on"],
        "carve_held": raw["carve_held"],
        "cached": raw["cached"],
    }


def op_alloc_until(size: int, seconds: float) -> dict:
    """Try to allocate until it succeeds or the time is up; how long it took."""
    t0 = time.monotonic()
    tries = 0
    while True:
        tries += 1
        rc, p = core.alloc(DEV, size, STREAM, core.TAG_CUPY)
        if rc == Status.OK:
            live[p] = size
            return {"rc": rc, "elapsed": time.monotonic() - t0, "tries": tries}
        if time.monotonic() - t0 > seconds:
            return {"rc": rc, "elapsed": time.monotonic() - t0, "tries": tries}
        time.sleep(0.01)


def op_hammer(seconds: float, block: int, budget: int, counter: str, seed: int) -> dict:
    rng = random.Random(seed)
    mine: list[int] = []
    ok = refused = violations = 0
    high = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if mine and (rng.random() < 0.45 or len(mine) * block >= budget):
            p = mine.pop(rng.randrange(len(mine)))
            counter_add(counter, -block)
            core.free(p)
            continue
        rc, p = core.alloc(DEV, block, STREAM, core.TAG_CUPY)
        if rc != Status.OK:
            refused += 1
            continue
        ok += 1
        mine.append(p)
        held = counter_add(counter, block)
        high = max(high, held)
        if held > budget:
            violations += 1
    for p in mine:
        counter_add(counter, -block)
        core.free(p)
    return {"ok": ok, "refused": refused, "violations": violations, "high": high}


def op_spin(size: int) -> dict:
    """Allocate and free blocks of `size` until killed; answers once first."""
    rc, p = core.alloc(DEV, size, STREAM, core.TAG_CUPY)
    print(json.dumps({"rc": rc}), flush=True)
    if rc == Status.OK:
        core.free(p)
    while True:
        rc, p = core.alloc(DEV, size, STREAM, core.TAG_CUPY)
        if rc == Status.OK:
            core.free(p)


def op_exec() -> dict:
    """Replace this process's image (os.execv): same pid, same start time."""
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, os.path.abspath(__file__)])
    return {}  # not reached: the new image answers with its "ready" line


def op_alloc_wait(size: int, seconds: float) -> dict:
    """One allocation that may wait `seconds` for memory (bridge.waiting)."""
    core.set_thread_wait(True, seconds, 0)
    t0 = time.monotonic()
    try:
        rc, p = core.alloc(DEV, size, STREAM, core.TAG_CUPY)
    finally:
        core.set_thread_wait(False, 0.0, 0)
    elapsed = time.monotonic() - t0
    if rc == Status.OK:
        live[p] = size
    return {"rc": rc, "elapsed": elapsed, "outcome": core.last_wait()[1]}


def op_mem_info() -> dict:
    """bridge.mem_get_info's figures: what torch.cuda.mem_get_info and CuPy's memGetInfo
    answer under the budget views."""
    from bridge import views

    free, total = views.mem_get_info(DEV)
    return {"free": free, "total": total, "view": views.budget_view(DEV)}


class _Refuses:
    """An adapter whose install refuses in a way no too_late() can tell ahead (torch
    refusing the allocator swap, JAX's start failing)."""

    def install(self, devices: list[int], **kw: object) -> None:
        raise BridgeError("the framework refused as it was installed")


def op_unify(name: str | None, budget: int = 0, refuse: bool = False, ipc: bool = False) -> dict:
    """bridge.unify(share=name) of this process's device (``refuse``: with a torch whose
    install refuses, after the call joined the share): what refused it, and this process's
    membership, exportable pool, cache and budget after it."""
    import importlib

    import bridge

    unify_mod = importlib.import_module("bridge.unify")
    if refuse:
        unify_mod._adapter = lambda fw: _Refuses()  # type: ignore[assignment]
    refused = None
    try:
        bridge.unify(
            cupy=False,
            torch=refuse,
            device=DEV,
            share=name,
            budget=budget or None,
            ipc=ipc,
        )
    except BridgeError as exc:
        refused = str(exc)
    rc, raw = core.stats(DEV)
    return {
        "refused": refused,
        "share": share.membership(DEV),
        "ipc": core.ipc_enabled(DEV),
        "carve_on": raw["carve_on"],
        "limit": raw["limit"],
    }


OPS = {
    "join": op_join,
    "unify": op_unify,
    "alloc": op_alloc,
    "free": op_free,
    "trim": op_trim,
    "stats": op_stats,
    "alloc_until": op_alloc_until,
    "hammer": op_hammer,
    "spin": op_spin,
    "exec": op_exec,
    "alloc_wait": op_alloc_wait,
    "mem_info": op_mem_info,
}


def main() -> None:
    _runtime.ensure_device(DEV)
    core.set_cache(DEV, 1 << 30)
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
