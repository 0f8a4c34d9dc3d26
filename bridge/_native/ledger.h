/* SPDX-License-Identifier: Apache-2.0 */
/* ledger.h: the per-device state the core's C files share (internal).
 *
 * ledger.c owns the budget, allocation and free; graph.c the CUDA graph
 * pools; streams.c what a stream handle means (per-thread default streams,
 * streams that live as long as the process, capture status) and how a free
 * is ordered after the streams that used the block.  Nothing here is part
 * of the library's interface (bridge.h is).
 */
#ifndef BRIDGE_LEDGER_H
#define BRIDGE_LEDGER_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "bridge.h"
#include "driver.h"
#include "records.h"
#include "share.h"

#define RELAXED memory_order_relaxed

/* ---- per-framework figures ---- */
typedef struct tag_state {
    _Atomic uint64_t current;   /* live bytes; what the framework sees */
    _Atomic uint64_t peak;      /* max of current since reset */
    _Atomic uint64_t allocated; /* cumulative bytes */
    _Atomic uint64_t freed;     /* cumulative bytes */
    _Atomic uint64_t num_allocs;
    _Atomic uint64_t num_frees;
    _Atomic uint64_t num_ooms;
    _Atomic uint64_t limit;     /* the framework's own cap; 0 = none */
    _Atomic int64_t count;      /* live blocks (allocations not yet freed); never reset */
    _Atomic int64_t count_peak; /* max of count since the last peak reset */
} tag_state;

/* A free that cannot be issued yet (a capture is running), or whose stream
 * may be gone before it can be: `event` (when not NULL) marks the point of
 * the stream after which the block is free, and the free is then issued on
 * the device's side stream after it. */
typedef struct deferred_free {
    record rec;
    CUevent event;
} deferred_free;

typedef struct graph_pools graph_pools; /* graph.c */

typedef struct device_state {
    /* ---- the ledger (see ledger.c's banner) ---- */
    _Atomic uint64_t reserved;  /* <= limit - others when checked */
    _Atomic uint64_t committed; /* driver-granted, not yet freed */
    _Atomic uint64_t limit;     /* budget; 0 = none */
    _Atomic uint64_t peak;      /* max of reserved after a passed check */
    tag_state tag[BRIDGE_NTAGS];
    _Atomic uint64_t num_allocs, num_frees, num_ooms, num_retries;
    _Atomic uint64_t num_driver_errors;
    _Atomic uint64_t num_cache_hits;       /* allocations served from the cache */
    _Atomic uint64_t graph_bytes;          /* graph blocks the user freed, kept for the graph */
    _Atomic uint64_t last_pool_used;       /* last USED_MEM_CURRENT read that succeeded */
    _Atomic uint64_t num_pool_read_errors; /* budget checks that used last_pool_used */
    _Atomic uint64_t num_order_fallbacks;  /* frees ordered by a synchronization,
                                              not by events (a recorded stream failed) */

    /* ---- the pool (set once by setup, under setup_lock) ---- */
    atomic_int ready; /* 1 once the fields below are valid */
    CUdevice dev;
    CUcontext ctx;     /* the primary context, retained */
    CUmemoryPool pool; /* the default pool */
    CUstream side;     /* non-blocking stream: graph blocks, deferred frees */
    uint64_t total;    /* device memory, bytes */
    _Atomic uint64_t release_threshold;

    /* ---- captures (under capture_lock) ---- */
    pthread_mutex_t capture_lock;
    atomic_int captures_active; /* captures between begin and end: torch's and CuPy's */
    atomic_int syncs;           /* synchronizations being issued (sync_enter..sync_exit):
                                   a capture announced meanwhile begins after they end */
    atomic_int cupy_captures;   /* CuPy captures with a pool bound to their stream (graph.c):
                                   while 0, no allocation looks for one */
    graph_pools *graphs;        /* graph.c; allocated at the first capture */
    deferred_free *deferred;    /* frees waiting for the captures to end */
    size_t ndeferred, cap_deferred;
    _Atomic uint64_t num_deferred; /* == ndeferred, readable without the lock */

    /* ---- the share (share.c): set once by bridge_share_join ---- */
    _Atomic(share_member *) share; /* NULL: this process's own budget only */
} device_state;

extern device_state bridge_devices[BRIDGE_MAX_DEVICES];

static inline device_state *device_of(int device)
{
    if (device < 0 || device >= BRIDGE_MAX_DEVICES)
        return NULL;
    device_state *d = &bridge_devices[device];
    return atomic_load_explicit(&d->ready, memory_order_acquire) ? d : NULL;
}

static inline void atomic_max(_Atomic uint64_t *a, uint64_t v)
{
    uint64_t cur = atomic_load_explicit(a, RELAXED);
    while (cur < v && !atomic_compare_exchange_weak_explicit(a, &cur, v, RELAXED, RELAXED))
        ;
}

/* ---- ledger.c ---- */
/* The device's state, set up on first use (a device outside unify's list:
 * its default pool, no budget); NULL with *rc set when it cannot be. */
device_state *device_use(int device, int *rc);
/* Reserve / give back budget bytes for a tag (reserve: BRIDGE_OK or the
 * limit that refused). */
int ledger_reserve(device_state *d, int tag, uint64_t size);
void ledger_unreserve(device_state *d, int tag, uint64_t size);
/* The driver granted a reserved block: count it as committed. */
void ledger_commit(device_state *d, uint64_t size);
/* Count a free on the framework's figures (the memory itself may live on). */
void ledger_count_free(device_state *d, const record *rec);
/* Count an allocation on the framework's figures (after the record exists). */
void ledger_count_alloc(device_state *d, int tag, uint64_t size);
/* Give the block back to the pool now if its streams allow it, else defer it
 * until they do; the ledger is settled when the driver free is issued. */
void ledger_release(device_state *d, const record *rec);
/* Hold a free back until no capture runs on its stream. */
void ledger_defer(device_state *d, const record *rec);
/* The capture of `key` (a stream alive now, that may be destroyed soon
 * after) ended: mark the point of the stream for the frees deferred on it,
 * which are then issued on the side stream after it, never on the handle. */
void ledger_mark_deferred(device_state *d, CUstream key);
/* Issue the frees deferred earlier whose streams allow it now. */
void ledger_flush_deferred(device_state *d);

/* ---- the calling thread's context ---- */
typedef struct ctx_guard {
    CUcontext prev;
    int changed;
} ctx_guard;
/* Make the device's primary context current for a driver call (torch's
 * autograd thread has none; a caller may have another device's current) and
 * put the caller's back afterwards, "none" included. */
void ctx_enter(device_state *d, ctx_guard *g);
void ctx_exit(ctx_guard *g);
/* While a capture runs, driver calls on other streams must not invalidate
 * it, nor fail: relaxed capture mode for this thread (torch does the same
 * around cudaMalloc while capturing).  capture_mode_enter relaxes always: a
 * capture of another thread may be one the core cannot see. */
int capture_mode_enter(device_state *d);
void capture_mode_exit(int mode);
/* Capture mode relaxed for one call, whatever the device says. */
int capture_mode_relax(void);

/* ---- synchronizations and captures (ledger.c) ----
 * A synchronization the core issues never overlaps a capture it knows of:
 * sync_enter announces the synchronization, then looks for captures (0: one
 * runs, do not synchronize); capture_announce counts the capture, then
 * waits for the synchronizations announced before it to end.  Both steps
 * are sequentially consistent, so of a racing pair at least one sees the
 * other (the capture begins in the driver after capture_announce returns:
 * torch and CuPy tell the bridge before they begin). */
int sync_enter(device_state *d);
void sync_exit(device_state *d);
void capture_announce(device_state *d);
/* Let the frees queued on the device's streams land without a host wait
 * that could invalidate a capture, known or not: the legacy stream (after
 * every blocking stream) unless a capture answers there, the side stream
 * and the registered streams that are not capturing; nothing while a
 * capture the core knows of runs. */
void drain_streams(device_state *d);

/* ---- streams.c ---- */
/* The key a stream handle is remembered by: the handle itself, except the
 * per-thread default stream (handle 2), which names a different stream on
 * every thread: its key is unique to the calling thread, forever. */
CUstream stream_key(CUstream s);
/* The handle to give the driver for a key, from the calling thread: a
 * per-thread key of another thread becomes the legacy default stream, which
 * waits for every blocking stream's queued work (that thread's included). */
CUstream stream_handle(CUstream key);
/* Whether blocks freed on `key` may be kept and handed to the next
 * allocation on the same key: default streams, per-thread keys and streams
 * registered as living as long as the process (torch's stream pool). */
int stream_long_lived(CUstream key);
/* Remove a registered stream (bridge_forget_stream). */
int stream_forget(CUstream key);
/* 1 when the stream is capturing (or answers a capture error, as the legacy
 * stream does while a blocking stream captures), else 0, also for a handle
 * the driver calls unusable.  Handles 0, 1 and 2 are asked in d's context. */
int stream_capturing(device_state *d, CUstream key);
/* Synchronize the registered streams of `ctx` that are not capturing. */
void stream_sync_long_lived(CUcontext ctx);
/* Make `free_stream` wait for the queued work of every stream recorded in
 * `rec`.  0 when ordered; 1 when a recorded stream is capturing (the free
 * must wait until the capture ends); -1 when a recorded stream could not be
 * used (destroyed, say): the caller must order the free another way. */
int stream_order_after_recorded(const record *rec, CUstream free_stream);

/* The key a block's free is issued on: its own stream when the bridge can
 * prove that stream alive at the free (default and per-thread streams,
 * registered streams, streams of a tag whose framework keeps them alive
 * until the free returns: bridge_set_tag_holds_streams), else the legacy
 * default stream, which is ordered after the queued work of every blocking
 * stream.  A handle the bridge cannot prove alive is never given to the
 * driver: a destroyed stream's handle crashed the driver or named a new
 * stream on an H200. */
CUstream free_key(const record *rec);
#define STREAM_LEGACY ((CUstream)(uintptr_t)1)

/* ---- graph.c ---- */
/* A graph block the user freed: onto its pool's free list.  (The one call
 * from ledger.c into graph.c: bridge_free meets graph blocks first.) */
void graph_block_freed(device_state *d, const record *rec);
/* The CuPy capture pool bound to a capturing stream key (its id1; id0 is
 * BRIDGE_CUPY_POOL): 1 when there is one. */
int graph_pool_of_stream(device_state *d, CUstream key, uint64_t *id1);
/* bridge_alloc_graph without the history's note (bridge_alloc notes it). */
int graph_alloc(int device, size_t size, int tag, uint64_t id0, uint64_t id1, void *stream,
                void **out);
/* The pools of CuPy graphs that died (their user objects' destructors ran:
 * bridge_capture_bind_graph) are released now; how many.  Nothing pending:
 * one relaxed load.  Called with no lock of the core held (it takes the
 * capture lock and the records' shard locks, and frees blocks). */
int graph_collect_dead(void);
/* A fork child: the parent's dead graphs and released ids are forgotten. */
void graph_forget_after_fork(void);

#endif /* BRIDGE_LEDGER_H */
