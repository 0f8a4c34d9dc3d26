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
 * The DLPack export itself (capsules, deleters, the device type) is
 * dlpack.c.
 */
#include "dlpack.h"
#include "pybind.h"
#include "pyowner.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- PinnedBufferBase ---- */
typedef struct {
    BRIDGE_OWNER_HEAD;          /* ptr: the block's address; NULL for 0 bytes */
    Py_ssize_t size;            /* bytes asked for */
    bridge_pinned_block *block; /* one reference; NULL for 0 bytes */
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

static int PinnedBuffer_getbuffer(PinnedBuffer *self, Py_buffer *view, int flags)
{
    void *p = self->ptr ? self->ptr : (void *)empty_bytes;
    return PyBuffer_FillInfo(view, (PyObject *)self, p, self->size, 0, flags);
}

static PyBufferProcs PinnedBuffer_as_buffer = {
    .bf_getbuffer = (getbufferproc)PinnedBuffer_getbuffer,
};

static PyObject *PinnedBuffer_dlpack(PinnedBuffer *self, PyObject *args, PyObject *kw)
{
    bridge_dlpack_request req;
    if (bridge_dlpack_parse(args, kw, &req) < 0)
        return NULL;
    /* The export's own reference: the same block, or a copy in a new one. */
    bridge_pinned_block *b = self->block;
    void *data = self->ptr;
    if (req.copy && self->size > 0) {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = bridge_pinned_alloc((size_t)self->size, 1, &b);
        if (rc == BRIDGE_OK)
            memcpy(bridge_pinned_ptr(b), self->ptr, (size_t)self->size);
        Py_END_ALLOW_THREADS
        if (rc != BRIDGE_OK) {
            PyErr_Format(PyExc_BufferError,
                         "copy=True: no pinned memory for a copy of %zd bytes (status %d); "
                         "export without a copy, or free pinned memory first",
                         self->size, rc);
            return NULL;
        }
        data = bridge_pinned_ptr(b);
    } else {
        bridge_pinned_retain(b);
    }
    return bridge_dlpack_capsule(b, data, self->size, &req);
}

static PyObject *PinnedBuffer_dlpack_device(PinnedBuffer *self, PyObject *a)
{
    (void)self;
    (void)a;
    return Py_BuildValue("ii", kDLCUDAHost, 0);
}

static PyObject *PinnedBuffer_repr(PinnedBuffer *self)
{
    char hex[2 + 2 * sizeof(size_t) + 1]; /* PyUnicode_FromFormat knows no %zx before 3.12 */
    snprintf(hex, sizeof hex, "0x%zx", (size_t)self->ptr);
    return PyUnicode_FromFormat("<%s %s, %zd bytes, pinned>", Py_TYPE(self)->tp_name, hex,
                                self->size);
}

BRIDGE_OWNER_ATTRIBUTES(PinnedBuffer, "host address (0 for 0 bytes)",
                        BRIDGE_OWNER_SIZE(PinnedBuffer, "size")
                            BRIDGE_OWNER_SIZE(PinnedBuffer, "nbytes"));

static PyMethodDef PinnedBuffer_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))PinnedBuffer_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(stream=None, max_version=None, dl_device=None, copy=None) -> PyCapsule"},
    {"__dlpack_device__", (PyCFunction)PinnedBuffer_dlpack_device, METH_NOARGS,
     "-> (3, 0): kDLCUDAHost, device 0"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PinnedBufferType = {
    BRIDGE_OWNER_TYPE(PinnedBuffer, "PinnedBufferBase", Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
                      "One block of the pinned pool; it returns to the pool when this object and "
                      "every view and DLPack export of it are gone."),
    .tp_as_buffer = &PinnedBuffer_as_buffer,
    .tp_weaklistoffset = offsetof(PinnedBuffer, weakrefs),
    .tp_methods = PinnedBuffer_methods,
};

/* ---- module functions ---- */
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

/* The functions of this file, one row each (pybind.h): X rows of the table, H rows written
 * by hand above, py_<name>. */
#define PINNED_FUNCTIONS(X, H)                                                                 \
    /* the pool */                                                                             \
    X(pinned_setup, i_out_i, bridge_pinned_setup, "i", BIND_NOGIL,                             \
      "pinned_setup(backend) -> (status, chosen backend)", BIND_NO_DEFAULTS)                   \
    X(pinned_set_limit, k, bridge_pinned_set_limit, "K", BIND_NOGIL,                           \
      "pinned_set_limit(bytes) -> status", BIND_NO_DEFAULTS)                                   \
    X(pinned_trim, v, bridge_pinned_trim, BIND_NO_ARGS, BIND_NOGIL, "pinned_trim() -> status", \
      BIND_NO_DEFAULTS)                                                                        \
    /* its blocks */                                                                           \
    H(pinned_alloc, FASTCALL, "pinned_alloc(cls, size) -> (status, buffer or None)")           \
    X(pinned_record, cpp, bridge_pinned_record, "KK", BIND_NOGIL,                              \
      "pinned_record(addr, stream) -> status", BIND_NO_DEFAULTS)                               \
    H(pinned_lookup, VARARGS, "pinned_lookup(addr) -> (status, base, size)")                   \
    /* its figures */                                                                          \
    H(pinned_stats, NOARGS, "pinned_stats() -> (status, dict)")                                \
    X(pinned_reset_peak, v, bridge_pinned_reset_peak, BIND_NO_ARGS, BIND_PLAIN,                \
      "pinned_reset_peak() -> status", BIND_NO_DEFAULTS)

BRIDGE_METHOD_TABLE(pinned_methods, PINNED_FUNCTIONS);

/* the backends of pinned_setup (pybind.h: BRIDGE_BIND_CONSTANT) */
#define PINNED_CONSTANTS(C) C(PINNED_CACHED), C(PINNED_MEMPOOL), C(PINNED_AUTO)

/* Called by PyInit__core (pymod.c): add the type, functions and constants. */
int bridge_pypinned_add(PyObject *m)
{
    if (PyModule_AddType(m, &PinnedBufferType) < 0) /* readied, added as its tp_name's last part */
        return -1;
    static const bridge_bind_constant constants[] = {
        PINNED_CONSTANTS(BRIDGE_BIND_CONSTANT),
        {NULL, 0},
    };
    return bridge_bind_add(m, pinned_methods, constants);
}
