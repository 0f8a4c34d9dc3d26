// SPDX-License-Identifier: Apache-2.0
// _torch_history.cpp: the bridge's torch allocator's link to the core, and the
// history and snapshot torch's memory tools read (_record_memory_history,
// _snapshot, memory_viz): torch's own trace entries and snapshot structs, for
// torch's blocks, with torch's own stack recorder.
//
// Cost: with the history and the trackers off, note() is two relaxed loads;
// on, one lock per event plus the stack recorder (which takes the GIL for
// Python stacks), as torch's own allocator pays.
#include <dlfcn.h>

#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>

#include "_torch_allocator.h"

namespace bridge_torch
{
namespace core
{
#define BRIDGE_DEFINE(name) decltype(&::name) name = nullptr;
BRIDGE_CORE_FUNCTIONS(BRIDGE_DEFINE)
#undef BRIDGE_DEFINE
} // namespace core

void load_core(const std::string &path)
{
    void *lib = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
    TORCH_CHECK(lib, "bridge: the core ", path, " is not loaded in this process (", dlerror(),
                "): import bridge before installing the torch allocator");
#define BRIDGE_RESOLVE(name)                                              \
    core::name = reinterpret_cast<decltype(&::name)>(dlsym(lib, #name));  \
    TORCH_CHECK(core::name, "bridge: the core ", path, " has no ", #name, \
                ": rebuild bridge (pip install -e .) so that the core and this module match");
    BRIDGE_CORE_FUNCTIONS(BRIDGE_RESOLVE)
#undef BRIDGE_RESOLVE
}

// ---- the history ----
History &history = *new History;
std::atomic<bool> tracking{false};

void note(TraceEntry::Action action, int device, void *ptr, size_t size, cudaStream_t stream,
          MempoolId pool)
{
    bool on = history.on.load(std::memory_order_relaxed);
    if (!on && !tracking.load(std::memory_order_relaxed))
        return;
    std::shared_ptr<c10::GatheredContext> ctx;
    CCA::CreateContextFn recorder = nullptr;
    CCA::RecordContext when;
    // Every entry of a block carries the context of its allocation, as torch's
    // do (its _memory_viz reads `frames` on each): the segment's and the
    // block's allocation share one stack, taken once; the free's entries reuse
    // it (a free_requested takes its own under context="all").
    const bool alloc_kind = action == TraceEntry::ALLOC || action == TraceEntry::SEGMENT_ALLOC;
    std::shared_ptr<c10::GatheredContext> stored;
    {
        std::lock_guard<std::mutex> lock(history.mu);
        recorder = history.recorder;
        when = history.when;
        // a new segment takes a new stack (a context left at its address is stale)
        if (on && ptr && action != TraceEntry::OOM && action != TraceEntry::SEGMENT_ALLOC) {
            auto it = history.contexts.find(ptr);
            if (it != history.contexts.end())
                stored = it->second;
        }
    }
    const bool fresh = recorder && on &&
                       ((alloc_kind && !stored && when >= CCA::RecordContext::STATE) ||
                        (action == TraceEntry::FREE_REQUESTED && when == CCA::RecordContext::ALL) ||
                        (action == TraceEntry::OOM && when >= CCA::RecordContext::ALLOC));
    if (fresh)
        ctx = recorder(); // outside the lock: it may take the GIL (Python stacks)
    else
        ctx = stored;
    TraceEntry entry(action, static_cast<c10::DeviceIndex>(device), reinterpret_cast<size_t>(ptr),
                     size, stream, pool, c10::getApproximateTime(),
                     when < CCA::RecordContext::ALLOC ? nullptr : ctx);
    std::vector<CCA::AllocatorTraceTracker> trackers;
    {
        std::lock_guard<std::mutex> lock(history.mu);
        if (on) {
            if (alloc_kind && fresh && ctx && ptr) {
                if (history.contexts.insert_or_assign(ptr, ctx).second)
                    history.n_contexts.fetch_add(1, std::memory_order_relaxed);
            } else if (action == TraceEntry::SEGMENT_FREE) {
                if (history.contexts.erase(ptr))
                    history.n_contexts.fetch_sub(1, std::memory_order_relaxed);
            }
            if (!history.skip.count(static_cast<int>(action)) && history.max_entries > 0) {
                history.trace.push_back(entry);
                while (history.trace.size() > history.max_entries)
                    history.trace.pop_front();
            }
        }
        trackers = history.trackers;
    }
    for (auto &t : trackers)
        t(entry);
}

// A context kept for a block freed while the history was off.
void forget_context(void *ptr)
{
    std::lock_guard<std::mutex> lock(history.mu);
    if (history.contexts.erase(ptr))
        history.n_contexts.fetch_sub(1, std::memory_order_relaxed);
}

void record_history(bool enabled, CCA::CreateContextFn recorder, size_t max_entries,
                    CCA::RecordContext when, bool clear,
                    const std::vector<std::string> &skip_actions)
{
    std::lock_guard<std::mutex> lock(history.mu);
    history.recorder = enabled ? recorder : nullptr;
    history.when = when;
    history.max_entries = enabled ? max_entries : history.max_entries;
    history.skip.clear();
    for (const auto &a : skip_actions)
        history.skip.insert(
            static_cast<int>(c10::CachingDeviceAllocator::parseTraceEntryAction(a)));
    if (clear || !enabled) {
        if (clear)
            history.trace.clear();
        if (!enabled) {
            history.n_contexts.fetch_sub(static_cast<int64_t>(history.contexts.size()));
            history.contexts.clear();
        }
    }
    history.on.store(enabled);
}

std::vector<bridge_block_info> live_blocks()
{
    std::vector<bridge_block_info> all(256);
    size_t count = 0;
    for (;;) {
        core::bridge_live_blocks(all.data(), all.size(), &count);
        if (count <= all.size())
            break;
        all.resize(count + count / 4 + 16);
    }
    all.resize(count);
    return all;
}

CCA::SnapshotInfo snapshot_of(MempoolId pool, bool include_traces)
{
    CCA::SnapshotInfo info;
    std::vector<bridge_block_info> all = live_blocks();
    bool one_pool = pool.first != 0 || pool.second != 0;
    std::lock_guard<std::mutex> lock(history.mu);
    for (const bridge_block_info &b : all) {
        if (b.tag != BRIDGE_TAG_TORCH)
            continue;
        bool graph = b.flags & 1u;
        if (one_pool && !(graph && b.graph0 == pool.first && b.graph1 == pool.second))
            continue;
        bool live = !(b.flags & 2u);
        c10::CachingDeviceAllocator::SegmentInfo seg;
        seg.device = static_cast<c10::DeviceIndex>(b.device);
        seg.address = b.ptr;
        seg.total_size = b.size;
        seg.requested_size = live ? b.size : 0;
        seg.allocated_size = live ? b.size : 0;
        seg.active_size = live ? b.size : 0;
        seg.stream = reinterpret_cast<void *>(b.stream);
        seg.is_large = b.size > (1u << 20);
        seg.owner_private_pool_id = graph ? MempoolId{b.graph0, b.graph1} : MempoolId{0, 0};
        c10::CachingDeviceAllocator::BlockInfo blk;
        blk.size = b.size;
        blk.requested_size = b.size;
        blk.allocated = live;
        blk.active = live;
        auto it = history.contexts.find(reinterpret_cast<void *>(b.ptr));
        if (it != history.contexts.end())
            blk.context_when_allocated = it->second;
        seg.context_when_allocated = blk.context_when_allocated;
        seg.blocks.push_back(std::move(blk));
        info.segments.push_back(std::move(seg));
    }
    int n = std::max(static_cast<int>(c10::cuda::device_count()), 1);
    info.device_traces.resize(static_cast<size_t>(n));
    if (include_traces) {
        auto to_ns = history.clock.makeConverter(); // nanoseconds since the epoch
        for (const TraceEntry &e : history.trace) {
            if (e.device_ >= 0 && e.device_ < n) {
                info.device_traces[static_cast<size_t>(e.device_)].push_back(e);
                TraceEntry &copy = info.device_traces[static_cast<size_t>(e.device_)].back();
                copy.time_.t_ = to_ns(e.time_.approx_t_) / 1000;
            }
        }
    }
    info.config_metadata.garbage_collection_threshold = 0;
    info.config_metadata.max_split_size = std::numeric_limits<size_t>::max();
    info.config_metadata.pinned_num_register_threads = 1;
    info.config_metadata.expandable_segments = false;
    info.config_metadata.release_lock_on_malloc = false;
    info.config_metadata.pinned_use_host_register = false;
    info.config_metadata.graph_capture_record_stream_reuse = false;
    info.config_metadata.last_allocator_settings = "bridge";
    return info;
}

} // namespace bridge_torch
