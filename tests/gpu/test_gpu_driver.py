# SPDX-License-Identifier: Apache-2.0
"""Loading the real driver: what a process that sees no GPU is told. (Run by scripts/gpu-test.)

The CPU half (tests/core/test_driver.py) makes the stand-in's cuInit answer
CUDA_ERROR_NO_DEVICE; this checks that the real driver answers so when
CUDA_VISIBLE_DEVICES hides every GPU (the native half, with cuda.bindings), and what the
bridge then says.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu


def _hidden(code: str, visible: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.mark.parametrize("visible", ["", "-1"])
def test_native_cuinit_answers_no_device_when_every_gpu_is_hidden(visible):
    r = _hidden(
        """
        from cuda.bindings import driver as cu
        (err,) = cu.cuInit(0)
        print(err.name)
        """,
        visible,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "CUDA_ERROR_NO_DEVICE", r.stdout


@pytest.mark.parametrize("visible", ["", "-1"])
def test_unify_names_cuda_visible_devices_when_every_gpu_is_hidden(visible):
    r = _hidden(
        """
        import bridge
        try:
            bridge.unify(cupy=False, torch=False)
        except bridge.BridgeError as e:
            print(e)
        else:
            print("started")
        """,
        visible,
    )
    assert r.returncode == 0, r.stderr
    assert "CUDA_ERROR_NO_DEVICE (code 100)" in r.stdout, r.stdout
    assert f'CUDA_VISIBLE_DEVICES="{visible}" leaves no GPU visible' in r.stdout, r.stdout
