// SPDX-License-Identifier: Apache-2.0
// null_alloc.c: a trivial allocator for torch's CUDAPluggableAllocator, with
// no driver call per event (bench_trace.py's "null-pluggable" configuration).
//
// It serves blocks out of one region taken once at setup (the benchmark gets
// it with cuMemAlloc; the CPU tests pass a malloc'd buffer: nothing here
// reads or writes the region).  A request is rounded up to 512 B (0 B counts
// as 512, so every block has its own address: torch keys its map by pointer);
// a freed block goes onto a LIFO list of its rounded size, and an allocation
// takes the newest block of its size or, when there is none, bumps a pointer.
// The bump pointer never goes back: its high-water mark is the memory held
// ("reserved"), equal to the sum over sizes of the most blocks of that size
// live at once.  Streams are ignored (a block freed on one stream may be
// handed out on another): fine for a replay that never touches the memory,
// not for real kernels.  One mutex guards everything.
//
// When the region is exhausted null_alloc returns NULL.  torch's pluggable
// path does not check the pointer it is given (a NULL would become a tensor
// without memory and collide in torch's pointer map), so the benchmark calls
// null_init with abort_on_exhaustion = 1: the allocation then prints why on
// stderr and aborts the process.
//
// The entry points have the types torch casts them to (see
// bridge/_native/torch_abi.cpp): alloc(size_t, int, cudaStream_t),
// free(void *, size_t, int, cudaStream_t).
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NULL_ALIGN   512u
#define NULL_CLASSES (1u << 14) /* distinct rounded sizes kept (open addressing) */

typedef struct {
    uint64_t size;    /* rounded size; 0 = empty entry */
    uintptr_t *items; /* freed blocks of this size, newest last */
    uint32_t n, cap;
} size_class;

/* The order of null_get_stats's values (bench_trace.NULL_STATS names them). */
enum {
    ST_REGION,     /* bytes in the region */
    ST_HIGH_WATER, /* the bump pointer's offset: bytes ever handed out */
    ST_ALLOCS,     /* allocations served */
    ST_BUMPS,      /* ... of them by the bump pointer */
    ST_REUSES,     /* ... of them from a size's free list */
    ST_FREES,      /* frees of a block of the region */
    ST_FAILED,     /* allocations refused (region exhausted) */
    ST_DROPPED,    /* freed blocks not kept (no room for their size): never reused */
    ST_FOREIGN,    /* frees of a pointer outside the region (ignored) */
    ST_LIVE,       /* bytes handed out and not freed (rounded) */
    ST_PEAK_LIVE,  /* the most of ST_LIVE at once */
    ST_CLASSES,    /* distinct rounded sizes seen */
    ST_COUNT
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static uintptr_t base;
static uint64_t region, bump;
static int abort_on_exhaustion;
static uint64_t stats[ST_COUNT];
static size_class classes[NULL_CLASSES];

/* Round up to the alignment; 0 for a size too large to round. */
static uint64_t rounded(size_t size)
{
    if (size == 0)
        return NULL_ALIGN;
    if (size > UINT64_MAX - (NULL_ALIGN - 1))
        return 0;
    return ((uint64_t)size + (NULL_ALIGN - 1)) & ~(uint64_t)(NULL_ALIGN - 1);
}

/* The class of `size` (created when `insert`), or NULL. */
static size_class *find(uint64_t size, int insert)
{
    uint64_t h = (size / NULL_ALIGN) * 0x9E3779B97F4A7C15ull;
    for (uint32_t i = 0; i < NULL_CLASSES; i++) {
        size_class *c = &classes[(h + i) & (NULL_CLASSES - 1)];
        if (c->size == size)
            return c;
        if (c->size == 0) {
            if (!insert || stats[ST_CLASSES] >= NULL_CLASSES / 2)
                return NULL;
            c->size = size;
            stats[ST_CLASSES]++;
            return c;
        }
    }
    return NULL;
}

/* Forget every block and size; serve [base, base + size) from now on.
 * Returns 0, or -1 for an empty region. */
int null_init(uintptr_t region_base, uint64_t region_size, int abort_when_exhausted)
{
    if (!region_base || !region_size)
        return -1;
    pthread_mutex_lock(&lock);
    for (uint32_t i = 0; i < NULL_CLASSES; i++)
        free(classes[i].items);
    memset(classes, 0, sizeof classes);
    memset(stats, 0, sizeof stats);
    base = region_base;
    region = region_size;
    bump = 0;
    abort_on_exhaustion = abort_when_exhausted;
    stats[ST_REGION] = region_size;
    pthread_mutex_unlock(&lock);
    return 0;
}

void *null_alloc(size_t size, int device, void *stream)
{
    (void)device;
    (void)stream;
    uint64_t r = rounded(size);
    uintptr_t p = 0;
    pthread_mutex_lock(&lock);
    size_class *c = r ? find(r, 1) : NULL;
    if (c && c->n) {
        p = c->items[--c->n];
        stats[ST_REUSES]++;
    } else if (r && base && r <= region - bump) {
        p = base + bump;
        bump += r;
        stats[ST_HIGH_WATER] = bump;
        stats[ST_BUMPS]++;
    }
    if (p) {
        stats[ST_ALLOCS]++;
        stats[ST_LIVE] += r;
        if (stats[ST_LIVE] > stats[ST_PEAK_LIVE])
            stats[ST_PEAK_LIVE] = stats[ST_LIVE];
    } else {
        stats[ST_FAILED]++;
    }
    uint64_t held = bump, total = region;
    pthread_mutex_unlock(&lock);
    if (!p && abort_on_exhaustion) {
        fprintf(stderr,
                "null_alloc: region exhausted: %zu bytes asked, %llu of %llu bytes "
                "handed out and none of this size free (raise the region size)\n",
                size, (unsigned long long)held, (unsigned long long)total);
        fflush(stderr);
        abort();
    }
    return (void *)p;
}

void null_free(void *ptr, size_t size, int device, void *stream)
{
    (void)device;
    (void)stream;
    if (!ptr)
        return;
    uintptr_t p = (uintptr_t)ptr;
    uint64_t r = rounded(size);
    pthread_mutex_lock(&lock);
    if (p < base || p - base >= bump || !r) {
        stats[ST_FOREIGN]++;
        pthread_mutex_unlock(&lock);
        return;
    }
    stats[ST_FREES]++;
    stats[ST_LIVE] -= r <= stats[ST_LIVE] ? r : stats[ST_LIVE];
    size_class *c = find(r, 1);
    if (c && c->n == c->cap) {
        uint32_t cap = c->cap ? 2 * c->cap : 16;
        uintptr_t *items = realloc(c->items, cap * sizeof *items);
        if (items) {
            c->items = items;
            c->cap = cap;
        }
    }
    if (c && c->n < c->cap)
        c->items[c->n++] = p;
    else
        stats[ST_DROPPED]++;
    pthread_mutex_unlock(&lock);
}

/* Copy the first n counters (ST_ order) into out; returns how many there are. */
int null_get_stats(uint64_t *out, int n)
{
    pthread_mutex_lock(&lock);
    for (int i = 0; i < n && i < ST_COUNT; i++)
        out[i] = stats[i];
    pthread_mutex_unlock(&lock);
    return ST_COUNT;
}
