# SPDX-License-Identifier: Apache-2.0
"""The budget, out-of-memory retries and the pressure callback, on the stand-in driver.

Every figure asserted is one a user relies on: bytes per framework, statuses,
what the budget lets through, what the driver was asked to do.  The core is
process-global: tests compare against figures read at their start, free what
they allocate, and undo what they add to the stand-in (the `led` fixture).
"""

from __future__ import annotations

import ctypes
import sys
import threading

import pytest
from ledger_util import (
    C_ALLOC,
    C_FREE,
    C_SYNC,
    DEV,
    GIB,
    MIB,
    S1,
    TAG_CUPY,
    TAG_OTHER,
    TAG_TORCH,
    _in_thread,
    _make_current,
    others,
    stats,
)

from bridge._errors import TAG_LIMIT_ZERO, Status
from bridge._runtime import core


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
    assert core.set_tag_limit(DEV, core.NTAGS, MIB) == Status.INVALID
    assert core.set_tag_limit(DEV, -1, MIB) == Status.INVALID
    led.free(t)
    led.free(c)


def test_a_tag_cap_of_zero_bytes_refuses_every_allocation_of_that_tag(led):
    # torch.cuda.set_per_process_memory_fraction(0.0): torch gets nothing (0 is no cap)
    assert core.set_tag_limit(DEV, TAG_TORCH, TAG_LIMIT_ZERO) == Status.OK
    assert led.alloc(1, tag=TAG_TORCH) == (Status.TAG_LIMIT, 0)
    assert led.alloc(MIB, tag=TAG_TORCH) == (Status.TAG_LIMIT, 0)
    c = led.ok(MIB, tag=TAG_CUPY)  # other frameworks are not capped
    assert stats()["tags"][TAG_TORCH]["num_ooms"] == 2
    assert core.set_tag_limit(DEV, TAG_TORCH, 0) == Status.OK  # no cap again
    t = led.ok(1, tag=TAG_TORCH)
    led.free(t)
    led.free(c)


def test_a_tag_cap_of_zero_bytes_refuses_a_cached_block_too(led):
    core.set_cache(DEV, 64 * MIB)
    try:
        t = led.ok(MIB, stream=0, tag=TAG_TORCH)
        led.free(t)
        assert stats()["cached"] == MIB
        core.set_tag_limit(DEV, TAG_TORCH, TAG_LIMIT_ZERO)
        assert led.alloc(MIB, stream=0, tag=TAG_TORCH) == (Status.TAG_LIMIT, 0)
        assert stats()["tags"][TAG_TORCH]["current"] == 0
    finally:
        core.set_tag_limit(DEV, TAG_TORCH, 0)
        core.set_cache(DEV, 0)


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
    assert [t["current"] for t in s["tags"]] == [0] * core.NTAGS
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
            rc, p = core.alloc(DEV, 1000 + i, S1 + i, i % core.NTAGS)
            if rc != Status.OK:
                failures.append(rc)
                continue
            if core.lookup(p) != (Status.OK, 1000 + i, DEV, i % core.NTAGS):
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
    expected = [0] * core.NTAGS
    for i in range(nthreads):
        expected[i % core.NTAGS] += rounds * (1000 + i)
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


def test_an_allocation_the_driver_refuses_leaves_the_frameworks_peaks_alone(led):
    """torch.cuda.max_memory_allocated (and memory_stats' peaks) read the tag's peak: an
    allocation the device refused was never live, so it must not raise it, as natively (a
    batch-size search catches the OOM and reads the peak of what did fit)."""
    led.sd.standin_set_capacity(DEV, 64 * MIB)
    p = led.ok(48 * MIB, tag=TAG_TORCH)
    core.reset_peak(DEV, -1)
    for size in (32 * MIB, 17 * MIB):  # refused by the driver: no budget, the device is full
        assert led.alloc(size, tag=TAG_TORCH) == (Status.OOM, 0)
    led.sd.standin_fail(b"cuMemAllocFromPoolAsync", 2, 5)  # refused however small
    assert led.alloc(MIB, tag=TAG_TORCH) == (Status.OOM, 0)
    led.sd.standin_clear_faults()
    t = stats()["tags"][TAG_TORCH]
    assert (t["current"], t["peak"]) == (48 * MIB, 48 * MIB), t
    assert (t["count"], t["count_peak"]) == (1, 1), t
    q = led.ok(8 * MIB, tag=TAG_TORCH)  # one that is served raises it
    assert stats()["tags"][TAG_TORCH]["peak"] == 56 * MIB
    led.free(q)
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
    # CuPy's tag: its blocks' stream is alive at the free, which is tried there
    # first, then on the legacy stream
    p = led.ok(5 * MIB, tag=TAG_CUPY)
    s0 = stats()
    led.sd.standin_fail(b"cuMemFreeAsync", 999, 2)
    led.free(p)  # never raises
    s = stats()
    assert s["used"] == 0 and s["tags"][TAG_CUPY]["current"] == 0
    assert s["tags"][TAG_CUPY]["freed"] == s0["tags"][TAG_CUPY]["freed"] + 5 * MIB
    assert s["num_driver_errors"] == s0["num_driver_errors"] + 2
    assert core.lookup(p)[0] == Status.INVALID
    # the driver still holds the block: honestly counted as someone else's
    assert others() == 5 * MIB
    # (undo the stand-in's leak so later tests start from an empty pool; the
    # core left this context-less thread with device 0's primary context, the
    # one its first runtime call would have made current)
    ctx, current = ctypes.c_void_p(), ctypes.c_void_p()
    assert led.sd.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), DEV) == 0
    assert led.sd.cuCtxGetCurrent(ctypes.byref(current)) == 0 and current.value == ctx.value
    free = led.sd.cuMemFreeAsync
    free.argtypes = [ctypes.c_ulonglong, ctypes.c_void_p]
    assert free(p, None) == 0
    assert led.sd.cuCtxSetCurrent(None) == 0
    led.sd.standin_sync_all(DEV)
    assert others() == 0


# ---- the pressure callback ----
def test_pressure_callback_runs_before_failing_and_a_retry_follows(led):
    core.set_limit(DEV, 16 * MIB)
    cache = [led.ok(12 * MIB, stream=S1, tag=TAG_CUPY)]  # e.g. a framework's cache
    calls = []

    def relieve(device, size, tag, stage):
        calls.append((device, size, tag, stage))
        led.free(cache.pop())
        return True

    core.set_pressure_callback(relieve)
    s0 = stats()
    p = led.ok(8 * MIB, stream=S1, tag=TAG_TORCH)
    assert calls == [(DEV, 8 * MIB, TAG_TORCH, core.RELIEVE_ALL)]  # no wait: the whole chain
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
    assert calls == [(DEV, 2 * MIB, TAG_TORCH, core.RELIEVE_ALL)]
    s = stats()
    assert s["num_ooms"] == s0["num_ooms"] + 1
    assert s["num_retries"] == s0["num_retries"]
    assert led.counter(C_ALLOC) == allocs


def test_pressure_callback_that_raises_never_breaks_the_allocation(led, monkeypatch):
    core.set_limit(DEV, MIB)
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))

    def broken(device, size, tag, stage):
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

    def relieve(device, size, tag, stage):
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
