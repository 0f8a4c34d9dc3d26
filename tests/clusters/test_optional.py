# SPDX-License-Identifier: Apache-2.0
"""The cluster plugins are optional extras: `import bridge` imports neither Dask nor Ray,
and a missing one is an ImportError that says what to install."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_bridge_imports_neither_dask_nor_ray():
    r = _run(
        "import sys, bridge\n"
        "print(sorted(m for m in ('dask', 'distributed', 'ray') if m in sys.modules))\n"
        "print('dask' in dir(bridge), 'ray' in dir(bridge))"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["[]", "True True"]


@pytest.mark.parametrize(
    "module, needs, install",
    [
        ("dask", "distributed", "pip install 'distributed>=2024.1'"),
        ("ray", "ray", "pip install 'ray>=2.9'"),
    ],
)
def test_a_missing_extra_is_an_import_error_that_says_what_to_install(module, needs, install):
    # sys.modules[name] = None: the import fails as where the package is not installed
    r = _run(
        f"import sys; sys.modules[{needs!r}] = None\n"
        "import bridge\n"
        "try:\n"
        f"    bridge.{module}\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    assert r.returncode == 0, r.stderr
    assert f"bridge.{module} needs" in r.stdout and install in r.stdout, r.stdout
    assert f"pip install -e '.[{module}]'" in r.stdout
