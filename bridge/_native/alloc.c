/* SPDX-License-Identifier: Apache-2.0 */
/* alloc.c: the allocation entry points, the top of the core.
 *
 * bridge_alloc and bridge_free and their cached variants, the cache in front
 * of the pool, the recovery chain of a refused allocation and its wait, and
 * the calls that touch every part (bridge_trim, bridge_get_stats, a fork
 * child's forgetting).  Every call goes down: to the graph pools (graph.c),
 * the wait (wait.c), the history (views.c), the cache (cache.c), the ledger
 * (ledger.c), streams and devices; none of them calls back in here.  The
 * ledger's own accounting and its free path are in ledger.c's banner; a
 * block's states and the functions here that move it between them, in
 * block.h's.
 */
#include "ledger.h"
#include "cache.h"
#include "carve.h"
#include "graph.h"
#include "ipc.h"
#include "views.h"
#include "wait.h"
#include "tls.h"

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

/* The carved free in progress on this thread of a block whose framework keeps
 * the block's stream alive until its free returns (stream_tag_holds: CuPy's,
 * RMM's): its stream key and tag (carved_return's `held`); key NULL: none. */
static _Thread_local struct {
    CUstream key;
    int tag;
} held_free;

/* release_cached for the segments that free empties: one of the freed block's
 * stream (a forgotten stream's, say) goes back on that stream, after its
 * work, as the block itself would (free_key, with the block's tag), not on
 * the legacy stream, which a non-blocking stream's work does not precede. */
static void release_cached_held(int device, uintptr_t ptr, uint64_t size, CUstream key)
{
    record rec = {.ptr = ptr, .size = size, .stream = key, .device = device};
    if (key == held_free.key)
        rec.tag = (uint8_t)held_free.tag;
    ledger_release(&bridge_devices[device], &rec);
}

/* The device's committed bytes less a block being freed (still committed):
 * cache_put's `held`, of which the cache's cap takes live = held - cached. */
static inline uint64_t cache_held(device_state *d, uint64_t freeing)
{
    uint64_t committed = atomic_load_explicit(&d->committed, RELAXED);
    return committed > freeing ? committed - freeing : 0;
}

/* ---- a block parked with its record (park.h) ----
 * A block that its thread allocated last and frees into that thread's empty
 * slot keeps its record in the table (absent to every reader while parked),
 * and that thread's next allocation of its key takes it back live without an
 * insert: a block cycling through one thread's allocation and free takes no
 * shard lock.  The free knows the record without the table from the thread's
 * memo, a copy of the record of its last allocation, valid while the memo
 * word of its slot still names the block (records.c clears it at any change
 * of the record).  The states (PARKED, PARKED_CARVED, MEMO) and who moves a
 * block in and out of them: block.h. */
/* The memo lives on the heap (tls.h), made at the thread's first one (NULL
 * before), freed at its exit; memo_key's value. */
static _Thread_local record *my_memo BRIDGE_TLS_ONE_LOAD;
static pthread_key_t memo_key;
static pthread_once_t memo_once = PTHREAD_ONCE_INIT;
static int memo_key_ok;

/* A later destructor's allocation makes a memo anew and sets the key again
 * (this runs once more); its frees find none and ask the table. */
static void memo_thread_ended(void *memo)
{
    my_memo = NULL;
    free(memo);
}

static void make_memo_key(void)
{
    memo_key_ok = pthread_key_create(&memo_key, memo_thread_ended) == 0;
}

/* The thread's memo; NULL without host memory or a thread key (its frees
 * then take the table's way). */
static record *memo_attach(void)
{
    pthread_once(&memo_once, make_memo_key);
    record *m = memo_key_ok ? calloc(1, sizeof *m) : NULL;
    if (m && pthread_setspecific(memo_key, m) != 0) {
        free(m);
        m = NULL;
    }
    return my_memo = m;
}

/* The thread's copy of the record of its allocation just made (the table's
 * record, as inserted or taken back live). */
static inline void memo_set(const record *r)
{
    record *m;
    /* a plain block or a carved one (parked as cache_park_carved says) */
    if (r->park && !(r->flags & ~REC_CARVED) && ((m = my_memo) || (m = memo_attach()))) {
        *m = *r;
        atomic_store_explicit(&r->park->memo, r->ptr, memory_order_release);
    }
}

/* The free of ptr by the thread that allocated it last: its record from the
 * memo, the memo word consumed (1), or 0 (the table has to be asked).  A load
 * and a store, no locked instruction: whatever changed the record before this
 * free (record_stream, a free by pointer from another thread: each ordered
 * before it by the program, as the tensor's own references order them)
 * cleared the word first, under the record's shard lock.  Only a change made
 * at the same time as the free, a use of memory being freed, could go
 * unseen, as it would by the table. */
static inline const record *memo_peek(void *ptr)
{
    uintptr_t p = (uintptr_t)ptr;
    const record *memo = my_memo;
    if (!memo || memo->ptr != p || !memo->park ||
        atomic_load_explicit(&memo->park->memo, memory_order_acquire) != p)
        return NULL;
    return memo;
}

static inline int memo_claim(void *ptr, record *out)
{
    const record *memo = memo_peek(ptr);
    if (!memo)
        return 0;
    atomic_store_explicit(&memo->park->memo, 0, RELAXED);
    *out = *memo;
    return 1;
}

/* A parked block leaves its slot for anything but its owner's allocation:
 * its record out of the table (cache.c calls it, with no cache lock held). */
static void detach_parked(int device, uintptr_t ptr)
{
    (void)device;
    record rec;
    if (records_take_parked(ptr, &rec, ledger_unpark) == 0)
        free(rec.recs); /* NULL: a parked block has no recorded stream */
}

/* Blocks cache_put evicted back to the pool; more while a full batch came. */
static void release_evicted(int device, uint64_t held, cache_block *evicted, int n)
{
    for (;;) {
        for (int k = 0; k < n; k++) {
            if (evicted[k].kept)
                detach_parked(device, evicted[k].ptr);
            release_cached(device, evicted[k].ptr, evicted[k].size, evicted[k].stream);
        }
        if (n < BRIDGE_CACHE_EVICT_MAX)
            return;
        n = cache_trim(device, held, evicted);
    }
}

/* Each tag's reserved_peak raised to its `current` + graph_bytes + cached
 * now (torch's reserved_bytes; bridge.h): at every read of the figures and
 * before the cache is flushed, so that a flush lowers the figure, never its
 * peak, as torch's own empty_cache leaves max_memory_reserved.  Not on the
 * hot path: a peak between two of these points is seen as far as `peak`
 * (the live bytes') shows it. */
static void raise_reserved_peaks(device_state *d, int device)
{
    uint64_t held = atomic_load(&d->graph_bytes) + cache_bytes(device);
    for (int i = 0; i < BRIDGE_NTAGS; i++) {
        uint64_t live;
        ledger_tag_live(d, i, &live, NULL);
        atomic_max(&d->tag[i].reserved_peak, live + held);
    }
}

/* Every cached block of a device back to the pool (in stream order; blocks
 * of a stream being captured wait for its end). */
static uint64_t flush_cache(int device)
{
    if (device_of(device))
        raise_reserved_peaks(&bridge_devices[device], device);
    uint64_t bytes = cache_flush(device, release_cached);
    return bytes + carve_flush(device, release_cached);
}

int bridge_forget_stream(void *stream)
{
    /* its cached blocks first, freed on it while it is still registered (it
     * lives until this returns), then it is forgotten; a block cached on it
     * meanwhile is freed on the legacy stream later, never on its handle.
     * Likewise its segments: a segment another thread carved on it between
     * the two passes is orphaned by the second, so that a new stream given
     * the same handle never carves from it. */
    for (int i = 0; i < BRIDGE_MAX_DEVICES; i++)
        if (device_of(i)) {
            cache_flush_stream(i, (CUstream)stream, release_cached);
            carve_forget_stream(i, (CUstream)stream, release_cached);
        }
    int rc = stream_forget((CUstream)stream);
    for (int i = 0; i < BRIDGE_MAX_DEVICES; i++)
        if (device_of(i)) {
            cache_flush_stream(i, (CUstream)stream, release_cached);
            carve_forget_stream(i, (CUstream)stream, release_cached);
        }
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

int bridge_set_cache_carve(int device, double share, uint64_t min, uint64_t max, uint64_t keep,
                           uint64_t small_keep)
{
    if (!device_of(device))
        return BRIDGE_E_DEVICE;
    if (!(share >= 0.0 && share <= 65536.0) || (max && (!min || min > max)))
        return BRIDGE_E_INVALID;
    carve_set(device, (uint64_t)(share * 65536.0 + 0.5), min, max, keep, small_keep);
    carve_set_slack(device, 0); /* the chunks past keep go back as they empty */
    if (!max) {
        cache_release_carved(device);        /* the parked carved blocks to their chunks */
        carve_flush(device, release_cached); /* off: no empty chunk is kept */
    }
    return BRIDGE_OK;
}

int bridge_set_cache_segments(int device, int on)
{
    if (!device_of(device))
        return BRIDGE_E_DEVICE;
    if (on) {
        carve_set(device, BRIDGE_SEGMENTS_SHARE_Q16, BRIDGE_SEGMENTS_MIN, BRIDGE_SEGMENTS_MAX,
                  UINT64_MAX, UINT64_MAX);
        carve_set_slack(device, BRIDGE_SEGMENTS_SLACK_PM);
    } else {
        carve_set(device, 0, 0, 0, 0, 0);
        carve_set_slack(device, 0);
        cache_release_carved(device);
        carve_flush(device, release_cached);
    }
    return BRIDGE_OK;
}

int bridge_set_cache_segments_keep(int device, uint64_t keep)
{
    if (!device_of(device))
        return BRIDGE_E_DEVICE;
    carve_set_keep(device, keep, keep, release_cached);
    return BRIDGE_OK;
}

int bridge_set_cache_large_fraction(int device, double fraction)
{
    if (!device_of(device))
        return BRIDGE_E_DEVICE;
    if (!(fraction >= 0.0 && fraction <= 65536.0))
        return BRIDGE_E_INVALID;
    cache_set_large_fraction(device, (uint64_t)(fraction * 65536.0 + 0.5));
    return BRIDGE_OK;
}

int bridge_set_cache_thread_slots(int device, int on)
{
    if (!device_of(device))
        return BRIDGE_E_DEVICE;
    cache_set_thread_slots(device, on);
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
    return !rec->nrec && !(rec->flags & REC_UNORDERED) &&
           !(atomic_load_explicit(&uncached_tags, RELAXED) & (1u << rec->tag)) &&
           stream_long_lived(rec->stream);
}

/* ---- carved blocks (carve.c) ---- */
/* Carved frees that must wait (HELD_BACK, block.h): a capture of the
 * block's stream runs, or a stream recorded against it could not be ordered
 * before its chunk's.  Each returns to its chunk once no capture runs on the
 * device (the next carved free or carved allocation there retries them).
 * Under pending_lock, a leaf. */
static pthread_mutex_t pending_lock = PTHREAD_MUTEX_INITIALIZER;
static record *pending;
static size_t npending, cappending;
static _Atomic size_t pending_count;

static void hold_back(const record *rec)
{
    pthread_mutex_lock(&pending_lock);
    if (npending == cappending) {
        size_t want = cappending ? 2 * cappending : 16;
        record *p = realloc(pending, want * sizeof *p);
        if (p) {
            pending = p;
            cappending = want;
        }
    }
    if (npending < cappending) {
        pending[npending++] = *rec;
        atomic_store(&pending_count, npending);
    } else {
        /* no host memory to hold it: the range stays carved (lost to reuse
         * until the process ends, never handed out twice) */
        atomic_fetch_add_explicit(&bridge_devices[rec->device].num_order_fallbacks, 1, RELAXED);
        free(rec->recs);
    }
    pthread_mutex_unlock(&pending_lock);
}

static int carved_return(device_state *d, const record *rec, int held);

/* The held-back frees of devices with no capture now, once more. */
static void retry_held_back(void)
{
    pthread_mutex_lock(&pending_lock);
    record *mine = pending;
    size_t n = npending;
    pending = NULL;
    npending = cappending = 0;
    atomic_store(&pending_count, 0);
    pthread_mutex_unlock(&pending_lock);
    for (size_t i = 0; i < n; i++)
        if (carved_return(&bridge_devices[mine[i].device], &mine[i], 0))
            hold_back(&mine[i]);
    free(mine);
}

/* ledger_parts' captures_ended: the carved frees held back while a capture
 * ran (their blocks in no tag, not cached) return to their segments now
 * where no capture runs on their device. */
static void captures_ended(device_state *d)
{
    (void)d;
    if (atomic_load_explicit(&pending_count, RELAXED))
        retry_held_back();
}

/* A carved block back to its chunk, in stream order: 0 when given back, 1
 * when it must wait (a capture of its stream, or of a stream recorded against
 * it; a recorded stream that could not be ordered).  `held`: the caller's
 * framework keeps the block's stream alive until this returns (its free).
 * The chunk, emptied, is kept unless threads wait for memory or the cache is
 * off (jax=True: what the frameworks free goes back to the pool at once). */
static int carved_return(device_state *d, const record *rec, int held)
{
    if (atomic_load_explicit(&d->captures_active, RELAXED) && stream_capturing(d, rec->stream))
        return 1;
    if (rec->flags & REC_UNORDERED) {
        /* a non-blocking stream the core cannot name used it (ledger_hold):
         * only a device-wide synchronization puts the range after its work */
        if (!ledger_sync_device(d))
            return 1;
    } else if (rec->nrec) {
        /* the chunk's stream waits for the recorded streams' work: what is
         * carved from the range next runs after it */
        ctx_guard g;
        ctx_enter(d, &g);
        int mode = capture_mode_relax();
        int o = stream_order_after_recorded(rec, stream_handle(rec->stream));
        capture_mode_exit(mode);
        ctx_exit(&g);
        if (o != 0)
            return 1;
    }
    free(rec->recs);
    if (held) {
        held_free.key = rec->stream;
        held_free.tag = rec->tag;
    }
    carve_give(rec->device, rec->ptr, rec->size,
               atomic_load(&wait_count[rec->device]) > 0 || !cache_limit(rec->device),
               held ? release_cached_held : release_cached);
    if (held)
        held_free.key = NULL;
    return 0;
}

/* bridge_free's end for a carved block (the tag's figures already counted);
 * `held` as carved_return's. */
static void carved_free(device_state *d, const record *rec, int held)
{
    if (carved_return(d, rec, held))
        hold_back(rec);
    else if (atomic_load_explicit(&pending_count, RELAXED) &&
             !atomic_load_explicit(&d->captures_active, RELAXED))
        retry_held_back();
}

/* A carved block parked in a thread slot (cache_park_carved) that leaves it
 * other than to its owner's allocation (cache.c calls it, no cache lock
 * held): its record out of the table (the tag's figures with it), then back
 * to its segment in stream order, as a carved free returns it. */
static void carved_leaves_slot(int device, const cache_block *b)
{
    record rec;
    if (!b->kept || records_take_parked(b->ptr, &rec, ledger_unpark) != 0)
        /* no record to take (never so: a carved block parks with it): the
         * range back all the same, never lost nor handed out twice */
        rec = (record){.ptr = b->ptr,
                       .size = b->size,
                       .stream = b->stream,
                       .device = device,
                       .flags = REC_CARVED};
    carved_free(&bridge_devices[device], &rec, 0);
}

void bridge_free(void *ptr)
{
    if (!ptr || bridge_forked())
        return; /* a fork child owns none of the parent's blocks */
    if (ipc_held(ptr))
        return; /* another process holds it: freed when it lets go (ipc.c) */
    record rec;
    int kept = 0;
    device_state *d;
    /* fastest: the block this thread allocated last, parked in its slot with
     * its record (a plain block that goes to the cache now, or a carved one of
     * segments: no capture, no deferred frees, cacheable); else the table */
    int parkable = memo_claim(ptr, &rec);
    if (parkable) {
        d = &bridge_devices[rec.device];
        parkable = !(rec.flags & ~REC_CARVED) &&
                   !atomic_load_explicit(&d->captures_active, RELAXED) &&
                   !atomic_load_explicit(&d->num_deferred, RELAXED) && cacheable(&rec);
    }
    /* fast path: one shard lock, one cache lock, a few atomics */
    if (!parkable)
        kept = records_take((uintptr_t)ptr, &rec, keep_graph_block);
    if (kept < 0 || kept == 2) {
        /* unknown pointer or double free: count it, change nothing else */
        atomic_fetch_add_explicit(&bad_frees, 1, RELAXED);
        return;
    }
    history_maybe(BRIDGE_EV_FREE, rec.device, rec.ptr, rec.size, rec.stream, rec.tag);
    d = &bridge_devices[rec.device];
    if (parkable) {
        /* parked: still in the tag's figures (park.h); only the free's count.
         * A carved block stays carved, the slot's carved block (if any) back
         * to its segment first. */
        if ((rec.flags & REC_CARVED)
                ? cache_park_carved(rec.device, rec.stream, rec.size, rec.ptr, rec.tag, rec.park, 1)
                : cache_park(rec.device, rec.stream, rec.size, rec.ptr, rec.tag,
                             cache_held(d, rec.size), rec.park)) {
            ledger_count_parked(&rec);
            return;
        }
        /* no room in the slot: the record out, and the block cached as usual */
        record taken;
        if (records_take(rec.ptr, &taken, NULL) != 0) {
            atomic_fetch_add_explicit(&bad_frees, 1, RELAXED); /* freed twice at once */
            return;
        }
        ledger_count_free(d, &rec);
        if (rec.flags & REC_CARVED) {
            carved_free(d, &rec, stream_tag_holds(rec.tag));
            return;
        }
        goto cache_it;
    }
    if (kept == 1) {
        graph_block_freed(d, &rec); /* memory kept for the graph's pool */
        return;
    }
    ledger_count_free(d, &rec);
    if (rec.flags & REC_CARVED) {
        carved_free(d, &rec, stream_tag_holds(rec.tag));
        return;
    }
    /* During a capture, a block of a captured stream (one the captured work
     * may still use) is held back until it ends; others go on as usual, so
     * memory other threads free meanwhile is usable at once.  A capture that
     * ended without its end hook (torch 2.11 after an invalidated capture)
     * is noticed first (graph.h). */
    if (atomic_load_explicit(&d->captures_active, RELAXED))
        graph_reap_ended(d, 0);
    if (atomic_load_explicit(&d->captures_active, RELAXED) && stream_capturing(d, free_key(&rec))) {
        ledger_defer(d, &rec);
        return;
    }
    /* kept for the next allocation of this size on this stream; the oldest
     * cached blocks beyond the cap go back to the pool (after the cache's
     * lock is dropped) */
    if (cacheable(&rec)) {
    cache_it:;
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
    if ((r->flags & (REC_GRAPH | REC_CARVED)) || !cacheable(r) ||
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
    if (bridge_forked() || atomic_load_explicit(&bridge_history_on, RELAXED) || ipc_held(ptr))
        return BRIDGE_E_MISS; /* (held by another process: bridge_free takes the free over) */
    record rec;
    /* the block this thread allocated last: parked in its slot with its
     * record, cache_or_keep's rule without the table (the block stays in
     * the tag's figures while parked, park.h).  A carved one parks only into
     * an empty slot (a carved block there goes back to its segment through
     * a detach: bridge_free's work, the memo left for it) */
    const record *memo = memo_peek(ptr);
    if (memo && memo->flags == REC_CARVED) {
        device_state *d = &bridge_devices[memo->device];
        if (!cacheable(memo) || atomic_load_explicit(&d->captures_active, RELAXED) ||
            atomic_load_explicit(&d->num_deferred, RELAXED) ||
            !cache_park_carved(memo->device, memo->stream, memo->size, memo->ptr, memo->tag,
                               memo->park, 0))
            return BRIDGE_E_MISS;
        atomic_store_explicit(&memo->park->memo, 0, RELAXED);
        ledger_count_parked(memo);
        return BRIDGE_OK;
    }
    if (memo_claim(ptr, &rec)) {
        device_state *d = &bridge_devices[rec.device];
        if (!rec.flags && cacheable(&rec) && !atomic_load_explicit(&d->captures_active, RELAXED) &&
            !atomic_load_explicit(&d->num_deferred, RELAXED) &&
            cache_park(rec.device, rec.stream, rec.size, rec.ptr, rec.tag, cache_held(d, rec.size),
                       rec.park)) {
            ledger_count_parked(&rec);
            return BRIDGE_OK;
        }
    }
    /* unknown pointers and double frees miss too: bridge_free counts them */
    return records_take((uintptr_t)ptr, &rec, cache_or_keep) == 0 ? BRIDGE_OK : BRIDGE_E_MISS;
}

/* ---- allocation ---- */
/* One allocation on its way down: the record it will have (ptr aside) and
 * how its block is taken. */
typedef struct request {
    device_state *d;
    record want;     /* size, tag, device, stream key, owner; graph flags and ids */
    CUstream stream; /* the framework's handle, for the driver */
    int side;        /* allocate on the side stream, complete: a capture runs on it */
} request;

static inline request request_of(device_state *d, int device, size_t size, void *stream, int tag)
{
    return (request){.d = d,
                     .want = {.size = size,
                              .stream = stream_key((CUstream)stream),
                              .device = device,
                              .tag = (uint8_t)tag,
                              .owner = thread_self(),
                              .park = cache_park_words(device)},
                     .stream = (CUstream)stream};
}

/* A graph pool's request (torch's graph pools and MemPools, a CuPy capture):
 * always on the side stream; refused, it neither runs the frameworks' relief
 * nor waits. */
static inline void request_graph(request *q, uint64_t id0, uint64_t id1)
{
    q->want.flags = REC_GRAPH;
    q->want.graph0 = id0;
    q->want.graph1 = id1;
    q->side = 1;
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

/* What others freed and the core still holds goes back to the pool: dead
 * CuPy graphs' pools, the cache, deferred frees. */
static void give_back_held(device_state *d, int device)
{
    graph_collect_dead();
    graph_reap_ended(d, 1);
    flush_cache(device);
    ledger_flush_deferred(d);
    ledger_settle_held(d);
}

/* ---- the refusal path: relief and waiting (wait.c) ---- */
static int alloc_again(request *q, void **out);

typedef struct retry_args {
    request *q;
    int rc; /* the last refusal */
} retry_args;

/* One more try of a refused allocation (wait.h's flags): the frameworks'
 * relief first when asked, what the core holds back to the pool, the
 * allocating stream's frees landed, and the allocation again. */
static int retry_alloc(void *ctx, int flags, void **out)
{
    retry_args *a = ctx;
    request *q = a->q;
    device_state *d = q->d;
    ctx_guard g;
    bridge_pressure_fn hook = atomic_load(&pressure_hook); /* one read: see its comment */
    if (flags & WAIT_RETRY_RELIEVE) {
        /* the frameworks release their caches (and collect their garbage,
         * unless this thread will wait: its wait collects, once); no
         * device-wide synchronization: another library's capture (XLA's)
         * may be running, and the pool reuses memory freed on other streams
         * by itself.  Nothing released: the refusal stands. */
        int stage = flags & WAIT_RETRY_COLLECT ? BRIDGE_RELIEVE_ALL : BRIDGE_RELIEVE_CACHES;
        ctx_enter(d, &g);
        int relieved = hook && hook(q->want.device, q->want.size, q->want.tag, stage);
        ctx_exit(&g);
        if (!relieved)
            return a->rc;
    } else if ((flags & WAIT_RETRY_COLLECT) && hook) {
        hook(q->want.device, q->want.size, q->want.tag, BRIDGE_RELIEVE_COLLECT);
    }
    give_back_held(d, q->want.device);
    ctx_enter(d, &g); /* after the hook: it may have run Python that switched the context */
    if (flags & (WAIT_RETRY_FREED | WAIT_RETRY_RELIEVE))
        sync_stream(d, q->stream, q->want.stream); /* its frees reach the pool */
    int rc = alloc_again(q, out);
    ctx_exit(&g);
    if (rc == BRIDGE_OK && (flags & WAIT_RETRY_RELIEVE))
        atomic_fetch_add_explicit(&d->num_retries, 1, RELAXED);
    a->rc = rc;
    return rc;
}

/* This thread's own block taken back live with the record it kept while
 * parked (the memo, park.h): BRIDGE_E_TAG_LIMIT, changing nothing, when the
 * tag's cap refuses it. */
static inline int readopt_memo(device_state *d, const record *memo, void **out)
{
    if (ledger_readopt(d, memo) != BRIDGE_OK)
        return BRIDGE_E_TAG_LIMIT;
    atomic_store_explicit(&memo->park->memo, memo->ptr, memory_order_release);
    *out = (void *)memo->ptr; /* counted a cache hit by ledger_readopt */
    return BRIDGE_OK;
}

/* A block the cache handed to the request (q->want.ptr; kept: parked with
 * its record), adopted for the request's tag.  BRIDGE_E_MISS when adopting
 * it failed (the tag's cap, no host memory for the record): the block went
 * back to the pool. */
static int adopt_cached(request *q, int kept, void **out)
{
    if (kept) {
        /* this thread's own block, parked with its record: back live as it
         * is when the record is the one this request would make */
        const record *w = &q->want, *memo = my_memo;
        if (memo && memo->ptr == w->ptr && memo->park == w->park && !w->flags &&
            memo->tag == w->tag && memo->owner == w->owner &&
            readopt_memo(q->d, memo, out) == BRIDGE_OK)
            return BRIDGE_OK;
        detach_parked(w->device, w->ptr);
    }
    if (ledger_adopt(q->d, &q->want, out) != BRIDGE_OK)
        return BRIDGE_E_MISS;
    memo_set(&q->want);
    counts_cache_hit(q->want.device);
    return BRIDGE_OK;
}

/* The cache's fast path: a block of this size freed on this stream (one
 * lock, one pop, one shard lock; no driver call, so no context needed),
 * adopted for the request's tag; BRIDGE_E_MISS when none is cached or
 * adopting it failed. */
static int take_cached(request *q, void **out)
{
    int kept;
    q->want.ptr = cache_take(q->want.device, q->want.stream, q->want.size, &kept);
    return q->want.ptr ? adopt_cached(q, kept, out) : BRIDGE_E_MISS;
}

/* take_cached for a plain request (no graph pool) of bridge_alloc and
 * bridge_alloc_cached, *q made here.  First the block this thread freed
 * last, when it waits in its slot with its record under this request's key
 * and tag: back live without a request made (the memo is the record the
 * request would make, save the pointer).  Any other case is take_cached's,
 * in its order. */
static int take_cached_plain(device_state *d, int device, size_t size, void *stream, int tag,
                             request *q, void **out)
{
    CUstream key = stream_key((CUstream)stream);
    const record *memo = my_memo;
    uintptr_t p = 0;
    int kept = 0;
    if (memo && memo->size == size && memo->stream == key && memo->tag == tag &&
        !(memo->flags & ~REC_CARVED) && memo->owner == thread_self()) {
        /* a carved block: not while a capture runs on the device (carvable's
         * rule: a capture's allocations take graph.c's path) */
        int carved = memo->flags != 0;
        if (!carved || (!atomic_load_explicit(&d->captures_active, RELAXED) &&
                        !atomic_load_explicit(&d->stream_captures, RELAXED)))
            p = cache_take_back(device, memo->park, memo->ptr, key, size, carved, &kept);
        if (p && kept && readopt_memo(d, memo, out) == BRIDGE_OK)
            return BRIDGE_OK;
        if (p && carved) { /* the tag's cap refused it: back to its segment */
            cache_block b = {p, size, key, kept, 1};
            carved_leaves_slot(device, &b);
            p = 0;
        }
    }
    /* a carved block parked by this thread's last free and not taken back by
     * this allocation: back to its segment before anything is carved (a
     * parked block lives until its owner's next allocation, no longer) */
    if (!p)
        cache_release_mine_carved(device);
    *q = request_of(d, device, size, stream, tag);
    if (!p)
        return take_cached(q, out);
    q->want.ptr = p;
    return adopt_cached(q, kept, out);
}

/* May the request be carved (carve.c): carving on, the cache on (jax=True
 * turns it off), the tag cached, a stream that outlives its blocks, and no
 * capture on the device (a capture's allocations take graph.c's path).  Not
 * a request larger than the device: the pool path refuses it (ledger_reserve),
 * where carve.c's rounding up to 512 B and 2 MiB would wrap near SIZE_MAX
 * to a few bytes. */
static inline int carvable(const request *q)
{
    int dev = q->want.device;
    return carve_on(dev) && !(q->want.flags & REC_GRAPH) && q->want.size <= q->d->total &&
           cache_limit(dev) &&
           !(atomic_load_explicit(&uncached_tags, RELAXED) & (1u << q->want.tag)) &&
           !atomic_load_explicit(&q->d->captures_active, RELAXED) &&
           !atomic_load_explicit(&q->d->stream_captures, RELAXED) &&
           stream_long_lived(q->want.stream);
}

/* A carved block handed to the request's tag; refused (the tag's cap, no
 * host memory for the record): given back to its chunk. */
static int adopt_carved(request *q, uintptr_t p, void **out)
{
    record want = q->want;
    want.ptr = p;
    want.flags |= REC_CARVED;
    if (!want.park && carve_slack(want.device)) /* the slot where its free parks it */
        want.park = cache_park_words_made(want.device);
    int rc = ledger_adopt(q->d, &want, out);
    if (rc != BRIDGE_OK)
        carve_give(want.device, p, want.size, 0, release_cached);
    else if (carve_slack(want.device))
        memo_set(&want); /* segments: its free may park it (BRIDGE_CACHE_CARVE's blocks never) */
    return rc;
}

/* Carving's fast path: a free range of the stream's chunks (no driver call). */
static int take_carved(request *q, void **out)
{
    uintptr_t p = carve_take(q->want.device, q->want.stream, q->want.size);
    if (!p || adopt_carved(q, p, out) != BRIDGE_OK)
        return BRIDGE_E_MISS;
    counts_cache_hit(q->want.device);
    return BRIDGE_OK;
}

/* A refused request once more, after what the core held went back: a range of
 * its stream's segments first (the flush returned the parked carved blocks to
 * them, and a segment still in use keeps the ranges freed in it, which no
 * pool call reaches), then the pool. */
static int alloc_again(request *q, void **out)
{
    if (!q->side && carvable(q) && take_carved(q, out) == BRIDGE_OK)
        return BRIDGE_OK;
    return ledger_alloc(q->d, &q->want, q->stream, q->side, out);
}

/* A new chunk for the request, sized by the bytes live now, and the block
 * carved from it (a driver call: the device's context is current).  A
 * request past its tag's cap takes no chunk.  With segments (the release
 * rule on) under a budget or a share: a chunk's idle bytes go back only once
 * every block carved from it is freed, so a chunk larger than the request is
 * taken only while it is at most half the room they leave (ledger_room),
 * else the request's own (carve_chunk_least); before a chunk that does not
 * fit the room, every idle byte of the cache goes back and the allocating
 * stream is synchronized, so that the frees land (a share then trims this
 * pool before it asks the other members); a larger chunk refused is tried
 * again at the request's own size, after the same.  Refused: BRIDGE_E_MISS,
 * and the request goes to the pool as it would without carving (with the
 * recovery chain). */
static int carve_new_chunk(request *q, void **out)
{
    device_state *d = q->d;
    int dev = q->want.device;
    uint64_t size = q->want.size, live = 0, tag_live = 0;
    for (int t = 0; t < BRIDGE_NTAGS; t++) {
        uint64_t bytes;
        ledger_tag_live(d, t, &bytes, NULL);
        live += bytes;
        if (t == q->want.tag)
            tag_live = bytes;
    }
    uint64_t tlimit = atomic_load_explicit(&d->tag[q->want.tag].limit, RELAXED);
    if (tlimit && (size > tlimit || tag_live > tlimit - size))
        return BRIDGE_E_MISS; /* the pool path refuses it with the cap's error */
    uint64_t bytes = carve_chunk_bytes(dev, size, live);
    uint64_t least = carve_chunk_least(size);
    uint64_t room = carve_slack(dev) ? ledger_room(d) : UINT64_MAX; /* segments only */
    if (room != UINT64_MAX) {
        if (bytes > least && bytes > room / 2)
            bytes = least;
        if (bytes > room && flush_cache(dev))
            sync_stream(d, q->stream, q->want.stream); /* the frees land: a trim returns them */
    }
    /* segments: the empty chunks past the release rule go back first */
    carve_make_room(dev, bytes, size, release_cached);
    uintptr_t base;
    if (ledger_alloc_chunk(d, bytes, q->stream, &base) != BRIDGE_OK) {
        if (bytes == least || !carve_slack(dev))
            return BRIDGE_E_MISS;
        if (flush_cache(dev))
            sync_stream(d, q->stream, q->want.stream);
        bytes = least;
        if (ledger_alloc_chunk(d, bytes, q->stream, &base) != BRIDGE_OK)
            return BRIDGE_E_MISS;
    }
    uintptr_t p = carve_add(dev, q->want.stream, base, bytes, size, release_cached);
    return p && adopt_carved(q, p, out) == BRIDGE_OK ? BRIDGE_OK : BRIDGE_E_MISS;
}

static int obtain_uncached(request *q, void **out);

/* The one way down for every allocation: the graph pool's free list (a
 * graph request), the cache, the pool; then, refused, the recovery chain
 * and the wait (a graph request: the chain's first step alone). */
static int obtain(request *q, void **out)
{
    /* a graph pool's fast path: a block its graphs freed, no driver call */
    if ((q->want.flags & REC_GRAPH) && (*out = (void *)graph_reuse(q->d, &q->want)))
        return BRIDGE_OK;
    /* fastest path: a block of this size freed on this stream (for a graph
     * request, freed before the capture: everything that used it precedes
     * the capture in that stream's order, and torch's private pools take
     * such blocks too) */
    if (take_cached(q, out) == BRIDGE_OK)
        return BRIDGE_OK;
    return obtain_uncached(q, out);
}

/* obtain after the cache missed: carving, the pool, the recovery chain. */
static int obtain_uncached(request *q, void **out)
{
    device_state *d = q->d;
    int graph = q->want.flags & REC_GRAPH;
    /* carving (off unless asked for): a free range of the stream's chunks */
    int carve = carvable(q);
    if (carve) {
        if (atomic_load_explicit(&pending_count, RELAXED))
            retry_held_back();
        if (take_carved(q, out) == BRIDGE_OK)
            return BRIDGE_OK;
    }
    /* A stream the free may not be able to name, that the legacy stream does
     * not wait for: its block's free waits for a device-wide synchronization
     * (ledger_hold).  A stream of a tag that keeps its streams alive until
     * the free returns (CuPy's) is named at the free. */
    if (!graph && !stream_tag_holds(q->want.tag) && stream_needs_device_order(q->want.stream))
        q->want.flags |= REC_UNORDERED;
    ctx_guard g;
    ctx_enter(d, &g);
    if (!graph) /* a capture the core does not run (CuPy's Stream.begin_capture without it) */
        q->side = atomic_load_explicit(&d->captures_active, RELAXED) &&
                  stream_capturing(d, q->want.stream);
    /* ... or a new chunk to carve it from */
    if (carve && !q->side && carve_new_chunk(q, out) == BRIDGE_OK) {
        ctx_exit(&g);
        return BRIDGE_OK;
    }
    /* fast path: two atomic adds (plus one attribute read under a budget),
     * one driver call, one shard lock */
    int rc = ledger_alloc(d, &q->want, q->stream, q->side, out);
    if (rc == BRIDGE_OK) {
        record made = q->want;
        made.ptr = (uintptr_t)*out;
        memo_set(&made);
    }
    int refused = rc != BRIDGE_OK;
    if (refused)
        wait_refused(); /* the OOM message tells this refusal's wait, none before */
    if (retryable(rc)) {
        /* 1. What the core holds back to the pool, the stream's pending frees
         *    land (not while a capture runs: a synchronization could
         *    invalidate it), and again: a graph request too (the cache's
         *    blocks are not the capture's; returning them blocks nothing). */
        give_back_held(d, q->want.device);
        sync_stream(d, q->stream, q->want.stream);
        rc = alloc_again(q, out);
        if (rc == BRIDGE_OK)
            atomic_fetch_add_explicit(&d->num_retries, 1, RELAXED);
        /* 2. The frameworks' relief, then 3. waiting for others to free, if
         *    this thread may (wait.c); not for a graph request: the relief
         *    runs Python (its collection), and a capture must not block. */
        if (retryable(rc) && !graph) {
            ctx_exit(&g); /* the wait may be long; each retry enters again */
            retry_args a = {q, rc};
            rc = wait_for_room(d, q->want.device, q->want.size, rc, retry_alloc, &a, out);
            ctx_enter(d, &g);
        } else if (retryable(rc)) {
            wait_refused_graph(d, q->want.size); /* the OOM message says why it did not wait */
        }
    }
    if (retryable(rc) || rc == BRIDGE_E_TAG_LIMIT) { /* refusals, not driver errors */
        atomic_fetch_add_explicit(&d->num_ooms, 1, RELAXED);
        atomic_fetch_add_explicit(&d->tag[q->want.tag].num_ooms, 1, RELAXED);
    }
    if (refused)
        wait_chain_end(); /* the next allocation is a new one to the share */
    ctx_exit(&g);
    return rc;
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
    if (atomic_load_explicit(&d->num_deferred, RELAXED)) {
        if (atomic_load_explicit(&d->captures_active, RELAXED))
            graph_reap_ended(d, 0); /* a capture that ended without its end hook */
        ledger_flush_deferred(d);
    }
    request q;
    if (!atomic_load_explicit(&d->stream_captures, RELAXED))
        return take_cached_plain(d, device, size, stream, tag, &q, out) == BRIDGE_OK
                   ? BRIDGE_OK
                   : obtain_uncached(&q, out);
    q = request_of(d, device, size, stream, tag);
    /* a CuPy capture of this stream: its graph's pool (graph.c), never the
     * cache's other blocks (a cached block would leave the graph at its free) */
    uint64_t bound_pool;
    if (graph_pool_of_stream(d, q.want.stream, &bound_pool))
        request_graph(&q, BRIDGE_STREAM_POOL, bound_pool);
    return obtain(&q, out);
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

int bridge_alloc_graph(int device, size_t size, int tag, uint64_t id0, uint64_t id1, void *stream,
                       void **out)
{
    *out = NULL;
    if (size == 0)
        return BRIDGE_OK;
    if (tag < 0 || tag >= BRIDGE_NTAGS)
        return BRIDGE_E_INVALID;
    int rc;
    device_state *d = device_use(device, &rc);
    if (d) {
        request q = request_of(d, device, size, stream, tag);
        request_graph(&q, id0, id1);
        rc = obtain(&q, out);
        graph_watch(d, id0, id1, q.want.stream); /* its capture's stream, once */
    }
    note_alloc(rc, device, size, stream, tag, *out);
    return rc;
}

int bridge_graph_take(int device, size_t size, int tag, uint64_t id0, uint64_t id1, void *stream,
                      void **out)
{
    *out = NULL;
    if (size == 0 || tag < 0 || tag >= BRIDGE_NTAGS)
        return BRIDGE_E_INVALID;
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_MISS;
    request q = request_of(d, device, size, stream, tag);
    request_graph(&q, id0, id1);
    if (!(*out = (void *)graph_reuse(d, &q.want)))
        return BRIDGE_E_MISS;
    note_alloc(BRIDGE_OK, device, size, stream, tag, *out);
    return BRIDGE_OK;
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
    request q;
    int rc = take_cached_plain(d, device, size, stream, tag, &q, out);
    if (rc != BRIDGE_OK && carvable(&q))
        rc = take_carved(&q, out); /* no chunk taken here: that is a driver call */
    if (rc == BRIDGE_OK)
        note_alloc(rc, device, size, stream, tag, *out);
    return rc;
}

/* A stream that used a block, as bridge_record_stream and
 * bridge_free_on_stream tell it: `unordered` when it is one the block's free
 * cannot be ordered after by name (stream_needs_device_order, asked while it
 * is alive, outside the shard lock). */
typedef struct stream_use {
    CUstream s;
    int unordered;
} stream_use;

static stream_use use_of(void *stream)
{
    return (stream_use){(CUstream)stream, stream_needs_device_order(stream_key((CUstream)stream))};
}

static int add_stream(record *r, void *arg)
{
    const stream_use *u = arg;
    CUstream s = u->s;
    if (u->unordered)
        r->flags |= REC_UNORDERED;
    /* The per-thread default stream of the calling thread: recorded as the
     * legacy stream, which any thread can order after (it waits for every
     * blocking stream's queued work). */
    if (s == (CUstream)(uintptr_t)2)
        s = stream_key(s) == r->stream ? r->stream : (CUstream)(uintptr_t)1;
    if (s == r->stream)
        return 0;
    return records_add_stream(r, s) ? -2 : 0;
}

int bridge_record_stream(void *ptr, void *stream)
{
    stream_use u = use_of(stream);
    int rc = records_update((uintptr_t)ptr, add_stream, &u);
    return rc == 0 ? BRIDGE_OK : rc == -2 ? BRIDGE_E_OOM : BRIDGE_E_INVALID;
}

/* bridge_free_on_stream's change to the record, under the shard lock.  A
 * tag whose framework keeps the stream it frees on alive during the free
 * (RMM's deallocate(ptr, size, stream), CuPy's): the free is issued on that
 * stream, as the framework's own pool does, and after the block's own
 * stream too where that one is provably alive.  Any other tag, or a graph
 * block: the stream is recorded, as by bridge_record_stream. */
static int retarget_free(record *r, void *arg)
{
    if ((r->flags & (REC_GRAPH | REC_CARVED)) || !stream_tag_holds(r->tag))
        return add_stream(r, arg); /* a carved block stays on its chunk's stream */
    CUstream key = stream_key(((const stream_use *)arg)->s);
    if (key == r->stream)
        return 0;
    if (stream_long_lived(r->stream) && records_add_stream(r, r->stream))
        return -2;
    r->stream = key;
    return 0;
}

void bridge_free_on_stream(void *ptr, void *stream)
{
    /* An unknown pointer or a double free changes nothing here: bridge_free
     * counts it.  No host memory to record the block's own stream: the free
     * stays in the block's own order, as bridge_record_stream's would. */
    if (ptr && !bridge_forked() && !ipc_held(ptr)) {
        stream_use u = use_of(stream);
        (void)records_update((uintptr_t)ptr, retarget_free, &u);
    }
    bridge_free(ptr);
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
    graph_reap_ended(d, 1);
    flush_cache(device);
    return ledger_trim(d, keep);
}

/* ---- fork ---- */
/* What the parts above the ledger forget in a fork child, after the ledger
 * forgot the devices (ledger.c's handler calls it: no lock is taken). */
static void forget_after_fork(void)
{
    cache_forget_after_fork();
    carve_forget_after_fork();
    graph_forget_after_fork();
    records_forget_after_fork();
    history_forget_after_fork();
    wait_forget_after_fork();
}

/* The ledger's table of the parts above it, filled when the library is
 * loaded, before any allocation (share.c fills its entries at its join). */
__attribute__((constructor)) static void tell_the_ledger(void)
{
    const ledger_parts parts = {.freed = wait_freed,
                                .forget_after_fork = forget_after_fork,
                                .captures_ended = captures_ended};
    ledger_listen(&parts);
    cache_set_detach(detach_parked);
    cache_set_carved_return(carved_leaves_slot);
}

/* ---- figures ---- */
int bridge_get_stats(int device, bridge_stats *out)
{
    memset(out, 0, sizeof *out);
    device_state *d = device_of(device);
    if (!d)
        return bridge_initialized() ? BRIDGE_E_DEVICE : BRIDGE_E_NOTINIT;
    graph_collect_dead();   /* the figures count no dead CuPy graph's pool */
    graph_reap_ended(d, 1); /* nor a failed capture's */
    out->limit = atomic_load(&d->limit);
    out->used = atomic_load(&d->reserved);
    out->peak_used = atomic_load(&d->peak);
    out->release_threshold = atomic_load(&d->release_threshold);
    out->total = d->total;
    uint64_t sums[BRIDGE_NTAGS][COUNT_TAG_FIGURES];
    counts_sum(device, sums, &out->num_allocs, &out->num_frees, &out->num_cache_hits);
    out->num_ooms = atomic_load(&d->num_ooms);
    out->num_retries = atomic_load(&d->num_retries);
    out->num_bad_frees = atomic_load(&bad_frees);
    out->num_driver_errors = atomic_load(&d->num_driver_errors);
    out->num_deferred = atomic_load(&d->num_deferred) + atomic_load(&d->num_held);
    out->graph_bytes = atomic_load(&d->graph_bytes);
    out->cached = cache_bytes(device);
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
    out->cache_large_fraction = (double)cache_large_fraction_q16(device) / 65536.0;
    out->carve_held = carve_held(device);
    out->carve_on = (uint64_t)carve_on(device);
    out->carve_hwm = carve_hwm(device);
    out->carve_slack = carve_slack(device);
    out->carve_parked = cache_parked_carved(device);
    wait_fill_stats(device, out);
    raise_reserved_peaks(d, device);
    for (int i = 0; i < BRIDGE_NTAGS; i++) {
        tag_state *t = &d->tag[i];
        uint64_t since[COUNT_TAG_FIGURES]; /* the sums less the last reset's */
        for (int k = 0; k < COUNT_TAG_FIGURES; k++)
            since[k] = sums[i][k] - atomic_load(&t->base[k]);
        uint64_t live;
        int64_t count;
        ledger_tag_live(d, i, &live, &count);
        out->tag[i] = (bridge_tag_stats){live,
                                         atomic_load(&t->peak),
                                         since[COUNT_ALLOCATED],
                                         since[COUNT_FREED],
                                         since[COUNT_ALLOCS],
                                         since[COUNT_FREES],
                                         atomic_load(&t->num_ooms),
                                         atomic_load(&t->limit),
                                         (uint64_t)count,
                                         (uint64_t)atomic_load(&t->count_peak),
                                         0};
        /* the live bytes' peak bounds it below (the live bytes are reserved) */
        uint64_t rp = atomic_load(&t->reserved_peak);
        out->tag[i].reserved_peak = rp > out->tag[i].peak ? rp : out->tag[i].peak;
    }
    CUresult r;
    int mode = capture_mode_relax(); /* figures asked for during another's capture */
    if ((r = pool_figure(d, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &out->pool_used)) != CUDA_SUCCESS ||
        (r = pool_figure(d, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &out->pool_reserved)) !=
            CUDA_SUCCESS ||
        (r = pool_figure(d, CU_MEMPOOL_ATTR_USED_MEM_HIGH, &out->pool_used_high)) != CUDA_SUCCESS) {
        capture_mode_exit(mode);
        return bridge_note_driver_error(r), BRIDGE_E_DRIVER;
    }
    capture_mode_exit(mode);
    return BRIDGE_OK;
}
