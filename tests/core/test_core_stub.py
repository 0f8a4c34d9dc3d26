# SPDX-License-Identifier: Apache-2.0
"""bridge/_core.pyi, the type stub of the compiled core, matches the module.

mypy trusts the stub: a function added to pymod.c but not to the stub is an
error for every caller, and a stale stub hides real mistakes. These tests
keep the two in step (names, and the keys of the figures dicts).
"""

from __future__ import annotations

import ast
import pathlib

from bridge._errors import Status
from bridge._runtime import core

STUB = pathlib.Path(__file__).resolve().parents[2] / "bridge" / "_core.pyi"


def _stub() -> ast.Module:
    return ast.parse(STUB.read_text())


def _stub_names() -> set[str]:
    names = set()
    for node in _stub().body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _typed_dict_keys(name: str) -> set[str]:
    for node in _stub().body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {
                n.target.id
                for n in node.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            }
    raise AssertionError(f"{name} is not in {STUB}")


# names the stub declares for typing only (TypedDicts of the figures)
STUB_ONLY = {"RawStats", "TagStats", "PinnedStats", "MemInfo", "ShareStats"}


def test_every_name_of_the_module_is_in_the_stub() -> None:
    public = {n for n in dir(core) if not n.startswith("_")}
    missing = public - _stub_names()
    assert not missing, f"add to bridge/_core.pyi: {sorted(missing)}"


def test_the_stub_declares_nothing_the_module_lacks() -> None:
    public = {n for n in dir(core) if not n.startswith("_")}
    extra = _stub_names() - public - STUB_ONLY
    assert not extra, f"bridge/_core.pyi declares what bridge._core lacks: {sorted(extra)}"


def test_stats_keys_match_the_typed_dicts(standin: object) -> None:
    rc, raw = core.stats(0)
    assert rc == Status.OK
    assert set(raw) == _typed_dict_keys("RawStats")
    assert set(raw["tags"][0]) == _typed_dict_keys("TagStats")
    rc, pinned = core.pinned_stats()
    assert rc == Status.OK
    assert set(pinned) == _typed_dict_keys("PinnedStats")
    rc, info = core.mem_info(0)
    assert rc == Status.OK
    assert set(info) == _typed_dict_keys("MemInfo")
