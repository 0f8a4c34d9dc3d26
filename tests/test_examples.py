# SPDX-License-Identifier: Apache-2.0
"""The examples run as written on a GPU machine (gpu tests)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu
EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize(
    "name",
    [
        "mixed_pipeline",
        "jax_torch_cupy",
        "pinned_staging",
        "oom_handled",
        "numba_kernels",
        "rmm_buffers",
    ],
)
def test_example_runs(name, tmp_path):
    needs = {"numba_kernels": "numba.cuda", "rmm_buffers": "rmm"}
    if name in needs:
        pytest.importorskip(needs[name])
    args = [sys.executable, str(EXAMPLES / f"{name}.py")]
    if name == "mixed_pipeline":
        args.append(str(tmp_path))
    r = subprocess.run(args, capture_output=True, text=True, timeout=400)
    print(r.stdout)
    assert r.returncode == 0, r.stderr[-3000:]
    if name == "mixed_pipeline":
        assert (tmp_path / "mixed_pipeline.csv").stat().st_size > 0
    if name in ("oom_handled", "numba_kernels", "rmm_buffers"):
        assert "ok" in r.stdout
