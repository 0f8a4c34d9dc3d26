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

torch's allocator interface changes between minor versions: before compiling,
``torch_interface`` reads the installed torch's headers for the methods the
source compiles only where torch has them (``-DBRIDGE_TORCH_HAS_<name>``) and
for pure virtual methods the source does not implement (then no build runs,
and the reason names them and the torch version). A failed build's reason is
the torch version and the compiler's first error; it is kept in the cache
(``<name>.failed``) so that ``bridge doctor`` can say why torch would run on the
fallback.
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

import contextlib
import importlib.util
import os
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

from . import torch_interface
from .native_build import (
    CACHE_DIR_ENV,
    NO_CUDA_HEADERS,
    build_timed,
    cache_dir,
    cached,
    core_headers,
    cuda_include_dirs,
    cxx,
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
#: Whether the last :func:`load` found a torch built without CUDA (nothing to build, and
#: nothing to fall back to: unify leaves such a torch alone or refuses it).
without_cuda = False
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


def key(interface: torch_interface.Interface | None = None) -> str:
    """What the built module depends on, as one short hash (the cache's folder name).

    ``interface`` is the installed torch's (default: read now); its defines are part of it.
    """
    torch = _torch()
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    defines = (interface or torch_interface.read()).defines
    return digest(
        [*SOURCES, HEADER, ABI_HEADER, *core_headers()],
        [torch.__version__, str(torch.version.cuda), str(abi), " ".join(defines)],
    )


# A failed build's record beside the builds: "<torch version>\n<reason>".
_FAILED = ".failed"


def _record_failure(name: str, version: str, why: str) -> None:
    try:
        cache_dir().mkdir(parents=True, exist_ok=True)
        (cache_dir() / f"{name}{_FAILED}").write_text(f"{version}\n{why}\n")
    except OSError:  # a read-only cache: the reason is still said where the build ran
        pass


def last_failure(version: str) -> str:
    """Why the last build for torch ``version`` failed (empty when none failed, or one built)."""
    records = sorted(cache_dir().glob(f"bridge_torch_*{_FAILED}"), key=lambda p: p.stat().st_mtime)
    for record in reversed(records):
        try:
            said, _, why = record.read_text().partition("\n")
        except OSError:
            continue
        if said == version:
            return why.strip()
    return ""


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
    global reason, built_from_cache, build_seconds, location, without_cuda
    try:
        torch = _torch()
    except ImportError as exc:
        reason = (
            f"torch cannot be imported ({type(exc).__name__}: {exc}): install a CUDA build "
            "of torch (pip install torch)"
        )
        return None
    if os.environ.get(PLUGGABLE_ENV, "").strip() not in ("", "0"):
        reason = (
            f"{PLUGGABLE_ENV}={os.environ[PLUGGABLE_ENV]} asks for torch's CUDAPluggableAllocator"
        )
        return None
    without_cuda = getattr(torch.version, "cuda", None) is None  # a CPU-only (or ROCm) build
    if without_cuda:
        reason = (
            f"torch {torch.__version__} is built without CUDA (torch.version.cuda is None): it "
            "has no CUDA allocator to build against; install a CUDA build (pip uninstall torch, "
            "then pip install torch)"
        )
        return None
    interface = torch_interface.read()
    name = f"bridge_torch_{key(interface)}"
    folder = cache_dir() / name
    module = import_built(name, folder)
    if module is not None:
        reason, built_from_cache, build_seconds, location = "", True, 0.0, str(folder)
        _stamp(folder, torch.__version__, interface)
        return module
    if not build:
        reason = f"not built yet for torch {torch.__version__} (in {folder})"
        return None
    problem = missing_tools() or interface.problem()
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
            extra_cflags=["-O2", "-g0", *interface.flags()],
            extra_ldflags=[f"-L{torch_lib}", "-lc10_cuda", "-ltorch_cuda", "-s"],
            build_directory=str(stage),
            with_cuda=False,
            verbose=verbose,
        )

    banner = (
        f"bridge: compiling its torch allocator for torch {torch.__version__} (once, about 30 s; "
        f"kept in {folder.parent})"
    )
    failed = f"building it for torch {torch.__version__} failed"
    module, reason, seconds = build_timed(folder, banner, build_into, failed)
    if module is None:
        if verbose and "Error building extension" in reason:  # the compiler's output is above
            reason += " (the compiler's output is above)"
        _record_failure(name, torch.__version__, reason)
        return None
    with contextlib.suppress(OSError):
        (cache_dir() / f"{name}{_FAILED}").unlink()
    _stamp(folder, torch.__version__, interface)
    build_seconds, built_from_cache, location = seconds, False, str(folder)
    return module


#: What the pluggable fallback lacks, said by doctor, stats and unify's warning.
FALLBACK_LACKS = (
    "an OOM is a plain RuntimeError, and cudnn.benchmark, torch.cuda.MemPool, CUDA graph "
    "trees and CUDA IPC do not work"
)
_FALLBACK = "torch's CUDAPluggableAllocator"
# Written in a build's folder: "<torch version>\n<sources digest>", for describe().
_BUILT_FOR = "built-for.txt"


def _sources_digest(interface: torch_interface.Interface) -> str:
    """The part of :func:`key` that needs no torch import: the sources and the defines."""
    return digest([*SOURCES, HEADER, ABI_HEADER, *core_headers()], interface.defines)


def _stamp(folder: Path, version: str, interface: torch_interface.Interface) -> None:
    """Say in a build's folder which torch and sources it was built for (read by describe)."""
    stamp = folder / _BUILT_FOR
    text = f"{version}\n{_sources_digest(interface)}\n"
    with contextlib.suppress(OSError):
        if not stamp.is_file() or stamp.read_text() != text:
            stamp.write_text(text)


def describe() -> tuple[str, str]:
    """Which torch allocator ``unify(torch=True)`` will install here, and why: (level, words).

    The level is doctor's (``"ok"`` or ``"warn"``). Reads torch's files (its
    version, its allocator's headers) and the cache; imports no framework.
    """
    try:
        if pluggable_from_env():
            return "warn", (
                f"{PLUGGABLE_ENV} is set: torch would run on {_FALLBACK} ({FALLBACK_LACKS})."
            )
    except ValueError as exc:
        return "warn", str(exc)
    interface = torch_interface.read()
    version = interface.version
    who = f"torch {version}" if version else "torch"
    stamp = f"{version}\n{_sources_digest(interface)}"
    for folder in reversed(cached_builds()):
        try:
            if (folder / _BUILT_FOR).read_text().strip() == stamp:
                return (
                    "ok",
                    f"{who} runs on the bridge's torch allocator, built for it in {folder}.",
                )
        except OSError:
            continue
    failed = last_failure(version)
    for cannot in (interface.problem(), missing_tools(), failed and f"the last try: {failed}"):
        if cannot:
            return "warn", (
                f"{who} would run on {_FALLBACK}, because the bridge's torch allocator cannot "
                f"be built for it here: {cannot}. On that path {FALLBACK_LACKS}."
            )
    extras = [d[len(torch_interface.DEFINE_PREFIX) :] for d in interface.defines]
    with_ = f", with torch's later additions ({', '.join(extras)})" if extras else ""
    return "ok", (
        f"{who} runs on the bridge's torch allocator, compiled for it{with_} on the first "
        "unify(torch=True) (about 30 s, once); `python -m bridge build-torch` does it now."
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
