# SPDX-License-Identifier: Apache-2.0
"""The C++ torch allocator's stand-in scenarios: a fresh process, its last RESULT line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

#: The start of a stand-in scenario of the C++ allocator: the device set up, the allocator
#: built against the installed torch (or the scenario skips) and installed; ``out`` the dict
#: the scenario fills and prints as ``RESULT <json>``.
SCENARIO_START = r"""
import ctypes, json, os, threading, time, torch
import bridge
from bridge import _runtime
from bridge._runtime import core
from bridge.adapters import torch_build
out = {}
_runtime.ensure_device(0)
missing = torch_build.missing_tools()
if missing:
    print("RESULT " + json.dumps({"skip": missing})); raise SystemExit
mod = torch_build.load()
assert mod is not None, torch_build.reason
mod.install(core.__file__)
"""


def run_scenario(scenario: str, cache_dir: str, **env: str) -> dict:
    """Run ``scenario`` (Python text printing ``RESULT <json>`` lines) in a fresh process on
    the stand-in, with the build cache ``cache_dir`` unless BRIDGE_CACHE_DIR is set; its
    last RESULT as a dict. Skips on a GPU run, and where the scenario found the build's tools
    missing (it prints ``{"skip": why}``)."""
    if os.environ.get("BRIDGE_TEST_GPU") == "1":
        pytest.skip("stand-in test; this is a GPU run")
    e = dict(os.environ)
    e.setdefault("BRIDGE_CACHE_DIR", cache_dir)
    e.pop("BRIDGE_TORCH_PLUGGABLE", None)
    e.update(env)
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(scenario)],
        capture_output=True,
        text=True,
        timeout=600,
        env=e,
    )
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-3000:] + r.stderr[-6000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    if "skip" in out:
        pytest.skip(f"the C++ torch allocator's build needs what is missing: {out['skip']}")
    return out


def cuda_torch():
    """torch where it is a CUDA build (the C++ allocator is compiled against torch's CUDA
    headers and symbols); else the calling test module is skipped with the reason."""
    torch = pytest.importorskip("torch")
    if torch.version.cuda is None:
        pytest.skip(
            f"torch {torch.__version__} is built without CUDA: the bridge's torch allocator "
            "needs a CUDA torch (bridge.unify() leaves this one alone: "
            "tests/adapters/test_cpu_only.py)",
            allow_module_level=True,
        )
    return torch
