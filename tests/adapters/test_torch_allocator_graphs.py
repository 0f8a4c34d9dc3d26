# SPDX-License-Identifier: Apache-2.0
"""CUDA graph pools through the C++ torch allocator's hooks, as torch sends them.

Two corners of torch's graphs (issue 61):
- a graph deleted while a replay of it still runs on a stream nobody registered
  (torch.cuda.ExternalStream): its pool's memory must not be handed out before
  that replay is done (native torch's release frees a private pool through
  cudaFree, which synchronizes the device);
- a capture that fails before allocating into its pool: the allocator must not
  go on as if a capture ran.

As tests/adapters/test_torch_allocator.py: a subprocess on the stand-in calling
the allocator's hooks (torch cannot start CUDA here, so the begin hook is
called through the module's test entry with the stand-in stream as torch's
current stream and a capture's or a routing's filter); the GPU halves, with
native torch beside them, are in tests/gpu/test_gpu_graphs.py.
"""

from __future__ import annotations

import pytest
from torch_util import SCENARIO_START, cuda_torch, run_scenario

torch = cuda_torch()

MIB = 1 << 20

SCENARIO = (
    SCENARIO_START
    + r"""
sd = ctypes.CDLL(os.environ["BRIDGE_CUDA_LIBRARY"])
sd.standin_new_stream_flags.argtypes = [ctypes.c_int, ctypes.c_uint]
sd.standin_new_stream_flags.restype = ctypes.c_void_p
sd.standin_launch.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_int]
sd.standin_counter.restype = ctypes.c_uint64
sd.standin_queued_kernels.restype = ctypes.c_uint64
sd.cuStreamBeginCapture_v2.argtypes = [ctypes.c_void_p, ctypes.c_int]
sd.cuStreamEndCapture.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
C_FREE, C_SYNC, C_UNORDERED = 1, 2, 15
MIB = 1 << 20
def figures():
    s = core.stats(0)[1]
    return {k: s[k] for k in ("used", "cached", "captures_active", "num_deferred", "graph_bytes")}
cap = sd.standin_new_stream_flags(0, 1)
core.register_stream(cap)  # torch's capture stream: one of its pooled streams
other = sd.standin_new_stream_flags(0, 1)
core.register_stream(other)

# ---- a graph deleted while its replay runs on an external stream ----
ext = sd.standin_new_stream_flags(0, 1)  # a raw non-blocking stream: ExternalStream
pool = (0, 12)
mod._begin_pool_on(0, *pool, cap, True)  # torch's capture_begin: the hook ...
assert sd.cuStreamBeginCapture_v2(cap, 2) == 0  # ... then the capture
tmp = mod._alloc_on(4 * MIB, 0, cap)  # a temporary of the captured work
mod._free(tmp)  # it stays with the pool
g = ctypes.c_void_p()
assert sd.cuStreamEndCapture(cap, ctypes.byref(g)) == 0
torch._C._cuda_endAllocateToPool(0, pool)
sd.standin_launch(ext, tmp, 0)  # g.replay() on torch.cuda.ExternalStream(ext)
unordered, syncs = sd.standin_counter(C_UNORDERED), sd.standin_counter(C_SYNC)
frees = sd.standin_counter(C_FREE)
torch._C._cuda_releasePool(0, pool)  # del g
out["released"] = figures()
out["released_frees"] = sd.standin_counter(C_FREE) - frees
new = mod._alloc_on(4 * MIB, 0, other)  # a tensor made meanwhile
out["new_is_tmp"] = new == tmp
out["unordered_before_sync"] = sd.standin_counter(C_UNORDERED) - unordered
torch._C._cuda_emptyCache()  # torch.cuda.empty_cache(): the device is synchronized first
out["after_empty_cache"] = figures()
out["synced"] = sd.standin_counter(C_SYNC) > syncs
out["queued_kernels"] = sd.standin_queued_kernels()
out["unordered"] = sd.standin_counter(C_UNORDERED) - unordered
mod._free(new)
sd.cuGraphDestroy(g)

# ---- a capture that fails before allocating into its pool ----
core.set_cache(0, 64 * MIB)
a = mod._alloc_on(4 * MIB, 0, cap)  # made before the capture
pool = (0, 13)
mod._begin_pool_on(0, *pool, cap, True)
assert sd.cuStreamBeginCapture_v2(cap, 2) == 0
mod._free(a)  # freed inside the capture, on its stream: held back
out["during"] = figures()
sd.standin_invalidate_capture()  # an .item() in the body
assert sd.cuStreamEndCapture(cap, ctypes.byref(g)) == 901  # capture_end raises, no end hook
out["after_failure"] = figures()
out["torch_after_failure"] = torch._C._cuda_memoryStats(0)["allocated_bytes"]["all"]["current"]
p = mod._alloc_on(MIB, 0, cap)
mod._free(p)
q = mod._alloc_on(MIB, 0, cap)
out["reused"] = q == p
out["reuse_figures"] = figures()
mod._free(q)
# torch 2.14+'s reset of the failed graph: the end hook and the release, later
torch._C._cuda_endAllocateToPool(0, pool)
torch._C._cuda_releasePool(0, pool)
out["after_reset"] = figures()

# ---- a use_mem_pool routing is never taken for a failed capture ----
mp = (0, 14)
mod._begin_pool_on(0, *mp, cap, False)  # the routing's filter takes the stream
r = mod._alloc_on(MIB, 0, cap)
core.trim(0, 0)  # a forced look by this thread
out["routing"] = figures()
mod._free(r)
torch._C._cuda_endAllocateToPool(0, mp)
torch._C._cuda_releasePool(0, mp)
out["routing_released"] = figures()
core.set_cache(0, 0)
print("RESULT " + json.dumps(out))
"""
)


@pytest.fixture(scope="module", params=["segments", "tiers"])
def result(request, tmp_path_factory):
    """The scenario on the default cache (segments) and on the exact-size tiers
    (BRIDGE_CACHE_SEGMENTS=0): the same holds, other figures."""
    cache = str(tmp_path_factory.mktemp("torch-cache"))
    env = {"BRIDGE_CACHE_SEGMENTS": "0"} if request.param == "tiers" else {}
    out = run_scenario(SCENARIO, cache, **env)
    out["mode"] = request.param
    return out


def test_a_deleted_graphs_pool_is_not_handed_out_while_its_replay_runs_on_an_external_stream(
    result,
):
    """Issue 61: the release ordered the pool's frees after registered streams only, so
    a replay on a torch.cuda.ExternalStream still wrote memory given back to the pool."""
    assert result["released_frees"] == 0  # held: nothing given back at the release
    released = result["released"]
    assert released["graph_bytes"] == 0 and released["used"] == 4 * MIB
    assert released["num_deferred"] == 1
    assert result["new_is_tmp"] is False  # the new tensor got other memory
    assert result["unordered_before_sync"] == 0
    # empty_cache synchronizes the device, then gives the pool's bytes back
    assert result["synced"] is True and result["queued_kernels"] == 0
    assert result["unordered"] == 0
    after = result["after_empty_cache"]
    # the new tensor only is live (on segments, the rest of its segment is idle)
    assert after["num_deferred"] == 0 and after["used"] - after["cached"] == 4 * MIB


def test_a_capture_that_failed_before_allocating_leaves_no_capture_behind(result):
    """Issue 61: the core learned the capture's stream at the pool's first allocation
    only; a capture that failed before one stayed active: the block freed during it
    was never given back and stats showed a capture."""
    assert result["during"]["captures_active"] == 1
    if result["mode"] == "tiers":  # (a carved block's free waits in carving's held list)
        assert result["during"]["num_deferred"] == 1
    after = result["after_failure"]
    assert after["captures_active"] == 0 and after["num_deferred"] == 0
    # what was freed during it went back: torch holds nothing live
    assert after["used"] == after["cached"] and result["torch_after_failure"] == 0
    assert result["reused"] is True  # a freed block is handed out again at once
    reuse = result["reuse_figures"]
    assert reuse["used"] - reuse["cached"] == MIB
    assert result["after_reset"]["captures_active"] == 0
    assert result["after_reset"]["used"] == result["after_reset"]["cached"]


def test_a_routing_is_not_taken_for_a_failed_capture(result):
    routing = result["routing"]
    assert routing["captures_active"] == 1 and routing["graph_bytes"] == 0
    assert routing["used"] == MIB  # routed into the pool, live
    released = result["routing_released"]
    assert released["captures_active"] == 0 and released["graph_bytes"] == 0
    # no graph used the pool: its block went back at once, with no device sync
    assert released["num_deferred"] == 0 and released["used"] == released["cached"]
