# SPDX-License-Identifier: Apache-2.0
"""How much does the driver's default pool grow per allocation? (GPU diagnostic)

    python scripts/pool_growth_probe.py [seconds]

The share (unify(share=...)) claims, for each allocation in flight, its size
rounded up to 2 MiB, assuming the pool grows by no more.  This probe allocates
from the default pool with the release threshold at its maximum (as the bridge
sets it) and prints, per case, the largest growth of RESERVED_MEM_CURRENT over
the request rounded to 2 MiB: single sizes, then random sizes allocated and
freed on two streams (frees in flight on one stream, allocations on another).
"""

from __future__ import annotations

import json
import random
import sys
import time

from cuda.bindings import driver as cu

MIB = 1 << 20


def check(r):
    err = r[0] if isinstance(r, tuple) else r
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(err)
    return r[1] if isinstance(r, tuple) and len(r) == 2 else r


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    check(cu.cuInit(0))
    dev = check(cu.cuDeviceGet(0))
    ctx = check(cu.cuDevicePrimaryCtxRetain(dev))
    check(cu.cuCtxSetCurrent(ctx))
    pool = check(cu.cuDeviceGetDefaultMemPool(dev))
    thr = cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
    check(cu.cuMemPoolSetAttribute(pool, thr, cu.cuuint64_t(2**64 - 1)))
    res = cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT

    def reserved() -> int:
        return int(check(cu.cuMemPoolGetAttribute(pool, res)))

    def unit(n: int) -> int:
        return -(-n // (2 * MIB)) * 2 * MIB

    s1 = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
    s2 = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
    out: dict = {"single": []}
    for size in (
        512,
        4096,
        MIB,
        2 * MIB + 1,
        3 * MIB,
        17 * MIB,
        33 * MIB,
        65 * MIB,
        100 * MIB,
        257 * MIB,
        1024 * MIB + 4096,
    ):
        check(cu.cuMemPoolTrimTo(pool, 0))
        r0 = reserved()
        p = check(cu.cuMemAllocFromPoolAsync(size, pool, s1))
        g = reserved() - r0
        out["single"].append([size, g, g - unit(size)])
        check(cu.cuMemFreeAsync(p, s1))
        check(cu.cuStreamSynchronize(s1))
    # random sizes, 64 MiB - 1.5 GiB in MiB (as the share test), on two streams
    rng = random.Random(0)
    held: list = []
    worst, n, over = 0, 0, 0
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        if held and (len(held) > 8 or rng.random() < 0.45):
            p, s = held.pop(rng.randrange(len(held)))
            check(cu.cuMemFreeAsync(p, s))
            continue
        size = rng.randrange(64 * MIB, 1536 * MIB + 1) // MIB * MIB
        s = s1 if rng.random() < 0.5 else s2
        r0 = reserved()
        p = check(cu.cuMemAllocFromPoolAsync(size, pool, s))
        g = reserved() - r0 - unit(size)
        n += 1
        if g > 0:
            over += 1
            worst = max(worst, g)
        held.append((p, s))
        if rng.random() < 0.1:
            check(cu.cuMemPoolTrimTo(pool, rng.choice([0, 4 << 30])))
    for p, s in held:
        check(cu.cuMemFreeAsync(p, s))
    check(cu.cuCtxSynchronize())
    out["random"] = {"allocs": n, "grew_past_unit": over, "worst_bytes_past_unit": worst}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
