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

static PyObject *py_mem_info(PyObject *m, PyObject *args)
{
    (void)m;
    int dev;
    if (!PyArg_ParseTuple(args, "i", &dev))
        return NULL;
    bridge_mem_info mi;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bridge_get_mem_info(dev, &mi);
    Py_END_ALLOW_THREADS
    return Py_BuildValue(
        "i{sKsKsKsKsKsKsKsK}", rc, "free", (unsigned long long)mi.free, "total",
        (unsigned long long)mi.total, "driver_free", (unsigned long long)mi.driver_free,
        "driver_total", (unsigned long long)mi.driver_total, "pool_idle",
        (unsigned long long)mi.pool_idle, "cached", (unsigned long long)mi.cached, "held",
        (unsigned long long)mi.held, "limit", (unsigned long long)mi.limit);
}

static PyObject *py_live_blocks(PyObject *m, PyObject *a)
{
    (void)m;
    (void)a;
    size_t n = 256, count = 0;
    bridge_block_info *buf = NULL;
    for (;;) {
        bridge_block_info *nb = realloc(buf, n * sizeof *nb);
        if (!nb) {
            free(buf);
            return PyErr_NoMemory();
        }
        buf = nb;
        bridge_live_blocks(buf, n, &count);
        if (count <= n)
            break;
        n = count + count / 4 + 16; /* blocks appear meanwhile: some room */
    }
    PyObject *list = PyList_New((Py_ssize_t)count);
    for (size_t i = 0; list && i < count; i++) {
        bridge_block_info *b = &buf[i];
        PyObject *t =
            Py_BuildValue("(KKKiiIKK)", (unsigned long long)b->ptr, (unsigned long long)b->size,
                          (unsigned long long)b->stream, b->device, b->tag, b->flags,
                          (unsigned long long)b->graph0, (unsigned long long)b->graph1);
        if (!t) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, t);
    }
    free(buf);
    return list;
}

static PyObject *py_history(PyObject *m, PyObject *args)
{
    (void)m;
    int on, stacks, clear;
    unsigned long long max_entries;
    if (!PyArg_ParseTuple(args, "ppKp", &on, &stacks, &max_entries, &clear))
        return NULL;
    return PyLong_FromLong(bridge_history_set(on, stacks, max_entries, clear));
}

static PyObject *py_history_events(PyObject *m, PyObject *a)
{
    (void)m;
    (void)a;
    size_t n = 0, count = 0;
    bridge_history_copy(NULL, 0, &count);
    bridge_event *buf = NULL;
    for (;;) {
        n = count + 64;
        bridge_event *nb = realloc(buf, n * sizeof *nb);
        if (!nb) {
            free(buf);
            return PyErr_NoMemory();
        }
        buf = nb;
        bridge_history_copy(buf, n, &count);
        if (count <= n)
            break;
    }
    PyObject *list = PyList_New((Py_ssize_t)count);
    for (size_t i = 0; list && i < count; i++) {
        bridge_event *e = &buf[i];
        PyObject *t = Py_BuildValue(
            "(KiiKKKKiK)", (unsigned long long)e->time_us, e->action, e->device,
            (unsigned long long)e->ptr, (unsigned long long)e->size, (unsigned long long)e->stream,
            (unsigned long long)e->stack, e->tag, (unsigned long long)e->extra);
        if (!t) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, t);
    }
    free(buf);
    return list;
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

static PyMethodDef views_methods[] = {
    {"mem_info", py_mem_info, METH_VARARGS,
     "mem_info(device) -> (status, dict): free and total memory under the budget"},
    {"live_blocks", py_live_blocks, METH_NOARGS,
     "Every live allocation: (ptr, size, stream, device, tag, flags, graph0, graph1)."},
    {"history", py_history, METH_VARARGS,
     "history(on, stacks, max_entries, clear) -> status: record allocation events"},
    {"history_events", py_history_events, METH_NOARGS,
     "The events kept, oldest first: (time_us, action, device, ptr, size, stream, stack, tag, "
     "extra)."},
    {"cached_blocks", py_cached_blocks, METH_VARARGS,
     "cached_blocks(device) -> (status, n): the freed blocks the cache keeps for reuse"},
    {"set_stack_callback", py_set_stack_callback, METH_O,
     "The callable naming the caller's stack for each event (or None)."},
    {NULL, NULL, 0, NULL},
};

int bridge_pyviews_add(PyObject *m)
{
    if (PyModule_AddFunctions(m, views_methods) < 0 ||
        PyModule_AddIntConstant(m, "EV_ALLOC", BRIDGE_EV_ALLOC) < 0 ||
        PyModule_AddIntConstant(m, "EV_FREE", BRIDGE_EV_FREE) < 0 ||
        PyModule_AddIntConstant(m, "EV_OOM", BRIDGE_EV_OOM) < 0)
        return -1;
    return 0;
}
