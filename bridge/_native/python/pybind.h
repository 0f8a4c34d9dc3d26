/* SPDX-License-Identifier: Apache-2.0 */
/* pybind.h: the module functions of bridge._core, one row of a list each
 * (pybind.c holds the one body that serves every row of the table kind).
 *
 * Most of the core's functions reach Python unchanged: parse the arguments,
 * call, maybe without the GIL, return the status (or a bool, or (status,
 * out), or what a converter makes of a struct the call fills).  Such a
 * function is an X row of its file's list; a function written by hand,
 * py_<name>, because it builds more than that or keeps state of its own, is
 * an H row:
 *
 *   #define MY_FUNCTIONS(X, H) \
 *       X(trim, ik, bridge_trim, "i|K", BIND_NOGIL, "trim(device, keep=0) -> status", [1].k = 0) \
 *       H(lookup, VARARGS, "lookup(ptr) -> (status, size, device, tag)")
 *
 *   X(python name, kind, C function, PyArg_ParseTuple format, flags, docstring,
 *     values of the optional arguments: designators of the slots, or BIND_NO_DEFAULTS)
 *   H(python name, calling convention: METH_ without its prefix, docstring)
 *
 * BRIDGE_METHOD_TABLE(my_methods, MY_FUNCTIONS) defines one small C entry
 * point an X row (Python needs a function of its own for each name) and the
 * PyMethodDef table of all the rows, my_methods.  The kind names the C
 * signature (the union member the function must fit, checked by the
 * compiler) and where the arguments land: slot n holds argument n, an int
 * (format i or p), an unsigned long long (K; a pointer where the C function
 * takes one), a double (d) or a string (s or z).  A row without arguments
 * has the format BIND_NO_ARGS (Python calls it with none, METH_NOARGS).
 */
#ifndef BRIDGE_PYBIND_H
#define BRIDGE_PYBIND_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* The kinds: X(kind, C result, C parameters, where PyArg_ParseTuple writes
 * the arguments, the call's arguments, what Python gets).  Format unit n
 * writes slot a[n]'s member of its own type: .i (i, p), .k (K), .d (d) or .s
 * (s, z); a kind without arguments parses nothing (NULL).  The call's
 * arguments are the slots, PTR(a[n]) for a slot's value as a pointer, and
 * &out.i / &out.k for what the function writes; what Python gets is one of
 * pybind.c's GIVE_ macros:
 *   STATUS        the int result (a bool with BIND_BOOL)
 *   STATUS_OUT_I  (status, out.i)        STATUS_OUT_K  (status, out.k)
 *   U64, FLOAT, STR  the result itself (these take no BIND_NOGIL)
 *   NONE          None */
#define BRIDGE_BIND_KINDS(X)                                                                       \
    X(v, int, (void), (NULL), (), STATUS)                                                          \
    X(u64, uint64_t, (void), (NULL), (), U64)                                                      \
    X(dbl, double, (void), (NULL), (), FLOAT)                                                      \
    X(str, const char *, (void), (NULL), (), STR)                                                  \
    X(out_i, int, (int *), (NULL), (&out.i), STATUS_OUT_I)                                         \
    X(s, int, (const char *), (&a[0].s), (a[0].s), STATUS)                                         \
    X(k, int, (uint64_t), (&a[0].k), (a[0].k), STATUS)                                             \
    X(i, int, (int), (&a[0].i), (a[0].i), STATUS)                                                  \
    X(ii, int, (int, int), (&a[0].i, &a[1].i), (a[0].i, a[1].i), STATUS)                           \
    X(ik, int, (int, uint64_t), (&a[0].i, &a[1].k), (a[0].i, a[1].k), STATUS)                      \
    X(ikk, int, (int, uint64_t, uint64_t), (&a[0].i, &a[1].k, &a[2].k), (a[0].i, a[1].k, a[2].k),  \
      STATUS)                                                                                      \
    X(iik, int, (int, int, uint64_t), (&a[0].i, &a[1].i, &a[2].k), (a[0].i, a[1].i, a[2].k),       \
      STATUS)                                                                                      \
    X(iiki, int, (int, int, uint64_t, int), (&a[0].i, &a[1].i, &a[2].k, &a[3].i),                  \
      (a[0].i, a[1].i, a[2].k, a[3].i), STATUS)                                                    \
    X(id, int, (int, double), (&a[0].i, &a[1].d), (a[0].i, a[1].d), STATUS)                        \
    X(idi, int, (int, double, int), (&a[0].i, &a[1].d, &a[2].i), (a[0].i, a[1].d, a[2].i), STATUS) \
    X(idk, int, (int, double, uint64_t), (&a[0].i, &a[1].d, &a[2].k), (a[0].i, a[1].d, a[2].k),    \
      STATUS)                                                                                      \
    X(idkkkk, int, (int, double, uint64_t, uint64_t, uint64_t, uint64_t),                          \
      (&a[0].i, &a[1].d, &a[2].k, &a[3].k, &a[4].k, &a[5].k),                                      \
      (a[0].i, a[1].d, a[2].k, a[3].k, a[4].k, a[5].k), STATUS)                                    \
    X(issk, int, (int, const char *, const char *, uint64_t),                                      \
      (&a[0].i, &a[1].s, &a[2].s, &a[3].k), (a[0].i, a[1].s, a[2].s, a[3].k), STATUS)              \
    X(ikp, int, (int, uint64_t, void *), (&a[0].i, &a[1].k, &a[2].k), (a[0].i, a[1].k, PTR(a[2])), \
      STATUS)                                                                                      \
    X(ikkpi, int, (int, uint64_t, uint64_t, void *, int),                                          \
      (&a[0].i, &a[1].k, &a[2].k, &a[3].k, &a[4].i), (a[0].i, a[1].k, a[2].k, PTR(a[3]), a[4].i),  \
      STATUS)                                                                                      \
    X(i_out_i, int, (int, int *), (&a[0].i), (a[0].i, &out.i), STATUS_OUT_I)                       \
    X(i_out_k, int, (int, uint64_t *), (&a[0].i), (a[0].i, &out.k), STATUS_OUT_K)                  \
    X(ii_out_k, int, (int, int, uint64_t *), (&a[0].i, &a[1].i), (a[0].i, a[1].i, &out.k),         \
      STATUS_OUT_K)                                                                                \
    X(p, int, (void *), (&a[0].k), (PTR(a[0])), STATUS)                                            \
    X(pp, int, (void *, void *), (&a[0].k, &a[1].k), (PTR(a[0]), PTR(a[1])), STATUS)               \
    X(cpp, int, (const void *, void *), (&a[0].k, &a[1].k), (PTR(a[0]), PTR(a[1])), STATUS)        \
    X(void_p, void, (void *), (&a[0].k), (PTR(a[0])), NONE)

/* One kind more, `get`: int f(int, T *out), and what Python gets of the
 * struct, convert(status, &out); the row's C function is the getter
 * BRIDGE_BIND_GETTER(name, T, f, convert) defines. */
typedef struct {
    int (*call)(int arg, void *out);
    PyObject *(*convert)(int status, const void *out);
} bridge_bind_getter;

/* the largest struct a getter fills (on the stack of the call) */
#define BRIDGE_BIND_OUT_MAX 1024

#define BRIDGE_BIND_GETTER(name, T, f, convert_fn)                          \
    static int name##_call_(int arg, void *out)                             \
    {                                                                       \
        return f(arg, (T *)out);                                            \
    }                                                                       \
    static PyObject *name##_convert_(int status, const void *out)           \
    {                                                                       \
        return convert_fn(status, (const T *)out);                          \
    }                                                                       \
    static const bridge_bind_getter name = {name##_call_, name##_convert_}; \
    _Static_assert(sizeof(T) <= BRIDGE_BIND_OUT_MAX, #T " is larger than a getter's out")

#define BRIDGE_BIND_ENUM_(kind, ...) BIND_##kind,
typedef enum { BRIDGE_BIND_KINDS(BRIDGE_BIND_ENUM_) BIND_get } bridge_bind_kind;
#undef BRIDGE_BIND_ENUM_

/* flags */
#define BIND_PLAIN 0u
#define BIND_NOGIL 1u /* the call runs with the GIL released (not u64, dbl, str) */
#define BIND_BOOL  2u /* the int result is returned as a bool (the status kinds) */

/* One argument: its default before parsing, its value after. */
typedef union {
    int i;
    unsigned long long k;
    double d;
    const char *s;
} bridge_bind_slot;

#define BRIDGE_BIND_SLOTS 6
/* the format of a row without arguments */
#define BIND_NO_ARGS      ""
/* the last of a row without optional arguments */
#define BIND_NO_DEFAULTS  [0].i = 0

typedef struct {
    bridge_bind_kind kind;
    const char *format; /* PyArg_ParseTuple's; "" (BIND_NO_ARGS) for the rows without arguments */
    unsigned flags;
    bridge_bind_slot defaults[BRIDGE_BIND_SLOTS];
    union {
#define BRIDGE_BIND_MEMBER_(kind, result, params, ...) result(*kind) params;
        BRIDGE_BIND_KINDS(BRIDGE_BIND_MEMBER_)
#undef BRIDGE_BIND_MEMBER_
        const bridge_bind_getter *get;
    } fn;
} bridge_binding;

/* The module's constants of a file, under their names without BRIDGE_: an
 * X-list of the names, MY_CONSTANTS(C) C(EV_ALLOC), C(EV_FREE), makes the table
 *   static const bridge_bind_constant t[] = {MY_CONSTANTS(BRIDGE_BIND_CONSTANT), {NULL, 0}}; */
typedef struct {
    const char *name;
    long value;
} bridge_bind_constant;
#define BRIDGE_BIND_CONSTANT(name) \
    {                              \
#name, BRIDGE_##name       \
    }

/* Add a file's functions (NULL: none) and constants to the module: -1 with
 * the error set on failure. */
int bridge_bind_add(PyObject *m, PyMethodDef *functions, const bridge_bind_constant *constants);

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

/* a row without arguments (BIND_NO_ARGS, "") is called with none */
#define BRIDGE_BIND_METHOD(name, kind, function, format, flags, doc, ...) \
    {#name, bind_##name, sizeof(format) == 1 ? METH_NOARGS : METH_VARARGS, doc},

/* a function written by hand, py_<name> */
#define BRIDGE_HAND_METHOD(name, convention, doc) \
    {#name, (PyCFunction)(void (*)(void))py_##name, METH_##convention, doc},
#define BRIDGE_HAND_NONE(name, convention, doc)

/* The functions of a list and their PyMethodDef table, `table`, ended. */
#define BRIDGE_METHOD_TABLE(table, list)                                        \
    list(BRIDGE_BIND_FUNCTION, BRIDGE_HAND_NONE) static PyMethodDef table[] = { \
        list(BRIDGE_BIND_METHOD, BRIDGE_HAND_METHOD){NULL, NULL, 0, NULL}}

#endif /* BRIDGE_PYBIND_H */
