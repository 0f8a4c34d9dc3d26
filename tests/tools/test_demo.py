# SPDX-License-Identifier: Apache-2.0
"""bridge demo (bridge.tools.demo): arguments, no-GPU handling and the report, without a GPU.

The runs themselves need a GPU, CuPy and torch: tests/gpu/test_gpu_demo.py. Here
the children are stand-ins that return made-up figures.
"""

from __future__ import annotations

import csv
import io
import os
import pathlib
import subprocess
import sys
import time

import pytest

from bridge.tools import cli, demo
from bridge.tools.cli import main

REPO = pathlib.Path(__file__).resolve().parents[2]
GIB = 1 << 30


def run_main(*argv: str, child=None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    if child is None:
        rc = main(list(argv), stdout=out, stderr=err)
    else:
        real = demo.run
        try:
            demo.run = lambda args, o, e: real(args, o, e, child=child)  # type: ignore[assignment]
            rc = main(list(argv), stdout=out, stderr=err)
        finally:
            demo.run = real  # type: ignore[assignment]
    return rc, out.getvalue(), err.getvalue()


def never(mode, size, interval):
    raise AssertionError("no run should start")


def fake_result(mode: str, size: int, *, ok: bool, total: int = 16 * GIB) -> demo.RunResult:
    ctx = GIB // 2
    held = size if mode == "native" else 0
    end = ctx + size  # native: CuPy's pool still holds N; bridge: torch now holds it
    samples = [
        [0.0, ctx, 0, 0, 0],
        [0.5, ctx + size, size, 0, 0],
        [1.0, ctx + size, held, 0, 0 if mode == "native" else size],
        [1.5, end, held, size if ok else 0, 0],
    ]
    return demo.RunResult(
        mode=mode,
        ok=ok,
        error="" if ok else "CUDA out of memory. Tried to allocate 9.60 GiB",
        size=size,
        total=total,
        used_at_ask=ctx + size,
        used_at_end=end,
        peak_used=end,
        cupy_after_free=held,
        seconds=1.5,
        samples=samples,
        marks=[[0.0, "start"], [0.5, "CuPy holds"], [1.0, "CuPy frees it"], [1.5, "torch"]],
    )


def fake_child(outcomes: dict, seen: list | None = None):
    def child(mode, size, interval):
        if seen is not None:
            seen.append((mode, size, interval))
        return fake_result(mode, size, ok=outcomes[mode])

    return child


@pytest.mark.parametrize(
    "argv",
    [
        ["--size", "0"],
        ["--size", "-2"],
        ["--size", "abc"],
        ["--size", "nan"],
        ["--interval", "0"],
        ["--interval", "5"],
        ["--bogus"],
    ],
)
def test_bad_arguments_are_a_usage_error_and_nothing_runs(argv, standin, capsys):
    rc, _, _ = run_main("demo", *argv, child=never)
    assert rc == 2
    err = capsys.readouterr().err  # argparse writes to sys.stderr
    assert "usage:" in err and ("--bogus" in err or "bridge demo" in err)


def test_help_names_the_options_and_the_exit_status(standin, capsys):
    rc, _, _ = run_main("demo", "--help", child=never)
    assert rc == 0
    out = capsys.readouterr().out
    for word in ("--size SIZE", "--out PNG", "--interval", "60% of the GPU", "Exits 0"):
        assert word in " ".join(out.split()), word


def test_without_a_driver_it_says_so_and_exits_1():
    env = dict(os.environ, BRIDGE_CUDA_LIBRARY="/nonexistent")
    r = subprocess.run(
        [sys.executable, "-m", "bridge", "demo"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    assert "Traceback" not in r.stdout + r.stderr
    assert r.stderr.startswith("bridge demo: no usable GPU here")
    assert "/nonexistent" in r.stderr and "nvidia-smi" in r.stderr
    assert r.stdout == ""


def test_a_size_the_gpu_cannot_hold_is_refused_before_any_run(standin):
    rc, out, err = run_main("demo", "--size", "15", child=never)  # the stand-in has 16 GiB
    assert rc == 1 and out == ""
    assert "--size 15 is 15.0 GiB, more than 90% of this GPU's 16.0 GiB" in err
    assert "Pass --size 14.4 or less" in err


@pytest.mark.parametrize(
    "text, gib", [("40GiB", 40.0), ("512MiB", 0.5), ("40", 40.0), ("0.5", 0.5), ("8 GiB", 8.0)]
)
def test_size_takes_units_as_everywhere_and_a_bare_number_is_gib(text, gib):
    ns = cli._parser("bridge").parse_args(["demo", "--size", text])
    assert ns.size == gib


@pytest.mark.parametrize("text", ["40Gbits", "50%", "0GiB"])
def test_a_size_that_is_no_size_is_refused_with_the_forms_it_takes(text, capsys):
    with pytest.raises(SystemExit) as exc:
        cli._parser("bridge").parse_args(["demo", "--size", text])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert repr(text) in err


def test_a_size_with_a_unit_too_large_for_the_gpu_is_refused_before_any_run(standin):
    rc, out, err = run_main("demo", "--size", "15GiB", child=never)
    assert rc == 1 and "more than 90% of this GPU's 16.0 GiB" in err


def test_missing_frameworks_are_named(standin, monkeypatch):
    monkeypatch.setattr(demo, "_missing_frameworks", lambda: ["cupy", "torch"])
    rc, out, err = run_main("demo", "--size", "1")
    assert rc == 1 and out == ""
    assert "needs CuPy and PyTorch; cupy and torch are not installed" in err


def test_default_size_is_60_percent_of_the_gpu_and_native_runs_first(standin, tmp_path):
    seen: list = []
    child = fake_child({"native": False, "bridge": True}, seen)
    rc, out, err = run_main("demo", "--out", str(tmp_path / "d.png"), child=child)
    assert rc == 0, err
    assert [m for m, _, _ in seen] == ["native", "bridge"]
    assert {s for _, s, _ in seen} == {int(16 * GIB * 0.6)}
    assert {i for _, _, i in seen} == {0.02}


@pytest.mark.parametrize("matplotlib", ["installed", "missing"])
def test_the_report_puts_both_outcomes_side_by_side(standin, tmp_path, monkeypatch, matplotlib):
    if matplotlib == "installed":
        pytest.importorskip("matplotlib")
    else:
        for name in ("matplotlib", "matplotlib.backends.backend_agg", "matplotlib.figure"):
            monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    child = fake_child({"native": False, "bridge": True})
    png = tmp_path / "demo.png"
    rc, out, err = run_main("demo", "--size", "8", "--out", str(png), child=child)
    assert rc == 0, err
    lines = out.splitlines()
    header = next(ln for ln in lines if ln.strip().startswith("native allocators"))
    assert header.index("native allocators") < header.index("bridge (one pool)")
    asks = next(ln for ln in lines if ln.startswith("torch asks for 8.0 GiB"))
    assert asks.split()[5:] == ["out", "of", "memory", "done"]
    held = next(ln for ln in lines if ln.startswith("CuPy held after its free"))
    assert held.split()[-4:] == ["8.0", "GiB", "0.0", "GiB"]
    assert "native runs out at 8.5 GiB in use: torch could not get 8.0 GiB" in out
    assert "while CuPy held 8.0 GiB it had freed (CUDA out of memory." in out
    assert "the bridge finishes at 8.5 GiB in use: torch got its 8.0 GiB." in out
    table = png.with_suffix(".csv")
    with table.open() as fh:
        rows = list(csv.DictReader(fh))
    assert {r["mode"] for r in rows} == {"native", "bridge"}
    assert len([r for r in rows if r["label"] == ""]) == 8  # 4 samples per run
    assert [r["label"] for r in rows if r["mode"] == "bridge" and r["label"]][1] == "CuPy holds"
    if matplotlib == "missing":
        assert "no PNG: the demo's PNG needs matplotlib" in out and str(table) in out
        assert "pip install 'gpumem-bridge[plot]'" in out
        assert not png.exists()
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"timelines: {png} (samples: {table})" in out


def test_exit_status_1_when_the_bridge_run_fails_or_crashes(standin, tmp_path):
    out_png = str(tmp_path / "d.png")
    rc, out, _ = run_main(
        "demo", "--size", "4", "--out", out_png, child=fake_child({"native": True, "bridge": False})
    )
    assert rc == 1
    assert "the bridge runs out at" in out

    def crashing(mode, size, interval):
        if mode == "bridge":
            return demo.RunResult(mode, failed=True, size=size, error="exit status 1: boom")
        return fake_result(mode, size, ok=True)

    rc, out, _ = run_main("demo", "--size", "4", "--out", out_png, child=crashing)
    assert rc == 1
    assert "the bridge: the run failed: exit status 1: boom" in out
    assert "native finishes at 4.5 GiB in use" in out


def test_an_out_folder_that_does_not_exist_is_refused(standin, tmp_path):
    rc, out, err = run_main("demo", "--size", "1", "--out", str(tmp_path / "no" / "d.png"),
                            child=never)  # fmt: skip
    assert rc == 1 and "does not exist" in err


def test_a_child_that_cannot_run_is_reported_not_raised():
    # the real child needs CuPy: without it, it fails at its import
    if "cupy" in sys.modules or demo.importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed: the child would really run")
    r = demo._run_child("native", GIB, 0.02)
    assert r.failed and r.mode == "native" and not r.ok
    assert r.error.startswith("exit status 1: ") and "cupy" in r.error


def test_the_module_alone_points_at_the_command():
    r = subprocess.run(
        [sys.executable, "-m", "bridge.tools.demo"], cwd=REPO, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert r.returncode == 1 and "python -m bridge demo" in r.stderr


def test_the_sampler_reads_in_a_thread_and_marks_in_order():
    calls = []

    def read():
        calls.append(1)
        return len(calls) * GIB, 1, 2, 3

    with demo._Sampler(read, 0.005) as rec:
        used = rec.mark("first")
        time.sleep(0.1)
        rec.mark("second")
    assert used >= GIB
    assert [m[1] for m in rec.marks] == ["first", "second"]
    times = [s[0] for s in rec.samples]
    assert times == sorted(times) and len(rec.samples) >= 5  # the thread sampled meanwhile
    assert all(s[2:] == [1, 2, 3] for s in rec.samples)
    assert not rec._thread.is_alive()
    n = len(rec.samples)
    time.sleep(0.03)
    assert len(rec.samples) == n  # nothing after the end


def test_a_child_with_an_unknown_mode_says_so():
    r = subprocess.run(
        [sys.executable, "-m", "bridge.tools.demo", "--child", "fast", "1", "0.02"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "mode 'fast' is not one of" in r.stderr


def test_the_runs_have_no_budget_even_with_the_variable_set(standin, tmp_path, monkeypatch):
    monkeypatch.setenv("BRIDGE_GPU_MEMORY_LIMIT", "50%")
    child = fake_child({"native": False, "bridge": True})
    rc, out, _ = run_main("demo", "--size", "2", "--out", str(tmp_path / "d.png"), child=child)
    assert rc == 0
    assert "BRIDGE_GPU_MEMORY_LIMIT is left out of both runs" in out
    seen = {}

    def fake_run(cmd, **kw):
        seen.update(kw["env"], cmd=cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "boom")

    monkeypatch.setattr(demo.subprocess, "run", fake_run)
    r = demo._run_child("bridge", GIB, 0.02)
    assert r.failed and r.error == "exit status 1: boom"
    assert "BRIDGE_GPU_MEMORY_LIMIT" not in seen
    assert seen["cmd"][1:] == ["-m", "bridge.tools.demo", "--child", "bridge", str(GIB), "0.02"]
