/* SPDX-License-Identifier: Apache-2.0 */
/* standin_cuda.c: a stand-in CUDA driver for the CPU tests.
 *
 * It exports the driver entry points the core loads (same names, same
 * signatures) and behaves like one stream-ordered default pool per device,
 * with host bookkeeping instead of GPU memory:
 *   - allocations get unique fake addresses; no memory stands behind them;
 *   - cuMemFreeAsync only queues the free on its stream: the bytes stay in use
 *     until that stream (or the context) is synchronized, as on a GPU whose
 *     stream has not reached the free yet;
 *   - the capacity of each device can be set, bytes held by "others" (JAX)
 *     can be added, entry points can be made to fail (fault injection);
 *   - allocating without a current context fails, as on the real driver;
 *   - pinned host memory (cuMemHostAlloc, host-located pools made by
 *     cuMemPoolCreate) is real malloc'd memory, so numpy views work;
 *   - a device pool made by cuMemPoolCreate with POSIX file-descriptor
 *     export is real memory: a memfd mapped into the process, exported as a
 *     dup of that fd, so another process that imports the pool and a
 *     pointer (cuMemPoolImportFromShareableHandle, cuMemPoolImportPointer)
 *     maps the same bytes; its allocations count against the device's
 *     capacity with the default pool's;
 *   - events are real objects: recorded while standin_hold_events(1) they
 *     stay pending (cuEventQuery: CUDA_ERROR_NOT_READY) until their stream
 *     or context is synchronized or standin_complete_events() is called;
 *   - work that reads a block (standin_launch, a kernel) stays queued until a
 *     synchronization covers it, and a cuMemFreeAsync of the block on a
 *     stream not ordered after it is counted (C_UNORDERED: on a GPU the pool
 *     could hand the memory to another stream while the kernel reads it).
 *     Order follows CUDA's rules: a stream is ordered after its own work and
 *     after events it waited for; the legacy stream after every blocking
 *     stream's work and blocking streams after the legacy stream's, never
 *     after a non-blocking stream's (CU_STREAM_NON_BLOCKING).
 * It is NEVER evidence that anything works on a GPU: it exists so that CI can
 * test the ledger.  Controls: the standin_* functions at the end.
 */
#define _GNU_SOURCE /* memfd_create */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef void *CUmemoryPool;
typedef unsigned long long CUdeviceptr;

#define OK                0
#define E_INVALID_VALUE   1
#define E_OUT_OF_MEMORY   2
#define E_NOT_INITIALIZED 3
#define E_INVALID_DEVICE  101
#define E_INVALID_CONTEXT 201
#define E_INVALID_HANDLE  400

#define MAXDEV     8
#define MAXPENDING 65536

/* ---- state (all under mu) ---- */
typedef struct live {
    CUdeviceptr ptr;
    size_t size;
    int dev;
    int xp; /* the exportable pool's index; -1: the default pool */
} live;
typedef struct pending {
    CUdeviceptr ptr;
    size_t size;
    CUstream stream;
    int xp;
} pending;

typedef struct device {
    int ctx_tag;  /* &ctx_tag is the primary context handle */
    int pool_tag; /* &pool_tag is the default pool handle */
    uint64_t total, capacity;
    uint64_t used, reserved, used_high, reserved_high, threshold;
    int pools_supported;
    pending pend[MAXPENDING];
    size_t npend;
    uint64_t access_grants;
} device;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int initialized, ndev = 2;
static device devs[MAXDEV];
static CUdeviceptr next_addr = 0x7f0000000000ull;
static live *lives; /* open table of live allocations */
static size_t nlive, caplive;
static uint64_t counters[16]; /* see standin_counter */
static __thread CUcontext current_ctx;
static __thread int capture_mode;
static uintptr_t next_handle = 0x1000;
static CUstream capturing_stream = (CUstream)(uintptr_t)-1;

enum {
    C_ALLOC,
    C_FREE,
    C_SYNC,
    C_WAIT,
    C_RECORD,
    C_SETCTX,
    C_TRIM,
    C_MODE,
    C_HOSTALLOC,
    C_HOSTFREE,
    C_EVCREATE,
    C_EVQUERY,
    C_HOSTPOOL,
    C_INVALIDATED, /* calls that would have invalidated another thread's capture */
    C_DEAD,        /* calls given the handle of a destroyed stream */
    C_UNORDERED    /* frees of a block a queued kernel still reads, not ordered after it */
};

/* fault injection: entry name -> (code, remaining count) */
typedef struct fault {
    char name[48];
    int code;
    int count;
} fault;
static fault faults[16];

static int take_fault(const char *name)
{
    for (int i = 0; i < 16; i++)
        if (faults[i].count > 0 && strcmp(faults[i].name, name) == 0) {
            faults[i].count--;
            return faults[i].code;
        }
    return 0;
}

/* Another thread's capture in global mode (standin_set_global_capture): a
 * potentially unsafe call (an event query, a synchronization, a pool trim,
 * a free-memory query, a host allocation) from a thread whose capture mode
 * is not relaxed fails with 900 and invalidates that capture, as on a GPU;
 * a device-wide synchronization invalidates it in any mode, and so does any
 * synchronization of the capturing stream itself. */
static int global_capture;
static CUstream global_capture_stream;
#define CAPTURE_MODE_RELAXED 2

/* Under mu.  1 when the call must fail (and the capture is invalidated). */
static int unsafe_call(int device_wide)
{
    if (!global_capture || (!device_wide && capture_mode == CAPTURE_MODE_RELAXED))
        return 0;
    counters[C_INVALIDATED]++;
    return 1;
}

#define UNSAFE(device_wide)             \
    do {                                \
        if (unsafe_call(device_wide)) { \
            pthread_mutex_unlock(&mu);  \
            return 900;                 \
        }                               \
    } while (0)

#define FAULT(name)                    \
    do {                               \
        int f_ = take_fault(name);     \
        if (f_) {                      \
            pthread_mutex_unlock(&mu); \
            return f_;                 \
        }                              \
    } while (0)

/* standin_hold_syncs(1): synchronizations wait inside the driver until it is
 * called with 0 (a long synchronization, to race captures against). */
static int hold_syncs, syncs_waiting;
static pthread_cond_t sync_cv = PTHREAD_COND_INITIALIZER;

static void held_sync(void) /* under mu */
{
    syncs_waiting++;
    while (hold_syncs)
        pthread_cond_wait(&sync_cv, &mu);
    syncs_waiting--;
}

static int dev_of_ctx(CUcontext c)
{
    for (int i = 0; i < ndev; i++)
        if (c == &devs[i].ctx_tag)
            return i;
    return -1;
}

static int dev_of_pool(CUmemoryPool p)
{
    for (int i = 0; i < ndev; i++)
        if (p == &devs[i].pool_tag)
            return i;
    return -1;
}

static void setup_once(void)
{
    if (initialized)
        return;
    const char *n = getenv("BRIDGE_STANDIN_DEVICES");
    ndev = n ? atoi(n) : 2;
    if (ndev < 0 || ndev > MAXDEV)
        ndev = 2;
    const char *t = getenv("BRIDGE_STANDIN_TOTAL");
    uint64_t total = t ? strtoull(t, NULL, 10) : (16ull << 30);
    for (int i = 0; i < MAXDEV; i++) {
        devs[i].total = devs[i].capacity = total;
        devs[i].pools_supported = 1;
    }
    initialized = 1;
}

/* ---- live table (linear probing on the address) ---- */
static size_t slot_of(CUdeviceptr p)
{
    return (size_t)((p >> 8) * 0x9E3779B97F4A7C15ull);
}

static int live_put(CUdeviceptr p, size_t size, int dev, int xp)
{
    if ((nlive + 1) * 2 > caplive) {
        size_t ncap = caplive ? caplive * 2 : 1024;
        live *n = calloc(ncap, sizeof *n);
        if (!n)
            return -1;
        for (size_t i = 0; i < caplive; i++)
            if (lives[i].ptr) {
                size_t j = slot_of(lives[i].ptr) & (ncap - 1);
                while (n[j].ptr)
                    j = (j + 1) & (ncap - 1);
                n[j] = lives[i];
            }
        free(lives);
        lives = n;
        caplive = ncap;
    }
    size_t j = slot_of(p) & (caplive - 1);
    while (lives[j].ptr)
        j = (j + 1) & (caplive - 1);
    lives[j] = (live){p, size, dev, xp};
    nlive++;
    return 0;
}

static int live_take(CUdeviceptr p, live *out)
{
    if (!caplive)
        return -1;
    size_t j = slot_of(p) & (caplive - 1);
    while (lives[j].ptr) {
        if (lives[j].ptr == p) {
            *out = lives[j];
            /* backward-shift deletion keeps probe chains intact */
            size_t i = j;
            for (;;) {
                lives[i].ptr = 0;
                size_t k = i;
                for (;;) {
                    k = (k + 1) & (caplive - 1);
                    if (!lives[k].ptr) {
                        nlive--;
                        return 0;
                    }
                    size_t h = slot_of(lives[k].ptr) & (caplive - 1);
                    if ((i <= k) ? (i < h && h <= k) : (i < h || h <= k))
                        continue;
                    break;
                }
                lives[i] = lives[k];
                i = k;
            }
        }
        j = (j + 1) & (caplive - 1);
    }
    return -1;
}

/* ---- exportable device pools (all under mu) ----
 * A pool of CUmemPoolCreate with location DEVICE and handle type POSIX file
 * descriptor: XPOOL_CAP bytes of a memfd mapped MAP_SHARED (pages exist once
 * touched), allocated first fit in XPOOL_ALIGN steps.  Exported: a dup of
 * the memfd; a pointer's export data: the memfd's inode, the offset and the
 * size.  Imported: the fd mapped again (another address, the same bytes);
 * an imported pointer is freed by cuMemFreeAsync at once. */
#define MAXXPOOLS   16
#define MAXXIMPORTS 4096
#define XPOOL_CAP   (1ull << 30)
#define XPOOL_ALIGN 512ull
#define XPOOL_MAGIC 0x7374616e6478706full
typedef struct xrange {
    uint64_t off, size;
} xrange;
typedef struct xpool {
    int in_use, imported, dev, fd;
    int shared; /* its descriptor exported: only then are its pointers (the H200's driver) */
    char *base;
    uint64_t cap, ino;
    uint64_t used, reserved, used_high, reserved_high, threshold;
    uint64_t access_grants; /* cuMemPoolSetAccess's descriptors */
    xrange *r;              /* allocated ranges, sorted by offset (an exporter's) */
    size_t nr, capr;
} xpool;
typedef struct xexport { /* CUmemPoolPtrExportData: 64 bytes */
    uint64_t magic, ino, off, size;
    unsigned char pad[32];
} xexport;
static xpool xpools[MAXXPOOLS];
static struct {
    CUdeviceptr ptr;
    int xp;
} ximports[MAXXIMPORTS];
static size_t nximports;

static xpool *xpool_of(CUmemoryPool p)
{
    for (int i = 0; i < MAXXPOOLS; i++)
        if (p == (CUmemoryPool)&xpools[i] && xpools[i].in_use)
            return &xpools[i];
    return NULL;
}

/* What the device's exportable pools hold: device memory as the default
 * pool's is. */
static uint64_t xused(int dev)
{
    uint64_t n = 0;
    for (int i = 0; i < MAXXPOOLS; i++)
        if (xpools[i].in_use && !xpools[i].imported && xpools[i].dev == dev)
            n += xpools[i].reserved > xpools[i].used ? xpools[i].reserved : xpools[i].used;
    return n;
}

static int xalloc(xpool *x, uint64_t size, uint64_t *off)
{
    size = (size + XPOOL_ALIGN - 1) / XPOOL_ALIGN * XPOOL_ALIGN;
    uint64_t at = 0;
    size_t i = 0;
    for (; i < x->nr; i++) {
        if (x->r[i].off - at >= size)
            break;
        at = x->r[i].off + x->r[i].size;
    }
    if (at + size > x->cap)
        return -1;
    if (x->nr == x->capr) {
        size_t nc = x->capr ? x->capr * 2 : 64;
        xrange *n = realloc(x->r, nc * sizeof *n);
        if (!n)
            return -1;
        x->r = n;
        x->capr = nc;
    }
    memmove(&x->r[i + 1], &x->r[i], (x->nr - i) * sizeof *x->r);
    x->r[i] = (xrange){at, size};
    x->nr++;
    *off = at;
    return 0;
}

static void xfreed(int xp, CUdeviceptr p, uint64_t size)
{
    xpool *x = &xpools[xp];
    uint64_t off = (uint64_t)((char *)(uintptr_t)p - x->base);
    for (size_t i = 0; i < x->nr; i++)
        if (x->r[i].off == off) {
            memmove(&x->r[i], &x->r[i + 1], (x->nr - i - 1) * sizeof *x->r);
            x->nr--;
            break;
        }
    x->used -= size;
    if (x->reserved > x->threshold && x->reserved > x->used)
        x->reserved = x->used > x->threshold ? x->used : x->threshold;
}

static int nonblocking_stream(CUstream s);

/* Complete the queued frees of `stream` (NULL: every stream; the legacy
 * handle 1: every stream but those created non-blocking, as the legacy
 * default stream waits for the blocking ones). */
static void complete(int dev, CUstream stream, int all)
{
    device *d = &devs[dev];
    size_t kept = 0;
    for (size_t i = 0; i < d->npend; i++) {
        if (all || d->pend[i].stream == stream || stream == NULL ||
            ((uintptr_t)stream == 1 && !nonblocking_stream(d->pend[i].stream))) {
            if (d->pend[i].xp >= 0)
                xfreed(d->pend[i].xp, d->pend[i].ptr, d->pend[i].size);
            else
                d->used -= d->pend[i].size;
        } else
            d->pend[kept++] = d->pend[i];
    }
    d->npend = kept;
    if (d->reserved > d->threshold && d->reserved > d->used)
        d->reserved = d->used > d->threshold ? d->used : d->threshold;
}

/* ---- events, streams, pinned host memory (all under mu) ---- */
typedef struct sevent {
    struct sevent *next;
    CUstream stream; /* last stream recorded on */
    int pending;     /* 1: cuEventQuery says NOT_READY */
    uint64_t *kids;  /* the queued kernels the record is ordered after */
    size_t nk;
} sevent;
static sevent *events;  /* every live event */
static int hold_events; /* 1: events recorded now stay pending */

#define MAXSTREAMS 4096
static struct {
    CUstream s;
    CUcontext ctx;
    int dead;        /* destroyed (cuStreamDestroy_v2); the next cuStreamCreate reuses the handle */
    int nonblocking; /* created with CU_STREAM_NON_BLOCKING: the legacy stream does not wait */
} streams[MAXSTREAMS];
static int nstreams;

static int nonblocking_stream(CUstream s)
{
    for (int i = 0; i < nstreams; i++)
        if (streams[i].s == s)
            return streams[i].nonblocking;
    return 0;
}

/* Under mu.  1 (counted) when `s` names a destroyed stream: a GPU driver may
 * crash on it (cuStreamIsCapturing did on an H200) or take it for another. */
static int dead_stream(CUstream s)
{
    for (int i = 0; i < nstreams; i++)
        if (streams[i].s == s && streams[i].dead) {
            counters[C_DEAD]++;
            return 1;
        }
    return 0;
}

/* ---- kernels (standin_launch): queued work that reads a block ---- */
#define MAXAFTER 32
typedef struct skernel {
    struct skernel *next;
    uint64_t id;
    CUdeviceptr ptr;
    int dev;                  /* handles 0, 1 and 2 name this device's streams */
    CUstream after[MAXAFTER]; /* streams whose later work is ordered after it */
    int nafter;
} skernel;
static skernel *kernels;
static uint64_t kernel_ids;

static CUstream norm_stream(CUstream s)
{
    return (uintptr_t)s == 0 ? (CUstream)(uintptr_t)1 : s;
}

static int blocking_stream(CUstream s) /* under mu; legacy and per-thread included */
{
    return (uintptr_t)s <= 2 || !nonblocking_stream(s);
}

/* Under mu: is work queued on `s` now (of device `dev`) ordered after k? */
static int ordered_after(const skernel *k, CUstream s, int dev)
{
    s = norm_stream(s);
    for (int i = 0; i < k->nafter; i++) {
        CUstream a = k->after[i];
        if ((uintptr_t)a <= 2 && k->dev != dev && (uintptr_t)s <= 2)
            continue; /* another device's default streams */
        if (a == s)
            return 1;
        /* the legacy stream waits for blocking streams, and they for it */
        if ((uintptr_t)s == 1 && blocking_stream(a))
            return 1;
        if ((uintptr_t)a == 1 && blocking_stream(s))
            return 1;
    }
    return 0;
}

static void kernel_after(skernel *k, CUstream s) /* under mu */
{
    s = norm_stream(s);
    for (int i = 0; i < k->nafter; i++)
        if (k->after[i] == s)
            return;
    if (k->nafter < MAXAFTER)
        k->after[k->nafter++] = s;
}

/* Under mu: the kernels a synchronization of `s` (NULL: the whole device
 * `dev`) waits for are done. */
static void kernels_complete(CUstream s, int dev)
{
    for (skernel **pp = &kernels; *pp;) {
        skernel *k = *pp;
        if ((s == NULL && (dev < 0 || k->dev == dev)) || (s && ordered_after(k, s, dev))) {
            *pp = k->next;
            free(k);
        } else {
            pp = &k->next;
        }
    }
}

/* Under mu: a free of `p` on `s`: counted when a kernel reading p is queued
 * and the free is not ordered after it. */
static void check_free_order(CUdeviceptr p, CUstream s, int dev)
{
    for (skernel *k = kernels; k; k = k->next)
        if (k->ptr == p && !ordered_after(k, s, dev))
            counters[C_UNORDERED]++;
}

/* What the last cuStreamWaitEvent was given: the handle and the device of
 * the context current then (handles 0, 1 and 2 mean that context's). */
static CUstream last_wait_stream;
static int last_wait_dev = -1;

typedef struct hostpool {
    int in_use;
    uint64_t used, reserved, threshold;
} hostpool;
#define MAXHOSTPOOLS 4
static hostpool hostpools[MAXHOSTPOOLS];
static int host_pools_supported = 1;

typedef struct hostblk {
    struct hostblk *next;
    void *p;
    size_t size;
    hostpool *pool;
} hostblk;
static hostblk *hostblks; /* live pinned host allocations */
static uint64_t host_used, host_capacity = UINT64_MAX;

/* ---- captured graphs and user objects (all under mu but the destructors) ----
 * A capture (cuStreamBeginCapture_v2, or standin_set_capturing) captures into
 * a graph of its own, which cuStreamGetCaptureInfo_v2 names while it runs
 * and cuStreamEndCapture hands to the caller.  User objects have a refcount;
 * a graph owns the references retained for it (cuGraphRetainUserObject), an
 * exec instantiated from it a copy of each, and a launch keeps its exec's
 * until its stream completes (synchronized, or standin_complete_events):
 * as the CUDA programming guide's "User Objects" says.  A destructor runs
 * once the last reference goes, on the stand-in's destructor thread, never
 * the releasing thread (the real driver runs it on an internal thread). */
typedef void (*CUhostFn)(void *);
typedef struct suobj {
    unsigned refs;
    void *ptr;
    CUhostFn destroy;
} suobj;
typedef struct sref {
    suobj *obj;
    unsigned count;
} sref;
typedef struct srefs {
    sref *r;
    size_t n;
} srefs;
typedef struct sgraph {
    struct sgraph *next;
    uint64_t id;   /* the capture's id */
    int capturing; /* the capture runs: destroy is refused, as on a GPU */
    srefs refs;
} sgraph;
typedef struct sexec {
    struct sexec *next;
    srefs refs;
    CUstream launched; /* a launch not completed yet runs there */
    int pending, destroyed;
} sexec;
static sgraph *graphs; /* every live graph */
static sexec *execs;   /* every exec not yet gone (destroyed ones wait for their launch) */
static sgraph *capture_graph, *global_graph;
static uint64_t capture_ids;
static int capture_invalid; /* standin_invalidate_capture: the running capture fails */

/* the destructor thread: a queue under dmu, never mu (lock order: mu, then dmu) */
typedef struct sdtor {
    struct sdtor *next;
    CUhostFn fn;
    void *ptr;
} sdtor;
static pthread_mutex_t dmu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t dcv = PTHREAD_COND_INITIALIZER;
static sdtor *dq, **dq_tail = &dq;
static int dthread_started, dhold, drunning;
static uint64_t dran;

static void *destructor_thread(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&dmu);
    for (;;) {
        while (!dq || dhold)
            pthread_cond_wait(&dcv, &dmu);
        sdtor *t = dq;
        dq = t->next;
        if (!dq)
            dq_tail = &dq;
        drunning = 1;
        pthread_mutex_unlock(&dmu);
        t->fn(t->ptr); /* no lock of the stand-in held */
        free(t);
        pthread_mutex_lock(&dmu);
        drunning = 0;
        dran++;
        pthread_cond_broadcast(&dcv);
    }
    return NULL;
}

static uint64_t live_uobjs;

static void queue_destructor(suobj *o) /* under mu */
{
    live_uobjs--;
    sdtor *t = malloc(sizeof *t);
    if (!t)
        return; /* no memory: the object is lost, as a driver would lose it */
    *t = (sdtor){NULL, o->destroy, o->ptr};
    free(o);
    pthread_mutex_lock(&dmu);
    if (!dthread_started) {
        pthread_t th;
        if (pthread_create(&th, NULL, destructor_thread, NULL) == 0) {
            pthread_detach(th);
            dthread_started = 1;
        }
    }
    *dq_tail = t;
    dq_tail = &t->next;
    pthread_cond_broadcast(&dcv);
    pthread_mutex_unlock(&dmu);
}

static void uobj_release(suobj *o, unsigned count) /* under mu */
{
    o->refs = count >= o->refs ? 0 : o->refs - count;
    if (!o->refs)
        queue_destructor(o);
}

static void refs_release(srefs *r) /* under mu */
{
    for (size_t i = 0; i < r->n; i++)
        uobj_release(r->r[i].obj, r->r[i].count);
    free(r->r);
    *r = (srefs){NULL, 0};
}

static sgraph *graph_new(void) /* under mu */
{
    sgraph *g = calloc(1, sizeof *g);
    if (g) {
        g->capturing = 1;
        g->id = ++capture_ids;
        g->next = graphs;
        graphs = g;
    }
    return g;
}

static int graph_live(sgraph *g)
{
    for (sgraph *h = graphs; h; h = h->next)
        if (h == g)
            return 1;
    return 0;
}

static void graph_free(sgraph *g) /* under mu */
{
    for (sgraph **pp = &graphs; *pp; pp = &(*pp)->next)
        if (*pp == g) {
            *pp = g->next;
            break;
        }
    refs_release(&g->refs);
    free(g);
}

static void exec_gone(sexec *x) /* under mu: destroyed and its launch completed */
{
    for (sexec **pp = &execs; *pp; pp = &(*pp)->next)
        if (*pp == x) {
            *pp = x->next;
            break;
        }
    refs_release(&x->refs);
    free(x);
}

static void launches_complete(CUstream s, int all) /* under mu */
{
    for (sexec *x = execs, *next; x; x = next) {
        next = x->next;
        if (x->pending && (all || x->launched == s)) {
            x->pending = 0;
            if (x->destroyed)
                exec_gone(x);
        }
    }
}

static void events_complete(CUstream s, int all)
{
    for (sevent *e = events; e; e = e->next)
        if (all || e->stream == s)
            e->pending = 0;
    launches_complete(s, all);
}

static hostpool *host_pool_of(CUmemoryPool p)
{
    for (int i = 0; i < MAXHOSTPOOLS; i++)
        if (p == (CUmemoryPool)&hostpools[i] && hostpools[i].in_use)
            return &hostpools[i];
    return NULL;
}

static CUresult host_alloc(void **pp, size_t size, hostpool *pool)
{
    if (!current_ctx)
        return E_INVALID_CONTEXT;
    if (size == 0)
        return E_INVALID_VALUE;
    if (host_used + size > host_capacity)
        return E_OUT_OF_MEMORY;
    size_t rounded = (size + 4095) / 4096 * 4096;
    hostblk *h = malloc(sizeof *h);
    void *p = h ? aligned_alloc(4096, rounded) : NULL;
    if (!p) {
        free(h);
        return E_OUT_OF_MEMORY;
    }
    *h = (hostblk){hostblks, p, size, pool};
    hostblks = h;
    host_used += size;
    if (pool) {
        pool->used += size;
        if (pool->used > pool->reserved)
            pool->reserved = pool->used;
    }
    *pp = p;
    return OK;
}

/* Free a pinned host allocation; `pool` must match where it came from. */
static CUresult host_free(void *p, int from_pool)
{
    for (hostblk **pp = &hostblks; *pp; pp = &(*pp)->next) {
        hostblk *h = *pp;
        if (h->p != p)
            continue;
        if ((h->pool != NULL) != from_pool)
            return E_INVALID_VALUE;
        *pp = h->next;
        host_used -= h->size;
        if (h->pool)
            h->pool->used -= h->size;
        free(h->p);
        free(h);
        return OK;
    }
    return E_INVALID_VALUE;
}

static int host_owns(void *p)
{
    for (hostblk *h = hostblks; h; h = h->next)
        if (h->p == p)
            return 1;
    return 0;
}

/* ---- the driver API ---- */
CUresult cuInit(unsigned int flags)
{
    (void)flags;
    /* BRIDGE_STANDIN_INIT_DELAY_MS: cuInit takes this long (a driver starts
     * its GPUs: seconds on a machine of eight), for a fork made meanwhile */
    const char *delay = getenv("BRIDGE_STANDIN_INIT_DELAY_MS");
    if (delay && atoi(delay) > 0) {
        struct timespec ts = {atoi(delay) / 1000, (long)(atoi(delay) % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    pthread_mutex_lock(&mu);
    FAULT("cuInit");
    setup_once();
    pthread_mutex_unlock(&mu);
    return OK;
}

CUresult cuDriverGetVersion(int *v)
{
    *v = 13000;
    return OK;
}

CUresult cuGetErrorName(CUresult e, const char **s)
{
    switch (e) {
    case OK:
        *s = "CUDA_SUCCESS";
        break;
    case E_INVALID_VALUE:
        *s = "CUDA_ERROR_INVALID_VALUE";
        break;
    case E_OUT_OF_MEMORY:
        *s = "CUDA_ERROR_OUT_OF_MEMORY";
        break;
    case E_NOT_INITIALIZED:
        *s = "CUDA_ERROR_NOT_INITIALIZED";
        break;
    case 100:
        *s = "CUDA_ERROR_NO_DEVICE";
        break;
    case E_INVALID_DEVICE:
        *s = "CUDA_ERROR_INVALID_DEVICE";
        break;
    case E_INVALID_CONTEXT:
        *s = "CUDA_ERROR_INVALID_CONTEXT";
        break;
    case E_INVALID_HANDLE:
        *s = "CUDA_ERROR_INVALID_HANDLE";
        break;
    case 999:
        *s = "CUDA_ERROR_UNKNOWN";
        break;
    default:
        *s = NULL;
        return E_INVALID_VALUE;
    }
    return OK;
}

CUresult cuDeviceGetCount(int *n)
{
    pthread_mutex_lock(&mu);
    FAULT("cuDeviceGetCount");
    *n = ndev;
    pthread_mutex_unlock(&mu);
    return ndev ? OK : 100;
}

CUresult cuDeviceGet(CUdevice *d, int ordinal)
{
    if (ordinal < 0 || ordinal >= ndev)
        return E_INVALID_DEVICE;
    *d = ordinal;
    return OK;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    if (dev < 0 || dev >= ndev)
        return E_INVALID_DEVICE;
    if (len > 0)
        snprintf(name, (size_t)len, "Stand-in GPU %d", dev);
    return OK;
}

CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev)
{
    if (dev < 0 || dev >= ndev)
        return E_INVALID_DEVICE;
    switch (attrib) {
    case 115:
        *pi = devs[dev].pools_supported;
        break;
    case 75:
        *pi = 9;
        break; /* compute capability 9.0 */
    default:
        *pi = 0;
    }
    return OK;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    if (dev < 0 || dev >= ndev)
        return E_INVALID_DEVICE;
    *bytes = devs[dev].total;
    return OK;
}

/* The device's free memory: its capacity less what the pools hold from it
 * (their reserved bytes, idle ones included) and what others hold. */
CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    pthread_mutex_lock(&mu);
    FAULT("cuMemGetInfo_v2");
    UNSAFE(0);
    int dev = dev_of_ctx(current_ctx);
    if (dev < 0) {
        pthread_mutex_unlock(&mu);
        return E_INVALID_CONTEXT;
    }
    device *d = &devs[dev];
    uint64_t held = (d->reserved > d->used ? d->reserved : d->used) + xused(dev);
    *free_bytes = d->capacity > held ? d->capacity - held : 0;
    *total = d->total;
    pthread_mutex_unlock(&mu);
    return OK;
}

/* A UUID per physical device: ordinal + BRIDGE_STANDIN_UUID_BASE (a process
 * given another base sees the same devices numbered differently, as with
 * CUDA_VISIBLE_DEVICES). */
CUresult cuDeviceGetUuid_v2(unsigned char *uuid, CUdevice dev)
{
    pthread_mutex_lock(&mu);
    FAULT("cuDeviceGetUuid_v2");
    pthread_mutex_unlock(&mu);
    if (dev < 0 || dev >= ndev)
        return E_INVALID_DEVICE;
    const char *b = getenv("BRIDGE_STANDIN_UUID_BASE");
    int physical = dev + (b ? atoi(b) : 0);
    memcpy(uuid, "standin-gpu-", 12);
    uuid[12] = (unsigned char)(physical >> 24);
    uuid[13] = (unsigned char)(physical >> 16);
    uuid[14] = (unsigned char)(physical >> 8);
    uuid[15] = (unsigned char)physical;
    return OK;
}

CUresult cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer)
{
    *can = dev != peer && dev >= 0 && peer >= 0 && dev < ndev && peer < ndev;
    return OK;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice dev)
{
    pthread_mutex_lock(&mu);
    FAULT("cuDevicePrimaryCtxRetain");
    *c = &devs[dev].ctx_tag;
    pthread_mutex_unlock(&mu);
    return OK;
}

CUresult cuCtxGetCurrent(CUcontext *c)
{
    *c = current_ctx;
    return OK;
}

CUresult cuCtxSetCurrent(CUcontext c)
{
    current_ctx = c;
    __atomic_fetch_add(&counters[C_SETCTX], 1, __ATOMIC_RELAXED);
    return OK;
}

CUresult cuCtxGetDevice(CUdevice *d)
{
    int dev = dev_of_ctx(current_ctx);
    if (dev < 0)
        return E_INVALID_CONTEXT;
    *d = dev;
    return OK;
}

CUresult cuCtxSynchronize(void)
{
    pthread_mutex_lock(&mu);
    UNSAFE(1);
    held_sync();
    int dev = dev_of_ctx(current_ctx);
    if (dev >= 0) {
        complete(dev, NULL, 1);
        events_complete(NULL, 1);
        kernels_complete(NULL, dev);
    }
    counters[C_SYNC]++;
    pthread_mutex_unlock(&mu);
    return dev >= 0 ? OK : E_INVALID_CONTEXT;
}

CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *p, CUdevice dev)
{
    *p = &devs[dev].pool_tag;
    return OK;
}

CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value)
{
    pthread_mutex_lock(&mu);
    FAULT("cuMemPoolGetAttribute");
    int dev = dev_of_pool(pool);
    CUresult r = OK;
    uint64_t *v = value;
    hostpool *hp = host_pool_of(pool);
    xpool *x = xpool_of(pool);
    if (x) {
        uint64_t f[] = {x->threshold, x->reserved, x->reserved_high, x->used, x->used_high};
        if (attr >= 4 && attr <= 8)
            *v = f[attr - 4];
        else
            r = E_INVALID_VALUE;
    } else if (hp) {
        if (attr == 4)
            *v = hp->threshold;
        else if (attr == 5 || attr == 6)
            *v = hp->reserved;
        else if (attr == 7 || attr == 8)
            *v = hp->used;
        else
            r = E_INVALID_VALUE;
    } else if (dev < 0)
        r = E_INVALID_VALUE;
    else if (attr == 4)
        *v = devs[dev].threshold;
    else if (attr == 5)
        *v = devs[dev].reserved;
    else if (attr == 6)
        *v = devs[dev].reserved_high;
    else if (attr == 7)
        *v = devs[dev].used;
    else if (attr == 8)
        *v = devs[dev].used_high;
    else
        r = E_INVALID_VALUE;
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value)
{
    pthread_mutex_lock(&mu);
    FAULT("cuMemPoolSetAttribute");
    int dev = dev_of_pool(pool);
    CUresult r = OK;
    uint64_t v = *(uint64_t *)value;
    xpool *x = xpool_of(pool);
    if (x) {
        if (attr == 4)
            x->threshold = v;
        else if (attr == 6)
            x->reserved_high = x->reserved;
        else if (attr == 8)
            x->used_high = x->used;
        else
            r = E_INVALID_VALUE;
    } else if (dev < 0)
        r = E_INVALID_VALUE;
    else if (attr == 4)
        devs[dev].threshold = v;
    else if (attr == 6)
        devs[dev].reserved_high = devs[dev].reserved;
    else if (attr == 8)
        devs[dev].used_high = devs[dev].used;
    else
        r = E_INVALID_VALUE;
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep)
{
    pthread_mutex_lock(&mu);
    UNSAFE(0);
    int dev = dev_of_pool(pool);
    hostpool *hp = host_pool_of(pool);
    xpool *x = xpool_of(pool);
    if (x) {
        uint64_t floor = x->used > keep ? x->used : keep;
        if (x->reserved > floor)
            x->reserved = floor;
        counters[C_TRIM]++;
        pthread_mutex_unlock(&mu);
        return OK;
    }
    if (hp) {
        hp->reserved = hp->used > keep ? hp->used : keep;
        counters[C_TRIM]++;
        pthread_mutex_unlock(&mu);
        return OK;
    }
    if (dev >= 0) {
        device *d = &devs[dev];
        uint64_t floor = d->used > keep ? d->used : keep;
        if (d->reserved > floor)
            d->reserved = floor;
        counters[C_TRIM]++;
    }
    pthread_mutex_unlock(&mu);
    return dev >= 0 ? OK : E_INVALID_VALUE;
}

typedef struct {
    struct {
        int type, id;
    } location;
    int flags;
} access_desc;

CUresult cuMemPoolSetAccess(CUmemoryPool pool, const access_desc *map, size_t count)
{
    pthread_mutex_lock(&mu);
    int dev = dev_of_pool(pool);
    xpool *x = xpool_of(pool);
    if (dev >= 0)
        devs[dev].access_grants += count;
    if (x)
        x->access_grants += count;
    pthread_mutex_unlock(&mu);
    (void)map;
    return dev >= 0 || x ? OK : E_INVALID_VALUE;
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream s)
{
    (void)s;
    pthread_mutex_lock(&mu);
    FAULT("cuMemAllocFromPoolAsync");
    if (dead_stream(s)) {
        pthread_mutex_unlock(&mu);
        return E_INVALID_HANDLE;
    }
    int dev = dev_of_pool(pool);
    CUresult r = OK;
    hostpool *hp = host_pool_of(pool);
    xpool *x = xpool_of(pool);
    if (x) {
        uint64_t off = 0;
        if (!current_ctx)
            r = E_INVALID_CONTEXT;
        else if (x->imported || size == 0)
            r = E_INVALID_VALUE;
        else if (s == capturing_stream || (global_capture && s == global_capture_stream))
            r = 900;
        else if (devs[x->dev].used + xused(x->dev) + size > devs[x->dev].capacity ||
                 xalloc(x, size, &off) != 0)
            r = E_OUT_OF_MEMORY;
        else if (live_put((CUdeviceptr)(uintptr_t)(x->base + off), size, x->dev,
                          (int)(x - xpools)) != 0) {
            xfreed((int)(x - xpools), (CUdeviceptr)(uintptr_t)(x->base + off), 0);
            r = E_OUT_OF_MEMORY;
        } else {
            x->used += size;
            if (x->used > x->used_high)
                x->used_high = x->used;
            if (x->used > x->reserved)
                x->reserved = x->used;
            if (x->reserved > x->reserved_high)
                x->reserved_high = x->reserved;
            *dptr = (CUdeviceptr)(uintptr_t)(x->base + off);
            counters[C_ALLOC]++;
        }
        pthread_mutex_unlock(&mu);
        return r;
    }
    if (hp) {
        void *hptr = NULL;
        r = host_alloc(&hptr, size, hp);
        if (r == OK) {
            *dptr = (CUdeviceptr)(uintptr_t)hptr;
            counters[C_HOSTALLOC]++;
        }
        pthread_mutex_unlock(&mu);
        return r;
    }
    if (!current_ctx)
        r = E_INVALID_CONTEXT; /* what the autograd thread saw on a GPU */
    else if (dev < 0 || size == 0)
        r = E_INVALID_VALUE;
    else if (s == capturing_stream || (global_capture && s == global_capture_stream))
        r = 900; /* CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED-like: tests assert it never happens */
    else if (devs[dev].used + xused(dev) + size > devs[dev].capacity)
        r = E_OUT_OF_MEMORY;
    else {
        device *d = &devs[dev];
        CUdeviceptr p = next_addr;
        next_addr += (size + 511) / 512 * 512 + 512;
        if (live_put(p, size, dev, -1) != 0) {
            r = E_OUT_OF_MEMORY;
        } else {
            d->used += size;
            if (d->used > d->used_high)
                d->used_high = d->used;
            if (d->used > d->reserved)
                d->reserved = d->used;
            if (d->reserved > d->reserved_high)
                d->reserved_high = d->reserved;
            *dptr = p;
            counters[C_ALLOC]++;
        }
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s)
{
    pthread_mutex_lock(&mu);
    FAULT("cuMemFreeAsync");
    if (dead_stream(s)) {
        pthread_mutex_unlock(&mu);
        return E_INVALID_HANDLE;
    }
    live l;
    CUresult r = OK;
    if (current_ctx && host_owns((void *)(uintptr_t)p)) {
        /* a host-pool block: freed at once (as if its stream were idle) */
        r = host_free((void *)(uintptr_t)p, 1);
        if (r == OK)
            counters[C_HOSTFREE]++;
        pthread_mutex_unlock(&mu);
        return r;
    }
    for (size_t i = 0; current_ctx && i < nximports; i++)
        if (ximports[i].ptr == p) { /* an imported pointer: unmapped from this process */
            ximports[i] = ximports[--nximports];
            counters[C_FREE]++;
            pthread_mutex_unlock(&mu);
            return OK;
        }
    if (!current_ctx)
        r = E_INVALID_CONTEXT;
    else if (s == capturing_stream || (global_capture && s == global_capture_stream))
        r = 900;
    else if (live_take(p, &l) != 0)
        r = E_INVALID_VALUE; /* the driver would not know this pointer either */
    else {
        check_free_order(p, s, dev_of_ctx(current_ctx));
        device *d = &devs[l.dev];
        if (d->npend == MAXPENDING)
            complete(l.dev, NULL, 1);
        d->pend[d->npend++] = (pending){p, l.size, s, l.xp};
        counters[C_FREE]++;
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuStreamCreate(CUstream *s, unsigned int flags)
{
    pthread_mutex_lock(&mu);
    for (int i = 0; i < nstreams; i++)
        if (streams[i].dead) { /* the driver hands a destroyed stream's handle out again */
            streams[i].dead = 0;
            streams[i].nonblocking = flags & 1;
            streams[i].ctx = current_ctx;
            *s = streams[i].s;
            pthread_mutex_unlock(&mu);
            return OK;
        }
    *s = (CUstream)(next_handle += 16);
    if (nstreams < MAXSTREAMS) {
        streams[nstreams].s = *s;
        streams[nstreams].nonblocking = flags & 1;
        streams[nstreams++].ctx = current_ctx;
    }
    pthread_mutex_unlock(&mu);
    return OK;
}

CUresult cuStreamDestroy_v2(CUstream s)
{
    pthread_mutex_lock(&mu);
    CUresult r = E_INVALID_HANDLE;
    for (int i = 0; i < nstreams; i++)
        if (streams[i].s == s && !streams[i].dead) {
            /* its queued frees complete on their own, as on a GPU */
            for (int d = 0; d < ndev; d++)
                complete(d, s, 0);
            events_complete(s, 0);
            streams[i].dead = 1;
            r = OK;
            break;
        }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuStreamGetCtx(CUstream s, CUcontext *ctx)
{
    pthread_mutex_lock(&mu);
    FAULT("cuStreamGetCtx");
    CUresult r = E_INVALID_HANDLE;
    *ctx = NULL;
    if ((uintptr_t)s <= 2) {
        *ctx = current_ctx;
        r = current_ctx ? OK : E_INVALID_CONTEXT;
    } else if (!dead_stream(s)) {
        for (int i = 0; i < nstreams; i++)
            if (streams[i].s == s) {
                *ctx = streams[i].ctx ? streams[i].ctx : (CUcontext)&devs[0].ctx_tag;
                r = OK;
                break;
            }
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuStreamSynchronize(CUstream s)
{
    pthread_mutex_lock(&mu);
    FAULT("cuStreamSynchronize");
    UNSAFE(global_capture && s == global_capture_stream);
    if (dead_stream(s)) {
        pthread_mutex_unlock(&mu);
        return E_INVALID_HANDLE;
    }
    held_sync();
    int dev = dev_of_ctx(current_ctx);
    if (dev >= 0)
        complete(dev, s, 0);
    events_complete(s, 0);
    kernels_complete(s, dev);
    counters[C_SYNC]++;
    pthread_mutex_unlock(&mu);
    return OK;
}

CUresult cuStreamGetFlags(CUstream s, unsigned int *flags)
{
    pthread_mutex_lock(&mu);
    if (dead_stream(s)) {
        pthread_mutex_unlock(&mu);
        return E_INVALID_HANDLE;
    }
    *flags = (uintptr_t)s > 2 && nonblocking_stream(s) ? 1u : 0u;
    pthread_mutex_unlock(&mu);
    return OK;
}

CUresult cuStreamIsCapturing(CUstream s, int *status)
{
    pthread_mutex_lock(&mu);
    if (dead_stream(s)) {
        pthread_mutex_unlock(&mu);
        return E_INVALID_HANDLE;
    }
    *status = s == capturing_stream || (global_capture && s == global_capture_stream) ? 1 : 0;
    pthread_mutex_unlock(&mu);
    return OK;
}

CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned int flags)
{
    (void)flags;
    pthread_mutex_lock(&mu);
    if (dead_stream(s)) {
        pthread_mutex_unlock(&mu);
        return E_INVALID_HANDLE;
    }
    sevent *ev = e;
    for (size_t i = 0; ev && i < ev->nk; i++)
        for (skernel *k = kernels; k; k = k->next)
            if (k->id == ev->kids[i])
                kernel_after(k, s);
    last_wait_stream = s;
    last_wait_dev = dev_of_ctx(current_ctx);
    pthread_mutex_unlock(&mu);
    __atomic_fetch_add(&counters[C_WAIT], 1, __ATOMIC_RELAXED);
    return OK;
}

CUresult cuEventCreate(CUevent *e, unsigned int flags)
{
    (void)flags;
    pthread_mutex_lock(&mu);
    FAULT("cuEventCreate");
    sevent *ev = calloc(1, sizeof *ev);
    if (ev) {
        ev->next = events;
        events = ev;
        counters[C_EVCREATE]++;
    }
    *e = ev;
    pthread_mutex_unlock(&mu);
    return ev ? OK : E_OUT_OF_MEMORY;
}

CUresult cuEventRecord(CUevent e, CUstream s)
{
    pthread_mutex_lock(&mu);
    FAULT("cuEventRecord");
    if (dead_stream(s)) {
        pthread_mutex_unlock(&mu);
        return E_INVALID_HANDLE;
    }
    sevent *ev = e;
    if (ev) {
        ev->stream = s;
        ev->pending = hold_events;
        /* the queued kernels work on `s` is ordered after, now */
        free(ev->kids);
        ev->kids = NULL;
        ev->nk = 0;
        size_t n = 0;
        int dev = dev_of_ctx(current_ctx);
        for (skernel *k = kernels; k; k = k->next)
            n += ordered_after(k, s, dev);
        if (n && (ev->kids = malloc(n * sizeof *ev->kids)))
            for (skernel *k = kernels; k; k = k->next)
                if (ordered_after(k, s, dev))
                    ev->kids[ev->nk++] = k->id;
    }
    counters[C_RECORD]++;
    pthread_mutex_unlock(&mu);
    return ev ? OK : E_INVALID_HANDLE;
}

CUresult cuEventQuery(CUevent e)
{
    pthread_mutex_lock(&mu);
    FAULT("cuEventQuery");
    UNSAFE(0);
    sevent *ev = e;
    counters[C_EVQUERY]++;
    CUresult r = !ev ? E_INVALID_HANDLE : ev->pending ? 600 /* CUDA_ERROR_NOT_READY */ : OK;
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuEventDestroy_v2(CUevent e)
{
    pthread_mutex_lock(&mu);
    CUresult r = E_INVALID_HANDLE;
    for (sevent **pp = &events; *pp; pp = &(*pp)->next)
        if (*pp == e) {
            *pp = (*pp)->next;
            free(((sevent *)e)->kids);
            free(e);
            r = OK;
            break;
        }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuMemHostAlloc(void **pp, size_t bytes, unsigned int flags)
{
    (void)flags;
    pthread_mutex_lock(&mu);
    FAULT("cuMemHostAlloc");
    UNSAFE(0);
    CUresult r = host_alloc(pp, bytes, NULL);
    if (r == OK)
        counters[C_HOSTALLOC]++;
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuMemFreeHost(void *p)
{
    pthread_mutex_lock(&mu);
    FAULT("cuMemFreeHost");
    UNSAFE(0);
    CUresult r = host_free(p, 0);
    if (r == OK)
        counters[C_HOSTFREE]++;
    pthread_mutex_unlock(&mu);
    return r;
}

/* ---- managed memory: host memory (the CPU may touch it, as a GPU's), outside the
 * pools, counted per device against the device's capacity as a GPU counts it ---- */
typedef struct managed {
    CUdeviceptr ptr;
    size_t size;
    int dev;
} managed;
static managed *manageds;
static size_t nmanaged, capmanaged;
static uint64_t managed_bytes[MAXDEV];

CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned int flags)
{
    pthread_mutex_lock(&mu);
    FAULT("cuMemAllocManaged");
    int dev = dev_of_ctx(current_ctx);
    CUresult r = OK;
    if (dev < 0)
        r = E_INVALID_CONTEXT;
    else if (size == 0 || (flags != 1 && flags != 2)) /* CU_MEM_ATTACH_GLOBAL or _HOST */
        r = E_INVALID_VALUE;
    else {
        /* no bound of the device's: managed memory may be larger than the
         * device (oversubscription, Linux and Pascal or later), the host's
         * memory bounds it */
        if (nmanaged == capmanaged) {
            size_t ncap = capmanaged * 2 + 16;
            managed *grown = realloc(manageds, ncap * sizeof *grown);
            if (grown) {
                manageds = grown;
                capmanaged = ncap;
            }
        }
        void *p = nmanaged < capmanaged ? calloc(1, size) : NULL;
        if (!p) {
            r = E_OUT_OF_MEMORY;
        } else {
            manageds[nmanaged++] = (managed){(CUdeviceptr)(uintptr_t)p, size, dev};
            managed_bytes[dev] += size;
            *dptr = (CUdeviceptr)(uintptr_t)p;
        }
    }
    pthread_mutex_unlock(&mu);
    return r;
}

/* cuMemFree of a managed block (the only kind the bridge frees synchronously). */
CUresult cuMemFree_v2(CUdeviceptr p)
{
    pthread_mutex_lock(&mu);
    FAULT("cuMemFree_v2");
    CUresult r = E_INVALID_VALUE;
    for (size_t i = 0; i < nmanaged; i++)
        if (manageds[i].ptr == p) {
            managed_bytes[manageds[i].dev] -= manageds[i].size;
            free((void *)(uintptr_t)p);
            manageds[i] = manageds[--nmanaged];
            r = OK;
            break;
        }
    pthread_mutex_unlock(&mu);
    return r;
}

uint64_t standin_managed_bytes(int dev)
{
    pthread_mutex_lock(&mu);
    uint64_t b = dev >= 0 && dev < MAXDEV ? managed_bytes[dev] : 0;
    pthread_mutex_unlock(&mu);
    return b;
}

static int new_xpool(void)
{
    for (int i = 0; i < MAXXPOOLS; i++)
        if (!xpools[i].in_use) {
            free(xpools[i].r);
            memset(&xpools[i], 0, sizeof xpools[i]);
            return i;
        }
    return -1;
}

/* Host-located pinned pools, and device pools with POSIX file-descriptor
 * export (the exportable pools above); the ledger's default pools are
 * cuDeviceGetDefaultMemPool's. */
CUresult cuMemPoolCreate(CUmemoryPool *pool, const void *props)
{
    const int *f = props; /* allocType, handleTypes, location.type, location.id */
    pthread_mutex_lock(&mu);
    FAULT("cuMemPoolCreate");
    CUresult r = 801; /* CUDA_ERROR_NOT_SUPPORTED */
    if (f[0] == 1 && f[1] == 1 && f[2] == 1) {
        int i = new_xpool(), fd = -1;
        struct stat st;
        void *base = MAP_FAILED;
        if (f[3] < 0 || f[3] >= ndev)
            r = E_INVALID_DEVICE;
        else if (i < 0 || (fd = memfd_create("standin-pool", MFD_CLOEXEC)) < 0 ||
                 ftruncate(fd, (off_t)XPOOL_CAP) != 0 || fstat(fd, &st) != 0 ||
                 (base = mmap(NULL, XPOOL_CAP, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) ==
                     MAP_FAILED) {
            if (fd >= 0)
                close(fd);
            r = E_OUT_OF_MEMORY;
        } else {
            xpool *x = &xpools[i];
            x->in_use = 1;
            x->dev = f[3];
            x->fd = fd;
            x->base = base;
            x->cap = XPOOL_CAP;
            x->ino = (uint64_t)st.st_ino;
            *pool = (CUmemoryPool)x;
            r = OK;
        }
        pthread_mutex_unlock(&mu);
        return r;
    }
    if (host_pools_supported && f[0] == 1 && (f[2] == 2 || f[2] == 3))
        for (int i = 0; i < MAXHOSTPOOLS; i++)
            if (!hostpools[i].in_use) {
                hostpools[i] = (hostpool){1, 0, 0, 0};
                *pool = &hostpools[i];
                counters[C_HOSTPOOL]++;
                r = OK;
                break;
            }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    pthread_mutex_lock(&mu);
    xpool *x = xpool_of(pool);
    if (x) {
        munmap(x->base, x->cap);
        if (x->fd >= 0)
            close(x->fd);
        x->in_use = 0;
        pthread_mutex_unlock(&mu);
        return OK;
    }
    hostpool *hp = host_pool_of(pool);
    if (hp)
        hp->in_use = 0;
    pthread_mutex_unlock(&mu);
    return hp ? OK : E_INVALID_VALUE;
}

CUresult cuMemPoolExportToShareableHandle(void *handle, CUmemoryPool pool, int type,
                                          unsigned long long flags)
{
    pthread_mutex_lock(&mu);
    FAULT("cuMemPoolExportToShareableHandle");
    xpool *x = xpool_of(pool);
    CUresult r = OK;
    if (!x || x->imported || type != 1 || flags)
        r = E_INVALID_VALUE;
    else if ((*(int *)handle = dup(x->fd)) < 0)
        r = E_OUT_OF_MEMORY;
    else
        x->shared = 1;
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuMemPoolImportFromShareableHandle(CUmemoryPool *pool, void *handle, int type,
                                            unsigned long long flags)
{
    int fd = (int)(intptr_t)handle;
    struct stat st;
    pthread_mutex_lock(&mu);
    FAULT("cuMemPoolImportFromShareableHandle");
    CUresult r = OK;
    int i = new_xpool();
    void *base = MAP_FAILED;
    if (type != 1 || flags || fstat(fd, &st) != 0 || (uint64_t)st.st_size != XPOOL_CAP)
        r = E_INVALID_VALUE;
    else if (i < 0 || (base = mmap(NULL, XPOOL_CAP, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) ==
                          MAP_FAILED)
        r = E_OUT_OF_MEMORY;
    else {
        xpool *x = &xpools[i];
        x->in_use = x->imported = 1;
        x->fd = -1; /* the caller's fd stays the caller's */
        x->base = base;
        x->cap = XPOOL_CAP;
        x->ino = (uint64_t)st.st_ino;
        *pool = (CUmemoryPool)x;
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuMemPoolExportPointer(void *data, CUdeviceptr p)
{
    pthread_mutex_lock(&mu);
    FAULT("cuMemPoolExportPointer");
    CUresult r = E_INVALID_VALUE;
    size_t j = caplive ? slot_of(p) & (caplive - 1) : 0;
    while (caplive && lives[j].ptr) {
        if (lives[j].ptr == p) {
            if (lives[j].xp >= 0 && xpools[lives[j].xp].shared) {
                xpool *x = &xpools[lives[j].xp];
                xexport e = {XPOOL_MAGIC,
                             x->ino,
                             (uint64_t)((char *)(uintptr_t)p - x->base),
                             lives[j].size,
                             {0}};
                memcpy(data, &e, sizeof e);
                r = OK;
            }
            break;
        }
        j = (j + 1) & (caplive - 1);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuMemPoolImportPointer(CUdeviceptr *p, CUmemoryPool pool, void *data)
{
    xexport e;
    memcpy(&e, data, sizeof e);
    pthread_mutex_lock(&mu);
    FAULT("cuMemPoolImportPointer");
    xpool *x = xpool_of(pool);
    CUresult r = OK;
    if (!x || !x->imported || e.magic != XPOOL_MAGIC || e.ino != x->ino || e.off + e.size > x->cap)
        r = E_INVALID_VALUE;
    else if (nximports == MAXXIMPORTS)
        r = E_OUT_OF_MEMORY;
    else {
        *p = (CUdeviceptr)(uintptr_t)(x->base + e.off);
        ximports[nximports].ptr = *p;
        ximports[nximports++].xp = (int)(x - xpools);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

/* Pointers imported and not yet freed (tests). */
uint64_t standin_imported_count(void)
{
    pthread_mutex_lock(&mu);
    uint64_t n = nximports;
    pthread_mutex_unlock(&mu);
    return n;
}

CUresult cuThreadExchangeStreamCaptureMode(int *mode)
{
    int old = capture_mode;
    capture_mode = *mode;
    *mode = old;
    __atomic_fetch_add(&counters[C_MODE], 1, __ATOMIC_RELAXED);
    return OK;
}

/* ---- stream capture, graphs, user objects ---- */
#define E_CAPTURE_INVALIDATED 901 /* CUDA_ERROR_STREAM_CAPTURE_INVALIDATED */
#define E_ILLEGAL_STATE       401 /* CUDA_ERROR_ILLEGAL_STATE */

CUresult cuStreamBeginCapture_v2(CUstream s, int mode)
{
    (void)mode;
    pthread_mutex_lock(&mu);
    FAULT("cuStreamBeginCapture_v2");
    CUresult r = OK;
    if (dead_stream(s))
        r = E_INVALID_HANDLE;
    else if (capture_graph) /* the stand-in captures one stream at a time */
        r = E_ILLEGAL_STATE;
    else if (!(capture_graph = graph_new()))
        r = E_OUT_OF_MEMORY;
    else {
        capturing_stream = s;
        capture_invalid = 0;
    }
    pthread_mutex_unlock(&mu);
    return r;
}

/* The capture's graph goes to the caller; an invalidated capture's is
 * destroyed (its user objects' references released) and NULL returned. */
CUresult cuStreamEndCapture(CUstream s, void **graph)
{
    pthread_mutex_lock(&mu);
    *graph = NULL;
    CUresult r = OK;
    if (!capture_graph || s != capturing_stream)
        r = E_ILLEGAL_STATE;
    else {
        sgraph *g = capture_graph;
        capture_graph = NULL;
        capturing_stream = (CUstream)(uintptr_t)-1;
        g->capturing = 0;
        if (capture_invalid) {
            graph_free(g);
            r = E_CAPTURE_INVALIDATED;
        } else {
            *graph = g;
        }
        capture_invalid = 0;
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuStreamGetCaptureInfo_v2(CUstream s, int *status, uint64_t *id, void **graph,
                                   const void **deps, size_t *ndeps)
{
    pthread_mutex_lock(&mu);
    FAULT("cuStreamGetCaptureInfo_v2");
    if (dead_stream(s)) {
        pthread_mutex_unlock(&mu);
        return E_INVALID_HANDLE;
    }
    sgraph *g = s == capturing_stream                          ? capture_graph
                : global_capture && s == global_capture_stream ? global_graph
                                                               : NULL;
    *status = !g ? 0 : (g == capture_graph && capture_invalid) ? 2 : 1;
    if (id)
        *id = g ? g->id : 0;
    if (graph)
        *graph = *status == 1 ? g : NULL;
    if (deps)
        *deps = NULL;
    if (ndeps)
        *ndeps = 0;
    pthread_mutex_unlock(&mu);
    return OK;
}

CUresult cuUserObjectCreate(void **obj, void *ptr, CUhostFn destroy, unsigned int refs,
                            unsigned int flags)
{
    pthread_mutex_lock(&mu);
    FAULT("cuUserObjectCreate");
    CUresult r = OK;
    suobj *o = NULL;
    if (!destroy || !refs || flags != 1) /* CU_USER_OBJECT_NO_DESTRUCTOR_SYNC is required */
        r = E_INVALID_VALUE;
    else if (!(o = malloc(sizeof *o)))
        r = E_OUT_OF_MEMORY;
    else {
        *o = (suobj){refs, ptr, destroy};
        live_uobjs++;
    }
    *obj = o;
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuUserObjectRelease(void *obj, unsigned int count)
{
    pthread_mutex_lock(&mu);
    CUresult r = OK;
    if (!obj || !count)
        r = E_INVALID_VALUE;
    else
        uobj_release(obj, count);
    pthread_mutex_unlock(&mu);
    return r;
}

static int refs_add(srefs *r, suobj *o, unsigned count) /* under mu */
{
    for (size_t i = 0; i < r->n; i++)
        if (r->r[i].obj == o) {
            r->r[i].count += count;
            return 0;
        }
    sref *n = realloc(r->r, (r->n + 1) * sizeof *n);
    if (!n)
        return -1;
    n[r->n++] = (sref){o, count};
    r->r = n;
    return 0;
}

/* CU_GRAPH_USER_OBJECT_MOVE (1): the caller's references move to the graph;
 * 0: new references. */
CUresult cuGraphRetainUserObject(void *graph, void *obj, unsigned int count, unsigned int flags)
{
    pthread_mutex_lock(&mu);
    FAULT("cuGraphRetainUserObject");
    CUresult r = OK;
    suobj *o = obj;
    if (!graph_live(graph) || !o || !count || (flags & ~1u))
        r = E_INVALID_VALUE;
    else if (refs_add(&((sgraph *)graph)->refs, o, count) != 0)
        r = E_OUT_OF_MEMORY;
    else if (!(flags & 1))
        o->refs += count;
    pthread_mutex_unlock(&mu);
    return r;
}

/* An exec retains a copy of every reference its graph owns. */
CUresult cuGraphInstantiateWithFlags(void **exec, void *graph, unsigned long long flags)
{
    (void)flags;
    pthread_mutex_lock(&mu);
    FAULT("cuGraphInstantiateWithFlags");
    *exec = NULL;
    CUresult r = OK;
    sgraph *g = graph;
    sexec *x = NULL;
    if (!graph_live(g) || g->capturing)
        r = E_INVALID_VALUE;
    else if (!(x = calloc(1, sizeof *x)) ||
             (g->refs.n && !(x->refs.r = malloc(g->refs.n * sizeof *x->refs.r)))) {
        free(x);
        r = E_OUT_OF_MEMORY;
    } else {
        for (size_t i = 0; i < g->refs.n; i++) {
            x->refs.r[i] = g->refs.r[i];
            g->refs.r[i].obj->refs += g->refs.r[i].count;
        }
        x->refs.n = g->refs.n;
        x->next = execs;
        execs = x;
        *exec = x;
    }
    pthread_mutex_unlock(&mu);
    return r;
}

static int exec_live(sexec *x)
{
    for (sexec *y = execs; y; y = y->next)
        if (y == x && !y->destroyed)
            return 1;
    return 0;
}

/* The launch runs until its stream completes (synchronized, or
 * standin_complete_events). */
CUresult cuGraphLaunch(void *exec, CUstream s)
{
    pthread_mutex_lock(&mu);
    CUresult r = OK;
    sexec *x = exec;
    if (!exec_live(x))
        r = E_INVALID_VALUE;
    else if (dead_stream(s))
        r = E_INVALID_HANDLE;
    else {
        x->pending = 1;
        x->launched = s;
    }
    pthread_mutex_unlock(&mu);
    return r;
}

/* A launch not completed keeps the exec's references until it completes. */
CUresult cuGraphExecDestroy(void *exec)
{
    pthread_mutex_lock(&mu);
    CUresult r = OK;
    sexec *x = exec;
    if (!exec_live(x))
        r = E_INVALID_VALUE;
    else {
        x->destroyed = 1;
        if (!x->pending)
            exec_gone(x);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuGraphDestroy(void *graph)
{
    pthread_mutex_lock(&mu);
    CUresult r = OK;
    sgraph *g = graph;
    if (!graph_live(g) || g->capturing)
        r = E_INVALID_VALUE;
    else
        graph_free(g);
    pthread_mutex_unlock(&mu);
    return r;
}

/* ---- controls for the tests ---- */
void standin_set_capacity(int dev, uint64_t bytes)
{
    pthread_mutex_lock(&mu);
    devs[dev].capacity = bytes;
    pthread_mutex_unlock(&mu);
}

/* Bytes held in the pool by others (JAX): counted in USED_MEM_CURRENT. */
void standin_add_foreign(int dev, int64_t delta)
{
    pthread_mutex_lock(&mu);
    devs[dev].used += (uint64_t)delta;
    if (devs[dev].used > devs[dev].reserved)
        devs[dev].reserved = devs[dev].used;
    pthread_mutex_unlock(&mu);
}

void standin_set_pools_supported(int dev, int on)
{
    pthread_mutex_lock(&mu);
    devs[dev].pools_supported = on;
    pthread_mutex_unlock(&mu);
}

/* The next `count` calls of `entry` return `code`. */
void standin_fail(const char *entry, int code, int count)
{
    pthread_mutex_lock(&mu);
    for (int i = 0; i < 16; i++)
        if (faults[i].count <= 0 || strcmp(faults[i].name, entry) == 0) {
            strncpy(faults[i].name, entry, sizeof faults[i].name - 1);
            faults[i].code = code;
            faults[i].count = count;
            break;
        }
    pthread_mutex_unlock(&mu);
}

void standin_clear_faults(void)
{
    pthread_mutex_lock(&mu);
    memset(faults, 0, sizeof faults);
    pthread_mutex_unlock(&mu);
}

/* Frees queued on streams that have not been synchronized. */
uint64_t standin_pending_bytes(int dev)
{
    pthread_mutex_lock(&mu);
    uint64_t b = 0;
    for (size_t i = 0; i < devs[dev].npend; i++)
        b += devs[dev].pend[i].size;
    pthread_mutex_unlock(&mu);
    return b;
}

/* Frees queued on one stream handle (as the core passed it). */
uint64_t standin_pending_on(int dev, CUstream s)
{
    pthread_mutex_lock(&mu);
    uint64_t b = 0;
    for (size_t i = 0; i < devs[dev].npend; i++)
        if (devs[dev].pend[i].stream == s)
            b += devs[dev].pend[i].size;
    pthread_mutex_unlock(&mu);
    return b;
}

uint64_t standin_live_count(void)
{
    pthread_mutex_lock(&mu);
    uint64_t n = nlive;
    pthread_mutex_unlock(&mu);
    return n;
}

uint64_t standin_counter(int which)
{
    return __atomic_load_n(&counters[which], __ATOMIC_RELAXED);
}

uint64_t standin_access_grants(int dev)
{
    return devs[dev].access_grants;
}

/* The grants of device dev's exportable pools (this process's own, not imported). */
uint64_t standin_xpool_access_grants(int dev)
{
    uint64_t n = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAXXPOOLS; i++)
        if (xpools[i].in_use && !xpools[i].imported && xpools[i].dev == dev)
            n += xpools[i].access_grants;
    pthread_mutex_unlock(&mu);
    return n;
}

/* Make `s` report an active capture (NULL: none). Driver calls on it fail. */
void standin_set_capturing(CUstream s)
{
    pthread_mutex_lock(&mu);
    capturing_stream = s ? s : (CUstream)(uintptr_t)-1;
    if (s && !capture_graph)
        capture_graph = graph_new();
    else if (!s && capture_graph) { /* ended without cuStreamEndCapture: nobody has the graph */
        graph_free(capture_graph);
        capture_graph = NULL;
    }
    capture_invalid = 0;
    pthread_mutex_unlock(&mu);
}

/* Forget the calling thread's current context (a fresh thread, autograd's). */
void standin_clear_current(void)
{
    current_ctx = NULL;
}

int standin_capture_mode(void)
{
    return capture_mode;
}

/* Complete every queued free of a device. */
void standin_sync_all(int dev)
{
    pthread_mutex_lock(&mu);
    complete(dev, NULL, 1);
    kernels_complete(NULL, dev);
    pthread_mutex_unlock(&mu);
}

/* Events recorded from now on stay pending (1) or complete at once (0). */
void standin_hold_events(int on)
{
    pthread_mutex_lock(&mu);
    hold_events = on;
    pthread_mutex_unlock(&mu);
}

/* Complete every pending event (the GPU caught up). */
void standin_complete_events(void)
{
    pthread_mutex_lock(&mu);
    events_complete(NULL, 1);
    kernels_complete(NULL, -1);
    pthread_mutex_unlock(&mu);
}

uint64_t standin_pending_events(void)
{
    pthread_mutex_lock(&mu);
    uint64_t n = 0;
    for (sevent *e = events; e; e = e->next)
        n += e->pending;
    pthread_mutex_unlock(&mu);
    return n;
}

uint64_t standin_live_events(void)
{
    pthread_mutex_lock(&mu);
    uint64_t n = 0;
    for (sevent *e = events; e; e = e->next)
        n++;
    pthread_mutex_unlock(&mu);
    return n;
}

/* Pinned host bytes the system lets the process hold (UINT64_MAX: any). */
void standin_set_host_capacity(uint64_t bytes)
{
    pthread_mutex_lock(&mu);
    host_capacity = bytes;
    pthread_mutex_unlock(&mu);
}

/* Pinned host bytes allocated (cuMemHostAlloc and host pools), not freed. */
uint64_t standin_host_used(void)
{
    pthread_mutex_lock(&mu);
    uint64_t b = host_used;
    pthread_mutex_unlock(&mu);
    return b;
}

void standin_set_host_pools_supported(int on)
{
    pthread_mutex_lock(&mu);
    host_pools_supported = on;
    pthread_mutex_unlock(&mu);
}

/* A stream of device `dev`'s primary context (what torch or CuPy would make). */
/* Declare a handle a test made up as a stream of device `dev`. */
void standin_adopt_stream(CUstream s, int dev)
{
    pthread_mutex_lock(&mu);
    int known = 0;
    for (int i = 0; i < nstreams; i++)
        known |= streams[i].s == s;
    if (!known && nstreams < MAXSTREAMS) {
        streams[nstreams].s = s;
        streams[nstreams++].ctx = (CUcontext)&devs[dev].ctx_tag;
    }
    pthread_mutex_unlock(&mu);
}

CUstream standin_new_stream(int dev)
{
    pthread_mutex_lock(&mu);
    CUstream s = (CUstream)(next_handle += 16);
    if (nstreams < MAXSTREAMS && dev >= 0 && dev < ndev) {
        streams[nstreams].s = s;
        streams[nstreams++].ctx = &devs[dev].ctx_tag;
    }
    pthread_mutex_unlock(&mu);
    return s;
}

/* Another thread captures `s` in global mode from now (1) or not (0); see
 * unsafe_call.  `s` reports capturing; driver calls on it fail. */
void standin_set_global_capture(int on, CUstream s)
{
    pthread_mutex_lock(&mu);
    global_capture = on;
    global_capture_stream = on ? s : NULL;
    if (on && !global_graph)
        global_graph = graph_new();
    else if (!on && global_graph) {
        graph_free(global_graph);
        global_graph = NULL;
    }
    pthread_mutex_unlock(&mu);
}

/* The last cuStreamWaitEvent's stream handle and the device of the context
 * that was current for it (-1: none). */
CUstream standin_last_wait(int *dev)
{
    pthread_mutex_lock(&mu);
    CUstream s = last_wait_stream;
    *dev = last_wait_dev;
    pthread_mutex_unlock(&mu);
    return s;
}

/* Synchronizations wait in the driver from now (1) until released (0). */
void standin_hold_syncs(int on)
{
    pthread_mutex_lock(&mu);
    hold_syncs = on;
    if (!on)
        pthread_cond_broadcast(&sync_cv);
    pthread_mutex_unlock(&mu);
}

/* Synchronizations waiting in the driver now. */
int standin_syncs_waiting(void)
{
    pthread_mutex_lock(&mu);
    int n = syncs_waiting;
    pthread_mutex_unlock(&mu);
    return n;
}

/* The running capture (standin_set_capturing's or cuStreamBeginCapture_v2's)
 * is invalidated: cuStreamEndCapture fails and destroys its graph. */
void standin_invalidate_capture(void)
{
    pthread_mutex_lock(&mu);
    if (capture_graph)
        capture_invalid = 1;
    pthread_mutex_unlock(&mu);
}

/* Destructors of user objects wait in the queue from now (1) until released (0). */
void standin_hold_destructors(int on)
{
    pthread_mutex_lock(&dmu);
    dhold = on;
    pthread_cond_broadcast(&dcv);
    pthread_mutex_unlock(&dmu);
}

/* Destructors run so far, once those queued now have run (unless held). */
uint64_t standin_wait_destructors(void)
{
    pthread_mutex_lock(&dmu);
    while ((dq && !dhold) || drunning)
        pthread_cond_wait(&dcv, &dmu);
    uint64_t n = dran;
    pthread_mutex_unlock(&dmu);
    return n;
}

/* Destructors queued and not run yet. */
uint64_t standin_queued_destructors(void)
{
    pthread_mutex_lock(&dmu);
    uint64_t n = 0;
    for (sdtor *t = dq; t; t = t->next)
        n++;
    pthread_mutex_unlock(&dmu);
    return n;
}

/* User objects whose destructor is not queued yet (some reference lives). */
uint64_t standin_live_user_objects(void)
{
    pthread_mutex_lock(&mu);
    uint64_t n = live_uobjs;
    pthread_mutex_unlock(&mu);
    return n;
}

/* A stream of device `dev` created with `flags` (1: CU_STREAM_NON_BLOCKING),
 * as torch's pool or cupy.cuda.Stream(non_blocking=True) makes one. */
CUstream standin_new_stream_flags(int dev, unsigned int flags)
{
    pthread_mutex_lock(&mu);
    CUstream s = (CUstream)(next_handle += 16);
    if (nstreams < MAXSTREAMS && dev >= 0 && dev < ndev) {
        streams[nstreams].s = s;
        streams[nstreams].nonblocking = flags & 1;
        streams[nstreams++].ctx = &devs[dev].ctx_tag;
    }
    pthread_mutex_unlock(&mu);
    return s;
}

/* A kernel that reads block `p`, queued on `s` (handles 0, 1 and 2: of the
 * current context's device, else of `dev`): queued until a synchronization
 * covers it (see the banner). */
void standin_launch(CUstream s, unsigned long long p, int dev)
{
    pthread_mutex_lock(&mu);
    skernel *k = calloc(1, sizeof *k);
    if (k) {
        k->id = ++kernel_ids;
        k->ptr = p;
        k->dev = (uintptr_t)s <= 2 && dev_of_ctx(current_ctx) >= 0 ? dev_of_ctx(current_ctx) : dev;
        k->after[k->nafter++] = norm_stream(s);
        k->next = kernels;
        kernels = k;
    }
    pthread_mutex_unlock(&mu);
}

/* Kernels still queued. */
uint64_t standin_queued_kernels(void)
{
    pthread_mutex_lock(&mu);
    uint64_t n = 0;
    for (skernel *k = kernels; k; k = k->next)
        n++;
    pthread_mutex_unlock(&mu);
    return n;
}
