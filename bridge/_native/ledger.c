/* SPDX-License-Identifier: Apache-2.0 */
/* ledger.c: per-device pools, the budget ledger, allocation and free.
 *
 * Accounting, per device (every figure is an atomic, lock-free to read):
 *   reserved   bytes counted against the budget: live allocations, graph
 *              blocks kept for replay, deferred frees, blocks kept by the
 *              cache (cache.c), and reservations of allocations in flight.
 *              A reservation is added BEFORE the driver is asked, and checked
 *              against the budget with the sum that includes every concurrent
 *              reservation, so two threads can both be refused at the edge
 *              but never both pass it.
 *   committed  bytes the driver granted and the bridge has not yet freed;
 *              `others` = pool USED_MEM_CURRENT - committed.
 *   tag[t]     bytes live for framework t as the framework sees them.
 * Ordering that keeps the budget conservative under races: alloc adds
 * `reserved`, calls the driver, then adds `committed`; free calls the driver,
 * then subtracts `committed`, then `reserved`.
 *
 * A free reaches the driver only in stream order: on the block's stream
 * (streams.c says which handle that is from this thread), after every stream
 * recorded against it, and never while that stream is being captured (the
 * free would become a node of the user's graph): such frees are deferred
 * and issued as soon as the captures end.
 */
#include "ledger.h"
#include "cache.h"
#include "views.h"
#include "wait.h"

#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

device_state bridge_devices[BRIDGE_MAX_DEVICES];
static pthread_mutex_t setup_lock = PTHREAD_MUTEX_INITIALIZER;
/* Set from Python while other threads allocate without the GIL: atomic, and
 * read once per use (a second read could see NULL after the first saw a hook). */
static _Atomic(bridge_pressure_fn) pressure_hook;
static _Atomic uint64_t bad_frees; /* unknown pointers and double frees, every device */
/* Bit t set: blocks of tag t are never cached (bridge_set_tag_cached). */
static _Atomic unsigned uncached_tags;
/* Bit t set: tag t keeps its blocks' streams alive until their frees return
 * (bridge_set_tag_holds_streams).  CuPy's by default: the core's own CuPy
 * allocator (cupy_alloc.c) gives each block a reference to its Stream,
 * dropped after the free has returned (pyblock.c). */
static _Atomic unsigned holding_tags = 1u << BRIDGE_TAG_CUPY;
/* The release threshold of devices set up lazily (the last one asked for). */
static _Atomic uint64_t default_threshold = UINT64_MAX;

/* ---- the current context ---- */
void ctx_enter(device_state *d, ctx_guard *g)
{
    g->prev = NULL;
    g->changed = 0;
    if (bridge_drv.cuCtxGetCurrent(&g->prev) != CUDA_SUCCESS || g->prev != d->ctx) {
        bridge_drv.cuCtxSetCurrent(d->ctx);
        g->changed = 1;
    }
}

void ctx_exit(ctx_guard *g)
{
    /* "None" is put back too: a thread left with this device's context would
     * send its next runtime call (torch.empty(device="cuda")) to this device. */
    if (g->changed)
        bridge_drv.cuCtxSetCurrent(g->prev);
}

int capture_mode_enter(device_state *d)
{
    /* Always, not only while a capture the core knows of runs: another
     * thread's capture in global mode (torch.cuda.graph's default, with
     * torch's own allocator, or XLA's) is invisible here, and a pool
     * allocation or free in global mode then fails with
     * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (seen on an H200: a CuPy
     * allocation on a side stream during a torch capture). */
    (void)d;
    return capture_mode_relax();
}

void capture_mode_exit(int mode)
{
    if (mode >= 0)
        bridge_drv.cuThreadExchangeStreamCaptureMode(&mode);
}

/* ---- synchronizations and captures (ledger.h) ---- */
int sync_enter(device_state *d)
{
    atomic_fetch_add(&d->syncs, 1);
    if (!atomic_load(&d->captures_active))
        return 1;
    atomic_fetch_sub(&d->syncs, 1);
    return 0;
}

void sync_exit(device_state *d)
{
    atomic_fetch_sub(&d->syncs, 1);
}

void capture_announce(device_state *d)
{
    atomic_fetch_add(&d->captures_active, 1);
    /* a synchronization that did not see the capture is under way: it ends
     * before the capture begins (rare: a trim or a refusal's retry) */
    struct timespec ts = {0, 50000};
    while (atomic_load(&d->syncs))
        nanosleep(&ts, NULL);
}

void drain_streams(device_state *d)
{
    if (!sync_enter(d))
        return;
    ctx_guard g;
    ctx_enter(d, &g);
    int mode = capture_mode_relax();
    int status = CU_STREAM_CAPTURE_STATUS_NONE;
    /* never cuCtxSynchronize: it would invalidate a capture the core cannot
     * see (XLA's); the legacy stream answers an error while a blocking
     * stream captures, and then is left alone too */
    if (bridge_drv.cuStreamIsCapturing(STREAM_LEGACY, &status) == CUDA_SUCCESS &&
        status == CU_STREAM_CAPTURE_STATUS_NONE)
        bridge_drv.cuStreamSynchronize(STREAM_LEGACY);
    bridge_drv.cuStreamSynchronize(d->side);
    stream_sync_long_lived(d->ctx);
    capture_mode_exit(mode);
    ctx_exit(&g);
    sync_exit(d);
}

CUstream free_key(const record *rec)
{
    if (stream_long_lived(rec->stream) ||
        (atomic_load_explicit(&holding_tags, RELAXED) & (1u << rec->tag)))
        return rec->stream;
    return STREAM_LEGACY;
}

int bridge_set_tag_holds_streams(int tag, int holds)
{
    if (tag < 0 || tag >= BRIDGE_NTAGS)
        return BRIDGE_E_INVALID;
    if (holds)
        atomic_fetch_or(&holding_tags, 1u << tag);
    else
        atomic_fetch_and(&holding_tags, ~(1u << tag));
    return BRIDGE_OK;
}

/* ---- devices ---- */
static void register_fork_handler(void);

int bridge_device_setup(int device, uint64_t release_threshold)
{
    if (!bridge_initialized())
        return bridge_forked() ? BRIDGE_E_FORKED : BRIDGE_E_NOTINIT;
    static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
    pthread_once(&fork_once, register_fork_handler); /* after the driver's: runs after it */
    if (device < 0 || device >= BRIDGE_MAX_DEVICES)
        return BRIDGE_E_DEVICE;
    int count = 0;
    if (bridge_device_count(&count) != BRIDGE_OK || device >= count)
        return BRIDGE_E_DEVICE;
    device_state *d = &bridge_devices[device];
    int rc = BRIDGE_OK;
    pthread_mutex_lock(&setup_lock);
    if (!atomic_load(&d->ready)) {
        CUresult r;
        int pools = 0;
        size_t total = 0;
        if ((r = bridge_drv.cuDeviceGet(&d->dev, device)) != CUDA_SUCCESS ||
            (r = bridge_drv.cuDeviceGetAttribute(&pools, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED,
                                                 d->dev)) != CUDA_SUCCESS) {
            rc = BRIDGE_E_DRIVER;
        } else if (!pools) {
            rc = BRIDGE_E_NOPOOLS;
        } else if ((r = bridge_drv.cuDevicePrimaryCtxRetain(&d->ctx, d->dev)) != CUDA_SUCCESS ||
                   (r = bridge_drv.cuDeviceTotalMem_v2(&total, d->dev)) != CUDA_SUCCESS ||
                   (r = bridge_drv.cuDeviceGetDefaultMemPool(&d->pool, d->dev)) != CUDA_SUCCESS) {
            rc = BRIDGE_E_DRIVER;
        } else {
            ctx_guard g;
            ctx_enter(d, &g);
            r = bridge_drv.cuStreamCreate(&d->side, CU_STREAM_NON_BLOCKING);
            ctx_exit(&g);
            if (r != CUDA_SUCCESS)
                rc = BRIDGE_E_DRIVER;
        }
        if (rc == BRIDGE_E_DRIVER)
            bridge_note_driver_error(r);
        if (rc == BRIDGE_OK) {
            d->total = total;
            pthread_mutex_init(&d->capture_lock, NULL);
            /* the cache's default size: 2% of the device, at least 1 GiB
             * (bridge/_runtime.py may set another) */
            uint64_t cache = total / 50 > (1ull << 30) ? total / 50 : (1ull << 30);
            cache_set_limits(device, cache, BRIDGE_CACHE_MAX_BLOCK);
            atomic_store_explicit(&d->ready, 1, memory_order_release);
        }
    }
    if (rc == BRIDGE_OK) {
        atomic_store(&d->release_threshold, release_threshold);
        atomic_store(&default_threshold, release_threshold);
        rc = bridge_reassert(device);
    }
    pthread_mutex_unlock(&setup_lock);
    return rc;
}

device_state *device_use(int device, int *rc)
{
    device_state *d = device_of(device);
    if (d) {
        *rc = BRIDGE_OK;
        return d;
    }
    /* A device outside unify's list that a framework uses all the same
     * (torch copying to cuda:1): its default pool, set up now, no budget,
     * readable by its peers as unify's devices are (a peer copy reads it). */
    *rc = bridge_device_setup(device, atomic_load(&default_threshold));
    if (*rc != BRIDGE_OK)
        return NULL;
    int granted = 0;
    bridge_grant_peer_access(device, &granted);
    return device_of(device);
}

int bridge_device_ready(int device)
{
    return device_of(device) != NULL;
}

int bridge_reassert(int device)
{
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_DEVICE;
    uint64_t t = atomic_load(&d->release_threshold);
    CUresult r = bridge_drv.cuMemPoolSetAttribute(d->pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &t);
    return r == CUDA_SUCCESS ? BRIDGE_OK : (bridge_note_driver_error(r), BRIDGE_E_DRIVER);
}

int bridge_pool_attribute(int device, int attr, uint64_t *value)
{
    *value = 0;
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_DEVICE;
    CUresult r = bridge_drv.cuMemPoolGetAttribute(d->pool, attr, value);
    return r == CUDA_SUCCESS ? BRIDGE_OK : (bridge_note_driver_error(r), BRIDGE_E_DRIVER);
}

int bridge_grant_peer_access(int device, int *granted)
{
    *granted = 0;
    device_state *d = device_of(device);
    int count = 0;
    if (!d || bridge_device_count(&count) != BRIDGE_OK)
        return BRIDGE_E_DEVICE;
    for (int p = 0; p < count; p++) {
        int can = 0;
        if (p == device || bridge_drv.cuDeviceCanAccessPeer(&can, p, d->dev) != CUDA_SUCCESS ||
            !can)
            continue;
        bridge_CUmemAccessDesc desc = {{CU_MEM_LOCATION_TYPE_DEVICE, p},
                                       CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
        CUresult r = bridge_drv.cuMemPoolSetAccess(d->pool, &desc, 1);
        if (r != CUDA_SUCCESS)
            return bridge_note_driver_error(r), BRIDGE_E_DRIVER;
        (*granted)++;
    }
    return BRIDGE_OK;
}

/* ---- the budget ---- */
static uint64_t others_of(device_state *d)
{
    /* `committed` first: a grant landing between the two reads is then in the
     * pool's figure but not in ours, and counts as others (too much, never
     * too little). */
    uint64_t mine = atomic_load_explicit(&d->committed, memory_order_acquire);
    uint64_t used = 0;
    /* relaxed capture mode: a capturing thread (torch's, checking its graph
     * allocation against the budget) must not invalidate its own capture */
    int mode = capture_mode_enter(d);
    CUresult r = bridge_drv.cuMemPoolGetAttribute(d->pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used);
    capture_mode_exit(mode);
    if (r == CUDA_SUCCESS) {
        atomic_store_explicit(&d->last_pool_used, used, RELAXED);
    } else {
        /* Never fail open (others = 0): the last good figure, counted. */
        atomic_fetch_add_explicit(&d->num_pool_read_errors, 1, RELAXED);
        used = atomic_load_explicit(&d->last_pool_used, RELAXED);
    }
    return used > mine ? used - mine : 0;
}

int bridge_others(int device, uint64_t *out)
{
    *out = 0;
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_DEVICE;
    *out = others_of(d);
    return BRIDGE_OK;
}

/* Fast path without a budget: two atomic adds. */
int ledger_reserve(device_state *d, int tag, uint64_t size)
{
    /* No request larger than the device can succeed; refusing it here also
     * keeps the sums below from wrapping (SIZE_MAX from a C caller would
     * otherwise pass every check with a wrapped total). */
    if (size > d->total)
        return BRIDGE_E_OOM;
    tag_state *t = &d->tag[tag];
    uint64_t tlimit = atomic_load_explicit(&t->limit, RELAXED);
    uint64_t tcur = atomic_fetch_add_explicit(&t->current, size, RELAXED) + size;
    if (tlimit && tcur > tlimit) {
        atomic_fetch_sub_explicit(&t->current, size, RELAXED);
        return BRIDGE_E_TAG_LIMIT;
    }
    uint64_t r = atomic_fetch_add_explicit(&d->reserved, size, memory_order_acq_rel) + size;
    uint64_t limit = atomic_load_explicit(&d->limit, RELAXED);
    if (limit) {
        /* one driver call: what others hold in the pool counts too */
        uint64_t others = others_of(d);
        if (r > limit || others > limit - r) {
            atomic_fetch_sub_explicit(&d->reserved, size, memory_order_acq_rel);
            atomic_fetch_sub_explicit(&t->current, size, RELAXED);
            return BRIDGE_E_BUDGET;
        }
    }
    /* the budget of the processes sharing this GPU (share.c): one load when
     * there is none */
    share_member *sm = atomic_load_explicit(&d->share, memory_order_acquire);
    if (sm && share_reserve(d, sm, size) != BRIDGE_OK) {
        atomic_fetch_sub_explicit(&d->reserved, size, memory_order_acq_rel);
        atomic_fetch_sub_explicit(&t->current, size, RELAXED);
        return BRIDGE_E_BUDGET;
    }
    atomic_max(&d->peak, r);
    atomic_max(&t->peak, tcur);
    return BRIDGE_OK;
}

void ledger_unreserve(device_state *d, int tag, uint64_t size)
{
    share_member *sm = atomic_load_explicit(&d->share, memory_order_acquire);
    if (sm)
        share_settle(d, sm, size, 0);
    atomic_fetch_sub_explicit(&d->tag[tag].current, size, RELAXED);
    atomic_fetch_sub_explicit(&d->reserved, size, memory_order_acq_rel);
}

void ledger_commit(device_state *d, uint64_t size)
{
    atomic_fetch_add_explicit(&d->committed, size, RELAXED);
    share_member *sm = atomic_load_explicit(&d->share, memory_order_acquire);
    if (sm)
        share_settle(d, sm, size, 1);
}

void ledger_count_alloc(device_state *d, int tag, uint64_t size)
{
    tag_state *t = &d->tag[tag];
    atomic_fetch_add_explicit(&t->allocated, size, RELAXED);
    atomic_fetch_add_explicit(&t->num_allocs, 1, RELAXED);
    atomic_fetch_add_explicit(&d->num_allocs, 1, RELAXED);
    int64_t live = atomic_fetch_add_explicit(&t->count, 1, RELAXED) + 1;
    int64_t peak = atomic_load_explicit(&t->count_peak, RELAXED);
    while (peak < live &&
           !atomic_compare_exchange_weak_explicit(&t->count_peak, &peak, live, RELAXED, RELAXED))
        ;
}

/* A free's accumulated figures (ledger_count_free less the tag's current bytes). */
static inline void count_freed(device_state *d, const record *rec)
{
    tag_state *t = &d->tag[rec->tag];
    atomic_fetch_add_explicit(&t->freed, rec->size, RELAXED);
    atomic_fetch_add_explicit(&t->num_frees, 1, RELAXED);
    atomic_fetch_add_explicit(&d->num_frees, 1, RELAXED);
    atomic_fetch_sub_explicit(&t->count, 1, RELAXED);
}

void ledger_count_free(device_state *d, const record *rec)
{
    atomic_fetch_sub_explicit(&d->tag[rec->tag].current, rec->size, RELAXED);
    count_freed(d, rec);
}

int bridge_set_limit(int device, uint64_t limit)
{
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_DEVICE;
    atomic_store(&d->limit, limit);
    return BRIDGE_OK;
}

int bridge_set_tag_limit(int device, int tag, uint64_t limit)
{
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_DEVICE;
    if (tag < 0 || tag >= BRIDGE_NTAGS)
        return BRIDGE_E_INVALID;
    atomic_store(&d->tag[tag].limit, limit);
    return BRIDGE_OK;
}

void bridge_set_pressure_hook(bridge_pressure_fn fn)
{
    atomic_store(&pressure_hook, fn);
}

/* ---- freeing ---- */
/* Issue the driver free of a block (its record out of the table), ordered
 * after its streams, on rec->stream (a key free_key chose: one the bridge
 * can prove alive).  0 when issued, or when the driver refused it for good
 * (counted: the ledger forgets the block, which never stays deferred for an
 * error); 1 when it must wait for a capture to end.  Needs the device's
 * context current.  No host wait: a stream that cannot be ordered after is
 * stood in for by the legacy stream, which waits for every blocking
 * stream's queued work. */
static int issue_free(device_state *d, const record *rec)
{
    CUstream stream = stream_handle(rec->stream);
    if (rec->nrec) {
        int o = stream_order_after_recorded(rec, stream);
        if (o > 0)
            return 1;
        if (o < 0) {
            atomic_fetch_add_explicit(&d->num_order_fallbacks, 1, RELAXED);
            stream = STREAM_LEGACY;
        }
    }
    CUresult r = bridge_drv.cuMemFreeAsync((CUdeviceptr)rec->ptr, stream);
    if (r != CUDA_SUCCESS) {
        bridge_note_driver_error(r);
        atomic_fetch_add_explicit(&d->num_driver_errors, 1, RELAXED);
        /* The stream is capturing (wait for it) or unusable: then (once more)
         * the legacy stream, ordered after every blocking stream's work. */
        if ((r >= 900 && r <= 909) || stream_capturing(d, rec->stream))
            return 1;
        atomic_fetch_add_explicit(&d->num_order_fallbacks, 1, RELAXED);
        stream = STREAM_LEGACY;
        r = bridge_drv.cuMemFreeAsync((CUdeviceptr)rec->ptr, stream);
    }
    if (r != CUDA_SUCCESS) {
        bridge_note_driver_error(r);
        atomic_fetch_add_explicit(&d->num_driver_errors, 1, RELAXED);
        /* a blocking stream captures (the legacy stream answers so): later */
        if ((r >= 900 && r <= 909) || stream_capturing(d, STREAM_LEGACY))
            return 1;
    }
    return 0;
}

static void settle(device_state *d, const record *rec)
{
    free(rec->recs);
    atomic_fetch_sub_explicit(&d->committed, rec->size, RELAXED);
    /* seq_cst, then the waiter count: a waiter either sees the lower
     * `reserved` in its retry or is woken here (wait.h) */
    atomic_fetch_sub_explicit(&d->reserved, rec->size, memory_order_seq_cst);
    if (atomic_load(&wait_count[rec->device]))
        wait_freed(rec->device);
}

void ledger_release(device_state *d, const record *rec)
{
    record r = *rec;
    r.stream = free_key(rec); /* never a stream the bridge cannot prove alive */
    /* During a capture a block of the captured stream (a cached one, say)
     * must not be freed on it: the free would join the user's graph. */
    if (atomic_load_explicit(&d->captures_active, RELAXED) && stream_capturing(d, r.stream)) {
        ledger_defer(d, &r);
        return;
    }
    ctx_guard g;
    ctx_enter(d, &g);
    int mode = capture_mode_enter(d);
    int wait = issue_free(d, &r);
    capture_mode_exit(mode);
    ctx_exit(&g);
    if (wait)
        ledger_defer(d, &r);
    else
        settle(d, &r);
}

void ledger_defer(device_state *d, const record *rec)
{
    deferred_free item = {.rec = *rec};
    item.rec.stream = free_key(rec);
    /* A stream that may be destroyed before the free is issued (a CuPy
     * stream whose last reference goes with the array; alive now: its tag
     * holds it until this free returns): mark the point of the stream now,
     * and issue the free on the side stream after it.  A capturing one
     * cannot be marked (the event would join the capture): the end of its
     * capture marks it (ledger_mark_deferred, while CuPy's Stream lives). */
    if (!stream_long_lived(item.rec.stream)) {
        if (!stream_capturing(d, item.rec.stream)) {
            ctx_guard g;
            ctx_enter(d, &g);
            int mode = capture_mode_relax();
            if (bridge_drv.cuEventCreate(&item.event, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS)
                item.event = NULL;
            else if (bridge_drv.cuEventRecord(item.event, stream_handle(item.rec.stream)) !=
                     CUDA_SUCCESS) {
                bridge_drv.cuEventDestroy_v2(item.event);
                item.event = NULL;
            }
            capture_mode_exit(mode);
            ctx_exit(&g);
            if (!item.event)
                item.rec.stream = STREAM_LEGACY;
        }
    }
    pthread_mutex_lock(&d->capture_lock);
    if (d->ndeferred == d->cap_deferred) {
        size_t ncap = d->cap_deferred ? d->cap_deferred * 2 : 64;
        deferred_free *n = realloc(d->deferred, ncap * sizeof *n);
        if (n) {
            d->deferred = n;
            d->cap_deferred = ncap;
        }
    }
    if (d->ndeferred < d->cap_deferred) {
        d->deferred[d->ndeferred++] = item;
        atomic_store(&d->num_deferred, d->ndeferred);
    } else {
        /* No host memory to remember it: the block stays on the ledger (a
         * leak the figures show), never freed out of order. */
        atomic_fetch_add_explicit(&d->num_driver_errors, 1, RELAXED);
        if (item.event)
            bridge_drv.cuEventDestroy_v2(item.event);
    }
    pthread_mutex_unlock(&d->capture_lock);
}

void ledger_mark_deferred(device_state *d, CUstream key)
{
    if (!atomic_load_explicit(&d->num_deferred, RELAXED) || stream_long_lived(key))
        return;
    ctx_guard g;
    ctx_enter(d, &g);
    int mode = capture_mode_relax();
    pthread_mutex_lock(&d->capture_lock);
    for (size_t i = 0; i < d->ndeferred; i++) {
        deferred_free *it = &d->deferred[i];
        if (it->event || it->rec.stream != key)
            continue;
        if (bridge_drv.cuEventCreate(&it->event, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) {
            it->event = NULL;
            it->rec.stream = STREAM_LEGACY; /* never the handle after this */
        } else if (bridge_drv.cuEventRecord(it->event, stream_handle(key)) != CUDA_SUCCESS) {
            bridge_drv.cuEventDestroy_v2(it->event);
            it->event = NULL;
            it->rec.stream = STREAM_LEGACY;
        }
    }
    pthread_mutex_unlock(&d->capture_lock);
    capture_mode_exit(mode);
    ctx_exit(&g);
}

void ledger_flush_deferred(device_state *d)
{
    if (!atomic_load_explicit(&d->num_deferred, RELAXED) ||
        atomic_load_explicit(&d->captures_active, RELAXED))
        return;
    ctx_guard g;
    ctx_enter(d, &g);
    int mode = capture_mode_relax();
    pthread_mutex_lock(&d->capture_lock);
    if (!atomic_load(&d->captures_active)) {
        size_t kept = 0;
        for (size_t i = 0; i < d->ndeferred; i++) {
            deferred_free *it = &d->deferred[i];
            record rec = it->rec;
            /* torch calls the end hook after the capture ended on its stream,
             * but another capture of the same stream may have begun, and a
             * free issued on a capturing stream would join its graph.  The
             * key is one the bridge can prove alive (ledger_defer) */
            if (!it->event && stream_capturing(d, rec.stream)) {
                d->deferred[kept++] = *it;
                continue;
            }
            if (it->event) {
                /* the marked point, then the side stream: the block's own
                 * stream handle may be gone by now */
                if (bridge_drv.cuStreamWaitEvent(d->side, it->event, 0) == CUDA_SUCCESS) {
                    rec.stream = d->side;
                } else {
                    atomic_fetch_add_explicit(&d->num_order_fallbacks, 1, RELAXED);
                    rec.stream = STREAM_LEGACY;
                }
            }
            if (issue_free(d, &rec)) {
                d->deferred[kept++] = *it;
                continue;
            }
            if (it->event)
                bridge_drv.cuEventDestroy_v2(it->event);
            settle(d, &rec);
        }
        d->ndeferred = kept;
        atomic_store(&d->num_deferred, kept);
    }
    pthread_mutex_unlock(&d->capture_lock);
    capture_mode_exit(mode);
    ctx_exit(&g);
}

/* ---- the cache in front of the pool (cache.c) ---- */
static void release_cached(int device, uintptr_t ptr, uint64_t size, CUstream key)
{
    record rec = {.ptr = ptr, .size = size, .stream = key, .device = device};
    ledger_release(&bridge_devices[device], &rec);
}

/* The device's committed bytes less a block being freed (still committed):
 * cache_put's `held`, of which the cache's cap takes live = held - cached. */
static inline uint64_t cache_held(device_state *d, uint64_t freeing)
{
    uint64_t committed = atomic_load_explicit(&d->committed, RELAXED);
    return committed > freeing ? committed - freeing : 0;
}

/* Blocks cache_put evicted back to the pool; more while a full batch came. */
static void release_evicted(int device, uint64_t held, cache_block *evicted, int n)
{
    for (;;) {
        for (int k = 0; k < n; k++)
            release_cached(device, evicted[k].ptr, evicted[k].size, evicted[k].stream);
        if (n < BRIDGE_CACHE_EVICT_MAX)
            return;
        n = cache_trim(device, held, evicted);
    }
}

/* Every cached block of a device back to the pool (in stream order; blocks
 * of a stream being captured wait for its end). */
static void flush_cache(int device)
{
    cache_flush(device, release_cached);
}

/* An allocation served from the cache: the bytes are already on the ledger
 * (reserved and committed); only the framework's figures move. */
static int adopt_cached(device_state *d, int device, uintptr_t p, size_t size, CUstream key,
                        int tag, void **out)
{
    tag_state *t = &d->tag[tag];
    uint64_t tlimit = atomic_load_explicit(&t->limit, RELAXED);
    uint64_t tcur = atomic_fetch_add_explicit(&t->current, size, RELAXED) + size;
    record rec = {.ptr = p,
                  .size = size,
                  .stream = key,
                  .device = device,
                  .tag = (uint8_t)tag,
                  .owner = thread_self()};
    if ((tlimit && tcur > tlimit) || records_insert(&rec) != 0) {
        atomic_fetch_sub_explicit(&t->current, size, RELAXED);
        ledger_release(d, &rec);
        return BRIDGE_E_TAG_LIMIT;
    }
    atomic_max(&t->peak, tcur);
    ledger_count_alloc(d, tag, size);
    atomic_fetch_add_explicit(&d->num_cache_hits, 1, RELAXED);
    *out = (void *)p;
    return BRIDGE_OK;
}

int bridge_forget_stream(void *stream)
{
    /* its cached blocks first, freed on it while it is still registered (it
     * lives until this returns), then it is forgotten; a block cached on it
     * meanwhile is freed on the legacy stream later, never on its handle */
    for (int i = 0; i < BRIDGE_MAX_DEVICES; i++)
        if (device_of(i))
            cache_flush_stream(i, (CUstream)stream, release_cached);
    int rc = stream_forget((CUstream)stream);
    for (int i = 0; i < BRIDGE_MAX_DEVICES; i++)
        if (device_of(i))
            cache_flush_stream(i, (CUstream)stream, release_cached);
    return rc;
}

int bridge_set_tag_cached(int tag, int cached)
{
    if (tag < 0 || tag >= BRIDGE_NTAGS)
        return BRIDGE_E_INVALID;
    if (cached)
        atomic_fetch_and(&uncached_tags, ~(1u << tag));
    else
        atomic_fetch_or(&uncached_tags, 1u << tag);
    return BRIDGE_OK;
}

int bridge_set_cache(int device, uint64_t limit, uint64_t max_block)
{
    if (!device_of(device))
        return BRIDGE_E_DEVICE;
    cache_set_limits(device, limit, max_block);
    if (!limit)
        flush_cache(device);
    return BRIDGE_OK;
}

int bridge_set_cache_fraction(int device, double fraction, uint64_t floor)
{
    if (!device_of(device))
        return BRIDGE_E_DEVICE;
    if (!(fraction >= 0.0 && fraction <= 65536.0))
        return BRIDGE_E_INVALID;
    cache_set_share(device, (uint64_t)(fraction * 65536.0 + 0.5), floor);
    return BRIDGE_OK;
}

int bridge_set_cache_tiers(int device, uint64_t small_max, uint64_t large_cap)
{
    if (!device_of(device))
        return BRIDGE_E_DEVICE;
    cache_set_tiers(device, small_max, large_cap);
    return BRIDGE_OK;
}

/* records_take's `keep` for bridge_free: a graph block stays in the table,
 * marked freed by the user, because replays may still write it; the pool's
 * release returns it.  Runs under the shard lock, so the mark and the figures
 * change in the same step that bridge_graph_release's sweep sees.
 * 0: an ordinary block (take it); 1: a graph block, first free; 2: again. */
static int keep_graph_block(record *r)
{
    if (!(r->flags & REC_GRAPH))
        return 0;
    if (r->flags & REC_USER_FREED)
        return 2;
    r->flags |= REC_USER_FREED;
    device_state *d = &bridge_devices[r->device];
    ledger_count_free(d, r);
    atomic_fetch_add_explicit(&d->graph_bytes, r->size, RELAXED);
    return 1;
}

/* May a freed block wait in the cache (bridge_free, bridge_free_cached):
 * no stream recorded against it (its free is ordered after them), its tag
 * cached, and its stream one that outlives the block. */
static inline int cacheable(const record *rec)
{
    return !rec->nrec && !(atomic_load_explicit(&uncached_tags, RELAXED) & (1u << rec->tag)) &&
           stream_long_lived(rec->stream);
}

void bridge_free(void *ptr)
{
    if (!ptr || bridge_forked())
        return; /* a fork child owns none of the parent's blocks */
    record rec;
    /* fast path: one shard lock, one cache lock, a few atomics */
    int kept = records_take((uintptr_t)ptr, &rec, keep_graph_block);
    if (kept < 0 || kept == 2) {
        /* unknown pointer or double free: count it, change nothing else */
        atomic_fetch_add_explicit(&bad_frees, 1, RELAXED);
        return;
    }
    history_maybe(BRIDGE_EV_FREE, rec.device, rec.ptr, rec.size, rec.stream, rec.tag);
    device_state *d = &bridge_devices[rec.device];
    if (kept == 1) {
        graph_block_freed(d, &rec); /* memory kept for the graph's pool */
        return;
    }
    ledger_count_free(d, &rec);
    /* During a capture, a block of a captured stream (one the captured work
     * may still use) is held back until it ends; others go on as usual, so
     * memory other threads free meanwhile is usable at once. */
    if (atomic_load_explicit(&d->captures_active, RELAXED) &&
        stream_capturing(d, free_key(&rec))) {
        ledger_defer(d, &rec);
        return;
    }
    /* kept for the next allocation of this size on this stream; the oldest
     * cached blocks beyond the cap go back to the pool (after the cache's
     * lock is dropped) */
    if (cacheable(&rec)) {
        cache_block evicted[BRIDGE_CACHE_EVICT_MAX];
        int nevicted;
        uint64_t held = cache_held(d, rec.size);
        int cached = cache_put(rec.device, rec.stream, rec.size, rec.ptr, held, evicted, &nevicted);
        if (nevicted)
            release_evicted(rec.device, held, evicted, nevicted);
        if (cached) {
            if (atomic_load_explicit(&d->num_deferred, RELAXED))
                ledger_flush_deferred(d);
            return;
        }
    }
    ledger_release(d, &rec);
    if (atomic_load_explicit(&d->num_deferred, RELAXED))
        ledger_flush_deferred(d);
}

/* records_take's `keep` for bridge_free_cached, under the shard lock: the
 * block goes to the cache only when that needs no driver call and no
 * eviction; then the record is taken (0).  Otherwise nothing changes and the
 * record stays (FREE_DECLINED): a graph block, a block that is not cacheable,
 * any capture on the device (asking the driver whether its stream captures
 * is a call), frees deferred by a capture pending (completing them makes
 * driver calls), or a cache that would have to evict.  The tag's bytes drop
 * before the block is visible in the cache: an allocation that adopts it at
 * once (it waits for this shard lock to insert its record, not to count)
 * never counts it twice in the tag's peak.  A decline adds them back. */
#define FREE_DECLINED 3
static int cache_or_keep(record *r)
{
    device_state *d = &bridge_devices[r->device];
    if ((r->flags & REC_GRAPH) || !cacheable(r) ||
        atomic_load_explicit(&d->captures_active, RELAXED) ||
        atomic_load_explicit(&d->num_deferred, RELAXED))
        return FREE_DECLINED;
    tag_state *t = &d->tag[r->tag];
    atomic_fetch_sub_explicit(&t->current, r->size, RELAXED);
    if (!cache_put_no_evict(r->device, r->stream, r->size, r->ptr, cache_held(d, r->size))) {
        atomic_fetch_add_explicit(&t->current, r->size, RELAXED);
        return FREE_DECLINED;
    }
    count_freed(d, r);
    return 0;
}

int bridge_free_cached(void *ptr)
{
    if (!ptr)
        return BRIDGE_OK; /* as bridge_free: nothing to free */
    /* A fork child: bridge_free ignores it.  History on: the free's note
     * must precede any reuse of the block, and its stack hook runs Python,
     * which no shard lock may be held across: bridge_free notes it. */
    if (bridge_forked() || atomic_load_explicit(&bridge_history_on, RELAXED))
        return BRIDGE_E_MISS;
    record rec;
    /* unknown pointers and double frees miss too: bridge_free counts them */
    return records_take((uintptr_t)ptr, &rec, cache_or_keep) == 0 ? BRIDGE_OK : BRIDGE_E_MISS;
}

/* ---- allocation ---- */
static int try_alloc(device_state *d, int device, size_t size, CUstream stream, CUstream key,
                     int tag, int outside_capture, void **out)
{
    int rc = ledger_reserve(d, tag, size);
    if (rc != BRIDGE_OK)
        return rc;
    CUdeviceptr p = 0;
    CUresult r;
    if (outside_capture) {
        /* The stream is being captured (CuPy's Stream.begin_capture): an
         * allocation on it would become a node of the user's graph.  Allocate
         * on the side stream, complete, as torch's graph blocks are. */
        int mode = capture_mode_relax();
        r = bridge_drv.cuMemAllocFromPoolAsync(&p, size, d->pool, d->side);
        if (r == CUDA_SUCCESS)
            r = bridge_drv.cuStreamSynchronize(d->side);
        capture_mode_exit(mode);
    } else {
        int mode = capture_mode_enter(d);
        r = bridge_drv.cuMemAllocFromPoolAsync(&p, size, d->pool, stream);
        capture_mode_exit(mode);
    }
    if (r != CUDA_SUCCESS || !p) {
        ledger_unreserve(d, tag, size);
        bridge_note_driver_error(r);
        return r == CUDA_ERROR_OUT_OF_MEMORY || r == CUDA_SUCCESS ? BRIDGE_E_OOM : BRIDGE_E_DRIVER;
    }
    ledger_commit(d, size);
    record rec = {.ptr = (uintptr_t)p,
                  .size = size,
                  .stream = key,
                  .device = device,
                  .tag = (uint8_t)tag,
                  .owner = thread_self()};
    if (records_insert(&rec) != 0) {
        /* no host memory for the record: give the block back */
        atomic_fetch_sub_explicit(&d->tag[tag].current, size, RELAXED);
        ledger_release(d, &rec);
        return BRIDGE_E_OOM;
    }
    ledger_count_alloc(d, tag, size);
    *out = (void *)p;
    return BRIDGE_OK;
}

/* The refusal path's synchronization of the allocating stream (alive: its
 * framework allocates on it): not while a capture the core knows of runs
 * (sync_enter), nor when the stream itself is captured by one it does not
 * know of (a synchronization would invalidate it).  Relaxed capture mode. */
static void sync_stream(device_state *d, CUstream stream, CUstream key)
{
    if (!sync_enter(d))
        return;
    int mode = capture_mode_relax();
    if (!stream_capturing(d, key))
        bridge_drv.cuStreamSynchronize(stream);
    /* the frees of streams the core could not prove alive went to the legacy
     * stream: they land with it (unless a blocking stream captures) */
    if (stream != STREAM_LEGACY && (uintptr_t)stream != 0 && !stream_capturing(d, STREAM_LEGACY))
        bridge_drv.cuStreamSynchronize(STREAM_LEGACY);
    capture_mode_exit(mode);
    sync_exit(d);
}

static int retryable(int rc)
{
    return rc == BRIDGE_E_BUDGET || rc == BRIDGE_E_OOM;
}

/* ---- the refusal path: waiting for memory others free (wait.c) ---- */
typedef struct retry_args {
    device_state *d;
    int device, tag, captured;
    size_t size;
    CUstream stream, key;
} retry_args;

/* One more try of a waiting allocation: the garbage collection first when
 * asked (wait.h), then what others freed into the cache or deferred goes
 * back to the pool. */
static int retry_alloc(void *ctx, int flags, void **out)
{
    retry_args *a = ctx;
    if (flags & WAIT_RETRY_COLLECT) {
        bridge_pressure_fn hook = atomic_load(&pressure_hook);
        if (hook)
            hook(a->device, a->size, a->tag, BRIDGE_RELIEVE_COLLECT);
    }
    graph_collect_dead();
    flush_cache(a->device);
    ledger_flush_deferred(a->d);
    ctx_guard g;
    ctx_enter(a->d, &g); /* after the hook: it may have run Python that switched the context */
    if (flags & WAIT_RETRY_FREED)
        sync_stream(a->d, a->stream, a->key); /* its frees reach the pool */
    int rc = try_alloc(a->d, a->device, a->size, a->stream, a->key, a->tag, a->captured, out);
    ctx_exit(&g);
    return rc;
}

/* The cache's fast path, shared by alloc_block and bridge_alloc_cached: a
 * block of this size freed on this stream (one lock, one pop, one shard lock;
 * no driver call, so no context needed), adopted for `tag`.  BRIDGE_E_MISS
 * when none is cached, or when adopting it failed (the tag's cap, no host
 * memory for the record): adopt_cached gave the block back to the pool. */
static int take_cached(device_state *d, int device, size_t size, CUstream key, int tag, void **out)
{
    uintptr_t hit = cache_take(device, key, size);
    if (hit && adopt_cached(d, device, hit, size, key, tag, out) == BRIDGE_OK)
        return BRIDGE_OK;
    return BRIDGE_E_MISS;
}

static int alloc_block(int device, size_t size, void *stream, int tag, void **out)
{
    *out = NULL;
    if (size == 0)
        return BRIDGE_OK; /* a null pointer is the right answer for 0 bytes */
    if (tag < 0 || tag >= BRIDGE_NTAGS)
        return BRIDGE_E_INVALID;
    int rc;
    device_state *d = device_of(device);
    if (!d && !(d = device_use(device, &rc)))
        return rc;
    CUstream key = stream_key((CUstream)stream);
    if (atomic_load_explicit(&d->num_deferred, RELAXED))
        ledger_flush_deferred(d);
    /* a CuPy capture of this stream: its graph's pool (graph.c), never the
     * cache (a cached block would leave the graph at its free) */
    uint64_t cupy_pool;
    if (atomic_load_explicit(&d->cupy_captures, RELAXED) &&
        graph_pool_of_stream(d, key, &cupy_pool))
        return graph_alloc(device, size, tag, BRIDGE_CUPY_POOL, cupy_pool, stream, out);
    /* fastest path: a block of this size freed on this stream */
    if (take_cached(d, device, size, key, tag, out) == BRIDGE_OK)
        return BRIDGE_OK;
    ctx_guard g;
    ctx_enter(d, &g);
    int captured = atomic_load_explicit(&d->captures_active, RELAXED) && stream_capturing(d, key);
    /* fast path: two atomic adds (plus one attribute read under a budget),
     * one driver call, one shard lock */
    rc = try_alloc(d, device, size, (CUstream)stream, key, tag, captured, out);
    if (rc != BRIDGE_OK)
        wait_refused(); /* the OOM message tells this refusal's wait, none before */
    if (retryable(rc)) {
        /* 1. Cached blocks back to the pool, the stream's pending frees land
         *    (not while a capture runs: a synchronization could invalidate
         *    it), deferred frees complete, dead CuPy graphs' pools go. */
        graph_collect_dead();
        flush_cache(device);
        sync_stream(d, (CUstream)stream, key);
        ledger_flush_deferred(d);
        rc = try_alloc(d, device, size, (CUstream)stream, key, tag, captured, out);
        /* 2. Ask the frameworks to release their caches, then try again.  No
         *    device-wide synchronization: another library's capture (XLA's)
         *    may be running, and the pool reuses memory freed on other
         *    streams by itself.  A thread that will wait leaves the garbage
         *    collection to its wait (bridge.h, wait.c). */
        bridge_pressure_fn hook = atomic_load(&pressure_hook); /* one read: see its comment */
        int stage = wait_would_wait(d, size) ? BRIDGE_RELIEVE_CACHES : BRIDGE_RELIEVE_ALL;
        if (retryable(rc) && hook && hook(device, size, tag, stage)) {
            /* The hook may have run Python that switched the context: make
             * the device's current again (keeping the caller's in `g`). */
            bridge_drv.cuCtxSetCurrent(d->ctx);
            graph_collect_dead(); /* the hook's collection may have ended a CuPy graph */
            flush_cache(device);
            sync_stream(d, (CUstream)stream, key);
            ledger_flush_deferred(d);
            rc = try_alloc(d, device, size, (CUstream)stream, key, tag, captured, out);
        }
        if (rc == BRIDGE_OK)
            atomic_fetch_add_explicit(&d->num_retries, 1, RELAXED);
        /* 3. Still refused: wait for others to free, if this thread may. */
        if (retryable(rc)) {
            ctx_exit(&g); /* the wait may be long; each retry enters again */
            retry_args a = {d, device, tag, captured, size, (CUstream)stream, key};
            rc = wait_for_room(d, device, size, rc, retry_alloc, &a, out);
            ctx_enter(d, &g);
        }
    }
    if (retryable(rc) || rc == BRIDGE_E_TAG_LIMIT) { /* refusals, not driver errors */
        atomic_fetch_add_explicit(&d->num_ooms, 1, RELAXED);
        atomic_fetch_add_explicit(&d->tag[tag].num_ooms, 1, RELAXED);
    }
    ctx_exit(&g);
    return rc;
}

/* The history's note of an allocation (handed out or refused); off: one
 * relaxed load.  Outside every lock of the core (the stack hook runs Python). */
static inline void note_alloc(int rc, int device, size_t size, void *stream, int tag, void *out)
{
    if (atomic_load_explicit(&bridge_history_on, RELAXED) && size &&
        (rc == BRIDGE_OK || retryable(rc) || rc == BRIDGE_E_TAG_LIMIT))
        history_note(rc == BRIDGE_OK ? BRIDGE_EV_ALLOC : BRIDGE_EV_OOM, device, (uintptr_t)out,
                     size, stream_key((CUstream)stream), tag);
}

int bridge_alloc(int device, size_t size, void *stream, int tag, void **out)
{
    int rc = alloc_block(device, size, stream, tag, out);
    note_alloc(rc, device, size, stream, tag, *out);
    return rc;
}

int bridge_alloc_cached(int device, size_t size, void *stream, int tag, void **out)
{
    *out = NULL;
    if (size == 0)
        return BRIDGE_OK; /* as bridge_alloc: a null pointer for 0 bytes */
    if (tag < 0 || tag >= BRIDGE_NTAGS)
        return BRIDGE_E_INVALID;
    /* A device nobody set up yet, or frees deferred by a capture (completing
     * them makes driver calls): bridge_alloc's business. */
    device_state *d = device_of(device);
    if (!d || atomic_load_explicit(&d->num_deferred, RELAXED) ||
        atomic_load_explicit(&d->cupy_captures, RELAXED))
        return BRIDGE_E_MISS; /* a CuPy capture: bridge_alloc routes its arrays to its graph */
    int rc = take_cached(d, device, size, stream_key((CUstream)stream), tag, out);
    if (rc == BRIDGE_OK)
        note_alloc(rc, device, size, stream, tag, *out);
    return rc;
}

static int add_stream(record *r, void *arg)
{
    CUstream s = (CUstream)arg;
    /* The per-thread default stream of the calling thread: recorded as the
     * legacy stream, which any thread can order after (it waits for every
     * blocking stream's queued work). */
    if (s == (CUstream)(uintptr_t)2)
        s = stream_key(s) == r->stream ? r->stream : (CUstream)(uintptr_t)1;
    if (s == r->stream)
        return 0;
    for (uint16_t i = 0; i < r->nrec; i++)
        if (r->recs[i] == s)
            return 0;
    if (r->nrec == UINT16_MAX)
        return -2;
    CUstream *n = realloc(r->recs, (r->nrec + 1u) * sizeof *n);
    if (!n)
        return -2;
    n[r->nrec++] = s;
    r->recs = n;
    return 0;
}

int bridge_record_stream(void *ptr, void *stream)
{
    int rc = records_update((uintptr_t)ptr, add_stream, stream);
    return rc == 0 ? BRIDGE_OK : rc == -2 ? BRIDGE_E_OOM : BRIDGE_E_INVALID;
}

static int copy_record(record *r, void *arg)
{
    *(record *)arg = *r;
    return 0;
}

int bridge_lookup(void *ptr, size_t *size, int *device, int *tag)
{
    record rec;
    if (records_update((uintptr_t)ptr, copy_record, &rec) != 0)
        return BRIDGE_E_INVALID;
    if (size)
        *size = rec.size;
    if (device)
        *device = rec.device;
    if (tag)
        *tag = rec.tag;
    return BRIDGE_OK;
}

/* ---- idle memory ---- */
int bridge_trim(int device, uint64_t keep)
{
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_DEVICE;
    graph_collect_dead();
    flush_cache(device);
    ledger_flush_deferred(d);
    drain_streams(d); /* pending frees return to the pool (never cuCtxSynchronize) */
    ctx_guard g;
    ctx_enter(d, &g);
    int mode = capture_mode_relax(); /* a trim in global mode invalidates another's capture */
    CUresult r = bridge_drv.cuMemPoolTrimTo(d->pool, keep);
    ctx_exit(&g);
    share_member *sm = atomic_load(&d->share);
    if (sm)
        share_trimmed(d, sm); /* the claim follows the pool down (its figures: relaxed too) */
    capture_mode_exit(mode);
    return r == CUDA_SUCCESS ? BRIDGE_OK : (bridge_note_driver_error(r), BRIDGE_E_DRIVER);
}

/* ---- fork ---- */
static void forget_after_fork(void)
{
    /* The child owns none of the parent's blocks and may find any lock held
     * by a thread that no longer exists: forget everything, take no lock. */
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    setup_lock = fresh;
    for (int i = 0; i < BRIDGE_MAX_DEVICES; i++) {
        device_state *d = &bridge_devices[i];
        atomic_store(&d->ready, 0);
        d->capture_lock = fresh;
        atomic_store(&d->syncs, 0);         /* a parent's thread's, gone */
        atomic_store(&d->cupy_captures, 0); /* the parent's pools, forgotten below */
        d->deferred = NULL;
        d->ndeferred = d->cap_deferred = 0;
        atomic_store(&d->num_deferred, 0);
        d->graphs = NULL;              /* the parent's graph pools; never freed here */
        atomic_store(&d->share, NULL); /* the parent's membership (its mapping stays) */
    }
    cache_forget_after_fork();
    graph_forget_after_fork();
    records_forget_after_fork();
    history_forget_after_fork();
    wait_forget_after_fork();
}

static void register_fork_handler(void)
{
    pthread_atfork(NULL, NULL, forget_after_fork);
}

/* ---- figures ---- */
int bridge_get_stats(int device, bridge_stats *out)
{
    memset(out, 0, sizeof *out);
    device_state *d = device_of(device);
    if (!d)
        return bridge_initialized() ? BRIDGE_E_DEVICE : BRIDGE_E_NOTINIT;
    graph_collect_dead(); /* the figures count no dead CuPy graph's pool */
    out->limit = atomic_load(&d->limit);
    out->used = atomic_load(&d->reserved);
    out->peak_used = atomic_load(&d->peak);
    out->release_threshold = atomic_load(&d->release_threshold);
    out->total = d->total;
    out->num_allocs = atomic_load(&d->num_allocs);
    out->num_frees = atomic_load(&d->num_frees);
    out->num_ooms = atomic_load(&d->num_ooms);
    out->num_retries = atomic_load(&d->num_retries);
    out->num_bad_frees = atomic_load(&bad_frees);
    out->num_driver_errors = atomic_load(&d->num_driver_errors);
    out->num_deferred = atomic_load(&d->num_deferred);
    out->graph_bytes = atomic_load(&d->graph_bytes);
    out->cached = cache_bytes(device);
    out->num_cache_hits = atomic_load(&d->num_cache_hits);
    out->num_order_fallbacks = atomic_load(&d->num_order_fallbacks);
    out->num_pool_read_errors = atomic_load(&d->num_pool_read_errors);
    out->captures_active = (uint64_t)atomic_load(&d->captures_active);
    out->cache_limit = cache_limit(device);
    out->cache_floor = cache_floor(device);
    out->cache_fraction = (double)cache_fraction_q16(device) / 65536.0;
    out->cached_small = cache_tier_bytes(device, 0);
    out->cached_large = cache_tier_bytes(device, 1);
    out->cache_small_max = cache_small_max(device);
    out->cache_large_cap = cache_large_cap(device);
    wait_fill_stats(device, out);
    for (int i = 0; i < BRIDGE_NTAGS; i++) {
        tag_state *t = &d->tag[i];
        out->tag[i] = (bridge_tag_stats){
            atomic_load(&t->current),         atomic_load(&t->peak),
            atomic_load(&t->allocated),       atomic_load(&t->freed),
            atomic_load(&t->num_allocs),      atomic_load(&t->num_frees),
            atomic_load(&t->num_ooms),        atomic_load(&t->limit),
            (uint64_t)atomic_load(&t->count), (uint64_t)atomic_load(&t->count_peak)};
    }
    CUresult r;
    int mode = capture_mode_relax(); /* figures asked for during another's capture */
    if ((r = bridge_drv.cuMemPoolGetAttribute(d->pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
                                              &out->pool_used)) != CUDA_SUCCESS ||
        (r = bridge_drv.cuMemPoolGetAttribute(d->pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                                              &out->pool_reserved)) != CUDA_SUCCESS ||
        (r = bridge_drv.cuMemPoolGetAttribute(d->pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                                              &out->pool_used_high)) != CUDA_SUCCESS) {
        capture_mode_exit(mode);
        return bridge_note_driver_error(r), BRIDGE_E_DRIVER;
    }
    capture_mode_exit(mode);
    return BRIDGE_OK;
}

int bridge_reset_peak(int device, int tag)
{
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_DEVICE;
    if (tag < -1 || tag >= BRIDGE_NTAGS)
        return BRIDGE_E_INVALID;
    for (int i = 0; i < BRIDGE_NTAGS; i++)
        if (tag == -1 || tag == i) {
            atomic_store(&d->tag[i].peak, atomic_load(&d->tag[i].current));
            atomic_store(&d->tag[i].count_peak, atomic_load(&d->tag[i].count));
        }
    if (tag == -1)
        atomic_store(&d->peak, atomic_load(&d->reserved));
    return BRIDGE_OK;
}

int bridge_reset_accumulated(int device, int tag)
{
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_DEVICE;
    if (tag < -1 || tag >= BRIDGE_NTAGS)
        return BRIDGE_E_INVALID;
    for (int i = 0; i < BRIDGE_NTAGS; i++) {
        if (tag != -1 && tag != i)
            continue;
        tag_state *t = &d->tag[i];
        atomic_store(&t->allocated, 0);
        atomic_store(&t->freed, 0);
        atomic_store(&t->num_allocs, 0);
        atomic_store(&t->num_frees, 0);
        atomic_store(&t->num_ooms, 0);
    }
    return BRIDGE_OK;
}

uint64_t bridge_live_records(void)
{
    return records_count();
}
