# SPDX-License-Identifier: Apache-2.0
"""Streams, threads, devices and fork in the core, on the stand-in driver.

tests/gpu/test_gpu_streams.py runs the same semantics on a GPU, against the
native allocators.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from bridge._errors import Status
from bridge._runtime import core

DEV = 0
MIB = 1 << 20
TORCH, CUPY = core.TAG_TORCH, core.TAG_CUPY
PER_THREAD, LEGACY = 2, 1
USER = 0xD1000  # a stream somebody created (ExternalStream of a CuPy stream)


@pytest.fixture
def sd(standin):
    standin.standin_adopt_stream(USER, DEV)
    core.set_cache(DEV, 64 * MIB)
    live = core.live_records()
    yield standin
    core.set_cache(DEV, 0)
    core.forget_stream(USER)
    standin.standin_sync_all(DEV)
    assert core.live_records() == live


def stats() -> dict:
    rc, s = core.stats(DEV)
    assert rc == Status.OK
    return s


def in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    if "error" in out:
        raise out["error"]
    return out["value"]


# ---- the per-thread default stream ----
def test_per_thread_default_streams_of_two_threads_never_share_a_cached_block(sd):
    """Issue: with CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1, thread B got the block
    thread A had just dropped while A's kernel still read it."""

    def thread_a():
        rc, p = core.alloc(DEV, 2 * MIB, PER_THREAD, CUPY)
        core.free(p)  # cached for A's per-thread stream
        rc, q = core.alloc(DEV, 2 * MIB, PER_THREAD, CUPY)  # A's stream order: safe
        core.free(q)  # cached for A again
        return p, q

    p, q = in_thread(thread_a)
    assert q == p and stats()["cached"] == 2 * MIB
    # handle 2 from another thread names another stream: never A's block
    b = in_thread(lambda: core.alloc(DEV, 2 * MIB, PER_THREAD, CUPY)[1])
    c = core.alloc(DEV, 2 * MIB, PER_THREAD, CUPY)[1]
    assert p not in (b, c)
    for x in (b, c):
        core.free(x)


def test_a_per_thread_block_freed_by_another_thread_is_freed_on_the_legacy_stream(sd):
    core.set_cache(DEV, 0)
    rc, p = in_thread(lambda: core.alloc(DEV, MIB, PER_THREAD, CUPY))
    sd.standin_sync_all(DEV)
    core.free(p)  # this thread's per-thread stream is not the one that used it
    assert sd.standin_pending_on(DEV, LEGACY) == MIB
    assert sd.standin_pending_on(DEV, PER_THREAD) == 0
    rc, q = core.alloc(DEV, MIB, PER_THREAD, CUPY)
    sd.standin_sync_all(DEV)
    core.free(q)  # the allocating thread frees on its own per-thread stream
    assert sd.standin_pending_on(DEV, PER_THREAD) == MIB


# ---- streams that may be destroyed ----
def test_blocks_of_a_user_stream_are_not_cached_until_it_is_registered(sd):
    rc, p = core.alloc(DEV, MIB, USER, TORCH)
    core.free(p)
    assert stats()["cached"] == 0  # the stream may be destroyed and its handle reused
    assert core.register_stream(USER) == Status.OK
    rc, p = core.alloc(DEV, MIB, USER, TORCH)
    core.free(p)
    assert stats()["cached"] == MIB


def test_forgetting_a_stream_returns_its_cached_blocks_on_it(sd):
    core.register_stream(USER)
    rc, p = core.alloc(DEV, MIB, USER, TORCH)
    core.free(p)
    assert stats()["cached"] == MIB
    sd.standin_sync_all(DEV)
    assert core.forget_stream(USER) == Status.OK
    assert stats()["cached"] == 0
    assert sd.standin_pending_on(DEV, USER) == MIB  # in the stream's order, while it lives
    rc, q = core.alloc(DEV, MIB, USER, TORCH)
    core.free(q)
    assert stats()["cached"] == 0


def test_a_stream_registered_and_forgotten_again_and_again_leaves_room_for_others(sd):
    """Issue: a forgotten stream left a tombstone in the table of registered
    streams for good, and every registration took a fresh slot: CuPy registers
    a capture's stream while a graph holds it and forgets it when the graph
    dies, so after 2048 graphs (on one stream or on many) no stream could be
    registered any more: torch's pooled streams of a device used later then
    lost their cache and their frees' stream order."""
    for i in range(3000):
        for h in (0xD2000, 0xD2000 + 0x100 * (i + 1)):  # the same stream, and new ones
            assert core.register_stream(h) == Status.OK
            assert core.forget_stream(h) == Status.OK
    other = 0xD1100
    sd.standin_adopt_stream(other, DEV)
    assert core.register_stream(other) == Status.OK
    try:
        rc, p = core.alloc(DEV, MIB, other, TORCH)
        core.free(p)
        assert stats()["cached"] == MIB  # registered: its blocks are cached on it
    finally:
        core.forget_stream(other)


# ---- ordering a free after recorded streams ----
def test_a_failing_event_record_falls_back_to_the_legacy_stream_and_counts_it(sd):
    """Issue: event record or wait failures before a free were ignored: the free
    went ahead unordered.  Then (issue 30) the fallback was a device-wide
    synchronization, a host wait that invalidates captures: now the free goes
    to the legacy stream, after every blocking stream's queued work."""
    core.set_cache(DEV, 0)
    core.register_stream(USER)  # torch's streams are registered (adapters/torch.py)
    try:
        rc, p = core.alloc(DEV, MIB, 0, TORCH)
        assert core.record_stream(p, USER) == Status.OK
        s0 = stats()
        syncs = sd.standin_counter(2)
        sd.standin_fail(b"cuEventRecord", 400, 1)  # e.g. the recorded stream was destroyed
        core.free(p)
        s = stats()
        assert s["num_order_fallbacks"] == s0["num_order_fallbacks"] + 1
        assert sd.standin_counter(2) == syncs  # no host wait
        assert sd.standin_pending_on(DEV, 1) == MIB  # on the legacy stream
        assert s["used"] == 0
    finally:
        core.forget_stream(USER)


def test_a_recorded_stream_that_is_capturing_defers_the_free(sd):
    core.set_cache(DEV, 0)
    core.register_stream(USER)
    try:
        rc, p = core.alloc(DEV, MIB, 0, TORCH)
        assert core.record_stream(p, USER) == Status.OK
        sd.standin_set_capturing(USER)
        core.free(p)
        assert stats()["num_deferred"] == 1
        sd.standin_set_capturing(None)
        core.free(core.alloc(DEV, MIB, 0, TORCH)[1])
        assert stats()["num_deferred"] == 0 and stats()["used"] == 0
    finally:
        core.forget_stream(USER)


# ---- the budget never fails open ----
def test_a_failing_pool_read_uses_the_last_good_figure(sd):
    """Issue: when reading the pool's used bytes failed, others' bytes counted as 0."""
    core.set_limit(DEV, 10 * MIB)
    try:
        sd.standin_add_foreign(DEV, 8 * MIB)  # JAX holds 8 MiB of the pool
        rc, p = core.alloc(DEV, MIB, 0, CUPY)  # a read that succeeds
        assert rc == Status.OK
        n0 = stats()["num_pool_read_errors"]
        sd.standin_fail(b"cuMemPoolGetAttribute", 999, 1)
        assert core.alloc(DEV, 4 * MIB, 0, CUPY) == (Status.BUDGET, 0)
        assert stats()["num_pool_read_errors"] == n0 + 1
        core.free(p)
    finally:
        sd.standin_add_foreign(DEV, -8 * MIB)
        core.set_limit(DEV, 0)


# ---- the pressure hook from threads without the GIL ----
def test_a_torch_thread_never_waits_on_the_gil_past_the_relief_timeout(sd):
    """Issue: the recovery chain took the GIL from any torch thread (autograd), which
    deadlocks when a GIL holder waits for a lock that thread holds.  The thread asks
    the reliever and waits a bounded time."""
    from bridge import recovery

    core.set_limit(DEV, MIB)
    calls = []
    core.set_pressure_callback(lambda d, n, t, stage: calls.append(n) or True)
    recovery._start_reliever()
    core.set_relief_timeout(0.2)
    libc = ctypes.PyDLL(None)  # a call through PyDLL keeps the GIL
    libc.usleep.argtypes = [ctypes.c_uint]
    try:
        # a reliever that can get the GIL runs the chain for the torch thread
        assert in_thread(lambda: core.alloc(DEV, 2 * MIB, 0, TORCH)) == (Status.BUDGET, 0)
        assert calls == [2 * MIB]
        # a GIL held elsewhere: the torch thread gives up after the timeout
        result: dict = {}

        def torch_thread():
            t0 = time.monotonic()
            result["rc"] = core.alloc(DEV, 2 * MIB, 0, TORCH)
            result["s"] = time.monotonic() - t0

        t = threading.Thread(target=torch_thread)
        t.start()
        time.sleep(0.05)
        libc.usleep(2_000_000)  # this thread holds the GIL for 2 s
        t.join(10)
        assert result["rc"] == (Status.BUDGET, 0)
        assert result["s"] < 1.5
    finally:
        core.set_relief_timeout(5.0)
        core.set_pressure_callback(None)
        core.set_limit(DEV, 0)


# A stand-in cupy module for the children below, in two parts around the test's own Stream
# (and Graph): the modules and CuPy's OutOfMemoryError first; then ExternalStream, the
# modules installed, and the bridge's CuPy adapter imported as `adapter`.
STANDIN_CUPY = """
        cupy = types.ModuleType("cupy")
        cuda = types.ModuleType("cupy.cuda")
        memory = types.ModuleType("cupy.cuda.memory")
        class OutOfMemoryError(MemoryError):
            def __init__(self, size, total, limit=0):
                super().__init__(size, total, limit)
        memory.OutOfMemoryError = OutOfMemoryError
        memory.UnownedMemory = memory.MemoryPointer = object
"""
STANDIN_CUPY_ADAPTER = """
        class ExternalStream(Stream):
            pass
        cuda.Stream, cuda.ExternalStream, cuda.memory = Stream, ExternalStream, memory
        cuda.runtime = types.SimpleNamespace(getDevice=lambda: 0)
        cupy.cuda = cuda
        sys.modules.update({"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.memory": memory})
        from bridge.adapters import cupy as adapter
"""


# ---- devices outside unify's list; fork ----
def _child(code: str) -> subprocess.CompletedProcess:
    script = textwrap.dedent(code)
    env = dict(os.environ)
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )


def test_a_device_nobody_set_up_is_served_without_a_budget(standin):
    """Issue: a rank that unified device 0 got 'could not allocate ... (CUDA_SUCCESS)'
    when torch copied a tensor to cuda:1."""
    r = _child(
        """
        import os
        from bridge._runtime import core
        assert core.init(os.environ["BRIDGE_CUDA_LIBRARY"]) == 0
        assert core.setup(0, 2**64 - 1) == 0
        assert not core.ready(1)
        rc, p = core.alloc(1, 1 << 20, 0, core.TAG_TORCH)
        assert rc == 0 and p, rc
        rc, s = core.stats(1)
        assert s["limit"] == 0 and s["tags"][core.TAG_TORCH]["current"] == 1 << 20
        core.free(p)
        print("ok")
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_a_fork_child_starts_clean_and_never_deadlocks(standin):
    """Issue: no fork handling: a child inherited held locks and the parent's
    pointers.  The child gets BridgeError, frees of the parent's blocks are
    ignored, nothing of the parent's is handed out, and it never hangs even when
    another thread was allocating at the fork."""
    r = _child(
        """
        import os, sys, threading
        from bridge._runtime import core
        from bridge._errors import BridgeError, check
        import bridge
        assert core.init(os.environ["BRIDGE_CUDA_LIBRARY"]) == 0
        for d in (0, 1):
            assert core.setup(d, 2**64 - 1) == 0
        core.set_cache(0, 64 << 20)
        rc, kept = core.alloc(0, 1 << 20, 0, core.TAG_CUPY)
        rc, cached = core.alloc(0, 2 << 20, 0, core.TAG_CUPY)
        core.free(cached)  # in the parent's cache
        buf = bridge.pinned_buffer(4096)  # a pinned block of the parent
        stop = False
        def churn():  # holds the core's locks now and then
            while not stop:
                rc, p = core.alloc(0, 4096, 0, core.TAG_TORCH)
                core.free(p)
        t = threading.Thread(target=churn)
        t.start()
        for i in range(20):
            pid = os.fork()
            if pid == 0:
                code = 0
                if not core.forked():
                    code = 10
                rc, p = core.alloc(0, 2 << 20, 0, core.TAG_CUPY)
                if rc != 10 or p:  # FORKED, nothing handed out
                    code = 11
                core.free(kept)  # the parent's: ignored, never counted as a bad free
                del buf
                try:
                    bridge.empty_pinned(16)
                    code = 12
                except BridgeError as e:
                    if "forked" not in str(e):
                        code = 13
                try:
                    check(core.init(None), what="starting the bridge")
                    code = 14
                except BridgeError as e:
                    if "spawn" not in str(e):
                        code = 15
                os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (i, status)
        stop = True
        t.join()
        core.free(kept)
        print("ok")
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_a_cupy_graph_that_dies_gives_its_pool_back(standin):
    """Issue (H200, CuPy 14.2): CuPy's Graph is a Cython class with neither _add_ref nor
    weak references, so the pool of its capture was kept for good (graph_bytes still
    32 MiB after `del g; gc.collect()`).  The adapter now binds the pool to the graph
    being captured (a user object); the pool goes once the graph and its exec are
    destroyed and its launch has completed, and the holder (the Stream) with it.  A
    stand-in cupy module here whose Stream and Graph drive the stand-in driver as CuPy
    drives CUDA."""
    r = _child(
        """
        import ctypes, os, sys, time, types, weakref
        import bridge
        from bridge._runtime import core
        lib = ctypes.CDLL(os.environ["BRIDGE_CUDA_LIBRARY"])  # the driver the core loaded
        vp = ctypes.c_void_p
        lib.standin_new_stream.restype = vp
        lib.cuStreamBeginCapture_v2.argtypes = [vp, ctypes.c_int]
        lib.cuStreamEndCapture.argtypes = [vp, ctypes.POINTER(vp)]
        lib.cuGraphInstantiateWithFlags.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_ulonglong]
        lib.cuGraphLaunch.argtypes = [vp, vp]
        lib.cuGraphExecDestroy.argtypes = lib.cuGraphDestroy.argtypes = [vp]
        assert core.init(os.environ["BRIDGE_CUDA_LIBRARY"]) == 0
        assert core.setup(0, 2**64 - 1) == 0
"""
        + STANDIN_CUPY
        + """
        class Graph:  # CuPy 14.2's fields; no _add_ref, no weak reference
            __slots__ = ("graph", "graphExec")
            def __init__(self, graph):
                self.graph, self.graphExec = graph, vp()
                assert lib.cuGraphInstantiateWithFlags(ctypes.byref(self.graphExec), graph, 0) == 0
            def launch(self, stream):
                assert lib.cuGraphLaunch(self.graphExec, stream.ptr) == 0
            def __del__(self):  # CuPy's __dealloc__
                if getattr(self, "graphExec", None):
                    assert lib.cuGraphExecDestroy(self.graphExec) == 0
                    assert lib.cuGraphDestroy(self.graph) == 0
        class Stream:
            def __init__(self):
                self.device_id = 0
                self.ptr = lib.standin_new_stream(0)
            def begin_capture(self, mode=None):
                assert lib.cuStreamBeginCapture_v2(self.ptr, 2) == 0
            def end_capture(self):
                g = vp()
                rc = lib.cuStreamEndCapture(self.ptr, ctypes.byref(g))
                if rc:
                    raise RuntimeError(f"cudaErrorStreamCaptureInvalidated ({rc})")
                return Graph(g)
"""
        + STANDIN_CUPY_ADAPTER
        + """
        try:
            weakref.ref(Graph.__new__(Graph))
            raise SystemExit("the stand-in Graph must refuse weak references")
        except TypeError:
            pass
        adapter._tell_captures()
        graph_bytes = lambda: core.stats(0)[1]["graph_bytes"]
        s = Stream()
        s.begin_capture()
        rc, p = core.alloc(0, 1 << 20, s.ptr, core.TAG_CUPY)
        assert rc == 0
        core.free(p)  # a temporary of the capture: kept for its graph
        g = s.end_capture()
        assert graph_bytes() == 1 << 20 and adapter._held
        g.launch(s)
        del g  # CuPy destroys the exec and the graph; the launch still runs
        lib.standin_complete_events()  # the GPU finished it: the destructor is due
        deadline = time.monotonic() + 2
        while graph_bytes() and time.monotonic() < deadline:
            bridge.stats(0)  # the public figures collect
            time.sleep(0.01)
        bridge.stats(0)
        assert graph_bytes() == 0, graph_bytes()  # CuPy 14.2 on an H200: 33554432
        assert not adapter._bound and not adapter._held and not adapter._unreleased
        # a capture that fails at its end: the driver destroys the graph, and the
        # pool goes with it (released once: the adapter releases nothing itself)
        s.begin_capture()
        rc, p = core.alloc(0, 1 << 20, s.ptr, core.TAG_CUPY)
        core.free(p)
        lib.standin_invalidate_capture()
        try:
            s.end_capture()
            raise SystemExit("the capture should have failed")
        except RuntimeError:
            pass
        deadline = time.monotonic() + 2
        while adapter._bound and time.monotonic() < deadline:
            bridge.stats(0)
            time.sleep(0.01)
        assert graph_bytes() == 0 and not adapter._bound and not adapter._held
        assert core.stats(0)[1]["captures_active"] == 0
        # a fork child (the one reset hook) forgets the parent's holders: no Stream of
        # the parent kept, no release expected from a core that forgot the pools
        s.begin_capture()
        g2 = s.end_capture()
        assert adapter._bound
        from bridge import _runtime
        _runtime.reset_process_state()
        assert not adapter._bound and not adapter._capturing
        print("ok")
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_one_reset_forgets_every_module_singleton(standin):
    """A fork child (os.register_at_fork) and the tests use one hook, not private flags."""
    import importlib

    from bridge import _runtime, recovery

    unify_mod = importlib.import_module("bridge.unify")

    recovery.install()
    unify_mod._bridge = unify_mod.Bridge()
    _runtime.ensure_device(0)
    assert recovery._installed and unify_mod.current() is not None and _runtime._configured
    _runtime.reset_process_state()
    assert not recovery._installed
    assert unify_mod.current() is None
    assert not _runtime._configured


def test_cupy_captures_are_told_to_the_core(standin):
    """The CuPy adapter wraps Stream.begin_capture / end_capture (on a stand-in cupy
    module here): the core counts the capture while it runs, an ExternalStream's
    device -1 is the current device, and a failed begin counts nothing."""
    r = _child(
        """
        import os, sys, types
        from bridge._runtime import core
        assert core.init(os.environ["BRIDGE_CUDA_LIBRARY"]) == 0
        assert core.setup(0, 2**64 - 1) == 0
"""
        + STANDIN_CUPY
        + """
        class Stream:
            def __init__(self, device_id=0, fail=False):
                self.device_id, self.fail = device_id, fail
                self.ptr = 0xE000  # the stream's handle, as CuPy's Stream has
            def begin_capture(self, mode=None):
                if self.fail:
                    raise RuntimeError("cannot capture")
            def end_capture(self):
                make = getattr(self, "make_graph", None)
                return make() if make else "graph"
"""
        + STANDIN_CUPY_ADAPTER
        + """
        adapter._tell_captures()
        adapter._tell_captures()  # twice: wrapped once
        active = lambda: core.stats(0)[1]["captures_active"]
        s = Stream()
        s.begin_capture()
        assert active() == 1
        assert s.end_capture() == "graph" and active() == 0
        e = ExternalStream(device_id=-1)
        e.begin_capture()
        assert active() == 1
        e.end_capture()
        assert active() == 0
        # a capture's arrays go to its graph's pool, kept while its Graph lives; these
        # stand-in streams do not capture in the driver (no graph to bind the pool
        # to) and the "graph" cannot say when it dies: kept for good
        assert len(adapter._unreleased) == 2 and not adapter._bound
        class Graph:  # the fallback: a Graph that keeps what _add_ref gets until it dies
            def __init__(self):
                self._refs = []
            def _add_ref(self, ref):
                self._refs.append(ref)
        g = Stream()
        g.ptr, g.make_graph = 0xE100, Graph
        g.begin_capture()
        rc, p = core.alloc(0, 1 << 20, 0xE100, core.TAG_CUPY)
        assert rc == 0
        core.free(p)  # a temporary of the capture: kept for its graph
        graph = g.end_capture()
        assert core.stats(0)[1]["graph_bytes"] == 1 << 20
        del graph  # the Graph dies: its pool goes
        assert core.stats(0)[1]["graph_bytes"] == 0
        try:
            Stream(fail=True).begin_capture()
        except RuntimeError:
            pass
        assert active() == 0
        print("ok")
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


# ---- frees ordered after non-blocking streams the core cannot name (issue 61, item 3) ----
C_SYNC, C_DEAD, C_UNORDERED = 2, 14, 15
NON_BLOCKING = 1


def dev_stats(dev: int) -> dict:
    rc, s = core.stats(dev)
    assert rc == Status.OK
    return s


def test_a_block_freed_on_a_non_blocking_stream_nobody_registered_waits_for_its_kernel(sd):
    """Issue: a block freed on a CU_STREAM_NON_BLOCKING stream of device 1 (torch's
    pooled streams of a device unify() did not register, a non-blocking CuPy stream
    behind an ExternalStream) was queued on the legacy stream, which does not wait
    for that stream: the pool could hand the memory on while the kernel still read
    it.  The stream is destroyed before the free and its handle handed out again:
    the free must not name it either."""
    s = sd.standin_new_stream_flags(1, NON_BLOCKING)
    rc, p = core.alloc(1, 4 * MIB, s, TORCH)
    assert rc == Status.OK
    sd.standin_launch(s, p, 1)  # a kernel on s still reads the block
    assert sd.cuStreamDestroy_v2(s) == 0  # gone before the free; its work still queued
    made = []  # new streams until the driver hands s's handle out again
    while s not in made and len(made) < 4096:
        h = ctypes.c_void_p()
        assert sd.cuStreamCreate(ctypes.byref(h), NON_BLOCKING) == 0
        made.append(h.value)
    assert s in made
    dead, unordered = sd.standin_counter(C_DEAD), sd.standin_counter(C_UNORDERED)
    core.free(p)
    assert sd.standin_counter(C_UNORDERED) == unordered  # never freed before the kernel
    assert sd.standin_pending_on(1, LEGACY) == 0 and sd.standin_pending_on(1, s) == 0
    st = dev_stats(1)
    assert st["num_deferred"] == 1 and st["used"] == 4 * MIB  # held, still counted
    # another stream's allocation meets the limit: the held block comes back,
    # after one device-wide synchronization (the kernel done), not before
    core.set_limit(1, 6 * MIB)
    try:
        syncs = sd.standin_counter(C_SYNC)
        rc, q = core.alloc(1, 4 * MIB, LEGACY, TORCH)
        assert rc == Status.OK
        assert sd.standin_counter(C_SYNC) > syncs
        assert sd.standin_queued_kernels() == 0
        assert sd.standin_counter(C_UNORDERED) == unordered
        assert dev_stats(1)["num_deferred"] == 0
        core.free(q)
    finally:
        core.set_limit(1, 0)
    assert sd.standin_counter(C_DEAD) == dead  # the reused handle was never given to the driver
    for h in made:
        assert sd.cuStreamDestroy_v2(h) == 0
    sd.standin_sync_all(1)


def test_a_recorded_non_blocking_stream_nobody_registered_orders_the_free(sd):
    """record_stream with such a stream: the legacy stream stood for it, and does
    not wait for it.  Now the free waits for a device-wide synchronization,
    which torch.cuda.empty_cache() makes."""
    s = sd.standin_new_stream_flags(DEV, NON_BLOCKING)
    rc, p = core.alloc(DEV, 2 * MIB, LEGACY, TORCH)
    sd.standin_launch(s, p, DEV)  # a side stream reads it
    assert core.record_stream(p, s) == Status.OK
    unordered = sd.standin_counter(C_UNORDERED)
    core.free(p)
    assert sd.standin_counter(C_UNORDERED) == unordered
    assert stats()["num_deferred"] == 1
    assert core.trim(DEV, 0) == Status.OK  # torch.cuda.empty_cache()
    assert sd.standin_counter(C_UNORDERED) == unordered
    s_ = stats()
    assert s_["num_deferred"] == 0 and s_["used"] == 0
    assert sd.standin_pending_bytes(DEV) == 0


def test_a_blocking_stream_nobody_registered_is_still_ordered_by_the_legacy_stream(sd):
    """What stays cheap: a blocking stream's block goes to the legacy stream, which
    waits for it, with no host wait."""
    s = sd.standin_new_stream_flags(DEV, 0)
    rc, p = core.alloc(DEV, 2 * MIB, s, TORCH)
    sd.standin_launch(s, p, DEV)
    unordered, syncs = sd.standin_counter(C_UNORDERED), sd.standin_counter(C_SYNC)
    core.free(p)
    assert sd.standin_counter(C_UNORDERED) == unordered
    assert sd.standin_counter(C_SYNC) == syncs
    assert sd.standin_pending_on(DEV, LEGACY) == 2 * MIB
    assert stats()["num_deferred"] == 0
    sd.standin_sync_all(DEV)


def test_a_registered_non_blocking_stream_frees_on_itself_with_no_host_wait(sd):
    """torch's pooled streams, once registered: freed (and cached) on the stream."""
    s = sd.standin_new_stream_flags(DEV, NON_BLOCKING)
    core.register_stream(s)
    try:
        rc, p = core.alloc(DEV, 2 * MIB, s, TORCH)
        sd.standin_launch(s, p, DEV)
        unordered, syncs = sd.standin_counter(C_UNORDERED), sd.standin_counter(C_SYNC)
        core.set_cache(DEV, 0)
        core.free(p)
        assert sd.standin_counter(C_UNORDERED) == unordered
        assert sd.standin_counter(C_SYNC) == syncs
        assert sd.standin_pending_on(DEV, s) == 2 * MIB
    finally:
        core.forget_stream(s)
        sd.standin_sync_all(DEV)


def test_a_cupy_block_of_another_device_is_ordered_on_that_devices_stream(standin):
    """``bridge.pool(1).malloc(n)`` while device 0 is current: the block is allocated on, and
    freed after, device 1's current stream (CuPy's ``get_current_stream(1)``), never on
    device 0's, which the driver cannot order an allocation of device 1 on."""
    r = _child(
        """
        import ctypes, os, sys, types
        from bridge._runtime import core
        assert core.init(os.environ["BRIDGE_CUDA_LIBRARY"]) == 0
        for d in (0, 1):
            assert core.setup(d, 2**64 - 1) == 0
        lib = ctypes.CDLL(os.environ["BRIDGE_CUDA_LIBRARY"])
        lib.standin_new_stream.restype = ctypes.c_void_p
        lib.standin_new_stream.argtypes = [ctypes.c_int]
"""
        + STANDIN_CUPY
        + """
        class Stream:
            def __init__(self, ptr):
                self.ptr = ptr
        current = {0: Stream(lib.standin_new_stream(0)), 1: Stream(lib.standin_new_stream(1))}
        memory.UnownedMemory = lambda ptr, size, owner, device: (ptr, size, owner, device)
        memory.MemoryPointer = lambda mem, offset: mem
"""
        + STANDIN_CUPY_ADAPTER
        + """
        cuda.get_current_stream = lambda device_id=-1: current[0 if device_id < 0 else device_id]
        ptr, size, owner, device = adapter.malloc(1, 1 << 20)
        assert (size, device) == (1 << 20, 1), (size, device)
        (block,) = [b for b in core.live_blocks() if b[0] == ptr]
        assert block[3] == 1 and block[2] == current[1].ptr, (block, current[1].ptr)
        print("ok")
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
