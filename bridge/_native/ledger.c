/* ledger.c: per-device pools, the budget ledger, allocation and free.
 *
 * Accounting, per device (every figure is an atomic, lock-free to read):
 *   reserved   bytes counted against the budget: live allocations, graph
 *              blocks kept for replay, deferred frees, blocks kept by the
 *              cache (cache.c), and reservations of allocations in flight.  A reservation is added BEFORE the
 *              driver is asked, and checked against the budget with the sum
 *              that includes every concurrent reservation, so two threads
 *              can both be refused at the edge but never both pass it.
 *   committed  bytes the driver granted and the bridge has not yet freed;
 *              `others` = pool USED_MEM_CURRENT - committed.
 *   tag[t]     bytes live for framework t as the framework sees them.
 * Ordering that keeps the budget conservative under races: alloc adds
 * `reserved`, calls the driver, then adds `committed`; free calls the driver,
 * then subtracts `committed`, then `reserved`.
 */
#include "bridge.h"
#include "driver.h"
#include "records.h"
#include "cache.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* ---- per-device state ---- */
typedef struct tag_state {
    _Atomic uint64_t current;    /* live bytes; what the framework sees */
    _Atomic uint64_t peak;       /* max of current since reset */
    _Atomic uint64_t allocated;  /* cumulative bytes */
    _Atomic uint64_t freed;      /* cumulative bytes */
    _Atomic uint64_t num_allocs;
    _Atomic uint64_t num_frees;
    _Atomic uint64_t num_ooms;
    _Atomic uint64_t limit;      /* the framework's own cap; 0 = none */
} tag_state;

typedef struct deferred_free {
    record rec;                  /* the block, with its streams */
} deferred_free;

#define MAX_GRAPHS 128 /* graph pools open at once per device */
typedef struct graph_pool {
    uint64_t id0, id1;
    int in_use;                  /* 1 from begin until release */
    int capturing;               /* 1 from begin until end */
} graph_pool;

typedef struct device_state {
    /* ---- the ledger ---- */
    _Atomic uint64_t reserved;   /* see the banner; <= limit - others when checked */
    _Atomic uint64_t committed;  /* driver-granted, not yet freed */
    _Atomic uint64_t limit;      /* budget; 0 = none */
    _Atomic uint64_t peak;       /* max of reserved after a passed check */
    tag_state tag[BRIDGE_NTAGS];
    _Atomic uint64_t num_allocs, num_frees, num_ooms, num_retries;
    _Atomic uint64_t num_driver_errors;
    _Atomic uint64_t num_cache_hits; /* allocations served from the cache */
    _Atomic uint64_t graph_bytes; /* bytes of graph blocks the user freed */

    /* ---- the pool (set once by setup, under setup_lock) ---- */
    atomic_int ready;            /* 1 once the fields below are valid */
    CUdevice dev;
    CUcontext ctx;               /* the primary context, retained */
    CUmemoryPool pool;           /* the default pool */
    CUstream side;               /* non-blocking stream for graph blocks */
    uint64_t total;              /* device memory, bytes */
    _Atomic uint64_t release_threshold;

    /* ---- graph capture (under capture_lock) ---- */
    pthread_mutex_t capture_lock;
    atomic_int captures_active;  /* captures between begin and end */
    graph_pool graphs[MAX_GRAPHS];
    deferred_free *deferred;     /* frees waiting for the captures to end */
    size_t ndeferred, cap_deferred;
    _Atomic uint64_t num_deferred; /* == ndeferred, readable without the lock */
} device_state;

static device_state devices[BRIDGE_MAX_DEVICES];
static pthread_mutex_t setup_lock = PTHREAD_MUTEX_INITIALIZER;
/* Set from Python while other threads allocate without the GIL: atomic, and
 * read once per use (a second read could see NULL after the first saw a hook). */
static _Atomic(bridge_pressure_fn) pressure_hook;
static _Atomic uint64_t bad_frees; /* unknown pointers and double frees, every device */

#define RELAXED memory_order_relaxed

static inline device_state *device_of(int device)
{
    if (device < 0 || device >= BRIDGE_MAX_DEVICES)
        return NULL;
    device_state *d = &devices[device];
    return atomic_load_explicit(&d->ready, memory_order_acquire) ? d : NULL;
}

static inline void atomic_max(_Atomic uint64_t *a, uint64_t v)
{
    uint64_t cur = atomic_load_explicit(a, RELAXED);
    while (cur < v && !atomic_compare_exchange_weak_explicit(a, &cur, v, RELAXED, RELAXED))
        ;
}

/* ---- the current context ---- */
/* The driver allocates in the calling thread's current context.  torch's
 * autograd thread has none, and a caller may have another device's current;
 * make the device's primary context current for the call. */
typedef struct ctx_guard {
    CUcontext prev;
    int changed;
} ctx_guard;

static inline void ctx_enter(device_state *d, ctx_guard *g)
{
    g->prev = NULL;
    g->changed = 0;
    if (bridge_drv.cuCtxGetCurrent(&g->prev) != CUDA_SUCCESS || g->prev != d->ctx) {
        bridge_drv.cuCtxSetCurrent(d->ctx);
        g->changed = 1;
    }
}

static inline void ctx_exit(ctx_guard *g)
{
    /* A thread that had no context keeps the primary one: the next call is
     * then one cheap check, and torch's runtime would make the same choice. */
    if (g->changed && g->prev)
        bridge_drv.cuCtxSetCurrent(g->prev);
}

/* While a capture runs, driver calls on other streams must not invalidate it:
 * switch this thread to relaxed capture mode for the call (torch does the
 * same around cudaMalloc). */
static inline int capture_mode_enter(device_state *d)
{
    if (!atomic_load_explicit(&d->captures_active, RELAXED))
        return -1;
    int mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    bridge_drv.cuThreadExchangeStreamCaptureMode(&mode);
    return mode;
}

static inline void capture_mode_exit(int mode)
{
    if (mode >= 0)
        bridge_drv.cuThreadExchangeStreamCaptureMode(&mode);
}

/* ---- devices ---- */
int bridge_device_setup(int device, uint64_t release_threshold)
{
    if (!bridge_initialized())
        return BRIDGE_E_NOTINIT;
    if (device < 0 || device >= BRIDGE_MAX_DEVICES)
        return BRIDGE_E_DEVICE;
    int count = 0;
    if (bridge_device_count(&count) != BRIDGE_OK || device >= count)
        return BRIDGE_E_DEVICE;
    device_state *d = &devices[device];
    int rc = BRIDGE_OK;
    pthread_mutex_lock(&setup_lock);
    if (!atomic_load(&d->ready)) {
        CUresult r;
        int pools = 0;
        size_t total = 0;
        if ((r = bridge_drv.cuDeviceGet(&d->dev, device)) != CUDA_SUCCESS ||
            (r = bridge_drv.cuDeviceGetAttribute(
                 &pools, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, d->dev)) != CUDA_SUCCESS) {
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
            atomic_store_explicit(&d->ready, 1, memory_order_release);
        }
    }
    if (rc == BRIDGE_OK) {
        atomic_store(&d->release_threshold, release_threshold);
        rc = bridge_reassert(device);
    }
    pthread_mutex_unlock(&setup_lock);
    return rc;
}

int bridge_device_ready(int device) { return device_of(device) != NULL; }

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
        if (p == device || bridge_drv.cuDeviceCanAccessPeer(&can, p, d->dev) != CUDA_SUCCESS || !can)
            continue;
        bridge_CUmemAccessDesc desc = {{1 /* DEVICE */, p}, 3 /* READWRITE */};
        CUresult r = bridge_drv.cuMemPoolSetAccess(d->pool, &desc, 1);
        if (r != CUDA_SUCCESS)
            return bridge_note_driver_error(r), BRIDGE_E_DRIVER;
        (*granted)++;
    }
    return BRIDGE_OK;
}

/* ---- the budget ---- */
static uint64_t bridge_others_of(device_state *d)
{
    /* `committed` first: a grant landing between the two reads is then in the
     * pool's figure but not in ours, and counts as others (too much, never
     * too little). */
    uint64_t mine = atomic_load_explicit(&d->committed, memory_order_acquire);
    uint64_t used = 0;
    if (bridge_drv.cuMemPoolGetAttribute(d->pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used) != CUDA_SUCCESS)
        return 0;
    return used > mine ? used - mine : 0;
}

int bridge_others(int device, uint64_t *out)
{
    *out = 0;
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_DEVICE;
    *out = bridge_others_of(d);
    return BRIDGE_OK;
}

/* Reserve size bytes for tag; BRIDGE_OK or the limit that refused it.
 * Fast path without a budget: two atomic adds. */
static int reserve(device_state *d, int tag, uint64_t size)
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
        uint64_t others = bridge_others_of(d);
        if (r > limit || others > limit - r) {
            atomic_fetch_sub_explicit(&d->reserved, size, memory_order_acq_rel);
            atomic_fetch_sub_explicit(&t->current, size, RELAXED);
            return BRIDGE_E_BUDGET;
        }
    }
    atomic_max(&d->peak, r);
    atomic_max(&t->peak, tcur);
    return BRIDGE_OK;
}

static void unreserve(device_state *d, int tag, uint64_t size)
{
    atomic_fetch_sub_explicit(&d->tag[tag].current, size, RELAXED);
    atomic_fetch_sub_explicit(&d->reserved, size, memory_order_acq_rel);
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

void bridge_set_pressure_hook(bridge_pressure_fn fn) { atomic_store(&pressure_hook, fn); }

/* ---- freeing ---- */
/* Issue the driver free of a block whose record is already out of the table,
 * ordered after every stream recorded against it, and settle the ledger. */
static void release_block(device_state *d, const record *rec)
{
    ctx_guard g;
    ctx_enter(d, &g);
    int mode = capture_mode_enter(d);
    CUstream stream = rec->stream;
    if (rec->nrec) {
        /* The allocating stream waits for the recorded streams' queued work
         * (one event, recorded and waited once per stream). */
        CUevent ev = NULL;
        if (bridge_drv.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS) {
            for (uint16_t i = 0; i < rec->nrec; i++) {
                bridge_drv.cuEventRecord(ev, rec->recs[i]);
                bridge_drv.cuStreamWaitEvent(stream, ev, 0);
            }
            bridge_drv.cuEventDestroy_v2(ev);
        } else {
            for (uint16_t i = 0; i < rec->nrec; i++)
                bridge_drv.cuStreamSynchronize(rec->recs[i]);
        }
        free(rec->recs);
    }
    CUresult r = bridge_drv.cuMemFreeAsync((CUdeviceptr)rec->ptr, stream);
    if (r != CUDA_SUCCESS) {
        /* The stream may be gone: finish the device's work, then free on the
         * legacy stream, which is then ordered after everything. */
        bridge_note_driver_error(r);
        atomic_fetch_add_explicit(&d->num_driver_errors, 1, RELAXED);
        bridge_drv.cuCtxSynchronize();
        if (bridge_drv.cuMemFreeAsync((CUdeviceptr)rec->ptr, NULL) != CUDA_SUCCESS)
            atomic_fetch_add_explicit(&d->num_driver_errors, 1, RELAXED);
    }
    capture_mode_exit(mode);
    ctx_exit(&g);
    atomic_fetch_sub_explicit(&d->committed, rec->size, RELAXED);
    atomic_fetch_sub_explicit(&d->reserved, rec->size, memory_order_acq_rel);
}

/* Count a free on the framework's figures (the memory itself may live on). */
static void count_free(device_state *d, const record *rec)
{
    tag_state *t = &d->tag[rec->tag];
    atomic_fetch_sub_explicit(&t->current, rec->size, RELAXED);
    atomic_fetch_add_explicit(&t->freed, rec->size, RELAXED);
    atomic_fetch_add_explicit(&t->num_frees, 1, RELAXED);
    atomic_fetch_add_explicit(&d->num_frees, 1, RELAXED);
}

/* Complete the frees deferred during captures, when none is active.  A block
 * whose stream is still capturing stays deferred. */
static void flush_deferred(device_state *d)
{
    if (!atomic_load_explicit(&d->num_deferred, RELAXED) ||
        atomic_load_explicit(&d->captures_active, RELAXED))
        return;
    pthread_mutex_lock(&d->capture_lock);
    size_t kept = 0;
    for (size_t i = 0; i < d->ndeferred; i++) {
        record *rec = &d->deferred[i].rec;
        int status = CU_STREAM_CAPTURE_STATUS_NONE;
        int mode = CU_STREAM_CAPTURE_MODE_RELAXED;
        bridge_drv.cuThreadExchangeStreamCaptureMode(&mode);
        bridge_drv.cuStreamIsCapturing(rec->stream, &status);
        bridge_drv.cuThreadExchangeStreamCaptureMode(&mode);
        if (status != CU_STREAM_CAPTURE_STATUS_NONE || atomic_load(&d->captures_active))
            d->deferred[kept++] = d->deferred[i];
        else
            release_block(d, rec);
    }
    d->ndeferred = kept;
    atomic_store(&d->num_deferred, kept);
    pthread_mutex_unlock(&d->capture_lock);
}

static int defer_free(device_state *d, const record *rec)
{
    pthread_mutex_lock(&d->capture_lock);
    if (!atomic_load(&d->captures_active)) {
        pthread_mutex_unlock(&d->capture_lock);
        return 0; /* the capture ended meanwhile: free now */
    }
    if (d->ndeferred == d->cap_deferred) {
        size_t ncap = d->cap_deferred ? d->cap_deferred * 2 : 64;
        deferred_free *n = realloc(d->deferred, ncap * sizeof *n);
        if (!n) {
            pthread_mutex_unlock(&d->capture_lock);
            return 0; /* no host memory to remember it: free now */
        }
        d->deferred = n;
        d->cap_deferred = ncap;
    }
    d->deferred[d->ndeferred++].rec = *rec;
    atomic_store(&d->num_deferred, d->ndeferred);
    pthread_mutex_unlock(&d->capture_lock);
    return 1;
}

/* ---- the cache in front of the pool (cache.c) ---- */
/* Tags whose streams live as long as the process (torch's pooled streams):
 * their blocks are cached on any stream.  Other tags' blocks are cached on
 * the default streams only, since a user stream may be destroyed and its
 * handle reused, and stream order is what makes a cached block safe. */
static atomic_int cache_any_stream[BRIDGE_NTAGS];

static inline int default_stream(CUstream s) { return (uintptr_t)s <= 2; /* NULL, legacy, per-thread */ }

static void release_cached(int device, uintptr_t ptr, uint64_t size, CUstream stream)
{
    record rec = {.ptr = ptr, .size = size, .stream = stream, .device = device};
    release_block(&devices[device], &rec);
}

/* Every cached block of a device back to the pool. */
static void flush_cache(int device) { cache_flush(device, release_cached); }

/* An allocation served from the cache: the bytes are already on the ledger
 * (reserved and committed); only the framework's figures move. */
static int adopt_cached(device_state *d, int device, uintptr_t p, size_t size, CUstream stream,
                        int tag, void **out)
{
    tag_state *t = &d->tag[tag];
    uint64_t tlimit = atomic_load_explicit(&t->limit, RELAXED);
    uint64_t tcur = atomic_fetch_add_explicit(&t->current, size, RELAXED) + size;
    record rec = {.ptr = p, .size = size, .stream = stream, .device = device, .tag = (uint8_t)tag};
    if ((tlimit && tcur > tlimit) || records_insert(&rec) != 0) {
        atomic_fetch_sub_explicit(&t->current, size, RELAXED);
        release_block(d, &rec);
        return BRIDGE_E_TAG_LIMIT;
    }
    atomic_max(&t->peak, tcur);
    atomic_fetch_add_explicit(&t->allocated, size, RELAXED);
    atomic_fetch_add_explicit(&t->num_allocs, 1, RELAXED);
    atomic_fetch_add_explicit(&d->num_allocs, 1, RELAXED);
    atomic_fetch_add_explicit(&d->num_cache_hits, 1, RELAXED);
    *out = (void *)p;
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

int bridge_set_cache_any_stream(int tag, int on)
{
    if (tag < 0 || tag >= BRIDGE_NTAGS)
        return BRIDGE_E_INVALID;
    atomic_store(&cache_any_stream[tag], on ? 1 : 0);
    return BRIDGE_OK;
}

/* records_take's `keep` for bridge_free: a graph block stays in the table,
 * marked freed by the user, because replays may still write it; the graph's
 * release returns it.  Runs under the shard lock, so the mark and the figures
 * change in the same step that bridge_graph_release's sweep sees (taking the
 * record out and inserting it back, as before, let a sweep in between miss
 * it: the block then stayed on the ledger for good).
 * 0: an ordinary block (take it); 1: a graph block, first free; 2: again. */
static int keep_graph_block(record *r)
{
    if (!(r->flags & REC_GRAPH))
        return 0;
    if (r->flags & REC_USER_FREED)
        return 2;
    r->flags |= REC_USER_FREED;
    device_state *d = &devices[r->device];
    count_free(d, r);
    atomic_fetch_add_explicit(&d->graph_bytes, r->size, RELAXED);
    return 1;
}

void bridge_free(void *ptr)
{
    if (!ptr)
        return;
    record rec;
    /* fast path: one shard lock, the driver free, four atomic subtractions */
    int kept = records_take((uintptr_t)ptr, &rec, keep_graph_block);
    if (kept < 0 || kept == 2) {
        /* unknown pointer or double free: count it, change nothing else */
        atomic_fetch_add_explicit(&bad_frees, 1, RELAXED);
        return;
    }
    if (kept == 1)
        return; /* a graph block: counted as freed, memory kept until the release */
    device_state *d = &devices[rec.device];
    count_free(d, &rec);
    int capturing = atomic_load_explicit(&d->captures_active, RELAXED);
    if (capturing && defer_free(d, &rec))
        return;
    /* fast path: kept for the next allocation of this size on this stream */
    if (!capturing && !rec.nrec &&
        (default_stream(rec.stream) || atomic_load_explicit(&cache_any_stream[rec.tag], RELAXED)) &&
        cache_put(rec.device, rec.stream, rec.size, rec.ptr))
        return;
    release_block(d, &rec);
    flush_deferred(d);
}

/* ---- allocation ---- */
static int try_alloc(device_state *d, int device, size_t size, CUstream stream, int tag,
                     void **out)
{
    int rc = reserve(d, tag, size);
    if (rc != BRIDGE_OK)
        return rc;
    CUdeviceptr p = 0;
    int mode = capture_mode_enter(d);
    CUresult r = bridge_drv.cuMemAllocFromPoolAsync(&p, size, d->pool, stream);
    capture_mode_exit(mode);
    if (r != CUDA_SUCCESS || !p) {
        unreserve(d, tag, size);
        bridge_note_driver_error(r);
        return r == CUDA_ERROR_OUT_OF_MEMORY || r == CUDA_SUCCESS ? BRIDGE_E_OOM : BRIDGE_E_DRIVER;
    }
    atomic_fetch_add_explicit(&d->committed, size, RELAXED);
    record rec = {.ptr = (uintptr_t)p, .size = size, .stream = stream,
                  .device = device, .tag = (uint8_t)tag};
    if (records_insert(&rec) != 0) {
        /* no host memory for the record: give the block back */
        atomic_fetch_sub_explicit(&d->tag[tag].current, size, RELAXED);
        release_block(d, &rec);
        return BRIDGE_E_OOM;
    }
    tag_state *t = &d->tag[tag];
    atomic_fetch_add_explicit(&t->allocated, size, RELAXED);
    atomic_fetch_add_explicit(&t->num_allocs, 1, RELAXED);
    atomic_fetch_add_explicit(&d->num_allocs, 1, RELAXED);
    *out = (void *)p;
    return BRIDGE_OK;
}

static int retryable(int rc) { return rc == BRIDGE_E_BUDGET || rc == BRIDGE_E_OOM; }

int bridge_alloc(int device, size_t size, void *stream, int tag, void **out)
{
    *out = NULL;
    if (size == 0)
        return BRIDGE_OK; /* a null pointer is the right answer for 0 bytes */
    if (tag < 0 || tag >= BRIDGE_NTAGS)
        return BRIDGE_E_INVALID;
    device_state *d = device_of(device);
    if (!d)
        return bridge_initialized() ? BRIDGE_E_DEVICE : BRIDGE_E_NOTINIT;
    /* fastest path: a block of this size freed on this stream (one lock, one
     * pop, one shard lock; no driver call, so no context needed) */
    uintptr_t hit = cache_take(device, stream, size);
    if (hit && adopt_cached(d, device, hit, size, stream, tag, out) == BRIDGE_OK)
        return BRIDGE_OK;
    ctx_guard g;
    ctx_enter(d, &g);
    if (atomic_load_explicit(&d->num_deferred, RELAXED))
        flush_deferred(d);
    /* fast path: two atomic adds (plus one attribute read under a budget),
     * one driver call, one shard lock */
    int rc = try_alloc(d, device, size, stream, tag, out);
    if (retryable(rc)) {
        /* 1. Let the stream's pending frees land and complete deferred ones.
         *    (Not while a capture runs: a synchronize would invalidate it.) */
        flush_cache(device);
        if (!atomic_load_explicit(&d->captures_active, RELAXED))
            bridge_drv.cuStreamSynchronize(stream);
        flush_deferred(d);
        rc = try_alloc(d, device, size, stream, tag, out);
        /* 2. Ask the frameworks to release their caches, then try again. */
        bridge_pressure_fn hook = atomic_load(&pressure_hook); /* one read: see its comment */
        if (retryable(rc) && hook && hook(device, size, tag)) {
            /* The hook ran Python, which may have switched the context: make
             * the device's current again, but keep `g` as it is: it holds the
             * caller's context for ctx_exit (a second ctx_enter(d, &g) here
             * overwrote it, and the caller was left on this device's). */
            bridge_drv.cuCtxSetCurrent(d->ctx);
            flush_cache(device);
            /* the whole device this time: frees queued on other streams land */
            if (!atomic_load_explicit(&d->captures_active, RELAXED))
                bridge_drv.cuCtxSynchronize();
            rc = try_alloc(d, device, size, stream, tag, out);
        }
        if (rc == BRIDGE_OK)
            atomic_fetch_add_explicit(&d->num_retries, 1, RELAXED);
    }
    if (retryable(rc) || rc == BRIDGE_E_TAG_LIMIT) { /* refusals, not driver errors */
        atomic_fetch_add_explicit(&d->num_ooms, 1, RELAXED);
        atomic_fetch_add_explicit(&d->tag[tag].num_ooms, 1, RELAXED);
    }
    ctx_exit(&g);
    return rc;
}

static int add_stream(record *r, void *arg)
{
    CUstream s = (CUstream)arg;
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

/* ---- CUDA graph capture ---- */
int bridge_captures_active(int device)
{
    device_state *d = device_of(device);
    return d ? atomic_load(&d->captures_active) : 0;
}

int bridge_graph_begin(int device, uint64_t id0, uint64_t id1)
{
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_DEVICE;
    int rc = BRIDGE_E_INVALID;
    pthread_mutex_lock(&d->capture_lock);
    graph_pool *free_slot = NULL;
    for (int i = 0; i < MAX_GRAPHS; i++) {
        graph_pool *gp = &d->graphs[i];
        if (gp->in_use && gp->id0 == id0 && gp->id1 == id1) {
            free_slot = gp; /* a pool captured into again */
            break;
        }
        if (!gp->in_use && !free_slot)
            free_slot = gp;
    }
    if (free_slot) {
        if (!free_slot->capturing)
            atomic_fetch_add(&d->captures_active, 1);
        *free_slot = (graph_pool){.id0 = id0, .id1 = id1, .in_use = 1, .capturing = 1};
        rc = BRIDGE_OK;
    }
    pthread_mutex_unlock(&d->capture_lock);
    return rc;
}

int bridge_graph_end(int device, uint64_t id0, uint64_t id1)
{
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_DEVICE;
    int rc = BRIDGE_E_INVALID;
    pthread_mutex_lock(&d->capture_lock);
    for (int i = 0; i < MAX_GRAPHS; i++) {
        graph_pool *gp = &d->graphs[i];
        if (gp->in_use && gp->capturing && gp->id0 == id0 && gp->id1 == id1) {
            gp->capturing = 0;
            atomic_fetch_sub(&d->captures_active, 1);
            rc = BRIDGE_OK;
            break;
        }
    }
    pthread_mutex_unlock(&d->capture_lock);
    /* Deferred frees complete at the next allocation or free: the capture
     * itself ends only after this hook returns. */
    return rc;
}

typedef struct release_arg {
    device_state *d;
    uint64_t id0, id1;
} release_arg;

static int release_graph_record(record *r, void *arg)
{
    release_arg *a = arg;
    if (!(r->flags & REC_GRAPH) || r->graph0 != a->id0 || r->graph1 != a->id1 ||
        &devices[r->device] != a->d)
        return 0;
    if (!(r->flags & REC_USER_FREED)) {
        r->flags = 0; /* still in use: an ordinary block from now on */
        return 0;
    }
    atomic_fetch_sub_explicit(&a->d->graph_bytes, r->size, RELAXED);
    release_block(a->d, r);
    return 1;
}

int bridge_graph_release(int device, uint64_t id0, uint64_t id1)
{
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_DEVICE;
    int found = 0;
    pthread_mutex_lock(&d->capture_lock);
    for (int i = 0; i < MAX_GRAPHS; i++) {
        graph_pool *gp = &d->graphs[i];
        if (gp->in_use && gp->id0 == id0 && gp->id1 == id1) {
            if (gp->capturing)
                atomic_fetch_sub(&d->captures_active, 1);
            *gp = (graph_pool){0};
            found = 1;
        }
    }
    pthread_mutex_unlock(&d->capture_lock);
    if (!found)
        return BRIDGE_OK;
    /* Replays may still be running: wait for the device before the blocks
     * go back to the pool. */
    ctx_guard g;
    ctx_enter(d, &g);
    if (!atomic_load(&d->captures_active))
        bridge_drv.cuCtxSynchronize();
    release_arg a = {d, id0, id1};
    records_sweep(release_graph_record, &a);
    ctx_exit(&g);
    return BRIDGE_OK;
}

int bridge_alloc_graph(int device, size_t size, int tag, uint64_t id0, uint64_t id1, void **out)
{
    *out = NULL;
    if (size == 0)
        return BRIDGE_OK;
    if (tag < 0 || tag >= BRIDGE_NTAGS)
        return BRIDGE_E_INVALID;
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_DEVICE;
    int rc = reserve(d, tag, size);
    if (rc != BRIDGE_OK) {
        atomic_fetch_add_explicit(&d->num_ooms, 1, RELAXED);
        atomic_fetch_add_explicit(&d->tag[tag].num_ooms, 1, RELAXED);
        return rc;
    }
    ctx_guard g;
    ctx_enter(d, &g);
    /* Allocated outside the capture, on the side stream, and complete before
     * the captured work uses it: the graph holds no allocation node, so
     * every replay finds the memory at the same address. */
    int mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    bridge_drv.cuThreadExchangeStreamCaptureMode(&mode);
    CUdeviceptr p = 0;
    CUresult r = bridge_drv.cuMemAllocFromPoolAsync(&p, size, d->pool, d->side);
    if (r == CUDA_SUCCESS)
        r = bridge_drv.cuStreamSynchronize(d->side);
    bridge_drv.cuThreadExchangeStreamCaptureMode(&mode);
    ctx_exit(&g);
    if (r != CUDA_SUCCESS || !p) {
        unreserve(d, tag, size);
        bridge_note_driver_error(r);
        atomic_fetch_add_explicit(&d->num_ooms, 1, RELAXED);
        atomic_fetch_add_explicit(&d->tag[tag].num_ooms, 1, RELAXED);
        return r == CUDA_ERROR_OUT_OF_MEMORY ? BRIDGE_E_OOM : BRIDGE_E_DRIVER;
    }
    atomic_fetch_add_explicit(&d->committed, size, RELAXED);
    record rec = {.ptr = (uintptr_t)p, .size = size, .stream = d->side, .device = device,
                  .tag = (uint8_t)tag, .flags = REC_GRAPH, .graph0 = id0, .graph1 = id1};
    if (records_insert(&rec) != 0) {
        atomic_fetch_sub_explicit(&d->tag[tag].current, size, RELAXED);
        release_block(d, &rec);
        return BRIDGE_E_OOM;
    }
    atomic_fetch_add_explicit(&d->tag[tag].allocated, size, RELAXED);
    atomic_fetch_add_explicit(&d->tag[tag].num_allocs, 1, RELAXED);
    atomic_fetch_add_explicit(&d->num_allocs, 1, RELAXED);
    *out = (void *)p;
    return BRIDGE_OK;
}

/* ---- idle memory ---- */
int bridge_trim(int device, uint64_t keep)
{
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_DEVICE;
    ctx_guard g;
    ctx_enter(d, &g);
    flush_cache(device);
    flush_deferred(d);
    if (!atomic_load(&d->captures_active))
        bridge_drv.cuCtxSynchronize(); /* pending frees return to the pool */
    CUresult r = bridge_drv.cuMemPoolTrimTo(d->pool, keep);
    ctx_exit(&g);
    return r == CUDA_SUCCESS ? BRIDGE_OK : (bridge_note_driver_error(r), BRIDGE_E_DRIVER);
}

/* ---- figures ---- */
int bridge_get_stats(int device, bridge_stats *out)
{
    memset(out, 0, sizeof *out);
    device_state *d = device_of(device);
    if (!d)
        return bridge_initialized() ? BRIDGE_E_DEVICE : BRIDGE_E_NOTINIT;
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
    out->cache_limit = cache_limit(device);
    for (int i = 0; i < BRIDGE_NTAGS; i++) {
        tag_state *t = &d->tag[i];
        out->tag[i] = (bridge_tag_stats){
            atomic_load(&t->current), atomic_load(&t->peak),      atomic_load(&t->allocated),
            atomic_load(&t->freed),   atomic_load(&t->num_allocs), atomic_load(&t->num_frees),
            atomic_load(&t->num_ooms), atomic_load(&t->limit)};
    }
    CUresult r;
    if ((r = bridge_drv.cuMemPoolGetAttribute(d->pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
                                              &out->pool_used)) != CUDA_SUCCESS ||
        (r = bridge_drv.cuMemPoolGetAttribute(d->pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                                              &out->pool_reserved)) != CUDA_SUCCESS ||
        (r = bridge_drv.cuMemPoolGetAttribute(d->pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                                              &out->pool_used_high)) != CUDA_SUCCESS)
        return bridge_note_driver_error(r), BRIDGE_E_DRIVER;
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
        if (tag == -1 || tag == i)
            atomic_store(&d->tag[i].peak, atomic_load(&d->tag[i].current));
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

uint64_t bridge_live_records(void) { return records_count(); }
