# SPDX-License-Identifier: Apache-2.0
"""Issue 30's corners on the stand-in driver: captures the core cannot see, streams
destroyed under its feet, another device's default stream, graph blocks that outlive
their graph, CuPy's captures, synchronizations racing captures.

The stand-in models what was measured on an H200 (docs in tests/standin/standin_cuda.c):
a potentially unsafe call made in global capture mode while another thread captures
fails with 900 and invalidates that capture (counted: C_INVALIDATED), a device-wide
synchronization invalidates it in any mode, and a call given a destroyed stream's
handle is counted (C_DEAD; on a GPU it crashed the driver or named a new stream).
The GPU halves are in tests/gpu/test_gpu_corners.py.
"""

from __future__ import annotations

import ctypes
import threading
import time

import pytest

from bridge._errors import Status
from bridge._runtime import core

DEV = 0
MIB = 1 << 20
TORCH, CUPY = core.TAG_TORCH, core.TAG_CUPY
BEGIN, END, RELEASE = 0, 1, 2
C_ALLOC, C_FREE, C_SYNC, C_WAIT, C_RECORD = 0, 1, 2, 3, 4
C_INVALIDATED, C_DEAD = 13, 14
LEGACY = 1
XLA = 0xD1000  # a stream another library captures in global mode (the core cannot see it)
CAP = 0xD2000  # a torch capture stream (registered, as adapters/torch.py does)


@pytest.fixture
def sd(standin):
    for s in (XLA, CAP):
        standin.standin_adopt_stream(s, DEV)
    core.register_stream(CAP)
    live = core.live_records()
    yield standin
    standin.standin_set_global_capture(0, None)
    standin.standin_set_capturing(None)
    standin.standin_sync_all(DEV)
    core.forget_stream(CAP)
    assert core.live_records() == live
    s = stats()
    assert s["captures_active"] == 0 and s["num_deferred"] == 0


def stats(dev: int = DEV) -> dict:
    rc, s = core.stats(dev)
    assert rc == Status.OK
    return s


def new_stream(sd) -> int:
    """A stream made by CuPy or torch (the stand-in's cuStreamCreate, device 0's context)."""
    ctx = ctypes.c_void_p()
    sd.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), DEV)
    prev = ctypes.c_void_p()
    sd.cuCtxGetCurrent(ctypes.byref(prev))
    sd.cuCtxSetCurrent(ctx)
    s = ctypes.c_void_p()
    assert sd.cuStreamCreate(ctypes.byref(s), 0) == 0
    sd.cuCtxSetCurrent(prev)
    return int(s.value)


# ---- item 8: no driver call of the core invalidates a capture it cannot see ----
def test_a_trim_during_another_threads_global_capture_leaves_it_valid(sd):
    """bridge_trim synchronized the whole device (cuCtxSynchronize) and trimmed in the
    caller's mode: torch.cuda.empty_cache() during XLA's capture invalidated it."""
    rc, p = core.alloc(DEV, 4 * MIB, 0, TORCH)
    core.free(p)  # a free queued on the default stream
    bad = sd.standin_counter(C_INVALIDATED)
    sd.standin_set_global_capture(1, XLA)
    assert core.trim(DEV, 0) == Status.OK
    assert sd.standin_counter(C_INVALIDATED) == bad
    sd.standin_set_global_capture(0, None)
    # the queued free landed all the same (the legacy stream, not the device)
    assert stats()["pool_reserved"] == 0


def test_the_views_during_another_threads_global_capture_leave_it_valid(sd):
    """cuMemGetInfo (torch.cuda.mem_get_info, CuPy's memGetInfo under a budget) and
    the pool figures were asked in the caller's mode."""
    core.set_limit(DEV, 64 * MIB)
    try:
        bad = sd.standin_counter(C_INVALIDATED)
        sd.standin_set_global_capture(1, XLA)
        rc, info = core.mem_info(DEV)
        assert rc == Status.OK and info["total"] == 64 * MIB
        assert core.stats(DEV)[0] == Status.OK
        assert sd.standin_counter(C_INVALIDATED) == bad
    finally:
        sd.standin_set_global_capture(0, None)
        core.set_limit(DEV, 0)


def test_a_refused_allocation_during_another_threads_capture_syncs_nothing_captured(sd):
    """The refusal path synchronized the allocating stream whenever the core knew of
    no capture: a stream captured by XLA was synchronized, invalidating its capture."""
    core.set_limit(DEV, 4 * MIB)
    try:
        rc, p = core.alloc(DEV, 3 * MIB, XLA, CUPY)
        assert rc == Status.OK
        bad = sd.standin_counter(C_INVALIDATED)
        sd.standin_set_global_capture(1, XLA)
        assert core.alloc(DEV, 2 * MIB, XLA, CUPY)[0] == Status.BUDGET
        assert sd.standin_counter(C_INVALIDATED) == bad
        sd.standin_set_global_capture(0, None)
        core.free(p)
    finally:
        core.set_limit(DEV, 0)


# ---- item 4: frees on destroyed streams ----
def test_torch_blocks_on_destroyed_external_streams_never_reach_the_driver_by_handle(sd):
    """Thirty tensors on torch.cuda.ExternalStream(cupy_stream.ptr) outlive their CuPy
    streams, new streams are made in between (the driver hands the handles out again):
    every free is issued without the dead handles, none stays deferred, the ledger
    returns to where it was.  Before, the frees went to the dead handles (on an H200:
    a crash in cuStreamIsCapturing, or a free on a new stream that reused the handle)."""
    base = stats()["used"]
    dead = sd.standin_counter(C_DEAD)
    blocks = []
    for _ in range(30):
        s = new_stream(sd)
        rc, p = core.alloc(DEV, MIB, s, TORCH)
        assert rc == Status.OK
        blocks.append((p, s))
        assert sd.cuStreamDestroy_v2(s) == 0  # the CuPy stream goes first
        new_stream(sd)  # and a new one takes its handle
    for p, _ in blocks:
        core.free(p)
    assert sd.standin_counter(C_DEAD) == dead
    s = stats()
    assert s["used"] == base and s["num_deferred"] == 0
    for _, h in blocks:  # nothing was queued on a handle a new stream owns now
        assert sd.standin_pending_on(DEV, h) == 0
    assert sd.standin_pending_on(DEV, LEGACY) >= 30 * MIB
    assert core.trim(DEV, 0) == Status.OK
    assert stats()["pool_reserved"] == 0  # no leak in the pool either


def test_a_recorded_stream_that_was_destroyed_is_never_touched(sd):
    """record_stream(s) then s destroyed: the free's ordering step asked the driver
    about s (cuStreamIsCapturing, cuStreamGetCtx, cuEventRecord)."""
    s = new_stream(sd)
    rc, p = core.alloc(DEV, MIB, 0, TORCH)
    assert core.record_stream(p, s) == Status.OK
    assert sd.cuStreamDestroy_v2(s) == 0
    dead = sd.standin_counter(C_DEAD)
    core.free(p)
    assert sd.standin_counter(C_DEAD) == dead
    assert stats()["num_deferred"] == 0 and stats()["used"] == 0


def test_a_free_the_driver_refuses_for_a_stream_never_stays_deferred(sd):
    """A stream whose capture status cannot be read counted as capturing: the block
    stayed deferred for good (reserved leaked, every *_cached fast path turned off)."""
    rc, p = core.alloc(DEV, MIB, XLA, CUPY)  # CuPy's blocks hold their stream: freed on it
    rc2, q = core.alloc(DEV, MIB, 0, TORCH)
    pool = (0x30, 4)
    core.graph(BEGIN, DEV, *pool)  # a capture runs elsewhere
    sd.standin_fail(b"cuMemFreeAsync", 400, 1)  # the handle is unusable
    core.free(p)
    core.graph(END, DEV, *pool)
    core.free(q)
    s = stats()
    assert s["num_deferred"] == 0 and s["used"] == 0
    core.graph(RELEASE, DEV, *pool)


# ---- item 2 is in tests/pinned/test_pinned.py (the pinned pool's fixtures) ----


# ---- item 5: graph blocks alive at the release ----
def test_a_released_graphs_static_output_is_freed_after_a_device_sync_never_at_the_free(sd):
    """After `del g`, a static output read on the default stream and then freed was
    cached on the capture stream and handed to its next allocation, with no ordering
    after the default stream's read.  A replay may also still write it on a stream
    nobody registered (issue 61): its free waits for a device-wide synchronization,
    made by the next trim or refusal, never at the release or the free."""
    core.set_cache(DEV, 64 * MIB)
    try:
        pool = (0x31, 0)
        core.graph(BEGIN, DEV, *pool)
        rc, out = core.alloc_graph(DEV, 2 * MIB, TORCH, *pool, CAP)
        assert rc == Status.OK
        core.graph(END, DEV, *pool)
        syncs = sd.standin_counter(C_SYNC)
        core.graph(RELEASE, DEV, *pool)  # del g
        core.free(out)  # read on the default stream, then dropped
        assert sd.standin_counter(C_SYNC) == syncs  # no host wait, at the release or the free
        rc, new = core.alloc(DEV, 2 * MIB, CAP, TORCH)
        assert new != out  # not the cache's, nor the pool's yet
        s = stats()
        assert s["num_deferred"] == 1 and s["cached"] == 0
        frees = sd.standin_counter(C_FREE)
        assert core.trim(DEV, 0) == Status.OK  # torch.cuda.empty_cache()
        assert sd.standin_counter(C_SYNC) > syncs and sd.standin_counter(C_FREE) == frees + 1
        assert stats()["num_deferred"] == 0
        core.free(new)
    finally:
        core.set_cache(DEV, 0)


# ---- item 9: races of captures with synchronizations and releases ----
def test_a_capture_announced_during_a_synchronization_begins_after_it(sd):
    """captures_active was read, then the device synchronized: a capture that began
    in between ran into the synchronization (invalidated).  Now a capture announced
    while a synchronization of the core is under way begins after it ends."""
    sd.standin_hold_syncs(1)
    trim = threading.Thread(target=core.trim, args=(DEV, 0))  # torch.cuda.empty_cache()
    trim.start()
    try:
        deadline = time.monotonic() + 5
        while sd.standin_syncs_waiting() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sd.standin_syncs_waiting() == 1  # the trim is inside a synchronization
        pool = (0x32, 0)
        begun = threading.Event()

        def begin() -> None:
            core.graph(BEGIN, DEV, *pool)  # torch's capture_begin hook
            begun.set()  # torch begins the capture in the driver after this

        capture = threading.Thread(target=begin)
        capture.start()
        assert not begun.wait(0.3)  # it waits for the synchronization ...
        sd.standin_hold_syncs(0)
        assert begun.wait(5)  # ... and begins once it ended
        capture.join(5)
        core.graph(END, DEV, *pool)
        core.graph(RELEASE, DEV, *pool)
    finally:
        sd.standin_hold_syncs(0)
        trim.join(10)


def _flags(ptr: int) -> int:
    for b in core.live_blocks():
        if b[0] == ptr:
            return b[5]
    return -1


def test_a_pool_begun_again_during_its_release_keeps_its_new_blocks(sd):
    """bridge_graph_release dropped the pool, unlocked, synchronized, then swept the
    table for blocks of its id: a capture that began a pool with the same id in
    between had its new graph blocks turned into ordinary ones (freed at once, then
    reused while its replays still wrote them)."""
    pool = (0x33, 0)
    stop = threading.Event()
    errors: list[str] = []

    def capture_again() -> None:
        while not stop.is_set():
            assert core.graph(BEGIN, DEV, *pool) == Status.OK
            rc, p = core.alloc_graph(DEV, 4096, TORCH, *pool, CAP)
            assert rc == Status.OK
            core.graph(END, DEV, *pool)
            if _flags(p) != 1:  # REC_GRAPH, while this capture holds the pool
                errors.append(f"a new capture's block has flags {_flags(p)}")
            core.free(p)
            core.graph(RELEASE, DEV, *pool)

    t = threading.Thread(target=capture_again)
    t.start()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and not errors:
        assert core.graph(BEGIN, DEV, *pool) == Status.OK
        rc, q = core.alloc_graph(DEV, 8192, TORCH, *pool, CAP)
        core.graph(END, DEV, *pool)
        core.free(q)
        core.graph(RELEASE, DEV, *pool)
    stop.set()
    t.join(10)
    assert not errors
    assert stats()["graph_bytes"] == 0
    assert core.trim(DEV, 0) == Status.OK  # the released pools' blocks, held until a sync
    assert stats()["num_deferred"] == 0


# ---- item 1: another device's default stream ----
def test_a_free_on_the_default_stream_recorded_on_another_device_waits_there(sd):
    """x on cuda:0's default stream, x.record_stream(s1) with s1 on cuda:1: the wait
    for s1 was issued with cuda:1's context current, so handle 0 meant cuda:1's
    default stream and cuda:0's was never ordered after s1."""
    s1 = int(sd.standin_new_stream(1))
    core.register_stream(s1)  # a torch stream of cuda:1
    try:
        rc, p = core.alloc(DEV, MIB, 0, TORCH)
        assert core.record_stream(p, s1) == Status.OK
        waits = sd.standin_counter(C_WAIT)
        core.free(p)
        assert sd.standin_counter(C_WAIT) == waits + 1
        dev = ctypes.c_int(-1)
        assert not sd.standin_last_wait(ctypes.byref(dev))  # the default stream (handle 0) ...
        assert dev.value == DEV  # ... of cuda:0, the block's device
    finally:
        core.forget_stream(s1)
