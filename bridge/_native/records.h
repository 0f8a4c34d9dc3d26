/* SPDX-License-Identifier: Apache-2.0 */
/* records.h: the table of live allocations (records.c).
 *
 * Every pointer the core hands out has one record until it is freed; a free
 * of a pointer without a record is a double free or a foreign pointer.  The
 * states in which a block has its record, and the flags: block.h.  The
 * table is split into shards, each an open-addressing hash table under its own
 * mutex, so threads freeing different pointers rarely meet.
 */
#ifndef BRIDGE_RECORDS_H
#define BRIDGE_RECORDS_H

#include <pthread.h>
#include <stdint.h>

#include "block.h"
#include "driver.h"
#include "park.h"

typedef struct record {
    uintptr_t ptr;   /* key; 0 = empty slot, 1 = tombstone */
    uint64_t size;   /* bytes, as requested */
    CUstream stream; /* the allocating stream; frees are ordered on it */
    int32_t device;
    uint8_t tag;             /* enum bridge_tag */
    uint8_t flags;           /* REC_* (block.h) */
    uint16_t nrec;           /* streams recorded against the block (recs[]) */
    CUstream *recs;          /* malloc'd, nrec entries; NULL when nrec == 0 */
    uint64_t graph0, graph1; /* graph pool id when REC_GRAPH */
    unsigned long owner;     /* the allocating thread (pthread_self), for wait.c's
                            check that every thread holding memory is waiting */
    park_words *park;        /* the allocating thread's slot's words (park.h); NULL: none */
} record;

/* A record whose block waits in its thread's slot with the record kept
 * (park.h) is absent to every call below but records_take_parked: taken,
 * updated and looked up it is unknown, a sweep passes over it, the count
 * leaves it out.  Every call that takes or may change a record clears its
 * thread's memo word first. */

/* Insert a record (ptr must not be present).  0 on success, -1 when the host
 * is out of memory. */
int records_insert(const record *r);
/* Remove the record of ptr into *out.  0 when found, -1 when unknown.
 * When `keep` is given and returns nonzero for the record, the record stays
 * in the table (keep may change it, not its key), *out gets its changed copy
 * and keep's result is returned.  One step under the shard lock: no other
 * thread ever sees a kept record missing (a graph block freed by the user
 * while its graph is released, see bridge_free). */
int records_take(uintptr_t ptr, record *out, int (*keep)(record *r));
/* Call fn on the record of ptr under its shard's lock; fn may change it (not
 * its key).  Returns fn's result, or -1 when unknown. */
int records_update(uintptr_t ptr, int (*fn)(record *r, void *arg), void *arg);
/* Visit every record; fn returns 1 to remove the record (copied to the visitor
 * first), 0 to keep it.  Used by rare paths only (graph release). */
void records_sweep(int (*fn)(record *r, void *arg), void *arg);
/* Number of live records, parked ones left out (a walk of the table:
 * diagnostics and tests). */
uint64_t records_count(void);
/* The record of a block parked with its record (park.h), out of the table
 * into *out, `taken` called with it (under the shard lock, before the slot's
 * `kept` word is cleared), and that word cleared: 0, or -1 when ptr is not
 * parked so.  For whoever takes a parked block out of its slot, other than
 * its owner taking it back live. */
int records_take_parked(uintptr_t ptr, record *out, void (*taken)(const record *r));
/* Records parked so, now (a walk of the table: diagnostics and tests). */
uint64_t records_parked(void);
/* Add `s` to the streams recorded against r (recs[]) unless it is there:
 * 0, or -1 when there is no host memory or no room (r unchanged).  The
 * caller holds r's shard lock (records_update's fn). */
int records_add_stream(record *r, CUstream s);
/* A fork child forgets every record (no lock taken). */
void records_forget_after_fork(void);

/* The calling thread, as records remember it: pthread_self (on Linux what
 * Python's threading.get_ident() says).  On x86-64 glibc that is the thread
 * pointer itself (%fs:0), read inline: the allocation path pays no call. */
static inline unsigned long thread_self(void)
{
#if defined(__x86_64__) && defined(__GLIBC__) && defined(__GNUC__) && !defined(__clang__)
    return (unsigned long)__builtin_thread_pointer();
#else
    return (unsigned long)pthread_self();
#endif
}

#endif
