# SPDX-License-Identifier: Apache-2.0
"""Without a GPU, every example says so in one clear line (no traceback)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.py")), ids=lambda p: p.name)
def test_without_a_gpu_an_example_says_so_in_one_line(path, tmp_path):
    env = dict(os.environ, BRIDGE_CUDA_LIBRARY=str(tmp_path / "no-libcuda.so.1"))
    args = [sys.executable, str(path)] + ([str(tmp_path)] if path.stem == "mixed_pipeline" else [])
    r = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{path.name}: "), r.stderr
    assert "no usable CUDA driver" in lines[0], lines[0]
