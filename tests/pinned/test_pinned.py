# SPDX-License-Identifier: Apache-2.0
"""bridge.pinned: the pinned host memory pool and its DLPack exports.

These tests run on the stand-in driver, whose pinned memory is real malloc'd
memory (numpy views work) and whose events stay pending while
``standin_hold_events(1)``.  tests/gpu/test_gpu_pinned.py checks numpy, torch,
JAX and CuPy on a real GPU.
"""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import bridge
from bridge import pinned
from bridge._runtime import core

KIB, MIB = 1 << 10, 1 << 20
C_HOSTALLOC, C_HOSTFREE, C_EVCREATE, C_EVQUERY, C_HOSTPOOL = 8, 9, 10, 11, 12


# ---- fixtures ----
def _reset(lib) -> None:
    gc.collect()
    lib.standin_hold_events(0)
    lib.standin_complete_events()
    lib.standin_set_host_capacity(2**64 - 1)
    lib.standin_set_host_pools_supported(1)
    pp = bridge.pinned_pool()
    pp.set_limit(0)
    if pp.backend != "cached":
        pinned._set_backend("cached")
    pp.free_all_blocks()


@pytest.fixture
def pp(standin):
    """The pinned pool on the stand-in, empty, no limit, cached backend, events complete."""
    lib = standin
    lib.standin_set_host_capacity.argtypes = [ctypes.c_uint64]
    lib.standin_host_used.restype = ctypes.c_uint64
    lib.standin_pending_events.restype = ctypes.c_uint64
    lib.standin_live_events.restype = ctypes.c_uint64
    lib.standin_new_stream.restype = ctypes.c_void_p
    lib.standin_new_stream.argtypes = [ctypes.c_int]
    lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
    lib.standin_counter.argtypes = [ctypes.c_int]
    bridge.pinned_buffer(0)  # set the pool up
    _reset(lib)
    pool = bridge.pinned_pool()
    assert pool.used_bytes() == 0, "a view from an earlier test is still alive"
    yield pool
    _reset(lib)


@pytest.fixture
def lib(standin):
    return standin


def stream(lib, dev: int = 0) -> int:
    """A stream of device `dev` that the stand-in knows (as torch would make)."""
    return int(lib.standin_new_stream(dev))


class Holder:
    """Hands a ready-made capsule to numpy.from_dlpack (which wants __dlpack__)."""

    def __init__(self, capsule, device=(3, 0)):
        self.capsule, self.device = capsule, device

    def __dlpack__(self, **kwargs):
        return self.capsule

    def __dlpack_device__(self):
        return self.device


# ---- reading capsules ----
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("code", ctypes.c_uint8),
        ("bits", ctypes.c_uint8),
        ("lanes", ctypes.c_uint16),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _Versioned(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


class _Legacy(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


_get_name = ctypes.pythonapi.PyCapsule_GetName
_get_name.restype, _get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
_get_ptr = ctypes.pythonapi.PyCapsule_GetPointer
_get_ptr.restype, _get_ptr.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


def read_capsule(cap):
    """(name, tensor struct, versioned struct or None) of an unconsumed capsule."""
    name = _get_name(cap)
    addr = _get_ptr(cap, name)
    if name == b"dltensor_versioned":
        v = _Versioned.from_address(addr)
        return name.decode(), v.dl_tensor, v
    return name.decode(), _Legacy.from_address(addr).dl_tensor, None


# ---- numpy views ----
def test_numpy_view_is_the_buffer(pp, lib):
    before = lib.standin_host_used()
    a = bridge.empty_pinned((4, 5), dtype=np.float32)
    buf = a.base
    assert isinstance(buf, bridge.PinnedBuffer)
    assert a.ctypes.data == buf.ptr != 0
    assert buf.size == a.nbytes == 80
    assert lib.standin_host_used() - before >= 80  # real pinned memory behind it
    rc, base, size = core.pinned_lookup(a.ctypes.data + 12)
    assert (rc, base, size) == (0, buf.ptr, 80)
    a[:] = np.arange(20, dtype=np.float32).reshape(4, 5)
    assert bytes(memoryview(buf)) == a.tobytes()  # one memory, two views
    assert a.flags.writeable and a.flags.c_contiguous


def test_page_aligned_and_writable_through_every_view(pp):
    buf = bridge.pinned_buffer(10 * KIB)
    assert buf.ptr % 4096 == 0
    v1 = np.frombuffer(buf, np.uint8)
    v2 = buf.numpy(np.int32, (10 * KIB // 4,))
    v1[:4] = [1, 0, 0, 0]
    assert v2[0] == 1
    assert v1.ctypes.data == v2.ctypes.data == buf.ptr


@pytest.mark.parametrize(
    "dtype",
    [np.float64, np.int8, np.complex128, np.float16, np.dtype([("a", "<i4"), ("b", "<f8")])],
)
@pytest.mark.parametrize(
    "shape, dims",
    [
        (7, (7,)),
        ((3, 4), (3, 4)),
        ([2, 3, 5], (2, 3, 5)),
        ((0,), (0,)),
        ((2, 0, 3), (2, 0, 3)),
        ((), ()),
    ],
)
@pytest.mark.parametrize("order", ["C", "F"])
def test_empty_dtype_shape_order(pp, dtype, shape, dims, order):
    a = bridge.empty_pinned(shape, dtype=dtype, order=order)
    assert a.shape == dims
    assert a.dtype == np.dtype(dtype)
    assert a.base.size == a.nbytes
    if a.size:
        assert a.flags.c_contiguous if order == "C" else a.flags.f_contiguous
        assert a.ctypes.data == a.base.ptr


def test_default_dtype_is_float(pp):
    assert bridge.empty_pinned(3).dtype == np.float64
    assert bridge.zeros_pinned((2, 2)).dtype == np.float64


def test_zeros_clears_a_reused_block(pp):
    a = bridge.empty_pinned(1000, dtype=np.uint8)
    a[:] = 0xAB
    p = a.ctypes.data
    del a
    z = bridge.zeros_pinned((10, 100), dtype=np.uint8, order="F")
    assert z.ctypes.data == p  # the same block came back ...
    assert not z.any()  # ... cleared
    assert z.flags.f_contiguous


def test_numpy_integer_shapes(pp):
    a = bridge.empty_pinned((np.int64(3), np.int32(2)), dtype=np.int16)
    assert a.shape == (3, 2)
    assert bridge.pinned_buffer(np.int64(100)).size == 100


# ---- the pool's figures ----
def test_stats_rise_and_fall(pp):
    s0 = pp.stats()
    a = bridge.empty_pinned(1000, dtype=np.uint8)  # class 4 KiB
    b = bridge.pinned_buffer(5000)  # class 5 KiB (4 KiB + 1/8 of it)
    assert pp.used_bytes() == 4 * KIB + 5 * KIB
    assert pp.total_bytes() == s0["total"] + 9 * KIB
    assert pp.stats()["n_live_blocks"] == 2
    del a
    assert pp.used_bytes() == 5 * KIB
    assert pp.free_bytes() == s0["free"] + 4 * KIB
    assert pp.n_free_blocks() == s0["n_free_blocks"] + 1
    del b
    assert pp.used_bytes() == 0
    assert pp.total_bytes() == pp.free_bytes() == s0["free"] + 9 * KIB
    assert pp.stats()["peak_used"] >= 9 * KIB
    pp.free_all_blocks()
    assert pp.total_bytes() == pp.free_bytes() == pp.n_free_blocks() == 0


@pytest.mark.parametrize(
    "size, cls",
    [
        (1, 4096),
        (4096, 4096),
        (4097, 4608),
        (8192, 8192),
        (8193, 9216),
        (MIB, MIB),
        (MIB + 1, MIB + 128 * KIB),
        (3 * MIB, 3 * MIB),
    ],
)
def test_size_classes(pp, size, cls):
    buf = bridge.pinned_buffer(size)
    assert pp.used_bytes() == cls
    assert buf.size == size


def test_freed_block_is_reused_without_the_driver(pp, lib):
    buf = bridge.pinned_buffer(100 * KIB)
    p = buf.ptr
    del buf
    allocs = lib.standin_counter(C_HOSTALLOC)
    reuses = pp.stats()["num_reuses"]
    buf = bridge.pinned_buffer(99 * KIB)  # same class
    assert buf.ptr == p
    assert lib.standin_counter(C_HOSTALLOC) == allocs
    assert pp.stats()["num_reuses"] == reuses + 1


def test_a_view_keeps_the_block(pp):
    a = bridge.empty_pinned(1000, dtype=np.uint8)
    v = a[10:20]
    p = a.ctypes.data
    del a
    gc.collect()
    assert pp.used_bytes() == 4 * KIB  # v still uses it
    assert bridge.pinned_buffer(1000).ptr != p  # not handed out again
    del v
    assert bridge.pinned_buffer(1000).ptr == p


# ---- DLPack ----
def test_numpy_from_dlpack_same_address(pp):
    buf = bridge.pinned_buffer(64)
    a = np.from_dlpack(buf)
    assert a.ctypes.data == buf.ptr
    assert a.shape == (64,) and a.dtype == np.uint8
    a[:] = 5
    assert bytes(memoryview(buf)) == b"\x05" * 64
    del buf
    assert pp.used_bytes() == 4 * KIB  # the array's export holds the block
    del a
    assert pp.used_bytes() == 0


def test_dlpack_device_and_capsule_kinds(pp):
    buf = bridge.pinned_buffer(100)
    assert buf.__dlpack_device__() == (3, 0)
    cases = [  # kwargs -> capsule name, device type
        (dict(max_version=(1, 0)), "dltensor_versioned", 1),  # torch.from_dlpack's call
        (dict(max_version=(1, 2), dl_device=None, copy=None), "dltensor_versioned", 1),
        (dict(stream=None), "dltensor", 3),  # jax.dlpack.from_dlpack's call
        (dict(stream=None, max_version=(1, 0)), "dltensor_versioned", 3),
        (dict(max_version=(0, 8)), "dltensor", 1),
        (dict(max_version=(1, 0), dl_device=(1, 0)), "dltensor_versioned", 1),
        (dict(dl_device=(3, 0)), "dltensor", 3),
        ({}, "dltensor", 1),  # a pre-versioning consumer
    ]
    for kwargs, name, device in cases:
        cap = buf.__dlpack__(**kwargs)
        got, t, v = read_capsule(cap)
        assert (got, t.device.device_type) == (name, device), kwargs
        assert t.data == buf.ptr and t.ndim == 1 and t.shape[0] == 100 and t.strides[0] == 1
        assert (t.code, t.bits, t.lanes) == (1, 8, 1)
        if v is not None:
            assert (v.major, v.flags) == (1, 0)


def test_export_depends_on_the_arguments_not_on_the_caller(pp):
    # torch.from_dlpack (torch/utils/dlpack.py) calls __dlpack__(max_version=(1, 0));
    # the device type comes from the arguments alone, whoever calls
    buf = bridge.pinned_buffer(100)
    for module in ("torch.utils.dlpack", "jax._src.dlpack", "__main__"):
        scope = {"__name__": module, "buf": buf}
        exec("a = buf.__dlpack__(max_version=(1, 0)); b = buf.__dlpack__(stream=None)", scope)
        assert read_capsule(scope["a"])[1].device.device_type == 1, module
        assert read_capsule(scope["b"])[1].device.device_type == 3, module


def test_unconsumed_capsules_release_the_block(pp, lib):
    buf = bridge.pinned_buffer(100)
    caps = [buf.__dlpack__(), buf.__dlpack__(max_version=(1, 0))]
    del buf
    assert pp.used_bytes() == 4 * KIB
    del caps[0]
    assert pp.used_bytes() == 4 * KIB
    del caps[0]
    assert pp.used_bytes() == 0


def test_consumed_capsule_is_the_consumers(pp):
    buf = bridge.pinned_buffer(100)
    cap = buf.__dlpack__(max_version=(1, 0))
    a = np.from_dlpack(Holder(cap))
    assert _get_name(cap) == b"used_dltensor_versioned"
    assert a.ctypes.data == buf.ptr
    del cap, buf  # numpy's deleter owns it now
    assert pp.used_bytes() == 4 * KIB
    del a
    assert pp.used_bytes() == 0


def test_legacy_capsule_consumed_by_numpy(pp):
    buf = bridge.pinned_buffer(8)
    cap = buf.__dlpack__(stream=None)
    a = np.from_dlpack(Holder(cap))
    assert _get_name(cap) == b"used_dltensor"
    assert a.ctypes.data == buf.ptr
    del buf, cap, a
    assert pp.used_bytes() == 0


def test_dlpack_copy(pp):
    buf = bridge.pinned_buffer(100)
    np.frombuffer(buf, np.uint8)[:] = np.arange(100)
    cap = buf.__dlpack__(max_version=(1, 0), copy=True)
    name, t, v = read_capsule(cap)
    assert t.data != buf.ptr and v.flags == 2  # DLPACK_FLAG_BITMASK_IS_COPIED
    c = np.from_dlpack(Holder(cap))
    assert c.tolist() == list(range(100))
    assert pp.used_bytes() == 8 * KIB  # the copy is a pinned block too
    c2 = np.from_dlpack(buf, copy=True)
    assert c2.ctypes.data != buf.ptr and c2.tolist() == list(range(100))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dl_device=(2, 0)), "kDLCPU"),
        (dict(dl_device=(13, 0)), "kDLCPU"),
        (dict(dl_device="cpu"), "tuple"),
        (dict(dl_device=(1, 1)), r"device \(1, 0\), not \(1, 1\)"),
        (dict(dl_device=(3, 2)), r"ask for device id 0"),
        (dict(max_version=1), "tuple"),
        (dict(max_version=("a", 0)), "tuple"),
    ],
)
def test_dlpack_bad_requests(pp, kwargs, match):
    buf = bridge.pinned_buffer(10)
    with pytest.raises(BufferError, match=match):
        buf.__dlpack__(**kwargs)
    del buf
    assert pp.used_bytes() == 0  # nothing leaked on the error path


def test_zero_bytes(pp):
    buf = bridge.pinned_buffer(0)
    assert (buf.ptr, buf.size) == (0, 0)
    assert np.from_dlpack(buf).shape == (0,)
    assert len(memoryview(buf)) == 0
    a = bridge.empty_pinned((0, 3))
    assert a.shape == (0, 3)
    assert pp.used_bytes() == 0
    buf.record(0)  # nothing to record: no error
    bridge.pinned_record(a, 0)
    bridge.pinned_record(bridge.empty_pinned(10)[5:5], 0)


# ---- reuse safety: recorded copies ----
def test_no_reuse_while_a_recorded_copy_is_pending(pp, lib):
    s = stream(lib)
    lib.standin_hold_events(1)  # the "GPU" is busy
    buf = bridge.pinned_buffer(64 * KIB)
    p = buf.ptr
    buf.record(s)  # an async copy reads it on s
    del buf
    st = pp.stats()
    assert (st["n_pending_blocks"], st["used"]) == (1, 0)
    other = bridge.pinned_buffer(64 * KIB)
    assert other.ptr != p  # a pending block is not lent
    lib.standin_complete_events()  # the copy is done
    again = bridge.pinned_buffer(64 * KIB)
    assert again.ptr == p
    assert pp.stats()["n_pending_blocks"] == 0


C_INVALIDATED = 13


def test_a_block_taken_during_another_threads_global_capture_leaves_it_valid(pp, lib):
    """Issue 30, item 2: the pool's event queries ran in the caller's capture mode.
    During another thread's global-mode capture (torch.cuda.graph's default) a query
    failed with 900 and invalidated that capture, and the failure counted as the copy
    having completed: the block whose copy was still queued was lent again."""
    lib.standin_set_global_capture.argtypes = [ctypes.c_int, ctypes.c_void_p]
    s = stream(lib)
    lib.standin_hold_events(1)  # the "GPU" is busy
    buf = bridge.pinned_buffer(64 * KIB)
    p = buf.ptr
    buf.record(s)  # an async copy reads it on s
    del buf  # pending
    bad = lib.standin_counter(C_INVALIDATED)
    lib.standin_set_global_capture(1, None)  # another thread captures, global mode
    try:
        taken = [bridge.pinned_buffer(64 * KIB) for _ in range(3)]
        assert lib.standin_counter(C_INVALIDATED) == bad  # its capture stays valid
        assert p not in [t.ptr for t in taken]  # the pending block is not lent
        assert pp.stats()["n_pending_blocks"] == 1
    finally:
        lib.standin_set_global_capture(0, None)
    lib.standin_complete_events()  # the copy is done: the block is lent again
    del taken
    again = [bridge.pinned_buffer(64 * KIB) for _ in range(4)]
    reused = p in [t.ptr for t in again]
    del again
    assert reused


def test_a_failing_event_query_never_counts_as_a_completed_copy(pp, lib):
    s = stream(lib)
    lib.standin_hold_events(1)
    buf = bridge.pinned_buffer(64 * KIB)
    p = buf.ptr
    buf.record(s)
    del buf
    lib.standin_fail(b"cuEventQuery", 999, 2)  # a query that fails is no answer
    other = bridge.pinned_buffer(64 * KIB)
    assert other.ptr != p
    assert pp.stats()["n_pending_blocks"] == 1
    lib.standin_clear_faults()
    lib.standin_complete_events()
    again = bridge.pinned_buffer(64 * KIB)  # the pending one: the only free block
    reused = again.ptr == p
    del other, again
    assert reused


def test_stream_synchronize_completes_the_copy(pp, lib):
    s1, s2 = stream(lib), stream(lib)
    lib.standin_hold_events(1)
    a = bridge.empty_pinned(1000, dtype=np.uint8)
    p = a.ctypes.data
    bridge.pinned_record(a[100:], s1)  # a slice is enough
    bridge.pinned_record(a, s2)
    del a
    lib.cuStreamSynchronize(s1)
    other = bridge.pinned_buffer(1000)
    assert other.ptr != p  # s2 still pending
    lib.cuStreamSynchronize(s2)
    assert bridge.pinned_buffer(1000).ptr == p


def test_recording_the_same_stream_again_reuses_its_event(pp, lib):
    s1, s2 = stream(lib), stream(lib)
    buf = bridge.pinned_buffer(100)
    created = lib.standin_counter(C_EVCREATE)
    for _ in range(3):
        buf.record(s1)
    buf.record(s2)
    assert pp.stats()["num_records"] >= 4
    assert lib.standin_counter(C_EVCREATE) - created <= 2
    del buf
    buf = bridge.pinned_buffer(100)  # events came back to the cache
    buf.record(s1)
    assert lib.standin_counter(C_EVCREATE) - created <= 2


def test_record_on_default_streams(pp, lib):
    buf = bridge.pinned_buffer(100)
    for s in (None, 0, 1, 2):  # legacy, CU_STREAM_LEGACY, per-thread
        buf.record(s)


def test_record_accepts_stream_objects(pp, lib):
    s = stream(lib)

    class TorchLike:
        cuda_stream = s

    class CupyLike:
        ptr = s

    class Protocol:
        def __cuda_stream__(self):
            return (0, s)

    buf = bridge.pinned_buffer(100)
    for obj in (TorchLike(), CupyLike(), Protocol(), np.int64(s)):
        buf.record(obj)
    with pytest.raises(TypeError, match="stream"):
        buf.record("s")
    with pytest.raises(ValueError):
        buf.record(-1)


def test_record_rejects_foreign_memory_and_streams(pp, lib):
    buf = bridge.pinned_buffer(100)
    with pytest.raises(ValueError, match="not in pinned memory"):
        bridge.pinned_record(np.zeros(10), stream(lib))
    with pytest.raises(ValueError, match="not a stream"):
        buf.record(0xDEAD0)
    with pytest.raises(TypeError, match="address"):
        bridge.pinned_record(object(), 0)


def test_record_after_release_is_rejected(pp, lib):
    buf = bridge.pinned_buffer(100)
    p = buf.ptr
    del buf
    with pytest.raises(ValueError, match="not in pinned memory"):
        bridge.pinned_record(p, stream(lib))


def test_free_all_blocks_keeps_awaited_blocks(pp, lib):
    s = stream(lib)
    base = lib.standin_host_used()
    keep = bridge.pinned_buffer(MIB)
    busy = bridge.pinned_buffer(MIB)
    idle = bridge.pinned_buffer(MIB)
    lib.standin_hold_events(1)
    busy.record(s)
    del busy, idle
    pp.free_all_blocks()
    st = pp.stats()
    assert (st["n_free_blocks"], st["n_pending_blocks"]) == (1, 1)
    assert lib.standin_host_used() - base == 2 * MIB  # idle freed, busy kept
    lib.standin_complete_events()
    pp.free_all_blocks()
    assert lib.standin_host_used() - base == MIB and pp.free_bytes() == 0
    del keep


# ---- the limit ----
def test_limit_enforced_with_a_clear_error(pp):
    pp.set_limit(64 * KIB)
    assert pp.get_limit() == 64 * KIB
    held = [bridge.pinned_buffer(16 * KIB) for _ in range(4)]
    with pytest.raises(bridge.OutOfMemoryError) as info:
        bridge.pinned_buffer(1)
    err = info.value
    assert isinstance(err, MemoryError)
    assert "BRIDGE_PINNED_MEMORY_LIMIT" in str(err) and "64.00 KiB" in str(err)
    assert (err.size, err.limit) == (1, 64 * KIB)
    assert pp.stats()["num_ooms"] >= 1
    del held[0]
    bridge.pinned_buffer(16 * KIB)  # room again


def test_limit_evicts_free_blocks_of_other_sizes(pp, lib):
    pp.set_limit(MIB)
    a = bridge.pinned_buffer(512 * KIB)
    b = bridge.pinned_buffer(512 * KIB)
    del a, b  # 1 MiB cached in one class
    c = bridge.pinned_buffer(768 * KIB)  # another class: cached blocks go
    assert pp.total_bytes() <= MIB
    assert c.size == 768 * KIB


@pytest.mark.parametrize("held, ask", [(0, 16 * MIB), (6 * MIB, 4 * MIB)])
def test_a_request_past_the_limit_keeps_the_cached_blocks(pp, lib, held, ask):
    """A request the limit refuses even with every free block evicted gave the
    free blocks back all the same (each a cuMemFreeHost, which synchronizes the
    device): the refusal keeps them for the requests that fit."""
    pp.set_limit(8 * MIB)
    kept = [bridge.pinned_buffer(MIB) for _ in range(held // MIB)]
    cached = [bridge.pinned_buffer(MIB) for _ in range(2)]
    del cached
    frees = lib.standin_counter(C_HOSTFREE)
    with pytest.raises(bridge.OutOfMemoryError, match="limit is 8.00 MiB"):
        bridge.pinned_buffer(ask)
    assert lib.standin_counter(C_HOSTFREE) == frees
    st = pp.stats()
    assert (st["free"], st["n_free_blocks"], st["used"]) == (2 * MIB, 2, held)
    del kept


def test_lowering_the_limit_trims_free_blocks(pp):
    bufs = [bridge.pinned_buffer(100 * KIB) for _ in range(4)]
    del bufs
    assert pp.total_bytes() == 4 * 104 * KIB  # class of 100 KiB is 104 KiB
    pp.set_limit(250 * KIB)
    assert pp.total_bytes() <= 250 * KIB


def test_pending_blocks_count_against_the_limit(pp, lib):
    s = stream(lib)
    pp.set_limit(128 * KIB)
    lib.standin_hold_events(1)
    buf = bridge.pinned_buffer(128 * KIB)
    buf.record(s)
    del buf
    with pytest.raises(bridge.OutOfMemoryError, match="awaiting copies"):
        bridge.pinned_buffer(64 * KIB)
    lib.standin_complete_events()
    bridge.pinned_buffer(64 * KIB)  # the completed block was evicted


def test_set_limit_arguments(pp):
    total = pinned.host_memory_total()
    pp.set_limit(fraction=0.5)
    assert pp.get_limit() == int(0.5 * total)
    pp.set_limit("1MiB")
    assert pp.get_limit() == MIB
    pp.set_limit("10%")
    assert pp.get_limit() == int(0.1 * total)
    pp.set_limit()
    assert pp.get_limit() == 0
    for kwargs in (
        dict(size=1, fraction=0.5),
        dict(fraction=1.5),
        dict(fraction=-0.1),
        dict(fraction=True),
        dict(size=-1),
        dict(size="lots"),
    ):
        with pytest.raises(ValueError):
            pp.set_limit(**kwargs)
    pp.set_limit("0.5")  # a fraction written as text
    assert pp.get_limit() == int(0.5 * total)
    pp.set_limit(0)


def test_a_limit_above_the_host_memory_warns(pp):
    total = pinned.host_memory_total()
    with pytest.warns(UserWarning, match="larger than the host's memory") as record:
        pp.set_limit(2 * total)
    msg = str(record[0].message)
    assert f"({2 * total} bytes)" in msg and f"{total} bytes" in msg
    assert record[0].filename == __file__
    assert pp.get_limit() == 2 * total  # applied: it is not wrong, only useless
    pp.set_limit(0)


def test_driver_out_of_memory_gives_cached_blocks_back(pp, lib):
    base = lib.standin_host_used()
    bufs = [bridge.pinned_buffer(MIB) for _ in range(3)]
    del bufs  # 3 MiB cached
    lib.standin_set_host_capacity(base + 3 * MIB)
    big = bridge.pinned_buffer(2 * MIB + 1)  # fits only once the cache is freed
    assert pp.free_bytes() == 0
    with pytest.raises(bridge.OutOfMemoryError, match="could not page-lock"):
        bridge.pinned_buffer(2 * MIB)
    del big


@pytest.mark.parametrize("extra", [1, 1 << 50])
def test_a_request_larger_than_the_host_says_so_and_keeps_the_cache(pp, lib, extra):
    """A pinned request larger than the host's memory (a wrong shape or dtype) gave
    every free block back (each cuMemFreeHost synchronizes the device), asked the
    driver again, and said to drop views or free blocks; past 128 TiB it was not
    counted in num_ooms.  It is refused at once, counted, and says why."""
    host = pinned.host_memory_total()
    cached = [bridge.pinned_buffer(MIB) for _ in range(2)]
    del cached
    lib.standin_set_host_capacity(lib.standin_host_used() + 8 * MIB)
    allocs, frees = lib.standin_counter(C_HOSTALLOC), lib.standin_counter(C_HOSTFREE)
    ooms = pp.stats()["num_ooms"]
    with pytest.raises(bridge.OutOfMemoryError, match="more than this host's memory") as info:
        bridge.pinned_buffer(host + extra)
    assert "ask for less" in str(info.value) and info.value.size == host + extra
    del info
    assert lib.standin_counter(C_HOSTALLOC) == allocs  # the driver was not asked
    assert lib.standin_counter(C_HOSTFREE) == frees  # nor the cache given back
    st = pp.stats()
    assert (st["free"], st["num_ooms"]) == (2 * MIB, ooms + 1)


def _run(code: str, **env) -> subprocess.CompletedProcess:
    e = dict(os.environ, **env)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=60
    )


def test_limit_and_backend_from_the_environment(pp):
    code = (
        "import bridge; p = bridge.pinned_pool(); print(p.get_limit(), p.backend); "
        "import numpy; bridge.empty_pinned(10)"
    )
    r = _run(code, BRIDGE_PINNED_MEMORY_LIMIT="3MiB", BRIDGE_PINNED_BACKEND="mempool")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(3 * MIB), "mempool"]
    r = _run(code, BRIDGE_PINNED_MEMORY_LIMIT="lots")
    assert r.returncode != 0
    assert "BRIDGE_PINNED_MEMORY_LIMIT='lots'" in r.stderr
    # the pinned pool is host memory: the message says so, and nothing of a device
    last = r.stderr.strip().splitlines()[-1]
    assert "a share of the host's memory: a percentage (80%) or a fraction (0.8)" in last
    assert "device" not in last
    r = _run(code, BRIDGE_PINNED_MEMORY_LIMIT="0.001")  # a fraction of the host's memory
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[0]) == int(0.001 * pinned.host_memory_total())
    r = _run(code, BRIDGE_PINNED_BACKEND="fast")
    assert r.returncode != 0 and "BRIDGE_PINNED_BACKEND='fast'" in r.stderr


# ---- bad inputs ----
@pytest.mark.parametrize("nbytes", [-1, 1.5, "10", True, None])
def test_bad_sizes(pp, nbytes):
    with pytest.raises(ValueError):
        bridge.pinned_buffer(nbytes)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(shape=(-1,)),
        dict(shape=(2, -3)),
        dict(shape="ab"),
        dict(shape=(2.5,)),
        dict(shape=(True,)),
        dict(shape=3, order="K"),
        dict(shape=3, order="c"),
    ],
)
def test_bad_shapes_and_orders(pp, kwargs):
    with pytest.raises(ValueError):
        bridge.empty_pinned(**kwargs)
    with pytest.raises(ValueError):
        bridge.zeros_pinned(**kwargs)


def test_bad_dtype(pp):
    with pytest.raises(TypeError):
        bridge.empty_pinned(3, dtype="no such type")
    assert pp.used_bytes() == 0


def test_buffers_are_made_by_the_pool_only(pp):
    with pytest.raises(TypeError):
        bridge.PinnedBuffer(10)


# ---- the mempool backend (a host-located stream-ordered pool) ----
def test_mempool_backend(pp, lib):
    assert pinned._set_backend("mempool") == "mempool"
    assert lib.standin_counter(C_HOSTPOOL) >= 1
    a = bridge.empty_pinned(1000, dtype=np.int32)
    a[:] = np.arange(1000)
    assert a.ctypes.data == a.base.ptr
    assert np.from_dlpack(a.base).ctypes.data == a.ctypes.data
    p = a.ctypes.data
    del a
    assert bridge.pinned_buffer(4000).ptr == p  # free lists as in the cached base
    s = stream(lib)
    lib.standin_hold_events(1)
    busy = bridge.pinned_buffer(MIB)
    busy.record(s)
    with pytest.raises(bridge.BridgeError, match=r"no pinned block .*\(now 1 lent, 0 awaited"):
        pinned._set_backend("cached")  # a block is lent: the message counts it
    del busy
    base = lib.standin_host_used()
    waits = lib.standin_counter(3)  # C_WAIT
    pp.free_all_blocks()  # freed on the stream, not waited for
    assert pp.stats()["n_pending_blocks"] == 0
    assert lib.standin_counter(3) > waits
    assert lib.standin_host_used() < base
    lib.standin_complete_events()
    assert pinned._set_backend("cached") == "cached"


def test_a_switch_after_the_copies_completed_is_not_refused(pp, lib):
    """A block freed with a queued copy is pending until an allocation queries its
    event; a caller that synchronized (the copy completed) may switch backends: the
    switch settles such blocks itself.  One still awaited refuses, and loses nothing."""
    s = stream(lib)
    lib.standin_hold_events(1)
    buf = bridge.pinned_buffer(MIB)
    buf.record(s)
    del buf  # pending: its copy is still queued
    assert pp.stats()["n_pending_blocks"] == 1
    with pytest.raises(bridge.BridgeError, match=r"\(now 0 lent, 1 awaited by a copy\)"):
        pinned._set_backend("mempool")  # still awaited: refused
    assert pp.stats()["n_pending_blocks"] == 1  # ... and kept, not freed under the copy
    lib.standin_complete_events()  # the copy completed; nothing queried it since
    assert pinned._set_backend("mempool") == "mempool"
    assert pp.stats()["n_pending_blocks"] == 0
    assert pinned._set_backend("cached") == "cached"


def test_auto_backend_falls_back_to_cached(pp, lib):
    assert pinned._set_backend("auto") in ("mempool", "cached")
    pinned._set_backend("cached")


# ---- fork ----
_FORK_CHILD = """
import os, sys
import bridge
buf = bridge.pinned_buffer(4096)
pid = os.fork()
if pid == 0:
    code = 1
    try:
        {call}
    except bridge.BridgeError as e:
        print(type(e).__name__, e)
        code = 0
    except Exception as e:
        print(type(e).__name__, e)
    sys.stdout.flush()
    os._exit(code)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.parametrize(
    "call", ["bridge.pinned_record(buf, 0)", "buf.record(0)", "bridge.pinned_buffer(10)"]
)
def test_a_forked_child_is_told_it_was_forked(pp, call):
    """In a child forked after the pool was set up, recording a copy against the
    parent's buffer said "the CUDA driver is not loaded yet; call bridge.unify()
    first", which a DataLoader worker cannot act on: it is told it was forked."""
    r = _run(_FORK_CHILD.format(call=call))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "forked child" in r.stdout and "spawn" in r.stdout, r.stdout
    assert "unify" not in r.stdout


_FORK_DURING_SETUP = """
import os, signal, sys, threading
import bridge
from bridge.pinned import _backend

# another thread is in the pool's first set-up (holding its lock) when this one forks
entered, go = threading.Event(), threading.Event()
real_setup = _backend._setup
def held_setup(backend):
    entered.set()
    go.wait()
    return real_setup(backend)
_backend._setup = held_setup
t = threading.Thread(target=bridge.pinned_buffer, args=(10,))
t.start()
assert entered.wait(30)
pid = os.fork()
if pid == 0:
    _backend._setup = real_setup
    signal.alarm(20)  # a child stuck on the lock dies of SIGALRM
    try:
        bridge.pinned_buffer(10)
        print("no error")
    except bridge.BridgeError as e:
        print(type(e).__name__, e)
    sys.stdout.flush()
    os._exit(0)
go.set()
t.join()
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
bridge.pinned_buffer(10)  # the parent's set-up completed
"""


def test_a_child_forked_during_setup_is_told_it_was_forked(pp):
    """A child forked while another thread of the parent was in the pinned pool's first
    set-up inherited the set-up lock held, and its first pinned call waited on it forever
    (a DataLoader worker forked while the main thread first made pinned memory): it is
    told it was forked, as any child is."""
    r = _run(_FORK_DURING_SETUP)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "child 0" in r.stdout, r.stdout  # not -14: killed by the alarm, stuck on the lock
    assert "forked child" in r.stdout and "spawn" in r.stdout, r.stdout


# ---- threads ----
def test_threads_share_the_pool(pp, lib):
    s = stream(lib)
    errors = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(300):
                n = int(rng.integers(1, 64 * KIB))
                a = bridge.empty_pinned(n, dtype=np.uint8)
                a[:] = seed
                if rng.random() < 0.3:
                    bridge.pinned_record(a, s)
                assert (a == seed).all()  # nobody else got this block
                del a
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    st = pp.stats()
    assert st["used"] == 0 and st["n_live_blocks"] == 0
    assert st["total"] == st["free"]


# ---- empty_like_pinned / zeros_like_pinned: cupyx's arguments ----
def _is_pinned(arr) -> bool:
    base = arr
    while getattr(base, "base", None) is not None and not isinstance(base, bridge.PinnedBuffer):
        base = base.base
    return isinstance(base, bridge.PinnedBuffer)


@pytest.mark.parametrize("fn", ["empty_like_pinned", "zeros_like_pinned"])
def test_like_pinned_keeps_the_sources_layout_with_order_k(pp, fn):
    like = getattr(bridge, fn)
    c = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    f = np.asfortranarray(c)
    t = c.transpose(1, 2, 0)  # neither C nor F: the order of its strides is kept, packed
    for src in (c, f, t):
        out = like(src)
        assert out.shape == src.shape and out.dtype == src.dtype and _is_pinned(out)
        assert np.argsort(out.strides).tolist() == np.argsort(src.strides).tolist()
        assert out.nbytes == src.nbytes
    assert like(f).flags.f_contiguous and like(c).flags.c_contiguous
    assert like(t).strides == (16, 4, 48)
    assert like(t, order="C").flags.c_contiguous
    assert like(c, order="F").flags.f_contiguous
    assert like(f, order="A").flags.f_contiguous and like(t, order="A").flags.c_contiguous
    assert like(f, shape=(6, 4)).flags.c_contiguous  # another number of dimensions: C
    out = like(c, dtype=np.int64, shape=(5,))
    assert out.shape == (5,) and out.dtype == np.int64


def test_zeros_like_pinned_is_zeros_and_empty_like_reuses_the_pool(pp):
    src = np.ones((64, 64))
    z = bridge.zeros_like_pinned(src)
    assert not z.any() and z.shape == src.shape
    e = bridge.empty_like_pinned(src)
    e[...] = 3
    assert (e == 3).all()


@pytest.mark.parametrize("fn", ["empty_like_pinned", "zeros_like_pinned"])
def test_like_pinned_refuses_subok_as_cupyx_does(pp, fn):
    with pytest.raises(TypeError, match="subok is not supported"):
        getattr(bridge, fn)(np.zeros(3), subok=True)
    with pytest.raises(TypeError, match="subok is not supported"):
        getattr(bridge, fn)(np.zeros(3), subok=False)
    with pytest.raises(ValueError, match="order"):
        getattr(bridge, fn)(np.zeros(3), order="X")


def test_the_c_buffer_says_its_address_and_size(pp):
    # the C type's own repr (PinnedBuffer's __repr__ is Python's): on Python 3.10 and 3.11
    # PyUnicode_FromFormat knows no %zx, and such a repr printed its format string
    buf = bridge.pinned_buffer(4096)
    text = core.PinnedBufferBase.__repr__(buf)
    assert text == f"<PinnedBuffer {hex(buf.ptr)}, 4096 bytes, pinned>"
    del buf
