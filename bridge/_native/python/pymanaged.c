/* SPDX-License-Identifier: Apache-2.0 */
/* pymanaged.c: the Python face of managed.c (bridge._core.ManagedBlock and
 * functions): a managed block is owned by a C object whose dealloc frees it
 * (cuMemFree may wait for the device: the GIL is released around it). */
#include "bridge.h"
#include "managed.h"
#include "pybind.h"
#include "pyblock.h"

/* A Block's struct (its stream NULL), freed by managed.c */
typedef bridge_Block ManagedBlock;

static void free_managed(void *p)
{
    bridge_free_managed(p); /* never fails: counts what went wrong */
}

static void ManagedBlock_dealloc(ManagedBlock *self)
{
    void *p = self->ptr;
    self->ptr = NULL;
    if (p) {
        Py_BEGIN_ALLOW_THREADS
        free_managed(p);
        Py_END_ALLOW_THREADS
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *ManagedBlock_repr(ManagedBlock *self)
{
    return PyUnicode_FromFormat("<bridge managed block %p, %zu bytes, device %d>", self->ptr,
                                self->size, self->device);
}

BRIDGE_OWNER_ATTRIBUTES(ManagedBlock, "address (device and host)",
                        BRIDGE_OWNER_SIZE(ManagedBlock, "size") BRIDGE_OWNER_DEVICE(ManagedBlock));

static PyTypeObject ManagedBlockType = {
    BRIDGE_OWNER_TYPE(ManagedBlock, "ManagedBlock", Py_TPFLAGS_DEFAULT,
                      "One managed allocation on the budget, freed when this object dies."),
};

static PyObject *py_alloc_managed(PyObject *m, PyObject *args)
{
    (void)m;
    int dev, tag;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "ini", &dev, &size, &tag))
        return NULL;
    if (size < 0)
        return Py_BuildValue("iO", BRIDGE_E_INVALID, Py_None);
    void *p = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bridge_alloc_managed(dev, (size_t)size, tag, &p);
    Py_END_ALLOW_THREADS
    if (rc != BRIDGE_OK || !p) /* refused, or 0 bytes: no block */
        return Py_BuildValue("iO", rc, Py_None);
    PyObject *b = block_new_of(&ManagedBlockType, free_managed, p, (size_t)size, dev, NULL);
    if (!b)
        return NULL;
    return Py_BuildValue("iN", rc, b);
}

static PyObject *py_managed_stats(PyObject *m, PyObject *args)
{
    (void)m;
    int dev;
    if (!PyArg_ParseTuple(args, "i", &dev))
        return NULL;
    uint64_t bytes, blocks;
    int rc = bridge_managed_stats(dev, &bytes, &blocks);
    return Py_BuildValue("iKK", rc, (unsigned long long)bytes, (unsigned long long)blocks);
}

/* The functions of this file, one row each (pybind.h): X rows of the table, H rows written
 * by hand above, py_<name>. */
#define MANAGED_FUNCTIONS(X, H)                                                            \
    H(alloc_managed, VARARGS,                                                              \
      "alloc_managed(device, size, tag) -> (status, ManagedBlock | None): managed memory " \
      "(cuMemAllocManaged) on the budget, counted under the tag")                          \
    H(managed_stats, VARARGS,                                                              \
      "managed_stats(device) -> (status, bytes, blocks): the managed memory live now")

BRIDGE_METHOD_TABLE(managed_methods, MANAGED_FUNCTIONS);

int bridge_pymanaged_add(PyObject *m)
{
    if (PyModule_AddType(m, &ManagedBlockType) < 0) /* readied, added as its tp_name's last part */
        return -1;
    return PyModule_AddFunctions(m, managed_methods);
}
