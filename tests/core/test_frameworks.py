# SPDX-License-Identifier: Apache-2.0
"""The one table of frameworks (bridge.frameworks): what pool, unify and the timeline read."""

from __future__ import annotations

import importlib
import importlib.util

import pytest

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


def test_the_c_half_counts_its_lines():
    # BRIDGE_NTAGS (bridge.h) is tag 0 and one slot per line of frameworks.h's list
    import pathlib
    import re

    header = pathlib.Path(frameworks.__file__).parent / "_native" / "frameworks.h"
    lines = re.findall(r"X\((\w+), (\d+)\)", header.read_text())
    assert core.NTAGS == 1 + len(lines)
    assert [int(n) for _, n in lines] == list(range(1, core.NTAGS))  # each at its place


def test_the_stub_names_every_tag_of_the_c_half():
    # bridge/_core.pyi types bridge._core: a line of frameworks.h is a TAG_<NAME> there
    import pathlib
    import re

    here = pathlib.Path(frameworks.__file__).parent
    lines = re.findall(r"X\((\w+), \d+\)", (here / "_native" / "frameworks.h").read_text())
    stub = set(re.findall(r"^(TAG_\w+): int$", (here / "_core.pyi").read_text(), re.M))
    want = {"TAG_OTHER"} | {f"TAG_{name}" for name in lines}
    assert stub == want, f"bridge/_core.pyi: add {sorted(want - stub)}, drop {sorted(stub - want)}"


def test_the_columns_are_the_rows_then_other():
    # by_framework's keys and the timeline's columns as users have read them: cupy, torch
    # and jax first, the rows' column order; a row without one comes after
    first = ("cupy", "torch", "jax", "numba", "rmm")
    assert frameworks.FRAMEWORKS[:5] == first and frameworks.FRAMEWORKS[-1] == "other"
    assert set(frameworks.FRAMEWORKS) - {"other"} == set(frameworks.NAMES)
    new = frameworks.Framework("x", None, "m", "#000000")  # a row that names no column
    assert new.column > max(frameworks.row(n).column for n in first)


def test_unify_takes_each_row_by_its_name_with_the_rows_default():
    import inspect

    unify_module = importlib.import_module("bridge.unify")
    params = inspect.signature(unify_module.unify).parameters
    own = [f for f in frameworks.REGISTRY if f.name in params]
    assert [f.name for f in own] == ["jax", "torch", "cupy", "numba", "rmm"]
    for f in own:  # unify's own keywords: the rows' defaults
        assert params[f.name].default is f.default, f.name
    assert params["other_frameworks"].kind is inspect.Parameter.VAR_KEYWORD
    asked = unify_module._asked({})
    assert list(asked) == [n for n in frameworks.FRAMEWORKS if n != "other"]
    assert {n: asked[n] for n in ("cupy", "torch", "jax", "numba", "rmm")} == {
        "cupy": None,  # when installed
        "torch": None,
        "jax": False,  # when asked for
        "numba": False,
        "rmm": False,
    }
    with pytest.raises(TypeError, match="unexpected keyword argument 'cupyy'"):
        unify_module._asked({"cupyy": True})
    with pytest.raises(ValueError, match="numba=None: pass True or False"):
        unify_module._asked({"numba": None})


def test_properties_not_names():
    # the per-framework behaviours the core has are rows' properties
    assert frameworks.OUTSIDE == "jax" and frameworks.row("jax").partition
    assert frameworks.OUTSIDES == ("jax",)
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


def test_torchs_refusal_names_every_framework_of_the_c_half(standin):
    # adapters/_torch_abi.cpp writes torch's out-of-memory message from frameworks.h's list:
    # torch first, then each other line's framework with its bytes, in the list's order
    import ctypes
    import re

    from bridge import _runtime

    _runtime.ensure_device(0)
    lib = ctypes.CDLL(core.__file__)
    lib.bridge_torch_failure_message.argtypes = [
        ctypes.c_int,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_int),
    ]
    held = []
    for i, f in enumerate(f for f in frameworks.REGISTRY if f.tag is not None):
        rc, p = core.alloc(0, (i + 1) << 30, 0, f.tag)  # 1, 2, 3, 4 GiB
        assert rc == 0
        held.append((f.name, (i + 1) << 30, p))
    try:
        buf, oom = ctypes.create_string_buffer(4096), ctypes.c_int(0)
        lib.bridge_torch_failure_message(1, 1 << 20, 0, buf, len(buf), ctypes.byref(oom))
    finally:
        for _, _, p in held:
            core.free(p)
    msg = buf.value.decode()
    assert oom.value == 1 and msg.startswith("CUDA out of memory."), msg
    (in_use,) = re.findall(r"In use: (.*?), other bridge users", msg)
    named = dict(part.split(" ", 1) for part in in_use.split(", "))
    sizes = {name: f"{size / (1 << 30):.2f} GiB" for name, size, _ in held}
    assert list(named) == ["torch"] + [n for n in sizes if n != "torch"]
    assert named == sizes
