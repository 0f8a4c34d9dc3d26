# SPDX-License-Identifier: Apache-2.0
"""benchmarks/probes/pool_sequence.py on a stand-in for the driver's pool (CPU).

The stand-in packs every block without a gap, so its high-water mark is the most bytes the
calls held at once: what the probe reports for a pool that wastes nothing."""

from __future__ import annotations

import enum
import json
import pathlib
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "probes"))
import pool_sequence as ps  # noqa: E402


class FakeDriver(types.ModuleType):
    """The calls of cuda.bindings.driver the probe makes, over a gapless pool."""

    class CUresult(enum.Enum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_OUT_OF_MEMORY = 2

    class CUstream_flags(enum.IntEnum):
        CU_STREAM_NON_BLOCKING = 1

    class CUmemPool_attribute(enum.IntEnum):
        CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4
        CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT = 5
        CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH = 6

    cuuint64_t = int
    CUstream = int

    def __init__(self) -> None:
        super().__init__("cuda.bindings.driver")
        self.cur = self.high = self.n = 0
        self.threshold = None
        self.syncs = 0
        self.sizes: dict[int, int] = {}
        ok = (self.CUresult.CUDA_SUCCESS,)
        for name, value in (("cuInit", 0), ("cuDeviceGet", 0), ("cuDevicePrimaryCtxRetain", 1),
                            ("cuDeviceGetDefaultMemPool", 7), ("cuStreamCreate", 9)):  # fmt: skip
            setattr(self, name, lambda *a, v=value: (*ok, v))
        for name in ("cuCtxSetCurrent", "cuMemPoolTrimTo"):
            setattr(self, name, lambda *a: ok)

    def cuStreamSynchronize(self, stream):
        self.syncs += 1
        return (self.CUresult.CUDA_SUCCESS,)

    def cuMemPoolSetAttribute(self, pool, attr, value):
        if attr == self.CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
            self.high = int(value)
        else:
            self.threshold = int(value)
        return (self.CUresult.CUDA_SUCCESS,)

    def cuMemPoolGetAttribute(self, pool, attr):
        high = attr == self.CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH
        return (self.CUresult.CUDA_SUCCESS, self.high if high else self.cur)

    def cuMemAllocFromPoolAsync(self, n, pool, stream):
        self.n += 1
        self.sizes[self.n] = n
        self.cur += n
        self.high = max(self.high, self.cur)
        return (self.CUresult.CUDA_SUCCESS, self.n)

    def cuMemFreeAsync(self, ptr, stream):
        self.cur -= self.sizes.pop(ptr)
        return (self.CUresult.CUDA_SUCCESS,)


@pytest.fixture
def driver(monkeypatch):
    d = FakeDriver()
    cuda = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = d
    cuda.bindings = bindings
    for name, mod in (("cuda", cuda), ("cuda.bindings", bindings), ("cuda.bindings.driver", d)):
        monkeypatch.setitem(sys.modules, name, mod)
    return d


def test_the_calls_are_made_in_order_and_what_is_left_is_freed(driver):
    pool = ps.GpuPool()
    assert driver.threshold == 2**64 - 1  # memory kept, as unify sets the pool
    # 100 and 200 bytes, the 200 freed, then 300 and 50: 450 held at most
    syncs = driver.syncs
    out = pool.run([100, 200, -2, 0, 300, 50, 0])  # 0: the end of a pass, synchronized
    assert out["reserved_high"] == 450 and out["reserved_before"] == 0
    assert driver.syncs - syncs == 2 + 2  # the two passes, and before and after the run
    assert driver.cur == 0 and not driver.sizes  # the blocks still held went back


def test_a_refused_call_stops_the_probe_with_the_driver_error(driver):
    driver.cuMemAllocFromPoolAsync = lambda *a: (driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY, 0)
    with pytest.raises(RuntimeError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        ps.GpuPool().run([100])


def test_each_policy_gets_a_row_with_the_model_and_the_pool_beside_it(driver, tmp_path):
    out = tmp_path / "seq.json"
    trace = str(ROOT / "benchmarks" / "traces" / "cupy-fft.json.gz")
    assert ps.main([trace, "--only", "none", "--only", "all-64M-keep1-smallall",
                    "--json", str(out)]) == 0  # fmt: skip
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"none", "all-64M-keep1-smallall"}
    none = rows["none"]
    assert none["hits"] == 0 and none["driver_calls"] == 2 * none["allocs"]
    # with no cache the calls hold exactly the live bytes (the warm-up's 4 bytes aside):
    # a gapless pool's mark is the trace's peak of live bytes
    assert abs(none["gpu_reserved_over_live"] - 1) < 1e-6
    carved = rows["all-64M-keep1-smallall"]
    assert carved["hits"] > 0.8 and carved["gpu_reserved_over_live"] >= 1


def test_a_child_process_replays_the_calls_it_is_given(driver, tmp_path, capsys):
    ops = tmp_path / "ops.json"
    ops.write_text(json.dumps([512, 1024, -1, 0]))
    assert ps.main(["--run-ops", str(ops)]) == 0
    assert json.loads(capsys.readouterr().out)["reserved_high"] == 1536
