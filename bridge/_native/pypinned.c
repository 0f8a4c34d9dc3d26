/* SPDX-License-Identifier: Apache-2.0 */
/* pypinned.c: the Python face of the pinned pool (pinned.c), in bridge._core.
 *
 *   PinnedBufferBase  owner of one pinned block (bridge/pinned.py subclasses
 *                     it as bridge.PinnedBuffer): buffer protocol (numpy
 *                     views), DLPack export, `ptr` and `size` (what CuPy's
 *                     PinnedMemoryPointer reads from its `mem`).
 *   pinned_*          module functions returning status codes, which
 *                     bridge/pinned.py turns into exceptions.
 *
 * DLPack (https://dmlc.github.io/dlpack/latest/python_spec.html): every
 * export holds its own reference to the block, released by the deleter,
 * which needs no GIL (consumers call it from any thread).  A capsule that is
 * never consumed keeps its name ("dltensor" / "dltensor_versioned") and its
 * destructor calls the deleter; a consumer renames it "used_*" and becomes
 * responsible.  Device type: kDLCUDAHost (3) for numpy, JAX and anyone who
 * does not ask, kDLCPU (1) for torch, which refuses 3 (see export_device).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#if PY_VERSION_HEX < 0x030B0000
#include <frameobject.h>
#endif

#include <stdlib.h>
#include <string.h>

#include "bridge.h"

/* ---- the DLPack ABI (dlpack.h, v1.x; plain C, no toolkit needed) ---- */
enum { kDLCPU = 1, kDLCUDAHost = 3 };
enum { kDLUInt = 1 };
#define DLPACK_FLAG_BITMASK_IS_COPIED (1ull << 1)

typedef struct { int32_t device_type; int32_t device_id; } DLDevice;
typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } DLDataType;
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;
typedef struct { uint32_t major; uint32_t minor; } DLPackVersion;
typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

/* One allocation per export: the managed tensor, then shape and strides. */
typedef struct {
    DLManagedTensor m;
    int64_t shape[1], strides[1];
} legacy_export;
typedef struct {
    DLManagedTensorVersioned m;
    int64_t shape[1], strides[1];
} versioned_export;

/* The deleters: release the block's reference, free the export. */
static void legacy_deleter(DLManagedTensor *m)
{
    if (!m)
        return;
    bridge_pinned_release((bridge_pinned_block *)m->manager_ctx);
    free(m);
}

static void versioned_deleter(DLManagedTensorVersioned *m)
{
    if (!m)
        return;
    bridge_pinned_release((bridge_pinned_block *)m->manager_ctx);
    free(m);
}

/* Capsule destructors: only an unconsumed capsule still owns its tensor. */
static void legacy_capsule_dtor(PyObject *cap)
{
    if (PyCapsule_IsValid(cap, "used_dltensor"))
        return;
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
    if (m && m->deleter)
        m->deleter(m);
    else
        PyErr_WriteUnraisable(cap);
    PyErr_Restore(t, v, tb);
}

static void versioned_capsule_dtor(PyObject *cap)
{
    if (PyCapsule_IsValid(cap, "used_dltensor_versioned"))
        return;
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    DLManagedTensorVersioned *m = PyCapsule_GetPointer(cap, "dltensor_versioned");
    if (m && m->deleter)
        m->deleter(m);
    else
        PyErr_WriteUnraisable(cap);
    PyErr_Restore(t, v, tb);
}

/* ---- PinnedBufferBase ---- */
typedef struct {
    PyObject_HEAD
    bridge_pinned_block *block; /* one reference; NULL for 0 bytes */
    void *ptr;                  /* the block's address; NULL for 0 bytes */
    Py_ssize_t size;            /* bytes asked for */
    PyObject *weakrefs;
} PinnedBuffer;

static char empty_bytes[1]; /* what a 0-byte buffer shows the buffer protocol */

static void PinnedBuffer_dealloc(PinnedBuffer *self)
{
    if (self->weakrefs)
        PyObject_ClearWeakRefs((PyObject *)self);
    bridge_pinned_block *b = self->block;
    self->block = NULL;
    bridge_pinned_release(b); /* never fails; a lock and a list push at most */
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *PinnedBuffer_get_ptr(PinnedBuffer *self, void *c)
{
    (void)c;
    return PyLong_FromVoidPtr(self->ptr);
}

static int PinnedBuffer_getbuffer(PinnedBuffer *self, Py_buffer *view, int flags)
{
    void *p = self->ptr ? self->ptr : (void *)empty_bytes;
    return PyBuffer_FillInfo(view, (PyObject *)self, p, self->size, 0, flags);
}

static PyBufferProcs PinnedBuffer_as_buffer = {
    .bf_getbuffer = (getbufferproc)PinnedBuffer_getbuffer,
};

/* Parse a (type, id) pair; -1 with an exception when it is not one. */
static int parse_pair(PyObject *o, const char *what, long *a, long *b)
{
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != 2) {
        PyErr_Format(PyExc_BufferError, "%s must be a tuple of two ints, got %R", what, o);
        return -1;
    }
    *a = PyLong_AsLong(PyTuple_GET_ITEM(o, 0));
    *b = PyLong_AsLong(PyTuple_GET_ITEM(o, 1));
    if (PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_BufferError, "%s must be a tuple of two ints, got %R", what, o);
        return -1;
    }
    return 0;
}

/* The device type of an export, from the call's own arguments (never from
 * who the caller is):
 *   dl_device given   what the consumer asks: (1, 0) kDLCPU or (3, 0) kDLCUDAHost;
 *   a stream given    kDLCUDAHost: a consumer that synchronizes with streams
 *                     knows device memory kinds (JAX passes one: an array
 *                     in pinned_host memory);
 *   otherwise         kDLCPU: torch.from_dlpack passes only max_version for
 *                     a non-CUDA device and refuses 3; a pre-2023 consumer
 *                     passes nothing.  Pinned memory seen as CPU memory is
 *                     still pinned (tensor.is_pinned() asks the driver). */
static int export_device(PyObject *dl_device, int stream_given, int *type)
{
    if (dl_device && dl_device != Py_None) {
        long t, id;
        if (parse_pair(dl_device, "dl_device", &t, &id) < 0)
            return -1;
        if (t != kDLCPU && t != kDLCUDAHost) {
            PyErr_Format(PyExc_BufferError,
                         "pinned host memory can be exported as kDLCPU (1) or kDLCUDAHost (3) "
                         "only, not device type %ld", t);
            return -1;
        }
        *type = (int)t;
        return 0;
    }
    *type = stream_given ? kDLCUDAHost : kDLCPU;
    return 0;
}

static PyObject *PinnedBuffer_dlpack(PinnedBuffer *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|OOOO:__dlpack__", names, &stream, &max_version,
                                     &dl_device, &copy))
        return NULL;
    /* Host memory has no stream to synchronize: writes are the host's own. */
    (void)stream;
    int stream_given = PyTuple_GET_SIZE(args) > 0 || (kw && PyDict_GetItemString(kw, "stream"));
    int type;
    if (export_device(dl_device, stream_given, &type) < 0)
        return NULL;
    int versioned = 0;
    if (max_version != Py_None) {
        long major, minor;
        if (parse_pair(max_version, "max_version", &major, &minor) < 0)
            return NULL;
        versioned = major >= 1;
    }
    int want_copy = 0;
    if (copy != Py_None && (want_copy = PyObject_IsTrue(copy)) < 0)
        return NULL;

    /* The export's own reference: the same block, or a copy in a new one. */
    bridge_pinned_block *b = self->block;
    void *data = self->ptr;
    if (want_copy && self->size > 0) {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = bridge_pinned_alloc((size_t)self->size, 1, &b);
        if (rc == BRIDGE_OK)
            memcpy(bridge_pinned_ptr(b), self->ptr, (size_t)self->size);
        Py_END_ALLOW_THREADS
        if (rc != BRIDGE_OK) {
            PyErr_Format(PyExc_BufferError,
                         "copy=True: no pinned memory for a copy of %zd bytes (status %d); "
                         "export without a copy, or free pinned memory first", self->size, rc);
            return NULL;
        }
        data = bridge_pinned_ptr(b);
    } else {
        bridge_pinned_retain(b);
    }

    DLTensor *t;
    PyObject *cap;
    if (versioned) {
        versioned_export *e = calloc(1, sizeof *e);
        if (!e) {
            bridge_pinned_release(b);
            return PyErr_NoMemory();
        }
        e->m.version.major = 1;
        e->m.version.minor = 0;
        e->m.manager_ctx = b;
        e->m.deleter = versioned_deleter;
        e->m.flags = want_copy ? DLPACK_FLAG_BITMASK_IS_COPIED : 0;
        e->shape[0] = self->size;
        e->strides[0] = 1;
        t = &e->m.dl_tensor;
        t->shape = e->shape;
        t->strides = e->strides;
        cap = PyCapsule_New(&e->m, "dltensor_versioned", versioned_capsule_dtor);
        if (!cap)
            versioned_deleter(&e->m);
    } else {
        legacy_export *e = calloc(1, sizeof *e);
        if (!e) {
            bridge_pinned_release(b);
            return PyErr_NoMemory();
        }
        e->m.manager_ctx = b;
        e->m.deleter = legacy_deleter;
        e->shape[0] = self->size;
        e->strides[0] = 1;
        t = &e->m.dl_tensor;
        t->shape = e->shape;
        t->strides = e->strides;
        cap = PyCapsule_New(&e->m, "dltensor", legacy_capsule_dtor);
        if (!cap)
            legacy_deleter(&e->m);
    }
    if (!cap)
        return NULL;
    t->data = data;
    t->device.device_type = type;
    t->device.device_id = 0;
    t->ndim = 1;
    t->dtype.code = kDLUInt;
    t->dtype.bits = 8;
    t->dtype.lanes = 1;
    t->byte_offset = 0;
    return cap;
}

static PyObject *PinnedBuffer_dlpack_device(PinnedBuffer *self, PyObject *a)
{
    (void)self;
    (void)a;
    return Py_BuildValue("ii", kDLCUDAHost, 0);
}

static PyObject *PinnedBuffer_repr(PinnedBuffer *self)
{
    return PyUnicode_FromFormat("<%s 0x%zx, %zd bytes, pinned>", Py_TYPE(self)->tp_name,
                                (size_t)self->ptr, self->size);
}

static PyMemberDef PinnedBuffer_members[] = {
    {"size", T_PYSSIZET, offsetof(PinnedBuffer, size), READONLY, "bytes"},
    {"nbytes", T_PYSSIZET, offsetof(PinnedBuffer, size), READONLY, "bytes"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef PinnedBuffer_getset[] = {
    {"ptr", (getter)PinnedBuffer_get_ptr, NULL, "host address (0 for 0 bytes)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef PinnedBuffer_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))PinnedBuffer_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(stream=None, max_version=None, dl_device=None, copy=None) -> PyCapsule"},
    {"__dlpack_device__", (PyCFunction)PinnedBuffer_dlpack_device, METH_NOARGS,
     "-> (3, 0): kDLCUDAHost, device 0"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PinnedBufferType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "bridge._core.PinnedBufferBase",
    .tp_basicsize = sizeof(PinnedBuffer),
    .tp_dealloc = (destructor)PinnedBuffer_dealloc,
    .tp_repr = (reprfunc)PinnedBuffer_repr,
    .tp_as_buffer = &PinnedBuffer_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "One block of the pinned pool; it returns to the pool when this object and "
              "every view and DLPack export of it are gone.",
    .tp_weaklistoffset = offsetof(PinnedBuffer, weakrefs),
    .tp_members = PinnedBuffer_members,
    .tp_getset = PinnedBuffer_getset,
    .tp_methods = PinnedBuffer_methods,
};

/* ---- module functions ---- */
static PyObject *py_pinned_setup(PyObject *m, PyObject *args)
{
    (void)m;
    int backend, chosen = -1, rc;
    if (!PyArg_ParseTuple(args, "i", &backend))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = bridge_pinned_setup(backend, &chosen);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("ii", rc, chosen);
}

/* pinned_alloc(cls, size) -> (status, buffer | None).  Fast path with the
 * GIL (a free-list pop); the driver is asked without it. */
static PyObject *py_pinned_alloc(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    (void)m;
    if (nargs != 2 || !PyType_Check(args[0]) ||
        !PyType_IsSubtype((PyTypeObject *)args[0], &PinnedBufferType)) {
        PyErr_SetString(PyExc_TypeError, "pinned_alloc(cls, size): cls a PinnedBufferBase type");
        return NULL;
    }
    Py_ssize_t size = PyLong_AsSsize_t(args[1]);
    if (size == -1 && PyErr_Occurred())
        return NULL;
    if (size < 0) {
        PyErr_Format(PyExc_ValueError, "size must be >= 0, got %zd", size);
        return NULL;
    }
    bridge_pinned_block *b = NULL;
    int rc = BRIDGE_OK;
    if (size > 0) {
        rc = bridge_pinned_alloc((size_t)size, 0, &b);
        if (rc == BRIDGE_OK && !b) {
            Py_BEGIN_ALLOW_THREADS
            rc = bridge_pinned_alloc((size_t)size, 1, &b);
            Py_END_ALLOW_THREADS
        }
        if (rc != BRIDGE_OK)
            return Py_BuildValue("iO", rc, Py_None);
    }
    PyTypeObject *cls = (PyTypeObject *)args[0];
    PinnedBuffer *self = (PinnedBuffer *)cls->tp_alloc(cls, 0);
    if (!self) {
        bridge_pinned_release(b);
        return NULL;
    }
    self->block = b;
    self->ptr = bridge_pinned_ptr(b);
    self->size = size;
    return Py_BuildValue("iN", rc, (PyObject *)self);
}

static PyObject *py_pinned_record(PyObject *m, PyObject *args)
{
    (void)m;
    unsigned long long addr, stream;
    if (!PyArg_ParseTuple(args, "KK", &addr, &stream))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bridge_pinned_record((const void *)(uintptr_t)addr, (void *)(uintptr_t)stream);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *py_pinned_lookup(PyObject *m, PyObject *args)
{
    (void)m;
    unsigned long long addr;
    if (!PyArg_ParseTuple(args, "K", &addr))
        return NULL;
    void *base = NULL;
    size_t size = 0;
    int rc = bridge_pinned_lookup((const void *)(uintptr_t)addr, &base, &size);
    return Py_BuildValue("iKn", rc, (unsigned long long)(uintptr_t)base, (Py_ssize_t)size);
}

static PyObject *py_pinned_set_limit(PyObject *m, PyObject *args)
{
    (void)m;
    unsigned long long limit;
    if (!PyArg_ParseTuple(args, "K", &limit))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bridge_pinned_set_limit(limit);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *py_pinned_trim(PyObject *m, PyObject *a)
{
    (void)m;
    (void)a;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bridge_pinned_trim();
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *py_pinned_reset_peak(PyObject *m, PyObject *a)
{
    (void)m;
    (void)a;
    return PyLong_FromLong(bridge_pinned_reset_peak());
}

static PyObject *py_pinned_stats(PyObject *m, PyObject *a)
{
    (void)m;
    (void)a;
    bridge_pinned_stats s;
    int rc = bridge_pinned_get_stats(&s);
    PyObject *d = Py_BuildValue(
        "{sisisKsKsKsKsKsKsKsKsKsKsKsKsKsKsK}", "backend", s.backend, "mempool_available",
        s.mempool_available, "limit", s.limit, "used", s.used, "free", s.free, "total", s.total,
        "peak_used", s.peak_used, "n_free_blocks", s.n_free_blocks, "n_pending_blocks",
        s.n_pending_blocks, "n_live_blocks", s.n_live_blocks, "num_allocs", s.num_allocs,
        "num_reuses", s.num_reuses, "num_base_allocs", s.num_base_allocs, "num_base_frees",
        s.num_base_frees, "num_ooms", s.num_ooms, "num_driver_errors", s.num_driver_errors,
        "num_records", s.num_records);
    if (!d)
        return NULL;
    return Py_BuildValue("iN", rc, d);
}

static PyMethodDef pinned_methods[] = {
    {"pinned_setup", py_pinned_setup, METH_VARARGS,
     "pinned_setup(backend) -> (status, chosen backend)"},
    {"pinned_alloc", (PyCFunction)(void (*)(void))py_pinned_alloc, METH_FASTCALL,
     "pinned_alloc(cls, size) -> (status, buffer or None)"},
    {"pinned_record", py_pinned_record, METH_VARARGS, "pinned_record(addr, stream) -> status"},
    {"pinned_lookup", py_pinned_lookup, METH_VARARGS, "pinned_lookup(addr) -> (status, base, size)"},
    {"pinned_set_limit", py_pinned_set_limit, METH_VARARGS, "pinned_set_limit(bytes) -> status"},
    {"pinned_trim", py_pinned_trim, METH_NOARGS, "pinned_trim() -> status"},
    {"pinned_reset_peak", py_pinned_reset_peak, METH_NOARGS, "pinned_reset_peak() -> status"},
    {"pinned_stats", py_pinned_stats, METH_NOARGS, "pinned_stats() -> (status, dict)"},
    {NULL, NULL, 0, NULL},
};

/* Called by PyInit__core (pymod.c): add the type, functions and constants. */
int bridge_pypinned_add(PyObject *m)
{
    if (PyType_Ready(&PinnedBufferType) < 0)
        return -1;
    Py_INCREF(&PinnedBufferType);
    if (PyModule_AddObject(m, "PinnedBufferBase", (PyObject *)&PinnedBufferType) < 0) {
        Py_DECREF(&PinnedBufferType);
        return -1;
    }
    if (PyModule_AddFunctions(m, pinned_methods) < 0 ||
        PyModule_AddIntConstant(m, "PINNED_CACHED", BRIDGE_PINNED_CACHED) < 0 ||
        PyModule_AddIntConstant(m, "PINNED_MEMPOOL", BRIDGE_PINNED_MEMPOOL) < 0 ||
        PyModule_AddIntConstant(m, "PINNED_AUTO", BRIDGE_PINNED_AUTO) < 0)
        return -1;
    return 0;
}
