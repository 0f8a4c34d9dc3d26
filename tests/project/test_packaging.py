# SPDX-License-Identifier: Apache-2.0
"""pyproject.toml's extras: every set names one CUDA major, as it resolves from PyPI."""

from __future__ import annotations

import pathlib
import re

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from bridge import frameworks

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = pathlib.Path(__file__).resolve().parents[2]
# PyPI's torch wheels are CUDA 13 builds from 2.11 on (2.9 and 2.10 are CUDA 12.8 builds);
# a CUDA 12 torch of today comes from PyTorch's own index
TORCH_CUDA13_FROM = Version("2.11")

# a requirement's name (and extras) -> the CUDA major it is built for
_SUFFIXES = (
    re.compile(r"cupy-cuda(\d\d)\d?x?"),
    re.compile(r"rmm-cu(\d\d)"),
    re.compile(r"nvidia-.+-cu(\d\d)"),
    re.compile(r"jax-cuda(\d\d)-(?:plugin|pjrt)"),
)
_EXTRA = re.compile(r"cuda(\d\d)(?:[_-].*)?|cu(\d\d)")  # jax[cuda12], numba-cuda[cu13]


def extras() -> dict[str, list[str]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project["optional-dependencies"]


def expand(name: str, sets: dict[str, list[str]]) -> list[Requirement]:
    """The requirements of a set, with its bridge[...] references expanded."""
    out: list[Requirement] = []
    for text in sets[name]:
        req = Requirement(text)
        if req.name == "bridge":
            for sub in sorted(req.extras):
                out += expand(sub, sets)
        else:
            out.append(req)
    return out


def majors_of(req: Requirement) -> set[int]:
    """The CUDA majors a requirement names (empty: none, it is not CUDA-specific)."""
    found = set()
    for pattern in _SUFFIXES:
        m = pattern.fullmatch(req.name.lower())
        if m:
            found.add(int(m.group(1)))
    for extra in req.extras:
        m = _EXTRA.fullmatch(extra.lower())
        if m:
            found.add(int(m.group(1) or m.group(2)))
    if req.name.lower() == "torch":
        # what PyPI gives: a CUDA 13 build only when the oldest allowed version is one
        lows = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
        assert lows and min(lows) >= TORCH_CUDA13_FROM, (
            f"{req}: PyPI's torch below {TORCH_CUDA13_FROM} is a CUDA 12 build; give a lower "
            "bound so that the set resolves to one CUDA major"
        )
        found.add(13)
    return found


@pytest.mark.parametrize("name", sorted(extras()))
def test_every_set_of_extras_names_one_cuda_major(name):
    sets = extras()
    by_major: dict[int, list[str]] = {}
    for req in expand(name, sets):
        for major in majors_of(req):
            by_major.setdefault(major, []).append(str(req))
    assert len(by_major) <= 1, f"[{name}] mixes CUDA majors: {by_major}"


def test_the_cuda_sets_are_the_majors_they_are_named_for_and_hold_the_frameworks():
    sets = extras()
    for major in (12, 13):
        reqs = expand(f"cuda{major}", sets)
        assert {m for r in reqs for m in majors_of(r)} == {major}
        names = {r.name for r in reqs}
        assert {f"cupy-cuda{major}x", "jax"} <= names
    # PyPI's torch is CUDA 13: in the CUDA 13 set, left out of the CUDA 12 one (its words
    # say where a CUDA 12 torch comes from)
    assert "torch" in {r.name for r in expand("cuda13", sets)}
    assert "torch" not in {r.name for r in expand("cuda12", sets)}
    # the registry's CUDA 12 torch comes from the index that pyproject.toml and the README cite
    index = frameworks.row("torch").pip(12).split("--index-url ")[1]
    assert index == "https://download.pytorch.org/whl/cu129"
    assert index in (REPO / "pyproject.toml").read_text()
    assert index in (REPO / "README.md").read_text()


def test_the_checks_catch_a_mixed_set():
    mixed = {"x": ["cupy-cuda12x", "torch"]}
    with pytest.raises(AssertionError, match="lower bound"):
        [majors_of(r) for r in expand("x", mixed)]
    mixed = {"x": ["cupy-cuda12x", "torch>=2.11"], "y": ["bridge[x]", "rmm-cu12"]}
    assert {m for r in expand("y", mixed) for m in majors_of(r)} == {12, 13}
    assert majors_of(Requirement("jax[cuda12]")) == {12}
    assert majors_of(Requirement("numba-cuda[cu13]")) == {13}


def test_dev_installs_what_the_readme_runs_next():
    dev = {r.name for r in expand("dev", extras())}
    assert {"pre-commit", "pytest", "ruff", "mypy"} <= dev


def test_the_metadata_is_complete_and_the_classifiers_exist():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for key in ("description", "readme", "requires-python", "license", "classifiers", "keywords"):
        assert project.get(key), key
    assert "License :: OSI Approved :: Apache Software License" in project["classifiers"]
    trove = pytest.importorskip("trove_classifiers")
    assert set(project["classifiers"]) <= trove.classifiers


def test_the_wheel_is_stripped_and_holds_no_c_sources_by_its_configuration():
    setup = (REPO / "setup.py").read_text()
    assert '"-g0"' in setup and '"-s"' in setup
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {"_native/*.c", "_native/*.cpp"} <= set(tool["exclude-package-data"]["bridge"])
    # the adapters' C compiled into the core stays out too (adapters/, setup.py's ADAPTERS)
    assert {"_torch_abi.cpp", "*.c"} <= set(tool["exclude-package-data"]["bridge.adapters"])
    assert "scripts/build-wheel" in (REPO / ".ci" / "run").read_text()
