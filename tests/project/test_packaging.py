# SPDX-License-Identifier: Apache-2.0
"""pyproject.toml: every set of extras names one CUDA major, as it resolves from PyPI; the
distribution's name is one that PyPI can give (not "bridge"), its license an SPDX expression,
its long description without relative links, and its sdist holds the stand-in tests."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from bridge import frameworks
from bridge._version import DISTRIBUTION

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


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def extras() -> dict[str, list[str]]:
    return pyproject()["project"]["optional-dependencies"]


def expand(name: str, sets: dict[str, list[str]]) -> list[Requirement]:
    """The requirements of a set, with its bridge[...] references expanded."""
    out: list[Requirement] = []
    for text in sets[name]:
        req = Requirement(text)
        if req.name == DISTRIBUTION:
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
    mixed = {"x": ["cupy-cuda12x", "torch>=2.11"], "y": [f"{DISTRIBUTION}[x]", "rmm-cu12"]}
    assert {m for r in expand("y", mixed) for m in majors_of(r)} == {12, 13}
    assert majors_of(Requirement("jax[cuda12]")) == {12}
    assert majors_of(Requirement("numba-cuda[cu13]")) == {13}


def test_dev_installs_what_the_readme_runs_next():
    dev = {r.name for r in expand("dev", extras())}
    assert {"pre-commit", "pytest", "ruff", "mypy"} <= dev


def test_the_metadata_is_complete_and_the_classifiers_exist():
    project = pyproject()["project"]
    for key in ("description", "requires-python", "license", "classifiers", "keywords"):
        assert project.get(key), key
    # README.md with absolute links and the project URLs come from setup.py
    assert {"version", "readme", "urls"} <= set(project["dynamic"])
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


def _setup_py():
    """setup.py's functions, without running setup() (it runs only as setuptools runs it)."""
    spec = importlib.util.spec_from_file_location("bridge_setup_py", REPO / "setup.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_distribution_is_not_pypis_bridge_and_installs_the_package_bridge():
    config = pyproject()
    name = config["project"]["name"]
    # PyPI's "bridge" (and its spellings) is another project: pip install bridge never gets this
    assert _canonical(name) != "bridge" and name == DISTRIBUTION
    assert "bridge" in config["tool"]["setuptools"]["packages"]  # import bridge stays
    # the extras that name the project itself name it by its distribution
    for text in config["project"]["optional-dependencies"]["dev"]:
        req = Requirement(text)
        assert _canonical(req.name) != "bridge", text
    # README gives the command that installs it from PyPI, and nothing anywhere installs
    # PyPI's bridge with extras of ours (pip install 'bridge[plot]')
    assert f'pip install "{name}[cuda13]"' in (REPO / "README.md").read_text()
    wrong = re.compile(r"""pip install -?U? ?['"]?bridge\[""")
    texts = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
    texts += sorted((REPO / "bridge").rglob("*.py")) + sorted((REPO / "adapters").glob("*.py"))
    bad = [str(p.relative_to(REPO)) for p in texts if wrong.search(p.read_text())]
    assert not bad, f"pip install bridge[...] installs PyPI's bridge, not {name}: {bad}"


def test_the_license_is_an_spdx_expression_as_setuptools_wants_it():
    config = pyproject()
    project = config["project"]
    # a table (license = {text = ...}) stops building on 2027-02-18 (setuptools' warning)
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"] and (REPO / "LICENSE").is_file()
    # with an expression, setuptools refuses License :: classifiers (PEP 639)
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]
    # setuptools reads license expressions and license-files from 77.0 on
    (requires,) = [r for r in config["build-system"]["requires"] if r.startswith("setuptools")]
    lows = [Version(s.version) for s in Requirement(requires).specifier if s.operator == ">="]
    assert lows and min(lows) >= Version("77"), requires


# a relative link of Markdown: [text](path), not [text](https://...) nor [text](#anchor)
_RELATIVE = re.compile(r"\]\((?![a-z][a-z0-9+.-]*:|#)[^)]*\)")


def test_the_long_description_has_no_relative_link_and_the_urls_are_the_repositorys():
    setup_py = _setup_py()
    readme = (REPO / "README.md").read_text()
    assert _RELATIVE.search(readme), "README links to files of the tree (on GitHub, relatively)"
    # what the package index shows, as setup.py builds it
    shown = setup_py.long_description(readme)
    assert not _RELATIVE.search(shown), _RELATIVE.findall(shown)
    urls = setup_py.project_urls()
    assert set(urls) in (set(), {"Homepage", "Documentation", "Source", "Issues", "Changelog"})
    for url in urls.values():
        assert url.startswith("https://") and not re.search(r"example|your|todo|xxx", url, re.I)
    # with a repository, every link to a file of the tree leads into it, anchor kept
    repo = "https://git.test/team/bridge"
    shown = setup_py.long_description(readme, repo)
    assert not _RELATIVE.search(shown)
    assert (
        f"[trying it without a GPU]({repo}/blob/main/docs/user-guide.md#trying-it-without-a-gpu)"
        in shown
    )
    assert f"[benchmarks/]({repo}/blob/main/benchmarks/README.md)" in shown
    urls = setup_py.project_urls(repo)
    assert urls["Source"] == repo and urls["Issues"] == f"{repo}/issues"
    assert urls["Changelog"] == f"{repo}/blob/main/CHANGELOG.md"
    # without one, the link's words stay and name the file (the sdist holds it)
    shown = setup_py.long_description(readme, None)
    assert "user guide in `docs/user-guide.md`" in shown
    assert "`benchmarks/results/capacity.md`" in shown


def _sdist_files(monkeypatch) -> set[str]:
    """The files MANIFEST.in adds to the sdist, as setuptools reads it."""
    egg_info = pytest.importorskip("setuptools.command.egg_info")
    monkeypatch.chdir(REPO)
    files = egg_info.FileList()
    files.findall(os.curdir)
    for line in (REPO / "MANIFEST.in").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            files.process_template_line(line)
    return {os.path.normpath(f) for f in files.files}


def test_the_sdist_holds_the_stand_in_tests_and_what_readme_names(monkeypatch):
    files = _sdist_files(monkeypatch)
    # the stand-in driver's source, the conftest that builds it and the core tests that use it
    for needed in (
        "tests/standin/standin_cuda.c",
        "tests/conftest.py",
        "tests/core/test_pool.py",
        "tests/ledger_util.py",
        "LICENSE",
        "README.md",
    ):
        assert needed in files, f"{needed} is not in the sdist (MANIFEST.in)"
    # what a checkout builds or caches stays out
    assert not [f for f in files if f.endswith((".so", ".pyc")) or "/build/" in f]
    # every file README links to (the long description names them without a repository)
    for target in re.findall(r"\]\(([^)#\s:]+)(?:#[^)]*)?\)", (REPO / "README.md").read_text()):
        assert os.path.normpath(target) in files, f"README's {target} is not in the sdist"


def test_the_wheel_build_runs_the_stand_in_tests_from_the_sdist():
    script = (REPO / "scripts" / "build-wheel").read_text()
    assert "tests/core/test_pool.py" in script and "metadata.version(dist)" in script
