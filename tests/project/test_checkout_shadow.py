# SPDX-License-Identifier: Apache-2.0
"""A checkout folder named bridge in the working directory: the package still imports, or the
import says in words what happened (never an empty namespace package)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _checkout_next_to_the_working_directory(tmp_path: pathlib.Path) -> pathlib.Path:
    folder = tmp_path / "bridge"  # as `git clone .../bridge` makes it
    folder.mkdir()
    shutil.copy(REPO / "__init__.py", folder / "__init__.py")
    (folder / "README.md").write_text("a checkout\n")
    return folder


def test_with_the_package_installed_a_checkout_folder_does_not_shadow_it(tmp_path):
    _checkout_next_to_the_working_directory(tmp_path)
    r = subprocess.run(
        [sys.executable, "-c", "import bridge; print(bridge.__file__, callable(bridge.unify))"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    where, ok = r.stdout.split()
    assert ok == "True" and not where.startswith(str(tmp_path))


def test_without_the_package_the_import_says_what_happened(tmp_path):
    folder = _checkout_next_to_the_working_directory(tmp_path)
    r = subprocess.run(  # -S: no site-packages, so no installed bridge
        [sys.executable, "-S", "-c", "import bridge"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: 'import bridge' found ")
    assert str(folder) in last and "the top folder of a checkout of bridge" in last
    assert "pip install -e" in last


@pytest.mark.skipif(not hasattr(pytest, "Dir"), reason="pytest 7 collects no folder as a plain one")
def test_the_tests_do_not_put_the_folder_above_the_checkout_on_sys_path():
    """pytest collects the checkout's top folder as a plain folder (tests/conftest.py): were it
    collected as the package its __init__.py makes it, pytest would import that file and put
    the folder above the checkout first on sys.path, where the checkout's siblings shadow
    installed modules in every test and in the processes the tests start."""
    top_init = REPO / "__init__.py"
    imported = [
        name
        for name, module in list(sys.modules.items())
        if getattr(module, "__file__", None) and pathlib.Path(module.__file__) == top_init
    ]
    assert imported == []
    above = REPO.parent
    if pathlib.Path.cwd().resolve() != above:  # run from there, the folder is on it anyway
        assert [p for p in sys.path if pathlib.Path(p or ".").resolve() == above] == []
