/* SPDX-License-Identifier: Apache-2.0 */
/* cache.c: exact-size, per-stream cache of freed blocks with least-recently-
 * cached eviction (see cache.h).
 *
 * Each cached block is a node of a per-device array (allocated on the first
 * put, recycled through a free list).  A node is on two doubly-linked lists:
 * the device's order of caching (newest .. oldest), and its key's blocks
 * (top = newest .. bottom = oldest), the key being (stream, size) in an
 * open-addressed table.  A take pops the top of its key; an eviction removes
 * the device's oldest block, wherever its key is: both O(1). */
#include "cache.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "bridge.h"

#define SLOT_BITS 12
#define SLOTS     (1u << SLOT_BITS)   /* (stream, size) keys per device */
#define DEPTH     16                  /* blocks kept per key */
#define NODES     (DEPTH * SLOTS / 2) /* every key that may hold blocks, full */
#define NONE      UINT32_MAX

typedef struct node {
    uintptr_t ptr;
    uint64_t size;
    CUstream stream;
    uint32_t newer, older;   /* the device's order of caching; `older` also
                                links the free list */
    uint32_t knewer, kolder; /* the blocks of the same key */
} node;

typedef struct slot {
    CUstream stream; /* key part 1 */
    uint64_t size;   /* key part 2; 0 = never used */
    uint32_t n;      /* blocks of the key */
    uint32_t top;    /* its newest block (NONE when n == 0) */
    uint32_t bottom; /* its oldest */
} slot;

typedef struct dcache {
    pthread_mutex_t lock;
    slot *slots;                /* SLOTS entries, allocated on first put */
    node *nodes;                /* NODES entries, allocated with slots */
    uint32_t nused;             /* nodes[0..nused) were handed out */
    uint32_t free_head;         /* nodes given back, linked by `older` */
    uint32_t newest, oldest;    /* ends of the order of caching */
    _Atomic uint64_t bytes;     /* cached bytes; <= the cap after every put */
    _Atomic uint64_t limit;     /* hard cap; 0 = caching off */
    _Atomic uint64_t max_block; /* larger blocks are never cached */
    _Atomic uint64_t fraction;  /* the cap's share of live bytes, x 65536 */
    _Atomic uint64_t floor;     /* the cap is at least this (under `limit`) */
    uint32_t keys;              /* slots with size != 0; <= SLOTS / 2 */
    uint32_t live_keys;         /* slots with n > 0; <= keys */
    int held;                   /* threads waiting for memory (wait.c): while > 0
                                  nothing is cached, freed bytes go to the pool */
} dcache;

#define DEFAULT_LIMIT (1ull << 30)
static dcache caches[BRIDGE_MAX_DEVICES] = {
    [0 ... BRIDGE_MAX_DEVICES - 1] = {.lock = PTHREAD_MUTEX_INITIALIZER,
                                      .free_head = NONE,
                                      .newest = NONE,
                                      .oldest = NONE,
                                      .limit = DEFAULT_LIMIT,
                                      .max_block = BRIDGE_CACHE_MAX_BLOCK,
                                      .fraction = BRIDGE_CACHE_FRACTION_Q16,
                                      .floor = BRIDGE_CACHE_FLOOR}};

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

/* Node i becomes the newest of the device and of its key. */
static void link_node(dcache *c, slot *sl, uint32_t i)
{
    node *nd = &c->nodes[i];
    nd->newer = NONE;
    nd->older = c->newest;
    if (c->newest != NONE)
        c->nodes[c->newest].newer = i;
    else
        c->oldest = i;
    c->newest = i;
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
    if (nd->newer != NONE)
        c->nodes[nd->newer].older = nd->older;
    else
        c->newest = nd->older;
    if (nd->older != NONE)
        c->nodes[nd->older].newer = nd->newer;
    else
        c->oldest = nd->newer;
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
    atomic_fetch_sub_explicit(&c->bytes, nd->size, memory_order_relaxed);
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

/* cached <= min(limit, max(floor, live * fraction)); `held`: the device's
 * committed bytes, the cached ones included (live = held - cached). */
static uint64_t cap_for(dcache *c, uint64_t held)
{
    uint64_t cached = atomic_load_explicit(&c->bytes, memory_order_relaxed);
    uint64_t live = held > cached ? held - cached : 0;
    uint64_t limit = atomic_load_explicit(&c->limit, memory_order_relaxed);
    uint64_t floor = atomic_load_explicit(&c->floor, memory_order_relaxed);
    unsigned __int128 share =
        ((unsigned __int128)live * atomic_load_explicit(&c->fraction, memory_order_relaxed)) >> 16;
    uint64_t cap = share > floor ? (share > limit ? limit : (uint64_t)share) : floor;
    return cap < limit ? cap : limit;
}

/* Move the oldest blocks to `out` (at most `max`) until cached + extra <= cap. */
static __attribute__((noinline)) int evict(dcache *c, uint64_t cap, uint64_t extra,
                                           cache_block *out, int max)
{
    int k = 0;
    while (k < max && c->oldest != NONE &&
           atomic_load_explicit(&c->bytes, memory_order_relaxed) + extra > cap) {
        uint32_t i = c->oldest;
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
        p = nd->ptr;
        if (nd->newer != NONE)
            c->nodes[nd->newer].older = nd->older;
        else
            c->newest = nd->older;
        if (nd->older != NONE)
            c->nodes[nd->older].newer = nd->newer;
        else
            c->oldest = nd->newer;
        sl->top = nd->kolder;
        if (sl->top != NONE)
            c->nodes[sl->top].knewer = NONE;
        else
            sl->bottom = NONE;
        if (!--sl->n)
            c->live_keys--;
        nd->older = c->free_head;
        c->free_head = i;
        atomic_fetch_sub_explicit(&c->bytes, size, memory_order_relaxed);
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
        c->free_head = c->newest = c->oldest = NONE;
    }
    /* c->held: read under the lock already taken (no cost when nobody waits) */
    if (c->slots && !c->held) {
        /* under the floor and the limit: under the cap, whatever the live bytes */
        uint64_t low = atomic_load_explicit(&c->floor, memory_order_relaxed);
        uint64_t limit = atomic_load_explicit(&c->limit, memory_order_relaxed);
        low = low < limit ? low : limit;
        uint64_t bytes = atomic_load_explicit(&c->bytes, memory_order_relaxed);
        uint64_t cap = bytes + size <= low ? low : cap_for(c, held);
        /* no eviction allowed: no room, no change (not even a new key) */
        int room = evicted || bytes + size <= cap;
        slot *sl = NULL;
        if (room && size <= cap) {
            sl = find(c, stream, size, 1);
            if (!sl && compact(c))
                sl = find(c, stream, size, 1);
            if (sl && sl->n >= DEPTH)
                sl = NULL;
        }
        /* room for the block when it is kept; else back under the cap */
        if (evicted && bytes + size > cap)
            *nevicted = evict(c, cap, sl ? size : 0, evicted, BRIDGE_CACHE_EVICT_MAX);
        if (sl && atomic_load_explicit(&c->bytes, memory_order_relaxed) + size <= cap) {
            uint32_t i = new_node(c);
            if (i != NONE) {
                c->nodes[i].ptr = ptr;
                c->nodes[i].size = size;
                c->nodes[i].stream = stream;
                link_node(c, sl, i);
                atomic_fetch_add_explicit(&c->bytes, size, memory_order_relaxed);
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
    pthread_mutex_lock(&c->lock);
    int k = c->slots ? evict(c, cap_for(c, held), 0, evicted, BRIDGE_CACHE_EVICT_MAX) : 0;
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
    uint32_t i = c->oldest;
    c->slots = NULL;
    c->nodes = NULL;
    c->newest = c->oldest = c->free_head = NONE;
    c->nused = 0;
    c->keys = 0;
    c->live_keys = 0;
    uint64_t bytes = atomic_exchange(&c->bytes, 0);
    pthread_mutex_unlock(&c->lock);
    for (; nodes && i != NONE; i = nodes[i].newer)
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
        for (uint32_t i = c->slots ? c->oldest : NONE; i != NONE && n < BATCH;) {
            node *nd = &c->nodes[i];
            uint32_t next = nd->newer;
            if (nd->stream == stream) {
                out[n++] = (cache_block){nd->ptr, nd->size, nd->stream};
                unlink_node(c, find(c, nd->stream, nd->size, 0), i);
            }
            i = next;
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

uint64_t cache_bytes(int device)
{
    return atomic_load(&caches[device].bytes);
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

/* A fork child forgets the parent's cached blocks without taking a lock. */
void cache_forget_after_fork(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    for (int i = 0; i < BRIDGE_MAX_DEVICES; i++) {
        caches[i].lock = fresh;
        caches[i].slots = NULL;
        caches[i].nodes = NULL;
        caches[i].nused = 0;
        caches[i].free_head = caches[i].newest = caches[i].oldest = NONE;
        caches[i].keys = caches[i].live_keys = 0;
        caches[i].held = 0;
        atomic_store(&caches[i].bytes, 0);
    }
}
