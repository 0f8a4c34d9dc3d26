/* SPDX-License-Identifier: Apache-2.0 */
/* cache.c: exact-size, per-stream cache of freed blocks (see cache.h). */
#include "cache.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "bridge.h"

#define SLOT_BITS 12
#define SLOTS     (1u << SLOT_BITS) /* (stream, size) keys per device */
#define DEPTH     16                /* blocks kept per key */

typedef struct slot {
    CUstream stream; /* key part 1 */
    uint64_t size;   /* key part 2; 0 = never used */
    uint32_t n;      /* blocks in ptrs[0..n) */
    uintptr_t ptrs[DEPTH];
} slot;

typedef struct dcache {
    pthread_mutex_t lock;
    slot *slots;                /* SLOTS entries, allocated on first put */
    _Atomic uint64_t bytes;     /* cached bytes; <= limit after every put */
    _Atomic uint64_t limit;     /* cap; 0 = caching off */
    _Atomic uint64_t max_block; /* larger blocks are never cached */
    uint32_t keys;              /* slots with size != 0; <= SLOTS / 2 */
    uint32_t live_keys;         /* slots with n > 0; <= keys */
    int held;                   /* threads waiting for memory (wait.c): while > 0
                                  nothing is cached, freed bytes go to the pool */
} dcache;

#define DEFAULT_LIMIT (1ull << 30)
static dcache caches[BRIDGE_MAX_DEVICES] = {
    [0 ... BRIDGE_MAX_DEVICES - 1] = {PTHREAD_MUTEX_INITIALIZER, NULL, 0, DEFAULT_LIMIT,
                                      BRIDGE_CACHE_MAX_BLOCK, 0, 0, 0}};

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
            c->keys++;
            return sl;
        }
    }
    return NULL;
}

/* Drop the keys whose blocks were all taken again, so new (stream, size)
 * pairs find room.  Only when at most a quarter of the table holds blocks:
 * the next compaction is then SLOTS / 4 new keys away (amortized O(1)). */
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

uintptr_t cache_take(int device, CUstream stream, uint64_t size)
{
    dcache *c = &caches[device];
    if (!atomic_load_explicit(&c->bytes, memory_order_relaxed))
        return 0; /* nothing cached: no lock */
    uintptr_t p = 0;
    pthread_mutex_lock(&c->lock);
    slot *sl = c->slots ? find(c, stream, size, 0) : NULL;
    if (sl && sl->n) {
        p = sl->ptrs[--sl->n];
        if (!sl->n)
            c->live_keys--;
        atomic_fetch_sub_explicit(&c->bytes, size, memory_order_relaxed);
    }
    pthread_mutex_unlock(&c->lock);
    return p;
}

int cache_put(int device, CUstream stream, uint64_t size, uintptr_t ptr)
{
    dcache *c = &caches[device];
    uint64_t limit = atomic_load_explicit(&c->limit, memory_order_relaxed);
    if (!limit || size > atomic_load_explicit(&c->max_block, memory_order_relaxed))
        return 0;
    int kept = 0;
    pthread_mutex_lock(&c->lock);
    if (!c->slots)
        c->slots = calloc(SLOTS, sizeof(slot));
    /* c->held: read under the lock already taken (no cost when nobody waits) */
    if (c->slots && !c->held &&
        atomic_load_explicit(&c->bytes, memory_order_relaxed) + size <= limit) {
        slot *sl = find(c, stream, size, 1);
        if (!sl && compact(c))
            sl = find(c, stream, size, 1);
        if (sl && sl->n < DEPTH) {
            if (!sl->n)
                c->live_keys++;
            sl->ptrs[sl->n++] = ptr;
            atomic_fetch_add_explicit(&c->bytes, size, memory_order_relaxed);
            kept = 1;
        }
    }
    pthread_mutex_unlock(&c->lock);
    return kept;
}

uint64_t cache_flush(int device, cache_release_fn release)
{
    dcache *c = &caches[device];
    if (!atomic_load(&c->bytes))
        return 0;
    /* Take the blocks out under the lock, release them after it. */
    pthread_mutex_lock(&c->lock);
    slot *old = c->slots;
    c->slots = NULL;
    c->keys = 0;
    c->live_keys = 0;
    uint64_t bytes = atomic_exchange(&c->bytes, 0);
    pthread_mutex_unlock(&c->lock);
    if (old) {
        for (uint32_t i = 0; i < SLOTS; i++)
            for (uint32_t k = 0; k < old[i].n; k++)
                release(device, old[i].ptrs[k], old[i].size, old[i].stream);
        free(old);
    }
    return bytes;
}

uint64_t cache_flush_stream(int device, CUstream stream, cache_release_fn release)
{
    dcache *c = &caches[device];
    if (!atomic_load(&c->bytes))
        return 0;
    uintptr_t ptrs[DEPTH];
    uint64_t bytes = 0;
    for (;;) {
        /* one key at a time: take its blocks under the lock, release after */
        uint32_t n = 0;
        uint64_t size = 0;
        pthread_mutex_lock(&c->lock);
        for (uint32_t i = 0; c->slots && i < SLOTS && !n; i++) {
            slot *sl = &c->slots[i];
            if (sl->n && sl->stream == stream) {
                n = sl->n;
                size = sl->size;
                for (uint32_t k = 0; k < n; k++)
                    ptrs[k] = sl->ptrs[k];
                sl->n = 0;
                c->live_keys--;
                atomic_fetch_sub(&c->bytes, size * n);
            }
        }
        pthread_mutex_unlock(&c->lock);
        if (!n)
            return bytes;
        for (uint32_t k = 0; k < n; k++)
            release(device, ptrs[k], size, stream);
        bytes += size * n;
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

/* A fork child forgets the parent's cached blocks without taking a lock. */
void cache_forget_after_fork(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    for (int i = 0; i < BRIDGE_MAX_DEVICES; i++) {
        caches[i].lock = fresh;
        caches[i].slots = NULL;
        caches[i].keys = caches[i].live_keys = 0;
        caches[i].held = 0;
        atomic_store(&caches[i].bytes, 0);
    }
}
