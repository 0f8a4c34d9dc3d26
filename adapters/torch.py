# SPDX-License-Identifier: Apache-2.0
"""PyTorch on the shared pool: the bridge's own torch allocator, over the core.

The allocator is a C++ class of torch's whole ``CUDAAllocator`` interface
(``_torch_allocator.cpp``), built against the installed torch on the first
start (``torch_build``) and installed with torch's ``changeCurrentAllocator``:
every CUDA tensor's memory comes from the core with no GIL and no Python, an
OOM is ``torch.cuda.OutOfMemoryError``, and torch's own figures, snapshot,
OOM observers, ``MemPool``, CUDA graphs and graph trees answer from the core.

Where that module cannot be built (no compiler, no ninja, no CUDA headers,
``BRIDGE_TORCH_PLUGGABLE=1``), torch's ``CUDAPluggableAllocator`` over the
core's C entry points stands in, with Python stand-ins for torch's figures, and
the bridge says so once (``path()`` and ``path_reason()`` tell which runs).
"""

from __future__ import annotations

__all__ = [
    "install",
    "installed",
    "memory_stats",
    "install_views",
    "remove_views",
    "path",
    "path_reason",
    "pinned_array",
    "too_late",
    "without_cuda",
]

import ctypes
import functools
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from bridge import _runtime, recovery, snapshot, views
from bridge._errors import BridgeError, check
from bridge._install import install_hint
from bridge._runtime import core
from bridge.pinned import _shapes as shapes
from bridge.pinned._shapes import ShapeLike

_allocator: Any = None
_path = ""  # "bridge" (the C++ allocator) or "pluggable" once installed
_path_reason = ""  # why the pluggable path runs
_HOOKS = (
    ("set_init_fn", "bridge_torch_init"),
    ("set_reset_fn", "bridge_torch_empty_cache"),
    ("set_memory_fraction_fn", "bridge_torch_memory_fraction"),
    ("set_record_stream_fn", "bridge_torch_record_stream"),
    ("set_begin_allocate_to_pool", "bridge_torch_begin_allocate_to_pool"),
    ("set_end_allocate_to_pool_fn", "bridge_torch_end_allocate_to_pool"),
    ("set_release_pool", "bridge_torch_release_pool"),
)


def installed() -> bool:
    """Whether torch allocates from the shared pool."""
    return _allocator is not None


def path() -> str:
    """Which torch allocator runs: ``"bridge"`` (the C++ one), ``"pluggable"``, or ``""``."""
    return _path


def path_reason() -> str:
    """Why torch's ``CUDAPluggableAllocator`` stands in (empty on the C++ path)."""
    return _path_reason


def without_cuda() -> str:
    """Empty for a torch that can use the GPU; else what the installed torch is and what to
    install.

    Read from ``torch.version`` (``cuda`` is None in a CPU-only or a ROCm build) and, for a
    CUDA build, ``torch.cuda.is_available()``, so torch's CUDA is not started: a CPU-only
    torch has no CUDA allocator to replace, and one whose CUDA the driver cannot run has no
    GPU to allocate on (bridge.frameworks' ``cpu_builds``).
    """
    cuda = getattr(torch.version, "cuda", None)
    if cuda is not None:
        return _cuda_unusable(cuda)
    hip = getattr(torch.version, "hip", None)
    kind = (
        f"a ROCm build (torch.version.hip is {hip!r})"
        if hip
        else "a CPU-only build (torch.version.cuda is None)"
    )
    return (
        f"torch {torch.__version__} is {kind}: it has no CUDA allocator to put on the shared "
        "pool. Install a CUDA build in its place (pip keeps the installed torch until it is "
        f"uninstalled): pip uninstall torch, then {install_hint(['torch'])}"
    )


def _cuda_unusable(cuda: str) -> str:
    """Empty where this CUDA build of torch can use a GPU; else why not and what to do.

    ``torch.cuda.is_available()`` asks the CUDA runtime for its devices without starting
    torch's CUDA (``torch.cuda.is_initialized()`` stays False, the allocator can still be
    swapped). It is False where the driver is older than the torch build's CUDA: torch then
    warns, and its warning is the reason given.
    """
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        if torch.cuda.is_available():
            return ""
    why = " ".join(" ".join(str(w.message).split()) for w in said)
    return (
        f"torch {torch.__version__} is a CUDA {cuda} build that cannot use this machine's "
        f"GPU (torch.cuda.is_available() is False{': ' + why if why else ''}). Install an "
        f"NVIDIA driver for CUDA {cuda}, or a torch built for the CUDA your driver has "
        f"(nvidia-smi shows it) in its place: pip uninstall torch, then {install_hint(['torch'])}"
    )


def pinned_array(buffer: Any, dtype: Any = None, shape: ShapeLike | None = None) -> Any:
    """``PinnedBuffer.as_torch``: a torch CPU tensor on the pinned block (same address)."""
    # a legacy capsule with kDLCPU: what every torch version takes
    t = torch.utils.dlpack.from_dlpack(buffer.__dlpack__(dl_device=(1, 0)))
    if dtype is not None and dtype != torch.uint8:
        itemsize = torch.empty((), dtype=dtype).element_size()
        t = t[: buffer.size - buffer.size % itemsize].view(dtype)
    return t if shape is None else t.reshape(shapes.shape(shape))


def _device_index(device: Any) -> int:
    if device is None:
        return torch.cuda.current_device()
    return torch.cuda._utils._get_device_index(device, optional=True)


def memory_stats(device: Any = None) -> dict:
    """torch's nested memory-stats dict for torch's share, from the ledger (the pluggable path).

    Keys as torch names them: ``allocated_bytes.all.current`` and so on, the
    same figures the C++ allocator gives torch: every torch block is one pool
    allocation; "reserved" is torch's live bytes, the blocks graph pools keep
    and the cache of freed blocks every framework shares.
    """
    dev = _device_index(device)
    t: Any
    if _unused(dev):  # every figure 0, as torch's own allocator gives them
        t = dict.fromkeys(_TAG_FIGURES, 0)
        pool_held = retries = 0
    else:
        rc, raw = core.stats(dev)
        check(rc, what="reading torch's memory figures", device=dev)
        t = raw["tags"][core.TAG_TORCH]
        pool_held = raw["graph_bytes"] + raw["cached"]
        # since the last reset_accumulated_memory_stats (the core's count is never reset)
        retries = raw["num_retries"] - min(raw["num_retries"], _retries_base.get(dev, 0))

    def stat(current: int, peak: int, allocated: int, freed: int) -> dict:
        one = {"current": current, "peak": peak, "allocated": allocated, "freed": freed}
        return {"all": one, "small_pool": dict.fromkeys(one, 0), "large_pool": dict(one)}

    nbytes = stat(t["current"], t["peak"], t["allocated"], t["freed"])
    count = stat(t["count"], t["count_peak"], t["num_allocs"], t["num_frees"])
    held = t["current"] + pool_held
    # its peak never falls without a reset (empty_cache lowers `held` only)
    reserved = stat(held, max(held, t["reserved_peak"]), t["allocated"], t["freed"])
    zero = stat(0, 0, 0, 0)
    return {
        "allocated_bytes": nbytes,
        "active_bytes": nbytes,
        "requested_bytes": nbytes,
        "reserved_bytes": reserved,
        "inactive_split_bytes": zero,
        "allocation": count,
        "active": count,
        "segment": count,
        "inactive_split": zero,
        "num_alloc_retries": retries,
        "num_ooms": t["num_ooms"],
        "num_sync_all_streams": 0,
        "num_device_alloc": t["num_allocs"],
        "num_device_free": t["num_frees"],
        "max_split_size": -1,
        "oversize_allocations": zero["all"],
        "oversize_segments": zero["all"],
    }


#: The figures of torch's tag that memory_stats reads.
_TAG_FIGURES = ("current", "peak", "allocated", "freed", "count", "count_peak", "num_allocs",
                "num_frees", "reserved_peak", "num_ooms")  # fmt: skip


def _unused(dev: int) -> bool:
    """A visible device the core has not set up: torch never allocated on it (nor was it
    unified). Its figures are 0 and its resets change nothing, as torch's own allocator
    answers for a device it never used (the core would refuse it as no device)."""
    return not core.ready(dev) and 0 <= dev < _runtime.device_count()


def _reset_peak(device: Any) -> None:
    dev = _device_index(device)
    if _unused(dev):
        return
    check(core.reset_peak(dev, core.TAG_TORCH), what="resetting torch's peak", device=dev)


#: The core's num_retries per device at torch's last reset_accumulated_memory_stats.
_retries_base: dict[int, int] = {}


def _reset_accumulated(device: Any) -> None:
    dev = _device_index(device)
    if _unused(dev):
        return
    check(
        core.reset_accumulated(dev, core.TAG_TORCH), what="resetting torch's counters", device=dev
    )
    rc, raw = core.stats(dev)
    if rc == 0:
        _retries_base[dev] = raw["num_retries"]


def _release_caches(device: int, tag: int) -> None:
    """Under pressure from another framework: torch's cuFFT plan cache.

    Not when torch itself is allocating: torch may hold the plan cache's lock
    while it allocates a cuFFT work area, and clearing would deadlock.
    """
    if tag == core.TAG_TORCH:
        return
    cache = torch.backends.cuda.cufft_plan_cache
    cache[device].clear()


def register_pool_streams(device: int) -> int:
    """Tell the core that torch's pooled streams of a device live as long as the process.

    torch hands out its streams (``torch.cuda.Stream()``, the autograd
    streams, graph capture's side streams) from a fixed pool per device and
    priority, created once and never destroyed, so blocks freed on them may
    be cached by stream.  Any other stream (``torch.cuda.ExternalStream`` of
    a CuPy stream, say) may be destroyed and its handle reused: its blocks
    go back to the pool instead.  Returns the number of streams registered.
    """
    least, greatest = torch.cuda.Stream.priority_range()
    step = -1 if greatest < least else 1
    seen: set[int] = set()
    for priority in range(least, greatest + step, step):
        first = None
        for _ in range(1024):  # a pool is 32 streams, handed out round-robin
            handle = torch.cuda.Stream(device=device, priority=priority).cuda_stream
            if handle == first or (first is None and handle in seen):
                break  # went round (or a clamped priority: the same pool)
            first = handle if first is None else first
            seen.add(handle)
    for handle in seen:
        check(core.register_stream(handle), what="registering torch's streams", device=device)
    return len(seen)


_native_mem_get_info: Any = None
_native_accelerator_info: Any = None


def _mem_get_info(device: Any = None) -> tuple[int, int]:
    """``torch.cuda.mem_get_info`` within the budget (bridge.views); natively without one."""
    view = views.budget_view(_device_index(device))
    return view if view is not None else _native_mem_get_info(device)


def _accelerator_info(device_index: Any = None) -> tuple[int, int]:
    """``torch.accelerator.get_memory_info`` on CUDA, within the budget."""
    index = torch.cuda.current_device() if device_index is None else int(device_index)
    view = views.budget_view(index) if index >= 0 else None
    return view if view is not None else _native_accelerator_info(device_index)


def install_views() -> None:
    """Make torch's free-memory queries answer within the budget (bridge.views).

    ``torch.cuda.mem_get_info`` (also ``torch.cuda.memory.mem_get_info``,
    which accelerate's ``get_max_memory`` and Hugging Face's
    ``device_map="auto"`` call) and ``torch.accelerator.get_memory_info``.
    """
    global _native_mem_get_info, _native_accelerator_info
    if _native_mem_get_info is None:
        _native_mem_get_info = torch.cuda.memory.mem_get_info
        view = functools.wraps(_native_mem_get_info)(_mem_get_info)
        torch.cuda.memory.mem_get_info = view
        torch.cuda.mem_get_info = view
    native = getattr(torch._C, "_accelerator_getMemoryInfo", None)
    if native is not None and _native_accelerator_info is None:
        _native_accelerator_info = native
        torch._C._accelerator_getMemoryInfo = _accelerator_info


def remove_views() -> None:
    """Give torch its own free-memory answers back."""
    global _native_mem_get_info, _native_accelerator_info
    if _native_mem_get_info is not None:
        torch.cuda.memory.mem_get_info = _native_mem_get_info
        torch.cuda.mem_get_info = _native_mem_get_info
        _native_mem_get_info = None
    if _native_accelerator_info is not None:
        torch._C._accelerator_getMemoryInfo = _native_accelerator_info
        _native_accelerator_info = None


def _graphs_without_trees() -> None:
    """``torch.compile(mode="reduce-overhead")`` with the CUDA graphs a pluggable allocator allows.

    Inductor's default CUDA graph *trees* share one private pool between
    every graph of a model and checkpoint that pool's allocator state
    (``_cuda_getCheckpointState`` & co.), which torch offers only for its own
    caching allocator: under a pluggable allocator they raise "does not yet
    support checkPoolLiveAllocations".  Without trees, inductor captures each
    compiled graph with ``torch.cuda.graph`` into a pool of its own, which the
    bridge serves (graph.c).  The cost: no pool shared between a model's
    forward and backward graphs, so graph memory is the sum of their peaks,
    and inputs are copied into static buffers before each replay.
    """
    try:
        from torch._inductor import config as inductor_config
    except ImportError:  # a torch without inductor
        return
    inductor_config.triton.cudagraph_trees = False


_TOO_LATE = (
    "call bridge.unify(torch=True) before the first CUDA tensor: torch has already "
    "initialized its CUDA allocator, and it cannot be swapped afterwards. Move "
    "bridge.unify() to the top of your program, before any .cuda(), "
    "torch.device('cuda') tensor or torch.cuda call that starts CUDA."
)


def too_late() -> str:
    """Why :func:`install` would refuse now, without trying: torch has started CUDA ("" when
    it has not, or torch is on the shared pool already). unify() asks before it changes
    anything (a share joined could not be left)."""
    return _TOO_LATE if _allocator is None and torch.cuda.is_initialized() else ""


def _check_order() -> None:
    if torch.cuda.is_initialized():
        raise BridgeError(_TOO_LATE)


def _install_native(module: Any) -> str:
    """Install the C++ allocator; "" when it runs, else why not (torch left untouched)."""
    try:
        module.install(core.__file__)
    except RuntimeError as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if text.startswith("bridge: the core"):  # a module built for another core
            return f"the built module does not match this bridge ({text})"
        raise BridgeError(
            "call bridge.unify(torch=True) before the first CUDA tensor: torch refused to swap "
            f"its allocator ({exc})."
        ) from exc
    return ""


def _install_pluggable(path: str) -> Any:
    alloc = torch.cuda.memory.CUDAPluggableAllocator(
        path, "bridge_torch_alloc", "bridge_torch_free"
    )
    lib = ctypes.CDLL(path)
    hooks = alloc.allocator()
    for setter, symbol in _HOOKS:
        getattr(hooks, setter)(ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value)
    try:
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as exc:
        raise BridgeError(
            "call bridge.unify(torch=True) before the first CUDA tensor: torch refused to swap "
            f"its allocator ({exc})."
        ) from exc
    _graphs_without_trees()
    # torch.cuda.memory_stats & co. read these; a bare pluggable allocator raises.
    torch._C._cuda_memoryStats = memory_stats
    torch._C._cuda_resetPeakMemoryStats = _reset_peak
    torch._C._cuda_resetAccumulatedMemoryStats = _reset_accumulated
    # torch.cuda.memory._record_memory_history / _snapshot / _dump_snapshot /
    # memory_snapshot: a pluggable allocator raises; the bridge's snapshot answers.
    torch._C._cuda_record_memory_history = snapshot.torch_record_history
    torch._C._cuda_record_memory_history_legacy = snapshot.torch_record_history_legacy
    torch._C._cuda_memorySnapshot = snapshot.torch_memory_snapshot
    return alloc


def install(devices: Iterable[int], *, library: str | None = None) -> None:
    """Make the core torch's CUDA allocator. Must run before torch starts CUDA.

    The C++ allocator where it builds (``torch_build.load``); torch's
    ``CUDAPluggableAllocator`` over ``library`` (default: the core) otherwise,
    or when ``library`` is given.
    """
    global _allocator, _path, _path_reason
    if _allocator is not None:
        return
    missing = without_cuda()
    if missing:  # before anything is compiled or installed
        raise BridgeError(f"bridge.unify(torch=True): {missing}.")
    _check_order()
    devices_list = list(devices)
    for d in devices_list:
        _runtime.ensure_device(d)
    from . import torch_build

    module = None
    if library is None:
        module = torch_build.load()
        reason = torch_build.reason
    else:
        reason = f"a core library was named ({library})"
    if module is not None:
        reason = _install_native(module)
        if not reason:
            _allocator, _path, _path_reason = module, "bridge", ""
    if _allocator is None:
        _allocator = _install_pluggable(library or core.__file__)
        _path, _path_reason = "pluggable", reason
        warnings.warn(
            "bridge: torch runs on torch's CUDAPluggableAllocator, not the bridge's own torch "
            f"allocator, because {reason}. On this path {torch_build.FALLBACK_LACKS}. "
            "`python -m bridge build-torch` builds the allocator and says what it needs.",
            RuntimeWarning,
            stacklevel=3,
        )
    # Only the current device's: creating torch streams on another device
    # would make that device's context current and then put the caller's
    # back, starting a context on a GPU the process may never use (a
    # torchrun rank that unified its own device before set_device).  The C++
    # allocator also registers each of torch's pooled streams, on any device,
    # the first time it allocates on it (torch's stream ids tell them from
    # external streams); on the pluggable path, blocks freed on other
    # devices' streams go where the core can prove their order.
    current = _runtime.current_device()
    if current in devices_list:
        register_pool_streams(current)
    recovery.register_releaser("torch", _release_caches)
