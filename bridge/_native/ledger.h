/* SPDX-License-Identifier: Apache-2.0 */
/* ledger.h: the ledger (ledger.c; internal): per-device pools, the budget,
 * allocation from the pool and free to it, and the one table through which
 * the ledger asks and tells the parts above it.
 *
 * The core's floors (docs/design.md, "The C core's map"): device.c, then
 * streams.c (and views.c), then ledger.c; wait.c and graph.c above it, then
 * alloc.c, the allocation entry points, which calls them all; share.c and
 * managed.c on top.  Nothing here is part of the library's interface
 * (bridge.h is).
 */
#ifndef BRIDGE_LEDGER_H
#define BRIDGE_LEDGER_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "bridge.h"
#include "device.h"
#include "driver.h"
#include "records.h"
#include "streams.h"

/* ---- ledger.c ---- */
/* The device's state, set up on first use (a device outside unify's list:
 * its default pool, no budget); NULL with *rc set when it cannot be. */
device_state *device_use(int device, int *rc);
/* Reserve budget bytes for a tag: BRIDGE_OK or the limit that refused
 * (managed.c; ledger_alloc for pool blocks). */
int ledger_reserve(device_state *d, int tag, uint64_t size);
/* The same for memory that may be larger than the device (managed memory,
 * which the driver pages in and out): the caller bounds `size` so that the
 * sums cannot wrap. */
int ledger_reserve_oversubscribed(device_state *d, int tag, uint64_t size);
/* A new block from the pool for `want` (its size, tag, stream key, flags and
 * graph ids; ptr ignored): reserved on the budget, allocated on `stream`, or
 * on the device's side stream and complete when `side` (a capture runs on
 * the stream), committed, recorded and counted; *out set.  BRIDGE_OK, the
 * limit that refused, BRIDGE_E_OOM or BRIDGE_E_DRIVER.  The device's context
 * is current; any capture mode (the pool call runs relaxed). */
int ledger_alloc(device_state *d, const record *want, CUstream stream, int side, void **out);
/* A chunk of `size` from the pool for the carved blocks (carve.c), on
 * `stream`: reserved on the budget (in no tag: its bytes are idle until
 * carved) and committed, with no record; *out set.  BRIDGE_OK, the limit that
 * refused, BRIDGE_E_OOM or BRIDGE_E_DRIVER.  The device's context is current. */
int ledger_alloc_chunk(device_state *d, uint64_t size, CUstream stream, uintptr_t *out);
/* The bytes the device's reservations may still grow by: the budget's room
 * (what others hold in the pool counted: one driver call) and the share's
 * (share_room), the smaller; UINT64_MAX under neither.  A figure of the
 * moment for sizing a chunk; the reservation decides. */
uint64_t ledger_room(device_state *d);
/* A block already on the budget (the cache's), handed to rec->tag: the tag's
 * cap checked, the record inserted and counted, *out set.  Refused
 * (BRIDGE_E_TAG_LIMIT, or BRIDGE_E_OOM: no host memory for the record): the
 * block went back to the pool, or for a carved one (REC_CARVED) is the
 * caller's to give back. */
int ledger_adopt(device_state *d, const record *rec, void **out);
/* ledger_adopt for a block whose record is in the table already (parked with
 * it, park.h, and still in the tag's `current` and `count`): the tag's cap
 * checked, the block live again (its `kept` word cleared), the peaks and the
 * counts (a cache hit among them); no insert, no shared figure changed.
 * BRIDGE_E_TAG_LIMIT (nothing changed) past the tag's cap. */
int ledger_readopt(device_state *d, const record *rec);
/* A parked block's record taken out of the table (records_take_parked's
 * `taken`, under the shard lock, before its `kept` word is cleared): its
 * bytes and allocation out of the tag's figures. */
void ledger_unpark(const record *rec);
/* The tag's live bytes and allocations (either may be NULL): `current` and
 * `count` less the blocks parked with their records (cache_kept). */
void ledger_tag_live(device_state *d, int tag, uint64_t *bytes, int64_t *count);
/* A block whose record is live again for `tag` (a graph pool's, reused):
 * the tag's bytes, peak and counts. */
void ledger_count_reuse(device_state *d, int tag, uint64_t size);
/* Count a free on the framework's figures (the memory itself may live on). */
void ledger_count_free(device_state *d, const record *rec);
/* Count an allocation on the framework's figures (after the record exists). */
void ledger_count_alloc(device_state *d, int tag, uint64_t size);
/* The same for a block ledger_reserve reserved and the driver granted: the
 * tag's byte peak raised too (ledger_reserve leaves it: a refused block was
 * never live). */
void ledger_count_granted(device_state *d, int tag, uint64_t size);
/* Give the block back to the pool now if its streams allow it, else defer it
 * until they do; the ledger is settled when the driver free is issued. */
void ledger_release(device_state *d, const record *rec);
/* A REC_UNORDERED block's free (a block of a stream the core cannot name,
 * or of a released graph pool): held (its bytes still counted) until a
 * device-wide synchronization orders it (ledger_settle_held). */
void ledger_hold(device_state *d, const record *rec);
/* Synchronize the device's context (unless a capture the core knows of
 * runs: then nothing) and issue the held frees: how many were issued. */
int ledger_settle_held(device_state *d);
/* One synchronization of the device's context, in relaxed capture mode and
 * never during a capture the core knows of: 1 when it was made. */
int ledger_sync_device(device_state *d);
/* Hold a free back until no capture runs on its stream. */
void ledger_defer(device_state *d, const record *rec);
/* The capture of `key` (a stream alive now, that may be destroyed soon
 * after) ended: mark the point of the stream for the frees deferred on it,
 * which are then issued on the side stream after it, never on the handle. */
void ledger_mark_deferred(device_state *d, CUstream key);
/* Issue the frees deferred earlier whose streams allow it now. */
void ledger_flush_deferred(device_state *d);
/* The pool trimmed to `keep` after the deferred frees and the frees in
 * flight landed (bridge_trim, after the cache went back). */
int ledger_trim(device_state *d, uint64_t keep);

/* A free that parks its block with its record: the accumulated figures
 * only (the block stays in `current` and `count` while parked, park.h). */
static inline void ledger_count_parked(const record *rec)
{
    counts_free(rec->device, rec->tag, rec->size);
}

/* A free's accumulated figures (ledger_count_free less the tag's current bytes). */
static inline void ledger_count_freed(device_state *d, const record *rec)
{
    counts_free(rec->device, rec->tag, rec->size);
    atomic_fetch_sub_explicit(&d->tag[rec->tag].count, 1, RELAXED);
}

/* Threads waiting on each device (wait.c raises and lowers it).  A free that
 * settles reads it (seq_cst, after its seq_cst decrement of `reserved`), a
 * waiter raises it before its first retry: a free is either seen by the
 * retry or wakes the waiter. */
extern _Atomic int wait_count[BRIDGE_MAX_DEVICES];

/* ---- the parts above the ledger, as the ledger calls them ----
 * The ledger names no file above it: it asks and tells them through this
 * table, a direct call through a function pointer each.  alloc.c fills
 * `freed` and `forget_after_fork` when the library is loaded; share.c fills
 * its three at its first join, before any device's `share` is set (the
 * ledger calls them only for a device whose `share` it read set). */
typedef struct ledger_parts {
    /* The ledger of `device` went down while a thread waits (wait_freed). */
    void (*freed)(int device);
    /* The share's claim around a growth of the pool (share.h). */
    int (*reserve_growth)(device_state *d, share_member *m, uint64_t size);
    void (*settle_growth)(device_state *d, share_member *m, uint64_t size, int granted);
    void (*pool_trimmed)(device_state *d, share_member *m);
    /* The bytes the share lets this process's pool grow by now. */
    uint64_t (*room)(device_state *d, share_member *m);
    /* A fork child: the parts above forget the parent's state (no lock). */
    void (*forget_after_fork)(void);
    /* The device's last capture ended: what the parts above held back for it
     * can go (no lock of the core held). */
    void (*captures_ended)(device_state *d);
} ledger_parts;
/* graph.c, as a device's last capture ends: the frees deferred for it issued
 * (ledger_flush_deferred), then the parts above told. */
void ledger_captures_ended(device_state *d);
/* Copy the entries of `parts` that are not NULL into the ledger's table. */
void ledger_listen(const ledger_parts *parts);

#endif /* BRIDGE_LEDGER_H */
