# SPDX-License-Identifier: Apache-2.0
"""bridge.adapters.rmm and the core's StreamAllocator / stream_free, on the stand-in driver.

RMM needs a GPU to allocate, so these tests put a stand-in ``rmm`` module in
``sys.modules`` (tests/rmm_util.py) and run the callback resource
(``BRIDGE_RMM_CALLBACK=1``): its ``CallbackMemoryResource`` calls the two
callables as RMM's C++ callback resource does. The C++ resource is
test_rmm_resource.py's; the real RMM is tested by tests/gpu/test_gpu_rmm.py.
"""

from __future__ import annotations

import types

import pytest
from ledger_util import C_RECORD, DEV, MIB, S1, S2, S3, stats
from rmm_util import Stream, forget_fake_rmm, install_fake_rmm

import bridge
from bridge._errors import OutOfMemoryError, Status
from bridge._runtime import core

# the callback resource is asked for: its one-time warning says so, which is not news here
pytestmark = pytest.mark.filterwarnings("ignore:bridge. RMM runs on:RuntimeWarning")


@pytest.fixture
def fake_rmm(standin, monkeypatch):
    """A stand-in rmm with per-device resources; the bridge's adapter imported on it, on
    the callback resource."""
    monkeypatch.setenv("BRIDGE_RMM_CALLBACK", "1")
    yield install_fake_rmm(monkeypatch)
    forget_fake_rmm()


def test_unify_gives_every_device_a_resource_counted_as_rmm(fake_rmm, standin):
    b = bridge.unify(cupy=False, torch=False, rmm=True)
    assert "rmm" in b.frameworks
    from bridge.adapters import rmm as adapter

    assert sorted(fake_rmm) == [0, 1] and adapter.installed(0) and adapter.installed(1)
    assert adapter.path() == "callback" and "BRIDGE_RMM_CALLBACK=1" in adapter.path_reason()
    mr = fake_rmm[0]
    p = mr.allocate(3 * MIB, Stream(S1))
    assert core.lookup(p) == (Status.OK, 3 * MIB, 0, core.TAG_RMM)
    assert bridge.stats(0).by_framework["rmm"] == 3 * MIB
    mr.deallocate(p, 3 * MIB, Stream(S1))
    assert bridge.stats(0).by_framework["rmm"] == 0 and stats()["used"] == 0
    # freed on the stream RMM frees on (RMM keeps it alive through the free)
    assert standin.standin_pending_on(0, S1) == 3 * MIB
    # device 1's resource allocates on device 1
    q = fake_rmm[1].allocate(MIB, Stream(S1))
    assert core.lookup(q)[2] == 1
    fake_rmm[1].deallocate(q, MIB, Stream(S1))
    # the same call again changes nothing
    assert bridge.unify(cupy=False, torch=False, rmm=True) is b and fake_rmm[0] is mr


def test_past_the_budget_rmm_raises_memoryerror_and_holds_nothing(fake_rmm):
    bridge.unify(cupy=False, torch=False, rmm=True, budget=64 * MIB)
    mr = fake_rmm[0]
    keep = mr.allocate(40 * MIB, Stream(S1))
    with pytest.raises(MemoryError) as info:
        mr.allocate(40 * MIB, Stream(S1))
    msg = str(info.value)
    assert "for rmm on device 0" in msg and "budget is 64.00 MiB" in msg
    assert "rmm 40.00 MiB" in msg
    assert bridge.stats(0).by_framework["rmm"] == 40 * MIB
    mr.deallocate(keep, 40 * MIB, Stream(S1))
    assert stats()["used"] == 0 and stats()["tags"][core.TAG_RMM]["num_ooms"] >= 1


def test_the_allocator_raises_the_bridges_oom_which_is_a_memoryerror(led):
    core.set_limit(DEV, 8 * MIB)
    alloc = core.StreamAllocator(DEV, core.TAG_RMM, _raise_oom)
    with pytest.raises(OutOfMemoryError):
        alloc(16 * MIB, Stream(S1))
    assert issubclass(OutOfMemoryError, MemoryError)
    assert stats()["used"] == 0


def _raise_oom(size, device, stream, rc):
    raise OutOfMemoryError(f"status {rc}", device=device, size=size)


@pytest.fixture
def holds(led):
    """The rmm tag holding its streams, as bridge.adapters.rmm.install sets it."""
    assert core.set_tag_holds_streams(core.TAG_RMM, True) == Status.OK
    yield led
    core.set_tag_holds_streams(core.TAG_RMM, False)


def test_a_free_is_issued_on_the_stream_rmm_frees_on(holds):
    """Issue (H200, 2026-12-02): a DeviceBuffer freed on a non-blocking CuPy
    stream while a kernel still read it was freed on the legacy stream, which does
    not wait for a non-blocking stream; a buffer of the same size made at once on
    another stream got the memory and overwrote what the kernel read. RMM keeps the
    stream alive through the free, so the free goes on it, as RMM's own
    CudaAsyncMemoryResource issues it."""
    standin = holds.sd
    alloc = core.StreamAllocator(DEV, core.TAG_RMM, _raise_oom)
    p = alloc(MIB, Stream(S1))
    standin.standin_sync_all(DEV)
    records = standin.standin_counter(C_RECORD)
    core.stream_free(p, MIB, Stream(S1))
    assert standin.standin_pending_on(DEV, S1) == MIB
    assert standin.standin_pending_on(DEV, 1) == 0  # not the legacy stream
    assert standin.standin_counter(C_RECORD) == records  # its own stream: no event
    standin.standin_sync_all(DEV)
    q = alloc(MIB, S1)  # an int handle works too
    standin.standin_sync_all(DEV)
    core.stream_free(q, MIB, Stream(S2))  # freed on another stream: issued there
    assert standin.standin_pending_on(DEV, S2) == MIB
    assert standin.standin_pending_on(DEV, S1) == standin.standin_pending_on(DEV, 1) == 0
    assert stats()["used"] == 0


def test_a_free_after_a_long_lived_allocation_stream_waits_for_it_too(holds):
    standin = holds.sd
    core.register_stream(S3)
    try:
        alloc = core.StreamAllocator(DEV, core.TAG_RMM, _raise_oom)
        p = alloc(MIB, Stream(S3))
        standin.standin_sync_all(DEV)
        records = standin.standin_counter(C_RECORD)
        core.stream_free(p, MIB, Stream(S2))
        assert standin.standin_counter(C_RECORD) == records + 1  # S2 after S3's work
        assert standin.standin_pending_on(DEV, S2) == MIB
    finally:
        core.forget_stream(S3)
    assert stats()["used"] == 0


def test_for_a_tag_that_does_not_hold_its_streams_the_free_waits_on_the_legacy_stream(led):
    standin = led.sd
    alloc = core.StreamAllocator(DEV, core.TAG_NUMBA, _raise_oom)
    p = alloc(MIB, Stream(S1))
    records = standin.standin_counter(C_RECORD)
    core.stream_free(p, MIB, Stream(S2))  # S2's queued work first: an event on S2
    assert standin.standin_counter(C_RECORD) == records + 1
    # neither stream is one the core can prove alive: the legacy stream stands
    # for both, after every blocking stream's queued work (issue 30, item 4)
    assert standin.standin_pending_on(DEV, 1) == MIB
    assert stats()["used"] == 0


def test_a_stream_that_cannot_be_read_still_frees_the_block(led):
    class Broken:
        def __cuda_stream__(self):
            raise RuntimeError("gone")

    alloc = core.StreamAllocator(DEV, core.TAG_RMM, _raise_oom)
    p = alloc(MIB)  # no stream: the legacy default stream
    with pytest.raises(RuntimeError, match="gone"):
        core.stream_free(p, MIB, Broken())
    assert stats()["used"] == 0 and core.lookup(p)[0] == Status.INVALID
    with pytest.raises(RuntimeError, match="gone"):
        alloc(MIB, Broken())
    assert stats()["used"] == 0
    core.stream_free(p, MIB, None)  # a double free is counted, never raised
    assert stats()["num_bad_frees"] >= 1


@pytest.mark.parametrize(
    "args, error",
    [((DEV, core.NTAGS, print), ValueError), ((-1, 0, print), ValueError), ((0, 0, 1), TypeError)],
)
def test_stream_allocator_checks_its_arguments(args, error):
    with pytest.raises(error):
        core.StreamAllocator(*args)


def test_stream_allocator_call_checks_its_arguments(led):
    alloc = core.StreamAllocator(DEV, core.TAG_RMM, _raise_oom)
    assert (alloc.device, alloc.tag) == (DEV, core.TAG_RMM)
    with pytest.raises(TypeError):
        alloc()
    with pytest.raises(TypeError):
        alloc(MIB, S1, S2)
    with pytest.raises(OverflowError):
        alloc(-1)
    with pytest.raises(TypeError, match="version, handle"):
        alloc(MIB, types.SimpleNamespace(__cuda_stream__=lambda: 5))
    assert alloc(0, S1) == 0  # no memory for no bytes
    assert stats()["used"] == 0
