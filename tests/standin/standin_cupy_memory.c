/* SPDX-License-Identifier: Apache-2.0 */
/* standin_cupy_memory.c: CuPy's BaseMemory and MemoryPointer for the CPU tests.
 *
 * Laid out as Cython lays out CuPy's classes (cupy/cuda/memory.pxd): a
 * BaseMemory is `intptr_t ptr, size_t size, int device_id` after the object
 * header, no GC, a base type; a MemoryPointer has a vtable pointer first (its
 * cdef methods), then `intptr_t ptr, int device_id, BaseMemory mem`, and its
 * tp_new sets mem to None.  The misplaced variants hold the same fields in
 * another order, so bridge._core.CupyAllocator's layout check must refuse
 * them.  Built by tests/adapters/test_cupy_memory.py; never used on a GPU.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    intptr_t ptr;
    size_t size;
    int device_id;
} BaseMemory;

typedef struct {
    PyObject_HEAD
    size_t size; /* misplaced: size before ptr */
    intptr_t ptr;
    int device_id;
} SwappedMemory;

typedef struct {
    PyObject_HEAD
    void *vtab;
    intptr_t ptr;
    int device_id;
    PyObject *mem;
} MemoryPointer;

typedef struct {
    PyObject_HEAD
    void *vtab;
    PyObject *mem; /* misplaced: mem before ptr */
    intptr_t ptr;
    int device_id;
} SwappedPointer;

static int vtable; /* what the vtable pointer points at: never read */

static PyMemberDef BaseMemory_members[] = {
    {"ptr", T_PYSSIZET, offsetof(BaseMemory, ptr), 0, NULL},
    {"size", T_PYSSIZET, offsetof(BaseMemory, size), 0, NULL},
    {"device_id", T_INT, offsetof(BaseMemory, device_id), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyMemberDef SwappedMemory_members[] = {
    {"ptr", T_PYSSIZET, offsetof(SwappedMemory, ptr), 0, NULL},
    {"size", T_PYSSIZET, offsetof(SwappedMemory, size), 0, NULL},
    {"device_id", T_INT, offsetof(SwappedMemory, device_id), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

#define POINTER_MEMBERS(T)                                            \
    {"ptr", T_PYSSIZET, offsetof(T, ptr), READONLY, NULL},            \
        {"device_id", T_INT, offsetof(T, device_id), READONLY, NULL}, \
        {"mem", T_OBJECT, offsetof(T, mem), READONLY, NULL},          \
    {                                                                 \
        NULL, 0, 0, 0, NULL                                           \
    }

static PyMemberDef MemoryPointer_members[] = {POINTER_MEMBERS(MemoryPointer)};
static PyMemberDef SwappedPointer_members[] = {POINTER_MEMBERS(SwappedPointer)};

static PyObject **pointer_mem(PyObject *self)
{
    return Py_TYPE(self)->tp_members == MemoryPointer_members ? &((MemoryPointer *)self)->mem
                                                              : &((SwappedPointer *)self)->mem;
}

static PyObject *MemoryPointer_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    (void)args;
    (void)kw;
    PyObject *self = type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    ((MemoryPointer *)self)->vtab = &vtable; /* first in both layouts */
    *pointer_mem(self) = Py_NewRef(Py_None);
    return self;
}

static int MemoryPointer_traverse(PyObject *self, visitproc visit, void *arg)
{
    Py_VISIT(*pointer_mem(self));
    return 0;
}

static int MemoryPointer_clear(PyObject *self)
{
    Py_CLEAR(*pointer_mem(self));
    return 0;
}

static void MemoryPointer_dealloc(PyObject *self)
{
    PyObject_GC_UnTrack(self);
    MemoryPointer_clear(self);
    Py_TYPE(self)->tp_free(self);
}

#define MEMORY_TYPE(NAME, T)                                                   \
    static PyTypeObject NAME##Type = {                                         \
        PyVarObject_HEAD_INIT(NULL, 0).tp_name = "standin_cupy_memory." #NAME, \
        .tp_basicsize = sizeof(T),                                             \
        .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,                  \
        .tp_members = NAME##_members,                                          \
        .tp_new = PyType_GenericNew,                                           \
    }

#define POINTER_TYPE(NAME, T)                                                  \
    static PyTypeObject NAME##Type = {                                         \
        PyVarObject_HEAD_INIT(NULL, 0).tp_name = "standin_cupy_memory." #NAME, \
        .tp_basicsize = sizeof(T),                                             \
        .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,                   \
        .tp_members = NAME##_members,                                          \
        .tp_new = MemoryPointer_new,                                           \
        .tp_dealloc = MemoryPointer_dealloc,                                   \
        .tp_traverse = MemoryPointer_traverse,                                 \
        .tp_clear = MemoryPointer_clear,                                       \
    }

MEMORY_TYPE(BaseMemory, BaseMemory);
MEMORY_TYPE(SwappedMemory, SwappedMemory);
POINTER_TYPE(MemoryPointer, MemoryPointer);
POINTER_TYPE(SwappedPointer, SwappedPointer);

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "standin_cupy_memory",
    "CuPy's BaseMemory and MemoryPointer laid out as Cython lays them out, and two "
    "misplaced variants.",
    -1,
    NULL,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit_standin_cupy_memory(void);
PyMODINIT_FUNC PyInit_standin_cupy_memory(void)
{
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    struct {
        const char *name;
        PyTypeObject *type;
    } types[] = {
        {"BaseMemory", &BaseMemoryType},
        {"SwappedMemory", &SwappedMemoryType},
        {"MemoryPointer", &MemoryPointerType},
        {"SwappedPointer", &SwappedPointerType},
    };
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        if (PyType_Ready(types[i].type) < 0 ||
            PyModule_AddObjectRef(m, types[i].name, (PyObject *)types[i].type) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
