/* SPDX-License-Identifier: Apache-2.0 */
/* block.h: a block's life, from the pool back to the pool: its states, who
 * holds it in each, the figures it counts in, the transitions (which
 * function, under which lock, in what stream order) and the invariants.
 * The other files' banners tell their own mechanism and point here for the
 * life of a block; park.h writes out the two words of PARKED and MEMO.
 *
 * A block is a range of device memory the core handed out or will hand out:
 * a pool block of its own (cuMemAllocFromPoolAsync) or a range carved from a
 * segment, a chunk the core took from the pool (carve.c; segments are the
 * default cache).  Its record (records.h) exists while the block is LIVE,
 * PARKED, PARKED_CARVED, GRAPH_LIVE, GRAPH_FREED or IPC_HELD; its flags
 * (REC_*, below) say which rules its frees follow.
 *
 * The figures, per device (device.h):
 *   tag        the tag's `current` and `count` (tag_state): bytes and
 *              allocations live for one framework.  Readers take the parked
 *              blocks out (ledger_tag_live less cache_kept).
 *   cached     cache_bytes: the tiers' lists and the thread slots' plain
 *              blocks (`parked`), the carved blocks parked in slots
 *              (`parked_carved`), and the segments' idle bytes (carve_idle).
 *   graph      `graph_bytes`: graph blocks the user freed, kept for replays.
 *   deferred   num_deferred: the frees DEFERRED and HELD (count, not bytes).
 *   reserved   the budget's figure (checked against `limit` and the share),
 *              with `committed` (what the driver granted): every state but
 *              POOL counts here, a carved block through its segment's bytes.
 *
 * States (holder; figures it counts in besides `reserved` and `committed`):
 *   POOL           the driver's pool, or never allocated: in no figure.
 *   LIVE           handed out: its record in the records table (a shard),
 *                  flags 0, REC_CARVED or REC_UNORDERED.  tag.
 *     MEMO         LIVE, and its owner's memo (alloc.c, a copy of the record)
 *                  valid: the owner's slot's `memo` word names it (park.h).
 *                  A sub-state: the figures are LIVE's.
 *   PARKED         a plain block freed by its owner into that thread's empty
 *                  slot (cache.c) with its record left in the table and the
 *                  slot's `kept` word naming it (park.h); absent to every
 *                  reader of the table.  tag (raw: readers take it out) and
 *                  cached (its tier's `parked`).
 *   SLOT           a plain block in a thread slot without a record.  cached
 *                  (its tier's `parked`).
 *   CACHED         a plain block on cache.c's lists (its tier's order and its
 *                  (stream, size) key's).  cached (its tier's `bytes`).
 *   CARVED_FREE    a range of a segment's free ranges (carve.c): no block any
 *                  more, merged with its free neighbours.  cached (carve_idle).
 *                  A segment none of whose ranges is carved goes back to the
 *                  pool by carve.c's keep or release rule, or a flush.
 *   PARKED_CARVED  a carved block freed by its owner into that thread's slot
 *                  with its record (cache_park_carved), still carved out of its
 *                  segment; in no tier, no cap holds it, and it lives until
 *                  its owner's next allocation.  tag (raw) and cached
 *                  (`parked_carved`).
 *   HELD_BACK      a carved free that must wait (alloc.c's hold_back list,
 *                  under pending_lock): a capture of its stream runs, a stream
 *                  recorded against it could not be ordered before the
 *                  segment's, or it is REC_UNORDERED and no device-wide
 *                  synchronization could be made.  No record; in no tag and
 *                  not cached (the range is still carved).
 *   DEFERRED       a free to the pool that waits for the capture of its stream
 *                  to end (ledger_defer: device_state's `deferred`, under
 *                  capture_lock).  No record.  deferred.
 *   HELD           the free of a REC_UNORDERED block to the pool, waiting for a
 *                  device-wide synchronization (ledger_hold: `held`, under
 *                  capture_lock): a released graph pool's blocks among them.
 *                  No record.  deferred.
 *   GRAPH_LIVE     LIVE with REC_GRAPH: allocated for a graph pool (graph.c),
 *                  outside the capture, on the side stream.  tag.
 *   GRAPH_FREED    REC_GRAPH | REC_USER_FREED: freed by the user, its record
 *                  kept (replays may still write it), on its pool's free list
 *                  (capture_lock) unless a stream was recorded against it.
 *                  graph.
 *   IPC_HELD       LIVE, freed by its owner while another process holds it
 *                  (ipc.c's `freed`, under serve_lock): nothing else changed,
 *                  its free runs when the last hold drops.  tag (the owner's
 *                  ledger alone counts it).
 * A reservation in flight (ledger_reserve to the driver's answer) counts in
 * the tag's `current` and in `reserved` before it is a block (not yet in
 * `committed` nor the tag's `count`).
 *
 * Transitions (the function; the lock; the stream order):
 *   POOL -> LIVE          ledger_alloc (obtain_uncached, retry_alloc):
 *                         reserve, the pool's allocation on the allocating
 *                         stream (a capture's: the side stream, synchronized),
 *                         commit, records_insert (shard lock), then MEMO
 *                         (memo_set).  A refusal runs the recovery chain and
 *                         the wait (wait.c) before it stands.
 *   POOL -> CARVED_FREE   ledger_alloc_chunk, carve_add (carve lock): a new
 *                         segment for the allocating stream, in no tag.
 *   CARVED_FREE -> LIVE   carve_take / carve_add (carve lock), adopt_carved:
 *                         ledger_adopt (tag cap, records_insert: shard lock).
 *                         Ordered: only the segment's stream carves from it.
 *   LIVE -> CARVED_FREE   bridge_free: records_take (shard lock),
 *                         ledger_count_free, carved_free: carve_give (carve
 *                         lock) once the segment's stream is made to wait for
 *                         the recorded streams, or after a device-wide
 *                         synchronization for REC_UNORDERED; else HELD_BACK.
 *   LIVE -> HELD_BACK     carved_free when carved_return must wait (above):
 *                         hold_back (pending_lock).
 *   HELD_BACK -> CARVED_FREE  retry_held_back, once no capture runs on the
 *                         device: the next carved free or allocation, a
 *                         capture's end (graph.c: ledger_captures_ended, which
 *                         tells alloc.c's captures_ended).
 *   LIVE -> PARKED        bridge_free / bridge_free_cached of the block in
 *                         MEMO: memo_claim, cache_park (no lock: the slot's
 *                         `kept` set, then its `ptr` released),
 *                         ledger_count_parked.  Only with flags 0, no capture
 *                         and no deferred free on the device, a cacheable
 *                         block (cacheable()).
 *   LIVE -> PARKED_CARVED the same for REC_CARVED with segments:
 *                         cache_park_carved (the slot's carved block, if any,
 *                         goes back to its segment first).
 *   PARKED -> LIVE,
 *   PARKED_CARVED -> LIVE the owner's next allocation of its key and tag:
 *                         take_cached_plain, cache_take_back (a CAS of the
 *                         slot), readopt_memo / ledger_readopt (`kept`
 *                         cleared): no lock, no shared figure changed.  A
 *                         plain one also through cache_take (*kept).
 *   PARKED -> (as SLOT)   anyone but its owner's allocation that takes it
 *                         out of its slot (a flush, an eviction, a free into
 *                         the occupied slot, another thread's cache_take):
 *                         detach_parked, records_take_parked with
 *                         ledger_unpark (shard lock, no cache lock held);
 *                         then on as a SLOT block (the lists, the pool, or
 *                         LIVE for the other thread).
 *   PARKED_CARVED -> CARVED_FREE  carved_leaves_slot (the carved-return
 *                         hook; no cache lock held): records_take_parked,
 *                         then carved_free.  At a flush, a stream's end, the
 *                         owner's allocation that does not take it back
 *                         (cache_release_mine_carved), a plain free into the
 *                         slot, the owner's exit, segments off.
 *   LIVE -> SLOT/CACHED   bridge_free: records_take (shard lock),
 *                         ledger_count_free, cache_put (an empty slot with no
 *                         lock, or the cache lock); bridge_free_cached:
 *                         cache_or_keep, cache_put_no_evict under the shard
 *                         lock.  Only a cacheable block (no recorded stream,
 *                         not REC_UNORDERED, its tag cached, a stream that
 *                         outlives it).
 *   SLOT/CACHED -> LIVE   cache_take (a CAS of a slot, or the cache lock),
 *                         adopt_cached: ledger_adopt (shard lock).  Ordered:
 *                         the same (stream, size) key only, no event.
 *   SLOT/CACHED -> POOL   an eviction (cache_put, cache_trim:
 *                         release_evicted), a flush (flush_cache,
 *                         cache_flush_stream at a stream's end): the blocks
 *                         out under the cache lock, ledger_release after it
 *                         (DEFERRED during a capture of its stream, as LIVE's).
 *   LIVE -> POOL          ledger_release: issue_free on the block's stream
 *                         (free_key), after every recorded stream
 *                         (stream_order_after_recorded; else the legacy
 *                         stream), then settle (committed, then reserved;
 *                         wakes the waiters).  A capture of its stream, or
 *                         issue_free that must wait: DEFERRED instead;
 *                         REC_UNORDERED: HELD.
 *   LIVE -> DEFERRED      bridge_free during a capture of its stream, or
 *                         ledger_release when issue_free must wait:
 *                         ledger_defer (capture_lock).
 *   DEFERRED -> POOL      ledger_flush_deferred (capture_lock, no capture
 *                         active): on its stream, or on the side stream after
 *                         the event that marked a short-lived stream.
 *   LIVE -> HELD          ledger_release / ledger_defer of a REC_UNORDERED
 *                         block: ledger_hold (capture_lock).
 *   HELD -> POOL          ledger_settle_held: cuCtxSynchronize, then the free
 *                         on the side stream (the refusal path's
 *                         give_back_held, ledger_trim).
 *   POOL/CACHED -> GRAPH_LIVE  an allocation for a graph pool
 *                         (bridge_alloc_graph, a CuPy capture's stream):
 *                         obtain with REC_GRAPH, a block freed before the
 *                         capture on its stream (cache_take) or the pool's,
 *                         on the side stream.
 *   GRAPH_LIVE -> GRAPH_FREED  bridge_free: records_take's keep_graph_block
 *                         (shard lock: the flag, ledger_count_free,
 *                         graph_bytes), graph_block_freed (capture_lock).
 *   GRAPH_FREED -> GRAPH_LIVE  graph_reuse (capture_lock, then the shard lock:
 *                         adopt_block), bridge_graph_adopt: ledger_count_reuse.
 *                         Ordered: the same pool and stream, capture order.
 *   GRAPH_* -> LIVE/HELD/POOL  the pool's release (release_pool: capture_lock,
 *                         records_sweep's shard locks in the same step): the
 *                         live ones become LIVE (REC_UNORDERED where a graph
 *                         may replay), the user-freed ones leave the table and
 *                         graph_bytes and go to ledger_release (HELD where a
 *                         graph may replay, else on the legacy stream after
 *                         the capture stream).
 *   LIVE -> IPC_HELD      bridge_free while ipc_held (serve_lock): the free
 *                         is taken over, nothing counted.
 *   IPC_HELD -> (free)    the last hold drops (a DROP, a closed connection):
 *                         bridge_free again, as from LIVE.
 *
 * Locks, outer to inner: serve_lock (ipc.c) and capture_lock (device.h)
 * before a records shard lock; a shard lock before the cache lock
 * (cache_or_keep); the carve lock and pending_lock are leaves.  Neither a
 * detach nor a carved return runs under the cache lock.
 *
 * Invariants.
 *   Never handed out twice: a block is in one state at a time, and every
 *     way out of a state is one atomic step: a record's insert and take under
 *     its shard lock (a second free finds none: num_bad_frees), a slot's CAS
 *     of `ptr` (to 0 or SLOT_BUSY), a list's pop under the cache lock, a
 *     range under the carve lock, a graph pool's free list and its records
 *     under capture_lock and their shard locks.  Where the host
 *     has no memory to remember a block (DEFERRED, HELD, HELD_BACK), it
 *     stays counted and is lost to reuse (num_driver_errors,
 *     num_order_fallbacks), never freed out of order nor handed out again.
 *   A free never raises: bridge_free returns nothing; unknown pointers and
 *     double frees are counted (num_bad_frees), driver errors counted
 *     (num_driver_errors) and the free retried on the legacy stream or
 *     DEFERRED.
 *   Counted once: a byte is in `reserved` from its reservation to its
 *     settle (a carved block's through its segment), in a tag only while
 *     LIVE, GRAPH_LIVE or IPC_HELD (PARKED and PARKED_CARVED stay in the raw
 *     figure, and every reader takes them out: cache_kept), in `cached` only while PARKED, SLOT,
 *     CACHED, PARKED_CARVED or CARVED_FREE, in graph_bytes only while
 *     GRAPH_FREED.  A block another process holds stays in its owner's
 *     ledger alone.
 *   Stream order: a block is reused without an event only on its own stream
 *     key (SLOT, CACHED, PARKED, a segment's ranges) or its graph pool's
 *     stream; a block with recorded streams is never cached (a carved one
 *     goes back to its segment after them), and its free waits for them; a REC_UNORDERED block waits for a device-wide
 *     synchronization.
 */
#ifndef BRIDGE_BLOCK_H
#define BRIDGE_BLOCK_H

/* A record's flags (record.flags): the rules its block's states follow. */
#define REC_GRAPH      1u /* owned by a captured graph until it is released */
#define REC_USER_FREED 2u /* graph block the user has freed (memory kept) */
#define REC_CARVED     4u /* carved from a chunk (carve.c): its free returns it there */
/* A stream that used it may be gone at the free and is non-blocking, or a
 * released graph pool's block (a replay may still use it on any stream): only
 * a device-wide synchronization orders its free (ledger_hold). */
#define REC_UNORDERED  8u

#endif
