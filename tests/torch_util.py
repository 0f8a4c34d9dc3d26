# SPDX-License-Identifier: Apache-2.0
"""The C++ torch allocator's stand-in scenarios: a fresh process, its last RESULT line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest


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
