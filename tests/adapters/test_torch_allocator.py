# SPDX-License-Identifier: Apache-2.0
"""The C++ torch allocator (adapters/_torch_allocator.cpp) against the ledger, on the stand-in.

Needs torch with its C++ headers, a compiler and ninja (skipped otherwise, as in
CI). torch cannot start CUDA without a GPU, so what torch reaches here are the
allocator's methods that take the device as an argument: figures, resets, the
history and snapshot, pools and their checkpoints, and the deleter; the
allocation itself runs on a GPU (tests/gpu/test_gpu_torch_native.py). This is the
stand-in: it shows the C++ maps the ledger as torch expects, never that it
works on a GPU.
"""

from __future__ import annotations

import pytest
from torch_util import cuda_torch, run_scenario

torch = cuda_torch()

SCENARIO = r"""
import json, os, torch
import bridge
from bridge import _runtime
from bridge._runtime import core
from bridge.adapters import torch_build
out = {}
_runtime.ensure_device(0)
missing = torch_build.missing_tools()
if missing:  # the build's tools are not here; a build that fails with them is a failure
    print("RESULT " + json.dumps({"skip": missing})); raise SystemExit
mod = torch_build.load()
assert mod is not None, torch_build.reason
mod.install(core.__file__)
out["installed"] = mod.installed()
out["name"] = mod.current_name()
T = core.TAG_TORCH
def stats():
    s = torch._C._cuda_memoryStats(0)
    return {k: s[k]["all"] if isinstance(s[k], dict) and "all" in s[k] else s[k]
            for k in ("allocated_bytes", "requested_bytes", "allocation", "active",
                      "reserved_bytes", "num_ooms", "num_alloc_retries")}
rc, p1 = core.alloc(0, 4096, 0, T)
rc, p2 = core.alloc(0, 1 << 20, 0, T)
rc, pc = core.alloc(0, 8192, 0, core.TAG_CUPY)       # another framework's: not torch's
out["two"] = stats()
from bridge.adapters import torch as torch_adapter  # the pluggable path's Python figures
py = torch_adapter.memory_stats(0)
out["py_two"] = {k: py[k]["all"] if isinstance(py[k], dict) and "all" in py[k] else py[k]
                 for k in out["two"]}
torch._C._cuda_cudaCachingAllocator_raw_delete(p1)  # torch's raw_delete: the bridge's deleter
out["one"] = stats()
torch._C._cuda_resetAccumulatedMemoryStats(0)
out["reset_accumulated"] = stats()
torch._C._cuda_resetPeakMemoryStats(0)
out["reset_peak"] = stats()
try:  # torch may start CUDA for a snapshot (it cannot here)
    snap = torch._C._cuda_memorySnapshot(None)
    out["segments"] = [[s["address"], s["total_size"], s["blocks"][0]["state"]]
                       for s in snap["segments"]]
except RuntimeError as e:
    out["segments"] = str(e)[:60]
out["history_on"] = torch._C._cuda_isHistoryEnabled()
out["p1"], out["p2"] = p1, p2
# a graph pool: live blocks, a checkpoint, a state set back
pool = (7, 0)
core.graph(0, 0, *pool)                            # begin (as a capture's begin)
rc, g1 = core.alloc_graph(0, 1 << 16, T, *pool, 0)
rc, g2 = core.alloc_graph(0, 1 << 16, T, *pool, 0)
core.graph(1, 0, *pool)                            # end
out["live_both"] = torch._C._cuda_checkPoolLiveAllocations(0, pool, {g1, g2})
out["live_one"] = torch._C._cuda_checkPoolLiveAllocations(0, pool, {g1})
state = torch._C._cuda_getCheckpointState(0, pool)
torch._C._cuda_cudaCachingAllocator_raw_delete(g2)
out["after_free"] = torch._C._cuda_checkPoolLiveAllocations(0, pool, {g1})
before = core.stats(0)[1]["tags"][T]
torch._C._cuda_setCheckpointPoolState(0, state, [], [])  # g2 live again
after = core.stats(0)[1]["tags"][T]
out["live_again"] = torch._C._cuda_checkPoolLiveAllocations(0, pool, {g1, g2})
out["set_state"] = [after["num_allocs"] - before["num_allocs"],
                    after["num_frees"] - before["num_frees"]]
out["graph_bytes_live"] = core.stats(0)[1]["graph_bytes"]
torch._C._cuda_cudaCachingAllocator_raw_delete(g1)
torch._C._cuda_cudaCachingAllocator_raw_delete(g2)  # as graph trees free what no tensor holds
torch._C._cuda_releasePool(0, pool)
out["graph_bytes_released"] = core.stats(0)[1]["graph_bytes"]
# use_mem_pool's routing: this thread's allocations go to the pool until its end
mp = (0, 5)
torch._C._cuda_beginAllocateCurrentThreadToPool(0, mp)
r1 = mod._alloc_on(1 << 16, 0, 0)
torch._C._cuda_endAllocateToPool(0, mp)
r2 = mod._alloc_on(1 << 16, 0, 0)
flags = {b[0]: (b[5], b[6], b[7]) for b in core.live_blocks()}
out["routed"] = [list(flags[r1]), list(flags[r2])]
mod._free(r1)
mod._free(r2)
out["routed_kept"] = core.stats(0)[1]["graph_bytes"]
torch._C._cuda_releasePool(0, mp)
out["routed_released"] = core.stats(0)[1]["graph_bytes"]
torch._C._cuda_setMemoryFraction(0.25, 0)
out["tag_limit"] = core.stats(0)[1]["tags"][T]["limit"]
out["total"] = core.stats(0)[1]["total"]
# the allocation path and its refusals (on an explicit device and stream)
q = mod._alloc_on(1 << 16, 0, 0)
out["alloc_on"] = [q != 0, core.stats(0)[1]["tags"][T]["current"]]
mod._free(q)
core.set_limit(0, core.stats(0)[1]["used"] + (1 << 20))
try:
    mod._alloc_on(8 << 20, 0, 0)
    out["oom"] = "no error"
except torch.cuda.OutOfMemoryError as e:
    out["oom"] = ["OutOfMemoryError", isinstance(e, RuntimeError), str(e).splitlines()[0]]
out["num_ooms"] = torch._C._cuda_memoryStats(0)["num_ooms"]
core.set_limit(0, 0)
# torch 2.12+: a request past torch's fraction is refused before the driver; with
# throw_on_cudamalloc_oom torch's allocator counts it and calls the rejection observers
if hasattr(mod, "_watch_rejections"):
    mod._watch_rejections()
    over = out["total"] // 4 + (1 << 20)
    for setting in ("False", "True"):
        torch._C._accelerator_setAllocatorSettings(
            "throw_on_cudamalloc_oom:" + setting)
        try:
            mod._alloc_on(over, 0, 0)
            kind = "no error"
        except torch.cuda.OutOfMemoryError:
            kind = "OutOfMemoryError"
        out["rejection_" + setting] = [
            kind, torch._C._cuda_memoryStats(0).get("num_oom_rejections"),
            [list(r) for r in mod._rejections_seen()]]
    torch._C._accelerator_setAllocatorSettings("throw_on_cudamalloc_oom:False")
    out["rejection_used"] = core.stats(0)[1]["tags"][T]["current"]
import ctypes
standin = ctypes.CDLL(os.environ["BRIDGE_CUDA_LIBRARY"])
standin.standin_fail.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
standin.standin_fail(b"cuMemAllocFromPoolAsync", 999, 4)  # CUDA_ERROR_UNKNOWN
try:
    mod._alloc_on(1 << 20, 0, 0)
    out["driver_error"] = "no error"
except torch.cuda.OutOfMemoryError as e:
    out["driver_error"] = ["OutOfMemoryError", str(e)]
except RuntimeError as e:
    out["driver_error"] = ["RuntimeError", str(e).splitlines()[0]]
standin.standin_clear_faults()
q = mod._alloc_on(4096, 0, 0)   # torch keeps working
out["after"] = q != 0
mod._free(q)
torch._C._cuda_cudaCachingAllocator_raw_delete(p2)
core.free(pc)
torch._C._cuda_cudaCachingAllocator_raw_delete(p2)  # a double free: counted, never raised
s = core.stats(0)[1]
out["end"] = [s["tags"][T]["current"], s["tags"][T]["count"], s["num_bad_frees"]]
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("torch-cache"))
    return run_scenario(SCENARIO, cache)


def test_installed_as_torchs_allocator(result):
    assert result["installed"] is True and result["name"] == "bridge"


def test_torch_stats_are_torchs_share_of_the_ledger(result):
    two = result["two"]
    assert two["allocated_bytes"]["current"] == 4096 + (1 << 20)  # not CuPy's 8192
    assert two["requested_bytes"]["current"] == 4096 + (1 << 20)
    assert two["allocation"]["current"] == 2 and two["active"]["current"] == 2
    assert two["reserved_bytes"]["current"] >= two["allocated_bytes"]["current"]
    one = result["one"]
    assert one["allocated_bytes"]["current"] == 1 << 20
    assert one["allocation"] == {"current": 1, "peak": 2, "allocated": 2, "freed": 1}


def test_both_torch_paths_give_the_same_figures(result):
    assert result["py_two"] == result["two"]


def test_reset_accumulated_keeps_live_counts_and_reset_peak_lowers_peaks(result):
    acc = result["reset_accumulated"]
    assert acc["allocation"] == {"current": 1, "peak": 2, "allocated": 0, "freed": 0}
    assert acc["allocated_bytes"]["allocated"] == 0 and acc["num_ooms"] == 0
    peak = result["reset_peak"]
    assert peak["allocation"]["peak"] == 1
    assert peak["allocated_bytes"]["peak"] == 1 << 20


def test_snapshot_segments_are_torchs_live_blocks(result):
    assert result["history_on"] is False
    if isinstance(result["segments"], str):
        pytest.skip(f"torch starts CUDA for a snapshot: {result['segments']}")
    segs = {addr: (size, state) for addr, size, state in result["segments"]}
    assert segs[result["p2"]] == (1 << 20, "active_allocated")
    assert result["p1"] not in segs  # freed


def test_graph_pool_live_allocations_and_checkpoint_state(result):
    assert result["live_both"] is True and result["live_one"] is False
    assert result["after_free"] is True  # g2's memory stays with the pool, not live
    # the state set back made g2 live again: one allocation, no free (torch releases a
    # DataPtr no storage claims without calling its deleter; graph trees free it later)
    assert result["set_state"] == [1, 0]
    assert result["live_again"] is True
    assert result["graph_bytes_live"] == 0  # no freed block kept for the pool now
    assert result["graph_bytes_released"] == 0


def test_a_threads_allocations_routed_to_a_pool_stay_with_it_until_its_release(result):
    pools, ordinary = result["routed"]
    assert pools == [1, 0, 5]  # a pool's block (REC_GRAPH, the pool's id) ...
    # ... then an ordinary one: no graph flag, no pool (carved from a segment by default:
    # REC_CARVED, 4; with BRIDGE_CACHE_SEGMENTS=0 a pool block of its own, 0)
    assert ordinary[0] & 1 == 0 and ordinary[0] in (0, 4) and ordinary[1:] == [0, 0]
    assert result["routed_kept"] == 1 << 16  # freed, kept for the pool
    assert result["routed_released"] == 0


def test_memory_fraction_caps_torchs_tag(result):
    assert result["tag_limit"] == result["total"] // 4


def test_a_refusal_is_torchs_oom(result):
    assert result["alloc_on"] == [True, (1 << 20) + (1 << 16)]
    kind, is_runtime, msg = result["oom"]
    assert kind == "OutOfMemoryError" and is_runtime, result["oom"]
    assert msg.startswith(
        "CUDA out of memory. Tried to allocate 0.01 GiB (8388608 bytes) on device 0"
    )
    for words in ("The bridge budget is", "In use: torch", "cupy", "jax"):
        assert words in msg, (words, msg)
    assert result["num_ooms"] == 1


def test_a_request_past_torchs_fraction_is_a_counted_rejection_where_torch_asks(result):
    if "rejection_True" not in result:
        pytest.skip(f"torch {torch.__version__} has no OOM rejection observers (2.12 added them)")
    over = result["total"] // 4 + (1 << 20)
    # without throw_on_cudamalloc_oom: an OOM, as natively, no rejection counted or observed
    assert result["rejection_False"] == ["OutOfMemoryError", 0, []]
    kind, count, seen = result["rejection_True"]
    assert kind == "OutOfMemoryError" and count == 1
    # (device, request, torch's bytes in use, device total), as torch's allocator calls them
    assert seen == [[0, over, result["rejection_used"], result["total"]]]


def test_a_driver_error_is_a_runtime_error_not_an_oom_and_torch_goes_on(result):
    kind, msg = result["driver_error"]
    assert kind == "RuntimeError" and msg.startswith("CUDA error: bridge could not allocate")
    assert "the driver said" in msg
    assert result["after"] is True


def test_frees_end_balanced_and_a_double_free_is_counted(result):
    current, count, bad = result["end"]
    assert current == 0 and count == 0 and bad >= 1
