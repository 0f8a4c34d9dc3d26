# SPDX-License-Identifier: Apache-2.0
"""The compiled core's ledger, on the stand-in driver (bridge._runtime.core).

Every figure asserted here is one a user relies on: bytes per framework,
statuses, what the budget lets through, what the driver was asked to do.
The core is process-global: tests compare against figures read at their
start, free what they allocate, and undo what they add to the stand-in.
"""

from __future__ import annotations

import ctypes
import sys
import threading

import pytest

from bridge._errors import Status
from bridge._runtime import core

DEV = 0
MIB = 1 << 20
GIB = 1 << 30
TAG_OTHER, TAG_CUPY, TAG_TORCH = core.TAG_OTHER, core.TAG_CUPY, core.TAG_TORCH
# Stream handles: the stand-in never dereferences them, it only compares them.
S1, S2, S3 = 0xA1000, 0xA2000, 0xA3000
# stand-in counters (standin_counter)
C_ALLOC, C_FREE, C_SYNC, C_WAIT, C_RECORD, C_SETCTX, C_TRIM, C_MODE = range(8)
GRAPH_BEGIN, GRAPH_END, GRAPH_RELEASE = 0, 1, 2


def stats(dev: int = DEV) -> dict:
    rc, s = core.stats(dev)
    assert rc == Status.OK
    return s


def others(dev: int = DEV) -> int:
    rc, n = core.others(dev)
    assert rc == Status.OK
    return n


class Ledger:
    """Allocations of one test: freed at teardown if the test did not."""

    def __init__(self, standin):
        self.sd = standin
        self.live: set[int] = set()
        self.foreign: dict[int, int] = {}
        self.graphs: list[tuple[int, int, int]] = []

    def alloc(self, size, stream=S1, tag=TAG_CUPY, dev=DEV):
        rc, p = core.alloc(dev, size, stream, tag)
        if rc == Status.OK and p:
            self.live.add(p)
        return rc, p

    def ok(self, size, stream=S1, tag=TAG_CUPY, dev=DEV) -> int:
        rc, p = self.alloc(size, stream, tag, dev)
        assert rc == Status.OK, Status(rc).name
        assert p != 0
        return p

    def free(self, p):
        core.free(p)
        self.live.discard(p)

    def add_foreign(self, dev, n):
        self.sd.standin_add_foreign(dev, n)
        self.foreign[dev] = self.foreign.get(dev, 0) + n

    def graph(self, op, dev, id0, id1):
        if op == GRAPH_BEGIN:
            self.graphs.append((dev, id0, id1))
        return core.graph(op, dev, id0, id1)

    def counter(self, which) -> int:
        return self.sd.standin_counter(which)

    def close(self):
        self.sd.standin_set_capturing(None)
        for dev, id0, id1 in self.graphs:
            core.graph(GRAPH_END, dev, id0, id1)
            core.graph(GRAPH_RELEASE, dev, id0, id1)
        for p in list(self.live):
            core.free(p)
        for dev in (0, 1):  # complete frees deferred by a capture
            rc, p = core.alloc(dev, 1, S1, TAG_OTHER)
            core.free(p)
        for dev, n in self.foreign.items():
            self.sd.standin_add_foreign(dev, -n)
        for dev in (0, 1):
            self.sd.standin_sync_all(dev)


@pytest.fixture
def led(standin):
    standin.standin_adopt_stream.argtypes = [ctypes.c_void_p, ctypes.c_int]
    for s_ in (S1, S2, S3):  # made-up handles the driver should know as streams
        standin.standin_adopt_stream(s_, DEV)
    led = Ledger(standin)
    live_before = core.live_records()
    yield led
    led.close()
    # whatever a test did, the core ends it holding nothing
    assert core.live_records() == live_before
    for dev in (0, 1):
        s = stats(dev)
        assert s["used"] == 0, f"device {dev}: {s['used']} bytes still counted"
        assert s["num_deferred"] == 0 and s["graph_bytes"] == 0
        assert [t["current"] for t in s["tags"]] == [0, 0, 0]


# ---- exact figures ----
def test_figures_are_exact_per_tag(led):
    s0 = stats()
    pc = led.ok(1000, tag=TAG_CUPY)
    pt = led.ok(3000, tag=TAG_TORCH)
    po = led.ok(500, tag=TAG_OTHER)
    s = stats()
    assert s["used"] == 4500
    assert s["pool_used"] == s0["pool_used"] + 4500
    assert [t["current"] for t in s["tags"]] == [500, 1000, 3000]
    assert [t["peak"] for t in s["tags"]] == [500, 1000, 3000]
    assert s["peak_used"] == 4500
    assert s["num_allocs"] == s0["num_allocs"] + 3
    for i, n in enumerate((500, 1000, 3000)):
        assert s["tags"][i]["allocated"] == s0["tags"][i]["allocated"] + n
        assert s["tags"][i]["num_allocs"] == s0["tags"][i]["num_allocs"] + 1
    assert others() == 0
    assert core.lookup(pc) == (Status.OK, 1000, DEV, TAG_CUPY)
    assert core.lookup(pt) == (Status.OK, 3000, DEV, TAG_TORCH)
    assert core.lookup(po) == (Status.OK, 500, DEV, TAG_OTHER)

    led.free(pt)
    s = stats()
    assert s["used"] == 1500
    assert [t["current"] for t in s["tags"]] == [500, 1000, 0]
    assert s["tags"][TAG_TORCH]["peak"] == 3000
    assert s["tags"][TAG_TORCH]["freed"] == s0["tags"][TAG_TORCH]["freed"] + 3000
    assert s["tags"][TAG_TORCH]["num_frees"] == s0["tags"][TAG_TORCH]["num_frees"] + 1
    assert s["num_frees"] == s0["num_frees"] + 1
    assert s["peak_used"] == 4500
    assert core.lookup(pt)[0] == Status.INVALID
    # the free is queued on its stream: the pool still holds the bytes, and
    # until the stream gets there they count as held by someone else
    assert led.sd.standin_pending_bytes(DEV) == 3000
    assert others() == 3000
    led.sd.standin_sync_all(DEV)
    assert others() == 0
    assert stats()["pool_used"] == s0["pool_used"] + 1500

    led.free(pc)
    led.free(po)
    s = stats()
    assert s["used"] == 0
    assert [t["current"] for t in s["tags"]] == [0, 0, 0]
    assert s["num_frees"] == s0["num_frees"] + 3


def test_addresses_are_distinct_and_live_records_counted(led):
    n0 = core.live_records()
    ptrs = [led.ok(4096 + i) for i in range(100)]
    assert len(set(ptrs)) == 100
    assert core.live_records() == n0 + 100
    assert stats()["used"] == sum(4096 + i for i in range(100))
    for p in ptrs:
        led.free(p)
    assert core.live_records() == n0


def test_devices_are_accounted_separately(led):
    p1 = led.ok(7 * MIB, dev=1, tag=TAG_TORCH)
    assert core.lookup(p1) == (Status.OK, 7 * MIB, 1, TAG_TORCH)
    assert stats(1)["used"] == 7 * MIB
    assert stats(0)["used"] == 0
    assert core.set_limit(0, MIB) == Status.OK
    p2 = led.ok(2 * MIB, dev=1)  # device 0's budget does not apply to device 1
    assert stats(1)["used"] == 9 * MIB
    led.free(p1)
    led.free(p2)


def test_block_frees_itself_when_dropped(led):
    s0 = stats()
    rc, block = core.alloc_block(DEV, 3 * MIB, S1, TAG_CUPY)
    assert rc == Status.OK
    assert (block.size, block.device) == (3 * MIB, DEV)
    assert core.lookup(block.ptr) == (Status.OK, 3 * MIB, DEV, TAG_CUPY)
    assert stats()["tags"][TAG_CUPY]["current"] == 3 * MIB
    del block
    s = stats()
    assert s["used"] == 0 and s["tags"][TAG_CUPY]["current"] == 0
    assert s["num_frees"] == s0["num_frees"] + 1


def test_alloc_block_refused_gives_none(led):
    core.set_limit(DEV, MIB)
    rc, block = core.alloc_block(DEV, MIB + 1, S1, TAG_CUPY)
    assert (rc, block) == (Status.BUDGET, None)
    with pytest.raises(ValueError):
        core.alloc_block(DEV, -1, S1, TAG_CUPY)


# ---- the budget ----
def test_exactly_at_the_limit_passes_one_byte_over_is_refused(led):
    core.set_limit(DEV, 64 * MIB)
    s0 = stats()
    live0 = led.sd.standin_live_count()
    rc, p = led.alloc(64 * MIB + 1)
    assert (rc, p) == (Status.BUDGET, 0)
    s = stats()
    # nothing leaks on refusal: no bytes counted, no block in the driver
    assert s["used"] == 0 and s["tags"][TAG_CUPY]["current"] == 0
    assert s["pool_used"] == s0["pool_used"]
    assert led.sd.standin_live_count() == live0
    assert s["num_ooms"] == s0["num_ooms"] + 1
    assert s["tags"][TAG_CUPY]["num_ooms"] == s0["tags"][TAG_CUPY]["num_ooms"] + 1
    assert s["num_allocs"] == s0["num_allocs"]

    p = led.ok(64 * MIB)
    assert stats()["used"] == 64 * MIB
    assert led.alloc(1) == (Status.BUDGET, 0)
    assert stats()["used"] == 64 * MIB
    led.free(p)
    assert stats()["used"] == 0


def test_budget_counts_every_tag_together(led):
    core.set_limit(DEV, 10 * MIB)
    a = led.ok(4 * MIB, tag=TAG_CUPY)
    b = led.ok(4 * MIB, tag=TAG_TORCH)
    assert led.alloc(2 * MIB + 1, tag=TAG_OTHER) == (Status.BUDGET, 0)
    c = led.ok(2 * MIB, tag=TAG_OTHER)
    assert stats()["used"] == 10 * MIB
    for p in (a, b, c):
        led.free(p)


def test_tag_limit_caps_one_framework_only(led):
    assert core.set_tag_limit(DEV, TAG_TORCH, 3 * MIB) == Status.OK
    assert stats()["tags"][TAG_TORCH]["limit"] == 3 * MIB
    t = led.ok(3 * MIB, tag=TAG_TORCH)
    assert led.alloc(1, tag=TAG_TORCH) == (Status.TAG_LIMIT, 0)
    c = led.ok(10 * MIB, tag=TAG_CUPY)  # other frameworks are not capped
    s = stats()
    assert s["tags"][TAG_TORCH]["current"] == 3 * MIB and s["used"] == 13 * MIB
    assert core.set_tag_limit(DEV, 3, MIB) == Status.INVALID
    assert core.set_tag_limit(DEV, -1, MIB) == Status.INVALID
    led.free(t)
    led.free(c)


def test_others_bytes_in_the_pool_count_against_the_budget(led):
    core.set_limit(DEV, 100 * MIB)
    led.add_foreign(DEV, 30 * MIB)  # JAX holds 30 MiB of the same pool
    assert others() == 30 * MIB
    assert led.alloc(70 * MIB + 1) == (Status.BUDGET, 0)
    p = led.ok(70 * MIB)
    assert others() == 30 * MIB  # the ledger's own bytes are not "others"
    assert led.alloc(1) == (Status.BUDGET, 0)
    # JAX lets go of 10 MiB: 10 MiB more fit, not one byte more
    led.add_foreign(DEV, -10 * MIB)
    assert led.alloc(10 * MIB + 1) == (Status.BUDGET, 0)
    q = led.ok(10 * MIB)
    led.free(p)
    led.free(q)


def test_others_above_the_budget_refuses_everything(led):
    core.set_limit(DEV, 10 * MIB)
    led.add_foreign(DEV, 20 * MIB)
    assert led.alloc(1) == (Status.BUDGET, 0)
    assert stats()["used"] == 0


def test_lowering_the_limit_below_usage(led):
    a = led.ok(8 * MIB)
    b = led.ok(8 * MIB)
    assert core.set_limit(DEV, 10 * MIB) == Status.OK
    assert stats()["limit"] == 10 * MIB
    assert led.alloc(1) == (Status.BUDGET, 0)  # 16 MiB in use: nothing new fits
    led.free(a)  # frees still work over the limit
    assert stats()["used"] == 8 * MIB
    led.free(b)
    assert stats()["used"] == 0
    # the queued frees land with the stream sync of the retry
    s0 = stats()
    c = led.ok(10 * MIB)
    assert stats()["num_retries"] == s0["num_retries"] + 1
    assert led.alloc(1) == (Status.BUDGET, 0)
    led.free(c)


def test_raising_and_removing_the_limit(led):
    core.set_limit(DEV, MIB)
    assert led.alloc(2 * MIB) == (Status.BUDGET, 0)
    core.set_limit(DEV, 4 * MIB)
    a = led.ok(2 * MIB)
    core.set_limit(DEV, 0)  # 0 = no limit
    assert stats()["limit"] == 0
    b = led.ok(GIB)
    led.free(a)
    led.free(b)


def test_set_limit_on_a_device_not_set_up():
    assert core.set_limit(7, MIB) == Status.DEVICE
    assert core.set_limit(-1, MIB) == Status.DEVICE
    assert core.set_tag_limit(7, 0, MIB) == Status.DEVICE


def test_eight_threads_at_the_budget_edge(led):
    """Concurrent allocations never let the ledger pass the budget."""
    size = 3 * MIB
    limit = 4 * size + MIB  # 4 blocks fit, a fifth does not
    core.set_limit(DEV, limit)
    core.reset_peak(DEV, -1)
    s0 = stats()
    nthreads, rounds = 8, 300
    barrier = threading.Barrier(nthreads)
    results: list[dict] = [{} for _ in range(nthreads)]
    errors: list[BaseException] = []

    def worker(i):
        counts = {"ok": 0, "budget": 0, "other": 0}
        stream = S1 + 0x100 * i if i % 2 else 0  # half on the legacy stream
        try:
            barrier.wait()
            held = []
            for r in range(rounds):
                rc, p = core.alloc(DEV, size, stream, TAG_CUPY if i % 3 else TAG_TORCH)
                if rc == Status.OK:
                    counts["ok"] += 1
                    held.append(p)
                elif rc == Status.BUDGET:
                    counts["budget"] += 1
                else:
                    counts["other"] += 1
                if len(held) >= 2 or (held and r % 2):
                    core.free(held.pop(0))
            for p in held:
                core.free(p)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
        results[i] = counts

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(nthreads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not errors
    ok = sum(r["ok"] for r in results)
    refused = sum(r["budget"] for r in results)
    assert sum(r["other"] for r in results) == 0
    assert ok + refused == nthreads * rounds
    assert ok > 0
    s = stats()
    assert s["peak_used"] <= limit, "the ledger passed the budget"
    assert s["peak_used"] >= size
    # figures return to zero, and agree with what happened
    assert s["used"] == 0
    assert [t["current"] for t in s["tags"]] == [0, 0, 0]
    assert s["num_allocs"] - s0["num_allocs"] == ok
    assert s["num_frees"] - s0["num_frees"] == ok
    assert s["num_ooms"] - s0["num_ooms"] == refused
    pairs = list(zip(s["tags"], s0["tags"], strict=True))
    assert sum(t["allocated"] - t0["allocated"] for t, t0 in pairs) == ok * size
    assert sum(t["freed"] - t0["freed"] for t, t0 in pairs) == ok * size
    led.sd.standin_sync_all(DEV)
    assert others() == 0


def test_threads_without_budget_account_exactly(led):
    s0 = stats()
    nthreads, rounds = 8, 500
    barrier = threading.Barrier(nthreads)
    failures = []

    def worker(i):
        barrier.wait()
        for _ in range(rounds):
            rc, p = core.alloc(DEV, 1000 + i, S1 + i, i % 3)
            if rc != Status.OK:
                failures.append(rc)
                continue
            if core.lookup(p) != (Status.OK, 1000 + i, DEV, i % 3):
                failures.append("lookup")
            core.free(p)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(nthreads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert failures == []
    s = stats()
    assert s["used"] == 0
    assert s["num_allocs"] - s0["num_allocs"] == nthreads * rounds
    assert s["num_frees"] - s0["num_frees"] == nthreads * rounds
    expected = [0, 0, 0]
    for i in range(nthreads):
        expected[i % 3] += rounds * (1000 + i)
    pairs = zip(s["tags"], s0["tags"], strict=True)
    assert [t["allocated"] - t0["allocated"] for t, t0 in pairs] == expected


# ---- out of memory and retries ----
def test_oom_retry_completes_queued_frees_on_the_stream(led):
    led.sd.standin_set_capacity(DEV, 64 * MIB)
    p = led.ok(64 * MIB, stream=S1)
    led.free(p)
    assert led.sd.standin_pending_bytes(DEV) == 64 * MIB  # queued, not completed
    s0 = stats()
    syncs = led.counter(C_SYNC)
    q = led.ok(64 * MIB, stream=S1)
    s = stats()
    assert s["num_retries"] == s0["num_retries"] + 1
    assert s["num_ooms"] == s0["num_ooms"]
    assert led.counter(C_SYNC) > syncs
    assert led.sd.standin_pending_bytes(DEV) == 0
    assert s["used"] == 64 * MIB
    led.free(q)


def test_oom_when_the_memory_is_really_gone(led):
    led.sd.standin_set_capacity(DEV, 64 * MIB)
    p = led.ok(48 * MIB)
    s0 = stats()
    live0 = led.sd.standin_live_count()
    assert led.alloc(32 * MIB) == (Status.OOM, 0)
    s = stats()
    assert s["num_ooms"] == s0["num_ooms"] + 1
    assert s["num_retries"] == s0["num_retries"]
    assert s["used"] == 48 * MIB and s["tags"][TAG_CUPY]["current"] == 48 * MIB
    assert led.sd.standin_live_count() == live0
    led.free(p)


def test_alloc_driver_oom_once_is_retried(led):
    s0 = stats()
    led.sd.standin_fail(b"cuMemAllocFromPoolAsync", 2, 1)
    p = led.ok(MIB)
    s = stats()
    assert s["num_retries"] == s0["num_retries"] + 1
    assert s["used"] == MIB and s["tags"][TAG_CUPY]["current"] == MIB
    led.free(p)


def test_alloc_driver_oom_persisting_fails_cleanly(led):
    s0 = stats()
    live0 = led.sd.standin_live_count()
    led.sd.standin_fail(b"cuMemAllocFromPoolAsync", 2, 5)
    assert led.alloc(MIB) == (Status.OOM, 0)
    s = stats()
    assert s["used"] == 0 and s["tags"][TAG_CUPY]["current"] == 0
    assert s["num_ooms"] == s0["num_ooms"] + 1
    assert s["num_allocs"] == s0["num_allocs"]
    assert led.sd.standin_live_count() == live0
    assert core.last_driver_error() == (2, "CUDA_ERROR_OUT_OF_MEMORY")
    led.sd.standin_clear_faults()
    led.free(led.ok(MIB))


def test_alloc_other_driver_error_is_not_retried(led):
    s0 = stats()
    allocs = led.counter(C_ALLOC)
    led.sd.standin_fail(b"cuMemAllocFromPoolAsync", 999, 1)
    assert led.alloc(MIB) == (Status.DRIVER, 0)
    s = stats()
    assert s["used"] == 0 and s["tags"][TAG_CUPY]["current"] == 0
    assert s["num_retries"] == s0["num_retries"]
    assert s["num_allocs"] == s0["num_allocs"]
    assert led.counter(C_ALLOC) == allocs
    assert core.last_driver_error() == (999, "CUDA_ERROR_UNKNOWN")
    # the fault was one call: the next allocation works
    led.free(led.ok(MIB))


def test_free_driver_error_once_is_recovered(led):
    p = led.ok(5 * MIB)
    s0 = stats()
    frees = led.counter(C_FREE)
    led.sd.standin_fail(b"cuMemFreeAsync", 999, 1)
    led.free(p)  # never raises
    s = stats()
    assert s["used"] == 0 and s["tags"][TAG_CUPY]["current"] == 0
    assert s["num_frees"] == s0["num_frees"] + 1
    assert s["num_driver_errors"] == s0["num_driver_errors"] + 1
    # the second attempt (after a device sync, on the legacy stream) reached the driver
    assert led.counter(C_FREE) == frees + 1
    led.sd.standin_sync_all(DEV)
    assert others() == 0


def test_free_driver_error_persisting_keeps_figures_exact(led):
    p = led.ok(5 * MIB, tag=TAG_TORCH)
    s0 = stats()
    led.sd.standin_fail(b"cuMemFreeAsync", 999, 2)
    led.free(p)  # never raises
    s = stats()
    assert s["used"] == 0 and s["tags"][TAG_TORCH]["current"] == 0
    assert s["tags"][TAG_TORCH]["freed"] == s0["tags"][TAG_TORCH]["freed"] + 5 * MIB
    assert s["num_driver_errors"] == s0["num_driver_errors"] + 2
    assert core.lookup(p)[0] == Status.INVALID
    # the driver still holds the block: honestly counted as someone else's
    assert others() == 5 * MIB
    # (undo the stand-in's leak so later tests start from an empty pool; the
    # core left this thread without a context, as it found it)
    ctx = ctypes.c_void_p()
    assert led.sd.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and not ctx.value
    assert led.sd.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), DEV) == 0
    assert led.sd.cuCtxSetCurrent(ctx) == 0
    free = led.sd.cuMemFreeAsync
    free.argtypes = [ctypes.c_ulonglong, ctypes.c_void_p]
    assert free(p, None) == 0
    assert led.sd.cuCtxSetCurrent(None) == 0
    led.sd.standin_sync_all(DEV)
    assert others() == 0


# ---- bad inputs ----
def test_negative_size_raises_valueerror(led):
    s0 = stats()
    with pytest.raises(ValueError, match="size"):
        core.alloc(DEV, -1, S1, TAG_CUPY)
    with pytest.raises(ValueError, match="size"):
        core.alloc_graph(DEV, -1, TAG_TORCH, 1, 2)
    assert stats()["num_allocs"] == s0["num_allocs"]
    assert stats()["num_ooms"] == s0["num_ooms"]


def test_size_zero_gives_null_and_ok(led):
    s0 = stats()
    assert core.alloc(DEV, 0, S1, TAG_CUPY) == (Status.OK, 0)
    assert core.alloc_graph(DEV, 0, TAG_TORCH, 1, 2) == (Status.OK, 0)
    s = stats()
    assert s["num_allocs"] == s0["num_allocs"] and s["used"] == 0
    core.free(0)  # freeing null is a no-op, not a bad free
    assert stats()["num_bad_frees"] == s0["num_bad_frees"]


@pytest.mark.parametrize("tag", [-1, 3, 255])
def test_bad_tag_is_invalid(led, tag):
    s0 = stats()
    assert core.alloc(DEV, MIB, S1, tag) == (Status.INVALID, 0)
    assert core.alloc_graph(DEV, MIB, tag, 1, 2) == (Status.INVALID, 0)
    s = stats()
    assert s["used"] == 0
    assert s["num_ooms"] == s0["num_ooms"]  # a bad argument is not an OOM


@pytest.mark.parametrize("dev", [2, 7, 63, 64, -1, 1000])
def test_bad_device(led, dev):
    assert core.alloc(dev, MIB, S1, TAG_CUPY) == (Status.DEVICE, 0)
    assert core.alloc_graph(dev, MIB, TAG_CUPY, 1, 2) == (Status.DEVICE, 0)
    assert core.stats(dev)[0] == Status.DEVICE
    assert core.others(dev)[0] == Status.DEVICE
    assert core.trim(dev) == Status.DEVICE
    assert core.graph(GRAPH_BEGIN, dev, 1, 2) == Status.DEVICE


def test_double_free_and_unknown_pointer_change_nothing_but_bad_frees(led):
    p = led.ok(2 * MIB)
    keep = led.ok(MIB)
    led.free(p)
    s0 = stats()
    frees = led.counter(C_FREE)
    live = core.live_records()
    core.free(p)  # double free
    core.free(0x7E00DEAD0000)  # never handed out
    core.free(keep + 8)  # inside a live block, not its start
    s = stats()
    assert s["num_bad_frees"] == s0["num_bad_frees"] + 3
    for key in ("used", "num_frees", "num_allocs", "num_driver_errors", "pool_used"):
        assert s[key] == s0[key], key
    assert s["tags"] == s0["tags"]
    assert led.counter(C_FREE) == frees  # nothing reached the driver
    assert core.live_records() == live
    assert core.lookup(keep) == (Status.OK, MIB, DEV, TAG_CUPY)
    led.free(keep)


def test_lookup_and_record_stream_of_unknown_pointer(led):
    assert core.lookup(0x7E00DEAD0000)[0] == Status.INVALID
    assert core.lookup(0)[0] == Status.INVALID
    assert core.record_stream(0x7E00DEAD0000, S2) == Status.INVALID


# ---- threads and contexts ----
def _in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=60)
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_thread_without_current_context_allocates_and_frees(led):
    """torch's autograd thread has no current CUDA context."""
    sd = led.sd

    def autograd():
        sd.standin_clear_current()
        assert core.current_device() == (Status.OK, 0)  # no context: reported as 0
        rc, p = core.alloc(1, 2 * MIB, S1, TAG_TORCH)
        sd.standin_clear_current()
        core.free(p)  # freed from a context-less thread too
        return rc, p

    s0 = stats(1)
    frees = led.counter(C_FREE)
    rc, p = _in_thread(autograd)
    assert rc == Status.OK and p != 0
    s = stats(1)
    assert s["num_allocs"] == s0["num_allocs"] + 1
    assert s["num_frees"] == s0["num_frees"] + 1
    assert s["used"] == 0
    assert s["num_driver_errors"] == s0["num_driver_errors"]
    assert led.counter(C_FREE) == frees + 1


def _make_current(sd, device):
    ctx = ctypes.c_void_p()
    assert sd.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device) == 0
    assert sd.cuCtxSetCurrent(ctx) == 0


def test_callers_context_is_restored(led):
    """Allocating on device 0 from a thread whose current device is 1."""
    sd = led.sd

    def run():
        _make_current(sd, 1)
        before = core.current_device()
        rc, p0 = core.alloc(0, MIB, S1, TAG_CUPY)
        assert rc == Status.OK
        after_alloc = core.current_device()
        core.free(p0)
        after_free = core.current_device()
        return before, after_alloc, after_free, p0

    before, after_alloc, after_free, p0 = _in_thread(run)
    assert before == (Status.OK, 1)
    assert after_alloc == (Status.OK, 1)
    assert after_free == (Status.OK, 1)
    assert p0 != 0


def test_a_thread_without_context_is_left_without_one(led):
    """Issue: a context-less thread that allocated or freed on cuda:1 was left with
    device 1's context current, and its next torch.empty(device='cuda') went there."""
    sd = led.sd

    def run():
        sd.standin_clear_current()
        rc, p1 = core.alloc(1, MIB, S1, TAG_TORCH)  # a miss: a driver call in device 1's context
        assert rc == Status.OK
        ctx = ctypes.c_void_p()
        after_alloc = sd.cuCtxGetCurrent(ctypes.byref(ctx)), ctx.value
        core.free(p1)
        after_free = sd.cuCtxGetCurrent(ctypes.byref(ctx)), ctx.value
        return after_alloc, after_free

    after_alloc, after_free = _in_thread(run)
    assert after_alloc == (0, None)
    assert after_free == (0, None)


# ---- record_stream ----
def test_record_stream_orders_the_free_after_the_recorded_streams(led):
    p = led.ok(MIB, stream=S1)
    assert core.record_stream(p, S2) == Status.OK
    assert core.record_stream(p, S3) == Status.OK
    assert core.record_stream(p, S2) == Status.OK  # twice: waited once
    assert core.record_stream(p, S1) == Status.OK  # its own stream: nothing to wait for
    waits, records = led.counter(C_WAIT), led.counter(C_RECORD)
    led.free(p)
    assert led.counter(C_WAIT) == waits + 2
    assert led.counter(C_RECORD) == records + 2
    assert stats()["used"] == 0


def test_free_without_recorded_streams_issues_no_waits(led):
    p = led.ok(MIB, stream=S1)
    waits = led.counter(C_WAIT)
    led.free(p)
    assert led.counter(C_WAIT) == waits


def test_free_is_queued_on_the_allocating_stream(led):
    p = led.ok(MIB, stream=S1)
    q = led.ok(MIB, stream=S2)
    led.free(p)
    led.free(q)
    assert led.sd.standin_pending_bytes(DEV) == 2 * MIB
    # a retry on S2 completes S2's frees only
    led.sd.standin_set_capacity(DEV, 3 * MIB)
    r = led.ok(2 * MIB, stream=S2)
    assert led.sd.standin_pending_bytes(DEV) == MIB  # S1's free is still queued
    led.free(r)


# ---- CUDA graph capture ----
def test_graph_blocks_live_until_the_graph_is_released(led):
    g = (0x11, 0x22)
    assert led.graph(GRAPH_BEGIN, DEV, *g) == Status.OK
    s0 = stats()
    rc, p = core.alloc_graph(DEV, 6 * MIB, TAG_TORCH, *g)
    assert rc == Status.OK and p
    assert core.lookup(p) == (Status.OK, 6 * MIB, DEV, TAG_TORCH)
    s = stats()
    assert s["used"] == 6 * MIB and s["tags"][TAG_TORCH]["current"] == 6 * MIB
    assert s["num_allocs"] == s0["num_allocs"] + 1
    frees = led.counter(C_FREE)
    core.free(p)  # replays may still write it: the memory is kept
    s = stats()
    assert s["graph_bytes"] == 6 * MIB
    assert s["used"] == 6 * MIB  # still counted against the budget
    assert s["tags"][TAG_TORCH]["current"] == 0  # torch sees it freed
    assert led.counter(C_FREE) == frees
    core.free(p)  # a second free of a kept graph block is a bad free
    assert stats()["num_bad_frees"] == s0["num_bad_frees"] + 1
    assert stats()["graph_bytes"] == 6 * MIB
    assert core.graph(GRAPH_END, DEV, *g) == Status.OK
    assert stats()["graph_bytes"] == 6 * MIB  # ending the capture keeps it: replays
    assert core.graph(GRAPH_RELEASE, DEV, *g) == Status.OK
    s = stats()
    assert s["graph_bytes"] == 0 and s["used"] == 0
    assert led.counter(C_FREE) == frees + 1
    assert core.lookup(p)[0] == Status.INVALID


def test_graph_block_still_in_use_at_release_becomes_ordinary(led):
    g = (0x33, 0x44)
    led.graph(GRAPH_BEGIN, DEV, *g)
    rc, p = core.alloc_graph(DEV, MIB, TAG_TORCH, *g)
    assert rc == Status.OK
    core.graph(GRAPH_END, DEV, *g)
    frees = led.counter(C_FREE)
    assert core.graph(GRAPH_RELEASE, DEV, *g) == Status.OK
    assert led.counter(C_FREE) == frees  # the user still holds it
    assert stats()["used"] == MIB
    core.free(p)
    s = stats()
    assert s["used"] == 0 and s["graph_bytes"] == 0
    assert led.counter(C_FREE) == frees + 1


def test_graph_allocations_obey_the_budget(led):
    g = (0x55, 0x66)
    core.set_limit(DEV, 4 * MIB)
    led.graph(GRAPH_BEGIN, DEV, *g)
    s0 = stats()
    assert core.alloc_graph(DEV, 4 * MIB + 1, TAG_TORCH, *g) == (Status.BUDGET, 0)
    assert stats()["num_ooms"] == s0["num_ooms"] + 1
    assert stats()["used"] == 0
    rc, p = core.alloc_graph(DEV, 4 * MIB, TAG_TORCH, *g)
    assert rc == Status.OK
    core.free(p)
    core.graph(GRAPH_END, DEV, *g)
    core.graph(GRAPH_RELEASE, DEV, *g)


def test_frees_on_a_captured_stream_are_deferred_until_it_ends(led):
    g = (0x77, 0x88)
    p = led.ok(3 * MIB, stream=S1, tag=TAG_TORCH)
    q = led.ok(2 * MIB, stream=S2, tag=TAG_TORCH)
    led.graph(GRAPH_BEGIN, DEV, *g)
    led.sd.standin_set_capturing(S1)
    frees = led.counter(C_FREE)
    led.free(p)  # the captured work may still use it: held back
    led.free(q)  # another stream (another thread's tensor): freed at once
    s = stats()
    assert s["num_deferred"] == 1
    assert led.counter(C_FREE) == frees + 1
    assert s["used"] == 3 * MIB  # p still counted against the budget
    assert s["tags"][TAG_TORCH]["current"] == 0  # but freed for torch
    # torch ends the capture on the stream before it calls the end hook: the
    # deferred frees go at once (they used to wait for memory pressure)
    led.sd.standin_set_capturing(None)
    assert core.graph(GRAPH_END, DEV, *g) == Status.OK
    s = stats()
    assert s["num_deferred"] == 0
    assert led.counter(C_FREE) == frees + 2
    assert s["used"] == 0
    core.graph(GRAPH_RELEASE, DEV, *g)


def test_deferred_frees_also_complete_at_the_next_free(led):
    g = (0x99, 0xAA)
    p = led.ok(MIB, stream=S1)
    q = led.ok(MIB)
    led.graph(GRAPH_BEGIN, DEV, *g)
    led.sd.standin_set_capturing(S1)  # the capture has not ended on its stream yet
    led.free(p)
    core.graph(GRAPH_END, DEV, *g)
    assert stats()["num_deferred"] == 1  # p's stream is still capturing
    led.sd.standin_set_capturing(None)
    frees = led.counter(C_FREE)
    led.free(q)
    assert stats()["num_deferred"] == 0
    assert led.counter(C_FREE) == frees + 2
    core.graph(GRAPH_RELEASE, DEV, *g)


def test_the_core_never_frees_or_syncs_on_a_capturing_stream(led):
    """standin_set_capturing makes driver calls on that stream fail."""
    g = (0xBB, 0xCC)
    cap = S1
    p = led.ok(2 * MIB, stream=cap, tag=TAG_TORCH)
    q = led.ok(MIB, stream=S2, tag=TAG_TORCH)
    s0 = stats()
    led.graph(GRAPH_BEGIN, DEV, *g)
    led.sd.standin_set_capturing(cap)
    rc, gp = core.alloc_graph(DEV, MIB, TAG_TORCH, *g)  # routed to the side stream
    assert rc == Status.OK
    led.free(p)
    led.free(q)
    assert stats()["num_deferred"] == 1  # p; q's stream is not captured: freed at once
    assert led.sd.standin_pending_bytes(DEV) == MIB
    # the end hook, while the stream still captures: p waits
    core.graph(GRAPH_END, DEV, *g)
    r = led.ok(MIB, stream=S3)
    s = stats()
    assert s["num_deferred"] == 1
    led.sd.standin_set_capturing(None)
    led.free(r)
    s = stats()
    assert s["num_deferred"] == 0
    assert s["num_driver_errors"] == s0["num_driver_errors"]
    assert core.last_driver_error()[0] != 900
    core.free(gp)
    core.graph(GRAPH_RELEASE, DEV, *g)


def test_no_stream_sync_while_a_capture_runs(led):
    """An OOM retry during capture must not synchronize (it would invalidate it)."""
    g = (0xDD, 0xEE)
    led.sd.standin_set_capacity(DEV, 8 * MIB)
    p = led.ok(8 * MIB, stream=S2)
    led.graph(GRAPH_BEGIN, DEV, *g)
    syncs = led.counter(C_SYNC)
    assert led.alloc(MIB, stream=S2) == (Status.OOM, 0)
    assert led.counter(C_SYNC) == syncs
    led.sd.standin_set_capturing(S2)
    led.free(p)  # a block of the captured stream: held back
    assert stats()["num_deferred"] == 1
    led.sd.standin_set_capturing(None)
    core.graph(GRAPH_END, DEV, *g)
    core.graph(GRAPH_RELEASE, DEV, *g)
    # the next allocation completes the deferred free, and its retry on S2
    # (no capture now) lets that free land
    led.free(led.ok(MIB, stream=S2))
    assert stats()["num_deferred"] == 0


def test_driver_calls_during_capture_use_relaxed_capture_mode(led):
    g = (0xF1, 0xF2)
    p = led.ok(MIB, stream=S2)
    led.graph(GRAPH_BEGIN, DEV, *g)
    modes = led.counter(C_MODE)
    q = led.ok(MIB, stream=S2)
    assert led.counter(C_MODE) >= modes + 2  # switched to relaxed and back
    assert led.sd.standin_capture_mode() == 0  # the thread's mode is restored
    led.free(q)
    led.free(p)
    core.graph(GRAPH_END, DEV, *g)
    core.graph(GRAPH_RELEASE, DEV, *g)
    led.free(led.ok(1))  # completes the deferred frees
    assert stats()["num_deferred"] == 0


def test_graph_ids_and_slots(led):
    assert core.graph(GRAPH_END, DEV, 0xAB, 0xCD) == Status.INVALID  # never begun
    assert core.graph(GRAPH_RELEASE, DEV, 0xAB, 0xCD) == Status.OK  # nothing to release
    ids = [(0x1000 + i, 1) for i in range(300)]  # no fixed number of pools
    for g in ids:
        assert led.graph(GRAPH_BEGIN, DEV, *g) == Status.OK
    assert stats()["captures_active"] == 300
    for g in ids:
        assert core.graph(GRAPH_END, DEV, *g) == Status.OK
        assert core.graph(GRAPH_RELEASE, DEV, *g) == Status.OK
    # every capture ended: frees are immediate again
    frees = led.counter(C_FREE)
    led.free(led.ok(MIB))
    assert led.counter(C_FREE) == frees + 1
    assert stats()["num_deferred"] == 0


# ---- trim ----
def test_trim_returns_idle_memory_including_queued_frees(led):
    assert core.trim(DEV, 0) == Status.OK
    s0 = stats()
    assert s0["pool_reserved"] == s0["pool_used"] == 0
    p = led.ok(8 * MIB)
    q = led.ok(4 * MIB)
    led.free(p)
    assert stats()["pool_reserved"] >= s0["pool_reserved"] + 12 * MIB
    assert core.trim(DEV, 0) == Status.OK
    s = stats()
    assert led.sd.standin_pending_bytes(DEV) == 0
    assert s["pool_reserved"] == s["pool_used"] == 4 * MIB
    led.free(q)
    led.sd.standin_sync_all(DEV)
    assert stats()["pool_reserved"] == 4 * MIB  # the release threshold keeps idle bytes
    assert core.trim(DEV, MIB) == Status.OK
    assert stats()["pool_reserved"] == MIB  # keep=1 MiB
    assert core.trim(DEV, 0) == Status.OK
    assert stats()["pool_reserved"] == 0


# ---- the pressure callback ----
def test_pressure_callback_runs_before_failing_and_a_retry_follows(led):
    core.set_limit(DEV, 16 * MIB)
    cache = [led.ok(12 * MIB, stream=S1, tag=TAG_CUPY)]  # e.g. a framework's cache
    calls = []

    def relieve(device, size, tag):
        calls.append((device, size, tag))
        led.free(cache.pop())
        return True

    core.set_pressure_callback(relieve)
    s0 = stats()
    p = led.ok(8 * MIB, stream=S1, tag=TAG_TORCH)
    assert calls == [(DEV, 8 * MIB, TAG_TORCH)]
    s = stats()
    assert s["num_retries"] == s0["num_retries"] + 1
    assert s["num_ooms"] == s0["num_ooms"]
    assert s["used"] == 8 * MIB
    # not called when the allocation fits
    led.free(p)
    led.free(led.ok(MIB, stream=S1))
    assert len(calls) == 1


def test_pressure_callback_not_called_when_a_stream_sync_suffices(led):
    led.sd.standin_set_capacity(DEV, 8 * MIB)
    calls = []
    core.set_pressure_callback(lambda *a: calls.append(a) or True)
    led.free(led.ok(8 * MIB, stream=S1))
    led.free(led.ok(8 * MIB, stream=S1))
    assert calls == []


def test_pressure_callback_returning_false_means_no_retry(led):
    core.set_limit(DEV, MIB)
    calls = []
    core.set_pressure_callback(lambda *a: calls.append(a) or False)
    s0 = stats()
    allocs = led.counter(C_ALLOC)
    assert led.alloc(2 * MIB, tag=TAG_TORCH) == (Status.BUDGET, 0)
    assert calls == [(DEV, 2 * MIB, TAG_TORCH)]
    s = stats()
    assert s["num_ooms"] == s0["num_ooms"] + 1
    assert s["num_retries"] == s0["num_retries"]
    assert led.counter(C_ALLOC) == allocs


def test_pressure_callback_that_raises_never_breaks_the_allocation(led, monkeypatch):
    core.set_limit(DEV, MIB)
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))

    def broken(device, size, tag):
        raise RuntimeError("boom")

    core.set_pressure_callback(broken)
    assert led.alloc(2 * MIB) == (Status.BUDGET, 0)
    assert len(seen) == 1 and str(seen[0]) == "boom"
    assert stats()["used"] == 0
    core.set_pressure_callback(None)
    assert led.alloc(2 * MIB) == (Status.BUDGET, 0)
    assert len(seen) == 1  # removed: not called again
    with pytest.raises(TypeError):
        core.set_pressure_callback(42)


def test_pressure_callback_from_a_context_less_thread_keeps_its_context(led):
    """The retry after the hook must not leave the caller on another device."""
    core.set_limit(0, 4 * MIB)
    cache = [led.ok(4 * MIB, stream=S1, dev=0)]

    def relieve(device, size, tag):
        if cache:
            led.free(cache.pop())
        return True

    core.set_pressure_callback(relieve)
    sd = led.sd

    def run():
        _make_current(sd, 1)  # as after torch.cuda.set_device(1)
        rc, p0 = core.alloc(0, 2 * MIB, S1, TAG_CUPY)  # needs the hook
        dev_after = core.current_device()
        core.free(p0)
        return rc, dev_after

    s0 = stats(0)
    rc, dev_after = _in_thread(run)
    assert rc == Status.OK
    assert stats(0)["num_retries"] == s0["num_retries"] + 1
    assert dev_after == (Status.OK, 1)


def test_on_pressure_python_callbacks(led):
    """bridge.on_pressure: fn(device, nbytes) runs, then the allocation is retried."""
    import bridge

    core.set_limit(DEV, 10 * MIB)
    held = [led.ok(10 * MIB, stream=S1)]
    calls = []

    def drop_cache(device, nbytes):
        calls.append((device, nbytes))
        while held:
            led.free(held.pop())

    bridge.on_pressure(drop_cache)
    try:
        p = led.ok(3 * MIB, stream=S1)
        assert calls == [(DEV, 3 * MIB)]
        led.free(p)
    finally:
        bridge.remove_pressure_callback(drop_cache)
