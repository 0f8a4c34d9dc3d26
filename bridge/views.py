# SPDX-License-Identifier: Apache-2.0
"""Free-memory queries under the budget: what the frameworks' own queries answer.

Tools size themselves by free memory: Hugging Face ``device_map="auto"`` and
accelerate's ``get_max_memory`` call ``torch.cuda.mem_get_info``, inference
servers profile it to size their caches, CuPy users read
``cupy.cuda.runtime.memGetInfo()``. Natively these report the whole card, so
under a budget such tools plan for memory the budget will refuse. With budget
views on (``bridge.unify(..., budget_views=True)``, the default), each
framework's query answers within the budget::

    free  = min(what the device has free, budget - what the budget's users hold)
    total = min(budget, the device's memory)

"What the device has free" counts the driver's free memory, the idle memory of
the shared pool and the bridge's cache of freed blocks (all of it usable by an
allocation through the bridge); "what the budget's users hold" is what the
budget check counts: every framework's live bytes, graph blocks kept for
replay, and whatever else the pool holds (JAX). A device without a budget
answers as the framework does natively.

Each adapter installs its framework's side (``install_views`` /
``remove_views``); this module holds the figures and the switch.
"""

from __future__ import annotations

__all__ = ["mem_get_info", "budget_view", "enabled", "want", "apply"]

import logging
import sys
from collections.abc import Iterable

from bridge import _runtime
from bridge import frameworks as registry
from bridge._errors import check
from bridge._runtime import core

log = logging.getLogger("bridge")

_wanted = True  # set by unify(budget_views=...) before the adapters install


@_runtime.on_reset
def _forget() -> None:
    global _wanted
    _wanted = True


def mem_get_info(device: int | None = None) -> tuple[int, int]:
    """A device's free and total memory as the budget leaves them.

    Parameters
    ----------
    device : int, optional
        The device; the current one when None.

    Returns
    -------
    tuple[int, int]
        ``(free, total)`` in bytes: with a budget, ``free = min(device free,
        budget - held)`` and ``total = min(budget, device memory)``; without
        one, the driver's own figures (``cuMemGetInfo``).

    Raises
    ------
    BridgeError
        When there is no CUDA driver or device.
    """
    from bridge.pool import _device

    d = _device(device)
    rc, info = core.mem_info(d)
    check(rc, what="reading the device's free memory", device=d)
    return int(info["free"]), int(info["total"])


def budget_view(device: int) -> tuple[int, int] | None:
    """``(free, total)`` under the device's budget, for a framework's query.

    None when the framework should answer natively: the device has no budget,
    the bridge has not set it up, or its figures cannot be read now (a query
    never fails because of the bridge).
    """
    try:
        if not core.ready(device):
            return None
        rc, info = core.mem_info(device)
    except Exception:  # noqa: BLE001 - a bad device index: the framework's own answer
        return None
    if rc != 0 or not info["limit"]:
        return None
    return int(info["free"]), int(info["total"])


def enabled() -> bool:
    """Whether the frameworks' free-memory queries answer within the budget."""
    return _wanted


def want(on: bool) -> None:
    """Set the switch before the adapters install (JAX reads it at start-up)."""
    global _wanted
    _wanted = bool(on)


def apply(frameworks: Iterable[str], on: bool) -> None:
    """Install (or remove) each installed framework's budget view."""
    want(on)
    for name in frameworks:
        adapter = sys.modules.get(registry.row(name).adapter)
        if adapter is None:
            continue  # not installed in this process
        fn = getattr(adapter, "install_views" if on else "remove_views", None)
        if fn is not None:
            fn()
