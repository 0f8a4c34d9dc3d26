# SPDX-License-Identifier: Apache-2.0
"""The one table of environment variables (bridge._env): doctor and the library agree."""

from __future__ import annotations

import pathlib
import re

import pytest

from bridge import _env
from bridge.tools import doctor as _doctor

REPO = pathlib.Path(__file__).resolve().parents[2]

# a value each reader refuses, and one it takes
BAD = {
    "BRIDGE_GPU_MEMORY_LIMIT": "abc",
    "BRIDGE_CACHE_LIMIT": "150%",
    "BRIDGE_CACHE_FRACTION": "lots",
    "BRIDGE_CACHE_FLOOR": "-1",
    "BRIDGE_CACHE_SMALL_MAX": "1XB",
    "BRIDGE_CACHE_LARGE_CAP": "abc",
    "BRIDGE_CACHE_LARGE_FRACTION": "-1",
    "BRIDGE_CACHE_CARVE": "maybe",
    "BRIDGE_IPC": "maybe",
    "BRIDGE_CACHE_SEGMENTS": "perhaps",
    "BRIDGE_CACHE_THREAD_SLOT": "sometimes",
    "BRIDGE_PINNED_MEMORY_LIMIT": "lots",
    "BRIDGE_PINNED_BACKEND": "fast",
    "BRIDGE_WAIT": "abc",
    "BRIDGE_SHARE": "x" * 64,
    "BRIDGE_SHARE_DIR": "/nonexistent/bridge-shares",
    "BRIDGE_SHARE_GROWTH": "3MiB",
    "BRIDGE_TORCH_PLUGGABLE": "maybe",
    "BRIDGE_RMM_CALLBACK": "yes",
    "BRIDGE_CUPY_UNOWNED": "on",
}
GOOD = {
    "BRIDGE_GPU_MEMORY_LIMIT": "25%",
    "BRIDGE_CACHE_LIMIT": "1GiB",
    "BRIDGE_CACHE_FRACTION": "0.125",
    "BRIDGE_CACHE_FLOOR": "64MiB",
    "BRIDGE_CACHE_SMALL_MAX": "1MiB",
    "BRIDGE_CACHE_LARGE_CAP": "64MiB",
    "BRIDGE_CACHE_LARGE_FRACTION": "12.5%",
    "BRIDGE_CACHE_CARVE": "1",
    "BRIDGE_IPC": "1",
    "BRIDGE_CACHE_SEGMENTS": "1",
    "BRIDGE_CACHE_THREAD_SLOT": "0",
    "BRIDGE_PINNED_MEMORY_LIMIT": "1GiB",
    "BRIDGE_PINNED_BACKEND": "cached",
    "BRIDGE_WAIT": "2.5",
    "BRIDGE_SHARE": "workers",
    "BRIDGE_SHARE_DIR": "/tmp",
    "BRIDGE_SHARE_GROWTH": "4MiB",
    "BRIDGE_CUDA_LIBRARY": "libcuda.so.1",
    "BRIDGE_TORCH_PLUGGABLE": "1",
    "BRIDGE_RMM_CALLBACK": "1",
    "BRIDGE_CUPY_UNOWNED": "1",
    "BRIDGE_CACHE_DIR": "/tmp/bridge-cache",
}
FREE_FORM = {"BRIDGE_CUDA_LIBRARY", "BRIDGE_CACHE_DIR"}  # paths: any value is read as it is


def test_the_table_is_every_variable_the_library_reads():
    py = "".join(p.read_text() for p in (REPO / "bridge").rglob("*.py"))
    py += "".join(p.read_text() for p in (REPO / "adapters").rglob("*.py"))
    c = "".join(p.read_text() for p in (REPO / "bridge" / "_native").glob("*.[ch]*"))
    read = set(re.findall(r'_ENV = "(BRIDGE_[A-Z_]+)"', py))
    read |= set(re.findall(r'getenv\("(BRIDGE_[A-Z_]+)"', c))
    read |= set(re.findall(r'environ(?:\.get)?\(\s*"(BRIDGE_[A-Z_]+)"', py))
    assert read == set(_env.NAMES)
    assert _doctor.BRIDGE_ENV == _env.NAMES  # doctor's list is the table
    assert set(BAD) | FREE_FORM == set(_env.NAMES) == set(GOOD)


@pytest.mark.parametrize("name", sorted(BAD))
def test_what_the_library_refuses_doctor_refuses_naming_it_once(name, standin, monkeypatch):
    monkeypatch.setenv(name, BAD[name])
    var = _env.variable(name)
    with pytest.raises(ValueError, match=name):
        var.read(_env.Totals(device=16 << 30, host=64 << 30, devices=(16 << 30,)))
    (finding,) = [f for f in _doctor.collect().environment if f.subject.startswith(name + "=")]
    assert finding.level == "error"
    assert finding.subject == f"{name}={BAD[name]}"
    assert name not in finding.text  # the subject names it; the words do not repeat it
    assert finding.text.endswith("fix or unset it.")


@pytest.mark.parametrize("name", sorted(GOOD))
def test_what_the_library_takes_doctor_takes(name, standin, monkeypatch):
    monkeypatch.setenv(name, GOOD[name])
    var = _env.variable(name)
    var.read(_env.Totals(device=16 << 30, host=64 << 30, devices=(16 << 30,)))
    if name == "BRIDGE_CUDA_LIBRARY":
        return  # the stand-in's own path is the one in use here
    (finding,) = [f for f in _doctor.collect().environment if f.subject.startswith(name + "=")]
    assert finding.level in ("ok", "info"), finding


def test_bridge_wait_is_checked_by_doctor_as_unify_reads_it(standin, monkeypatch):
    monkeypatch.setenv("BRIDGE_WAIT", "abc")
    report = _doctor.collect()
    assert report.exit_status == 1
    (f,) = [f for f in report.errors if f.subject == "BRIDGE_WAIT=abc"]
    assert "number of seconds" in f.text


@pytest.mark.parametrize("name", ["BRIDGE_SHARE", "BRIDGE_GPU_MEMORY_LIMIT", "BRIDGE_WAIT"])
def test_a_blank_variable_is_unset_for_the_library_and_doctor(name, standin, monkeypatch):
    monkeypatch.setenv(name, "   ")
    assert _env.variable(name).read(_env.Totals(device=16 << 30)) is None
    assert not [f for f in _doctor.collect().environment if f.subject.startswith(name + "=")]


@pytest.mark.parametrize("raw, kept", [("", None), ("   ", None), ("512MiB", 512 << 20)])
def test_a_blank_cache_limit_bounds_no_empty_segments(raw, kept, standin, monkeypatch):
    """BRIDGE_CACHE_LIMIT set bounds the empty segments kept; a blank one is unset, as for
    every variable (a value of spaces bounded them at the default cache size)."""
    from bridge import _runtime

    bounds = []
    monkeypatch.setattr(
        _runtime.core, "set_cache_segments_keep", lambda d, keep: bounds.append(keep) or 0
    )
    monkeypatch.setenv("BRIDGE_CACHE_LIMIT", raw)
    monkeypatch.delenv("BRIDGE_CACHE_SEGMENTS", raising=False)
    monkeypatch.delenv("BRIDGE_CACHE_CARVE", raising=False)
    _runtime.reset_process_state()  # device 0 is set up again from the environment
    _runtime.ensure_device(0)
    assert bounds == ([] if kept is None else [kept])
