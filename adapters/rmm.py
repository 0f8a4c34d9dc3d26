# SPDX-License-Identifier: Apache-2.0
"""RMM on the shared pool: every device's RMM resource allocates through the ledger.

``install`` gives each visible device a resource of the bridge's
(``rmm.mr.set_per_device_resource``), counted under tag ``rmm``, that
allocates on the stream RMM passes and frees on the stream RMM frees on, as
RMM's own stream-ordered resources do: RMM keeps that stream alive while the
buffer lives (``DeviceBuffer`` holds a reference to it), so the core may give
it to the driver at the free, also for a stream of its own that the bridge
does not know (tag ``rmm`` holds its streams: ``set_tag_holds_streams``).

Which resource (``path()``, ``path_reason()``; ``bridge doctor`` says which
would run):

- ``"bridge"``: ``BridgeResource`` (``_rmm_resource.pyx``), an
  ``rmm.mr.DeviceMemoryResource`` whose C++ resource calls the core's
  ``bridge_alloc`` and ``bridge_free_on_stream`` from C: no GIL and no Python
  per allocation. Compiled against the installed RMM on the first
  ``unify(rmm=True)`` (``rmm_build``: needs Cython and a C++ compiler, once,
  into the cache the torch allocator uses).
- ``"callback"``, where that cannot be built or ``BRIDGE_RMM_CALLBACK=1``:
  an ``rmm.mr.CallbackMemoryResource`` whose two callables are C functions of
  the core (``bridge._core.StreamAllocator``, ``bridge._core.stream_free``).
  No Python frame runs per allocation, but RMM's wrapper takes the GIL and
  builds a ``Stream`` object for each call (benchmarks/bench_rmm.py measures
  both against RMM's ``CudaAsyncMemoryResource``); the bridge warns once.

Both refuse the same way: a refused allocation calls ``_on_failure`` with the
GIL, which sets up a device first used now or raises the bridge's
``OutOfMemoryError`` (a ``MemoryError``); RMM turns it into
``rmm::out_of_memory`` in C++, and that into ``MemoryError`` at the Python
surface, as for RMM's own resources.

Everything built on RMM's current device resource follows: ``rmm.DeviceBuffer``,
``rmm.allocators.cupy.rmm_cupy_allocator`` (CuPy arrays then count as ``rmm``),
cuDF, cuML, XGBoost.

``rmm.reinitialize()`` or ``rmm.mr.set_current_device_resource(...)`` after
``bridge.unify(rmm=True)`` replaces the bridge's resource: call unify after them.
"""

from __future__ import annotations

__all__ = ["callback_resource", "install", "installed", "path", "path_reason", "resource"]

import warnings
from collections.abc import Iterable
from typing import Any

import rmm
import rmm.mr

from bridge import _runtime
from bridge._errors import OOM_STATUSES, OutOfMemoryError, Status, check, oom_message
from bridge._runtime import core

_resources: dict[int, Any] = {}  # device -> the resource set for it
_module: Any = None  # the compiled BridgeResource's module, once loaded
_path = ""  # "bridge" (the C++ resource) or "callback", once chosen
_path_reason = ""  # why the callback resource runs


def installed(device: int | None = None) -> bool:
    """Whether RMM's resource of a device (the current one when None) is the bridge's."""
    d = _runtime.current_device() if device is None else device
    mr = _resources.get(d)
    return mr is not None and rmm.mr.get_per_device_resource(d) is mr


def path() -> str:
    """Which resource runs: ``"bridge"`` (the C++ one), ``"callback"``, or ``""`` (none yet)."""
    return _path


def path_reason() -> str:
    """Why RMM's ``CallbackMemoryResource`` stands in (empty on the C++ path)."""
    return _path_reason


def _native() -> Any:
    """The compiled resource's module (built on the first call), or None: the callback path."""
    global _module, _path, _path_reason
    if _path:
        return _module
    from . import rmm_build

    module = rmm_build.load()
    reason = rmm_build.reason
    if module is not None:
        try:
            module.load_core(core.__file__)
        except RuntimeError as exc:
            module, reason = None, f"its module cannot reach the core: {exc}"
    if module is None:
        _path, _path_reason = "callback", reason
        warnings.warn(
            "bridge: RMM runs on RMM's CallbackMemoryResource, not the bridge's C++ RMM "
            f"resource, because {reason}. On this path {rmm_build.FALLBACK_COSTS}. "
            "`python -m bridge build-rmm` builds the resource and says what it needs.",
            RuntimeWarning,
            stacklevel=5,  # _native, resource, install, unify: the caller of unify
        )
    else:
        _module, _path, _path_reason = module, "bridge", ""
    return _module


def resource(device: int) -> Any:
    """The bridge's RMM resource of a device (a new one the first time)."""
    mr = _resources.get(device)
    if mr is None:
        native = _native()
        if native is not None:
            mr = native.BridgeResource(device, core.TAG_RMM, _on_failure)
        else:
            mr = callback_resource(device)
        _resources[device] = mr
    return mr


def callback_resource(device: int) -> Any:
    """A new callback resource of a device: RMM's ``CallbackMemoryResource`` over the core's C
    callables (the fallback; benchmarks/bench_rmm.py measures it beside the C++ one)."""
    alloc = core.StreamAllocator(device, core.TAG_RMM, _on_failure)
    return rmm.mr.CallbackMemoryResource(alloc, core.stream_free)


def _on_failure(size: int, device: int, stream: int, rc: int) -> int:
    """The slow path of both resources: set up a device first used now, or raise the OOM.

    Called with the GIL by the resource's allocation when the core refused it
    (``rc``); returns an address, or raises the bridge's ``OutOfMemoryError``
    (a ``MemoryError``, which RMM raises as its own ``MemoryError``).
    """
    if rc in (Status.DEVICE, Status.NOTINIT):
        _runtime.ensure_device(device)
        rc, ptr = core.alloc(device, size, stream, core.TAG_RMM)
        if rc == Status.OK:
            return int(ptr)
    if rc in OOM_STATUSES:
        raw_rc, raw = core.stats(device)
        raise OutOfMemoryError(
            oom_message(device, size, rc, framework="rmm"),
            device=device,
            size=size,
            limit=int(raw["limit"]) if raw_rc == Status.OK else 0,
        )
    check(rc, what=f"rmm allocation of {size} bytes", device=device)
    raise MemoryError(f"rmm allocation of {size} bytes failed with status {rc}")


def install(devices: Iterable[int]) -> None:
    """Make RMM's resource of every visible device allocate from the shared pool.

    The devices named are set up now (budget, pool); the others are set up by
    their first RMM allocation, as for the other frameworks.
    """
    # A free's stream is alive during the free (RMM's contract): issue it there.
    check(core.set_tag_holds_streams(core.TAG_RMM, True), what="rmm's streams")
    for d in devices:
        _runtime.ensure_device(d)
    for d in range(_runtime.device_count()):
        mr = resource(d)
        if rmm.mr.get_per_device_resource(d) is not mr:
            rmm.mr.set_per_device_resource(d, mr)


@_runtime.on_reset
def _forget() -> None:
    """A fork child (or a test) starts without the parent's resources (the module stays)."""
    _resources.clear()
