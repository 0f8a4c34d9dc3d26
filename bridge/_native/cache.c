/* SPDX-License-Identifier: Apache-2.0 */
/* cache.c: exact-size, per-stream cache of freed blocks with least-recently-
 * cached eviction in two tiers (see cache.h).
 *
 * Each cached block is a node of a per-device array (allocated on the first
 * put, recycled through a free list).  A node is on two doubly-linked lists:
 * its tier's order of caching (newest .. oldest), and its key's blocks
 * (top = newest .. bottom = oldest), the key being (stream, size) in an
 * open-addressed table.  A take pops the top of its key; an eviction removes
 * the tier's oldest block, wherever its key is: both O(1).  The node keeps
 * its tier, so a change of the boundary leaves every block where it was. */
#include "cache.h"
#include "carve.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "bridge.h"

#define SLOT_BITS 12
#define SLOTS     (1u << SLOT_BITS)   /* (stream, size) keys per device */
#define DEPTH     BRIDGE_CACHE_DEPTH  /* blocks kept per key */
#define NODES     (DEPTH * SLOTS / 2) /* every key that may hold blocks, full */
#define NONE      UINT32_MAX

typedef struct node {
    uintptr_t ptr;
    uint64_t size;
    CUstream stream;
    uint32_t newer, older;   /* the device's order of caching; `older` also
                                links the free list */
    uint32_t knewer, kolder; /* the blocks of the same key */
    uint32_t tier;           /* TIER_SMALL or TIER_LARGE: the order it is on */
} node;

typedef struct slot {
    CUstream stream; /* key part 1 */
    uint64_t size;   /* key part 2; 0 = never used */
    uint32_t n;      /* blocks of the key */
    uint32_t top;    /* its newest block (NONE when n == 0) */
    uint32_t bottom; /* its oldest */
} slot;

enum { TIER_SMALL, TIER_LARGE, TIERS };

/* One order of caching and its bytes.  Every write is made under the
 * device's lock (a plain load and store: no locked instruction on the hot
 * path); the atomics let figures be read without it. */
typedef struct tier {
    uint32_t newest, oldest; /* ends of the tier's order of caching */
    _Atomic uint64_t bytes;  /* the tier's cached bytes */
} tier;

typedef struct dcache {
    pthread_mutex_t lock;
    slot *slots;                /* SLOTS entries, allocated on first put */
    node *nodes;                /* NODES entries, allocated with slots */
    uint32_t nused;             /* nodes[0..nused) were handed out */
    uint32_t free_head;         /* nodes given back, linked by `older` */
    tier tiers[TIERS];          /* blocks <= small_max, and the larger ones */
    _Atomic uint64_t bytes;     /* cached bytes, both tiers; written under the lock */
    _Atomic uint64_t limit;     /* hard cap of `bytes`; 0 = caching off */
    _Atomic uint64_t max_block; /* larger blocks are never cached */
    _Atomic uint64_t fraction;  /* the small tier's share of live bytes, x 65536 */
    _Atomic uint64_t floor;     /* the small tier's cap is at least this */
    _Atomic uint64_t small_max; /* the largest block of the small tier */
    _Atomic uint64_t large_cap; /* the large tier's cap ... */
    _Atomic uint64_t large_fraction; /* ... and its share of live, x 65536; 0: none */
    uint32_t keys;              /* slots with size != 0; <= SLOTS / 2 */
    uint32_t live_keys;         /* slots with n > 0; <= keys */
    int held;                   /* threads waiting for memory (wait.c): while > 0
                                  nothing is cached, freed bytes go to the pool */
} dcache;

#define DEFAULT_LIMIT (1ull << 30)
static dcache caches[BRIDGE_MAX_DEVICES] = {
    [0 ... BRIDGE_MAX_DEVICES - 1] = {.lock = PTHREAD_MUTEX_INITIALIZER,
                                      .free_head = NONE,
                                      .tiers = {{NONE, NONE, 0}, {NONE, NONE, 0}},
                                      .limit = DEFAULT_LIMIT,
                                      .max_block = BRIDGE_CACHE_MAX_BLOCK,
                                      .fraction = BRIDGE_CACHE_FRACTION_Q16,
                                      .floor = BRIDGE_CACHE_FLOOR,
                                      .small_max = BRIDGE_CACHE_SMALL_MAX,
                                      .large_cap = BRIDGE_CACHE_LARGE_CAP,
                                      .large_fraction = BRIDGE_CACHE_LARGE_FRACTION_Q16}};

#define RELAXED memory_order_relaxed

/* bytes += delta (a two's complement delta subtracts), for a counter written
 * only under the device's lock */
static inline void add_locked(_Atomic uint64_t *v, uint64_t delta)
{
    atomic_store_explicit(v, atomic_load_explicit(v, RELAXED) + delta, RELAXED);
}

static void reset_tiers(dcache *c)
{
    for (int t = 0; t < TIERS; t++) {
        c->tiers[t].newest = c->tiers[t].oldest = NONE;
        atomic_store(&c->tiers[t].bytes, 0);
    }
}

/* The slot index comes from the TOP bits of a 64-bit multiplicative hash:
 * sizes that are multiples of 1 MiB and aligned stream handles have low
 * bits that are all zero, and the low bits of a product of them are too (the
 * old index took those and piled such keys onto a few slots). */
static inline uint64_t hash(CUstream s, uint64_t size)
{
    uint64_t h = ((uint64_t)(uintptr_t)s ^ (size * 0xC2B2AE3D27D4EB4Full)) * 0x9E3779B97F4A7C15ull;
    return h >> (64 - SLOT_BITS);
}

/* The slot of (s, size), or the empty slot where it would go; NULL if full. */
static slot *find(dcache *c, CUstream s, uint64_t size, int insert)
{
    uint64_t h = hash(s, size);
    for (uint32_t i = 0; i < SLOTS; i++) {
        slot *sl = &c->slots[(h + i) & (SLOTS - 1)];
        if (sl->size == size && sl->stream == s)
            return sl;
        if (sl->size == 0) {
            if (!insert || c->keys >= SLOTS / 2)
                return NULL;
            sl->size = size;
            sl->stream = s;
            sl->n = 0;
            sl->top = sl->bottom = NONE;
            c->keys++;
            return sl;
        }
    }
    return NULL;
}

/* Drop the keys whose blocks were all taken again, so new (stream, size)
 * pairs find room.  Only when at most a quarter of the table holds blocks:
 * the next compaction is then SLOTS / 4 new keys away (amortized O(1)).
 * Nodes do not point at slots, so they stay as they are. */
static int compact(dcache *c)
{
    if (c->live_keys >= SLOTS / 4)
        return 0;
    slot *fresh = calloc(SLOTS, sizeof(slot));
    if (!fresh)
        return 0;
    slot *old = c->slots;
    c->slots = fresh;
    c->keys = 0;
    for (uint32_t i = 0; i < SLOTS; i++)
        if (old[i].n)
            *find(c, old[i].stream, old[i].size, 1) = old[i];
    free(old);
    return 1;
}

/* Node i becomes the newest of its tier and of its key. */
static void link_node(dcache *c, slot *sl, uint32_t i)
{
    node *nd = &c->nodes[i];
    tier *t = &c->tiers[nd->tier];
    nd->newer = NONE;
    nd->older = t->newest;
    if (t->newest != NONE)
        c->nodes[t->newest].newer = i;
    else
        t->oldest = i;
    t->newest = i;
    nd->knewer = NONE;
    nd->kolder = sl->top;
    if (sl->top != NONE)
        c->nodes[sl->top].knewer = i;
    else
        sl->bottom = i;
    sl->top = i;
    if (!sl->n++)
        c->live_keys++;
}

/* Node i leaves both lists and goes to the free list. */
static inline __attribute__((always_inline)) void unlink_node(dcache *c, slot *sl, uint32_t i)
{
    node *nd = &c->nodes[i];
    tier *t = &c->tiers[nd->tier];
    if (nd->newer != NONE)
        c->nodes[nd->newer].older = nd->older;
    else
        t->newest = nd->older;
    if (nd->older != NONE)
        c->nodes[nd->older].newer = nd->newer;
    else
        t->oldest = nd->newer;
    if (nd->knewer != NONE)
        c->nodes[nd->knewer].kolder = nd->kolder;
    else
        sl->top = nd->kolder;
    if (nd->kolder != NONE)
        c->nodes[nd->kolder].knewer = nd->knewer;
    else
        sl->bottom = nd->knewer;
    if (!--sl->n)
        c->live_keys--;
    nd->older = c->free_head;
    c->free_head = i;
    add_locked(&t->bytes, -nd->size);
    add_locked(&c->bytes, -nd->size);
}

static uint32_t new_node(dcache *c)
{
    uint32_t i = c->free_head;
    if (i != NONE)
        c->free_head = c->nodes[i].older;
    else if (c->nused < NODES)
        i = c->nused++;
    return i;
}

/* live * q16 / 65536, without overflow */
static inline uint64_t share_of(uint64_t live, uint64_t q16)
{
    unsigned __int128 share = ((unsigned __int128)live * q16) >> 16;
    return share > UINT64_MAX ? UINT64_MAX : (uint64_t)share;
}

/* The cap of each tier; `held`: the device's committed bytes, the cached ones
 * included (live = held - cached); `size`: the block being cached (0 for a
 * trim).  The limit bounds both tiers together: each has the room under it
 * that the other leaves.
 *     small: cached_small <= min(limit - cached_large, max(floor, live * fraction))
 *     large: cached_large <= min(limit - cached_small, large_cap,
 *                                max(live * large_fraction, size))
 * The large tier's share keeps large blocks from pinning the pool's chunks
 * where little else is live; with `size` as its floor, a block up to
 * large_cap always fits, evicting the tier's older blocks (a loop of one large
 * size hits as before).  large_fraction 0: the fixed cap alone. */
static uint64_t cap_for(dcache *c, int t, uint64_t held, uint64_t size)
{
    uint64_t limit = atomic_load_explicit(&c->limit, RELAXED);
    uint64_t other = atomic_load_explicit(&c->tiers[!t].bytes, RELAXED);
    uint64_t room = limit > other ? limit - other : 0;
    uint64_t cached = atomic_load_explicit(&c->bytes, RELAXED);
    uint64_t live = held > cached ? held - cached : 0;
    uint64_t cap;
    if (t == TIER_LARGE) {
        cap = atomic_load_explicit(&c->large_cap, RELAXED);
        uint64_t q16 = atomic_load_explicit(&c->large_fraction, RELAXED);
        if (q16) {
            uint64_t share = share_of(live, q16);
            if (share < size)
                share = size;
            if (share < cap)
                cap = share;
        }
    } else {
        uint64_t floor = atomic_load_explicit(&c->floor, RELAXED);
        uint64_t share = share_of(live, atomic_load_explicit(&c->fraction, RELAXED));
        cap = share > floor ? (share > room ? room : share) : floor;
    }
    return cap < room ? cap : room;
}

/* Move tier t's oldest blocks to `out` (at most `max`) until its bytes + extra
 * <= cap. */
static __attribute__((noinline)) int evict(dcache *c, int t, uint64_t cap, uint64_t extra,
                                           cache_block *out, int max)
{
    tier *tr = &c->tiers[t];
    int k = 0;
    while (k < max && tr->oldest != NONE &&
           atomic_load_explicit(&tr->bytes, RELAXED) + extra > cap) {
        uint32_t i = tr->oldest;
        node *nd = &c->nodes[i];
        out[k++] = (cache_block){nd->ptr, nd->size, nd->stream};
        unlink_node(c, find(c, nd->stream, nd->size, 0), i);
    }
    return k;
}

uintptr_t cache_take(int device, CUstream stream, uint64_t size)
{
    dcache *c = &caches[device];
    if (!atomic_load_explicit(&c->bytes, memory_order_relaxed))
        return 0; /* nothing cached: no lock */
    uintptr_t p = 0;
    pthread_mutex_lock(&c->lock);
    slot *sl = c->slots ? find(c, stream, size, 0) : NULL;
    if (sl && sl->n) {
        /* the newest block of the key: the top of its list */
        uint32_t i = sl->top;
        node *nd = &c->nodes[i];
        tier *t = &c->tiers[nd->tier];
        p = nd->ptr;
        if (nd->newer != NONE)
            c->nodes[nd->newer].older = nd->older;
        else
            t->newest = nd->older;
        if (nd->older != NONE)
            c->nodes[nd->older].newer = nd->newer;
        else
            t->oldest = nd->newer;
        sl->top = nd->kolder;
        if (sl->top != NONE)
            c->nodes[sl->top].knewer = NONE;
        else
            sl->bottom = NONE;
        if (!--sl->n)
            c->live_keys--;
        nd->older = c->free_head;
        c->free_head = i;
        add_locked(&t->bytes, -size);
        add_locked(&c->bytes, -size);
    }
    pthread_mutex_unlock(&c->lock);
    return p;
}

/* cache_put and cache_put_no_evict: `evicted` NULL means evict nothing,
 * decline when the block does not fit as the cache is. */
static int put(int device, CUstream stream, uint64_t size, uintptr_t ptr, uint64_t held,
               cache_block *evicted, int *nevicted)
{
    dcache *c = &caches[device];
    if (!atomic_load_explicit(&c->limit, memory_order_relaxed) ||
        size > atomic_load_explicit(&c->max_block, memory_order_relaxed))
        return 0;
    int kept = 0;
    pthread_mutex_lock(&c->lock);
    if (!c->slots) {
        c->slots = calloc(SLOTS, sizeof(slot));
        c->nodes = c->slots ? malloc(NODES * sizeof(node)) : NULL;
        if (!c->nodes) {
            free(c->slots);
            c->slots = NULL;
        }
        c->nused = 0;
        c->free_head = NONE;
        reset_tiers(c);
    }
    /* c->held: read under the lock already taken (no cost when nobody waits) */
    if (c->slots && !c->held) {
        /* the block's tier decides the cap it is held to (and the only
         * blocks it may evict: the other tier keeps its own) */
        int t = size > atomic_load_explicit(&c->small_max, RELAXED) ? TIER_LARGE : TIER_SMALL;
        tier *tr = &c->tiers[t];
        uint64_t bytes = atomic_load_explicit(&tr->bytes, RELAXED);
        uint64_t cap;
        if (t == TIER_SMALL) {
            /* under the floor and the limit: under the cap, whatever the live
             * bytes (the large tier's bytes are part of what the limit holds) */
            uint64_t low = atomic_load_explicit(&c->floor, RELAXED);
            uint64_t limit = atomic_load_explicit(&c->limit, RELAXED);
            uint64_t large = atomic_load_explicit(&c->tiers[TIER_LARGE].bytes, RELAXED);
            limit = limit > large ? limit - large : 0;
            low = low < limit ? low : limit;
            cap = bytes + size <= low ? low : cap_for(c, t, held, size);
        } else {
            cap = cap_for(c, t, held, size);
        }
        /* no eviction allowed: no room in the block's tier as it is, no change
         * (not even a new key) */
        int room = evicted || bytes + size <= cap;
        slot *sl = NULL;
        if (room && size <= cap) {
            sl = find(c, stream, size, 1);
            if (!sl && compact(c))
                sl = find(c, stream, size, 1);
            if (sl && sl->n >= DEPTH)
                sl = NULL;
        }
        /* room for the block when it is kept; else back under the cap (the
         * block's own tier only: the other tier keeps its blocks) */
        if (evicted && bytes + size > cap)
            *nevicted = evict(c, t, cap, sl ? size : 0, evicted, BRIDGE_CACHE_EVICT_MAX);
        if (sl && atomic_load_explicit(&tr->bytes, RELAXED) + size <= cap) {
            uint32_t i = new_node(c);
            if (i != NONE) {
                c->nodes[i].ptr = ptr;
                c->nodes[i].size = size;
                c->nodes[i].stream = stream;
                c->nodes[i].tier = (uint32_t)t;
                link_node(c, sl, i);
                add_locked(&tr->bytes, size);
                add_locked(&c->bytes, size);
                kept = 1;
            }
        }
    }
    pthread_mutex_unlock(&c->lock);
    return kept;
}

int cache_put(int device, CUstream stream, uint64_t size, uintptr_t ptr, uint64_t held,
              cache_block *evicted, int *nevicted)
{
    *nevicted = 0;
    return put(device, stream, size, ptr, held, evicted, nevicted);
}

int cache_put_no_evict(int device, CUstream stream, uint64_t size, uintptr_t ptr, uint64_t held)
{
    return put(device, stream, size, ptr, held, NULL, NULL);
}

int cache_trim(int device, uint64_t held, cache_block *evicted)
{
    dcache *c = &caches[device];
    if (!atomic_load_explicit(&c->bytes, memory_order_relaxed))
        return 0;
    int k = 0;
    pthread_mutex_lock(&c->lock);
    /* each tier down to its cap, the small one first (the large tier's cap
     * is then read with the small tier's bytes after the eviction) */
    for (int t = 0; c->slots && t < TIERS && k < BRIDGE_CACHE_EVICT_MAX; t++)
        k += evict(c, t, cap_for(c, t, held, 0), 0, evicted + k, BRIDGE_CACHE_EVICT_MAX - k);
    pthread_mutex_unlock(&c->lock);
    return k;
}

uint64_t cache_flush(int device, cache_release_fn release)
{
    dcache *c = &caches[device];
    if (!atomic_load(&c->bytes))
        return 0;
    /* Take the blocks out under the lock, release them after it. */
    pthread_mutex_lock(&c->lock);
    slot *old = c->slots;
    node *nodes = c->nodes;
    uint32_t first[TIERS];
    for (int t = 0; t < TIERS; t++)
        first[t] = c->tiers[t].oldest;
    c->slots = NULL;
    c->nodes = NULL;
    c->free_head = NONE;
    reset_tiers(c);
    c->nused = 0;
    c->keys = 0;
    c->live_keys = 0;
    uint64_t bytes = atomic_exchange(&c->bytes, 0);
    pthread_mutex_unlock(&c->lock);
    for (int t = 0; nodes && t < TIERS; t++)
        for (uint32_t i = first[t]; i != NONE; i = nodes[i].newer)
            release(device, nodes[i].ptr, nodes[i].size, nodes[i].stream);
    free(nodes);
    free(old);
    return bytes;
}

uint64_t cache_flush_stream(int device, CUstream stream, cache_release_fn release)
{
    dcache *c = &caches[device];
    if (!atomic_load(&c->bytes))
        return 0;
    enum { BATCH = 64 };
    cache_block out[BATCH];
    uint64_t bytes = 0;
    for (;;) {
        /* a batch at a time, oldest first: taken under the lock, released after */
        int n = 0;
        pthread_mutex_lock(&c->lock);
        for (int t = 0; c->slots && t < TIERS; t++) {
            for (uint32_t i = c->tiers[t].oldest; i != NONE && n < BATCH;) {
                node *nd = &c->nodes[i];
                uint32_t next = nd->newer;
                if (nd->stream == stream) {
                    out[n++] = (cache_block){nd->ptr, nd->size, nd->stream};
                    unlink_node(c, find(c, nd->stream, nd->size, 0), i);
                }
                i = next;
            }
        }
        pthread_mutex_unlock(&c->lock);
        for (int k = 0; k < n; k++) {
            release(device, out[k].ptr, out[k].size, out[k].stream);
            bytes += out[k].size;
        }
        if (n < BATCH)
            return bytes;
    }
}

void cache_hold(int device, int on)
{
    dcache *c = &caches[device];
    pthread_mutex_lock(&c->lock);
    c->held += on ? 1 : -1;
    pthread_mutex_unlock(&c->lock);
}

uint64_t cache_blocks(int device)
{
    dcache *c = &caches[device];
    uint64_t n = 0;
    pthread_mutex_lock(&c->lock);
    for (int t = 0; c->nodes && t < TIERS; t++)
        for (uint32_t i = c->tiers[t].oldest; i != NONE; i = c->nodes[i].newer)
            n++;
    pthread_mutex_unlock(&c->lock);
    return n;
}

uint64_t cache_bytes(int device)
{
    /* the carved classes' idle bytes too: every byte kept for reuse */
    return atomic_load(&caches[device].bytes) + carve_idle(device);
}

uint64_t cache_limit(int device)
{
    return atomic_load(&caches[device].limit);
}

void cache_set_limits(int device, uint64_t limit, uint64_t max_block)
{
    atomic_store(&caches[device].limit, limit);
    atomic_store(&caches[device].max_block, max_block);
}

void cache_set_share(int device, uint64_t fraction_q16, uint64_t floor)
{
    atomic_store(&caches[device].fraction, fraction_q16);
    atomic_store(&caches[device].floor, floor);
}

uint64_t cache_fraction_q16(int device)
{
    return atomic_load(&caches[device].fraction);
}

uint64_t cache_floor(int device)
{
    return atomic_load(&caches[device].floor);
}

void cache_set_tiers(int device, uint64_t small_max, uint64_t large_cap)
{
    atomic_store(&caches[device].small_max, small_max);
    atomic_store(&caches[device].large_cap, large_cap);
}

uint64_t cache_small_max(int device)
{
    return atomic_load(&caches[device].small_max);
}

uint64_t cache_large_cap(int device)
{
    return atomic_load(&caches[device].large_cap);
}

void cache_set_large_fraction(int device, uint64_t fraction_q16)
{
    atomic_store(&caches[device].large_fraction, fraction_q16);
}

uint64_t cache_large_fraction_q16(int device)
{
    return atomic_load(&caches[device].large_fraction);
}

uint64_t cache_tier_bytes(int device, int large)
{
    return atomic_load(&caches[device].tiers[large ? TIER_LARGE : TIER_SMALL].bytes);
}

/* A fork child forgets the parent's cached blocks without taking a lock. */
void cache_forget_after_fork(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    for (int i = 0; i < BRIDGE_MAX_DEVICES; i++) {
        caches[i].lock = fresh;
        caches[i].slots = NULL;
        caches[i].nodes = NULL;
        caches[i].nused = 0;
        caches[i].free_head = NONE;
        reset_tiers(&caches[i]);
        caches[i].keys = caches[i].live_keys = 0;
        caches[i].held = 0;
        atomic_store(&caches[i].bytes, 0);
    }
}
