# SPDX-License-Identifier: Apache-2.0
"""Build and load the bridge's torch allocator (``_torch_allocator.cpp``) for the installed torch.

The C++ class implements torch's whole ``CUDAAllocator`` interface, so it is
compiled against the headers of the torch that runs: on the first
``bridge.unify(torch=True)`` (or ``python -m bridge build-torch``) with torch's
own extension builder, into a cache keyed by everything the binary depends on
(the sources, torch's version, its C++ ABI, its CUDA version, Python's), and
loaded from there on every later start without a compiler.

What the build needs: a C++ compiler (g++ or clang++), ``ninja`` (``pip install
ninja``) and CUDA's runtime headers (``cuda_runtime_api.h``), which torch's
headers include: from a CUDA toolkit (``CUDA_HOME``, ``/usr/local/cuda``) or
from the NVIDIA wheels torch installs (``nvidia/*/include``).  Where the build
cannot run, :func:`load` returns ``None`` with the reason in :data:`reason`,
and the torch adapter falls back to torch's ``CUDAPluggableAllocator``.
"""

from __future__ import annotations

__all__ = [
    "VARIABLES",
    "cache_dir",
    "cuda_include_dirs",
    "describe",
    "key",
    "load",
    "reason",
    "built_from_cache",
    "location",
]

import glob
import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from types import ModuleType
from typing import Any

#: The folder of built torch allocators (default ``~/.cache/bridge``).
CACHE_DIR_ENV = "BRIDGE_CACHE_DIR"
#: ``1``: use torch's ``CUDAPluggableAllocator`` even where the C++ allocator builds.
PLUGGABLE_ENV = "BRIDGE_TORCH_PLUGGABLE"

_HERE = Path(__file__).resolve().parent
SOURCES = [_HERE / "_torch_allocator.cpp", _HERE / "_torch_history.cpp"]
HEADER = _HERE / "_torch_allocator.h"
# the core's entry points it calls by name (compiled into bridge._core from _torch_abi.cpp)
ABI_HEADER = _HERE / "_torch_abi.h"
_NATIVE = _HERE.parent / "_native"  # installed layout: bridge/adapters -> bridge/_native
_HEADER_NAME = "bridge.h"

#: Why the C++ allocator is not available (empty when it is).
reason = ""
#: Whether the last :func:`load` found the module built already.
built_from_cache = False
#: Seconds the last build took (0 when it came from the cache).
build_seconds = 0.0
#: The cache folder the module lives in (after :func:`load` found or built it).
location = ""


def _native_dir() -> Path:
    """Where ``bridge.h`` lives: beside the package (installed) or in the checkout."""
    for candidate in (_NATIVE, _HERE.parent / "bridge" / "_native"):
        if (candidate / _HEADER_NAME).is_file():
            return candidate
    import bridge

    return Path(bridge.__file__).resolve().parent / "_native"


def pluggable_from_env() -> bool:
    """Whether ``BRIDGE_TORCH_PLUGGABLE`` asks for torch's ``CUDAPluggableAllocator``.

    Unset, empty or ``0``: no; ``1``: yes; anything else raises ``ValueError``
    naming the variable.
    """
    raw = os.environ.get(PLUGGABLE_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(
            f"{PLUGGABLE_ENV}={os.environ[PLUGGABLE_ENV]!r} is not 0 or 1: 1 runs torch on "
            "torch's CUDAPluggableAllocator instead of the bridge's torch allocator; unset it "
            "or write 0 for the bridge's."
        )
    return raw == "1"


def cache_dir() -> Path:
    """The folder of built torch allocators: ``$BRIDGE_CACHE_DIR``, else ``~/.cache/bridge``."""
    root = os.environ.get(CACHE_DIR_ENV, "").strip()
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "bridge"


#: The variables this module reads, as rows of bridge._env's table (``name, who, read,
#: describe``; frameworks.py's torch row points it here): ``bridge doctor`` checks them
#: with these very readers.
VARIABLES: tuple[tuple[str, str, Any, Any], ...] = (
    (
        PLUGGABLE_ENV,
        "bridge.unify(torch=True) raises ValueError on it",
        lambda t: pluggable_from_env(),
        lambda v, t: (
            ("info", "torch runs on torch's CUDAPluggableAllocator, not the bridge's own.")
            if v
            else ("ok", "valid: torch runs on the bridge's own torch allocator where it builds.")
        ),
    ),
    (
        CACHE_DIR_ENV,
        "the bridge's torch allocator is built and kept there",
        lambda t: str(cache_dir()),
        lambda v, t: ("info", f"the bridge's torch allocator is built and kept in {v}."),
    ),
)


def cuda_include_dirs() -> list[str]:
    """Folders holding CUDA's runtime headers, toolkit first, then the NVIDIA wheels."""
    found: list[str] = []
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    if "torch" in sys.modules:  # torch's own guess, where torch is loaded already
        try:
            from torch.utils.cpp_extension import CUDA_HOME

            roots.append(CUDA_HOME)
        except ImportError:  # a torch without the extension builder
            pass
    roots.append("/usr/local/cuda")
    for root in roots:
        if root and os.path.isfile(os.path.join(root, "include", "cuda_runtime_api.h")):
            found.append(os.path.join(root, "include"))
            break
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        for inc in sorted(glob.glob(os.path.join(base, "*", "include"))):
            if os.path.isdir(inc) and inc not in found:
                found.append(inc)
    return found


def _torch() -> Any:
    import torch

    return torch


def key() -> str:
    """What the built module depends on, as one short hash (the cache's folder name)."""
    torch = _torch()
    h = hashlib.sha256()
    for path in (*SOURCES, HEADER, ABI_HEADER):
        h.update(path.read_bytes())
    h.update((_native_dir() / _HEADER_NAME).read_bytes())
    h.update((_native_dir() / "frameworks.h").read_bytes())  # the tags bridge.h includes
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    for part in (
        torch.__version__,
        str(torch.version.cuda),
        str(abi),
        sys.version,
        sysconfig.get_platform(),
    ):
        h.update(part.encode())
    return h.hexdigest()[:16]


def _import(name: str, folder: Path) -> ModuleType | None:
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    for path in (folder / f"{name}{suffix}", folder / f"{name}.so"):
        if path.is_file():
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    return None


def load(*, build: bool = True, verbose: bool = False) -> ModuleType | None:
    """The compiled torch allocator module, built first if needed; ``None`` with :data:`reason`.

    Parameters
    ----------
    build
        Compile when the cache has no module for this torch (the first start);
        ``False`` only looks in the cache.
    verbose
        Show the compiler's output.
    """
    global reason, built_from_cache, build_seconds, location
    torch = _torch()
    if os.environ.get(PLUGGABLE_ENV, "").strip() not in ("", "0"):
        reason = (
            f"{PLUGGABLE_ENV}={os.environ[PLUGGABLE_ENV]} asks for torch's CUDAPluggableAllocator"
        )
        return None
    name = f"bridge_torch_{key()}"
    folder = cache_dir() / name
    module = _import(name, folder)
    if module is not None:
        reason, built_from_cache, build_seconds, location = "", True, 0.0, str(folder)
        return module
    if not build:
        reason = f"not built yet for torch {torch.__version__} (in {folder})"
        return None
    problem = missing_tools()
    if problem:
        reason = problem
        return None
    from torch.utils import cpp_extension

    # Built beside the cache's folder and renamed into place when complete, so
    # a process starting meanwhile never imports a half-written module.
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.parent / f"{name}.building-{os.getpid()}"
    staging.mkdir(exist_ok=True)
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    print(
        f"bridge: compiling its torch allocator for torch {torch.__version__} (once, about 30 s; "
        f"kept in {folder.parent})",
        file=sys.stderr,
        flush=True,
    )
    start = time.perf_counter()
    try:
        module = cpp_extension.load(
            name=name,
            sources=[str(p) for p in SOURCES],
            extra_include_paths=[str(_native_dir()), *cuda_include_dirs()],
            extra_cflags=["-O2", "-g0"],
            extra_ldflags=[f"-L{torch_lib}", "-lc10_cuda", "-ltorch_cuda", "-s"],
            build_directory=str(staging),
            with_cuda=False,
            verbose=verbose,
        )
    except Exception as exc:  # noqa: BLE001 - any build failure means: fall back
        shutil.rmtree(staging, ignore_errors=True)
        text = [line for line in str(exc).strip().splitlines() if line.strip()]
        reason = "building it failed: " + (text[-1] if text else type(exc).__name__)
        return None
    build_seconds = time.perf_counter() - start
    try:
        os.replace(staging, folder)
    except OSError:  # another process put its build there first: keep theirs
        shutil.rmtree(staging, ignore_errors=True)
    reason, built_from_cache, location = "", False, str(folder)
    return module


#: What the pluggable fallback lacks, said by doctor, stats and unify's warning.
FALLBACK_LACKS = (
    "an OOM is a plain RuntimeError, and cudnn.benchmark, torch.cuda.MemPool, CUDA graph "
    "trees and CUDA IPC do not work"
)
_FALLBACK = f"torch would run on torch's CUDAPluggableAllocator ({FALLBACK_LACKS})"


def describe() -> tuple[str, str]:
    """Which torch allocator ``unify(torch=True)`` will install here, and why: (level, words).

    The level is doctor's (``"ok"`` or ``"warn"``); imports no framework.
    """
    try:
        pluggable = pluggable_from_env()
    except ValueError as exc:
        return "warn", str(exc)
    if pluggable:
        return "warn", f"{PLUGGABLE_ENV} is set: {_FALLBACK}."
    built = cached_builds()
    missing = missing_tools()
    if missing and not built:
        return "warn", f"the bridge's torch allocator cannot be built here: {missing}; {_FALLBACK}."
    if built:
        return "ok", (
            f"the bridge's torch allocator: {len(built)} build(s) in {cache_dir()}; one for "
            "another torch is compiled on the first unify(torch=True)."
        )
    return "ok", (
        "the bridge's torch allocator is compiled for this torch on the first "
        "unify(torch=True) (about 30 s, once); `python -m bridge build-torch` does it now."
    )


def cached_builds() -> list[Path]:
    """The torch allocators built so far (one folder per torch and source version)."""
    root = cache_dir()
    return sorted(
        p for p in root.glob("bridge_torch_*") if p.is_dir() and ".building-" not in p.name
    )


def missing_tools() -> str:
    """What the build lacks, in words (empty when nothing); imports no framework."""
    if not any(shutil.which(cxx) for cxx in (os.environ.get("CXX") or "c++", "g++", "clang++")):
        return "no C++ compiler (install g++ or clang++)"
    if importlib.util.find_spec("ninja") is None and not shutil.which("ninja"):
        return "ninja is not installed (pip install ninja)"
    if not any(os.path.isfile(os.path.join(d, "cuda_runtime_api.h")) for d in cuda_include_dirs()):
        return (
            "CUDA's runtime headers (cuda_runtime_api.h) were not found: install a CUDA "
            "toolkit and set CUDA_HOME, or pip install the nvidia-cuda-runtime wheel of "
            "torch's CUDA version"
        )
    return ""
