/* SPDX-License-Identifier: Apache-2.0 */
/* pymanaged.c: the Python face of managed.c (bridge._core.ManagedBlock and
 * functions): a managed block is owned by a C object whose dealloc frees it
 * (cuMemFree may wait for the device: the GIL is released around it). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include "bridge.h"
#include "managed.h"

typedef struct {
    PyObject_HEAD
    void *ptr;
    Py_ssize_t size;
    int device;
} ManagedBlock;

static void ManagedBlock_dealloc(ManagedBlock *self)
{
    void *p = self->ptr;
    self->ptr = NULL;
    if (p) {
        Py_BEGIN_ALLOW_THREADS
        bridge_free_managed(p); /* never fails: counts what went wrong */
        Py_END_ALLOW_THREADS
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *ManagedBlock_get_ptr(ManagedBlock *self, void *c)
{
    (void)c;
    return PyLong_FromVoidPtr(self->ptr);
}

static PyObject *ManagedBlock_repr(ManagedBlock *self)
{
    return PyUnicode_FromFormat("<bridge managed block %p, %zd bytes, device %d>", self->ptr,
                                self->size, self->device);
}

static PyMemberDef ManagedBlock_members[] = {
    {"size", T_PYSSIZET, offsetof(ManagedBlock, size), READONLY, "bytes"},
    {"device", T_INT, offsetof(ManagedBlock, device), READONLY, "device ordinal"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef ManagedBlock_getset[] = {
    {"ptr", (getter)ManagedBlock_get_ptr, NULL, "address (device and host)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ManagedBlockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "bridge._core.ManagedBlock",
    .tp_basicsize = sizeof(ManagedBlock),
    .tp_dealloc = (destructor)ManagedBlock_dealloc,
    .tp_repr = (reprfunc)ManagedBlock_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One managed allocation on the budget, freed when this object dies.",
    .tp_members = ManagedBlock_members,
    .tp_getset = ManagedBlock_getset,
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
    ManagedBlock *b = PyObject_New(ManagedBlock, &ManagedBlockType);
    if (!b) {
        bridge_free_managed(p);
        return NULL;
    }
    b->ptr = p;
    b->size = size;
    b->device = dev;
    PyObject *out = Py_BuildValue("iO", rc, (PyObject *)b);
    Py_DECREF(b);
    return out;
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

static PyMethodDef managed_methods[] = {
    {"alloc_managed", py_alloc_managed, METH_VARARGS,
     "alloc_managed(device, size, tag) -> (status, ManagedBlock | None): managed memory "
     "(cuMemAllocManaged) on the budget, counted under the tag"},
    {"managed_stats", py_managed_stats, METH_VARARGS,
     "managed_stats(device) -> (status, bytes, blocks): the managed memory live now"},
    {NULL, NULL, 0, NULL},
};

int bridge_pymanaged_add(PyObject *m)
{
    if (PyModule_AddType(m, &ManagedBlockType) < 0) /* readied, added as its tp_name's last part */
        return -1;
    return PyModule_AddFunctions(m, managed_methods);
}
