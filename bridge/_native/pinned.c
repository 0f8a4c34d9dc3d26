/* SPDX-License-Identifier: Apache-2.0 */
/* pinned.c: the pool of pinned (page-locked) host memory, the staging memory
 * that numpy, torch, JAX and CuPy share through DLPack.
 *
 * Why our own pool, not cuda.core's PinnedMemoryResource (cuda-core 1.2):
 *   - it is not in CI, and the pool has to be tested there: here the stand-in
 *     driver runs every path of this file;
 *   - its buffers are stream-ordered: host code may touch one only after the
 *     allocation stream has been synchronized, and a host write to a freshly
 *     allocated block is not ordered after a copy still reading it on another
 *     stream; staging memory is written by the CPU right after allocation;
 *   - its DLPack export is always kDLCUDAHost, which torch refuses, and it has
 *     no byte budget nor the figures CuPy's PinnedMemoryPool offers;
 *   - a Python object per allocation in the way of the CuPy pinned allocator.
 * What it does well, creating a host-located stream-ordered pool
 * (cuMemPoolCreate with CU_MEM_LOCATION_TYPE_HOST), is kept as one of the two
 * base allocators below ("mempool"), selectable and tested on the GPU.
 *
 * Glossary
 *   block     one pinned allocation lent to Python (a PinnedBuffer and every
 *             DLPack export of it hold a reference); page-aligned.
 *   class     the rounded size blocks are cut to: 4 KiB, then 8 classes per
 *             doubling (at most 12.5 % rounding).  Free lists are per class.
 *   ready     a free block nothing can still touch: reusable at once.
 *   pending   a free block an asynchronous copy was recorded against
 *             (bridge_pinned_record) whose event has not completed yet:
 *             reused only once cuEventQuery says every event completed.
 *   base      where blocks come from: CACHED = cuMemHostAlloc (portable);
 *             MEMPOOL = cuMemAllocFromPoolAsync on a host-located pool,
 *             followed by a synchronization of the pool's private stream so
 *             that the host may write at once.  Both feed the same free
 *             lists; the difference is freeing: a MEMPOOL block with pending
 *             copies is freed on the stream (after cuStreamWaitEvent) without
 *             waiting, a CACHED one only after its copies completed.
 *
 * Locking: one mutex (`P.lock`) guards every field of the pool and the free
 * lists; block reference counts are atomics.  Slow driver calls
 * (cuMemHostAlloc, cuMemFreeHost, pool allocation and synchronization) are
 * made without the lock: the budget is reserved first under it.  Nothing here
 * calls Python; free paths never fail (they count driver errors).
 */
#include "bridge.h"
#include "driver.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CUDA_ERROR_NOT_READY           600
#define CU_MEMHOSTALLOC_PORTABLE       1
#define CU_MEM_ALLOCATION_TYPE_PINNED  1
#define CU_MEM_LOCATION_TYPE_HOST      2
#define CU_MEM_LOCATION_TYPE_HOST_NUMA 3

#define PIN_MIN_SHIFT      12 /* 4 KiB: the page the driver pins anyway */
#define PIN_STEPS_SHIFT    3  /* 8 classes per doubling */
#define PIN_NCLASS         (1 + (63 - PIN_MIN_SHIFT) * (1 << PIN_STEPS_SHIFT))
#define PIN_MAX_SIZE       (1ull << 47) /* larger requests cannot be host memory */
#define PIN_PENDING_PROBES 4            /* pending blocks checked per allocation */
#define PIN_EVENT_CACHE    256          /* idle events kept for reuse */

/* A test's hook between a last release's decrement and its lock (tests/native). */
#ifndef PIN_TEST_AFTER_LAST_RELEASE
#define PIN_TEST_AFTER_LAST_RELEASE(b) ((void)0)
#endif

/* ---- blocks ---- */
typedef struct pin_event {
    CUcontext ctx;   /* the context of `stream`, where `event` was created */
    CUstream stream; /* the stream recorded against the block */
    CUevent event;   /* recorded on `stream` after the copy was enqueued */
} pin_event;

struct bridge_pinned_block {
    void *ptr;                 /* host address; never NULL */
    size_t capacity;           /* bytes held from the base (the class size) */
    size_t size;               /* bytes the current owner asked for */
    atomic_int refs;           /* owners; 0 = in the pool's free lists */
    int cls;                   /* class index */
    int base;                  /* BRIDGE_PINNED_CACHED or _MEMPOOL: how to free */
    int nev, capev;            /* recorded events (under P.lock) */
    pin_event *ev;             /* malloc'd, capev entries */
    bridge_pinned_block *next; /* free list link (under P.lock) */
};

/* ---- the pool ---- */
static struct pin_pool {
    pthread_mutex_t lock;
    int ready;          /* 1 once setup succeeded */
    int backend;        /* base of new blocks */
    CUcontext ctx;      /* primary context of device 0, retained: the
                                  context host allocations are made in */
    CUmemoryPool mpool; /* MEMPOOL: the host-located pool (never destroyed) */
    CUstream stream;    /* MEMPOOL: private stream of allocations and frees */
    int mpool_tried;    /* 1 once creating mpool was attempted */

    uint64_t host_mem;  /* the host's physical memory (0 unknown): no block is larger */
    uint64_t limit;     /* 0 = none; `total` never passes it */
    uint64_t total;     /* bytes held from the base: used + free + reserved */
    uint64_t used;      /* capacity of blocks with owners */
    uint64_t free;      /* capacity of blocks in the free lists */
    uint64_t peak_used; /* highest `used` */
    uint64_t n_ready, n_pending;
    uint64_t num_allocs, num_reuses, num_base_allocs, num_base_frees;
    uint64_t num_ooms, num_driver_errors, num_records;

    bridge_pinned_block *ready_list[PIN_NCLASS]; /* LIFO: the warmest first */
    bridge_pinned_block *pend_head[PIN_NCLASS];  /* FIFO: oldest copies first */
    bridge_pinned_block *pend_tail[PIN_NCLASS];

    bridge_pinned_block **live; /* blocks with owners, sorted by address */
    size_t nlive, caplive;

    pin_event *evcache; /* idle events, any context */
    size_t nevcache;
} P = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* ---- context and capture mode ---- */
typedef struct pin_guard {
    CUcontext prev;
    int changed;
    int mode; /* previous capture mode */
} pin_guard;

/* Make `ctx` current and this thread's capture mode relaxed, so that a host
 * allocation never invalidates a graph capture running on another stream. */
static void guard_enter(CUcontext ctx, pin_guard *g)
{
    g->prev = NULL;
    g->changed = 0;
    if (bridge_drv.cuCtxGetCurrent(&g->prev) != CUDA_SUCCESS || g->prev != ctx) {
        bridge_drv.cuCtxSetCurrent(ctx);
        g->changed = 1;
    }
    g->mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    bridge_drv.cuThreadExchangeStreamCaptureMode(&g->mode);
}

static void guard_exit(pin_guard *g)
{
    bridge_drv.cuThreadExchangeStreamCaptureMode(&g->mode);
    if (g->changed && g->prev)
        bridge_drv.cuCtxSetCurrent(g->prev);
}

/* ---- size classes ---- */
static int class_of(size_t size, size_t *cap)
{
    if (size <= ((size_t)1 << PIN_MIN_SHIFT)) {
        *cap = (size_t)1 << PIN_MIN_SHIFT;
        return 0;
    }
    int p = 63 - __builtin_clzll((unsigned long long)(size - 1)); /* 2^p < size <= 2^(p+1) */
    size_t step = (size_t)1 << (p - PIN_STEPS_SHIFT);
    size_t k = (size - 1 - ((size_t)1 << p)) / step;
    *cap = ((size_t)1 << p) + (k + 1) * step;
    return 1 + ((p - PIN_MIN_SHIFT) << PIN_STEPS_SHIFT) + (int)k;
}

/* ---- the live table: blocks with owners, sorted by address (P.lock) ---- */
static size_t live_lower(uintptr_t addr)
{
    size_t lo = 0, hi = P.nlive;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if ((uintptr_t)P.live[mid]->ptr < addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static int live_insert(bridge_pinned_block *b)
{
    if (P.nlive == P.caplive) {
        size_t ncap = P.caplive ? P.caplive * 2 : 256;
        bridge_pinned_block **n = realloc(P.live, ncap * sizeof *n);
        if (!n)
            return -1;
        P.live = n;
        P.caplive = ncap;
    }
    size_t i = live_lower((uintptr_t)b->ptr);
    memmove(&P.live[i + 1], &P.live[i], (P.nlive - i) * sizeof *P.live);
    P.live[i] = b;
    P.nlive++;
    return 0;
}

static void live_remove(bridge_pinned_block *b)
{
    size_t i = live_lower((uintptr_t)b->ptr);
    if (i < P.nlive && P.live[i] == b) {
        memmove(&P.live[i], &P.live[i + 1], (P.nlive - i - 1) * sizeof *P.live);
        P.nlive--;
    }
}

/* The live block whose capacity holds `addr`, or NULL.  A block whose last
 * reference was dropped stays in the table until its release takes the lock:
 * it is no longer lent, and never counts as found. */
static bridge_pinned_block *live_find(uintptr_t addr)
{
    size_t i = live_lower(addr + 1); /* first block starting after addr */
    if (i == 0)
        return NULL;
    bridge_pinned_block *b = P.live[i - 1];
    if (addr >= (uintptr_t)b->ptr + b->capacity ||
        atomic_load_explicit(&b->refs, memory_order_relaxed) == 0)
        return NULL;
    return b;
}

/* ---- events (P.lock) ---- */
/* An idle event of `ctx` from the cache; {0} when none. */
static pin_event evcache_take(CUcontext ctx)
{
    for (size_t i = P.nevcache; i-- > 0;)
        if (P.evcache[i].ctx == ctx) {
            pin_event e = P.evcache[i];
            P.evcache[i] = P.evcache[--P.nevcache];
            return e;
        }
    return (pin_event){0};
}

/* Keep an idle event for reuse, or destroy it when the cache is full. */
static void evcache_put(pin_event e)
{
    if (!P.evcache)
        P.evcache = malloc(PIN_EVENT_CACHE * sizeof *P.evcache);
    if (P.evcache && P.nevcache < PIN_EVENT_CACHE) {
        P.evcache[P.nevcache++] = e;
        return;
    }
    if (bridge_drv.cuEventDestroy_v2(e.event) != CUDA_SUCCESS)
        P.num_driver_errors++;
}

/* Drop the block's completed events; 1 when none is left pending.  The
 * queries run in relaxed capture mode: in the caller's mode (global, by
 * default) a query made while another thread captures fails with 900 and
 * invalidates that capture (seen on an H200 under torch.cuda.graph).  A query
 * that fails, whatever the reason, leaves the event pending: the copy may
 * still be queued, and a block is never lent again before its copies are
 * known complete (bridge_pinned_trim frees such blocks, CACHED ones once
 * their queries succeed).  No event: no driver call at all. */
static int settle_events(bridge_pinned_block *b)
{
    if (!b->nev)
        return 1;
    int mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    bridge_drv.cuThreadExchangeStreamCaptureMode(&mode);
    int kept = 0;
    for (int i = 0; i < b->nev; i++) {
        CUresult r = bridge_drv.cuEventQuery(b->ev[i].event);
        if (r == CUDA_SUCCESS) {
            evcache_put(b->ev[i]);
            continue;
        }
        if (r != CUDA_ERROR_NOT_READY) {
            bridge_note_driver_error(r);
            P.num_driver_errors++;
        }
        b->ev[kept++] = b->ev[i];
    }
    bridge_drv.cuThreadExchangeStreamCaptureMode(&mode);
    b->nev = kept;
    return kept == 0;
}

/* ---- free lists (P.lock) ---- */
static void push_ready(bridge_pinned_block *b)
{
    b->next = P.ready_list[b->cls];
    P.ready_list[b->cls] = b;
    P.n_ready++;
}

static void push_pending(bridge_pinned_block *b)
{
    b->next = NULL;
    if (P.pend_tail[b->cls])
        P.pend_tail[b->cls]->next = b;
    else
        P.pend_head[b->cls] = b;
    P.pend_tail[b->cls] = b;
    P.n_pending++;
}

/* A reusable block of class `cls`: a ready one, else one of the oldest
 * pending ones whose copies have completed.  NULL when none. */
static bridge_pinned_block *take_free(int cls)
{
    bridge_pinned_block *b = P.ready_list[cls];
    if (b) {
        P.ready_list[cls] = b->next;
        P.n_ready--;
        return b;
    }
    bridge_pinned_block *prev = NULL;
    b = P.pend_head[cls];
    for (int probes = 0; b && probes < PIN_PENDING_PROBES; probes++) {
        if (settle_events(b)) {
            if (prev)
                prev->next = b->next;
            else
                P.pend_head[cls] = b->next;
            if (P.pend_tail[cls] == b)
                P.pend_tail[cls] = prev;
            P.n_pending--;
            return b;
        }
        prev = b;
        b = b->next;
    }
    return NULL;
}

/* Move free blocks out of the lists onto `*out` (linked by next) until
 * `need` bytes are gathered (0: all of them): ready blocks, pending ones
 * whose copies completed, and pending MEMPOOL blocks, which are freed on the
 * stream without waiting.  Returns the bytes gathered; `total` and `free`
 * drop by as much. */
static uint64_t gather_free(uint64_t need, bridge_pinned_block **out)
{
    uint64_t got = 0;
    /* largest classes first: the fewest driver calls for the bytes */
    for (int c = PIN_NCLASS - 1; c >= 0 && (need == 0 || got < need); c--) {
        while (P.ready_list[c] && (need == 0 || got < need)) {
            bridge_pinned_block *b = P.ready_list[c];
            P.ready_list[c] = b->next;
            P.n_ready--;
            b->next = *out;
            *out = b;
            got += b->capacity;
        }
        bridge_pinned_block *prev = NULL, *b = P.pend_head[c];
        while (b && (need == 0 || got < need)) {
            bridge_pinned_block *next = b->next;
            if (b->base == BRIDGE_PINNED_MEMPOOL || settle_events(b)) {
                if (prev)
                    prev->next = next;
                else
                    P.pend_head[c] = next;
                if (P.pend_tail[c] == b)
                    P.pend_tail[c] = prev;
                P.n_pending--;
                b->next = *out;
                *out = b;
                got += b->capacity;
            } else {
                prev = b;
            }
            b = next;
        }
    }
    P.total -= got;
    P.free -= got;
    return got;
}

/* ---- the bases ---- */
/* Allocate `cap` bytes from `base`, without the lock. */
static int base_alloc(int base, size_t cap, void **out)
{
    pin_guard g;
    guard_enter(P.ctx, &g);
    CUresult r;
    if (base == BRIDGE_PINNED_MEMPOOL) {
        CUdeviceptr p = 0;
        r = bridge_drv.cuMemAllocFromPoolAsync(&p, cap, P.mpool, P.stream);
        /* the host writes as soon as we return: wait for the allocation (and
         * for the frees on this stream that it may reuse) */
        if (r == CUDA_SUCCESS && (r = bridge_drv.cuStreamSynchronize(P.stream)) != CUDA_SUCCESS)
            bridge_drv.cuMemFreeAsync(p, P.stream);
        *out = r == CUDA_SUCCESS ? (void *)(uintptr_t)p : NULL;
    } else {
        r = bridge_drv.cuMemHostAlloc(out, cap, CU_MEMHOSTALLOC_PORTABLE);
    }
    guard_exit(&g);
    if (r == CUDA_SUCCESS && *out)
        return BRIDGE_OK;
    *out = NULL;
    bridge_note_driver_error(r);
    return r == CUDA_ERROR_OUT_OF_MEMORY ? BRIDGE_E_OOM : BRIDGE_E_DRIVER;
}

/* Give a chain of blocks (linked by next) back to their bases, without the
 * lock.  A MEMPOOL block is freed on the pool's stream after its pending
 * copies; a CACHED block never has pending copies here. */
static void base_free_chain(bridge_pinned_block *b)
{
    if (!b)
        return;
    pin_guard g;
    guard_enter(P.ctx, &g);
    uint64_t errors = 0;
    int trim = 0;
    while (b) {
        bridge_pinned_block *next = b->next;
        CUresult r;
        if (b->base == BRIDGE_PINNED_MEMPOOL) {
            for (int i = 0; i < b->nev; i++)
                if (bridge_drv.cuStreamWaitEvent(P.stream, b->ev[i].event, 0) != CUDA_SUCCESS)
                    errors++;
            r = bridge_drv.cuMemFreeAsync((CUdeviceptr)(uintptr_t)b->ptr, P.stream);
            trim = 1;
        } else {
            r = bridge_drv.cuMemFreeHost(b->ptr);
        }
        if (r != CUDA_SUCCESS) {
            bridge_note_driver_error(r);
            errors++;
        }
        pthread_mutex_lock(&P.lock);
        /* the waits above captured the events: they may be recorded again */
        for (int i = 0; i < b->nev; i++)
            evcache_put(b->ev[i]);
        P.num_base_frees++;
        P.num_driver_errors += errors;
        pthread_mutex_unlock(&P.lock);
        errors = 0;
        free(b->ev);
        free(b);
        b = next;
    }
    /* memory whose frees have completed goes back to the system now; the
     * rest at a later trim (the pool's release threshold is 0) */
    if (trim && P.mpool)
        bridge_drv.cuMemPoolTrimTo(P.mpool, 0);
    guard_exit(&g);
}

/* ---- setup ---- */
static int create_mpool(void)
{
    if (P.mpool_tried)
        return P.mpool ? BRIDGE_OK : BRIDGE_E_NOPOOLS;
    P.mpool_tried = 1;
    bridge_CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type = CU_MEM_LOCATION_TYPE_HOST;
    props.location.id = 0;
    pin_guard g;
    guard_enter(P.ctx, &g);
    CUmemoryPool pool = NULL;
    CUresult r = bridge_drv.cuMemPoolCreate(&pool, &props);
    if (r != CUDA_SUCCESS) {
        /* older drivers know host pools by NUMA node only */
        props.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
        r = bridge_drv.cuMemPoolCreate(&pool, &props);
    }
    CUstream s = NULL;
    if (r == CUDA_SUCCESS &&
        (r = bridge_drv.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING)) != CUDA_SUCCESS)
        bridge_drv.cuMemPoolDestroy(pool);
    guard_exit(&g);
    if (r != CUDA_SUCCESS) {
        bridge_note_driver_error(r);
        return BRIDGE_E_NOPOOLS;
    }
    P.mpool = pool;
    P.stream = s;
    return BRIDGE_OK;
}

static void register_fork_handler(void);

int bridge_pinned_setup(int backend, int *chosen)
{
    if (chosen)
        *chosen = -1;
    if (!bridge_initialized())
        return bridge_forked() ? BRIDGE_E_FORKED : BRIDGE_E_NOTINIT;
    static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
    pthread_once(&fork_once, register_fork_handler); /* after the driver's: runs after it */
    if (backend != BRIDGE_PINNED_CACHED && backend != BRIDGE_PINNED_MEMPOOL &&
        backend != BRIDGE_PINNED_AUTO)
        return BRIDGE_E_INVALID;
    int rc = BRIDGE_OK;
    pthread_mutex_lock(&P.lock);
    if (!P.ctx) {
        int count = 0;
        CUdevice dev = 0;
        CUresult r = CUDA_SUCCESS;
        if (bridge_device_count(&count) != BRIDGE_OK || count == 0)
            rc = BRIDGE_E_DEVICE;
        else if ((r = bridge_drv.cuDeviceGet(&dev, 0)) != CUDA_SUCCESS ||
                 (r = bridge_drv.cuDevicePrimaryCtxRetain(&P.ctx, dev)) != CUDA_SUCCESS) {
            bridge_note_driver_error(r);
            P.ctx = NULL;
            rc = BRIDGE_E_DRIVER;
        }
    }
    int want = backend;
    if (rc == BRIDGE_OK && backend != BRIDGE_PINNED_CACHED) {
        int m = create_mpool();
        if (m != BRIDGE_OK && backend == BRIDGE_PINNED_MEMPOOL)
            rc = m;
        want = m == BRIDGE_OK ? BRIDGE_PINNED_MEMPOOL : BRIDGE_PINNED_CACHED;
    }
    /* Switching bases mixes blocks of both in the free lists: allowed only
     * while nothing is lent or awaited.  The free blocks go first (the switch
     * frees them anyway), pending ones whose copies completed with them: a
     * caller that synchronized has nothing awaited, though no allocation has
     * queried the events since. */
    bridge_pinned_block *chain = NULL;
    int switching = rc == BRIDGE_OK && P.ready && want != P.backend;
    if (switching && !P.used)
        gather_free(0, &chain);
    if (switching && (P.used || P.n_pending))
        rc = BRIDGE_E_INVALID;
    if (rc == BRIDGE_OK) {
        long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
        P.host_mem = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
        P.backend = want;
        P.ready = 1;
        if (chosen)
            *chosen = want;
    }
    pthread_mutex_unlock(&P.lock);
    base_free_chain(chain);
    return rc;
}

/* ---- allocation ---- */
int bridge_pinned_alloc(size_t size, int may_block, bridge_pinned_block **out)
{
    *out = NULL;
    if (size == 0)
        return BRIDGE_E_INVALID;
    if (size > PIN_MAX_SIZE) {
        pthread_mutex_lock(&P.lock);
        P.num_ooms++;
        pthread_mutex_unlock(&P.lock);
        return BRIDGE_E_OOM;
    }
    size_t cap;
    int cls = class_of(size, &cap);
    int reused = 1;

    if (bridge_forked())
        return BRIDGE_E_FORKED; /* the free lists hold the parent's blocks */
    /* fast path: one lock and a list pop */
    pthread_mutex_lock(&P.lock);
    if (!P.ready) {
        pthread_mutex_unlock(&P.lock);
        return BRIDGE_E_NOTINIT;
    }
    bridge_pinned_block *b = take_free(cls);
    if (b) {
        P.free -= cap;
        goto lend; /* still under the lock */
    }
    if (!may_block) {
        pthread_mutex_unlock(&P.lock);
        return BRIDGE_OK; /* *out NULL: call again where blocking is fine */
    }

    /* slow path: reserve the bytes, then ask the base without the lock */
    if (P.host_mem && size > P.host_mem) {
        /* no system pins more than it has: the cache stays, the driver is not asked */
        P.num_ooms++;
        pthread_mutex_unlock(&P.lock);
        return BRIDGE_E_OOM;
    }
    bridge_pinned_block *evict = NULL;
    /* evict free blocks only when that makes room: a request the limit refuses
     * anyway keeps the cache (each cuMemFreeHost synchronizes the device) */
    if (P.limit && P.total + cap > P.limit && P.total - P.free + cap <= P.limit)
        gather_free(P.total + cap - P.limit, &evict);
    if (P.limit && P.total + cap > P.limit) {
        P.num_ooms++;
        pthread_mutex_unlock(&P.lock);
        base_free_chain(evict);
        return BRIDGE_E_BUDGET;
    }
    P.total += cap;
    int base = P.backend;
    pthread_mutex_unlock(&P.lock);
    base_free_chain(evict);

    void *ptr = NULL;
    int rc = base_alloc(base, cap, &ptr);
    if (rc == BRIDGE_E_OOM) {
        /* the system is short of pinnable memory: give back what we cache */
        pthread_mutex_lock(&P.lock);
        evict = NULL;
        gather_free(0, &evict);
        pthread_mutex_unlock(&P.lock);
        if (evict) {
            base_free_chain(evict);
            rc = base_alloc(base, cap, &ptr);
        }
    }
    if (rc == BRIDGE_OK && !(b = calloc(1, sizeof *b))) {
        pin_guard g;
        guard_enter(P.ctx, &g);
        if (base == BRIDGE_PINNED_MEMPOOL)
            bridge_drv.cuMemFreeAsync((CUdeviceptr)(uintptr_t)ptr, P.stream);
        else
            bridge_drv.cuMemFreeHost(ptr);
        guard_exit(&g);
        rc = BRIDGE_E_OOM;
    }
    pthread_mutex_lock(&P.lock);
    if (rc != BRIDGE_OK) {
        P.total -= cap;
        if (rc == BRIDGE_E_OOM)
            P.num_ooms++;
        else
            P.num_driver_errors++;
        pthread_mutex_unlock(&P.lock);
        return rc;
    }
    b->ptr = ptr;
    b->capacity = cap;
    b->cls = cls;
    b->base = base;
    P.num_base_allocs++;
    reused = 0;

lend:
    P.num_reuses += (uint64_t)reused;
    P.num_allocs++;
    b->size = size;
    b->next = NULL;
    atomic_store_explicit(&b->refs, 1, memory_order_relaxed);
    P.used += cap;
    if (P.used > P.peak_used)
        P.peak_used = P.used;
    if (live_insert(b) != 0) {
        /* no host memory for the table: the block goes back, the caller fails */
        P.used -= cap;
        P.free += cap;
        push_ready(b);
        P.num_ooms++;
        pthread_mutex_unlock(&P.lock);
        return BRIDGE_E_OOM;
    }
    pthread_mutex_unlock(&P.lock);
    *out = b;
    return BRIDGE_OK;
}

void *bridge_pinned_ptr(const bridge_pinned_block *b)
{
    return b ? b->ptr : NULL;
}

size_t bridge_pinned_size(const bridge_pinned_block *b)
{
    return b ? b->size : 0;
}

void bridge_pinned_retain(bridge_pinned_block *b)
{
    if (b)
        atomic_fetch_add_explicit(&b->refs, 1, memory_order_relaxed);
}

/* fast path: one atomic decrement; the last owner takes the lock once */
void bridge_pinned_release(bridge_pinned_block *b)
{
    if (!b || atomic_fetch_sub_explicit(&b->refs, 1, memory_order_acq_rel) != 1 || bridge_forked())
        return;
    PIN_TEST_AFTER_LAST_RELEASE(b);
    pthread_mutex_lock(&P.lock);
    live_remove(b);
    P.used -= b->capacity;
    P.free += b->capacity;
    if (settle_events(b))
        push_ready(b);
    else
        push_pending(b);
    pthread_mutex_unlock(&P.lock);
}

/* ---- streams recorded against a block ---- */
/* The context a stream belongs to.  The special handles (0 the legacy
 * stream, 1 CU_STREAM_LEGACY, 2 CU_STREAM_PER_THREAD) mean the current
 * context's, or the pool's context when the thread has none. */
static int stream_context(CUstream stream, CUcontext *ctx)
{
    *ctx = NULL;
    if ((uintptr_t)stream <= 2) {
        if (bridge_drv.cuCtxGetCurrent(ctx) != CUDA_SUCCESS || !*ctx)
            *ctx = P.ctx;
        return BRIDGE_OK;
    }
    CUresult r = bridge_drv.cuStreamGetCtx(stream, ctx);
    if (r != CUDA_SUCCESS || !*ctx) {
        bridge_note_driver_error(r);
        return BRIDGE_E_INVALID;
    }
    return BRIDGE_OK;
}

int bridge_pinned_record(const void *addr, void *stream)
{
    if (bridge_forked())
        return BRIDGE_E_FORKED; /* the pool was forgotten: the parent's blocks are not ours */
    CUstream s = (CUstream)stream;
    CUcontext ctx;
    int rc = stream_context(s, &ctx);
    if (rc != BRIDGE_OK)
        return rc;

    pthread_mutex_lock(&P.lock);
    if (!P.ready) {
        pthread_mutex_unlock(&P.lock);
        return BRIDGE_E_NOTINIT;
    }
    /* A reference of our own keeps the block lent while we work.  The caller
     * may hold none (an address given as an int) and its last owner may drop
     * it now: the count reaches 0 before that release takes the lock.  Taken
     * only from a count that is not 0, the block goes to the free lists once
     * (by that release, or by ours below), never twice. */
    bridge_pinned_block *b = live_find((uintptr_t)addr);
    int refs = b ? atomic_load_explicit(&b->refs, memory_order_relaxed) : 0;
    while (refs > 0 && !atomic_compare_exchange_weak_explicit(
                           &b->refs, &refs, refs + 1, memory_order_relaxed, memory_order_relaxed))
        ;
    if (refs == 0) {
        pthread_mutex_unlock(&P.lock);
        return BRIDGE_E_INVALID;
    }
    pin_event e = {0};
    int have = 0;
    for (int i = 0; i < b->nev; i++)
        if (b->ev[i].stream == s && b->ev[i].ctx == ctx) {
            e = b->ev[i]; /* recording again covers the earlier copies too */
            have = 1;
            break;
        }
    if (!have)
        e = evcache_take(ctx);
    P.num_records++;
    pthread_mutex_unlock(&P.lock);

    pin_guard g;
    guard_enter(ctx, &g);
    CUresult r = CUDA_SUCCESS;
    if (!e.event)
        r = bridge_drv.cuEventCreate(&e.event, CU_EVENT_DISABLE_TIMING);
    e.ctx = ctx;
    e.stream = s;
    if (r == CUDA_SUCCESS)
        r = bridge_drv.cuEventRecord(e.event, s);
    guard_exit(&g);

    pthread_mutex_lock(&P.lock);
    if (r != CUDA_SUCCESS) {
        bridge_note_driver_error(r);
        P.num_driver_errors++;
        if (!have && e.event)
            evcache_put(e);
        rc = BRIDGE_E_DRIVER;
    } else if (!have) {
        if (b->nev == b->capev) {
            int ncap = b->capev ? b->capev * 2 : 2;
            pin_event *n = realloc(b->ev, (size_t)ncap * sizeof *n);
            if (!n) {
                /* cannot remember it: wait for the copy instead */
                pthread_mutex_unlock(&P.lock);
                bridge_drv.cuStreamSynchronize(s);
                pthread_mutex_lock(&P.lock);
                evcache_put(e);
                goto done;
            }
            b->ev = n;
            b->capev = ncap;
        }
        b->ev[b->nev++] = e;
    }
done:
    pthread_mutex_unlock(&P.lock);
    bridge_pinned_release(b);
    return rc;
}

int bridge_pinned_lookup(const void *addr, void **base, size_t *size)
{
    *base = NULL;
    *size = 0;
    pthread_mutex_lock(&P.lock);
    bridge_pinned_block *b = P.ready ? live_find((uintptr_t)addr) : NULL;
    if (b) {
        *base = b->ptr;
        *size = b->size;
    }
    pthread_mutex_unlock(&P.lock);
    return b ? BRIDGE_OK : BRIDGE_E_INVALID;
}

/* ---- budget and trimming ---- */
int bridge_pinned_set_limit(uint64_t limit)
{
    pthread_mutex_lock(&P.lock);
    P.limit = limit;
    bridge_pinned_block *chain = NULL;
    if (limit && P.total > limit)
        gather_free(P.total - limit, &chain);
    pthread_mutex_unlock(&P.lock);
    base_free_chain(chain);
    return BRIDGE_OK;
}

int bridge_pinned_trim(void)
{
    pthread_mutex_lock(&P.lock);
    bridge_pinned_block *chain = NULL;
    gather_free(0, &chain);
    pthread_mutex_unlock(&P.lock);
    base_free_chain(chain);
    return BRIDGE_OK;
}

int bridge_pinned_get_stats(bridge_pinned_stats *out)
{
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&P.lock);
    out->backend = P.ready ? P.backend : -1;
    out->limit = P.limit;
    out->used = P.used;
    out->free = P.free;
    out->total = P.total;
    out->peak_used = P.peak_used;
    out->n_free_blocks = P.n_ready + P.n_pending;
    out->n_pending_blocks = P.n_pending;
    out->n_live_blocks = P.nlive;
    out->num_allocs = P.num_allocs;
    out->num_reuses = P.num_reuses;
    out->num_base_allocs = P.num_base_allocs;
    out->num_base_frees = P.num_base_frees;
    out->num_ooms = P.num_ooms;
    out->num_driver_errors = P.num_driver_errors;
    out->num_records = P.num_records;
    out->mempool_available = P.mpool != NULL;
    pthread_mutex_unlock(&P.lock);
    return BRIDGE_OK;
}

int bridge_pinned_reset_peak(void)
{
    pthread_mutex_lock(&P.lock);
    P.peak_used = P.used;
    pthread_mutex_unlock(&P.lock);
    return BRIDGE_OK;
}

/* ---- fork ---- */
/* The child forgets the parent's blocks (never handed out again: CUDA
 * marks pinned pages not to be inherited) without taking the lock. */
static void forget_after_fork(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    memset(&P, 0, sizeof P);
    P.lock = fresh;
}

static void register_fork_handler(void)
{
    pthread_atfork(NULL, NULL, forget_after_fork);
}
