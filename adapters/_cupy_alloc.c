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
 *
 * The block's memory object: when the adapter hands CuPy's BaseMemory over
 * (`base_memory`), a block is wrapped in a BridgeMemory, a subtype of
 * BaseMemory made here whose dealloc frees the block, and the MemoryPointer
 * is made by its type's tp_new with its three fields stored in C: no
 * UnownedMemory, no Block and no Python-level __init__ (their argument
 * parsing and int objects were about 0.4 us of a CuPy pair).  This relies on
 * Cython's layout of the two classes (cupy/cuda/memory.pxd, which CuPy's
 * wheels do not ship, so there is nothing to compile against): it is checked
 * once, when the allocator is made, by storing values in C and reading them
 * back through CuPy's own attributes (and the other way round); a CuPy whose
 * layout differs keeps UnownedMemory + MemoryPointer, and `memory_problem`
 * says why.
 */
#include "pyblock.h"

#include <stdio.h>
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
#define CUPY_STREAM_SIGNATURE                     \
    "PyObject *(int __pyx_skip_dispatch, struct " \
    "__pyx_opt_args_4cupy_4cuda_6stream_get_current_stream *__pyx_optional_args)"

typedef struct {
    PyObject_HEAD
    PyObject *get_device;      /* () -> int: CuPy's current device */
    PyObject *get_stream;      /* () -> CuPy's current Stream (its .ptr is the handle) */
    PyObject *unowned;         /* cupy.cuda.memory.UnownedMemory */
    PyObject *pointer;         /* cupy.cuda.memory.MemoryPointer */
    PyObject *on_failure;      /* (size, device, stream, status) -> MemoryPointer or raise */
    PyObject *capsules;        /* (device capsule, stream capsule) in use, or None */
    cupy_device_fn device_c;   /* CuPy's get_device_id, or NULL: call get_device */
    cupy_stream_fn stream_c;   /* CuPy's get_current_stream, or NULL: call get_stream */
    PyTypeObject *memory_type; /* BridgeMemory (a BaseMemory), or NULL: UnownedMemory */
    PyObject *memory_problem;  /* why memory_type is NULL (str), or None */
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
    Py_VISIT(self->memory_type);
    Py_VISIT(self->memory_problem);
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
    Py_CLEAR(self->memory_type);
    Py_CLEAR(self->memory_problem);
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

/* CuPy's BaseMemory and MemoryPointer as Cython lays them out (cupy/cuda/
 * memory.pxd: `public intptr_t ptr, size_t size, int device_id`; a
 * MemoryPointer has cdef methods, so its vtable pointer comes first, then
 * `readonly intptr_t ptr, int device_id, BaseMemory mem`).  check_layout()
 * proves it on the CuPy that runs before either is used. */
typedef struct {
    PyObject_HEAD
    intptr_t ptr;
    size_t size;
    int device_id;
} cupy_BaseMemory;

typedef struct {
    PyObject_HEAD
    void *vtab;
    intptr_t ptr;
    int device_id;
    PyObject *mem;
} cupy_MemoryPointer;

/* A block as CuPy's memory: BaseMemory's fields, then the Stream the block
 * holds until its free is queued on it (as a Block holds it). */
typedef struct {
    cupy_BaseMemory base;
    PyObject *stream;
} BridgeMemory;

static void BridgeMemory_dealloc(PyObject *o)
{
    BridgeMemory *m = (BridgeMemory *)o;
    void *p = (void *)m->base.ptr;
    m->base.ptr = 0;
    if (p)
        block_free(p);
    Py_CLEAR(m->stream);
    PyTypeObject *tp = Py_TYPE(o);
    tp->tp_free(o);
    Py_DECREF(tp); /* a heap type: each instance holds it */
}

static PyObject *BridgeMemory_repr(PyObject *o)
{
    BridgeMemory *m = (BridgeMemory *)o;
    /* the hex made here: PyUnicode_FromFormat knows no %zx before Python 3.12 */
    char hex[2 + 2 * sizeof(size_t) + 1];
    snprintf(hex, sizeof hex, "0x%zx", (size_t)m->base.ptr);
    return PyUnicode_FromFormat("<bridge memory %s, %zu bytes, device %d>", hex, m->base.size,
                                m->base.device_id);
}

static PyType_Slot BridgeMemory_slots[] = {
    {Py_tp_dealloc, (void *)BridgeMemory_dealloc},
    {Py_tp_repr, (void *)BridgeMemory_repr},
    {Py_tp_doc, "One allocation from the shared pool as CuPy's BaseMemory, freed when it dies."},
    {0, NULL},
};

static PyType_Spec BridgeMemory_spec = {
    .name = "bridge._core.BridgeMemory",
    .basicsize = sizeof(BridgeMemory),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = BridgeMemory_slots,
};

static PyObject *empty_tuple;

/* A MemoryPointer(mem, 0) of `pointer_type` made in C: tp_new (which sets
 * the vtable and mem = None), then its fields; steals `mem`. */
static PyObject *pointer_to(PyTypeObject *pointer_type, PyObject *mem, intptr_t ptr, int dev)
{
    PyObject *p = pointer_type->tp_new(pointer_type, empty_tuple, NULL);
    if (!p) {
        Py_DECREF(mem);
        return NULL;
    }
    cupy_MemoryPointer *mp = (cupy_MemoryPointer *)p;
    PyObject *old = mp->mem;
    mp->mem = mem;
    mp->ptr = ptr;
    mp->device_id = dev;
    Py_XDECREF(old);
    return p;
}

/* A new BridgeMemory owning `ptr` (freed at once if the object cannot be made). */
static PyObject *memory_new(PyTypeObject *tp, void *ptr, size_t size, int dev, PyObject *stream)
{
    BridgeMemory *m = (BridgeMemory *)tp->tp_alloc(tp, 0);
    if (!m) {
        if (ptr)
            block_free(ptr);
        return NULL;
    }
    m->base.ptr = (intptr_t)ptr;
    m->base.size = size;
    m->base.device_id = dev;
    Py_XINCREF(stream);
    m->stream = stream;
    return (PyObject *)m;
}

/* Whether `name` of `o` reads as `want` (an int attribute). 0 no, 1 yes, -1 error. */
static int attr_is(PyObject *o, const char *name, long long want)
{
    PyObject *v = PyObject_GetAttrString(o, name);
    if (!v)
        return -1;
    long long got = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (got == -1 && PyErr_Occurred())
        return -1;
    return got == want;
}

/* Prove the layout above on this CuPy's classes: NULL when it holds (and
 * *out is the BridgeMemory type), else the reason in words (a new str). */
static PyObject *check_layout(PyObject *base, PyObject *pointer, PyTypeObject **out)
{
    *out = NULL;
    if (!PyType_Check(base) || !PyType_Check(pointer))
        return PyUnicode_FromString("base_memory and memory_pointer must be CuPy's classes");
    PyTypeObject *bt = (PyTypeObject *)base, *pt = (PyTypeObject *)pointer;
    if (bt->tp_basicsize != (Py_ssize_t)sizeof(cupy_BaseMemory) || bt->tp_itemsize ||
        !(bt->tp_flags & Py_TPFLAGS_BASETYPE) || (bt->tp_flags & Py_TPFLAGS_HAVE_GC))
        return PyUnicode_FromFormat("%s is %zd bytes%s, not the %zd-byte BaseMemory this build "
                                    "knows (no GC, a base type)",
                                    bt->tp_name, bt->tp_basicsize,
                                    bt->tp_flags & Py_TPFLAGS_HAVE_GC ? " with GC" : "",
                                    (Py_ssize_t)sizeof(cupy_BaseMemory));
    if (pt->tp_basicsize < (Py_ssize_t)sizeof(cupy_MemoryPointer) || pt->tp_itemsize || !pt->tp_new)
        return PyUnicode_FromFormat("%s is %zd bytes, not the MemoryPointer this build knows",
                                    pt->tp_name, pt->tp_basicsize);
    PyObject *bases = PyTuple_Pack(1, base);
    PyTypeObject *tp =
        bases ? (PyTypeObject *)PyType_FromSpecWithBases(&BridgeMemory_spec, bases) : NULL;
    Py_XDECREF(bases);
    if (!tp)
        return NULL;
    /* C -> CuPy: values stored here read back through CuPy's own attributes */
    const intptr_t fake = (intptr_t)0x7e5700c0ffee00LL;
    PyObject *m = memory_new(tp, NULL, 123456789, 5, NULL), *problem = NULL, *p = NULL;
    if (!m)
        goto error;
    ((BridgeMemory *)m)->base.ptr = fake; /* never freed: reset before it dies */
    int ok = attr_is(m, "ptr", fake), ok2 = ok == 1 ? attr_is(m, "size", 123456789) : ok;
    int ok3 = ok2 == 1 ? attr_is(m, "device_id", 5) : ok2;
    if (ok3 < 0)
        goto error;
    if (!ok3) {
        problem = PyUnicode_FromString("BaseMemory's ptr, size and device_id are not where this "
                                       "build stores them");
        goto done;
    }
    /* CuPy -> C: CuPy's setter lands where this file reads */
    PyObject *v = PyLong_FromLongLong(fake + 64);
    int set = v ? PyObject_SetAttrString(m, "ptr", v) : -1;
    Py_XDECREF(v);
    if (set < 0)
        goto error;
    if (((BridgeMemory *)m)->base.ptr != fake + 64) {
        problem = PyUnicode_FromString("BaseMemory.ptr's setter does not store where this build "
                                       "reads");
        goto done;
    }
    /* the pointer: tp_new leaves mem None, and the fields read back */
    p = pt->tp_new(pt, empty_tuple, NULL);
    if (!p)
        goto error;
    if (((cupy_MemoryPointer *)p)->mem != Py_None) {
        problem = PyUnicode_FromString("a new MemoryPointer's mem is not where this build stores "
                                       "it");
        goto done;
    }
    Py_INCREF(m);
    Py_SETREF(((cupy_MemoryPointer *)p)->mem, m);
    ((cupy_MemoryPointer *)p)->ptr = fake + 64;
    ((cupy_MemoryPointer *)p)->device_id = 5;
    PyObject *mem = PyObject_GetAttrString(p, "mem");
    if (!mem)
        goto error;
    int same = mem == m;
    Py_DECREF(mem);
    int okp = same ? attr_is(p, "ptr", fake + 64) : 0,
        okp2 = okp == 1 ? attr_is(p, "device_id", 5) : okp;
    if (okp2 < 0)
        goto error;
    if (!okp2)
        problem = PyUnicode_FromString("MemoryPointer's ptr, device_id and mem are not where this "
                                       "build stores them");
    goto done;
error: /* an exception is set */
    if (m)
        ((BridgeMemory *)m)->base.ptr = 0;
    Py_XDECREF(p);
    Py_XDECREF(m);
    Py_DECREF(tp);
    return NULL;
done:
    ((BridgeMemory *)m)->base.ptr = 0; /* the fake address is never freed */
    Py_XDECREF(p);
    Py_DECREF(m);
    if (problem)
        Py_DECREF(tp);
    else
        *out = tp;
    return problem;
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
    if (self->memory_type) {
        PyObject *mem = memory_new(self->memory_type, ptr, size, (int)dev, stream_obj);
        Py_DECREF(stream_obj);
        return mem ? pointer_to((PyTypeObject *)self->pointer, mem, (intptr_t)ptr, (int)dev) : NULL;
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
    static char *names[] = {"get_device",  "get_stream", "unowned_memory", "memory_pointer",
                            "on_failure",  "tag",        "device_capsule", "stream_capsule",
                            "base_memory", NULL};
    PyObject *gd, *gs, *um, *mp, *of, *dcap = NULL, *scap = NULL, *base = NULL;
    int tag = BRIDGE_TAG_CUPY;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|iOOO", names, &gd, &gs, &um, &mp, &of, &tag,
                                     &dcap, &scap, &base))
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
    if (base && base != Py_None) {
        PyObject *problem = check_layout(base, mp, &self->memory_type);
        if (!problem && !self->memory_type) { /* the check raised: keep UnownedMemory, say why */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            problem = PyUnicode_FromFormat("checking CuPy's memory classes raised %S",
                                           value ? value : Py_None);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            if (!problem) {
                Py_DECREF(self);
                return NULL;
            }
        }
        self->memory_problem = problem ? problem : Py_NewRef(Py_None);
    } else
        self->memory_problem = PyUnicode_FromString("no base_memory given");
    if (!self->memory_problem) {
        Py_DECREF(self);
        return NULL;
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

static PyObject *CupyAllocator_memory_objects(CupyAllocator *self, void *closure)
{
    (void)closure;
    return PyUnicode_FromString(self->memory_type ? "BridgeMemory" : "UnownedMemory");
}

static PyGetSetDef CupyAllocator_getset[] = {
    {"memory_objects", (getter)CupyAllocator_memory_objects, NULL,
     "What a block is wrapped in: 'BridgeMemory' (a BaseMemory made in C, when CuPy's layout "
     "checked out) or 'UnownedMemory' (CuPy's own, with a Block as its owner).",
     NULL},
    {"direct_lookups", (getter)CupyAllocator_direct, NULL,
     "Whether CuPy's device and stream come from its C functions (their capsules), not from "
     "Python calls.",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef CupyAllocator_members[] = {
    {"memory_problem", T_OBJECT, offsetof(CupyAllocator, memory_problem), READONLY,
     "Why blocks are wrapped in UnownedMemory (None when they are BridgeMemory)."},
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
             "(direct_lookups tells).\n"
             "\n"
             "base_memory: CuPy's BaseMemory; when its layout and MemoryPointer's check\n"
             "out, blocks are wrapped in a BridgeMemory made in C instead of\n"
             "unowned_memory (memory_objects and memory_problem tell).");

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
    if (!empty_tuple && !(empty_tuple = PyTuple_New(0)))
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
