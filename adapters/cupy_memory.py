# SPDX-License-Identifier: Apache-2.0
"""What CuPy's blocks are wrapped in, and the switch back to CuPy's ``UnownedMemory``.

``bridge._core.CupyAllocator`` wraps each block in a ``BridgeMemory``: a
subtype of CuPy's ``BaseMemory`` made in C whose deallocation frees the block,
inside a ``MemoryPointer`` made by its type's ``tp_new`` with its fields stored
in C (no ``UnownedMemory``, no owner object, no Python-level ``__init__``). That
relies on how Cython lays out CuPy's two classes, which CuPy's wheels give no
declarations to compile against; the allocator checks the layout once, when it
is made, by storing values in C and reading them back through CuPy's own
attributes, and keeps ``UnownedMemory`` + ``MemoryPointer`` (with a ``Block`` as
the owner) when it does not check out. ``BRIDGE_CUPY_UNOWNED=1`` keeps them
regardless. Imports no framework (``bridge._env`` reads :data:`VARIABLES`).
"""

from __future__ import annotations

__all__ = ["UNOWNED_ENV", "VARIABLES", "unowned_from_env"]

from typing import Any

from .native_build import flag_from_env, switch_variable

#: ``1``: wrap CuPy's blocks in CuPy's ``UnownedMemory`` even where ``BridgeMemory`` works.
UNOWNED_ENV = "BRIDGE_CUPY_UNOWNED"


def unowned_from_env() -> bool:
    """Whether ``BRIDGE_CUPY_UNOWNED`` asks for CuPy's ``UnownedMemory``.

    Unset, empty or ``0``: no; ``1``: yes; anything else raises ``ValueError``
    naming the variable.
    """
    return flag_from_env(
        UNOWNED_ENV,
        "wraps CuPy's blocks in CuPy's UnownedMemory (about 0.25 us more per allocation) "
        "instead of the bridge's BridgeMemory",
    )


#: The variables this module reads, as rows of bridge._env's table (``name, who, read,
#: describe``; frameworks.py's cupy row points it here).
VARIABLES: tuple[tuple[str, str, Any, Any], ...] = (
    switch_variable(
        UNOWNED_ENV,
        "bridge.unify(cupy=True) raises ValueError on it",
        unowned_from_env,
        "CuPy's blocks are wrapped in CuPy's UnownedMemory, not the bridge's BridgeMemory.",
        "valid: CuPy's blocks are wrapped in the bridge's BridgeMemory where CuPy's layout "
        "checks out.",
    ),
)
