# SPDX-License-Identifier: Apache-2.0
"""The docs stand on their own and their recipes run as written.

Every ```` ```python cpu ```` block of the Markdown files runs here, in a fresh
process without any CUDA driver, as on a user's machine without a GPU; every
```` ```python standin ```` block runs on the stand-in driver (what a user gets by
following the user guide's "Trying it without a GPU"), and says so in its first
line; both with warnings as errors. Every other Python block must at least
compile (it needs a GPU and the frameworks).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCS = sorted(
    [REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "CHANGELOG.md"]
    + list((REPO / "docs").glob("*.md"))
    + [REPO / "benchmarks" / "README.md"]
)
FENCE = re.compile(r"^([ \t]*)```python([^\n]*)\n(.*?)^\1```[ \t]*$", re.S | re.M)


def _blocks() -> list[tuple[str, int, str, str]]:
    """(file, line, kind, code) for every Python block of the docs."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            code = textwrap.dedent(m.group(3))
            found.append((str(path.relative_to(REPO)), line, m.group(2).strip(), code))
    return found


BLOCKS = _blocks()
CPU = [b for b in BLOCKS if b[2] in ("cpu", "standin")]
STANDIN_NOTE = "# without a GPU: on the stand-in driver (user guide, Trying it without a GPU)"
# recipes of an optional extra (dask, ray) run where it is installed (.ci/run installs both)
OPTIONAL = ("distributed", "ray")


def test_the_docs_have_cpu_recipes():
    files = {f for f, *_ in CPU}
    assert "docs/user-guide.md" in files and len(CPU) >= 5


def test_a_recipe_that_needs_the_stand_in_says_so_where_the_reader_sees_it():
    for path, line, kind, code in CPU:
        if kind == "standin":
            assert code.splitlines()[0] == STANDIN_NOTE, f"{path}:{line}"
    guide = (REPO / "docs" / "user-guide.md").read_text()
    assert "## Trying it without a GPU" in guide and "BRIDGE_CUDA_LIBRARY" in guide


@pytest.mark.parametrize("path, line, kind, code", CPU, ids=[f"{f}:{n}" for f, n, *_ in CPU])
def test_cpu_recipe_runs_as_written(standin, tmp_path, path, line, kind, code):
    for module in OPTIONAL:
        if re.search(rf"^(import|from) {module}\b", code, re.M):
            pytest.importorskip(module)
    env = dict(os.environ)  # the stand-in driver (conftest), two 16 GiB GPUs
    if kind == "cpu":  # no driver at all, as on a machine without a GPU
        env["BRIDGE_CUDA_LIBRARY"] = str(tmp_path / "no-libcuda.so.1")
    # a bare unify() beside a CPU-only torch warns that it leaves torch alone (CI has none)
    quiet = ["-W", "ignore:bridge.unify() left torch out:UserWarning"]
    r = subprocess.run(
        [sys.executable, "-W", "error", *quiet, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, f"{path}:{line}\n{code}\n{r.stdout}\n{r.stderr}"


@pytest.mark.parametrize("path, line, kind, code", BLOCKS, ids=[f"{f}:{n}" for f, n, *_ in BLOCKS])
def test_every_python_block_compiles(path, line, kind, code):
    assert kind in ("", "cpu", "standin"), f"{path}:{line}: unknown block kind {kind!r}"
    compile(code, f"{path}:{line}", "exec")


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(REPO)) for p in DOCS])
def test_no_reference_outside_the_repository(path):
    text = path.read_text()
    needles = ["/work/", "shared/", "CONTRACT", "PLATFORM.md"]
    if path.name != "CHANGELOG.md":  # the changelog tells the broken recipe's story
        needles.append("bridge.__main__.main")  # `import bridge` does not import __main__
    for needle in needles:
        assert needle not in text, f"{path.name} mentions {needle!r}"


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(REPO)) for p in DOCS])
def test_relative_links_resolve(path):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if "://" in target:
            continue
        assert (path.parent / target).exists(), f"{path.name} links to a missing {target}"


def test_the_readme_opens_with_install_test_and_the_gpu_example():
    lines = (REPO / "README.md").read_text().splitlines()
    assert lines[2:6] == ["```", 'pip install -e ".[test]"', "pytest", "```"]
    assert "python examples/mixed_pipeline.py" in lines[6] and "GPU machine" in lines[6]
    assert "C and a C++ compiler" in "\n".join(lines[:12])


def test_no_file_of_the_repository_points_outside_it():
    here = pathlib.Path(__file__).resolve()
    bad = []
    for path in REPO.rglob("*"):
        rel = path.relative_to(REPO)
        if (
            not path.is_file()
            or path == here
            or rel.parts == (".git",)  # a worktree's pointer to its repository
            or any(p.startswith(".") or p in ("build", "results") for p in rel.parts[:-1])
            or path.suffix not in (".py", ".pyi", ".c", ".h", ".cpp", ".md", ".toml", ".txt", "")
        ):
            continue
        text = path.read_text(errors="replace")
        bad += [f"{rel}: {n}" for n in ("/work/", "CONTRACT.md", "PLATFORM.md") if n in text]
    assert not bad, bad


def test_the_changelog_has_one_entry_per_release_in_keep_a_changelog_form():
    text = (REPO / "CHANGELOG.md").read_text()
    releases = re.split(r"^## ", text, flags=re.M)[1:]
    assert releases and releases[0].startswith("[Unreleased]")
    names = [r.split("\n", 1)[0] for r in releases]
    assert len(names) == len(set(names)), names
    kinds = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")
    for release in releases:
        heads = re.findall(r"^### (.+)$", release, re.M)
        assert len(heads) == len(set(heads)), (release.split("\n", 1)[0], heads)
        assert set(heads) <= set(kinds), heads
    assert "GPU status" not in text  # run records live in benchmarks/results
