/* SPDX-License-Identifier: Apache-2.0 */
/* bench_tables.c: the core's two hash tables on keys real programs make.
 *
 * records.c (live allocations, keyed by pointer) and cache.c (freed blocks,
 * keyed by stream and size), timed on the CPU with no driver:
 *   - records: N live pointers at a 512 B stride and at a 64 MiB stride
 *     (pool pointers of large blocks are 2 MiB-aligned or more), insert all,
 *     then take all; ns per operation;
 *   - cache: put then take K blocks of K different sizes, odd sizes and sizes
 *     that are multiples of 1 MiB, on one stream; ns per put+take pair.
 * Before the tables indexed with the high bits of their hash, aligned keys
 * piled onto a few slots (13.8 us per record operation at a 64 MiB stride
 * with 1 M live blocks, 600 ns per cache pair for 1,000 sizes in MiB).
 *
 *   python benchmarks/bench_tables.py     (builds and runs this file)
 */
#define _POSIX_C_SOURCE 199309L
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "bridge.h"
#include "cache.h"
#include "records.h"

static double now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static void bench_records(const char *name, uint64_t n, uint64_t stride)
{
    uint64_t base = 0x7f0000000000ull;
    double t0 = now_ns();
    for (uint64_t i = 0; i < n; i++) {
        record r = {.ptr = base + i * stride, .size = stride};
        if (records_insert(&r) != 0) {
            fprintf(stderr, "insert failed\n");
            exit(1);
        }
    }
    double t1 = now_ns();
    for (uint64_t i = 0; i < n; i++) {
        record out;
        if (records_take(base + i * stride, &out, NULL) != 0) {
            fprintf(stderr, "take failed\n");
            exit(1);
        }
    }
    double t2 = now_ns();
    printf("{\"table\": \"records\", \"case\": \"%s\", \"n\": %" PRIu64
           ", \"insert_ns\": %.1f, \"take_ns\": %.1f}\n",
           name, n, (t1 - t0) / (double)n, (t2 - t1) / (double)n);
}

/* cache_take of this tree (which also tells whether the block kept its
 * record) or of a revision before it */
static uintptr_t take(CUstream s, uint64_t size)
{
#ifdef HAVE_PARK
    int kept;
    return cache_take(0, s, size, &kept);
#else
    return cache_take(0, s, size);
#endif
}

/* cache_put of this tree (a cap that follows live bytes, evictions handed
 * back) or of a revision before it */
static int put(CUstream s, uint64_t size, uintptr_t ptr)
{
#ifdef BRIDGE_CACHE_EVICT_MAX
    cache_block evicted[BRIDGE_CACHE_EVICT_MAX];
    int n;
    int kept = cache_put(0, s, size, ptr, 1ull << 62, evicted, &n);
    return kept && !n;
#else
    return cache_put(0, s, size, ptr);
#endif
}

static void bench_cache(const char *name, uint64_t k, uint64_t unit, uint64_t odd, int rounds)
{
    cache_set_limits(0, 1ull << 62, 1ull << 62);
#ifdef BRIDGE_CACHE_LARGE_CAP
    cache_set_tiers(0, BRIDGE_CACHE_SMALL_MAX, 1ull << 62); /* the large tier unbounded too */
#endif
    CUstream s = (CUstream)(uintptr_t)0x7f00001000ull;
    double best = 1e30;
    for (int r = 0; r < rounds; r++) {
        double t0 = now_ns();
        for (uint64_t i = 0; i < k; i++)
            if (!put(s, (i + 1) * unit + odd, 0x1000 * (i + 1))) {
                fprintf(stderr, "put refused at %" PRIu64 "\n", i);
                exit(1);
            }
        for (uint64_t i = 0; i < k; i++)
            if (!take(s, (i + 1) * unit + odd)) {
                fprintf(stderr, "take missed at %" PRIu64 "\n", i);
                exit(1);
            }
        double dt = (now_ns() - t0) / (double)k;
        best = dt < best ? dt : best;
    }
    printf("{\"table\": \"cache\", \"case\": \"%s\", \"sizes\": %" PRIu64 ", \"pair_ns\": %.1f}\n",
           name, k, best);
}

int main(int argc, char **argv)
{
    uint64_t n = argc > 1 ? strtoull(argv[1], NULL, 10) : 1000000;
    bench_records("512 B stride", n, 512);
    bench_records("64 MiB stride", n, 64ull << 20);
    bench_cache("odd sizes", 1000, 4096, 7, 20);
    bench_cache("multiples of 1 MiB", 1000, 1ull << 20, 0, 20);
    return 0;
}
