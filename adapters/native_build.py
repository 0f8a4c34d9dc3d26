# SPDX-License-Identifier: Apache-2.0
"""What the adapters' modules compiled on first use share: the cache, its keys, the tools.

The torch allocator (``torch_build``) and the RMM resource (``rmm_build``) are
compiled against the framework that runs, on the first ``unify``, into one
cache folder: one sub-folder per module and key (a hash of everything the
binary depends on), built beside it and renamed into place when complete, and
imported from there on every later start without a compiler. Imports no
framework.
"""

from __future__ import annotations

__all__ = [
    "build_timed",
    "CACHE_DIR_ENV",
    "NO_CUDA_HEADERS",
    "cache_dir",
    "cached",
    "core_headers",
    "cuda_include_dirs",
    "cxx",
    "describe_build",
    "digest",
    "first_error",
    "flag_from_env",
    "switch_variable",
    "has_cuda_headers",
    "import_built",
    "last_line",
    "native_dir",
    "staging",
]

import contextlib
import glob
import hashlib
import importlib.util
import os
import re
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

#: The folder of the built modules (default ``~/.cache/bridge``).
CACHE_DIR_ENV = "BRIDGE_CACHE_DIR"

_HERE = Path(__file__).resolve().parent
_NATIVE = _HERE.parent / "_native"  # installed layout: bridge/adapters -> bridge/_native
_HEADERS = ("bridge.h", "frameworks.h")  # the core's C API and the tags it includes


def cache_dir() -> Path:
    """The folder of built modules: ``$BRIDGE_CACHE_DIR``, else ``$XDG_CACHE_HOME/bridge``, else
    ``~/.cache/bridge``."""
    root = os.environ.get(CACHE_DIR_ENV, "").strip()
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "bridge"


def flag_from_env(name: str, meaning: str) -> bool:
    """Whether the variable ``name`` is ``1``; unset, empty or ``0``: no.

    Anything else raises ``ValueError`` naming the variable, with ``meaning``
    (what 1 does) in its words.
    """
    raw = os.environ.get(name, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(
            f"{name}={os.environ[name]!r} is not 0 or 1: 1 {meaning}; unset it or write 0 "
            "for the bridge's."
        )
    return raw == "1"


def switch_variable(name: str, who: str, read: Any, on: str, off: str) -> tuple[str, str, Any, Any]:
    """The row of bridge._env's table for a module's fallback switch (``name``,
    read by ``read()``): doctor's words when it is set (``on``) and when not (``off``)."""
    return (
        name,
        who,
        lambda t: read(),
        lambda v, t: ("info", on) if v else ("ok", off),
    )


def describe_build(
    what: str,
    switch: tuple[str, Any],
    fallback: str,
    problem: str,
    builds: list[Path],
    missing: str,
    again: str,
    first: str,
) -> tuple[str, str]:
    """Which module a ``unify`` will install, and why: (doctor's level, words).

    ``what`` names the module ("the bridge's torch allocator"); ``switch`` is its
    fallback variable and reader; ``fallback`` says what runs instead; ``problem``
    is why it cannot be built whatever the tools (empty: none), ``missing`` the tool
    it lacks; ``again`` ends the words when ``builds`` has some, ``first`` says
    when and how it is compiled when there are none.
    """
    name, read = switch
    try:
        if read():
            return "warn", f"{name} is set: {fallback}."
    except ValueError as exc:
        return "warn", str(exc)
    for cannot in (problem, "" if builds else missing):
        if cannot:
            return "warn", f"{what} cannot be built here: {cannot}; {fallback}."
    if builds:
        return "ok", f"{what}: {len(builds)} build(s) in {cache_dir()}; {again}"
    return "ok", f"{what} is compiled {first}"


def native_dir() -> Path:
    """Where ``bridge.h`` lives: beside the package (installed) or in the checkout."""
    for candidate in (_NATIVE, _HERE.parent / "bridge" / "_native"):
        if (candidate / _HEADERS[0]).is_file():
            return candidate
    import bridge

    return Path(bridge.__file__).resolve().parent / "_native"


def core_headers() -> list[Path]:
    """The core's headers a built module depends on (part of every key)."""
    return [native_dir() / name for name in _HEADERS]


def digest(files: Iterable[Path], parts: Iterable[str]) -> str:
    """One short hash of the files' bytes and the strings, with Python's version and platform."""
    h = hashlib.sha256()
    for path in files:
        h.update(path.read_bytes())
    for part in (*parts, sys.version, sysconfig.get_platform()):
        h.update(part.encode())
    return h.hexdigest()[:16]


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


def has_cuda_headers() -> bool:
    """Whether CUDA's runtime headers (``cuda_runtime_api.h``) are found."""
    return any(os.path.isfile(os.path.join(d, "cuda_runtime_api.h")) for d in cuda_include_dirs())


#: What the build says when CUDA's runtime headers are missing.
NO_CUDA_HEADERS = (
    "CUDA's runtime headers (cuda_runtime_api.h) were not found: install a CUDA "
    "toolkit and set CUDA_HOME, or pip install the nvidia-cuda-runtime wheel of "
    "the framework's CUDA version"
)


def cxx() -> str | None:
    """The C++ compiler: ``$CXX``, else ``c++``, ``g++``, ``clang++``; None when none is found."""
    for name in (os.environ.get("CXX") or "c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


def import_built(name: str, folder: Path) -> ModuleType | None:
    """The extension module ``name`` built in ``folder``; None when it is not there."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    for path in (folder / f"{name}{suffix}", folder / f"{name}.so"):
        if path.is_file():
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    return None


def cached(prefix: str) -> list[Path]:
    """The modules built so far whose folder names start with ``prefix`` (one per key)."""
    return sorted(
        p for p in cache_dir().glob(f"{prefix}*") if p.is_dir() and ".building-" not in p.name
    )


@contextlib.contextmanager
def staging(folder: Path) -> Iterator[Path]:
    """A folder to build ``folder``'s module in, renamed to ``folder`` when the block ends.

    A process starting meanwhile never imports a half-written module. When
    the block raises, the staging folder is removed; when another process put
    its build in place first, theirs is kept.
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    stage = folder.parent / f"{folder.name}.building-{os.getpid()}"
    stage.mkdir(exist_ok=True)
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    try:
        os.replace(stage, folder)
    except OSError:  # another process put its build there first: keep theirs
        shutil.rmtree(stage, ignore_errors=True)


def last_line(exc: BaseException) -> str:
    """A failed build's last non-empty line of words (the compiler's error, usually)."""
    text = [line for line in str(exc).strip().splitlines() if line.strip()]
    return text[-1] if text else type(exc).__name__


# A compiler's or linker's error line: gcc's and clang's "file:line:col: error: ...",
# "fatal error: ...", ld's "undefined reference to ..." and "cannot find -lc10_cuda".
_ERROR_LINE = re.compile(r"(?:\b(?:fatal )?error:|undefined reference to|cannot find -l)")


def first_error(text: str) -> str:
    """The first line of a compiler's output that names an error, else its last line.

    A build stops at ninja's "build stopped: subcommand failed." or the linker's
    "ld returned 1 exit status": the first error is the cause. A path before
    ``file:line:`` is cut to the file's name.
    """
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if _ERROR_LINE.search(line) and not line.startswith("collect2:"):
            return re.sub(r"^(?:\S*/)([^/\s]+:\d+)", r"\1", line)
    return lines[-1] if lines else "no output"


def build_timed(
    folder: Path,
    banner: str,
    build: Callable[[Path], ModuleType],
    failed: str = "building it failed",
) -> tuple[ModuleType | None, str, float]:
    """A first start's build: say so, build in :func:`staging`, time it.

    ``build(stage)`` compiles into ``stage`` and returns the module. Returns
    ``(module, "", seconds)``, or ``(None, reason, 0.0)`` when it raised (any failure
    means: fall back), the reason being ``failed`` and the compiler's first error
    (:func:`first_error` of the exception's words).
    """
    print(banner, file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        with staging(folder) as stage:
            module = build(stage)
    except Exception as exc:  # noqa: BLE001 - any build or load failure means: fall back
        return None, f"{failed}: {first_error(str(exc) or type(exc).__name__)}", 0.0
    return module, "", time.perf_counter() - start
