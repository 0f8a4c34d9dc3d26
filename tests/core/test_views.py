# SPDX-License-Identifier: Apache-2.0
"""Free-memory queries under the budget (bridge.views, views.c) on the stand-in driver.

The stand-in's free memory is its capacity less what its pools hold from it
(reserved bytes, idle ones included): what cuMemGetInfo reports on a GPU.
The frameworks' side runs on stand-in modules in child processes; the GPU
tests (test_gpu_views.py) check the real frameworks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from ledger_util import GIB, MIB, TAG_CUPY, TAG_TORCH

import bridge
from bridge import views
from bridge._errors import Status
from bridge._runtime import core

TOTAL = 16 * GIB  # the stand-in's device memory (the standin fixture)


def info(dev: int = 0) -> dict:
    rc, mi = core.mem_info(dev)
    assert rc == Status.OK
    return dict(mi)


def test_without_a_budget_the_answer_is_the_drivers(led):
    led.ok(3 * GIB)
    mi = info()
    assert (mi["free"], mi["total"]) == (TOTAL - 3 * GIB, TOTAL)
    assert (mi["driver_free"], mi["driver_total"]) == (TOTAL - 3 * GIB, TOTAL)
    assert bridge.mem_get_info(0) == (TOTAL - 3 * GIB, TOTAL)
    assert views.budget_view(0) is None  # the frameworks answer natively


def test_ten_gib_budget_with_four_held_reports_six_free_of_ten(led):
    core.set_limit(0, 10 * GIB)
    led.ok(3 * GIB, tag=TAG_TORCH)
    led.ok(1 * GIB, tag=TAG_CUPY)
    assert bridge.mem_get_info(0) == (6 * GIB, 10 * GIB)
    assert views.budget_view(0) == (6 * GIB, 10 * GIB)
    assert info()["held"] == 4 * GIB


def test_the_device_free_memory_caps_the_answer(led):
    led.sd.standin_set_capacity(0, 7 * GIB)  # less on the card than the budget leaves
    core.set_limit(0, 10 * GIB)
    led.ok(4 * GIB)
    assert bridge.mem_get_info(0) == (3 * GIB, 10 * GIB)


def test_what_others_hold_in_the_pool_counts_against_the_budget(led):
    core.set_limit(0, 10 * GIB)
    led.ok(4 * GIB)
    led.add_foreign(0, 2 * GIB)  # JAX, say: in the pool, not through the bridge
    assert bridge.mem_get_info(0) == (4 * GIB, 10 * GIB)


def test_a_budget_above_the_device_reports_the_device_as_total(led):
    with pytest.warns(UserWarning):
        bridge.pool(0).set_limit(32 * GIB)
    led.ok(4 * GIB)
    assert bridge.mem_get_info(0) == (TOTAL - 4 * GIB, TOTAL)


def test_the_cache_and_the_pools_idle_memory_count_as_free(led):
    core.set_cache(0, 4 * GIB)
    core.set_cache_fraction(0, 1 / 16, 256 * MIB)
    core.set_cache_tiers(0, MIB, 256 * MIB)  # a large tier's cap above the block: it is kept
    core.set_limit(0, 15 * GIB)
    p = led.ok(128 * MIB, stream=0)  # freed on the default stream: kept in the cache
    led.free(p)
    q = led.ok(6 * GIB)
    led.free(q)  # back to the pool, which keeps it (idle) until trimmed
    led.sd.standin_sync_all(0)
    mi = info()
    assert mi["cached"] == 128 * MIB and mi["pool_idle"] == 6 * GIB
    # natively the pool's memory, idle or cached, is not free
    assert mi["driver_free"] == TOTAL - 6 * GIB - 128 * MIB
    assert (mi["free"], mi["total"]) == (15 * GIB, 15 * GIB)
    core.set_cache(0, 0)


def test_a_full_budget_reports_zero_free(led):
    core.set_limit(0, 4 * GIB)
    led.ok(4 * GIB)
    led.add_foreign(0, 1 * GIB)  # the pool past the budget: never a negative figure
    assert bridge.mem_get_info(0) == (0, 4 * GIB)


def test_budget_view_is_none_where_the_framework_should_answer(standin):
    assert views.budget_view(0) is None  # no budget
    assert views.budget_view(40) is None  # a device nobody set up
    assert views.budget_view(-1) is None


def test_unify_checks_budget_views_and_sets_the_switch(standin, monkeypatch):
    unify_mod = sys.modules["bridge.unify"]
    monkeypatch.setattr(unify_mod, "_bridge", None)
    with pytest.raises(ValueError, match="budget_views"):
        bridge.unify(cupy=False, torch=False, budget="8GiB", budget_views="yes")  # type: ignore[arg-type]
    assert core.stats(0)[1]["limit"] == 0  # nothing changed
    bridge.unify(cupy=False, torch=False, budget="8GiB", budget_views=False)
    assert not views.enabled()
    bridge.unify(cupy=False, torch=False, budget="8GiB")
    assert views.enabled()


def _child(code: str) -> subprocess.CompletedProcess:
    prelude = textwrap.dedent(
        """
        import os, sys, types
        from bridge._runtime import core
        GIB = 1 << 30
        assert core.init(os.environ["BRIDGE_CUDA_LIBRARY"]) == 0
        assert core.setup(0, 2**64 - 1) == 0
        """
    )
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )


def test_cupy_queries_answer_within_the_budget_and_come_back(standin):
    """On a stand-in cupy module: runtime.memGetInfo and Device().mem_info give the
    budget's figures with views on, CuPy's own after remove_views; devices CuPy
    makes itself are still instances of cupy.cuda.Device."""
    r = _child(
        """
        cupy = types.ModuleType("cupy")
        cuda = types.ModuleType("cupy.cuda")
        memory = types.ModuleType("cupy.cuda.memory")
        device_mod = types.ModuleType("cupy.cuda.device")
        class OutOfMemoryError(MemoryError):
            pass
        memory.OutOfMemoryError = OutOfMemoryError
        memory.UnownedMemory = memory.MemoryPointer = object
        NATIVE = (123, 456)
        class Device:  # CuPy's is a Cython class; the subclass is what matters
            def __init__(self, device=None):
                self.id = 0 if device is None else int(device)
            @property
            def mem_info(self):
                return NATIVE
        device_mod.Device = Device
        cuda.Device, cuda.device, cuda.memory = Device, device_mod, memory
        cuda.runtime = types.SimpleNamespace(getDevice=lambda: 0, memGetInfo=lambda: NATIVE)
        cupy.cuda = cuda
        sys.modules.update({"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.memory": memory,
                            "cupy.cuda.device": device_mod})
        from bridge.adapters import cupy as adapter
        adapter.install_views()
        assert cuda.runtime.memGetInfo() == NATIVE  # no budget: CuPy's own answer
        assert core.set_limit(0, 10 * GIB) == 0
        rc, p = core.alloc(0, 4 * GIB, 0xA1000, core.TAG_CUPY)
        assert rc == 0
        assert cuda.runtime.memGetInfo() == (6 * GIB, 10 * GIB)
        assert cupy.cuda.Device(0).mem_info == (6 * GIB, 10 * GIB)
        assert cupy.cuda.device.Device().mem_info == (6 * GIB, 10 * GIB)
        made_by_cupy = Device(0)
        assert isinstance(made_by_cupy, cupy.cuda.Device)
        assert issubclass(Device, cupy.cuda.Device)
        adapter.install_views()  # twice: installed once
        adapter.remove_views()
        assert cuda.runtime.memGetInfo() == NATIVE
        assert cupy.cuda.Device is Device and cupy.cuda.device.Device is Device
        assert cupy.cuda.Device(0).mem_info == NATIVE
        core.free(p)
        print("ok")
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_torch_queries_answer_within_the_budget_and_come_back(standin):
    """On a stand-in torch module: torch.cuda.mem_get_info (and .memory's, and
    torch.accelerator's) give the budget's figures, torch's own after remove_views."""
    r = _child(
        """
        torch = types.ModuleType("torch")
        cuda = types.ModuleType("torch.cuda")
        memory = types.ModuleType("torch.cuda.memory")
        NATIVE = (123, 456)
        def native_mem_get_info(device=None):
            '''torch's docstring'''
            return NATIVE
        memory.mem_get_info = cuda.mem_get_info = native_mem_get_info
        cuda.memory = memory
        cuda.current_device = lambda: 0
        cuda._utils = types.SimpleNamespace(
            _get_device_index=lambda d, optional=False: 0 if d is None else int(d))
        torch.cuda = cuda
        torch._C = types.SimpleNamespace(_accelerator_getMemoryInfo=lambda i: NATIVE)
        sys.modules.update({"torch": torch, "torch.cuda": cuda, "torch.cuda.memory": memory})
        from bridge.adapters import torch as adapter
        adapter.install_views()
        assert cuda.mem_get_info() == NATIVE  # no budget
        assert core.set_limit(0, 10 * GIB) == 0
        rc, p = core.alloc(0, 4 * GIB, 0xA1000, core.TAG_TORCH)
        assert rc == 0
        assert cuda.mem_get_info() == (6 * GIB, 10 * GIB)
        assert cuda.mem_get_info(0) == (6 * GIB, 10 * GIB)
        assert cuda.memory.mem_get_info(0) == (6 * GIB, 10 * GIB)
        assert torch._C._accelerator_getMemoryInfo(0) == (6 * GIB, 10 * GIB)
        assert cuda.mem_get_info.__doc__ == "torch's docstring"
        assert cuda.mem_get_info(7) == NATIVE  # a device the bridge did not set up
        adapter.remove_views()
        assert cuda.mem_get_info is native_mem_get_info
        assert cuda.memory.mem_get_info is native_mem_get_info
        assert torch._C._accelerator_getMemoryInfo(0) == NATIVE
        core.free(p)
        print("ok")
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
