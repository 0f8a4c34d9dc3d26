# SPDX-License-Identifier: Apache-2.0
"""What torch users read from the C++ torch allocator, as native torch gives it.

Measured against torch's own CUDACachingAllocator: the out-of-memory
observer's arguments (device, request, allowed, free), a memory fraction of 0.0
(every allocation refused) and one set for a device not set up yet, the
snapshot's trace times (microseconds since the epoch), max_memory_reserved
across empty_cache, cacheInfo (cuDNN's benchmark workspaces), a MemPool made
with use_on_oom=True, a second beginAllocateToPool on a pool already routed,
num_alloc_retries after reset_accumulated_memory_stats, and a MemPool whose own
allocator returns no memory.

As tests/adapters/test_torch_allocator.py: a subprocess on the stand-in,
calling torch._C's entry points against the C++ allocator (torch cannot start
CUDA here); the GPU halves are in tests/gpu/test_gpu_torch_native.py.
"""

from __future__ import annotations

import pytest
from torch_util import SCENARIO_START, cuda_torch, run_scenario

torch = cuda_torch()

MIB = 1 << 20

SCENARIO = (
    SCENARIO_START
    + r"""
from bridge.adapters import torch as torch_adapter
T = core.TAG_TORCH
MIB = 1 << 20
core.set_cache(0, 1 << 30, 1 << 30)  # blocks freed on the default stream are kept
total = core.stats(0)[1]["total"]
out["total"] = total
def reserved():
    s = torch._C._cuda_memoryStats(0)["reserved_bytes"]["all"]
    p = torch_adapter.memory_stats(0)["reserved_bytes"]["all"]
    return [s["current"], s["peak"], p["current"], p["peak"]]

# ---- max_memory_reserved across empty_cache ----
torch._C._cuda_resetPeakMemoryStats(0)
b = mod._alloc_on(128 * MIB, 0, 0)        # 128 MiB live
a = mod._alloc_on(8 * MIB, 0, 0)          # another size
mod._free(a)                              # 8 MiB cached (segments: its 64 MiB segment)
torch._C._cuda_emptyCache()               # nobody read the figures before
out["reserved_after_empty"] = reserved()
torch._C._cuda_resetPeakMemoryStats(0)
out["reserved_after_reset"] = reserved()
mod._free(b)
torch._C._cuda_emptyCache()

# ---- cacheInfo without a budget: the cache and the pool's idle memory count ----
a = mod._alloc_on(16 * MIB, 0, 0)
mod._free(a)                              # 16 MiB cached
rc, mi = core.mem_info(0)
out["cache_info"] = [mod._cache_info(0), mi["driver_free"], mi["pool_idle"], mi["cached"]]
core.set_limit(0, core.stats(0)[1]["used"] + 64 * MIB)
rc, mi = core.mem_info(0)
out["cache_info_budget"] = [mod._cache_info(0), mi["free"]]
core.set_limit(0, 0)
torch._C._cuda_emptyCache()

# ---- the out-of-memory observer's arguments ----
mod._observe_ooms()  # torch._C's attach starts CUDA: the module attaches one of C++
held = mod._alloc_on(4 * MIB, 0, 0)       # torch holds 4 MiB
limit = core.stats(0)[1]["used"] + MIB
core.set_limit(0, limit)
try:
    mod._alloc_on(128 * MIB, 0, 0)        # more than any idle rest of held's segment
    out["observer_budget"] = "no error"
except torch.cuda.OutOfMemoryError:
    rc, mi = core.mem_info(0)
    out["observer_budget"] = [mod._last_observed(), limit, mi["free"]]
core.set_limit(0, 0)
torch._C._cuda_setMemoryFraction(0.25, 0)
try:
    mod._alloc_on(total // 4, 0, 0)       # with the 4 MiB held: past the cap
    out["observer_fraction"] = "no error"
except torch.cuda.OutOfMemoryError:
    out["observer_fraction"] = mod._last_observed()
mod._free(held)

# ---- a fraction of 0.0 refuses every allocation ----
torch._C._cuda_setMemoryFraction(0.0, 0)
out["fraction_zero_get"] = torch._C._cuda_getMemoryFraction(0)
try:
    q = mod._alloc_on(4096, 0, 0)
    mod._free(q)
    out["fraction_zero"] = "no error"
except torch.cuda.OutOfMemoryError as e:
    out["fraction_zero"] = ["OutOfMemoryError", str(e).splitlines()[0]]
torch._C._cuda_setMemoryFraction(1.0, 0)
q = mod._alloc_on(4096, 0, 0)
out["fraction_one"] = [q != 0, core.stats(0)[1]["tags"][T]["limit"]]
mod._free(q)

# ---- a fraction set for a device not set up yet ----
out["dev1_ready_before"] = core.stats(1)[0] == 0
torch._C._cuda_setMemoryFraction(0.5, 1)
q = mod._alloc_on(MIB, 1, 0)             # sets device 1 up
s1 = core.stats(1)[1]
out["dev1"] = [s1["tags"][T]["limit"], s1["total"]]
try:
    mod._alloc_on(s1["total"] // 2, 1, 0)
    out["dev1_over"] = "no error"
except torch.cuda.OutOfMemoryError as e:
    out["dev1_over"] = "OutOfMemoryError"
mod._free(q)
# the pluggable path's entry point (torch's CUDAPluggableAllocator calls it)
import ctypes
lib = ctypes.CDLL(core.__file__)
lib.bridge_torch_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
out["dev2_ready_before"] = core.stats(2)[0] == 0
lib.bridge_torch_memory_fraction(0.5, 2)
_runtime.ensure_device(2)
out["dev2"] = [core.stats(2)[1]["tags"][T]["limit"], core.stats(2)[1]["total"]]
lib.bridge_torch_memory_fraction(0.0, 2)
out["dev2_zero"] = core.stats(2)[1]["tags"][T]["limit"]
lib.bridge_torch_memory_fraction(1.0, 2)
out["dev2_one"] = core.stats(2)[1]["tags"][T]["limit"]

# ---- a MemPool made with use_on_oom=True lends its idle blocks before an OOM ----
pool = (0, 9)
torch._C._cuda_beginAllocateCurrentThreadToPool(0, pool)
g = mod._alloc_on(4 * MIB, 0, 0)
torch._C._cuda_endAllocateToPool(0, pool)
mod._free(g)                              # kept for the pool
torch._C._cuda_emptyCache()               # no idle segment left to serve the request
core.set_limit(0, core.stats(0)[1]["used"] + MIB)
def try_alloc():
    try:
        return mod._alloc_on(4 * MIB, 0, 0)
    except torch.cuda.OutOfMemoryError:
        return "OutOfMemoryError"
out["oom_pool_off"] = try_alloc() == "OutOfMemoryError"
mod._set_use_on_oom(0, *pool, True)
calls = mod._last_observed()[4]
r = try_alloc()
flags = {x[0]: (x[5], x[6], x[7]) for x in core.live_blocks()}
out["oom_pool_on"] = [r == g, list(flags.get(r, ())), core.stats(0)[1]["graph_bytes"],
                      mod._last_observed()[4] - calls]
if isinstance(r, int):
    mod._free(r)                          # back to the pool
out["oom_pool_freed"] = core.stats(0)[1]["graph_bytes"]
mod._set_use_on_oom(0, *pool, False)
out["oom_pool_unset"] = try_alloc() == "OutOfMemoryError"
core.set_limit(0, 0)
torch._C._cuda_releasePool(0, pool)

# ---- one route per pool: a second begin is refused, the first route stays ----
pool = (0, 11)
torch._C._cuda_beginAllocateCurrentThreadToPool(0, pool)
err = []
def second():
    try:
        torch._C._cuda_beginAllocateCurrentThreadToPool(0, pool)
        err.append("no error")
    except RuntimeError as e:
        err.append(str(e).splitlines()[0])
th = threading.Thread(target=second); th.start(); th.join()
r1 = mod._alloc_on(MIB, 0, 0)             # this thread's route still works
torch._C._cuda_endAllocateToPool(0, pool)
r2 = mod._alloc_on(MIB, 0, 0)
flags = {x[0]: (x[5], x[6], x[7]) for x in core.live_blocks()}
out["second_begin"] = [err[0], list(flags[r1]), list(flags[r2])]
mod._free(r1); mod._free(r2)
torch._C._cuda_releasePool(0, pool)

# ---- the snapshot's trace times: microseconds since the epoch ----
mod._record_history(True)  # torch._C's own call starts CUDA
before = time.time()
x = mod._alloc_on(MIB, 0, 0)
time.sleep(0.2)
y = mod._alloc_on(MIB, 0, 0)
after = time.time()
ALLOC = 0  # TraceEntry::ALLOC
out["times"] = [[a, t] for a, action, t in mod._trace_times() if action == ALLOC]
out["x_y_clock"] = [x, y, before, after]
mod._record_history(False)
mod._free(x); mod._free(y)
print("RESULT " + json.dumps(out))
"""
)


@pytest.fixture(scope="module", params=["segments", "tiers"])
def result(request, tmp_path_factory):
    # devices 1 and 2 are set up by the scenario; the cache as by default (segments) and
    # as BRIDGE_CACHE_SEGMENTS=0 makes it (the exact-size tiers)
    cache = str(tmp_path_factory.mktemp("torch-cache"))
    seg = "1" if request.param == "segments" else "0"
    out = run_scenario(SCENARIO, cache, BRIDGE_STANDIN_DEVICES="3", BRIDGE_CACHE_SEGMENTS=seg)
    out["mode"] = request.param
    return out


def test_oom_observer_gets_the_request_and_what_torch_may_use(result):
    # torch's observer: (device, alloc_size, allowed, device_free), not the live bytes
    (device, size, allowed, free, _), limit, mi_free = result["observer_budget"]
    assert (device, size) == (0, 128 * MIB)  # torch held 4 MiB: the request is passed
    assert allowed == limit and free == mi_free
    device, size, allowed, _, calls = result["observer_fraction"]
    total = result["total"]
    assert size == total // 4 and allowed == total // 4  # the fraction's cap
    assert calls == 2


def test_memory_fraction_zero_refuses_every_allocation(result):
    assert result["fraction_zero_get"] == 0.0
    kind, msg = result["fraction_zero"]
    assert kind == "OutOfMemoryError"
    assert msg.startswith("CUDA out of memory. Tried to allocate 0.00 GiB (4096 bytes) on device 0")
    assert "capped at 0.00 GiB by torch.cuda.set_per_process_memory_fraction" in msg
    assert result["fraction_one"] == [True, 0]  # 1.0: no cap again


def test_memory_fraction_for_a_device_not_set_up_applies_at_its_setup(result):
    assert result["dev1_ready_before"] is False  # nothing had set device 1 up
    limit, total = result["dev1"]
    assert limit == total // 2
    assert result["dev1_over"] == "OutOfMemoryError"


def test_the_pluggable_paths_memory_fraction_does_the_same(result):
    assert result["dev2_ready_before"] is False
    limit, total = result["dev2"]
    assert limit == total // 2
    assert result["dev2_zero"] == (1 << 64) - 1  # bridge.h's BRIDGE_TAG_LIMIT_ZERO
    assert result["dev2_one"] == 0


def test_max_memory_reserved_survives_empty_cache_until_a_reset(result):
    # 128 MiB live and a's bytes cached (8 MiB; segments: its emptied 64 MiB segment) were
    # reserved before empty_cache
    idle = 64 * MIB if result["mode"] == "segments" else 8 * MIB
    current, peak, py_current, py_peak = result["reserved_after_empty"]
    assert current == 128 * MIB and peak == 128 * MIB + idle
    assert (py_current, py_peak) == (current, peak)  # the pluggable path's figures agree
    assert result["reserved_after_reset"] == [128 * MIB] * 4


def test_cache_info_counts_the_cache_and_the_pools_idle_memory(result):
    largest, driver_free, pool_idle, cached = result["cache_info"]
    # the freed 16 MiB (segments: the 64 MiB segment it emptied)
    assert cached == (64 * MIB if result["mode"] == "segments" else 16 * MIB)
    assert largest == driver_free + pool_idle + cached
    largest, free = result["cache_info_budget"]
    assert largest == free  # under a budget: what the budget leaves


def test_use_on_oom_pool_lends_its_idle_block_before_an_oom(result):
    assert result["oom_pool_off"] is True  # without the flag: refused
    same, flags, graph_bytes, observed = result["oom_pool_on"]
    assert same is True and flags == [1, 0, 9]  # the pool's own block, live for torch
    assert graph_bytes == 0 and observed == 0  # no OOM was reported
    assert result["oom_pool_freed"] == 4 * MIB  # its free gives it back to the pool
    assert result["oom_pool_unset"] is True


def test_a_second_begin_on_a_routed_pool_is_refused_and_the_route_stays(result):
    msg, routed, plain = result["second_begin"]
    assert msg == "beginAllocateToPool: already recording to mempool_id"
    assert routed == [1, 0, 11]
    # no graph flag, no pool (segments: carved, REC_CARVED 4; tiers: a pool block, 0)
    assert plain == ([4, 0, 0] if result["mode"] == "segments" else [0, 0, 0])


def test_snapshot_trace_times_are_microseconds_since_the_epoch(result):
    x, y, before, after = result["x_y_clock"]
    times = dict(result["times"])
    tx, ty = times[x], times[y]
    assert 150_000 <= ty - tx <= 1_000_000  # the 0.2 s sleep, in microseconds
    assert before * 1e6 - 2e6 <= tx <= after * 1e6 + 2e6


# ---- num_alloc_retries after a reset, and a MemPool whose allocator returns no memory ----
RESETS_AND_POOLS = (
    SCENARIO_START
    + r"""
from bridge.adapters import torch as torch_adapter
MIB = 1 << 20
core.set_cache(0, 1 << 30, 1 << 30)
a = mod._alloc_on(8 * MIB, 0, 0)
mod._free(a)                              # 8 MiB cached (the exact-size tiers)
core.set_limit(0, core.stats(0)[1]["used"] + MIB)
b = mod._alloc_on(4 * MIB, 0, 0)          # refused, the cache flushed, retried: served
core.set_limit(0, 0)
def retries():
    return [torch._C._cuda_memoryStats(0)["num_alloc_retries"],
            torch_adapter.memory_stats(0)["num_alloc_retries"]]
out["retries"] = retries()
torch._C._cuda_resetAccumulatedMemoryStats(0)   # the C++ allocator's reset
torch_adapter._reset_accumulated(0)             # the pluggable path's
out["retries_after_reset"] = retries()
out["core_retries"] = core.stats(0)[1]["num_retries"]
mod._free(b)

# torch.cuda.MemPool(allocator=...) whose allocator returns NULL, under use_mem_pool
pool = (0, 13)
mod._pool_with_null_allocator(0, *pool)
mod._observe_ooms()
ooms = torch._C._cuda_memoryStats(0)["num_ooms"]
torch._C._cuda_beginAllocateCurrentThreadToPool(0, pool)
try:
    p = mod._alloc_on(MIB, 0, 0)
    out["null_pool"] = ["no error", p]
except torch.cuda.OutOfMemoryError as e:
    out["null_pool"] = ["OutOfMemoryError", str(e).splitlines()[0]]
except RuntimeError as e:
    out["null_pool"] = ["RuntimeError", str(e).splitlines()[0]]
rc, mi = core.mem_info(0)
out["null_pool_ooms"] = [torch._C._cuda_memoryStats(0)["num_ooms"] - ooms,
                         mod._last_observed(), mi["total"]]
torch._C._cuda_resetAccumulatedMemoryStats(0)
out["null_pool_ooms_reset"] = torch._C._cuda_memoryStats(0)["num_ooms"]
torch._C._cuda_endAllocateToPool(0, pool)
torch._C._cuda_releasePool(0, pool)       # use_mem_pool's exit
torch._C._cuda_releasePool(0, pool)       # the MemPool's end
q = mod._alloc_on(MIB, 0, 0)              # torch keeps working
out["after"] = q != 0
mod._free(q)

# device 1: visible, never unified nor allocated on (torch.cuda.memory_allocated(1) in a
# loop over the devices); torch's figures of it, and its resets, on both paths
def figures(s):
    return [s["allocated_bytes"]["all"]["current"], s["reserved_bytes"]["all"]["peak"],
            s["allocation"]["all"]["allocated"], s["num_ooms"], s["num_alloc_retries"]]
out["unused_ready"] = core.ready(1)
for name, stats, reset_peak, reset_accumulated in (
        ("cpp", torch._C._cuda_memoryStats, torch._C._cuda_resetPeakMemoryStats,
         torch._C._cuda_resetAccumulatedMemoryStats),
        ("pluggable", torch_adapter.memory_stats, torch_adapter._reset_peak,
         torch_adapter._reset_accumulated)):
    try:
        reset_peak(1)
        reset_accumulated(1)
        out["unused_" + name] = figures(stats(1))
    except Exception as e:
        out["unused_" + name] = [type(e).__name__, str(e)[:200]]
out["unused_ready_after"] = core.ready(1)
print("RESULT " + json.dumps(out))
"""
)


@pytest.fixture(scope="module")
def resets(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("torch-cache"))
    return run_scenario(RESETS_AND_POOLS, cache, BRIDGE_CACHE_SEGMENTS="0")


def test_reset_accumulated_memory_stats_resets_num_alloc_retries(resets):
    # torch's resetAccumulatedStats zeroes num_alloc_retries with the other counts
    assert resets["retries"] == [1, 1], resets
    assert resets["retries_after_reset"] == [0, 0], resets
    assert resets["core_retries"] == 1  # bridge.stats()'s own count is the device's


def test_mempool_allocator_returning_no_memory_is_torchs_oom(resets):
    # torch's own allocator takes a NULL from a pool's allocator as cudaErrorMemoryAllocation
    kind, first = resets["null_pool"]
    assert kind == "OutOfMemoryError", resets["null_pool"]
    assert first.startswith("CUDA out of memory. Tried to allocate 1048576 bytes on device 0")
    assert resets["after"] is True


def test_mempool_allocator_returning_no_memory_counts_and_tells_the_observers(resets):
    """Issue: that error was neither in num_ooms nor told to torch's OOM observers, as
    torch's own allocator's is (and its reset_accumulated_memory_stats zeroes the count)."""
    counted, observed, total = resets["null_pool_ooms"]
    assert counted == 1, resets
    device, size, allowed, _free, calls = observed  # (device, request, allowed, free)
    assert (device, size, allowed, calls) == (0, 1 << 20, total, 1)
    assert resets["null_pool_ooms_reset"] == 0


def test_a_device_torch_never_used_has_zero_figures_on_both_paths(resets):
    """Issue: on the pluggable path torch.cuda.memory_allocated(1), max_memory_reserved(1)
    and reset_peak_memory_stats(1) of a visible device the bridge had not set up raised
    BridgeError ("no such CUDA device"); torch's own allocator (and the C++ one) give 0."""
    assert resets["unused_ready"] is False
    assert resets["unused_cpp"] == [0] * 5, resets
    assert resets["unused_pluggable"] == [0] * 5, resets
    assert resets["unused_ready_after"] is False  # reading them set nothing up


# ---- torch.cuda.caching_allocator_enable(False) ----
CACHING_OFF = (
    SCENARIO_START
    + r"""
MIB = 1 << 20
core.set_cache(0, 1 << 30, 1 << 30)
def cycle(size):
    before = core.stats(0)[1]["cached"]
    p = mod._alloc_on(size, 0, 0)
    mod._free(p)
    s = core.stats(0)[1]
    return [s["cached"] - before, s["tags"][core.TAG_TORCH]["current"]]
out["on"] = cycle(2 * MIB)
torch._C._cuda_emptyCache()
torch._C._cuda_cudaCachingAllocator_enable(False)  # torch.cuda.caching_allocator_enable(False)
out["off"] = [cycle(2 * MIB), cycle(3 * MIB), core.stats(0)[1]["cached"]]
torch._C._cuda_cudaCachingAllocator_enable(True)
out["on_again"] = cycle(2 * MIB)
print("RESULT " + json.dumps(out))
"""
)


@pytest.mark.parametrize("cache", ["segments", "tiers"])
def test_caching_allocator_enable_false_caches_no_freed_block(cache, tmp_path_factory):
    """Issue: torch.cuda.caching_allocator_enable(False) changed nothing; torch's own
    allocator then gives every freed block back (cudaFree), and the bridge's torch
    allocator now gives torch's freed blocks back to the pool, none kept in its cache."""
    seg = "1" if cache == "segments" else "0"
    r = run_scenario(
        CACHING_OFF, str(tmp_path_factory.mktemp("torch-cache")), BRIDGE_CACHE_SEGMENTS=seg
    )
    assert r["on"][0] > 0 and r["on"][1] == 0, r  # on: the freed block is kept
    assert r["off"] == [[0, 0], [0, 0], 0], r  # off: nothing kept
    assert r["on_again"][0] > 0, r
