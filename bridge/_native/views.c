/* SPDX-License-Identifier: Apache-2.0 */
/* views.c: what the core tells tools about memory.
 *
 *   free memory   a device's free and total memory as the budget leaves
 *                 them (bridge_get_mem_info): what the frameworks'
 *                 free-memory queries answer under a budget
 *   live blocks   every allocation of the table (records.c), copied out for
 *                 a memory snapshot (bridge_live_blocks)
 *   history       a ring of allocation, free and refusal events, recorded
 *                 only while it is on (bridge_history_set), each with the id
 *                 of the caller's Python stack when stacks were asked for
 *
 * The hot path's only cost here is one relaxed load of bridge_history_on
 * (views.h); everything else runs when a tool asks.
 */
#include "views.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cache.h"
#include "device.h"
#include "records.h"

/* ---- free memory under the budget ---- */
int bridge_get_mem_info(int device, bridge_mem_info *out)
{
    memset(out, 0, sizeof *out);
    device_state *d = device_of(device);
    if (!d)
        return bridge_initialized() ? BRIDGE_E_DEVICE : BRIDGE_E_NOTINIT;
    size_t dfree = 0, dtotal = 0;
    ctx_guard g;
    ctx_enter(d, &g);
    /* relaxed capture mode: a free-memory query in global mode invalidates
     * another thread's capture (tools ask during torch.cuda.graph) */
    int mode = capture_mode_relax();
    CUresult r = bridge_drv.cuMemGetInfo_v2(&dfree, &dtotal);
    capture_mode_exit(mode);
    ctx_exit(&g);
    if (r != CUDA_SUCCESS)
        return bridge_note_driver_error(r), BRIDGE_E_DRIVER;
    /* `committed` before the pool's figure, as in the budget check: a grant
     * landing between the reads counts as others (too much, never too
     * little). */
    uint64_t committed = atomic_load_explicit(&d->committed, memory_order_acquire);
    uint64_t reserved = atomic_load_explicit(&d->reserved, RELAXED);
    uint64_t used = 0, pool_reserved = 0;
    mode = capture_mode_relax();
    r = pool_figure(d, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used);
    if (r == CUDA_SUCCESS)
        r = pool_figure(d, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &pool_reserved);
    capture_mode_exit(mode);
    if (r != CUDA_SUCCESS)
        return bridge_note_driver_error(r), BRIDGE_E_DRIVER;
    uint64_t others = used > committed ? used - committed : 0;
    out->driver_free = dfree;
    out->driver_total = dtotal;
    out->pool_idle = pool_reserved > used ? pool_reserved - used : 0;
    out->cached = cache_bytes(device);
    out->held = reserved + others > out->cached ? reserved + others - out->cached : 0;
    out->limit = atomic_load_explicit(&d->limit, RELAXED);
    /* A share's budget (share.c) refuses too, with the other members'
     * claims counted: what this process may still have of it is the budget
     * less their claims less what its own pool holds in use (the pool's idle
     * memory and the cache are its own to reuse). */
    uint64_t share_free = UINT64_MAX;
    bridge_share_stats sh;
    if (atomic_load_explicit(&d->share, memory_order_acquire) &&
        bridge_share_get(device, &sh) == BRIDGE_OK && sh.joined) {
        uint64_t theirs = sh.group > sh.claim ? sh.group - sh.claim : 0;
        uint64_t mine = used > out->cached ? used - out->cached : 0;
        share_free =
            sh.budget > theirs && sh.budget - theirs > mine ? sh.budget - theirs - mine : 0;
        if (!out->limit || sh.budget < out->limit)
            out->limit = sh.budget;
    }
    if (!out->limit) {
        out->free = dfree;
        out->total = dtotal;
        return BRIDGE_OK;
    }
    /* an allocation through the bridge may have the device's free memory,
     * the pool's idle memory and the cache (flushed before any refusal) */
    uint64_t device_free = dfree + out->pool_idle + out->cached;
    uint64_t budget_free = out->limit > out->held ? out->limit - out->held : 0;
    out->free = device_free < budget_free ? device_free : budget_free;
    if (share_free < out->free)
        out->free = share_free;
    out->total = out->limit < dtotal ? out->limit : dtotal;
    return BRIDGE_OK;
}

/* ---- live blocks ---- */
typedef struct block_copy {
    bridge_block_info *out;
    size_t n, count;
} block_copy;

static int copy_block(record *r, void *arg)
{
    block_copy *c = arg;
    if (c->count < c->n)
        c->out[c->count] = (bridge_block_info){.ptr = r->ptr,
                                               .size = r->size,
                                               .stream = (uint64_t)(uintptr_t)r->stream,
                                               .device = r->device,
                                               .tag = r->tag,
                                               .flags = r->flags,
                                               .graph0 = r->graph0,
                                               .graph1 = r->graph1};
    c->count++;
    return 0; /* keep the record */
}

int bridge_live_blocks(bridge_block_info *out, size_t n, size_t *count)
{
    block_copy c = {out, n, 0};
    records_sweep(copy_block, &c);
    *count = c.count;
    return BRIDGE_OK;
}

/* ---- the history ---- */
atomic_int bridge_history_on;
static atomic_int history_stacks;
static _Atomic(bridge_stack_fn) stack_hook;

/* Under hist_mu.  Events are kept in order in ev[0..count) until the ring
 * is full (count == cap == max); then the oldest is ev[head] and each new
 * event overwrites it. */
static pthread_mutex_t hist_mu = PTHREAD_MUTEX_INITIALIZER;
static bridge_event *ev;
static size_t ev_cap, ev_count, ev_head;
static uint64_t ev_max = 1u << 20; /* the cap of events kept; bridge_history_set sets it */
static uint64_t ev_dropped;        /* events lost because the host had no memory */

static uint64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* The events oldest first, in a buffer of their own (under hist_mu);
 * keeps only the newest `keep`.  -1 when the host has no memory. */
static int linearize(uint64_t keep)
{
    size_t n = ev_count < keep ? ev_count : (size_t)keep;
    bridge_event *fresh = n ? malloc(n * sizeof *fresh) : NULL;
    if (n && !fresh)
        return -1;
    for (size_t i = 0; i < n; i++)
        fresh[i] = ev[(ev_head + ev_count - n + i) % (ev_cap ? ev_cap : 1)];
    free(ev);
    ev = fresh;
    ev_cap = ev_count = n;
    ev_head = 0;
    return 0;
}

void history_note(int action, int device, uintptr_t ptr, uint64_t size, CUstream stream, int tag)
{
    bridge_event e = {.time_us = now_us(),
                      .ptr = ptr,
                      .size = size,
                      .stream = (uint64_t)(uintptr_t)stream,
                      .device = device,
                      .action = action,
                      .tag = tag};
    if (action == BRIDGE_EV_OOM) {
        bridge_mem_info mi;
        if (bridge_get_mem_info(device, &mi) == BRIDGE_OK)
            e.extra = mi.free;
    }
    /* the hook runs Python (it may free tensors, which notes frees): call it
     * before taking the lock */
    if (atomic_load_explicit(&history_stacks, RELAXED)) {
        bridge_stack_fn fn = atomic_load(&stack_hook);
        if (fn)
            e.stack = fn();
    }
    pthread_mutex_lock(&hist_mu);
    if (!atomic_load_explicit(&bridge_history_on, RELAXED)) {
        pthread_mutex_unlock(&hist_mu); /* stopped meanwhile */
        return;
    }
    if (ev_count < ev_max) {
        if (ev_count == ev_cap) {
            size_t ncap = ev_cap ? ev_cap * 2 : 1024;
            if (ncap > ev_max)
                ncap = (size_t)ev_max;
            bridge_event *n = realloc(ev, ncap * sizeof *n);
            if (!n) {
                ev_dropped++;
                pthread_mutex_unlock(&hist_mu);
                return;
            }
            ev = n;
            ev_cap = ncap;
        }
        ev[ev_count++] = e;
    } else if (ev_cap) {
        ev[ev_head] = e; /* full: the oldest goes */
        ev_head = (ev_head + 1) % ev_cap;
    }
    pthread_mutex_unlock(&hist_mu);
}

int bridge_history_set(int on, int stacks, uint64_t max_entries, int clear)
{
    pthread_mutex_lock(&hist_mu);
    int rc = BRIDGE_OK;
    if (clear) {
        free(ev);
        ev = NULL;
        ev_cap = ev_count = ev_head = 0;
        ev_dropped = 0;
    }
    if (max_entries && max_entries != ev_max) {
        if (linearize(max_entries) == 0)
            ev_max = max_entries;
        else
            rc = BRIDGE_E_OOM;
    }
    if (rc == BRIDGE_OK) {
        atomic_store(&history_stacks, on && stacks);
        atomic_store(&bridge_history_on, on ? 1 : 0);
    }
    pthread_mutex_unlock(&hist_mu);
    return rc;
}

int bridge_history_copy(bridge_event *out, size_t n, size_t *count)
{
    pthread_mutex_lock(&hist_mu);
    *count = ev_count;
    for (size_t i = 0; i < n && i < ev_count; i++)
        out[i] = ev[(ev_head + i) % ev_cap];
    pthread_mutex_unlock(&hist_mu);
    return BRIDGE_OK;
}

void bridge_set_stack_hook(bridge_stack_fn fn)
{
    atomic_store(&stack_hook, fn);
}

void history_forget_after_fork(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    hist_mu = fresh;
    ev = NULL; /* the parent's buffer; never freed here */
    ev_cap = ev_count = ev_head = 0;
    atomic_store(&bridge_history_on, 0);
    atomic_store(&history_stacks, 0);
}
