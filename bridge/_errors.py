# SPDX-License-Identifier: Apache-2.0
"""Errors of bridge, and the one place where core status codes become them."""

from __future__ import annotations

__all__ = [
    "BridgeError",
    "OutOfMemoryError",
    "Status",
    "check",
    "format_bytes",
    "oom_message",
    "set_figures",
    "set_wait_note",
]

import enum
from collections.abc import Callable
from typing import Any


class BridgeError(RuntimeError):
    """The bridge is in the wrong state for the call, or no GPU stack is usable.

    The message says what to do.
    """


class OutOfMemoryError(MemoryError):
    """A request would pass the device's budget, or the device is full.

    Frameworks raise their own OOM error instead (CuPy's
    ``OutOfMemoryError``, torch's ``CUDA out of memory.``); this one is for
    allocations made through ``bridge`` itself.

    Attributes
    ----------
    device : int
    size : int
        Bytes requested.
    limit : int
        The budget in bytes (0 = none).
    by_framework : dict[str, int]
        Live bytes per framework when the request failed.
    """

    def __init__(
        self,
        message: str,
        *,
        device: int = 0,
        size: int = 0,
        limit: int = 0,
        by_framework: dict[str, int] | None = None,
    ) -> None:
        super().__init__(message)
        self.device = device
        self.size = size
        self.limit = limit
        self.by_framework = dict(by_framework or {})


class Status(enum.IntEnum):
    """Status codes of the compiled core (bridge/_native/bridge.h)."""

    OK = 0
    BUDGET = 1
    OOM = 2
    DRIVER = 3
    NODRIVER = 4
    NOPOOLS = 5
    DEVICE = 6
    INVALID = 7
    TAG_LIMIT = 8
    NOTINIT = 9
    FORKED = 10
    SHARE = 11
    MISS = 12  # bridge_alloc_cached / bridge_free_cached: not from the cache (never check()ed)
    IPC = 13  # a block cannot be shared or imported (core.ipc_error() says why)


OOM_STATUSES = frozenset({Status.BUDGET, Status.OOM, Status.TAG_LIMIT})
#: A tag's cap of no bytes (bridge.h's BRIDGE_TAG_LIMIT_ZERO; a limit of 0 is no cap).
TAG_LIMIT_ZERO = (1 << 64) - 1


def format_bytes(n: int) -> str:
    """``1536`` -> ``'1.50 KiB'``: bytes in the largest binary unit below them."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _driver_error() -> str:
    import bridge._core as _core

    code, name = _core.last_driver_error()
    return f"{name} (code {code})"


def check(rc: int, *, what: str, device: int | None = None) -> None:
    """Raise the exception a core status code stands for; nothing for OK."""
    if rc == Status.OK:
        return
    where = f" on device {device}" if device is not None else ""
    if rc == Status.NODRIVER:
        import bridge._core as _core

        raise BridgeError(
            f"{what}: no usable CUDA driver ({_core.load_error()}). `nvidia-smi` shows the "
            "GPUs and the driver this machine has; `python -m bridge doctor` shows what the "
            "bridge found."
        )
    if rc == Status.NOPOOLS:
        raise BridgeError(
            f"{what}: the CUDA driver has no stream-ordered memory pools{where} "
            "(CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED is 0): the GPU runs under a "
            "virtualization or on a platform that disables them. Run on a GPU whose "
            '`bridge doctor` line says "memory pools: yes".'
        )
    if rc == Status.DEVICE:
        raise BridgeError(
            f"{what}: no such CUDA device{where}, or it is not set up. "
            "Pass a device between 0 and the number of visible GPUs minus one."
        )
    if rc == Status.FORKED:
        raise BridgeError(
            f"{what}: this process was forked from one that had started CUDA, and CUDA cannot "
            "be used in a forked child. Start workers with the 'spawn' method "
            "(multiprocessing.set_start_method('spawn'), or DataLoader(multiprocessing_context="
            "'spawn')), or allocate GPU and pinned memory in the parent."
        )
    if rc == Status.SHARE:
        import bridge._core as _core

        raise BridgeError(f"{what}{where}: {_core.share_error()}")
    if rc == Status.IPC:
        import bridge._core as _core

        raise BridgeError(f"{what}{where}: {_core.ipc_error()}")
    if rc == Status.NOTINIT:
        raise BridgeError(f"{what}: the CUDA driver is not loaded yet; call bridge.unify() first.")
    if rc == Status.INVALID:
        raise ValueError(f"{what}: invalid argument")
    if rc == Status.DRIVER:
        raise BridgeError(f"{what}{where}: CUDA driver error {_driver_error()}.")
    raise BridgeError(f"{what}{where}: core status {rc}")


# How an OOM message learns what a device holds: bridge.pool imports this module,
# so this module cannot import bridge.pool; pool hands its snapshot function in
# when it is imported (set_figures), and a message without it says "unknown".
_figures: Callable[[int], Any] | None = None


# What the calling thread's last refused allocation did about waiting
# (bridge._wait hands it in, as bridge.pool hands in the figures).
_wait_note: Callable[[int], str] | None = None


def set_wait_note(fn: Callable[[int], str] | None) -> None:
    """Where :func:`oom_message` reads what a wait did: ``fn(device)`` -> a sentence or ``""``."""
    global _wait_note
    _wait_note = fn


def set_figures(fn: Callable[[int], Any] | None) -> None:
    """Where :func:`oom_message` reads a device's figures: ``fn(device)`` -> ``bridge.Stats``."""
    global _figures
    _figures = fn


def oom_message(device: int, size: int, rc: int, *, framework: str) -> str:
    """The text every OOM carries: device, request, budget, each framework's bytes."""
    try:
        if _figures is None:
            raise LookupError("no figures")
        s = _figures(device)
        held = ", ".join(f"{k} {format_bytes(v)}" for k, v in s.by_framework.items())
        budget = format_bytes(s.limit) if s.limit else "none"
        tail = f"pool reserved {format_bytes(s.reserved)} of {format_bytes(s.total)}"
        cap = next((t["limit"] for t in s.tags if t.get("name") == framework), 0)
        cap = 0 if cap == TAG_LIMIT_ZERO else cap  # the cap of no bytes (fraction 0.0)
        share = s.share
    except Exception:  # noqa: BLE001 - the message must not fail
        held, budget, tail, cap, share = "unknown", "unknown", "", 0, None
    if rc == Status.TAG_LIMIT:
        why = (
            f"{framework}'s share is capped at {format_bytes(cap)} "
            "(torch.cuda.set_per_process_memory_fraction)"
        )
    elif rc == Status.BUDGET and share:
        why = (
            f"the share {share['name']!r} ({share['members']} "
            f"process{'' if share['members'] == 1 else 'es'} on this GPU) has a "
            f"budget of {format_bytes(share['budget'])}, of which the others claim "
            f"{format_bytes(max(0, share['group'] - share['claim']))} and this process "
            f"{format_bytes(share['claim'])} (`python -m bridge stats` lists them)"
        )
    elif rc == Status.BUDGET:
        why = f"the bridge budget is {budget}"
    else:
        why = f"the device is full (bridge budget {budget})"
    try:
        waited = _wait_note(device) if _wait_note is not None else ""
    except Exception:  # noqa: BLE001 - the message must not fail
        waited = ""
    waited = f" {waited}" if waited else ""
    return (
        f"Out of memory allocating {size:,} bytes ({format_bytes(size)}) for {framework} on "
        f"device {device}: {why}. In use: {held}; {tail}.{waited} Free arrays or tensors you "
        "no longer need, lower the batch size, or raise the budget "
        "(bridge.unify(budget=...) or BRIDGE_GPU_MEMORY_LIMIT)."
    )
