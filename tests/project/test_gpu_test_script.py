# SPDX-License-Identifier: Apache-2.0
"""scripts/gpu-test on a machine without a GPU: it says loudly that no GPU test ran."""

from __future__ import annotations

import os
import pathlib
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_no_gpu_test_ran_is_said_and_fails(tmp_path):
    env = dict(os.environ)
    env["BRIDGE_CUDA_LIBRARY"] = "/nonexistent/libcuda.so.1"  # no driver, as without a GPU
    env["BRIDGE_GPU_TEST_SKIP_BUILD"] = "1"  # the bridge under test is installed already
    r = subprocess.run(
        [str(REPO / "scripts" / "gpu-test"), str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
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
    env = dict(os.environ)
    env["BRIDGE_CUDA_LIBRARY"] = "/nonexistent/libcuda.so.1"
    env["BRIDGE_GPU_TEST_SKIP_BUILD"] = "1"
    env["BRIDGE_GPU_TEST_DEADLINE"] = "0"
    env["BRIDGE_GPU_TEST_FILES"] = "tests/gpu/test_gpu_core.py tests/gpu/test_gpu_pinned.py"
    r = subprocess.run(
        [str(REPO / "scripts" / "gpu-test"), str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    summary = (tmp_path / "summary.txt").read_text()
    for name in ("test_gpu_core", "test_gpu_pinned"):
        assert f"{name}" in summary and "not run (BRIDGE_GPU_TEST_DEADLINE=0 s)" in summary
    assert "gpu: 0 passed, 0 failed" in summary
    assert "passed in" not in (tmp_path / "gpu-test.log").read_text()  # nothing started
