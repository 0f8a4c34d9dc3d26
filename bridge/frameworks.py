# SPDX-License-Identifier: Apache-2.0
"""The frameworks the bridge knows, in one table: the seam between the core and the adapters.

Each row says what the rest of the library needs to know of a framework: its
name (the key of ``bridge.stats().by_framework``, of ``unify()``'s flags, of the
timeline's columns), the ledger's tag its bytes are counted under (``None``
for JAX, whose memory the pool counts as "others"), the adapter module that
knows it, and its colour in the timeline's plot. The order of the rows is the
order ``unify()`` sets frameworks up in (JAX first: its environment must
precede its backend). Adding a framework is one adapter and one row here.
"""

from __future__ import annotations

__all__ = ["Framework", "REGISTRY", "NAMES", "FRAMEWORKS", "TAG_NAMES", "ORDER", "COLORS"]

import dataclasses

from bridge._runtime import core


@dataclasses.dataclass(frozen=True)
class Framework:
    """One framework: what the library needs to know of it."""

    name: str
    tag: int | None  # the ledger's tag (bridge.h); None: outside the ledger (JAX)
    adapter: str  # the module that knows the framework (imported lazily)
    color: str  # in the timeline's plot


REGISTRY: tuple[Framework, ...] = (
    Framework("jax", None, "bridge.adapters.jax", "#55a868"),
    Framework("torch", core.TAG_TORCH, "bridge.adapters.torch", "#dd8452"),
    Framework("cupy", core.TAG_CUPY, "bridge.adapters.cupy", "#4c72b0"),
    Framework("numba", core.TAG_NUMBA, "bridge.adapters.numba", "#c44e52"),
    Framework("rmm", core.TAG_RMM, "bridge.adapters.rmm", "#8172b3"),
)
#: The frameworks' names, in set-up order.
ORDER: tuple[str, ...] = tuple(f.name for f in REGISTRY)
NAMES = ORDER
#: The keys of ``by_framework`` and the timeline's columns, as users read them.
FRAMEWORKS: tuple[str, ...] = ("cupy", "torch", "jax", "numba", "rmm", "other")
#: The ledger's tags by index: what each framework's bytes are counted under.
TAG_NAMES: dict[int, str] = {core.TAG_OTHER: "other"} | {
    f.tag: f.name for f in REGISTRY if f.tag is not None
}
COLORS: dict[str, str] = {f.name: f.color for f in REGISTRY} | {"other": "#8c8c8c"}
