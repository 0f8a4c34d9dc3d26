/* SPDX-License-Identifier: Apache-2.0 */
/* dlpack.c: DLPack export of pinned host blocks (see dlpack.h).
 *
 * DLPack (https://dmlc.github.io/dlpack/latest/python_spec.html): every
 * export holds its own reference to the block, released by the deleter,
 * which needs no GIL (consumers call it from any thread).  A capsule that is
 * never consumed keeps its name ("dltensor" / "dltensor_versioned") and its
 * destructor calls the deleter; a consumer renames it "used_*" and becomes
 * responsible.  The device type comes from the call's arguments (see
 * export_device).
 */
#include "dlpack.h"

#include <stdlib.h>
#include <string.h>

/* ---- the DLPack ABI (dlpack.h, v1.x; plain C, no toolkit needed) ---- */
enum { kDLUInt = 1 };
#define DLPACK_FLAG_BITMASK_IS_COPIED (1ull << 1)

typedef struct {
    int32_t device_type;
    int32_t device_id;
} DLDevice;
typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;
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
typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;
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
                         "only, not device type %ld",
                         t);
            return -1;
        }
        *type = (int)t;
        return 0;
    }
    *type = stream_given ? kDLCUDAHost : kDLCPU;
    return 0;
}

int bridge_dlpack_parse(PyObject *args, PyObject *kw, bridge_dlpack_request *req)
{
    static char *names[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|OOOO:__dlpack__", names, &stream, &max_version,
                                     &dl_device, &copy))
        return -1;
    /* Host memory has no stream to synchronize: writes are the host's own.
     * That one was given tells what the consumer knows of device memory. */
    int stream_given = PyTuple_GET_SIZE(args) > 0 || (kw && PyDict_GetItemString(kw, "stream"));
    if (export_device(dl_device, stream_given, &req->device_type) < 0)
        return -1;
    req->versioned = 0;
    if (max_version != Py_None) {
        long major, minor;
        if (parse_pair(max_version, "max_version", &major, &minor) < 0)
            return -1;
        req->versioned = major >= 1;
    }
    req->copy = 0;
    if (copy != Py_None && (req->copy = PyObject_IsTrue(copy)) < 0)
        return -1;
    return 0;
}

PyObject *bridge_dlpack_capsule(bridge_pinned_block *b, void *data, Py_ssize_t size,
                                const bridge_dlpack_request *req)
{
    DLTensor *t;
    PyObject *cap;
    if (req->versioned) {
        versioned_export *e = calloc(1, sizeof *e);
        if (!e) {
            bridge_pinned_release(b);
            return PyErr_NoMemory();
        }
        e->m.version.major = 1;
        e->m.version.minor = 0;
        e->m.manager_ctx = b;
        e->m.deleter = versioned_deleter;
        e->m.flags = req->copy ? DLPACK_FLAG_BITMASK_IS_COPIED : 0;
        e->shape[0] = size;
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
        e->shape[0] = size;
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
    t->device.device_type = req->device_type;
    t->device.device_id = 0;
    t->ndim = 1;
    t->dtype.code = kDLUInt;
    t->dtype.bits = 8;
    t->dtype.lanes = 1;
    t->byte_offset = 0;
    return cap;
}
