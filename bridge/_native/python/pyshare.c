/* SPDX-License-Identifier: Apache-2.0 */
/* pyshare.c: the Python face of share.c (functions of bridge._core). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "bridge.h"
#include "pybind.h"

static PyObject *py_share_join(PyObject *m, PyObject *args)
{
    (void)m;
    int dev;
    const char *name, *dir;
    unsigned long long budget;
    if (!PyArg_ParseTuple(args, "issK", &dev, &name, &dir, &budget))
        return NULL;
    BRIDGE_RETURN_STATUS_NOGIL(bridge_share_join(dev, name, dir, budget));
}

static PyObject *py_share_stats(PyObject *m, PyObject *args)
{
    (void)m;
    int dev;
    if (!PyArg_ParseTuple(args, "i", &dev))
        return NULL;
    bridge_share_stats s;
    int rc = bridge_share_get(dev, &s);
    if (rc != BRIDGE_OK || !s.joined)
        return Py_BuildValue("iO", rc, Py_None);
    return Py_BuildValue(
        "i{sssssKsKsKsKsIsKsKsKsKsKsKsKsK}", rc, "name", s.name, "path", s.path, "budget",
        (unsigned long long)s.budget, "claim", (unsigned long long)s.claim, "group",
        (unsigned long long)s.group, "members", (unsigned long long)s.members, "slot", s.slot,
        "inflight", (unsigned long long)s.inflight, "num_refused",
        (unsigned long long)s.num_refused, "num_asks", (unsigned long long)s.num_asks,
        "num_trims_served", (unsigned long long)s.num_trims_served, "num_reclaimed",
        (unsigned long long)s.num_reclaimed, "num_overshoots", (unsigned long long)s.num_overshoots,
        "max_overshoot", (unsigned long long)s.max_overshoot, "num_lost",
        (unsigned long long)s.num_lost);
}

static PyObject *py_share_layout(PyObject *m, PyObject *a)
{
    (void)m;
    (void)a;
    bridge_share_layout_info l;
    bridge_share_layout(&l);
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
#define PUT(k)                                            \
    do {                                                  \
        PyObject *v_ = PyLong_FromUnsignedLongLong(l.k);  \
        if (!v_ || PyDict_SetItemString(d, #k, v_) < 0) { \
            Py_XDECREF(v_);                               \
            Py_DECREF(d);                                 \
            return NULL;                                  \
        }                                                 \
        Py_DECREF(v_);                                    \
    } while (0)
    PUT(magic);
    PUT(version);
    PUT(file_size);
    PUT(header_size);
    PUT(slot_size);
    PUT(nslots);
    PUT(unit);
    PUT(unit_bits);
    PUT(pid_bits);
    PUT(off_budget);
    PUT(off_uid);
    PUT(off_uuid);
    PUT(off_name);
    PUT(off_word);
    PUT(off_start);
    PUT(off_trim_req);
    PUT(off_trim_done);
    PUT(off_asked_at);
    PUT(off_heartbeat);
    PUT(off_tag_bytes);
    PUT(off_outside);
    PUT(off_cached);
    PUT(off_pool_reserved);
    PUT(off_device);
    PUT(off_overshoots);
    PUT(off_fields_gen);
#undef PUT
    return d;
}

/* X(python name, kind, C function, format, flags, docstring, defaults...): pybind.h */
#define SHARE_BINDINGS(X)                                                                        \
    X(share_set_growth, k, bridge_share_set_growth, "K", BIND_PLAIN,                             \
      "share_set_growth(bytes) -> status: the growth the next joins claim (0: the default)",     \
      BIND_NO_DEFAULTS)                                                                          \
    X(share_error, str, bridge_share_error, NULL, BIND_PLAIN, "Why the last share_join failed.", \
      BIND_NO_DEFAULTS)

SHARE_BINDINGS(BRIDGE_BIND_FUNCTION)
static PyMethodDef share_bindings[] = {BRIDGE_BIND_METHODS(SHARE_BINDINGS)};

static PyMethodDef share_methods[] = {
    {"share_join", py_share_join, METH_VARARGS,
     "share_join(device, name, dir, budget) -> status: join the share of the device's GPU"},
    {"share_stats", py_share_stats, METH_VARARGS,
     "share_stats(device) -> (status, dict | None): this process's membership"},
    {"share_layout", py_share_layout, METH_NOARGS, "The share file's layout (offsets, sizes)."},
    {NULL, NULL, 0, NULL},
};

int bridge_pyshare_add(PyObject *m)
{
    if (PyModule_AddFunctions(m, share_bindings) < 0 || PyModule_AddFunctions(m, share_methods) < 0)
        return -1;
    return 0;
}
