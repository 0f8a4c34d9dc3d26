// SPDX-License-Identifier: Apache-2.0
// _torch_abi.cpp: the entry points torch's CUDAPluggableAllocator calls, compiled
// into bridge._core (setup.py) beside the torch adapter that plugs them in.
//
// torch calls these from C++ on any thread, the autograd thread included, with
// or without the GIL; nothing here touches Python.  An allocation that cannot
// be satisfied throws std::runtime_error whose message starts with
// "CUDA out of memory." (torch turns it into a RuntimeError with that message
// and keeps working; accelerate-style OOM handlers match on that prefix).  The
// throw starts here, in C++, never unwinding through the C core.  The graph
// hooks have the exact types torch's set_begin_allocate_to_pool & co. cast to.
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bridge.h"
#include "_torch_abi.h"

struct CUstream_st; // cudaStream_t is CUstream_st*
using MempoolId = std::pair<unsigned long long, unsigned long long>;
using StreamFilter = std::function<bool(CUstream_st *)>;

namespace
{

// ---- captures torch announced (begin_allocate_to_pool .. end) ----
struct Capture {
    int device;
    MempoolId id;
    StreamFilter filter; // true for streams capturing into this pool
    uint64_t serial;     // which begin added it (a failed begin removes its own)
};
std::mutex capture_mu;
std::vector<Capture> captures; // under capture_mu
uint64_t capture_serial;       // under capture_mu

// The capture that claims `stream`, if any.
bool route_to_graph(int device, void *stream, MempoolId *id)
{
    std::lock_guard<std::mutex> lock(capture_mu);
    for (const Capture &c : captures) {
        if (c.device == device && c.filter && c.filter(static_cast<CUstream_st *>(stream))) {
            *id = c.id;
            return true;
        }
    }
    return false;
}

std::string gib(uint64_t bytes)
{
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / (1u << 30));
    return buf;
}

// A framework's name as users write it, from its tag's name in frameworks.h (CUPY -> cupy).
std::string lowercase(const char *name)
{
    std::string out(name);
    for (char &c : out)
        if (c >= 'A' && c <= 'Z')
            c = static_cast<char>(c - 'A' + 'a');
    return out;
}

// What the refused allocation did about waiting (bridge.waiting / unify(wait=)).
std::string wait_note(int device)
{
    double waited = 0;
    int outcome = BRIDGE_WAIT_NONE;
    bridge_last_wait(&waited, &outcome);
    char secs[32];
    std::snprintf(secs, sizeof secs, "%.2f s", waited);
    std::string note;
    if (outcome == BRIDGE_WAIT_TIMEOUT)
        note = std::string("Waited ") + secs +
               " for other threads to free memory; none freed enough. ";
    else if (outcome == BRIDGE_WAIT_ALL_WAITING)
        note = std::string("Stopped waiting after ") + secs +
               ": every thread holding bridge memory on this device was waiting for memory too, "
               "so none would free any (this one was refused to end it). ";
    else if (outcome == BRIDGE_WAIT_INTERRUPTED)
        note = std::string("Gave up waiting after ") + secs + " (interrupted). ";
    else if (outcome == BRIDGE_WAIT_CAPTURE)
        note = "Did not wait: a CUDA graph capture runs on this device. ";
    else if (outcome == BRIDGE_WAIT_HOPELESS)
        note = "Did not wait: the request is larger than the budget or the device. ";
    if (outcome == BRIDGE_WAIT_TIMEOUT || outcome == BRIDGE_WAIT_ALL_WAITING) {
        bridge_holder h[8];
        int n = 0;
        if (bridge_wait_holders(device, h, 8, &n) == BRIDGE_OK && n > 0) {
            note += "Threads holding bridge memory:";
            for (int i = 0; i < n; i++)
                note += std::string(i ? "," : "") + " thread " + std::to_string(h[i].thread) + " " +
                        gib(h[i].bytes) + (h[i].waiting ? " (waiting)" : "");
            note += ". ";
        }
    }
    return note;
}

// The words of a refused torch allocation; *oom: whether it is an out-of-memory
// (torch.cuda.OutOfMemoryError) rather than another CUDA error.
std::string failure_message(int rc, size_t size, int device, bool *oom)
{
    *oom = false;
    if (rc == BRIDGE_E_FORKED)
        return "CUDA error: this process was forked from one that had started CUDA, and CUDA "
               "cannot be used in a forked child: start workers with the 'spawn' method";
    if (rc == BRIDGE_E_DRIVER || rc == BRIDGE_E_DEVICE || rc == BRIDGE_E_NOTINIT ||
        rc == BRIDGE_E_NOPOOLS || rc == BRIDGE_E_INVALID) {
        std::string msg = "CUDA error: bridge could not allocate " + std::to_string(size) +
                          " bytes on device " + std::to_string(device) + ": ";
        int code = bridge_last_driver_error();
        if (rc == BRIDGE_E_DRIVER && code != 0)
            msg += std::string("the driver said ") + bridge_driver_error_name(code) + " (code " +
                   std::to_string(code) + ")";
        else if (rc == BRIDGE_E_NOPOOLS)
            msg += "the device has no stream-ordered memory pools";
        else if (rc == BRIDGE_E_NOTINIT)
            msg += "the CUDA driver is not loaded (call bridge.unify first)";
        else
            msg += "no such device, or it could not be set up (bridge status " +
                   std::to_string(rc) + ")";
        return msg;
    }
    *oom = true;
    bridge_stats s;
    bridge_get_stats(device, &s);
    uint64_t others = 0;
    bridge_others(device, &others);
    std::string msg = "CUDA out of memory. Tried to allocate " + gib(size) + " (" +
                      std::to_string(size) + " bytes) on device " + std::to_string(device) + ". ";
    uint64_t cap = s.tag[BRIDGE_TAG_TORCH].limit;
    if (rc == BRIDGE_E_TAG_LIMIT)
        msg += "torch's share is capped at " + gib(cap == BRIDGE_TAG_LIMIT_ZERO ? 0 : cap) +
               " by torch.cuda.set_per_process_memory_fraction. ";
    else if (rc == BRIDGE_E_BUDGET)
        msg += "The bridge budget is " + gib(s.limit) + ". ";
    else
        msg += "The device is full (" + gib(s.total) + " in all; bridge budget " +
               (s.limit ? gib(s.limit) : std::string("none")) + "). ";
    // torch first, then every other framework with a slot, as frameworks.h lists them
    msg += "In use: torch " + gib(s.tag[BRIDGE_TAG_TORCH].current);
#define BRIDGE_TAG_IN_USE_(name, n) \
    if (n != BRIDGE_TAG_TORCH)      \
        msg += ", " + lowercase(#name) + " " + gib(s.tag[n].current);
    BRIDGE_FRAMEWORK_TAGS(BRIDGE_TAG_IN_USE_)
#undef BRIDGE_TAG_IN_USE_
    msg += ", other bridge users " + gib(s.tag[BRIDGE_TAG_OTHER].current) +
           ", jax and others outside the bridge " + gib(others) + ", pool reserved " +
           gib(s.pool_reserved) + ". " + wait_note(device) +
           "Free tensors or arrays you no longer need, lower the batch size, or raise the "
           "budget (bridge.unify(budget=...) or BRIDGE_GPU_MEMORY_LIMIT).";
    return msg;
}

[[noreturn]] void throw_failure(int rc, size_t size, int device)
{
    bool oom;
    throw std::runtime_error(failure_message(rc, size, device, &oom));
}

} // namespace

extern "C" {

uint64_t bridge_torch_fraction_cap(double fraction, int device)
{
    if (fraction >= 1.0)
        return 0;
    uint64_t total = 0;
    int major = 0, minor = 0;
    char name[8];
    if (bridge_device_info(device, name, sizeof name, &major, &minor, &total) != BRIDGE_OK)
        return 0; // no such device: bridge_set_tag_limit refuses it
    uint64_t cap = static_cast<uint64_t>(fraction * static_cast<double>(total));
    return cap ? cap : BRIDGE_TAG_LIMIT_ZERO;
}

// The message of a refused torch allocation (the same words on both torch
// paths): copied into buf (NUL-terminated within len); returns its length, and
// *oom is 1 for an out-of-memory, 0 for another CUDA error.
size_t bridge_torch_failure_message(int rc, size_t size, int device, char *buf, size_t len,
                                    int *oom)
{
    bool is_oom = false;
    std::string msg = failure_message(rc, size, device, &is_oom);
    *oom = is_oom ? 1 : 0;
    if (len) {
        size_t n = msg.size() < len - 1 ? msg.size() : len - 1;
        std::memcpy(buf, msg.data(), n);
        buf[n] = 0;
    }
    return msg.size();
}

// fast path: one atomic load, then bridge_alloc (no lock taken here)
void *bridge_torch_alloc(size_t size, int device, void *stream)
{
    void *p = nullptr;
    int rc;
    MempoolId id;
    if (bridge_captures_active(device) && route_to_graph(device, stream, &id))
        rc = bridge_alloc_graph(device, size, BRIDGE_TAG_TORCH, id.first, id.second, stream, &p);
    else
        rc = bridge_alloc(device, size, stream, BRIDGE_TAG_TORCH, &p);
    if (rc != BRIDGE_OK)
        throw_failure(rc, size, device);
    return p;
}

void bridge_torch_free(void *ptr, size_t, int, void *)
{
    bridge_free(ptr);
}

void bridge_torch_init(int)
{
}

// torch.cuda.empty_cache(): idle pool memory of every device goes back
// (nothing synchronized or freed on a stream being captured).
void bridge_torch_empty_cache(void)
{
    for (int d = 0; d < BRIDGE_MAX_DEVICES; d++)
        if (bridge_device_ready(d))
            bridge_trim(d, 0);
}

// torch.cuda.set_per_process_memory_fraction(f, device): torch's own cap.
void bridge_torch_memory_fraction(double fraction, int device)
{
    bridge_set_tag_limit(device, BRIDGE_TAG_TORCH, bridge_torch_fraction_cap(fraction, device));
}

void bridge_torch_record_stream(void *ptr, CUstream_st *stream)
{
    bridge_record_stream(ptr, stream);
}

void bridge_torch_begin_allocate_to_pool(int device, MempoolId id, StreamFilter filter)
{
    uint64_t serial;
    {
        std::lock_guard<std::mutex> lock(capture_mu);
        serial = ++capture_serial;
        captures.push_back(Capture{device, id, std::move(filter), serial});
    }
    if (bridge_graph_begin(device, id.first, id.second) != BRIDGE_OK) {
        std::lock_guard<std::mutex> lock(capture_mu);
        for (auto it = captures.begin(); it != captures.end(); ++it) {
            if (it->serial == serial) {
                captures.erase(it);
                break;
            }
        }
        // torch raises this as a RuntimeError from capture_begin
        throw std::runtime_error("bridge: no host memory to open a CUDA graph pool on device " +
                                 std::to_string(device));
    }
}

void bridge_torch_end_allocate_to_pool(int device, MempoolId id)
{
    {
        std::lock_guard<std::mutex> lock(capture_mu);
        for (auto it = captures.begin(); it != captures.end(); ++it) {
            if (it->device == device && it->id == id) {
                captures.erase(it);
                break;
            }
        }
    }
    bridge_graph_end(device, id.first, id.second);
}

void bridge_torch_release_pool(int device, MempoolId id)
{
    bridge_graph_release(device, id.first, id.second);
}

} // extern "C"
