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

__all__ = [
    "install",
    "installed",
    "partition",
    "backend_started",
    "too_late",
    "without_cuda",
    "jax_bytes",
    "SHARED_ENV",
]

import importlib.machinery
import importlib.metadata as metadata
import importlib.util
import os
import pathlib
import sys
import warnings
from collections.abc import Iterable

from bridge import _runtime
from bridge._errors import BridgeError, check
from bridge._install import install_hint
from bridge._runtime import core
from bridge.pool import register_attribution

SHARED_ENV = {"XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
#: The values of SHARED_ENV's variables that JAX reads as the same setting (lowercased):
#: jaxlib's xla_client reads "0" as no preallocation, as it reads "false".
_SAME = {"XLA_PYTHON_CLIENT_PREALLOCATE": ("false", "0")}
#: JAX's memory fraction: the name JAX documents now, and the older one it still reads
#: when the first is unset (JAX refuses to start with both set).
_FRACTION_ENV = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
#: Every variable install() may write: a failing install puts each back as it found it.
_WRITES = (*SHARED_ENV, *_FRACTION_ENV)
#: The CUDA plugins' modules (jax-cuda13-plugin, jax-cuda12-plugin), as jaxlib looks for them.
_CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")
_installed = False
_partition: int | None = None


def installed() -> bool:
    """Whether JAX was configured by the bridge."""
    return _installed


def partition() -> int | None:
    """The bytes of JAX's hard partition (taken out of the budget) when the bridge installed
    JAX with one; None otherwise (JAX shares the pool, or is not installed)."""
    return _partition if _installed else None


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


_STARTED = (
    "call bridge.unify(jax=True) before JAX's GPU backend starts: it has already "
    "started (a jax array, jax.devices() or a jitted call ran). Move bridge.unify() "
    "to the top of your program."
)
_SETTINGS_READ = (
    "call bridge.unify(jax=True) before JAX's GPU backend first starts: its backends "
    "were started earlier in this process (by JAX before clear_backends(), or by an "
    "earlier bridge.unify(jax=True) that failed), and JAX keeps the allocator "
    "settings it read then, so the bridge's would not apply. Move bridge.unify() to "
    "the top of your program, or run JAX in a new process."
)


def _settings_read() -> bool:
    """Whether JAX has read its ``XLA_PYTHON_CLIENT_*`` variables, its backends started or not.

    JAX registers its PJRT plugins once, when its backends first start, with the allocator
    options it reads from the environment then; clearing the backends
    (``jax.extend.backend.clear_backends()``, a failed start) keeps the plugins and their
    options.
    """
    xla_bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(getattr(xla_bridge, "_plugins_registered", False))


def too_late() -> str:
    """Why :func:`install` would refuse now, without trying: JAX's backend has started, or
    started once and kept the settings it read then ("" when neither, or the bridge
    configured JAX already). unify() asks before it changes anything (a share joined could
    not be left)."""
    if _installed:
        return ""
    if backend_started():
        return _STARTED
    return _SETTINGS_READ if _settings_read() else ""


def _spec(module: str) -> importlib.machinery.ModuleSpec | None:
    """A top-level module's spec, found without importing anything."""
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _children(package: str) -> set[str]:
    """The names in an installed package's folders (a namespace package's too), unimported."""
    spec = _spec(package)
    roots = (spec.submodule_search_locations or []) if spec is not None else []
    return {p.name for root in roots if os.path.isdir(root) for p in pathlib.Path(root).iterdir()}


def _has_cuda() -> bool:
    """Whether the installed JAX has a CUDA backend, from the installed packages alone.

    A CUDA plugin (``jax_cuda13_plugin``, ``jax_cuda12_plugin``), a PJRT plugin whose
    name says CUDA (under the ``jax_plugins`` namespace or its entry points, where JAX
    discovers them), or an older jaxlib built with CUDA (``+cuda`` in its version, or a
    ``jaxlib/cuda`` folder). Nothing is imported: JAX's backends stay unstarted.
    """
    if any(_spec(m) is not None for m in _CUDA_PLUGINS):
        return True
    if any("cuda" in ep.name for ep in metadata.entry_points(group="jax_plugins")):
        return True
    if any("cuda" in name for name in _children("jax_plugins")):  # jax_plugins.xla_cuda13
        return True
    if "cuda" in _children("jaxlib"):  # an older jaxlib with CUDA inside
        return True
    return "+cuda" in (_version("jaxlib") or "")


def without_cuda() -> str:
    """Empty for a JAX with a CUDA backend; else what the installed JAX is and what to install.

    Read from the installed packages (see ``_has_cuda``): JAX is not imported and its
    backends do not start, so a refusal leaves JAX as it was (bridge.frameworks'
    ``cpu_builds``).
    """
    if _spec("jax") is None or _has_cuda():
        return ""
    return (
        f"jax {_version('jax') or '(version unknown)'} (jaxlib "
        f"{_version('jaxlib') or 'not installed'}) is a CPU-only build: no CUDA plugin is "
        "installed (jax-cuda13-plugin or jax-cuda12-plugin), so JAX has no GPU backend to "
        f"put on the shared pool. Install one: {install_hint(['jax'])}"
    )


def agrees(var: str, value: str) -> bool:
    """Whether a user's value of one of ``SHARED_ENV``'s variables is what the shared pool
    needs, as JAX reads it (``XLA_PYTHON_CLIENT_PREALLOCATE=0`` is ``false``)."""
    return value.lower() in _SAME.get(var, (SHARED_ENV[var],))


def _conflicts(partition: int | None) -> list[str]:
    problems = []
    if partition is None:
        for var, want in SHARED_ENV.items():
            have = os.environ.get(var)
            if have is not None and not agrees(var, have):
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
    """Configure XLA for the shared pool (or a hard partition), start JAX, re-assert the pool.

    A JAX without CUDA is refused before anything changes; a start that fails puts back
    the variables this call set, the cache and the budget (a partition shrank it), and
    clears the backends it started (BridgeError).
    """
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
    missing = without_cuda()
    if missing:  # before the backend check: a CPU-only JAX may have started on the CPU
        raise BridgeError(f"bridge.unify(jax=True): {missing}.")
    if backend_started():
        raise BridgeError(_STARTED)
    if _settings_read():
        raise BridgeError(_SETTINGS_READ)
    fractions = [var for var in _FRACTION_ENV if var in os.environ]
    if fractions and partition is None:
        warnings.warn(
            f"{fractions[0]} has no effect with the shared pool "
            "(XLA's cuda_async allocator enforces no limit); the bridge budget "
            "applies instead.",
            stacklevel=3,
        )
    for d in devices:
        _runtime.ensure_device(d)
    # JAX starts on every visible device: one the bridge set up already is JAX's too
    devices = sorted(set(devices) | {d for d in range(_runtime.device_count()) if core.ready(d)})
    found = {var: os.environ.get(var) for var in _WRITES}
    # _configure turns the cache off (shared pool) or takes the partition out of the budget
    raw = {d: core.stats(d)[1] for d in devices}
    try:
        _configure(devices, partition)
        _start(devices)
    except BaseException as exc:
        _put_back(found)
        _runtime.cache_off_from_now(False)
        _runtime.partition_from_now(0)
        for d, was in raw.items():
            core.set_cache(d, was["cache_limit"])
            core.set_limit(d, was["limit"])
        if isinstance(exc, RuntimeError) and not isinstance(exc, BridgeError):
            raise BridgeError(
                f"bridge.unify(jax=True): JAX did not start on the GPU ({exc}). The bridge put "
                "back the XLA_PYTHON_CLIENT_* variables it had set and cleared JAX's "
                "backends. Check that JAX's CUDA plugin matches jaxlib and sees the GPU "
                "(python -c 'import jax; print(jax.devices())' in a fresh process), or pass "
                "jax=False."
            ) from exc
        raise
    if partition is None:
        register_attribution("jax", jax_bytes)
    _partition = partition
    _installed = True


def _configure(devices: list[int], partition: int | None) -> None:
    """XLA's variables for the shared pool or the hard partition (before JAX starts)."""
    if partition is None:
        os.environ.update(SHARED_ENV)
        # XLA allocates from the pool itself and cannot ask the bridge to
        # flush: a freed block the bridge kept cached would be memory JAX
        # cannot have.  No cache (unless BRIDGE_CACHE_LIMIT asks for one):
        # what CuPy and torch free goes back to the pool at once.
        if not os.environ.get(_runtime.CACHE_LIMIT_ENV, "").strip():  # blank: unset
            for d in devices:
                check(core.set_cache(d, 0), what="turning the cache off for JAX", device=d)
        # JAX allocates on every visible device: one set up later keeps none either
        _runtime.cache_off_from_now(True)
        return
    for d in devices:
        rc, raw = core.stats(d)
        check(rc, what="reading the device", device=d)
        if partition >= raw["total"]:
            raise ValueError(
                f"jax partition of {partition} bytes is not below the device's {raw['total']} bytes"
            )
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
        fraction = f"{partition / raw['total']:.6f}"
        if os.environ.get("XLA_CLIENT_MEM_FRACTION"):  # the name JAX reads first
            os.environ["XLA_CLIENT_MEM_FRACTION"] = fraction
            os.environ.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)  # both: JAX refuses
        else:  # read by every JAX
            os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = fraction
        if raw["limit"]:
            check(
                core.set_limit(d, max(1, raw["limit"] - partition)),
                what="shrinking the budget by JAX's partition",
                device=d,
            )
    os.environ.pop("XLA_PYTHON_CLIENT_ALLOCATOR", None)
    # JAX takes its arena on every visible device: one set up later gives it up too
    _runtime.partition_from_now(partition)


def _start(devices: list[int]) -> None:
    """Start JAX's GPU backend and its allocator, then re-assert the pools' attributes."""
    import jax
    import jax.numpy as jnp

    # Start the backend and its allocator now, so that what XLA writes into the
    # pool's attributes at start-up is overwritten below, not later.
    for dev in jax.devices("gpu"):
        jnp.zeros((1,), device=dev).block_until_ready()
    for d in devices:
        check(core.reassert(d), what="re-asserting the pool after JAX started", device=d)


def _put_back(found: dict[str, str | None]) -> None:
    """After a failed start: XLA's variables as they were, and no backend of this call."""
    for var, value in found.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value
    if not backend_started():
        return
    try:  # the backends this call started (install() refuses a JAX that had started)
        from jax.extend.backend import clear_backends
    except ImportError:
        from jax._src.xla_bridge import _clear_backends as clear_backends
    clear_backends()
