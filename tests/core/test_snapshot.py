# SPDX-License-Identifier: Apache-2.0
"""Memory snapshots in torch's format (bridge.snapshot, views.c) on the stand-in driver.

The snapshot is checked against torch's format twice: by bridge.snapshot.problems
(no torch needed) and, where torch is importable, by torch's own
``torch.cuda._memory_viz`` functions.
"""

from __future__ import annotations

import ctypes
import pickle

import pytest
from ledger_util import (
    GRAPH_BEGIN,
    GRAPH_END,
    MIB,
    S1,
    S2,
    TAG_CUPY,
    TAG_OTHER,
    TAG_TORCH,
    bridge_alloc_fn,
)

import bridge
from bridge import snapshot
from bridge._errors import Status
from bridge._runtime import core


@pytest.fixture
def rec(led):
    """A Ledger with the history off and cleared before and after."""
    snapshot.record_memory_history(None, clear_history=True)
    yield led
    snapshot.record_memory_history(None, clear_history=True)


def _alloc_holding_the_gil(size: int, tag: int = TAG_TORCH, stream: int = S1) -> int:
    """bridge_alloc called as torch calls it from a Python thread: the GIL held."""
    out = ctypes.c_void_p()
    assert bridge_alloc_fn(keep_gil=True)(0, size, stream, tag, ctypes.byref(out)) == Status.OK
    return int(out.value or 0)


def _alloc_without_the_gil(size: int, tag: int = TAG_TORCH) -> int:
    """As torch's autograd thread calls it: no GIL (ctypes.CDLL releases it)."""
    out = ctypes.c_void_p()
    assert bridge_alloc_fn(keep_gil=False)(0, size, S1, tag, ctypes.byref(out)) == Status.OK
    return int(out.value or 0)


def _by_framework(snap: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                out[seg["framework"]] = out.get(seg["framework"], 0) + b["size"]
    return out


def test_the_snapshot_lists_every_live_block_with_the_ledgers_sizes(rec):
    a = rec.ok(3 * MIB, tag=TAG_CUPY)
    b = rec.ok(5 * MIB, tag=TAG_TORCH)
    c = rec.ok(700, tag=TAG_TORCH, dev=1)
    snap = bridge.memory_snapshot()
    assert snapshot.problems(snap) == []
    seen = {s["address"]: (s["device"], s["total_size"], s["segment_type"])
            for s in snap["segments"]}  # fmt: skip
    assert seen == {a: (0, 3 * MIB, "large"), b: (0, 5 * MIB, "large"), c: (1, 700, "small")}
    assert _by_framework(snap) == {"cupy": 3 * MIB, "torch": 5 * MIB + 700}
    tags = core.stats(0)[1]["tags"]
    assert tags[TAG_CUPY]["current"] == 3 * MIB and tags[TAG_TORCH]["current"] == 5 * MIB
    assert len(snap["device_traces"]) == 2 and snap["device_traces"] == [[], []]  # no history
    assert snap["bridge"][0]["by_framework"]["cupy"] == 3 * MIB
    only1 = bridge.memory_snapshot(device=1)
    assert [s["address"] for s in only1["segments"]] == [c]


def test_a_block_of_one_mib_is_small_as_torch_pools_it(rec):
    """torch's small pool serves requests of up to 1 MiB (kSmallSize), and the torch
    allocator's snapshot calls such a segment small; the bridge's called it large."""
    one = rec.ok(MIB, tag=TAG_TORCH)
    more = rec.ok(MIB + 512, tag=TAG_TORCH)
    kinds = {s["address"]: s["segment_type"] for s in bridge.memory_snapshot()["segments"]}
    assert (kinds[one], kinds[more]) == ("small", "large")


def test_the_history_holds_allocations_frees_and_refusals(rec):
    bridge.record_memory_history(context=None)
    p = rec.ok(2 * MIB, tag=TAG_CUPY, stream=S2)
    rec.free(p)
    rec.sd.standin_sync_all(0)  # the free reached: nothing else in the pool
    core.set_limit(0, 4 * MIB)
    refused, _ = core.alloc(0, 8 * MIB, S1, TAG_TORCH)
    assert refused == Status.BUDGET
    core.set_limit(0, 0)
    snap = bridge.memory_snapshot()
    assert snapshot.problems(snap) == []
    trace = snap["device_traces"][0]
    assert [e["action"] for e in trace] == ["alloc", "free_requested", "free_completed", "oom"]
    assert all(e["addr"] == p and e["size"] == 2 * MIB and e["stream"] == S2 for e in trace[:3])
    assert trace[0]["framework"] == "cupy" and trace[3]["framework"] == "torch"
    assert trace[3]["size"] == 8 * MIB and trace[3]["device_free"] == 4 * MIB
    assert trace[0]["time_us"] <= trace[1]["time_us"] <= trace[3]["time_us"]
    assert all(e["frames"] == [] for e in trace)  # context=None: no Python stack


def test_stacks_come_from_python_threads_with_or_without_the_gil(rec):
    """torch's operators release the GIL around the allocation, CuPy's allocator
    too: the stack is the allocating thread's all the same."""
    bridge.record_memory_history()  # torch's defaults: every event, stacks
    held = _alloc_holding_the_gil(4 * MIB)
    rec.live.add(held)
    released = _alloc_without_the_gil(6 * MIB)
    rec.live.add(released)
    through_core = rec.ok(2 * MIB, tag=TAG_CUPY)  # core.alloc releases the GIL too
    snap = bridge.memory_snapshot()
    assert snapshot.problems(snap) == []
    frames = {s["address"]: s["blocks"][0]["frames"] for s in snap["segments"]}
    test_name = "test_stacks_come_from_python_threads_with_or_without_the_gil"
    for ptr, innermost in (
        (held, "_alloc_holding_the_gil"),
        (released, "_alloc_without_the_gil"),
        (through_core, "alloc"),  # ledger_util.Ledger.alloc
    ):
        names = [f["name"] for f in frames[ptr]]
        assert names[0] == innermost, names  # innermost first, as torch lists them
        assert test_name in names
    assert frames[held][0]["filename"].endswith("test_snapshot.py")
    alloc_events = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    assert [bool(e["frames"]) for e in alloc_events] == [True, True, True]


def test_without_context_no_python_runs_on_the_allocation_path(rec, monkeypatch):
    calls = []
    monkeypatch.setattr(snapshot, "_capture_stack", lambda: calls.append(1) or 0)
    bridge.record_memory_history(context=None)
    rec.live.add(_alloc_holding_the_gil(MIB))
    assert calls == []
    bridge.record_memory_history(context="alloc")
    rec.live.add(_alloc_holding_the_gil(MIB))
    assert calls == [1]


def test_max_entries_keeps_the_newest_events(rec):
    bridge.record_memory_history(max_entries=4)
    ptrs = [rec.ok(MIB + i, tag=TAG_OTHER) for i in range(10)]
    trace = bridge.memory_snapshot()["device_traces"][0]
    assert [e["size"] for e in trace] == [MIB + i for i in range(6, 10)]
    assert len(snapshot._stacks) == 1  # one line allocated them all: one stack, kept once
    bridge.record_memory_history(max_entries=2)  # shrinking keeps the newest
    trace = bridge.memory_snapshot()["device_traces"][0]
    assert [e["size"] for e in trace] == [MIB + 8, MIB + 9]
    for p in ptrs:
        rec.free(p)


def test_stopping_keeps_what_was_recorded_and_records_no_more(rec):
    bridge.record_memory_history()
    rec.ok(MIB)
    bridge.record_memory_history(None)
    rec.ok(2 * MIB)
    events = core.history_events()
    assert [(e[1], e[4]) for e in events] == [(core.EV_ALLOC, MIB)]
    bridge.record_memory_history(None, clear_history=True)
    assert core.history_events() == []


def test_state_keeps_stacks_of_live_blocks_but_no_trace(rec):
    bridge.record_memory_history("state", context="state")
    p = _alloc_holding_the_gil(3 * MIB)
    rec.live.add(p)
    snap = bridge.memory_snapshot()
    assert snap["device_traces"][0] == []
    assert snap["segments"][0]["frames"][0]["name"] == "_alloc_holding_the_gil"


def test_a_graph_block_freed_by_the_user_is_an_inactive_block(rec):
    rec.graph(GRAPH_BEGIN, 0, 7, 9)
    rc, p = core.alloc_graph(0, 4 * MIB, TAG_TORCH, 7, 9, S1)
    assert rc == Status.OK
    core.graph(GRAPH_END, 0, 7, 9)
    core.free(p)  # the graph keeps the memory
    snap = bridge.memory_snapshot()
    assert snapshot.problems(snap) == []
    (seg,) = snap["segments"]
    assert seg["segment_pool_id"] == (7, 9)
    assert seg["blocks"][0]["state"] == "inactive" and seg["allocated_size"] == 0


def test_dump_snapshot_writes_the_pickle_the_viewer_opens(rec, tmp_path):
    p = rec.ok(3 * MIB)
    path = tmp_path / "snap.pickle"
    bridge.dump_snapshot(path)
    with open(path, "rb") as f:
        loaded = pickle.load(f)
    assert snapshot.problems(loaded) == []
    assert [s["address"] for s in loaded["segments"]] == [p]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"enabled": "yes"},
        {"context": "some"},
        {"stacks": "cpp"},
        {"max_entries": 0},
        {"max_entries": True},
    ],
)
def test_bad_arguments_raise_and_change_nothing(rec, kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        bridge.record_memory_history(**kwargs)
    rec.ok(MIB)
    assert core.history_events() == []  # still off


def test_problems_finds_what_torch_would_trip_on():
    assert snapshot.problems([]) == ["the snapshot is not a dict"]
    assert snapshot.problems({"segments": []}) == ["no list 'device_traces'"]
    seg = {
        "device": 0,
        "address": 1,
        "total_size": 10,
        "allocated_size": 10,
        "active_size": 10,
        "requested_size": 10,
        "stream": 0,
        "segment_type": "small",
        "segment_pool_id": (0, 0),
        "blocks": [{"address": 1, "size": 8, "requested_size": 8, "state": "busy", "frames": []}],
    }
    found = snapshot.problems({"segments": [seg], "device_traces": [[{"action": "oom"}]]})
    assert "segments[0]: blocks hold 8 bytes of 10" in found
    assert "segments[0].blocks[0].state: 'busy'" in found
    assert any(x.startswith("device_traces[0][0]: no 'size'") for x in found)


def test_the_snapshot_loads_with_torchs_memory_viz(rec):
    memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    bridge.record_memory_history()
    a = _alloc_holding_the_gil(3 * MIB)
    rec.live.add(a)
    b = rec.ok(5 * MIB, tag=TAG_CUPY)
    rec.free(rec.ok(MIB))
    snap = pickle.loads(pickle.dumps(bridge.memory_snapshot()))

    def lines(text: str) -> str:  # instead of downloading flamegraph.pl
        return text

    summary = memory_viz.segsum(snap)
    assert "total_allocated: 8.0MiB" in summary
    assert f"seg_{a}" in memory_viz.segments(snap, format_flamegraph=lines)
    stacks = memory_viz.memory(snap, format_flamegraph=lines)
    assert f"{3 * MIB}" in stacks and f"{5 * MIB}" in stacks
    assert "_alloc_holding_the_gil" in stacks
    assert "free completed" in memory_viz.trace(snap)
    assert "snapshot.pickle" in memory_viz.trace_plot(snap)
    rec.free(b)


def test_torchs_entry_points_take_torchs_arguments(rec):
    """What torch.cuda.memory._record_memory_history / _snapshot pass to torch._C
    (positional, with more arguments than the bridge uses)."""
    snapshot.torch_record_history("all", "all", "all", 1000, False, False, False, [], False, True)
    p = _alloc_holding_the_gil(2 * MIB)
    rec.live.add(p)
    snap = snapshot.torch_memory_snapshot(None)
    assert [e["action"] for e in snap["device_traces"][0]] == ["alloc"]
    assert snap["segments"][0]["frames"][0]["name"] == "_alloc_holding_the_gil"
    snapshot.torch_record_history(None, "all", "all", 1000, False)  # stop
    rec.ok(MIB)
    assert len(core.history_events()) == 1
    snapshot.torch_record_history_legacy(True, True, 1, False, False, True)  # state only
    assert snapshot._settings == {"enabled": "state", "context": "state"}
    assert core.history_events() == []  # clear_history
    rec.graph(GRAPH_BEGIN, 0, 7, 9)
    rc, g = core.alloc_graph(0, MIB, TAG_TORCH, 7, 9, S1)
    assert rc == Status.OK
    core.graph(GRAPH_END, 0, 7, 9)
    in_pool = snapshot.torch_memory_snapshot((7, 9))["segments"]
    assert [s["address"] for s in in_pool] == [g]
    core.free(g)


def test_state_mode_keeps_a_bounded_number_of_events(rec, monkeypatch):
    monkeypatch.setattr(snapshot, "STATE_EVENTS", 3)
    bridge.record_memory_history("state")
    for _ in range(5):
        rec.ok(MIB)
    assert len(core.history_events()) == 3
