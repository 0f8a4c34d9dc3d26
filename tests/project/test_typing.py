# SPDX-License-Identifier: Apache-2.0
"""What a user's type checker sees of the installed package, and what dir(bridge) lists."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

import bridge

USER_SCRIPT = """
import numpy
import bridge

b: bridge.Bridge = bridge.unify(budget="80%")
a = bridge.empty_pinned((4, 4), dtype=numpy.float32)
reveal_type(a)
e = bridge.empty_like_pinned(a)
z = bridge.zeros_like_pinned(a, order="F")
p: bridge.PinnedPool = bridge.pinned_pool()
with bridge.record(interval=0.1) as rec:
    pass
reveal_type(rec)
bridge.dump_snapshot("x.pickle")
free, total = bridge.mem_get_info()
n: int = bridge.pool().n_free_blocks()
"""
TYPO = "import bridge\nbridge.empty_pinnedd((4,))\n"


def _mypy(tmp_path, text: str) -> subprocess.CompletedProcess:
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent(text))
    # run where the checkout is not the working directory: the installed package is found
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--strict-optional", str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )


@pytest.fixture
def mypy_here():
    pytest.importorskip("mypy")
    if shutil.which("gcc") is None:  # pragma: no cover - the package itself needs it
        pytest.skip("no compiler")


def test_a_users_script_type_checks_against_the_installed_package(mypy_here, tmp_path):
    r = _mypy(tmp_path, USER_SCRIPT)
    out = r.stdout + r.stderr
    assert "Cannot find implementation or library stub" not in out, out
    assert r.returncode == 0, out
    assert 'Revealed type is "numpy.ndarray' in out  # not Any: the lazy names are typed
    assert 'Revealed type is "bridge.timeline.Recording"' in out


def test_a_typo_in_a_lazily_loaded_name_is_an_error(mypy_here, tmp_path):
    r = _mypy(tmp_path, TYPO)
    assert r.returncode == 1
    assert 'Module has no attribute "empty_pinnedd"' in r.stdout, r.stdout


def test_dir_lists_the_public_names_lazy_ones_included_and_no_helpers():
    names = dir(bridge)
    for name in bridge.__all__:
        assert name in names, name
        assert getattr(bridge, name) is not None
    for helper in ("Any", "annotations", "TYPE_CHECKING", "importlib"):
        assert helper not in names, helper
    assert {"empty_like_pinned", "zeros_like_pinned", "record", "dump_snapshot"} <= set(names)
