/* SPDX-License-Identifier: Apache-2.0 */
/* counts.c: the per-thread copies of the ledger's cumulative figures (see
 * counts.h): made on a thread's first count on a device, listed per device
 * for readers, handed to the spare list at the thread's exit. */
#include "counts.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

__attribute__((visibility("hidden"))) _Thread_local thread_counts **counts_mine BRIDGE_TLS_ONE_LOAD;

/* Every copy of a device, newest first; pushed, never removed (a copy is
 * reused, not freed), so a reader walks it without a lock. */
static _Atomic(thread_counts *) every[BRIDGE_MAX_DEVICES];

/* Copies whose threads ended, per device, linked by `sibling`. */
static pthread_mutex_t spare_lock = PTHREAD_MUTEX_INITIALIZER;
static thread_counts *spare[BRIDGE_MAX_DEVICES];

/* The key whose destructor hands a thread's copies back: its value is the
 * thread's newest copy, the others linked from it by `sibling`. */
static pthread_key_t owner_key;
static pthread_once_t owner_once = PTHREAD_ONCE_INIT;
static int owner_key_ok;

static void thread_ended(void *newest)
{
    /* The thread's table goes first: should one of the thread's later
     * destructors allocate, it attaches a copy again (and a table) and sets
     * the key again (its destructor then runs once more) rather than write
     * a copy another thread may already have taken over. */
    free(counts_mine);
    counts_mine = NULL;
    pthread_mutex_lock(&spare_lock);
    for (thread_counts *c = newest, *next; c; c = next) {
        next = c->sibling;
        c->sibling = spare[c->device];
        spare[c->device] = c;
    }
    pthread_mutex_unlock(&spare_lock);
}

static void make_owner_key(void)
{
    owner_key_ok = pthread_key_create(&owner_key, thread_ended) == 0;
}

thread_counts *counts_attach(int device)
{
    pthread_once(&owner_once, make_owner_key);
    /* Without the key (none left in the process) the table is never freed
     * either: one per such thread. */
    if (!counts_mine && !(counts_mine = calloc(BRIDGE_MAX_DEVICES, sizeof *counts_mine)))
        return NULL;
    pthread_mutex_lock(&spare_lock);
    thread_counts *c = spare[device];
    if (c)
        spare[device] = c->sibling;
    pthread_mutex_unlock(&spare_lock);
    if (!c) {
        /* a line of its own: no two threads' copies share a cache line */
        size_t bytes = (sizeof *c + 63) & ~(size_t)63;
        c = aligned_alloc(64, bytes);
        if (!c)
            return NULL;
        memset(c, 0, bytes);
        c->device = device;
        thread_counts *head = atomic_load_explicit(&every[device], memory_order_relaxed);
        do
            c->next = head;
        while (!atomic_compare_exchange_weak_explicit(&every[device], &head, c,
                                                      memory_order_release, memory_order_relaxed));
    }
    /* Without the key (none left in the process) the copy is never handed
     * back: still counted, one copy per such thread. */
    c->sibling = NULL;
    if (owner_key_ok) {
        c->sibling = pthread_getspecific(owner_key);
        pthread_setspecific(owner_key, c);
    }
    counts_mine[device] = c;
    return c;
}

void counts_sum(int device, uint64_t out[BRIDGE_NTAGS][COUNT_TAG_FIGURES], uint64_t *allocs,
                uint64_t *frees, uint64_t *cache_hits)
{
    uint64_t a = 0, f = 0, h = 0;
    if (out)
        memset(out, 0, sizeof(uint64_t) * BRIDGE_NTAGS * COUNT_TAG_FIGURES);
    for (thread_counts *c = atomic_load_explicit(&every[device], memory_order_acquire); c;
         c = c->next) {
        if (out)
            for (int t = 0; t < BRIDGE_NTAGS; t++)
                for (int k = 0; k < COUNT_TAG_FIGURES; k++)
                    out[t][k] += atomic_load_explicit(&c->tag[t][k], memory_order_relaxed);
        a += atomic_load_explicit(&c->allocs, memory_order_relaxed);
        f += atomic_load_explicit(&c->frees, memory_order_relaxed);
        h += atomic_load_explicit(&c->cache_hits, memory_order_relaxed);
    }
    if (allocs)
        *allocs = a;
    if (frees)
        *frees = f;
    if (cache_hits)
        *cache_hits = h;
}

void counts_forget_after_fork(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    spare_lock = fresh;
}
