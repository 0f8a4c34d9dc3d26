/* SPDX-License-Identifier: Apache-2.0 */
/* _cupy_alloc.c: CuPy's allocator on the shared pool (bridge._core.CupyAllocator),
 * compiled into bridge._core (setup.py; frameworks.h lists its module hook).
 *
 * The callable handed to cupy.cuda.set_allocator by the CuPy adapter
 * (adapters/cupy.py): it asks CuPy for the device and stream, allocates,
 * and wraps the block (a Block, pyblock.h) in CuPy's UnownedMemory +
 * MemoryPointer.  CuPy's device and stream come from its own C functions
 * when the adapter hands their capsules over (Cython exports a module's
 * cdef and cpdef functions in `__pyx_capi__`, each capsule named by the
 * function's C signature): a C call each, where the Python callables cost a
 * Python call and an int object, and the stream is asked for on the device
 * already known.  A capsule whose name is not the signature this file calls
 * is not used: the Python callables stay the path then.  A block the core's
 * cache of freed blocks holds is taken with the GIL kept (bridge_alloc_cached:
 * a lock and a pop, no driver call, no wait); only a miss releases the GIL around bridge_alloc, which may call
 * the driver, run the recovery chain or wait for memory.  Releasing it on
 * every call let other threads take it each time, and the allocating thread
 * could then wait a whole switch interval to get it back (a convoy).  CuPy's
 * classes and functions come from the adapter: this file imports nothing of
 * CuPy's.
 */
#include "pyblock.h"

#include <string.h>
#include <structmember.h>

#include "bridge.h"

static PyObject *str_ptr; /* interned "ptr" */

typedef bridge_Block Block;

/* CuPy's C functions, as Cython declares them (cupy/cuda/device.pxd and
 * stream.pxd): `cpdef int get_device_id() except? -1` and
 * `cpdef get_current_stream(int device_id=*)`.  A cpdef function takes a
 * leading skip-dispatch flag; its optional arguments come in a struct
 * whose first field counts those given. */
typedef int (*cupy_device_fn)(int skip_dispatch);
typedef struct {
    int n; /* optional arguments given */
    int device_id;
} cupy_stream_opt;
typedef PyObject *(*cupy_stream_fn)(int skip_dispatch, cupy_stream_opt *opt);

#define CUPY_DEVICE_SIGNATURE "int (int __pyx_skip_dispatch)"
#define CUPY_STREAM_SIGNATURE                                                                  \
    "PyObject *(int __pyx_skip_dispatch, struct "                                              \
    "__pyx_opt_args_4cupy_4cuda_6stream_get_current_stream *__pyx_optional_args)"

typedef struct {
    PyObject_HEAD
    PyObject *get_device; /* () -> int: CuPy's current device */
    PyObject *get_stream; /* () -> CuPy's current Stream (its .ptr is the handle) */
    PyObject *unowned;    /* cupy.cuda.memory.UnownedMemory */
    PyObject *pointer;    /* cupy.cuda.memory.MemoryPointer */
    PyObject *on_failure; /* (size, device, stream, status) -> MemoryPointer or raise */
    PyObject *capsules;   /* (device capsule, stream capsule) in use, or None */
    cupy_device_fn device_c; /* CuPy's get_device_id, or NULL: call get_device */
    cupy_stream_fn stream_c; /* CuPy's get_current_stream, or NULL: call get_stream */
    int tag;
    unsigned long long num_gil_releases; /* calls that went to bridge_alloc without the GIL */
    vectorcallfunc vectorcall;
} CupyAllocator;

static int CupyAllocator_traverse(CupyAllocator *self, visitproc visit, void *arg)
{
    Py_VISIT(self->get_device);
    Py_VISIT(self->get_stream);
    Py_VISIT(self->unowned);
    Py_VISIT(self->pointer);
    Py_VISIT(self->on_failure);
    Py_VISIT(self->capsules);
    return 0;
}

static int CupyAllocator_clear(CupyAllocator *self)
{
    Py_CLEAR(self->get_device);
    Py_CLEAR(self->get_stream);
    Py_CLEAR(self->unowned);
    Py_CLEAR(self->pointer);
    Py_CLEAR(self->on_failure);
    Py_CLEAR(self->capsules);
    self->device_c = NULL;
    self->stream_c = NULL;
    return 0;
}

static void CupyAllocator_dealloc(CupyAllocator *self)
{
    PyObject_GC_UnTrack(self);
    CupyAllocator_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Wrap a block as cupy's MemoryPointer(UnownedMemory(ptr, size, block, dev), 0). */
static PyObject *wrap_block(CupyAllocator *self, PyObject *block, void *ptr, size_t size, int dev)
{
    PyObject *args[5] = {NULL};
    PyObject *mem = NULL, *out = NULL;
    args[1] = PyLong_FromVoidPtr(ptr);
    args[2] = PyLong_FromSize_t(size);
    args[3] = block;
    args[4] = PyLong_FromLong(dev);
    if (args[1] && args[2] && args[4])
        mem =
            PyObject_Vectorcall(self->unowned, args + 1, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_XDECREF(args[1]);
    Py_XDECREF(args[2]);
    Py_XDECREF(args[4]);
    if (mem) {
        PyObject *pargs[3] = {NULL, mem, NULL};
        pargs[2] = PyLong_FromLong(0);
        if (pargs[2])
            out = PyObject_Vectorcall(self->pointer, pargs + 1, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                      NULL);
        Py_XDECREF(pargs[2]);
        Py_DECREF(mem);
    }
    return out;
}

static PyObject *CupyAllocator_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                          PyObject *kwnames)
{
    CupyAllocator *self = (CupyAllocator *)callable;
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames) {
        PyErr_SetString(PyExc_TypeError, "the allocator takes one argument: the size in bytes");
        return NULL;
    }
    size_t size = PyLong_AsSize_t(args[0]);
    if (size == (size_t)-1 && PyErr_Occurred())
        return NULL;
    long dev;
    PyObject *o;
    if (self->device_c) {
        int d = self->device_c(1);
        if (d == -1 && PyErr_Occurred())
            return NULL;
        dev = d;
    } else {
        o = PyObject_CallNoArgs(self->get_device);
        if (!o)
            return NULL;
        dev = PyLong_AsLong(o);
        Py_DECREF(o);
        if (dev == -1 && PyErr_Occurred())
            return NULL;
    }
    PyObject *stream_obj;
    if (self->stream_c) {
        cupy_stream_opt opt = {1, (int)dev}; /* the device's stream: no second lookup */
        stream_obj = self->stream_c(1, &opt);
    } else
        stream_obj = PyObject_CallNoArgs(self->get_stream);
    if (!stream_obj)
        return NULL;
    o = PyObject_GetAttr(stream_obj, str_ptr);
    void *stream = o ? PyLong_AsVoidPtr(o) : NULL;
    Py_XDECREF(o);
    if (!o || (!stream && PyErr_Occurred())) {
        Py_DECREF(stream_obj);
        return NULL;
    }
    void *ptr = NULL;
    /* a cache hit keeps the GIL; a miss drops it around the core */
    int rc = bridge_alloc_cached((int)dev, size, stream, self->tag, &ptr);
    if (rc == BRIDGE_E_MISS) {
        self->num_gil_releases++;
        Py_BEGIN_ALLOW_THREADS
        rc = bridge_alloc((int)dev, size, stream, self->tag, &ptr);
        Py_END_ALLOW_THREADS
    }
    if (rc != BRIDGE_OK) {
        Py_DECREF(stream_obj);
        if (raise_if_interrupted() < 0)
            return NULL; /* Ctrl-C while waiting: KeyboardInterrupt, nothing allocated */
        return PyObject_CallFunction(self->on_failure, "nlni", (Py_ssize_t)size, dev,
                                     (Py_ssize_t)(intptr_t)stream, rc);
    }
    PyObject *block = block_new(ptr, size, (int)dev, stream_obj);
    Py_DECREF(stream_obj);
    if (!block)
        return NULL;
    PyObject *out = wrap_block(self, block, ptr, size, (int)dev);
    Py_DECREF(block);
    return out;
}

/* The function a capsule holds when its name is `signature`; NULL (no error
 * set) for None, another signature or anything else. */
static void *capsule_function(PyObject *capsule, const char *signature)
{
    if (!capsule || !PyCapsule_CheckExact(capsule))
        return NULL;
    const char *name = PyCapsule_GetName(capsule);
    if (!name || strcmp(name, signature) != 0)
        return NULL;
    void *fn = PyCapsule_GetPointer(capsule, name);
    if (!fn)
        PyErr_Clear();
    return fn;
}

static PyObject *CupyAllocator_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *names[] = {"get_device", "get_stream",     "unowned_memory",
                            "memory_pointer", "on_failure", "tag",
                            "device_capsule", "stream_capsule", NULL};
    PyObject *gd, *gs, *um, *mp, *of, *dcap = NULL, *scap = NULL;
    int tag = BRIDGE_TAG_CUPY;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|iOO", names, &gd, &gs, &um, &mp, &of, &tag,
                                     &dcap, &scap))
        return NULL;
    if (tag < 0 || tag >= BRIDGE_NTAGS) {
        PyErr_Format(PyExc_ValueError, "tag must be in [0, %d), got %d", BRIDGE_NTAGS, tag);
        return NULL;
    }
    CupyAllocator *self = (CupyAllocator *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    Py_INCREF(gd);
    Py_INCREF(gs);
    Py_INCREF(um);
    Py_INCREF(mp);
    Py_INCREF(of);
    self->get_device = gd;
    self->get_stream = gs;
    self->unowned = um;
    self->pointer = mp;
    self->on_failure = of;
    /* both of CuPy's functions, or neither: the device and its stream come one way */
    void *dfn = capsule_function(dcap, CUPY_DEVICE_SIGNATURE);
    void *sfn = capsule_function(scap, CUPY_STREAM_SIGNATURE);
    if (dfn && sfn) {
        self->device_c = (cupy_device_fn)dfn;
        self->stream_c = (cupy_stream_fn)sfn;
        self->capsules = PyTuple_Pack(2, dcap, scap);
        if (!self->capsules) {
            Py_DECREF(self);
            return NULL;
        }
    } else {
        Py_INCREF(Py_None);
        self->capsules = Py_None;
    }
    self->tag = tag;
    self->vectorcall = CupyAllocator_vectorcall;
    return (PyObject *)self;
}

static PyObject *CupyAllocator_wrap(CupyAllocator *self, PyObject *args)
{
    /* wrap(ptr, size, device): used by the recovery path after a retry */
    PyObject *blockobj;
    if (!PyArg_ParseTuple(args, "O!", &BlockType, &blockobj))
        return NULL;
    Block *b = (Block *)blockobj;
    return wrap_block(self, blockobj, b->ptr, b->size, b->device);
}

static PyMethodDef CupyAllocator_methods[] = {
    {"wrap", (PyCFunction)CupyAllocator_wrap, METH_VARARGS, "Wrap a Block as a MemoryPointer."},
    {NULL, NULL, 0, NULL},
};

static PyObject *CupyAllocator_direct(CupyAllocator *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(self->device_c != NULL);
}

static PyGetSetDef CupyAllocator_getset[] = {
    {"direct_lookups", (getter)CupyAllocator_direct, NULL,
     "Whether CuPy's device and stream come from its C functions (their capsules), not from "
     "Python calls.",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef CupyAllocator_members[] = {
    {"num_gil_releases", T_ULONGLONG, offsetof(CupyAllocator, num_gil_releases), READONLY,
     "Calls that released the GIL: those the cache of freed blocks could not serve."},
    {NULL, 0, 0, 0, NULL},
};

PyDoc_STRVAR(CupyAllocator_doc,
             "CuPy allocator on the shared pool: call with a size, get a MemoryPointer.\n"
             "\n"
             "A block the core's cache of freed blocks holds (same size, same stream) is\n"
             "served with the GIL held; any other request releases the GIL while the core\n"
             "allocates.  num_gil_releases (read-only) counts the calls that released it.\n"
             "\n"
             "device_capsule and stream_capsule: CuPy's get_device_id and\n"
             "get_current_stream from their modules' __pyx_capi__; when both carry the\n"
             "signatures this type calls, they replace get_device and get_stream\n"
             "(direct_lookups tells).");

static PyTypeObject CupyAllocatorType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "bridge._core.CupyAllocator",
    .tp_basicsize = sizeof(CupyAllocator),
    .tp_dealloc = (destructor)CupyAllocator_dealloc,
    .tp_vectorcall_offset = offsetof(CupyAllocator, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = CupyAllocator_doc,
    .tp_traverse = (traverseproc)CupyAllocator_traverse,
    .tp_clear = (inquiry)CupyAllocator_clear,
    .tp_methods = CupyAllocator_methods,
    .tp_members = CupyAllocator_members,
    .tp_getset = CupyAllocator_getset,
    .tp_new = CupyAllocator_new,
};

int bridge_pycupy_add(PyObject *m);
int bridge_pycupy_add(PyObject *m)
{
    if (!str_ptr && !(str_ptr = PyUnicode_InternFromString("ptr")))
        return -1;
    if (PyType_Ready(&CupyAllocatorType) < 0)
        return -1;
    Py_INCREF(&CupyAllocatorType);
    if (PyModule_AddObject(m, "CupyAllocator", (PyObject *)&CupyAllocatorType) < 0) {
        Py_DECREF(&CupyAllocatorType);
        return -1;
    }
    /* each block holds its Stream until its free returns: the core may order
     * the free on it (streams.c) */
    bridge_set_tag_holds_streams(BRIDGE_TAG_CUPY, 1);
    return PyModule_AddObject(m, "CUPY_POOL", PyLong_FromUnsignedLongLong(BRIDGE_CUPY_POOL));
}
