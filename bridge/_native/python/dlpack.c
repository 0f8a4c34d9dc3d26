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
static void release_export(void *block, void *export)
{
    bridge_pinned_release((bridge_pinned_block *)block);
    free(export);
}

static void legacy_deleter(DLManagedTensor *m)
{
    if (m)
        release_export(m->manager_ctx, m);
}

static void versioned_deleter(DLManagedTensorVersioned *m)
{
    if (m)
        release_export(m->manager_ctx, m);
}

/* Capsule destructors: only an unconsumed capsule (its name not yet
 * "used_*") still owns its tensor, which its own deleter frees; never
 * raises, keeps a pending error. */
static void capsule_dtor(PyObject *cap, int versioned)
{
    if (PyCapsule_IsValid(cap, versioned ? "used_dltensor_versioned" : "used_dltensor"))
        return;
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    void *m = PyCapsule_GetPointer(cap, versioned ? "dltensor_versioned" : "dltensor");
    DLManagedTensorVersioned *mv = versioned ? m : NULL;
    DLManagedTensor *ml = versioned ? NULL : m;
    if (mv && mv->deleter)
        mv->deleter(mv);
    else if (ml && ml->deleter)
        ml->deleter(ml);
    else
        PyErr_WriteUnraisable(cap);
    PyErr_Restore(t, v, tb);
}

static void legacy_capsule_dtor(PyObject *cap)
{
    capsule_dtor(cap, 0);
}

static void versioned_capsule_dtor(PyObject *cap)
{
    capsule_dtor(cap, 1);
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
        if (id != 0) { /* host memory is device 0 of either kind */
            PyErr_Format(PyExc_BufferError,
                         "pinned host memory is device (%ld, 0), not (%ld, %ld): ask for device "
                         "id 0",
                         t, t, id);
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

/* An export's tensor: `size` uint8 bytes at `data`, its shape and strides
 * those of the export. */
static void fill_tensor(DLTensor *t, int64_t *shape, int64_t *strides, void *data, Py_ssize_t size,
                        int device_type)
{
    shape[0] = size;
    strides[0] = 1;
    t->data = data;
    t->device.device_type = device_type;
    t->device.device_id = 0;
    t->ndim = 1;
    t->dtype.code = kDLUInt;
    t->dtype.bits = 8;
    t->dtype.lanes = 1;
    t->shape = shape;
    t->strides = strides;
    t->byte_offset = 0;
}

/* The capsule of managed tensor `m`; when it cannot be made, the tensor's
 * export is released (release_export) and NULL. */
static PyObject *capsule_of(void *m, void *block, const char *name, PyCapsule_Destructor dtor)
{
    PyObject *cap = PyCapsule_New(m, name, dtor);
    if (!cap)
        release_export(block, m);
    return cap;
}

PyObject *bridge_dlpack_capsule(bridge_pinned_block *b, void *data, Py_ssize_t size,
                                const bridge_dlpack_request *req)
{
    void *e = calloc(1, req->versioned ? sizeof(versioned_export) : sizeof(legacy_export));
    if (!e) {
        bridge_pinned_release(b);
        return PyErr_NoMemory();
    }
    if (req->versioned) {
        versioned_export *v = e;
        v->m.version.major = 1;
        v->m.version.minor = 0;
        v->m.manager_ctx = b;
        v->m.deleter = versioned_deleter;
        v->m.flags = req->copy ? DLPACK_FLAG_BITMASK_IS_COPIED : 0;
        fill_tensor(&v->m.dl_tensor, v->shape, v->strides, data, size, req->device_type);
        return capsule_of(&v->m, b, "dltensor_versioned", versioned_capsule_dtor);
    }
    legacy_export *l = e;
    l->m.manager_ctx = b;
    l->m.deleter = legacy_deleter;
    fill_tensor(&l->m.dl_tensor, l->shape, l->strides, data, size, req->device_type);
    return capsule_of(&l->m, b, "dltensor", legacy_capsule_dtor);
}
