# SPDX-License-Identifier: Apache-2.0
"""What the cluster tests run inside Dask workers and Ray actors (tests/clusters/).

Imported by name in the workers (the tests put tests/ on their PYTHONPATH); the
blocks a worker holds stay in this module until it releases them.
"""

from __future__ import annotations

import importlib
import os

import bridge

_held: list[object] = []


def figures(device: int = 0) -> dict:
    """This process's bridge as a test checks it: pid, devices, budget, share."""
    b = importlib.import_module("bridge.unify").current()  # the Bridge, or None
    s = bridge.stats(device)
    return {
        "pid": os.getpid(),
        "devices": list(b.devices) if b is not None else None,
        "limit": s.limit,
        "share": dict(s.share) if s.share is not None else None,
        "held": sum(getattr(p, "size", 0) for p in _held),
    }


def hold(nbytes: int, device: int = 0) -> str:
    """Allocate and keep ``nbytes``: "ok", or the OOM's type and message."""
    try:
        _held.append(bridge.pool(device).malloc(nbytes))
    except bridge.OutOfMemoryError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def release() -> int:
    """Free what this process holds; how many blocks that was."""
    n = len(_held)
    _held.clear()
    return n


def pid() -> int:
    return os.getpid()


class Holder:
    """A Ray actor (``ray.remote(num_gpus=...)(Holder)``) that holds memory on demand."""

    def figures(self) -> dict:
        from bridge import ray as bridge_ray

        # what the bridge's setup saw: Ray had set CUDA_VISIBLE_DEVICES before it
        return dict(figures(), setup=dict(bridge_ray.last_setup))

    def hold(self, nbytes: int) -> str:
        return hold(nbytes)

    def release(self) -> int:
        return release()
