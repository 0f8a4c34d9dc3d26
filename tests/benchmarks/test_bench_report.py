# SPDX-License-Identifier: Apache-2.0
"""benchmarks/checks.py and report.py, and run_all's bookkeeping, on fake results.

No GPU and no framework: the report must be buildable anywhere from a
results.json, and run_all must record a child that crashes or hangs instead
of stopping.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import textwrap

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import _common  # noqa: E402
import checks  # noqa: E402
import report  # noqa: E402
import run_all  # noqa: E402

SIZES = [512, 1 << 20, 64 << 20]


def alloc_run(fw: str, config: str, ns: list[float], rnd: int = 1, **extra) -> dict:
    return {
        "bench": "alloc",
        "framework": fw,
        "config": config,
        "round": rnd,
        "status": "ok",
        "ns_per_pair": {str(s): v for s, v in zip(SIZES, ns, strict=True)},
        **extra,
    }


# what benchmarks/bench_pinned.py writes (abridged)
PINNED = {
    "status": "ok",
    "bench": "pinned",
    "backend": "cached",
    "bandwidth": {
        "h2d": {
            "1 MiB": {
                "bridge_GBps": 40.1,
                "torch_pinned_GBps": 40.5,
                "pageable_GBps": 9.0,
                "iters": 200,
            },
            "256 MiB": {
                "bridge_GBps": 52.0,
                "torch_pinned_GBps": 55.9,
                "pageable_GBps": 20.0,
                "iters": 16,
            },
        },
        "d2h": {"1 MiB": {"bridge_GBps": 41.0, "torch_pinned_GBps": 41.2}},
    },
    "alloc_ns": {
        "4 KiB": {
            "bridge_pool": 310.5,
            "torch_pin_memory": 905.0,
            "cupy_default": "RuntimeError: no cupy",
        }
    },
    "bridge_over_torch_pinned": {"h2d 1 MiB": 0.99, "h2d 256 MiB": 0.93, "d2h 1 MiB": 0.995},
    "ratio": 0.93,
}


def fake_results() -> dict:
    runs = [
        alloc_run("torch", "native", [2400, 2400, 2300]),
        alloc_run("torch", "native", [2600, 2500, 2500], rnd=2),
        # 64 MiB: slower than native -> fail
        alloc_run("torch", "bridge", [2200, 2300, 2600], floor_ns=7000.0),
        alloc_run("torch", "bridge", [2400, 2300, 2600], rnd=2, floor_ns=11000.0),
        alloc_run("torch", "async", [5900, 4100, 4700]),
        {
            "bench": "alloc",
            "framework": "torch",
            "config": "rmm",
            "round": 1,
            "status": "skipped",
            "reason": "RMM is not installed (No module named 'rmm')",
        },
        alloc_run("cupy", "native", [1300, 1300, 1300]),
        alloc_run("cupy", "bridge", [1800, 1900, 2100]),  # 64 MiB: 1.62 > 1.5 -> fail
        alloc_run("cupy", "async", [4900, 4900, 4900]),
        {
            "bench": "alloc",
            "framework": "cupy",
            "config": "rmm",
            "round": 1,
            "status": "error",
            "error": "timed out after 150 s",
        },
    ]
    return {
        "meta": {
            "date": "2026-11-29T12:00:00+00:00",
            "gpu_name": "NVIDIA H200",
            "driver_version": "580.159",
            "bridge_version": "0.1.0",
            "quick": False,
            "versions": {"torch": "2.11.0", "cupy": "14.2.0"},
            "rmm": "not available: RMM configs are skipped",
        },
        "alloc": {"sizes": SIZES, "runs": runs},
        "alloc_same_process": {
            "status": "ok",
            "configs": {
                "native": {"ns_per_pair": {str(s): 1000.0 for s in SIZES}},
                "bridge": {"ns_per_pair": {str(s): 1200.0 for s in SIZES}},
            },
            "info": {"skipped": {"rmm": "Skip: RMM is not installed"}},
        },
        "mixed": {
            "runs": [
                {
                    "mode": "native",
                    "status": "ok",
                    "outcome": "oom",
                    "n_gib": 80.0,
                    "oom": "OutOfMemoryError: CUDA out of memory. Tried to allocate 80.00 GiB",
                    "used_at_oom": int(138.5 * 2**30),
                    "phases": [{"phase": "cupy holds N", "used_gib": 80.5, "used": 0, "live": 1}],
                },
                {
                    "mode": "bridge",
                    "status": "ok",
                    "outcome": "ok",
                    "n_gib": 80.0,
                    "used_over_live": 1.004,
                    "raw_used_over_live": 1.006,
                    "phases": [
                        {"phase": "cupy holds N", "used_gib": 80.5},
                        {
                            "phase": "torch holds N",
                            "used_gib": 80.5,
                            "used_over_live": 1.004,
                            "raw_used_over_live": 1.006,
                        },
                    ],
                },
            ]
        },
        "e2e": {
            "runs": [
                {"mode": "native", "round": 1, "status": "ok", "steps_per_s": 100.0},
                {"mode": "bridge", "round": 1, "status": "ok", "steps_per_s": 99.0},
                {"mode": "native", "round": 2, "status": "ok", "steps_per_s": 102.0},
                {
                    "mode": "bridge",
                    "round": 2,
                    "status": "ok",
                    "steps_per_s": 100.0,
                    "issue_ms": 2.25,
                    "synced_step_ms": 3.5,
                    "per_step": {"allocs": 62.0, "cache_hits": 57.0},
                },
            ]
        },
        "pinned": {"status": "ok", "files": ["raw/pinned.json"], "data": PINNED},
        "problems": ["alloc-cupy-rmm-r1: timed out after 150 s"],
    }


def by_id(results: dict) -> dict:
    return {c["id"]: c for c in results["checks"]}


def test_alloc_summary_is_the_median_over_processes():
    r = checks.summarize(fake_results())
    native = r["alloc"]["summary"]["torch"]["native"]["512"]
    assert native == {"median": 2500.0, "min": 2400.0, "max": 2600.0, "n": 2}
    assert "rmm" not in r["alloc"]["summary"]["torch"]  # a skipped config has no figures


def test_checks_against_the_targets():
    c = by_id(checks.summarize(fake_results()))
    assert c["torch.alloc.native.512"]["value"] == pytest.approx(
        2200 / 2400, abs=1e-4
    )  # best of each
    # issue 29's target: torch at <= 0.90 of its caching allocator (0.917 misses it)
    assert c["torch.alloc.native.512"]["target"] == 0.90
    assert c["torch.alloc.native.512"]["status"] == "fail"
    assert c["torch.alloc.native.67108864"]["status"] == "fail"  # 2600 / 2300
    assert c["torch.alloc.async.1048576"]["status"] == "pass"
    assert c["cupy.alloc.native.1048576"]["value"] == pytest.approx(1900 / 1300, abs=1e-4)


def test_cupy_memorypool_target_is_nine_tenths():
    """Issue 34: a CuPy pair at <= 0.90 of CuPy's MemoryPool."""
    c = by_id(checks.summarize(fake_results()))
    assert c["cupy.alloc.native.512"]["target"] == 0.90
    assert c["cupy.alloc.native.512"]["op"] == "<="
    assert c["cupy.alloc.native.512"]["status"] == "fail"  # 1800 / 1300 = 1.38
    assert c["cupy.alloc.native.67108864"]["status"] == "fail"  # 1.62
    assert c["cupy.alloc.async.512"]["op"] == "<"


def test_missing_baselines_say_why():
    c = by_id(checks.summarize(fake_results()))
    rmm = c["torch.alloc.rmm.512"]
    assert rmm["status"] == "missing" and rmm["value"] is None
    assert "RMM is not installed" in rmm["note"]
    assert "timed out" in c["cupy.alloc.rmm.512"]["note"]


def turns_result(fw: str, ns: dict, rounds: dict, status: str = "ok") -> dict:
    return {
        "bench": "alloc_turns",
        "framework": fw,
        "status": status,
        "repeats": 3,
        "iters": 5000,
        "cpu": 3,
        "configs": {
            c: {
                "status": "ok",
                "ns_per_pair": {str(s): min(v) for s, v in zip(SIZES, per, strict=True)},
                "ns_samples": {str(s): v for s, v in zip(SIZES, per, strict=True)},
                "floor_ns": 7000.0,
            }
            for c, per in ns.items()
        }
        | {"rmm": {"status": "skipped", "reason": "RMM is not installed"}},
        "turn_ratios": rounds,
    }


def test_turns_decide_the_allocation_targets_where_they_ran(tmp_path):
    r = fake_results()
    same = [[2000] * 3, [2100] * 3, [2200] * 3]  # samples per size
    r["alloc_turns"] = {
        "torch": turns_result(
            "torch",
            {"native": same, "bridge": [[1900] * 3, [2000] * 3, [2000] * 3]},
            {
                "native": {
                    "512": {
                        "median": 0.88,
                        "min": 0.8,
                        "max": 1.01,
                        "n": 3,
                        "process_medians": [0.86, 0.88, 0.95],
                    }
                }
            },
        ),
        "cupy": {"status": "error", "error": "no configuration ran: native: boom"},
    }
    report.write_all(r, str(tmp_path), png=False)
    c = by_id(r)
    # torch from the turns: the median of the rounds (0.88), not the best loops (1900 / 2000)
    # nor the processes (2200 / 2400)
    assert c["torch.alloc.native.512"]["value"] == pytest.approx(0.88)
    assert c["torch.alloc.native.512"]["status"] == "pass"
    note = c["torch.alloc.native.512"]["note"]
    assert "median of 3 rounds [0.800-1.010]; best loops 0.950" in note
    assert "3 generations' medians: median 0.880 [0.860-0.950]" in note
    # no round-by-round ratios at 64 MiB: best loop against best loop, 2000 / 2200 = 0.909
    assert c["torch.alloc.native.67108864"]["value"] == pytest.approx(2000 / 2200, abs=1e-4)
    assert c["torch.alloc.native.67108864"]["status"] == "fail"
    assert "no round-by-round ratios" in c["torch.alloc.native.67108864"]["note"]
    assert "skipped: RMM is not installed" in c["torch.alloc.rmm.512"]["note"]
    # cupy's turns failed: its targets come from the separate processes
    assert c["cupy.alloc.native.1048576"]["value"] == pytest.approx(1900 / 1300, abs=1e-4)
    assert c["cupy.alloc.native.1048576"]["note"] == "separate processes"
    md = (tmp_path / "results.md").read_text()
    assert "## Allocation, allocators taking turns (the verdict)" in md
    assert "| native caching | 2,000 (2,000) | 2,100 (2,100) | 2,200 (2,200) | 7,000 |" in md
    assert (
        "| bridge / native (target <= 0.90) | 0.880 pass | 0.952 **FAIL** | 0.909 **FAIL** |  |"
        in md
    )
    assert "|   best loops; rounds [min-max] | 0.950; [0.800-1.010] | 0.952 | 0.909 |  |" in md
    turns_md = md.split("## Allocation, allocators taking turns")[1].split("## Allocation, one")[0]
    assert "bridge / RMM" not in turns_md  # RMM skipped: no ratio rows
    # the processes' own ratios, shown as context where the turns decided
    assert "| bridge / native (context) | 0.917 | 0.958 | 1.130 |  |" in md
    assert "cupy: error: no configuration ran: native: boom" in md


def test_mixed_e2e_and_pinned_checks():
    c = by_id(checks.summarize(fake_results()))
    assert c["mixed.bridge.used_over_live"]["value"] == pytest.approx(1.004)
    assert c["mixed.bridge.used_over_live"]["status"] == "pass"
    # best process of each mode (the noise only slows a process down)
    assert c["e2e.bridge_over_native"]["value"] == pytest.approx(100.0 / 102.0, abs=1e-4)
    assert c["e2e.bridge_over_native"]["status"] == "pass"
    # one figure per direction and size (bridge_over_torch_pinned): the smallest decides
    assert c["pinned.bridge_over_torch"]["value"] == pytest.approx(0.93)
    assert c["pinned.bridge_over_torch"]["status"] == "fail"
    assert "h2d 256 MiB" in c["pinned.bridge_over_torch"]["note"]


def test_pinned_top_level_ratio_and_absent_script():
    r = fake_results()
    r["pinned"] = {"status": "ok", "data": {"ratio": 0.99, "x": {"other_ratio": 0.1}}}
    assert by_id(checks.summarize(r))["pinned.bridge_over_torch"]["value"] == 0.99
    r["pinned"] = {
        "status": "partial",
        "data": {
            "bridge_over_torch_pinned": {"h2d 1 MiB": 0.97, "d2h 1 MiB": 1.2},
            "ratio": 0.97,
            "errors": {"alloc_ns": "boom"},
        },
    }
    c = by_id(checks.summarize(r))["pinned.bridge_over_torch"]
    assert c["value"] == 0.97 and c["status"] == "pass" and "boom" in c["note"]
    r["pinned"] = {"status": "skipped", "reason": "benchmarks/bench_pinned.py does not exist"}
    c = by_id(checks.summarize(r))["pinned.bridge_over_torch"]
    assert c["status"] == "missing" and "does not exist" in c["note"]


def test_bridge_oom_in_the_mixed_phases_is_missing_not_a_crash():
    r = fake_results()
    r["mixed"]["runs"][1].update(outcome="oom", oom="RuntimeError: CUDA out of memory.")
    c = by_id(checks.summarize(r))["mixed.bridge.used_over_live"]
    assert c["status"] == "missing" and "oom" in c["note"]


def test_markdown_has_every_section_and_verdict(tmp_path):
    r = fake_results()
    report.write_all(r, str(tmp_path), png=False)
    md = (tmp_path / "results.md").read_text()
    v = r["verdict"]
    assert f"{v['pass']} pass, {v['fail']} fail, {v['missing']} missing" in md
    assert v["fail"] >= 3 and v["missing"] >= 6
    for text in (
        "NVIDIA H200",
        "580.159",
        "## Allocation",
        "| native caching |",
        "2,500 [2,400-2,600]",
        "bridge / native (target <= 0.90)",
        "skipped: RMM is not installed",
        "ONE process",
        "1.200",
        "torch OOM",
        "138.5 at OOM",
        "1.004",
        "## End to end",
        "| bridge | 100.0 | 99.5 | 99.0-100.0 | 2 | 2.25 | 3.50 | allocs 62, cache_hits 57 |",
        "| 2,600 [2,600-2,600] | 9,000 [7,000-11,000] |",
        "## Pinned",
        "| h2d 256 MiB | 0.930 |",
        "| 256 MiB | 52.00 | 55.90 | 20.00 | 16 |",
        "| 4 KiB | 310 | 905 | RuntimeError: no cupy |",
        "timed out after 150 s",
        "**FAIL**",
    ):
        assert text in md, text
    # every table row has as many cells as its header
    for block in md.split("\n\n"):
        rows = [ln for ln in block.splitlines() if ln.startswith("|")]
        if rows:
            assert len({ln.count("|") for ln in rows}) == 1, block
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["checks"] == r["checks"]


def test_png_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    r = checks.summarize(fake_results())
    assert report.write_png(r, str(tmp_path / "results.png"))
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_of_an_empty_run(tmp_path):
    r = {"meta": {}, "alloc": {"sizes": SIZES, "runs": []}}
    report.write_all(r, str(tmp_path), png=False)
    assert r["verdict"]["pass"] == 0 and r["verdict"]["fail"] == 0
    assert "missing" in (tmp_path / "results.md").read_text()


def test_report_cli_rebuilds_from_json(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps(fake_results()))
    assert report.main([str(tmp_path)]) == 0
    assert "## Targets" in (tmp_path / "results.md").read_text()


def test_parse_sizes():
    assert _common.parse_sizes("512,1MiB,64MiB") == SIZES
    assert _common.parse_sizes("2k, 1g") == [2048, 1 << 30]
    with pytest.raises(ValueError):
        _common.parse_sizes("12 parsecs")
    assert _common.size_label(64 << 20) == "64 MiB" and _common.size_label(512) == "512 B"


def test_plan_is_fresh_processes_with_the_async_env(tmp_path):
    tasks = run_all.plan(run_all.FULL, sys.executable, False, None)
    names = [t.name for t in tasks]
    assert len(names) == len(set(names))
    # the allocators taking turns come first: they decide the allocation targets
    assert names[:2] == ["alloc-turns-torch", "alloc-turns-cupy"]
    turns = tasks[0].argv
    assert turns[turns.index("--configs") + 1] == "native,async,rmm,bridge"
    assert "alloc-torch-native-r1" in names  # and every configuration in its own process
    async_env = {t.name: t.env for t in tasks if t.section == "alloc"}
    assert async_env["alloc-torch-async-r1"] == {
        "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"
    }
    assert async_env["alloc-cupy-async-r1"] == {}
    assert names.index("alloc-torch-native-r1") < names.index("alloc-torch-bridge-r1")
    timed = ("alloc_turns", "alloc", "e2e", "alloc_same_process")
    assert all(t.pin for t in tasks if t.section in timed)
    assert not any(t.pin for t in tasks if t.section in ("mixed", "pinned"))
    quick = run_all.plan(run_all.QUICK, sys.executable, True, None)
    assert not any(t.name.endswith("-r2") for t in quick)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity here")
def test_fastest_cpu_is_one_of_ours_and_affinity_is_restored():
    mine = os.sched_getaffinity(0)
    cpu = run_all.fastest_cpu(loops=1)
    assert cpu in mine
    assert os.sched_getaffinity(0) == mine


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity here")
def test_a_pinned_child_gets_the_cpu_flag(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, os, sys
            cpu = int(sys.argv[sys.argv.index("--cpu") + 1])
            os.sched_setaffinity(0, {cpu})
            path = sys.argv[sys.argv.index("--json") + 1]
            json.dump({"status": "ok", "cpu": cpu, "now": sorted(os.sched_getaffinity(0))},
                      open(path, "w"))
            """
        )
    )
    task = run_all.Task("child", "alloc", [sys.executable, str(script)], 30, pin=True)
    (tmp_path / "raw").mkdir()
    result = run_all.run_task(task, str(tmp_path / "raw"), timeout=30)
    assert result["status"] == "ok", result
    assert result["cpu"] in os.sched_getaffinity(0) and result["now"] == [result["cpu"]]


def test_alloc_sizes_take_turns_and_a_failing_size_is_kept_apart():
    import argparse

    import bench_alloc

    calls = []

    def loop(n: int, iters: int) -> None:
        calls.append((n, iters))
        if n == 7 and len([c for c in calls if c[0] == 7]) > 2:
            raise RuntimeError("out of memory at size 7")

    args = argparse.Namespace(iters=10, warmup=3, repeats=3)
    result: dict = {}
    bench_alloc.measure(loop, [1, 7, 2], args, result)
    timed = [n for n, it in calls if it == 10]
    assert timed == [1, 7, 2, 1, 7, 2, 1, 2]  # turns; 7 fails in round 2 and is dropped
    assert set(result["ns_per_pair"]) == {"1", "2"}
    assert len(result["ns_samples"]["1"]) == 3 and "7" not in result["ns_samples"]
    assert "out of memory at size 7" in result["size_errors"]["7"]
    assert result["status"] == "partial"


def test_child_env_drops_allocator_settings(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("BRIDGE_GPU_MEMORY_LIMIT", "50%")
    env, removed = run_all.child_env({"X_SET": "1"})
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env and "BRIDGE_GPU_MEMORY_LIMIT" not in env
    assert env["X_SET"] == "1" and "PYTORCH_CUDA_ALLOC_CONF" in removed


@pytest.mark.parametrize(
    "body, expect",
    [
        ("import sys; sys.exit(3)", "no result from the child (rc=3"),
        ("import time; time.sleep(30)", "timed out after 1 s"),
        ("raise SystemExit(0)", "no result from the child (rc=0"),
    ],
)
def test_a_failing_child_is_recorded(tmp_path, body, expect):
    script = tmp_path / "child.py"
    script.write_text(body)
    task = run_all.Task(
        "child",
        "alloc",
        [sys.executable, str(script)],
        1,
        extra={"framework": "torch", "config": "native"},
    )
    raw = tmp_path / "raw"
    raw.mkdir()
    result = run_all.run_task(task, str(raw), timeout=1)
    assert result["status"] == "error" and expect in result["error"]
    assert result["framework"] == "torch"  # so the report can say which config failed


def test_a_child_that_hangs_after_writing_keeps_its_result(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent("""
        import json, sys, time
        path = sys.argv[sys.argv.index("--json") + 1]
        json.dump({"status": "ok", "ns_per_pair": {"512": 1.0}}, open(path, "w"))
        time.sleep(30)
    """)
    )
    raw = tmp_path / "raw"
    raw.mkdir()
    task = run_all.Task("child", "alloc", [sys.executable, str(script)], 2)
    result = run_all.run_task(task, str(raw), timeout=2)
    assert result["status"] == "ok" and result["timed_out_after_s"] == 2


def test_a_child_result_is_taken_and_its_exit_code_checked(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent("""
        import json, sys
        path = sys.argv[sys.argv.index("--json") + 1]
        json.dump({"status": "ok", "ns_per_pair": {"512": 1.0}}, open(path, "w"))
        sys.exit(int(sys.argv[1]))
    """)
    )
    raw = tmp_path / "raw"
    raw.mkdir()
    for rc, status in ((0, "ok"), (1, "error")):
        task = run_all.Task(
            "child", "alloc", [sys.executable, str(script), str(rc)], 30, extra={"round": 1}
        )
        result = run_all.run_task(task, str(raw), timeout=30)
        assert result["status"] == status and result["round"] == 1


def test_bench_pinned_result_is_kept_whole(tmp_path):
    script = tmp_path / "bench_pinned.py"
    script.write_text(
        textwrap.dedent("""
        import json, sys
        path = sys.argv[sys.argv.index("--out") + 1]
        json.dump({"status": "ok", "ratio": 0.99, "bridge_over_torch_pinned": {"h2d 1 MiB": 0.99}},
                  open(path, "w"))
    """)
    )
    raw = tmp_path / "raw"
    raw.mkdir()
    task = run_all.Task("pinned", "pinned", [sys.executable, str(script)], 30, result_flag="--out")
    result = run_all.run_task(task, str(raw), timeout=30)
    assert result["status"] == "ok" and result["files"] == ["raw/pinned.json"]
    assert result["data"]["bridge_over_torch_pinned"] == {"h2d 1 MiB": 0.99}
    c = by_id(checks.summarize({"pinned": result}))["pinned.bridge_over_torch"]
    assert c["value"] == 0.99 and c["status"] == "pass"


FAKE_TORCH = """
import time
__version__ = "0.0-fake"
uint8 = "uint8"
_cost = {"native": 2e-6}


def empty(n, dtype=None, device=None):
    import bridge
    t = time.perf_counter() + (1e-6 if bridge.UNIFIED else 2e-6)
    while time.perf_counter() < t:
        pass


class _T:
    def add_(self, x):
        pass


def zeros(n, device=None):
    return _T()


class cuda:
    @staticmethod
    def synchronize():
        pass

    @staticmethod
    def get_allocator_backend():
        return "native"
"""

FAKE_BRIDGE = """
UNIFIED = False


def unify(**kw):
    global UNIFIED
    UNIFIED = True
"""


def test_turns_alternate_fresh_workers_and_compare_to_bridge(tmp_path):
    """bench_turns.py end to end on a stand-in torch (bridge's alloc costs 1 us, native 2 us)."""
    import subprocess

    (tmp_path / "torch.py").write_text(FAKE_TORCH)
    (tmp_path / "bridge.py").write_text(FAKE_BRIDGE)
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    argv = [
        sys.executable,
        str(BENCH / "bench_turns.py"),
        "--framework",
        "torch",
        "--configs",
        "native,rmm,bridge",
        "--sizes",
        "512,1MiB",
        "--iters",
        "50",
        "--warmup",
        "5",
        "--repeats",
        "4",
        "--json",
        str(out),
    ]
    if hasattr(os, "sched_getaffinity"):
        argv += ["--cpu", str(min(os.sched_getaffinity(0)))]
    subprocess.run(argv, env=env, timeout=120, check=True)
    r = json.loads(out.read_text())
    assert r["status"] == "ok", r
    cfg = r["configs"]
    assert cfg["rmm"]["status"] == "skipped" and "RMM" in cfg["rmm"]["reason"]
    assert cfg["native"]["info"]["backend"] == "native"
    for c in ("native", "bridge"):
        assert len(cfg[c]["ns_samples"]["512"]) == 4 and cfg[c]["floor_ns"] >= 0
        if "--cpu" in argv:
            assert cfg[c]["info"]["cpu"] == int(argv[-1])
    assert cfg["bridge"]["ns_per_pair"]["512"] < cfg["native"]["ns_per_pair"]["512"]
    ratio = r["turn_ratios"]["native"]["1048576"]
    assert ratio["n"] == 4 and 0.2 < ratio["median"] < 0.9
    assert "rmm" not in r["turn_ratios"]


def test_turns_over_generations_of_fresh_workers_give_each_generations_median(tmp_path):
    """bench_turns.py --processes 3: three generations of workers, each taking every round."""
    import subprocess

    (tmp_path / "torch.py").write_text(FAKE_TORCH)
    (tmp_path / "bridge.py").write_text(FAKE_BRIDGE)
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    argv = [sys.executable, str(BENCH / "bench_turns.py"), "--framework", "torch",
            "--configs", "native,bridge", "--sizes", "1MiB", "--iters", "50", "--warmup", "5",
            "--repeats", "3", "--processes", "3", "--json", str(out)]  # fmt: skip
    subprocess.run(argv, env=env, timeout=180, check=True)
    r = json.loads(out.read_text())
    assert r["status"] == "ok" and r["processes"] == 3, r
    for c in ("native", "bridge"):
        assert len(r["configs"][c]["ns_samples"]["1048576"]) == 9  # 3 rounds x 3 generations
    ratio = r["turn_ratios"]["native"]["1048576"]
    assert ratio["n"] == 9 and len(ratio["process_medians"]) == 3
    assert 0.2 < ratio["process_median"] < 0.9  # bridge's stand-in pair costs half native's
    assert sorted(ratio["process_medians"])[1] == ratio["process_median"]
    bad = subprocess.run(argv[:-2] + ["--processes", "0"], env=env, timeout=60,
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "--processes must be >= 1" in bad.stderr


def test_turns_take_every_torch_configuration_bench_alloc_knows(tmp_path):
    """bench_turns.py --configs accepts each bridge configuration of bench_alloc's torch setup
    (bridge-noslot, the cache without its thread slots, was refused once) and times each in its
    own worker beside the bridge."""
    import subprocess

    import bench_alloc

    others = [c for c in bench_alloc.TORCH_CONFIGS if c.startswith("bridge-")]
    assert "bridge-noslot" in others and set(others) <= set(bench_alloc.CONFIGS[:-1])
    (tmp_path / "torch.py").write_text(FAKE_TORCH)
    (tmp_path / "bridge.py").write_text(FAKE_BRIDGE)
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    argv = [sys.executable, str(BENCH / "bench_turns.py"), "--framework", "torch",
            "--configs", ",".join(["bridge"] + others), "--sizes", "1MiB", "--iters", "50",
            "--warmup", "5", "--repeats", "2", "--json", str(out)]  # fmt: skip
    subprocess.run(argv, env=env, timeout=120, check=True)
    r = json.loads(out.read_text())
    for c in others:
        assert r["configs"][c]["status"] == "ok", (c, r)
        assert len(r["configs"][c]["ns_samples"]["1048576"]) == 2
        assert r["turn_ratios"][c]["1048576"]["n"] == 2


def test_turns_with_no_worker_able_to_start_is_an_error(tmp_path):
    import subprocess

    (tmp_path / "torch.py").write_text("raise ImportError('torch is broken here')\n")
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    rc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "bench_turns.py"),
            "--framework",
            "torch",
            "--configs",
            "native,bridge",
            "--repeats",
            "1",
            "--json",
            str(out),
        ],
        env=env,
        timeout=120,
    ).returncode
    r = json.loads(out.read_text())
    assert rc == 1 and r["status"] == "error"
    assert "torch is broken here" in r["configs"]["native"]["error"]


def test_e2e_turns_decide_the_end_to_end_target(tmp_path):
    r = fake_results()
    r["e2e_turns"] = {
        "status": "ok",
        "steps": 100,
        "modes": {
            "native": {
                "status": "ok",
                "steps_per_s_samples": [300.0, 350.0, 340.0],
                "best_steps_per_s": 350.0,
                "issue_ms": 2.3,
                "synced_step_ms": 3.1,
            },
            "bridge": {
                "status": "ok",
                "steps_per_s_samples": [310.0, 346.5, 330.0],
                "best_steps_per_s": 346.5,
                "per_step": {"allocs": 62.0, "driver_allocs": 5.0},
            },
        },
        "turn_ratios": {"native": {"median": 0.99, "min": 0.97, "max": 1.033, "n": 3}},
    }
    report.write_all(r, str(tmp_path), png=False)
    c = by_id(r)["e2e.bridge_over_native"]
    assert c["value"] == pytest.approx(0.99) and c["status"] == "pass"
    assert "per round: median 0.990 [0.970-1.033], n=3" in c["note"]
    md = (tmp_path / "results.md").read_text()
    assert "| native | 350.0 | 340.0 | 300.0-350.0 | 3 | 2.30 | 3.10 | - |" in md
    assert "| bridge | 346.5 | 330.0 | 310.0-346.5 | 3 | - | - | allocs 62, driver_allocs 5 |" in md
    assert "### One process after another (context)" in md
    # a failed turns run falls back to the separate processes, saying so
    r["e2e_turns"] = {"status": "error", "error": "no mode ran: native: boom"}
    c = by_id(checks.summarize(r))["e2e.bridge_over_native"]
    assert c["value"] == pytest.approx(100.0 / 102.0, abs=1e-4)
    assert c["note"] == "separate processes"


def test_plan_has_the_e2e_turns():
    tasks = {t.name: t for t in run_all.plan(run_all.FULL, sys.executable, False, None)}
    t = tasks["e2e-turns"]
    assert t.section == "e2e_turns" and t.pin
    assert t.argv[t.argv.index("--turns") + 1] == "native,bridge"
    assert int(t.argv[t.argv.index("--repeats") + 1]) >= 10


def test_e2e_cli_needs_one_mode_or_turns(capsys):
    import bench_e2e

    for argv in ([], ["--mode", "bridge", "--turns", "native,bridge"], ["--turns", "bridge"]):
        with pytest.raises(SystemExit) as exc:
            bench_e2e.main(argv)
        assert exc.value.code == 2
    assert "--turns" in capsys.readouterr().err


FAKE_CUPY = """
import time
__version__ = "0.0-fake"
uint8 = "uint8"
float32 = "float32"
_allocator = [None]


def _spin(us):
    t = time.perf_counter() + us * 1e-6
    while time.perf_counter() < t:
        pass


class _Pool:
    def malloc(self, n):
        _spin(2)


def get_default_memory_pool():
    return _Pool()


def empty(n, dtype=None):
    _allocator[0](n)


def zeros(n, dtype=None):
    return object()


def add(x, y, out=None):
    pass


class cuda:
    class Device:
        def synchronize(self):
            pass

    @staticmethod
    def set_allocator(a):
        _allocator[0] = a

    @staticmethod
    def get_allocator():
        return lambda n: _spin(1)
"""


def test_turns_for_cupy_use_the_same_setup_as_one_process(tmp_path):
    """bench_turns.py and bench_alloc.py for CuPy on a stand-in cupy (bridge 1 us, pool 2 us)."""
    import subprocess

    (tmp_path / "cupy.py").write_text(FAKE_CUPY)
    (tmp_path / "bridge.py").write_text(FAKE_BRIDGE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    common = ["--sizes", "512", "--iters", "50", "--warmup", "5", "--repeats", "4"]
    out = tmp_path / "turns.json"
    subprocess.run(
        [
            sys.executable,
            str(BENCH / "bench_turns.py"),
            "--framework",
            "cupy",
            "--configs",
            "native,bridge",
            *common,
            "--json",
            str(out),
        ],
        env=env,
        timeout=120,
        check=True,
    )
    r = json.loads(out.read_text())
    assert r["status"] == "ok", r
    assert (
        r["configs"]["bridge"]["ns_per_pair"]["512"] < r["configs"]["native"]["ns_per_pair"]["512"]
    )
    assert r["turn_ratios"]["native"]["512"]["n"] == 4
    for config in ("native", "bridge"):
        one = tmp_path / f"{config}.json"
        subprocess.run(
            [
                sys.executable,
                str(BENCH / "bench_alloc.py"),
                "--framework",
                "cupy",
                "--config",
                config,
                *common,
                "--json",
                str(one),
            ],
            env=env,
            timeout=120,
            check=True,
        )
        p = json.loads(one.read_text())
        assert p["status"] == "ok" and len(p["ns_samples"]["512"]) == 4 and p["floor_ns"] >= 0
        assert p["info"]["cupy"] == "0.0-fake"
