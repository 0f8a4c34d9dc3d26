/* SPDX-License-Identifier: Apache-2.0 */
/* frameworks.h: the registry's C half, the one C header of the core that
 * names frameworks (bridge/frameworks.py is the registry; this is what C code
 * needs of it at compile time).
 *
 * The seam, as mimalloc's prim.h is its port's: the core counts tags (plain
 * slots, bridge.h), and what a framework adds to the compiled module lives
 * beside its adapter (adapters/_<name>_*.c, .cpp), listed here:
 *
 *   BRIDGE_FRAMEWORK_TAGS(X)  X(NAME, n): the slots C code counts under, as
 *                             BRIDGE_TAG_<NAME> (bridge._core.TAG_<NAME>):
 *                             every framework with a slot (torch's refusal
 *                             message, _torch_abi.cpp, names each one's bytes).
 *                             tests/core/test_frameworks.py keeps both halves
 *                             in agreement.
 *   BRIDGE_ADAPTER_MODULES(X) X(fn): int fn(PyObject *module), called by
 *                             PyInit__core (pymod.c) to add an adapter's types
 *                             and constants to bridge._core.
 */
#ifndef BRIDGE_FRAMEWORKS_H
#define BRIDGE_FRAMEWORKS_H

#define BRIDGE_FRAMEWORK_TAGS(X) \
    X(CUPY, 1)                   \
    X(TORCH, 2)                  \
    X(NUMBA, 3)                  \
    X(RMM, 4)

#define BRIDGE_TAG_ENUM_(name, n) BRIDGE_TAG_##name = n,
enum bridge_framework_tag { BRIDGE_FRAMEWORK_TAGS(BRIDGE_TAG_ENUM_) };
#undef BRIDGE_TAG_ENUM_

/* The id0 of the graph pools of CuPy's captures: the core's stream-capture
 * pools (bridge.h; bridge._core.CUPY_POOL, added by adapters/_cupy_alloc.c). */
#define BRIDGE_CUPY_POOL BRIDGE_STREAM_POOL

/* adapters/_cupy_alloc.c: bridge._core.CupyAllocator and CUPY_POOL */
#define BRIDGE_ADAPTER_MODULES(X) X(bridge_pycupy_add)

#endif /* BRIDGE_FRAMEWORKS_H */
