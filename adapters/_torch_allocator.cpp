// SPDX-License-Identifier: Apache-2.0
// _torch_allocator.cpp: torch's whole CUDA allocator interface over bridge's core.
//
// One class, BridgeAllocator, derives from torch's
// c10::cuda::CUDACachingAllocator::CUDAAllocator and is installed with torch's
// own changeCurrentAllocator, so every CUDA tensor, torch's C++ callers
// (cuDNN's workspace search, cuBLAS, NCCL) and torch's Python figures reach
// the core directly: one ledger, one budget, the same cache, graph pools,
// waiting, share, views and history as the other frameworks.  It is built
// against the installed torch (adapters/torch_build.py) and talks to the core
// through the core's exported C functions, found in the already-loaded
// bridge._core with dlsym (no link-time dependency on where bridge lives;
// _torch_history.cpp holds that table, the history and the snapshot).
//
// The hot path (allocate, the deleter): no GIL, no Python, no lock of its own:
// the current device and stream (as torch's own allocator reads them), one
// atomic load (is a capture or MemPool routing allocations?), bridge_alloc;
// one atomic load (is the history on?) and bridge_free.
//
// Out of memory: the core's recovery chain (cache flush, sync, framework
// caches, callbacks, waiting) runs inside bridge_alloc; a refusal then calls
// torch's OOM observers and throws c10::OutOfMemoryError from this C++ frame
// (torch.cuda.OutOfMemoryError in Python; cuDNN's and cuBLAS's smaller
// workspace fallbacks catch it in C++).
//
// Pools (CUDA graphs, torch.cuda.MemPool, graph trees): torch's pool calls map
// onto the core's graph pools (graph.c): begin/end/release count users and
// route the claimed streams' allocations to the pool (the begin also tells the
// core torch's current stream and whether a capture begins on it, so that a
// capture that fails before allocating is noticed); createOrIncrefPool is a
// use without routing; the checkpoint calls of CUDA graph trees read and set
// which of a pool's blocks are live.  A MemPool made with an allocator of its
// own gets its blocks from that allocator, as natively (outside the budget);
// one made with use_on_oom=True lends its idle blocks to a request refused for
// memory, as torch's allocator does before its out-of-memory error.
//
// Locks: route_mu (the routes torch announced), history.mu (history,
// observers) and foreign.mu (pools with an allocator of their own) are
// leaves: none is held while another is taken or the core is called, except
// the core's own leaf locks from bridge_free inside setCheckpointPoolState.
//
// torch versions: the methods torch's interface gained after 2.11 are compiled
// where the installed torch has them, under BRIDGE_TORCH_HAS_<name>, which
// adapters/torch_interface.py defines from torch's headers (torch 2.12 added
// the pure virtual attachOomRejectionObserver, with throw_on_cudamalloc_oom
// and num_oom_rejections).
#include <c10/cuda/CUDACachingAllocator.h>
#ifdef BRIDGE_TORCH_HAS_throw_on_cudamalloc_oom
#include <c10/cuda/CUDAAllocatorConfig.h>
#endif
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <map>
#include <mutex>
#include <tuple>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "_torch_allocator.h"

namespace bridge_torch
{
// ---- pools with an allocator of their own: torch.cuda.MemPool(allocator=...) ----
// As torch's own allocator does, a pool created with another allocator gets
// its memory from that allocator (NCCL's symmetric memory, vLLM's cuMem
// allocator): those blocks are outside the shared pool and the budget, by the
// user's choice.  Under foreign.mu (a leaf).
using PoolKey = std::tuple<int, uint64_t, uint64_t>;
struct Foreign {
    std::mutex mu;
    std::map<PoolKey, std::shared_ptr<CCA::CUDAAllocator>> pools;
    std::unordered_map<void *, std::shared_ptr<CCA::CUDAAllocator>> blocks; // live ones
    std::atomic<int64_t> n_blocks{0}; // == blocks.size(), readable without mu
};
Foreign &foreign = *new Foreign;

std::shared_ptr<CCA::CUDAAllocator> foreign_pool(int device, MempoolId id)
{
    std::lock_guard<std::mutex> lock(foreign.mu);
    auto it = foreign.pools.find(PoolKey{device, id.first, id.second});
    return it == foreign.pools.end() ? nullptr : it->second;
}

// The allocator of a live block from a pool of its own; nullptr for the bridge's.
std::shared_ptr<CCA::CUDAAllocator> foreign_owner(void *ptr)
{
    if (foreign.n_blocks.load(std::memory_order_relaxed) == 0)
        return nullptr;
    std::lock_guard<std::mutex> lock(foreign.mu);
    auto it = foreign.blocks.find(ptr);
    return it == foreign.blocks.end() ? nullptr : it->second;
}

// ---- the deleter of every tensor's memory (the free hot path) ----
void bridge_delete(void *ptr)
{
    if (!ptr)
        return;
    if (foreign.n_blocks.load(std::memory_order_relaxed) > 0) {
        std::shared_ptr<CCA::CUDAAllocator> owner;
        {
            std::lock_guard<std::mutex> lock(foreign.mu);
            auto it = foreign.blocks.find(ptr);
            if (it != foreign.blocks.end()) {
                owner = std::move(it->second);
                foreign.blocks.erase(it);
                foreign.n_blocks.fetch_sub(1, std::memory_order_relaxed);
            }
        }
        if (owner) {
            owner->raw_delete(ptr);
            return;
        }
    }
    if (history.on.load(std::memory_order_relaxed) || tracking.load(std::memory_order_relaxed)) {
        size_t size = 0;
        int device = 0, tag = 0;
        core::bridge_lookup(ptr, &size, &device, &tag);
        // every block is one pool allocation: its own segment, as the snapshot shows it
        note(TraceEntry::FREE_REQUESTED, device, ptr, size, nullptr, {0, 0});
        note(TraceEntry::FREE_COMPLETED, device, ptr, size, nullptr, {0, 0});
        note(TraceEntry::SEGMENT_FREE, device, ptr, size, nullptr, {0, 0});
    } else if (history.n_contexts.load(std::memory_order_relaxed) > 0) {
        forget_context(ptr);
    }
    core::bridge_free(ptr); // never fails: an unknown pointer is counted
}

// ---- routes: streams torch sends to a pool (captures, use_mem_pool, trees) ----
struct Route {
    int device;
    MempoolId id;
    std::function<bool(cudaStream_t)> filter;
    uint64_t serial;
};
std::mutex &route_mu = *new std::mutex;
std::vector<Route> &routes = *new std::vector<Route>; // under route_mu
uint64_t route_serial = 0;                            // under route_mu
// MemPools made with use_on_oom=True: (device, id0, id1), under route_mu
std::vector<PoolKey> &oom_pools = *new std::vector<PoolKey>;

bool route_of(int device, cudaStream_t stream, MempoolId *id)
{
    std::lock_guard<std::mutex> lock(route_mu);
    for (const Route &r : routes) {
        if (r.device == device && r.filter && r.filter(stream)) {
            *id = r.id;
            return true;
        }
    }
    return false;
}

struct PoolBlock {
    uint64_t ptr, size, stream;
    bool live; // allocated (not a block the pool keeps after its tensor's free)
    int tag;
};

// The blocks of one pool (graph blocks of `id` on `device`), live or freed.
std::vector<PoolBlock> pool_blocks(int device, MempoolId id)
{
    std::vector<PoolBlock> out;
    for (const bridge_block_info &b : live_blocks())
        if (b.device == device && (b.flags & 1u) && b.graph0 == id.first && b.graph1 == id.second)
            out.push_back({b.ptr, b.size, b.stream, !(b.flags & 2u), b.tag});
    return out;
}

struct PoolState : CCA::AllocatorState {
    int device = 0;
    MempoolId id{0, 0};
    std::unordered_map<uint64_t, bool> live; // ptr -> live when the state was taken
};

class BridgeAllocator final : public CCA::CUDAAllocator
{
  public:
    // ---- allocation ----
    // The current stream.  torch's pooled streams (an odd stream id: torch's
    // own, never destroyed, on any device) are registered with the core the
    // first time they are met, so that blocks freed on them are ordered and
    // cached on them; external streams (an even id: the handle itself) are
    // not, and their frees go where the core can prove order.  Cost: one
    // lock-free lookup for a non-default stream.
    static void register_if_pooled(const c10::cuda::CUDAStream &cs)
    {
        if ((cs.id() & 1) && !core::bridge_stream_registered(cs.stream()))
            core::bridge_register_stream(cs.stream());
    }
    static cudaStream_t current_stream(c10::DeviceIndex device)
    {
        c10::cuda::CUDAStream cs = c10::cuda::getCurrentCUDAStream(device);
        register_if_pooled(cs);
        return cs.stream();
    }
    void *malloc(size_t size, int device, cudaStream_t stream)
    {
        void *p = nullptr;
        if (size == 0)
            return nullptr;
        MempoolId id;
        int rc;
        bool routed = core::bridge_captures_active(device) && route_of(device, stream, &id);
        if (routed) {
            if (auto other = foreign_pool(device, id))
                return foreign_alloc(other, size, device, id, stream);
            rc = core::bridge_alloc_graph(device, size, BRIDGE_TAG_TORCH, id.first, id.second,
                                          stream, &p);
        } else
            rc = core::bridge_alloc(device, size, stream, BRIDGE_TAG_TORCH, &p);
        if (rc != BRIDGE_OK && (routed || !take_on_oom(rc, size, device, stream, &p)))
            fail(rc, size, device, stream);
        if (history.on.load(std::memory_order_relaxed) ||
            tracking.load(std::memory_order_relaxed)) {
            // a segment of its own (NCCL's register hook and memory_viz read segments)
            note(TraceEntry::SEGMENT_ALLOC, device, p, size, stream, {0, 0});
            note(TraceEntry::ALLOC, device, p, size, stream, {0, 0});
        }
        return p;
    }

    // A block of a pool with an allocator of its own (that allocator's errors
    // are its own).  One that returns no memory is out of memory, as torch's
    // own allocator takes it: torch.cuda.OutOfMemoryError, never a null
    // pointer under a tensor of nonzero size.
    void *foreign_alloc(const std::shared_ptr<CCA::CUDAAllocator> &other, size_t size, int device,
                        MempoolId id, cudaStream_t stream)
    {
        void *p = other->raw_alloc_with_stream(size, stream);
        if (!p) {
            // counted in num_ooms and told to the observers, as torch's own allocator does
            if (device >= 0 && device < BRIDGE_MAX_DEVICES)
                foreign_ooms_[device].fetch_add(1, std::memory_order_relaxed);
            bridge_stats s{};
            bridge_mem_info mi{};
            observe_oom(device, size, stream, s, mi);
        }
        TORCH_CHECK_WITH(OutOfMemoryError, p, "CUDA out of memory. Tried to allocate ", size,
                         " bytes on device ", device, " from torch.cuda.MemPool (", id.first, ", ",
                         id.second, "), whose allocator (", other->name(),
                         ") returned no memory. Free that pool's tensors, or allocate "
                         "outside torch.cuda.use_mem_pool.");
        std::lock_guard<std::mutex> lock(foreign.mu);
        foreign.blocks[p] = other;
        foreign.n_blocks.fetch_add(1, std::memory_order_relaxed);
        return p;
    }

    // Refused for memory, a request no pool was routed to takes a block a
    // use_on_oom MemPool of its device freed, as torch's own allocator does
    // before its out-of-memory error (no new memory: the pool's idle blocks).
    static bool take_on_oom(int rc, size_t size, int device, cudaStream_t stream, void **p)
    {
        if (rc != BRIDGE_E_BUDGET && rc != BRIDGE_E_OOM && rc != BRIDGE_E_TAG_LIMIT)
            return false;
        std::vector<PoolKey> pools;
        {
            std::lock_guard<std::mutex> lock(route_mu);
            for (const PoolKey &k : oom_pools)
                if (std::get<0>(k) == device)
                    pools.push_back(k);
        }
        for (const PoolKey &k : pools)
            if (core::bridge_graph_take(device, size, BRIDGE_TAG_TORCH, std::get<1>(k),
                                        std::get<2>(k), stream, p) == BRIDGE_OK)
                return true;
        return false;
    }

    [[noreturn]] void fail(int rc, size_t size, int device, cudaStream_t stream)
    {
        std::string msg(4096, '\0');
        int oom = 0;
        size_t n =
            core::bridge_torch_failure_message(rc, size, device, msg.data(), msg.size(), &oom);
        msg.resize(std::min(n, msg.size() - 1));
        if (!oom)
            TORCH_CHECK(false, msg);
        bridge_stats s{};
        bridge_mem_info mi{};
        observe_oom(device, size, stream, s, mi);
#ifdef BRIDGE_TORCH_HAS_attachOomRejectionObserver
        if (rc == BRIDGE_E_TAG_LIMIT)
            rejected(device, size, s.tag[BRIDGE_TAG_TORCH].current, mi.total);
#endif
        TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
    }

    // An out-of-memory error to come: its trace entry and torch's OOM observers,
    // from the device's figures (read into s and mi).
    void observe_oom(int device, size_t size, cudaStream_t stream, bridge_stats &s,
                     bridge_mem_info &mi)
    {
        core::bridge_get_mem_info(device, &mi);
        core::bridge_get_stats(device, &s);
        note(TraceEntry::OOM, device, reinterpret_cast<void *>(mi.free), size, stream, {0, 0});
        std::vector<CCA::OutOfMemoryObserver> observers;
        {
            std::lock_guard<std::mutex> lock(history.mu);
            observers = history.oom_observers;
        }
        // torch's arguments: the request, what torch may use (its memory
        // fraction's cap, else the device's memory or the budget) and the
        // free memory the request met
        uint64_t cap = s.tag[BRIDGE_TAG_TORCH].limit;
        size_t allowed = cap == 0                       ? mi.total
                         : cap == BRIDGE_TAG_LIMIT_ZERO ? 0
                                                        : std::min<uint64_t>(cap, mi.total);
        for (auto &o : observers)
            o(device, size, allowed, mi.free);
    }

#ifdef BRIDGE_TORCH_HAS_attachOomRejectionObserver
    // A refusal at torch's own cap (set_per_process_memory_fraction), which the
    // core makes before asking the driver.  As torch's allocator does with
    // PYTORCH_CUDA_ALLOC_CONF=throw_on_cudamalloc_oom:True (a request past the
    // fraction refused before cudaMalloc): count it and call the rejection
    // observers (device, request, torch's bytes in use, device total).
    void rejected(int device, size_t size, uint64_t in_use, uint64_t total)
    {
#ifdef BRIDGE_TORCH_HAS_throw_on_cudamalloc_oom
        if (!CCA::CUDAAllocatorConfig::throw_on_cudamalloc_oom())
            return;
#endif
        if (device >= 0 && device < BRIDGE_MAX_DEVICES)
            rejections_[device].fetch_add(1, std::memory_order_relaxed);
        std::vector<CCA::OomRejectionObserver> observers;
        {
            std::lock_guard<std::mutex> lock(history.mu);
            observers = rejection_observers_;
        }
        for (auto &o : observers)
            o(device, size, in_use, total);
    }
#endif

    c10::DataPtr allocate(size_t size) override
    {
        c10::DeviceIndex device = c10::cuda::current_device();
        cudaStream_t stream = current_stream(device);
        void *p = malloc(size, device, stream);
        return {p, p, &bridge_delete, c10::Device(c10::DeviceType::CUDA, device)};
    }
    c10::DeleterFnPtr raw_deleter() const override
    {
        return &bridge_delete;
    }
    void copy_data(void *dest, const void *src, std::size_t count) const final
    {
        C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
    }
    void *raw_alloc(size_t nbytes) override
    {
        c10::DeviceIndex device = c10::cuda::current_device();
        return malloc(nbytes, device, current_stream(device));
    }
    void *raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override
    {
        // torch.cuda.caching_allocator_alloc(n, stream=s) (DGL and others pass
        // torch's current stream): registered as allocate() registers it when it
        // is one of torch's pooled streams; any other stream's blocks are freed
        // where the core can order them (a non-blocking one's after a device-wide
        // synchronization: streams.h, stream_needs_device_order)
        c10::DeviceIndex device = c10::cuda::current_device();
        c10::cuda::CUDAStream cs = c10::cuda::getCurrentCUDAStream(device);
        if (cs.stream() == stream)
            register_if_pooled(cs);
        return malloc(nbytes, device, stream);
    }
    void raw_delete(void *ptr) override
    {
        bridge_delete(ptr);
    }

    // ---- set-up and settings ----
    void init(int) override
    {
        initialized_.store(true);
    }
    bool initialized() override
    {
        return initialized_.load();
    }
    double getMemoryFraction(c10::DeviceIndex device) override
    {
        std::lock_guard<std::mutex> lock(settings_mu_);
        auto it = fraction_.find(device);
        return it == fraction_.end() ? 1.0 : it->second;
    }
    void setMemoryFraction(double fraction, c10::DeviceIndex device) override
    {
        TORCH_CHECK(fraction >= 0 && fraction <= 1, "invalid fraction: ", fraction,
                    ". Please set within [0, 1].");
        {
            std::lock_guard<std::mutex> lock(settings_mu_);
            fraction_[device] = fraction;
        }
        // a device not set up yet keeps the cap for its first allocation;
        // a fraction of no bytes refuses every allocation, as torch's does
        core::bridge_set_tag_limit(device, BRIDGE_TAG_TORCH,
                                   core::bridge_torch_fraction_cap(fraction, device));
    }
    std::vector<CCA::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override
    {
        return {}; // the pool grows in the driver; no expandable segments of ours
    }
    // torch.cuda.caching_allocator_enable(False): torch's own allocator then
    // takes every block from the driver and gives it back at its free; here
    // torch's freed blocks go back to the pool at once, none cached nor carved
    // from a segment (True: cached again).
    void enable(bool value) override
    {
        enabled_.store(value);
        core::bridge_set_tag_cached(BRIDGE_TAG_TORCH, value ? 1 : 0);
    }
    bool isEnabled() const override
    {
        return enabled_.load();
    }
    std::string name() override
    {
        return "bridge";
    }

    // ---- caches ----
    void emptyCache(MempoolId id) override
    {
        if (id.first != 0 || id.second != 0)
            return; // a pool's memory goes back when its last user releases it
        for (int d = 0; d < BRIDGE_MAX_DEVICES; d++)
            if (core::bridge_device_ready(d))
                core::bridge_trim(d, 0);
    }
    // The largest block a request could get now (cuDNN sizes its benchmark
    // workspaces by it): what the budget leaves, or without one the device's
    // free memory with the pool's idle memory and the cache of freed blocks,
    // all of which a request can have (torch's: free memory or its largest
    // cached block).
    void cacheInfo(c10::DeviceIndex device, size_t *largest) override
    {
        bridge_mem_info mi{};
        if (core::bridge_get_mem_info(device, &mi) != BRIDGE_OK)
            *largest = 0;
        else
            *largest = mi.limit ? mi.free : mi.driver_free + mi.pool_idle + mi.cached;
    }
    void *getBaseAllocation(void *ptr, size_t *size) override
    {
        if (auto owner = foreign_owner(ptr))
            return owner->getBaseAllocation(ptr, size);
        int device = 0, tag = 0;
        size_t n = 0;
        TORCH_CHECK(core::bridge_lookup(ptr, &n, &device, &tag) == BRIDGE_OK, "bridge: ", ptr,
                    " is not the start of a block the bridge handed out");
        if (size)
            *size = n;
        return ptr;
    }
    void recordStream(const c10::DataPtr &ptr, c10::cuda::CUDAStream stream) override
    {
        if (!ptr.get() || ptr.get_deleter() != &bridge_delete)
            return; // not ours (an empty tensor, memory from elsewhere)
        if (auto owner = foreign_owner(ptr.get())) {
            // the owner's own record of the stream (its DataPtr is ours: pass the pointer)
            owner->recordStream(c10::DataPtr(ptr.get(), ptr.device()), stream);
            return;
        }
        // one of torch's pooled streams, on any device, is known to live: the
        // block's free is then ordered after it (an unknown stream's is not)
        register_if_pooled(stream);
        core::bridge_record_stream(ptr.get(), stream.stream());
    }

    // ---- figures: torch's stats of torch's share, from the ledger ----
    DeviceStats getDeviceStats(c10::DeviceIndex device) override
    {
        DeviceStats out;
        bridge_stats s{};
        if (core::bridge_get_stats(device, &s) != BRIDGE_OK)
            return out; // a device nobody used: all zero
        const bridge_tag_stats &t = s.tag[BRIDGE_TAG_TORCH];
        auto fill = [](c10::CachingAllocator::StatArray &a, int64_t current, int64_t peak,
                       int64_t allocated, int64_t freed) {
            using c10::CachingAllocator::StatType;
            for (auto type : {StatType::AGGREGATE, StatType::LARGE_POOL}) {
                auto &st = a[static_cast<size_t>(type)];
                st.current = current;
                st.peak = peak;
                st.allocated = allocated;
                st.freed = freed;
            }
        };
        auto i64 = [](uint64_t v) { return static_cast<int64_t>(v); };
        fill(out.allocated_bytes, i64(t.current), i64(t.peak), i64(t.allocated), i64(t.freed));
        fill(out.active_bytes, i64(t.current), i64(t.peak), i64(t.allocated), i64(t.freed));
        fill(out.requested_bytes, i64(t.current), i64(t.peak), i64(t.allocated), i64(t.freed));
        fill(out.allocation, i64(t.count), i64(t.count_peak), i64(t.num_allocs), i64(t.num_frees));
        fill(out.active, i64(t.count), i64(t.count_peak), i64(t.num_allocs), i64(t.num_frees));
        fill(out.segment, i64(t.count), i64(t.count_peak), i64(t.num_allocs), i64(t.num_frees));
        // reserved: torch's live blocks, the blocks graph pools keep, and the
        // cache of freed blocks (shared by every framework, and torch's to take)
        int64_t reserved = i64(t.current + s.graph_bytes + s.cached);
        fill(out.reserved_bytes, reserved, std::max(reserved, i64(t.reserved_peak)),
             i64(t.allocated), i64(t.freed));
        // since the last reset_accumulated_memory_stats, as torch's own count
        out.num_alloc_retries = i64(s.num_retries - std::min(s.num_retries, retries_base(device)));
        out.num_ooms = i64(t.num_ooms) + foreign_ooms(device);
        out.num_device_alloc = i64(t.num_allocs);
        out.num_device_free = i64(t.num_frees);
        out.max_split_size = -1;
#if defined(BRIDGE_TORCH_HAS_attachOomRejectionObserver) && \
    defined(BRIDGE_TORCH_HAS_num_oom_rejections)
        if (device >= 0 && device < BRIDGE_MAX_DEVICES)
            out.num_oom_rejections = rejections_[device].load(std::memory_order_relaxed);
#endif
        return out;
    }
    void resetAccumulatedStats(c10::DeviceIndex device) override
    {
        core::bridge_reset_accumulated(device, BRIDGE_TAG_TORCH);
        // the core's count of retried allocations is the device's, never reset
        // (bridge.stats()): torch's count is taken from here on
        bridge_stats s{};
        if (device >= 0 && device < BRIDGE_MAX_DEVICES &&
            core::bridge_get_stats(device, &s) == BRIDGE_OK)
            retries_base_[device].store(s.num_retries, std::memory_order_relaxed);
        if (device >= 0 && device < BRIDGE_MAX_DEVICES)
            foreign_ooms_[device].store(0, std::memory_order_relaxed);
#ifdef BRIDGE_TORCH_HAS_attachOomRejectionObserver
        if (device >= 0 && device < BRIDGE_MAX_DEVICES)
            rejections_[device].store(0, std::memory_order_relaxed);
#endif
    }
    void resetPeakStats(c10::DeviceIndex device) override
    {
        core::bridge_reset_peak(device, BRIDGE_TAG_TORCH);
    }

    // ---- history, snapshot, observers ----
    void recordHistory(bool enabled, CCA::CreateContextFn recorder, size_t max_entries,
                       CCA::RecordContext when, bool clear,
                       const std::vector<std::string> &skip_actions) override
    {
        record_history(enabled, recorder, max_entries, when, clear, skip_actions);
    }
    bool isHistoryEnabled() override
    {
        return history.on.load();
    }
    void attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) override
    {
        std::lock_guard<std::mutex> lock(history.mu);
        history.oom_observers.push_back(std::move(observer));
    }
#ifdef BRIDGE_TORCH_HAS_attachOomRejectionObserver
    // torch 2.12+: called for a request refused before the driver (rejected()).
    void attachOomRejectionObserver(CCA::OomRejectionObserver observer) override
    {
        std::lock_guard<std::mutex> lock(history.mu);
        rejection_observers_.push_back(std::move(observer));
    }
#endif
    void attachAllocatorTraceTracker(CCA::AllocatorTraceTracker tracker) override
    {
        std::lock_guard<std::mutex> lock(history.mu);
        history.trackers.push_back(std::move(tracker));
        tracking.store(true);
    }
    CCA::SnapshotInfo snapshot(MempoolId pool, bool include_traces) override
    {
        return snapshot_of(pool, include_traces);
    }

    // ---- pools: CUDA graphs, torch.cuda.MemPool, graph trees ----
    void beginAllocateToPool(c10::DeviceIndex device, MempoolId id,
                             std::function<bool(cudaStream_t)> filter) override
    {
        cudaStream_t stream;
        try {
            stream = current_stream(device);
        } catch (const std::exception &) {
            begin_pool(device, id, std::move(filter), nullptr, -1); // no stream to ask
            return;
        }
        begin_on(device, id, std::move(filter), stream);
    }
    // What a begin is, from torch's current stream `stream`: torch calls the
    // hook before cudaStreamBeginCapture, so a capture's filter (the stream
    // capturing into this capture) refuses the stream now, and a routing's
    // (use_mem_pool: this thread; graph trees: this stream) takes it.
    void begin_on(int device, MempoolId id, std::function<bool(cudaStream_t)> filter,
                  cudaStream_t stream)
    {
        int kind;
        try {
            kind = filter && filter(stream) ? 0 : 1;
        } catch (const std::exception &) {
            kind = -1;
        }
        begin_pool(device, id, std::move(filter), stream, kind);
    }
    // kind: 1 a capture begins next on `stream`, 0 a routing, -1 unknown.
    void begin_pool(int device, MempoolId id, std::function<bool(cudaStream_t)> filter,
                    cudaStream_t stream, int kind)
    {
        uint64_t serial;
        {
            std::lock_guard<std::mutex> lock(route_mu);
            // one route per pool, as torch's allocator allows (its end is that route's)
            for (const Route &r : routes)
                TORCH_CHECK(r.device != device || r.id != id,
                            "beginAllocateToPool: already recording to mempool_id");
            serial = ++route_serial;
            routes.push_back(Route{device, id, std::move(filter), serial});
        }
        int rc = kind < 0 ? core::bridge_graph_begin(device, id.first, id.second)
                          : core::bridge_graph_begin_on(device, id.first, id.second, stream, kind);
        if (rc != BRIDGE_OK) {
            drop_route(serial);
            TORCH_CHECK(false, "bridge: no host memory to open a memory pool on device ", device);
        }
    }
    void endAllocateToPool(c10::DeviceIndex device, MempoolId id) override
    {
        {
            std::lock_guard<std::mutex> lock(route_mu);
            for (auto it = routes.begin(); it != routes.end(); ++it) {
                if (it->device == device && it->id == id) {
                    routes.erase(it);
                    break;
                }
            }
        }
        core::bridge_graph_end(device, id.first, id.second);
    }
    void releasePool(c10::DeviceIndex device, MempoolId id) override
    {
        core::bridge_graph_release(device, id.first, id.second);
        if (core::bridge_graph_uses(device, id.first, id.second) == 0) {
            {
                std::lock_guard<std::mutex> lock(foreign.mu); // its live blocks keep their owner
                foreign.pools.erase(PoolKey{device, id.first, id.second});
            }
            set_use_on_oom(device, id, false);
        }
    }
    int getPoolUseCount(c10::DeviceIndex device, MempoolId id) override
    {
        return core::bridge_graph_uses(device, id.first, id.second);
    }
    void createOrIncrefPool(c10::DeviceIndex device, MempoolId id,
                            std::shared_ptr<CUDAAllocator> allocator) override
    {
        TORCH_CHECK(core::bridge_graph_incref(device, id.first, id.second) == BRIDGE_OK,
                    "bridge: no host memory to open a memory pool on device ", device);
        if (allocator && allocator.get() != this) {
            std::lock_guard<std::mutex> lock(foreign.mu);
            foreign.pools[PoolKey{device, id.first, id.second}] = std::move(allocator);
        }
    }
    void setUseOnOOM(c10::DeviceIndex device, MempoolId id, bool use_on_oom) override
    {
        set_use_on_oom(device, id, use_on_oom);
    }
    static void set_use_on_oom(int device, MempoolId id, bool on)
    {
        std::lock_guard<std::mutex> lock(route_mu);
        PoolKey key{device, id.first, id.second};
        auto it = std::find(oom_pools.begin(), oom_pools.end(), key);
        if (on && it == oom_pools.end())
            oom_pools.push_back(key);
        else if (!on && it != oom_pools.end())
            oom_pools.erase(it);
    }
    void setNoSplit(c10::DeviceIndex, MempoolId) override
    {
        // The bridge never splits a block: every block is one pool allocation.
    }
    bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId id,
                                  const std::unordered_set<void *> &expected) override
    {
        size_t live = 0;
        for (const PoolBlock &b : pool_blocks(device, id)) {
            if (!b.live)
                continue;
            if (!expected.count(reinterpret_cast<void *>(b.ptr)))
                return false;
            live++;
        }
        return live == expected.size();
    }
    std::shared_ptr<CCA::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                            MempoolId id) override
    {
        auto state = std::make_shared<PoolState>();
        state->device = device;
        state->id = id;
        for (const PoolBlock &b : pool_blocks(device, id))
            state->live[b.ptr] = b.live;
        return state;
    }
    CCA::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                                std::shared_ptr<CCA::AllocatorState> pps) override
    {
        auto state = std::dynamic_pointer_cast<PoolState>(pps);
        TORCH_CHECK(state && state->device == device,
                    "bridge: a pool state from another allocator or device");
        CCA::CheckpointDelta delta;
        for (const PoolBlock &b : pool_blocks(device, state->id)) {
            auto it = state->live.find(b.ptr);
            bool was_live = it != state->live.end() && it->second;
            void *p = reinterpret_cast<void *>(b.ptr);
            if (b.live && !was_live) {
                bridge_delete(p); // back to the pool's free list
                delta.ptrs_freed.push_back(p);
            } else if (!b.live && was_live &&
                       core::bridge_graph_adopt(p, BRIDGE_TAG_TORCH) == BRIDGE_OK) {
                delta.dataptrs_allocd.emplace_back(p, p, &bridge_delete,
                                                   c10::Device(c10::DeviceType::CUDA, device));
            }
        }
        return delta;
    }

    // ---- several processes and devices ----
    // A block of the exportable pool (unify(ipc=True)) as torch pickles it:
    // the core's handle (the block's export data, where to fetch the pool's
    // descriptor), its offset 0 (torch's storages start at their blocks).
    // torch keeps the block alive while a consumer holds it (its sent-data
    // ref counting); the core also holds it for the consumer's connection.
    CCA::ShareableHandle shareIpcHandle(void *ptr) override
    {
        unsigned char h[BRIDGE_IPC_HANDLE_SIZE];
        uint64_t offset = 0;
        TORCH_CHECK(core::bridge_ipc_export(ptr, h, &offset) == BRIDGE_OK,
                    "bridge: this CUDA tensor cannot be sent to another process: ",
                    core::bridge_ipc_error());
        return {static_cast<ptrdiff_t>(offset), std::string(reinterpret_cast<char *>(h), sizeof h)};
    }
    // The block of another process's handle, imported on the current device
    // (the context torch's guard made current) and let go when torch drops
    // its last reference.
    std::shared_ptr<void> getIpcDevPtr(std::string handle) override
    {
        void *p = nullptr;
        int device = 0;
        core::bridge_current_device(&device);
        TORCH_CHECK(core::bridge_ipc_import(reinterpret_cast<const unsigned char *>(handle.data()),
                                            handle.size(), device, &p) == BRIDGE_OK,
                    "bridge: a CUDA tensor from another process cannot be opened here: ",
                    core::bridge_ipc_error());
        auto release = core::bridge_ipc_release;
        return std::shared_ptr<void>(p, [release](void *q) { release(q); });
    }
    void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override
    {
        c10::cuda::CUDAGuard guard(dev);
        cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
        if (err == cudaErrorPeerAccessAlreadyEnabled)
            (void)cudaGetLastError();
        else
            C10_CUDA_CHECK(err);
        int granted = 0; // dev reads dev_to_access's pool memory
        core::bridge_grant_peer_access(dev_to_access, &granted);
    }
    cudaError_t memcpyAsync(void *dst, int dst_device, const void *src, int src_device,
                            size_t count, cudaStream_t stream, bool p2p_enabled) override
    {
        // Pool memory of another device is copied with the peer copy unless
        // peer access was granted (cudaMemcpyAsync would fail otherwise).
        if (p2p_enabled || dst_device == src_device)
            return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
        return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
    }

  private:
    uint64_t retries_base(int device) const
    {
        return device >= 0 && device < BRIDGE_MAX_DEVICES
                   ? retries_base_[device].load(std::memory_order_relaxed)
                   : 0;
    }
    int64_t foreign_ooms(int device) const
    {
        return device >= 0 && device < BRIDGE_MAX_DEVICES
                   ? foreign_ooms_[device].load(std::memory_order_relaxed)
                   : 0;
    }
    void drop_route(uint64_t serial)
    {
        std::lock_guard<std::mutex> lock(route_mu);
        for (auto it = routes.begin(); it != routes.end(); ++it) {
            if (it->serial == serial) {
                routes.erase(it);
                return;
            }
        }
    }

    std::atomic<bool> initialized_{false};
    std::atomic<bool> enabled_{true};
    std::mutex settings_mu_;
    std::unordered_map<int, double> fraction_; // under settings_mu_
    // the core's num_retries at torch's last resetAccumulatedStats, per device
    std::atomic<uint64_t> retries_base_[BRIDGE_MAX_DEVICES] = {};
    // requests a MemPool's own allocator returned no memory for (foreign_alloc), per
    // device since torch's last resetAccumulatedStats: in num_ooms with the core's count
    std::atomic<int64_t> foreign_ooms_[BRIDGE_MAX_DEVICES] = {};
#ifdef BRIDGE_TORCH_HAS_attachOomRejectionObserver
    std::vector<CCA::OomRejectionObserver> rejection_observers_; // under history.mu
    std::atomic<int64_t> rejections_[BRIDGE_MAX_DEVICES] = {};   // requests rejected()
#endif
};

// The installed allocator; held for the whole process (torch holds it too).
std::shared_ptr<BridgeAllocator> &installed = *new std::shared_ptr<BridgeAllocator>;

// Make the bridge torch's CUDA allocator (before torch initializes CUDA).
void install(const std::string &core_path)
{
    if (installed)
        return;
    load_core(core_path);
    auto alloc = std::make_shared<BridgeAllocator>();
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(alloc);
    installed = alloc;
}

bool is_installed()
{
    return installed && CCA::get() == installed.get();
}

// What torch's caching layer above us is: its name, for doctor and stats.
std::string current_name()
{
    CCA::CUDAAllocator *a = CCA::get();
    return a ? a->name() : std::string();
}

// For the stand-in tests, which cannot start CUDA in torch: the allocation
// path on an explicit device and stream (allocate() reads them from torch's
// runtime), its refusal included, and the deleter.
uintptr_t alloc_on(size_t size, int device, uintptr_t stream)
{
    TORCH_CHECK(installed, "bridge: install() first");
    return reinterpret_cast<uintptr_t>(
        installed->malloc(size, device, reinterpret_cast<cudaStream_t>(stream)));
}

void free_ptr(uintptr_t ptr)
{
    bridge_delete(reinterpret_cast<void *>(ptr));
}

// For the stand-in tests: torch's shareIpcHandle and getIpcDevPtr as
// storage._share_cuda_ and _new_shared_cuda call them (through torch's
// current allocator); an opened block is kept until _close_ipc_handle.
std::mutex ipc_opened_mu;
std::unordered_map<uintptr_t, std::shared_ptr<void>> ipc_opened;

pybind11::tuple share_ipc_handle(uintptr_t ptr)
{
    CCA::ShareableHandle h = CCA::shareIpcHandle(reinterpret_cast<void *>(ptr));
    return pybind11::make_tuple(pybind11::bytes(h.handle), h.offset);
}

uintptr_t open_ipc_handle(const std::string &handle)
{
    std::shared_ptr<void> p = CCA::getIpcDevPtr(handle);
    std::lock_guard<std::mutex> g(ipc_opened_mu);
    ipc_opened[reinterpret_cast<uintptr_t>(p.get())] = p;
    return reinterpret_cast<uintptr_t>(p.get());
}

void close_ipc_handle(uintptr_t ptr)
{
    std::shared_ptr<void> p;
    {
        std::lock_guard<std::mutex> g(ipc_opened_mu);
        auto it = ipc_opened.find(ptr);
        if (it == ipc_opened.end())
            return;
        p = std::move(it->second);
        ipc_opened.erase(it);
    }
}

// ---- for the stand-in tests: what torch reaches only with CUDA started ----
// torch.cuda.MemPool(use_on_oom=True)'s flag.
void set_use_on_oom_for(int device, uint64_t id0, uint64_t id1, bool on)
{
    TORCH_CHECK(installed, "bridge: install() first");
    installed->setUseOnOOM(static_cast<c10::DeviceIndex>(device), MempoolId{id0, id1}, on);
}

// torch.cuda.MemPool(allocator=...) whose allocator returns no memory (a
// CUDAPluggableAllocator whose alloc function returns NULL; torch's own
// raw_alloc_with_stream asks the CUDA runtime for the device first).
struct NullAllocator final : torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
    NullAllocator()
        : CUDAPluggableAllocator([](size_t, int, cudaStream_t) -> void * { return nullptr; },
                                 [](void *, size_t, int, cudaStream_t) {})
    {
    }
    void *raw_alloc_with_stream(size_t, cudaStream_t) override
    {
        return nullptr;
    }
};

void pool_with_null_allocator(int device, uint64_t id0, uint64_t id1)
{
    TORCH_CHECK(installed, "bridge: install() first");
    installed->createOrIncrefPool(static_cast<c10::DeviceIndex>(device), MempoolId{id0, id1},
                                  std::make_shared<NullAllocator>());
}

// The arguments torch's out-of-memory observers got last, and how many calls
// there were (the stand-in tests cannot attach a Python one: torch starts
// CUDA for that).
std::vector<int64_t> &observed = *new std::vector<int64_t>;
std::mutex &observed_mu = *new std::mutex;

void observe_ooms()
{
    TORCH_CHECK(installed, "bridge: install() first");
    installed->attachOutOfMemoryObserver(
        [](int64_t device, size_t size, size_t allowed, size_t free) {
            std::lock_guard<std::mutex> lock(observed_mu);
            int64_t calls = observed.empty() ? 1 : observed.back() + 1;
            observed = {device, static_cast<int64_t>(size), static_cast<int64_t>(allowed),
                        static_cast<int64_t>(free), calls};
        });
}

std::vector<int64_t> last_observed()
{
    std::lock_guard<std::mutex> lock(observed_mu);
    return observed;
}

// torch's _record_memory_history and its snapshot's trace of device 0, as
// (address, action, time_us) (torch starts CUDA for its own calls of these).
void record_history_for(bool on)
{
    TORCH_CHECK(installed, "bridge: install() first");
    installed->recordHistory(on, nullptr, 1000, CCA::RecordContext::NEVER, false, {});
}

std::vector<std::tuple<uintptr_t, int, int64_t>> trace_times()
{
    TORCH_CHECK(installed, "bridge: install() first");
    std::vector<std::tuple<uintptr_t, int, int64_t>> out;
    CCA::SnapshotInfo info = installed->snapshot({0, 0}, true);
    for (const TraceEntry &e : info.device_traces.at(0))
        out.emplace_back(e.addr_, static_cast<int>(e.action_), static_cast<int64_t>(e.time_.t_));
    return out;
}

size_t cache_info(int device)
{
    TORCH_CHECK(installed, "bridge: install() first");
    size_t largest = 0;
    installed->cacheInfo(static_cast<c10::DeviceIndex>(device), &largest);
    return largest;
}

// For the tests: torch's begin hook with `stream` as torch's current stream
// (torch cannot start CUDA on the stand-in) and the filter of a capture
// (`capture`: the stream, once the capture began after the hook) or of a
// routing (use_mem_pool's: this thread, any stream).
void begin_pool_on(int device, uint64_t id0, uint64_t id1, uint64_t stream, bool capture)
{
    TORCH_CHECK(installed, "bridge: install() first");
    auto s = reinterpret_cast<cudaStream_t>(stream);
    std::function<bool(cudaStream_t)> filter = [](cudaStream_t) { return true; };
    auto began = std::make_shared<std::atomic<bool>>(false);
    if (capture)
        filter = [began, s](cudaStream_t x) { return began->load() && x == s; };
    installed->begin_on(device, MempoolId{id0, id1}, std::move(filter), s);
    began->store(true);
}

#ifdef BRIDGE_TORCH_HAS_attachOomRejectionObserver
// For the tests: an OOM rejection observer attached through torch's own entry
// point (as a C++ monitor would), and the calls it saw: (device, size, in use, total).
using Rejection = std::tuple<int64_t, size_t, size_t, size_t>;
std::mutex &seen_mu = *new std::mutex;
std::vector<Rejection> &seen = *new std::vector<Rejection>; // under seen_mu

void watch_rejections()
{
    CCA::attachOomRejectionObserver([](int64_t device, size_t size, size_t in_use, size_t total) {
        std::lock_guard<std::mutex> lock(seen_mu);
        seen.emplace_back(device, size, in_use, total);
    });
}

std::vector<Rejection> rejections_seen()
{
    std::lock_guard<std::mutex> lock(seen_mu);
    return seen;
}
#endif

} // namespace bridge_torch

using namespace bridge_torch;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.doc() = "bridge's torch allocator: torch's CUDAAllocator interface over bridge's core";
    m.def("install", &install, "Make the bridge torch's CUDA allocator", pybind11::arg("core"));
    m.def("installed", &is_installed, "Whether torch allocates through this module now");
    m.def("current_name", &current_name, "The name of torch's current CUDA allocator");
    m.def("_alloc_on", &alloc_on, "For tests: allocate on (device, stream) as allocate() does",
          pybind11::arg("size"), pybind11::arg("device"), pybind11::arg("stream"));
    m.def("_free", &free_ptr, "For tests: the deleter of every tensor's memory");
    m.def("_share_ipc_handle", &share_ipc_handle, "For tests: torch's shareIpcHandle(ptr)");
    m.def("_open_ipc_handle", &open_ipc_handle, "For tests: torch's getIpcDevPtr(handle)");
    m.def("_close_ipc_handle", &close_ipc_handle, "For tests: drop what _open_ipc_handle kept");
    m.def("_set_use_on_oom", &set_use_on_oom_for, "For tests: setUseOnOOM (a MemPool's flag)",
          pybind11::arg("device"), pybind11::arg("id0"), pybind11::arg("id1"), pybind11::arg("on"));
    m.def("_pool_with_null_allocator", &pool_with_null_allocator,
          "For tests: createOrIncrefPool with an allocator of its own that returns no memory",
          pybind11::arg("device"), pybind11::arg("id0"), pybind11::arg("id1"));
    m.def("_observe_ooms", &observe_ooms,
          "For tests: attach an OOM observer that keeps its arguments");
    m.def("_last_observed", &last_observed,
          "For tests: the arguments the OOM observers got last, and how many calls");
    m.def("_record_history", &record_history_for, "For tests: recordHistory on or off",
          pybind11::arg("on"));
    m.def("_trace_times", &trace_times,
          "For tests: the snapshot's trace of device 0 as (address, action, time_us)");
    m.def("_begin_pool_on", &begin_pool_on,
          "For tests: the begin hook of a capture (or a routing) on a given current stream",
          pybind11::arg("device"), pybind11::arg("id0"), pybind11::arg("id1"),
          pybind11::arg("stream"), pybind11::arg("capture"));
    m.def("_cache_info", &cache_info, "For tests: cacheInfo (the largest block a request gets)",
          pybind11::arg("device"));
#ifdef BRIDGE_TORCH_HAS_attachOomRejectionObserver
    m.def("_watch_rejections", &watch_rejections,
          "For tests: attach an OOM rejection observer through torch's entry point");
    m.def("_rejections_seen", &rejections_seen,
          "For tests: the (device, size, in use, total) the observer was called with");
#endif
}
