# SPDX-License-Identifier: Apache-2.0
"""JAX on the shared pool: XLA's ``cuda_async`` allocator draws from the default pool.

JAX is configured through its environment before its GPU backend starts
(``XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async``, no preallocation). XLA writes the
pool's release threshold when the backend starts (0 without preallocation,
measured), so the bridge starts the backend and then re-asserts the pool
attributes it owns. XLA enforces no byte limit of its own on that pool: the
bridge's budget sees JAX's bytes (the pool's used bytes beyond the ledger) and
refuses CuPy and torch allocations that would pass it; JAX's own allocations
are not refused by the bridge and fail with XLA's ``RESOURCE_EXHAUSTED`` when
the device is full.

Hard partition (``install(..., partition=...)``, or ``bridge.unify(jax=True,
jax_memory="8GiB")``): JAX gets its own BFC arena of that size, preallocated
and capped by XLA; the shared pool's budget shrinks by the same amount. JAX
cannot then borrow the others' idle memory, nor they JAX's: the trade-off is
isolation for sharing.
"""

from __future__ import annotations

__all__ = ["install", "installed", "backend_started", "jax_bytes", "SHARED_ENV"]

import os
import sys
import warnings
from collections.abc import Iterable

from bridge import _runtime
from bridge._errors import BridgeError, check
from bridge._runtime import core
from bridge.pool import register_attribution

SHARED_ENV = {"XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
_installed = False
_partition: int | None = None


def installed() -> bool:
    """Whether JAX was configured by the bridge."""
    return _installed


def backend_started() -> bool:
    """Whether JAX's backends are already initialized (without starting them)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
    except ImportError:
        return True  # a JAX we cannot inspect: assume the worst
    started = getattr(xla_bridge, "backends_are_initialized", None)
    if callable(started):
        return bool(started())
    return bool(getattr(xla_bridge, "_backends", {}))


def _conflicts(partition: int | None) -> list[str]:
    problems = []
    if partition is None:
        for var, want in SHARED_ENV.items():
            have = os.environ.get(var)
            if have is not None and have.lower() != want:
                problems.append(f"{var}={have} (the shared pool needs {want})")
    else:
        have = os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR")
        if have not in (None, "default", "bfc"):
            problems.append(
                f"XLA_PYTHON_CLIENT_ALLOCATOR={have} (a hard partition uses JAX's own BFC arena)"
            )
    return problems


def jax_bytes(device: int) -> int | None:
    """JAX's live bytes on a CUDA device, from JAX's own ``memory_stats()``."""
    if not backend_started():
        return 0
    import jax

    for d in jax.local_devices():
        if d.platform == "gpu" and getattr(d, "local_hardware_id", d.id) == device:
            ms = d.memory_stats() or {}
            if "bytes_in_use" in ms:
                return int(ms["bytes_in_use"])
    return None


def install(devices: Iterable[int], *, partition: int | None = None) -> None:
    """Configure XLA for the shared pool (or a hard partition), start JAX, re-assert the pool."""
    global _installed, _partition
    if _installed:
        return
    devices = list(devices)
    problems = _conflicts(partition)
    if problems:
        raise BridgeError(
            "bridge.unify(jax=True): these settings conflict with the bridge: "
            + "; ".join(problems)
            + ". Unset them (the bridge sets what JAX needs) and call "
            "bridge.unify() before JAX starts."
        )
    if backend_started():
        raise BridgeError(
            "call bridge.unify(jax=True) before JAX's GPU backend starts: it has already "
            "started (a jax array, jax.devices() or a jitted call ran). Move bridge.unify() "
            "to the top of your program."
        )
    if "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ and partition is None:
        warnings.warn(
            "XLA_PYTHON_CLIENT_MEM_FRACTION has no effect with the shared pool "
            "(XLA's cuda_async allocator enforces no limit); the bridge budget "
            "applies instead.",
            stacklevel=3,
        )
    for d in devices:
        _runtime.ensure_device(d)
    if partition is None:
        os.environ.update(SHARED_ENV)
        # XLA allocates from the pool itself and cannot ask the bridge to
        # flush: a freed block the bridge kept cached would be memory JAX
        # cannot have.  No cache (unless BRIDGE_CACHE_LIMIT asks for one):
        # what CuPy and torch free goes back to the pool at once.
        if os.environ.get(_runtime.CACHE_LIMIT_ENV) is None:
            for d in devices:
                check(core.set_cache(d, 0), what="turning the cache off for JAX", device=d)
    else:
        for d in devices:
            rc, raw = core.stats(d)
            check(rc, what="reading the device", device=d)
            if partition >= raw["total"]:
                raise ValueError(
                    f"jax partition of {partition} bytes is not below the "
                    f"device's {raw['total']} bytes"
                )
            os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
            os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{partition / raw['total']:.6f}"
            if raw["limit"]:
                check(
                    core.set_limit(d, max(1, raw["limit"] - partition)),
                    what="shrinking the budget by JAX's partition",
                    device=d,
                )
        os.environ.pop("XLA_PYTHON_CLIENT_ALLOCATOR", None)
    import jax
    import jax.numpy as jnp

    # Start the backend and its allocator now, so that what XLA writes into the
    # pool's attributes at start-up is overwritten below, not later.
    for dev in jax.devices("gpu"):
        jnp.zeros((1,), device=dev).block_until_ready()
    for d in devices:
        check(core.reassert(d), what="re-asserting the pool after JAX started", device=d)
    if partition is None:
        register_attribution("jax", jax_bytes)
    _partition = partition
    _installed = True
