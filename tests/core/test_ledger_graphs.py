# SPDX-License-Identifier: Apache-2.0
"""CUDA graph capture and trim in the ledger, on the stand-in driver.

Every figure asserted is one a user relies on: bytes per framework, statuses,
what the budget lets through, what the driver was asked to do.  The core is
process-global: tests compare against figures read at their start, free what
they allocate, and undo what they add to the stand-in (the `led` fixture).
"""

from __future__ import annotations

import pytest
from ledger_util import (
    C_FREE,
    C_MODE,
    C_SYNC,
    DEV,
    GRAPH_BEGIN,
    GRAPH_END,
    GRAPH_RELEASE,
    MIB,
    S1,
    S2,
    S3,
    TAG_TORCH,
    stats,
)

from bridge._errors import Status
from bridge._runtime import core


@pytest.fixture(autouse=True)
def _torch_streams(led):
    """S1..S3 stand for torch's streams, which the torch adapter registers as
    living as long as the process: the core may free torch's blocks on them
    (an unregistered stream's blocks are freed on the legacy stream)."""
    for s in (S1, S2, S3):
        core.register_stream(s)
    yield
    for s in (S1, S2, S3):
        core.forget_stream(s)


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
    # out of the pool; a replay may still run on any stream: held (still counted)
    # until a device-wide synchronization, which a trim (or a refusal) makes
    s = stats()
    assert s["graph_bytes"] == 0 and s["used"] == 6 * MIB and s["num_deferred"] == 1
    assert led.counter(C_FREE) == frees
    assert core.lookup(p)[0] == Status.INVALID
    assert core.trim(DEV, 0) == Status.OK
    s = stats()
    assert s["used"] == 0 and s["num_deferred"] == 0
    assert led.counter(C_FREE) == frees + 1


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
    core.free(p)  # a replay may still write it: after a device-wide synchronization
    s = stats()
    assert s["used"] == MIB and s["graph_bytes"] == 0 and s["num_deferred"] == 1
    assert led.counter(C_FREE) == frees
    assert core.trim(DEV, 0) == Status.OK
    assert stats()["used"] == 0
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
    core.trim(DEV, 0)  # the released pool's block, held for a device-wide sync


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
