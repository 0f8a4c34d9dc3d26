/* SPDX-License-Identifier: Apache-2.0 */
/* carve.h: blocks carved from pool chunks, in front of the pool (carve.c).
 *
 * Off by default (BRIDGE_CACHE_CARVE=1, bridge_set_cache_carve).  When on,
 * an allocation the cache may serve (a stream that outlives its blocks, a
 * tag that is cached, no capture on the device) is carved from a chunk the
 * core took from the pool for that stream, instead of being its own pool
 * block: a request of at most 1 MiB (rounded up to 512 B) from 2 MiB chunks,
 * a larger one from chunks of `share` of the bytes live when the chunk is
 * taken, rounded up to a power of two within [min, max] (a request larger
 * than that: a chunk of its own, rounded up to 2 MiB).  Best fit: the
 * smallest free range of the stream's chunks of its class that holds the
 * request (ties: the oldest chunk, then the lowest offset), the rest of the
 * range left free; a freed block joins its free neighbours.  A chunk with
 * nothing carved from it is kept while its class's empty chunks stay within
 * `keep` (small: `small_keep`) bytes, else the oldest empty one goes back to
 * the pool at once; a flush returns every empty chunk.  The rules are
 * benchmarks/model_cache.py's Carver's, rule for rule (its hits are exact,
 * and its calls to the pool, given to the H200's pool, give this cache's
 * memory: benchmarks/probes/pool_sequence.py).
 *
 * Blocks are ordered as cached blocks are: a range freed on the chunk's
 * stream is carved again by the next request on that stream, after the
 * freed block's work in stream order; a block with streams recorded against
 * it returns to its chunk after the chunk's stream was made to wait for them
 * (alloc.c).  The free ranges are idle bytes like cached blocks (CARVED_FREE;
 * a block's states and their figures: block.h).
 *
 * One lock per device, a leaf: no driver call, no other lock under it.
 */
#ifndef BRIDGE_CARVE_H
#define BRIDGE_CARVE_H

#include <stdint.h>

#include "cache.h"

/* The small class: requests of at most this, from chunks of CHUNK bytes. */
#define BRIDGE_CARVE_SMALL_MAX   (1ull << 20)
#define BRIDGE_CARVE_SMALL_CHUNK (2ull << 20)
/* A request larger than the large class's chunk gets a chunk of its own,
 * rounded up to this. */
#define BRIDGE_CARVE_ROUND       (2ull << 20)
/* Defaults of bridge_set_cache_carve (the best of the carved policies on the
 * four committed traces, measured on the H200's pool: benchmarks/results/probes.md). */
#define BRIDGE_CARVE_SHARE_Q16   (65536u / 8)
#define BRIDGE_CARVE_MIN         (32ull << 20)
#define BRIDGE_CARVE_MAX         (256ull << 20)

/* Segments (BRIDGE_CACHE_SEGMENTS=1, bridge_set_cache_segments): carving with
 * every emptied chunk kept (keep and small_keep unbounded), large chunks of
 * 1/16 of the live bytes within 64-512 MiB, and one release rule instead:
 * carve_make_room before each new chunk.  The rules are
 * benchmarks/model_cache.py's Segments' (policy segments-core), held to it
 * event by event on the committed traces (tests/benchmarks).  Under a budget
 * or a share, alloc.c sizes a new chunk by the room they leave
 * (carve_new_chunk: larger than carve_chunk_least only within half of it).
 * In front of segments (not of carving alone): the carved block a thread
 * allocated last and frees waits in that thread's cache.c slot, still carved
 * (live to this file, idle in the figures: cache.c's parked_carved), until
 * the thread's next allocation takes it back or it comes back here through
 * carve_give (cache.h, cache_park_carved). */
#define BRIDGE_SEGMENTS_SHARE_Q16 (65536u / 16)
#define BRIDGE_SEGMENTS_MIN       (64ull << 20)
#define BRIDGE_SEGMENTS_MAX       (512ull << 20)
#define BRIDGE_SEGMENTS_SLACK_PM  1050u /* 1.05 x the high-water mark */

/* Carving on for the device (relaxed: read on every allocation). */
int carve_on(int device);
/* On (max > 0) or off, and the settings: the large chunks' share of the live
 * bytes (x 65536; 0: always `min`), their least and largest bytes, the empty
 * chunks kept in the large and the small class.  Off: blocks carved before
 * still return to their chunks, and an empty chunk goes back at once. */
void carve_set(int device, uint64_t share_q16, uint64_t min, uint64_t max, uint64_t keep,
               uint64_t small_keep);
/* The empty chunks kept in the large and the small class, leaving the other
 * settings as they are (segments: unbounded unless the user bounds them);
 * the empty chunks past them go to `release` now, oldest first. */
void carve_set_keep(int device, uint64_t keep, uint64_t small_keep, cache_release_fn release);
/* A block of `size` carved for stream `key` from its chunks' free ranges:
 * its address, or 0 when no free range holds it (a chunk is needed). */
uintptr_t carve_take(int device, CUstream key, uint64_t size);
/* The bytes of a new chunk for a request of `size`, `live` bytes being live
 * on the device. */
uint64_t carve_chunk_bytes(int device, uint64_t size, uint64_t live);
/* The least chunk for a request of `size`: the request rounded up to
 * BRIDGE_CARVE_ROUND (for the small class, one small chunk). */
uint64_t carve_chunk_least(uint64_t size);
/* Add a chunk the pool just gave (base, bytes) for stream `key`, and carve
 * `size` (best fit, as carve_take): the block's address; 0 only when the host
 * has no memory for the chunk's bookkeeping (the chunk then goes to
 * `release`, after the lock). */
uintptr_t carve_add(int device, CUstream key, uintptr_t base, uint64_t bytes, uint64_t size,
                    cache_release_fn release);
/* Give back a carved block (its address and requested size); the empty
 * chunks past their class's keep (all of them when `keep_none`) go to
 * `release` after the lock. */
void carve_give(int device, uintptr_t ptr, uint64_t size, int keep_none, cache_release_fn release);
/* The release rule's slack, per mille of the high-water mark (0: no rule,
 * the default; segments: BRIDGE_SEGMENTS_SLACK_PM); the mark starts again
 * from the carved bytes live now. */
void carve_set_slack(int device, uint64_t slack_pm);
/* Before a chunk of `bytes` is taken for a request of `size`: the high-water
 * mark of the carved bytes live (requested sizes) takes in those live now
 * plus `size`; then, while the chunks' bytes + `bytes` exceed slack x that
 * mark and a chunk is empty, the one that emptied first (either class, any
 * stream) goes to `release` after the lock.  A chunk with a block carved
 * from it never does.  Returns the bytes given back; 0 without a slack. */
uint64_t carve_make_room(int device, uint64_t bytes, uint64_t size, cache_release_fn release);
/* The high-water mark of the carved bytes live (never lowered but by a fork). */
uint64_t carve_hwm(int device);
uint64_t carve_slack(int device);
/* Every empty chunk of the device to `release`; returns their bytes. */
uint64_t carve_flush(int device, cache_release_fn release);
/* A stream is forgotten: its empty chunks go to `release`, and nothing is
 * carved from its other chunks again (each goes back when it empties). */
void carve_forget_stream(int device, CUstream key, cache_release_fn release);
/* Bytes of the device's chunks, and of them the idle ones (not carved out
 * to a live block, by the blocks' requested sizes). */
uint64_t carve_held(int device);
uint64_t carve_idle(int device);
/* A fork child forgets every chunk (no lock taken). */
void carve_forget_after_fork(void);

#endif
