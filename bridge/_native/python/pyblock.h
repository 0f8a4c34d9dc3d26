/* SPDX-License-Identifier: Apache-2.0 */
/* pyblock.h: Block, the owner of one allocation (pyblock.c), for pymod.c and the adapters' C (adapters/_cupy_alloc.c). */
#ifndef BRIDGE_PYBLOCK_H
#define BRIDGE_PYBLOCK_H

#include "pyowner.h"

/* The C-level owner of one allocation (bridge._core.Block): its dealloc
 * frees the block, with no Python __del__ involved. */
typedef struct {
    BRIDGE_OWNER_HEAD;
    size_t size;
    int device;
    PyObject *stream; /* the framework's stream object, kept alive until the
                         free is queued on it (a destroyed stream must never
                         be handed to the driver); may be NULL */
} bridge_Block;
extern PyTypeObject BlockType;
/* Frees of Blocks that released the GIL (bridge_free after a
 * bridge_free_cached miss); read and written under the GIL. */
extern unsigned long long block_gil_releases;
/* Free an allocation with the GIL held (a Block's dealloc does): into the
 * core's cache when that needs no driver call, else with the GIL released. */
void block_free(void *ptr);
/* A new Block owning `ptr` (freed at once if the object cannot be made). */
PyObject *block_new(void *ptr, size_t size, int device, PyObject *stream);
/* A new object of `type`, Block or another type of its struct (ManagedBlock),
 * owning `ptr`: release(ptr) at once if the object cannot be made. */
PyObject *block_new_of(PyTypeObject *type, void (*release)(void *), void *ptr, size_t size,
                       int device, PyObject *stream);
/* After a refused allocation: when its wait gave up for Ctrl-C, run the
 * signal handlers now (KeyboardInterrupt).  -1 with the exception set. */
int raise_if_interrupted(void);
/* Add the Block type to the module. */
int bridge_pyblock_add(PyObject *m);

#endif /* BRIDGE_PYBLOCK_H */
