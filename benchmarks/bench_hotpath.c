/* SPDX-License-Identifier: Apache-2.0 */
/* bench_hotpath.c: the core's allocation hot path on the CPU, no GPU.
 *
 * bridge_alloc + bridge_free pairs through the C API on the stand-in driver
 * (tests/standin), for the paths that take no driver call: a block of the
 * same size freed on the same stream is served by the cache.  Streams: the
 * legacy default stream (handle 0), the per-thread default stream (handle 2)
 * and, where the core has the call, a stream registered as long-lived.  Where
 * the core has bridge_free_cached, also the cache-only pair
 * (bridge_alloc_cached + bridge_free_cached); where it has segments, a block
 * carved from a segment and given back (and, with the cache-only calls, parked
 * in the thread's slot: -1 where the core has no such slot and the pair
 * misses).  Best of several loops, ns per pair.
 *
 *   python benchmarks/bench_hotpath.py [--rev GITREV ...]
 */
#define _POSIX_C_SOURCE 199309L
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "bridge.h"

static double now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

/* cached: the cache-only calls (bridge_alloc_cached + bridge_free_cached,
 * as the CuPy allocator and its blocks make them with the GIL held) */
static double pairs(void *stream, size_t size, int n, int loops, int cached)
{
    double best = 1e30;
    void *p = NULL;
    bridge_alloc(0, size, stream, BRIDGE_TAG_TORCH, &p); /* warm: one block cached */
    bridge_free(p);
    for (int l = 0; l < loops; l++) {
        double t0 = now_ns();
        for (int i = 0; i < n; i++) {
#ifdef HAVE_FREE_CACHED
            if (cached) {
                if (bridge_alloc_cached(0, size, stream, BRIDGE_TAG_TORCH, &p) != BRIDGE_OK ||
                    bridge_free_cached(p) != BRIDGE_OK) {
                    if (cached == 2) /* segments: a core with no slot for carved blocks */
                        return -1.0;
                    fprintf(stderr, "cache-only pair missed\n");
                    exit(1);
                }
                continue;
            }
#endif
            if (bridge_alloc(0, size, stream, BRIDGE_TAG_TORCH, &p) != BRIDGE_OK) {
                fprintf(stderr, "alloc failed\n");
                exit(1);
            }
            bridge_free(p);
        }
        double dt = (now_ns() - t0) / n;
        best = dt < best ? dt : best;
    }
    return best;
}

int main(int argc, char **argv)
{
    if (argc < 2 || bridge_init(argv[1]) != BRIDGE_OK ||
        bridge_device_setup(0, ~0ull) != BRIDGE_OK) {
        fprintf(stderr, "usage: bench_hotpath STANDIN_LIBRARY\n");
        return 2;
    }
    bridge_set_cache(0, 1ull << 30, 256ull << 20);
    int n = 200000, loops = 15;
    printf("{\"path\": \"cache hit, legacy stream\", \"pair_ns\": %.1f}\n",
           pairs(NULL, 1 << 20, n, loops, 0));
    printf("{\"path\": \"cache hit, per-thread stream\", \"pair_ns\": %.1f}\n",
           pairs((void *)(uintptr_t)2, 1 << 20, n, loops, 0));
#ifdef HAVE_REGISTER
    bridge_register_stream((void *)(uintptr_t)0x5000);
    printf("{\"path\": \"cache hit, registered stream\", \"pair_ns\": %.1f}\n",
           pairs((void *)(uintptr_t)0x5000, 1 << 20, n, loops, 0));
#endif
#ifdef HAVE_FREE_CACHED
    printf("{\"path\": \"cache-only calls, legacy stream\", \"pair_ns\": %.1f}\n",
           pairs(NULL, 1 << 20, n, loops, 1));
    printf("{\"path\": \"cache-only calls, per-thread stream\", \"pair_ns\": %.1f}\n",
           pairs((void *)(uintptr_t)2, 1 << 20, n, loops, 1));
#endif
#ifdef HAVE_SEGMENTS
    /* segments (BRIDGE_CACHE_SEGMENTS=1): the tiers emptied first, so each pair is
     * carved from a segment and given back to it */
    bridge_set_cache(0, 0, 0);
    bridge_set_cache(0, 1ull << 30, 256ull << 20);
    bridge_set_cache_segments(0, 1);
    printf("{\"path\": \"segments hit, legacy stream\", \"pair_ns\": %.1f}\n",
           pairs(NULL, 1 << 20, n, loops, 0));
    printf("{\"path\": \"segments hit, per-thread stream\", \"pair_ns\": %.1f}\n",
           pairs((void *)(uintptr_t)2, 1 << 20, n, loops, 0));
    printf("{\"path\": \"segments hit, 64 MiB, legacy stream\", \"pair_ns\": %.1f}\n",
           pairs(NULL, 64 << 20, n, loops, 0));
#ifdef HAVE_FREE_CACHED
    /* CuPy's calls: a carved block its thread allocated last, parked at the free
     * (where the core has the segments' thread slot; else the pair misses) */
    printf("{\"path\": \"segments, cache-only calls, legacy stream\", \"pair_ns\": %.1f}\n",
           pairs(NULL, 1 << 20, n, loops, 2));
#endif
#endif
    return 0;
}
