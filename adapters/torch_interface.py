# SPDX-License-Identifier: Apache-2.0
"""What the installed torch's allocator interface asks of the bridge's torch allocator.

``_torch_allocator.cpp`` derives from torch's
``c10::cuda::CUDACachingAllocator::CUDAAllocator``, whose methods change
between torch's minor versions: torch 2.12 added the pure virtual
``attachOomRejectionObserver``, so a class written for 2.11 is abstract there
and does not compile. Before the build, this module reads the installed
torch's headers (never importing torch): the virtual methods of
``CUDAAllocator`` and its bases, which of them are pure, and which of the
optional features the C++ source guards with ``#ifdef BRIDGE_TORCH_HAS_<name>``
this torch has. The build passes ``-DBRIDGE_TORCH_HAS_<name>`` for each; a pure
virtual the source does not implement at all is named before any compiler
runs, with the torch version, instead of a compiler's "abstract class" error.
"""

from __future__ import annotations

__all__ = [
    "DEFINE_PREFIX",
    "TESTED",
    "Interface",
    "class_virtuals",
    "guarded",
    "implemented",
    "read",
    "torch_root",
    "torch_version",
]

import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

#: The torch minor versions the allocator was built and tested against (oldest, newest).
TESTED = ("2.11", "2.15")
#: The prefix of the defines the build passes (``-DBRIDGE_TORCH_HAS_attachOomRejectionObserver``).
DEFINE_PREFIX = "BRIDGE_TORCH_HAS_"

_HERE = Path(__file__).resolve().parent
SOURCE = _HERE / "_torch_allocator.cpp"

# The allocator's class and its bases, each in its header (relative to torch/include).
_CLASSES = (
    ("c10/cuda/CUDACachingAllocator.h", "CUDAAllocator"),
    ("c10/core/CachingDeviceAllocator.h", "DeviceAllocator"),
    ("c10/core/Allocator.h", "Allocator"),
)
# Features that are not methods of those classes: define name -> (header, what shows it).
_MARKERS = {
    "throw_on_cudamalloc_oom": (
        "c10/cuda/CUDAAllocatorConfig.h",
        r"\bthrow_on_cudamalloc_oom\s*\(",
    ),
    "num_oom_rejections": ("c10/core/CachingDeviceAllocator.h", r"\bnum_oom_rejections\b"),
}


@dataclass
class Interface:
    """The installed torch's allocator interface, as the build needs it."""

    version: str  #: torch's version (``2.15.0+cu130``), from torch/version.py
    include: Path | None  #: torch's C++ headers (torch/include); None when not found
    virtuals: dict[str, bool] = field(default_factory=dict)  #: method -> pure
    defines: list[str] = field(default_factory=list)  #: the ``BRIDGE_TORCH_HAS_*`` to pass
    unknown: list[str] = field(default_factory=list)  #: pure virtuals the source lacks

    def problem(self) -> str:
        """Why the allocator cannot be built against this torch (empty: it can)."""
        if self.include is None or not self.virtuals:
            return (
                f"torch {self.version or '(version unknown)'} has no C++ headers "
                f"(c10/cuda/CUDACachingAllocator.h under torch/include, with its CUDAAllocator "
                "class): install a CUDA build of torch from PyPI or pytorch.org"
            )
        if self.unknown:
            return (
                f"torch {self.version}'s CUDAAllocator declares pure virtual method(s) the "
                f"bridge's torch allocator does not implement: {', '.join(self.unknown)} (the "
                f"bridge knows torch {TESTED[0]} to {TESTED[1]}); upgrade bridge, or install "
                f"torch<{_next_minor(TESTED[1])}"
            )
        return ""

    def flags(self) -> list[str]:
        """The compiler flags of :attr:`defines`."""
        return [f"-D{d}" for d in self.defines]


def _next_minor(version: str) -> str:
    major, minor = version.split(".")[:2]
    return f"{major}.{int(minor) + 1}"


def torch_root() -> Path | None:
    """The installed torch package's folder, found without importing torch."""
    file = getattr(sys.modules.get("torch"), "__file__", None)
    if file:
        return Path(file).resolve().parent
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def torch_version(root: Path | None) -> str:
    """torch's ``__version__`` as torch/version.py writes it (empty when not found)."""
    try:
        text = (root / "version.py").read_text() if root is not None else ""
    except OSError:
        return ""
    found = re.search(r"^__version__\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return found.group(1) if found else ""


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _matching(text: str, start: int, open_: str, close: str) -> int:
    """The index just past the bracket closing the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def class_virtuals(header: str, name: str) -> dict[str, bool]:
    """The virtual methods the class or struct ``name`` declares in ``header``'s text.

    Returns method name -> whether it is pure (``= 0``); the destructor is left
    out; empty when the class is not found.
    """
    text = _strip_comments(header)
    head = re.search(rf"\b(?:class|struct)\s+(?:\w+\s+)*{re.escape(name)}\s*(?::[^{{;]*)?\{{", text)
    if head is None:
        return {}
    body = text[head.end() - 1 : _matching(text, head.end() - 1, "{", "}")]
    found: dict[str, bool] = {}
    for m in re.finditer(r"\bvirtual\b[^;{}()]*?(~?\b\w+)\s*\(", body):
        if m.group(1).startswith("~"):
            continue
        after = _matching(body, m.end() - 1, "(", ")")
        tail = re.match(r"[^;{]*", body[after:])
        pure = bool(tail and re.search(r"=\s*0\s*$", tail.group(0)))
        found[m.group(1)] = found.get(m.group(1), False) or pure
    return found


def implemented(source: str) -> set[str]:
    """The methods the C++ source overrides (``override`` or ``final``), guarded or not."""
    text = _strip_comments(source)
    names = set()
    for m in re.finditer(r"\b(\w+)\s*\(", text):
        after = _matching(text, m.end() - 1, "(", ")")
        if re.match(r"\s*(?:const\s*)?(?:noexcept\s*)?(?:override|final)\b", text[after:]):
            names.add(m.group(1))
    return names


def guarded(source: str) -> set[str]:
    """The features the C++ source compiles only where torch has them (``BRIDGE_TORCH_HAS_*``)."""
    return set(re.findall(rf"\b{DEFINE_PREFIX}(\w+)", _strip_comments(source)))


def read(root: Path | None = None, source: str | None = None) -> Interface:
    """The installed torch's allocator interface (``root``: torch's folder; default: found).

    ``source`` is the allocator's C++ text (default: ``_torch_allocator.cpp``).
    """
    root = torch_root() if root is None else root
    version = torch_version(root)
    include = root / "include" if root is not None else None
    if include is None or not (include / _CLASSES[0][0]).is_file():
        return Interface(version, None)
    src = SOURCE.read_text() if source is None else source
    virtuals: dict[str, bool] = {}
    texts: dict[str, str] = {}
    for relative, cls in _CLASSES:
        try:
            texts[relative] = (include / relative).read_text(errors="replace")
        except OSError:
            texts[relative] = ""
        for method, pure in class_virtuals(texts[relative], cls).items():
            # a derived class's declaration (the first met) decides whether it is pure
            virtuals.setdefault(method, pure)
    wanted = guarded(src)
    defines = [DEFINE_PREFIX + m for m in sorted(wanted) if m in virtuals]
    for define, (relative, pattern) in sorted(_MARKERS.items()):
        if define not in wanted:
            continue
        if relative not in texts:
            try:
                texts[relative] = (include / relative).read_text(errors="replace")
            except OSError:
                texts[relative] = ""
        if re.search(pattern, _strip_comments(texts[relative])):
            defines.append(DEFINE_PREFIX + define)
    done = implemented(src)
    unknown = sorted(m for m, pure in virtuals.items() if pure and m not in done)
    return Interface(version, include, virtuals, defines, unknown)
