/* SPDX-License-Identifier: Apache-2.0 */
/* records.c: sharded open-addressing table of live allocations. */
#include "records.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define NSHARDS 64 /* power of two */
#define EMPTY   ((uintptr_t)0)
#define TOMB    ((uintptr_t)1)

typedef struct shard {
    pthread_mutex_t lock;
    record *slots; /* cap entries; NULL until the first insert */
    size_t cap;    /* power of two, or 0 */
    size_t count;  /* live records */
    size_t tombs;  /* tombstones; count + tombs <= cap / 2 after an insert */
} shard;

static shard shards[NSHARDS] = {
#define S1                                       \
    {                                            \
        PTHREAD_MUTEX_INITIALIZER, NULL, 0, 0, 0 \
    }
#define S4  S1, S1, S1, S1
#define S16 S4, S4, S4, S4
    S16, S16, S16, S16
#undef S16
#undef S4
#undef S1
};

/* Whether r's block waits in its thread's slot with r kept: then r is absent. */
static inline int parked(const record *r)
{
    return r->park && atomic_load_explicit(&r->park->kept, memory_order_acquire) == r->ptr;
}

/* r is about to be taken or may change: its thread's copy is no longer the
 * table's (park.h's memo), so that thread's free reads the table.  A load
 * first: no locked instruction unless the word names r. */
static inline void forget_memo(const record *r)
{
    uintptr_t p = r->ptr;
    if (r->park && atomic_load_explicit(&r->park->memo, memory_order_relaxed) == p)
        atomic_compare_exchange_strong(&r->park->memo, &p, 0);
}

/* Pool pointers are aligned (to 512 B, and to 2 MiB for large blocks): a
 * multiplicative hash spreads them only in its HIGH bits.  The shard comes
 * from the top 6 bits, the slot from the next ones (a slot index from the
 * low bits piled 64 MiB-strided pointers onto a few slots). */
static inline uint64_t mix(uintptr_t p)
{
    return (uint64_t)p * 0x9E3779B97F4A7C15ull;
}

static inline shard *shard_of(uint64_t h)
{
    return &shards[h >> 58];
}

static inline size_t slot_index(uint64_t h, size_t mask)
{
    return (size_t)(h >> 6 >> 20) & mask;
}

/* Slot of ptr in s, or of the first free slot on its probe path (insert). */
static record *probe(shard *s, uintptr_t ptr, uint64_t h, int for_insert)
{
    size_t mask = s->cap - 1;
    record *first_tomb = NULL;
    for (size_t i = slot_index(h, mask);; i = (i + 1) & mask) {
        record *r = &s->slots[i];
        if (r->ptr == ptr)
            return r;
        if (r->ptr == TOMB) {
            if (!first_tomb)
                first_tomb = r;
        } else if (r->ptr == EMPTY) {
            if (!for_insert)
                return NULL;
            return first_tomb ? first_tomb : r;
        }
    }
}

static int grow(shard *s)
{
    size_t ncap = s->cap ? s->cap : 64;
    while ((s->count + 1) * 4 > ncap) /* keep live records under 1/4 */
        ncap *= 2;
    record *slots = calloc(ncap, sizeof *slots);
    if (!slots)
        return -1;
    record *old = s->slots;
    size_t ocap = s->cap;
    s->slots = slots;
    s->cap = ncap;
    s->tombs = 0;
    for (size_t i = 0; i < ocap; i++)
        if (old[i].ptr > TOMB)
            *probe(s, old[i].ptr, mix(old[i].ptr), 1) = old[i];
    free(old);
    return 0;
}

int records_insert(const record *r)
{
    uint64_t h = mix(r->ptr);
    shard *s = shard_of(h);
    pthread_mutex_lock(&s->lock);
    if ((s->count + s->tombs + 1) * 2 > s->cap && grow(s) != 0) {
        pthread_mutex_unlock(&s->lock);
        return -1;
    }
    record *slot = probe(s, r->ptr, h, 1);
    if (slot->ptr == TOMB)
        s->tombs--;
    *slot = *r;
    s->count++;
    pthread_mutex_unlock(&s->lock);
    return 0;
}

/* The record of ptr with its shard's lock taken (*sp), when it is there and
 * parked as `want_parked` says; NULL, the lock given back, otherwise.  Its
 * thread's memo word is cleared: the caller takes or may change it. */
static record *find_locked(uintptr_t ptr, int want_parked, shard **sp)
{
    if (ptr <= TOMB)
        return NULL;
    uint64_t h = mix(ptr);
    shard *s = shard_of(h);
    pthread_mutex_lock(&s->lock);
    record *slot = s->cap ? probe(s, ptr, h, 0) : NULL;
    if (!slot || parked(slot) != want_parked) {
        pthread_mutex_unlock(&s->lock);
        return NULL;
    }
    forget_memo(slot);
    *sp = s;
    return slot;
}

/* The record at `slot` out of its shard (the lock held). */
static void remove_locked(shard *s, record *slot)
{
    memset(slot, 0, sizeof *slot);
    slot->ptr = TOMB;
    s->count--;
    s->tombs++;
}

int records_take(uintptr_t ptr, record *out, int (*keep)(record *r))
{
    shard *s;
    record *slot = find_locked(ptr, 0, &s);
    if (!slot)
        return -1;
    int kept = keep ? keep(slot) : 0;
    *out = *slot;
    if (!kept)
        remove_locked(s, slot);
    pthread_mutex_unlock(&s->lock);
    return kept;
}

int records_update(uintptr_t ptr, int (*fn)(record *r, void *arg), void *arg)
{
    shard *s;
    record *slot = find_locked(ptr, 0, &s);
    if (!slot)
        return -1;
    int rc = fn(slot, arg);
    pthread_mutex_unlock(&s->lock);
    return rc;
}

void records_sweep(int (*fn)(record *r, void *arg), void *arg)
{
    for (int k = 0; k < NSHARDS; k++) {
        shard *s = &shards[k];
        pthread_mutex_lock(&s->lock);
        for (size_t i = 0; i < s->cap; i++) {
            record *r = &s->slots[i];
            if (r->ptr <= TOMB || parked(r))
                continue;
            forget_memo(r);
            if (fn(r, arg))
                remove_locked(s, r);
        }
        pthread_mutex_unlock(&s->lock);
    }
}

/* The records that are parked (park.h) or, parked 0, the others: a walk of
 * every shard (diagnostics only, so the hot path keeps no count of them). */
static uint64_t count_records(int parked_ones)
{
    uint64_t n = 0;
    for (int k = 0; k < NSHARDS; k++) {
        shard *s = &shards[k];
        pthread_mutex_lock(&s->lock);
        for (size_t i = 0; i < s->cap; i++)
            if (s->slots[i].ptr > TOMB && parked(&s->slots[i]) == parked_ones)
                n++;
        pthread_mutex_unlock(&s->lock);
    }
    return n;
}

uint64_t records_count(void)
{
    return count_records(0);
}

uint64_t records_parked(void)
{
    return count_records(1);
}

int records_take_parked(uintptr_t ptr, record *out, void (*taken)(const record *r))
{
    shard *s;
    record *slot = find_locked(ptr, 1, &s);
    if (!slot)
        return -1;
    *out = *slot;
    remove_locked(s, slot);
    /* before the word: a reader of the tag's figures may take the block out
     * twice for a moment, never count it twice */
    taken(out);
    /* absent now by the table itself: the slot's word may name another block */
    uintptr_t p = ptr;
    atomic_compare_exchange_strong(&out->park->kept, &p, 0);
    pthread_mutex_unlock(&s->lock);
    return 0;
}

int records_add_stream(record *r, CUstream s)
{
    for (uint16_t i = 0; i < r->nrec; i++)
        if (r->recs[i] == s)
            return 0;
    if (r->nrec == UINT16_MAX)
        return -1;
    CUstream *n = realloc(r->recs, (r->nrec + 1u) * sizeof *n);
    if (!n)
        return -1;
    n[r->nrec++] = s;
    r->recs = n;
    return 0;
}

/* A fork child forgets the parent's records without taking a lock. */
void records_forget_after_fork(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    for (int k = 0; k < NSHARDS; k++)
        shards[k] = (shard){fresh, NULL, 0, 0, 0};
}
