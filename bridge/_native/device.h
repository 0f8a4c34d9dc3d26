/* SPDX-License-Identifier: Apache-2.0 */
/* device.h: the core's ground floor (internal): a device's state, the
 * calling thread's context and capture mode, and the announcements that keep
 * the core's synchronizations out of captures (device.c).
 *
 * Every file of the core stands on this one; it calls none of them.  The
 * fields of device_state belong to the files that its comments name: the
 * ledger's figures to ledger.c, the deferred frees to ledger.c under
 * capture_lock, the graph pools to graph.c, the share to share.c.
 */
#ifndef BRIDGE_DEVICE_H
#define BRIDGE_DEVICE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "bridge.h"
#include "counts.h"
#include "driver.h"
#include "records.h"

#define RELAXED memory_order_relaxed

/* ---- per-framework figures ---- */
typedef struct tag_state {
    _Atomic uint64_t current; /* live bytes; what the framework sees */
    _Atomic uint64_t peak;    /* max of current since reset */
    /* the cumulative figures (bytes allocated and freed, allocations, frees)
     * are counted per thread (counts.h); these are their sums at the last
     * reset, which the figures read leave out */
    _Atomic uint64_t base[COUNT_TAG_FIGURES];
    _Atomic uint64_t num_ooms;
    _Atomic uint64_t limit;         /* the framework's own cap; 0 = none */
    _Atomic int64_t count;          /* live blocks (allocations not yet freed); never reset */
    _Atomic int64_t count_peak;     /* max of count since the last peak reset */
    _Atomic uint64_t reserved_peak; /* max of current + graph_bytes + cached where
                                       seen (alloc.c's raise_reserved_peaks) */
} tag_state;

/* A free that cannot be issued yet (a capture is running), or whose stream
 * may be gone before it can be: `event` (when not NULL) marks the point of
 * the stream after which the block is free, and the free is then issued on
 * the device's side stream after it. */
typedef struct deferred_free {
    record rec;
    CUevent event;
} deferred_free;

typedef struct graph_pools graph_pools;   /* graph.c */
typedef struct share_member share_member; /* share.c */

typedef struct device_state {
    /* ---- the ledger (see ledger.c's banner) ---- */
    _Atomic uint64_t reserved;  /* <= limit - others when checked */
    _Atomic uint64_t committed; /* driver-granted, not yet freed */
    _Atomic uint64_t limit;     /* budget; 0 = none */
    _Atomic uint64_t peak;      /* max of reserved after a passed check */
    tag_state tag[BRIDGE_NTAGS];
    _Atomic uint64_t num_ooms, num_retries; /* allocations, frees and cache hits: counts.h */
    _Atomic uint64_t num_driver_errors;
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
    /* the pool the bridge allocates from instead, one it created with
     * POSIX file-descriptor export (bridge_ipc_enable; ipc.c shares its
     * blocks with other processes); NULL: the default pool.  Set once. */
    _Atomic(CUmemoryPool) ipc_pool;
    CUstream side;  /* non-blocking stream: graph blocks, deferred frees */
    uint64_t total; /* device memory, bytes */
    _Atomic uint64_t release_threshold;

    /* ---- captures (under capture_lock) ----
     * The core's lock order, outermost first (a lock is only ever taken
     * while holding the ones above it on its line, never the reverse):
     *   capture_lock -> the records' shard locks (records.c) -> a cache's lock
     *   capture_lock -> wait.c's mu (a deferred free that settles wakes waiters)
     *   wait.c's hold_lock -> the shard locks (its sweep), then mu
     *   share.c's join_lock -> a member's lock
     *   ipc.c's serve_lock -> the shard locks (a hold looks its block up)
     * Leaves (nothing is taken under them): setup_lock (ledger.c), a
     * cache's lock (cache.c), a member's lock (share.c), spare_lock (counts.c),
     * hist_mu (views.c), long_lived_lock (streams.c), released_lock
     * (graph.c), managed.c's lock, the pinned pool's lock, driver.c's,
     * ipc.c's client_lock and enable_lock. */
    pthread_mutex_t capture_lock;
    atomic_int captures_active; /* captures between begin and end: torch's and CuPy's */
    atomic_int syncs;           /* synchronizations being issued (sync_enter..sync_exit):
                                   a capture announced meanwhile begins after they end */
    atomic_int stream_captures; /* CuPy captures with a pool bound to their stream (graph.c):
                                   while 0, no allocation looks for one */
    graph_pools *graphs;        /* graph.c; allocated at the first capture */
    deferred_free *deferred;    /* frees waiting for the captures to end */
    size_t ndeferred, cap_deferred;
    _Atomic uint64_t num_deferred; /* == ndeferred, readable without the lock */
    record *held;                  /* REC_UNORDERED frees waiting for a device-wide
                                      synchronization (ledger_hold) */
    size_t nheld, cap_held;
    _Atomic uint64_t num_held; /* == nheld, readable without the lock */

    /* ---- the share (share.c): set by bridge_share_join, cleared by bridge_share_leave ---- */
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

/* The pool the bridge's allocations come from (frees go to whichever pool
 * a block came from: cuMemFreeAsync needs no pool). */
static inline CUmemoryPool alloc_pool(device_state *d)
{
    CUmemoryPool p = atomic_load_explicit(&d->ipc_pool, memory_order_acquire);
    return p ? p : d->pool;
}

/* A figure of the device's pools (CU_MEMPOOL_ATTR_*): the default pool's,
 * plus the exportable pool's when there is one (a high-water mark is then
 * the sum of the two, at most that much above the true one).  Called in
 * relaxed capture mode, as every pool call. */
static inline CUresult pool_figure(device_state *d, int attr, uint64_t *value)
{
    uint64_t a = 0, b = 0;
    CUresult r = bridge_drv.cuMemPoolGetAttribute(d->pool, attr, &a);
    CUmemoryPool x = atomic_load_explicit(&d->ipc_pool, memory_order_acquire);
    if (r == CUDA_SUCCESS && x)
        r = bridge_drv.cuMemPoolGetAttribute(x, attr, &b);
    if (r == CUDA_SUCCESS)
        *value = a + b;
    return r;
}

static inline void atomic_max(_Atomic uint64_t *a, uint64_t v)
{
    uint64_t cur = atomic_load_explicit(a, RELAXED);
    while (cur < v && !atomic_compare_exchange_weak_explicit(a, &cur, v, RELAXED, RELAXED))
        ;
}

/* ---- the calling thread's context ---- */
typedef struct ctx_guard {
    CUcontext prev;
    int changed;
} ctx_guard;
/* Make the device's primary context current for a driver call (torch's
 * autograd thread has none; a caller may have another device's current) and
 * put the caller's back afterwards, "none" included, except on device 0:
 * a thread with none keeps device 0's there (the runtime's own choice for
 * it), so the runtime's next call does not take its context-less path. */
void ctx_enter(device_state *d, ctx_guard *g);
void ctx_exit(ctx_guard *g);
/* While a capture runs, driver calls on other streams must not invalidate
 * it, nor fail: every driver call of the core runs in relaxed capture mode
 * for this thread (torch does the same around cudaMalloc while capturing),
 * whether or not the core knows of a capture: another thread's may be one
 * it cannot see.  capture_mode_relax returns the mode to put back. */
int capture_mode_relax(void);
void capture_mode_exit(int mode);

/* ---- synchronizations and captures (device.c) ----
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

#endif /* BRIDGE_DEVICE_H */
