/* SPDX-License-Identifier: Apache-2.0 */
/* pybind.c: the one body of the table-made module functions (pybind.h). */
#include "pybind.h"

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

#define PARSE(...)                                       \
    if (!PyArg_ParseTuple(args, b->format, __VA_ARGS__)) \
    return NULL

#define PTR(slot) ((void *)(uintptr_t)(slot).k)

PyObject *bridge_bind_call(const bridge_binding *b, PyObject *args)
{
    bridge_bind_slot a[BRIDGE_BIND_SLOTS];
    for (int n = 0; n < BRIDGE_BIND_SLOTS; n++)
        a[n] = b->defaults[n];
    int rc = 0, out = 0;
    uint64_t out_k = 0;
    switch (b->kind) {
    case BIND_v:
        CALL(rc = b->fn.v());
        break;
    case BIND_u64:
        return PyLong_FromUnsignedLongLong(b->fn.u64());
    case BIND_str:
        return PyUnicode_FromString(b->fn.str());
    case BIND_out_i:
        CALL(rc = b->fn.out_i(&out));
        return Py_BuildValue("ii", rc, out);
    case BIND_s:
        PARSE(&a[0].s);
        CALL(rc = b->fn.s(a[0].s));
        break;
    case BIND_k:
        PARSE(&a[0].k);
        CALL(rc = b->fn.k(a[0].k));
        break;
    case BIND_i:
        PARSE(&a[0].i);
        CALL(rc = b->fn.i(a[0].i));
        break;
    case BIND_ii:
        PARSE(&a[0].i, &a[1].i);
        CALL(rc = b->fn.ii(a[0].i, a[1].i));
        break;
    case BIND_ik:
        PARSE(&a[0].i, &a[1].k);
        CALL(rc = b->fn.ik(a[0].i, a[1].k));
        break;
    case BIND_ikk:
        PARSE(&a[0].i, &a[1].k, &a[2].k);
        CALL(rc = b->fn.ikk(a[0].i, a[1].k, a[2].k));
        break;
    case BIND_iik:
        PARSE(&a[0].i, &a[1].i, &a[2].k);
        CALL(rc = b->fn.iik(a[0].i, a[1].i, a[2].k));
        break;
    case BIND_id:
        PARSE(&a[0].i, &a[1].d);
        CALL(rc = b->fn.id(a[0].i, a[1].d));
        break;
    case BIND_idk:
        PARSE(&a[0].i, &a[1].d, &a[2].k);
        CALL(rc = b->fn.idk(a[0].i, a[1].d, a[2].k));
        break;
    case BIND_ikp:
        PARSE(&a[0].i, &a[1].k, &a[2].k);
        CALL(rc = b->fn.ikp(a[0].i, a[1].k, PTR(a[2])));
        break;
    case BIND_i_out_i:
        PARSE(&a[0].i);
        CALL(rc = b->fn.i_out_i(a[0].i, &out));
        return Py_BuildValue("ii", rc, out);
    case BIND_i_out_k:
        PARSE(&a[0].i);
        CALL(rc = b->fn.i_out_k(a[0].i, &out_k));
        return Py_BuildValue("iK", rc, (unsigned long long)out_k);
    case BIND_ii_out_k:
        PARSE(&a[0].i, &a[1].i);
        CALL(rc = b->fn.ii_out_k(a[0].i, a[1].i, &out_k));
        return Py_BuildValue("iK", rc, (unsigned long long)out_k);
    case BIND_p:
        PARSE(&a[0].k);
        CALL(rc = b->fn.p(PTR(a[0])));
        break;
    case BIND_pp:
        PARSE(&a[0].k, &a[1].k);
        CALL(rc = b->fn.pp(PTR(a[0]), PTR(a[1])));
        break;
    case BIND_void_p:
        PARSE(&a[0].k);
        CALL(b->fn.void_p(PTR(a[0])));
        Py_RETURN_NONE;
    }
    return b->flags & BIND_BOOL ? PyBool_FromLong(rc) : PyLong_FromLong(rc);
}
