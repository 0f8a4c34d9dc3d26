/* SPDX-License-Identifier: Apache-2.0 */
/* pyblock.c: Block, the C-level owner of one allocation (bridge._core.Block),
 * for the module's functions (pymod.c) and CuPy's allocator (adapters/_cupy_alloc.c):
 * its dealloc frees the block, with no Python __del__ involved. */
#include "pyblock.h"

#include <stdio.h>

#include "bridge.h"

typedef bridge_Block Block;

unsigned long long block_gil_releases;

/* Free a block with the GIL held: into the core's cache when that needs no
 * driver call and no wait (bridge_free_cached: a shard lock and the cache's
 * lock, neither held by anyone waiting for the GIL); only otherwise is the
 * GIL released, around bridge_free (driver frees, evictions, deferred frees). */
void block_free(void *p)
{
    if (bridge_free_cached(p) != BRIDGE_E_MISS)
        return;
    block_gil_releases++; /* under the GIL */
    Py_BEGIN_ALLOW_THREADS
    bridge_free(p); /* never fails: counts what went wrong */
    Py_END_ALLOW_THREADS
}

static void Block_dealloc(Block *self)
{
    void *p = self->ptr;
    self->ptr = NULL;
    if (p)
        block_free(p);
    Py_CLEAR(self->stream);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Block_repr(Block *self)
{
    char hex[2 + 2 * sizeof(size_t) + 1]; /* PyUnicode_FromFormat knows no %zx before 3.12 */
    snprintf(hex, sizeof hex, "0x%zx", (size_t)self->ptr);
    return PyUnicode_FromFormat("<bridge block %s, %zu bytes, device %d>", hex, self->size,
                                self->device);
}

BRIDGE_OWNER_ATTRIBUTES(Block, "device address",
                        BRIDGE_OWNER_SIZE(Block, "size") BRIDGE_OWNER_DEVICE(Block));

PyTypeObject BlockType = {
    BRIDGE_OWNER_TYPE(Block, "Block", Py_TPFLAGS_DEFAULT,
                      "One allocation from the shared pool, freed when this object dies."),
};

PyObject *block_new_of(PyTypeObject *type, void (*release)(void *), void *ptr, size_t size,
                       int device, PyObject *stream)
{
    Block *b = PyObject_New(Block, type);
    if (!b) {
        release(ptr);
        return NULL;
    }
    b->ptr = ptr;
    b->size = size;
    b->device = device;
    Py_XINCREF(stream);
    b->stream = stream;
    return (PyObject *)b;
}

PyObject *block_new(void *ptr, size_t size, int device, PyObject *stream)
{
    return block_new_of(&BlockType, block_free, ptr, size, device, stream);
}

/* After a refused allocation: when its wait gave up for Ctrl-C, run the
 * signal handlers now (KeyboardInterrupt).  -1 with the exception set. */
int raise_if_interrupted(void)
{
    double waited;
    int outcome;
    bridge_last_wait(&waited, &outcome);
    return outcome == BRIDGE_WAIT_INTERRUPTED ? PyErr_CheckSignals() : 0;
}

int bridge_pyblock_add(PyObject *m)
{
    return PyModule_AddType(m, &BlockType); /* readied, added as its tp_name's last part */
}
