/* SPDX-License-Identifier: Apache-2.0 */
/* pyshare.c: the Python face of share.c (functions of bridge._core). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "bridge.h"
#include "pybind.h"

/* share_stats(device) -> (status, dict | None) */
static PyObject *share_dict(int rc, const bridge_share_stats *s)
{
    if (rc != BRIDGE_OK || !s->joined)
        return Py_BuildValue("iO", rc, Py_None);
    return Py_BuildValue(
        "i{sssssKsKsKsKsIsKsKsKsKsKsKsKsK}", rc, "name", s->name, "path", s->path, "budget",
        (unsigned long long)s->budget, "claim", (unsigned long long)s->claim, "group",
        (unsigned long long)s->group, "members", (unsigned long long)s->members, "slot", s->slot,
        "inflight", (unsigned long long)s->inflight, "num_refused",
        (unsigned long long)s->num_refused, "num_asks", (unsigned long long)s->num_asks,
        "num_trims_served", (unsigned long long)s->num_trims_served, "num_reclaimed",
        (unsigned long long)s->num_reclaimed, "num_overshoots",
        (unsigned long long)s->num_overshoots, "max_overshoot",
        (unsigned long long)s->max_overshoot, "num_lost", (unsigned long long)s->num_lost);
}
BRIDGE_BIND_GETTER(share_getter, bridge_share_stats, bridge_share_get, share_dict);

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

/* The functions of this file, one row each (pybind.h): X rows of the table, H rows written
 * by hand above, py_<name>. */
#define SHARE_FUNCTIONS(X, H)                                                                      \
    X(share_join, issk, bridge_share_join, "issK", BIND_NOGIL,                                     \
      "share_join(device, name, dir, budget) -> status: join the share of the device's GPU",       \
      BIND_NO_DEFAULTS)                                                                            \
    X(share_leave, i, bridge_share_leave, "i", BIND_NOGIL,                                         \
      "share_leave(device) -> status: leave the share of the device's GPU", BIND_NO_DEFAULTS)      \
    X(share_stats, get, &share_getter, "i", BIND_PLAIN,                                            \
      "share_stats(device) -> (status, dict | None): this process's membership", BIND_NO_DEFAULTS) \
    X(share_set_growth, k, bridge_share_set_growth, "K", BIND_PLAIN,                               \
      "share_set_growth(bytes) -> status: the growth the next joins claim (0: the default)",       \
      BIND_NO_DEFAULTS)                                                                            \
    X(share_error, str, bridge_share_error, BIND_NO_ARGS, BIND_PLAIN,                              \
      "Why the last share_join failed.", BIND_NO_DEFAULTS)                                         \
    H(share_layout, NOARGS, "The share file's layout (offsets, sizes).")

BRIDGE_METHOD_TABLE(share_methods, SHARE_FUNCTIONS);

int bridge_pyshare_add(PyObject *m)
{
    return PyModule_AddFunctions(m, share_methods);
}
