# SPDX-License-Identifier: Apache-2.0
"""A checkout folder named bridge in the working directory: the package still imports, or the
import says in words what happened (never an empty namespace package)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

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
