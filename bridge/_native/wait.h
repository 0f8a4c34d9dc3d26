/* SPDX-License-Identifier: Apache-2.0 */
/* wait.h: waiting for memory others free (wait.c); internal.
 *
 * The device allocation path calls in at two places: bridge_alloc's refusal path (alloc.c:
 * wait_for_room, the recovery chain's last two steps) and the ledger's settle
 * (wait_freed, through ledger_parts, when a free lowered the ledger while
 * somebody waits: wait_count, ledger.h). */
#ifndef BRIDGE_WAIT_H
#define BRIDGE_WAIT_H

#include "ledger.h"

/* A refusal that will not wait (a framework cap, a graph pool): the thread's
 * last wait is "none", so its OOM message tells no earlier wait. */
void wait_refused(void);

/* A refused graph request (a capture's pool, a MemPool): it never waits, and
 * the thread's last wait says why where a wait was due (BRIDGE_WAIT_CAPTURE
 * while a capture runs on the device, BRIDGE_WAIT_HOPELESS), else none. */
void wait_refused_graph(device_state *d, size_t size);

/* The ledger of `device` went down: wake its waiters. */
void wait_freed(int device);

/* One more try of the refused allocation (alloc.c: what the core holds back
 * to the pool, then reserve and allocate); a bridge_status.  `flags`:
 *   WAIT_RETRY_RELIEVE  the frameworks are asked to release what they cache
 *                       first (the pressure hook, BRIDGE_RELIEVE_CACHES; with
 *                       WAIT_RETRY_COLLECT, BRIDGE_RELIEVE_ALL: their garbage
 *                       collection too), and the waiter's stream is
 *                       synchronized; when they release nothing the try is
 *                       skipped and the last refusal stands;
 *   WAIT_RETRY_FREED    a free settled since the last try: the waiter's own
 *                       stream is synchronized first (not during a capture),
 *                       so that frees issued on it (the stream a producer and
 *                       its consumer share) are really back in the pool;
 *   WAIT_RETRY_COLLECT  (alone) the pressure hook's garbage collection runs
 *                       first (BRIDGE_RELIEVE_COLLECT), once a wait: past the
 *                       grace, or before the wait ends in a refusal. */
enum { WAIT_RETRY_FREED = 1, WAIT_RETRY_COLLECT = 2, WAIT_RETRY_RELIEVE = 4 };
typedef int (*wait_retry_fn)(void *ctx, int flags, void **out);

/* The end of bridge_alloc's refusal path: `rc` is the refusal after the
 * core gave back what it held.  First one try after the frameworks' relief
 * (WAIT_RETRY_RELIEVE; with their garbage collection unless this thread
 * will wait, whose wait runs it later, once), then the wait for room as the
 * calling thread's setting says (its wait time above 0, no capture on the
 * device, a request a free could satisfy), retrying with `retry`.  BRIDGE_OK
 * with *out set, else the last refusal.  Needs no context and no lock held. */
int wait_for_room(device_state *d, int device, size_t size, int rc, wait_retry_fn retry, void *ctx,
                  void **out);

/* The calling thread's wait in progress: a number unique to it, 0 outside
 * wait_for_room's retries (share.c asks the other members once per wait). */
uint64_t wait_current(void);
/* The calling thread's refused allocation: a number that changes when one
 * ends (wait_chain_end: alloc.c's obtain after its recovery chain, managed.c
 * after a refusal), so that share.c asks the other members once per
 * allocation, not once per second. */
uint64_t wait_chain(void);
void wait_chain_end(void);

void wait_fill_stats(int device, bridge_stats *out);
/* A fork child: no waiter, fresh lock (no lock taken). */
void wait_forget_after_fork(void);

#endif /* BRIDGE_WAIT_H */
