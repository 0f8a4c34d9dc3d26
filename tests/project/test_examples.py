# SPDX-License-Identifier: Apache-2.0
# gpu-test: alone (the examples size their work by the device)
"""The examples run as written on a GPU machine (gpu tests)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


NEEDS = {  # the optional libraries an example needs beyond CuPy, torch and JAX
    "lightning_fit": ("cupy", "torch", "lightning"),
    "hf_trainer": ("cupy", "torch", "transformers", "accelerate", "sentence_transformers"),
    "numba_kernels": ("numba.cuda",),
    "rmm_buffers": ("rmm",),
}


@pytest.mark.parametrize(
    "name",
    ["mixed_pipeline", "jax_torch_cupy", "pinned_staging", "oom_handled"] + list(NEEDS),
)
def test_example_runs(name, tmp_path):
    for module in NEEDS.get(name, ()):
        pytest.importorskip(module)
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
    if name == "lightning_fit":  # both searches: the batch found fits, twice it does not
        found = [ln for ln in r.stdout.splitlines() if "fits the budget" in ln]
        assert len(found) == 2 and all(ln.endswith(": False") for ln in found), found
        assert all("fits the budget: True;" in ln for ln in found), found
    if name == "hf_trainer":
        assert "trained at" in r.stdout and "encoded 256 sentences to 128 dims" in r.stdout
