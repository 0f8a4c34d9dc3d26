/* SPDX-License-Identifier: Apache-2.0 */
/* stress.c: threads against the core's ledger, built with a sanitizer.
 *
 * A standalone program (no Python): it links the core's C files (driver.c,
 * records.c, cache.c, ledger.c, wait.c, share.c, pinned.c, views.c; not pymod.c, pypinned.c,
 * pyviews.c, pyshare.c nor
 * adapters/_torch_abi.cpp) and loads the stand-in driver (tests/standin/standin_cuda.c)
 * through bridge_init(path), so ThreadSanitizer sees every lock and atomic of
 * the core and AddressSanitizer (with LeakSanitizer) every byte it mallocs.
 * scripts/sanitize builds it twice (-fsanitize=thread, and
 * -fsanitize=address,undefined) and runs both; any sanitizer report or failed
 * CHECK exits non-zero.
 *
 * Usage: stress <libstandin_cuda.so> [scale]   (scale: iterations x; scripts/sanitize runs 3)
 *
 * Phases, each followed by check_idle() (every figure back to 0):
 *   init        bridge_init and device setup from many threads at once
 *   edge        threads allocating and freeing at the budget edge; the ledger
 *               peak and the live bytes never pass the budget
 *   cross       blocks allocated on one thread, freed on another
 *   limits      the budget, the tag caps and the pressure hook changed while
 *               threads allocate
 *   record      bridge_record_stream / bridge_lookup racing bridge_free
 *   double      several threads freeing the same pointers (half of them
 *               asking bridge_free_cached first): one free counts, the
 *               others are bad frees
 *   cache       threads on the default streams, allocating sizes that the
 *               cache of freed blocks (cache.c) serves again (half of them
 *               asking bridge_alloc_cached and bridge_free_cached first, as
 *               the CuPy allocator and its blocks do), while its cap, its
 *               tiers and its any-stream switch change under them
 *   graph       captures begin and end while threads allocate and free
 *               (deferred frees), graph blocks freed racing their release
 *   corners     (issue 30) two threads capturing into pools of the SAME id
 *               (a release's sweep racing the next begin: a live capture's
 *               blocks must stay graph blocks), CuPy captures with pools of
 *               their own, trims and refusals synchronizing while captures
 *               are announced (sync_enter / capture_announce: no
 *               synchronization once a capture is announced), blocks of
 *               streams destroyed under the core (never given to the
 *               driver by handle), pinned blocks lent during another
 *               thread's global-mode capture (never invalidating it)
 *   graphgone   CuPy captures whose pools a user object of the captured graph
 *               releases: graphs and execs destroyed (launches completing
 *               late) while threads allocate at the budget edge (the refusal
 *               path collects), read the figures and collect; the stand-in
 *               runs the destructors on a thread of its own
 *   huge        sizes that would overflow the ledger's arithmetic
 *   views       threads allocating and freeing at the budget edge while
 *               another turns the allocation history on and off (with and
 *               without a stack hook, changing its cap, clearing it),
 *               copies its events and the live blocks out, and reads the
 *               free memory under the budget (views.c)
 *   pinned      the pinned host pool (pinned.c), on either base: threads
 *               lending blocks, writing every byte of them, handing their
 *               references to each other, recording copies against them
 *               (by address alone too, racing their last release), while
 *               the limit changes, the pool is trimmed and events complete
 *               late
 *   share       (last: a process leaves only a share unify() failed in) threads at the
 *               edge of a share's budget (share.c) while another trims the pool
 *               over and over: the pool never holds more than the budget, no
 *               growth escapes the claim; then it leaves while threads
 *               allocate and joins again (one member, its first slot freed)
 */
#include "bridge.h"

#include <dlfcn.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define KIB  (1024ull)
#define MIB  (1024ull * 1024ull)
#define NDEV 2

#define CHECK(cond, ...)                                                                     \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            fprintf(stderr, "stress: %s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                                    \
            fputc('\n', stderr);                                                             \
            abort();                                                                         \
        }                                                                                    \
    } while (0)

static int scale = 1;

/* ---- the stand-in driver's controls (same library the core loaded) ---- */
static struct {
    void (*set_capacity)(int dev, uint64_t bytes);
    void (*add_foreign)(int dev, int64_t delta);
    void (*sync_all)(int dev);
    uint64_t (*live_count)(void);
    int (*ctx_get)(void **ctx);             /* the driver's cuCtxGetCurrent */
    int (*ctx_set)(void *ctx);              /* cuCtxSetCurrent */
    int (*ctx_retain)(void **ctx, int dev); /* cuDevicePrimaryCtxRetain */
    uint64_t (*counter)(int which);         /* standin_counter: 0 = driver allocations */
    void (*hold_events)(int on);            /* events recorded now stay pending */
    void (*complete_events)(void);
    int (*stream_create)(void **stream, unsigned flags); /* cuStreamCreate */
    void (*adopt_stream)(void *stream, int dev);         /* a made-up handle becomes a stream */
    int (*stream_destroy)(void *stream);                 /* cuStreamDestroy_v2 */
    void (*set_global_capture)(int on, void *stream);    /* another thread's global capture */
    /* captures, graphs and user objects (the graphgone phase) */
    int (*begin_capture)(void *stream, int mode);   /* cuStreamBeginCapture_v2 */
    int (*end_capture)(void *stream, void **graph); /* cuStreamEndCapture */
    int (*instantiate)(void **exec, void *graph,
                       unsigned long long);  /* cuGraphInstantiateWithFlags */
    int (*launch)(void *exec, void *stream); /* cuGraphLaunch */
    int (*exec_destroy)(void *exec);         /* cuGraphExecDestroy */
    int (*graph_destroy)(void *graph);       /* cuGraphDestroy */
    uint64_t (*wait_destructors)(void);      /* destructors run, once idle */
    uint64_t (*live_user_objects)(void);
} standin;

static void load_standin(const char *path)
{
    /* bridge_init loaded it already: this returns the same handle */
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    CHECK(lib, "%s is not loaded: %s", path, dlerror());
    *(void **)&standin.set_capacity = dlsym(lib, "standin_set_capacity");
    *(void **)&standin.add_foreign = dlsym(lib, "standin_add_foreign");
    *(void **)&standin.sync_all = dlsym(lib, "standin_sync_all");
    *(void **)&standin.live_count = dlsym(lib, "standin_live_count");
    *(void **)&standin.ctx_get = dlsym(lib, "cuCtxGetCurrent");
    *(void **)&standin.ctx_set = dlsym(lib, "cuCtxSetCurrent");
    *(void **)&standin.ctx_retain = dlsym(lib, "cuDevicePrimaryCtxRetain");
    *(void **)&standin.counter = dlsym(lib, "standin_counter");
    *(void **)&standin.hold_events = dlsym(lib, "standin_hold_events");
    *(void **)&standin.complete_events = dlsym(lib, "standin_complete_events");
    *(void **)&standin.stream_create = dlsym(lib, "cuStreamCreate");
    *(void **)&standin.adopt_stream = dlsym(lib, "standin_adopt_stream");
    *(void **)&standin.stream_destroy = dlsym(lib, "cuStreamDestroy_v2");
    *(void **)&standin.set_global_capture = dlsym(lib, "standin_set_global_capture");
    *(void **)&standin.begin_capture = dlsym(lib, "cuStreamBeginCapture_v2");
    *(void **)&standin.end_capture = dlsym(lib, "cuStreamEndCapture");
    *(void **)&standin.instantiate = dlsym(lib, "cuGraphInstantiateWithFlags");
    *(void **)&standin.launch = dlsym(lib, "cuGraphLaunch");
    *(void **)&standin.exec_destroy = dlsym(lib, "cuGraphExecDestroy");
    *(void **)&standin.graph_destroy = dlsym(lib, "cuGraphDestroy");
    *(void **)&standin.wait_destructors = dlsym(lib, "standin_wait_destructors");
    *(void **)&standin.live_user_objects = dlsym(lib, "standin_live_user_objects");
    CHECK(standin.begin_capture && standin.end_capture && standin.instantiate && standin.launch &&
              standin.exec_destroy && standin.graph_destroy && standin.wait_destructors &&
              standin.live_user_objects,
          "%s lacks the graphs' entry points", path);
    CHECK(standin.adopt_stream, "%s lacks standin_adopt_stream", path);
    CHECK(standin.stream_destroy && standin.set_global_capture, "%s lacks issue 30's controls",
          path);
    CHECK(standin.set_capacity && standin.add_foreign && standin.sync_all && standin.live_count &&
              standin.ctx_get && standin.ctx_set && standin.ctx_retain && standin.counter &&
              standin.hold_events && standin.complete_events && standin.stream_create,
          "%s lacks the standin_* controls", path);
    /* the handle stays open for the life of the program, like the core's */
    for (int i = 0; i < 32; i++) /* the streams the phases use (stream_of) */
        standin.adopt_stream((void *)(uintptr_t)(0x5000 + 16 * (uintptr_t)i), 0);
}

/* ---- small helpers ---- */
static uint64_t rnd(uint64_t *s) /* xorshift64* */
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545F4914F6CDD1Dull;
}

static void *stream_of(int i)
{
    return (void *)(uintptr_t)(0x5000 + 16 * (uintptr_t)i);
}

static bridge_stats stats_of(int dev)
{
    bridge_stats s;
    CHECK(bridge_get_stats(dev, &s) == BRIDGE_OK, "stats of device %d", dev);
    return s;
}

typedef void *(*thread_fn)(void *);
static void run_threads(int n, thread_fn fn, void *args, size_t arg_size)
{
    pthread_t t[64];
    CHECK(n <= 64, "too many threads");
    for (int i = 0; i < n; i++)
        CHECK(pthread_create(&t[i], NULL, fn, (char *)args + (size_t)i * arg_size) == 0,
              "pthread_create");
    for (int i = 0; i < n; i++)
        pthread_join(t[i], NULL);
}

/* Every device idle: no live block, no reservation, no deferred free, no graph
 * block, the driver's pool empty, and `committed` back to 0 (seen through
 * others: with X foreign bytes in the pool, others must read exactly X). */
static void check_idle(const char *phase)
{
    CHECK(bridge_live_records() == 0, "%s: %" PRIu64 " records left", phase, bridge_live_records());
    for (int d = 0; d < NDEV; d++) {
        /* before the trim: blocks parked with their records (still in their
         * tags' `current` and `count`, park.h) are out of the figures read */
        bridge_stats before = stats_of(d);
        for (int t = 0; t < BRIDGE_NTAGS; t++)
            CHECK(before.tag[t].current == 0 && before.tag[t].count == 0 &&
                      before.tag[t].peak >= before.tag[t].current,
                  "%s: device %d tag %d current %" PRIu64 " count %" PRIu64 " with blocks parked",
                  phase, d, t, before.tag[t].current, before.tag[t].count);
        CHECK(bridge_trim(d, 0) == BRIDGE_OK, "%s: trim", phase); /* flushes deferred frees */
        standin.sync_all(d);
        bridge_stats s = stats_of(d);
        CHECK(s.used == 0, "%s: device %d ledger %" PRIu64 " after every free", phase, d, s.used);
        CHECK(s.cached == 0, "%s: device %d cache %" PRIu64 " after a trim", phase, d, s.cached);
        CHECK(s.num_deferred == 0, "%s: device %d %" PRIu64 " deferred", phase, d, s.num_deferred);
        CHECK(s.graph_bytes == 0, "%s: device %d graph bytes %" PRIu64, phase, d, s.graph_bytes);
        CHECK(s.pool_used == 0, "%s: device %d pool used %" PRIu64, phase, d, s.pool_used);
        CHECK(bridge_parked_records() == 0 || d + 1 < NDEV,
              "%s: %" PRIu64 " records of parked blocks after every trim", phase,
              bridge_parked_records());
        CHECK(s.num_allocs == s.num_frees, "%s: device %d allocs %" PRIu64 " frees %" PRIu64, phase,
              d, s.num_allocs, s.num_frees);
        for (int t = 0; t < BRIDGE_NTAGS; t++) {
            bridge_tag_stats *ts = &s.tag[t];
            CHECK(ts->current == 0, "%s: device %d tag %d current %" PRIu64, phase, d, t,
                  ts->current);
            CHECK(ts->allocated == ts->freed,
                  "%s: device %d tag %d allocated %" PRIu64 " freed %" PRIu64, phase, d, t,
                  ts->allocated, ts->freed);
            CHECK(ts->num_allocs == ts->num_frees, "%s: device %d tag %d", phase, d, t);
        }
        uint64_t others = 0;
        standin.add_foreign(d, 12345);
        CHECK(bridge_others(d, &others) == BRIDGE_OK, "others");
        standin.add_foreign(d, -12345);
        CHECK(others == 12345,
              "%s: device %d others %" PRIu64 " with 12345 foreign bytes "
              "(committed did not return to 0)",
              phase, d, others);
    }
    CHECK(standin.live_count() == 0, "%s: the driver holds %" PRIu64 " blocks", phase,
          standin.live_count());
}

/* Start a phase from a clean slate: no limit, figures reset. */
static void reset(void)
{
    bridge_set_pressure_hook(NULL);
    for (int d = 0; d < NDEV; d++) {
        CHECK(bridge_set_limit(d, 0) == BRIDGE_OK, "set_limit");
        for (int t = 0; t < BRIDGE_NTAGS; t++)
            CHECK(bridge_set_tag_limit(d, t, 0) == BRIDGE_OK, "set_tag_limit");
        CHECK(bridge_reset_peak(d, -1) == BRIDGE_OK, "reset_peak");
        CHECK(bridge_reset_accumulated(d, -1) == BRIDGE_OK, "reset_accumulated");
    }
}

/* Accounting every allocating thread keeps: bytes it holds, added after a
 * successful alloc, removed before the free, so the sum never exceeds what
 * the ledger granted. */
static _Atomic uint64_t live_bytes[NDEV];

static int status_ok_or_refused(int rc)
{
    return rc == BRIDGE_OK || rc == BRIDGE_E_BUDGET || rc == BRIDGE_E_OOM ||
           rc == BRIDGE_E_TAG_LIMIT;
}

/* ---- phase: init ---- */
static const char *standin_path;

static void *init_thread(void *arg)
{
    (void)arg;
    CHECK(bridge_init(standin_path) == BRIDGE_OK, "bridge_init: %s", bridge_load_error());
    for (int d = 0; d < NDEV; d++)
        CHECK(bridge_device_setup(d, UINT64_MAX) == BRIDGE_OK, "setup %d", d);
    CHECK(bridge_device_ready(0) && bridge_device_ready(1), "ready");
    return NULL;
}

static void phase_init(void)
{
    int dummy[8];
    run_threads(8, init_thread, dummy, sizeof dummy[0]);
    int count = 0;
    CHECK(bridge_device_count(&count) == BRIDGE_OK && count >= NDEV, "device count %d", count);
}

/* ---- phase: edge ---- */
typedef struct worker {
    int id;
    int dev;
    int iters;
    uint64_t limit; /* live bytes of dev never pass it (0: no check) */
    uint64_t max_size;
    uint64_t seed;
    int tags;            /* rotate tags 0..tags-1 */
    int check_ctx;       /* the thread's current context (another device's)
                          * must be the same after every call */
    int default_streams; /* allocate on the default streams (NULL, 1, 2)
                          * and a few sizes only: the cache serves them */
    double wait_s;       /* the thread's wait for memory (wait.c); 0: none */
    int cached_first;    /* as the CuPy allocator and its blocks: bridge_alloc_cached
                          * and bridge_free_cached first (their hits counted),
                          * bridge_alloc / bridge_free on a miss */
    uint64_t refusals, ok, hits, free_hits;
} worker;

/* Looks that found a block parked with its record (park.h): the park ran. */
static _Atomic uint64_t parked_seen;

/* A worker's free: bridge_free_cached first when it asks the cache first. */
static void worker_free(worker *w, void *p)
{
    /* every 64th free looks (the count walks the table under each shard's lock) */
    if ((w->ok & 63) == 0 && bridge_parked_records())
        atomic_fetch_add_explicit(&parked_seen, 1, memory_order_relaxed);
    if (w->cached_first) {
        int rc = bridge_free_cached(p);
        CHECK(rc == BRIDGE_OK || rc == BRIDGE_E_MISS, "free_cached status %d", rc);
        if (rc == BRIDGE_OK) {
            w->free_hits++;
            return;
        }
    }
    bridge_free(p);
}

#define HOLD 8

static void *edge_thread(void *arg)
{
    worker *w = arg;
    void *held[HOLD] = {0};
    size_t sizes[HOLD] = {0};
    uint64_t s = w->seed;
    void *ctx = NULL, *now_ctx = NULL;
    if (w->wait_s > 0)
        CHECK(bridge_set_thread_wait(1, w->wait_s, w->id % 3) == BRIDGE_OK, "set_thread_wait");
    if (w->check_ctx) {
        /* the caller works on the other device: its context is current */
        CHECK(standin.ctx_retain(&ctx, 1 - w->dev) == 0 && ctx != NULL, "no context");
        standin.ctx_set(ctx);
    }
    for (int i = 0; i < w->iters; i++) {
        if (w->check_ctx) {
            standin.ctx_get(&now_ctx);
            CHECK(now_ctx == ctx,
                  "iteration %d: the bridge changed the caller's current "
                  "context",
                  i);
        }
        int k = (int)(rnd(&s) % HOLD);
        if (held[k]) {
            atomic_fetch_sub(&live_bytes[w->dev], sizes[k]);
            worker_free(w, held[k]);
            held[k] = NULL;
            continue;
        }
        size_t size = 1 + rnd(&s) % w->max_size;
        void *stream = stream_of(w->id);
        if (w->default_streams) {
            static const size_t few[] = {4 * KIB, 8 * KIB, 16 * KIB, 64 * KIB, 100};
            size = few[rnd(&s) % 5];
            stream = (void *)(uintptr_t)(rnd(&s) % 3);
        }
        int tag = w->tags ? (int)(rnd(&s) % (uint64_t)w->tags) : BRIDGE_TAG_TORCH;
        void *p = NULL;
        int rc = BRIDGE_E_MISS;
        if (w->cached_first) {
            rc = bridge_alloc_cached(w->dev, size, stream, tag, &p);
            CHECK(rc == BRIDGE_OK || rc == BRIDGE_E_MISS, "alloc_cached status %d", rc);
            CHECK((rc == BRIDGE_OK) == (p != NULL), "alloc_cached: status %d with %p", rc, p);
            w->hits += rc == BRIDGE_OK;
        }
        if (rc == BRIDGE_E_MISS)
            rc = bridge_alloc(w->dev, size, stream, tag, &p);
        CHECK(status_ok_or_refused(rc), "alloc status %d", rc);
        if (rc != BRIDGE_OK) {
            CHECK(p == NULL, "a refused alloc gave a pointer");
            w->refusals++;
            continue;
        }
        CHECK(p != NULL, "OK with a null pointer");
        w->ok++;
        uint64_t now = atomic_fetch_add(&live_bytes[w->dev], size) + size;
        if (w->limit)
            CHECK(now <= w->limit, "live bytes %" PRIu64 " passed the budget %" PRIu64, now,
                  w->limit);
        held[k] = p;
        sizes[k] = size;
    }
    for (int k = 0; k < HOLD; k++)
        if (held[k]) {
            atomic_fetch_sub(&live_bytes[w->dev], sizes[k]);
            worker_free(w, held[k]);
        }
    return NULL;
}

static void phase_edge(void)
{
    reset();
    const uint64_t limit = 1 * MIB;
    CHECK(bridge_set_limit(0, limit) == BRIDGE_OK, "set_limit");
    CHECK(bridge_set_limit(1, limit / 2) == BRIDGE_OK, "set_limit");
    worker w[8];
    for (int i = 0; i < 8; i++)
        w[i] = (worker){.id = i,
                        .dev = i % 4 == 3,
                        .iters = 4000 * scale,
                        .limit = i % 4 == 3 ? limit / 2 : limit,
                        .max_size = 128 * KIB,
                        .seed = 0x9E3779B97F4A7C15ull * (uint64_t)(i + 1),
                        .tags = BRIDGE_NTAGS,
                        .check_ctx = i % 2};
    run_threads(8, edge_thread, w, sizeof w[0]);
    uint64_t refusals = 0, ok = 0;
    for (int i = 0; i < 8; i++)
        refusals += w[i].refusals, ok += w[i].ok;
    bridge_stats s0 = stats_of(0), s1 = stats_of(1);
    CHECK(s0.peak_used <= limit, "device 0 peak %" PRIu64 " > budget", s0.peak_used);
    CHECK(s1.peak_used <= limit / 2, "device 1 peak %" PRIu64 " > budget", s1.peak_used);
    CHECK(s0.peak_used > limit / 2, "device 0 never came near its budget (peak %" PRIu64 ")",
          s0.peak_used);
    CHECK(refusals > 0, "the budget never refused anything: not at the edge");
    printf("  edge: %" PRIu64 " allocations, %" PRIu64 " refused at the budget, peak %" PRIu64
           " of %" PRIu64 "\n",
           ok, refusals, s0.peak_used, limit);
    check_idle("edge");
}

/* ---- phase: wait (the edge, every thread waiting a little when refused) ----
 * The edge is made, not hoped for: eight threads alone do not pass the budget
 * (each holds at most 8 blocks of 128 KiB, the budget), and on a loaded machine
 * they can run one after another, so nobody would be refused.  The main thread
 * first takes the budget's room in 64 KiB blocks until refused (it sets no wait:
 * it holds, it never waits), starts the workers, and frees its blocks only once
 * a worker was counted as waiting (num_waits moves while the waiter is in the
 * queue); that free wakes the waiters, and the workers go on at the edge. */
#define WAIT_FILL   (64 * KIB)
#define WAIT_SEEN_S 60 /* generous: a sanitizer build on a loaded 2-core machine */
static void phase_wait(void)
{
    reset();
    const uint64_t limit = 1 * MIB;
    CHECK(bridge_set_limit(0, limit) == BRIDGE_OK, "set_limit");
    bridge_stats b = stats_of(0);
    void *fill[2 * MIB / WAIT_FILL];
    int nfill = 0, rc;
    for (;;) {
        CHECK(nfill < (int)(sizeof fill / sizeof fill[0]),
              "%d blocks of 64 KiB and no refusal under a 1 MiB budget", nfill);
        rc = bridge_alloc(0, WAIT_FILL, stream_of(8), BRIDGE_TAG_TORCH, &fill[nfill]);
        if (rc != BRIDGE_OK)
            break;
        atomic_fetch_add(&live_bytes[0], WAIT_FILL);
        nfill++;
    }
    CHECK(rc == BRIDGE_E_BUDGET, "filling the budget: status %d", rc);
    CHECK(nfill > 0 && (uint64_t)nfill * WAIT_FILL <= limit,
          "%d blocks of 64 KiB before the 1 MiB budget refused", nfill);
    CHECK(stats_of(0).num_waits == b.num_waits, "the main thread (no wait set) waited");
    worker w[8];
    for (int i = 0; i < 8; i++)
        w[i] = (worker){.id = i,
                        .dev = 0,
                        .iters = 600 * scale,
                        .limit = limit,
                        .max_size = 128 * KIB,
                        .seed = 0xD1B54A32D192ED03ull * (uint64_t)(i + 1),
                        .tags = BRIDGE_NTAGS,
                        .wait_s = 0.002};
    pthread_t t[8];
    for (int i = 0; i < 8; i++)
        CHECK(pthread_create(&t[i], NULL, edge_thread, &w[i]) == 0, "pthread_create");
    /* until a worker is counted as waiting, with the budget held */
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int seen = 0;
    for (now = t0; !seen && now.tv_sec - t0.tv_sec < WAIT_SEEN_S;) {
        seen = stats_of(0).num_waits > b.num_waits;
        if (!seen)
            usleep(100);
        clock_gettime(CLOCK_MONOTONIC, &now);
    }
    CHECK(seen,
          "nobody waited in %d s with the budget held by another thread: a refused "
          "allocation with a wait time set did not wait",
          WAIT_SEEN_S);
    for (int i = 0; i < nfill; i++) {
        atomic_fetch_sub(&live_bytes[0], WAIT_FILL);
        bridge_free(fill[i]);
    }
    for (int i = 0; i < 8; i++)
        pthread_join(t[i], NULL);
    uint64_t ok = 0;
    for (int i = 0; i < 8; i++)
        ok += w[i].ok;
    bridge_stats s = stats_of(0);
    CHECK(s.peak_used <= limit, "peak %" PRIu64 " > budget", s.peak_used);
    CHECK(s.num_waits > b.num_waits, "nobody waited: not at the edge");
    CHECK(s.waiting == 0, "%" PRIu64 " threads still counted as waiting", s.waiting);
    printf("  wait: %" PRIu64 " allocations, %" PRIu64 " waits (%" PRIu64 " timed out, %" PRIu64
           " ended as all waiting)\n",
           ok, s.num_waits - b.num_waits, s.num_wait_timeouts - b.num_wait_timeouts,
           s.num_wait_all_waiting - b.num_wait_all_waiting);
    check_idle("wait");
}

/* ---- phase: cross (allocated here, freed there) ---- */
#define RING 256
static struct {
    pthread_mutex_t mu;
    void *slot[RING];
    size_t head, tail; /* head - tail = blocks waiting */
    int producers_left;
} ring = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void *producer_thread(void *arg)
{
    worker *w = arg;
    uint64_t s = w->seed;
    for (int i = 0; i < w->iters; i++) {
        void *p = NULL;
        size_t size = 1 + rnd(&s) % w->max_size;
        int rc = bridge_alloc(w->dev, size, stream_of(w->id), BRIDGE_TAG_CUPY, &p);
        CHECK(status_ok_or_refused(rc), "alloc status %d", rc);
        if (rc != BRIDGE_OK)
            continue;
        pthread_mutex_lock(&ring.mu);
        if (ring.head - ring.tail < RING) {
            ring.slot[ring.head++ % RING] = p;
            p = NULL;
        }
        pthread_mutex_unlock(&ring.mu);
        bridge_free(p); /* the ring was full: free it here; NULL is a no-op */
    }
    pthread_mutex_lock(&ring.mu);
    ring.producers_left--;
    pthread_mutex_unlock(&ring.mu);
    return NULL;
}

static void *consumer_thread(void *arg)
{
    (void)arg;
    for (;;) {
        void *p = NULL;
        int done;
        pthread_mutex_lock(&ring.mu);
        if (ring.head != ring.tail)
            p = ring.slot[ring.tail++ % RING];
        done = ring.producers_left == 0 && ring.head == ring.tail;
        pthread_mutex_unlock(&ring.mu);
        if (p)
            bridge_free(p);
        else if (done)
            return NULL;
        else
            sched_yield();
    }
}

static void *cross_thread(void *arg)
{
    worker *w = arg;
    return w->id < 4 ? producer_thread(w) : consumer_thread(w);
}

static void phase_cross(void)
{
    reset();
    CHECK(bridge_set_limit(0, 2 * MIB) == BRIDGE_OK, "set_limit");
    ring.producers_left = 4;
    worker w[8];
    for (int i = 0; i < 8; i++)
        w[i] = (worker){.id = i,
                        .dev = 0,
                        .iters = 3000 * scale,
                        .max_size = 64 * KIB,
                        .seed = 0xC0FFEEull * (uint64_t)(i + 7)};
    run_threads(8, cross_thread, w, sizeof w[0]);
    CHECK(stats_of(0).peak_used <= 2 * MIB, "peak passed the budget");
    check_idle("cross");
}

/* Eight threads at the budget's edge on streams 0-7 (registered): edge_thread,
 * the odd ones up to 3 MiB, the even ones up to 64 KiB, the first four's even
 * ones on the legacy and per-thread streams, every third trying the cache
 * first. */
static void edge_on_streams(worker *w, uint64_t limit, uint64_t seed)
{
    for (int i = 0; i < 8; i++)
        w[i] = (worker){.id = i,
                        .dev = 0,
                        .iters = 3000 * scale,
                        .limit = limit,
                        .max_size = i % 2 ? 3 * MIB : 64 * KIB,
                        .seed = seed * (uint64_t)(i + 3),
                        .tags = BRIDGE_NTAGS,
                        .default_streams = i < 4 && i % 2 == 0,
                        .cached_first = i % 3 == 0};
    run_threads(8, edge_thread, w, sizeof w[0]);
}

/* Blocks allocated by threads 0-3 on registered streams and freed by 4-7
 * (cross_thread), up to max_size. */
static void cross_on_streams(worker *w, uint64_t max_size, uint64_t seed)
{
    ring.producers_left = 4;
    for (int i = 0; i < 8; i++)
        w[i] = (worker){.id = i, /* 0-3 produce on registered streams, 4-7 free */
                        .dev = 0,
                        .iters = 2000 * scale,
                        .max_size = max_size,
                        .seed = seed * (uint64_t)(i + 11)};
    run_threads(8, cross_thread, w, sizeof w[0]);
}

/* ---- phase: carve (blocks carved from pool chunks: BRIDGE_CACHE_CARVE=1) ---- */
static void phase_carve(void)
{
    reset();
    const uint64_t limit = 24 * MIB; /* chunks of 2-8 MiB: the budget refuses some */
    uint64_t cache = stats_of(0).cache_limit;
    CHECK(bridge_set_cache(0, 64 * MIB, 256 * MIB) == BRIDGE_OK, "set_cache");
    CHECK(bridge_set_cache_carve(0, 1.0 / 8, 2 * MIB, 8 * MIB, 4 * MIB, 2 * MIB) == BRIDGE_OK,
          "set_cache_carve");
    CHECK(bridge_set_limit(0, limit) == BRIDGE_OK, "set_limit");
    for (int i = 0; i < 8; i++) /* their blocks are carved too */
        CHECK(bridge_register_stream(stream_of(i)) == BRIDGE_OK, "register_stream");
    uint64_t driver_allocs = standin.counter(0), allocs = stats_of(0).num_allocs;
    worker w[8];
    edge_on_streams(w, limit, 0xCA47Eull);
    bridge_stats s = stats_of(0);
    CHECK(s.peak_used <= limit, "peak %" PRIu64 " passed the budget", s.peak_used);
    CHECK(s.carve_on == 1, "carving is off");
    CHECK(standin.counter(0) - driver_allocs < s.num_allocs - allocs,
          "carving served no allocation");
    /* carved here, freed on another thread */
    CHECK(bridge_set_limit(0, 0) == BRIDGE_OK, "set_limit");
    cross_on_streams(w, 256 * KIB, 0xC0FFEEull);
    printf("  carve: %" PRIu64 " allocations, %" PRIu64 " from the driver, %" PRIu64
           " bytes in chunks at the end\n",
           stats_of(0).num_allocs - allocs, standin.counter(0) - driver_allocs,
           stats_of(0).carve_held);
    for (int i = 0; i < 8; i++)
        bridge_forget_stream(stream_of(i));
    CHECK(bridge_set_cache_carve(0, 0, 0, 0, 0, 0) == BRIDGE_OK, "carving off");
    CHECK(bridge_set_cache(0, cache, 256 * MIB) == BRIDGE_OK, "set_cache");
    check_idle("carve");
    CHECK(stats_of(0).carve_held == 0, "carve: %" PRIu64 " bytes of chunks left",
          stats_of(0).carve_held);
}

/* ---- phase: segments (carving with the release rule: BRIDGE_CACHE_SEGMENTS=1) ---- */
/* The threads' slots in front of the segments: threads 0-5 loop on a few sizes
 * on four streams, each freeing the block it allocated last (parked in its
 * slot, still carved) and mostly allocating it again (taken back), half of
 * them through CuPy's calls; every 8th block goes to a mailbox, where the
 * paired thread frees it (a block another thread allocated last: the table's
 * way); thread 6 trims and flushes meanwhile (every parked block back to its
 * segment under the owners' feet); each worker ends with a block parked,
 * which its exit gives back. */
static _Atomic int slot_stop;
static _Atomic uint64_t slot_parked_seen;
static void *_Atomic mailbox[8];

static void *slot_thread(void *arg)
{
    worker *w = arg;
    if (w->id == 6) {
        while (!atomic_load(&slot_stop)) {
            if (stats_of(0).carve_parked)
                atomic_fetch_add(&slot_parked_seen, 1);
            CHECK(bridge_trim(0, 0) == BRIDGE_OK, "trim");
            sched_yield();
        }
        return NULL;
    }
    static const size_t few[] = {4 * KIB, 64 * KIB, 3 * MIB};
    uint64_t s = w->seed;
    for (int i = 0; i < w->iters; i++) {
        size_t size = few[rnd(&s) % 3];
        void *stream = stream_of(w->id % 4);
        void *p = NULL;
        int rc = BRIDGE_E_MISS;
        if (w->cached_first)
            rc = bridge_alloc_cached(0, size, stream, BRIDGE_TAG_CUPY, &p);
        if (rc == BRIDGE_E_MISS)
            rc = bridge_alloc(0, size, stream, BRIDGE_TAG_CUPY, &p);
        CHECK(rc == BRIDGE_OK && p, "alloc status %d", rc);
        w->ok++;
        if (rnd(&s) % 8 == 0) { /* to the paired thread, whose free is the table's */
            worker_free(w, atomic_exchange(&mailbox[w->id ^ 1], p));
            continue;
        }
        worker_free(w, p); /* parked: the block this thread allocated last */
        if (rnd(&s) % 4) { /* and taken back by the next allocation */
            void *q = NULL;
            rc = BRIDGE_E_MISS;
            if (w->cached_first)
                rc = bridge_alloc_cached(0, size, stream, BRIDGE_TAG_CUPY, &q);
            if (rc == BRIDGE_E_MISS)
                rc = bridge_alloc(0, size, stream, BRIDGE_TAG_CUPY, &q);
            CHECK(rc == BRIDGE_OK && q, "alloc status %d", rc);
            w->ok++;
            w->hits += q == p;
            worker_free(w, q);
        }
    }
    void *p = NULL;
    CHECK(bridge_alloc(0, 4 * KIB, stream_of(w->id % 4), BRIDGE_TAG_CUPY, &p) == BRIDGE_OK,
          "alloc");
    bridge_free(p); /* parked at the thread's exit */
    return NULL;
}

static void phase_segments(void)
{
    reset();
    /* 2 MiB segments and 64 MiB ones: the budget refuses some (segments sized
     * by its room), a framework's cap others, the release rule and the
     * recovery chain give empty ones back under the threads */
    const uint64_t limit = 160 * MIB;
    uint64_t cache = stats_of(0).cache_limit;
    CHECK(bridge_set_cache(0, 64 * MIB, 256 * MIB) == BRIDGE_OK, "set_cache");
    CHECK(bridge_set_cache_segments(0, 1) == BRIDGE_OK, "set_cache_segments");
    CHECK(bridge_set_limit(0, limit) == BRIDGE_OK, "set_limit");
    CHECK(bridge_set_tag_limit(0, 1, 24 * MIB) == BRIDGE_OK, "set_tag_limit");
    for (int i = 0; i < 8; i++)
        CHECK(bridge_register_stream(stream_of(i)) == BRIDGE_OK, "register_stream");
    uint64_t driver_allocs = standin.counter(0), allocs = stats_of(0).num_allocs;
    worker w[8];
    edge_on_streams(w, limit, 0x5E65ull);
    bridge_stats s = stats_of(0);
    CHECK(s.peak_used <= limit, "peak %" PRIu64 " passed the budget", s.peak_used);
    CHECK(s.carve_on == 1 && s.carve_slack == 1050, "segments are off");
    CHECK(standin.counter(0) - driver_allocs < s.num_allocs - allocs,
          "segments served no allocation");
    CHECK(s.tag[1].peak <= 24 * MIB, "tag 1's peak %" PRIu64 " passed its cap", s.tag[1].peak);
    CHECK(bridge_set_tag_limit(0, 1, 0) == BRIDGE_OK, "set_tag_limit");
    CHECK(bridge_set_limit(0, 0) == BRIDGE_OK, "set_limit");
    cross_on_streams(w, 4 * MIB, 0x5E65ull);
    printf("  segments: %" PRIu64 " allocations, %" PRIu64 " from the driver, %" PRIu64
           " bytes in segments at the end (high-water mark %" PRIu64 ")\n",
           stats_of(0).num_allocs - allocs, standin.counter(0) - driver_allocs,
           stats_of(0).carve_held, stats_of(0).carve_hwm);
    /* the threads' slots (slot_thread): six workers and a trimmer */
    pthread_t trimmer;
    worker tw = {.id = 6};
    atomic_store(&slot_stop, 0);
    CHECK(pthread_create(&trimmer, NULL, slot_thread, &tw) == 0, "pthread_create");
    for (int i = 0; i < 6; i++)
        w[i] = (worker){.id = i,
                        .dev = 0,
                        .iters = 2000 * scale,
                        .seed = 0x5107ull * (uint64_t)(i + 5),
                        .cached_first = i % 2};
    run_threads(6, slot_thread, w, sizeof w[0]);
    atomic_store(&slot_stop, 1);
    pthread_join(trimmer, NULL);
    for (int i = 0; i < 8; i++)
        bridge_free(atomic_exchange(&mailbox[i], NULL));
    uint64_t taken_back = 0;
    for (int i = 0; i < 6; i++)
        taken_back += w[i].hits;
    s = stats_of(0);
    /* every worker ended with a block parked: their exits gave them back */
    CHECK(s.carve_parked == 0, "%" PRIu64 " bytes parked after the threads ended", s.carve_parked);
    CHECK(bridge_parked_records() == 0, "parked records after the threads ended");
    CHECK(taken_back > 0, "no block was taken back from a slot");
    printf("  segments' slots: %" PRIu64 " blocks taken back, parked bytes seen %" PRIu64
           " times by the trimmer\n",
           taken_back, atomic_load(&slot_parked_seen));
    for (int i = 0; i < 8; i++)
        bridge_forget_stream(stream_of(i));
    CHECK(bridge_set_cache_segments(0, 0) == BRIDGE_OK, "segments off");
    CHECK(bridge_set_cache(0, cache, 256 * MIB) == BRIDGE_OK, "set_cache");
    check_idle("segments");
    CHECK(stats_of(0).carve_held == 0, "segments: %" PRIu64 " bytes left", stats_of(0).carve_held);
}

/* ---- phase: limits (budget, tag caps, hook changed under the allocators) ---- */
static atomic_int limits_stop;
static atomic_int hook_calls;

static int pressure_hook(int device, size_t size, int tag, int stage)
{
    (void)size;
    (void)tag;
    (void)stage;
    atomic_fetch_add(&hook_calls, 1);
    standin.sync_all(device); /* "a framework dropped its cache": queued frees land */
    return 1;
}

static void *limit_changer(void *arg)
{
    uint64_t s = *(uint64_t *)arg;
    static const uint64_t budgets[] = {256 * KIB, 1 * MIB, 4 * MIB};
    static const uint64_t caps[] = {0, 512 * KIB, 2 * MIB};
    while (!atomic_load(&limits_stop)) {
        CHECK(bridge_set_limit(0, budgets[rnd(&s) % 3]) == BRIDGE_OK, "set_limit");
        CHECK(bridge_set_tag_limit(0, (int)(rnd(&s) % BRIDGE_NTAGS), caps[rnd(&s) % 3]) ==
                  BRIDGE_OK,
              "set_tag_limit");
        bridge_set_pressure_hook(rnd(&s) % 2 ? pressure_hook : NULL);
        if (rnd(&s) % 8 == 0)
            bridge_reset_peak(0, -1);
        sched_yield();
    }
    return NULL;
}

static void phase_limits(void)
{
    reset();
    atomic_store(&limits_stop, 0);
    CHECK(bridge_set_limit(0, 1 * MIB) == BRIDGE_OK, "set_limit");
    pthread_t changer;
    uint64_t seed = 42;
    CHECK(pthread_create(&changer, NULL, limit_changer, &seed) == 0, "pthread_create");
    worker w[6];
    for (int i = 0; i < 6; i++)
        w[i] = (worker){.id = i,
                        .dev = 0,
                        .iters = 3000 * scale,
                        .limit = 4 * MIB,
                        .max_size = 256 * KIB,
                        .seed = 0xABCDEFull * (uint64_t)(i + 3),
                        .tags = BRIDGE_NTAGS,
                        .check_ctx = 1};
    run_threads(6, edge_thread, w, sizeof w[0]);
    atomic_store(&limits_stop, 1);
    pthread_join(changer, NULL);
    bridge_stats s = stats_of(0);
    CHECK(s.peak_used <= 4 * MIB, "peak %" PRIu64 " passed the largest budget", s.peak_used);
    printf("  limits: pressure hook called %d times\n", atomic_load(&hook_calls));
    check_idle("limits");
}

/* ---- phase: record (record_stream and lookup racing free) ---- */
#define NSLOTS 32
static _Atomic(void *) slots[NSLOTS];
static atomic_int record_stop;

static void *slot_owner(void *arg)
{
    worker *w = arg;
    uint64_t s = w->seed;
    for (int i = 0; i < w->iters; i++) {
        int k = (int)(rnd(&s) % NSLOTS);
        void *old = atomic_exchange(&slots[k], NULL);
        if (old) {
            bridge_free(old);
            continue;
        }
        void *p = NULL;
        int rc = bridge_alloc(0, 1 + rnd(&s) % (16 * KIB), stream_of(w->id), BRIDGE_TAG_TORCH, &p);
        /* no budget, but the device can fill up with frees queued on the
         * other threads' streams (the stand-in completes them at a sync) */
        CHECK(rc == BRIDGE_OK || rc == BRIDGE_E_OOM, "alloc without a budget: %d", rc);
        if (rc != BRIDGE_OK)
            continue;
        void *expected = NULL;
        if (!atomic_compare_exchange_strong(&slots[k], &expected, p))
            bridge_free(p);
    }
    return NULL;
}

static void *recorder(void *arg)
{
    worker *w = arg;
    uint64_t s = w->seed;
    while (!atomic_load(&record_stop)) {
        void *p = atomic_load(&slots[rnd(&s) % NSLOTS]);
        if (!p)
            continue;
        /* the block may be freed at any moment: OK or INVALID, never a crash */
        int rc = bridge_record_stream(p, stream_of(16 + (int)(rnd(&s) % 6)));
        CHECK(rc == BRIDGE_OK || rc == BRIDGE_E_INVALID, "record_stream %d", rc);
        size_t size = 0;
        int dev = -1, tag = -1;
        rc = bridge_lookup(p, &size, &dev, &tag);
        CHECK(rc == BRIDGE_E_INVALID ||
                  (rc == BRIDGE_OK && dev == 0 && size > 0 && tag == BRIDGE_TAG_TORCH),
              "lookup %d", rc);
    }
    return NULL;
}

static void *record_thread(void *arg)
{
    worker *w = arg;
    if (w->id < 3) {
        slot_owner(w);
        return NULL;
    }
    return recorder(w);
}

static void phase_record(void)
{
    reset();
    atomic_store(&record_stop, 0);
    worker w[6];
    for (int i = 0; i < 6; i++)
        w[i] = (worker){
            .id = i, .dev = 0, .iters = 4000 * scale, .seed = 0x5EEDull * (uint64_t)(i + 11)};
    /* recorders run until the owners are done */
    pthread_t t[6];
    for (int i = 0; i < 6; i++)
        CHECK(pthread_create(&t[i], NULL, record_thread, &w[i]) == 0, "pthread_create");
    for (int i = 0; i < 3; i++)
        pthread_join(t[i], NULL);
    atomic_store(&record_stop, 1);
    for (int i = 3; i < 6; i++)
        pthread_join(t[i], NULL);
    for (int k = 0; k < NSLOTS; k++)
        bridge_free(atomic_exchange(&slots[k], NULL));
    check_idle("record");
}

/* ---- phase: double (the same pointers freed by several threads) ---- */
#define DOUBLE_N 64
static void *double_ptrs[DOUBLE_N];
static pthread_barrier_t double_go;

static void *double_freer(void *arg)
{
    int id = *(int *)arg;
    pthread_barrier_wait(&double_go);
    for (int i = 0; i < DOUBLE_N; i++) {
        void *p = double_ptrs[(i + id * 7) % DOUBLE_N];
        /* half the threads ask the cache first: a miss (a double free
         * included) goes on to bridge_free, which counts it */
        if (!(id % 2) || bridge_free_cached(p) == BRIDGE_E_MISS)
            bridge_free(p);
    }
    return NULL;
}

static void phase_double(void)
{
    reset();
    const int nthreads = 4, rounds = 50 * scale;
    uint64_t bad0 = stats_of(0).num_bad_frees;
    for (int r = 0; r < rounds; r++) {
        for (int i = 0; i < DOUBLE_N; i++)
            CHECK(bridge_alloc(i % NDEV, 4096 + (size_t)i, stream_of(i % 3), i % BRIDGE_NTAGS,
                               &double_ptrs[i]) == BRIDGE_OK,
                  "alloc");
        pthread_barrier_init(&double_go, NULL, (unsigned)nthreads);
        int ids[4] = {0, 1, 2, 3};
        run_threads(nthreads, double_freer, ids, sizeof ids[0]);
        pthread_barrier_destroy(&double_go);
    }
    /* a pointer the bridge never gave out, and one inside a block */
    bridge_free((void *)(uintptr_t)0xdeadbeef000ull);
    bridge_free((void *)(uintptr_t)1);
    uint64_t bad = stats_of(0).num_bad_frees - bad0;
    uint64_t expected = (uint64_t)rounds * DOUBLE_N * (uint64_t)(nthreads - 1) + 2;
    CHECK(bad == expected, "bad frees %" PRIu64 ", expected %" PRIu64, bad, expected);
    check_idle("double");
}

/* ---- phase: cache (freed blocks served again, cache settings changing) ---- */
static atomic_int cache_stop;

static void *cache_changer(void *arg)
{
    uint64_t s = *(uint64_t *)arg;
    static const uint64_t caps[] = {0, 64 * KIB, 1ull << 30};
    for (int n = 0; !atomic_load(&cache_stop); n++) {
        /* every other turn, the first one included, the defaults (shortly):
         * settings that cache nothing (cap 0, floor and fraction 0) drawn
         * first and lasting the whole phase left it with no hit at all */
        int dflt = n % 2 == 0;
        uint64_t cap = dflt ? 1ull << 30 : caps[rnd(&s) % 3];
        uint64_t max_block = dflt || rnd(&s) % 2 ? 256 * MIB : 8 * KIB;
        CHECK(bridge_set_cache(0, cap, max_block) == BRIDGE_OK, "set_cache");
        /* the cap follows the live bytes: evictions (oldest first) now and then */
        static const double fractions[] = {0.0, 1.0 / 16, 1.0};
        static const uint64_t floors[] = {0, 16 * KIB, 64 * MIB};
        double fraction = dflt ? 1.0 / 16 : fractions[rnd(&s) % 3];
        uint64_t floor = dflt ? 64 * MIB : floors[rnd(&s) % 3];
        CHECK(bridge_set_cache_fraction(0, fraction, floor) == BRIDGE_OK, "set_cache_fraction");
        /* the tiers' boundary moves (0: every block is large; the workers'
         * blocks are at most 64 KiB) while blocks of both tiers are cached;
         * the defaults on the default turns and half the others, so the
         * cache still serves */
        static const uint64_t small_maxes[] = {0, 16 * KIB, MIB, MIB};
        static const uint64_t large_caps[] = {0, 32 * KIB, 64 * MIB, 64 * MIB};
        uint64_t small_max = dflt ? MIB : small_maxes[rnd(&s) % 4];
        uint64_t large_cap = dflt ? 64 * MIB : large_caps[rnd(&s) % 4];
        CHECK(bridge_set_cache_tiers(0, small_max, large_cap) == BRIDGE_OK, "set_cache_tiers");
        /* streams become long-lived and are forgotten again while blocks
         * freed on them come and go through the cache */
        void *st = stream_of((int)(rnd(&s) % 6));
        CHECK((rnd(&s) % 2 ? bridge_register_stream(st) : bridge_forget_stream(st)) == BRIDGE_OK,
              "register/forget stream");
        /* turns by the clock (a yield loop's length depends on how many
         * cores the workers leave: on two, one turn outlasted the phase) */
        for (int i = 0; i < (dflt ? 2 : 10) && !atomic_load(&cache_stop); i++)
            usleep(100);
    }
    return NULL;
}

static void phase_cache(void)
{
    reset();
    const uint64_t limit = 2 * MIB; /* reached now and then: a refusal flushes the cache */
    CHECK(bridge_set_limit(0, limit) == BRIDGE_OK, "set_limit");
    atomic_store(&cache_stop, 0);
    pthread_t changer;
    uint64_t seed = 7;
    uint64_t driver_allocs = standin.counter(0), allocs = stats_of(0).num_allocs;
    CHECK(pthread_create(&changer, NULL, cache_changer, &seed) == 0, "pthread_create");
    worker w[6];
    for (int i = 0; i < 6; i++)
        w[i] = (worker){.id = i,
                        .dev = 0,
                        .iters = 3000 * scale,
                        .limit = limit,
                        .max_size = 64 * KIB,
                        .seed = 0xCAC4Eull * (uint64_t)(i + 5),
                        .tags = BRIDGE_NTAGS,
                        .default_streams = i < 4,
                        .cached_first = i % 2};
    run_threads(6, edge_thread, w, sizeof w[0]);
    uint64_t hits = 0, free_hits = 0;
    for (int i = 0; i < 6; i++) {
        hits += w[i].hits;
        free_hits += w[i].free_hits;
    }
    atomic_store(&cache_stop, 1);
    pthread_join(changer, NULL);
    bridge_stats s = stats_of(0);
    CHECK(s.peak_used <= limit, "peak %" PRIu64 " passed the budget", s.peak_used);
    CHECK(s.cached == s.cached_small + s.cached_large,
          "cached %" PRIu64 " != small %" PRIu64 " + large %" PRIu64, s.cached, s.cached_small,
          s.cached_large);
    driver_allocs = standin.counter(0) - driver_allocs;
    allocs = s.num_allocs - allocs;
    CHECK(driver_allocs < allocs, "the cache served no allocation");
    CHECK(hits > 0, "bridge_alloc_cached served no allocation");
    CHECK(free_hits > 0, "bridge_free_cached kept no block");
    printf("  cache: %" PRIu64 " allocations, %" PRIu64 " from the driver, %" PRIu64
           " by bridge_alloc_cached; %" PRIu64 " frees by bridge_free_cached\n",
           allocs, driver_allocs, hits, free_hits);
    check_idle("cache");
    /* the defaults again (cache.c) */
    CHECK(bridge_set_cache(0, 1ull << 30, 256 * MIB) == BRIDGE_OK, "set_cache");
    CHECK(bridge_set_cache_tiers(0, MIB, 64 * MIB) == BRIDGE_OK, "set_cache_tiers");
    for (int i = 0; i < 6; i++)
        CHECK(bridge_forget_stream(stream_of(i)) == BRIDGE_OK, "forget_stream");
}

/* ---- phase: graph (captures, deferred frees, graph blocks racing release) ---- */
static atomic_int graph_stop;

static void *capture_toggler(void *arg)
{
    (void)arg;
    uint64_t id = 1000;
    while (!atomic_load(&graph_stop)) {
        id++;
        CHECK(bridge_graph_begin(0, 7, id) == BRIDGE_OK, "graph_begin");
        void *p = NULL;
        int rc = bridge_alloc_graph(0, 4096, BRIDGE_TAG_TORCH, 7, id, stream_of(30), &p);
        /* OOM is possible: the workers' frees queue on streams nobody
         * synchronizes, and a graph allocation does not retry (it may not
         * synchronize during a capture) */
        CHECK(rc == BRIDGE_OK || rc == BRIDGE_E_OOM, "alloc_graph %d", rc);
        sched_yield();
        CHECK(bridge_graph_end(0, 7, id) == BRIDGE_OK, "graph_end");
        bridge_free(p); /* kept for replays until the release */
        CHECK(bridge_graph_release(0, 7, id) == BRIDGE_OK, "graph_release");
    }
    return NULL;
}

typedef struct graph_race {
    void *blocks[16];
    uint64_t id;
    pthread_barrier_t *go;
    int releaser;
} graph_race;

static void *graph_race_thread(void *arg)
{
    graph_race *g = arg;
    pthread_barrier_wait(g->go);
    if (g->releaser) {
        CHECK(bridge_graph_release(1, 9, g->id) == BRIDGE_OK, "graph_release");
    } else {
        for (int i = 0; i < 16; i++)
            bridge_free(g->blocks[i]);
    }
    return NULL;
}

static void phase_graph(void)
{
    reset();
    /* 1. ordinary frees while captures come and go: some are deferred */
    atomic_store(&graph_stop, 0);
    pthread_t toggler;
    CHECK(pthread_create(&toggler, NULL, capture_toggler, NULL) == 0, "pthread_create");
    worker w[4];
    for (int i = 0; i < 4; i++)
        w[i] = (worker){.id = i,
                        .dev = 0,
                        .iters = 2000 * scale,
                        .max_size = 32 * KIB,
                        .seed = 0x6A09E667ull * (uint64_t)(i + 1),
                        .tags = BRIDGE_NTAGS,
                        .cached_first = i % 2};
    run_threads(4, edge_thread, w, sizeof w[0]);
    atomic_store(&graph_stop, 1);
    pthread_join(toggler, NULL);
    check_idle("graph (deferred frees)");

    /* 2. the user frees graph blocks while the graph is released */
    reset();
    for (int r = 0; r < 200 * scale; r++) {
        graph_race g[2];
        pthread_barrier_t go;
        pthread_barrier_init(&go, NULL, 2);
        uint64_t id = (uint64_t)r;
        CHECK(bridge_graph_begin(1, 9, id) == BRIDGE_OK, "graph_begin");
        for (int i = 0; i < 16; i++)
            CHECK(bridge_alloc_graph(1, 512 + (size_t)i, BRIDGE_TAG_TORCH, 9, id, stream_of(31),
                                     &g[0].blocks[i]) == BRIDGE_OK,
                  "alloc_graph");
        CHECK(bridge_graph_end(1, 9, id) == BRIDGE_OK, "graph_end");
        g[0].id = g[1].id = id;
        g[0].go = g[1].go = &go;
        g[0].releaser = 0;
        g[1].releaser = 1;
        run_threads(2, graph_race_thread, g, sizeof g[0]);
        pthread_barrier_destroy(&go);
        /* every block out of the pool, held until a device-wide synchronization
         * (a replay may still run on any stream): the trim makes it */
        bridge_stats s = stats_of(1);
        uint64_t sizes = 16 * 512 + 15 * 16 / 2;
        CHECK(s.graph_bytes == 0 && s.used == sizes && s.num_deferred == 16,
              "round %d: after the user freed every graph block and the graph was released, "
              "the ledger holds %" PRIu64 " bytes (graph bytes %" PRIu64 ", %" PRIu64
              " held), not the 16 blocks held",
              r, s.used, s.graph_bytes, s.num_deferred);
        CHECK(bridge_trim(1, 0) == BRIDGE_OK, "trim");
        s = stats_of(1);
        CHECK(s.used == 0 && s.num_deferred == 0,
              "round %d: after the trim the ledger holds %" PRIu64 " bytes", r, s.used);
    }
    check_idle("graph (release racing free)");
}

/* ---- phase: corners (issue 30's orderings) ---- */
#define C_INVALIDATED 13
#define C_DEAD        14
static atomic_int corners_stop;
static _Atomic uint64_t corners_captures;

/* torch's hooks into pool (7, 77) from two threads: each capture's own block
 * must be a graph block (kept at its free: graph_bytes grows) while it holds
 * a use of the pool, whatever the other thread's release sweeps meanwhile. */
static void *same_id_capturer(void *arg)
{
    (void)arg;
    while (!atomic_load(&corners_stop)) {
        CHECK(bridge_graph_begin(0, 7, 77) == BRIDGE_OK, "graph_begin");
        void *p = NULL;
        int rc = bridge_alloc_graph(0, 4096, BRIDGE_TAG_TORCH, 7, 77, stream_of(29), &p);
        CHECK(rc == BRIDGE_OK || rc == BRIDGE_E_OOM || rc == BRIDGE_E_BUDGET, "alloc_graph %d", rc);
        CHECK(bridge_graph_end(0, 7, 77) == BRIDGE_OK, "graph_end");
        if (p) {
            size_t size = 0;
            int tag = -1;
            CHECK(bridge_lookup(p, &size, NULL, &tag) == BRIDGE_OK && size == 4096,
                  "a live capture's block is gone");
            bridge_block_info blocks[256];
            size_t n = 0;
            CHECK(bridge_live_blocks(blocks, 256, &n) == BRIDGE_OK, "live_blocks");
            for (size_t i = 0; i < n && i < 256; i++)
                if (blocks[i].ptr == (uintptr_t)p)
                    CHECK(blocks[i].flags & 1, "a live capture's block was made ordinary "
                                               "by another release's sweep");
            bridge_free(p);
        }
        CHECK(bridge_graph_release(0, 7, 77) == BRIDGE_OK, "graph_release");
        atomic_fetch_add(&corners_captures, 1);
    }
    return NULL;
}

/* CuPy's captures: a pool per capture, a temporary freed inside it. */
static void *cupy_capturer(void *arg)
{
    (void)arg;
    void *s = stream_of(28);
    while (!atomic_load(&corners_stop)) {
        uint64_t pool = 0;
        CHECK(bridge_capture_begin_stream(0, s, &pool) == BRIDGE_OK && pool, "capture_begin");
        void *tmp = NULL, *out = NULL;
        int rc = bridge_alloc(0, 8192, s, BRIDGE_TAG_CUPY, &tmp);
        CHECK(rc == BRIDGE_OK || rc == BRIDGE_E_OOM || rc == BRIDGE_E_BUDGET,
              "alloc in a capture %d", rc);
        rc = bridge_alloc(0, 4096, s, BRIDGE_TAG_CUPY, &out);
        CHECK(rc == BRIDGE_OK || rc == BRIDGE_E_OOM || rc == BRIDGE_E_BUDGET,
              "alloc in a capture %d", rc);
        bridge_free(tmp); /* stays with the graph */
        CHECK(bridge_capture_end_stream(0, pool) == BRIDGE_OK, "capture_end");
        CHECK(bridge_graph_release(0, BRIDGE_CUPY_POOL, pool) == BRIDGE_OK, "release");
        bridge_free(out); /* outlived its graph */
    }
    return NULL;
}

/* Trims (torch.cuda.empty_cache) from another thread and, when `arg` is
 * non-NULL, a global-mode capture the core cannot see switched on and off. */
static void *corners_trimmer(void *arg)
{
    int invisible = arg != NULL;
    int i = 0;
    while (!atomic_load(&corners_stop)) {
        standin.set_global_capture(invisible && i % 4 == 0, stream_of(27));
        CHECK(bridge_trim(0, 0) == BRIDGE_OK, "trim");
        bridge_mem_info mi;
        CHECK(bridge_get_mem_info(0, &mi) == BRIDGE_OK, "mem_info");
        standin.set_global_capture(0, NULL);
        i++;
        sched_yield();
    }
    return NULL;
}

/* torch's tensors on external streams that die before them. */
static void *dead_stream_worker(void *arg)
{
    worker *w = arg;
    void *ctx = NULL;
    CHECK(standin.ctx_retain(&ctx, 0) == 0, "retain");
    for (int i = 0; i < w->iters; i++) {
        void *prev = NULL;
        standin.ctx_get(&prev);
        standin.ctx_set(ctx);
        void *s = NULL;
        CHECK(standin.stream_create(&s, 0) == 0, "cuStreamCreate");
        standin.ctx_set(prev);
        void *p = NULL;
        int rc = bridge_alloc(0, 1024 + (size_t)(i % 7) * 512, s, BRIDGE_TAG_TORCH, &p);
        CHECK(rc == BRIDGE_OK || rc == BRIDGE_E_OOM || rc == BRIDGE_E_BUDGET, "alloc %d", rc);
        CHECK(standin.stream_destroy(s) == 0, "cuStreamDestroy");
        bridge_free(p); /* NULL is a no-op */
    }
    return NULL;
}

/* Two runs: graph pools captured, released and swept while others allocate,
 * free and trim; then trims during a global capture the core cannot see
 * (XLA's), with nothing held for a device-wide synchronization: none may
 * invalidate it.  (A released graph pool's blocks wait for a device-wide
 * synchronization, as torch's own release through cudaFree does: a trim or
 * refusal that gives them back during such a capture would invalidate it.) */
static void phase_corners(void)
{
    reset();
    uint64_t dead = standin.counter(C_DEAD);
    atomic_store(&corners_stop, 0);
    pthread_t cap[2], cupy, trimmer;
    for (int i = 0; i < 2; i++)
        CHECK(pthread_create(&cap[i], NULL, same_id_capturer, NULL) == 0, "pthread_create");
    CHECK(pthread_create(&cupy, NULL, cupy_capturer, NULL) == 0, "pthread_create");
    CHECK(pthread_create(&trimmer, NULL, corners_trimmer, NULL) == 0, "pthread_create");
    worker w[4];
    for (int i = 0; i < 4; i++)
        w[i] = (worker){.id = i,
                        .dev = 0,
                        .iters = 1000 * scale,
                        .limit = 8 * MIB,
                        .max_size = 256 * KIB,
                        .seed = 0xC0FFEEull * (uint64_t)(i + 1),
                        .tags = BRIDGE_NTAGS};
    CHECK(bridge_set_limit(0, 8 * MIB) == BRIDGE_OK, "set_limit");
    run_threads(2, edge_thread, w, sizeof w[0]); /* refusals synchronize their streams */
    run_threads(2, dead_stream_worker, &w[2], sizeof w[0]);
    atomic_store(&corners_stop, 1);
    for (int i = 0; i < 2; i++)
        pthread_join(cap[i], NULL);
    pthread_join(cupy, NULL);
    pthread_join(trimmer, NULL);
    CHECK(atomic_load(&corners_captures) > 0, "no capture ran");
    CHECK(bridge_trim(0, 0) == BRIDGE_OK, "trim"); /* what the releases held */
    uint64_t bad = standin.counter(C_INVALIDATED);
    atomic_store(&corners_stop, 0);
    static int invisible = 1;
    CHECK(pthread_create(&trimmer, NULL, corners_trimmer, &invisible) == 0, "pthread_create");
    run_threads(2, edge_thread, w, sizeof w[0]);
    run_threads(2, dead_stream_worker, &w[2], sizeof w[0]);
    atomic_store(&corners_stop, 1);
    pthread_join(trimmer, NULL);
    CHECK(bridge_set_limit(0, 0) == BRIDGE_OK, "set_limit");
    CHECK(standin.counter(C_DEAD) == dead, "%" PRIu64 " driver calls on destroyed streams",
          standin.counter(C_DEAD) - dead);
    CHECK(standin.counter(C_INVALIDATED) == bad,
          "%" PRIu64 " calls would have invalidated a capture the core cannot see",
          standin.counter(C_INVALIDATED) - bad);
    check_idle("corners");
}

/* ---- phase: pools (torch.cuda.MemPool and graph trees' checkpoints) ---- */
#define POOL_BLOCKS 32
static void *pool_blocks[POOL_BLOCKS];
static atomic_int pools_stop;

/* A graph tree restoring a checkpoint: freed blocks made live again
 * (bridge_graph_adopt) and freed back, racing allocations in the same pool
 * that reuse the same free-list entries. */
static void *adopter(void *arg)
{
    (void)arg;
    uint64_t seed = 0xA5A5A5A5ull;
    while (!atomic_load(&pools_stop)) {
        void *p = pool_blocks[rnd(&seed) % POOL_BLOCKS];
        if (bridge_graph_adopt(p, BRIDGE_TAG_TORCH) == BRIDGE_OK) {
            sched_yield();
            bridge_free(p); /* ours now: back onto the pool's free list */
        }
    }
    return NULL;
}

static void *pool_allocator(void *arg)
{
    (void)arg;
    uint64_t seed = 0x5A5A5A5Aull;
    for (int i = 0; i < 4000 * scale; i++) {
        void *p = NULL;
        size_t size = 4096 * (1 + rnd(&seed) % 2);
        int rc = bridge_alloc_graph(0, size, BRIDGE_TAG_TORCH, 11, 1, stream_of(32), &p);
        CHECK(rc == BRIDGE_OK, "alloc in a MemPool: %d", rc);
        sched_yield();
        bridge_free(p);
    }
    return NULL;
}

/* Pools made and released while the others run: uses never go wrong. */
static void *pool_cycler(void *arg)
{
    (void)arg;
    for (uint64_t id = 100; !atomic_load(&pools_stop); id++) {
        CHECK(bridge_graph_incref(0, 12, id) == BRIDGE_OK, "incref");
        CHECK(bridge_graph_uses(0, 12, id) == 1, "uses of a new pool");
        CHECK(bridge_graph_begin(0, 12, id) == BRIDGE_OK, "begin");
        CHECK(bridge_graph_uses(0, 12, id) == 2, "uses after begin");
        CHECK(bridge_graph_end(0, 12, id) == BRIDGE_OK, "end");
        CHECK(bridge_graph_release(0, 12, id) == BRIDGE_OK, "release");
        CHECK(bridge_graph_release(0, 12, id) == BRIDGE_OK, "release");
        CHECK(bridge_graph_uses(0, 12, id) == 0, "a released pool");
    }
    return NULL;
}

static void phase_pools(void)
{
    reset();
    CHECK(bridge_graph_incref(0, 11, 1) == BRIDGE_OK, "incref");
    for (int i = 0; i < POOL_BLOCKS; i++) {
        CHECK(bridge_alloc_graph(0, 4096 * (size_t)(1 + i % 2), BRIDGE_TAG_TORCH, 11, 1,
                                 stream_of(32), &pool_blocks[i]) == BRIDGE_OK,
              "alloc_graph");
        bridge_free(pool_blocks[i]); /* onto the pool's free list */
    }
    CHECK(bridge_graph_adopt(NULL, BRIDGE_TAG_TORCH) == BRIDGE_E_INVALID, "adopt NULL");
    uint64_t bad0 = stats_of(0).num_bad_frees;
    atomic_store(&pools_stop, 0);
    pthread_t a, c;
    CHECK(pthread_create(&a, NULL, adopter, NULL) == 0, "pthread_create");
    CHECK(pthread_create(&c, NULL, pool_cycler, NULL) == 0, "pthread_create");
    worker none[2];
    run_threads(2, pool_allocator, none, sizeof none[0]);
    atomic_store(&pools_stop, 1);
    pthread_join(a, NULL);
    pthread_join(c, NULL);
    bridge_stats s = stats_of(0);
    CHECK(s.tag[BRIDGE_TAG_TORCH].current == 0 && s.tag[BRIDGE_TAG_TORCH].count == 0,
          "torch holds %" PRIu64 " bytes in %" PRIu64 " blocks with every block freed",
          s.tag[BRIDGE_TAG_TORCH].current, s.tag[BRIDGE_TAG_TORCH].count);
    CHECK(s.num_bad_frees == bad0, "%" PRIu64 " bad frees: a block had two owners",
          s.num_bad_frees - bad0);
    CHECK(bridge_graph_release(0, 11, 1) == BRIDGE_OK, "release");
    check_idle("pools");
}

/* ---- phase: graphgone (a CuPy graph's end, told by its user object) ---- */
static atomic_int gone_stop;
static _Atomic uint64_t gone_released;

/* CuPy's Stream.begin_capture .. end_capture and its Graph's life: the pool
 * bound to the graph, the graph and its exec destroyed in either order, a
 * launch completing now or later (the destructor waits for it). */
static void *gone_capturer(void *arg)
{
    (void)arg;
    void *s = stream_of(29);
    void *late[4] = {0};
    for (int i = 0; i < 300 * scale; i++) {
        uint64_t pool = 0;
        CHECK(bridge_capture_begin_stream(0, s, &pool) == BRIDGE_OK && pool, "capture_begin");
        CHECK(standin.begin_capture(s, 2) == 0, "cuStreamBeginCapture_v2");
        void *tmp = NULL, *out = NULL;
        int rc = bridge_alloc(0, 8192, s, BRIDGE_TAG_CUPY, &tmp);
        CHECK(status_ok_or_refused(rc), "alloc in a capture %d", rc);
        rc = bridge_alloc(0, 4096, s, BRIDGE_TAG_CUPY, &out);
        CHECK(status_ok_or_refused(rc), "alloc in a capture %d", rc);
        bridge_free(tmp); /* stays with the graph */
        CHECK(bridge_capture_bind_graph(0, pool, s) == BRIDGE_OK, "bind");
        CHECK(bridge_capture_bind_graph(0, pool, s) == BRIDGE_E_INVALID, "bound twice");
        void *g = NULL, *x = NULL;
        CHECK(standin.end_capture(s, &g) == 0 && g, "cuStreamEndCapture");
        CHECK(bridge_capture_end_stream(0, pool) == BRIDGE_OK, "capture_end");
        CHECK(standin.instantiate(&x, g, 0) == 0 && x, "instantiate");
        CHECK(standin.launch(x, s) == 0, "launch");
        if (i % 2) {
            CHECK(standin.graph_destroy(g) == 0, "cuGraphDestroy");
            CHECK(standin.exec_destroy(x) == 0, "cuGraphExecDestroy");
        } else {
            CHECK(standin.exec_destroy(x) == 0, "cuGraphExecDestroy");
            CHECK(standin.graph_destroy(g) == 0, "cuGraphDestroy");
        }
        if (i % 3 == 0)
            standin.complete_events(); /* the launches ran: their destructors go */
        bridge_free(out);              /* outlived its graph */
        if (i % 5 == 0) {
            bridge_free(late[i / 5 % 4]);
            late[i / 5 % 4] = NULL;
            rc = bridge_alloc(0, 4096, stream_of(30), BRIDGE_TAG_CUPY, &late[i / 5 % 4]);
            CHECK(status_ok_or_refused(rc), "alloc %d", rc);
        }
    }
    for (int i = 0; i < 4; i++)
        bridge_free(late[i]);
    return NULL;
}

/* The figures (which collect) and Python's collect, from another thread. */
static void *gone_reader(void *arg)
{
    (void)arg;
    int devs[8];
    uint64_t ids[8];
    while (!atomic_load(&gone_stop)) {
        (void)stats_of(0);
        size_t n = bridge_graph_collect(devs, ids, 8);
        for (size_t i = 0; i < n; i++)
            CHECK(devs[i] == 0 && ids[i], "released (%d, %" PRIu64 ")", devs[i], ids[i]);
        atomic_fetch_add(&gone_released, n);
        sched_yield();
    }
    return NULL;
}

static void phase_graphgone(void)
{
    reset();
    atomic_store(&gone_stop, 0);
    atomic_store(&gone_released, 0);
    uint64_t ran = standin.wait_destructors();
    pthread_t cap, reader;
    CHECK(pthread_create(&cap, NULL, gone_capturer, NULL) == 0, "pthread_create");
    CHECK(pthread_create(&reader, NULL, gone_reader, NULL) == 0, "pthread_create");
    worker w[3];
    for (int i = 0; i < 3; i++)
        w[i] = (worker){.id = i,
                        .dev = 0,
                        .iters = 1000 * scale,
                        .limit = 8 * MIB,
                        .max_size = 256 * KIB,
                        .seed = 0x60E60Eull * (uint64_t)(i + 1),
                        .tags = BRIDGE_NTAGS};
    CHECK(bridge_set_limit(0, 8 * MIB) == BRIDGE_OK, "set_limit");
    run_threads(3, edge_thread, w, sizeof w[0]); /* refusals collect dead graphs */
    pthread_join(cap, NULL);
    atomic_store(&gone_stop, 1);
    pthread_join(reader, NULL);
    CHECK(bridge_set_limit(0, 0) == BRIDGE_OK, "set_limit");
    standin.complete_events(); /* the last launches ran */
    uint64_t graphs = (uint64_t)(300 * scale);
    CHECK(standin.wait_destructors() - ran == graphs, "%" PRIu64 " destructors ran of %" PRIu64,
          standin.wait_destructors() - ran, graphs);
    CHECK(standin.live_user_objects() == 0, "user objects left");
    int devs[64];
    uint64_t ids[64];
    size_t n;
    while ((n = bridge_graph_collect(devs, ids, 64)) > 0)
        atomic_fetch_add(&gone_released, n);
    CHECK(atomic_load(&gone_released) == graphs, "%" PRIu64 " pools released of %" PRIu64,
          atomic_load(&gone_released), graphs);
    CHECK(bridge_graph_collect(devs, ids, 64) == 0, "collect twice");
    check_idle("graphgone");
}

/* ---- phase: huge (sizes near 2^64 must not wrap the ledger) ---- */
static void phase_huge(void)
{
    reset();
    CHECK(bridge_set_limit(0, 1 * MIB) == BRIDGE_OK, "set_limit");
    void *keep = NULL;
    CHECK(bridge_alloc(0, 4096, NULL, BRIDGE_TAG_TORCH, &keep) == BRIDGE_OK, "alloc");
    const size_t sizes[] = {SIZE_MAX, SIZE_MAX - 4095, (size_t)1 << 63, SIZE_MAX / 2 + 1};
    for (int limited = 1; limited >= 0; limited--) {
        CHECK(bridge_set_limit(0, limited ? 1 * MIB : 0) == BRIDGE_OK, "set_limit");
        for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
            void *p = NULL;
            int rc = bridge_alloc(0, sizes[i], NULL, BRIDGE_TAG_TORCH, &p);
            CHECK(rc != BRIDGE_OK && p == NULL, "a %zu-byte allocation succeeded", sizes[i]);
            bridge_stats s = stats_of(0);
            CHECK(s.used == 4096 && s.tag[BRIDGE_TAG_TORCH].current == 4096,
                  "a refused %zu-byte request left the ledger at %" PRIu64, sizes[i], s.used);
            CHECK(s.peak_used == 4096, "peak %" PRIu64 " after a refused request", s.peak_used);
        }
    }
    bridge_free(keep);
    check_idle("huge");
}

/* ---- phase: pinned (the pinned host pool under threads) ---- */
#define PSLOTS 32
static _Atomic(bridge_pinned_block *) pslots[PSLOTS]; /* each holds one reference */
static _Atomic uintptr_t paddrs[PSLOTS];              /* the address last put in each slot */
static atomic_int pinned_stop;
static void *pinned_streams[4];

/* Put a block (one reference) in slot k; drop what was there. */
static void pslot_put(int k, bridge_pinned_block *b)
{
    if (b)
        atomic_store(&paddrs[k], (uintptr_t)bridge_pinned_ptr(b));
    bridge_pinned_block *old = atomic_exchange(&pslots[k], b);
    bridge_pinned_release(old); /* NULL is a no-op */
}

static void *pinned_worker(void *arg)
{
    worker *w = arg;
    uint64_t s = w->seed;
    for (int i = 0; i < w->iters; i++) {
        int k = (int)(rnd(&s) % PSLOTS);
        switch (rnd(&s) % 5) {
        case 0: { /* lend a block and write all of it (AddressSanitizer checks the bounds) */
            bridge_pinned_block *b = NULL;
            size_t size = 1 + rnd(&s) % (256 * KIB);
            int may_block = rnd(&s) % 4 != 0;
            int rc = bridge_pinned_alloc(size, may_block, &b);
            CHECK(rc == BRIDGE_OK || rc == BRIDGE_E_BUDGET || rc == BRIDGE_E_OOM, "pinned alloc %d",
                  rc);
            if (rc != BRIDGE_OK || !b) {
                CHECK(b == NULL, "a refused pinned alloc gave a block");
                CHECK(rc != BRIDGE_OK || !may_block, "may_block gave no block");
                break;
            }
            CHECK(bridge_pinned_size(b) == size, "size %zu", bridge_pinned_size(b));
            memset(bridge_pinned_ptr(b), w->id, size);
            pslot_put(k, b);
            break;
        }
        case 1: { /* take a block, share a reference with another slot */
            bridge_pinned_block *b = atomic_exchange(&pslots[k], NULL);
            if (!b)
                break;
            bridge_pinned_retain(b);
            pslot_put(k, b);
            pslot_put((k + 1) % PSLOTS, b);
            break;
        }
        case 2: { /* record a copy against a block, look it up */
            bridge_pinned_block *b = atomic_exchange(&pslots[k], NULL);
            if (!b)
                break;
            size_t size = bridge_pinned_size(b);
            char *p = (char *)bridge_pinned_ptr(b) + rnd(&s) % size;
            int rc = bridge_pinned_record(p, pinned_streams[rnd(&s) % 4]);
            CHECK(rc == BRIDGE_OK, "pinned record %d", rc);
            void *base = NULL;
            size_t got = 0;
            CHECK(bridge_pinned_lookup(p, &base, &got) == BRIDGE_OK && base == bridge_pinned_ptr(b),
                  "pinned lookup");
            p[0] ^= 1;
            pslot_put(k, b);
            break;
        }
        case 3: { /* record by address alone (an int from Python), owning no reference:
                   * the block may be dropped meanwhile, or be another one by now */
            uintptr_t a = atomic_load(&paddrs[k]);
            if (!a)
                break;
            int rc = bridge_pinned_record((void *)a, pinned_streams[rnd(&s) % 4]);
            CHECK(rc == BRIDGE_OK || rc == BRIDGE_E_INVALID, "pinned record by address %d", rc);
            break;
        }
        default: /* drop a reference */
            pslot_put(k, NULL);
        }
    }
    return NULL;
}

static void *pinned_changer(void *arg)
{
    uint64_t s = *(uint64_t *)arg;
    static const uint64_t limits[] = {0, 1 * MIB, 4 * MIB};
    while (!atomic_load(&pinned_stop)) {
        CHECK(bridge_pinned_set_limit(limits[rnd(&s) % 3]) == BRIDGE_OK, "pinned set_limit");
        if (rnd(&s) % 2)
            CHECK(bridge_pinned_trim() == BRIDGE_OK, "pinned trim");
        standin.hold_events((int)(rnd(&s) % 2));
        if (rnd(&s) % 2)
            standin.complete_events();
        bridge_pinned_stats ps;
        CHECK(bridge_pinned_get_stats(&ps) == BRIDGE_OK, "pinned stats");
        /* total = used + free + bytes being allocated or freed right now */
        CHECK(ps.used + ps.free <= ps.total && ps.peak_used >= ps.used,
              "pinned figures: used %" PRIu64 " free %" PRIu64 " total %" PRIu64, ps.used, ps.free,
              ps.total);
        for (int i = 0; i < 200 && !atomic_load(&pinned_stop); i++)
            sched_yield();
    }
    return NULL;
}

static void phase_pinned(int backend)
{
    int chosen = -1;
    bridge_pinned_stats before;
    CHECK(bridge_pinned_get_stats(&before) == BRIDGE_OK, "pinned stats");
    CHECK(bridge_pinned_setup(backend, &chosen) == BRIDGE_OK && chosen == backend,
          "pinned setup %d gave %d", backend, chosen);
    for (int i = 0; i < 4; i++)
        CHECK(standin.stream_create(&pinned_streams[i], 1) == 0, "cuStreamCreate");
    atomic_store(&pinned_stop, 0);
    pthread_t changer;
    uint64_t seed = 99 + (uint64_t)backend;
    CHECK(pthread_create(&changer, NULL, pinned_changer, &seed) == 0, "pthread_create");
    worker w[6];
    for (int i = 0; i < 6; i++)
        w[i] = (worker){.id = i, .iters = 2000 * scale, .seed = 0x9123ull * (uint64_t)(i + 1)};
    run_threads(6, pinned_worker, w, sizeof w[0]);
    atomic_store(&pinned_stop, 1);
    pthread_join(changer, NULL);
    for (int k = 0; k < PSLOTS; k++)
        pslot_put(k, NULL);
    /* every block back: nothing lent, and with every copy completed a trim
     * gives every byte back to the driver */
    standin.hold_events(0);
    standin.complete_events();
    CHECK(bridge_pinned_set_limit(0) == BRIDGE_OK, "pinned set_limit");
    CHECK(bridge_pinned_trim() == BRIDGE_OK, "pinned trim");
    bridge_pinned_stats ps;
    CHECK(bridge_pinned_get_stats(&ps) == BRIDGE_OK, "pinned stats");
    printf("  pinned (%s): %" PRIu64 " blocks lent, %" PRIu64 " reused, %" PRIu64 " records\n",
           backend == BRIDGE_PINNED_CACHED ? "cached" : "mempool",
           ps.num_allocs - before.num_allocs, ps.num_reuses - before.num_reuses,
           ps.num_records - before.num_records);
    CHECK(ps.used == 0 && ps.n_live_blocks == 0, "pinned: %" PRIu64 " bytes still lent", ps.used);
    CHECK(ps.total == 0 && ps.free == 0 && ps.n_free_blocks == 0 && ps.n_pending_blocks == 0,
          "pinned: %" PRIu64 " bytes held after a trim with every copy complete", ps.total);
}

/* ---- phase: views (history, live blocks, free memory under allocators) ---- */
static atomic_int views_stop;
static atomic_uint_fast64_t stack_calls;

static uint64_t count_stack(void)
{
    return atomic_fetch_add(&stack_calls, 1) + 1;
}

static void *viewer(void *arg)
{
    uint64_t s = *(uint64_t *)arg;
    static const uint64_t caps[] = {0, 16, 1000, 1u << 16};
    bridge_event ev[64];
    bridge_block_info blocks[64];
    while (!atomic_load(&views_stop)) {
        bridge_set_stack_hook(rnd(&s) % 2 ? count_stack : NULL);
        CHECK(bridge_history_set((int)(rnd(&s) % 4 != 0), (int)(rnd(&s) % 2), caps[rnd(&s) % 4],
                                 rnd(&s) % 8 == 0) == BRIDGE_OK,
              "history_set");
        size_t n = 0;
        CHECK(bridge_history_copy(ev, 64, &n) == BRIDGE_OK, "history_copy");
        for (size_t i = 0; i < n && i < 64; i++)
            CHECK(ev[i].action >= BRIDGE_EV_ALLOC && ev[i].action <= BRIDGE_EV_OOM &&
                      ev[i].device == 0 && (ev[i].action == BRIDGE_EV_OOM || ev[i].ptr),
                  "a torn event: action %d device %d", ev[i].action, ev[i].device);
        CHECK(bridge_live_blocks(blocks, 64, &n) == BRIDGE_OK, "live_blocks");
        for (size_t i = 0; i < n && i < 64; i++)
            CHECK(blocks[i].ptr && blocks[i].size, "a torn block");
        bridge_mem_info mi;
        CHECK(bridge_get_mem_info(0, &mi) == BRIDGE_OK, "mem_info");
        CHECK(mi.total == 2 * MIB && mi.free <= mi.total, "free %" PRIu64 " of %" PRIu64, mi.free,
              mi.total);
        sched_yield();
    }
    return NULL;
}

static void phase_views(void)
{
    reset();
    CHECK(bridge_set_limit(0, 2 * MIB) == BRIDGE_OK, "set_limit");
    atomic_store(&views_stop, 0);
    uint64_t seed = 0x5EED5ull;
    pthread_t v;
    CHECK(pthread_create(&v, NULL, viewer, &seed) == 0, "pthread_create");
    worker w[6];
    for (int i = 0; i < 6; i++)
        w[i] = (worker){.id = i,
                        .dev = 0,
                        .iters = 2000 * scale,
                        .limit = 2 * MIB,
                        .max_size = 256 * KIB,
                        .seed = 0xF00Dull * (uint64_t)(i + 3),
                        .tags = 3,
                        .cached_first = i % 2};
    run_threads(6, edge_thread, w, sizeof w[0]);
    atomic_store(&views_stop, 1);
    pthread_join(v, NULL);
    CHECK(bridge_history_set(0, 0, 0, 1) == BRIDGE_OK, "history off");
    bridge_set_stack_hook(NULL);
    check_idle("views");
}

/* ---- phase: share (last: a process joins for good) ---- */
static atomic_int share_stop;

static void *share_trimmer(void *arg)
{
    (void)arg;
    while (!atomic_load(&share_stop)) {
        CHECK(bridge_trim(0, 0) == BRIDGE_OK, "trim under a share");
        /* the pool (what the process takes from the GPU) never passes the
         * budget; the claims' sum may, for a moment, while a raise is
         * checked (it is visible to the sum before it is admitted) */
        bridge_stats s = stats_of(0);
        CHECK(s.pool_reserved <= 16 * MIB, "the pool holds %" PRIu64 " of a 16 MiB share",
              s.pool_reserved);
        usleep(200);
    }
    return NULL;
}

/* Allocates and frees 1 MiB blocks until share_stop: the share may refuse
 * (a raise racing the leave finds the slot no longer its own). */
static void *share_churn(void *arg)
{
    (void)arg;
    while (!atomic_load(&share_stop)) {
        void *p = NULL;
        int rc = bridge_alloc(0, MIB, NULL, BRIDGE_TAG_CUPY, &p);
        CHECK(rc == BRIDGE_OK || rc == BRIDGE_E_BUDGET, "alloc while leaving: %d", rc);
        bridge_free(p);
    }
    return NULL;
}

static void phase_share(void)
{
    reset();
    char dir[] = "/tmp/bridge-stress-XXXXXX";
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    const uint64_t budget = 16 * MIB;
    /* the stand-in's pool grows by exactly what is allocated: claim 2 MiB
     * chunks (a GPU's default pool grows in 32 MiB ones, the default, which
     * would refuse every request of this 16 MiB share) */
    setenv("BRIDGE_SHARE_GROWTH", "2097152", 1);
    CHECK(bridge_share_join(0, "stress", dir, budget) == BRIDGE_OK, "join: %s",
          bridge_share_error());
    pthread_t trimmer;
    atomic_store(&share_stop, 0);
    CHECK(pthread_create(&trimmer, NULL, share_trimmer, NULL) == 0, "trimmer thread");
    worker w[8];
    for (int i = 0; i < 8; i++)
        w[i] = (worker){.id = i,
                        .dev = 0,
                        .iters = 2000 * scale,
                        .limit = budget,
                        .max_size = 2 * MIB,
                        .seed = 0x2545F4914F6CDD1Dull * (uint64_t)(i + 1),
                        .tags = BRIDGE_NTAGS,
                        .default_streams = i % 2};
    run_threads(8, edge_thread, w, sizeof w[0]);
    atomic_store(&share_stop, 1);
    pthread_join(trimmer, NULL);
    uint64_t refusals = 0, ok = 0;
    for (int i = 0; i < 8; i++)
        refusals += w[i].refusals, ok += w[i].ok;
    bridge_share_stats st;
    CHECK(bridge_share_get(0, &st) == BRIDGE_OK, "share figures");
    CHECK(refusals > 0, "the share never refused anything: not at the edge");
    CHECK(ok > 0, "the share admitted nothing: not at the edge");
    CHECK(st.num_overshoots == 0 && st.num_lost == 0, "overshoots %" PRIu64 ", lost %" PRIu64,
          st.num_overshoots, st.num_lost);
    printf("  share: %" PRIu64 " allocations, %" PRIu64 " refused, group %" PRIu64 " of %" PRIu64
           "\n",
           ok, refusals, st.group, st.budget);
    check_idle("share");
    /* leaving while threads allocate and the service thread runs, then
     * joining again: the first slot was freed, so one member */
    atomic_store(&share_stop, 0);
    pthread_t churn[4];
    for (int i = 0; i < 4; i++)
        CHECK(pthread_create(&churn[i], NULL, share_churn, NULL) == 0, "churn thread");
    usleep(20000);
    CHECK(bridge_share_leave(0) == BRIDGE_OK, "leave");
    CHECK(bridge_share_get(0, &st) == BRIDGE_OK && !st.joined, "still a member after leaving");
    CHECK(bridge_share_leave(0) == BRIDGE_OK, "leave again: nothing to do");
    usleep(20000);
    CHECK(bridge_share_join(0, "stress", dir, budget) == BRIDGE_OK, "join again: %s",
          bridge_share_error());
    usleep(20000);
    atomic_store(&share_stop, 1);
    for (int i = 0; i < 4; i++)
        pthread_join(churn[i], NULL);
    CHECK(bridge_share_get(0, &st) == BRIDGE_OK && st.joined && st.members == 1,
          "%" PRIu64 " members after leaving and joining again", st.members);
    check_idle("share left and joined again");
    unlink(st.path); /* the mapping stays */
    rmdir(dir);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s <libstandin_cuda.so> [scale]\n", argv[0]);
        return 2;
    }
    standin_path = argv[1];
    if (argc > 2)
        scale = atoi(argv[2]) > 0 ? atoi(argv[2]) : 1;
    setvbuf(stdout, NULL, _IONBF, 0);

    printf("stress: init\n");
    phase_init();
    bridge_set_tag_holds_streams(BRIDGE_TAG_CUPY, 1); /* as CuPy's adapter does at load */
    load_standin(standin_path);
    for (int d = 0; d < NDEV; d++)
        standin.set_capacity(d, 64 * MIB);
    printf("stress: edge\n");
    phase_edge();
    printf("stress: wait\n");
    phase_wait();
    printf("stress: cross\n");
    phase_cross();
    printf("stress: limits\n");
    phase_limits();
    printf("stress: record\n");
    phase_record();
    printf("stress: double\n");
    phase_double();
    printf("stress: cache\n");
    phase_cache();
    printf("stress: carve\n");
    phase_carve();
    phase_segments();
    printf("stress: graph\n");
    phase_graph();
    printf("stress: corners\n");
    phase_corners();
    printf("stress: pools\n");
    phase_pools();
    printf("stress: graphgone\n");
    phase_graphgone();
    printf("stress: huge\n");
    phase_huge();
    printf("stress: views\n");
    phase_views();
    printf("stress: pinned\n");
    phase_pinned(BRIDGE_PINNED_CACHED);
    phase_pinned(BRIDGE_PINNED_MEMPOOL);
    printf("stress: share\n");
    phase_share();
    /* the thread slots' park ran in the phases that free through worker_free */
    CHECK(parked_seen > 0, "no block was parked with its record in any phase");
    printf("stress: %" PRIu64 " looks found a block parked with its record\n",
           (uint64_t)atomic_load(&parked_seen));
    printf("stress: all phases passed\n");
    return 0;
}
