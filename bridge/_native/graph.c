/* SPDX-License-Identifier: Apache-2.0 */
/* graph.c: CUDA graph pools, as torch's private pools behave.
 *
 * Glossary
 *   pool       one torch MempoolId: the memory of the graphs captured into it
 *              (torch.cuda.graph(pool=...), graph_pool_handle(),
 *              make_graphed_callables) or of a torch.cuda.use_mem_pool block.
 *   uses       begins minus releases: torch calls begin once per capture (or
 *              use_mem_pool) into the pool and release once per graph reset
 *              (or use_mem_pool exit).  The pool's memory lives until uses
 *              falls to 0, so a pool shared by several graphs lives until the
 *              last of them is released.
 *   graph block a block allocated for a pool: allocated OUTSIDE the capture
 *              (on the device's side stream, complete before it is returned),
 *              so the graph has no allocation node and every replay finds it
 *              at the same address; its record names the stream the work was
 *              captured on, which frees of it are ordered on.
 *   free list  graph blocks of a pool the user freed: their memory stays with
 *              the pool (replays may still write it) and later allocations in
 *              the same pool on the same stream reuse it, in capture order, as
 *              torch's private pool does.  Graphs sharing a pool must be
 *              replayed in the order they were captured (torch's rule too).
 *   release    the last user released the pool: its user-freed blocks go
 *              back to the pool, and its live blocks (static outputs) become
 *              ordinary blocks.  A replay may still run, on any stream (torch
 *              replays on the current stream: a non-blocking one, which the
 *              legacy stream does not wait for, or a torch.cuda.ExternalStream
 *              the core cannot name), and the core is never told where: so
 *              where a capture used the pool (`replayable`), every block of it
 *              is REC_UNORDERED: the user-freed ones now, the live ones at
 *              their free, are HELD (block.h) until a device-wide
 *              synchronization, which the recovery chain makes before a
 *              refusal and a trim (empty_cache) makes, then given back
 *              (ledger_hold, ledger_settle_held).  torch's own
 *              release does the same: a private pool's memory goes back only
 *              through empty_cache or the OOM retry, by cudaFree, which
 *              synchronizes the device.  No host wait at the release itself.
 *              A pool no capture used (a torch.cuda.use_mem_pool routing's),
 *              a dead CuPy graph's (its launches completed) and a failed
 *              capture's have no replay to wait for: each free is ordered on
 *              the legacy default stream (after every blocking stream) and
 *              after the capture stream, as any free.
 *              The pool leaves the table and its blocks are swept in one
 *              step under capture_lock, so a capture that begins a pool with
 *              the same id meanwhile keeps its own.
 *   ended unannounced  torch 2.11's capture_end checks cudaStreamEndCapture
 *              before it calls the end hook, and its reset releases only a
 *              capture that ended well: after an invalidated capture the
 *              core hears neither (pytorch PRs 180395 and 190348 changed
 *              that; torch 2.14 sends both at the graph's reset, which may
 *              come much later).  The core watches the stream of each torch
 *              capture and its capture id: the torch allocator tells the
 *              stream at the begin hook (torch's current stream; torch calls
 *              the hook just before cudaStreamBeginCapture, and the begin is
 *              a capture, not a routing, when torch's filter refuses that
 *              stream then: bridge_graph_begin_on), else the first
 *              allocation into the pool names it; only a registered stream
 *              (alive for good, safe to ask later).  When the thread that
 *              began the capture finds that stream no longer in that
 *              capture (or, told at the begin, not capturing and never seen
 *              capturing: the capture began right after the hook and has
 *              ended), and the end hook never came, the capture failed (a
 *              capture that ends well calls the hook in that thread before
 *              capture_end returns, and nothing between the hook and
 *              cudaStreamBeginCapture calls the allocator): the core ends it
 *              and drops its use of the pool, as torch's fixed capture_end
 *              and reset do (graph_reap_ended).  A capture on a stream
 *              nobody registered (an ExternalStream: its handle may be dead
 *              by the next look) is never asked about: it ends with torch's
 *              end hook, if one comes.  Nor is a routing (use_mem_pool) ever
 *              watched: a torch.cuda.graph captured inside it allocates into
 *              the routing's pool (torch's first route), on a stream whose
 *              capture is the graph's pool's, not the routing's.
 *   CuPy pool  a pool of one CuPy capture (bridge_capture_begin_stream):
 *              allocations on the capturing stream are routed to it, and it
 *              is released when CuPy's Graph dies: a CUDA user object the
 *              captured graph owns tells the core (bridge_capture_bind_graph,
 *              graph_collect_dead); adapters/cupy.py falls back on CuPy's own
 *              hooks when the driver refuses one.
 * A graph block's states (GRAPH_LIVE, GRAPH_FREED, then LIVE or HELD at the
 * release), their figures and transitions: block.h.
 * Locking: every field here is under the device's capture_lock.  The records
 * table's shard locks are never taken while a shard lock is held by the
 * caller: the release sweep collects records first and releases them after.
 */
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ledger.h"
#include "cache.h"
#include "graph.h"

typedef struct gblock {
    uintptr_t ptr;
    uint64_t size;
    CUstream stream; /* key */
} gblock;

typedef struct gpool {
    uint64_t id0, id1;
    int uses;       /* see the glossary */
    int capturing;  /* begins minus ends */
    CUstream bound; /* a CuPy capture's stream key while it captures; NULL: none */
    int owned;      /* a CuPy pool whose release a user object of its graph owns */
    gblock *free;   /* the free list */
    size_t nfree, capfree;
    /* a torch capture's stream, seen capturing (see "ended unannounced") */
    CUstream watch;      /* its key, a registered stream; NULL: none seen */
    uint64_t watch_id;   /* the capture's id there */
    unsigned long owner; /* the thread that began the capture */
    int watch_asked;     /* the stream was asked once since the last begin */
    int unannounced;     /* captures the core ended itself, their uses dropped */
    /* the stream a torch capture begins on, told at its begin hook before
     * the capture starts (bridge_graph_begin_on): a registered stream; NULL:
     * none told (see "ended unannounced") */
    CUstream cand;
    int replayable; /* a capture (or a begin of unknown kind) used the pool: a
                       graph may replay into its blocks (see "release") */
    int routing;    /* its begins since it last captured nothing are routings
                       (use_mem_pool): a stream its allocations meet capturing
                       is another pool's capture's, never watched */
} gpool;

struct graph_pools {
    gpool *pool;
    size_t n, cap;
};

/* A freed block fits a request when it is at least as large and at most
 * twice as large (no splitting: a block is one pool allocation). */
#define FIT_SLACK 2

static gpool *find_pool(device_state *d, uint64_t id0, uint64_t id1)
{
    graph_pools *g = d->graphs;
    for (size_t i = 0; g && i < g->n; i++)
        if (g->pool[i].id0 == id0 && g->pool[i].id1 == id1)
            return &g->pool[i];
    return NULL;
}

static gpool *add_pool(device_state *d, uint64_t id0, uint64_t id1)
{
    if (!d->graphs && !(d->graphs = calloc(1, sizeof *d->graphs)))
        return NULL;
    graph_pools *g = d->graphs;
    if (g->n == g->cap) {
        size_t ncap = g->cap ? g->cap * 2 : 16;
        gpool *n = realloc(g->pool, ncap * sizeof *n);
        if (!n)
            return NULL;
        g->pool = n;
        g->cap = ncap;
    }
    gpool *p = &g->pool[g->n++];
    *p = (gpool){.id0 = id0, .id1 = id1};
    return p;
}

static void drop_pool(device_state *d, gpool *p)
{
    graph_pools *g = d->graphs;
    free(p->free);
    *p = g->pool[--g->n];
}

int bridge_captures_active(int device)
{
    device_state *d = device_of(device);
    return d ? atomic_load(&d->captures_active) : 0;
}

/* The capture counted (under capture_lock or not), a synchronization that
 * did not see it ends before it begins (ledger.h). */
static void wait_for_syncs(device_state *d)
{
    while (atomic_load(&d->syncs))
        sched_yield();
}

static int release_pool(device_state *d, int device, uint64_t id0, uint64_t id1, int drop,
                        int replays);

/* ---- captures the bridge is told of (torch's hooks, CuPy's Stream) ---- */
int bridge_capture_begin(int device)
{
    int rc;
    device_state *d = device_use(device, &rc);
    if (!d)
        return rc;
    /* the carved blocks parked in thread slots back to their segments before
     * the capture counts (a parked block is no capture's to take) */
    cache_release_carved(device);
    capture_announce(d);
    return BRIDGE_OK;
}

int bridge_capture_end(int device)
{
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_DEVICE;
    int cur = atomic_load(&d->captures_active);
    while (cur > 0 && !atomic_compare_exchange_weak(&d->captures_active, &cur, cur - 1))
        ;
    if (cur <= 0)
        return BRIDGE_E_INVALID;
    /* The capture has ended (torch and CuPy end it before telling): the
     * frees it held back can go now, not only under pressure. */
    if (cur == 1)
        ledger_captures_ended(d);
    return BRIDGE_OK;
}

/* ---- torch's pool hooks ---- */
/* What a begin is: a use without a capture (torch.cuda.MemPool's creation),
 * a begin whose kind the caller does not know (it may be a capture), a
 * capture that begins next on a stream the caller names, a routing of a
 * thread or stream (use_mem_pool, graph trees' warm-up) that never captures. */
enum { USE_ONLY, BEGIN_UNKNOWN, BEGIN_CAPTURE, BEGIN_ROUTING };

/* One more user of the pool (made on first use); every begin is counted as
 * an active capture (a routing too: the torch allocator asks its routes
 * only while one is); `key`: a BEGIN_CAPTURE's stream. */
static int pool_use(device_state *d, uint64_t id0, uint64_t id1, int kind, CUstream key)
{
    int rc = BRIDGE_OK;
    pthread_mutex_lock(&d->capture_lock);
    gpool *p = find_pool(d, id0, id1);
    if (!p)
        p = add_pool(d, id0, id1);
    if (p) {
        p->uses++;
        if (kind != USE_ONLY) {
            if (!p->capturing) {
                p->watch = NULL;
                p->cand = NULL;
                p->owner = thread_self();
                p->routing = 1;
            }
            if (kind != BEGIN_ROUTING)
                p->routing = 0;
            /* only a registered stream: alive for good, safe to ask later */
            if (kind == BEGIN_CAPTURE && !p->watch && (uintptr_t)stream_handle(key) > 2 &&
                stream_long_lived(key))
                p->cand = key;
            if (kind != BEGIN_ROUTING)
                p->replayable = 1;
            p->watch_asked = 0;
            p->capturing++;
            atomic_fetch_add(&d->captures_active, 1);
        }
    } else {
        rc = BRIDGE_E_OOM;
    }
    pthread_mutex_unlock(&d->capture_lock);
    return rc;
}

int bridge_graph_begin(int device, uint64_t id0, uint64_t id1)
{
    int rc;
    device_state *d = device_use(device, &rc);
    if (!d)
        return rc;
    cache_release_carved(device); /* as bridge_capture_begin */
    rc = pool_use(d, id0, id1, BEGIN_UNKNOWN, NULL);
    if (rc == BRIDGE_OK)
        wait_for_syncs(d);
    return rc;
}

int bridge_graph_begin_on(int device, uint64_t id0, uint64_t id1, void *stream, int capture)
{
    int rc;
    device_state *d = device_use(device, &rc);
    if (!d)
        return rc;
    cache_release_carved(device); /* as bridge_capture_begin */
    rc = pool_use(d, id0, id1, capture ? BEGIN_CAPTURE : BEGIN_ROUTING,
                  stream_key((CUstream)stream));
    if (rc == BRIDGE_OK)
        wait_for_syncs(d);
    return rc;
}

/* ---- CuPy's captures: a pool of their own each ---- */
static _Atomic uint64_t next_stream_pool;

int bridge_capture_begin_stream(int device, void *stream, uint64_t *id1)
{
    *id1 = 0;
    int rc;
    device_state *d = device_use(device, &rc);
    if (!d)
        return rc;
    CUstream key = stream_key((CUstream)stream);
    uint64_t id = atomic_fetch_add(&next_stream_pool, 1) + 1;
    cache_release_carved(device); /* as bridge_capture_begin */
    rc = BRIDGE_OK;
    pthread_mutex_lock(&d->capture_lock);
    gpool *p = add_pool(d, BRIDGE_STREAM_POOL, id);
    if (p) {
        p->uses = 1; /* the Graph's: released when it dies */
        p->capturing = 1;
        p->replayable = 1;
        p->bound = key;
        atomic_fetch_add(&d->stream_captures, 1);
        atomic_fetch_add(&d->captures_active, 1);
    } else {
        rc = BRIDGE_E_OOM;
    }
    pthread_mutex_unlock(&d->capture_lock);
    if (rc != BRIDGE_OK)
        return rc;
    wait_for_syncs(d);
    *id1 = id;
    return BRIDGE_OK;
}

int bridge_capture_end_stream(int device, uint64_t id1)
{
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_DEVICE;
    pthread_mutex_lock(&d->capture_lock);
    gpool *p = find_pool(d, BRIDGE_STREAM_POOL, id1);
    CUstream key = p ? p->bound : NULL;
    if (key) {
        p->bound = NULL;
        atomic_fetch_sub(&d->stream_captures, 1);
    }
    pthread_mutex_unlock(&d->capture_lock);
    /* CuPy ended the capture and its Stream is alive until this returns */
    if (key)
        ledger_mark_deferred(d, key);
    return bridge_graph_end(device, BRIDGE_STREAM_POOL, id1);
}

/* ---- a CuPy graph's end, told by the driver ----
 * CuPy's Graph (14.2: a Cython class with neither _add_ref nor weak
 * references) cannot tell Python when it dies.  The driver can: a user
 * object whose only reference the captured graph owns is destroyed when that
 * reference goes.  The CUDA programming guide ("CUDA User Objects",
 * https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#cuda-user-objects):
 * "An instantiated cudaGraphExec_t retains a copy of every reference in the
 * source cudaGraph_t.  When a cudaGraphExec_t is destroyed without being
 * synchronized, the references are retained until the execution is
 * completed", and of its example's cudaGraphExecDestroy of an exec whose
 * launch was not synchronized: "After the launch is synchronized, the
 * remaining reference is released and the destructor will execute.  Note
 * this happens asynchronously."  So the destructor runs once the graph and
 * every exec made from it are destroyed and their launches have completed:
 * releasing the pool then needs no ordering after the launches (the release
 * still orders its frees as every release does).  The destructor runs on "a
 * shared internal thread", may call no CUDA API ("it is not legal to call
 * CUDA APIs from the destructor") and should not block: it pushes its
 * payload onto a lock-free stack and returns; graph_collect_dead, called
 * from the refusal path, the figures, trims and the CuPy adapter, releases
 * the pools. */
typedef struct dead_graph {
    struct dead_graph *next;
    int device;
    uint64_t id1; /* 0: the bind failed after the object was made: nothing to release */
} dead_graph;

static _Atomic(dead_graph *) dead_graphs; /* pushed by destructors, taken whole by collects */

typedef struct released_pool {
    int device;
    uint64_t id1;
} released_pool;
/* Pools released by collects that Python has not been told of yet
 * (bridge_graph_collect), so that it drops their holders. */
static pthread_mutex_t released_lock = PTHREAD_MUTEX_INITIALIZER;
static released_pool *released;
static size_t nreleased, capreleased;
static _Atomic size_t released_pending; /* nreleased, read without the lock */

/* The user object's destructor, on a driver thread: no CUDA call, no lock. */
static void graph_gone(void *arg)
{
    dead_graph *g = arg;
    dead_graph *head = atomic_load_explicit(&dead_graphs, RELAXED);
    do
        g->next = head;
    while (!atomic_compare_exchange_weak_explicit(&dead_graphs, &head, g, memory_order_release,
                                                  RELAXED));
}

int graph_collect_dead(void)
{
    if (!atomic_load_explicit(&dead_graphs, RELAXED))
        return 0; /* the usual case: one relaxed load */
    dead_graph *g = atomic_exchange_explicit(&dead_graphs, NULL, memory_order_acquire);
    int n = 0;
    while (g) {
        dead_graph *next = g->next;
        if (g->id1) {
            /* the launches have completed (the user object says so) */
            device_state *gd = device_of(g->device);
            if (gd)
                release_pool(gd, g->device, BRIDGE_STREAM_POOL, g->id1, 1, 0);
            n++;
            pthread_mutex_lock(&released_lock);
            if (nreleased == capreleased) {
                size_t ncap = capreleased ? capreleased * 2 : 16;
                released_pool *r = realloc(released, ncap * sizeof *r);
                if (r) {
                    released = r;
                    capreleased = ncap;
                }
            }
            /* no host memory: Python keeps that holder (a Stream), nothing more */
            if (nreleased < capreleased) {
                released[nreleased++] = (released_pool){g->device, g->id1};
                atomic_store_explicit(&released_pending, nreleased, RELAXED);
            }
            pthread_mutex_unlock(&released_lock);
        }
        free(g);
        g = next;
    }
    return n;
}

size_t bridge_graph_collect(int *devices, uint64_t *ids, size_t cap)
{
    graph_collect_dead();
    if (!atomic_load_explicit(&released_pending, RELAXED) || !cap)
        return 0;
    pthread_mutex_lock(&released_lock);
    size_t n = nreleased < cap ? nreleased : cap;
    for (size_t i = 0; i < n; i++) {
        devices[i] = released[nreleased - 1 - i].device;
        ids[i] = released[nreleased - 1 - i].id1;
    }
    nreleased -= n;
    atomic_store_explicit(&released_pending, nreleased, RELAXED);
    pthread_mutex_unlock(&released_lock);
    return n;
}

void graph_forget_after_fork(void)
{
    /* the parent's: leaked, never touched (a thread of the parent may have
     * held the lock) */
    atomic_store(&dead_graphs, NULL);
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    released_lock = fresh;
    released = NULL;
    nreleased = capreleased = 0;
    atomic_store(&released_pending, 0);
}

int bridge_capture_bind_graph(int device, uint64_t id1, void *stream)
{
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_DEVICE;
    CUstream key = stream_key((CUstream)stream);
    int rc = BRIDGE_OK;
    /* the pool must be this stream's capture's, and bound once */
    pthread_mutex_lock(&d->capture_lock);
    gpool *p = find_pool(d, BRIDGE_STREAM_POOL, id1);
    if (!p || !p->bound || p->bound != key || p->owned)
        rc = BRIDGE_E_INVALID;
    else
        p->owned = 1;
    pthread_mutex_unlock(&d->capture_lock);
    if (rc != BRIDGE_OK)
        return rc;
    dead_graph *g = malloc(sizeof *g);
    if (!g) {
        rc = BRIDGE_E_OOM;
        goto unowned;
    }
    *g = (dead_graph){.device = device, .id1 = id1};
    ctx_guard cg;
    ctx_enter(d, &cg);
    int mode = capture_mode_relax(); /* a query about a capture, during it */
    int status = CU_STREAM_CAPTURE_STATUS_NONE;
    uint64_t capture_id = 0;
    CUgraph graph = NULL;
    const void *deps = NULL;
    size_t ndeps = 0;
    CUresult r = bridge_drv.cuStreamGetCaptureInfo_v2((CUstream)stream, &status, &capture_id,
                                                      &graph, &deps, &ndeps);
    CUuserObject obj = NULL;
    if (r == CUDA_SUCCESS && (status != CU_STREAM_CAPTURE_STATUS_ACTIVE || !graph))
        rc = BRIDGE_E_INVALID; /* not capturing (invalidated): the caller releases the pool */
    else if (r == CUDA_SUCCESS &&
             (r = bridge_drv.cuUserObjectCreate(
                  &obj, g, graph_gone, 1, CU_USER_OBJECT_NO_DESTRUCTOR_SYNC)) == CUDA_SUCCESS) {
        r = bridge_drv.cuGraphRetainUserObject(graph, obj, 1, CU_GRAPH_USER_OBJECT_MOVE);
        if (r != CUDA_SUCCESS) {
            /* the object is ours alone: its destructor runs (on a driver
             * thread, later) and must release nothing */
            g->id1 = 0;
            bridge_drv.cuUserObjectRelease(obj, 1);
        }
        g = NULL; /* the destructor's now: graph_collect_dead frees it */
    }
    capture_mode_exit(mode);
    ctx_exit(&cg);
    if (r != CUDA_SUCCESS) {
        bridge_note_driver_error(r);
        rc = BRIDGE_E_DRIVER;
    }
    free(g);
    if (rc == BRIDGE_OK)
        return BRIDGE_OK;
unowned:
    pthread_mutex_lock(&d->capture_lock);
    if ((p = find_pool(d, BRIDGE_STREAM_POOL, id1)))
        p->owned = 0;
    pthread_mutex_unlock(&d->capture_lock);
    return rc;
}

int graph_pool_of_stream(device_state *d, CUstream key, uint64_t *id1)
{
    int found = 0;
    pthread_mutex_lock(&d->capture_lock);
    graph_pools *g = d->graphs;
    for (size_t i = 0; g && i < g->n && !found; i++)
        if (g->pool[i].bound == key && g->pool[i].capturing > 0) {
            *id1 = g->pool[i].id1;
            found = 1;
        }
    pthread_mutex_unlock(&d->capture_lock);
    return found;
}

int bridge_graph_end(int device, uint64_t id0, uint64_t id1)
{
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_DEVICE;
    int found = 0, late = 0;
    pthread_mutex_lock(&d->capture_lock);
    gpool *p = find_pool(d, id0, id1);
    if (p && p->capturing > 0) {
        p->capturing--;
        found = 1;
    } else if (p && p->unannounced > 0) {
        /* the core ended it (graph_reap_ended), and torch tells after all:
         * its release of the capture's use will come too */
        p->unannounced--;
        p->uses++;
        late = 1;
    }
    pthread_mutex_unlock(&d->capture_lock);
    if (late)
        return BRIDGE_OK;
    return found ? bridge_capture_end(device) : BRIDGE_E_INVALID;
}

typedef struct sweep {
    uint64_t id0, id1;
    int device;
    int replays; /* a graph may still replay into the blocks */
    record *out; /* user-freed blocks taken out of the table */
    size_t n, cap;
    int oom; /* no room to collect one: it stays in the table */
} sweep;

/* A released pool's block, from now on an ordinary one: its free is ordered
 * on the legacy stream and after the capture stream, and where a graph may
 * still replay into it (`replays`) after a device-wide synchronization
 * (REC_UNORDERED: ledger_hold; see the glossary).  0, or -1 when there is no
 * host memory for the stream (then the capture stream alone orders it). */
static int unbind_block(record *r, int replays)
{
    CUstream cap = r->stream;
    r->flags &= REC_UNORDERED; /* a recorded stream's mark stays */
    if (replays)
        r->flags |= REC_UNORDERED;
    if (cap == STREAM_LEGACY || (uintptr_t)cap == 0)
        return 0;
    if (records_add_stream(r, cap))
        return -1;
    r->stream = STREAM_LEGACY;
    return 0;
}

static int sweep_pool(record *r, void *arg)
{
    sweep *s = arg;
    if (!(r->flags & REC_GRAPH) || r->graph0 != s->id0 || r->graph1 != s->id1 ||
        r->device != s->device)
        return 0;
    if (!(r->flags & REC_USER_FREED)) {
        unbind_block(r, s->replays); /* still in use (a static output): an ordinary block */
        return 0;
    }
    if (s->n == s->cap) {
        size_t ncap = s->cap ? s->cap * 2 : 64;
        record *n = realloc(s->out, ncap * sizeof *n);
        if (!n) {
            s->oom = 1;
            unbind_block(r, s->replays); /* it stays, a block the user freed: lost */
            return 0;
        }
        s->out = n;
        s->cap = ncap;
    }
    unbind_block(r, s->replays);
    s->out[s->n++] = *r;
    return 1;
}

/* One use of the pool released (`drop`: 1; 0: its uses were dropped
 * already) and, at the last, the pool with it.  `replays`: a graph of the
 * pool may have been replayed on any stream, if a capture used the pool
 * (see the glossary). */
static int release_pool(device_state *d, int device, uint64_t id0, uint64_t id1, int drop,
                        int replays)
{
    sweep s = {.id0 = id0, .id1 = id1, .device = device};
    pthread_mutex_lock(&d->capture_lock);
    gpool *p = find_pool(d, id0, id1);
    int last = 0;
    if (p && (p->uses -= drop) <= 0) {
        if (p->capturing) /* released mid-capture (a failed capture): it ends here */
            atomic_fetch_sub(&d->captures_active, p->capturing);
        if (p->bound)
            atomic_fetch_sub(&d->stream_captures, 1);
        s.replays = replays && p->replayable;
        drop_pool(d, p);
        last = 1;
        /* In the same step (shard locks under capture_lock, the order
         * reuse() takes them in): a capture that begins a pool with this id
         * after the unlock allocates blocks this sweep never sees. */
        records_sweep(sweep_pool, &s);
    }
    pthread_mutex_unlock(&d->capture_lock);
    if (!last)
        return BRIDGE_OK; /* another graph still uses the pool */
    /* No host wait.  Where a replay may still run (s.replays: on any
     * stream, one the core cannot name included) the blocks are REC_UNORDERED:
     * held until a device-wide synchronization (ledger_hold), as torch's own
     * release gives a private pool back through cudaFree.  Else each free is
     * ordered after the capture stream and the legacy stream: nothing
     * replays a dead CuPy graph (its launches completed), a failed capture
     * or a pool only routings used. */
    for (size_t i = 0; i < s.n; i++) {
        atomic_fetch_sub_explicit(&d->graph_bytes, s.out[i].size, RELAXED);
        ledger_release(d, &s.out[i]);
    }
    free(s.out);
    return BRIDGE_OK;
}

int bridge_graph_release(int device, uint64_t id0, uint64_t id1)
{
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_DEVICE;
    return release_pool(d, device, id0, id1, 1, 1);
}

/* ---- captures that ended without their end hook (see the glossary) ---- */
void graph_watch(device_state *d, uint64_t id0, uint64_t id1, CUstream key)
{
    /* only a registered stream: alive for good, safe to ask later */
    if (id0 == BRIDGE_STREAM_POOL || (uintptr_t)stream_handle(key) <= 2 || !stream_long_lived(key))
        return;
    pthread_mutex_lock(&d->capture_lock);
    gpool *p = find_pool(d, id0, id1);
    if (p && p->capturing > 0 && !p->routing && !p->watch && !p->watch_asked) {
        /* once per begin (a routing is never watched: a capture its
         * allocations meet, torch.cuda.graph inside use_mem_pool, is another
         * pool's and ends with that pool's end hook) */
        p->watch_asked = 1;
        int status = CU_STREAM_CAPTURE_STATUS_NONE;
        uint64_t id = 0;
        int mode = capture_mode_relax();
        CUresult r = bridge_drv.cuStreamGetCaptureInfo_v2(key, &status, &id, NULL, NULL, NULL);
        capture_mode_exit(mode);
        if (r == CUDA_SUCCESS && status != CU_STREAM_CAPTURE_STATUS_NONE) {
            p->watch = key;
            p->watch_id = id;
        }
    }
    pthread_mutex_unlock(&d->capture_lock);
}

/* Not more than one look a millisecond per device from the free and
 * allocation paths (each is a lock and a driver call per watched pool). */
static _Atomic uint64_t next_reap_ns[BRIDGE_MAX_DEVICES];

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

typedef struct pool_id {
    uint64_t id0, id1;
} pool_id;

int graph_reap_ended(device_state *d, int force)
{
    if (!atomic_load_explicit(&d->captures_active, RELAXED))
        return 0;
    int device = (int)(d - bridge_devices);
    if (!force) {
        uint64_t now = now_ns(), next = atomic_load_explicit(&next_reap_ns[device], RELAXED);
        if (now < next || !atomic_compare_exchange_strong_explicit(&next_reap_ns[device], &next,
                                                                   now + 1000000, RELAXED, RELAXED))
            return 0;
    }
    unsigned long me = thread_self();
    pool_id *gone = NULL;
    int ended = 0, ngone = 0;
    pthread_mutex_lock(&d->capture_lock);
    graph_pools *g = d->graphs;
    if (g && g->n)
        gone = malloc(g->n * sizeof *gone);
    for (size_t i = 0; gone && i < g->n; i++) {
        gpool *p = &g->pool[i];
        /* the stream seen capturing, else the one the capture was begun on */
        CUstream s = p->watch ? p->watch : p->cand;
        if (!p->capturing || !s || p->owner != me || !stream_long_lived(s))
            continue;
        int status = CU_STREAM_CAPTURE_STATUS_NONE;
        uint64_t id = 0;
        int mode = capture_mode_relax();
        CUresult r = bridge_drv.cuStreamGetCaptureInfo_v2(s, &status, &id, NULL, NULL, NULL);
        capture_mode_exit(mode);
        if (r != CUDA_SUCCESS)
            continue;
        if (!p->watch && status != CU_STREAM_CAPTURE_STATUS_NONE) {
            p->watch = s; /* the capture begun on it runs: watch that one */
            p->watch_id = id;
            continue;
        }
        if (p->watch && status != CU_STREAM_CAPTURE_STATUS_NONE && id == p->watch_id)
            continue; /* still in its capture (invalidated ones too, until they end) */
        /* Over without its end hook: the capture watched, or (never seen) the
         * one begun on the told stream, which its thread began right after
         * the hook and ended since.  What torch's fixed capture_end and
         * reset do: end it, drop its use. */
        p->capturing--;
        p->watch = NULL;
        p->cand = NULL;
        p->unannounced++;
        atomic_fetch_sub(&d->captures_active, 1);
        ended++;
        if (--p->uses <= 0)
            gone[ngone++] = (pool_id){p->id0, p->id1};
    }
    pthread_mutex_unlock(&d->capture_lock);
    /* no graph came of a failed capture: nothing replays its blocks */
    for (int i = 0; i < ngone; i++)
        release_pool(d, device, gone[i].id0, gone[i].id1, 0, 0);
    free(gone);
    if (ended && !atomic_load(&d->captures_active))
        ledger_captures_ended(d);
    return ended;
}

/* ---- allocation in a pool ---- */
typedef struct adopt {
    uint64_t id0, id1, size;
    CUstream stream;
    int tag;
} adopt;

/* Take a freed graph block back for a new tensor, if it is still what the
 * free list says (a release may have swept it meanwhile). */
static int adopt_block(record *r, void *arg)
{
    adopt *a = arg;
    if ((r->flags & (REC_GRAPH | REC_USER_FREED)) != (REC_GRAPH | REC_USER_FREED) ||
        r->graph0 != a->id0 || r->graph1 != a->id1 || r->stream != a->stream ||
        r->size != a->size || r->nrec)
        return 1;
    r->flags = REC_GRAPH | (r->flags & REC_UNORDERED);
    r->tag = (uint8_t)a->tag;
    return 0;
}

/* A block of the pool's free list for `size` on `key`, best fit; 0 if none. */
static uintptr_t reuse(device_state *d, gpool *p, size_t size, CUstream key, int tag, uint64_t *got)
{
    for (;;) {
        size_t best = (size_t)-1;
        for (size_t i = 0; i < p->nfree; i++) {
            gblock *b = &p->free[i];
            if (b->stream == key && b->size >= size && b->size / FIT_SLACK <= size &&
                (best == (size_t)-1 || b->size < p->free[best].size))
                best = i;
        }
        if (best == (size_t)-1)
            return 0;
        gblock b = p->free[best];
        p->free[best] = p->free[--p->nfree];
        adopt a = {p->id0, p->id1, b.size, key, tag};
        if (records_update(b.ptr, adopt_block, &a) == 0) {
            atomic_fetch_sub_explicit(&d->graph_bytes, b.size, RELAXED);
            *got = b.size;
            return b.ptr;
        }
        /* stale entry: look again */
    }
}

uintptr_t graph_reuse(device_state *d, const record *want)
{
    uint64_t got = 0;
    pthread_mutex_lock(&d->capture_lock);
    gpool *p = find_pool(d, want->graph0, want->graph1);
    uintptr_t hit = p ? reuse(d, p, want->size, want->stream, want->tag, &got) : 0;
    pthread_mutex_unlock(&d->capture_lock);
    if (hit)
        ledger_count_reuse(d, want->tag, got);
    return hit;
}

/* A graph block the user freed: on its pool's free list, for the next
 * allocation in the pool (not one a side stream was recorded against: its
 * reuse would not be ordered after that stream). */
void graph_block_freed(device_state *d, const record *rec)
{
    if (rec->nrec)
        return;
    pthread_mutex_lock(&d->capture_lock);
    gpool *p = find_pool(d, rec->graph0, rec->graph1);
    if (p) {
        if (p->nfree == p->capfree) {
            size_t ncap = p->capfree ? p->capfree * 2 : 32;
            gblock *n = realloc(p->free, ncap * sizeof *n);
            if (n) {
                p->free = n;
                p->capfree = ncap;
            }
        }
        if (p->nfree < p->capfree)
            p->free[p->nfree++] = (gblock){rec->ptr, rec->size, rec->stream};
    }
    pthread_mutex_unlock(&d->capture_lock);
}

/* ---- torch.cuda.MemPool and CUDA graph trees (the torch allocator) ---- */
int bridge_graph_incref(int device, uint64_t id0, uint64_t id1)
{
    int rc;
    device_state *d = device_use(device, &rc);
    return d ? pool_use(d, id0, id1, USE_ONLY, NULL) : rc;
}

int bridge_graph_uses(int device, uint64_t id0, uint64_t id1)
{
    device_state *d = device_of(device);
    if (!d)
        return 0;
    pthread_mutex_lock(&d->capture_lock);
    gpool *p = find_pool(d, id0, id1);
    int uses = p ? p->uses : 0;
    pthread_mutex_unlock(&d->capture_lock);
    return uses;
}

typedef struct retake {
    int tag;
    int device;
    uint64_t size, id0, id1;
} retake;

/* records_update's fn for bridge_graph_adopt: a freed graph block becomes live. */
static int retake_block(record *r, void *arg)
{
    retake *a = arg;
    if ((r->flags & (REC_GRAPH | REC_USER_FREED)) != (REC_GRAPH | REC_USER_FREED))
        return 1;
    r->flags = REC_GRAPH | (r->flags & REC_UNORDERED);
    r->tag = (uint8_t)a->tag;
    a->device = r->device;
    a->size = r->size;
    a->id0 = r->graph0;
    a->id1 = r->graph1;
    return 0;
}

int bridge_graph_adopt(void *ptr, int tag)
{
    if (tag < 0 || tag >= BRIDGE_NTAGS || !ptr)
        return BRIDGE_E_INVALID;
    /* The record first (its shard lock), then the pool's free list (the
     * capture lock): a reuse() that meets the entry meanwhile finds the record
     * live and drops the entry itself, as it drops any stale one. */
    retake a = {.tag = tag};
    if (records_update((uintptr_t)ptr, retake_block, &a) != 0)
        return BRIDGE_E_INVALID;
    device_state *d = &bridge_devices[a.device];
    pthread_mutex_lock(&d->capture_lock);
    gpool *p = find_pool(d, a.id0, a.id1);
    for (size_t i = 0; p && i < p->nfree; i++) {
        if (p->free[i].ptr == (uintptr_t)ptr) {
            p->free[i] = p->free[--p->nfree];
            break;
        }
    }
    pthread_mutex_unlock(&d->capture_lock);
    atomic_fetch_sub_explicit(&d->graph_bytes, a.size, RELAXED);
    ledger_count_reuse(d, tag, a.size);
    return BRIDGE_OK;
}
