# SPDX-License-Identifier: Apache-2.0
# gpu-test: alone (reads the device's figures)
"""bridge doctor / stats (bridge.tools.cli), on the stand-in driver and without any driver."""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

import bridge
from bridge._errors import format_bytes
from bridge.tools import doctor as _doctor
from bridge.tools import doctor_frameworks as _doctor_frameworks
from bridge.tools.cli import COLUMNS, main

REPO = pathlib.Path(__file__).resolve().parents[2]
MIB = 1 << 20
GIB = 1 << 30
CONFLICTING = (
    "PYTORCH_CUDA_ALLOC_CONF",
    "NUMBA_CUDA_MEMORY_MANAGER",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_ALLOCATOR",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "CUPY_GPU_MEMORY_LIMIT",
    "BRIDGE_GPU_MEMORY_LIMIT",
    "BRIDGE_PINNED_MEMORY_LIMIT",
    "BRIDGE_CACHE_LIMIT",
    "BRIDGE_PINNED_BACKEND",
)


# The distributions of the frameworks the doctor reports on (bridge.tools.doctor_frameworks).
FRAMEWORK_DIST = re.compile(
    r"torch|jax|jaxlib|jax-cuda\d+-\w+|cupy(-\w+)?|numba(-cuda)?|rmm(-cu\d+)?"
    r"|cuda-(python|bindings|core)|nvidia-.+"
)
# What a doctor in a fresh process sees of the installed distributions: these hidden.
HIDE_INSTALLED = """
from bridge.tools import doctor as _doctor
_found = _doctor.distributions
_doctor.distributions = lambda: {{n: v for n, v in _found().items() if n not in {hidden!r}}}
"""


def installed_frameworks(fake_site: str | None = None) -> set[str]:
    """The frameworks installed here, less those of a test's fake site: what the doctor's tests
    of the driver and the environment hide from it, so that a torch or jax of this
    environment (a CPU-only build draws a warning) does not change their report. CI has none."""
    fakes = set()
    if fake_site:
        for dist in importlib.metadata.distributions(path=[fake_site]):
            fakes.add(re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower())
    found = _doctor_frameworks.distributions()
    return {n for n in found if FRAMEWORK_DIST.fullmatch(n)} - fakes


def run_main(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = main(list(argv), stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def run_cli(
    *argv: str,
    env: dict | None = None,
    code: str | None = None,
    pythonpath: str | None = None,
    hide_installed: bool = True,
) -> subprocess.CompletedProcess:
    """``python -m bridge *argv`` (or ``code``) in a fresh process, without the conflicting
    variables and (``hide_installed``) with the doctor blind to the frameworks installed here
    outside ``pythonpath`` (see installed_frameworks)."""
    e = dict(os.environ)
    for name in CONFLICTING:
        e.pop(name, None)
    e.update(env or {})
    if pythonpath:
        e["PYTHONPATH"] = pythonpath + os.pathsep + e.get("PYTHONPATH", "")
    hidden = sorted(installed_frameworks(pythonpath)) if hide_installed else []
    if hidden:  # the same command, run through main with the doctor's view narrowed
        run = f"import sys; from bridge.tools.cli import main; sys.exit(main({list(argv)!r}, "
        code = HIDE_INSTALLED.format(hidden=hidden) + (code or run + "prog='python -m bridge'))")
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "bridge", *argv]
    return subprocess.run(cmd, env=e, cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.fixture
def clean_env(monkeypatch):
    """No conflicting variable, and a doctor blind to the frameworks installed here."""
    for name in CONFLICTING:
        monkeypatch.delenv(name, raising=False)
    hidden = installed_frameworks()
    if hidden:
        found = _doctor.distributions
        monkeypatch.setattr(
            _doctor, "distributions", lambda: {n: v for n, v in found().items() if n not in hidden}
        )
    return monkeypatch


@pytest.fixture
def allocations(standin):
    """3 MiB of CuPy on device 0, 5 MiB of torch on device 1, a 1 GiB budget on device 0."""
    from bridge._runtime import core

    ptrs = []
    for dev, size, tag in ((0, 3 * MIB, 1), (1, 5 * MIB, 2), (0, 7 * MIB, 2)):
        rc, p = core.alloc(dev, size, 0, tag)
        assert rc == 0 and p
        ptrs.append(p)
    bridge.pool(0).set_limit(size=GIB)
    yield
    for p in ptrs:
        core.free(p)
    bridge.pool(0).set_limit(0)


# ---- doctor ----
def test_doctor_reports_driver_gpus_and_pools(standin, clean_env):
    rc, out, err = run_main("doctor")
    assert rc == 0, err
    assert "CUDA driver 13.0 (13000)" in out  # the stand-in reports 13000
    assert "GPUs: 2" in out
    for d in (0, 1):
        assert (
            f"device {d}: Stand-in GPU {d}, compute capability 9.0; 16.00 GiB; memory pools: yes"
            in out
        )
    for fw in ("cupy", "torch", "jax", "cuda-python"):
        assert fw in out
    assert "Summary: ready" in out


def test_doctor_json_matches_the_core(standin, clean_env):
    rc, out, _ = run_main("doctor", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["driver"]["loaded"] and doc["driver"]["version"] == 13000
    assert [d["index"] for d in doc["devices"]] == [0, 1]
    for d in doc["devices"]:
        assert d["pools"] is True and d["total"] == bridge.stats(d["index"]).total == 16 * GIB
    assert doc["problems"] == []
    assert doc["bridge"]["version"] == bridge.__version__
    # the package imported: where `import bridge` found it, not the folder of its tools
    assert doc["bridge"]["path"] == str(pathlib.Path(bridge.__file__).resolve().parent)


def test_doctor_without_a_driver_exits_1_and_says_so():
    r = run_cli("doctor", env={"BRIDGE_CUDA_LIBRARY": "/nonexistent"})
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert "no usable CUDA driver" in r.stdout and "/nonexistent" in r.stdout
    last = r.stdout.strip().splitlines()[-1]
    assert last == (
        "Summary: no GPU stack here; the bridge cannot run on this machine. "
        "Exit status 1: 1 error(s) reported."
    )
    assert "Frameworks" in r.stdout  # the rest of the report still runs


def test_doctor_without_a_driver_still_counts_a_bad_variable():
    env = {"BRIDGE_CUDA_LIBRARY": "/nonexistent", "BRIDGE_CACHE_LIMIT": "abc"}
    r = run_cli("doctor", env=env)
    assert r.returncode == 1
    line = next(ln for ln in r.stdout.splitlines() if "BRIDGE_CACHE_LIMIT=abc" in ln)
    assert line.lstrip().startswith("[error]") and "fix or unset it" in line
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith(
        "Summary: no GPU stack here; the bridge cannot run on this machine; "
        "1 more thing(s) to look at above ([warn], [error])."
    )
    assert last.endswith("Exit status 1: 2 error(s) reported.")
    doc = json.loads(run_cli("doctor", "--json", env=env).stdout)
    assert doc["exit_status"] == 1
    assert [p["subject"] for p in doc["problems"]] == ["driver", "BRIDGE_CACHE_LIMIT=abc"]


def test_doctor_in_a_subprocess_on_the_standin(standin):
    r = run_cli("doctor")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert "memory pools: yes" in r.stdout and "Summary: ready" in r.stdout


def test_doctor_and_stats_with_no_gpu(standin):
    env = {"BRIDGE_STANDIN_DEVICES": "0"}
    r = run_cli("doctor", env=env)
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr
    assert "[error] GPUs: 0" in r.stdout and "sees no GPU" in r.stdout
    assert "Summary: the driver sees no GPU" in r.stdout
    r = run_cli("stats", env=env)
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr
    assert "no CUDA device" in r.stderr


def test_doctor_flags_a_device_without_pools(standin):
    code = textwrap.dedent("""
        import ctypes, os, sys
        from bridge import _runtime
        _runtime.ensure_driver()
        ctypes.CDLL(os.environ["BRIDGE_CUDA_LIBRARY"]).standin_set_pools_supported(1, 0)
        from bridge.tools.cli import main
        sys.exit(main(["doctor"]))
    """)
    r = run_cli(code=code)
    assert r.returncode == 1, r.stderr  # an [error]: a device without pools
    assert (
        "device 0: Stand-in GPU 0, compute capability 9.0; 16.00 GiB; memory pools: yes" in r.stdout
    )
    assert "device 1:" in r.stdout and "memory pools: NO" in r.stdout
    assert "the GPU runs under a virtualization or on a platform that disables them" in r.stdout
    assert "Summary: 1 thing(s) to look at" in r.stdout


@pytest.mark.parametrize(
    "name, value, words",
    [
        ("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync", "Unset it"),
        ("XLA_PYTHON_CLIENT_PREALLOCATE", "true", "refuses to start"),
        ("XLA_PYTHON_CLIENT_ALLOCATOR", "platform", "outside the shared pool"),
        ("XLA_PYTHON_CLIENT_MEM_FRACTION", ".5", "limits nothing"),
        ("CUPY_GPU_MEMORY_LIMIT", "50%", "BRIDGE_GPU_MEMORY_LIMIT"),
        ("NUMBA_CUDA_MEMORY_MANAGER", "rmm.allocators.numba", "bridge.adapters.numba"),
    ],
)
def test_doctor_flags_conflicting_env(standin, clean_env, name, value, words):
    clean_env.setenv(name, value)
    rc, out, _ = run_main("doctor")
    assert rc == 0
    line = next(ln for ln in out.splitlines() if f"{name}={value}" in ln)
    assert line.lstrip().startswith("[warn]") and words in line
    doc = json.loads(run_main("doctor", "--json")[1])
    assert [p["subject"] for p in doc["problems"]] == [f"{name}={value}"]


@pytest.mark.parametrize(
    "name, value",
    [
        ("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),
        ("XLA_PYTHON_CLIENT_PREALLOCATE", "False"),
        ("XLA_PYTHON_CLIENT_PREALLOCATE", "0"),  # JAX reads it as false
        ("XLA_PYTHON_CLIENT_ALLOCATOR", "cuda_async"),
        ("NUMBA_CUDA_MEMORY_MANAGER", "bridge.adapters.numba"),
    ],
)
def test_doctor_accepts_settings_the_bridge_wants(standin, clean_env, name, value):
    clean_env.setenv(name, value)
    doc = json.loads(run_main("doctor", "--json")[1])
    assert doc["problems"] == []


@pytest.mark.parametrize(
    "name, value, words",
    [
        ("BRIDGE_GPU_MEMORY_LIMIT", "lots", "not a valid size"),
        ("BRIDGE_PINNED_MEMORY_LIMIT", "lots", "a share of the host's memory"),
        ("BRIDGE_CACHE_LIMIT", "lots", "not a valid size"),
        ("BRIDGE_CACHE_LIMIT", "150%", "a percentage must be in (0, 100]"),
        ("BRIDGE_PINNED_BACKEND", "fast", "use one of auto, cached, mempool"),
    ],
)
def test_doctor_flags_every_bad_bridge_variable(standin, clean_env, name, value, words):
    clean_env.setenv(name, value)
    rc, out, _ = run_main("doctor")
    assert rc == 1  # an [error]: the library would raise on this value
    line = next(ln for ln in out.splitlines() if f"{name}={value}" in ln)
    assert line.lstrip().startswith("[error]") and words in line
    assert "fix or unset it" in line
    assert "Exit status 1: 1 error(s) reported." in out


@pytest.mark.parametrize(
    "name, value, words",
    [
        ("BRIDGE_CACHE_LIMIT", "2GiB", "valid: a cache of 2.00 GiB per device"),
        ("BRIDGE_CACHE_LIMIT", "0", "valid: no cache"),
        ("BRIDGE_PINNED_BACKEND", "mempool", "valid."),
        ("BRIDGE_PINNED_MEMORY_LIMIT", "1GiB", "valid: 1.00 GiB"),
        ("BRIDGE_GPU_MEMORY_LIMIT", "0.5", "valid: a budget of 8.00 GiB per device"),
    ],
)
def test_doctor_accepts_good_bridge_variables(standin, clean_env, name, value, words):
    clean_env.setenv(name, value)
    rc, out, _ = run_main("doctor")
    assert rc == 0
    assert f"[ok]    {name}={value}: {words}" in out


def test_doctor_suspects_a_misspelt_variable(standin, clean_env):
    clean_env.setenv("BRIDGE_GPU_MEMORY_LIMT", "8GiB")
    rc, out, _ = run_main("doctor")
    assert rc == 0  # a warning
    line = next(ln for ln in out.splitlines() if "BRIDGE_GPU_MEMORY_LIMT" in ln)
    assert line.lstrip().startswith("[warn]")
    assert "did you mean BRIDGE_GPU_MEMORY_LIMIT?" in line
    assert "BRIDGE_STANDIN_DEVICES" not in out  # a test's own variable is nobody's typo


def test_doctor_reads_what_the_library_reads():
    # the one table of variables (bridge/_env.py; tests/core/test_env.py walks it)
    from bridge import _env

    assert _doctor.BRIDGE_ENV == _env.NAMES
    # every variable named in the library's code: NAME_ENV = "BRIDGE_..." or getenv("BRIDGE_...")
    py = "".join(p.read_text() for p in (REPO / "bridge").glob("*.py"))
    c = "".join(p.read_text() for p in (REPO / "bridge" / "_native").glob("*.[ch]*"))
    read = set(re.findall(r'_ENV = "(BRIDGE_[A-Z_]+)"', py))
    read |= set(re.findall(r'getenv\("(BRIDGE_[A-Z_]+)"', c))
    assert read <= set(_doctor.BRIDGE_ENV)


@pytest.mark.parametrize(
    "value, level, words",
    [
        ("4194304", "ok", "valid: a share member claims 4 MiB chunks"),
        ("32MiB", "ok", "valid: a share member claims 32 MiB chunks"),
        (str(3 << 20), "error", "write a positive multiple of 2 MiB up to 1 TiB"),
        ("3MiB", "error", "it is 3.00 MiB (3145728 bytes)"),
        ("0", "error", "a positive multiple of 2 MiB"),
        ("lots", "error", "not a valid size"),
    ],
)
def test_doctor_checks_the_share_growth_as_unify_reads_it(standin, clean_env, value, level, words):
    clean_env.setenv("BRIDGE_SHARE_GROWTH", value)
    rc, out, _ = run_main("doctor")
    assert rc == (1 if level == "error" else 0)
    line = next(ln for ln in out.splitlines() if f"BRIDGE_SHARE_GROWTH={value}:" in ln)
    assert line.lstrip().startswith(f"[{level}]") and words in line, line
    from bridge import share

    if level == "error":
        with pytest.raises(ValueError, match="BRIDGE_SHARE_GROWTH"):
            share.share_growth_from_env()
    else:
        assert share.share_growth_from_env() == int(words.split()[-3]) << 20


def test_share_growth_rule_is_the_cores():
    from bridge import share

    core_src = (REPO / "bridge" / "_native" / "share.c").read_text()
    assert f"#define SHARE_UNIT     ({share.SHARE_UNIT >> 20}ull << 20)" in core_src
    assert f"#define SHARE_GROWTH   ({share.DEFAULT_SHARE_GROWTH >> 20}ull << 20)" in core_src
    assert share.MAX_SHARE_GROWTH == 1 << 40 and "(1ull << 40)" in core_src


def test_doctor_shows_a_valid_budget(standin, clean_env):
    clean_env.setenv("BRIDGE_GPU_MEMORY_LIMIT", "25%")
    rc, out, _ = run_main("doctor")
    assert "BRIDGE_GPU_MEMORY_LIMIT=25%: valid: a budget of 4.00 GiB per device" in out


def test_doctor_flags_a_budget_above_the_gpu(standin, clean_env):
    clean_env.setenv("BRIDGE_GPU_MEMORY_LIMIT", "40GiB")  # the stand-in GPUs have 16 GiB
    line = next(ln for ln in run_main("doctor")[1].splitlines() if "=40GiB" in ln)
    assert line.lstrip().startswith("[warn]") and "limits nothing" in line


def _fake_package(root: pathlib.Path, dist: str, version: str, files: dict[str, str]) -> None:
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


POISON = "raise ImportError('the doctor must not import this framework')\n"


def test_doctor_reads_frameworks_without_importing_them(standin, tmp_path):
    _fake_package(
        tmp_path,
        "torch",
        "2.11.0",
        {
            "torch/__init__.py": POISON,
            "torch/version.py": "__version__ = '2.11.0+cu130'\ncuda: Optional[str] = '13.0'\n",
            "torch/cuda/memory.py": "class CUDAPluggableAllocator:\n    pass\n",
            # read for the allocator's interface (one pure virtual the bridge implements)
            "torch/include/c10/cuda/CUDACachingAllocator.h": (
                "class CUDAAllocator : public DeviceAllocator {\n"
                "  virtual void raw_delete(void* ptr) = 0;\n};\n"
            ),
        },
    )
    _fake_package(
        tmp_path,
        "cupy-cuda13x",
        "14.2.0",
        {
            "cupy/__init__.py": POISON,
            "cupy/cuda/__init__.py": "from cupy.cuda.memory import set_allocator\n",
        },
    )
    _fake_package(tmp_path, "jax", "0.11.2", {"jax/__init__.py": POISON})
    _fake_package(tmp_path, "jaxlib", "0.11.2", {"jaxlib/__init__.py": POISON})
    _fake_package(tmp_path, "jax-cuda13-plugin", "0.11.2", {})
    code = (
        "import sys; from bridge.tools.cli import main; rc = main(['doctor']); "
        "assert not {'torch', 'cupy', 'jax', 'jaxlib'} & set(sys.modules); sys.exit(rc)"
    )
    r = run_cli(code=code, pythonpath=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "torch        2.11.0" in out and "CUDA 13.0 build; call bridge.unify" in out
    # which torch allocator, and why
    assert "torch 2.11.0+cu130 runs on the bridge's torch allocator, compiled for it" in out
    assert "cupy         14.2.0 (cupy-cuda13x)" in out and "has cupy.cuda.set_allocator" in out
    assert "jax          0.11.2 (jaxlib 0.11.2, jax-cuda13-plugin 0.11.2)" in out
    assert "has a CUDA backend" in out
    assert "Summary: ready" in out


DRIVER_13 = {"version": 13000, "version_text": "13.0"}


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    """Package files come from tmp_path (find_spec would return an imported real torch)."""

    def package_file(package: str, relative: str) -> str | None:
        path = tmp_path / package / relative
        return path.read_text() if path.is_file() else None

    monkeypatch.setattr(_doctor_frameworks, "_package_file", package_file)
    return tmp_path


def test_doctor_torch_verdicts(fake_site):
    tmp_path = fake_site
    _fake_package(
        tmp_path,
        "torch",
        "2.11.0",
        {
            "torch/__init__.py": POISON,
            "torch/version.py": "cuda = None\n",
            "torch/cuda/memory.py": "class CUDAPluggableAllocator: pass\n",
        },
    )
    fw = _doctor_frameworks._torch({"torch": "2.11.0"}, DRIVER_13)
    assert not fw.usable and "CPU-only build" in fw.findings[0].text
    (tmp_path / "torch/version.py").write_text("cuda = '12.1'\n")
    (tmp_path / "torch/cuda/memory.py").write_text("# torch 1.13\n")
    fw = _doctor_frameworks._torch({"torch": "1.13.0"}, DRIVER_13)
    assert not fw.usable and "CUDAPluggableAllocator" in fw.findings[0].text
    (tmp_path / "torch/cuda/memory.py").write_text("class CUDAPluggableAllocator: pass\n")
    (tmp_path / "torch/version.py").write_text("cuda = '14.0'\n")
    fw = _doctor_frameworks._torch({"torch": "3.0.0"}, DRIVER_13)
    major = [f for f in fw.findings if "built for CUDA 14" in f.text]
    assert fw.usable and major and major[0].level == "warn"
    assert "built for CUDA 14, but the driver supports CUDA 13.0" in major[0].text


def test_doctor_says_which_torch_allocator_will_run(fake_site, monkeypatch, tmp_path):
    from bridge.adapters import torch_build, torch_interface

    _fake_package(
        fake_site,
        "torch",
        "2.11.0",
        {
            "torch/__init__.py": POISON,
            "torch/version.py": "cuda = '13.0'\n",
            "torch/cuda/memory.py": "class CUDAPluggableAllocator: pass\n",
        },
    )
    monkeypatch.setenv("BRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("BRIDGE_TORCH_PLUGGABLE", raising=False)
    # torch's headers as torch_interface reads them (tests/adapters/test_torch_interface.py
    # reads real-shaped ones): an interface the source covers, then one it does not
    iface = torch_interface.Interface("2.11.0+cu130", tmp_path, {"allocate": True})
    monkeypatch.setattr(torch_interface, "read", lambda root=None, source=None: iface)

    def last() -> tuple[str, str]:
        f = _doctor_frameworks._torch({"torch": "2.11.0"}, DRIVER_13).findings[-1]
        return f.level, f.text

    monkeypatch.setattr(torch_build, "missing_tools", lambda: "ninja is not installed (pip x)")
    level, text = last()
    assert level == "warn" and text.startswith(
        "torch 2.11.0+cu130 would run on torch's CUDAPluggableAllocator, because the bridge's "
        "torch allocator cannot be built for it here: ninja is not installed"
    )
    monkeypatch.setattr(torch_build, "missing_tools", lambda: "")
    level, text = last()
    assert level == "ok" and text.startswith(
        "torch 2.11.0+cu130 runs on the bridge's torch allocator, compiled for it on the first "
        "unify(torch=True)"
    )
    other = tmp_path / "cache" / "bridge_torch_0123456789abcdef"  # another torch's build
    other.mkdir(parents=True)
    (other / "built-for.txt").write_text("2.10.0\nabc\n")
    assert last() == (level, text)
    ours = tmp_path / "cache" / "bridge_torch_fedcba9876543210"
    ours.mkdir()
    (ours / "built-for.txt").write_text(f"2.11.0+cu130\n{torch_build._sources_digest(iface)}\n")
    assert last() == (
        "ok",
        f"torch 2.11.0+cu130 runs on the bridge's torch allocator, built for it in {ours}.",
    )
    iface.version = "2.16.0+cu132"  # a torch the bridge does not know
    iface.unknown = ["frobnicatePools"]
    level, text = last()
    assert level == "warn" and "torch 2.16.0+cu132 would run on torch's CUDAPluggableAllocator"
    assert "does not implement: frobnicatePools" in text
    monkeypatch.setenv("BRIDGE_TORCH_PLUGGABLE", "1")
    level, text = last()
    assert level == "warn" and "BRIDGE_TORCH_PLUGGABLE is set" in text


def test_doctor_flags_two_cupy_packages_and_a_cpu_only_jax(fake_site):
    tmp_path = fake_site
    _fake_package(
        tmp_path,
        "cupy-cuda12x",
        "13.0.0",
        {"cupy/__init__.py": POISON, "cupy/cuda/__init__.py": "set_allocator = None\n"},
    )
    fw = _doctor_frameworks._cupy({"cupy-cuda12x": "13.0.0", "cupy-cuda13x": "14.0.0"}, DRIVER_13)
    assert not fw.usable
    assert "several CuPy packages" in fw.findings[0].text
    fw = _doctor_frameworks._jax({"jax": "0.11.2", "jaxlib": "0.11.2"}, DRIVER_13)
    assert not fw.usable and "no CUDA plugin" in fw.findings[0].text


def test_doctor_reads_numba_cuda_and_rmm_without_importing_them(fake_site):
    tmp_path = fake_site
    _fake_package(
        tmp_path,
        "numba-cuda",
        "0.30.4",
        {"numba/cuda/cudadrv/driver.py": "def set_memory_manager(mm_plugin): ...\n"},
    )
    fw = _doctor_frameworks._numba({"numba-cuda": "0.30.4", "numba": "0.68.1"}, DRIVER_13)
    assert (
        fw.usable and fw.version == "0.30.4" and "bridge.unify(numba=True)" in fw.findings[0].text
    )
    fw = _doctor_frameworks._numba({"numba": "0.68.1"}, DRIVER_13)
    assert not fw.installed and "numba-cuda is not installed" in fw.findings[0].text
    _fake_package(
        tmp_path, "rmm-cu13", "26.10.0", {"rmm/mr/__init__.py": "CallbackMemoryResource = 1\n"}
    )
    fw = _doctor_frameworks._rmm({"rmm-cu13": "26.10.0"}, DRIVER_13)
    assert fw.usable and "bridge.unify(rmm=True)" in fw.findings[0].text
    fw = _doctor_frameworks._rmm({"rmm-cu14": "27.0.0"}, DRIVER_13)
    assert "built for CUDA 14, but the driver supports CUDA 13.0" in fw.findings[-1].text
    (tmp_path / "rmm" / "mr" / "__init__.py").write_text("# an old RMM\n")
    fw = _doctor_frameworks._rmm({"rmm-cu13": "26.10.0"}, DRIVER_13)
    assert not fw.usable and "upgrade RMM" in fw.findings[0].text


# ---- stats ----
def _table(out: str) -> dict[int, dict[str, str]]:
    lines = [ln.split() for ln in out.splitlines() if ln.strip()]
    header = next(i for i, ln in enumerate(lines) if ln[:1] == ["device"])
    assert tuple(lines[header]) == COLUMNS
    rows = {}
    for cells in lines[header + 1 :]:
        if not cells[0].isdigit():  # the lines below the table (shares, torch:, rmm:)
            break
        # "16.00 GiB" is two words: put the numbers and their units back together
        merged, i = [cells[0]], 1
        while i < len(cells):
            if i + 1 < len(cells) and cells[i + 1] in ("B", "KiB", "MiB", "GiB", "TiB"):
                merged.append(f"{cells[i]} {cells[i + 1]}")
                i += 2
            else:
                merged.append(cells[i])
                i += 1
        rows[int(merged[0])] = dict(zip(COLUMNS, merged, strict=True))
    return rows


def test_stats_table_matches_bridge_stats(allocations):
    rc, out, err = run_main("stats")
    assert rc == 0, err
    rows = _table(out)
    assert sorted(rows) == [0, 1]
    for d, row in rows.items():
        s = bridge.stats(d)
        for fw in ("cupy", "torch", "jax", "other"):
            assert row[fw] == format_bytes(s.by_framework[fw])
        assert row["used"] == format_bytes(s.used)
        assert row["reserved"] == format_bytes(s.reserved)
        assert row["peak"] == format_bytes(s.peak_used)
        assert row["total"] == format_bytes(s.total) == "16.00 GiB"
        assert row["budget"] == (format_bytes(s.limit) if s.limit else "none")
    assert rows[0]["cupy"] == "3.00 MiB" and rows[0]["torch"] == "7.00 MiB"
    assert rows[1]["torch"] == "5.00 MiB" and rows[0]["budget"] == "1.00 GiB"
    assert rows[1]["budget"] == "none"


def test_stats_json_matches_bridge_stats(allocations):
    rc, out, _ = run_main("stats", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert [d["device"] for d in doc["devices"]] == [0, 1]
    for d in doc["devices"]:
        assert d == json.loads(json.dumps(bridge.stats(d["device"]).as_dict()))
    assert doc["devices"][0]["by_framework"]["cupy"] == 3 * MIB
    assert doc["devices"][0]["limit"] == GIB


def test_stats_one_device(allocations):
    rc, out, _ = run_main("stats", "--device", "1", "--json")
    assert [d["device"] for d in json.loads(out)["devices"]] == [1]
    assert run_main("stats", "--device", "7")[0] == 1


def test_stats_watch_refreshes_count_times(allocations):
    rc, out, _ = run_main("stats", "--watch", "0.01", "--count", "3", "--json")
    assert rc == 0
    docs = [json.loads(ln) for ln in out.splitlines()]
    assert len(docs) == 3 and docs[0]["time"] <= docs[1]["time"] <= docs[2]["time"]
    rc, out, _ = run_main("stats", "--watch", "0.01", "--count", "2")
    assert rc == 0 and out.count("bridge pool figures") == 2


def test_stats_watch_stops_on_ctrl_c(allocations, monkeypatch):
    import bridge.tools.cli as cli

    def interrupt(_seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.time, "sleep", interrupt)
    rc, out, _ = run_main("stats", "--watch")
    assert rc == 0 and out.count("bridge pool figures") == 1


def test_stats_without_a_driver_exits_1_with_a_sentence():
    r = run_cli("stats", env={"BRIDGE_CUDA_LIBRARY": "/nonexistent"})
    assert r.returncode == 1
    assert "Traceback" not in r.stdout + r.stderr
    assert r.stderr.startswith("bridge stats: ") and "no usable CUDA driver" in r.stderr


def test_stats_with_a_bad_budget_variable(standin):
    r = run_cli("stats", env={"BRIDGE_GPU_MEMORY_LIMIT": "lots"})
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "BRIDGE_GPU_MEMORY_LIMIT='lots'" in r.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["stats", "--watch", "0"],
        ["stats", "--count", "0"],
        ["stats", "--watch", "soon"],
        ["frobnicate"],
    ],
)
def test_usage_errors_exit_2(argv, capsys):
    assert main(argv) == 2


def test_no_command_prints_help():
    rc, out, _ = run_main()
    assert rc == 2 and "doctor" in out and "stats" in out


@pytest.mark.gpu
def test_doctor_and_stats_on_a_gpu():
    r = run_cli("doctor", hide_installed=False)  # the frameworks of the GPU machine too
    assert r.returncode == 0 and "memory pools: yes" in r.stdout
    assert "name unavailable" not in r.stdout  # the real driver names its GPUs
    r = run_cli("stats", "--json")
    assert r.returncode == 0
    assert all(d["total"] > 0 for d in json.loads(r.stdout)["devices"])


# ---- how it is run ----
def test_usage_names_the_way_it_was_run(tmp_path):
    r = run_cli("--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m bridge ")
    assert "exit status: 0 all is well; 1 doctor reported an [error]" in " ".join(r.stdout.split())
    # the `bridge` console script runs bridge.tools.cli:main with argv[0] ending in /bridge
    code = (
        "import sys; sys.argv = ['/somewhere/bin/bridge', '--help']; "
        "from bridge.tools.cli import main; sys.exit(main())"
    )
    r = run_cli(code=code)
    assert r.returncode == 0 and r.stdout.startswith("usage: bridge ")
    script = pathlib.Path(sys.executable).parent / "bridge"
    if script.exists():  # the installed script itself
        r = subprocess.run([str(script), "doctor", "--help"], capture_output=True, text=True)
        assert r.stdout.startswith("usage: bridge doctor"), r.stdout + r.stderr


def test_entry_point_is_the_tools_cli_main_and_bridge_cli_stays_its_door():
    scripts = (REPO / "pyproject.toml").read_text().split("[project.scripts]")[1]
    assert scripts.split("[")[0].strip() == 'bridge = "bridge.tools.cli:main"'
    import bridge.cli
    import bridge.tools.cli

    assert bridge.cli.main is bridge.tools.cli.main  # the documented bridge.cli.main([...])


def test_a_closed_pipe_ends_quietly(standin):
    # `bridge stats --watch 0.01 | head -2`: the reader goes away after two lines
    e = dict(os.environ)
    proc = subprocess.Popen(
        [sys.executable, "-m", "bridge", "stats", "--watch", "0.01", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=e,
        cwd=REPO,
    )
    assert proc.stdout is not None and proc.stderr is not None
    lines = [proc.stdout.readline() for _ in range(2)]
    proc.stdout.close()
    rc = proc.wait(timeout=60)
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert all(json.loads(ln)["devices"] for ln in lines)
    assert rc == 1 and err == ""  # CPython's convention for EPIPE, without a traceback


def test_a_broken_pipe_inside_a_program_returns_1():
    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    assert main(["doctor"], stdout=Closed()) == 1


def test_the_cli_inside_a_program_as_the_docs_show(allocations):
    r = run_cli(code="import bridge, sys; sys.exit(bridge.cli.main(['stats', '--json']))")
    assert r.returncode == 0, r.stderr
    assert [d["device"] for d in json.loads(r.stdout)["devices"]] == [0, 1]
    # python -m bridge keeps its old names
    from bridge import __main__ as dunder_main

    assert dunder_main.main is main and dunder_main.COLUMNS is COLUMNS


# ---- CUDA majors of the frameworks together ----
@pytest.mark.parametrize(
    "dists, torch_cuda, expected",
    [
        ({}, None, {}),
        ({"cupy-cuda12x": "13.0"}, None, {12: ["cupy-cuda12x"]}),
        ({"cupy-cuda117": "11.0"}, None, {11: ["cupy-cuda117"]}),
        (
            {"cupy-cuda12x": "1", "jax-cuda12-plugin": "1", "nvidia-cublas-cu12": "1"},
            "12.8",
            {
                12: [
                    "cupy-cuda12x",
                    "jax-cuda12-plugin",
                    "torch (CUDA 12.8)",
                    "nvidia-*-cu12 (1 package)",
                ]
            },
        ),
        (
            {"cupy-cuda12x": "1", "nvidia-cublas-cu13": "1", "nvidia-cudnn-cu13": "1"},
            "13.0",
            {
                12: ["cupy-cuda12x"],
                13: ["torch (CUDA 13.0)", "nvidia-*-cu13 (2 packages)"],
            },
        ),
        ({"jax-cuda13-pjrt": "1", "numpy": "2"}, None, {13: ["jax-cuda13-pjrt"]}),
    ],
)
def test_cuda_majors_from_metadata(dists, torch_cuda, expected):
    assert _doctor.cuda_majors(dists, torch_cuda) == expected


def test_doctor_warns_about_two_cuda_majors(standin, tmp_path):
    # what the old `pip install -e '.[torch,cupy]'` gave: torch for CUDA 13, CuPy for CUDA 12
    _fake_package(
        tmp_path,
        "torch",
        "2.11.0",
        {
            "torch/__init__.py": POISON,
            "torch/version.py": "__version__ = '2.11.0'\ncuda: Optional[str] = '13.0'\n",
            "torch/cuda/memory.py": "class CUDAPluggableAllocator:\n    pass\n",
            # the C++ headers a CUDA wheel ships: the allocator can be built for it
            "torch/include/c10/cuda/CUDACachingAllocator.h": (
                "class CUDAAllocator : public DeviceAllocator {\n"
                " public:\n  virtual std::string name() = 0;\n};\n"
            ),
        },
    )
    _fake_package(
        tmp_path,
        "cupy-cuda12x",
        "14.2.0",
        {
            "cupy/__init__.py": POISON,
            "cupy/cuda/__init__.py": "from cupy.cuda.memory import set_allocator\n",
        },
    )
    _fake_package(tmp_path, "nvidia-cublas-cu13", "13.0.0", {})
    r = run_cli("doctor", pythonpath=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr  # a warning, not an error
    line = next(ln for ln in r.stdout.splitlines() if "CUDA versions" in ln)
    assert line.lstrip().startswith("[warn]")
    assert "(CUDA 12: cupy-cuda12x; CUDA 13: torch (CUDA 13.0), nvidia-*-cu13 (1 package))" in line
    assert "for CUDA 13, pip install cupy-cuda13x torch 'jax[cuda13]'" in line
    assert "for CUDA 12, pip install cupy-cuda12x 'jax[cuda12]' and pip install torch " in line
    assert "--index-url https://download.pytorch.org/whl/cu129" in line
    assert "Summary: 1 thing(s) to look at above" in r.stdout


@pytest.mark.parametrize(
    "line_fn, prefix, key, words",
    [
        ("_torch_allocator_line", "torch: ", "torch_allocator", "the bridge's torch allocator: x"),
        ("_rmm_resource_line", "rmm: ", "rmm_resource", "the bridge's C++ RMM resource: x"),
    ],
)
def test_stats_says_which_torch_allocator_and_rmm_resource_run(
    allocations, monkeypatch, line_fn, prefix, key, words
):
    from bridge.tools import cli

    monkeypatch.setattr(cli, line_fn, lambda: None)  # the framework is not installed
    rc, out, _ = run_main("stats")
    assert rc == 0 and not any(line.startswith(prefix) for line in out.splitlines())
    assert key not in json.loads(run_main("stats", "--json")[1])
    monkeypatch.setattr(cli, line_fn, lambda: words)
    rc, out, _ = run_main("stats")
    assert rc == 0 and prefix + words in out.splitlines()
    doc = json.loads(run_main("stats", "--json")[1])
    assert doc[key] == words


def test_build_rmm_says_where_the_module_is_or_why_not(monkeypatch):
    from bridge.adapters import rmm_build

    monkeypatch.setattr(rmm_build, "version", lambda: "26.10.00")

    def failed(**kw):
        rmm_build.reason = "Cython is not installed (pip install cython)"

    monkeypatch.setattr(rmm_build, "load", failed)
    rc, out, _ = run_main("build-rmm")
    assert rc == 1 and "resource is not available: Cython is not installed" in out
    assert "would use RMM's CallbackMemoryResource" in out
    monkeypatch.setattr(rmm_build, "load", lambda **kw: object())
    monkeypatch.setattr(rmm_build, "built_from_cache", False)
    monkeypatch.setattr(rmm_build, "build_seconds", 6.04)
    monkeypatch.setattr(rmm_build, "location", "/cache/bridge_rmm_x")
    rc, out, _ = run_main("build-rmm")
    assert rc == 0 and out.strip() == (
        "the bridge's C++ RMM resource for RMM 26.10.00: built in 6.0 s, in /cache/bridge_rmm_x"
    )


def test_doctor_says_where_a_cuda12_torch_comes_from(standin, tmp_path):
    _fake_package(
        tmp_path,
        "cupy-cuda12x",
        "14.2.0",
        {
            "cupy/__init__.py": POISON,
            "cupy/cuda/__init__.py": "from cupy.cuda.memory import set_allocator\n",
        },
    )
    r = run_cli("doctor", pythonpath=str(tmp_path))
    if not re.search(r"^\s+torch\s+not installed", r.stdout, re.M):
        pytest.skip("torch is installed here")
    line = next(ln for ln in r.stdout.splitlines() if "torch for CUDA 12" in ln)
    assert line.lstrip().startswith("[info]")
    assert "pip install torch --index-url https://download.pytorch.org/whl/cu129" in line
