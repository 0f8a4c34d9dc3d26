# SPDX-License-Identifier: Apache-2.0
"""The one table of frameworks (bridge.frameworks): what pool, unify and the timeline read."""

from __future__ import annotations

import importlib
import importlib.util

from bridge import frameworks
from bridge._runtime import core


def test_every_framework_has_a_column_and_every_tag_a_name():
    assert set(frameworks.FRAMEWORKS) == set(frameworks.ORDER) | {"other"}
    assert sorted(frameworks.TAG_NAMES) == list(range(core.NTAGS))
    assert set(frameworks.COLORS) == set(frameworks.FRAMEWORKS)


def test_jax_is_set_up_first_and_is_outside_the_ledger():
    assert frameworks.ORDER[0] == "jax"
    (jax,) = [f for f in frameworks.REGISTRY if f.name == "jax"]
    assert jax.tag is None


def test_the_library_reads_the_table():
    # the modules (bridge.pool and bridge.unify are also the functions of those names)
    pool, unify, timeline = (
        importlib.import_module(f"bridge.{m}") for m in ("pool", "unify", "timeline")
    )
    assert pool.FRAMEWORKS is frameworks.FRAMEWORKS and pool.TAG_NAMES is frameworks.TAG_NAMES
    assert unify.ORDER is frameworks.ORDER
    assert timeline.COLORS is frameworks.COLORS


def test_each_row_names_an_adapter_that_exists():
    for f in frameworks.REGISTRY:
        assert importlib.util.find_spec(f.adapter) is not None, f


def test_the_c_half_agrees_with_the_table():
    # bridge/_native/frameworks.h names the slots C code counts under; bridge._core
    # exports each as TAG_<NAME>: every one is its framework's row's tag
    import pathlib
    import re

    header = pathlib.Path(frameworks.__file__).parent / "_native" / "frameworks.h"
    pairs = re.findall(r"X\((\w+), (\d+)\)", header.read_text())
    assert pairs
    tags = {f.name: f.tag for f in frameworks.REGISTRY}
    for name, n in pairs:
        assert tags[name.lower()] == int(n) == getattr(core, f"TAG_{name}"), name
    counted = [f.tag for f in frameworks.REGISTRY if f.tag is not None]
    assert len(set(counted)) == len(counted) and all(0 < t < core.NTAGS for t in counted)


def test_properties_not_names():
    # the per-framework behaviours the core has are rows' properties
    assert frameworks.OUTSIDE == "jax" and frameworks.row("jax").partition
    assert frameworks.row("jax").imports_late
    assert frameworks.pointers().name == "cupy"
    assert [f.name for f in frameworks.REGISTRY if f.relieved] == ["torch"]
    assert frameworks.row("torch").env == ("BRIDGE_TORCH_PLUGGABLE",)
    assert core.set_tag_relieved(core.NTAGS, True) != 0  # a slot that is not there


def test_the_frameworks_with_builds_without_cuda_tell_them_apart():
    # unify() asks each cpu_builds row's adapter for without_cuda(); read from the source,
    # since importing an adapter imports its framework
    import ast
    import pathlib

    rows = [f for f in frameworks.REGISTRY if f.cpu_builds]
    assert [f.name for f in rows] == ["jax", "torch"]
    for f in rows:
        spec = importlib.util.find_spec(f.adapter)
        assert spec is not None and spec.origin is not None
        tree = ast.parse(pathlib.Path(spec.origin).read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert "without_cuda" in defined, f.adapter
