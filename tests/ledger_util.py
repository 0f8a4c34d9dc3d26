# SPDX-License-Identifier: Apache-2.0
"""Shared by the ledger tests: stand-in handles and counters, figures, and a
Ledger that frees at teardown what a test left (the `led` fixture, conftest.py)."""

from __future__ import annotations

import contextlib
import ctypes
import threading

from bridge._errors import Status
from bridge._runtime import core

DEV = 0
MIB = 1 << 20
GIB = 1 << 30
TAG_OTHER, TAG_CUPY, TAG_TORCH = core.TAG_OTHER, core.TAG_CUPY, core.TAG_TORCH
# Stream handles: the stand-in never dereferences them, it only compares them.
S1, S2, S3 = 0xA1000, 0xA2000, 0xA3000
# stand-in counters (standin_counter)
C_ALLOC, C_FREE, C_SYNC, C_WAIT, C_RECORD, C_SETCTX, C_TRIM, C_MODE = range(8)
GRAPH_BEGIN, GRAPH_END, GRAPH_RELEASE = 0, 1, 2


def bridge_alloc_fn(keep_gil: bool):
    """The core's bridge_alloc through ctypes, called as torch calls it: from a Python
    thread with the GIL kept (PyDLL), or as its autograd thread does, without it (CDLL)."""
    lib = (ctypes.PyDLL if keep_gil else ctypes.CDLL)(core.__file__)
    fn = lib.bridge_alloc
    fn.argtypes = [
        ctypes.c_int,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_void_p),
    ]
    fn.restype = ctypes.c_int
    return fn


def stats(dev: int = DEV) -> dict:
    rc, s = core.stats(dev)
    assert rc == Status.OK
    return s


def alloc(size: int, stream: int = 0, tag: int = TAG_TORCH, dev: int = DEV) -> int:
    """A block of `size` on `stream` for `tag`, which must be served."""
    rc, p = core.alloc(dev, size, stream, tag)
    assert rc == Status.OK and p
    return p


@contextlib.contextmanager
def at_budget(limit: int, dev: int = DEV):
    """The device's budget at `limit` for the block; after it none, and the pool trimmed."""
    core.set_limit(dev, limit)
    try:
        yield
    finally:
        core.set_limit(dev, 0)
        core.trim(dev, 0)


def others(dev: int = DEV) -> int:
    rc, n = core.others(dev)
    assert rc == Status.OK
    return n


class Ledger:
    """Allocations of one test: freed at teardown if the test did not."""

    def __init__(self, standin):
        self.sd = standin
        self.live: set[int] = set()
        self.foreign: dict[int, int] = {}
        self.graphs: list[tuple[int, int, int]] = []

    def alloc(self, size, stream=S1, tag=TAG_CUPY, dev=DEV):
        rc, p = core.alloc(dev, size, stream, tag)
        if rc == Status.OK and p:
            self.live.add(p)
        return rc, p

    def ok(self, size, stream=S1, tag=TAG_CUPY, dev=DEV) -> int:
        rc, p = self.alloc(size, stream, tag, dev)
        assert rc == Status.OK, Status(rc).name
        assert p != 0
        return p

    def free(self, p):
        core.free(p)
        self.live.discard(p)

    def add_foreign(self, dev, n):
        self.sd.standin_add_foreign(dev, n)
        self.foreign[dev] = self.foreign.get(dev, 0) + n

    def graph(self, op, dev, id0, id1):
        if op == GRAPH_BEGIN:
            self.graphs.append((dev, id0, id1))
        return core.graph(op, dev, id0, id1)

    def counter(self, which) -> int:
        return self.sd.standin_counter(which)

    def close(self):
        self.sd.standin_set_capturing(None)
        for dev, id0, id1 in self.graphs:
            core.graph(GRAPH_END, dev, id0, id1)
            core.graph(GRAPH_RELEASE, dev, id0, id1)
        for p in list(self.live):
            core.free(p)
        for dev in (0, 1):  # complete frees deferred by a capture
            rc, p = core.alloc(dev, 1, S1, TAG_OTHER)
            core.free(p)
        for dev, n in self.foreign.items():
            self.sd.standin_add_foreign(dev, -n)
        for dev in (0, 1):
            self.sd.standin_sync_all(dev)


def _in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=60)
    if "error" in out:
        raise out["error"]
    return out["value"]


def _make_current(sd, device):
    ctx = ctypes.c_void_p()
    assert sd.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device) == 0
    assert sd.cuCtxSetCurrent(ctx) == 0
