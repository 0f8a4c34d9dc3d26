# SPDX-License-Identifier: Apache-2.0
"""bridge.adapters.numba (Numba's EMM plugin) on the stand-in driver.

Where numba-cuda is installed its own classes are used; elsewhere (CI) a
stand-in ``numba.cuda.cudadrv.driver`` with the same ownership rules as
numba-cuda 0.30 (``MemoryPointer`` / ``AutoFreePointer`` reference counts,
``OwnedPointer`` views, ``HostOnlyCUDAMemoryManager``'s allocations and
deferred cleanup). Real contexts and kernels: tests/gpu/test_gpu_numba.py.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import types
import weakref

import pytest
from ledger_util import MIB

import bridge
from bridge._runtime import core


# ---- a stand-in of numba-cuda's driver module (the parts the plugin uses) ----
class CudaAPIError(Exception):
    def __init__(self, code, msg):
        self.code, self.msg = code, msg
        super().__init__(code, msg)


class MemoryPointer:
    def __init__(self, context, pointer, size, owner=None, finalizer=None):
        self.context, self.device_pointer, self.size = context, pointer, size
        self.is_managed = finalizer is not None
        self.refct = 1
        self._owner = owner
        if finalizer is not None:
            self._finalizer = weakref.finalize(self, finalizer)

    @property
    def owner(self):
        return self if self._owner is None else self._owner

    def own(self):
        return OwnedPointer(weakref.proxy(self))

    def free(self):
        if self.is_managed:
            self._finalizer()

    def view(self, start):
        view = MemoryPointer(self.context, self.device_pointer + start, 0, owner=self.owner)
        return OwnedPointer(weakref.proxy(self.owner), view)


class AutoFreePointer(MemoryPointer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.refct -= 1


class OwnedPointer:
    def __init__(self, memptr, view=None):
        self._mem, self._view = memptr, memptr if view is None else view
        mem = self._mem

        def deref():
            try:
                mem.refct -= 1
                if mem.refct == 0:
                    mem.free()
            except ReferenceError:
                pass

        self._mem.refct += 1
        weakref.finalize(self, deref)

    def __getattr__(self, name):
        return getattr(self._view, name)


class PendingDeallocs:
    def __init__(self):
        self.memory_capacity, self._disabled = 0, 0

    @contextlib.contextmanager
    def disable(self):
        self._disabled += 1
        try:
            yield
        finally:
            self._disabled -= 1

    @property
    def is_disabled(self):
        return self._disabled > 0

    def clear(self):
        pass


class HostOnlyCUDAMemoryManager:
    def __init__(self, *args, **kwargs):
        self.context = kwargs.pop("context")
        self.allocations, self.deallocations = {}, PendingDeallocs()

    def memhostalloc(self, size, mapped=False, portable=False, wc=False):
        return ("numba's own", size, mapped, wc)

    def reset(self):
        self.allocations.clear()

    @contextlib.contextmanager
    def defer_cleanup(self):
        with self.deallocations.disable():
            yield


class PinnedMemory:
    def __init__(self, context, pointer, size, owner=None, finalizer=None):
        self.owned, self.host_pointer, self.size = owner, pointer, size
        if finalizer is not None:
            weakref.finalize(self, finalizer)


def _standin_driver_module(devices: dict) -> types.ModuleType:
    drv = types.ModuleType("numba.cuda.cudadrv.driver")
    drv.binding = types.SimpleNamespace(
        CUresult=types.SimpleNamespace(CUDA_ERROR_OUT_OF_MEMORY=2, CUDA_ERROR_NOT_SUPPORTED=801),
        CUdeviceptr=int,
    )
    drv.CudaAPIError = CudaAPIError
    drv.MemoryPointer, drv.AutoFreePointer, drv.PinnedMemory = (
        MemoryPointer,
        AutoFreePointer,
        PinnedMemory,
    )
    drv.HostOnlyCUDAMemoryManager = HostOnlyCUDAMemoryManager
    drv.GetIpcHandleMixin = type("GetIpcHandleMixin", (), {})
    drv.MemoryInfo = lambda free, total: types.SimpleNamespace(free=free, total=total)
    drv._SizeNotSet = 0
    drv._memory_manager = None
    drv.driver = types.SimpleNamespace(devices=devices, cuMemGetInfo=lambda: (10 * MIB, 16 << 30))
    return drv


@pytest.fixture
def numba_adapter(standin, monkeypatch):
    """The adapter on numba-cuda where installed, else on the stand-in driver module."""
    devices: dict = {}
    try:
        from numba.cuda.cudadrv import driver as real

        real.binding.CUresult  # noqa: B018 - numba-cuda, not numba's old CUDA target
    except (ImportError, AttributeError):
        drv = _standin_driver_module(devices)
        cuda = types.ModuleType("numba.cuda")
        cuda.set_memory_manager = lambda cls: setattr(drv, "_memory_manager", cls)
        numba = types.ModuleType("numba")
        numba.cuda = cuda
        cudadrv = types.ModuleType("numba.cuda.cudadrv")
        cudadrv.driver = drv
        for name, mod in (
            ("numba", numba),
            ("numba.cuda", cuda),
            ("numba.cuda.cudadrv", cudadrv),
            ("numba.cuda.cudadrv.driver", drv),
        ):
            monkeypatch.setitem(sys.modules, name, mod)
    else:
        monkeypatch.setattr(real, "_memory_manager", real._memory_manager)
        monkeypatch.setattr(real.driver, "devices", devices)
        # no driver here: what cuMemGetInfo would say (set in the instance, not looked up)
        monkeypatch.setitem(vars(real.driver), "cuMemGetInfo", lambda: (10 * MIB, 16 << 30))
    monkeypatch.delitem(sys.modules, "bridge.adapters.numba", raising=False)
    monkeypatch.setattr(sys.modules["bridge.unify"], "_bridge", None)
    import bridge.adapters.numba as adapter

    yield adapter, devices
    sys.modules.pop("bridge.adapters.numba", None)


class Context:
    def __init__(self, device: int = 0) -> None:
        self.device = types.SimpleNamespace(id=device)


def numba_bytes(device: int = 0) -> int:
    return bridge.stats(device).by_framework["numba"]


def manager(adapter, device: int = 0):
    ctx = Context(device)
    m = adapter.BridgeNumbaManager(context=ctx)
    m._ctx = ctx  # keep the context alive (numba's Device does)
    return m


def test_unify_sets_numbas_memory_manager(numba_adapter):
    adapter, _ = numba_adapter
    b = bridge.unify(cupy=False, torch=False, numba=True)
    assert "numba" in b.frameworks and adapter.installed()
    assert adapter._numba_memory_manager is adapter.BridgeNumbaManager
    assert adapter.BridgeNumbaManager(context=None).interface_version == 1


def test_unify_refuses_after_numba_made_a_context_with_its_own_manager(numba_adapter):
    adapter, devices = numba_adapter
    own = types.SimpleNamespace(memory_manager=object())
    devices[0] = types.SimpleNamespace(id=0, primary_context=own)
    with pytest.raises(bridge.BridgeError, match="before Numba's first CUDA call"):
        bridge.unify(cupy=False, torch=False, numba=True)
    assert not adapter.installed()


def test_device_memory_is_counted_as_numba_and_freed_with_its_last_view(numba_adapter):
    adapter, _ = numba_adapter
    m = manager(adapter)
    p = m.memalloc(MIB)
    ptr = int(p.device_pointer)
    assert core.lookup(ptr)[1:] == (MIB, 0, core.TAG_NUMBA)
    assert numba_bytes() == MIB
    v = p.view(1024)
    del p
    gc.collect()
    assert numba_bytes() == MIB  # the view keeps the memory
    del v
    gc.collect()
    assert numba_bytes() == 0 and core.lookup(ptr)[0] != 0
    assert m.allocations == {}


def test_frees_wait_for_defer_cleanup_to_end(numba_adapter):
    adapter, _ = numba_adapter
    m = manager(adapter)
    with m.defer_cleanup():
        with m.defer_cleanup():
            p = m.memalloc(2 * MIB)
            del p
            gc.collect()
        assert numba_bytes() == 2 * MIB  # nested: still deferred
    assert numba_bytes() == 0


def test_reset_frees_everything(numba_adapter):
    adapter, _ = numba_adapter
    m = manager(adapter)
    keep = [m.memalloc(MIB), m.memalloc(3 * MIB)]
    assert numba_bytes() == 4 * MIB
    m.reset()
    gc.collect()
    assert numba_bytes() == 0
    del keep  # numba's arrays after a reset: dangling, and freeing them does nothing
    gc.collect()
    assert bridge.stats(0).ledger == 0


def test_zero_bytes_needs_no_memory(numba_adapter):
    adapter, _ = numba_adapter
    p = manager(adapter).memalloc(0)
    assert int(p.device_pointer) == 0 and numba_bytes() == 0


def test_past_the_budget_numba_raises_its_cudaapierror_oom_and_holds_nothing(numba_adapter):
    adapter, _ = numba_adapter
    core.set_limit(0, 8 * MIB)
    m = manager(adapter)
    keep = m.memalloc(6 * MIB)
    with pytest.raises(adapter.OutOfMemoryError) as info:
        m.memalloc(4 * MIB)
    e = info.value
    assert isinstance(e, adapter._drv.CudaAPIError) and isinstance(e, MemoryError)
    assert e.code == adapter._drv.binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    assert "CUDA_ERROR_OUT_OF_MEMORY" in str(e) and "for numba on device 0" in str(e)
    assert "numba 6.00 MiB" in str(e) and (e.device, e.size) == (0, 4 * MIB)
    assert numba_bytes() == 6 * MIB
    del keep
    gc.collect()
    assert numba_bytes() == 0


def test_memory_info_is_what_the_budget_leaves(numba_adapter):
    adapter, _ = numba_adapter
    core.set_limit(0, 64 * MIB)
    m = manager(adapter)
    p = m.memalloc(16 * MIB)
    info = m.get_memory_info()
    assert info.total == 64 * MIB
    assert info.free <= 48 * MIB
    del p


def test_memory_info_under_a_budget_is_what_torch_and_cupy_are_told(numba_adapter, monkeypatch):
    """Numba's get_memory_info (its deallocation threshold, users sizing work) answers as
    bridge.mem_get_info, torch's and CuPy's queries do: within the budget less what the
    budget counts, managed memory and a share's other members included, not less the pool's
    used bytes alone."""
    adapter, _ = numba_adapter
    monkeypatch.setattr(adapter._drv.driver, "cuMemGetInfo", lambda: (16 << 30, 16 << 30))
    core.set_limit(0, 64 * MIB)
    rc, managed = core.alloc_managed(0, 32 * MIB, core.TAG_OTHER)  # on the budget, not the pool
    assert rc == 0 and managed is not None
    try:
        m = manager(adapter)
        info = m.get_memory_info()
        assert (info.free, info.total) == bridge.mem_get_info(0) == (32 * MIB, 64 * MIB)
        p = m.memalloc(info.free)  # what it said is free is served
        del p
    finally:
        del managed
        core.set_limit(0, 0)


def test_pinned_memory_comes_from_the_pinned_pool(numba_adapter):
    adapter, _ = numba_adapter
    m = manager(adapter)
    before = bridge.pinned_pool().used_bytes()
    pm = m.memhostalloc(MIB)
    assert bridge.pinned_pool().used_bytes() >= before + MIB
    assert pm.size == MIB and pm.host_pointer == pm.owned.ptr
    del pm
    gc.collect()
    assert bridge.pinned_pool().used_bytes() == before
    if adapter._drv.HostOnlyCUDAMemoryManager is HostOnlyCUDAMemoryManager:  # the stand-in
        # mapped or write-combined host memory stays Numba's own
        assert m.memhostalloc(MIB, mapped=True) == ("numba's own", MIB, True, False)
        assert m.memhostalloc(MIB, wc=True) == ("numba's own", MIB, False, True)


def test_a_freed_block_goes_back_on_the_legacy_stream_and_is_never_cached(numba_adapter):
    """Numba uses an array on any of its streams: its free is issued on the legacy
    stream (which waits for them), and the per-stream cache would skip that."""
    adapter, _ = numba_adapter
    core.set_cache(0, 64 * MIB)
    fallbacks = core.stats(0)[1]["num_order_fallbacks"]
    m = manager(adapter)
    m.initialize()  # what Numba calls when the context is pushed
    p = m.memalloc(MIB)
    del p
    gc.collect()
    s = core.stats(0)[1]
    assert s["cached"] == 0 and numba_bytes() == 0
    assert s["num_order_fallbacks"] == fallbacks
    # unify(numba=True) sets the same rule
    core.set_tag_cached(core.TAG_NUMBA, True)
    bridge.unify(cupy=False, torch=False, numba=True)
    p = manager(adapter).memalloc(MIB)
    del p
    gc.collect()
    assert core.stats(0)[1]["cached"] == 0


def test_an_ipc_handle_is_refused_saying_why_and_what_to_do(numba_adapter):
    """Numba's IPC handles come from cuIpcGetMemHandle, which the driver refuses for memory
    of a stream-ordered pool (docs/numba.md): DeviceNDArray.get_ipc_handle() gave the
    driver's bare error. It is Numba's CudaAPIError (CUDA_ERROR_NOT_SUPPORTED) saying why
    and what to do, and the array stays as it was."""
    adapter, _ = numba_adapter
    m = manager(adapter)
    p = m.memalloc(MIB)
    with pytest.raises(adapter._drv.CudaAPIError) as info:
        m.get_ipc_handle(p)
    e = info.value
    assert e.code == adapter._drv.binding.CUresult.CUDA_ERROR_NOT_SUPPORTED
    assert "no CUDA IPC handle" in str(e) and "copy_to_host" in str(e)
    assert numba_bytes() == MIB
    del p, e, info  # the traceback holds the array
    gc.collect()
    assert numba_bytes() == 0
