# SPDX-License-Identifier: Apache-2.0
"""run_all.py's later sections (trace, capacity, wait, share, rmm), --only part runs that
merge into one results.json, and the report's tables and verdicts for those sections.

CPU only: the canned child JSON below has the schema each benchmark writes (read from
bench_trace.py's run(), bench_capacity.py's main(), bench_wait.py's main(),
bench_share.py's coordinate() and bench_rmm.py's body()); the children run_all starts
here are small scripts that write it.
"""

from __future__ import annotations

import copy
import json
import pathlib
import sys
import textwrap

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import checks  # noqa: E402
import report  # noqa: E402
import run_all  # noqa: E402

LATER = ("trace", "capacity", "wait", "share", "rmm")
GIB = 1 << 30


# ---- canned child output, in each benchmark's own schema ----


def replay(config: str, ns: float, reserved: int, live: int, trace: str = "gpt2") -> dict:
    """One bench_trace.py replay (run_guarded's base + replay()'s figures), as _best keeps it."""
    return {
        "bench": "trace",
        "trace": trace,
        "config": config,
        "events": 6517,
        "status": "ok",
        "pid": 1,
        "ns_per_event": ns,
        "ns_per_pass": [ns, ns * 1.1],
        "peak_reserved": reserved,
        "peak_live": live,
        "reserved_over_live": reserved / live if reserved else None,
        "torch": "2.9.0",
        "wall_s": 3.0,
        "rounds": 3,
    }


def turns(ratios: list[float]) -> dict:
    """What bench_trace.py run adds to a configuration's entry: its rounds against native."""
    import trace_turns

    return {
        "round_ratios": ratios,
        "median_ratio_to_native": trace_turns.median(ratios),
        "ratio_spread": trace_turns.quartile_spread(ratios),
        "rounds": len(ratios),
    }


def trace_out(name: str, live: int = 5 * GIB) -> dict:
    """bench_trace.py run --out: {trace name: {config: best replay}}."""
    return {
        name: {
            "native": replay("native", 2500.0, int(live * 1.20), live, name),
            "async": replay("async", 3000.0, int(live * 1.10), live, name),
            "rmm": {
                "bench": "trace",
                "trace": name,
                "config": "rmm",
                "status": "error",
                "error": "ModuleNotFoundError: No module named 'rmm'",
            },
            "bridge": {
                **replay("bridge", 2400.0, int(live * 1.03), live, name),
                **turns([2400 / 2500] * 9),
                "allocs": 19551,
                "cache_hits": 19000,
                "cache_limit": 1 << 32,
            },
        }
    }


CAPACITY = {
    "bench": "capacity",
    "budget": 40 * GIB,
    "steps": 2,
    "runs": [
        {
            "mode": "native",
            "split": 0.3,
            "batch": 100,
            "tries": [[16, True], [32, True]],
            "seconds": 20.0,
            "torch": "2.9.0",
            "cupy": "13.6.0",
        },
        {
            "mode": "native",
            "split": 0.5,
            "batch": 150,
            "tries": [[16, True]],
            "seconds": 21.0,
            "torch": "2.9.0",
            "cupy": "13.6.0",
        },
        {"status": "error", "error": "Traceback ... cuFFT failed"},
        {
            "mode": "bridge",
            "split": None,
            "batch": 300,
            "tries": [[16, True]],
            "seconds": 25.0,
            "torch": "2.9.0",
            "cupy": "13.6.0",
        },
    ],
    "native_best_split": "0.5",
    "native_batch": 150,
    "bridge_batch": 300,
    "ratio": 2.0,
}


def wait_run(sps: float, tight: bool, errors: list | None = None) -> dict:
    return {
        "steps_per_s": sps,
        "seconds": 300 / sps,
        "errors": errors or [],
        "budget": 1200 << 20 if tight else 0,
        "batch": 512 << 20,
        "num_waits": 40 if tight else 0,
        "wait_seconds": 0.8 if tight else 0.0,
        "num_ooms": 0,
        "ledger_peak": 1100 << 20,
    }


WAIT = {
    "benchmark": "wait",
    "steps": 300,
    "runs": {
        "unlimited": [wait_run(50.0, False), wait_run(40.0, False)],
        "tight": [wait_run(46.0, True), wait_run(60.0, True, ["OutOfMemoryError()"])],
    },
    "best_steps_per_s": {"unlimited": 50.0, "tight": 60.0},
    "ratio_tight_over_unlimited": 1.2,
    "target_ratio": 0.9,
    "errors": 1,
}


def _spread(median: float) -> dict:
    return {"median": median, "min": median - 0.2, "max": median + 0.3, "n": 21}


SHARE = {
    "bench": "share",
    "framework": "torch",
    "sizes": [512, 1 << 20, 64 << 20],
    "iters": 5000,
    "repeats": 21,
    "warmup": 2000,
    "budget": "8GiB",
    "cpu": 3,
    "started": "2026-11-30T16:14:00",
    "status": "ok",
    "pid": 2,
    "wall_s": 15.2,
    "configs": {
        c: {
            "status": "ok",
            "info": {},
            "ns_per_pair": {"512": 900.0, "1048576": 950.0, "67108864": 1000.0},
            "ns_samples": {"512": [900.0, 910.0]},
        }
        for c in ("own", "share", "own-pool", "share-pool")
    },
    "ratios": {
        "share/own": {
            "512": _spread(1.0037),
            "1048576": _spread(0.9648),
            "67108864": _spread(1.0833),
        },
        "share-pool/own-pool": {
            "512": _spread(1.0479),
            "1048576": _spread(1.0108),
            "67108864": _spread(1.0758),
        },
    },
}

RMM = {
    "benchmark": "rmm",
    "status": "ok",
    "pid": 3,
    "rmm": "25.10.0",
    "bridge": "0.9.0",
    "iters": 2000,
    "repeats": 7,
    "ns_per_pair": {
        "512 B": {
            "buffer_async": 1000.0,
            "buffer_bridge": 950.0,
            "mr_async": 500.0,
            "mr_bridge": 480.0,
            "ratio": 0.95,
            "mr_ratio": 0.96,
        },
        "1 MiB": {
            "buffer_async": 1000.0,
            "buffer_bridge": 1020.0,
            "mr_async": 500.0,
            "mr_bridge": 490.0,
            "ratio": 1.02,
            "mr_ratio": 0.98,
        },
        "64 MiB": {
            "buffer_async": 1100.0,
            "buffer_bridge": 1000.0,
            "mr_async": 510.0,
            "mr_bridge": 500.0,
            "ratio": 0.909,
            "mr_ratio": 0.98,
        },
    },
    "worst_ratio": 1.02,
    "stats": {},
    "wall_s": 2.0,
}

CANNED = {
    "trace-gpt2": trace_out("gpt2"),
    "trace-resnet50": trace_out("resnet50"),
    "trace-cupy-fft": trace_out("cupy-fft"),
    "capacity": CAPACITY,
    "wait": WAIT,
    "share-torch": SHARE,
    "rmm": RMM,
}


def wrapped(obj: dict) -> dict:
    """What run_all stores for a later section (its _as_result: the child's JSON whole)."""
    task = run_all.Task("x", "capacity", [], 1)
    return run_all._as_result(task, copy.deepcopy(obj), "/tmp/raw")


def later_results() -> dict:
    return {
        "trace": {
            "gpt2": wrapped(CANNED["trace-gpt2"]),
            "resnet50": wrapped(CANNED["trace-resnet50"]),
            "cupy-fft": wrapped(CANNED["trace-cupy-fft"]),
        },
        "capacity": wrapped(CAPACITY),
        "wait": wrapped(WAIT),
        "share": wrapped(SHARE),
        "rmm": wrapped(RMM),
    }


def checks_of(results: dict) -> dict:
    return {c["id"]: c for c in checks.summarize(results)["checks"]}


# ---- the plan ----


def test_plan_runs_the_later_sections_after_the_others_in_order():
    tasks = run_all.plan(run_all.FULL, sys.executable, False, None)
    sections = [t.section for t in tasks]
    first_later = min(sections.index(s) for s in LATER)
    assert set(sections[:first_later]) == set(run_all.SECTIONS) - set(LATER)
    order = [s for i, s in enumerate(sections[first_later:]) if s not in sections[first_later:][:i]]
    assert order == list(LATER)
    names = [t.name for t in tasks]
    assert names[first_later:] == [f"trace-{name}" for name in checks.TRACES] + [
        "capacity",
        "wait",
        "share-torch",
        "rmm",
    ]
    assert len(names) == len(set(names))
    by = {t.name: t for t in tasks}
    for name in run_all.TRACES:
        t = by[f"trace-{name}"]
        assert t.argv[2] == "run" and t.argv[3].endswith(f"traces/{name}.json.gz")
        assert pathlib.Path(t.argv[3]).is_file()  # the committed trace
        # carving (off by default) beside the default cache; RMM replays torch's events only
        want = (
            "native,async,bridge,bridge-carve"
            if name in checks.MIXED_TRACES
            else "native,async,rmm,bridge,bridge-carve"
        )
        assert t.argv[t.argv.index("--configs") + 1] == want
        assert t.result_flag == "--out" and t.extra == {"trace": name}
    assert by["capacity"].result_flag == by["wait"].result_flag == "--out"
    assert by["rmm"].result_flag == "--out" and by["share-torch"].result_flag == "--json"
    assert by["share-torch"].argv[by["share-torch"].argv.index("--framework") + 1] == "torch"
    # timed on one CPU where the script takes --cpu; not where it does not
    assert by["share-torch"].pin and by["rmm"].pin and by["trace-gpt2"].pin
    assert not any(by[n].pin for n in ("capacity", "wait"))
    # every child fits a 450 s part run on a machine with a 10-minute command limit
    assert all(t.timeout <= 450 for t in tasks)
    assert by["rmm"].skip is None


def _arg(task: run_all.Task, flag: str) -> str:
    return task.argv[task.argv.index(flag) + 1]


def test_quick_plan_uses_fewer_rounds_passes_steps_and_splits():
    full = {t.name: t for t in run_all.plan(run_all.FULL, sys.executable, False, None)}
    quick = {t.name: t for t in run_all.plan(run_all.QUICK, sys.executable, True, None)}
    assert set(n for n in full if full[n].section in LATER) == set(
        n for n in quick if quick[n].section in LATER
    )
    for flag in ("--rounds", "--passes"):
        assert int(_arg(quick["trace-gpt2"], flag)) < int(_arg(full["trace-gpt2"], flag))
    assert _arg(full["capacity"], "--budget") == "24GiB"
    assert len(_arg(quick["capacity"], "--splits").split(",")) < len(
        _arg(full["capacity"], "--splits").split(",")
    )
    assert all(0 < float(s) < 1 for s in _arg(full["capacity"], "--splits").split(","))
    for flag in ("--rounds", "--steps"):
        assert int(_arg(quick["wait"], flag)) < int(_arg(full["wait"], flag))
    assert int(_arg(quick["share-torch"], "--repeats")) < int(
        _arg(full["share-torch"], "--repeats")
    )
    assert "--quick" in quick["rmm"].argv and "--quick" not in full["rmm"].argv
    assert all(quick[n].timeout <= full[n].timeout for n in quick if n in full)


def test_without_rmm_the_rmm_section_is_skipped_with_the_reason():
    tasks = {
        t.name: t
        for t in run_all.plan(
            run_all.FULL, sys.executable, False, None, rmm_skip="No module named 'rmm'"
        )
    }
    assert "No module named 'rmm'" in tasks["rmm"].skip
    assert _arg(tasks["trace-gpt2"], "--configs") == "native,async,bridge,bridge-carve"
    why = run_all.rmm_missing(sys.executable)  # None where rmm imports
    assert why is None or "rmm" in why


def test_only_and_dry_run_print_the_part(capsys, tmp_path):
    assert run_all.main(["--out", str(tmp_path), "--dry-run", "--only", "wait,trace"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == [f"trace-{name}" for name in checks.TRACES] + ["wait"]
    assert all("--out " + str(tmp_path / "raw") in ln for ln in lines)
    assert not (tmp_path / "results.json").exists()  # a dry run writes nothing
    assert run_all.main(["--out", str(tmp_path), "--dry-run", "--only", "rmm"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("rmm") and (
        "skipped: rmm is not importable" in line or "bench_rmm.py" in line
    )
    with pytest.raises(SystemExit):
        run_all.main(["--out", str(tmp_path), "--dry-run", "--only", "trace,bogus"])
    assert "bogus" in capsys.readouterr().err


# ---- children, and part runs merging into one results.json ----

FAKE_CHILD = """
import json, os, sys
flag = "--out" if "--out" in sys.argv else "--json"
path = sys.argv[sys.argv.index(flag) + 1]
name = os.path.basename(path)[:-len(".json")]
canned = json.load(open(os.environ["CANNED"]))
json.dump(canned[name], open(path, "w"))
"""


def fake_plan(tmp_path: pathlib.Path, monkeypatch) -> None:
    """run_all.plan with every child replaced by FAKE_CHILD (writing its canned JSON)."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(FAKE_CHILD))
    canned = tmp_path / "canned.json"
    canned.write_text(
        json.dumps(
            CANNED
            | {
                "alloc-turns-torch": {"status": "error", "error": "no GPU here"},
            }
        )
    )
    monkeypatch.setenv("CANNED", str(canned))
    real = run_all.plan

    def plan(*a, **kw):
        tasks = real(*a, **kw)
        for t in tasks:
            t.argv = [sys.executable, str(script)]
            t.pin = False
        return tasks

    monkeypatch.setattr(run_all, "plan", plan)
    monkeypatch.setattr(run_all, "rmm_missing", lambda python: None)


def test_part_runs_merge_into_one_results_json(tmp_path, monkeypatch):
    fake_plan(tmp_path, monkeypatch)
    out = tmp_path / "out"
    # part 1: one of the earlier sections (its child fails: recorded, the run goes on)
    assert run_all.main(["--out", str(out), "--only", "alloc_turns"]) == 0
    first = json.loads((out / "results.json").read_text())
    assert first["alloc_turns"]["torch"]["status"] == "error"
    assert any(p.startswith("alloc-turns-torch:") for p in first["problems"])
    assert "trace" not in first and "pinned" not in first
    md = (out / "results.md").read_text()
    assert "## Capacity" in md and "Verdict: not run" in md
    # part 2: trace and capacity, merged
    assert run_all.main(["--out", str(out), "--only", "trace,capacity"]) == 0
    second = json.loads((out / "results.json").read_text())
    assert second["alloc_turns"] == first["alloc_turns"]  # kept
    assert any(p.startswith("alloc-turns-torch:") for p in second["problems"])
    assert set(second["trace"]) == set(checks.TRACES)
    assert second["trace"]["gpt2"]["data"] == CANNED["trace-gpt2"]
    assert second["capacity"]["data"]["ratio"] == 2.0
    assert [p["only"] for p in second["meta"]["parts"]] == ["alloc_turns", "trace,capacity"]
    # part 3: the rest; then part 2 again keeps parts 1 and 3
    assert run_all.main(["--out", str(out), "--only", "wait,share,rmm"]) == 0
    assert run_all.main(["--out", str(out), "--only", "capacity"]) == 0
    final = json.loads((out / "results.json").read_text())
    for section in ("alloc_turns", "trace", "wait", "share", "rmm"):
        assert section in final, section
    assert final["share"]["data"]["ratios"] == SHARE["ratios"]
    assert final["rmm"]["status"] == "ok" and final["rmm"]["rc"] == 0
    assert len(final["meta"]["parts"]) == 4
    c = {x["id"]: x for x in final["checks"]}
    assert c["capacity.bridge_over_native"]["status"] == "pass"
    assert c["wait.tight_over_unlimited"]["value"] == pytest.approx(46 / 50, abs=1e-4)
    assert c["rmm.worst_ratio"]["value"] == 1.02
    assert c["trace.gpt2.time"]["status"] == "pass"
    md = (out / "results.md").read_text()
    assert md.count("Verdict:") == 5


def test_a_full_run_does_not_merge(tmp_path, monkeypatch):
    fake_plan(tmp_path, monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text(
        json.dumps({"wait": {"status": "ok", "data": {}}, "meta": {}})
    )
    monkeypatch.setattr(run_all, "SECTIONS", ("wait",))  # a full run of a one-section suite
    assert run_all.main(["--out", str(out), "--budget-s", "60"]) == 0
    got = json.loads((out / "results.json").read_text())
    assert got["wait"]["data"] == WAIT and len(got["meta"]["parts"]) == 1


def test_a_skipped_rmm_is_recorded_with_its_reason(tmp_path, monkeypatch):
    fake_plan(tmp_path, monkeypatch)
    monkeypatch.setattr(run_all, "rmm_missing", lambda python: "No module named 'rmm'")
    out = tmp_path / "out"
    assert run_all.main(["--out", str(out), "--only", "rmm"]) == 0
    got = json.loads((out / "results.json").read_text())
    assert got["rmm"]["status"] == "skipped" and "No module named 'rmm'" in got["rmm"]["reason"]
    assert not (out / "raw" / "rmm.json").exists()
    c = {x["id"]: x for x in got["checks"]}["rmm.worst_ratio"]
    assert c["status"] == "missing" and "No module named 'rmm'" in c["note"]
    assert "Verdict: skipped" in (out / "results.md").read_text()


def test_merge_keeps_earlier_sections_and_replaces_the_ones_run():
    earlier = {
        "meta": {"date": "d1", "command": "run_all --only trace", "only": ["trace"]},
        "trace": {"gpt2": {"status": "ok"}},
        "wait": {"status": "error"},
        "problems": ["wait: crashed", "trace-gpt2: slow", "matplotlib missing: no png"],
    }
    now = run_all.fresh_results({"parts": [{"date": "d2"}]})
    now["problems"] = ["wait: again"]
    run_all.merge_earlier(now, earlier, {"wait"}, {"wait"})
    assert now["trace"] == {"gpt2": {"status": "ok"}} and "wait" not in now
    assert now["problems"] == ["trace-gpt2: slow", "wait: again"]
    assert [p["date"] for p in now["meta"]["parts"]] == ["d1", "d2"]


# ---- the report ----


def test_report_checks_each_later_section_against_its_target():
    c = checks_of(later_results())
    t = c["trace.gpt2.time"]
    assert t["value"] == pytest.approx(2400 / 2500, abs=1e-4) and t["status"] == "pass"
    f = c["trace.resnet50.reserved_over_live"]
    assert f["value"] == pytest.approx(1.03, abs=1e-3) and f["status"] == "pass"
    v = c["trace.gpt2.reserved_vs_native"]
    assert v["value"] == pytest.approx(1.03 / 1.20, abs=1e-3) and v["status"] == "pass"
    cap = c["capacity.bridge_over_native"]
    assert cap["value"] == 2.0 and cap["status"] == "pass" and "1 of 3" in cap["note"]
    # the tight run with errors is left out: 46 / 50, not 60 / 50
    w = c["wait.tight_over_unlimited"]
    assert w["value"] == pytest.approx(0.92) and w["status"] == "pass"
    assert "with errors" in w["note"]
    assert c["share.share_over_own.512"]["value"] == 1.0037
    assert c["share.share_over_own.512"]["status"] == "pass"
    assert c["share.share_over_own.67108864"]["status"] == "fail"  # 1.0833 > 1.05
    r = c["rmm.worst_ratio"]
    assert r["value"] == 1.02 and r["status"] == "pass" and "1 MiB" in r["note"]


def test_report_fails_what_misses_its_target():
    res = later_results()
    slow = trace_out("gpt2")
    slow["gpt2"]["bridge"].update(ns_per_event=3000.0, reserved_over_live=1.3, **turns([1.2] * 9))
    res["trace"]["gpt2"] = wrapped(slow)
    cap = copy.deepcopy(CAPACITY) | {"bridge_batch": 200, "ratio": 200 / 150}
    res["capacity"] = wrapped(cap)
    wait = copy.deepcopy(WAIT)
    wait["runs"]["tight"] = [wait_run(30.0, True)]
    res["wait"] = wrapped(wait)
    rmm = copy.deepcopy(RMM)
    rmm["ns_per_pair"]["64 MiB"]["ratio"] = 1.4
    res["rmm"] = wrapped(rmm)
    c = checks_of(res)
    assert c["trace.gpt2.time"]["value"] == pytest.approx(1.2)
    for cid in (
        "trace.gpt2.time",
        "trace.gpt2.reserved_over_live",
        "trace.gpt2.reserved_vs_native",
        "capacity.bridge_over_native",
        "wait.tight_over_unlimited",
        "rmm.worst_ratio",
    ):
        assert c[cid]["status"] == "fail", cid
    assert c["capacity.bridge_over_native"]["value"] == pytest.approx(200 / 150, abs=1e-4)
    assert c["wait.tight_over_unlimited"]["value"] == pytest.approx(0.6)
    assert c["rmm.worst_ratio"]["value"] == 1.4
    assert "Verdict: **FAIL**" in report.markdown(res)


def test_missing_sections_are_not_run_never_a_pass():
    res = checks.summarize({})
    later = [c for c in res["checks"] if c["group"] in LATER]
    assert {c["group"] for c in later} == set(LATER)
    assert all(c["status"] == "missing" and c["note"].startswith("not run") for c in later)
    md = report.markdown(res)
    for title in (
        "## Allocation traces",
        "## Capacity",
        "## Waiting",
        "## A cross-process",
        "## RMM",
    ):
        assert title in md
    assert md.count("Verdict: not run") == 5 and "Verdict: pass" not in md


def test_failed_children_and_broken_runs_are_missing_with_the_reason():
    res = later_results()
    res["trace"]["resnet50"] = {"status": "error", "error": "timed out after 300 s"}
    cap = copy.deepcopy(CAPACITY)
    cap["runs"][-1] = {"status": "error", "error": "bridge child crashed"}
    cap["bridge_batch"], cap["ratio"] = 0, 0.0
    res["capacity"] = wrapped(cap)
    wait = copy.deepcopy(WAIT)
    wait["runs"]["tight"] = [wait_run(60.0, True, ["OutOfMemoryError()"])]
    res["wait"] = wrapped(wait)
    res["share"] = wrapped(
        {**SHARE, "status": "error", "error": "RuntimeError: no config ran", "ratios": {}}
    )
    res["rmm"] = wrapped(
        {"benchmark": "rmm", "status": "skipped", "reason": "RMM is not installed: x"}
    )
    trace_gpt2 = trace_out("gpt2")
    trace_gpt2["gpt2"]["native"] = {"status": "error", "error": "CUDA error"}
    res["trace"]["gpt2"] = wrapped(trace_gpt2)
    c = checks_of(res)
    assert c["trace.resnet50.time"]["status"] == "missing"
    assert "timed out" in c["trace.resnet50.time"]["note"]
    assert (
        c["trace.gpt2.time"]["status"] == "missing" and "CUDA error" in c["trace.gpt2.time"]["note"]
    )
    assert c["trace.gpt2.reserved_over_live"]["status"] == "pass"  # bridge's own figure
    assert "bridge child crashed" in c["capacity.bridge_over_native"]["note"]
    assert c["capacity.bridge_over_native"]["status"] == "missing"  # not a 0.0 fail
    assert c["wait.tight_over_unlimited"]["status"] == "missing"
    assert all(
        c[f"share.share_over_own.{s}"]["status"] == "missing"
        for s in ("512", "1048576", "67108864")
    )
    assert c["rmm.worst_ratio"]["status"] == "missing"
    assert "RMM is not installed" in c["rmm.worst_ratio"]["note"]
    report.markdown(res)  # renders


def test_markdown_renders_each_later_section(tmp_path):
    res = later_results() | {"meta": {}}
    report.write_all(res, str(tmp_path), png=False)
    md = (tmp_path / "results.md").read_text()
    # trace: one row per configuration, the failed rmm replay with its error
    assert "| gpt2 | bridge | 2,400 |" in md and "| resnet50 | native | 2,500 |" in md
    assert "| gpt2 | rmm | error: ModuleNotFoundError" in md
    # capacity: the splits and the bridge, a failed split with its error
    assert "| native | 0.50 | 150 |" in md and "| bridge | - | 300 |" in md
    assert "cuFFT failed" in md
    # wait: every round, waits and errors
    assert "| tight | 2 | 60.0 |" in md and "OutOfMemoryError()" in md
    # share: ns per pair and the ratios per size
    assert "| share/own | 1.004 [0.80-1.30] | 0.965" in md
    # rmm: per size
    assert "| 1 MiB | 1,000 | 1,020 | 1.020 |" in md
    verdicts = [ln for ln in md.splitlines() if ln.startswith("Verdict")]
    assert len(verdicts) == 5
    assert verdicts[1].startswith("Verdict: pass") and "capacity" in verdicts[1]
    assert verdicts[3].startswith("Verdict: **FAIL**")  # share at 64 MiB
    targets = md[md.index("## Targets") : md.index("## Allocation")]
    assert "capacity: bridge / best native batch | 2.000 | >= 1.80 | pass" in targets
    json.loads((tmp_path / "results.json").read_text())


def test_the_trace_time_check_takes_the_median_of_round_ratios_over_nine_rounds_or_more():
    """A run whose configurations took turns decides by the median of its rounds'
    ratios, not by the two best passes (processes differ by up to 2x); fewer than nine
    rounds give no verdict, and the note shows the spread."""
    out = trace_out("gpt2")
    out["gpt2"]["bridge"]["ns_per_event"] = 2000.0  # best pass: 0.8 of native's 2500
    out["gpt2"]["bridge"].update(turns([0.8, 1.3, 1.2, 1.1, 1.25, 1.2, 0.9, 1.4, 1.15]))
    c = {x["id"]: x for x in checks.trace_checks({"gpt2": {"status": "ok", "data": out}})}
    t = c["trace.gpt2.time"]
    assert t["value"] == 1.2 and t["status"] == "fail"
    assert t["note"].startswith(
        "median 1.200 of 9 round-by-round ratios (quartiles 1.000-1.275, range 0.800-1.400); "
        "2,000 /"
    )
    out["gpt2"]["bridge"].update(turns([0.8, 1.3, 1.2]))  # three rounds: no verdict
    c = {x["id"]: x for x in checks.trace_checks({"gpt2": {"status": "ok", "data": out}})}
    t = c["trace.gpt2.time"]
    assert t["value"] is None and t["status"] == "missing"
    assert t["note"].startswith("3 round-by-round ratios, fewer than 9: no verdict; 2,000 /")
    for k in ("round_ratios", "median_ratio_to_native", "ratio_spread"):
        del out["gpt2"]["bridge"][k]  # a run without turns: no verdict either
    c = {x["id"]: x for x in checks.trace_checks({"gpt2": {"status": "ok", "data": out}})}
    assert c["trace.gpt2.time"]["status"] == "missing"


def test_the_trace_table_shows_the_spread_hits_and_processes():
    res = later_results() | {"meta": {}}
    res["trace"]["gpt2"]["data"]["gpt2"]["bridge"]["processes"] = [{}, {}, {}]
    md = report.markdown(checks.summarize(res))
    assert "| gpt2 | bridge | 2,400 | 0.960 [0.960-0.960] (0.960-0.960), n=9 |" in md
    assert "| 1.030 | 97.2% | 9 / 3 |" in md


def test_the_wait_check_takes_the_median_of_the_rounds_ratios():
    """Three clean rounds: 198/284, 284/284, 193/284; the median (0.70) decides, not the
    best tight run over the best unlimited one (1.0)."""
    data = copy.deepcopy(WAIT)
    data["runs"] = {"unlimited": [wait_run(284.0, False) for _ in range(3)],
                    "tight": [wait_run(v, True) for v in (198.0, 284.0, 193.0)]}  # fmt: skip
    value, note = checks.wait_value({"status": "ok", "data": data})
    assert value == pytest.approx(198 / 284) and note.startswith("median of 3 rounds' ratios")
    assert "best 284.0 / 284.0 steps/s" in note


def test_the_report_checks_every_trace_run_all_replays():
    """A committed trace that did not run shows as missing, never as absent."""
    assert checks.TRACES == run_all.TRACES
    c = checks_of({})
    for name in run_all.TRACES:
        assert c[f"trace.{name}.time"]["status"] == "missing"


def test_the_trace_section_defaults_give_a_verdict_of_rounds_in_turns():
    """Full and quick: at least checks.TRACE_MIN_ROUNDS rounds, split among three
    generations of workers, each trace's child pinned."""
    for params, quick in ((run_all.FULL, False), (run_all.QUICK, True)):
        tasks = {t.name: t for t in run_all.plan(params, sys.executable, quick, None)}
        for name in run_all.TRACES:
            t = tasks[f"trace-{name}"]
            assert int(_arg(t, "--rounds")) >= checks.TRACE_MIN_ROUNDS
            assert int(_arg(t, "--processes")) == 3 and t.pin


def test_carving_is_checked_beside_the_default_cache_where_a_trace_replayed_it():
    """bridge-carve (off by default, the memory answer of issue 34) gets the same three
    checks as bridge, under its own ids; runs without it add none."""
    out = trace_out("gpt2")
    assert not any(
        ".carve." in k
        for k in {x["id"] for x in checks.trace_checks({"gpt2": {"status": "ok", "data": out}})}
    )
    live = 5 * GIB
    out["gpt2"]["bridge-carve"] = {
        **replay("bridge-carve", 2300.0, int(live * 1.04), live, "gpt2"),
        **turns([2300 / 2500] * 9),
    }
    res = {"gpt2": {"status": "ok", "data": out}}
    c = {x["id"]: x for x in checks.trace_checks(res)}
    assert c["trace.gpt2.carve.time"]["value"] == pytest.approx(0.92)
    assert c["trace.gpt2.carve.time"]["label"] == "trace gpt2: bridge-carve / native ns per event"
    assert c["trace.gpt2.carve.reserved_over_live"]["value"] == pytest.approx(1.04, abs=1e-3)
    assert c["trace.gpt2.carve.reserved_over_live"]["status"] == "pass"
    assert c["trace.gpt2.carve.reserved_vs_native"]["value"] == pytest.approx(1.04 / 1.20, abs=1e-3)
    assert c["trace.gpt2.time"]["value"] == pytest.approx(0.96)  # the default's, unchanged
    # a trace that ran without carving: its carving checks are missing, with the reason
    c = {
        x["id"]: x
        for x in checks.trace_checks(res | {"mixed": {"status": "ok", "data": trace_out("mixed")}})
    }
    assert c["trace.mixed.carve.time"]["status"] == "missing"
    assert "bridge-carve: not run" in c["trace.mixed.carve.time"]["note"]


def test_the_turns_run_in_generations_of_fresh_workers():
    """Full: 21 rounds in each of nine generations (the figure a process's own speed moves
    least); quick: one generation."""
    for params, quick, gens in ((run_all.FULL, False, "9"), (run_all.QUICK, True, "1")):
        tasks = {t.name: t for t in run_all.plan(params, sys.executable, quick, None)}
        for fw in ("torch", "cupy"):
            assert _arg(tasks[f"alloc-turns-{fw}"], "--processes") == gens
    assert (
        _arg(
            {t.name: t for t in run_all.plan(run_all.FULL, sys.executable, False, None)}[
                "alloc-turns-torch"
            ],
            "--repeats",
        )
        == "21"
    )


def test_trace_rounds_and_capacity_splits_for_a_short_machine(capsys):
    assert (
        run_all.main(
            [
                "--out",
                "x",
                "--dry-run",
                "--only",
                "trace,capacity",
                "--trace-rounds",
                "9",
                "--capacity-splits",
                "0.45, 0.5,0.55",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("--rounds 9 ") == len(run_all.TRACES)
    assert "--splits 0.45,0.5,0.55 " in out
    for argv, says in (
        (["--trace-rounds", "3"], "at least 9 rounds"),
        (["--capacity-splits", "0.5,1.5"], "fractions between 0 and 1"),
        (["--capacity-splits", "half"], "fractions between 0 and 1"),
    ):
        with pytest.raises(SystemExit):
            run_all.main(["--out", "x", "--dry-run"] + argv)
        assert says in capsys.readouterr().err
