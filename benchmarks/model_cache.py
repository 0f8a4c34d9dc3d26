# SPDX-License-Identifier: Apache-2.0
"""A model of the cache of freed blocks over the driver's pool, judged on the traces (CPU).

    python benchmarks/model_cache.py [TRACES...]      (default: benchmarks/traces/*.json.gz)

Replays each trace (five passes, as ``bench_trace.py`` does) against a model of the
default pool and a cache policy, and prints the share of allocations the cache serves
(exact: it depends only on the trace and the policy) and the pool's peak reserved / peak
live (a model: see ``Pool``). Policies:

- ``none``: every free goes back to the pool;
- ``old``: the first cache, exact size per key, at most 16 blocks a key, 2% of a 141 GB
  card, never evicting;
- ``lru``: the cache of 2026-11-30, least recently cached evicted first under
  max(64 MiB, live / 16);
- ``tiers``: blocks up to 1 MiB under that cap, larger ones in their own
  least-recently-cached order under a fixed 64 MiB (a proposal, not built in main).

Every policy keeps at most 16 blocks a key, as the cache does; ``tiers`` is also shown
with 64 (GPT-2 keeps more than 16 blocks of one size alive at once).

The pool model: memory is mapped in 32 MiB chunks (measured on the H200:
``scripts/pool_growth_probe.py``) and never unmapped (the bridge's release threshold);
requests of at most 1 MiB and larger ones are placed in separate heaps, each best fit
over coalesced free ranges. Checked against the H200's replays: GPT-2 none / old / lru
1.015 / 1.422 / 1.027 against 1.008 / 1.464 / 1.027 measured; ResNet-50 1.019 / 1.459 /
1.113 against 1.060 / 1.511 / 1.189: it ranks the policies as the GPU did and
underestimates ResNet-50 by 0.04 to 0.08.
"""

from __future__ import annotations

import bisect
import glob
import gzip
import json
import os
import sys
from collections import OrderedDict, defaultdict

MIB = 1 << 20
CHUNK = 32 * MIB
HERE = os.path.dirname(os.path.abspath(__file__))


class Heap:
    """Memory mapped in CHUNK steps; best fit over coalesced free ranges."""

    def __init__(self) -> None:
        self.free: list[tuple[int, int]] = []  # (start, size), sorted by start
        self.top = 0  # bytes mapped

    def alloc(self, n: int) -> tuple[int, int]:
        n = -(-n // 512) * 512
        fits = [(z, i) for i, (_, z) in enumerate(self.free) if z >= n]
        if fits:
            _, i = min(fits)
            s, z = self.free.pop(i)
            if z > n:
                self.free.insert(i, (s + n, z - n))
            return s, n
        if self.free and sum(self.free[-1]) == self.top:  # grow the last free range
            s, z = self.free.pop()
        else:
            s, z = self.top, 0
        self.top += -(-(n - z) // CHUNK) * CHUNK
        if self.top > s + n:
            self.free.append((s + n, self.top - s - n))
        return s, n

    def release(self, s: int, n: int) -> None:
        i = bisect.bisect(self.free, (s, 0))
        if i and sum(self.free[i - 1]) == s:
            ps, pz = self.free.pop(i - 1)
            i, s, n = i - 1, ps, pz + n
        if i < len(self.free) and s + n == self.free[i][0]:
            n += self.free.pop(i)[1]
        self.free.insert(i, (s, n))


class Pool:
    """Small requests (<= 1 MiB) and larger ones in separate heaps."""

    def __init__(self) -> None:
        self.heaps = (Heap(), Heap())

    def reserved(self) -> int:
        return sum(h.top for h in self.heaps)

    def alloc(self, n: int) -> tuple[int, int, int]:
        k = int(n > MIB)
        return (k, *self.heaps[k].alloc(n))

    def release(self, block: tuple[int, int, int]) -> None:
        self.heaps[block[0]].release(block[1], block[2])


def cap_rule(policy: str, tier: int, live: int) -> int:
    """The cap of a tier's cached bytes (tier 1: blocks above 1 MiB, under `tiers`)."""
    if policy == "old":
        return 141 * 10**9 // 50
    if policy == "tiers" and tier == 1:
        return 64 * MIB
    return max(64 * MIB, live // 16)


def replay(events: list, policy: str, passes: int = 5, depth: int = 16) -> dict:
    pool = Pool()
    order: list[OrderedDict] = [OrderedDict(), OrderedDict()]  # per tier: id -> (block, size)
    cached = [0, 0]
    keys: dict[int, list] = defaultdict(list)  # size -> [(tier, id)], newest last
    live: dict[int, tuple] = {}
    live_bytes = peak_live = hits = allocs = serial = 0
    for _ in range(passes):
        for e in events:
            if e[0] == 0:
                size = e[2]
                allocs += 1
                if keys[size]:
                    t, i = keys[size].pop()
                    block = order[t].pop(i)[0]
                    cached[t] -= size
                    hits += 1
                else:
                    block = pool.alloc(size)
                live[e[1]] = (block, size)
                live_bytes += size
                peak_live = max(peak_live, live_bytes)
                continue
            block, size = live.pop(e[1])
            live_bytes -= size
            t = int(policy == "tiers" and size > MIB)
            cap = cap_rule(policy, t, live_bytes)
            if policy == "none" or size > 256 * MIB or size > cap or len(keys[size]) >= depth:
                pool.release(block)
                continue
            if policy == "old" and cached[t] + size > cap:
                pool.release(block)
                continue
            serial += 1
            order[t][serial] = (block, size)
            keys[size].append((t, serial))
            cached[t] += size
            while cached[t] > cap:
                i, (old, osize) = order[t].popitem(last=False)
                keys[osize].remove((t, i))
                cached[t] -= osize
                pool.release(old)
        for block, _ in live.values():
            pool.release(block)
        live.clear()
        live_bytes = 0
    return {"hits": hits / allocs, "reserved_over_live": pool.reserved() / peak_live}


def main(paths: list[str]) -> None:
    paths = paths or sorted(glob.glob(os.path.join(HERE, "traces", "*.json.gz")))
    print(f"{'trace':<10} {'policy':<34} {'cache hits':>10} {'reserved / live':>16}")
    for path in paths:
        with gzip.open(path) as f:
            trace = json.load(f)
        for policy, depth in (("none", 16), ("old", 16), ("lru", 16), ("tiers", 16), ("tiers", 64)):
            r = replay(trace["events"], policy, depth=depth)
            name = policy + ("" if depth == 16 else f" (at most {depth} blocks a key)")
            print(
                f"{trace['name']:<10} {name:<34} {r['hits']:>10.2f} "
                f"{r['reserved_over_live']:>16.3f}"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
