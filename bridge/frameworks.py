# SPDX-License-Identifier: Apache-2.0
"""The frameworks the bridge knows, in one table: the seam between the core and the adapters.

Each row says what the rest of the library needs to know of a framework: its
name (the key of ``bridge.stats().by_framework``, of ``unify()``'s flags, of the
timeline's columns, of doctor's list), the ledger's tag its bytes are counted
under (``None`` for JAX, whose memory the pool counts as "others"), the adapter
module that knows it, its colour in the timeline's plot, what to pip install for
each CUDA major (bridge._install's words), and the few behaviours the core
treats per framework, as properties (the core asks for the property, never for
a name). The order of the rows is the order ``unify()`` sets frameworks up in
(JAX first: its environment must precede its backend).

Everything else is derived from the rows: ``unify()``'s flags, their checks and
the keywords it takes beyond its own (``unify(name=True)``), ``by_framework``'s
keys (:data:`FRAMEWORKS`), the timeline's columns, doctor's list, and on the C
side the number of tags (``BRIDGE_NTAGS``) and the frameworks torch's
out-of-memory message names. Adding a framework is one adapter, one row here,
its extra in pyproject.toml, and, when C code counts its bytes under a slot of
its own, one line in bridge/_native/frameworks.h, the C half (see
docs/adding-a-framework.md). tests/project/test_layout.py keeps every
framework's name out of the rest of the core; tests/project/test_new_framework.py
adds one by a row and an adapter alone.
"""

from __future__ import annotations

__all__ = [
    "Framework",
    "REGISTRY",
    "NAMES",
    "FRAMEWORKS",
    "TAG_NAMES",
    "ORDER",
    "COLORS",
    "OUTSIDE",
    "OUTSIDES",
    "MAJORS",
    "row",
    "pointers",
    "pinned_view",
]

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

from bridge._runtime import core


@dataclasses.dataclass(frozen=True)
class Framework:
    """One framework: what the library needs to know of it."""

    name: str
    tag: int | None  # the ledger's tag (bridge.h); None: outside the ledger (JAX)
    adapter: str  # the module that knows the framework (imported lazily)
    color: str  # in the timeline's plot
    #: Its allocations may come from C++ threads holding the framework's locks
    #: without the GIL: their memory pressure goes to the reliever thread
    #: (bridge._core.set_tag_relieved, set here at import).
    relieved: bool = False
    #: It takes unify()'s hard memory partition (``install(..., partition=)``).
    partition: bool = False
    #: Its adapter imports the framework only in ``install``: unify() looks for
    #: the framework itself first, to tell a missing one before anything changes.
    imports_late: bool = False
    #: ``Pool.malloc``, ``malloc_managed`` and the pinned pool's allocator hand
    #: out its pointers when it is installed (its adapter's ``malloc``,
    #: ``malloc_managed`` and ``pinned_allocator``).
    pointers: bool = False
    #: Environment variables unify() reads (bridge._env) before anything
    #: changes when the framework is asked for: a bad value is refused first.
    env: tuple[str, ...] = ()
    #: The module of its adapter (it imports no framework) whose ``VARIABLES``
    #: rows, ``(name, who, read, describe)``, join bridge._env's table: the
    #: variables only its adapter reads.
    variables: str | None = None
    #: What to ``pip install`` for it, per CUDA major (:data:`MAJORS`), as
    #: bridge._install words it; pyproject.toml's extras are the same sets. A
    #: build that PyPI lacks names its own index (``--index-url``): that major's
    #: extra leaves the framework out.
    install: tuple[tuple[int, str], ...] = ()
    #: The PinnedBuffer method that views a pinned block as the framework's own
    #: host array: its adapter's ``pinned_array(buffer, dtype, shape)`` answers it.
    pinned_method: str | None = None
    #: It has builds without CUDA (PyTorch's CPU wheels, JAX without a CUDA plugin): its
    #: adapter's ``without_cuda()`` says, without starting the framework, whether the
    #: installed one is such a build ("" when it has CUDA; else what it is and what to
    #: install). unify() leaves such a build out when it was not asked for (one warning a
    #: process) and refuses it when it was, before anything changes.
    cpu_builds: bool = False
    #: ``unify()``'s default for it: ``False``, set up only when asked for (``name=True``);
    #: ``None``, set up when installed and skipped when not (``bridge.unify()`` alone).
    default: bool | None = False
    #: Its place among :data:`FRAMEWORKS` (``by_framework``'s keys, the timeline's columns,
    #: doctor's list): rows with the same number keep the table's order.
    column: int = 100
    #: What it does under ``unify(name=True)``, for unify's docstring: said for a row that
    #: is no keyword of unify's own (the first five are, with their own words there).
    doc: str = ""

    def pip(self, major: int) -> str:
        """What to ``pip install`` for this framework on CUDA ``major`` (KeyError: none)."""
        return dict(self.install)[major]


REGISTRY: tuple[Framework, ...] = (
    Framework(
        "jax",
        None,
        "bridge.adapters.jax",
        "#55a868",
        partition=True,
        imports_late=True,
        install=((13, "'jax[cuda13]'"), (12, "'jax[cuda12]'")),
        cpu_builds=True,
        column=2,
    ),
    Framework(
        "torch",
        core.TAG_TORCH,
        "bridge.adapters.torch",
        "#dd8452",
        relieved=True,
        env=("BRIDGE_TORCH_PLUGGABLE",),
        variables="bridge.adapters.torch_build",
        # PyPI's torch is a CUDA 13 build; a CUDA 12 torch comes from PyTorch's own index
        install=((13, "torch"), (12, "torch --index-url https://download.pytorch.org/whl/cu129")),
        pinned_method="as_torch",
        cpu_builds=True,
        default=None,
        column=1,
    ),
    Framework(
        "cupy",
        core.TAG_CUPY,
        "bridge.adapters.cupy",
        "#4c72b0",
        pointers=True,
        env=("BRIDGE_CUPY_UNOWNED",),
        variables="bridge.adapters.cupy_memory",
        install=((13, "cupy-cuda13x"), (12, "cupy-cuda12x")),
        default=None,
        column=0,
    ),
    Framework(
        "numba",
        core.TAG_NUMBA,
        "bridge.adapters.numba",
        "#c44e52",
        install=((13, "'numba-cuda[cu13]'"), (12, "'numba-cuda[cu12]'")),
        column=3,
    ),
    Framework(
        "rmm",
        core.TAG_RMM,
        "bridge.adapters.rmm",
        "#8172b3",
        env=("BRIDGE_RMM_CALLBACK",),
        variables="bridge.adapters.rmm_build",
        install=((13, "rmm-cu13"), (12, "rmm-cu12")),
        column=4,
    ),
)
#: The CUDA major versions the frameworks are installed for, the newest first.
MAJORS: tuple[int, ...] = (13, 12)
#: The frameworks' names, in set-up order.
ORDER: tuple[str, ...] = tuple(f.name for f in REGISTRY)
NAMES = ORDER
#: The keys of ``by_framework``, the timeline's columns and doctor's list, as users read
#: them: the rows by ``column``, then "other" (what no framework's adapter allocated).
_COLUMNS = sorted(REGISTRY, key=lambda f: f.column)
FRAMEWORKS: tuple[str, ...] = (*(f.name for f in _COLUMNS), "other")
#: The ledger's tags by index: what each framework's bytes are counted under.
TAG_NAMES: dict[int, str] = {core.TAG_OTHER: "other"} | {
    f.tag: f.name for f in REGISTRY if f.tag is not None
}
COLORS: dict[str, str] = {f.name: f.color for f in REGISTRY} | {"other": "#8c8c8c"}
#: The frameworks outside the ledger (tag None): the pool's "others" are their bytes as
#: far as each tells (bridge.pool.register_attribution), the rest the first one's that
#: does not tell (JAX's, before its adapter tells), else "other".
OUTSIDES: tuple[str, ...] = tuple(f.name for f in REGISTRY if f.tag is None)
#: The first of them, JAX (its row is the first of the table).
OUTSIDE = OUTSIDES[0]
_ROWS: dict[str, Framework] = {f.name: f for f in REGISTRY}


def row(name: str) -> Framework:
    """The row of the framework ``name`` (KeyError for a name not in the table)."""
    return _ROWS[name]


def pointers() -> Framework:
    """The framework whose pointers the core's allocators hand out when it is installed."""
    (found,) = [f for f in REGISTRY if f.pointers]
    return found


def pinned_view(method: str) -> Callable[..., Any]:
    """The adapter function behind the PinnedBuffer method ``method`` (``pinned_method``).

    It imports the adapter, and with it the framework: ImportError when that is missing.
    """
    (found,) = [f for f in REGISTRY if f.pinned_method == method]
    view: Callable[..., Any] = importlib.import_module(found.adapter).pinned_array
    return view


for _f in REGISTRY:
    if _f.relieved and _f.tag is not None:
        core.set_tag_relieved(_f.tag, True)
