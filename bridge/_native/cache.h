/* SPDX-License-Identifier: Apache-2.0 */
/* cache.h: a per-device cache of freed blocks in front of the driver pool.
 *
 * A block freed on stream S is kept, by its exact size, for the next
 * allocation of that size on S: stream order makes the reuse safe without an
 * event, and the allocation costs a lock and a pop instead of two driver
 * calls.  Cached bytes stay counted in the budget (they are the ledger's), are
 * capped per device, and go back to the pool whenever an allocation would
 * fail, on empty_cache / free_all_blocks, and when the cap is reached.
 */
#ifndef BRIDGE_CACHE_H
#define BRIDGE_CACHE_H

#include <stdint.h>

#include "driver.h"

/* Larger blocks are never cached (default of cache_set_limits' max_block). */
#define BRIDGE_CACHE_MAX_BLOCK (256ull << 20)

/* Streams are keys here (streams.c: the per-thread default stream has one
 * key per thread).  A cached block on its way back to the driver. */
typedef void (*cache_release_fn)(int device, uintptr_t ptr, uint64_t size, CUstream stream);

/* Pop a block of exactly `size` cached for `stream`; 0 when none. */
uintptr_t cache_take(int device, CUstream stream, uint64_t size);
/* Keep a freed block; 1 when kept, 0 when the caller must free it. */
int cache_put(int device, CUstream stream, uint64_t size, uintptr_t ptr);
/* Hand every cached block of `device` to `release`; returns the bytes. */
uint64_t cache_flush(int device, cache_release_fn release);
/* Hand the cached blocks of one stream to `release`; returns the bytes. */
uint64_t cache_flush_stream(int device, CUstream stream, cache_release_fn release);
uint64_t cache_bytes(int device);
/* A thread starts (on 1) or stops (0) waiting for memory on `device`: while
 * any waits, cache_put keeps nothing, so what is freed goes to the pool. */
void cache_hold(int device, int on);
/* Cap of cached bytes per device (0 disables) and the largest cached block. */
void cache_set_limits(int device, uint64_t limit, uint64_t max_block);
uint64_t cache_limit(int device);
/* A fork child forgets the cached blocks (no lock taken). */
void cache_forget_after_fork(void);

#endif
