/* SPDX-License-Identifier: Apache-2.0 */
/* pybind.h: module functions of bridge._core made from a table (pybind.c).
 *
 * Most of the core's functions reach Python unchanged: parse the arguments,
 * call, maybe without the GIL, return the status (or a bool, or (status,
 * out)).  Such a function is one row of a file's table, an X-list:
 *
 *   #define MY_BINDINGS(X) \
 *       X(trim, ik, bridge_trim, "i|K", BIND_NOGIL, "trim(device, keep=0) -> status", [1].k = 0)
 *
 *   X(python name, kind, C function, PyArg_ParseTuple format, flags, docstring,
 *     values of the optional arguments: designators of the slots, or BIND_NO_DEFAULTS)
 *
 * MY_BINDINGS(BRIDGE_BIND_FUNCTION) defines one small C entry point a row
 * (Python needs a function of its own for each name), and
 * MY_BINDINGS(BRIDGE_BIND_METHOD) writes the PyMethodDef rows.  The kind
 * names the C signature (the union member the function must fit, checked by
 * the compiler) and where the arguments land: slot n holds argument n, an
 * int (format i or p), an unsigned long long (K; a pointer where the C
 * function takes one), a double (d) or a string (s or z).  A function that
 * builds more than that, or keeps state of its own, is written by hand.
 */
#ifndef BRIDGE_PYBIND_H
#define BRIDGE_PYBIND_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* The C signatures; the result is a status unless said otherwise. */
typedef enum {
    BIND_v,        /* int f(void), no arguments */
    BIND_u64,      /* uint64_t f(void) -> int */
    BIND_str,      /* const char *f(void) -> str */
    BIND_out_i,    /* int f(int *out) -> (status, out) */
    BIND_s,        /* int f(const char *) */
    BIND_k,        /* int f(uint64_t) */
    BIND_i,        /* int f(int) */
    BIND_ii,       /* int f(int, int) */
    BIND_ik,       /* int f(int, uint64_t) */
    BIND_ikk,      /* int f(int, uint64_t, uint64_t) */
    BIND_iik,      /* int f(int, int, uint64_t) */
    BIND_id,       /* int f(int, double) */
    BIND_idk,      /* int f(int, double, uint64_t) */
    BIND_ikp,      /* int f(int, uint64_t, void *) */
    BIND_i_out_i,  /* int f(int, int *out) -> (status, out) */
    BIND_i_out_k,  /* int f(int, uint64_t *out) -> (status, out) */
    BIND_ii_out_k, /* int f(int, int, uint64_t *out) -> (status, out) */
    BIND_p,        /* int f(void *) */
    BIND_pp,       /* int f(void *, void *) */
    BIND_void_p,   /* void f(void *) -> None */
} bridge_bind_kind;

/* How Python calls each kind. */
#define BIND_METH_v        METH_NOARGS
#define BIND_METH_u64      METH_NOARGS
#define BIND_METH_str      METH_NOARGS
#define BIND_METH_out_i    METH_NOARGS
#define BIND_METH_s        METH_VARARGS
#define BIND_METH_k        METH_VARARGS
#define BIND_METH_i        METH_VARARGS
#define BIND_METH_ii       METH_VARARGS
#define BIND_METH_ik       METH_VARARGS
#define BIND_METH_ikk      METH_VARARGS
#define BIND_METH_iik      METH_VARARGS
#define BIND_METH_id       METH_VARARGS
#define BIND_METH_idk      METH_VARARGS
#define BIND_METH_ikp      METH_VARARGS
#define BIND_METH_i_out_i  METH_VARARGS
#define BIND_METH_i_out_k  METH_VARARGS
#define BIND_METH_ii_out_k METH_VARARGS
#define BIND_METH_p        METH_VARARGS
#define BIND_METH_pp       METH_VARARGS
#define BIND_METH_void_p   METH_VARARGS

/* flags */
#define BIND_PLAIN 0u
#define BIND_NOGIL 1u /* the call runs with the GIL released (not u64, str) */
#define BIND_BOOL  2u /* the int result is returned as a bool (the status kinds) */

/* One argument: its default before parsing, its value after. */
typedef union {
    int i;
    unsigned long long k;
    double d;
    const char *s;
} bridge_bind_slot;

#define BRIDGE_BIND_SLOTS 3
/* the last of a row without optional arguments */
#define BIND_NO_DEFAULTS  [0].i = 0

typedef struct {
    bridge_bind_kind kind;
    const char *format; /* PyArg_ParseTuple's; NULL for the kinds without arguments */
    unsigned flags;
    bridge_bind_slot defaults[BRIDGE_BIND_SLOTS];
    union {
        int (*v)(void);
        uint64_t (*u64)(void);
        const char *(*str)(void);
        int (*out_i)(int *);
        int (*s)(const char *);
        int (*k)(uint64_t);
        int (*i)(int);
        int (*ii)(int, int);
        int (*ik)(int, uint64_t);
        int (*ikk)(int, uint64_t, uint64_t);
        int (*iik)(int, int, uint64_t);
        int (*id)(int, double);
        int (*idk)(int, double, uint64_t);
        int (*ikp)(int, uint64_t, void *);
        int (*i_out_i)(int, int *);
        int (*i_out_k)(int, uint64_t *);
        int (*ii_out_k)(int, int, uint64_t *);
        int (*p)(void *);
        int (*pp)(void *, void *);
        void (*void_p)(void *);
    } fn;
} bridge_binding;

/* Parse `args` (NULL for METH_NOARGS), call, build the result. */
PyObject *bridge_bind_call(const bridge_binding *b, PyObject *args);

/* In a function written by hand: return the status of `call`, made with the
 * GIL released. */
#define BRIDGE_RETURN_STATUS_NOGIL(call) \
    do {                                 \
        int rc_;                         \
        Py_BEGIN_ALLOW_THREADS           \
        rc_ = (call);                    \
        Py_END_ALLOW_THREADS             \
        return PyLong_FromLong(rc_);     \
    } while (0)

#define BRIDGE_BIND_FUNCTION(name, kind, function, format, flags, doc, ...) \
    static PyObject *bind_##name(PyObject *Py_UNUSED(m), PyObject *args)    \
    {                                                                       \
        static const bridge_binding b = {                                   \
            BIND_##kind, format, flags, {__VA_ARGS__}, {.kind = function}}; \
        return bridge_bind_call(&b, args);                                  \
    }

#define BRIDGE_BIND_METHOD(name, kind, function, format, flags, doc, ...) \
    {#name, bind_##name, BIND_METH_##kind, doc},

/* The PyMethodDef rows of a table, ended: static PyMethodDef t[] = {BRIDGE_BIND_METHODS(LIST)}; */
#define BRIDGE_BIND_METHODS(list) \
    list(BRIDGE_BIND_METHOD)      \
    {                             \
        NULL, NULL, 0, NULL       \
    }

#endif /* BRIDGE_PYBIND_H */
