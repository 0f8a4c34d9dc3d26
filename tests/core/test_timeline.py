# SPDX-License-Identifier: Apache-2.0
"""bridge.record(): per-framework bytes over time, on the stand-in driver."""

from __future__ import annotations

import json
import sys
import time

import pytest

import bridge
from bridge import BridgeError, timeline
from bridge._runtime import core

MIB = 1 << 20
GIB = 1 << 30
CUPY, TORCH = 1, 2


def alloc(device: int, size: int, tag: int) -> int:
    rc, p = core.alloc(device, size, 0, tag)
    assert rc == 0 and p
    return p


def wait_for(pred, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def marked(rec: timeline.Recording, label: str, device: int = 0) -> timeline.Sample:
    (s,) = [s for s in rec.samples if s.label == label and s.device == device]
    return s


def test_record_is_the_lazy_public_name():
    assert bridge.record is timeline.record


def test_samples_reflect_allocations_per_framework(standin):
    with bridge.record(interval=0.005, device=0) as rec:
        p = alloc(0, 64 * MIB, CUPY)
        rec.mark("cupy")
        q = alloc(0, 32 * MIB, TORCH)
        rec.mark("torch")
        n = len(rec.samples)
        wait_for(lambda: len(rec.samples) >= n + 3)  # the thread samples on its own
        periodic = rec.samples[n:]
        core.free(p)
        standin.standin_sync_all(0)  # the stream reaches the free: the pool lets it go
        rec.mark("freed")
        core.free(q)
        standin.standin_sync_all(0)
    first = rec.samples[0]
    assert (first.label, first.cupy, first.torch, first.used) == ("", 0, 0, 0)
    s = marked(rec, "cupy")
    assert (s.cupy, s.torch, s.jax, s.other, s.used) == (64 * MIB, 0, 0, 0, 64 * MIB)
    s = marked(rec, "torch")
    assert (s.cupy, s.torch, s.other, s.used) == (64 * MIB, 32 * MIB, 0, 96 * MIB)
    assert s.reserved >= s.used
    s = marked(rec, "freed")
    assert (s.cupy, s.torch, s.other, s.used) == (0, 32 * MIB, 0, 32 * MIB)
    assert len(periodic) >= 3 and all(s.label == "" for s in periodic)
    assert all(s.t > marked(rec, "torch").t for s in periodic)
    assert all((s.cupy, s.torch) == (64 * MIB, 32 * MIB) for s in periodic)
    last = rec.samples[-1]
    assert (last.cupy, last.torch, last.used) == (0, 0, 0)
    times = [s.t for s in rec.samples]
    assert times == sorted(times) and times[0] >= 0


def test_sample_matches_bridge_stats(standin):
    p = alloc(0, 10 * MIB, TORCH)
    bridge.pool(0).set_limit(size=GIB)
    try:
        with bridge.record(interval=10, device=0) as rec:
            rec.mark("now")
            s, st = marked(rec, "now"), bridge.stats(0)
    finally:
        core.free(p)
        bridge.pool(0).set_limit(0)
    assert s.by_framework == st.by_framework
    assert (s.used, s.reserved, s.limit) == (st.used, st.reserved, GIB)


def test_freed_but_pending_bytes_show_as_other(standin):
    # The stream has not reached the free yet: the pool still counts the bytes.
    p = alloc(0, 8 * MIB, CUPY)
    with bridge.record(interval=10, device=0) as rec:
        core.free(p)
        rec.mark("pending")
        standin.standin_sync_all(0)
        rec.mark("landed")
    assert (marked(rec, "pending").cupy, marked(rec, "pending").other) == (0, 8 * MIB)
    assert marked(rec, "landed").other == 0


def test_several_devices_are_sampled_together(standin):
    with bridge.record(interval=10, device=[0, 1]) as rec:
        p = alloc(1, 4 * MIB, TORCH)
        rec.mark("d1")
        core.free(p)
        standin.standin_sync_all(1)
    assert rec.devices == (0, 1)
    assert marked(rec, "d1", 0).torch == 0 and marked(rec, "d1", 1).torch == 4 * MIB
    assert marked(rec, "d1", 0).t == marked(rec, "d1", 1).t
    assert [s.device for s in rec.samples] == [0, 1] * (len(rec.samples) // 2)


def test_default_device_is_the_current_one(standin):
    rec = bridge.record()
    assert rec.devices == (bridge._runtime.current_device(),) and rec.interval == 0.05


def test_thread_stops_with_the_block(standin):
    with bridge.record(interval=0.005, device=0) as rec:
        assert rec.running
        wait_for(lambda: len(rec.samples) >= 5)
    assert not rec.running
    n = len(rec.samples)
    time.sleep(0.05)
    assert len(rec.samples) == n


def test_mark_needs_a_running_recording(standin):
    rec = bridge.record(device=0)
    with pytest.raises(BridgeError, match="running recording"):
        rec.mark("too early")
    with rec:
        with pytest.raises(ValueError):
            rec.mark(3)  # type: ignore[arg-type]
        with pytest.raises(BridgeError, match="already running"):
            rec.start()
    with pytest.raises(BridgeError):
        rec.mark("too late")


@pytest.mark.parametrize("interval", [0, -1, float("nan"), float("inf"), True, "0.1"])
def test_bad_interval(standin, interval):
    with pytest.raises(ValueError, match="interval"):
        bridge.record(interval=interval)


def test_bad_device(standin):
    with pytest.raises(ValueError, match="device"):
        bridge.record(device=5)


def test_sampling_error_is_recorded_not_raised(standin):
    with bridge.record(interval=0.005, device=0) as rec:
        standin.standin_fail(b"cuMemPoolGetAttribute", 999, 1_000_000)
        wait_for(lambda: rec.errors)
        standin.standin_clear_faults()
    assert "CUDA driver error" in rec.errors[0]
    assert not rec.running


def _recording(standin) -> timeline.Recording:
    bridge.pool(0).set_limit(size=GIB)
    try:
        with bridge.record(interval=10, device=[0, 1]) as rec:
            p = alloc(0, 3 * MIB, CUPY)
            rec.mark('step 1, "warm"')  # a comma and quotes survive CSV
            q = alloc(1, 5 * MIB, TORCH)
            rec.mark("step 2")
            core.free(p)
            core.free(q)
            rec.mark("freed")
    finally:
        bridge.pool(0).set_limit(0)
    return rec


def test_csv_round_trip(standin, tmp_path):
    rec = _recording(standin)
    path = rec.to_csv(tmp_path / "mem.csv")
    assert path.read_text().splitlines()[0] == ",".join(timeline.FIELDS)
    back = timeline.Recording.from_csv(path)
    assert back.samples == rec.samples
    assert back.devices == (0, 1) and not back.running
    assert timeline.load(path).samples == rec.samples
    assert marked(back, 'step 1, "warm"').cupy == 3 * MIB
    assert marked(back, 'step 1, "warm"').limit == GIB


def test_json_round_trip(standin, tmp_path):
    rec = _recording(standin)
    path = rec.to_json(tmp_path / "mem.json")
    doc = json.loads(path.read_text())
    assert doc["interval"] == 10 and doc["devices"] == [0, 1]
    assert doc["fields"] == list(timeline.FIELDS) and len(doc["samples"]) == len(rec.samples)
    back = timeline.load(path)
    assert back.samples == rec.samples
    assert (back.interval, back.devices, back.start_time) == (10, (0, 1), rec.start_time)
    assert marked(back, "step 2", 1).torch == 5 * MIB


def test_plot_writes_a_png(standin, tmp_path):
    pytest.importorskip("matplotlib")
    rec = _recording(standin)
    path = rec.plot(tmp_path / "mem.png", title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    loaded = timeline.load(rec.to_csv(tmp_path / "mem.csv"))
    assert loaded.plot(tmp_path / "again.png").stat().st_size > 1000


def test_a_wait_for_memory_shows_on_the_timeline_and_in_the_plot(standin, tmp_path):
    """A sample taken while a thread waits counts it; the plot draws the band."""
    import threading

    core.set_limit(0, 64 * MIB)
    standin.standin_add_foreign(0, 64 * MIB)  # held outside the bridge: the wait times out
    try:
        with bridge.record(interval=0.01, device=0) as rec:

            def waiter():
                with bridge.waiting(0.3):
                    return core.alloc(0, MIB, 0, core.TAG_CUPY)

            t = threading.Thread(target=waiter)
            t.start()
            wait_for(lambda: bridge.stats(0).waiting == 1)
            rec.mark("waiting")
            t.join(10)
            rec.mark("done")
    finally:
        standin.standin_add_foreign(0, -64 * MIB)
        core.set_limit(0, 0)
    assert marked(rec, "waiting").waiting == 1
    done = marked(rec, "done")
    assert done.waiting == 0 and done.num_waits >= marked(rec, "waiting").num_waits >= 1
    loaded = timeline.load(rec.to_csv(tmp_path / "w.csv"))
    assert loaded.samples == rec.samples
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return  # the figures above are the point; the plot needs matplotlib
    assert rec.plot(tmp_path / "w.png").read_bytes()[:4] == b"\x89PNG"


def test_an_older_csv_without_wait_columns_loads(standin, tmp_path):
    path = tmp_path / "old.csv"
    path.write_text(
        "t,device,label,cupy,torch,jax,other,used,reserved,limit\n0.5,0,,1,2,3,4,10,20,0\n"
    )
    (s,) = timeline.load(path).samples
    assert (s.cupy, s.limit, s.waiting, s.num_waits) == (1, 0, 0, 0)


def test_plot_without_matplotlib_says_what_to_install(standin, tmp_path, monkeypatch):
    rec = _recording(standin)
    for name in (
        "matplotlib",
        "matplotlib.figure",
        "matplotlib.backends",
        "matplotlib.backends.backend_agg",
    ):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"pip install 'gpumem-bridge\[plot\]'"):
        rec.plot(tmp_path / "mem.png")


def test_plot_needs_samples(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="no samples"):
        timeline.Recording._loaded([], None, (), None).plot(tmp_path / "x.png")


@pytest.mark.gpu
def test_timeline_sees_real_framework_allocations():
    cupy = pytest.importorskip("cupy")
    try:
        import torch
    except ImportError:
        torch = None
    with_torch = torch is not None and not torch.cuda.is_initialized()
    bridge.unify(cupy=True, torch=with_torch, device=0)
    with bridge.record(interval=0.01, device=0) as rec:
        a = cupy.zeros(64 * MIB, dtype=cupy.uint8)
        t = torch.zeros(32 * MIB, dtype=torch.uint8, device="cuda:0") if with_torch else None
        rec.mark("allocated")
        del a, t
        cupy.cuda.get_current_stream().synchronize()
        if with_torch:
            torch.cuda.synchronize()
        rec.mark("freed")
    s = marked(rec, "allocated")
    assert s.cupy >= 64 * MIB and s.used >= s.cupy
    assert s.torch >= (32 * MIB if with_torch else 0)
    assert marked(rec, "freed").cupy <= s.cupy - 64 * MIB


def test_an_axis_where_nothing_was_held_is_not_labelled_in_fractions_of_a_byte():
    from bridge.timeline import axis_scale

    assert axis_scale(0) == (1.0, "B", 1.0)
    assert axis_scale(512) == (1.0, "B", None)
    assert axis_scale(3 << 20) == (1024.0**2, "MiB", None)
    assert axis_scale(40 << 30)[1] == "GiB"


def test_plot_of_an_idle_recording_has_whole_byte_ticks(standin, tmp_path):
    pytest.importorskip("matplotlib")
    with bridge.record(interval=10) as rec:
        pass
    fig_path = rec.plot(tmp_path / "idle.png")
    assert fig_path.read_bytes()[:4] == b"\x89PNG"
