/* SPDX-License-Identifier: Apache-2.0 */
/* pyviews.c: the Python face of views.c, in bridge._core.
 *
 *   mem_info        a device's free and total memory under its budget
 *   live_blocks     every live allocation of the table
 *   history         start / stop recording allocation events
 *   history_events  the events kept, oldest first
 *   cached_blocks   how many freed blocks the cache keeps (bridge.pool().n_free_blocks)
 *   set_stack_callback
 *                   the Python callable that names the caller's stack for
 *                   each event while stacks are on; called on threads that
 *                   Python runs on (taking the GIL back where the caller
 *                   released it, as torch's own recorder does); a thread
 *                   without a Python thread state gets no stack
 *
 * Functions return status codes (alone or first in a tuple), which
 * bridge/_errors.py turns into exceptions.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>

#include "bridge.h"
#include "cache.h"
#include "pybind.h"

/* mem_info(device) -> (status, dict) */
static PyObject *mem_info_dict(int rc, const bridge_mem_info *mi)
{
    return Py_BuildValue(
        "i{sKsKsKsKsKsKsKsK}", rc, "free", (unsigned long long)mi->free, "total",
        (unsigned long long)mi->total, "driver_free", (unsigned long long)mi->driver_free,
        "driver_total", (unsigned long long)mi->driver_total, "pool_idle",
        (unsigned long long)mi->pool_idle, "cached", (unsigned long long)mi->cached, "held",
        (unsigned long long)mi->held, "limit", (unsigned long long)mi->limit);
}
BRIDGE_BIND_GETTER(mem_info_getter, bridge_mem_info, bridge_get_mem_info, mem_info_dict);

/* ---- tables copied out whole ---- */
/* A table that may grow while it is copied: copy(buf, n, &count) copies the
 * first n of its count entries, item(entry) makes an entry's tuple. */
typedef struct {
    size_t size; /* of an entry */
    int (*copy)(void *buf, size_t n, size_t *count);
    PyObject *(*item)(const void *entry);
} table;

/* Every entry of `t`, in its order: the buffer grows until all fit, with
 * room for the entries that appear meanwhile. */
static PyObject *list_of_all(const table *t)
{
    size_t n, count = 0;
    t->copy(NULL, 0, &count);
    char *buf = NULL;
    do {
        n = count + count / 4 + 64;
        char *nb = realloc(buf, n * t->size);
        if (!nb) {
            free(buf);
            return PyErr_NoMemory();
        }
        buf = nb;
        t->copy(buf, n, &count);
    } while (count > n);
    PyObject *list = PyList_New((Py_ssize_t)count);
    for (size_t i = 0; list && i < count; i++) {
        PyObject *e = t->item(buf + i * t->size);
        if (!e) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, e);
    }
    free(buf);
    return list;
}

static int copy_blocks(void *buf, size_t n, size_t *count)
{
    return bridge_live_blocks(buf, n, count);
}

static PyObject *block_tuple(const void *entry)
{
    const bridge_block_info *b = entry;
    return Py_BuildValue("(KKKiiIKK)", (unsigned long long)b->ptr, (unsigned long long)b->size,
                         (unsigned long long)b->stream, b->device, b->tag, b->flags,
                         (unsigned long long)b->graph0, (unsigned long long)b->graph1);
}

static PyObject *py_live_blocks(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a))
{
    static const table blocks = {sizeof(bridge_block_info), copy_blocks, block_tuple};
    return list_of_all(&blocks);
}

static int copy_events(void *buf, size_t n, size_t *count)
{
    return bridge_history_copy(buf, n, count);
}

static PyObject *event_tuple(const void *entry)
{
    const bridge_event *e = entry;
    return Py_BuildValue("(KiiKKKKiK)", (unsigned long long)e->time_us, e->action, e->device,
                         (unsigned long long)e->ptr, (unsigned long long)e->size,
                         (unsigned long long)e->stream, (unsigned long long)e->stack, e->tag,
                         (unsigned long long)e->extra);
}

static PyObject *py_history_events(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a))
{
    static const table events = {sizeof(bridge_event), copy_events, event_tuple};
    return list_of_all(&events);
}

/* ---- the stack hook ---- */
static PyObject *stack_cb; /* read and written under the GIL */

static int finalizing(void)
{
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}

static uint64_t stack_trampoline(void)
{
    /* A thread Python never ran on (a thread state of its own: none) has no
     * Python stack.  A Python thread that released the GIL around the
     * allocation (torch's operators do, CuPy's allocator does) takes it back
     * for the stack, as torch's own recorder does: only while stacks are
     * recorded, on request. */
    if (!Py_IsInitialized() || finalizing())
        return 0;
    int held = PyGILState_Check();
    if (!held && !PyGILState_GetThisThreadState())
        return 0;
    PyGILState_STATE st = PyGILState_LOCKED;
    if (!held)
        st = PyGILState_Ensure();
    uint64_t id = 0;
    PyObject *cb = stack_cb;
    if (cb) {
        Py_INCREF(cb);
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb); /* the caller's pending error, if any, survives */
        PyObject *r = PyObject_CallNoArgs(cb);
        if (r) {
            id = PyLong_AsUnsignedLongLong(r);
            if (id == (uint64_t)-1 && PyErr_Occurred())
                id = 0;
            Py_DECREF(r);
        }
        PyErr_Clear(); /* never raise into an allocation */
        PyErr_Restore(type, value, tb);
        Py_DECREF(cb);
    }
    if (!held)
        PyGILState_Release(st);
    return id;
}

static PyObject *py_set_stack_callback(PyObject *m, PyObject *cb)
{
    (void)m;
    if (cb != Py_None && !PyCallable_Check(cb)) {
        PyErr_SetString(PyExc_TypeError, "set_stack_callback: pass a callable or None");
        return NULL;
    }
    PyObject *old = stack_cb;
    if (cb == Py_None) {
        stack_cb = NULL;
        bridge_set_stack_hook(NULL);
    } else {
        Py_INCREF(cb);
        stack_cb = cb;
        bridge_set_stack_hook(stack_trampoline);
    }
    Py_XDECREF(old);
    Py_RETURN_NONE;
}

static PyObject *py_cached_blocks(PyObject *m, PyObject *args)
{
    (void)m;
    int dev;
    if (!PyArg_ParseTuple(args, "i", &dev))
        return NULL;
    if (dev < 0 || dev >= BRIDGE_MAX_DEVICES)
        return Py_BuildValue("iK", BRIDGE_E_DEVICE, 0ull);
    return Py_BuildValue("iK", BRIDGE_OK, (unsigned long long)cache_blocks(dev));
}

/* The functions of this file, one row each (pybind.h): X rows of the table, H rows written
 * by hand above, py_<name>. */
#define VIEWS_FUNCTIONS(X, H)                                                                    \
    X(mem_info, get, &mem_info_getter, "i", BIND_NOGIL,                                          \
      "mem_info(device) -> (status, dict): free and total memory under the budget",              \
      BIND_NO_DEFAULTS)                                                                          \
    H(live_blocks, NOARGS,                                                                       \
      "Every live allocation: (ptr, size, stream, device, tag, flags, graph0, graph1).")         \
    X(history, iiki, bridge_history_set, "ppKp", BIND_PLAIN,                                     \
      "history(on, stacks, max_entries, clear) -> status: record allocation events",             \
      BIND_NO_DEFAULTS)                                                                          \
    H(history_events, NOARGS,                                                                    \
      "The events kept, oldest first: (time_us, action, device, ptr, size, stream, stack, tag, " \
      "extra).")                                                                                 \
    H(cached_blocks, VARARGS,                                                                    \
      "cached_blocks(device) -> (status, n): the freed blocks the cache keeps for reuse")        \
    H(set_stack_callback, O, "The callable naming the caller's stack for each event (or None).")

BRIDGE_METHOD_TABLE(views_methods, VIEWS_FUNCTIONS);

/* the actions of history_events (pybind.h: BRIDGE_BIND_CONSTANT) */
#define VIEWS_CONSTANTS(C) C(EV_ALLOC), C(EV_FREE), C(EV_OOM)

int bridge_pyviews_add(PyObject *m)
{
    static const bridge_bind_constant constants[] = {
        VIEWS_CONSTANTS(BRIDGE_BIND_CONSTANT),
        {NULL, 0},
    };
    return bridge_bind_add(m, views_methods, constants);
}
