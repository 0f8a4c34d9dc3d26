# SPDX-License-Identifier: Apache-2.0
"""Build and load the bridge's RMM resource in C++ (``_rmm_resource.pyx``) for the installed RMM.

``BridgeResource`` is an ``rmm.mr.DeviceMemoryResource`` (RMM's Cython class,
whose C++ resource RMM's ``DeviceBuffer`` calls without Python) holding an
``rmm::mr::callback_memory_resource`` whose callbacks are C functions calling
the core, so it is compiled against the Cython declarations and C++ headers of
the RMM that runs: on the first ``bridge.unify(rmm=True)`` (or ``python -m
bridge build-rmm``), into the cache the torch allocator uses (``native_build``),
keyed by the source, the core's headers, RMM's declarations and version,
Python's version and platform, and Cython's version; loaded from there on
every later start without a compiler or Cython.

What the build needs: Cython (``pip install cython``; the ``rmm`` extra
installs it), a C++17 compiler (g++ or clang++), Python's headers, RMM's
wheels as RMM installs them (``librmm``'s headers with their CCCL, its
``librmm.so``; ``cuda-bindings``' Cython declarations) and CUDA's runtime
headers (``cuda_runtime_api.h``: from a CUDA toolkit, ``CUDA_HOME``,
``/usr/local/cuda``, or the ``nvidia/*/include`` wheels). Where it cannot run,
:func:`load` returns ``None`` with the reason in :data:`reason`, and the RMM
adapter falls back to RMM's ``CallbackMemoryResource`` over the core's C
callables. Imports no framework until :func:`load` loads the module.
"""

from __future__ import annotations

__all__ = [
    "CALLBACK_ENV",
    "FALLBACK_COSTS",
    "VARIABLES",
    "built_from_cache",
    "cached_builds",
    "callback_from_env",
    "describe",
    "key",
    "load",
    "location",
    "missing_tools",
    "reason",
    "version",
]

import contextlib
import importlib
import importlib.metadata as metadata
import io
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any

from .native_build import (
    NO_CUDA_HEADERS,
    build_timed,
    cache_dir,
    cached,
    core_headers,
    cuda_include_dirs,
    cxx,
    describe_build,
    digest,
    flag_from_env,
    has_cuda_headers,
    import_built,
    switch_variable,
)

#: ``1``: use RMM's ``CallbackMemoryResource`` even where the C++ resource builds.
CALLBACK_ENV = "BRIDGE_RMM_CALLBACK"

_HERE = Path(__file__).resolve().parent
SOURCE = _HERE / "_rmm_resource.pyx"
_PREFIX = "bridge_rmm_"
# What the module compiles against, relative to a folder on sys.path (RMM's wheels).
_DECLARATIONS = (
    "rmm/pylibrmm/memory_resource/_memory_resource.pxd",  # DeviceMemoryResource's layout
    "rmm/librmm/memory_resource.pxd",  # callback_memory_resource, the exception handles
    "rmm/librmm/cuda_stream_ref.pxd",
)
# What the module's source needs of them: an RMM without these is one it cannot build on.
_API = (
    (_DECLARATIONS[0], r"optional\[device_async_resource_ref\]\s+c_ref", "c_ref"),
    (_DECLARATIONS[1], r"cppclass\s+callback_memory_resource\b", "callback_memory_resource"),
    (
        _DECLARATIONS[1],
        r"make_device_async_resource_ref\(\s*callback_memory_resource&\s*\)",
        "make_device_async_resource_ref(callback_memory_resource&)",
    ),
    (_DECLARATIONS[1], r"\bthrow_cpp_except\b", "throw_cpp_except"),
    # new in RMM 26.10: 26.02 to 26.08 have no cuda_stream_ref.pxd
    (_DECLARATIONS[2], r"\bstream_ref\b", "stream_ref"),
)
_RMM_HEADER = "librmm/include/rmm/mr/callback_memory_resource.hpp"
_CCCL = "librmm/include/rapids"  # the CCCL RMM was built with (cuda/stream, cuda/memory_resource)
_LIBRMM = "librmm/lib64/librmm.so"
_LOGGER = "rapids_logger/include"
_CUDA_BINDINGS = "cuda/bindings/cyruntime.pxd"  # RMM's declarations cimport it

#: Why the C++ resource is not available (empty when it is).
reason = ""
#: Whether the last :func:`load` found the module built already.
built_from_cache = False
#: Seconds the last build took (0 when it came from the cache).
build_seconds = 0.0
#: The cache folder the module lives in (after :func:`load` found or built it).
location = ""


def callback_from_env() -> bool:
    """Whether ``BRIDGE_RMM_CALLBACK`` asks for RMM's ``CallbackMemoryResource``.

    Unset, empty or ``0``: no; ``1``: yes; anything else raises ``ValueError``
    naming the variable.
    """
    return flag_from_env(
        CALLBACK_ENV,
        "runs RMM on RMM's CallbackMemoryResource instead of the bridge's C++ RMM resource",
    )


#: The variables this module reads, as rows of bridge._env's table (``name, who, read,
#: describe``; frameworks.py's rmm row points it here).
VARIABLES: tuple[tuple[str, str, Any, Any], ...] = (
    switch_variable(
        CALLBACK_ENV,
        "bridge.unify(rmm=True) raises ValueError on it",
        callback_from_env,
        "RMM runs on RMM's CallbackMemoryResource, not the bridge's C++ resource.",
        "valid: RMM runs on the bridge's C++ RMM resource where it builds.",
    ),
)


def _on_path(relative: str) -> Path | None:
    """``relative`` under the first folder of ``sys.path`` that has it (no import)."""
    for entry in sys.path:
        path = Path(entry or ".") / relative
        if path.exists():
            return path
    return None


def _root(relative: str) -> Path | None:
    """The folder of ``sys.path`` holding ``relative``."""
    path = _on_path(relative)
    return None if path is None else Path(str(path)[: -len(relative)])


def _text(relative: str) -> str:
    path = _on_path(relative)
    try:
        return path.read_text().strip() if path is not None else ""
    except OSError:
        return ""


def version() -> str:
    """The installed RMM's version, read from its files (empty when none is found)."""
    return _text("rmm/VERSION") or _metadata_version("rmm-cu13", "rmm-cu12", "rmm")


def _metadata_version(*names: str) -> str:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return ""


def _cython_version() -> str:
    """The installed Cython's version; empty when Cython is not installed."""
    found = _metadata_version("cython")
    if found:
        return found
    try:
        import Cython
    except ImportError:
        return ""
    return str(getattr(Cython, "__version__", ""))


def key() -> str:
    """What the built module depends on at run time, as one short hash.

    The module's name adds Cython's version (``bridge_rmm_<key>_cy<version>``):
    a start without Cython loads what any Cython built for this key.
    """
    files = [SOURCE, *core_headers()]
    files += [p for p in (_on_path(d) for d in _DECLARATIONS) if p is not None]
    return digest(files, [version(), _text("librmm/VERSION")])


def _name(cython_version: str) -> str:
    return f"{_PREFIX}{key()}_cy{re.sub(r'[^0-9A-Za-z]', '', cython_version)}"


def _api_problem() -> str:
    """What the installed RMM lacks of what the module compiles against (empty: nothing)."""
    for relative, pattern, what in _API:
        path = _on_path(relative)
        if path is None:
            return (
                f"RMM's Cython declarations ({relative}) were not found: RMM is not installed "
                "here, or is older than 26.10, the first with them"
            )
        if not re.search(pattern, path.read_text(errors="replace")):
            return (
                f"this RMM ({version() or 'unknown version'}) does not declare what the "
                f"bridge's resource is built on ({what} in {relative})"
            )
    return ""


def _python_include() -> list[str]:
    paths = sysconfig.get_paths()
    return list(dict.fromkeys(p for p in (paths.get("include"), paths.get("platinclude")) if p))


def missing_tools() -> str:
    """What the build lacks, in words (empty when nothing); imports no framework."""
    problem = _api_problem()
    if problem:
        return problem
    if not _cython_version():
        return "Cython is not installed (pip install cython)"
    if cxx() is None:
        return "no C++ compiler (install g++ or clang++)"
    if not any(os.path.isfile(os.path.join(d, "Python.h")) for d in _python_include()):
        return (
            f"Python's headers (Python.h) were not found in {_python_include()}: install "
            "Python's development package"
        )
    for relative, what in (
        (_RMM_HEADER, "librmm's C++ headers"),
        (_CCCL + "/cuda/stream", "the CCCL headers librmm ships"),
        (_LIBRMM, "librmm.so"),
        (_CUDA_BINDINGS, "cuda-bindings' Cython declarations"),
    ):
        if _on_path(relative) is None:
            return (
                f"{what} ({relative}) were not found: install RMM's wheels (pip install rmm-cu13)"
            )
    if not has_cuda_headers():
        return NO_CUDA_HEADERS
    return ""


def _first_error(text: str) -> str:
    """The first line of a compiler's output that names an error, else its last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if re.search(r"\berror\b", line, re.I):
            return line
    return lines[-1] if lines else "no output"


def _compile(name: str, stage: Path, verbose: bool) -> None:
    """Cython, then the C++ compiler: ``stage/<name><EXT_SUFFIX>``; raises with the error."""
    from Cython.Compiler import Main

    pyx = stage / f"{name}.pyx"
    shutil.copyfile(SOURCE, pyx)
    cpp = stage / f"{name}.cpp"
    roots = [_root(d) for d in (_DECLARATIONS[0], _CUDA_BINDINGS)]
    options = Main.CompilationOptions(
        Main.default_options,
        cplus=True,
        language_level=3,
        include_path=[str(r) for r in dict.fromkeys(roots) if r is not None],
        output_file=str(cpp),
    )
    said = io.StringIO()
    with contextlib.redirect_stderr(said):  # kept either way: a failure names its first error
        try:
            result = Main.compile(str(pyx), options)
            failed = result.num_errors > 0
        except Exception as exc:  # noqa: BLE001 - Cython's CompileError and the like
            said.write(f"{type(exc).__name__}: {exc}\n")
            failed = True
    if verbose:
        sys.stderr.write(said.getvalue())
    if failed or not cpp.is_file():
        raise RuntimeError("Cython: " + _first_error(said.getvalue()))
    librmm = _on_path(_LIBRMM)
    assert librmm is not None  # missing_tools checked it
    libdir = str(librmm.parent)
    includes = [_on_path(p) for p in ("librmm/include", _CCCL, _LOGGER)]
    # RMM's headers and its own CCCL first: a toolkit's CCCL must not stand in for them
    dirs = [str(p) for p in includes if p is not None] + cuda_include_dirs() + _python_include()
    out = stage / f"{name}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    compiler = cxx()
    assert compiler is not None  # missing_tools checked it
    cmd = [compiler, "-shared", "-fPIC", "-std=c++17", "-O2", "-g0", "-w"]
    cmd += [f"-I{d}" for d in dirs]
    cmd += [str(cpp), "-o", str(out), f"-L{libdir}", "-lrmm", f"-Wl,-rpath,{libdir}", "-s"]
    if verbose:
        print(" ".join(cmd), file=sys.stderr, flush=True)
    # captured either way: a failure's reason is the first error the compiler wrote
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if verbose:
        sys.stderr.write(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(compiler).name}: " + _first_error(done.stderr or ""))


def _from_cache(cython_version: str) -> tuple[ModuleType | None, Path]:
    """The module built for this key (by this Cython, or any where Cython is not installed)."""
    if cython_version:
        folder = cache_dir() / _name(cython_version)
        return import_built(folder.name, folder), folder
    for folder in sorted(cached(f"{_PREFIX}{key()}_cy"), key=lambda p: p.stat().st_mtime)[::-1]:
        module = import_built(folder.name, folder)
        if module is not None:
            return module, folder
    return None, cache_dir() / f"{_PREFIX}{key()}_cy"


def load(*, build: bool = True, verbose: bool = False) -> ModuleType | None:
    """The compiled RMM resource module, built first if needed; ``None`` with :data:`reason`.

    Parameters
    ----------
    build
        Compile when the cache has no module for this RMM (the first start);
        ``False`` only looks in the cache.
    verbose
        Show Cython's and the compiler's output.
    """
    global reason, built_from_cache, build_seconds, location
    if os.environ.get(CALLBACK_ENV, "").strip() not in ("", "0"):
        reason = f"{CALLBACK_ENV}={os.environ[CALLBACK_ENV]} asks for RMM's CallbackMemoryResource"
        return None
    problem = _api_problem()
    if problem:
        reason = problem
        return None
    try:  # loads librmm.so and rapids_logger's library, which the module links against
        importlib.import_module("rmm")
    except Exception as exc:  # noqa: BLE001 - an RMM that cannot start: the fallback says so
        reason = f"rmm cannot be imported ({type(exc).__name__}: {exc})"
        return None
    cython_version = _cython_version()
    try:
        module, folder = _from_cache(cython_version)
    except Exception as exc:  # noqa: BLE001 - a module this RMM cannot load: say so
        reason = f"loading it failed: {type(exc).__name__}: {exc}"
        return None
    if module is not None:
        reason, built_from_cache, build_seconds, location = "", True, 0.0, str(folder)
        return module
    if not build:
        reason = f"not built yet for RMM {version()} (in {folder})"
        return None
    problem = missing_tools()
    if problem:
        reason = problem
        return None

    def build_into(stage: Path) -> ModuleType:
        _compile(folder.name, stage, verbose)
        module = import_built(folder.name, stage)
        if module is None:
            raise RuntimeError(f"the compiler wrote no module in {stage}")
        return module

    banner = (
        f"bridge: compiling its RMM resource for RMM {version()} (once, about 10 s; kept in "
        f"{folder.parent})"
    )
    module, reason, seconds = build_timed(folder, banner, build_into)
    if module is None:
        return None
    build_seconds, built_from_cache, location = seconds, False, str(folder)
    return module


#: What the callback fallback costs, said by doctor, stats and unify's warning.
FALLBACK_COSTS = (
    "RMM's Python wrapper takes the GIL and makes a Stream object per allocation and free "
    "(a DeviceBuffer cost 1.16-1.41x what it costs on RMM's CudaAsyncMemoryResource on an "
    "H200)"
)
_FALLBACK = (
    f"RMM would run on RMM's CallbackMemoryResource over the core's C callables ({FALLBACK_COSTS})"
)


def describe() -> tuple[str, str]:
    """Which RMM resource ``unify(rmm=True)`` will install here, and why: (level, words).

    The level is doctor's (``"ok"`` or ``"warn"``); imports no framework.
    """
    return describe_build(
        "the bridge's C++ RMM resource",
        (CALLBACK_ENV, callback_from_env),
        _FALLBACK,
        _api_problem(),
        cached_builds(),
        missing_tools(),
        "one for another RMM is compiled on the first unify(rmm=True).",
        "for this RMM on the first unify(rmm=True) (about 10 s, once); "
        "`python -m bridge build-rmm` does it now.",
    )


def cached_builds() -> list[Path]:
    """The RMM resources built so far (one folder per RMM, source and Cython version)."""
    return cached(_PREFIX)
