# SPDX-License-Identifier: Apache-2.0
"""The names the docs give a user exist: variables, ``bridge.*`` names, anchors.

A user copies a variable or a name from the docs; these tests fail on one the
code does not have. The user guide's table of variables and ``bridge._env``'s
table (what ``bridge doctor`` checks) list the same variables; every
``BRIDGE_*`` name in the docs is a variable of that table, one the tests, the
scripts or the build read, or a name of the C core; every ``bridge.<name>``
resolves (by import, or, where the import needs a framework not installed
here, in the module's source); every link to a heading of a Markdown file
finds that heading.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import pathlib
import re

import pytest

from bridge import _env

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCS = sorted(
    [REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "CHANGELOG.md"]
    + list((REPO / "docs").glob("*.md"))
    + [REPO / "benchmarks" / "README.md"]
)
IDS = [str(p.relative_to(REPO)) for p in DOCS]
NOW = [p for p in DOCS if p.name != "CHANGELOG.md"]  # the changelog names what was renamed
VARIABLE = re.compile(r"\bBRIDGE_[A-Z0-9_]+")
# docs/adding-a-framework.md walks through adding a framework called "dummy"
EXAMPLE = re.compile(r"dummy", re.I)


def _sources(*globs: str) -> str:
    return "\n".join(
        p.read_text(errors="replace") for g in globs for p in REPO.glob(g) if p.is_file()
    )


def _read_by_tools() -> set[str]:
    """Variables the tests, the scripts and the build read (for contributors)."""
    text = _sources("tests/**/*.py", "tests/**/*.c", "scripts/*", ".ci/*", "setup.py")
    return set(re.findall(r"""["'](BRIDGE_[A-Z0-9_]+)["']""", text)) | set(
        re.findall(r"\$\{?(BRIDGE_[A-Z0-9_]+)", text)
    )


def _c_names() -> set[str]:
    """Identifiers of the C core and the adapters' C and C++ (macros, enum members)."""
    text = _sources("bridge/_native/**/*.[ch]", "adapters/*.c*", "adapters/*.h")
    return set(VARIABLE.findall(text))


def test_the_user_guides_table_lists_every_variable_the_library_reads_and_no_other():
    guide = (REPO / "docs" / "user-guide.md").read_text()
    rows = re.findall(r"^\| `(BRIDGE_[A-Z0-9_]+)` \|", guide, re.M)
    assert len(rows) == len(set(rows)), sorted(r for r in rows if rows.count(r) > 1)
    assert sorted(set(_env.NAMES) - set(rows)) == [], "variables missing from the table"
    assert sorted(set(rows) - set(_env.NAMES)) == [], "rows of variables nobody reads"


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_every_bridge_variable_the_docs_name_exists(path):
    known = set(_env.NAMES) | _read_by_tools() | _c_names()
    text = path.read_text()
    bad = []
    for m in VARIABLE.finditer(text):
        name = m.group(0)
        line = text.count("\n", 0, m.start()) + 1
        if EXAMPLE.search(name):
            continue
        if name.endswith("_"):  # a family, BRIDGE_SEGMENTS_*
            ok = any(k.startswith(name) for k in known)
        else:
            ok = name in known
        # a value a user sets in a shell is one the library or a tool reads
        if ok and text[m.end() : m.end() + 1] == "=" and name in _c_names():
            ok = name in _env.NAMES or name in _read_by_tools()
        if not ok:
            bad.append(f"{path.name}:{line}: {name}")
    assert not bad, bad


def _source(module: str) -> pathlib.Path | None:
    """The file of ``module``, found without running it (None when there is none)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return pathlib.Path(spec.origin) if spec and spec.origin else None


def _defined_in_source(path: pathlib.Path, attrs: list[str]) -> bool:
    """Whether the module at ``path`` defines ``attrs[0]`` at its top level (no import)."""
    if path.suffix != ".py" or len(attrs) != 1:
        return False
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return attrs[0] in names


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            source = _source(module)
            if source is None or (e.name or "").startswith("bridge"):
                continue
            # the module is there but imports a framework not installed here
            return i == len(parts) or _defined_in_source(source, parts[i:])
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("path", NOW, ids=[str(p.relative_to(REPO)) for p in NOW])
def test_every_bridge_name_the_docs_use_resolves(path):
    text = path.read_text()
    bad = []
    for m in re.finditer(r"(?<![\w./-])bridge(?:\.[A-Za-z_]\w*)+", text):
        name = m.group(0)
        if EXAMPLE.search(name) or (REPO / "bridge" / "_native" / name).exists():
            continue  # the walk-through's framework; bridge.h, a header of the core
        if not _resolves(name):
            bad.append(f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}: {name}")
    assert not bad, bad


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_every_link_to_a_heading_finds_it(path):
    text = path.read_text()
    bad = []
    for m in re.finditer(r"\]\(([^)\s#]*)#([^)\s]+)\)", text):
        target = path.parent / m.group(1) if m.group(1) else path
        if "://" in m.group(1) or target.suffix != ".md" or not target.exists():
            continue
        body = re.sub(r"^```.*?^```", "", target.read_text(), flags=re.S | re.M)
        heads = {_anchor(h) for h in re.findall(r"^#+ (.+)$", body, re.M)}
        if m.group(2) not in heads:
            bad.append(f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}")
    assert not bad, bad


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_every_extra_the_docs_install_exists(path):
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    text = path.read_text()
    named = re.findall(r"""(?:["']\.|gpumem-bridge)\[([a-z0-9_,-]+)\]""", text)
    bad = sorted({e for group in named for e in group.split(",") if e not in extras})
    assert not bad, f"{path.name} installs extras pyproject.toml has not: {bad}"


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_every_figure_and_pool_method_the_docs_name_exists(path):
    import bridge
    from bridge.pinned._pool import PinnedPool
    from bridge.pool import Pool

    stats = {f.name for f in dataclasses.fields(bridge.Stats)} | set(dir(bridge.Stats))
    kinds = {
        "stats": stats,
        "Stats": stats,
        "pool": set(dir(Pool)),
        "pinned_pool": set(dir(PinnedPool)),
    }
    text = path.read_text()
    bad = []
    for m in re.finditer(r"\b(stats|Stats|pool|pinned_pool)(?:\([^()]*\))?\.([a-z_]+)\b", text):
        kind, name = m.group(1), m.group(2)
        if kind in ("stats", "pool", "pinned_pool") and "(" not in m.group(0):
            continue  # bridge.stats itself, a module, not a call's result
        if name not in kinds[kind]:
            bad.append(f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}")
    assert not bad, bad


def test_the_user_guides_defaults_of_the_switches_are_the_readers(monkeypatch):
    guide = (REPO / "docs" / "user-guide.md").read_text()
    cell = re.compile(r"^\| `(BRIDGE_[A-Z0-9_]+)` \| ([^|]*)\|", re.M)
    default = re.compile(r"`([01])` \((?:on|off)?,? ?the default\)")
    checked = 0
    for name, values in cell.findall(guide):
        m = default.search(values)
        if not m:
            continue
        monkeypatch.delenv(name, raising=False)
        if name == "BRIDGE_CACHE_SEGMENTS":  # its default follows BRIDGE_CACHE_CARVE's
            monkeypatch.delenv("BRIDGE_CACHE_CARVE", raising=False)
        assert _env.variable(name).read(_env.Totals()) is (m.group(1) == "1"), name
        checked += 1
    assert checked >= 7


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_every_file_of_the_repository_the_docs_name_exists(path):
    text = path.read_text()
    folders = "bridge|tests|scripts|benchmarks|examples|adapters|docs|\\.ci"
    bad = []
    for m in re.finditer(rf"(?:^|[ (`])((?:{folders})/[\w./-]*\w)", text, re.M):
        name = m.group(1)
        if EXAMPLE.search(name) or text[m.end(1) : m.end(1) + 1] == "<":
            continue  # the walk-through's framework; adapters/_<name>_*.c
        if not ((REPO / name).exists() or (path.parent / name).exists()):
            bad.append(f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}: {name}")
    assert not bad, bad


def test_every_value_the_user_guides_table_shows_is_one_the_reader_takes(monkeypatch, tmp_path):
    guide = (REPO / "docs" / "user-guide.md").read_text()
    cell = re.compile(r"^\| `(BRIDGE_[A-Z0-9_]+)` \| ([^|]*)\|", re.M)
    totals = _env.Totals(device=16 << 30, host=64 << 30, devices=(16 << 30,))
    tried = 0
    for name, values in cell.findall(guide):
        for value in re.findall(r"`([^`]+)`", values):
            if any(c in value for c in "($= ") or value.startswith("BRIDGE_"):
                continue  # a call or another variable named in the cell, not a value
            monkeypatch.setenv(name, value)
            if name == "BRIDGE_CUDA_LIBRARY":
                continue  # any path; read only when the driver loads
            try:
                _env.variable(name).read(totals)
            except ValueError as e:
                pytest.fail(f"the user guide shows {name}={value}, which is refused: {e}")
            tried += 1
        monkeypatch.delenv(name, raising=False)
    assert tried >= 30
