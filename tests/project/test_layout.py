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
    # pyproject.toml reads it from bridge/_version.py; nothing else states it. The
    # distribution that installs the package bridge is named in _version.py too
    from bridge._version import DISTRIBUTION

    assert re.fullmatch(r"\d+\.\d+\.\d+(\S*)", bridge.__version__)
    assert importlib.metadata.version(DISTRIBUTION) == bridge.__version__
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"[],]', pyproject, re.M)
    assert f'name = "{DISTRIBUTION}"' in pyproject
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
    out += [
        REPO / "scripts" / n for n in ("gpu-test", "sanitize", "build-wheel", "torch-matrix")
    ] + [REPO / ".ci" / "run"]
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


# ---- one home per framework (issue 32) ----
FRAMEWORK_WORD = re.compile(r"torch|cupy|jax|numba|rmm", re.I)
CORE = REPO / "bridge"
# The registry (its Python table and its C half) is where the core may name frameworks.
REGISTRY_FILES = {"bridge/frameworks.py", "bridge/_native/frameworks.h"}
# Public names that carry a framework's name (CONTRACT: public names are never renamed):
# unify()'s own keywords (a framework added since is one of its **other_frameworks), the
# pinned pool's CuPy allocator and torch tensor, the entry points torch's adapter points
# torch._C at. The timeline's columns come from the registry.
PUBLIC: dict[str, set[str]] = {
    "bridge/unify.py": {"cupy", "torch", "jax", "numba", "rmm", "jax_memory"},
    "bridge/pinned/__init__.py": {"cupy_pinned_allocator"},
    "bridge/pinned/_buffer.py": {"as_torch"},
    "bridge/snapshot.py": {
        "torch_record_history",
        "torch_record_history_legacy",
        "torch_memory_snapshot",
    },
}
# Framework knowledge still in the core, each entry to go (the test fails when one is gone,
# so that the list only shrinks): none is left. The install words, the adapters' own
# environment variables and PinnedBuffer.as_torch's tensor come from the registry's rows
# (bridge/frameworks.py) and the adapters.
PENDING: dict[str, set[str]] = {}


def _core_files() -> list[pathlib.Path]:
    """The core: bridge/ without the adapters' home, its tools, and the registry.

    bridge/adapters (a link to adapters/) is where frameworks live. bridge/tools
    may know frameworks: doctor, the demo and the CLI are tools that look at and
    drive the installed frameworks by name (what is installed, which CUDA major,
    what each one allocated), which is their job and no part of the core that the
    adapters plug into. bridge/_core.pyi is the stub of the compiled module, which
    holds what the adapters' C adds to it (CupyAllocator) and the registry's tags.
    """
    out = []
    for path in sorted(CORE.rglob("*")):
        rel = path.relative_to(CORE).parts
        if rel[0] in ("adapters", "tools") or path.suffix not in (".py", ".c", ".h", ".cpp"):
            continue
        if str(path.relative_to(REPO)) not in REGISTRY_FILES:
            out.append(path)
    return out


def _py_words(source: str) -> list[tuple[int, str]]:
    """Names and name-like strings (no whitespace: keys, module paths) of Python code.

    Comments and docstrings are words about the frameworks, as are messages
    (strings with spaces, f-strings' text); names, imports and string keys are
    what knows them.
    """
    tree = ast.parse(source)
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                skipped.add(id(body[0].value))
        if isinstance(node, ast.JoinedStr):  # an f-string's text: a message's words
            skipped |= {id(v) for v in node.values if isinstance(v, ast.Constant)}
    out = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        names: list[str] = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, ast.keyword) and node.arg:
            names = [node.arg]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.alias):
            names = [node.name, node.asname or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in skipped and not re.search(r"\s", node.value):
                names = [node.value]
        out += [(line, n) for n in names if n and FRAMEWORK_WORD.search(n)]
    return out


def _c_words(source: str) -> list[tuple[int, str]]:
    """Identifiers and name-like string literals of C or C++ code, comments left out."""
    source = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group().count("\n"), source, flags=re.S)
    source = re.sub(r"//[^\n]*", "", source)
    out = []
    for n, line in enumerate(source.splitlines(), 1):
        for m in re.finditer(r'"(?:\\.|[^"\\])*"|\w+', line):
            word = m.group()
            if word.startswith('"'):
                word = word[1:-1]
                if re.search(r"\s", word):
                    continue
            if FRAMEWORK_WORD.search(word):
                out.append((n, word))
    return out


def _framework_words() -> dict[str, list[tuple[int, str]]]:
    found = {}
    for path in _core_files():
        text = path.read_text()
        words = _py_words(text) if path.suffix == ".py" else _c_words(text)
        if words:
            found[str(path.relative_to(REPO))] = words
    return found


def test_no_framework_name_in_the_core_outside_the_registry():
    """Framework knowledge lives in the adapters; the core reads the registry (issue 32)."""
    found = _framework_words()
    allowed = {f: PUBLIC.get(f, set()) | PENDING.get(f, set()) for f in set(PUBLIC) | set(PENDING)}
    hits = [
        f"{f}:{line}: {word}"
        for f, words in sorted(found.items())
        for line, word in words
        if word not in allowed.get(f, set())
    ]
    assert not hits, "framework names in the core (move them to adapters/ or the registry):\n" + (
        "\n".join(hits)
    )
    seen = {f: {w for _, w in words} for f, words in found.items()}
    gone = sorted(
        f"{f}: {w}" for f, words in allowed.items() for w in words if w not in seen.get(f, set())
    )
    assert not gone, f"gone from the core: strike them from PUBLIC/PENDING: {gone}"


def test_the_framework_grep_finds_what_it_should():
    assert _py_words('import torch\nx = {"cupy": 1}\n') == [(1, "torch"), (2, "cupy")]
    assert _py_words('"""Docstring: CuPy."""\n# jax\nraise ValueError("no torch here")\n') == []
    assert _c_words('/* torch */ int x = BRIDGE_TAG_CUPY; // jax\nf("RMM");\n') == [
        (1, "BRIDGE_TAG_CUPY"),
        (2, "RMM"),
    ]
    assert _c_words('puts("words about numba");\n') == []
