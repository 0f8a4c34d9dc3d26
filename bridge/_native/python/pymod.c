/* SPDX-License-Identifier: Apache-2.0 */
/* pymod.c: the Python face of the core, module bridge._core.
 *
 * Thin wrappers that return status codes (bridge/_errors.py turns them into
 * exceptions).  Block, the C-level owner of one allocation, is pyblock.c;
 * the pinned pool's objects pypinned.c; what adapters add to the module
 * (their C beside them in adapters/) is listed by frameworks.h.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "bridge.h"
#include "cache.h"
#include "pyblock.h"

/* ---- the pressure hook: Python's recovery chain, reached from C ---- */
/* The chain (framework caches, gc.collect, user callbacks) runs Python.  A
 * thread that already holds the GIL, or an allocation of a Python thread
 * that released it around the core (CuPy's), runs it itself.  A tag marked
 * relieved (set_tag_relieved: the registry's `relieved` frameworks, torch's)
 * may allocate from a C++ thread (autograd's) holding the framework's locks
 * that a GIL-holding thread waits for: taking the GIL there could deadlock.
 * Such a thread asks the reliever (a Python thread started by
 * bridge.recovery, blocked here without the GIL) and waits for it at most
 * relief_timeout; past that it goes on without the chain's help. */
static PyObject *pressure_callback; /* (device, size, tag, stage) -> bool */

static pthread_mutex_t relief_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t relief_cv = PTHREAD_COND_INITIALIZER;
static uint64_t relief_asked, relief_done; /* request generations (relief_mu) */
static int relief_args[3];                 /* device, tag, stage of the request */
static size_t relief_size;
static int relief_freed;            /* result of generation relief_done */
static int reliever_running;        /* a reliever waits for requests */
static double relief_timeout = 5.0; /* seconds */
static _Atomic unsigned relieved_tags; /* bit t: tag t's pressure goes to the reliever */

static int run_callback(int device, size_t size, int tag, int stage)
{
    int freed = 0;
    PyObject *cb = pressure_callback;
    if (cb) {
        Py_INCREF(cb);
        PyObject *r = PyObject_CallFunction(cb, "inii", device, (Py_ssize_t)size, tag, stage);
        if (r) {
            freed = PyObject_IsTrue(r) > 0;
            Py_DECREF(r);
        } else {
            PyErr_WriteUnraisable(cb); /* a hook never turns into a crash */
        }
        Py_DECREF(cb);
    }
    return freed;
}

/* -1 when no reliever runs (the caller then takes the GIL itself). */
static int ask_reliever(int device, size_t size, int tag, int stage)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    double whole = (double)(long)relief_timeout;
    until.tv_sec += (time_t)whole;
    until.tv_nsec += (long)((relief_timeout - whole) * 1e9);
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    int freed = -1;
    pthread_mutex_lock(&relief_mu);
    if (reliever_running) {
        /* one request at a time: a request in flight serves this one too
         * (whatever its stage: a second chain at once would find little) */
        if (relief_asked == relief_done) {
            relief_args[0] = device;
            relief_args[1] = tag;
            relief_args[2] = stage;
            relief_size = size;
            relief_asked++;
            pthread_cond_broadcast(&relief_cv);
        }
        uint64_t mine = relief_asked;
        int rc = 0;
        while (relief_done < mine && rc == 0)
            rc = pthread_cond_timedwait(&relief_cv, &relief_mu, &until);
        freed = relief_done >= mine && relief_freed;
    }
    pthread_mutex_unlock(&relief_mu);
    return freed;
}

static int pressure_trampoline(int device, size_t size, int tag, int stage)
{
    if (!Py_IsInitialized())
        return 0;
    if (tag >= 0 && tag < BRIDGE_NTAGS &&
        (atomic_load_explicit(&relieved_tags, memory_order_relaxed) & (1u << tag)) &&
        !PyGILState_Check()) {
        int freed = ask_reliever(device, size, tag, stage);
        if (freed >= 0)
            return freed;
    }
    PyGILState_STATE st = PyGILState_Ensure();
    int freed = run_callback(device, size, tag, stage);
    PyGILState_Release(st);
    return freed;
}

static PyObject *py_relief_loop(PyObject *m, PyObject *a)
{
    /* The reliever's body: serve requests until stop_relief() (never returns
     * otherwise).  Run it in a daemon thread. */
    (void)m;
    (void)a;
    pthread_mutex_lock(&relief_mu);
    if (reliever_running) {
        pthread_mutex_unlock(&relief_mu);
        Py_RETURN_FALSE; /* one reliever is enough */
    }
    reliever_running = 1;
    pthread_mutex_unlock(&relief_mu);
    for (;;) {
        int device = 0, tag = 0, stage = 0, stop = 0;
        size_t size = 0;
        uint64_t gen = 0;
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&relief_mu);
        while (reliever_running && relief_asked == relief_done)
            pthread_cond_wait(&relief_cv, &relief_mu);
        stop = !reliever_running;
        gen = relief_asked;
        device = relief_args[0];
        tag = relief_args[1];
        stage = relief_args[2];
        size = relief_size;
        pthread_mutex_unlock(&relief_mu);
        Py_END_ALLOW_THREADS
        if (stop)
            break;
        int freed = run_callback(device, size, tag, stage);
        pthread_mutex_lock(&relief_mu);
        relief_freed = freed;
        relief_done = gen;
        pthread_cond_broadcast(&relief_cv);
        pthread_mutex_unlock(&relief_mu);
    }
    Py_RETURN_TRUE;
}

static PyObject *py_stop_relief(PyObject *m, PyObject *a)
{
    (void)m;
    (void)a;
    pthread_mutex_lock(&relief_mu);
    reliever_running = 0;
    relief_done = relief_asked; /* nobody waits for a request nobody serves */
    pthread_cond_broadcast(&relief_cv);
    pthread_mutex_unlock(&relief_mu);
    Py_RETURN_NONE;
}

static PyObject *py_set_relief_timeout(PyObject *m, PyObject *arg)
{
    (void)m;
    double t = PyFloat_AsDouble(arg);
    if (t == -1.0 && PyErr_Occurred())
        return NULL;
    if (!(t >= 0.0 && t <= 3600.0)) {
        PyErr_Format(PyExc_ValueError, "the relief timeout must be in [0, 3600] seconds, got %R",
                     arg);
        return NULL;
    }
    pthread_mutex_lock(&relief_mu);
    relief_timeout = t;
    pthread_mutex_unlock(&relief_mu);
    Py_RETURN_NONE;
}

static PyObject *py_set_pressure_callback(PyObject *m, PyObject *cb)
{
    (void)m;
    if (cb == Py_None) {
        bridge_set_pressure_hook(NULL);
        Py_CLEAR(pressure_callback);
    } else {
        if (!PyCallable_Check(cb)) {
            PyErr_SetString(PyExc_TypeError, "the pressure callback must be callable");
            return NULL;
        }
        Py_INCREF(cb);
        Py_XSETREF(pressure_callback, cb);
        bridge_set_pressure_hook(pressure_trampoline);
    }
    Py_RETURN_NONE;
}

/* ---- waiting for memory (wait.c): the GIL and Ctrl-C ---- */
/* A waiting thread must not hold the GIL (the threads that would free run
 * Python): it is released for the wait when this thread holds it (a torch
 * allocation made with the GIL held; CuPy's allocator has released it
 * already).  Only the main thread receives Ctrl-C: a waiter on it takes the
 * GIL about every 50 ms to look (torch's autograd threads, which may hold
 * torch locks, never do), gives up, and leaves SIGINT pending so that
 * Python's handler raises KeyboardInterrupt where Python next checks. */
static unsigned long main_thread; /* threading.main_thread().ident; 0 = unknown */

static void *wait_release_gil(void)
{
    if (!Py_IsInitialized() || !PyGILState_Check())
        return NULL;
    return PyEval_SaveThread();
}

static void wait_reacquire_gil(void *token)
{
    PyEval_RestoreThread((PyThreadState *)token);
}

static int wait_interrupted(void)
{
    if (!main_thread || (unsigned long)pthread_self() != main_thread || !Py_IsInitialized())
        return 0;
    PyGILState_STATE st = PyGILState_Ensure();
    int hit = PyOS_InterruptOccurred(); /* takes the SIGINT mark... */
    if (hit)
        PyErr_SetInterrupt(); /* ...and leaves it for Python's handler */
    PyGILState_Release(st);
    return hit;
}

static PyObject *py_set_main_thread(PyObject *m, PyObject *arg)
{
    (void)m;
    unsigned long id = PyLong_AsUnsignedLong(arg);
    if (id == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    main_thread = id;
    static const bridge_wait_hooks h = {wait_release_gil, wait_reacquire_gil, wait_interrupted};
    bridge_set_wait_hooks(&h);
    Py_RETURN_NONE;
}

static PyObject *py_set_wait(PyObject *m, PyObject *arg)
{
    (void)m;
    double t = PyFloat_AsDouble(arg);
    if (t == -1.0 && PyErr_Occurred())
        return NULL;
    return PyLong_FromLong(bridge_set_wait(t));
}

static PyObject *py_get_wait(PyObject *m, PyObject *a)
{
    (void)m;
    (void)a;
    return PyFloat_FromDouble(bridge_get_wait());
}

static PyObject *py_set_thread_wait(PyObject *m, PyObject *args)
{
    (void)m;
    int set, priority;
    double seconds;
    if (!PyArg_ParseTuple(args, "pdi", &set, &seconds, &priority))
        return NULL;
    return PyLong_FromLong(bridge_set_thread_wait(set, seconds, priority));
}

static PyObject *py_thread_wait(PyObject *m, PyObject *a)
{
    (void)m;
    (void)a;
    int set, priority;
    double seconds;
    bridge_get_thread_wait(&set, &seconds, &priority);
    return Py_BuildValue("Ndi", PyBool_FromLong(set), seconds, priority);
}

static PyObject *py_last_wait(PyObject *m, PyObject *a)
{
    (void)m;
    (void)a;
    double seconds;
    int outcome;
    bridge_last_wait(&seconds, &outcome);
    return Py_BuildValue("di", seconds, outcome);
}

static PyObject *py_wait_holders(PyObject *m, PyObject *args)
{
    (void)m;
    int dev, n = 0;
    if (!PyArg_ParseTuple(args, "i", &dev))
        return NULL;
    bridge_holder h[64];
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bridge_wait_holders(dev, h, 64, &n);
    Py_END_ALLOW_THREADS
    PyObject *list = PyList_New(n);
    if (!list)
        return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *t = Py_BuildValue("kKN", h[i].thread, (unsigned long long)h[i].bytes,
                                    PyBool_FromLong(h[i].waiting));
        if (!t) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, t);
    }
    return Py_BuildValue("iN", rc, list);
}

/* ---- module functions ---- */
static PyObject *py_init(PyObject *m, PyObject *args)
{
    (void)m;
    const char *path = NULL;
    if (!PyArg_ParseTuple(args, "|z", &path))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bridge_init(path);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *py_initialized(PyObject *m, PyObject *a)
{
    (void)m;
    (void)a;
    return PyBool_FromLong(bridge_initialized());
}

/* f(int *out) -> (status, out) */
#define INT_OUT(pyname, fn)                           \
    static PyObject *pyname(PyObject *m, PyObject *a) \
    {                                                 \
        (void)m;                                      \
        (void)a;                                      \
        int out = 0;                                  \
        int rc = fn(&out);                            \
        return Py_BuildValue("ii", rc, out);          \
    }

INT_OUT(py_device_count, bridge_device_count)

INT_OUT(py_driver_version, bridge_driver_version)

INT_OUT(py_current_device, bridge_current_device)

static PyObject *py_device_info(PyObject *m, PyObject *args)
{
    (void)m;
    int dev;
    if (!PyArg_ParseTuple(args, "i", &dev))
        return NULL;
    char name[256];
    int major = 0, minor = 0, rc;
    uint64_t total = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = bridge_device_info(dev, name, (int)sizeof name, &major, &minor, &total);
    Py_END_ALLOW_THREADS
    name[sizeof name - 1] = '\0';
    return Py_BuildValue("isiiK", rc, rc == BRIDGE_OK ? name : "", major, minor,
                         (unsigned long long)total);
}

static PyObject *py_last_driver_error(PyObject *m, PyObject *a)
{
    (void)m;
    (void)a;
    int code = bridge_last_driver_error();
    return Py_BuildValue("is", code, code ? bridge_driver_error_name(code) : "CUDA_SUCCESS");
}

static PyObject *py_loaded_library(PyObject *m, PyObject *a)
{
    (void)m;
    (void)a;
    return PyUnicode_FromString(bridge_loaded_library());
}

static PyObject *py_load_error(PyObject *m, PyObject *a)
{
    (void)m;
    (void)a;
    return PyUnicode_FromString(bridge_load_error());
}

static PyObject *py_setup(PyObject *m, PyObject *args)
{
    (void)m;
    int dev;
    unsigned long long threshold;
    if (!PyArg_ParseTuple(args, "iK", &dev, &threshold))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bridge_device_setup(dev, threshold);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *py_ready(PyObject *m, PyObject *args)
{
    (void)m;
    int dev;
    if (!PyArg_ParseTuple(args, "i", &dev))
        return NULL;
    return PyBool_FromLong(bridge_device_ready(dev));
}

/* f(int) -> status, GIL released */
#define DEV_CALL(pyname, expr)                           \
    static PyObject *pyname(PyObject *m, PyObject *args) \
    {                                                    \
        (void)m;                                         \
        int dev;                                         \
        if (!PyArg_ParseTuple(args, "i", &dev))          \
            return NULL;                                 \
        int rc;                                          \
        Py_BEGIN_ALLOW_THREADS                           \
        rc = (expr);                                     \
        Py_END_ALLOW_THREADS                             \
        return PyLong_FromLong(rc);                      \
    }

DEV_CALL(py_reassert, bridge_reassert(dev))

static PyObject *py_pool_attribute(PyObject *m, PyObject *args)
{
    (void)m;
    int dev, attr;
    if (!PyArg_ParseTuple(args, "ii", &dev, &attr))
        return NULL;
    uint64_t v = 0;
    int rc = bridge_pool_attribute(dev, attr, &v);
    return Py_BuildValue("iK", rc, (unsigned long long)v);
}

static PyObject *py_trim(PyObject *m, PyObject *args)
{
    (void)m;
    int dev;
    unsigned long long keep = 0;
    if (!PyArg_ParseTuple(args, "i|K", &dev, &keep))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bridge_trim(dev, keep);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *py_grant_peer_access(PyObject *m, PyObject *args)
{
    (void)m;
    int dev, n = 0;
    if (!PyArg_ParseTuple(args, "i", &dev))
        return NULL;
    int rc = bridge_grant_peer_access(dev, &n);
    return Py_BuildValue("ii", rc, n);
}

/* ---- blocks shared with other processes (ipc.c) ---- */
static PyObject *py_ipc_enable(PyObject *m, PyObject *args)
{
    (void)m;
    int dev;
    if (!PyArg_ParseTuple(args, "i", &dev))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = bridge_ipc_enable(dev);
    Py_END_ALLOW_THREADS return PyLong_FromLong(rc);
}

static PyObject *py_ipc_enabled(PyObject *m, PyObject *args)
{
    (void)m;
    int dev;
    if (!PyArg_ParseTuple(args, "i", &dev))
        return NULL;
    return PyBool_FromLong(bridge_ipc_enabled(dev));
}

static PyObject *py_ipc_export(PyObject *m, PyObject *args)
{
    (void)m;
    unsigned long long ptr;
    if (!PyArg_ParseTuple(args, "K", &ptr))
        return NULL;
    unsigned char h[BRIDGE_IPC_HANDLE_SIZE];
    uint64_t offset = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = bridge_ipc_export((void *)(uintptr_t)ptr, h, &offset);
    Py_END_ALLOW_THREADS if (rc != BRIDGE_OK) return Py_BuildValue("iOK", rc, Py_None, 0ull);
    return Py_BuildValue("iy#K", rc, (const char *)h, (Py_ssize_t)sizeof h,
                         (unsigned long long)offset);
}

static PyObject *py_ipc_import(PyObject *m, PyObject *args)
{
    (void)m;
    Py_buffer h;
    int dev;
    if (!PyArg_ParseTuple(args, "y*i", &h, &dev))
        return NULL;
    void *out = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc =
        bridge_ipc_import((const unsigned char *)h.buf, (size_t)h.len, dev, &out);
    Py_END_ALLOW_THREADS PyBuffer_Release(&h);
    return Py_BuildValue("iK", rc, (unsigned long long)(uintptr_t)out);
}

static PyObject *py_ipc_release(PyObject *m, PyObject *args)
{
    (void)m;
    unsigned long long ptr;
    if (!PyArg_ParseTuple(args, "K", &ptr))
        return NULL;
    Py_BEGIN_ALLOW_THREADS bridge_ipc_release((void *)(uintptr_t)ptr);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_ipc_error(PyObject *m, PyObject *noargs)
{
    (void)m;
    (void)noargs;
    return PyUnicode_FromString(bridge_ipc_error());
}

static PyObject *py_ipc_counts(PyObject *m, PyObject *noargs)
{
    (void)m;
    (void)noargs;
    return Py_BuildValue("KKK", (unsigned long long)bridge_ipc_holds(),
                         (unsigned long long)bridge_ipc_imported(),
                         (unsigned long long)bridge_ipc_refused());
}

static PyObject *py_set_limit(PyObject *m, PyObject *args)
{
    (void)m;
    int dev;
    unsigned long long limit;
    if (!PyArg_ParseTuple(args, "iK", &dev, &limit))
        return NULL;
    return PyLong_FromLong(bridge_set_limit(dev, limit));
}

static PyObject *py_set_cache(PyObject *m, PyObject *args)
{
    (void)m;
    int dev;
    unsigned long long limit, max_block = 256ull << 20;
    if (!PyArg_ParseTuple(args, "iK|K", &dev, &limit, &max_block))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bridge_set_cache(dev, limit, max_block);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *py_set_cache_fraction(PyObject *m, PyObject *args)
{
    (void)m;
    int dev;
    double fraction;
    unsigned long long floor = 64ull << 20;
    if (!PyArg_ParseTuple(args, "id|K", &dev, &fraction, &floor))
        return NULL;
    return PyLong_FromLong(bridge_set_cache_fraction(dev, fraction, floor));
}

static PyObject *py_set_cache_tiers(PyObject *m, PyObject *args)
{
    (void)m;
    int dev;
    unsigned long long small_max = 1ull << 20, large_cap = 64ull << 20;
    if (!PyArg_ParseTuple(args, "i|KK", &dev, &small_max, &large_cap))
        return NULL;
    return PyLong_FromLong(bridge_set_cache_tiers(dev, small_max, large_cap));
}

static PyObject *py_set_cache_large_fraction(PyObject *m, PyObject *args)
{
    (void)m;
    int dev;
    double fraction;
    if (!PyArg_ParseTuple(args, "id", &dev, &fraction))
        return NULL;
    return PyLong_FromLong(bridge_set_cache_large_fraction(dev, fraction));
}

static PyObject *py_set_cache_thread_slots(PyObject *m, PyObject *args)
{
    (void)m;
    int dev, on;
    if (!PyArg_ParseTuple(args, "ip", &dev, &on))
        return NULL;
    return PyLong_FromLong(bridge_set_cache_thread_slots(dev, on));
}

static PyObject *py_set_cache_segments(PyObject *m, PyObject *args)
{
    (void)m;
    int dev, on = 1;
    if (!PyArg_ParseTuple(args, "i|p", &dev, &on))
        return NULL;
    return PyLong_FromLong(bridge_set_cache_segments(dev, on));
}

static PyObject *py_set_cache_carve(PyObject *m, PyObject *args)
{
    (void)m;
    int dev;
    double share = 1.0 / 8;
    unsigned long long lo = 32ull << 20, hi = 256ull << 20, keep = 0, small_keep = 0;
    if (!PyArg_ParseTuple(args, "i|dKKKK", &dev, &share, &lo, &hi, &keep, &small_keep))
        return NULL;
    return PyLong_FromLong(bridge_set_cache_carve(dev, share, lo, hi, keep, small_keep));
}

static PyObject *py_register_stream(PyObject *m, PyObject *args)
{
    (void)m;
    unsigned long long stream;
    if (!PyArg_ParseTuple(args, "K", &stream))
        return NULL;
    return PyLong_FromLong(bridge_register_stream((void *)(uintptr_t)stream));
}

static PyObject *py_forget_stream(PyObject *m, PyObject *args)
{
    (void)m;
    unsigned long long stream;
    if (!PyArg_ParseTuple(args, "K", &stream))
        return NULL;
    return PyLong_FromLong(bridge_forget_stream((void *)(uintptr_t)stream));
}

static PyObject *py_capture(PyObject *m, PyObject *args)
{
    /* capture(begin, device) -> status: a capture the bridge must know of */
    (void)m;
    int begin, dev;
    if (!PyArg_ParseTuple(args, "pi", &begin, &dev))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = begin ? bridge_capture_begin(dev) : bridge_capture_end(dev);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *py_capture_stream(PyObject *m, PyObject *args)
{
    /* capture_stream(begin, device, stream_or_pool) -> (status, pool): a CuPy
     * capture with a graph pool of its own (begin: the stream's handle, end:
     * the pool begin gave) */
    (void)m;
    int begin, dev;
    unsigned long long arg;
    if (!PyArg_ParseTuple(args, "piK", &begin, &dev, &arg))
        return NULL;
    int rc;
    uint64_t pool = arg;
    Py_BEGIN_ALLOW_THREADS
    rc = begin ? bridge_capture_begin_stream(dev, (void *)(uintptr_t)arg, &pool)
               : bridge_capture_end_stream(dev, arg);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("iK", rc, (unsigned long long)pool);
}

static PyObject *py_bind_graph(PyObject *m, PyObject *args)
{
    /* bind_graph(device, pool, stream) -> status: the graph the stream
     * captures into owns the release of the CuPy pool (a user object) */
    (void)m;
    int dev;
    unsigned long long pool, stream;
    if (!PyArg_ParseTuple(args, "iKK", &dev, &pool, &stream))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bridge_capture_bind_graph(dev, pool, (void *)(uintptr_t)stream);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *py_graph_collect(PyObject *m, PyObject *a)
{
    /* graph_collect() -> [(device, pool)]: dead graphs' pools released now,
     * and every pool released by a collect since the last call */
    (void)m;
    (void)a;
    PyObject *out = PyList_New(0);
    if (!out)
        return NULL;
    enum { CHUNK = 64 };
    int devs[CHUNK];
    uint64_t ids[CHUNK];
    size_t n;
    do {
        Py_BEGIN_ALLOW_THREADS
        n = bridge_graph_collect(devs, ids, CHUNK);
        Py_END_ALLOW_THREADS
        for (size_t i = 0; i < n; i++) {
            PyObject *t = Py_BuildValue("iK", devs[i], (unsigned long long)ids[i]);
            if (!t || PyList_Append(out, t) < 0) {
                Py_XDECREF(t);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(t);
        }
    } while (n == CHUNK);
    return out;
}

static PyObject *py_set_tag_holds_streams(PyObject *m, PyObject *args)
{
    (void)m;
    int tag, holds;
    if (!PyArg_ParseTuple(args, "ip", &tag, &holds))
        return NULL;
    return PyLong_FromLong(bridge_set_tag_holds_streams(tag, holds));
}

static PyObject *py_set_tag_relieved(PyObject *m, PyObject *args)
{
    (void)m;
    int tag, relieved;
    if (!PyArg_ParseTuple(args, "ip", &tag, &relieved))
        return NULL;
    if (tag < 0 || tag >= BRIDGE_NTAGS)
        return PyLong_FromLong(BRIDGE_E_INVALID);
    if (relieved)
        atomic_fetch_or(&relieved_tags, 1u << tag);
    else
        atomic_fetch_and(&relieved_tags, ~(1u << tag));
    return PyLong_FromLong(BRIDGE_OK);
}

static PyObject *py_forked(PyObject *m, PyObject *a)
{
    (void)m;
    (void)a;
    return PyBool_FromLong(bridge_forked());
}

static PyObject *py_set_tag_limit(PyObject *m, PyObject *args)
{
    (void)m;
    int dev, tag;
    unsigned long long limit;
    if (!PyArg_ParseTuple(args, "iiK", &dev, &tag, &limit))
        return NULL;
    return PyLong_FromLong(bridge_set_tag_limit(dev, tag, limit));
}

static PyObject *py_set_tag_cached(PyObject *m, PyObject *args)
{
    (void)m;
    int tag, cached;
    if (!PyArg_ParseTuple(args, "ip", &tag, &cached))
        return NULL;
    return PyLong_FromLong(bridge_set_tag_cached(tag, cached));
}

static PyObject *py_alloc(PyObject *m, PyObject *args)
{
    (void)m;
    int dev, tag;
    Py_ssize_t size;
    unsigned long long stream;
    if (!PyArg_ParseTuple(args, "inKi", &dev, &size, &stream, &tag))
        return NULL;
    if (size < 0) {
        PyErr_Format(PyExc_ValueError, "size must be >= 0, got %zd", size);
        return NULL;
    }
    void *p = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bridge_alloc(dev, (size_t)size, (void *)(uintptr_t)stream, tag, &p);
    Py_END_ALLOW_THREADS
    if (rc != BRIDGE_OK && raise_if_interrupted() < 0)
        return NULL;
    return Py_BuildValue("iK", rc, (unsigned long long)(uintptr_t)p);
}

static PyObject *py_alloc_cached(PyObject *m, PyObject *args)
{
    (void)m;
    int dev, tag;
    Py_ssize_t size;
    unsigned long long stream;
    if (!PyArg_ParseTuple(args, "inKi", &dev, &size, &stream, &tag))
        return NULL;
    if (size < 0) {
        PyErr_Format(PyExc_ValueError, "size must be >= 0, got %zd", size);
        return NULL;
    }
    void *p = NULL;
    /* with the GIL held: the cache only, nothing that waits */
    int rc = bridge_alloc_cached(dev, (size_t)size, (void *)(uintptr_t)stream, tag, &p);
    return Py_BuildValue("iK", rc, (unsigned long long)(uintptr_t)p);
}

static PyObject *py_alloc_block(PyObject *m, PyObject *args)
{
    (void)m;
    int dev, tag;
    Py_ssize_t size;
    unsigned long long stream;
    PyObject *stream_obj = Py_None;
    if (!PyArg_ParseTuple(args, "inKi|O", &dev, &size, &stream, &tag, &stream_obj))
        return NULL;
    if (size < 0) {
        PyErr_Format(PyExc_ValueError, "size must be >= 0, got %zd", size);
        return NULL;
    }
    void *p = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bridge_alloc(dev, (size_t)size, (void *)(uintptr_t)stream, tag, &p);
    Py_END_ALLOW_THREADS
    if (rc != BRIDGE_OK && raise_if_interrupted() < 0)
        return NULL;
    if (rc != BRIDGE_OK)
        return Py_BuildValue("iO", rc, Py_None);
    PyObject *b = block_new(p, (size_t)size, dev, stream_obj == Py_None ? NULL : stream_obj);
    if (!b)
        return NULL;
    return Py_BuildValue("iN", rc, b);
}

static PyObject *py_free(PyObject *m, PyObject *args)
{
    (void)m;
    unsigned long long ptr;
    if (!PyArg_ParseTuple(args, "K", &ptr))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    bridge_free((void *)(uintptr_t)ptr);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_free_cached(PyObject *m, PyObject *args)
{
    (void)m;
    unsigned long long ptr;
    if (!PyArg_ParseTuple(args, "K", &ptr))
        return NULL;
    /* with the GIL held: into the cache only, nothing that waits */
    return PyLong_FromLong(bridge_free_cached((void *)(uintptr_t)ptr));
}

static PyObject *py_block_gil_releases(PyObject *m, PyObject *a)
{
    (void)m;
    (void)a;
    return PyLong_FromUnsignedLongLong(block_gil_releases);
}

static PyObject *py_record_stream(PyObject *m, PyObject *args)
{
    (void)m;
    unsigned long long ptr, stream;
    if (!PyArg_ParseTuple(args, "KK", &ptr, &stream))
        return NULL;
    return PyLong_FromLong(bridge_record_stream((void *)(uintptr_t)ptr, (void *)(uintptr_t)stream));
}

static PyObject *py_lookup(PyObject *m, PyObject *args)
{
    (void)m;
    unsigned long long ptr;
    if (!PyArg_ParseTuple(args, "K", &ptr))
        return NULL;
    size_t size = 0;
    int dev = -1, tag = -1;
    int rc = bridge_lookup((void *)(uintptr_t)ptr, &size, &dev, &tag);
    return Py_BuildValue("inii", rc, (Py_ssize_t)size, dev, tag);
}

/* d[key] = o, the reference to o given up (o NULL: the error already set) */
static int put_new(PyObject *d, const char *key, PyObject *o)
{
    if (!o)
        return -1;
    int r = PyDict_SetItemString(d, key, o);
    Py_DECREF(o);
    return r;
}

static int put(PyObject *d, const char *key, uint64_t v)
{
    return put_new(d, key, PyLong_FromUnsignedLongLong(v));
}

static int put_float(PyObject *d, const char *key, double v)
{
    return put_new(d, key, PyFloat_FromDouble(v));
}

static PyObject *py_stats(PyObject *m, PyObject *args)
{
    (void)m;
    int dev;
    if (!PyArg_ParseTuple(args, "i", &dev))
        return NULL;
    bridge_stats s;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bridge_get_stats(dev, &s);
    Py_END_ALLOW_THREADS
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
#define PUT(k)               \
    if (put(d, #k, s.k) < 0) \
        goto fail;
    PUT(limit)
    PUT(used)
    PUT(peak_used)
    PUT(pool_used)
    PUT(pool_reserved)
    PUT(pool_used_high)
    PUT(release_threshold)
    PUT(total)
    PUT(num_allocs)
    PUT(num_frees)
    PUT(num_ooms)
    PUT(num_retries)
    PUT(num_bad_frees)
    PUT(num_driver_errors)
    PUT(num_deferred)
    PUT(graph_bytes)
    PUT(cached)
    PUT(cache_limit)
    PUT(cache_floor)
    PUT(cached_small)
    PUT(cached_large)
    PUT(cache_small_max)
    PUT(cache_large_cap)
    PUT(num_cache_hits)
    PUT(num_order_fallbacks)
    PUT(num_pool_read_errors)
    PUT(captures_active)
    PUT(num_waits)
    PUT(wait_ns)
    PUT(num_wait_timeouts)
    PUT(num_wait_all_waiting)
    PUT(num_wait_interrupts)
    PUT(waiting)
    PUT(carve_held)
    PUT(carve_on)
    PUT(carve_hwm)
    PUT(carve_slack)
    PUT(carve_parked)
#undef PUT
    if (put_float(d, "cache_fraction", s.cache_fraction) < 0 ||
        put_float(d, "cache_large_fraction", s.cache_large_fraction) < 0)
        goto fail;
    {
        PyObject *tags = PyList_New(BRIDGE_NTAGS);
        if (!tags)
            goto fail;
        for (int i = 0; i < BRIDGE_NTAGS; i++) {
            bridge_tag_stats *t = &s.tag[i];
            PyObject *td =
                Py_BuildValue("{sKsKsKsKsKsKsKsKsKsKsK}", "current", t->current, "peak", t->peak,
                              "allocated", t->allocated, "freed", t->freed, "num_allocs",
                              t->num_allocs, "num_frees", t->num_frees, "num_ooms", t->num_ooms,
                              "limit", t->limit, "count", t->count, "count_peak", t->count_peak,
                              "reserved_peak", t->reserved_peak);
            if (!td) {
                Py_DECREF(tags);
                goto fail;
            }
            PyList_SET_ITEM(tags, i, td);
        }
        if (PyDict_SetItemString(d, "tags", tags) < 0) {
            Py_DECREF(tags);
            goto fail;
        }
        Py_DECREF(tags);
    }
    return Py_BuildValue("iN", rc, d);
fail:
    Py_DECREF(d);
    return NULL;
}

static PyObject *py_reset_peak(PyObject *m, PyObject *args)
{
    (void)m;
    int dev, tag = -1;
    if (!PyArg_ParseTuple(args, "i|i", &dev, &tag))
        return NULL;
    return PyLong_FromLong(bridge_reset_peak(dev, tag));
}

static PyObject *py_reset_accumulated(PyObject *m, PyObject *args)
{
    (void)m;
    int dev, tag = -1;
    if (!PyArg_ParseTuple(args, "i|i", &dev, &tag))
        return NULL;
    return PyLong_FromLong(bridge_reset_accumulated(dev, tag));
}

static PyObject *py_others(PyObject *m, PyObject *args)
{
    (void)m;
    int dev;
    if (!PyArg_ParseTuple(args, "i", &dev))
        return NULL;
    uint64_t v = 0;
    int rc = bridge_others(dev, &v);
    return Py_BuildValue("iK", rc, (unsigned long long)v);
}

static PyObject *py_live_records(PyObject *m, PyObject *a)
{
    (void)m;
    (void)a;
    return PyLong_FromUnsignedLongLong(bridge_live_records());
}

static PyObject *py_parked_records(PyObject *m, PyObject *a)
{
    (void)m;
    (void)a;
    return PyLong_FromUnsignedLongLong(bridge_parked_records());
}

static PyObject *py_graph(PyObject *m, PyObject *args)
{
    /* graph(op, device, id0, id1): op 0 begin, 1 end, 2 release (tests) */
    (void)m;
    int op, dev;
    unsigned long long a, b;
    if (!PyArg_ParseTuple(args, "iiKK", &op, &dev, &a, &b))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = op == 0   ? bridge_graph_begin(dev, a, b)
         : op == 1 ? bridge_graph_end(dev, a, b)
                   : bridge_graph_release(dev, a, b);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *py_graph_begin_on(PyObject *m, PyObject *args)
{
    /* graph_begin_on(device, id0, id1, stream, capture) (tests) */
    (void)m;
    int dev, capture;
    unsigned long long a, b, stream;
    if (!PyArg_ParseTuple(args, "iKKKp", &dev, &a, &b, &stream, &capture))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bridge_graph_begin_on(dev, a, b, (void *)(uintptr_t)stream, capture);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *py_alloc_graph(PyObject *m, PyObject *args)
{
    (void)m;
    int dev, tag;
    Py_ssize_t size;
    unsigned long long a, b, stream = 0;
    if (!PyArg_ParseTuple(args, "iniKK|K", &dev, &size, &tag, &a, &b, &stream))
        return NULL;
    if (size < 0) {
        PyErr_Format(PyExc_ValueError, "size must be >= 0, got %zd", size);
        return NULL;
    }
    void *p = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bridge_alloc_graph(dev, (size_t)size, tag, a, b, (void *)(uintptr_t)stream, &p);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("iK", rc, (unsigned long long)(uintptr_t)p);
}

static PyMethodDef methods[] = {
    {"init", py_init, METH_VARARGS, "init(path=None) -> status: load the driver."},
    {"initialized", py_initialized, METH_NOARGS, "Whether the driver is loaded."},
    {"device_count", py_device_count, METH_NOARGS, "-> (status, count)"},
    {"driver_version", py_driver_version, METH_NOARGS, "-> (status, version)"},
    {"device_info", py_device_info, METH_VARARGS,
     "device_info(device) -> (status, name, cc_major, cc_minor, total_bytes)"},
    {"current_device", py_current_device, METH_NOARGS,
     "-> (status, device of the current context)"},
    {"last_driver_error", py_last_driver_error, METH_NOARGS, "-> (code, name)"},
    {"loaded_library", py_loaded_library, METH_NOARGS, "The driver library in use."},
    {"load_error", py_load_error, METH_NOARGS, "Why loading the driver failed."},
    {"setup", py_setup, METH_VARARGS, "setup(device, release_threshold) -> status"},
    {"ready", py_ready, METH_VARARGS, "ready(device) -> bool"},
    {"reassert", py_reassert, METH_VARARGS, "reassert(device) -> status"},
    {"pool_attribute", py_pool_attribute, METH_VARARGS,
     "pool_attribute(device, attr) -> (status, value)"},
    {"trim", py_trim, METH_VARARGS, "trim(device, keep=0) -> status"},
    {"grant_peer_access", py_grant_peer_access, METH_VARARGS, "-> (status, peers granted)"},
    {"set_limit", py_set_limit, METH_VARARGS, "set_limit(device, bytes) -> status"},
    {"ipc_enable", py_ipc_enable, METH_VARARGS,
     "ipc_enable(device) -> status: allocate from a pool with POSIX fd export from now on"},
    {"ipc_enabled", py_ipc_enabled, METH_VARARGS, "ipc_enabled(device) -> bool"},
    {"ipc_export", py_ipc_export, METH_VARARGS,
     "ipc_export(ptr) -> (status, handle bytes or None, offset)"},
    {"ipc_import", py_ipc_import, METH_VARARGS, "ipc_import(handle, device) -> (status, ptr)"},
    {"ipc_release", py_ipc_release, METH_VARARGS, "ipc_release(ptr): let go of an import"},
    {"ipc_error", py_ipc_error, METH_NOARGS, "why this thread's last ipc_* call failed"},
    {"ipc_counts", py_ipc_counts, METH_NOARGS,
     "ipc_counts() -> (holds others have here, imports held, connections refused)"},
    {"set_cache", py_set_cache, METH_VARARGS,
     "set_cache(device, limit, max_block=256MiB) -> status: the hard cap of cached bytes "
     "(0: no cache; emptied) and the largest cached block"},
    {"set_cache_fraction", py_set_cache_fraction, METH_VARARGS,
     "set_cache_fraction(device, fraction, floor=64MiB) -> status: the cache's cap follows "
     "the bytes the frameworks hold, cached <= min(limit, max(floor, live * fraction)); "
     "past it the least recently cached blocks go back to the pool (default 1/16, 64 MiB); "
     "blocks up to the small tier's largest (set_cache_tiers)"},
    {"set_cache_tiers", py_set_cache_tiers, METH_VARARGS,
     "set_cache_tiers(device, small_max=1MiB, large_cap=64MiB) -> status: blocks above "
     "small_max have their own least-recently-cached order under a fixed cap, "
     "cached_large <= min(limit, large_cap); each tier evicts only its own blocks"},
    {"set_cache_segments", py_set_cache_segments, METH_VARARGS,
     "set_cache_segments(device, on=True) -> status: the cache's requests carved from pool "
     "segments, every emptied one kept under the release rule (off: carving off)"},
    {"set_cache_carve", py_set_cache_carve, METH_VARARGS,
     "set_cache_carve(device, share=1/8, min=32 MiB, max=256 MiB, keep=0, small_keep=0) -> "
     "status: carve the cache's requests from pool chunks (max 0: off)"},
    {"set_cache_thread_slots", py_set_cache_thread_slots, METH_VARARGS,
     "set_cache_thread_slots(device, on) -> status: each thread's newest freed block waits "
     "in a slot of its own, taken back by that thread without a lock (default on)"},
    {"set_cache_large_fraction", py_set_cache_large_fraction, METH_VARARGS,
     "set_cache_large_fraction(device, fraction) -> status: the large tier's cap is also at "
     "most this share of the bytes the frameworks hold, but never less than the block being "
     "cached: cached_large <= min(limit, large_cap, max(live * fraction, block)) (default "
     "1/8; 0: the fixed cap alone)"},
    {"register_stream", py_register_stream, METH_VARARGS,
     "register_stream(handle) -> status: blocks freed on it may be cached"},
    {"forget_stream", py_forget_stream, METH_VARARGS,
     "forget_stream(handle) -> status: no longer cache blocks freed on it"},
    {"capture", py_capture, METH_VARARGS,
     "capture(begin, device) -> status: a stream capture starts or ends"},
    {"capture_stream", py_capture_stream, METH_VARARGS,
     "capture_stream(begin, device, stream_or_pool) -> (status, pool): a stream capture's pool"},
    {"bind_graph", py_bind_graph, METH_VARARGS,
     "bind_graph(device, pool, stream) -> status: the captured graph's end releases the pool"},
    {"graph_collect", py_graph_collect, METH_NOARGS,
     "graph_collect() -> [(device, pool)]: capture pools released since the last call"},
    {"set_tag_holds_streams", py_set_tag_holds_streams, METH_VARARGS,
     "set_tag_holds_streams(tag, holds) -> status: the tag keeps its streams alive until frees"},
    {"set_tag_relieved", py_set_tag_relieved, METH_VARARGS,
     "set_tag_relieved(tag, relieved) -> status: the tag's threads without the GIL ask the "
     "reliever to run the recovery chain"},
    {"forked", py_forked, METH_NOARGS, "Whether this is a fork child of a process that used CUDA."},
    {"relief_loop", py_relief_loop, METH_NOARGS,
     "Serve pressure requests of non-Python threads (run in a daemon thread)."},
    {"stop_relief", py_stop_relief, METH_NOARGS, "Stop the reliever."},
    {"set_relief_timeout", py_set_relief_timeout, METH_O,
     "Seconds a relieved tag's thread waits for the reliever."},
    {"set_tag_limit", py_set_tag_limit, METH_VARARGS,
     "set_tag_limit(device, tag, bytes) -> status"},
    {"set_tag_cached", py_set_tag_cached, METH_VARARGS,
     "set_tag_cached(tag, cached) -> status: may the tag's freed blocks be cached"},
    {"alloc", py_alloc, METH_VARARGS, "alloc(device, size, stream, tag) -> (status, ptr)"},
    {"alloc_cached", py_alloc_cached, METH_VARARGS,
     "alloc_cached(device, size, stream, tag) -> (status, ptr): from the cache only (MISS)"},
    {"alloc_block", py_alloc_block, METH_VARARGS,
     "alloc_block(device, size, stream, tag, stream_object=None) -> (status, Block|None)"},
    {"free", py_free, METH_VARARGS, "free(ptr): never raises"},
    {"free_cached", py_free_cached, METH_VARARGS,
     "free_cached(ptr) -> status: into the cache only (MISS: call free)"},
    {"block_gil_releases", py_block_gil_releases, METH_NOARGS,
     "Frees of Blocks that released the GIL (the cache could not take the block)."},
    {"record_stream", py_record_stream, METH_VARARGS, "record_stream(ptr, stream) -> status"},
    {"lookup", py_lookup, METH_VARARGS, "lookup(ptr) -> (status, size, device, tag)"},
    {"stats", py_stats, METH_VARARGS, "stats(device) -> (status, dict)"},
    {"reset_peak", py_reset_peak, METH_VARARGS, "reset_peak(device, tag=-1) -> status"},
    {"reset_accumulated", py_reset_accumulated, METH_VARARGS,
     "reset_accumulated(device, tag=-1) -> status"},
    {"others", py_others, METH_VARARGS, "others(device) -> (status, bytes)"},
    {"live_records", py_live_records, METH_NOARGS, "Live allocations, every device."},
    {"parked_records", py_parked_records, METH_NOARGS,
     "Freed blocks parked in their thread's slot with their record kept (diagnostics)."},
    {"graph", py_graph, METH_VARARGS, "graph(op, device, id0, id1) -> status"},
    {"graph_begin_on", py_graph_begin_on, METH_VARARGS,
     "graph_begin_on(device, id0, id1, stream, capture) -> status"},
    {"alloc_graph", py_alloc_graph, METH_VARARGS,
     "alloc_graph(device, size, tag, id0, id1, stream=0) -> (status, ptr)"},
    {"set_pressure_callback", py_set_pressure_callback, METH_O, "Set the recovery hook (or None)."},
    {"set_main_thread", py_set_main_thread, METH_O,
     "set_main_thread(ident): the thread that receives Ctrl-C; installs the wait hooks."},
    {"set_wait", py_set_wait, METH_O,
     "set_wait(seconds) -> status: the process's wait for memory (0: none)."},
    {"get_wait", py_get_wait, METH_NOARGS, "The process's wait for memory, seconds."},
    {"set_thread_wait", py_set_thread_wait, METH_VARARGS,
     "set_thread_wait(set, seconds, priority) -> status: this thread's own."},
    {"thread_wait", py_thread_wait, METH_NOARGS, "-> (set, seconds, priority) of this thread."},
    {"last_wait", py_last_wait, METH_NOARGS,
     "-> (seconds, outcome) of this thread's last refused allocation."},
    {"wait_holders", py_wait_holders, METH_VARARGS,
     "wait_holders(device) -> (status, [(thread, bytes, waiting)])"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    "bridge._core",
    "The compiled core of bridge: driver, ledger, allocation.",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

/* The pinned pool's type and functions (pypinned.c); the share's (pyshare.c). */
int bridge_pypinned_add(PyObject *m);
/* What tools see: free memory under the budget, live blocks, history (pyviews.c). */
int bridge_pyviews_add(PyObject *m);
/* Allocation callables for (size, stream) callbacks: RMM's (pycallback.c). */
int bridge_pycallback_add(PyObject *m);
int bridge_pyshare_add(PyObject *m);
/* What the adapters add (their C beside them in adapters/; frameworks.h). */
#define BRIDGE_DECLARE_ADAPTER_(fn) int fn(PyObject *m);
BRIDGE_ADAPTER_MODULES(BRIDGE_DECLARE_ADAPTER_)
#undef BRIDGE_DECLARE_ADAPTER_

static int add_frameworks(PyObject *m)
{
#define BRIDGE_ADD_TAG_(name, n)                                                                   \
    if (PyModule_AddIntConstant(m, "TAG_" #name, n) < 0)                                           \
        return -1;
    BRIDGE_FRAMEWORK_TAGS(BRIDGE_ADD_TAG_)
#undef BRIDGE_ADD_TAG_
#define BRIDGE_ADD_ADAPTER_(fn)                                                                    \
    if (fn(m) < 0)                                                                                 \
        return -1;
    BRIDGE_ADAPTER_MODULES(BRIDGE_ADD_ADAPTER_)
#undef BRIDGE_ADD_ADAPTER_
    return 0;
}
/* Managed memory on the budget (pymanaged.c). */
int bridge_pymanaged_add(PyObject *m);

PyMODINIT_FUNC PyInit__core(void)
{
    PyObject *m = PyModule_Create(&moduledef);
    if (!m)
        return NULL;
    if (bridge_pyblock_add(m) < 0 || add_frameworks(m) < 0 ||
        PyModule_AddIntConstant(m, "MAX_DEVICES", BRIDGE_MAX_DEVICES) < 0 ||
        PyModule_AddIntConstant(m, "CACHE_DEPTH", BRIDGE_CACHE_DEPTH) < 0 ||
        PyModule_AddIntConstant(m, "TAG_OTHER", BRIDGE_TAG_OTHER) < 0 ||
        PyModule_AddIntConstant(m, "RELIEVE_ALL", BRIDGE_RELIEVE_ALL) < 0 ||
        PyModule_AddIntConstant(m, "RELIEVE_CACHES", BRIDGE_RELIEVE_CACHES) < 0 ||
        PyModule_AddIntConstant(m, "RELIEVE_COLLECT", BRIDGE_RELIEVE_COLLECT) < 0 ||
        PyModule_AddIntConstant(m, "WAIT_NONE", BRIDGE_WAIT_NONE) < 0 ||
        PyModule_AddIntConstant(m, "WAIT_OK", BRIDGE_WAIT_OK) < 0 ||
        PyModule_AddIntConstant(m, "WAIT_TIMEOUT", BRIDGE_WAIT_TIMEOUT) < 0 ||
        PyModule_AddIntConstant(m, "WAIT_ALL_WAITING", BRIDGE_WAIT_ALL_WAITING) < 0 ||
        PyModule_AddIntConstant(m, "WAIT_INTERRUPTED", BRIDGE_WAIT_INTERRUPTED) < 0 ||
        PyModule_AddIntConstant(m, "WAIT_CAPTURE", BRIDGE_WAIT_CAPTURE) < 0 ||
        PyModule_AddIntConstant(m, "WAIT_HOPELESS", BRIDGE_WAIT_HOPELESS) < 0 ||
        PyModule_AddIntConstant(m, "NTAGS", BRIDGE_NTAGS) < 0 || bridge_pypinned_add(m) < 0 ||
        bridge_pyviews_add(m) < 0 || bridge_pycallback_add(m) < 0 || bridge_pyshare_add(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (bridge_pymanaged_add(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
