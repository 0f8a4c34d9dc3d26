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

import importlib.util
import os
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

from .native_build import (
    CACHE_DIR_ENV,
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
    native_dir,
    switch_variable,
)

#: ``1``: use torch's ``CUDAPluggableAllocator`` even where the C++ allocator builds.
PLUGGABLE_ENV = "BRIDGE_TORCH_PLUGGABLE"

_HERE = Path(__file__).resolve().parent
SOURCES = [_HERE / "_torch_allocator.cpp", _HERE / "_torch_history.cpp"]
HEADER = _HERE / "_torch_allocator.h"
# the core's entry points it calls by name (compiled into bridge._core from _torch_abi.cpp)
ABI_HEADER = _HERE / "_torch_abi.h"

#: Why the C++ allocator is not available (empty when it is).
reason = ""
#: Whether the last :func:`load` found the module built already.
built_from_cache = False
#: Seconds the last build took (0 when it came from the cache).
build_seconds = 0.0
#: The cache folder the module lives in (after :func:`load` found or built it).
location = ""


def pluggable_from_env() -> bool:
    """Whether ``BRIDGE_TORCH_PLUGGABLE`` asks for torch's ``CUDAPluggableAllocator``.

    Unset, empty or ``0``: no; ``1``: yes; anything else raises ``ValueError``
    naming the variable.
    """
    return flag_from_env(
        PLUGGABLE_ENV,
        "runs torch on torch's CUDAPluggableAllocator instead of the bridge's torch allocator",
    )


#: The variables this module reads, as rows of bridge._env's table (``name, who, read,
#: describe``; frameworks.py's torch row points it here): ``bridge doctor`` checks them
#: with these very readers.
VARIABLES: tuple[tuple[str, str, Any, Any], ...] = (
    switch_variable(
        PLUGGABLE_ENV,
        "bridge.unify(torch=True) raises ValueError on it",
        pluggable_from_env,
        "torch runs on torch's CUDAPluggableAllocator, not the bridge's own.",
        "valid: torch runs on the bridge's own torch allocator where it builds.",
    ),
    (
        CACHE_DIR_ENV,
        "the bridge's torch allocator and RMM resource are built and kept there",
        lambda t: str(cache_dir()),
        lambda v, t: (
            "info",
            f"the bridge's torch allocator and RMM resource are built and kept in {v}.",
        ),
    ),
)


def _torch() -> Any:
    import torch

    return torch


def key() -> str:
    """What the built module depends on, as one short hash (the cache's folder name)."""
    torch = _torch()
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    return digest(
        [*SOURCES, HEADER, ABI_HEADER, *core_headers()],
        [torch.__version__, str(torch.version.cuda), str(abi)],
    )


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
    module = import_built(name, folder)
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

    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")

    def build_into(stage: Path) -> ModuleType:
        return cpp_extension.load(
            name=name,
            sources=[str(p) for p in SOURCES],
            extra_include_paths=[str(native_dir()), *cuda_include_dirs()],
            extra_cflags=["-O2", "-g0"],
            extra_ldflags=[f"-L{torch_lib}", "-lc10_cuda", "-ltorch_cuda", "-s"],
            build_directory=str(stage),
            with_cuda=False,
            verbose=verbose,
        )

    banner = (
        f"bridge: compiling its torch allocator for torch {torch.__version__} (once, about 30 s; "
        f"kept in {folder.parent})"
    )
    module, reason, seconds = build_timed(folder, banner, build_into)
    if module is None:
        return None
    build_seconds, built_from_cache, location = seconds, False, str(folder)
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
    builds = cached_builds()
    return describe_build(
        "the bridge's torch allocator",
        (PLUGGABLE_ENV, pluggable_from_env),
        _FALLBACK,
        "",
        builds,
        missing_tools(),
        "one for another torch is compiled on the first unify(torch=True).",
        "for this torch on the first unify(torch=True) (about 30 s, once); "
        "`python -m bridge build-torch` does it now.",
    )


def cached_builds() -> list[Path]:
    """The torch allocators built so far (one folder per torch and source version)."""
    return cached("bridge_torch_")


def missing_tools() -> str:
    """What the build lacks, in words (empty when nothing); imports no framework."""
    if cxx() is None:
        return "no C++ compiler (install g++ or clang++)"
    if importlib.util.find_spec("ninja") is None and not shutil.which("ninja"):
        return "ninja is not installed (pip install ninja)"
    if not has_cuda_headers():
        return NO_CUDA_HEADERS
    return ""
