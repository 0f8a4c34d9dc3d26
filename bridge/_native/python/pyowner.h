/* SPDX-License-Identifier: Apache-2.0 */
/* pyowner.h: what the module's owners of one allocation share: Block
 * (pyblock.c), ManagedBlock (pymanaged.c) and PinnedBufferBase (pypinned.c).
 *
 * The struct T of each starts with BRIDGE_OWNER_HEAD; BRIDGE_OWNER_ATTRIBUTES
 * defines its attributes, `ptr` (the address, read-only) and the read-only
 * members listed (BRIDGE_OWNER_SIZE, BRIDGE_OWNER_DEVICE); BRIDGE_OWNER_TYPE
 * the head of its type object, from T_dealloc, T_repr and those. */
#ifndef BRIDGE_PYOWNER_H
#define BRIDGE_PYOWNER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

/* the head of an owner's struct, ended by its semicolon: BRIDGE_OWNER_HEAD; */
#define BRIDGE_OWNER_HEAD \
    PyObject_HEAD         \
    void *ptr /* the allocation's address; NULL once freed, or for none */

typedef struct {
    BRIDGE_OWNER_HEAD;
} bridge_owner;

/* `ptr` of any owner */
static inline PyObject *bridge_owner_ptr(PyObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromVoidPtr(((bridge_owner *)self)->ptr);
}

/* the tables T_members (the members listed, each ended by its comma) and T_getset */
#define BRIDGE_OWNER_ATTRIBUTES(T, ptr_doc, ...)                                       \
    static PyMemberDef T##_members[] = {__VA_ARGS__{NULL, 0, 0, 0, NULL}};             \
    static PyGetSetDef T##_getset[] = {{"ptr", bridge_owner_ptr, NULL, ptr_doc, NULL}, \
                                       {NULL, NULL, NULL, NULL, NULL}}

/* T's size, a Py_ssize_t or size_t field, as `name` */
#define BRIDGE_OWNER_SIZE(T, name) {name, T_PYSSIZET, offsetof(T, size), READONLY, "bytes"},
/* T's device, an int field */
#define BRIDGE_OWNER_DEVICE(T)     {"device", T_INT, offsetof(T, device), READONLY, "device ordinal"},

/* the type object's fields that every owner sets: {BRIDGE_OWNER_TYPE(...), more fields} */
#define BRIDGE_OWNER_TYPE(T, name, flags, doc)                                                \
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "bridge._core." name, .tp_basicsize = sizeof(T), \
                                .tp_dealloc = (destructor)T##_dealloc,                        \
                                .tp_repr = (reprfunc)T##_repr, .tp_flags = (flags),           \
                                .tp_doc = (doc), .tp_members = T##_members,                   \
                                .tp_getset = T##_getset

#endif /* BRIDGE_PYOWNER_H */
