/* SPDX-License-Identifier: Apache-2.0 */
/* bridge.h: the compiled core of bridge (internal header).
 *
 * Glossary
 *   pool       the CUDA driver's DEFAULT memory pool of a device
 *              (cuDeviceGetDefaultMemPool); every framework allocates from it.
 *   ledger     the bridge's own account of the bytes it handed out, per
 *              device and per framework tag; exact at every instant.
 *   budget     the byte limit of a device (0 = none).  It covers the ledger
 *              plus what others (JAX, anyone) hold in the same pool.
 *   others     pool USED_MEM_CURRENT minus the bytes the driver granted the
 *              ledger (never below 0).
 *   record     what the core remembers of one live allocation: pointer,
 *              size, device, stream, tag, streams recorded against it.
 *
 * The core never calls Python and never takes the GIL: it is called from
 * torch's allocator (any thread, autograd included), from the CuPy allocator
 * (which drops the GIL around bridge_alloc and bridge_free, not around
 * bridge_alloc_cached and bridge_free_cached) and from Python for figures and limits.
 * Error handling: functions return a bridge_status; one place in Python
 * (bridge/_errors.py) turns these into exceptions.  Free paths never fail:
 * they count what went wrong (bad_frees, driver_errors).
 */
#ifndef BRIDGE_H
#define BRIDGE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define BRIDGE_MAX_DEVICES 64

/* ---- tags: the ledger's slots, one per framework ----
 * Tag 0 counts what no framework's adapter allocated; 1 .. BRIDGE_NTAGS-1 are
 * the frameworks' slots.  Which framework holds which slot is the registry's
 * (bridge/frameworks.py; frameworks.h, its C half, names the slots C code
 * counts under): the core knows a tag only as a number, and how many there
 * are from frameworks.h's list (one slot per line of it, and tag 0). */
#include "frameworks.h"

#define BRIDGE_TAG_COUNT_(name, n) +1
enum bridge_tag { BRIDGE_TAG_OTHER = 0, BRIDGE_NTAGS = 1 BRIDGE_FRAMEWORK_TAGS(BRIDGE_TAG_COUNT_) };
#undef BRIDGE_TAG_COUNT_

/* ---- status codes ---- */
typedef enum bridge_status {
    BRIDGE_OK = 0,
    BRIDGE_E_BUDGET = 1,    /* the request would pass the device budget */
    BRIDGE_E_OOM = 2,       /* the driver is out of memory */
    BRIDGE_E_DRIVER = 3,    /* another driver error (see bridge_last_driver_error) */
    BRIDGE_E_NODRIVER = 4,  /* libcuda could not be loaded or cuInit failed */
    BRIDGE_E_NOPOOLS = 5,   /* the device has no stream-ordered memory pools */
    BRIDGE_E_DEVICE = 6,    /* no such device, or the device is not set up */
    BRIDGE_E_INVALID = 7,   /* bad argument */
    BRIDGE_E_TAG_LIMIT = 8, /* the request would pass the framework's own cap */
    BRIDGE_E_NOTINIT = 9,   /* bridge_init was not called */
    BRIDGE_E_FORKED = 10,   /* this process is a fork child of one that used CUDA */
    BRIDGE_E_SHARE = 11,    /* a share's file cannot be used (bridge_share_error says why) */
    BRIDGE_E_MISS = 12,     /* *_cached: the cache cannot; call bridge_alloc / bridge_free */
    BRIDGE_E_IPC = 13       /* a block cannot be shared or imported (bridge_ipc_error says why) */
} bridge_status;

/* ---- driver loading (driver.c) ---- */
/* Load libcuda (or the library named by `path`, e.g. the stand-in driver of
 * the tests), call cuInit.  Idempotent; thread-safe. */
int bridge_init(const char *path);
int bridge_initialized(void);
int bridge_device_count(int *count);
int bridge_driver_version(int *version);
/* The device's name (NUL-terminated within len), compute capability and
 * memory, from the driver alone (no context is made current or created). */
int bridge_device_info(int device, char *name, int len, int *cc_major, int *cc_minor,
                       uint64_t *total);
/* The device of the calling thread's current context; 0 when it has none. */
int bridge_current_device(int *device);
/* Last driver error code and name seen by any bridge call (diagnostics). */
int bridge_last_driver_error(void);
const char *bridge_driver_error_name(int code);
const char *bridge_loaded_library(void);
/* Why the last bridge_init failed (empty when it did not). */
const char *bridge_load_error(void);
/* 1 in a child forked after bridge_init: the parent's CUDA state is unusable
 * there, and the child owns none of the parent's blocks (frees are ignored,
 * every allocation fails with BRIDGE_E_FORKED). */
int bridge_forked(void);

/* ---- devices and their pools (ledger.c) ---- */
/* Retain the primary context, fetch the default pool, set its release
 * threshold.  Idempotent; release_threshold is (re)applied every call.  A
 * device nobody set up is set up by its first allocation (no budget). */
int bridge_device_setup(int device, uint64_t release_threshold);
int bridge_device_ready(int device);
/* Write the pool attributes the bridge owns again (after JAX changed them). */
int bridge_reassert(int device);
int bridge_pool_attribute(int device, int attr, uint64_t *value);
/* Return idle pool memory to the driver, keeping `keep` bytes; synchronizes
 * the device first so that pending frees are returned too. */
int bridge_trim(int device, uint64_t keep);
/* Let every peer that can access `device` read its pool memory. */
int bridge_grant_peer_access(int device, int *granted);

/* ---- budget ---- */
int bridge_set_limit(int device, uint64_t limit); /* 0 = none */
/* A framework's own cap (0 = none; BRIDGE_TAG_LIMIT_ZERO: every allocation
 * of the tag is refused).  A device not set up yet keeps the cap for its
 * setup (its first allocation), as torch applies a memory fraction to a
 * device it has not used yet. */
#define BRIDGE_TAG_LIMIT_ZERO UINT64_MAX
int bridge_set_tag_limit(int device, int tag, uint64_t limit);

/* ---- allocation (the hot path) ---- */
/* Allocate `size` bytes on `stream` for framework `tag`.  size 0 gives
 * *out = NULL and BRIDGE_OK.  Never returns a null pointer with BRIDGE_OK
 * for size > 0.  On budget or driver failure it synchronizes `stream`,
 * completes deferred frees, calls the pressure hook and retries once. */
int bridge_alloc(int device, size_t size, void *stream, int tag, void **out);
/* bridge_alloc served from the cache of freed blocks only: a block of `size`
 * freed on `stream` (its key: per-thread streams are the calling thread's),
 * adopted for `tag` under the tag's cap, noted in the history.  BRIDGE_OK on
 * a hit (size 0: *out = NULL, as bridge_alloc); BRIDGE_E_MISS when nothing
 * cached fits, the device is not set up yet, a CuPy capture runs on the
 * device (its arrays go to its graph's pool) or frees deferred by a
 * capture are pending (bridge_alloc completes them first): then call
 * bridge_alloc.
 * BRIDGE_E_INVALID for a bad tag.  It takes the cache's lock and one records
 * shard lock, both leaves that no holder keeps while calling Python or
 * waiting; it never waits and makes no driver call, except to give a block
 * back when adopting it failed (a tag's cap): fit for holding the GIL. */
int bridge_alloc_cached(int device, size_t size, void *stream, int tag, void **out);
/* Free a pointer the bridge handed out.  Never fails: an unknown pointer or a
 * double free is counted (bad_frees) and changes no figure. */
void bridge_free(void *ptr);
/* bridge_free into the cache of freed blocks only: BRIDGE_OK when the block
 * was kept for the next allocation of its size on its stream without a
 * driver call, an eviction or a wait (NULL: OK, nothing to free);
 * BRIDGE_E_MISS otherwise, with nothing changed: then call bridge_free.
 * Misses: a graph block, a block with streams recorded against it, a tag
 * that is not cached, a short-lived stream, any capture active on the
 * device, frees deferred by a capture pending, a cache that would have to
 * evict (the block must fit under its tier's cap as the cache is; neither
 * tier evicts for it) or is held by a waiter, or off, the history on, and unknown
 * pointers and double frees (bridge_free counts those).  It takes one
 * records shard lock and, under it, the cache's lock, both leaves that no
 * holder keeps while calling Python or waiting: fit for holding the GIL. */
int bridge_free_cached(void *ptr);
/* bridge_free after the work queued on `stream`, a stream the caller keeps
 * alive during this call (RMM's deallocate(ptr, size, stream)).  For a tag
 * that holds its streams (bridge_set_tag_holds_streams) the free is issued
 * on `stream`, as the framework's own stream-ordered pool issues it, and
 * after the block's own stream where that one outlives the block; for any
 * other tag `stream` is recorded first (bridge_record_stream).  Never fails,
 * as bridge_free. */
void bridge_free_on_stream(void *ptr, void *stream);
/* `stream` may use `ptr`: its queued work completes before the memory is
 * reused.  Returns BRIDGE_E_INVALID for an unknown pointer. */
int bridge_record_stream(void *ptr, void *stream);
/* Size and device of a live allocation; BRIDGE_E_INVALID when unknown. */
int bridge_lookup(void *ptr, size_t *size, int *device, int *tag);

/* ---- the cache of freed blocks (cache.c) ---- */
/* Cap the cached bytes of a device (0 turns the cache off and empties it) and
 * the largest block that is cached. */
int bridge_set_cache(int device, uint64_t limit, uint64_t max_block);
/* The small tier's cap follows what the frameworks hold on the device
 * (`live`): cached_small <= min(limit, max(floor, live * fraction)); past it
 * the tier's least recently cached blocks go back to the pool.  Defaults:
 * 1/16 and 64 MiB.
 * fraction in [0, 65536] (kept to 1/65536); BRIDGE_E_INVALID otherwise. */
int bridge_set_cache_fraction(int device, double fraction, uint64_t floor);
/* Two tiers: blocks of at most `small_max` bytes are capped as above; larger
 * ones have their own least-recently-cached order under their cap,
 * cached_large <= min(limit, large_cap, max(live * large_fraction, the block
 * being cached)), and each tier evicts only its own blocks.  Defaults: 1 MiB
 * and 64 MiB.  Blocks already cached stay where they are. */
int bridge_set_cache_tiers(int device, uint64_t small_max, uint64_t large_cap);
/* The large tier's share of the live bytes (default 1/8; 0: the fixed cap
 * alone).  One block up to large_cap is always cacheable.
 * fraction in [0, 65536] (kept to 1/65536); BRIDGE_E_INVALID otherwise. */
int bridge_set_cache_large_fraction(int device, double fraction);
/* Each thread's newest freed block waits in a slot of that thread's (on by
 * default): its next allocation of that size and stream takes it back, and a
 * free into an empty slot, with no lock; the slots are the newest end of the
 * cache's order (the hits and the cached bytes are the lists' alone would
 * give, on one thread).  Off: freed blocks go to the shared lists alone. */
int bridge_set_cache_thread_slots(int device, int on);
/* Carving (off by default; docs/design.md, Note [Segments]): the
 * requests the cache may serve are carved from pool chunks of their stream,
 * those of at most 1 MiB from 2 MiB chunks, larger ones from chunks of
 * `share` of the live bytes rounded up to a power of two within [min, max];
 * empty chunks kept: `keep` bytes of large ones, `small_keep` of small ones.
 * max 0: off (the empty chunks go back; blocks carved before return to their
 * chunks as they are freed).  share in [0, 65536] and 0 < min <= max when on;
 * BRIDGE_E_INVALID otherwise. */
int bridge_set_cache_carve(int device, double share, uint64_t min, uint64_t max, uint64_t keep,
                           uint64_t small_keep);
/* Segments (off in the core until set; the library's default: the Python side
 * turns them on for every device it sets up unless BRIDGE_CACHE_SEGMENTS=0;
 * docs/design.md, Note [Segments]): carving with large chunks of 1/16 of the live bytes within
 * 64-512 MiB, every emptied chunk kept, and one release rule: before a new
 * chunk is taken, while the chunks plus the new one exceed 1.05 x the
 * high-water mark of the carved bytes live, the empty chunk that emptied
 * first goes back to the pool (a flush, a waiter, the budget's recovery
 * chain: every empty chunk).  Under a budget or a share a chunk is larger
 * than its request (rounded up to 2 MiB) only while it is at most half the
 * room they leave, and every idle byte goes back before a chunk that does
 * not fit it.  Off: carving off, the empty chunks go back. */
int bridge_set_cache_segments(int device, int on);
/* The bytes of empty segments kept in each class (requests up to 1 MiB, and
 * larger ones); the emptied segments past it go back to the pool at once,
 * the one that emptied first first (UINT64_MAX, as set_cache_segments sets
 * it: every one kept, under the release rule alone).  BRIDGE_CACHE_LIMIT. */
int bridge_set_cache_segments_keep(int device, uint64_t keep);
/* Blocks freed on `stream` may be cached: it lives as long as the process
 * (torch's pooled streams).  Default streams need no registration; other
 * streams' blocks are never cached, since a user stream may be destroyed
 * and its handle reused, and stream order is what makes a cached block safe. */
int bridge_register_stream(void *stream);
/* 1 when `stream` is registered (or a default stream): one lock-free lookup,
 * for an allocator that registers streams as it first meets them. */
int bridge_stream_registered(void *stream);
/* The stream will be destroyed: blocks freed on it are no longer cached
 * (blocks already cached stay, and are freed in its order on a flush). */
int bridge_forget_stream(void *stream);

/* Whether blocks of framework `tag` may be cached (default: yes).  A
 * framework that uses its blocks on streams other than the one it allocated
 * on, relying on the legacy default stream's implicit ordering (Numba), must
 * have its blocks freed on that stream, not kept for the next request. */
int bridge_set_tag_cached(int tag, int cached);
/* Whether framework `tag` keeps a block's stream alive until the block's
 * free has returned (CuPy's blocks hold their Stream object): the core may
 * then issue the free on that stream.  Frees of other tags on streams that
 * are neither default nor registered (bridge_register_stream) never touch
 * their stream, which may be destroyed by then: they are issued on the
 * legacy default stream, after the queued work of every blocking stream. */
int bridge_set_tag_holds_streams(int tag, int holds);

/* ---- CUDA graph capture (graph.c) ---- */
/* torch's pool hooks.  begin/release count the pool's users (as torch
 * does); while a capture is active on a device, allocations the caller
 * routes to a pool (bridge_alloc_graph, with the capturing stream) come from
 * the pool's freed blocks or the side stream and stay with the pool until its
 * last user releases it; frees of other pointers are deferred until no
 * capture is active. */
int bridge_graph_begin(int device, uint64_t id0, uint64_t id1);
/* bridge_graph_begin with what the caller knows of the begin: `capture` 1:
 * a capture begins next on `stream` (torch's current stream at its begin
 * hook, which torch calls before cudaStreamBeginCapture), so a capture that
 * fails before any allocation into the pool is still noticed (a registered
 * stream only: one the core may ask about later); 0: a routing of a thread
 * or stream that never captures (torch.cuda.use_mem_pool), whose pool no
 * graph replays into unless a capture uses it too. */
int bridge_graph_begin_on(int device, uint64_t id0, uint64_t id1, void *stream, int capture);
int bridge_graph_end(int device, uint64_t id0, uint64_t id1);
int bridge_graph_release(int device, uint64_t id0, uint64_t id1);
int bridge_alloc_graph(int device, size_t size, int tag, uint64_t id0, uint64_t id1, void *stream,
                       void **out);
/* A pool's users without a capture: torch.cuda.MemPool's creation counts one
 * (bridge_graph_release ends it), as torch's createOrIncrefPool does. */
int bridge_graph_incref(int device, uint64_t id0, uint64_t id1);
/* A block the pool (id0, id1) freed earlier, of at least `size` bytes on
 * `stream` (best fit, as a graph request takes it), made live for `tag` with
 * no new memory: torch's last resort before an out-of-memory error, a
 * MemPool made with use_on_oom=True.  BRIDGE_E_MISS when the pool has none
 * (or the device is not set up). */
int bridge_graph_take(int device, size_t size, int tag, uint64_t id0, uint64_t id1, void *stream,
                      void **out);
/* The pool's users now (0 when it does not exist). */
int bridge_graph_uses(int device, uint64_t id0, uint64_t id1);
/* A graph block the user freed becomes live again for `tag` (off its pool's
 * free list): torch's graph trees restoring a checkpointed pool state.
 * BRIDGE_E_INVALID when `ptr` is not a freed graph block. */
int bridge_graph_adopt(void *ptr, int tag);
/* A capture the bridge would not otherwise see (CuPy's Stream.begin_capture):
 * nothing is freed, synchronized or allocated on a capturing stream. */
int bridge_capture_begin(int device);
int bridge_capture_end(int device);
/* The id0 of the graph pools of the stream captures the core is told of
 * (bridge_capture_begin_stream; CuPy's, as frameworks.h names it). */
#define BRIDGE_STREAM_POOL 0x4355505947524150ull /* "CUPYGRAP" */
/* A CuPy capture of `stream`: a graph pool of its own (id0 BRIDGE_STREAM_POOL,
 * *id1 a fresh id) that allocations on the stream go to while it captures,
 * as torch's graphs' do, so temporaries the capture frees stay with the
 * graph; end unbinds the stream; the pool is released when the graph is
 * gone (bridge_capture_bind_graph), or by bridge_graph_release(device,
 * that id0, id1) when it could not be bound. */
int bridge_capture_begin_stream(int device, void *stream, uint64_t *id1);
int bridge_capture_end_stream(int device, uint64_t id1);
/* While `stream` still captures (before CuPy's end_capture): the graph being
 * captured gets a CUDA user object whose destructor (run by the driver once
 * the graph and every exec made from it are destroyed and their launches
 * have completed) marks the pool dead; a later collect (bridge_graph_collect,
 * the refusal path, the figures, a trim) releases it.  BRIDGE_OK: the pool's
 * release is the core's (never bridge_graph_release it); BRIDGE_E_INVALID:
 * not that stream's capture's pool, bound already, or the capture is not
 * active; BRIDGE_E_DRIVER: the driver refused the user object; then the
 * caller still releases the pool itself. */
int bridge_capture_bind_graph(int device, uint64_t id1, void *stream);
/* Releases the pools of dead graphs now, then writes up to `cap` pools
 * released by any collect since the last call (device, id1), and returns
 * how many; the rest wait for the next call. */
size_t bridge_graph_collect(int *devices, uint64_t *ids, size_t cap);
int bridge_captures_active(int device);

/* ---- pressure hook: called once before an allocation fails ---- */
/* What the hook is asked to run (its `stage`).  A full garbage collection
 * holds the GIL for about 0.1 s in a process with torch and CuPy loaded,
 * stopping every Python thread: a thread that will wait for others' frees
 * leaves it out of the chain before the wait, and runs it only when the
 * wait goes on past a grace or is about to end in a refusal. */
enum {
    BRIDGE_RELIEVE_ALL = 0,     /* framework caches, garbage collection, callbacks */
    BRIDGE_RELIEVE_CACHES = 1,  /* before a wait: caches that collect nothing, callbacks */
    BRIDGE_RELIEVE_COLLECT = 2, /* during a wait: the collection, caches that collect */
};
/* Returns nonzero when it freed something worth a retry. */
typedef int (*bridge_pressure_fn)(int device, size_t size, int tag, int stage);
void bridge_set_pressure_hook(bridge_pressure_fn fn);

/* ---- waiting for memory others free (wait.c) ---- */
/* An allocation the budget (or a full device) refuses, after the recovery
 * chain, waits up to the calling thread's time for frees to make room:
 * without spinning, in order of arrival, never during a capture on the
 * device, and not at all when every thread holding bridge memory on the
 * device is waiting too (one of them, the lowest priority then the newest,
 * is refused at once).  Seconds <= 0: refuse at once (the default). */
int bridge_set_wait(double seconds); /* the process default */
double bridge_get_wait(void);
/* The calling thread's own time and priority (set 0: the process default,
 * priority 0).  Lower priorities are refused first when all wait. */
int bridge_set_thread_wait(int set, double seconds, int priority);
void bridge_get_thread_wait(int *set, double *seconds, int *priority);
enum bridge_wait_outcome {
    BRIDGE_WAIT_NONE = 0,        /* the thread did not wait (no time set, or not refused) */
    BRIDGE_WAIT_OK = 1,          /* it waited and got the memory */
    BRIDGE_WAIT_TIMEOUT = 2,     /* it waited its whole time */
    BRIDGE_WAIT_ALL_WAITING = 3, /* refused at once: every holder was waiting */
    BRIDGE_WAIT_INTERRUPTED = 4, /* gave up for Ctrl-C (the signal is left pending) */
    BRIDGE_WAIT_CAPTURE = 5,     /* did not wait: a capture runs on the device */
    BRIDGE_WAIT_HOPELESS = 6     /* did not wait: larger than the budget or the device */
};
/* How the calling thread's last refused allocation ended, and how long it
 * waited (for the OOM message). */
void bridge_last_wait(double *seconds, int *outcome);
/* Called on the waiting thread by the waiting loop (pymod.c sets them):
 * release_gil before blocking (returns a token, NULL when nothing was
 * released), reacquire_gil with it after; interrupted about every 50 ms:
 * nonzero gives the wait up. */
typedef struct bridge_wait_hooks {
    void *(*release_gil)(void);
    void (*reacquire_gil)(void *token);
    int (*interrupted)(void);
} bridge_wait_hooks;
void bridge_set_wait_hooks(const bridge_wait_hooks *hooks);
/* The threads holding bridge memory on a device (bytes they allocated and
 * have not freed), with whether each is waiting; *n gets how many were
 * written (at most max). */
typedef struct bridge_holder {
    unsigned long thread; /* pthread_self of the allocating thread (threading.get_ident) */
    uint64_t bytes;
    int waiting;
} bridge_holder;
int bridge_wait_holders(int device, bridge_holder *out, int max, int *n);

/* ---- figures ---- */
typedef struct bridge_tag_stats {
    uint64_t current;    /* live bytes of this tag */
    uint64_t peak;       /* highest `current` since the last reset */
    uint64_t allocated;  /* bytes allocated, cumulative */
    uint64_t freed;      /* bytes freed, cumulative */
    uint64_t num_allocs; /* allocations, cumulative */
    uint64_t num_frees;  /* frees, cumulative */
    uint64_t num_ooms;   /* refused requests */
    uint64_t limit;      /* the tag's own cap (0 = none; BRIDGE_TAG_LIMIT_ZERO) */
    uint64_t count;      /* live allocations now (not reset by reset_accumulated) */
    uint64_t count_peak; /* highest `count` since the last peak reset */
    /* highest `current` + graph_bytes + cached (torch's reserved_bytes)
     * since the last peak reset: at least `peak`, raised at every read of
     * the figures and before the cache is flushed (an empty_cache lowers
     * the figure, never its peak) */
    uint64_t reserved_peak;
} bridge_tag_stats;

typedef struct bridge_stats {
    uint64_t limit;          /* budget, 0 = none */
    uint64_t used;           /* ledger bytes, every tag */
    uint64_t peak_used;      /* highest `used`; never above limit - others */
    uint64_t pool_used;      /* driver: USED_MEM_CURRENT */
    uint64_t pool_reserved;  /* driver: RESERVED_MEM_CURRENT */
    uint64_t pool_used_high; /* driver: USED_MEM_HIGH */
    uint64_t release_threshold;
    uint64_t total; /* device memory */
    uint64_t num_allocs;
    uint64_t num_frees;
    uint64_t num_ooms;
    uint64_t num_retries;   /* allocations that succeeded on retry */
    uint64_t num_bad_frees; /* unknown pointers and double frees */
    uint64_t num_driver_errors;
    uint64_t num_deferred;         /* frees waiting for a capture to end, or for a
                                      synchronization of the device (a block of a
                                      non-blocking stream that may be gone) */
    uint64_t graph_bytes;          /* bytes held by captured graphs */
    uint64_t cached;               /* freed blocks kept for reuse (part of `used`) */
    uint64_t cache_limit;          /* cap of `cached`; 0 = no cache */
    uint64_t num_cache_hits;       /* allocations served from the cache */
    uint64_t num_order_fallbacks;  /* frees ordered by a device sync, not events */
    uint64_t num_pool_read_errors; /* budget checks that used the last pool figure */
    uint64_t captures_active;      /* captures the bridge knows are running */
    uint64_t num_waits;            /* allocations that waited for memory (wait.c) */
    uint64_t wait_ns;              /* time they waited, cumulative */
    uint64_t num_wait_timeouts;    /* waits that ran out of time */
    uint64_t num_wait_all_waiting; /* waits failed at once: every holder was waiting */
    uint64_t num_wait_interrupts;  /* waits given up for Ctrl-C */
    uint64_t waiting;              /* threads waiting now */
    bridge_tag_stats tag[BRIDGE_NTAGS];
    uint64_t cache_floor;        /* the small tier's cap is at least this (under cache_limit) */
    double cache_fraction;       /* ... and at most this share of the live bytes */
    uint64_t cached_small;       /* `cached` in the small tier (blocks <= cache_small_max) */
    uint64_t cached_large;       /* ... and in the large tier */
    uint64_t cache_small_max;    /* the largest block of the small tier */
    uint64_t cache_large_cap;    /* the large tier's cap (under cache_limit) ... */
    double cache_large_fraction; /* ... and its share of the live bytes (0: none) */
    uint64_t carve_held;         /* bytes of the chunks blocks are carved from */
    uint64_t carve_on;           /* 1 while carving is on */
    uint64_t carve_hwm;          /* the most carved bytes live at once (requested sizes) */
    uint64_t carve_slack;        /* the release rule's slack, per mille (0: none) */
    uint64_t carve_parked;       /* carved blocks parked in thread slots (requested sizes;
                                    in `cached`, still carved: in no chunk's free range) */
} bridge_stats;

int bridge_get_stats(int device, bridge_stats *out);
int bridge_reset_peak(int device, int tag); /* tag -1: every tag and the total */
int bridge_reset_accumulated(int device, int tag);
/* Bytes of `others` right now (pool used minus what the ledger was granted). */
int bridge_others(int device, uint64_t *out);
/* Live allocations on every device (records in the table). */
uint64_t bridge_live_records(void);
/* Freed blocks whose record stays in the table while they wait in their
 * thread's slot (diagnostics and tests: the park's own count). */
uint64_t bridge_parked_records(void);

/* ---- what tools see (views.c) ---- */
/* A device's free memory as a framework's free-memory query should report
 * it.  device_free = the driver's free memory (cuMemGetInfo) + the pool's
 * idle bytes + the cache of freed blocks: what an allocation through the
 * bridge could have.  held = what counts against the budget now (the ledger
 * and every other user of the pool, less the cache).  With a budget:
 * free = min(device_free, limit - held), total = min(limit, driver_total);
 * without one: the driver's own free and total.  In a share (share.c) the
 * limit is the smaller of this process's budget and the share's, and free is
 * at most the share's budget less the other members' claims less what this
 * process's pool holds in use. */
typedef struct bridge_mem_info {
    uint64_t free, total;               /* the answer */
    uint64_t driver_free, driver_total; /* cuMemGetInfo */
    uint64_t pool_idle;                 /* pool reserved - pool used */
    uint64_t cached;                    /* the bridge's cache of freed blocks */
    uint64_t held;                      /* bytes counted against the budget */
    uint64_t limit;                     /* the budget that refuses first; 0 = none */
} bridge_mem_info;
int bridge_get_mem_info(int device, bridge_mem_info *out);

/* One live allocation of the table (records.c), as bridge_live_blocks
 * copies it out. */
typedef struct bridge_block_info {
    uint64_t ptr, size, stream;
    int32_t device;
    int32_t tag;
    uint32_t flags;          /* 1: a graph's block; 2: a graph block the user freed */
    uint64_t graph0, graph1; /* the graph pool of a graph block */
} bridge_block_info;
/* Copy up to `n` live blocks into `out`; *count gets how many there are
 * (call again with a larger buffer when *count > n). */
int bridge_live_blocks(bridge_block_info *out, size_t n, size_t *count);

/* The allocation history. */
enum bridge_event_action {
    BRIDGE_EV_ALLOC = 0, /* an allocation was handed out */
    BRIDGE_EV_FREE = 1,  /* a block was freed (given back, cached or kept for its graph) */
    BRIDGE_EV_OOM = 2    /* an allocation was refused; `extra` = free bytes then */
};
typedef struct bridge_event {
    uint64_t time_us; /* CLOCK_REALTIME, microseconds */
    uint64_t ptr, size, stream;
    uint64_t stack; /* id from the stack hook; 0 = none */
    uint64_t extra;
    int32_t device;
    int32_t action; /* enum bridge_event_action */
    int32_t tag;
} bridge_event;
/* Start (on 1) or stop (on 0) recording; keep at most max_entries events
 * (the oldest are overwritten; 0 = keep the current cap); clear: forget
 * the events so far.  stacks: call the stack hook for each event. */
int bridge_history_set(int on, int stacks, uint64_t max_entries, int clear);
/* Copy up to `n` events, oldest first; *count gets how many are kept. */
int bridge_history_copy(bridge_event *out, size_t n, size_t *count);
/* The stack hook: called (outside every lock of the core) for each event
 * while stacks are on; returns an id for the caller's stack, 0 for none.
 * Set by the Python module; it must not block. */
typedef uint64_t (*bridge_stack_fn)(void);
void bridge_set_stack_hook(bridge_stack_fn fn);
/* ---- blocks shared with other processes (ipc.c) ---- */
#define BRIDGE_IPC_HANDLE_SIZE 152
/* The device's allocations come from now on from a pool the bridge creates
 * with POSIX file-descriptor export (same ledger, budget and cache; the
 * default pool's blocks stay where they are).  Idempotent.  BRIDGE_E_IPC
 * when the driver cannot create it. */
int bridge_ipc_enable(int device);
/* Undo bridge_ipc_enable: the device allocates from the default pool again
 * and the exportable pool is put away (its idle memory trimmed; the next
 * bridge_ipc_enable takes it back).  BRIDGE_E_IPC (bridge_ipc_error says
 * why) when the pool must stay: a block of it was shared with another
 * process, or blocks of it are live.  A device without one: BRIDGE_OK. */
int bridge_ipc_disable(int device);
int bridge_ipc_enabled(int device);
/* A handle of BRIDGE_IPC_HANDLE_SIZE bytes for a live block of the
 * exportable pool (its start; *offset: 0), for another process of this
 * user to import; starts the thread that serves the pool's descriptor. */
int bridge_ipc_export(void *ptr, unsigned char *handle, uint64_t *offset);
/* The block of a handle, mapped on `device` of this process and held in the
 * exporter until bridge_ipc_release (or until this process ends). */
int bridge_ipc_import(const unsigned char *handle, size_t len, int device, void **out);
/* Let go of an imported block, after this device's work on it: never fails. */
void bridge_ipc_release(void *ptr);
/* Why the last bridge_ipc_* call of this thread failed, in words. */
const char *bridge_ipc_error(void);
/* Holds other processes have on this process's blocks; imports this process
 * holds; connections refused (another user's). */
uint64_t bridge_ipc_holds(void);
uint64_t bridge_ipc_imported(void);
uint64_t bridge_ipc_refused(void);

/* ---- one budget for the processes of a GPU (share.c) ---- */
/* Join the share `name` of the physical GPU of `device` (by UUID) for this
 * process: the file <dir>/bridge-<uid>-<uuid>-<hash of name> is created
 * (mode 0600) or checked field by field, a member slot is taken and a
 * service thread started.  budget: bytes; 0 adopts the share's (the first
 * process must give one; later ones must give the same or 0).  Joining the
 * same share again is a no-op.  BRIDGE_E_SHARE: bridge_share_error() says
 * why, in words. */
int bridge_share_join(int device, const char *name, const char *dir, uint64_t budget);
/* The pool growth the next joins claim for an allocation in flight: bytes, a
 * multiple of 2 MiB up to 1 TiB (0: BRIDGE_SHARE_GROWTH as bytes, else 32 MiB).
 * BRIDGE_E_INVALID for another value. */
int bridge_share_set_growth(uint64_t bytes);
/* Leave the share of `device`'s GPU that this process joined: its service
 * thread ends, its slot is freed (its claim back to the other members, who
 * no longer count it) and the ledger asks the share no more; only this
 * process's own budget applies then.  A device in no share: BRIDGE_OK. */
int bridge_share_leave(int device);
const char *bridge_share_error(void);

typedef struct bridge_share_stats {
    int joined;    /* 0: the device is in no share */
    uint32_t slot; /* this process's slot */
    char name[64];
    char path[512];
    uint64_t budget;           /* the share's budget, rounded down to the claim unit */
    uint64_t claim;            /* this process's claim */
    uint64_t group;            /* every member's claim */
    uint64_t members;          /* slots with an owner */
    uint64_t inflight;         /* growth of allocations in flight (rounded) */
    uint64_t num_refused;      /* reservations the group refused */
    uint64_t num_asks;         /* times this process asked the others to trim */
    uint64_t num_trims_served; /* trims it did when asked */
    uint64_t num_reclaimed;    /* claims of dead members it took back */
    uint64_t num_overshoots;   /* pool growths its claim did not cover in advance */
    uint64_t max_overshoot;    /* bytes: the most the pool was seen above the claim */
    uint64_t num_lost;         /* claim changes refused: the slot was no longer its own */
} bridge_share_stats;
int bridge_share_get(int device, bridge_share_stats *out);

/* The file's layout, for readers in other languages (the stats command). */
typedef struct bridge_share_layout_info {
    uint64_t magic, version, file_size, header_size, slot_size, nslots, unit;
    uint64_t unit_bits, pid_bits;
    uint64_t off_budget, off_uid, off_uuid, off_name;
    uint64_t off_word, off_start, off_trim_req, off_trim_done, off_asked_at, off_heartbeat;
    uint64_t off_tag_bytes, off_outside, off_cached, off_pool_reserved, off_device, off_overshoots,
        off_fields_gen;
} bridge_share_layout_info;
int bridge_share_layout(bridge_share_layout_info *out);

/* ---- pinned host memory (pinned.c) ---- */
/* One process-wide pool of page-locked host memory: blocks cut to size
 * classes, kept in free lists, reused once every asynchronous copy recorded
 * against them has completed.  See pinned.c for the glossary. */
enum bridge_pinned_backend {
    BRIDGE_PINNED_CACHED = 0,  /* cuMemHostAlloc blocks (portable) */
    BRIDGE_PINNED_MEMPOOL = 1, /* a host-located stream-ordered pool (cuMemPoolCreate) */
    BRIDGE_PINNED_AUTO = 2     /* MEMPOOL where the driver offers it, else CACHED */
};
typedef struct bridge_pinned_block bridge_pinned_block; /* opaque */

/* Retain device 0's primary context (host allocations are made in it) and
 * choose the base of new blocks; *chosen gets it.  Callable again to switch
 * bases while no block is lent or awaited (else BRIDGE_E_INVALID);
 * BRIDGE_E_NOPOOLS when MEMPOOL was asked for and the driver has none. */
int bridge_pinned_setup(int backend, int *chosen);
/* Lend a block of at least `size` (> 0) bytes with one reference.  With
 * may_block 0 it only reuses a free block (no driver call, fit for holding
 * the GIL) and gives *out NULL with BRIDGE_OK when it would have to ask the
 * driver.  BRIDGE_E_BUDGET past the limit, BRIDGE_E_OOM when the system
 * cannot pin more. */
int bridge_pinned_alloc(size_t size, int may_block, bridge_pinned_block **out);
void *bridge_pinned_ptr(const bridge_pinned_block *b);
size_t bridge_pinned_size(const bridge_pinned_block *b);
/* References: every view of a block holds one.  The last release returns
 * the block to the pool; never fails, needs no GIL. */
void bridge_pinned_retain(bridge_pinned_block *b);
void bridge_pinned_release(bridge_pinned_block *b);
/* Record an event on `stream` against the lent block holding `addr`: the
 * block is not reused before the stream's work queued so far completed.
 * BRIDGE_E_INVALID when no lent block holds `addr` or the stream is bad;
 * BRIDGE_E_FORKED in a child forked after the pool was set up. */
int bridge_pinned_record(const void *addr, void *stream);
/* The lent block holding `addr`: its start and requested size. */
int bridge_pinned_lookup(const void *addr, void **base, size_t *size);
int bridge_pinned_set_limit(uint64_t limit); /* 0 = none; trims to fit */
/* Give every free block whose copies completed back to the system (and,
 * for MEMPOOL blocks, the awaited ones too: freed on the stream). */
int bridge_pinned_trim(void);
int bridge_pinned_reset_peak(void);

typedef struct bridge_pinned_stats {
    int backend;           /* enum bridge_pinned_backend; -1 before setup */
    int mempool_available; /* 1 when a host-located pool was created */
    uint64_t limit;        /* 0 = none; `total` never passes it */
    uint64_t used;         /* bytes of lent blocks (class sizes) */
    uint64_t free;         /* bytes of free blocks, pending ones included */
    uint64_t total;        /* bytes held from the driver: used + free */
    uint64_t peak_used;
    uint64_t n_free_blocks;    /* free blocks, pending ones included */
    uint64_t n_pending_blocks; /* free blocks awaiting a recorded copy */
    uint64_t n_live_blocks;    /* lent blocks */
    uint64_t num_allocs;       /* blocks lent, cumulative */
    uint64_t num_reuses;       /* of which came from the free lists */
    uint64_t num_base_allocs;  /* driver allocations */
    uint64_t num_base_frees;   /* driver frees */
    uint64_t num_ooms;         /* refused requests */
    uint64_t num_driver_errors;
    uint64_t num_records; /* bridge_pinned_record calls */
} bridge_pinned_stats;

int bridge_pinned_get_stats(bridge_pinned_stats *out);

#ifdef __cplusplus
}
#endif
#endif /* BRIDGE_H */
