/* SPDX-License-Identifier: Apache-2.0 */
/* pycallback.c: allocation callables for libraries that call back into
 * Python with (size, stream) and (address, size, stream), in bridge._core.
 *
 *   StreamAllocator  bound to one device and one framework tag: called with
 *                    (nbytes, stream), allocates from the shared pool on
 *                    that stream without the GIL and returns the address
 *                    as an int.  Failures go to `on_failure`, which raises
 *                    the framework's own OOM error (or returns an address
 *                    after setting the device up).
 *   stream_free      (address, nbytes, stream): the block is freed in the
 *                    order of `stream` too (after the work queued on it so
 *                    far), then returned.  Never raises for a bad address:
 *                    the core counts it (bad_frees).
 *
 * A stream is an int handle or any object with __cuda_stream__ (the CUDA
 * stream protocol: a (version, handle) tuple), which is what RMM hands its
 * callback resource.  No Python frame runs per call: one attribute call for
 * the stream handle, then the core.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "bridge.h"
#include "pybind.h"

static PyObject *str_cuda_stream; /* interned "__cuda_stream__" */

/* The handle of a stream argument; -1 with an exception set when unreadable. */
static int stream_handle_of(PyObject *s, void **out)
{
    *out = NULL;
    if (s == Py_None)
        return 0;
    if (PyLong_Check(s)) {
        *out = PyLong_AsVoidPtr(s);
        return *out == NULL && PyErr_Occurred() ? -1 : 0;
    }
    PyObject *t = PyObject_CallMethodNoArgs(s, str_cuda_stream);
    if (!t)
        return -1;
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 2) {
        Py_DECREF(t);
        PyErr_SetString(PyExc_TypeError, "__cuda_stream__() must return (version, handle)");
        return -1;
    }
    *out = PyLong_AsVoidPtr(PyTuple_GET_ITEM(t, 1));
    Py_DECREF(t);
    return *out == NULL && PyErr_Occurred() ? -1 : 0;
}

/* ---- StreamAllocator ---- */
typedef struct {
    PyObject_HEAD
    int device;
    int tag;
    PyObject *on_failure; /* (size, device, stream handle, status) -> address or raise */
    vectorcallfunc vectorcall;
} StreamAllocator;

static int StreamAllocator_traverse(StreamAllocator *self, visitproc visit, void *arg)
{
    Py_VISIT(self->on_failure);
    return 0;
}

static int StreamAllocator_clear(StreamAllocator *self)
{
    Py_CLEAR(self->on_failure);
    return 0;
}

static void StreamAllocator_dealloc(StreamAllocator *self)
{
    PyObject_GC_UnTrack(self);
    StreamAllocator_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* fast path: one call for the stream handle, then bridge_alloc without the GIL */
static PyObject *StreamAllocator_vectorcall(PyObject *callable, PyObject *const *args,
                                            size_t nargsf, PyObject *kwnames)
{
    StreamAllocator *self = (StreamAllocator *)callable;
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (n < 1 || n > 2 || kwnames) {
        PyErr_SetString(
            PyExc_TypeError,
            "the allocator takes (nbytes, stream=None): the size in bytes and a stream");
        return NULL;
    }
    size_t size = PyLong_AsSize_t(args[0]);
    if (size == (size_t)-1 && PyErr_Occurred())
        return NULL;
    void *stream = NULL;
    if (n == 2 && stream_handle_of(args[1], &stream) < 0)
        return NULL;
    void *ptr = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bridge_alloc(self->device, size, stream, self->tag, &ptr);
    Py_END_ALLOW_THREADS
    if (rc != BRIDGE_OK)
        return PyObject_CallFunction(self->on_failure, "nini", (Py_ssize_t)size, self->device,
                                     (Py_ssize_t)(intptr_t)stream, rc);
    return PyLong_FromVoidPtr(ptr);
}

static PyObject *StreamAllocator_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *names[] = {"device", "tag", "on_failure", NULL};
    int device, tag;
    PyObject *of;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiO", names, &device, &tag, &of))
        return NULL;
    if (tag < 0 || tag >= BRIDGE_NTAGS) {
        PyErr_Format(PyExc_ValueError, "tag must be in [0, %d), got %d", BRIDGE_NTAGS, tag);
        return NULL;
    }
    if (device < 0 || device >= BRIDGE_MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "device must be in [0, %d), got %d", BRIDGE_MAX_DEVICES,
                     device);
        return NULL;
    }
    if (!PyCallable_Check(of)) {
        PyErr_SetString(PyExc_TypeError, "on_failure must be callable");
        return NULL;
    }
    StreamAllocator *self = (StreamAllocator *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    Py_INCREF(of);
    self->device = device;
    self->tag = tag;
    self->on_failure = of;
    self->vectorcall = StreamAllocator_vectorcall;
    return (PyObject *)self;
}

static PyObject *StreamAllocator_repr(StreamAllocator *self)
{
    return PyUnicode_FromFormat("<bridge StreamAllocator device %d, tag %d>", self->device,
                                self->tag);
}

static PyObject *StreamAllocator_get_device(StreamAllocator *self, void *c)
{
    (void)c;
    return PyLong_FromLong(self->device);
}

static PyObject *StreamAllocator_get_tag(StreamAllocator *self, void *c)
{
    (void)c;
    return PyLong_FromLong(self->tag);
}

static PyGetSetDef StreamAllocator_getset[] = {
    {"device", (getter)StreamAllocator_get_device, NULL, "the device it allocates on", NULL},
    {"tag", (getter)StreamAllocator_get_tag, NULL, "the framework tag it counts under", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject StreamAllocatorType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "bridge._core.StreamAllocator",
    .tp_basicsize = sizeof(StreamAllocator),
    .tp_dealloc = (destructor)StreamAllocator_dealloc,
    .tp_repr = (reprfunc)StreamAllocator_repr,
    .tp_vectorcall_offset = offsetof(StreamAllocator, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Allocator of one device and tag: call with (nbytes, stream), get an address.",
    .tp_traverse = (traverseproc)StreamAllocator_traverse,
    .tp_clear = (inquiry)StreamAllocator_clear,
    .tp_getset = StreamAllocator_getset,
    .tp_new = StreamAllocator_new,
};

/* ---- stream_free ---- */
static PyObject *py_stream_free(PyObject *m, PyObject *const *args, Py_ssize_t n)
{
    /* (address, nbytes, stream=None): never raises for the address itself */
    (void)m;
    if (n < 1 || n > 3) {
        PyErr_SetString(PyExc_TypeError, "stream_free(address, nbytes=0, stream=None)");
        return NULL;
    }
    void *ptr = PyLong_AsVoidPtr(args[0]);
    if (!ptr && PyErr_Occurred())
        return NULL;
    void *stream = NULL;
    int with_stream = n == 3 && args[2] != Py_None;
    if (with_stream && stream_handle_of(args[2], &stream) < 0) {
        /* an unreadable stream: free in the block's own stream order, report after */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        Py_BEGIN_ALLOW_THREADS
        bridge_free(ptr);
        Py_END_ALLOW_THREADS
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    /* The caller's stream may still use the block: its queued work completes
     * before the memory is reused. */
    if (with_stream)
        bridge_free_on_stream(ptr, stream);
    else
        bridge_free(ptr);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* The functions of this file, one row each (pybind.h): X rows of the table, H rows written
 * by hand above, py_<name>. */
#define CALLBACK_FUNCTIONS(X, H) \
    H(stream_free, FASTCALL,     \
      "stream_free(address, nbytes=0, stream=None): free after the stream's queued work")

BRIDGE_METHOD_TABLE(callback_methods, CALLBACK_FUNCTIONS);

int bridge_pycallback_add(PyObject *m)
{
    str_cuda_stream = PyUnicode_InternFromString("__cuda_stream__");
    /* PyModule_AddType readies the type and adds it under its tp_name's last part */
    if (!str_cuda_stream || PyModule_AddType(m, &StreamAllocatorType) < 0)
        return -1;
    return PyModule_AddFunctions(m, callback_methods);
}
