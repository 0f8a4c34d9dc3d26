# SPDX-License-Identifier: Apache-2.0
"""Type stub of bridge._core, the compiled core (bridge/_native/pymod.c).

Every function returns a status code (see ``bridge._errors.Status``), alone or
first in a tuple; ``bridge._errors.check`` turns it into an exception.
"""

from collections.abc import Callable
from typing import Any, TypedDict, final

MAX_DEVICES: int
CACHE_DEPTH: int  # blocks kept per (stream, size) key
TAG_OTHER: int
TAG_CUPY: int
CUPY_POOL: int
TAG_TORCH: int
TAG_NUMBA: int
TAG_RMM: int
NTAGS: int
RELIEVE_ALL: int
RELIEVE_CACHES: int
RELIEVE_COLLECT: int
WAIT_NONE: int
WAIT_OK: int
WAIT_TIMEOUT: int
WAIT_ALL_WAITING: int
WAIT_INTERRUPTED: int
WAIT_CAPTURE: int
WAIT_HOPELESS: int

class TagStats(TypedDict):
    """One framework tag's figures (``bridge_tag_stats`` in bridge.h)."""

    current: int
    peak: int
    allocated: int
    freed: int
    num_allocs: int
    num_frees: int
    num_ooms: int
    limit: int
    count: int  # live allocations now (reset_accumulated leaves it)
    count_peak: int  # highest count since the last peak reset
    reserved_peak: int  # highest current + graph_bytes + cached (torch's reserved) since then

class RawStats(TypedDict):
    """One device's figures (``bridge_stats`` in bridge.h)."""

    limit: int
    used: int
    peak_used: int
    pool_used: int
    pool_reserved: int
    pool_used_high: int
    release_threshold: int
    total: int
    num_allocs: int
    num_frees: int
    num_ooms: int
    num_retries: int
    num_bad_frees: int
    num_driver_errors: int
    num_deferred: int
    graph_bytes: int
    cached: int
    cache_limit: int
    cache_floor: int
    cache_fraction: float
    cached_small: int
    cached_large: int
    cache_small_max: int
    cache_large_cap: int
    cache_large_fraction: float
    carve_held: int
    carve_on: int
    carve_hwm: int
    carve_slack: int
    carve_parked: int
    num_cache_hits: int
    num_order_fallbacks: int
    num_pool_read_errors: int
    captures_active: int
    num_waits: int
    wait_ns: int
    num_wait_timeouts: int
    num_wait_all_waiting: int
    num_wait_interrupts: int
    waiting: int
    tags: list[TagStats]

@final
class Block:
    """One allocation from the shared pool, freed when this object dies.

    The free goes into the core's cache of freed blocks with the GIL held when
    the cache can keep it without a driver call (``free_cached``); otherwise the
    GIL is released around the core's free.  ``block_gil_releases()`` counts the
    frees that released it, every Block together (CuPy's included).
    """

    @property
    def ptr(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def device(self) -> int: ...

@final
class ManagedBlock:
    """One managed allocation (cuMemAllocManaged) on the budget, freed when this object dies."""

    @property
    def ptr(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def device(self) -> int: ...

@final
class CupyAllocator:
    """CuPy allocator on the shared pool: call with a size, get a MemoryPointer.

    A block the core's cache of freed blocks holds (same size, same stream) is
    served with the GIL held; any other request releases the GIL while the core
    allocates.  ``num_gil_releases`` (read-only) counts the calls that released it.
    """

    def __new__(
        cls,
        get_device: Callable[[], int],
        get_stream: Callable[[], Any],
        unowned_memory: Any,
        memory_pointer: Any,
        on_failure: Callable[[int, int, int, int], Any],
        tag: int = ...,
        device_capsule: Any = ...,
        stream_capsule: Any = ...,
        base_memory: type | None = ...,
    ) -> CupyAllocator: ...
    def __call__(self, size: int, /) -> Any: ...
    def wrap(self, block: Block, /) -> Any: ...
    @property
    def num_gil_releases(self) -> int: ...
    @property
    def direct_lookups(self) -> bool: ...
    @property
    def memory_objects(self) -> str:
        """``"BridgeMemory"`` (CuPy's layout checked out) or ``"UnownedMemory"``."""
    @property
    def memory_problem(self) -> str | None:
        """Why blocks are wrapped in ``UnownedMemory``; None when they are BridgeMemory."""

@final
class StreamAllocator:
    """Allocator of one device and tag: call with (nbytes, stream), get an address."""

    def __new__(
        cls, device: int, tag: int, on_failure: Callable[[int, int, int, int], int]
    ) -> StreamAllocator: ...
    def __call__(self, nbytes: int, stream: Any = None, /) -> int: ...
    @property
    def device(self) -> int: ...
    @property
    def tag(self) -> int: ...

def stream_free(address: int, nbytes: int = 0, stream: Any = None, /) -> None: ...

# ---- the driver ----
def init(path: str | None = None, /) -> int: ...
def initialized() -> bool: ...
def device_count() -> tuple[int, int]: ...
def driver_version() -> tuple[int, int]: ...
def device_info(device: int) -> tuple[int, str, int, int, int]: ...
def current_device() -> tuple[int, int]: ...
def last_driver_error() -> tuple[int, str]: ...
def loaded_library() -> str: ...
def load_error() -> str: ...

# ---- devices and pools ----
def setup(device: int, release_threshold: int, /) -> int: ...
def ready(device: int, /) -> bool: ...
def reassert(device: int, /) -> int: ...
def pool_attribute(device: int, attr: int, /) -> tuple[int, int]: ...
def trim(device: int, keep: int = 0, /) -> int: ...
def grant_peer_access(device: int, /) -> tuple[int, int]: ...

# ---- blocks shared with other processes (ipc.c) ----
def ipc_enable(device: int, /) -> int: ...
def ipc_enabled(device: int, /) -> bool: ...
def ipc_export(ptr: int, /) -> tuple[int, bytes | None, int]: ...
def ipc_import(handle: bytes, device: int, /) -> tuple[int, int]: ...
def ipc_release(ptr: int, /) -> None: ...
def ipc_error() -> str: ...
def ipc_counts() -> tuple[int, int, int]: ...

# ---- the cache of freed blocks ----
def set_cache(device: int, limit: int, max_block: int = ..., /) -> int: ...
def set_cache_fraction(device: int, fraction: float, floor: int = ..., /) -> int: ...
def set_cache_tiers(device: int, small_max: int = ..., large_cap: int = ..., /) -> int: ...
def set_cache_large_fraction(device: int, fraction: float, /) -> int: ...
def set_cache_thread_slots(device: int, on: bool, /) -> int: ...
def set_cache_carve(
    device: int,
    share: float = ...,
    min: int = ...,
    max: int = ...,
    keep: int = ...,
    small_keep: int = ...,
    /,
) -> int: ...
def set_cache_segments(device: int, on: bool = ..., /) -> int: ...
def set_cache_segments_keep(device: int, keep: int, /) -> int: ...
def register_stream(stream: int, /) -> int: ...
def forget_stream(stream: int, /) -> int: ...

# ---- budget ----
def set_limit(device: int, limit: int, /) -> int: ...
def set_tag_limit(device: int, tag: int, limit: int, /) -> int: ...
def set_tag_cached(tag: int, cached: bool, /) -> int: ...
def set_tag_holds_streams(tag: int, holds: bool, /) -> int: ...
def set_tag_relieved(tag: int, relieved: bool, /) -> int: ...

# ---- allocation ----
def alloc(device: int, size: int, stream: int, tag: int, /) -> tuple[int, int]: ...
def alloc_cached(device: int, size: int, stream: int, tag: int, /) -> tuple[int, int]: ...
def alloc_block(
    device: int, size: int, stream: int, tag: int, stream_object: object = None, /
) -> tuple[int, Block | None]: ...
def free(ptr: int, /) -> None: ...
def free_cached(ptr: int, /) -> int: ...
def block_gil_releases() -> int: ...
def record_stream(ptr: int, stream: int, /) -> int: ...
def lookup(ptr: int, /) -> tuple[int, int, int, int]: ...

# ---- figures ----
def stats(device: int, /) -> tuple[int, RawStats]: ...
def reset_peak(device: int, tag: int = -1, /) -> int: ...
def reset_accumulated(device: int, tag: int = -1, /) -> int: ...
def others(device: int, /) -> tuple[int, int]: ...
def live_records() -> int: ...
def parked_records() -> int: ...

# ---- what tools see (bridge/_native/views.c, pyviews.c) ----
EV_ALLOC: int
EV_FREE: int
EV_OOM: int

class MemInfo(TypedDict):
    """A device's free and total memory under its budget (``bridge_mem_info`` in bridge.h)."""

    free: int
    total: int
    driver_free: int
    driver_total: int
    pool_idle: int
    cached: int
    held: int
    limit: int

def mem_info(device: int, /) -> tuple[int, MemInfo]: ...
def cached_blocks(device: int, /) -> tuple[int, int]: ...
def alloc_managed(device: int, size: int, tag: int, /) -> tuple[int, ManagedBlock | None]: ...
def managed_stats(device: int, /) -> tuple[int, int, int]: ...
def live_blocks() -> list[tuple[int, int, int, int, int, int, int, int]]: ...
def history(on: bool, stacks: bool, max_entries: int, clear: bool, /) -> int: ...
def history_events() -> list[tuple[int, int, int, int, int, int, int, int, int]]: ...
def set_stack_callback(callback: Callable[[], int] | None, /) -> None: ...

# ---- CUDA graph capture ----
def graph(op: int, device: int, id0: int, id1: int, /) -> int: ...
def graph_begin_on(device: int, id0: int, id1: int, stream: int, capture: bool, /) -> int: ...
def alloc_graph(
    device: int, size: int, tag: int, id0: int, id1: int, stream: int = 0, /
) -> tuple[int, int]: ...
def capture(begin: bool, device: int, /) -> int: ...
def capture_stream(begin: bool, device: int, stream_or_pool: int, /) -> tuple[int, int]: ...
def bind_graph(device: int, pool: int, stream: int, /) -> int: ...
def graph_collect() -> list[tuple[int, int]]: ...
def forked() -> bool: ...

# ---- recovery ----
def set_pressure_callback(
    callback: Callable[[int, int, int, int], object] | None, /
) -> None: ...  # (device, nbytes, tag, stage: RELIEVE_*)
def relief_loop() -> bool: ...
def stop_relief() -> None: ...
def set_relief_timeout(seconds: float, /) -> None: ...

# ---- waiting for memory (bridge/_native/wait.c) ----
def set_main_thread(ident: int, /) -> None: ...
def set_wait(seconds: float, /) -> int: ...
def get_wait() -> float: ...
def set_thread_wait(set: bool, seconds: float, priority: int, /) -> int: ...
def thread_wait() -> tuple[bool, float, int]: ...
def last_wait() -> tuple[float, int]: ...
def wait_holders(device: int, /) -> tuple[int, list[tuple[int, int, bool]]]: ...

# ---- pinned host memory (bridge/_native/pinned.c, pypinned.c) ----
PINNED_CACHED: int
PINNED_MEMPOOL: int
PINNED_AUTO: int

class PinnedStats(TypedDict):
    """The pinned pool's figures (``bridge_pinned_stats`` in bridge.h)."""

    backend: int
    mempool_available: int
    limit: int
    used: int
    free: int
    total: int
    peak_used: int
    n_free_blocks: int
    n_pending_blocks: int
    n_live_blocks: int
    num_allocs: int
    num_reuses: int
    num_base_allocs: int
    num_base_frees: int
    num_ooms: int
    num_driver_errors: int
    num_records: int

class PinnedBufferBase:
    """One block of the pinned pool (subclassed by ``bridge.PinnedBuffer``)."""

    @property
    def ptr(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __dlpack__(
        self,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...

def pinned_setup(backend: int, /) -> tuple[int, int]: ...
def pinned_alloc(cls: type[Any], size: int, /) -> tuple[int, Any]: ...
def pinned_record(addr: int, stream: int, /) -> int: ...
def pinned_lookup(addr: int, /) -> tuple[int, int, int]: ...
def pinned_set_limit(limit: int, /) -> int: ...
def pinned_trim() -> int: ...
def pinned_reset_peak() -> int: ...
def pinned_stats() -> tuple[int, PinnedStats]: ...

# one budget for the processes of a GPU (share.c)
class ShareStats(TypedDict):
    name: str
    path: str
    budget: int
    claim: int
    group: int
    members: int
    slot: int
    inflight: int
    num_refused: int
    num_asks: int
    num_trims_served: int
    num_reclaimed: int
    num_overshoots: int
    max_overshoot: int
    num_lost: int

def share_join(device: int, name: str, dir: str, budget: int, /) -> int: ...
def share_error() -> str: ...
def share_set_growth(bytes: int, /) -> int: ...
def share_stats(device: int, /) -> tuple[int, ShareStats | None]: ...
def share_layout() -> dict[str, int]: ...
