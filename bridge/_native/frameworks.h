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
 *                             every framework with a slot. A new framework
 *                             that needs one adds a line here, and it is the
 *                             only C line it adds: n is its place in the list
 *                             (the next number; the compiler checks it),
 *                             BRIDGE_NTAGS (bridge.h) counts the lines, and
 *                             torch's refusal message (_torch_abi.cpp) names
 *                             each line's bytes. tests/core/test_frameworks.py
 *                             keeps both halves in agreement.
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

/* Each line's n is its place in the list (tag 0 is no framework's), so that the
 * slots are 1 .. BRIDGE_NTAGS-1 with none skipped or taken twice: a line whose n
 * is not its place is an array of size -1, a compile error in C and C++ alike. */
#define BRIDGE_TAG_PLACE_(name, n) BRIDGE_TAG_PLACE_##name##_,
enum bridge_framework_tag_place_ { BRIDGE_TAG_PLACE_0_, BRIDGE_FRAMEWORK_TAGS(BRIDGE_TAG_PLACE_) };
#undef BRIDGE_TAG_PLACE_
#define BRIDGE_TAG_AT_ITS_PLACE_(name, n) \
    typedef char bridge_tag_at_its_place_##name[(n) == (int)BRIDGE_TAG_PLACE_##name##_ ? 1 : -1];
BRIDGE_FRAMEWORK_TAGS(BRIDGE_TAG_AT_ITS_PLACE_)
#undef BRIDGE_TAG_AT_ITS_PLACE_

/* The id0 of the graph pools of CuPy's captures: the core's stream-capture
 * pools (bridge.h; bridge._core.CUPY_POOL, added by adapters/_cupy_alloc.c). */
#define BRIDGE_CUPY_POOL BRIDGE_STREAM_POOL

/* adapters/_cupy_alloc.c: bridge._core.CupyAllocator and CUPY_POOL */
#define BRIDGE_ADAPTER_MODULES(X) X(bridge_pycupy_add)

#endif /* BRIDGE_FRAMEWORKS_H */
