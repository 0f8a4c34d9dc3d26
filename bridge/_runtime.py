# SPDX-License-Identifier: Apache-2.0
"""The driver and devices of this process: loaded once, set up once per device."""

from __future__ import annotations

__all__ = [
    "core",
    "on_reset",
    "reset_process_state",
    "on_graph_collect",
    "collect_graphs",
    "ensure_driver",
    "device_count",
    "ensure_device",
    "resolve_devices",
    "current_device",
    "DRIVER_LIBRARY_ENV",
    "MAX_THRESHOLD",
]

import os
import threading
from collections.abc import Callable, Iterable
from typing import cast

from bridge._errors import BridgeError, Status, check
from bridge.budget import DEVICE_MEMORY, GPU_LIMIT_ENV, as_int, size_from_env, warn_if_above

DRIVER_LIBRARY_ENV = "BRIDGE_CUDA_LIBRARY"  # another libcuda (the tests' stand-in)
MAX_THRESHOLD = 2**64 - 1  # the pool keeps what it has until trimmed
CACHE_LIMIT_ENV = "BRIDGE_CACHE_LIMIT"  # bytes of freed blocks / empty segments kept (0: none)
# the cache's cap follows the bytes the frameworks hold (live):
# cached <= min(limit, max(floor, live * fraction)), the oldest blocks evicted past it
CACHE_FRACTION_ENV = "BRIDGE_CACHE_FRACTION"  # a fraction (0.0625) or a percentage (6.25%)
CACHE_FLOOR_ENV = "BRIDGE_CACHE_FLOOR"  # a size: the cap is at least this (under the limit)
# two tiers: that cap holds the blocks of at most small_max bytes; larger ones have
# their own order of caching under their own cap,
# cached_large <= min(limit, large_cap, max(live * large_fraction, the block cached))
CACHE_SMALL_MAX_ENV = "BRIDGE_CACHE_SMALL_MAX"  # a size: the small tier's largest block
CACHE_LARGE_CAP_ENV = "BRIDGE_CACHE_LARGE_CAP"  # a size: the large tier's cap
CACHE_LARGE_FRACTION_ENV = "BRIDGE_CACHE_LARGE_FRACTION"  # a fraction or a percentage; 0: none
# carving (off by default): the cache's requests carved from pool chunks, no empty chunk
# kept (docs/design.md, Note [Segments]); 1 with BRIDGE_CACHE_SEGMENTS unset: carving
# instead of segments
CACHE_CARVE_ENV = "BRIDGE_CACHE_CARVE"  # 1 / on, 0 / off
IPC_ENV = "BRIDGE_IPC"  # 1: unify() allocates from exportable pools (unify(ipc=True))
# segments (the default): carving with every emptied segment kept under one release
# rule (docs/design.md, Note [Segments]); set, it wins over BRIDGE_CACHE_CARVE;
# 0: the exact-size tiers alone (BRIDGE_CACHE_LIMIT=0: no cache at all)
CACHE_SEGMENTS_ENV = "BRIDGE_CACHE_SEGMENTS"  # 1 / on, 0 / off
# each thread's newest freed block in a slot of its own, in front of the lists (default on)
CACHE_THREAD_SLOT_ENV = "BRIDGE_CACHE_THREAD_SLOT"  # 1 / on, 0 / off
DEFAULT_CACHE_FRACTION = 1 / 16
DEFAULT_CACHE_FLOOR = 64 << 20
DEFAULT_CACHE_SMALL_MAX = 1 << 20
DEFAULT_CACHE_LARGE_CAP = 64 << 20
DEFAULT_CACHE_LARGE_FRACTION = 1 / 8
GIB = 1 << 30


def default_cache_limit(total: int) -> int:
    """The cache's default size on a device of total bytes: 2% of it, at least 1 GiB.

    Large enough for the blocks a training step frees and allocates again (a
    small conv net at batch 256 cycles about 1.5 GB: with a 1 GiB cap, 5 of
    its 62 allocations per step went to the driver); small next to the memory
    the frameworks' own caches would hold idle.
    """
    return max(GIB, total // 50)


def cache_fraction_from_env(
    name: str = CACHE_FRACTION_ENV, default: float = DEFAULT_CACHE_FRACTION
) -> float:
    """BRIDGE_CACHE_FRACTION (or ``name``) as a fraction of the live bytes.

    Default 1/16 (``default``); BRIDGE_CACHE_LARGE_FRACTION's is 1/8.

    Raises
    ------
    ValueError
        Naming the variable and its value when it is not a fraction in [0, 65536]
        or a percentage.
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 65536:
        raise ValueError(
            f"{name}={raw!r}: use a fraction of the live bytes (0.0625) or a percentage (6.25%)"
        )
    return value


def cache_large_fraction_from_env() -> float:
    """BRIDGE_CACHE_LARGE_FRACTION: the large tier's share of the live bytes (default 1/8)."""
    return cache_fraction_from_env(CACHE_LARGE_FRACTION_ENV, DEFAULT_CACHE_LARGE_FRACTION)


def switch_from_env(name: str, default: bool, what: str) -> bool:
    """An on/off variable: 1, on, true, yes or 0, off, false, no; unset or empty: default.

    Raises
    ------
    ValueError
        Naming the variable and its value when it is neither on nor off.
    """
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("0", "off", "false", "no"):
        return False
    if raw in ("1", "on", "true", "yes"):
        return True
    raise ValueError(f"{name}={raw!r}: use 1 ({what}) or 0 (off)")


def cache_carve_from_env() -> bool:
    """BRIDGE_CACHE_CARVE: whether the cache carves its blocks from pool chunks (default off)."""
    return switch_from_env(CACHE_CARVE_ENV, False, "carve blocks from chunks")


def ipc_from_env() -> bool:
    """BRIDGE_IPC: whether unify() allocates from pools that other processes can import."""
    return switch_from_env(IPC_ENV, False, "blocks shareable with other processes")


def cache_segments_from_env() -> bool:
    """BRIDGE_CACHE_SEGMENTS: whether the cache serves its requests from pool segments,
    every emptied one kept under the release rule.

    Default on, unless BRIDGE_CACHE_CARVE=1 asks for carving instead; 0: the exact-size
    tiers alone (cache.c), as the cache was before segments.
    """
    return switch_from_env(
        CACHE_SEGMENTS_ENV, not cache_carve_from_env(), "serve from pool segments"
    )


def cache_thread_slot_from_env() -> bool:
    """BRIDGE_CACHE_THREAD_SLOT: whether each thread's newest freed block waits in a slot of
    its own, taken back without a lock (default on)."""
    return switch_from_env(CACHE_THREAD_SLOT_ENV, True, "a slot per thread")


_lock = threading.RLock()
_release_threshold = MAX_THRESHOLD

try:
    import bridge._core as core
except ImportError as exc:
    if "static TLS" in str(exc):  # installed, but no room left for its thread-locals (tls.h)
        raise ImportError(
            f"bridge's compiled core could not be loaded ({exc}): libraries loaded before it "
            "took glibc's room for static thread-local storage. Import bridge before the "
            "other libraries (torch, cupy, jax), or start Python with "
            "GLIBC_TUNABLES=glibc.rtld.optional_static_tls=4096."
        ) from exc
    raise ImportError(  # pragma: no cover - a broken install
        "bridge's compiled core (bridge._core) is missing: reinstall with "
        "`pip install -e .` from the source tree, which builds it with the C compiler."
    ) from exc

DeviceArg = int | Iterable[int] | None

# the thread that receives Ctrl-C: an allocation waiting for memory on it looks
# for SIGINT (bridge/_native/pymod.c); this also installs the core's wait hooks
core.set_main_thread(threading.main_thread().ident or 0)


def ensure_driver() -> None:
    """Load the CUDA driver (once). Raises BridgeError when there is none."""
    if core.initialized():
        return
    rc = core.init(os.environ.get(DRIVER_LIBRARY_ENV) or None)
    check(rc, what="bridge could not start")


def device_count() -> int:
    """Number of visible CUDA devices (loads the driver)."""
    ensure_driver()
    rc, n = core.device_count()
    check(rc, what="counting CUDA devices")
    return int(n)


def _no_gpu() -> BridgeError:
    return BridgeError(
        "bridge found no CUDA device: the driver loaded but reports 0 GPUs. "
        "Check CUDA_VISIBLE_DEVICES and `nvidia-smi`."
    )


def resolve_devices(device: DeviceArg) -> list[int]:
    """``None`` -> every visible device; an int or a list of ints -> those, checked."""
    n = device_count()
    if n == 0:
        raise _no_gpu()
    if device is None:
        return list(range(n))
    if isinstance(device, bool):
        raise ValueError(f"device={device!r}: pass an int or a list of ints")
    one = as_int(device)  # numpy's integers as ints (np.int64; a list's too, np.arange's)
    try:
        devices = [one] if isinstance(one, int) else [as_int(d) for d in cast(Iterable, device)]
    except TypeError:  # neither an int nor an iterable (a float, say)
        raise ValueError(f"device={device!r}: pass an int or a list of ints") from None
    if not devices:  # a budget for no device would hold nowhere, without a word
        raise ValueError(f"device={device!r}: name at least one device, or pass None")
    for d in devices:
        if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d < n:
            raise ValueError(f"device={device!r}: every device must be an int in [0, {n})")
    return sorted(set(devices))


def current_device() -> int:
    """The device of the calling thread's current CUDA context (0 when none)."""
    ensure_driver()
    rc, d = core.current_device()
    check(rc, what="reading the current device")
    return int(d)


_configured: set[int] = set()  # devices whose environment settings were applied
# unify(jax=True) on the shared pool: devices set up later keep no cache either (JAX
# allocates from the pool itself and cannot ask the bridge to flush; see adapters/jax.py)
_cache_off = False


def cache_off_from_now(on: bool) -> None:
    """Whether devices set up from now on keep no cache (unless BRIDGE_CACHE_LIMIT asks for
    one), as unify(jax=True) turns it off on the devices it sets up."""
    global _cache_off
    _cache_off = on


# unify(jax=True, jax_memory=...): JAX's arena on every visible device, outside the pool;
# a budget from the environment of a device set up later is taken down by it too
_partition = 0


def partition_from_now(size: int) -> None:
    """The bytes of JAX's arena that the environment's budget of a device set up from now
    on is taken down by (0: none), as unify(jax=True, jax_memory=...) takes down the
    budgets of the devices it sets up."""
    global _partition
    _partition = size


def ensure_device(device: int) -> None:
    """Set a device's pool up once: primary context, default pool, threshold, env budget.

    A bad environment value raises every time, not only the first: the device
    counts as set up only once its settings were applied.
    """
    if device in _configured:
        return
    with _lock:
        if device in _configured:
            return
        if not 0 <= device < device_count():
            raise ValueError(f"device={device}: no such CUDA device (there are {device_count()})")
        if not core.ready(device):
            check(core.setup(device, _release_threshold), what="setting up the pool", device=device)
        rc, stats = core.stats(device)
        check(rc, what="reading the pool", device=device)
        limit = size_from_env(GPU_LIMIT_ENV, total=stats["total"])
        if limit is not None:
            warn_if_above(
                limit, stats["total"], name=f"{GPU_LIMIT_ENV} on device {device}", of=DEVICE_MEMORY
            )
            if limit and _partition:
                limit = max(1, limit - _partition)
            check(core.set_limit(device, limit), what="setting the budget", device=device)
        given_cache = size_from_env(CACHE_LIMIT_ENV, total=stats["total"])  # blank: None
        cache = default_cache_limit(stats["total"]) if given_cache is None else given_cache
        check(core.set_cache(device, cache), what="sizing the cache", device=device)
        floor = size_from_env(CACHE_FLOOR_ENV, total=stats["total"])
        check(
            core.set_cache_fraction(
                device,
                cache_fraction_from_env(),
                DEFAULT_CACHE_FLOOR if floor is None else floor,
            ),
            what="sizing the cache",
            device=device,
        )
        small_max = size_from_env(CACHE_SMALL_MAX_ENV, total=stats["total"])
        large_cap = size_from_env(CACHE_LARGE_CAP_ENV, total=stats["total"])
        check(
            core.set_cache_tiers(
                device,
                DEFAULT_CACHE_SMALL_MAX if small_max is None else small_max,
                DEFAULT_CACHE_LARGE_CAP if large_cap is None else large_cap,
            ),
            what="sizing the cache",
            device=device,
        )
        check(
            core.set_cache_large_fraction(device, cache_large_fraction_from_env()),
            what="sizing the cache",
            device=device,
        )
        apply_cache_carving(device, stats["total"])
        check(
            core.set_cache_thread_slots(device, cache_thread_slot_from_env()),
            what="setting the cache's thread slots",
            device=device,
        )
        if _cache_off and os.environ.get(CACHE_LIMIT_ENV) is None:
            check(core.set_cache(device, 0), what="turning the cache off for JAX", device=device)
        _configured.add(device)


def apply_cache_carving(device: int, total: int) -> None:
    """Segments or carving for a device's cache as the environment asks (neither under
    ``unify(ipc=True)``: a carved block cannot be exported); ``total``: its memory."""
    if core.ipc_enabled(device):
        return
    if cache_segments_from_env():
        check(core.set_cache_segments(device), what="turning segments on", device=device)
        given_cache = size_from_env(CACHE_LIMIT_ENV, total=total)  # blank: None
        if given_cache is not None:  # the user's bound on the empty segments
            check(
                core.set_cache_segments_keep(device, given_cache),
                what="bounding the empty segments",
                device=device,
            )
    elif cache_carve_from_env():
        check(core.set_cache_carve(device), what="turning carving on", device=device)


_resetters: list[Callable[[], None]] = []


def on_reset(fn: Callable[[], None]) -> Callable[[], None]:
    """Register a module's way to forget its process-wide state (decorator).

    Every module singleton of the bridge (devices set up, the Bridge that
    unify() returned, the recovery chain's installation) registers here, so
    one call forgets them all: :func:`reset_process_state`.
    """
    _resetters.append(fn)
    return fn


_graph_collectors: list[Callable[[], int]] = []


def on_graph_collect(fn: Callable[[], int]) -> Callable[[], int]:
    """Register an adapter's collect of dead graphs' pools (decorator).

    The CuPy adapter's: the core releases the pool of a CuPy graph whose
    driver-side end was seen (a CUDA user object's destructor), and the
    adapter drops the pool's holder (its Stream) then.
    """
    if fn not in _graph_collectors:
        _graph_collectors.append(fn)
    return fn


def collect_graphs() -> int:
    """Release the pools of the graphs that died, now; how many (figures, trims, retries)."""
    return sum(fn() for fn in _graph_collectors)


def reset_process_state() -> None:
    """Forget what this process set up in Python (the compiled core keeps its own).

    Run in a fork child, where the core refuses CUDA (BridgeError) and nothing
    may claim a device is set up, and by the tests between cases.
    """
    for fn in _resetters:
        fn()


@on_reset
def _forget_devices() -> None:
    global _cache_off, _partition
    _configured.clear()
    _cache_off = False
    _partition = 0


os.register_at_fork(after_in_child=reset_process_state)


def set_release_threshold(threshold: int) -> None:
    """The release threshold every device's pool is (re)set to."""
    global _release_threshold
    if not 0 <= threshold <= MAX_THRESHOLD:
        raise ValueError(f"release_threshold={threshold}: must be in [0, 2**64)")
    with _lock:
        _release_threshold = threshold
        for d in range(core.MAX_DEVICES):
            if core.ready(d):
                check(core.setup(d, threshold), what="setting the release threshold", device=d)


def release_threshold() -> int:
    return _release_threshold


def status_name(rc: int) -> str:
    return Status(rc).name
