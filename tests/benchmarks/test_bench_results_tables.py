# SPDX-License-Identifier: Apache-2.0
"""benchmarks/results_tables.py: one small table per benchmark from a run's results.json
(CPU; the canned run is test_bench_run_all_sections.py's, in each benchmark's schema)."""

from __future__ import annotations

import copy
import json
import pathlib
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import results_tables as rt  # noqa: E402
import run_all  # noqa: E402
from test_bench_run_all_sections import later_results  # noqa: E402

META = {
    "date": "2026-12-02T10:00:00+00:00",
    "git": "abc1234",
    "command": "python3 benchmarks/run_all.py --out r --only trace,capacity,wait,share,rmm",
    "gpu_name": "NVIDIA H200",
    "gpu_total_bytes": 150_121_545_728,
    "driver_version": "580.159",
    "cuda_driver_api": "13.0",
    "bridge_version": "0.9.0",
    "versions": {"torch": "2.11.0+cu130", "cupy-cuda13x": "14.2.0", "numpy": "2.5.0"},
}


def run(**sections) -> dict:
    res = later_results() | {"meta": copy.deepcopy(META)}
    res.update(sections)
    return res


def test_each_benchmark_with_figures_gets_its_table_with_card_and_versions(tmp_path):
    done = rt.write_tables(run(), str(tmp_path), "../runs/r1")
    written = {n for n, what in done.items() if what == "written"}
    assert written == {"trace", "capacity", "wait", "share", "rmm"}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}.md" for n in written)
    for name in ("alloc", "mixed", "e2e", "pinned"):  # not in this run: nothing written
        assert done[name].startswith("no figure")
    text = (tmp_path / "trace.md").read_text()
    lines = text.splitlines()
    assert lines[0] == rt.MARKER and lines[2] == "# trace: the latest figures"
    assert "- card: NVIDIA H200, 139.8 GiB, driver 580.159 (CUDA 13.0 driver API)" in lines
    assert "- versions: bridge 0.9.0, torch 2.11.0+cu130, cupy-cuda13x 14.2.0, numpy 2.5.0" in lines
    assert "- run: 2026-12-02T10:00:00+00:00, git abc1234 (from ../runs/r1)" in lines
    # the targets with their values, then the benchmark's own table
    assert "| trace gpt2: bridge / native ns per event | 0.960 | <= 1 | pass |" in text
    assert "### Allocation traces replayed (bench_trace.py)" in text
    assert "| gpt2 | bridge | 2,400 | 0.960 [0.960-0.960] (0.960-0.960), n=9 |" in text
    assert "Verdict:" not in text and "Capacity" not in text  # only its own benchmark
    cap = (tmp_path / "capacity.md").read_text()
    assert "| capacity: bridge / best native batch | 2.000 | >= 1.8 | pass |" in cap


def test_a_later_part_run_refreshes_only_its_own_tables(tmp_path):
    rt.write_tables(run(), str(tmp_path), "r1")
    before = {p.name: p.read_text() for p in tmp_path.iterdir()}
    later = run()
    for section in ("trace", "capacity", "share", "rmm"):
        later.pop(section)  # a part run of wait only
    later["meta"]["date"] = "2026-12-03T09:00:00+00:00"
    done = rt.write_tables(later, str(tmp_path), "r2")
    assert done["wait"] == "written" and done["trace"].startswith("no figure")
    after = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert {n for n in after if after[n] != before[n]} == {"wait.md"}
    assert "2026-12-03" in after["wait.md"] and "2026-12-02" in after["trace.md"]


def test_a_run_whose_targets_are_all_missing_keeps_the_table(tmp_path):
    rt.write_tables(run(), str(tmp_path), "r1")
    old = (tmp_path / "rmm.md").read_text()
    broken = run(rmm={"status": "error", "error": "rmm crashed"})
    assert rt.write_tables(broken, str(tmp_path), "r2")["rmm"].startswith("no figure")
    assert (tmp_path / "rmm.md").read_text() == old


def test_a_file_it_did_not_write_is_never_overwritten(tmp_path):
    mine = tmp_path / "trace.md"
    mine.write_text("# notes by hand\n")
    (tmp_path / "README.md").write_text("the history\n")
    done = rt.write_tables(run(), str(tmp_path), "r1")
    assert done["trace"].startswith("not written") and "trace.md" in done["trace"]
    assert mine.read_text() == "# notes by hand\n"
    assert (tmp_path / "README.md").read_text() == "the history\n"
    assert done["wait"] == "written"


def test_a_table_transcribed_by_hand_is_replaced_by_a_run(tmp_path):
    old = tmp_path / "trace.md"
    old.write_text(rt.TRANSCRIBED + "\n\n# trace: from the run records\n")
    assert rt.write_tables(run(), str(tmp_path), "r1")["trace"] == "written"
    assert old.read_text().splitlines()[0] == rt.MARKER


def test_the_committed_tables_can_be_refreshed_by_a_run():
    # every benchmark's committed table is one results_tables.py may replace
    for name in rt.BENCHMARKS:
        first = (BENCH / "results" / f"{name}.md").read_text().splitlines()[0]
        assert first in (rt.MARKER, rt.TRANSCRIBED), name


def test_the_command_line_reads_a_run_directory(tmp_path, capsys):
    rdir = tmp_path / "runs" / "r1"
    rdir.mkdir(parents=True)
    (rdir / "results.json").write_text(json.dumps(run()))
    dest = tmp_path / "results"
    assert rt.main([str(rdir), "--dest", str(dest)]) == 0
    assert "trace: written" in capsys.readouterr().out
    assert "(from ../runs/r1)" in (dest / "trace.md").read_text()


def test_run_all_takes_a_tables_option():
    import inspect

    assert "--tables" in inspect.getsource(run_all.main)
    assert run_all.main(["--out", "/nonexistent", "--dry-run", "--only", "rmm"]) == 0


def test_each_table_names_the_part_run_that_measured_it(tmp_path, capsys):
    """A run in parts (--only, merged into one results.json): a table's date and command are
    those of the part that ran its sections, not the last part's; --source says where the
    run's files are kept."""
    res = run()
    res["meta"]["parts"] = [
        {"date": "2026-12-03T10:00:00+00:00", "command": "run_all.py --only trace",
         "only": "trace", "quick": False},
        {"date": "2026-12-03T11:00:00+00:00", "command": "run_all.py --only capacity,wait",
         "only": "capacity,wait", "quick": False},
    ]  # fmt: skip
    res["meta"]["date"], res["meta"]["command"] = "2026-12-03T11:00:00+00:00", "last part"
    rt.write_tables(res, str(tmp_path), "r")
    trace = (tmp_path / "trace.md").read_text()
    assert "- run: 2026-12-03T10:00:00+00:00," in trace
    assert "- command: `run_all.py --only trace`" in trace
    assert "- command: `run_all.py --only capacity,wait`" in (tmp_path / "wait.md").read_text()
    # two parts measured the trace: both named, the first one's date
    res["meta"]["parts"].append(
        {"date": "2026-12-03T12:00:00+00:00", "command": "again", "only": "trace,rmm"}
    )
    rt.write_tables(res, str(tmp_path), "r")
    trace = (tmp_path / "trace.md").read_text()
    assert "- run: 2026-12-03T10:00:00+00:00," in trace
    assert "- command: `run_all.py --only trace`; `again`" in trace
    # a benchmark no part names (share, rmm here): the run's own meta
    assert "- command: `last part`" in (tmp_path / "share.md").read_text()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "results.json").write_text(json.dumps(res))
    where = "git show abc1234:benchmarks/results/F/results.json"
    assert rt.main([str(run_dir), "--dest", str(tmp_path / "t"), "--source", where]) == 0
    assert f"(from {where})" in (tmp_path / "t" / "trace.md").read_text()
