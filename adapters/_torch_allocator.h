// SPDX-License-Identifier: Apache-2.0
// _torch_allocator.h: what the two units of the bridge's torch allocator share.
//
// _torch_allocator.cpp holds the allocator (torch's CUDAAllocator interface);
// _torch_history.cpp the core's function table, torch's allocation history
// and the snapshot.  Internal to the compiled module.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/ApproximateClock.h>

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "bridge.h"
#include "_torch_abi.h"

namespace bridge_torch
{
namespace CCA = c10::cuda::CUDACachingAllocator;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::TraceEntry;
using MempoolId = c10::MempoolId_t;

// ---- the core's functions, from the loaded bridge._core ----
#define BRIDGE_CORE_FUNCTIONS(X) \
    X(bridge_alloc)              \
    X(bridge_free)               \
    X(bridge_alloc_graph)        \
    X(bridge_captures_active)    \
    X(bridge_record_stream)      \
    X(bridge_lookup)             \
    X(bridge_get_stats)          \
    X(bridge_get_mem_info)       \
    X(bridge_reset_peak)         \
    X(bridge_reset_accumulated)  \
    X(bridge_trim)               \
    X(bridge_device_ready)       \
    X(bridge_set_tag_limit)      \
    X(bridge_graph_begin)        \
    X(bridge_graph_begin_on)     \
    X(bridge_graph_end)          \
    X(bridge_graph_release)      \
    X(bridge_graph_incref)       \
    X(bridge_graph_uses)         \
    X(bridge_graph_adopt)        \
    X(bridge_graph_take)         \
    X(bridge_live_blocks)        \
    X(bridge_grant_peer_access)  \
    X(bridge_register_stream)    \
    X(bridge_stream_registered)  \
    X(bridge_ipc_export)         \
    X(bridge_ipc_import)         \
    X(bridge_ipc_release)        \
    X(bridge_ipc_error)          \
    X(bridge_current_device)     \
    X(bridge_torch_fraction_cap) \
    X(bridge_set_tag_cached)     \
    X(bridge_torch_failure_message)

namespace core
{
#define BRIDGE_DECLARE(name) extern decltype(&::name) name;
BRIDGE_CORE_FUNCTIONS(BRIDGE_DECLARE)
#undef BRIDGE_DECLARE
} // namespace core

// Find the core's functions in the loaded bridge._core at `path` (throws when one is missing).
void load_core(const std::string &path);

// ---- the history torch's _record_memory_history asks for (_torch_history.cpp) ----
struct History {
    std::atomic<bool> on{false};        // recording allocations and frees
    std::atomic<int64_t> n_contexts{0}; // == contexts.size(), readable without mu
    std::mutex mu;                      // guards everything below; a leaf
    CCA::CreateContextFn recorder = nullptr;
    CCA::RecordContext when = CCA::RecordContext::NEVER;
    size_t max_entries = 0;
    std::deque<TraceEntry> trace;
    std::unordered_set<int> skip; // TraceEntry::Action values not recorded
    std::unordered_map<void *, std::shared_ptr<c10::GatheredContext>> contexts; // live blocks
    std::vector<CCA::OutOfMemoryObserver> oom_observers;
    std::vector<CCA::AllocatorTraceTracker> trackers;
    // the entries' times are the cheap clock's ticks; a snapshot gives
    // microseconds since the epoch, as torch's does (memory_viz's timeline)
    c10::ApproximateClockToUnixTimeConverter clock;
};
// Never destroyed: torch frees tensors until the very end of the process,
// after static destructors may have run.
extern History &history;
extern std::atomic<bool> tracking; // a trace tracker is attached

// An event for the history and the trace trackers (no-op when both are off).
void note(TraceEntry::Action action, int device, void *ptr, size_t size, cudaStream_t stream,
          MempoolId pool);
// A context kept for a block freed while the history was off.
void forget_context(void *ptr);
// torch's recordHistory: start, stop or clear the history.
void record_history(bool enabled, CCA::CreateContextFn recorder, size_t max_entries,
                    CCA::RecordContext when, bool clear,
                    const std::vector<std::string> &skip_actions);
// torch's snapshot of torch's blocks (one pool's when `pool` is not {0, 0}).
CCA::SnapshotInfo snapshot_of(MempoolId pool, bool include_traces);
// Every live block of the core (bridge_live_blocks, grown until all fit).
std::vector<bridge_block_info> live_blocks();

} // namespace bridge_torch
