# SPDX-License-Identifier: Apache-2.0
"""Threads, contexts and record_stream in the ledger, on the stand-in driver.

Every figure asserted is one a user relies on: bytes per framework, statuses,
what the budget lets through, what the driver was asked to do.  The core is
process-global: tests compare against figures read at their start, free what
they allocate, and undo what they add to the stand-in (the `led` fixture).
"""

from __future__ import annotations

import ctypes
import threading

from ledger_util import (
    C_FREE,
    C_RECORD,
    C_WAIT,
    DEV,
    MIB,
    S1,
    S2,
    S3,
    TAG_CUPY,
    TAG_TORCH,
    _in_thread,
    _make_current,
    stats,
)

from bridge._errors import Status
from bridge._runtime import core


# ---- threads and contexts ----
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


def test_a_thread_without_context_keeps_device_0s_after_a_driver_call_there(led):
    """A context-less thread's runtime device is 0, and its first runtime call would
    make device 0's primary context current: the core leaves that one current (put
    back "none", cudaGetDevice ran its slow context-less path, about 1.15 us instead
    of 50 ns on an H200, until something bound a context)."""
    sd = led.sd

    def run():
        sd.standin_clear_current()
        rc, p0 = core.alloc(0, MIB, S1, TAG_CUPY)  # a miss: a driver call in device 0's context
        assert rc == Status.OK
        ctx, primary = ctypes.c_void_p(), ctypes.c_void_p()
        after_alloc = sd.cuCtxGetCurrent(ctypes.byref(ctx)), ctx.value
        assert sd.cuDevicePrimaryCtxRetain(ctypes.byref(primary), 0) == 0
        core.free(p0)
        return after_alloc, primary.value, core.current_device()

    after_alloc, primary, device = _in_thread(run)
    assert after_alloc == (0, primary) and primary
    assert device == (Status.OK, 0)


# ---- the cumulative figures, counted per thread ----
def _tag(s: dict, tag: int) -> dict:
    return s["tags"][tag]


def test_figures_keep_the_counts_of_threads_that_ended(led):
    """The allocation and free counts and bytes are kept per thread (counts.h) and
    added up when read: what threads that ended counted stays in the figures, and a
    thread started later (which takes over an ended thread's copy) adds to them."""
    core.set_cache(DEV, 64 * MIB)
    s0 = stats()
    rounds, threads, per = 2, 6, 25
    errors: list[int] = []

    def work(i: int) -> None:
        for _ in range(per):  # the legacy stream (0) outlives every block: its frees are cached
            rc, p = core.alloc(DEV, (i + 1) * MIB, 0, TAG_TORCH)
            if rc != Status.OK:
                errors.append(rc)
            core.free(p)

    try:
        for _ in range(rounds):  # the second round's threads take over the first's copies
            ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        s = stats()
    finally:
        core.set_cache(DEV, 0)  # the cached blocks back to the pool
    assert errors == []
    n = rounds * threads * per
    nbytes = rounds * per * MIB * sum(i + 1 for i in range(threads))
    assert s["num_allocs"] - s0["num_allocs"] == n
    assert s["num_frees"] - s0["num_frees"] == n
    t, t0 = _tag(s, TAG_TORCH), _tag(s0, TAG_TORCH)
    assert (t["num_allocs"] - t0["num_allocs"], t["num_frees"] - t0["num_frees"]) == (n, n)
    assert (t["allocated"] - t0["allocated"], t["freed"] - t0["freed"]) == (nbytes, nbytes)
    # each thread's first allocation of its size misses; the rest are hits on its stream
    assert s["num_cache_hits"] - s0["num_cache_hits"] >= n - rounds * threads
    assert t["current"] == 0 and t["count"] == t0["count"]


def test_reset_accumulated_zeroes_a_tag_while_other_threads_count(led):
    """A reset starts the tag's figures from 0 without writing any thread's copy:
    what a thread counts after the reset shows, what it counted before does not, and
    the device's own counts and the other tags are untouched."""
    rc, p = core.alloc(DEV, MIB, S1, TAG_TORCH)
    core.free(p)
    rc, q = core.alloc(DEV, 2 * MIB, S1, TAG_CUPY)
    core.free(q)
    before = stats()
    first, go, done = threading.Event(), threading.Event(), threading.Event()

    def other() -> None:  # a thread that counted before the reset and counts after it
        rc, p = core.alloc(DEV, 3 * MIB, S2, TAG_TORCH)
        core.free(p)
        first.set()
        go.wait(10)
        rc, p = core.alloc(DEV, 5 * MIB, S2, TAG_TORCH)
        core.free(p)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    assert first.wait(10)  # its first pair is counted before the reset
    assert core.reset_accumulated(DEV, TAG_TORCH) == Status.OK
    z = _tag(stats(), TAG_TORCH)
    assert (z["allocated"], z["freed"], z["num_allocs"], z["num_frees"]) == (0, 0, 0, 0)
    go.set()
    t.join()
    assert done.is_set()
    s = stats()
    tt = _tag(s, TAG_TORCH)
    figures = (tt["allocated"], tt["freed"], tt["num_allocs"], tt["num_frees"])
    assert figures == (5 * MIB, 5 * MIB, 1, 1)
    assert _tag(s, TAG_CUPY)["allocated"] == _tag(before, TAG_CUPY)["allocated"]
    assert s["num_allocs"] == before["num_allocs"] + 2  # the device's counts: never reset


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
    # a retry on S2 synchronizes S2 and the legacy stream, where the frees of
    # streams the core cannot prove alive go (issue 30): the legacy stream
    # waits for every blocking stream, S1 included (no device-wide sync)
    led.sd.standin_set_capacity(DEV, 3 * MIB)
    syncs = led.sd.standin_counter(2)
    r = led.ok(2 * MIB, stream=S2)
    assert led.sd.standin_pending_bytes(DEV) == 0
    assert led.sd.standin_counter(2) == syncs + 2
    led.free(r)
