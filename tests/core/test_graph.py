# SPDX-License-Identifier: Apache-2.0
"""CUDA graph pools in the core (graph.c), on the stand-in driver.

The hooks torch calls (begin / end / release a pool, allocate into it) are
driven directly; tests/gpu/test_gpu_graphs.py runs the same semantics through
torch on a GPU, against native torch.
"""

from __future__ import annotations

import ctypes

import pytest

from bridge._errors import Status
from bridge._runtime import core

DEV = 0
MIB = 1 << 20
TORCH, CUPY = core.TAG_TORCH, core.TAG_CUPY
BEGIN, END, RELEASE = 0, 1, 2
CAP, OTHER = 0xC1000, 0xC2000  # a capture stream and another stream
C_ALLOC, C_FREE, C_SYNC, C_WAIT = 0, 1, 2, 3
LEGACY = 1  # CU_STREAM_LEGACY


@pytest.fixture
def sd(standin):
    for s in (CAP, OTHER):
        standin.standin_adopt_stream(s, DEV)
    live = core.live_records()
    yield standin
    standin.standin_set_capturing(None)
    # a released pool's blocks wait for a device-wide synchronization: a trim makes it
    core.trim(DEV, 0)
    standin.standin_sync_all(DEV)
    assert core.live_records() == live
    assert core.stats(DEV)[1]["captures_active"] == 0


def stats() -> dict:
    rc, s = core.stats(DEV)
    assert rc == Status.OK
    return s


def galloc(size: int, pool: tuple[int, int], stream: int = CAP) -> int:
    rc, p = core.alloc_graph(DEV, size, TORCH, *pool, stream)
    assert rc == Status.OK and p
    return p


def test_a_shared_pool_lives_until_its_last_graph_is_released(sd):
    """Issue: the first release freed the second graph's temporaries (84 M elements
    of later tensors overwritten on replay)."""
    pool = (0x51, 0)
    assert core.graph(BEGIN, DEV, *pool) == Status.OK  # g1 captured into the pool
    a = galloc(4 * MIB, pool)
    core.free(a)  # a temporary of g1: stays with the pool
    assert core.graph(END, DEV, *pool) == Status.OK
    assert core.graph(BEGIN, DEV, *pool) == Status.OK  # g2 shares it
    b = galloc(8 * MIB, pool)
    core.free(b)  # a temporary of g2
    assert core.graph(END, DEV, *pool) == Status.OK
    frees = sd.standin_counter(C_FREE)
    assert core.graph(RELEASE, DEV, *pool) == Status.OK  # del g1
    assert sd.standin_counter(C_FREE) == frees  # g2 still replays into both blocks
    assert stats()["graph_bytes"] == 12 * MIB
    assert core.graph(RELEASE, DEV, *pool) == Status.OK  # del g2
    # out of the pool, held until a device-wide synchronization (a replay of g2
    # may still run on any stream)
    s = stats()
    assert s["graph_bytes"] == 0 and s["num_deferred"] == 2 and s["used"] == 12 * MIB
    assert sd.standin_counter(C_FREE) == frees
    assert core.trim(DEV, 0) == Status.OK  # torch.cuda.empty_cache()
    assert sd.standin_counter(C_FREE) == frees + 2
    assert stats()["used"] == 0


def test_freed_graph_blocks_are_reused_within_the_pool(sd):
    """Issue: a captured loop of 10 x (allocate 64 MiB, free) kept 640 MiB."""
    pool = (0x52, 0)
    core.graph(BEGIN, DEV, *pool)
    allocs = sd.standin_counter(C_ALLOC)
    seen = set()
    for _ in range(10):
        p = galloc(64 * MIB, pool)
        seen.add(p)
        core.free(p)
    assert len(seen) == 1
    assert sd.standin_counter(C_ALLOC) == allocs + 1
    s = stats()
    assert s["graph_bytes"] == 64 * MIB and s["used"] == 64 * MIB
    # a smaller request fits a freed block up to twice its size; a tiny one does not
    q = galloc(40 * MIB, pool)
    assert q in seen
    r = galloc(MIB, pool)
    assert r not in seen
    core.free(q)
    core.free(r)
    core.graph(END, DEV, *pool)
    core.graph(RELEASE, DEV, *pool)
    assert core.trim(DEV, 0) == Status.OK
    assert stats()["used"] == 0


def test_reuse_stays_on_the_capturing_stream(sd):
    pool = (0x53, 0)
    core.graph(BEGIN, DEV, *pool)
    p = galloc(MIB, pool, stream=CAP)
    core.free(p)
    q = galloc(MIB, pool, stream=OTHER)  # another stream of the capture: no order with p's users
    assert q != p
    r = galloc(MIB, pool, stream=CAP)
    assert r == p
    for x in (q, r):
        core.free(x)
    core.graph(END, DEV, *pool)
    core.graph(RELEASE, DEV, *pool)


def test_a_block_with_recorded_streams_is_not_reused(sd):
    pool = (0x54, 0)
    core.graph(BEGIN, DEV, *pool)
    p = galloc(MIB, pool)
    assert core.record_stream(p, OTHER) == Status.OK
    core.free(p)
    q = galloc(MIB, pool)
    assert q != p
    core.free(q)
    core.graph(END, DEV, *pool)
    core.graph(RELEASE, DEV, *pool)


def test_pools_do_not_share_blocks(sd):
    g1, g2 = (0x55, 0), (0x56, 0)
    core.graph(BEGIN, DEV, *g1)
    p = galloc(MIB, g1)
    core.free(p)
    core.graph(END, DEV, *g1)
    core.graph(BEGIN, DEV, *g2)
    q = galloc(MIB, g2)
    assert q != p
    core.free(q)
    core.graph(END, DEV, *g2)
    for g in (g1, g2):
        core.graph(RELEASE, DEV, *g)


def test_a_live_graph_block_is_freed_after_a_device_wide_synchronization(sd):
    """A static output that outlives its graph: a replay of the graph may still write
    it on any stream (one the core cannot name included), so its free waits for a
    device-wide synchronization, as torch's private pool gives it back through
    cudaFree; never cached."""
    pool = (0x5C, 0)
    core.graph(BEGIN, DEV, *pool)
    p = galloc(2 * MIB, pool)
    core.graph(END, DEV, *pool)
    core.graph(RELEASE, DEV, *pool)
    core.register_stream(CAP)
    core.set_cache(DEV, 64 * MIB)
    try:
        frees, syncs = sd.standin_counter(C_FREE), sd.standin_counter(C_SYNC)
        core.free(p)
        s = stats()
        assert s["cached"] == 0 and s["num_deferred"] == 1 and s["used"] == 2 * MIB
        assert sd.standin_counter(C_FREE) == frees
        assert core.trim(DEV, 0) == Status.OK
        assert sd.standin_counter(C_SYNC) > syncs and sd.standin_counter(C_FREE) == frees + 1
        assert stats()["used"] == 0
    finally:
        core.set_cache(DEV, 0)
        core.forget_stream(CAP)


def test_a_routed_pools_live_block_is_freed_after_its_stream_and_the_default_stream(sd):
    """Issue: such blocks were recorded on the bridge's idle side stream, so their
    free completed at once while the capture stream's kernels still read them; then
    (issue 30, item 5) they were freed and cached on the capture stream alone, with
    no ordering after the default stream that read the static output.  A pool only
    routings used (torch.cuda.use_mem_pool) has no graph replaying into it: its
    blocks need no device-wide synchronization."""
    pool = (0x57, 0)
    assert core.graph_begin_on(DEV, *pool, CAP, False) == Status.OK  # use_mem_pool
    p = galloc(2 * MIB, pool)  # a block that outlives the pool
    core.graph(END, DEV, *pool)
    syncs = sd.standin_counter(C_SYNC)
    core.graph(RELEASE, DEV, *pool)
    sd.standin_sync_all(DEV)
    core.register_stream(CAP)
    core.set_cache(DEV, 64 * MIB)
    try:
        waits = sd.standin_counter(C_WAIT)
        core.free(p)
        assert stats()["cached"] == 0  # never handed to the next allocation on CAP
        # the legacy stream (after every blocking stream: the default stream that
        # read it) waits for the capture stream, then frees it
        assert sd.standin_pending_on(DEV, LEGACY) == 2 * MIB
        assert sd.standin_counter(C_WAIT) == waits + 1
        dev = ctypes.c_int(-1)
        assert sd.standin_last_wait(ctypes.byref(dev)) == LEGACY and dev.value == DEV
        assert sd.standin_counter(C_SYNC) == syncs  # and the host never waited
    finally:
        core.set_cache(DEV, 0)
        core.forget_stream(CAP)


def test_an_empty_cache_during_a_capture_frees_nothing_on_the_captured_stream(sd):
    """Issue: flushing the cache during a capture freed blocks on the capturing
    stream (a free node in the user's graph, or a failure and a device sync)."""
    core.register_stream(CAP)
    core.set_cache(DEV, 64 * MIB)
    try:
        rc, cached = core.alloc(DEV, 3 * MIB, CAP, TORCH)
        rc2, other = core.alloc(DEV, MIB, OTHER, CUPY)
        core.free(cached)  # cached on CAP
        assert stats()["cached"] == 3 * MIB
        pool = (0x58, 0)
        core.graph(BEGIN, DEV, *pool)
        sd.standin_set_capturing(CAP)
        syncs = sd.standin_counter(2)
        assert core.trim(DEV, 0) == Status.OK  # torch.cuda.empty_cache() from any thread
        s = stats()
        assert s["cached"] == 0 and s["num_deferred"] == 1  # held back, not freed on CAP
        assert s["num_driver_errors"] == stats()["num_driver_errors"]
        assert sd.standin_counter(2) == syncs  # and no synchronization
        frees = sd.standin_counter(C_FREE)
        core.free(other)  # a block of another stream: freed at once, capture or not
        assert stats()["num_deferred"] == 1
        assert sd.standin_counter(C_FREE) == frees + 1
        sd.standin_set_capturing(None)
        core.graph(END, DEV, *pool)  # the end hook issues what was held back
        assert stats()["num_deferred"] == 0
        core.graph(RELEASE, DEV, *pool)
    finally:
        core.set_cache(DEV, 0)
        core.forget_stream(CAP)


def test_deferred_frees_return_within_one_free_after_the_capture(sd):
    pool = (0x59, 0)
    ptrs = [core.alloc(DEV, MIB, OTHER, CUPY)[1] for _ in range(5)]
    core.graph(BEGIN, DEV, *pool)
    sd.standin_set_capturing(OTHER)  # a capture the end hook does not see end yet
    for p in ptrs[:4]:
        core.free(p)
    core.graph(END, DEV, *pool)
    assert stats()["num_deferred"] == 4
    sd.standin_set_capturing(None)
    core.free(ptrs[4])  # the first free after it: every deferred free goes
    s = stats()
    assert s["num_deferred"] == 0 and s["used"] == 0
    core.graph(RELEASE, DEV, *pool)


def test_a_cupy_capture_allocates_outside_the_captured_stream(sd):
    """CuPy's Stream.begin_capture, told to the core: an allocation on the captured
    stream is made on the side stream (no node in the user's graph)."""
    assert core.capture(True, DEV) == Status.OK
    sd.standin_set_capturing(CAP)
    rc, p = core.alloc(DEV, MIB, CAP, CUPY)  # the stand-in fails allocations on CAP
    assert rc == Status.OK and p
    core.free(p)  # deferred: the capture runs
    assert stats()["num_deferred"] == 1
    sd.standin_set_capturing(None)
    assert core.capture(False, DEV) == Status.OK  # issued at the end
    assert stats()["num_deferred"] == 0
    assert core.capture(False, DEV) == Status.INVALID  # no capture left to end


def test_releasing_a_pool_during_another_capture_waits_for_it(sd):
    g1, g2 = (0x5A, 0), (0x5B, 0)
    core.graph(BEGIN, DEV, *g1)
    p = galloc(MIB, g1)
    core.free(p)
    core.graph(END, DEV, *g1)
    core.graph(BEGIN, DEV, *g2)  # a capture runs, on the same capture stream
    core.register_stream(CAP)  # torch's capture streams are (adapters/torch.py)
    sd.standin_set_capturing(CAP)
    syncs = sd.standin_counter(2)
    frees = sd.standin_counter(C_FREE)
    core.graph(RELEASE, DEV, *g1)
    assert sd.standin_counter(2) == syncs  # no device sync during the capture
    assert sd.standin_counter(C_FREE) == frees
    assert stats()["num_deferred"] == 1
    sd.standin_set_capturing(None)
    core.graph(END, DEV, *g2)
    # held until a device-wide synchronization (g1's replay may run on any stream),
    # which the next trim or refusal makes now that no capture runs
    assert sd.standin_counter(C_FREE) == frees and stats()["num_deferred"] == 1
    assert core.trim(DEV, 0) == Status.OK
    assert sd.standin_counter(C_FREE) == frees + 1
    assert sd.standin_counter(2) > syncs
    assert stats()["graph_bytes"] == 0 and stats()["num_deferred"] == 0
    core.graph(RELEASE, DEV, *g2)
    core.forget_stream(CAP)


def test_a_cupy_captures_temporaries_stay_with_its_graph_until_it_is_released(sd):
    """Issue 30, item 3: arrays a CuPy capture allocated and freed (temporaries) went
    back to the pool at end_capture while Graph.launch() still read and wrote them;
    CuPy's own MemoryAsyncPool keeps them for the graph.  A CuPy capture now has a
    graph pool of its own, released when its graph is gone (bind_graph, below)."""
    rc, pool = core.capture_stream(True, DEV, OTHER)
    assert rc == Status.OK and pool
    sd.standin_set_capturing(OTHER)
    frees = sd.standin_counter(C_FREE)
    rc, tmp = core.alloc(DEV, 4 * MIB, OTHER, CUPY)  # a temporary of the captured work
    assert rc == Status.OK and tmp
    assert core.alloc_cached(DEV, 4 * MIB, OTHER, CUPY)[0] == Status.MISS  # never the cache's
    core.free(tmp)  # freed inside the capture
    rc, out = core.alloc(DEV, MIB, OTHER, CUPY)  # the graph's output, kept by the user
    sd.standin_set_capturing(None)
    assert core.capture_stream(False, DEV, pool)[0] == Status.OK  # end_capture
    assert sd.standin_counter(C_FREE) == frees  # nothing went back to the pool
    assert stats()["graph_bytes"] == 4 * MIB
    rc, new = core.alloc(DEV, 4 * MIB, OTHER, CUPY)  # new arrays on the stream meanwhile
    assert new != tmp
    core.free(new)
    assert core.graph(RELEASE, DEV, core.CUPY_POOL, pool) == Status.OK  # the Graph died
    assert stats()["graph_bytes"] == 0
    core.free(out)  # the output outlives its graph: an ordinary block now
    # a launch of the graph may still run: given back after a device-wide sync
    assert core.trim(DEV, 0) == Status.OK
    assert sd.standin_counter(C_FREE) >= frees + 3
    assert stats()["used"] == 0


# ---- a CuPy graph's end, told by a user object the captured graph owns ----
def cupy_capture(sd, stream: int = OTHER, temp: int = 4 * MIB, bind: bool = True):
    """CuPy's Stream.begin_capture .. end_capture in the adapter's order: the core's pool,
    the driver's capture, a temporary freed inside it, the pool bound to the graph being
    captured, the capture ended.  -> (pool, the driver's graph)."""
    rc, pool = core.capture_stream(True, DEV, stream)
    assert rc == Status.OK and pool
    assert sd.cuStreamBeginCapture_v2(stream, 2) == 0
    rc, tmp = core.alloc(DEV, temp, stream, CUPY)
    assert rc == Status.OK and tmp
    core.free(tmp)  # stays with the graph
    if bind:
        assert core.bind_graph(DEV, pool, stream) == Status.OK
    g = ctypes.c_void_p()
    assert sd.cuStreamEndCapture(stream, ctypes.byref(g)) == 0 and g.value
    assert core.capture_stream(False, DEV, pool)[0] == Status.OK
    return pool, g


def instantiate(sd, g) -> ctypes.c_void_p:
    x = ctypes.c_void_p()
    assert sd.cuGraphInstantiateWithFlags(ctypes.byref(x), g, 0) == 0 and x.value
    return x


def test_a_cupy_graph_that_is_gone_releases_its_pool_once_its_destructor_ran(sd):
    """Issue (H200, CuPy 14.2): CuPy's Graph has neither _add_ref nor weak references, so
    its pool was kept for good (graph_bytes 32 MiB after `del g; gc.collect()`).  The
    captured graph now owns a user object; its destructor (after the graph, its exec and
    the exec's launch are gone) lets the next collect release the pool, exactly once."""
    used = stats()["used"]
    pool, g = cupy_capture(sd)
    x = instantiate(sd, g)
    assert sd.cuGraphLaunch(x, OTHER) == 0
    assert stats()["graph_bytes"] == 4 * MIB
    sd.standin_hold_destructors(1)
    assert sd.cuGraphDestroy(g) == 0  # the exec still holds a reference
    assert sd.cuGraphExecDestroy(x) == 0  # its launch has not completed
    assert sd.standin_live_user_objects() == 1
    sd.standin_complete_events()  # the launch completed: the destructor is due
    assert sd.standin_live_user_objects() == 0 and sd.standin_queued_destructors() == 1
    assert core.graph_collect() == []  # not before the destructor ran
    assert stats()["graph_bytes"] == 4 * MIB
    sd.standin_hold_destructors(0)
    sd.standin_wait_destructors()  # it ran, on the stand-in's destructor thread
    s = stats()  # the figures collect
    assert s["graph_bytes"] == 0 and s["used"] == used
    assert core.graph_collect() == [(DEV, pool)]  # told once
    assert core.graph_collect() == []  # collecting twice is harmless


def test_a_cupy_graph_that_lives_keeps_its_pool(sd):
    pool, g = cupy_capture(sd)
    x = instantiate(sd, g)
    assert sd.cuGraphDestroy(g) == 0  # the exec lives on (CuPy keeps both)
    sd.standin_wait_destructors()
    assert core.trim(DEV, 0) == Status.OK  # a trim collects too
    assert core.graph_collect() == []
    assert stats()["graph_bytes"] == 4 * MIB
    assert sd.cuGraphExecDestroy(x) == 0
    sd.standin_wait_destructors()
    assert core.graph_collect() == [(DEV, pool)]
    assert stats()["graph_bytes"] == 0


def test_a_pool_is_bound_once_and_only_to_its_capturing_stream(sd):
    rc, pool = core.capture_stream(True, DEV, OTHER)
    assert rc == Status.OK
    assert core.bind_graph(DEV, pool, OTHER) == Status.INVALID  # the driver does not capture
    assert sd.cuStreamBeginCapture_v2(OTHER, 2) == 0
    assert core.bind_graph(DEV, pool, CAP) == Status.INVALID  # another stream's
    assert core.bind_graph(DEV, pool + 1000, OTHER) == Status.INVALID  # no such pool
    assert core.bind_graph(DEV, pool, OTHER) == Status.OK
    assert core.bind_graph(DEV, pool, OTHER) == Status.INVALID  # bound already
    g = ctypes.c_void_p()
    assert sd.cuStreamEndCapture(OTHER, ctypes.byref(g)) == 0
    assert core.capture_stream(False, DEV, pool)[0] == Status.OK
    assert sd.cuGraphDestroy(g) == 0
    sd.standin_wait_destructors()
    assert core.graph_collect() == [(DEV, pool)]


def test_a_failed_capture_bound_to_its_graph_is_released_once(sd):
    """An invalidated capture: cuStreamEndCapture fails and destroys the graph, whose
    user object's destructor releases the pool; the adapter releases nothing itself."""
    rc, pool = core.capture_stream(True, DEV, OTHER)
    assert sd.cuStreamBeginCapture_v2(OTHER, 2) == 0
    rc, tmp = core.alloc(DEV, MIB, OTHER, CUPY)
    core.free(tmp)
    assert core.bind_graph(DEV, pool, OTHER) == Status.OK
    sd.standin_invalidate_capture()
    g = ctypes.c_void_p()
    assert sd.cuStreamEndCapture(OTHER, ctypes.byref(g)) == 901 and not g.value
    assert core.capture_stream(False, DEV, pool)[0] == Status.OK
    sd.standin_wait_destructors()
    assert core.graph_collect() == [(DEV, pool)]
    assert stats()["graph_bytes"] == 0
    # invalidated before the bind: no graph to bind to, the caller releases
    rc, pool = core.capture_stream(True, DEV, OTHER)
    assert sd.cuStreamBeginCapture_v2(OTHER, 2) == 0
    sd.standin_invalidate_capture()
    assert core.bind_graph(DEV, pool, OTHER) == Status.INVALID
    assert sd.cuStreamEndCapture(OTHER, ctypes.byref(g)) == 901
    assert core.capture_stream(False, DEV, pool)[0] == Status.OK
    assert core.graph(RELEASE, DEV, core.CUPY_POOL, pool) == Status.OK
    assert core.graph_collect() == []


@pytest.mark.parametrize("entry", [b"cuUserObjectCreate", b"cuGraphRetainUserObject"])
def test_a_bind_the_driver_refuses_leaves_the_release_to_the_caller(sd, entry):
    """An older driver, or one out of memory: DRIVER, and the pool is the caller's to
    release (the adapter's fallbacks); the orphaned user object's destructor releases
    nothing."""
    sd.standin_fail(entry, 999, 1)
    rc, pool = core.capture_stream(True, DEV, OTHER)
    assert sd.cuStreamBeginCapture_v2(OTHER, 2) == 0
    rc, tmp = core.alloc(DEV, MIB, OTHER, CUPY)
    core.free(tmp)
    assert core.bind_graph(DEV, pool, OTHER) == Status.DRIVER
    g = ctypes.c_void_p()
    assert sd.cuStreamEndCapture(OTHER, ctypes.byref(g)) == 0
    assert core.capture_stream(False, DEV, pool)[0] == Status.OK
    assert sd.cuGraphDestroy(g) == 0
    sd.standin_wait_destructors()
    assert sd.standin_live_user_objects() == 0
    assert core.graph_collect() == []
    assert stats()["graph_bytes"] == MIB
    assert core.graph(RELEASE, DEV, core.CUPY_POOL, pool) == Status.OK  # the fallback's
    assert stats()["graph_bytes"] == 0


def test_a_refusal_takes_a_dead_cupy_graphs_memory_before_it_is_an_oom(sd):
    """torch's allocator has no Python: the core's refusal path collects the pools of
    CuPy graphs that died before it declares an OOM."""
    pool, g = cupy_capture(sd, temp=6 * MIB)
    assert sd.cuGraphDestroy(g) == 0
    sd.standin_wait_destructors()  # dead, not collected: nothing read the figures
    assert core.set_limit(DEV, 8 * MIB) == Status.OK
    try:
        rc, p = core.alloc(DEV, 4 * MIB, CAP, TORCH)
        assert rc == Status.OK and p
        assert core.graph_collect() == [(DEV, pool)]
        core.free(p)
    finally:
        core.set_limit(DEV, 0)
    assert stats()["graph_bytes"] == 0


def test_destructors_on_another_thread_while_threads_allocate(sd):
    """The driver's thread runs the destructors (pushing onto a lock-free stack) while
    other threads allocate, free and read the figures (which collect)."""
    import threading

    stop = threading.Event()
    errors: list[BaseException] = []

    def churn(stream: int) -> None:
        try:
            while not stop.is_set():
                rc, p = core.alloc(DEV, 64 << 10, stream, TORCH)
                assert rc == Status.OK
                core.free(p)
                stats()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    streams = (0xC3000, 0xC4000)
    for s in streams:
        sd.standin_adopt_stream(s, DEV)
    threads = [threading.Thread(target=churn, args=(s,)) for s in streams]
    for t in threads:
        t.start()
    pools = set()
    try:
        for i in range(50):
            pool, g = cupy_capture(sd, temp=MIB)
            pools.add(pool)
            x = instantiate(sd, g)
            assert sd.cuGraphLaunch(x, OTHER) == 0
            assert sd.cuGraphExecDestroy(x) == 0
            assert sd.cuGraphDestroy(g) == 0
            if i % 4 == 0:
                sd.standin_complete_events()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    sd.standin_complete_events()
    sd.standin_wait_destructors()
    released = set()
    for _ in range(3):
        released |= {p for d, p in core.graph_collect() if d == DEV}
    assert released == pools
    assert stats()["graph_bytes"] == 0


# ---- a release ordered after replays on any stream (issue 61) ----
C_UNORDERED = 15


@pytest.mark.parametrize("registered", [True, False], ids=["torch-stream", "external-stream"])
def test_a_released_pools_blocks_wait_for_a_replay_on_any_stream(sd, registered):
    """Issue 61, item 3: the release ordered its frees after the legacy and capture
    streams only; torch replays on the current stream, which may be non-blocking (the
    legacy stream does not wait for it).  Then only after registered streams (torch's
    pooled ones) by events: a replay on a stream nobody registered
    (torch.cuda.ExternalStream) still wrote the pool's memory given back.  Now the
    pool's blocks are held until a device-wide synchronization, as torch's release
    gives a private pool back through cudaFree: never handed out before it, in
    `used` meanwhile, and given back by the recovery chain before a refusal."""
    replay = sd.standin_new_stream_flags(DEV, 1)  # non-blocking
    if registered:
        core.register_stream(replay)
    try:
        pool = (0x71, 0)
        core.graph(BEGIN, DEV, *pool)
        tmp = galloc(4 * MIB, pool)
        core.free(tmp)  # a temporary of the graph: stays with the pool
        core.graph(END, DEV, *pool)
        sd.standin_launch(replay, tmp, DEV)  # g.replay() on it, still running
        unordered, syncs = sd.standin_counter(C_UNORDERED), sd.standin_counter(C_SYNC)
        frees = sd.standin_counter(C_FREE)
        core.graph(RELEASE, DEV, *pool)  # del g
        assert sd.standin_counter(C_FREE) == frees  # nothing given back yet
        assert sd.standin_counter(C_SYNC) == syncs  # and no host wait at the release
        s = stats()
        assert s["graph_bytes"] == 0 and s["used"] == 4 * MIB and s["num_deferred"] == 1
        # new work meanwhile never gets the pool's bytes
        rc, p = core.alloc(DEV, 4 * MIB, OTHER, TORCH)
        assert rc == Status.OK and p != tmp
        # a refusal: the recovery chain synchronizes and gives them back first
        core.set_limit(DEV, 12 * MIB)
        rc, q = core.alloc(DEV, 8 * MIB, OTHER, TORCH)
        assert rc == Status.OK and q
        assert sd.standin_counter(C_SYNC) > syncs
        assert sd.standin_queued_kernels() == 0  # the replay was done before
        assert sd.standin_counter(C_UNORDERED) == unordered
        s = stats()
        assert s["num_deferred"] == 0 and s["used"] == 12 * MIB
        core.free(p)
        core.free(q)
    finally:
        core.set_limit(DEV, 0)
        if registered:
            core.forget_stream(replay)
        sd.standin_sync_all(DEV)


# ---- a capture that failed without its end hook (issue 61, item 4) ----
def begin_capture(sd, pool, stream=CAP):
    """torch's capture_begin: the begin hook, then cuStreamBeginCapture."""
    assert core.graph(BEGIN, DEV, *pool) == Status.OK
    assert sd.cuStreamBeginCapture_v2(stream, 2) == 0


def fail_capture(sd, stream=CAP):
    """An .item() inside torch.cuda.graph: the capture is invalidated, and torch
    2.11's capture_end raises at cudaStreamEndCapture, before its end hook; its
    reset never releases the pool of a capture that did not end well."""
    sd.standin_invalidate_capture()
    g = ctypes.c_void_p()
    assert sd.cuStreamEndCapture(stream, ctypes.byref(g)) == 901 and not g.value


def test_a_capture_that_failed_without_its_end_hook_leaves_nothing_behind(sd):
    """Issue: after such a capture captures_active stayed 1 for good: the frees it
    deferred were never issued (the ledger counted 8 MiB torch no longer held),
    the GIL-held cache path missed on every call, trims and the refusal path never
    synchronized, waits were refused at once."""
    core.register_stream(CAP)  # torch's capture stream: one of its pooled streams
    core.set_cache(DEV, 64 * MIB)
    try:
        rc, before = core.alloc(DEV, 4 * MIB, CAP, TORCH)  # made before the capture
        pool = (0x72, 0)
        begin_capture(sd, pool)
        out = galloc(4 * MIB, pool)  # the capture's allocation
        core.free(before)  # used by the captured stream: deferred
        core.free(out)  # the graph's temporary: kept with its pool
        s = stats()
        assert s["num_deferred"] == 1 and s["graph_bytes"] == 4 * MIB and s["used"] == 8 * MIB
        fail_capture(sd)
        # the next look of the thread that began it (here the figures') ends it
        s = stats()
        assert s["captures_active"] == 0
        assert s["num_deferred"] == 0 and s["graph_bytes"] == 0 and s["used"] == 0
        assert [t["current"] for t in s["tags"]] == [0] * core.NTAGS
        # and everything works as before it: the cache's GIL-held path hits ...
        rc, p = core.alloc(DEV, MIB, CAP, TORCH)
        core.free(p)
        assert core.alloc_cached(DEV, MIB, CAP, TORCH) == (Status.OK, p)
        core.free(p)
        # ... a trim synchronizes the streams again
        syncs = sd.standin_counter(C_SYNC)
        assert core.trim(DEV, 0) == Status.OK
        assert sd.standin_counter(C_SYNC) > syncs
        # torch (a later one) releasing the pool after all changes nothing
        assert core.graph(RELEASE, DEV, *pool) == Status.OK
        assert stats()["used"] == 0
    finally:
        core.set_cache(DEV, 0)
        core.forget_stream(CAP)


def test_a_failed_capture_is_ended_only_by_the_thread_that_began_it(sd):
    """Another thread may look between cudaStreamEndCapture and the end hook of a
    capture that ended well: only the capturing thread, past capture_end without
    the hook, knows the capture failed."""
    import threading

    core.register_stream(CAP)
    try:
        pool = (0x73, 0)
        begin_capture(sd, pool)
        tmp = galloc(2 * MIB, pool)
        core.free(tmp)
        fail_capture(sd)
        t = threading.Thread(target=stats)
        t.start()
        t.join()
        assert core.stats(DEV)[1]["captures_active"] == 0  # this thread's look ends it
        assert stats()["graph_bytes"] == 0
    finally:
        core.forget_stream(CAP)


def test_a_failed_capture_into_a_shared_pool_drops_its_use_only(sd):
    """g1 captured into a pool, g2 failed in the same pool: g1's replays still use
    the pool; it goes back at g1's release.  A torch that sends the end hook after
    the core ended the capture (and so will release its use) is counted once."""
    core.register_stream(CAP)
    try:
        pool = (0x74, 0)
        begin_capture(sd, pool)
        a = galloc(2 * MIB, pool)
        core.free(a)
        g = ctypes.c_void_p()
        assert sd.cuStreamEndCapture(CAP, ctypes.byref(g)) == 0  # g1 ended well
        assert core.graph(END, DEV, *pool) == Status.OK
        begin_capture(sd, pool)  # g2, into the same pool
        b = galloc(8 * MIB, pool)  # not a's block: larger than twice its size
        core.free(b)
        fail_capture(sd)
        s = stats()
        assert s["captures_active"] == 0 and s["graph_bytes"] == 10 * MIB  # g1 replays
        assert core.graph(END, DEV, *pool) == Status.OK  # the end hook, late
        assert core.graph(RELEASE, DEV, *pool) == Status.OK  # g2's release
        assert stats()["graph_bytes"] == 10 * MIB  # g1 still holds the pool
        assert core.graph(RELEASE, DEV, *pool) == Status.OK  # g1's
        assert core.trim(DEV, 0) == Status.OK  # g1 may replay: after a device sync
        s = stats()
        assert s["graph_bytes"] == 0 and s["used"] == 0
        assert sd.cuGraphDestroy(g) == 0
    finally:
        core.forget_stream(CAP)


def test_a_use_mem_pool_routing_is_never_taken_for_a_failed_capture(sd):
    """torch.cuda.use_mem_pool routes a stream that never captures: the core counts
    it as a capture until its end hook, and must not end it because the stream is
    not capturing."""
    core.register_stream(CAP)
    try:
        pool = (0x75, 0)
        assert core.graph_begin_on(DEV, *pool, CAP, False) == Status.OK  # use_mem_pool enters
        p = galloc(MIB, pool)  # routed to the pool, no capture on CAP
        assert stats()["captures_active"] == 1
        assert core.trim(DEV, 0) == Status.OK  # a forced look
        assert stats()["captures_active"] == 1
        core.free(p)
        assert core.graph(END, DEV, *pool) == Status.OK  # use_mem_pool exits
        assert core.graph(RELEASE, DEV, *pool) == Status.OK  # the MemPool goes
        s = stats()
        assert s["captures_active"] == 0 and s["graph_bytes"] == 0 and s["used"] == 0
    finally:
        core.forget_stream(CAP)


# ---- a failed capture the core hears of only at its begin (issue 61) ----
@pytest.mark.parametrize("told", [True, False], ids=["stream-told", "begin-only"])
def test_a_capture_that_failed_before_allocating_into_its_pool_is_noticed(sd, told):
    """Issue 61: the core learned a capture's stream at the pool's first allocation,
    so a capture that failed before one (an .item() first thing in the body) stayed
    active for good: a block freed on the captured stream during it was never given
    back, the cache's GIL-held path missed, stats showed the capture.  The torch
    allocator now tells the stream at the begin hook (torch calls it just before
    cudaStreamBeginCapture); a begin that does not tell it (the pluggable path's)
    is still noticed only at the pool's first allocation."""
    core.register_stream(CAP)  # torch's capture stream: one of its pooled streams
    core.set_cache(DEV, 64 * MIB)
    try:
        rc, a = core.alloc(DEV, 4 * MIB, CAP, TORCH)  # made before the capture
        pool = (0x76, 0)
        if told:
            assert core.graph_begin_on(DEV, *pool, CAP, True) == Status.OK
        else:
            assert core.graph(BEGIN, DEV, *pool) == Status.OK
        assert sd.cuStreamBeginCapture_v2(CAP, 2) == 0
        core.free(a)  # freed inside the capture, on its stream: held back
        assert stats()["num_deferred"] == 1
        fail_capture(sd)
        s = stats()  # the next look of the thread that began it
        if not told:  # what the core did before it was told the stream
            assert s["captures_active"] == 1 and s["num_deferred"] == 1
            assert core.graph(END, DEV, *pool) == Status.OK  # torch 2.14's reset, later
            assert core.graph(RELEASE, DEV, *pool) == Status.OK
            return
        assert s["captures_active"] == 0 and s["num_deferred"] == 0 and s["used"] == 0
        # a freed block is handed out again at once, on the GIL-held path too
        rc, p = core.alloc(DEV, MIB, CAP, TORCH)
        core.free(p)
        assert core.alloc_cached(DEV, MIB, CAP, TORCH) == (Status.OK, p)
        core.free(p)
        # torch 2.14+ ends and releases the pool at the graph's reset: nothing more
        core.graph(END, DEV, *pool)  # the pool is gone already: a no-op
        assert core.graph(RELEASE, DEV, *pool) == Status.OK
        s = stats()
        assert s["captures_active"] == 0 and s["used"] == s["cached"]
    finally:
        core.set_cache(DEV, 0)
        core.forget_stream(CAP)


def test_a_told_capture_that_runs_is_not_ended_by_its_threads_looks(sd):
    """The stream told at the begin, capturing when the thread looks: the capture is
    watched, not ended; it ends with its end hook, as any capture."""
    core.register_stream(CAP)
    try:
        pool = (0x77, 0)
        assert core.graph_begin_on(DEV, *pool, CAP, True) == Status.OK
        assert sd.cuStreamBeginCapture_v2(CAP, 2) == 0
        assert stats()["captures_active"] == 1  # a look during the capture
        tmp = galloc(MIB, pool)
        core.free(tmp)
        assert core.trim(DEV, 0) == Status.OK  # a forced look
        assert stats()["captures_active"] == 1 and stats()["graph_bytes"] == MIB
        g = ctypes.c_void_p()
        assert sd.cuStreamEndCapture(CAP, ctypes.byref(g)) == 0
        assert core.graph(END, DEV, *pool) == Status.OK
        assert stats()["captures_active"] == 0 and stats()["graph_bytes"] == MIB
        assert core.graph(RELEASE, DEV, *pool) == Status.OK
        assert sd.cuGraphDestroy(g) == 0
    finally:
        core.forget_stream(CAP)


def test_a_told_capture_on_a_stream_nobody_registered_is_never_asked_about(sd):
    """A capture on a stream the core cannot prove alive (torch.cuda.ExternalStream):
    the core never gives its handle to the driver later (it may be destroyed); the
    capture ends with torch's end hook (torch 2.14+ sends it at the graph's reset)."""
    ext = sd.standin_new_stream_flags(DEV, 1)
    pool = (0x78, 0)
    assert core.graph_begin_on(DEV, *pool, ext, True) == Status.OK
    assert sd.cuStreamBeginCapture_v2(ext, 2) == 0
    fail_capture(sd, ext)
    assert sd.cuStreamDestroy_v2(ext) == 0  # the user's stream, gone
    dead = sd.standin_counter(14)  # C_DEAD: a destroyed stream's handle given
    assert stats()["captures_active"] == 1
    assert sd.standin_counter(14) == dead
    assert core.graph(END, DEV, *pool) == Status.OK
    assert core.graph(RELEASE, DEV, *pool) == Status.OK


def test_a_use_mem_pool_routing_around_a_capture_stays_open_after_the_capture(sd):
    """torch.cuda.use_mem_pool(pool) entered, then torch.cuda.graph captured inside it:
    the capture's allocations go to the MemPool (its route is the first, as in torch's
    own allocator).  Issue: the routing's pool then watched the capture's stream, and
    once that capture ended well the core took the routing for a failed capture and
    ended it: captures_active fell to 0 while the use_mem_pool block still ran (the
    torch allocator routes only while a capture is counted: later tensors of the block
    left the MemPool), and the pool lost the routing's use (released here, its
    tensors' blocks no longer the pool's)."""
    core.register_stream(CAP)  # torch.cuda.graph's capture stream: a pooled one
    try:
        mem, graph = (0x79, 0), (0x7A, 0)
        assert core.graph_begin_on(DEV, *mem, OTHER, False) == Status.OK  # use_mem_pool
        assert core.graph_begin_on(DEV, *graph, CAP, True) == Status.OK  # torch.cuda.graph
        assert sd.cuStreamBeginCapture_v2(CAP, 2) == 0
        p = galloc(MIB, mem, stream=CAP)  # routed to the MemPool, on the capture stream
        g = ctypes.c_void_p()
        assert sd.cuStreamEndCapture(CAP, ctypes.byref(g)) == 0  # the capture ended well
        assert core.graph(END, DEV, *graph) == Status.OK
        assert core.trim(DEV, 0) == Status.OK  # a forced look
        assert stats()["captures_active"] == 1  # use_mem_pool still routes
        core.free(p)  # a tensor of the pool: its block stays with the pool
        assert stats()["graph_bytes"] == MIB
        assert core.graph(END, DEV, *mem) == Status.OK  # use_mem_pool exits ...
        assert stats()["captures_active"] == 0
        assert core.graph(RELEASE, DEV, *mem) == Status.OK  # ... its use released: the last
        assert stats()["graph_bytes"] == 0
        assert core.graph(RELEASE, DEV, *graph) == Status.OK  # the graph's reset
        assert sd.cuGraphDestroy(g) == 0
    finally:
        core.forget_stream(CAP)
