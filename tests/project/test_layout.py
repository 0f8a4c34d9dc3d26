# SPDX-License-Identifier: Apache-2.0
"""The layout of the package: no import cycle in bridge/, one version, SPDX headers."""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re

import bridge

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = {"bridge": REPO / "bridge", "bridge.adapters": REPO / "adapters"}
COMPILED = {"bridge._core"}  # the C core imports nothing of the package


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package, root in PACKAGES.items():
        for path in sorted(root.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found[name] = path
    return found


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """Modules of the package this file imports, anywhere in it (functions included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from bridge import _runtime` imports the module bridge._runtime
            names = [f"{node.module}.{a.name}" for a in node.names]
            names = [n if n in modules or n in COMPILED else node.module for n in names]
        else:
            continue
        out |= {n for n in names if n in modules}
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_in_bridge():
    modules = _modules()
    # the package's __init__ imports its public modules; a module that imports the
    # package itself (`import bridge`) would close a cycle through it
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_one_version():
    # pyproject.toml reads it from bridge/_version.py; nothing else states it
    assert re.fullmatch(r"\d+\.\d+\.\d+(\S*)", bridge.__version__)
    assert importlib.metadata.version("bridge") == bridge.__version__
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject
    assert not re.search(r"^version\s*=\s*['\"]", pyproject, re.M)  # no literal version
    assert 'attr = "bridge._version.__version__"' in pyproject


# Files of the core rewrite in progress: they take their SPDX line with it.
SPDX_PENDING: set[str] = set()  # every source file carries its header


def _sources() -> list[pathlib.Path]:
    out = []
    for pattern in ("*.py", "*.pyi", "*.c", "*.h", "*.cpp"):
        out += [
            p
            for p in REPO.rglob(pattern)
            if not any(part in ("build", ".git") or part.startswith(".") for part in p.parts)
            and "site-packages" not in p.parts
        ]
    out += [REPO / "scripts" / n for n in ("gpu-test", "sanitize", "build-wheel")] + [
        REPO / ".ci" / "run"
    ]
    return sorted(out)


def test_every_source_file_carries_an_spdx_line():
    missing = []
    for path in _sources():
        rel = str(path.relative_to(REPO))
        head = "\n".join(path.read_text(errors="replace").splitlines()[:2])
        if "SPDX-License-Identifier: Apache-2.0" not in head and rel not in SPDX_PENDING:
            missing.append(rel)
    assert not missing, missing
    assert (REPO / "LICENSE").read_text().lstrip().startswith("Apache License")
