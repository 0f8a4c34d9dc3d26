/* SPDX-License-Identifier: Apache-2.0 */
/* ledger.c: per-device pools, the budget ledger, and the free of a block to
 * the pool.  The allocation entry points above it are alloc.c's; the parts
 * it tells of frees and asks about growth are called through ledger_parts
 * (ledger.h), never by name.
 *
 * Accounting, per device (every figure is an atomic, lock-free to read):
 *   reserved   bytes counted against the budget: every block in a state but
 *              POOL (block.h: live, parked, cached, carved, deferred, held,
 *              graph blocks), and reservations of allocations in flight.
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
 * and issued as soon as the captures end (DEFERRED; a block's states and
 * their figures: block.h).
 */
#include "ledger.h"
#include "cache.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

static pthread_mutex_t setup_lock = PTHREAD_MUTEX_INITIALIZER;
/* The release threshold of devices set up lazily (the last one asked for). */
static _Atomic uint64_t default_threshold = UINT64_MAX;

/* The parts above the ledger (ledger.h): filled once before they are called. */
static ledger_parts told;

_Atomic int wait_count[BRIDGE_MAX_DEVICES]; /* ledger.h */

void ledger_listen(const ledger_parts *parts)
{
    if (parts->freed)
        told.freed = parts->freed;
    if (parts->reserve_growth)
        told.reserve_growth = parts->reserve_growth;
    if (parts->settle_growth)
        told.settle_growth = parts->settle_growth;
    if (parts->pool_trimmed)
        told.pool_trimmed = parts->pool_trimmed;
    if (parts->room)
        told.room = parts->room;
    if (parts->forget_after_fork)
        told.forget_after_fork = parts->forget_after_fork;
    if (parts->captures_ended)
        told.captures_ended = parts->captures_ended;
}

void ledger_captures_ended(device_state *d)
{
    ledger_flush_deferred(d);
    if (told.captures_ended)
        told.captures_ended(d);
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
    CUmemoryPool x = atomic_load(&d->ipc_pool);
    if (r == CUDA_SUCCESS && x)
        r = bridge_drv.cuMemPoolSetAttribute(x, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &t);
    return r == CUDA_SUCCESS ? BRIDGE_OK : (bridge_note_driver_error(r), BRIDGE_E_DRIVER);
}

int bridge_pool_attribute(int device, int attr, uint64_t *value)
{
    *value = 0;
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_DEVICE;
    CUresult r = pool_figure(d, attr, value);
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
        CUmemoryPool x = atomic_load(&d->ipc_pool);
        if (r == CUDA_SUCCESS && x)
            r = bridge_drv.cuMemPoolSetAccess(x, &desc, 1);
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
    int mode = capture_mode_relax();
    CUresult r = pool_figure(d, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used);
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

/* The device's part of a reservation: `reserved`, checked against the budget
 * (what others hold in the pool included) and the share's claim. */
static int reserve_device(device_state *d, uint64_t size)
{
    uint64_t r = atomic_fetch_add_explicit(&d->reserved, size, memory_order_acq_rel) + size;
    uint64_t limit = atomic_load_explicit(&d->limit, RELAXED);
    if (limit) {
        /* one driver call: what others hold in the pool counts too */
        uint64_t others = others_of(d);
        if (r > limit || others > limit - r) {
            atomic_fetch_sub_explicit(&d->reserved, size, memory_order_acq_rel);
            return BRIDGE_E_BUDGET;
        }
    }
    /* the budget of the processes sharing this GPU (share.c): one load when
     * there is none */
    share_member *sm = atomic_load_explicit(&d->share, memory_order_acquire);
    if (sm && told.reserve_growth(d, sm, size) != BRIDGE_OK) {
        atomic_fetch_sub_explicit(&d->reserved, size, memory_order_acq_rel);
        return BRIDGE_E_BUDGET;
    }
    atomic_max(&d->peak, r);
    return BRIDGE_OK;
}

static void unreserve_device(device_state *d, uint64_t size)
{
    share_member *sm = atomic_load_explicit(&d->share, memory_order_acquire);
    if (sm)
        told.settle_growth(d, sm, size, 0);
    atomic_fetch_sub_explicit(&d->reserved, size, memory_order_acq_rel);
}

/* ---- a tag's live figures: the blocks parked with their records left out ----
 * A block parked with its record (park.h) stays in its tag's `current` and
 * `count`, so that its park and its owner's take back change no shared
 * figure.  Whoever reads the figures takes the parked blocks out
 * (cache_kept); the hot path does so only when a figure passes the tag's
 * limit or its peak, both rare once a loop runs. */
static uint64_t less_kept(device_state *d, int tag, uint64_t raw, int64_t *count)
{
    uint64_t bytes;
    int64_t n;
    cache_kept((int)(d - bridge_devices), tag, &bytes, &n);
    if (count)
        *count = *count > n ? *count - n : 0;
    return raw > bytes ? raw - bytes : 0;
}

void ledger_tag_live(device_state *d, int tag, uint64_t *bytes, int64_t *count)
{
    int64_t n = atomic_load(&d->tag[tag].count);
    uint64_t b = less_kept(d, tag, atomic_load(&d->tag[tag].current), &n);
    if (bytes)
        *bytes = b;
    if (count)
        *count = n;
}

/* The tag's byte peak raised to `raw` (its `current` after this thread's
 * change) less the parked blocks: a walk only when raw passes the peak. */
static void raise_peak(device_state *d, int tag, uint64_t raw)
{
    tag_state *t = &d->tag[tag];
    if (raw > atomic_load_explicit(&t->peak, RELAXED))
        atomic_max(&t->peak, less_kept(d, tag, raw, NULL));
}

/* The same for the number of live allocations. */
static void raise_count_peak(device_state *d, int tag, int64_t raw)
{
    tag_state *t = &d->tag[tag];
    int64_t peak = atomic_load_explicit(&t->count_peak, RELAXED);
    if (raw <= peak)
        return;
    less_kept(d, tag, 0, &raw);
    while (peak < raw &&
           !atomic_compare_exchange_weak_explicit(&t->count_peak, &peak, raw, RELAXED, RELAXED))
        ;
}

/* Would `raw` bytes of the tag pass its limit?  raw, the parked blocks left
 * out, when raw alone passes it; any bytes pass BRIDGE_TAG_LIMIT_ZERO. */
static inline int over_tag_limit(device_state *d, int tag, uint64_t tlimit, uint64_t raw)
{
    return tlimit &&
           (raw > tlimit ? less_kept(d, tag, raw, NULL) > tlimit : tlimit == BRIDGE_TAG_LIMIT_ZERO);
}

uint64_t ledger_room(device_state *d)
{
    uint64_t room = UINT64_MAX;
    uint64_t limit = atomic_load_explicit(&d->limit, RELAXED);
    if (limit) {
        uint64_t r = atomic_load_explicit(&d->reserved, memory_order_acquire);
        uint64_t others = others_of(d);
        room = r >= limit || others >= limit - r ? 0 : limit - r - others;
    }
    share_member *sm = atomic_load_explicit(&d->share, memory_order_acquire);
    if (sm && told.room) {
        uint64_t s = told.room(d, sm);
        if (s < room)
            room = s;
    }
    return room;
}

/* Fast path without a budget: two atomic adds. */
int ledger_reserve(device_state *d, int tag, uint64_t size)
{
    /* No request larger than the device can succeed; refusing it here also
     * keeps the sums below from wrapping (SIZE_MAX from a C caller would
     * otherwise pass every check with a wrapped total). */
    if (size > d->total)
        return BRIDGE_E_OOM;
    return ledger_reserve_oversubscribed(d, tag, size);
}

int ledger_reserve_oversubscribed(device_state *d, int tag, uint64_t size)
{
    tag_state *t = &d->tag[tag];
    uint64_t tlimit = atomic_load_explicit(&t->limit, RELAXED);
    uint64_t tcur = atomic_fetch_add_explicit(&t->current, size, RELAXED) + size;
    if (over_tag_limit(d, tag, tlimit, tcur)) {
        atomic_fetch_sub_explicit(&t->current, size, RELAXED);
        return BRIDGE_E_TAG_LIMIT;
    }
    int rc = reserve_device(d, size);
    if (rc != BRIDGE_OK) {
        atomic_fetch_sub_explicit(&t->current, size, RELAXED);
        return rc;
    }
    /* the tag's peak is raised once the block is granted (ledger_count_granted):
     * one the driver refuses was never live (torch's max_memory_allocated) */
    return BRIDGE_OK;
}

static void ledger_unreserve(device_state *d, int tag, uint64_t size)
{
    atomic_fetch_sub_explicit(&d->tag[tag].current, size, RELAXED);
    unreserve_device(d, size);
}

/* The driver granted a reserved block: count it as committed. */
static void ledger_commit(device_state *d, uint64_t size)
{
    atomic_fetch_add_explicit(&d->committed, size, RELAXED);
    share_member *sm = atomic_load_explicit(&d->share, memory_order_acquire);
    if (sm)
        told.settle_growth(d, sm, size, 1);
}

void ledger_count_alloc(device_state *d, int tag, uint64_t size)
{
    tag_state *t = &d->tag[tag];
    counts_alloc((int)(d - bridge_devices), tag, size);
    raise_count_peak(d, tag, atomic_fetch_add_explicit(&t->count, 1, RELAXED) + 1);
}

void ledger_count_granted(device_state *d, int tag, uint64_t size)
{
    raise_peak(d, tag, atomic_load_explicit(&d->tag[tag].current, RELAXED));
    ledger_count_alloc(d, tag, size);
}

void ledger_count_reuse(device_state *d, int tag, uint64_t size)
{
    tag_state *t = &d->tag[tag];
    raise_peak(d, tag, atomic_fetch_add_explicit(&t->current, size, RELAXED) + size);
    ledger_count_alloc(d, tag, size);
}

/* A block the pool just gave: its record inserted and counted, *out set;
 * BRIDGE_E_OOM (the block given back) when there is no host memory for the
 * record.  The tag's `current` already holds the block's size (reserve). */
static int ledger_record(device_state *d, const record *rec, void **out)
{
    if (records_insert(rec) != 0) {
        atomic_fetch_sub_explicit(&d->tag[rec->tag].current, rec->size, RELAXED);
        ledger_release(d, rec);
        return BRIDGE_E_OOM;
    }
    ledger_count_granted(d, rec->tag, rec->size);
    *out = (void *)(uintptr_t)rec->ptr;
    return BRIDGE_OK;
}

int ledger_alloc(device_state *d, const record *want, CUstream stream, int side, void **out)
{
    int rc = ledger_reserve(d, want->tag, want->size);
    if (rc != BRIDGE_OK)
        return rc;
    CUdeviceptr p = 0;
    /* relaxed capture mode: a capture another thread runs in global mode
     * would refuse (and be invalidated by) a pool call of this thread */
    int mode = capture_mode_relax();
    CUresult r =
        bridge_drv.cuMemAllocFromPoolAsync(&p, want->size, alloc_pool(d), side ? d->side : stream);
    if (side && r == CUDA_SUCCESS)
        r = bridge_drv.cuStreamSynchronize(d->side);
    capture_mode_exit(mode);
    if (r != CUDA_SUCCESS || !p) {
        ledger_unreserve(d, want->tag, want->size);
        bridge_note_driver_error(r);
        return r == CUDA_ERROR_OUT_OF_MEMORY || r == CUDA_SUCCESS ? BRIDGE_E_OOM : BRIDGE_E_DRIVER;
    }
    ledger_commit(d, want->size);
    record rec = *want;
    rec.ptr = (uintptr_t)p;
    return ledger_record(d, &rec, out);
}

int ledger_alloc_chunk(device_state *d, uint64_t size, CUstream stream, uintptr_t *out)
{
    *out = 0;
    if (size > d->total)
        return BRIDGE_E_OOM;
    int rc = reserve_device(d, size);
    if (rc != BRIDGE_OK)
        return rc;
    CUdeviceptr p = 0;
    int mode = capture_mode_relax();
    CUresult r = bridge_drv.cuMemAllocFromPoolAsync(&p, size, alloc_pool(d), stream);
    capture_mode_exit(mode);
    if (r != CUDA_SUCCESS || !p) {
        unreserve_device(d, size);
        bridge_note_driver_error(r);
        return r == CUDA_ERROR_OUT_OF_MEMORY || r == CUDA_SUCCESS ? BRIDGE_E_OOM : BRIDGE_E_DRIVER;
    }
    ledger_commit(d, size);
    *out = (uintptr_t)p;
    return BRIDGE_OK;
}

int ledger_adopt(device_state *d, const record *rec, void **out)
{
    tag_state *t = &d->tag[rec->tag];
    uint64_t tlimit = atomic_load_explicit(&t->limit, RELAXED);
    uint64_t tcur = atomic_fetch_add_explicit(&t->current, rec->size, RELAXED) + rec->size;
    int rc = BRIDGE_OK;
    if (over_tag_limit(d, rec->tag, tlimit, tcur))
        rc = BRIDGE_E_TAG_LIMIT;
    else if (records_insert(rec) != 0)
        rc = BRIDGE_E_OOM; /* no host memory for the record */
    if (rc != BRIDGE_OK) {
        atomic_fetch_sub_explicit(&t->current, rec->size, RELAXED);
        if (!(rec->flags & REC_CARVED)) /* a carved block: the caller gives it back */
            ledger_release(d, rec);
        return rc;
    }
    raise_peak(d, rec->tag, tcur);
    ledger_count_alloc(d, rec->tag, rec->size);
    *out = (void *)(uintptr_t)rec->ptr;
    return BRIDGE_OK;
}

int ledger_readopt(device_state *d, const record *rec)
{
    tag_state *t = &d->tag[rec->tag];
    uint64_t tlimit = atomic_load_explicit(&t->limit, RELAXED);
    uint64_t raw = atomic_load_explicit(&t->current, RELAXED); /* the block in it */
    /* the limit as ledger_adopt's: the parked blocks out, this one back in */
    if (tlimit && (raw > tlimit ? less_kept(d, rec->tag, raw, NULL) + rec->size > tlimit
                                : tlimit == BRIDGE_TAG_LIMIT_ZERO))
        return BRIDGE_E_TAG_LIMIT;
    atomic_store_explicit(&rec->park->kept, 0, memory_order_release); /* live again */
    raise_peak(d, rec->tag, raw);
    counts_alloc_hit(rec->device, rec->tag, rec->size);
    raise_count_peak(d, rec->tag, atomic_load_explicit(&t->count, RELAXED));
    return BRIDGE_OK;
}

void ledger_unpark(const record *rec)
{
    tag_state *t = &bridge_devices[rec->device].tag[rec->tag];
    atomic_fetch_sub_explicit(&t->current, rec->size, RELAXED);
    atomic_fetch_sub_explicit(&t->count, 1, RELAXED);
}

void ledger_count_free(device_state *d, const record *rec)
{
    atomic_fetch_sub_explicit(&d->tag[rec->tag].current, rec->size, RELAXED);
    ledger_count_freed(d, rec);
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
    /* a device of this machine not set up yet keeps the cap for its setup,
     * which leaves the tags' caps as they are */
    int count = 0;
    if (device < 0 || device >= BRIDGE_MAX_DEVICES ||
        (!device_of(device) && (bridge_device_count(&count) != BRIDGE_OK || device >= count)))
        return BRIDGE_E_DEVICE;
    if (tag < 0 || tag >= BRIDGE_NTAGS)
        return BRIDGE_E_INVALID;
    atomic_store(&bridge_devices[device].tag[tag].limit, limit);
    return BRIDGE_OK;
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
     * `reserved` in its retry or is woken here (ledger.h) */
    atomic_fetch_sub_explicit(&d->reserved, rec->size, memory_order_seq_cst);
    if (atomic_load(&wait_count[rec->device]))
        told.freed(rec->device);
}

void ledger_release(device_state *d, const record *rec)
{
    if (rec->flags & REC_UNORDERED) {
        ledger_hold(d, rec); /* no stream the core can name is ordered after its users */
        return;
    }
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
    int mode = capture_mode_relax();
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
    if (rec->flags & REC_UNORDERED) {
        ledger_hold(d, rec);
        return;
    }
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

/* ---- frees only a device-wide synchronization orders (HELD, block.h) ----
 * A REC_UNORDERED block: a stream that used it is non-blocking and may be
 * destroyed by the time of the free (its handle then another stream's, or
 * a crash in the driver: never given to it), or it is a released graph
 * pool's, which a replay may still use on a stream nobody names (graph.c's
 * "release").  No stream the core can name then is ordered after that
 * stream's work: the legacy stream waits for blocking streams only.
 * torch's own allocator gives the memory of blocks it cannot reuse by
 * stream back through cudaFree, which synchronizes the device; the core
 * does the same, once for many blocks: the block is held (its bytes stay
 * in `reserved`, shown in num_deferred) until ledger_settle_held
 * synchronizes the context, which the refusal path (before an allocation
 * is refused or waits) and a trim (empty_cache) ask for.  The
 * synchronization is never made during a capture the core knows of; it
 * would invalidate one it cannot see (XLA's), which only a process with
 * such blocks risks (as torch's own cudaFree would). */
void ledger_hold(device_state *d, const record *rec)
{
    pthread_mutex_lock(&d->capture_lock);
    if (d->nheld == d->cap_held) {
        size_t ncap = d->cap_held ? d->cap_held * 2 : 64;
        record *n = realloc(d->held, ncap * sizeof *n);
        if (n) {
            d->held = n;
            d->cap_held = ncap;
        }
    }
    if (d->nheld < d->cap_held) {
        d->held[d->nheld++] = *rec;
        atomic_store(&d->num_held, d->nheld);
    } else {
        /* no host memory to remember it: on the ledger for good, never
         * freed out of order (as ledger_defer) */
        atomic_fetch_add_explicit(&d->num_driver_errors, 1, RELAXED);
        free(rec->recs);
    }
    pthread_mutex_unlock(&d->capture_lock);
}

int ledger_sync_device(device_state *d)
{
    if (!sync_enter(d))
        return 0;
    ctx_guard g;
    ctx_enter(d, &g);
    int mode = capture_mode_relax();
    CUresult r = bridge_drv.cuCtxSynchronize();
    capture_mode_exit(mode);
    ctx_exit(&g);
    sync_exit(d);
    if (r != CUDA_SUCCESS)
        bridge_note_driver_error(r);
    return r == CUDA_SUCCESS;
}

int ledger_settle_held(device_state *d)
{
    if (!atomic_load_explicit(&d->num_held, RELAXED))
        return 0;
    /* the blocks held before the synchronization: those held later may
     * have work queued after it */
    pthread_mutex_lock(&d->capture_lock);
    record *mine = d->held;
    size_t n = d->nheld;
    d->held = NULL;
    d->nheld = d->cap_held = 0;
    atomic_store(&d->num_held, 0);
    pthread_mutex_unlock(&d->capture_lock);
    size_t i = 0;
    if (ledger_sync_device(d)) {
        ctx_guard g;
        ctx_enter(d, &g);
        int mode = capture_mode_relax();
        for (; i < n; i++) {
            /* every stream's work queued before it is done: the side stream,
             * alive for good, frees it */
            CUresult r = bridge_drv.cuMemFreeAsync((CUdeviceptr)mine[i].ptr, d->side);
            if (r != CUDA_SUCCESS) { /* refused for good: the ledger forgets it (issue_free) */
                bridge_note_driver_error(r);
                atomic_fetch_add_explicit(&d->num_driver_errors, 1, RELAXED);
            }
            settle(d, &mine[i]);
        }
        if (i)
            bridge_drv.cuStreamSynchronize(d->side); /* landed: any stream may reuse them */
        capture_mode_exit(mode);
        ctx_exit(&g);
    }
    for (size_t k = i; k < n; k++) /* not synchronized (a capture runs): held again */
        ledger_hold(d, &mine[k]);
    free(mine);
    return (int)i;
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

/* ---- idle memory ---- */
int ledger_trim(device_state *d, uint64_t keep)
{
    ledger_flush_deferred(d);
    ledger_settle_held(d);
    drain_streams(d); /* pending frees return to the pool (never cuCtxSynchronize) */
    ctx_guard g;
    ctx_enter(d, &g);
    int mode = capture_mode_relax(); /* a trim in global mode invalidates another's capture */
    CUresult r = bridge_drv.cuMemPoolTrimTo(d->pool, keep);
    CUmemoryPool x = atomic_load(&d->ipc_pool);
    if (r == CUDA_SUCCESS && x)
        r = bridge_drv.cuMemPoolTrimTo(x, keep);
    ctx_exit(&g);
    share_member *sm = atomic_load(&d->share);
    if (sm)
        told.pool_trimmed(d, sm); /* the claim follows the pool down (its figures: relaxed too) */
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
    counts_forget_after_fork();
    for (int i = 0; i < BRIDGE_MAX_DEVICES; i++) {
        device_state *d = &bridge_devices[i];
        atomic_store(&d->ready, 0);
        d->capture_lock = fresh;
        atomic_store(&d->syncs, 0);           /* a parent's thread's, gone */
        atomic_store(&d->stream_captures, 0); /* the parent's pools, forgotten below */
        d->deferred = NULL;
        d->ndeferred = d->cap_deferred = 0;
        atomic_store(&d->num_deferred, 0);
        d->held = NULL; /* the parent's */
        d->nheld = d->cap_held = 0;
        atomic_store(&d->num_held, 0);
        d->graphs = NULL;              /* the parent's graph pools; never freed here */
        atomic_store(&d->share, NULL); /* the parent's membership (its mapping stays) */
    }
    told.forget_after_fork(); /* the parts above (alloc.c names them) */
}

static void register_fork_handler(void)
{
    pthread_atfork(NULL, NULL, forget_after_fork);
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
            uint64_t bytes;
            int64_t count;
            ledger_tag_live(d, i, &bytes, &count);
            atomic_store(&d->tag[i].peak, bytes);
            atomic_store(&d->tag[i].count_peak, count);
            atomic_store(&d->tag[i].reserved_peak, 0); /* the next read raises it to now */
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
    /* the sums become the bases: no thread's copy is written (counts.h) */
    uint64_t sums[BRIDGE_NTAGS][COUNT_TAG_FIGURES];
    counts_sum(device, sums, NULL, NULL, NULL);
    for (int i = 0; i < BRIDGE_NTAGS; i++) {
        if (tag != -1 && tag != i)
            continue;
        tag_state *t = &d->tag[i];
        for (int k = 0; k < COUNT_TAG_FIGURES; k++)
            atomic_store(&t->base[k], sums[i][k]);
        atomic_store(&t->num_ooms, 0);
    }
    return BRIDGE_OK;
}

uint64_t bridge_live_records(void)
{
    return records_count();
}

uint64_t bridge_parked_records(void)
{
    return records_parked();
}
