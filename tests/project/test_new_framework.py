# SPDX-License-Identifier: Apache-2.0
"""A framework added as docs/adding-a-framework.md says: one row in bridge/frameworks.py and
one adapter module, nothing else.

A child process reads bridge/frameworks.py with one more row at the end of ``REGISTRY`` (as
a contributor would write it, compiled from the file's own text) and finds the row's adapter
and the framework itself in a temporary folder. Everything else is the checkout as it is:
unify() takes the framework's keyword, stats() counts its bytes, the timeline has its
column, doctor lists it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

# The row a contributor adds (outside the ledger, as JAX: the pool counts its bytes, the
# adapter tells which of the pool's "others" are its own).
ROW = '    Framework("dummy", None, "dummy_adapter", "#17becf", doc="the test\'s stand-in"),\n'

# The smallest adapter: install() puts the framework on the shared pool; here it only
# says how many of the pool's bytes the framework holds.
ADAPTER = '''
"""The dummy framework on the shared pool."""

from bridge.pool import register_attribution

HELD: dict[int, int] = {}  # device -> bytes the framework holds in the pool
installed_on: list[int] = []


def install(devices):
    installed_on.extend(devices)
    register_attribution("dummy", lambda device: HELD.get(device, 0))
'''

CHILD = r'''
import ast
import ctypes
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys

ROW = sys.argv[1]


class WithTheRow(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """bridge.frameworks from its file, with ROW as the last row of REGISTRY."""

    def find_spec(self, name, path, target=None):
        if name != "bridge.frameworks":
            return None
        origin = importlib.machinery.PathFinder.find_spec(name, path).origin
        return importlib.util.spec_from_file_location(name, origin, loader=self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        origin = module.__spec__.origin
        source = open(origin).read()
        (registry,) = [
            n for n in ast.parse(source).body
            if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "REGISTRY"
        ]
        lines = source.splitlines(keepends=True)
        lines.insert(registry.end_lineno - 1, ROW)  # before the table's closing ")"
        exec(compile("".join(lines), origin, "exec"), module.__dict__)


sys.meta_path.insert(0, WithTheRow())

import bridge
import dummy_adapter
from bridge import frameworks, timeline
from bridge.tools import doctor

out = {"names": list(frameworks.NAMES), "columns": list(frameworks.FRAMEWORKS)}
try:
    bridge.unify(dumy=True)
except TypeError as exc:
    out["typo"] = str(exc)
check_keywords = importlib.import_module("bridge.unify").check_keywords
out["takes"] = "dummy" in check_keywords({"dummy": True}, "where")
out["help"] = bridge.unify.__doc__
b = bridge.unify(cupy=False, torch=False, dummy=True, device=0)
out["frameworks"] = sorted(b.frameworks)
out["installed_on"] = dummy_adapter.installed_on

standin = ctypes.CDLL(os.environ["BRIDGE_CUDA_LIBRARY"])
standin.standin_add_foreign.argtypes = [ctypes.c_int, ctypes.c_int64]
standin.standin_add_foreign(0, 6 << 20)  # 6 MiB in the pool outside the ledger
dummy_adapter.HELD[0] = 4 << 20  # 4 MiB of them the dummy's
out["by_framework"] = bridge.stats(0).by_framework
with bridge.record(interval=10, device=0) as rec:
    rec.mark("now")
(sample,) = [s for s in rec.samples if s.label == "now"]
out["fields"] = list(timeline.FIELDS)
out["sample"] = [sample.dummy, sample.by_framework]
out["doctor"] = doctor.render(doctor.collect())
print(json.dumps(out))
'''


@pytest.fixture
def added(tmp_path, standin):
    """What the child process saw, with the dummy framework's row and adapter (on the
    stand-in driver, whose library the child loads as this process did)."""
    (tmp_path / "dummy_adapter.py").write_text(ADAPTER)
    (tmp_path / "dummy").mkdir()  # the framework itself: installed, found by doctor
    (tmp_path / "dummy" / "__init__.py").write_text("")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), ROW],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def test_unify_takes_the_new_framework_by_its_name(added):
    assert added["names"][-1] == "dummy"
    assert added["frameworks"] == ["dummy"] and added["installed_on"] == [0]
    assert added["typo"] == "unify() got an unexpected keyword argument 'dumy'"
    assert added["takes"]  # a Dask or Ray worker's unify() keywords take it too
    assert "``dummy`` (the test's stand-in)" in added["help"]


def test_stats_and_the_timeline_count_its_bytes(added):
    # after the first five, before "other" (what no framework's adapter allocated)
    assert added["columns"] == ["cupy", "torch", "jax", "numba", "rmm", "dummy", "other"]
    by = added["by_framework"]
    assert list(by) == added["columns"]
    # the pool's 6 MiB of "others": 4 the dummy says are its own, the rest "other"
    assert (by["dummy"], by["jax"], by["other"]) == (4 << 20, 0, 2 << 20)
    assert added["fields"].index("dummy") == added["fields"].index("rmm") + 1
    dummy, sample_by = added["sample"]
    assert dummy == 4 << 20 and sample_by == by


def test_doctor_lists_it(added):
    lines = added["doctor"].splitlines()
    (line,) = [ln for ln in lines if ln.split()[:1] == ["dummy"]]
    assert "not installed" not in line
    assert "bridge.unify(dummy=True)" in added["doctor"]
    listed = [ln.split()[0] for ln in lines if ln.startswith("  ") and ln.split()]
    assert listed.index("rmm") < listed.index("dummy") < listed.index("cuda-python")
