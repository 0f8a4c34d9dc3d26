# SPDX-License-Identifier: Apache-2.0
"""benchmarks/bench_trace.py on the CPU: traces from torch snapshots, their peaks,
files, and the replay loop (on a stand-in torch that records what it was asked)."""

from __future__ import annotations

import pathlib
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_trace as bt  # noqa: E402
import trace_turns as tt  # noqa: E402

SNAPSHOT = {
    "device_traces": [
        [
            {"action": "free_requested", "addr": 0x999, "size": 8, "stream": 0},  # before
            {"action": "alloc", "addr": 0x100, "size": 512, "stream": 0},
            {"action": "alloc", "addr": 0x300, "size": 1 << 20, "stream": 77},
            {"action": "free_requested", "addr": 0x100, "size": 512, "stream": 0},
            {"action": "free_completed", "addr": 0x100, "size": 512, "stream": 0},
            {"action": "alloc", "addr": 0x100, "size": 2048, "stream": 0},  # address reused
            {"action": "segment_alloc", "addr": 0x5000, "size": 2 << 20, "stream": 0},
            {"action": "free_requested", "addr": 0x300, "size": 1 << 20, "stream": 77},
        ]
    ]
}


def test_a_snapshot_becomes_allocs_and_frees_in_program_order():
    t = bt.from_snapshot(SNAPSHOT, "x")
    assert t["events"] == [
        [bt.ALLOC, 0, 512, 0],
        [bt.ALLOC, 1, 1 << 20, 1],
        [bt.FREE, 0],
        [bt.ALLOC, 2, 2048, 0],
        [bt.FREE, 1],
    ]
    assert t["streams"] == 2
    assert bt.peak_live(t) == (1 << 20) + 2048
    assert bt.summary(t) == {
        "name": "x",
        "events": 5,
        "sizes": 3,
        "streams": 2,
        "peak_live": (1 << 20) + 2048,
    }


def test_a_trace_file_round_trips(tmp_path):
    t = bt.from_snapshot(SNAPSHOT, "x")
    path = str(tmp_path / "t.json.gz")
    bt.save(t, path)
    assert bt.load(path) == t


def test_the_replay_allocates_each_block_on_its_stream_and_frees_it():
    calls: list[tuple] = []

    class Tensor:
        def __init__(self, n: int) -> None:
            self.n = n
            calls.append(("empty", n, state["stream"]))

        def __del__(self) -> None:
            calls.append(("del", self.n))

    state = {"stream": "s0"}
    cuda = types.SimpleNamespace(
        set_stream=lambda s: state.__setitem__("stream", s), synchronize=lambda: None
    )
    fake = types.SimpleNamespace(cuda=cuda, uint8="uint8", empty=lambda n, dtype, device: Tensor(n))
    t = bt.from_snapshot(SNAPSHOT, "x")
    times = bt.replay_events(fake, t, ["s0", "s1"], passes=2)
    assert len(times) == 2 and all(x > 0 for x in times)
    one_pass = [
        ("empty", 512, "s0"),
        ("empty", 1 << 20, "s1"),
        ("del", 512),
        ("empty", 2048, "s0"),
        ("del", 1 << 20),
        ("del", 2048),
    ]
    assert calls == one_pass * 2
    assert state["stream"] == "s0"  # the default stream is current again


# ---- the mixed trace: both frameworks' events in one order ----
T_TORCH, T_CUPY, T_NUMBA = 1, 2, 3  # ledger tags (any numbers: the caller maps them)
A, F = 10, 11  # the history's alloc and free actions
HISTORY = [
    # (time_us, action, device, ptr, size, stream, stack, tag, extra)
    (1, F, 0, 0x999, 8, 0, None, T_CUPY, 0),  # a block from before the recording
    (2, A, 0, 0x100, 4096, 0, None, T_CUPY, 0),
    (3, A, 0, 0x200, 512, 0, None, T_TORCH, 0),
    (4, A, 1, 0x300, 512, 0, None, T_TORCH, 0),  # another device: not this trace's
    (5, A, 0, 0x400, 64, 0, None, T_NUMBA, 0),  # a framework the trace does not replay
    (6, F, 0, 0x100, 4096, 0, None, T_CUPY, 0),
    (7, A, 0, 0x100, 1024, 0x77, None, T_TORCH, 0),  # address reused, on a second stream
    (8, F, 0, 0x200, 512, 0, None, T_TORCH, 0),
    (9, F, 0, 0x100, 1024, 0x77, None, T_TORCH, 0),
]


def test_the_bridge_history_becomes_one_trace_of_both_frameworks():
    t = bt.from_history(HISTORY, "m", {T_TORCH: bt.TORCH, T_CUPY: bt.CUPY}, (A, F))
    assert t["events"] == [
        [bt.ALLOC, 0, 4096, 0, bt.CUPY],
        [bt.ALLOC, 1, 512, 0],
        [bt.FREE, 0],
        [bt.ALLOC, 2, 1024, 1],
        [bt.FREE, 1],
        [bt.FREE, 2],
    ]
    assert t["streams"] == 2 and t["source"] == "bridge history"
    assert bt.is_mixed(t) and not bt.is_mixed(bt.from_snapshot(SNAPSHOT, "x"))
    assert bt.peak_live(t) == 4096 + 512
    assert bt.summary(t)["cupy_events"] == 1
    assert "cupy_events" not in bt.summary(bt.from_snapshot(SNAPSHOT, "x"))


def test_a_mixed_replay_sends_each_event_to_its_framework_on_its_stream():
    calls: list[tuple] = []

    class Block:
        def __init__(self, who: str, n: int, stream: str) -> None:
            self.who, self.n = who, n
            calls.append((who, n, stream))

        def __del__(self) -> None:
            calls.append(("del", self.who, self.n))

    state = {"torch": "s0", "cupy": "c0"}

    class CStream:
        def __init__(self, name: str) -> None:
            self.name = name

        def use(self) -> None:
            state["cupy"] = self.name

    cuda = types.SimpleNamespace(
        set_stream=lambda s: state.__setitem__("torch", s), synchronize=lambda: None
    )
    torch = types.SimpleNamespace(
        cuda=cuda, uint8="u8", empty=lambda n, dtype, device: Block("torch", n, state["torch"])
    )
    cupy = types.SimpleNamespace(uint8="u8", empty=lambda n, dtype: Block("cupy", n, state["cupy"]))
    t = bt.from_history(HISTORY, "m", {T_TORCH: bt.TORCH, T_CUPY: bt.CUPY}, (A, F))
    cs = [CStream("c0"), CStream("c1")]
    times = bt.replay_mixed_events(torch, cupy, t, ["s0", "s1"], cs, passes=2)
    assert len(times) == 2 and all(x > 0 for x in times)
    one_pass = [
        ("cupy", 4096, "c0"),
        ("torch", 512, "s0"),
        ("del", "cupy", 4096),
        ("torch", 1024, "s1"),
        ("del", "torch", 512),
        ("del", "torch", 1024),
    ]
    assert calls == one_pass * 2
    assert state == {"torch": "s0", "cupy": "c0"}  # both default streams current again


@pytest.mark.parametrize("config", bt.TORCH_ONLY)
def test_a_torch_only_configuration_refuses_a_mixed_trace_before_touching_anything(config):
    t = bt.from_history(HISTORY, "m", {T_TORCH: bt.TORCH, T_CUPY: bt.CUPY}, (A, F))
    with pytest.raises(ValueError, match="replays torch only.*native, async or a bridge"):
        bt._setup(config, t)


# ---- the configurations ----
def test_the_configurations_keep_the_old_names_and_add_the_two_new():
    assert bt.CONFIGS[:5] == ("native", "async", "rmm", "bridge", "bridge-nocache")
    assert "bridge-allhits" in bt.CONFIGS and "null-pluggable" in bt.CONFIGS
    for name in bt.CONFIGS:
        assert f"``{name}``" in bt.__doc__, name
    doc = " ".join(bt.__doc__.split())
    assert "``native`` against ``null-pluggable``" in doc
    assert "``null-pluggable`` against ``bridge``" in doc
    assert "no driver call per event" in doc


def test_allhits_sets_the_cache_as_large_as_the_environment_allows():
    from _common import config_env

    env = config_env("torch", "bridge-allhits")
    assert env == {
        "BRIDGE_CACHE_LIMIT": "100%",
        "BRIDGE_CACHE_FLOOR": "100%",
        "BRIDGE_CACHE_FRACTION": "1",
        "BRIDGE_CACHE_LARGE_CAP": "100%",
        "BRIDGE_CACHE_LARGE_FRACTION": "0",
    }
    assert config_env("torch", "bridge-fixedlarge") == {"BRIDGE_CACHE_LARGE_FRACTION": "0"}
    assert config_env("torch", "null-pluggable") == {}
    assert config_env("torch", "bridge-nocache") == {"BRIDGE_CACHE_LIMIT": "0"}


def test_pluggable_runs_torch_on_the_adapters_fallback_switch():
    from _common import config_env

    from bridge.adapters import torch_build

    assert config_env("torch", "bridge-pluggable") == {torch_build.PLUGGABLE_ENV: "1"}
    assert torch_build.PLUGGABLE_ENV == "BRIDGE_TORCH_PLUGGABLE"


def test_allhits_caches_a_block_above_the_default_largest(standin):
    """A fresh process on the stand-in with bridge-allhits' environment: the caps
    (the small tier's and the large tier's) are the device, and after
    lift_cache_max_block a 512 MiB block (above the 256 MiB default) comes back
    from the cache."""
    import os
    import subprocess

    from _common import ALLHITS_ENV

    e = {k: v for k, v in os.environ.items() if not k.startswith("BRIDGE_CACHE")}
    e.update(ALLHITS_ENV)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), e.get("PYTHONPATH", "")])
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
        "import bench_trace as bt\n"
        "from bridge import _runtime\n"
        "from bridge._runtime import core\n"
        "_runtime.ensure_device(0)\n"
        "st = core.stats(0)[1]\n"
        "assert st['cache_limit'] == st['total'] == st['cache_floor'], st\n"
        "assert st['cache_large_cap'] == st['total'], st\n"
        "assert bt.lift_cache_max_block(0) == st['total']\n"
        "rc, p = core.alloc(0, 512 << 20, 0, core.TAG_TORCH)\n"
        "assert rc == 0\n"
        "core.free(p)\n"
        "assert core.alloc(0, 512 << 20, 0, core.TAG_TORCH) == (0, p)\n"
        "print(core.stats(0)[1]['num_cache_hits'])\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == 1


# ---- null_alloc.c through ctypes, a host buffer standing in for the region ----
import ctypes  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402


@pytest.fixture(scope="module")
def null_lib(tmp_path_factory):
    return bt.build_null_alloc(tmp_path_factory.mktemp("null_alloc"))


@pytest.fixture
def region():
    """A malloc'd host buffer (freed after the test)."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    bufs: list[int] = []

    def make(size: int) -> int:
        p = libc.malloc(size)
        assert p
        bufs.append(p)
        return p

    yield make
    for p in bufs:
        libc.free(p)


@pytest.fixture
def null(null_lib):
    return bt.NullAllocator(null_lib)


def test_the_source_compiles_with_every_warning_an_error(tmp_path):
    import os

    cc = os.environ.get("CC", "cc").split()
    flags = ["-std=gnu11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-c"]
    out = str(tmp_path / "n.o")
    r = subprocess.run(
        [*cc, *flags, str(bt.NULL_SOURCE), "-o", out], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr


def test_it_exports_what_torch_loads(null_lib, null):
    lib = ctypes.CDLL(str(null_lib))
    for name in ("null_alloc", "null_free", "null_init", "null_get_stats"):
        assert getattr(lib, name)
    assert null.stats()["region"] >= 0


def test_sizes_round_up_to_512_and_zero_takes_a_block(null, region):
    base = region(1 << 20)
    null.init(base, 1 << 20)
    assert null.alloc(1) == base
    assert null.alloc(512) == base + 512
    assert null.alloc(513) == base + 1024
    assert null.alloc(0) == base + 2048  # 0 B: its own address
    st = null.stats()
    assert st["high_water"] == 2560 and st["bumps"] == 4 and st["live"] == 2560
    assert [bt.null_rounded(n) for n in (0, 1, 512, 513, 1024)] == [512, 512, 512, 1024, 1024]


def test_a_freed_block_is_reused_by_its_rounded_size_newest_first(null, region):
    base = region(1 << 20)
    null.init(base, 1 << 20)
    a, b, c = null.alloc(1000), null.alloc(1000), null.alloc(600)
    null.free(a, 1000)
    null.free(b, 1000)
    assert null.alloc(1024) == b  # LIFO; 1000 and 1024 share the 1024 B list
    assert null.alloc(1001) == a
    null.free(c, 600)
    assert null.alloc(4096) == c + 1024  # no 4096 B block free: the bump pointer
    assert null.alloc(600) == c
    st = null.stats()
    assert st["reuses"] == 3 and st["bumps"] == 4 and st["allocs"] == 7 and st["frees"] == 3
    assert st["high_water"] == 1024 * 3 + 4096
    assert st["peak_live"] == st["live"] == 1024 * 3 + 4096


def test_an_exhausted_region_returns_null_and_a_free_block_still_serves(null, region):
    base = region(4096)
    null.init(base, 4096)
    a = null.alloc(2048)
    b = null.alloc(2048)
    assert a and b
    assert null.alloc(512) == 0  # nothing left to bump, no 512 B block free
    assert null.alloc(1 << 40) == 0
    assert null.alloc(2**64 - 1) == 0  # too large to round
    null.free(b, 2048)
    assert null.alloc(2048) == b  # from the list, the region still full
    st = null.stats()
    assert st["failed"] == 3 and st["high_water"] == 4096


def test_a_null_free_is_a_no_op_and_a_foreign_pointer_is_ignored(null, region):
    base = region(1 << 16)
    null.init(base, 1 << 16)
    a = null.alloc(512)
    before = null.stats()
    null.free(0, 512)
    assert null.stats() == before
    null.free(base + (1 << 20), 512)  # outside the region
    null.free(base + 4096, 512)  # inside the region, above the bump pointer
    st = null.stats()
    assert st["foreign"] == 2 and st["frees"] == 0
    null.free(a, 512)
    assert null.stats()["frees"] == 1 and null.alloc(512) == a


def test_init_forgets_everything_and_refuses_an_empty_region(null, region):
    base = region(1 << 16)
    null.init(base, 1 << 16)
    a = null.alloc(512)
    null.free(a, 512)
    null.init(base, 1 << 16)
    st = null.stats()
    assert {k: v for k, v in st.items() if v} == {"region": 1 << 16}
    assert null.alloc(512) == base and null.stats()["bumps"] == 1
    with pytest.raises(ValueError):
        null.init(0, 1 << 16)
    with pytest.raises(ValueError):
        null.init(base, 0)


def test_threads_never_get_the_same_block(null, region):
    """Four threads allocate and free at once (ctypes drops the GIL for each call);
    each writes its mark at both ends of its blocks and checks it is still there
    when it frees them: a block handed out twice would be overwritten."""
    size = 64 << 20
    base = region(size)
    null.init(base, size)
    sizes = [512, 1000, 4096, 5000, 65536]
    errors: list[str] = []
    per_thread = 3000

    def work(tid: int) -> None:
        rng = random.Random(tid)
        mine: list[tuple[int, int]] = []
        mark = ctypes.c_uint64
        for _ in range(per_thread):
            if mine and rng.random() < 0.45:
                p, n = mine.pop(rng.randrange(len(mine)))
                r = bt.null_rounded(n)
                if mark.from_address(p).value != tid or mark.from_address(p + r - 8).value != tid:
                    errors.append(f"thread {tid}: block {p:#x} overwritten")
                null.free(p, n)
            else:
                n = rng.choice(sizes)
                p = null.alloc(n)
                if not p:
                    errors.append(f"thread {tid}: no block of {n}")
                    continue
                r = bt.null_rounded(n)
                mark.from_address(p).value = tid
                mark.from_address(p + r - 8).value = tid
                mine.append((p, n))
        for p, n in mine:
            null.free(p, n)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    st = null.stats()
    assert st["allocs"] == st["frees"] == st["bumps"] + st["reuses"]
    assert st["live"] == 0 and st["failed"] == st["foreign"] == st["dropped"] == 0
    assert st["reuses"] > st["bumps"]


def test_exhaustion_aborts_the_process_when_asked(null_lib, tmp_path):
    """What the benchmark asks for: torch does not check the pointer it gets, so the
    allocation says why on stderr and aborts."""
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
        "import ctypes, bench_trace as bt\n"
        f"null = bt.NullAllocator({str(null_lib)!r})\n"
        "buf = ctypes.create_string_buffer(4096)\n"
        "null.init(ctypes.addressof(buf), 4096, abort_on_exhaustion=True)\n"
        "assert null.alloc(4096)\n"
        "print('first ok', flush=True)\n"
        "null.alloc(512)\n"
        "print('not reached', flush=True)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "first ok" in r.stdout and "not reached" not in r.stdout
    assert "null_alloc: region exhausted: 512 bytes asked" in r.stderr


def test_the_footprint_is_the_bump_pointers_high_water_mark(null, region):
    events = [
        [bt.ALLOC, 0, 1000, 0],
        [bt.ALLOC, 1, 1000, 0],
        [bt.ALLOC, 2, 3000, 0],
        [bt.FREE, 0],
        [bt.FREE, 1],
        [bt.ALLOC, 3, 600, 0],  # 1024 B: a block of the list
        [bt.FREE, 2],
        [bt.ALLOC, 4, 2000, 0],  # 2048 B: new
        [bt.FREE, 3],
        [bt.FREE, 4],
    ]
    t = bt.make_trace("x", "test", events)
    assert bt.null_footprint(t) == 2 * 1024 + 3072 + 2048
    region_size = bt.null_region(t)
    assert region_size >= 2 * bt.peak_live(t) + bt.NULL_SLACK and region_size % (2 << 20) == 0
    base = region(1 << 20)
    null.init(base, 1 << 20)
    st = _replay_through(null, t, passes=3)
    assert st["high_water"] == bt.null_footprint(t)
    assert st["bumps"] == 4 and st["reuses"] == 3 * 5 - 4


def _replay_through(null, trace: dict, passes: int) -> dict:
    for _ in range(passes):
        live: dict[int, tuple[int, int]] = {}
        for e in trace["events"]:
            if e[0] == bt.ALLOC:
                p = null.alloc(e[2])
                assert p, e
                live[e[1]] = (p, e[2])
            else:
                null.free(*live.pop(e[1]))
        for p, n in live.values():  # what the trace never freed: freed at the pass's end
            null.free(p, n)
    return null.stats()


@pytest.mark.parametrize("name", ["gpt2", "resnet50"])
def test_the_recorded_traces_fit_the_region_the_benchmark_takes(null, name):
    """The recorded traces through null_alloc with the benchmark's region size; the
    base is an address nothing reads (the allocator never touches the region)."""
    t = bt.load(str(ROOT / "benchmarks" / "traces" / f"{name}.json.gz"))
    size = bt.null_region(t)
    null.init(1 << 44, size)
    st = _replay_through(null, t, passes=2)
    allocs = sum(1 for e in t["events"] if e[0] == bt.ALLOC)
    assert st["failed"] == 0 and st["allocs"] == 2 * allocs
    assert st["high_water"] == bt.null_footprint(t) <= size
    assert st["peak_live"] >= bt.peak_live(t)
    assert st["reuses"] >= allocs  # the second pass reuses every block


def test_the_null_setup_swaps_torchs_allocator_before_taking_the_region(monkeypatch, region):
    """_setup('null-pluggable') on stand-ins for torch and cuda.bindings (a host
    buffer for cuMemAlloc's region): the allocator is torch's before any driver
    call, the library torch loads is the one whose counters the result reads,
    and the region is sized from the trace."""
    calls: list[tuple] = []
    t = bt.from_snapshot(SNAPSHOT, "x")
    size = bt.null_region(t)
    base = region(size)

    class Pluggable:
        def __init__(self, path: str, alloc: str, free: str) -> None:
            calls.append(("pluggable", alloc, free))
            self.lib = ctypes.CDLL(path)

    memory = types.SimpleNamespace(
        CUDAPluggableAllocator=Pluggable,
        change_current_allocator=lambda a: calls.append(("change", a.lib)),
    )
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(memory=memory)  # type: ignore[attr-defined]
    ok = "success"

    def driver_call(name: str, *values: object):
        def call(*args: object) -> tuple:
            calls.append((name, *args))
            return (ok, *values)

        return call

    driver = types.ModuleType("cuda.bindings.driver")
    driver.CUresult = types.SimpleNamespace(CUDA_SUCCESS=ok)  # type: ignore[attr-defined]
    driver.cuInit = driver_call("cuInit")  # type: ignore[attr-defined]
    driver.cuDeviceGet = driver_call("cuDeviceGet", 0)  # type: ignore[attr-defined]
    driver.cuDevicePrimaryCtxRetain = driver_call("retain", "ctx")  # type: ignore[attr-defined]
    driver.cuCtxSetCurrent = driver_call("cuCtxSetCurrent")  # type: ignore[attr-defined]
    driver.cuMemAlloc = driver_call("cuMemAlloc", base)  # type: ignore[attr-defined]
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = driver  # type: ignore[attr-defined]
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings  # type: ignore[attr-defined]
    for name, mod in [
        ("torch", torch),
        ("cuda", cuda),
        ("cuda.bindings", bindings),
        ("cuda.bindings.driver", driver),
    ]:
        monkeypatch.setitem(sys.modules, name, mod)

    held, extra = bt._setup("null-pluggable", t)
    names = [c[0] for c in calls]
    assert names == ["pluggable", "change", "cuInit", "cuDeviceGet", "retain",
                     "cuCtxSetCurrent", "cuMemAlloc"]  # fmt: skip
    assert calls[0] == ("pluggable", "null_alloc", "null_free")
    assert calls[-1] == ("cuMemAlloc", size)
    lib = calls[1][1]  # what torch would call
    lib.null_alloc.restype = ctypes.c_void_p
    lib.null_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    assert lib.null_alloc(1000, 0, None) == base
    assert held() == 1024
    info = extra()["null_alloc"]
    assert info["region"] == size and info["high_water"] == 1024 and info["bumps"] == 1
    assert info["footprint_predicted"] == bt.null_footprint(t)


# ---- configurations in turns (trace_turns.run_trace): warm workers, rounds, the verdict ----
class FakeWorker:
    """A worker answering as serve() does: its passes take ns_of(generation, round) ns per
    event; every command it was sent is logged (with its config) in ``log``."""

    def __init__(self, config: str, gen: int, ns_of, log: list) -> None:
        self.config, self.gen, self.ns_of, self.log = config, gen, ns_of, log
        self.round = 0
        self.closed = False

    def ask(self, command: str):
        self.log.append((self.config, self.gen, command))
        name, *args = command.split()
        if name == "warm":
            return "ok", None
        if name == "time":
            ns = self.ns_of(self.config, self.gen, self.round)
            self.round += 1
            if ns is None:
                return "error", "RuntimeError: CUDA error"
            return "ok", [ns, ns * 1.2, ns * 1.05][: int(args[0])]
        return "ok", {
            "peak_reserved": 110 + self.gen,
            "peak_live": 100,
            "reserved_over_live": (110 + self.gen) / 100,
            "pid": 1000 + self.gen,
        }

    def close(self) -> None:
        self.closed = True


def fake_turns(monkeypatch, ns_of, skip: dict | None = None):
    """run_trace's workers replaced by FakeWorkers; returns the command log."""
    log: list = []
    workers: list = []

    def start(specs, status):
        gen = specs.pop("_generation")
        out = {}
        for c in specs:
            if skip and c in skip:
                status[c] = {"status": "skipped", "reason": skip[c]}
                continue
            status[c] = {"status": "ok", "info": {"gen": gen}}
            out[c] = FakeWorker(c, gen, ns_of, log)
        workers.extend(out.values())
        return out

    monkeypatch.setattr(tt, "start_workers", start)
    spec = lambda path, configs, cpu, g: {**{c: ([], {}) for c in configs}, "_generation": g}  # noqa: E731
    return log, workers, spec


def test_rounds_take_turns_in_rotating_order_across_fresh_processes(monkeypatch):
    log, workers, spec = fake_turns(monkeypatch, lambda c, g, r: 1000.0)
    out = tt.run_trace("t", ["native", "bridge"], rounds=9, passes=2, processes=3,
                       warmup=1, specs=spec)  # fmt: skip
    timed = [(c, g) for c, g, cmd in log if cmd.startswith("time")]
    # three generations of two workers, three rounds each; the order rotates every round
    # and carries on from one generation to the next
    assert [c for c, _ in timed] == ["native", "bridge", "bridge", "native"] * 4 + [
        "native",
        "bridge",
    ]
    assert [g for _, g in timed] == [0] * 6 + [1] * 6 + [2] * 6
    assert all(cmd == "time 2" for _, _, cmd in log if cmd.startswith("time"))
    # each worker: warmed before its first timed pass, asked for its stats after its last
    for g in range(3):
        mine = [(c, cmd) for c, gg, cmd in log if gg == g]
        assert mine[:2] == [("native", "warm 1"), ("bridge", "warm 1")]
        assert mine[-2:] == [("native", "stats"), ("bridge", "stats")]
    assert len(workers) == 6 and all(w.closed for w in workers)
    b = out["bridge"]
    assert b["status"] == "ok" and b["rounds"] == 9 and len(b["processes"]) == 3
    assert b["ns_per_round"] == [1000.0] * 9 and b["ns_per_event"] == 1000.0
    assert b["median_ratio_to_native"] == 1.0 and b["ratio_spread"]["n"] == 9
    # memory: every process's own figure kept, the largest is the configuration's
    assert [p["peak_reserved"] for p in b["processes"]] == [110, 111, 112]
    assert b["peak_reserved"] == 112 and b["reserved_over_live"] == 1.12
    assert "median_ratio_to_native" not in out["native"]


def bridge_ns(slow: set) -> object:
    """native at 1000 ns a round; the bridge at 900 ns a round, 5x in the (gen, round)s
    of slow (a round index counts within its process)."""

    def ns_of(config: str, gen: int, r: int) -> float:
        if config == "native":
            return 1000.0
        return 900.0 * (5 if (gen, r) in slow or (gen, None) in slow else 1)

    return ns_of


def test_one_slow_round_does_not_change_the_verdict(monkeypatch):
    _, _, spec = fake_turns(monkeypatch, bridge_ns(set()))
    quiet = tt.run_trace("t", ["native", "bridge"], 9, 1, 3, specs=spec)["bridge"]
    _, _, spec = fake_turns(monkeypatch, bridge_ns({(1, 2)}))
    noisy = tt.run_trace("t", ["native", "bridge"], 9, 1, 3, specs=spec)["bridge"]
    assert quiet["median_ratio_to_native"] == noisy["median_ratio_to_native"] == 0.9
    # the slow round shows in the spread, and only there
    assert noisy["ratio_spread"]["max"] == 4.5 and quiet["ratio_spread"]["max"] == 0.9
    assert sorted(noisy["round_ratios"]) == [0.9] * 8 + [4.5]
    # best against best would not see it either; a mean would (0.9 -> 1.29)
    assert noisy["ns_per_event"] == 900.0
    assert sum(noisy["round_ratios"]) / 9 > 1.2


def test_one_slow_process_does_not_change_the_verdict(monkeypatch):
    """A process slow for its whole life (all three of its rounds) among three."""
    _, _, spec = fake_turns(monkeypatch, bridge_ns({(2, None)}))
    b = tt.run_trace("t", ["native", "bridge"], 9, 1, 3, specs=spec)["bridge"]
    assert b["median_ratio_to_native"] == 0.9
    assert sorted(b["round_ratios"]) == [0.9] * 6 + [4.5] * 3
    assert b["ratio_spread"]["q3"] == 4.5 and b["ratio_spread"]["q1"] == 0.9
    assert b["median_ratio_by_process"] == [0.9, 0.9, 4.5]  # the slow one, named


def test_a_failing_worker_leaves_the_turns_and_the_next_process_goes_on(monkeypatch):
    def ns_of(c, g, r):
        return None if (c, g, r) == ("bridge", 0, 1) else 1000.0

    log, workers, spec = fake_turns(monkeypatch, ns_of, skip={"rmm": "No module named 'rmm'"})
    out = tt.run_trace("t", ["native", "rmm", "bridge"], 9, 1, 3, specs=spec)
    b = out["bridge"]
    assert b["status"] == "partial" and "CUDA error" in b["error"]
    assert b["ns_per_round"] == [1000.0, None, None] + [1000.0] * 6  # gone for gen 0 only
    assert len(b["round_ratios"]) == 7 and len(b["processes"]) == 2
    assert out["rmm"]["status"] == "skipped" and "rmm" in out["rmm"]["reason"]
    assert not any(c == "rmm" for c, _, _ in log)  # a skipped one is not started again
    assert out["native"]["status"] == "ok"


def test_quartile_spread():
    s = tt.quartile_spread([5.0, 1.0, 3.0, 2.0, 4.0, 100.0, 0.5, 2.5, 3.5])
    assert s == {"median": 3.0, "q1": 1.5, "q3": 4.5, "min": 0.5, "max": 100.0, "n": 9}
    assert tt.quartile_spread([2.0]) == {"median": 2.0, "q1": 2.0, "q3": 2.0, "min": 2.0,
                                         "max": 2.0, "n": 1}  # fmt: skip
    with pytest.raises(ValueError):
        tt.quartile_spread([])


STUB_TORCH = """
import os, time
__version__ = "0.0+stub"
uint8 = "uint8"
SPIN = int(os.environ.get("STUB_TORCH_SPIN", "0"))
_state = {"live": 0, "peak": 0}


class Tensor:
    def __init__(self, n):
        self.n = n
        _state["live"] += n
        _state["peak"] = max(_state["peak"], _state["live"])
        for _ in range(SPIN):
            pass

    def __del__(self):
        _state["live"] -= self.n


def empty(n, dtype=None, device=None):
    return Tensor(n)


class _Cuda:
    Stream = object

    @staticmethod
    def current_stream():
        return "default"

    @staticmethod
    def set_stream(s):
        pass

    @staticmethod
    def synchronize():
        pass

    @staticmethod
    def reset_peak_memory_stats():
        _state["peak"] = _state["live"]

    @staticmethod
    def max_memory_reserved():  # a perfect allocator: what it holds is what is live
        return _state["peak"]


cuda = _Cuda()
"""


def test_real_workers_take_turns_pinned_and_a_slow_process_shows_in_the_spread(tmp_path):
    """bench_trace.py worker processes (a stand-in torch on their path, the native setup)
    driven over their pipes: pinned to one CPU, rounds in turns over three generations;
    the second generation's "bridge" is made 30x slower per allocation. Its rounds show
    in the spread; the median stays near 1."""
    import os

    stub = tmp_path / "stub"
    (stub / "torch").mkdir(parents=True)
    (stub / "torch" / "__init__.py").write_text(STUB_TORCH)
    events = []
    for i in range(300):
        events += [[bt.ALLOC, i, 512 * (1 + i % 7), i % 2], [bt.FREE, i]]
    path = tmp_path / "t.json.gz"
    bt.save(bt.make_trace("t", "test", events), str(path))
    cpu = sorted(os.sched_getaffinity(0))[0]

    def spec(p, configs, cpu, g):
        out = {}
        for c in configs:
            argv, env = tt.worker_specs(p, ["native"], cpu)["native"]
            env["PYTHONPATH"] = os.pathsep.join([str(stub), env.get("PYTHONPATH", "")])
            env["STUB_TORCH_SPIN"] = "3000" if (c, g) == ("bridge", 1) else "100"
            out[c] = (argv, env)
        return out

    out = tt.run_trace(str(path), ["native", "bridge"], rounds=9, passes=2, processes=3,
                       cpu=cpu, specs=spec)  # fmt: skip
    n, b = out["native"], out["bridge"]
    assert n["status"] == b["status"] == "ok", (n, b)
    assert len(b["processes"]) == 3 and len({p["pid"] for p in b["processes"]}) == 3
    for p in b["processes"] + n["processes"]:
        assert p["info"]["cpu"] == cpu  # the timing thread was pinned
        assert p["passes"] == 1 + 3 * 2  # the warm-up, then two a round
        assert p["peak_live"] == bt.peak_live(bt.load(str(path)))
        assert p["reserved_over_live"] == 1.0  # what the stand-in saw live, at its peak
    ratios = b["round_ratios"]
    assert len(ratios) == 9
    slow = ratios[3:6]  # the second generation's rounds
    assert min(slow) > 3 * max(ratios[:3] + ratios[6:]), ratios
    assert b["median_ratio_to_native"] < 3 and b["ratio_spread"]["max"] == round(max(slow), 4)


def test_run_refuses_settings_that_give_no_verdict_to_compute(tmp_path, capsys):
    for argv in (
        ["--configs", "native"],  # nothing to compare against
        ["--configs", "native,native"],
        ["--configs", "native,bogus"],
        ["--rounds", "0"],
        ["--passes", "0"],
        ["--processes", "0"],
        ["--warmup", "-1"],
    ):
        with pytest.raises(SystemExit) as e:
            bt.main(["run", str(tmp_path / "t.json.gz"), *argv])
        assert e.value.code == 2, argv
    assert "--configs" in capsys.readouterr().err


def test_the_harness_and_the_checks_ask_for_the_same_number_of_rounds():
    import checks

    assert tt.MIN_ROUNDS == bt.MIN_ROUNDS == checks.TRACE_MIN_ROUNDS == 9
