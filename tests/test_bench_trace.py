# SPDX-License-Identifier: Apache-2.0
"""benchmarks/bench_trace.py on the CPU: traces from torch snapshots, their peaks,
files, and the replay loop (on a stand-in torch that records what it was asked)."""

from __future__ import annotations

import pathlib
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_trace as bt  # noqa: E402

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
