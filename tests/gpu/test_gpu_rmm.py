# SPDX-License-Identifier: Apache-2.0
"""RMM on the shared pool, on a real GPU. (scripts/gpu-test)

RMM is not on the GPU machine's Python: the run puts its wheels on PYTHONPATH
(rmm-cu13, librmm-cu13, rapids-logger, and Cython, which builds the bridge's C++
resource on the first unify(rmm=True)); these tests install nothing and skip
without RMM. Each scenario runs in fresh processes with RMM's own resource (the
power check) and on the bridge: its C++ resource (``BridgeResource``), and, with
``BRIDGE_RMM_CALLBACK=1``, the callback fallback; the pool's figures come from
cuda.bindings.
"""

from __future__ import annotations

import pytest
from gpu_util import POOL_USED_SNIPPET, SLOW_COPY_SNIPPET, run_mode

pytestmark = pytest.mark.gpu
MODES = ("native", "bridge")

ORACLE = POOL_USED_SNIPPET  # pool_used(): the driver's figure, in the scenario

BUFFERS = (
    ORACLE
    + """
import io, warnings
import numpy as np
import rmm, rmm.mr
said = []
if MODE == "bridge":
    import bridge
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bridge.unify(cupy=False, torch=False, rmm=True, budget="2GiB")
    said = [str(w.message) for w in caught if "RMM runs on" in str(w.message)]
    from bridge.adapters import rmm as adapter
    from bridge.tools.cli import main
    def cli(*argv):
        out = io.StringIO()
        main(list(argv), stdout=out, stderr=io.StringIO())
        return out.getvalue()
    stats_line = [ln for ln in cli("stats").splitlines() if ln.startswith("rmm: ")]
    doctor_lines = [ln.strip() for ln in cli("doctor").splitlines() if "RMM resource" in ln
                    or "BRIDGE_RMM_CALLBACK is set" in ln]
    which = dict(path=adapter.path(), reason=adapter.path_reason(), said=said,
                 stats_line=stats_line, doctor_lines=doctor_lines)
else:
    which = {}
resource = type(rmm.mr.get_per_device_resource(0)).__name__
current = rmm.mr.get_current_device_resource() is rmm.mr.get_per_device_resource(0)
def rmm_bytes():
    return bridge.stats(0).by_framework["rmm"] if MODE == "bridge" else 0
warm = rmm.DeviceBuffer(size=1)  # the runtime's context exists from here
del warm
used0 = pool_used()
b = rmm.DeviceBuffer(size=256 << 20)
data = np.arange(1 << 20, dtype=np.uint32)
c = rmm.DeviceBuffer.to_device(data.tobytes())
back = np.frombuffer(c.copy_to_host(), dtype=np.uint32)
held, delta = rmm_bytes(), pool_used() - used0
del b, c
freed = rmm_bytes()
def oom(nbytes):
    before = rmm_bytes()
    try:
        x = rmm.DeviceBuffer(size=nbytes)
        del x
        return None
    except MemoryError as e:
        held_after = rmm_bytes() - before
        return {"type": type(e).__name__, "message": str(e)[:400], "held_after": held_after}
past_budget, past_device = oom(3 << 30), oom(1 << 40)
d = rmm.DeviceBuffer.to_device(data.tobytes())  # RMM keeps working after its refusals
again = bool(np.array_equal(np.frombuffer(d.copy_to_host(), dtype=np.uint32), data))
held_again = rmm_bytes()
del d
report(checksum_ok=bool(np.array_equal(back, data)), held=held, delta=delta, freed=freed,
       past_budget=past_budget, past_device=past_device, again=again, held_again=held_again,
       after_all=rmm_bytes(), resource=resource, current=current, **which)
"""
)


def _check_buffers(r: dict, mode: str) -> None:
    assert r["checksum_ok"] and r["again"] and r["current"]
    assert r["past_device"]["type"] == "MemoryError"  # what RMM raises, every way
    if mode == "native":
        assert r["resource"] == "CudaMemoryResource"  # RMM's default
        assert r["delta"] < (256 << 20)  # cudaMalloc, not the pool: power check
        assert r["past_budget"] is None
        return
    size = (256 << 20) + 4 * (1 << 20)
    assert r["held"] == size and r["delta"] >= size
    assert r["freed"] == 0
    oom = r["past_budget"]
    assert oom["type"] == "MemoryError" and oom["held_after"] == 0
    assert "for rmm on device 0" in oom["message"] and "budget is 2.00 GiB" in oom["message"]
    assert r["past_device"]["held_after"] == 0
    assert r["held_again"] == 4 << 20 and r["after_all"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_device_buffers_are_counted_as_rmm_and_budgeted(mode):
    """rmm.DeviceBuffer comes from the pool as ``rmm`` through the bridge's C++ resource
    (RMM's per-device and current resource): its bytes round-trip, it is counted at its
    allocation and returned at its free; past the budget RMM's own MemoryError is raised,
    nothing is held, and RMM keeps working."""
    pytest.importorskip("rmm")
    r = run_mode(BUFFERS, mode, env={"BRIDGE_RMM_CALLBACK": "0"})
    _check_buffers(r, mode)
    if mode == "bridge":
        assert r["path"] == "bridge", r["reason"]  # the C++ resource was built and runs
        assert r["resource"] == "BridgeResource" and r["said"] == []
        assert r["stats_line"] and "the bridge's C++ RMM resource" in r["stats_line"][0]


def test_with_bridge_rmm_callback_the_callback_resource_runs_and_says_so():
    """BRIDGE_RMM_CALLBACK=1: RMM's CallbackMemoryResource over the core's C callables,
    with the same figures and refusals; the warning, doctor and stats say which runs.
    (The native half is the test above.)"""
    pytest.importorskip("rmm")
    r = run_mode(BUFFERS, "bridge", env={"BRIDGE_RMM_CALLBACK": "1"})
    _check_buffers(r, "bridge")
    assert r["path"] == "callback" and "BRIDGE_RMM_CALLBACK=1" in r["reason"]
    assert r["resource"] == "CallbackMemoryResource"
    assert len(r["said"]) == 1 and "CallbackMemoryResource" in r["said"][0]
    assert r["stats_line"] and "BRIDGE_RMM_CALLBACK is set" in r["stats_line"][0]
    assert any("BRIDGE_RMM_CALLBACK is set" in ln for ln in r["doctor_lines"]), r["doctor_lines"]


CUPY = (
    ORACLE
    + """
import cupy as cp
import rmm
from rmm.allocators.cupy import rmm_cupy_allocator
if MODE == "bridge":
    import bridge
    bridge.unify(cupy=False, torch=False, rmm=True, budget="2GiB")
cp.cuda.set_allocator(rmm_cupy_allocator)
cp.empty(1)
used0 = pool_used()
a = cp.arange(1 << 26, dtype=cp.float32)  # 256 MiB
total = float(a.sum(dtype=cp.float64))
by = bridge.stats(0).by_framework if MODE == "bridge" else {}
delta = pool_used() - used0
try:
    big = cp.empty(3 << 30, dtype=cp.uint8)
    refused = None
except MemoryError as e:
    refused = type(e).__name__  # MemoryError, or CuPy's OutOfMemoryError (a MemoryError)
report(total=total, rmm=by.get("rmm", 0), cupy=by.get("cupy", 0), delta=delta, refused=refused)
"""
)


@pytest.mark.parametrize("mode", MODES)
def test_a_cupy_array_on_rmm_is_counted_as_rmm(mode):
    """cupy.cuda.set_allocator(rmm_cupy_allocator): CuPy arrays come from RMM's
    resource, so from the pool as ``rmm``, under the budget."""
    pytest.importorskip("rmm")
    pytest.importorskip("cupy")
    r = run_mode(CUPY, mode)
    n = 1 << 26
    assert r["total"] == float(n * (n - 1) // 2)
    if mode == "native":
        assert r["delta"] < (256 << 20) and r["refused"] is None
        return
    assert r["rmm"] >= 256 << 20 and r["cupy"] == 0 and r["delta"] >= 256 << 20
    assert r["refused"] in ("MemoryError", "OutOfMemoryError")


STREAMS = """
import cupy as cp
import rmm
from rmm.pylibrmm.stream import Stream
if MODE == "bridge":
    import bridge
    bridge.unify(cupy=False, torch=False, rmm=True)
#SLOW_COPY
N = 50_000_000
s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
def as_array(buf):
    mem = cp.cuda.UnownedMemory(buf.ptr, buf.size, buf)
    return cp.ndarray((N,), cp.float32, cp.cuda.MemoryPointer(mem, 0))
buf = rmm.DeviceBuffer(size=N * 4, stream=Stream(s1))
with s1:
    as_array(buf).fill(3.0)
    out = cp.empty(N, dtype=cp.float32)
s1.synchronize()
with s1:
    slow_copy((264,), (256,), (as_array(buf), out, cp.int64(N), cp.int64(1_500_000_000)))
del buf  # freed on s1 while the kernel still reads it
buf2 = rmm.DeviceBuffer(size=N * 4, stream=Stream(s2))  # the same size, on another stream
with s2:
    as_array(buf2).fill(9.0)
s2.synchronize()
s1.synchronize()
with s2:
    wrong2 = int((as_array(buf2) != 9.0).sum())
del buf2  # freed on s2
path = ""
if MODE == "bridge":
    from bridge.adapters import rmm as adapter
    path = adapter.path()
    held = bridge.stats(0).by_framework["rmm"]
else:
    held = 0
report(corrupted=int((out != 3.0).sum()), wrong2=wrong2, held=held, path=path)
""".replace("#SLOW_COPY\n", SLOW_COPY_SNIPPET)


@pytest.mark.parametrize("mode", MODES)
def test_a_buffer_freed_on_one_stream_is_not_reused_early_on_another(mode):
    """A DeviceBuffer made on a non-blocking stream s1 and freed on it while a kernel
    reads it, then a buffer of the same size made and written on s2: the kernel's
    result and the second buffer's bytes are intact (the C++ resource on the bridge)."""
    pytest.importorskip("rmm")
    pytest.importorskip("cupy")
    r = run_mode(STREAMS, mode)
    assert r == {
        "corrupted": 0,
        "wrong2": 0,
        "held": 0,
        "path": "bridge" if mode == "bridge" else "",
    }
