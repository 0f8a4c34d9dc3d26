/* SPDX-License-Identifier: Apache-2.0 */
/* alloc.c: the allocation entry points, the top of the core.
 *
 * bridge_alloc and bridge_free and their cached variants, the cache in front
 * of the pool, the recovery chain of a refused allocation and its wait, and
 * the calls that touch every part (bridge_trim, bridge_get_stats, a fork
 * child's forgetting).  Every call goes down: to the graph pools (graph.c),
 * the wait (wait.c), the history (views.c), the cache (cache.c), the ledger
 * (ledger.c), streams and devices; none of them calls back in here.  The
 * ledger's own accounting and its free path are in ledger.c's banner.
 */
#include "ledger.h"
#include "cache.h"
#include "graph.h"
#include "views.h"
#include "wait.h"

#include <stdlib.h>
#include <string.h>

/* Set from Python while other threads allocate without the GIL: atomic, and
 * read once per use (a second read could see NULL after the first saw a hook). */
static _Atomic(bridge_pressure_fn) pressure_hook;
static _Atomic uint64_t bad_frees; /* unknown pointers and double frees, every device */
/* Bit t set: blocks of tag t are never cached (bridge_set_tag_cached). */
static _Atomic unsigned uncached_tags;

void bridge_set_pressure_hook(bridge_pressure_fn fn)
{
    atomic_store(&pressure_hook, fn);
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
    if (atomic_load_explicit(&d->captures_active, RELAXED) && stream_capturing(d, free_key(&rec))) {
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
    ledger_count_freed(d, r);
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
        int mode = capture_mode_relax();
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
    return ledger_record(d, &rec, out);
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
    uint64_t bound_pool;
    if (atomic_load_explicit(&d->stream_captures, RELAXED) &&
        graph_pool_of_stream(d, key, &bound_pool))
        return graph_alloc(device, size, tag, BRIDGE_STREAM_POOL, bound_pool, stream, out);
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
        atomic_load_explicit(&d->stream_captures, RELAXED))
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
    return ledger_trim(d, keep);
}

/* ---- fork ---- */
/* What the parts above the ledger forget in a fork child, after the ledger
 * forgot the devices (ledger.c's handler calls it: no lock is taken). */
static void forget_after_fork(void)
{
    cache_forget_after_fork();
    graph_forget_after_fork();
    records_forget_after_fork();
    history_forget_after_fork();
    wait_forget_after_fork();
}

/* The ledger's table of the parts above it, filled when the library is
 * loaded, before any allocation (share.c fills its entries at its join). */
__attribute__((constructor)) static void tell_the_ledger(void)
{
    const ledger_parts parts = {.freed = wait_freed, .forget_after_fork = forget_after_fork};
    ledger_listen(&parts);
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
