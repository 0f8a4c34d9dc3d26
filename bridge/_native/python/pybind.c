/* SPDX-License-Identifier: Apache-2.0 */
/* pybind.c: the one body of the table-made module functions (pybind.h). */
#include "pybind.h"

#include <string.h>

#include "bridge.h"

/* In a fork child of a process that started CUDA every device is out of
 * reach, the figures included: "no such device" and "not loaded yet, call
 * unify() first" would send the user the wrong way (unify() there is refused
 * too).  The child is told it was forked, and to use 'spawn'. */
static int status_of(int rc)
{
    return (rc == BRIDGE_E_DEVICE || rc == BRIDGE_E_NOTINIT) && bridge_forked() ? BRIDGE_E_FORKED
                                                                                : rc;
}

/* `call` without the GIL when the row asks for it */
#define CALL(call)                   \
    do {                             \
        if (b->flags & BIND_NOGIL) { \
            Py_BEGIN_ALLOW_THREADS   \
            call;                    \
            Py_END_ALLOW_THREADS     \
        } else {                     \
            call;                    \
        }                            \
    } while (0)

#define PTR(slot) ((void *)(uintptr_t)(slot).k)

/* What Python gets of each kind's call (pybind.h) */
#define GIVE_STATUS(call) \
    CALL(rc = (call));    \
    return b->flags & BIND_BOOL ? PyBool_FromLong(rc) : PyLong_FromLong(status_of(rc))
#define GIVE_STATUS_OUT_I(call) \
    CALL(rc = (call));          \
    return Py_BuildValue("ii", status_of(rc), out.i)
#define GIVE_STATUS_OUT_K(call) \
    CALL(rc = (call));          \
    return Py_BuildValue("iK", status_of(rc), (unsigned long long)out.k)
#define GIVE_U64(call)   return PyLong_FromUnsignedLongLong(call)
#define GIVE_FLOAT(call) return PyFloat_FromDouble(call)
#define GIVE_STR(call)   return PyUnicode_FromString(call)
#define GIVE_NONE(call) \
    CALL(call);         \
    Py_RETURN_NONE

/* the row's arguments into their slots; a row without arguments ("")
 * parses nothing */
#define PARSE(...)                                                     \
    if (*b->format && !PyArg_ParseTuple(args, b->format, __VA_ARGS__)) \
    return NULL

#define CASE_(kind, result, params, parsed, arguments, give) \
    case BIND_##kind:                                        \
        PARSE parsed;                                        \
        GIVE_##give(b->fn.kind arguments);

PyObject *bridge_bind_call(const bridge_binding *b, PyObject *args)
{
    bridge_bind_slot a[BRIDGE_BIND_SLOTS];
    for (int n = 0; n < BRIDGE_BIND_SLOTS; n++)
        a[n] = b->defaults[n];
    int rc = 0;
    union {
        int i;
        uint64_t k;
        _Alignas(16) unsigned char got[BRIDGE_BIND_OUT_MAX]; /* what a getter fills */
    } out;
    out.k = 0;
    switch (b->kind) {
        BRIDGE_BIND_KINDS(CASE_)
    case BIND_get:
        PARSE(&a[0].i);
        memset(out.got, 0, sizeof out.got); /* what the function leaves is 0 */
        CALL(rc = b->fn.get->call(a[0].i, out.got));
        return b->fn.get->convert(status_of(rc), out.got);
    }
    PyErr_SetString(PyExc_SystemError, "bridge._core: a binding of no known kind");
    return NULL;
}

int bridge_bind_add(PyObject *m, PyMethodDef *functions, const bridge_bind_constant *c)
{
    if (functions && PyModule_AddFunctions(m, functions) < 0)
        return -1;
    for (; c->name; c++)
        if (PyModule_AddIntConstant(m, c->name, c->value) < 0)
            return -1;
    return 0;
}
