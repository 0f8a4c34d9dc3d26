# SPDX-License-Identifier: Apache-2.0
"""scripts/gpu-test on a machine without a GPU: it says loudly that no GPU test ran."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[2]


def run_script(out, timeout=300, **variables):
    """scripts/gpu-test OUT as on a machine without a GPU (no driver), on the bridge
    installed already, with BRIDGE_GPU_TEST_<NAME> set from ``variables``."""
    env = dict(os.environ)
    env["BRIDGE_CUDA_LIBRARY"] = "/nonexistent/libcuda.so.1"  # no driver, as without a GPU
    env["BRIDGE_GPU_TEST_SKIP_BUILD"] = "1"  # the bridge under test is installed already
    env.update({f"BRIDGE_GPU_TEST_{k.upper()}": v for k, v in variables.items()})
    return subprocess.run(
        [str(REPO / "scripts" / "gpu-test"), str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_no_gpu_test_ran_is_said_and_fails(tmp_path):
    r = run_script(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "gpu-test: NO GPU TEST RAN: every test was skipped. This is not a pass." in r.stdout
    assert "skipped because: no usable CUDA driver" in r.stdout
    summary = (tmp_path / "summary.txt").read_text()
    assert "gpu: 0 passed, 0 failed" in summary and "NO GPU TEST RAN" in summary
    # every file with gpu tests was run in its own process
    assert "test_gpu_pinned " in summary and "test_gpu_core " in summary


def test_the_script_documents_its_exit_status():
    head = (REPO / "scripts" / "gpu-test").read_text().split("set -uo pipefail")[0]
    assert "Exit status:" in head and "NO GPU TEST RAN" in head


def test_a_deadline_starts_no_file_after_it_and_says_which(tmp_path):
    """BRIDGE_GPU_TEST_DEADLINE: a run that a machine's time limit would cut keeps its
    summary; the files it did not start are listed, and the run does not pass."""
    files = "tests/gpu/test_gpu_core.py tests/gpu/test_gpu_pinned.py"
    r = run_script(tmp_path, timeout=120, deadline="0", files=files)
    assert r.returncode == 1, r.stdout + r.stderr
    summary = (tmp_path / "summary.txt").read_text()
    for name in ("test_gpu_core", "test_gpu_pinned"):
        assert f"{name}" in summary and "not run (BRIDGE_GPU_TEST_DEADLINE=0 s)" in summary
    assert "gpu: 0 passed, 0 failed" in summary
    assert "passed in" not in (tmp_path / "gpu-test.log").read_text()  # nothing started


def test_jobs_run_every_file_once_and_keep_the_alone_ones_apart(tmp_path):
    """BRIDGE_GPU_TEST_JOBS=3: every file runs once, in its own process, and its log goes
    into gpu-test.log whole; a file marked "# gpu-test: alone" is still run."""
    names = ["test_gpu_core", "test_gpu_pinned", "test_gpu_graphs", "test_gpu_views"]
    assert "# gpu-test: alone" in (REPO / "tests/gpu/test_gpu_views.py").read_text()
    files = " ".join(f"tests/gpu/{n}.py" for n in names)
    r = run_script(tmp_path, jobs="3", files=files)
    assert r.returncode == 1, r.stdout + r.stderr  # no GPU: nothing ran, which is no pass
    summary = (tmp_path / "summary.txt").read_text()
    log = (tmp_path / "gpu-test.log").read_text()
    for n in names:
        assert summary.count(f"{n} ") == 1, summary
        assert log.count(f"===== {n} (rc=") == 1, log
    # each file's log is whole: its header, then its own pytest run to its last line
    blocks = re.split(r"^===== (test_\w+) \(rc=\d+\)$", log, flags=re.M)[1:]
    assert sorted(blocks[0::2]) == sorted(names)
    for body in blocks[1::2]:
        last = body.strip().splitlines()[-1]
        assert re.search(r"\d+ (skipped|deselected)|no tests ran", last), body
    order = [line.split()[0] for line in summary.splitlines() if line.startswith("test_")]
    assert order[-1] == "test_gpu_views"  # the alone file after those that share the GPU
    assert "gpu: 0 passed, 0 failed" in summary
    assert not (tmp_path / ".failed").exists() and not (tmp_path / ".lock").exists()
