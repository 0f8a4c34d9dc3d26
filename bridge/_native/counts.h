/* SPDX-License-Identifier: Apache-2.0 */
/* counts.h: the ledger's cumulative figures, one copy per thread (counts.c).
 *
 * Seven figures change on every allocation and free and are only ever added
 * to: a tag's allocated and freed bytes and its numbers of allocations and
 * frees, and the device's numbers of allocations, frees and cache hits.  As
 * shared atomics they cost a locked add each, about 29 ns of a ~97 ns cache
 * hit and free (benchmarks/bench_hotpath.py on the CPU).  So each thread
 * keeps its own copy per device, written only by that thread with a plain
 * load and store (relaxed atomics: no locked instruction, and a reader never
 * sees a torn value), and a reader adds the copies up.
 *
 * A copy outlives its thread: at the thread's exit it goes to a spare list,
 * and the next thread that needs one takes it over with its counts, so a sum
 * never loses what an ended thread counted and the copies are as many as the
 * threads alive at once, at most.  A reset writes no copy (another thread may
 * be writing it): it moves the tag's base (tag_state's *_base, ledger.c) to
 * the sum, and the figures read are the sum less the base.
 *
 * Lock order: spare_lock is a leaf.  Neither the hot path nor a reader takes
 * it; only a thread's first count on a device and its exit do.
 */
#ifndef BRIDGE_COUNTS_H
#define BRIDGE_COUNTS_H

#include <stdatomic.h>
#include <stdint.h>

#include "bridge.h"
#include "tls.h"

/* A tag's cumulative figures, in this order in every copy. */
enum { COUNT_ALLOCATED, COUNT_FREED, COUNT_ALLOCS, COUNT_FREES, COUNT_TAG_FIGURES };

typedef struct thread_counts {
    _Atomic uint64_t tag[BRIDGE_NTAGS][COUNT_TAG_FIGURES];
    _Atomic uint64_t allocs, frees, cache_hits; /* the device's */
    struct thread_counts *next;                 /* the device's list of every copy */
    struct thread_counts *sibling;              /* the owner's copy of another device;
                                                   on the spare list, the next spare */
    int device;
} thread_counts;

/* The calling thread's copies, by device (NULL until its first count
 * there): a table on the heap (tls.h), made at its first count, NULL before. */
extern __attribute__((
    visibility("hidden"))) _Thread_local thread_counts **counts_mine BRIDGE_TLS_ONE_LOAD;

/* The calling thread's copy for `device`, made or taken over on first use;
 * NULL only when the host has no memory for one (the count is then lost,
 * never the allocation). */
thread_counts *counts_attach(int device);

static inline thread_counts *counts_of(int device)
{
    thread_counts **t = counts_mine;
    thread_counts *c = t ? t[device] : NULL;
    return c ? c : counts_attach(device);
}

/* *v += by, for a figure only the calling thread writes. */
static inline void counts_add(_Atomic uint64_t *v, uint64_t by)
{
    atomic_store_explicit(v, atomic_load_explicit(v, memory_order_relaxed) + by,
                          memory_order_relaxed);
}

/* One allocation of `size` for `tag` in the copy `c`. */
static inline void counts_alloc_in(thread_counts *c, int tag, uint64_t size)
{
    counts_add(&c->tag[tag][COUNT_ALLOCATED], size);
    counts_add(&c->tag[tag][COUNT_ALLOCS], 1);
    counts_add(&c->allocs, 1);
}

static inline void counts_alloc(int device, int tag, uint64_t size)
{
    thread_counts *c = counts_of(device);
    if (!c)
        return;
    counts_alloc_in(c, tag, size);
}

/* counts_alloc and counts_cache_hit in one (a parked block taken back). */
static inline void counts_alloc_hit(int device, int tag, uint64_t size)
{
    thread_counts *c = counts_of(device);
    if (!c)
        return;
    counts_alloc_in(c, tag, size);
    counts_add(&c->cache_hits, 1);
}

static inline void counts_free(int device, int tag, uint64_t size)
{
    thread_counts *c = counts_of(device);
    if (!c)
        return;
    counts_add(&c->tag[tag][COUNT_FREED], size);
    counts_add(&c->tag[tag][COUNT_FREES], 1);
    counts_add(&c->frees, 1);
}

static inline void counts_cache_hit(int device)
{
    thread_counts *c = counts_of(device);
    if (c)
        counts_add(&c->cache_hits, 1);
}

/* The sums over every copy of `device`: out[tag][figure], and the device's
 * allocations, frees and cache hits (any of the three may be NULL). */
void counts_sum(int device, uint64_t out[BRIDGE_NTAGS][COUNT_TAG_FIGURES], uint64_t *allocs,
                uint64_t *frees, uint64_t *cache_hits);

/* A fork child: the spare list's lock is made anew (the copies stay, with
 * their counts: the figures are the parent's until then, as the ledger's). */
void counts_forget_after_fork(void);

#endif
