/* SPDX-License-Identifier: Apache-2.0 */
/* cache.h: a per-device cache of freed blocks in front of the driver pool.
 *
 * A block freed on stream S is kept, by its exact size, for the next
 * allocation of that size on S: stream order makes the reuse safe without an
 * event, and the allocation costs a lock and a pop instead of two driver
 * calls.  Cached bytes stay counted in the budget (they are the ledger's), and
 * go back to the pool whenever an allocation would fail, on empty_cache /
 * free_all_blocks, and when a cap is passed.  Blocks are cached in two
 * tiers, each with its own least-recently-cached order and cap, and each
 * evicting only its own oldest blocks (so one large block cached does not
 * push out many small ones):
 *
 *     small (size <= small_max): cached_small <= min(limit, max(floor, live * fraction))
 *     large (the others):        cached_large <= min(limit, large_cap)
 *
 * `live` is the bytes the frameworks hold; the limit bounds the two tiers
 * together (each has the room under it that the other leaves).  Defaults:
 * small_max 1 MiB, large_cap 64 MiB, fraction 1/16, floor 64 MiB, the limit
 * set by the ledger at set-up.
 *
 * In front of the shared lists, each thread has one slot per device for the
 * block it freed last (cache.c's thread slots): the newest end of the order
 * of caching, counted in its tier, taken back by that thread's next
 * allocation of the same size and stream, and put there by a free, without
 * the lock.  On one thread the hits and the cached bytes are the lists' own,
 * event for event; a key keeps DEPTH blocks in the lists and, beside them,
 * a thread's newest.  Other threads reach a slot's block when their request
 * misses the lists, and every flush, trim and stream's end reaches it.
 * With segments a slot may hold a carved block instead (cache_park_carved):
 * its owner's alone, in no tier, back to its segment when it leaves.  A
 * block's states here and elsewhere, and their figures: block.h.
 */
#ifndef BRIDGE_CACHE_H
#define BRIDGE_CACHE_H

#include <stdint.h>

#include "driver.h"
#include "park.h"

/* Larger blocks are never cached (default of cache_set_limits' max_block). */
#define BRIDGE_CACHE_MAX_BLOCK          (256ull << 20)
/* Defaults of the cap's floor and fraction of the live bytes (cache_set_share). */
#define BRIDGE_CACHE_FLOOR              (64ull << 20)
#define BRIDGE_CACHE_FRACTION_Q16       (65536u / 16) /* 1/16, in units of 1/65536 */
/* Defaults of the tiers' boundary and of the large tier's cap (cache_set_tiers). */
#define BRIDGE_CACHE_SMALL_MAX          (1ull << 20)
#define BRIDGE_CACHE_LARGE_CAP          (64ull << 20)
/* Default of the large tier's share of the live bytes (cache_set_large_fraction):
 * 1/8.  On the committed traces (benchmarks/model_cache.py) it keeps the hits
 * and lowers peak reserved / peak live most where little is live beside large
 * blocks (CuPy-FFT 1.599 to 1.299 modelled); a single block up to the large
 * cap is always cacheable, so a loop of one large size still hits. */
#define BRIDGE_CACHE_LARGE_FRACTION_Q16 (65536u / 8)
/* Most blocks one cache_put or cache_trim hands back for eviction. */
#define BRIDGE_CACHE_EVICT_MAX          16
/* Blocks kept per (stream, size) key.  64, not 16: a training step frees
 * dozens of blocks of one size (GPT-2: 48% of allocations hit with 16, 58%
 * with 64, at the same reserved / live in benchmarks/model_cache.py).  The
 * node array is sized for it but malloc'd lazily: untouched nodes cost no
 * memory. */
#define BRIDGE_CACHE_DEPTH              64

/* Streams are keys here (streams.c: the per-thread default stream has one
 * key per thread).  A cached block on its way back to the driver. */
typedef void (*cache_release_fn)(int device, uintptr_t ptr, uint64_t size, CUstream stream);

/* A block evicted from the cache: the caller releases it after the call. */
typedef struct cache_block {
    uintptr_t ptr;
    uint64_t size;
    CUstream stream;
    int kept;   /* parked with its record (park.h): the caller detaches it first */
    int carved; /* a carved block (carve.c) out of a thread slot */
} cache_block;

/* Pop the most recently cached block of exactly `size` for `stream` (never a
 * carved block parked in a slot); 0 when none.  *kept: 1 when it is the calling thread's own block parked with its
 * record (cache_park), which is still in the table (the caller takes it back
 * live or detaches it); 0 otherwise (any other block parked so was detached). */
uintptr_t cache_take(int device, CUstream stream, uint64_t size, int *kept);
/* cache_take's first case, for one block: `ptr` out of the calling thread's
 * slot on `device` when that slot's park words are `pw` and it holds ptr
 * under this key, a carved block (cache_park_carved) or a plain one as
 * `carved` says; 0 otherwise (the slot as it was).  *kept as cache_take's.
 * The only way a carved block leaves its slot live: cache_take never hands
 * one out. */
uintptr_t cache_take_back(int device, const park_words *pw, uintptr_t ptr, CUstream stream,
                          uint64_t size, int carved, int *kept);
/* The calling thread's slot's park words on `device` (park.h); NULL while it
 * has no slot there.  A record made by this thread points to them. */
park_words *cache_park_words(int device);
/* The same, the slot made first when the thread has none (the slots on). */
park_words *cache_park_words_made(int device);
/* Park a freed block in the calling thread's empty slot with its record left
 * in the table (its slot's words `pw`, the record's): 1 when parked (the
 * block is cached, its `kept` word set), 0 when it cannot be (the slot full
 * or another thread's words, the slots off, a thread waiting for memory, no
 * room under the tier's cap): the caller takes the record out and caches
 * the block as usual.  Never evicts, takes no lock.  `tag`: the record's,
 * for cache_kept. */
int cache_park(int device, CUstream stream, uint64_t size, uintptr_t ptr, int tag, uint64_t held,
               park_words *pw);
/* A freed carved block (carve.c) parked in the calling thread's slot with its
 * record (as cache_park), still carved out of its segment, for that thread's
 * next allocation of its key (cache_take_back).  The slot must be empty, or
 * (`evict`) hold a carved block, which goes back to its segment first (the
 * carved-return hook: a detach and the carve lock).  0 when it cannot be
 * parked (a plain block in the slot, another thread's words, the slots or
 * the cache off, a thread waiting for memory): the caller returns the block
 * to its segment.  No cap holds it (it is in no tier): its bytes are
 * `parked_carved`, in cache_bytes. */
int cache_park_carved(int device, CUstream stream, uint64_t size, uintptr_t ptr, int tag,
                      park_words *pw, int evict);
/* The calling thread's carved block parked on `device`, if any, back to its
 * segment (the hook): at that thread's allocation that does not take it back,
 * so that a parked block never outlives its owner's next allocation. */
void cache_release_mine_carved(int device);
/* Every carved block parked in a thread slot of `device` back to its
 * segment (the hook); returns their bytes.  cache_flush and
 * cache_flush_stream return them too (with the plain blocks). */
uint64_t cache_release_carved(int device);
/* The bytes of the carved blocks parked in thread slots of `device` (in
 * cache_bytes; requested sizes). */
uint64_t cache_parked_carved(int device);
/* Who returns a carved block that leaves a slot other than to its owner's
 * allocation (alloc.c: the record out of the table, then the range back to
 * its segment in stream order): called with no lock of the cache held, at a
 * flush, a stream's end, a carved park that needs the slot, a plain free
 * into the slot, the owner's exit.  Set once, before any park. */
typedef void (*cache_carved_fn)(int device, const cache_block *b);
void cache_set_carved_return(cache_carved_fn fn);
/* The blocks of `tag` parked with their records on `device` now: their bytes
 * and their number (a walk of the device's slots, no lock).  They are still
 * in the tag's `current` and `count` (park.h): a reader takes these out. */
void cache_kept(int device, int tag, uint64_t *bytes, int64_t *count);
/* Who takes a parked block's record out of the table (alloc.c): called for a
 * block parked with its record that leaves a slot other than to its owner's
 * allocation, with no lock of the cache held.  Set once, before any park. */
typedef void (*cache_detach_fn)(int device, uintptr_t ptr);
void cache_set_detach(cache_detach_fn fn);
/* Keep a freed block; 1 when kept, 0 when the caller must free it.  `held`:
 * the device's committed bytes, this block left out (the cached bytes
 * included: live = held - cached).  The oldest cached blocks of the block's
 * tier that no longer fit under its cap are moved to `evicted` (BRIDGE_CACHE_EVICT_MAX entries),
 * their number to *nevicted: the caller releases them, and calls cache_trim
 * while a full array came back. */
int cache_put(int device, CUstream stream, uint64_t size, uintptr_t ptr, uint64_t held,
              cache_block *evicted, int *nevicted);
/* cache_put that evicts nothing: keeps the block only if it fits under its
 * tier's cap as the cache is (1), else leaves the cache as it was (0); neither
 * tier loses a block.  For a free that must make no driver call
 * (bridge_free_cached). */
int cache_put_no_evict(int device, CUstream stream, uint64_t size, uintptr_t ptr, uint64_t held);
/* Evict each tier's oldest blocks until its cap (for `held`, as cache_put's)
 * holds, at most BRIDGE_CACHE_EVICT_MAX per call; returns how many went to
 * `evicted` (a slot's block parked with its record comes with `kept` set: the
 * caller detaches it before releasing it). */
int cache_trim(int device, uint64_t held, cache_block *evicted);
/* Hand every cached block of `device` to `release`; returns the bytes. */
uint64_t cache_flush(int device, cache_release_fn release);
/* Hand the cached blocks of one stream to `release`; returns the bytes. */
uint64_t cache_flush_stream(int device, CUstream stream, cache_release_fn release);
uint64_t cache_bytes(int device);
/* The number of cached blocks of `device` (walks them under the lock: for figures). */
uint64_t cache_blocks(int device);
/* A thread starts (on 1) or stops (0) waiting for memory on `device`: while
 * any waits, cache_put keeps nothing, so what is freed goes to the pool. */
void cache_hold(int device, int on);
/* Hard cap of cached bytes per device (0 disables) and the largest cached block. */
void cache_set_limits(int device, uint64_t limit, uint64_t max_block);
uint64_t cache_limit(int device);
/* The small tier's share of the live bytes (in units of 1/65536) and its floor. */
void cache_set_share(int device, uint64_t fraction_q16, uint64_t floor);
uint64_t cache_fraction_q16(int device);
uint64_t cache_floor(int device);
/* The largest block of the small tier and the large tier's fixed cap; blocks
 * already cached stay in their tier. */
void cache_set_tiers(int device, uint64_t small_max, uint64_t large_cap);
uint64_t cache_small_max(int device);
uint64_t cache_large_cap(int device);
/* The large tier's share of the live bytes (in units of 1/65536; 0: the fixed
 * cap alone): its cap is min(large_cap, max(live * share, the block being
 * cached)), so one block up to large_cap always fits. */
void cache_set_large_fraction(int device, uint64_t fraction_q16);
uint64_t cache_large_fraction_q16(int device);
/* The cached bytes of the small (large = 0) or the large tier. */
uint64_t cache_tier_bytes(int device, int large);
/* Whether a thread's newest freed block waits in a slot of its own, in front
 * of the lists (default on; cache.c's thread slots).  Off: frees go to the
 * lists alone; blocks already in slots stay until taken or flushed. */
void cache_set_thread_slots(int device, int on);
int cache_thread_slots(int device);
/* A fork child forgets the cached blocks (no lock taken). */
void cache_forget_after_fork(void);

#endif
