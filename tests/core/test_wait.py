# SPDX-License-Identifier: Apache-2.0
"""Waiting for memory others free (bridge/_native/wait.c), on the stand-in driver.

The stand-in's frees stay in the pool's used bytes until their stream is
synchronized, as on a GPU whose stream has not reached the free yet: a thread
that frees calls ``standin_sync_all`` to play the GPU catching up.  Every
thread is joined with a timeout: a hang fails the test instead of the run.
"""

from __future__ import annotations

import importlib
import os
import queue
import signal
import threading
import time

import pytest
from ledger_util import DEV, MIB, S1, S2, TAG_CUPY, TAG_TORCH, bridge_alloc_fn, stats

import bridge
from bridge._errors import Status, oom_message
from bridge._runtime import core


def _thread(fn, *args):
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _join(t, out, timeout=30.0):
    t.join(timeout)
    assert not t.is_alive(), "a thread hung"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.002)


def _alloc(size, stream=S1, tag=TAG_CUPY):
    return core.alloc(DEV, size, stream, tag)


def _free(p, sd):
    core.free(p)
    sd.standin_sync_all(DEV)  # the GPU reaches the free


# ---- producer / consumer at the budget's edge ----
def _pipeline(led, wait, items=60, block=64 * MIB, act=0):
    """A producer fills a queue of blocks at a budget of two; a consumer frees them
    (after allocating ``act`` bytes of its own per step, without waiting)."""
    sd = led.sd
    core.set_limit(DEV, 2 * block + act)
    q: queue.Queue = queue.Queue()
    refused = []

    def producer():
        with bridge.waiting(wait):
            for i in range(items):
                rc, p = _alloc(block)
                if rc != Status.OK:
                    refused.append(rc)
                    q.put(None)
                    return
                led.live.add(p)
                q.put((i, p))
        q.put(None)

    def consumer():
        got = []
        while (item := q.get(timeout=20)) is not None:
            i, p = item
            if act:  # the step's activations: the consumer sets no wait of its own
                rc, a = _alloc(act, S2, TAG_TORCH)
                assert rc == Status.OK, "the consumer was held back for the waiting producer"
            time.sleep(0.001)  # the training step
            if act:
                _free(a, sd)
            _free(p, sd)
            led.live.discard(p)
            got.append(i)
        return got

    tp, op = _thread(producer)
    tc, oc = _thread(consumer)
    _join(tp, op)
    return _join(tc, oc), refused


def test_producer_waits_for_the_consumer_at_two_batches_and_never_fails(led):
    s0 = stats()
    got, refused = _pipeline(led, wait=10.0)
    s = stats()
    assert got == list(range(60))  # every batch, in order
    assert refused == []
    assert s["num_ooms"] == s0["num_ooms"]
    assert s["num_waits"] > s0["num_waits"]  # it was at the edge: it did wait
    assert s["wait_ns"] > s0["wait_ns"]
    assert s["peak_used"] <= 2 * 64 * MIB  # the budget held throughout
    assert s["waiting"] == 0


def test_a_thread_that_does_not_wait_is_not_held_back_for_a_waiter(led):
    """The consumer's own allocations go ahead of the waiting producer: it is
    the one that will free (holding it back would leave everyone waiting)."""
    s0 = stats()
    got, refused = _pipeline(led, wait=10.0, act=16 * MIB)
    assert got == list(range(60)) and refused == []
    s = stats()
    assert s["num_ooms"] == s0["num_ooms"] and s["num_waits"] > s0["num_waits"]


def test_the_same_pipeline_without_waiting_meets_the_budget(led):
    s0 = stats()
    got, refused = _pipeline(led, wait=0)
    assert refused == [Status.BUDGET]
    assert len(got) < 60
    assert stats()["num_ooms"] == s0["num_ooms"] + 1
    assert stats()["num_waits"] == s0["num_waits"]


def test_a_stream_ordered_free_counts_once_the_stream_reaches_it(led):
    """A free on the waiter's own stream stays in the pool's used bytes until
    the stream reaches it: the waiter does not get the bytes early (the budget
    check reads the pool), and it lets its stream reach the free instead of
    waiting for someone else to synchronize."""
    sd = led.sd
    core.set_limit(DEV, 64 * MIB)
    p = led.ok(64 * MIB, S1)

    def consumer():
        time.sleep(0.03)
        core.free(p)  # queued on S1; nobody synchronizes it here
        led.live.discard(p)

    t, out = _thread(consumer)
    with bridge.waiting(10):
        rc, q = _alloc(64 * MIB, S1)
    _join(t, out)
    assert rc == Status.OK and q
    assert core.last_wait()[1] == core.WAIT_OK and core.last_wait()[0] < 5
    assert sd.standin_pending_on(DEV, S1) == 0  # the stream did reach the free
    assert stats()["peak_used"] <= 64 * MIB
    core.free(q)


# ---- time runs out ----
def test_a_wait_ends_at_its_time_with_the_usual_refusal(led):
    core.set_limit(DEV, 64 * MIB)
    led.add_foreign(DEV, 64 * MIB)  # JAX holds the budget: no bridge thread will free
    s0 = stats()
    t0 = time.monotonic()
    with bridge.waiting(0.3):
        rc, p = _alloc(MIB)
    took = time.monotonic() - t0
    s = stats()
    assert (rc, p) == (Status.BUDGET, 0)
    assert 0.3 <= took < 3.0
    waited, outcome = core.last_wait()
    assert outcome == core.WAIT_TIMEOUT and waited >= 0.3
    assert s["num_wait_timeouts"] == s0["num_wait_timeouts"] + 1
    assert s["num_ooms"] == s0["num_ooms"] + 1
    assert s["used"] == 0 and s["waiting"] == 0
    msg = oom_message(DEV, MIB, rc, framework="cupy")
    assert "Waited 0.3" in msg and "none freed enough" in msg


def test_memory_freed_outside_the_bridge_is_seen_without_a_free_to_wake_on(led):
    """JAX frees: no bridge free wakes the waiter, its re-reads of the pool do."""
    core.set_limit(DEV, 64 * MIB)
    led.add_foreign(DEV, 64 * MIB)

    def jax_frees():
        time.sleep(0.1)
        led.add_foreign(DEV, -64 * MIB)

    t, out = _thread(jax_frees)
    with bridge.waiting(10):
        rc, p = led.alloc(32 * MIB)
    _join(t, out)
    assert rc == Status.OK and p
    assert core.last_wait()[1] == core.WAIT_OK
    led.free(p)


def test_a_later_refusal_that_does_not_wait_tells_no_earlier_wait(led):
    core.set_limit(DEV, 64 * MIB)
    led.add_foreign(DEV, 64 * MIB)
    with bridge.waiting(0.05):
        _alloc(MIB)
    assert core.last_wait()[1] == core.WAIT_TIMEOUT
    core.set_tag_limit(DEV, TAG_CUPY, MIB)  # a framework cap refuses: no wait helps
    rc, _ = _alloc(2 * MIB)
    assert rc == Status.TAG_LIMIT
    assert core.last_wait() == (0.0, core.WAIT_NONE)
    assert "Waited" not in oom_message(DEV, 2 * MIB, rc, framework="cupy")


def test_a_request_larger_than_the_budget_does_not_wait(led):
    core.set_limit(DEV, 64 * MIB)
    t0 = time.monotonic()
    with bridge.waiting(30):
        rc, _ = _alloc(65 * MIB)
    assert rc == Status.BUDGET
    assert time.monotonic() - t0 < 1.0
    assert core.last_wait()[1] == core.WAIT_HOPELESS


def test_an_allocation_in_a_cupy_capture_does_not_wait_and_says_why(led):
    # A CuPy capture's allocation comes from its graph pool and never waits; the thread's
    # last wait says a capture runs, which the OOM message tells (the H200 showed a bare
    # message after graph pools took CuPy's captures).
    core.set_limit(DEV, 64 * MIB)
    held = led.ok(48 * MIB)
    rc, pool = core.capture_stream(True, DEV, S2)
    assert rc == Status.OK
    try:
        t0 = time.monotonic()
        with bridge.waiting(30):
            rc, _ = _alloc(32 * MIB, S2)
        assert rc == Status.BUDGET
        assert time.monotonic() - t0 < 1.0
        assert core.last_wait() == (0.0, core.WAIT_CAPTURE)
        assert "a CUDA graph capture runs on this device" in oom_message(
            DEV, 32 * MIB, rc, framework="cupy"
        )
    finally:
        assert core.capture_stream(False, DEV, pool)[0] == Status.OK
        core.graph(2, DEV, core.CUPY_POOL, pool)  # RELEASE: its graph is gone
    led.free(held)


# ---- order of service ----
def test_a_large_request_is_served_before_later_small_ones(led):
    sd = led.sd
    core.set_limit(DEV, 100 * MIB)
    held = [led.ok(10 * MIB) for _ in range(10)]  # the main thread holds the budget
    order: list[str] = []

    def large():
        with bridge.waiting(20):
            rc, p = _alloc(60 * MIB, S2)
        order.append("large")
        return rc, p

    def small():
        got = []
        with bridge.waiting(20):
            for _ in range(3):
                rc, p = _alloc(10 * MIB, S2, TAG_TORCH)
                assert rc == Status.OK
                order.append("small")
                got.append(p)
        return got

    tl, ol = _thread(large)
    _until(lambda: stats()["waiting"] == 1)
    ts, os_ = _thread(small)
    _until(lambda: stats()["waiting"] == 2)
    for p in held:  # 10 MiB at a time: room for a small request after the first
        _free(p, sd)
        led.live.discard(p)
        time.sleep(0.01)
    rc, p = _join(tl, ol)
    smalls = _join(ts, os_)
    assert rc == Status.OK
    assert order == ["large", "small", "small", "small"]
    for q in [p, *smalls]:
        core.free(q)
    assert stats()["used"] == 0


# ---- every holder waiting ----
def _two_holders(led, prio_a=None, prio_b=None):
    """A and B each hold half the budget, then ask for more: A first, B second."""
    sd = led.sd
    core.set_limit(DEV, 128 * MIB)
    a_holds, b_holds, a_asks = threading.Event(), threading.Event(), threading.Event()
    res: dict = {}

    def a():
        p = _alloc(64 * MIB)[1]
        a_holds.set()
        b_holds.wait(10)
        with bridge.waiting(20, priority=prio_a):
            a_asks.set()
            t0 = time.monotonic()
            rc, q = _alloc(32 * MIB)
            res["a"] = (rc, time.monotonic() - t0, core.last_wait()[1])
        if rc != Status.OK:
            _free(p, sd)  # the refused one gives its memory up, as a failed step would
            return []
        return [p, q]

    def b():
        a_holds.wait(10)
        p = _alloc(64 * MIB, S2, TAG_TORCH)[1]
        b_holds.set()
        a_asks.wait(10)
        _until(lambda: stats()["waiting"] == 1)
        with bridge.waiting(20, priority=prio_b):
            t0 = time.monotonic()
            rc, q = _alloc(32 * MIB, S2, TAG_TORCH)
            res["b"] = (rc, time.monotonic() - t0, core.last_wait()[1])
        if rc != Status.OK:
            _free(p, sd)
            return []
        return [p, q]

    s0 = stats()
    ta, oa = _thread(a)
    tb, ob = _thread(b)
    keep = _join(ta, oa) + _join(tb, ob)
    for p in keep:
        core.free(p)
    return res, s0


def test_when_every_holder_waits_the_newest_is_refused_at_once(led):
    res, s0 = _two_holders(led)
    rc_b, took_b, why_b = res["b"]
    assert rc_b == Status.BUDGET and why_b == core.WAIT_ALL_WAITING
    assert took_b < 2.0  # at once, not after its 20 s
    rc_a, _, why_a = res["a"]
    assert rc_a == Status.OK and why_a == core.WAIT_OK  # B's memory went to A
    s = stats()
    assert s["num_wait_all_waiting"] == s0["num_wait_all_waiting"] + 1
    assert s["used"] == 0 and s["waiting"] == 0


def test_when_every_holder_waits_the_lowest_priority_is_refused(led):
    res, _ = _two_holders(led, prio_a=-1, prio_b=0)
    rc_a, took_a, why_a = res["a"]
    assert rc_a == Status.BUDGET and why_a == core.WAIT_ALL_WAITING
    assert took_a < 2.0
    assert res["b"][0] == Status.OK


def test_a_lone_thread_waiting_on_its_own_memory_is_refused_at_once(led):
    core.set_limit(DEV, 64 * MIB)
    p = led.ok(64 * MIB)
    t0 = time.monotonic()
    with bridge.waiting(30):
        rc, _ = _alloc(MIB)
    assert rc == Status.BUDGET
    assert time.monotonic() - t0 < 2.0
    assert core.last_wait()[1] == core.WAIT_ALL_WAITING
    msg = oom_message(DEV, MIB, rc, framework="cupy")
    assert (
        "Stopped waiting after" in msg
        and "every thread holding bridge memory" in msg
        and "holding bridge memory: MainThread 64.00 MiB" in msg
    )
    led.free(p)


# ---- the GIL ----
def test_a_wait_made_with_the_gil_held_releases_it(led):
    """A torch allocation can reach the core with the GIL held: the thread that
    would free is Python and needs the GIL to run."""
    import ctypes

    alloc_keeping_the_gil = bridge_alloc_fn(keep_gil=True)
    core.set_limit(DEV, 64 * MIB)
    held = threading.Event()

    def other():
        rc, p = _alloc(64 * MIB, S2, TAG_TORCH)
        held.set()
        time.sleep(0.2)  # Python code: runs only if the waiter let the GIL go
        _free(p, led.sd)

    t, out = _thread(other)
    held.wait(10)
    got = ctypes.c_void_p()
    t0 = time.monotonic()
    with bridge.waiting(10):
        rc = alloc_keeping_the_gil(DEV, 32 * MIB, S1, TAG_TORCH, ctypes.byref(got))
    took = time.monotonic() - t0
    _join(t, out)
    assert rc == Status.OK and got.value
    assert took < 5.0
    core.free(got.value)


# ---- Ctrl-C ----
def test_ctrl_c_interrupts_a_wait_on_the_main_thread_and_leaks_nothing(led):
    assert threading.current_thread() is threading.main_thread()
    core.set_limit(DEV, 64 * MIB)
    led.add_foreign(DEV, 64 * MIB)
    s0 = stats()
    live0 = core.live_records()
    main = threading.get_ident()

    def press_ctrl_c():
        _until(lambda: stats()["waiting"] == 1)
        time.sleep(0.05)
        signal.pthread_kill(main, signal.SIGINT)

    t, out = _thread(press_ctrl_c)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt), bridge.waiting(30):
        _alloc(MIB)
    took = time.monotonic() - t0
    _join(t, out)
    assert took < 5.0
    s = stats()
    assert core.last_wait()[1] == core.WAIT_INTERRUPTED
    assert s["num_wait_interrupts"] == s0["num_wait_interrupts"] + 1
    assert s["used"] == 0 and s["waiting"] == 0 and core.live_records() == live0


def _cupy_allocator(failures):
    """CuPy's C allocator of the core, with stand-ins for CuPy's types."""

    class Stream:
        ptr = S1

    def on_failure(size, device, stream, rc):
        failures.append(rc)
        raise MemoryError(f"refused: {rc}")

    return core.CupyAllocator(
        lambda: DEV,
        Stream,
        lambda ptr, size, owner, dev: (ptr, size, owner),
        lambda mem, offset: mem,
        on_failure,
    )


def test_ctrl_c_interrupts_a_cupy_allocation_waiting_on_the_main_thread(led):
    core.set_limit(DEV, 64 * MIB)
    led.add_foreign(DEV, 64 * MIB)
    failures: list = []
    alloc = _cupy_allocator(failures)
    main = threading.get_ident()

    def press_ctrl_c():
        _until(lambda: stats()["waiting"] == 1)
        signal.pthread_kill(main, signal.SIGINT)

    t, out = _thread(press_ctrl_c)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt), bridge.waiting(30):
        alloc(MIB)
    _join(t, out)
    assert time.monotonic() - t0 < 5.0
    assert failures == []  # KeyboardInterrupt, not CuPy's OOM path
    assert stats()["used"] == 0


def test_a_cupy_allocation_that_waits_in_vain_goes_to_the_oom_path(led):
    core.set_limit(DEV, 64 * MIB)
    led.add_foreign(DEV, 64 * MIB)
    failures: list = []
    alloc = _cupy_allocator(failures)
    with pytest.raises(MemoryError), bridge.waiting(0.05):
        alloc(MIB)
    assert failures == [Status.BUDGET]
    assert core.last_wait()[1] == core.WAIT_TIMEOUT


# ---- the recovery chain around a wait ----
def _recording_hook(on_collect=None):
    """A pressure callback that notes each call's stage and time; ``on_collect``
    plays the garbage collection finding something."""
    calls: list[tuple[int, float]] = []

    def hook(device, size, tag, stage):
        calls.append((stage, time.monotonic()))
        if stage != core.RELIEVE_CACHES and on_collect:
            on_collect()
        return True

    core.set_pressure_callback(hook)
    return calls


def _wait_for_main_threads_block(led, wait, free_after):
    """The main thread holds the budget and frees it ``free_after`` seconds after
    a worker began to wait for 32 MiB with ``wait``; the worker's (rc, p) and
    the outcome of its wait."""
    core.set_limit(DEV, 64 * MIB)
    held = led.ok(64 * MIB)

    def worker():
        with bridge.waiting(wait):
            return (*_alloc(32 * MIB, S2), core.last_wait()[1])

    t, out = _thread(worker)
    _until(lambda: stats()["waiting"] == 1)
    time.sleep(free_after)
    _free(held, led.sd)
    led.live.discard(held)
    rc, p, outcome = _join(t, out)
    if p:
        led.live.add(p)
    return rc, p, outcome


def test_a_waiter_runs_the_chain_without_the_collection_and_a_quick_free_spares_it(led):
    """Issue 18's benchmark: a gc.collect() before each wait cost every Python
    thread about 0.1 s at each wait, for waits of milliseconds."""
    calls = _recording_hook()
    rc, p, outcome = _wait_for_main_threads_block(led, wait=10, free_after=0.01)
    assert rc == Status.OK and p
    assert [stage for stage, _ in calls] == [core.RELIEVE_CACHES]
    assert outcome == core.WAIT_OK


def test_a_wait_past_the_grace_runs_the_collection_once(led):
    calls = _recording_hook()
    rc, p, outcome = _wait_for_main_threads_block(led, wait=10, free_after=0.5)
    assert rc == Status.OK and p and outcome == core.WAIT_OK
    assert [stage for stage, _ in calls] == [core.RELIEVE_CACHES, core.RELIEVE_COLLECT]
    assert calls[1][1] - calls[0][1] >= 0.09  # after the 100 ms grace, not at once


def test_without_a_wait_the_whole_chain_runs_at_once(led):
    calls = _recording_hook()
    core.set_limit(DEV, 64 * MIB)
    led.add_foreign(DEV, 64 * MIB)
    with bridge.waiting(0):
        assert _alloc(MIB) == (Status.BUDGET, 0)
    assert [stage for stage, _ in calls] == [core.RELIEVE_ALL]


@pytest.mark.parametrize("collection_frees", [True, False])
def test_a_wait_about_to_time_out_runs_the_collection_and_retries(led, collection_frees):
    """A wait shorter than the grace still gets the collection, before its refusal."""
    core.set_limit(DEV, 64 * MIB)
    garbage = [led.ok(64 * MIB)]  # held by a cycle only a collection breaks

    def collect():
        if collection_frees and garbage:
            led.free(garbage.pop())
            led.sd.standin_sync_all(DEV)

    calls = _recording_hook(collect)

    def worker():
        with bridge.waiting(0.03):
            return _alloc(MIB, S2)

    t, out = _thread(worker)
    rc, p = _join(t, out)
    assert [stage for stage, _ in calls] == [core.RELIEVE_CACHES, core.RELIEVE_COLLECT]
    if collection_frees:
        assert rc == Status.OK and p
        led.live.add(p)
    else:
        assert (rc, p) == (Status.BUDGET, 0)
        for q in garbage:
            led.free(q)


def test_a_lone_waiter_gets_the_collection_before_it_is_refused(led):
    """Every holder waiting ends the wait; the garbage of that very thread may be
    what holds the budget."""
    core.set_limit(DEV, 64 * MIB)
    garbage = [led.ok(64 * MIB)]
    calls = _recording_hook(lambda: garbage and led.free(garbage.pop()))
    t0 = time.monotonic()
    with bridge.waiting(30):
        rc, p = led.alloc(MIB)
    assert rc == Status.OK and p
    assert time.monotonic() - t0 < 2.0
    assert [stage for stage, _ in calls] == [core.RELIEVE_CACHES, core.RELIEVE_COLLECT]


def test_a_torch_waiter_without_the_gil_gets_its_stages_from_the_reliever(led):
    """A torch allocation from a thread without the GIL (autograd's) asks the
    reliever thread, which runs the stage it was asked for."""
    from bridge import recovery

    calls = _recording_hook()
    recovery._start_reliever()
    core.set_limit(DEV, 64 * MIB)
    led.add_foreign(DEV, 64 * MIB)
    with bridge.waiting(0.03):
        assert _alloc(MIB, tag=TAG_TORCH) == (Status.BUDGET, 0)  # core.alloc drops the GIL
    assert [stage for stage, _ in calls] == [core.RELIEVE_CACHES, core.RELIEVE_COLLECT]


@pytest.mark.parametrize(
    ("stage", "ran"),
    [
        ("RELIEVE_ALL", ["releaser", "collecting releaser", "gc", "callback"]),
        ("RELIEVE_CACHES", ["releaser", "callback"]),
        ("RELIEVE_COLLECT", ["collecting releaser", "gc"]),
    ],
)
def test_relieve_runs_the_part_of_the_chain_its_stage_names(standin, monkeypatch, stage, ran):
    from bridge import recovery

    seen: list[str] = []

    class Gc:
        @staticmethod
        def collect():
            seen.append("gc")

    monkeypatch.setattr(recovery, "gc", Gc)
    monkeypatch.setattr(recovery, "_releasers", {})
    recovery.register_releaser("x", lambda d, t: seen.append("releaser"))
    recovery.register_releaser(  # CuPy's FFT plan cache: its clear() collects
        "y", lambda d, t: seen.append("collecting releaser"), collects=True
    )
    monkeypatch.setattr(recovery, "_callbacks", [lambda d, n: seen.append("callback")])
    assert recovery.relieve(DEV, MIB, TAG_CUPY, getattr(core, stage)) is True
    assert seen == ran


# ---- captures ----
def test_no_wait_while_a_capture_runs_on_the_device(led):
    core.set_limit(DEV, 64 * MIB)
    led.add_foreign(DEV, 64 * MIB)
    assert core.capture(True, DEV) == Status.OK
    try:
        t0 = time.monotonic()
        with bridge.waiting(30):
            rc, _ = _alloc(MIB)
        assert rc == Status.BUDGET
        assert time.monotonic() - t0 < 1.0
        assert core.last_wait()[1] == core.WAIT_CAPTURE
    finally:
        assert core.capture(False, DEV) == Status.OK


# ---- settings ----
def test_waiting_restores_the_enclosing_setting(standin):
    assert core.thread_wait() == (False, 0.0, 0)
    with bridge.waiting(2.5, priority=3):
        assert core.thread_wait() == (True, 2.5, 3)
        with bridge.waiting(None):
            assert core.thread_wait() == (True, 0.0, 3)  # priority kept
        assert core.thread_wait() == (True, 2.5, 3)
    assert core.thread_wait() == (False, 0.0, 0)


def test_a_thread_setting_is_the_threads_own(standin):
    with bridge.waiting(7):
        t, out = _thread(core.thread_wait)
        assert _join(t, out) == (False, 0.0, 0)


@pytest.mark.parametrize("bad", [-1, float("nan"), "5", True])
def test_bad_wait_times_raise_valueerror_and_change_nothing(standin, bad):
    with pytest.raises(ValueError, match="seconds"), bridge.waiting(bad):
        pass
    assert core.thread_wait() == (False, 0.0, 0)


def test_bad_priority_raises_valueerror(standin):
    with pytest.raises(ValueError, match="priority"), bridge.waiting(1, priority=1.5):  # type: ignore[arg-type]
        pass
    assert core.thread_wait() == (False, 0.0, 0)


def test_unify_wait_sets_the_process_default(standin, monkeypatch):
    unify_mod = importlib.import_module("bridge.unify")

    monkeypatch.setattr(unify_mod, "_bridge", None)
    monkeypatch.delenv("BRIDGE_WAIT", raising=False)
    bridge.unify(cupy=False, torch=False, wait=1.5)
    assert core.get_wait() == 1.5
    bridge.unify(cupy=False, torch=False)  # None: what the earlier call set
    assert core.get_wait() == 1.5
    bridge.unify(cupy=False, torch=False, wait=0)
    assert core.get_wait() == 0.0
    monkeypatch.setenv("BRIDGE_WAIT", "0.25")
    bridge.unify(cupy=False, torch=False)
    assert core.get_wait() == 0.25


@pytest.mark.parametrize("raw", ["soon", "-1", "nan"])
def test_a_bad_environment_wait_names_the_variable_and_changes_nothing(standin, monkeypatch, raw):
    unify_mod = importlib.import_module("bridge.unify")

    monkeypatch.setattr(unify_mod, "_bridge", None)
    monkeypatch.setenv("BRIDGE_WAIT", raw)
    with pytest.raises(ValueError, match="BRIDGE_WAIT"):
        bridge.unify(cupy=False, torch=False)
    assert core.get_wait() == 0.0
    assert unify_mod._bridge is None


def test_unify_rejects_a_bad_wait_before_changing_anything(standin, monkeypatch):
    unify_mod = importlib.import_module("bridge.unify")

    monkeypatch.setattr(unify_mod, "_bridge", None)
    with pytest.raises(ValueError, match="wait=-2"):
        bridge.unify(cupy=False, torch=False, wait=-2)
    assert unify_mod._bridge is None and core.get_wait() == 0.0


def test_stats_report_waits(led):
    core.set_limit(DEV, 64 * MIB)
    led.add_foreign(DEV, 64 * MIB)
    before = bridge.stats(DEV)
    with bridge.waiting(0.1):
        _alloc(MIB)
    after = bridge.stats(DEV)
    assert after.num_waits == before.num_waits + 1
    assert after.num_wait_timeouts == before.num_wait_timeouts + 1
    assert after.wait_seconds >= before.wait_seconds + 0.1
    assert after.waiting == 0


if os.environ.get("BRIDGE_TEST_GPU") == "1":  # pragma: no cover
    pytestmark = pytest.mark.skip(reason="stand-in driver tests")
