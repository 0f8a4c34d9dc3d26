/* SPDX-License-Identifier: Apache-2.0 */
/* pymod.c: the Python face of the core, module bridge._core.
 *
 * Functions that return status codes (bridge/_errors.py turns them into
 * exceptions), each a row of CORE_FUNCTIONS at the end: those that only
 * parse, call and return are rows of the table kind (one C body serves them
 * all: pybind.h); the rest, written by hand, build results or hold state of
 * their own.  Block, the C-level owner of one allocation, is pyblock.c;
 * the pinned pool's objects pypinned.c; what adapters add to the module
 * (their C beside them in adapters/) is listed by frameworks.h.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "bridge.h"
#include "cache.h"
#include "carve.h"
#include "pybind.h"
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
static int relief_freed;               /* result of generation relief_done */
static int reliever_running;           /* a reliever waits for requests */
static double relief_timeout = 5.0;    /* seconds */
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

static PyObject *py_relief_loop(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a))
{
    /* The reliever's body: serve requests until stop_relief() (never returns
     * otherwise).  Run it in a daemon thread. */
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

static PyObject *py_stop_relief(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a))
{
    pthread_mutex_lock(&relief_mu);
    reliever_running = 0;
    relief_done = relief_asked; /* nobody waits for a request nobody serves */
    pthread_cond_broadcast(&relief_cv);
    pthread_mutex_unlock(&relief_mu);
    Py_RETURN_NONE;
}

/* a float argument (METH_O): -1 with the error set */
static int float_arg(PyObject *arg, double *t)
{
    *t = PyFloat_AsDouble(arg);
    return *t == -1.0 && PyErr_Occurred() ? -1 : 0;
}

static PyObject *py_set_relief_timeout(PyObject *Py_UNUSED(m), PyObject *arg)
{
    double t;
    if (float_arg(arg, &t) < 0)
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

static PyObject *py_set_pressure_callback(PyObject *Py_UNUSED(m), PyObject *cb)
{
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

static PyObject *py_set_main_thread(PyObject *Py_UNUSED(m), PyObject *arg)
{
    unsigned long id = PyLong_AsUnsignedLong(arg);
    if (id == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    main_thread = id;
    static const bridge_wait_hooks h = {wait_release_gil, wait_reacquire_gil, wait_interrupted};
    bridge_set_wait_hooks(&h);
    Py_RETURN_NONE;
}

static PyObject *py_set_wait(PyObject *Py_UNUSED(m), PyObject *arg)
{
    double t;
    return float_arg(arg, &t) < 0 ? NULL : PyLong_FromLong(bridge_set_wait(t));
}

static PyObject *py_thread_wait(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a))
{
    int set, priority;
    double seconds;
    bridge_get_thread_wait(&set, &seconds, &priority);
    return Py_BuildValue("Ndi", PyBool_FromLong(set), seconds, priority);
}

static PyObject *py_last_wait(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a))
{
    double seconds;
    int outcome;
    bridge_last_wait(&seconds, &outcome);
    return Py_BuildValue("di", seconds, outcome);
}

static PyObject *py_wait_holders(PyObject *Py_UNUSED(m), PyObject *args)
{
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
static PyObject *py_device_info(PyObject *Py_UNUSED(m), PyObject *args)
{
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

static PyObject *py_last_driver_error(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a))
{
    int code = bridge_last_driver_error();
    return Py_BuildValue("is", code, code ? bridge_driver_error_name(code) : "CUDA_SUCCESS");
}

/* ---- blocks shared with other processes (ipc.c) ---- */
static PyObject *py_ipc_export(PyObject *Py_UNUSED(m), PyObject *args)
{
    unsigned long long ptr;
    if (!PyArg_ParseTuple(args, "K", &ptr))
        return NULL;
    unsigned char h[BRIDGE_IPC_HANDLE_SIZE];
    uint64_t offset = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bridge_ipc_export((void *)(uintptr_t)ptr, h, &offset);
    Py_END_ALLOW_THREADS
    if (rc != BRIDGE_OK)
        return Py_BuildValue("iOK", rc, Py_None, 0ull);
    return Py_BuildValue("iy#K", rc, (const char *)h, (Py_ssize_t)sizeof h,
                         (unsigned long long)offset);
}

static PyObject *py_ipc_import(PyObject *Py_UNUSED(m), PyObject *args)
{
    Py_buffer h;
    int dev;
    if (!PyArg_ParseTuple(args, "y*i", &h, &dev))
        return NULL;
    void *out = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bridge_ipc_import((const unsigned char *)h.buf, (size_t)h.len, dev, &out);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&h);
    return Py_BuildValue("iK", rc, (unsigned long long)(uintptr_t)out);
}

static PyObject *py_ipc_counts(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(noargs))
{
    return Py_BuildValue("KKK", (unsigned long long)bridge_ipc_holds(),
                         (unsigned long long)bridge_ipc_imported(),
                         (unsigned long long)bridge_ipc_refused());
}

static PyObject *py_capture(PyObject *Py_UNUSED(m), PyObject *args)
{
    /* capture(begin, device) -> status: a capture the bridge must know of */
    int begin, dev;
    if (!PyArg_ParseTuple(args, "pi", &begin, &dev))
        return NULL;
    BRIDGE_RETURN_STATUS_NOGIL(begin ? bridge_capture_begin(dev) : bridge_capture_end(dev));
}

static PyObject *py_capture_stream(PyObject *Py_UNUSED(m), PyObject *args)
{
    /* capture_stream(begin, device, stream_or_pool) -> (status, pool): a CuPy
     * capture with a graph pool of its own (begin: the stream's handle, end:
     * the pool begin gave) */
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

static PyObject *py_graph_collect(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a))
{
    /* graph_collect() -> [(device, pool)]: dead graphs' pools released now,
     * and every pool released by a collect since the last call */
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

static PyObject *py_set_tag_relieved(PyObject *Py_UNUSED(m), PyObject *args)
{
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

/* alloc, alloc_cached, alloc_block: (device, size, stream, tag[, stream object]) */
typedef struct {
    int dev, tag;
    size_t size;
    void *stream;
} alloc_args;

static int size_arg(Py_ssize_t n, size_t *size)
{
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "size must be >= 0, got %zd", n);
        return -1;
    }
    *size = (size_t)n;
    return 0;
}

/* stream_obj NULL: no fifth argument */
static int parse_alloc(PyObject *args, alloc_args *a, PyObject **stream_obj)
{
    Py_ssize_t size;
    unsigned long long stream;
    if (!PyArg_ParseTuple(args, stream_obj ? "inKi|O" : "inKi", &a->dev, &size, &stream, &a->tag,
                          stream_obj))
        return -1;
    a->stream = (void *)(uintptr_t)stream;
    return size_arg(size, &a->size);
}

/* bridge_alloc without the GIL: its status, or -1 with KeyboardInterrupt set
 * when its wait gave up for Ctrl-C */
static int alloc_nogil(const alloc_args *a, void **p)
{
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bridge_alloc(a->dev, a->size, a->stream, a->tag, p);
    Py_END_ALLOW_THREADS
    if (rc != BRIDGE_OK && raise_if_interrupted() < 0)
        return -1;
    return rc;
}

static PyObject *status_and_ptr(int rc, void *p)
{
    return Py_BuildValue("iK", rc, (unsigned long long)(uintptr_t)p);
}

static PyObject *py_alloc(PyObject *Py_UNUSED(m), PyObject *args)
{
    alloc_args a;
    void *p = NULL;
    if (parse_alloc(args, &a, NULL) < 0)
        return NULL;
    int rc = alloc_nogil(&a, &p);
    return rc < 0 ? NULL : status_and_ptr(rc, p);
}

static PyObject *py_alloc_cached(PyObject *Py_UNUSED(m), PyObject *args)
{
    alloc_args a;
    void *p = NULL;
    if (parse_alloc(args, &a, NULL) < 0)
        return NULL;
    /* with the GIL held: the cache only, nothing that waits */
    int rc = bridge_alloc_cached(a.dev, a.size, a.stream, a.tag, &p);
    return status_and_ptr(rc, p);
}

static PyObject *py_alloc_block(PyObject *Py_UNUSED(m), PyObject *args)
{
    alloc_args a;
    void *p = NULL;
    PyObject *stream_obj = Py_None;
    if (parse_alloc(args, &a, &stream_obj) < 0)
        return NULL;
    int rc = alloc_nogil(&a, &p);
    if (rc < 0)
        return NULL;
    if (rc != BRIDGE_OK)
        return Py_BuildValue("iO", rc, Py_None);
    PyObject *b = block_new(p, a.size, a.dev, stream_obj == Py_None ? NULL : stream_obj);
    if (!b)
        return NULL;
    return Py_BuildValue("iN", rc, b);
}

static PyObject *py_block_gil_releases(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a))
{
    return PyLong_FromUnsignedLongLong(block_gil_releases);
}

static PyObject *py_lookup(PyObject *Py_UNUSED(m), PyObject *args)
{
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

/* stats(device) -> (status, dict) */
static PyObject *stats_dict(int rc, const bridge_stats *s)
{
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
#define PUT(k)                \
    if (put(d, #k, s->k) < 0) \
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
    if (put_float(d, "cache_fraction", s->cache_fraction) < 0 ||
        put_float(d, "cache_large_fraction", s->cache_large_fraction) < 0)
        goto fail;
    {
        PyObject *tags = PyList_New(BRIDGE_NTAGS);
        if (!tags)
            goto fail;
        for (int i = 0; i < BRIDGE_NTAGS; i++) {
            const bridge_tag_stats *t = &s->tag[i];
            PyObject *td = Py_BuildValue(
                "{sKsKsKsKsKsKsKsKsKsKsK}", "current", t->current, "peak", t->peak, "allocated",
                t->allocated, "freed", t->freed, "num_allocs", t->num_allocs, "num_frees",
                t->num_frees, "num_ooms", t->num_ooms, "limit", t->limit, "count", t->count,
                "count_peak", t->count_peak, "reserved_peak", t->reserved_peak);
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
BRIDGE_BIND_GETTER(stats_getter, bridge_stats, bridge_get_stats, stats_dict);

static PyObject *py_graph(PyObject *Py_UNUSED(m), PyObject *args)
{
    /* graph(op, device, id0, id1): op 0 begin, 1 end, 2 release (tests) */
    int op, dev;
    unsigned long long a, b;
    if (!PyArg_ParseTuple(args, "iiKK", &op, &dev, &a, &b))
        return NULL;
    BRIDGE_RETURN_STATUS_NOGIL(op == 0   ? bridge_graph_begin(dev, a, b)
                               : op == 1 ? bridge_graph_end(dev, a, b)
                                         : bridge_graph_release(dev, a, b));
}

static PyObject *py_alloc_graph(PyObject *Py_UNUSED(m), PyObject *args)
{
    int dev, tag;
    Py_ssize_t n;
    size_t size;
    unsigned long long a, b, stream = 0;
    if (!PyArg_ParseTuple(args, "iniKK|K", &dev, &n, &tag, &a, &b, &stream) ||
        size_arg(n, &size) < 0)
        return NULL;
    void *p = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bridge_alloc_graph(dev, size, tag, a, b, (void *)(uintptr_t)stream, &p);
    Py_END_ALLOW_THREADS
    return status_and_ptr(rc, p);
}

/* ---- the module's functions ---- */
/* Every function of the module, one row each (pybind.h): X(python name, kind, C function,
 * format, flags, docstring, defaults) for the rows of the table, H(python name, calling
 * convention, docstring) for those written by hand above, py_<name>. */
#define CORE_FUNCTIONS(X, H)                                                                       \
    /* the driver and the devices */                                                               \
    X(init, s, bridge_init, "|z", BIND_NOGIL,                                                      \
      "init(path=None) -> status: load the driver.", [0].s = NULL)                                 \
    X(initialized, v, bridge_initialized, BIND_NO_ARGS, BIND_BOOL,                                 \
      "Whether the driver is loaded.", BIND_NO_DEFAULTS)                                           \
    X(device_count, out_i, bridge_device_count, BIND_NO_ARGS, BIND_PLAIN, "-> (status, count)",    \
      BIND_NO_DEFAULTS)                                                                            \
    X(driver_version, out_i, bridge_driver_version, BIND_NO_ARGS, BIND_PLAIN,                      \
      "-> (status, version)", BIND_NO_DEFAULTS)                                                    \
    X(current_device, out_i, bridge_current_device, BIND_NO_ARGS, BIND_PLAIN,                      \
      "-> (status, device of the current context)", BIND_NO_DEFAULTS)                              \
    X(loaded_library, str, bridge_loaded_library, BIND_NO_ARGS, BIND_PLAIN,                        \
      "The driver library in use.", BIND_NO_DEFAULTS)                                              \
    X(load_error, str, bridge_load_error, BIND_NO_ARGS, BIND_PLAIN,                                \
      "Why loading the driver failed.", BIND_NO_DEFAULTS)                                          \
    H(device_info, VARARGS,                                                                        \
      "device_info(device) -> (status, name, cc_major, cc_minor, total_bytes)")                    \
    H(last_driver_error, NOARGS, "-> (code, name)")                                                \
    X(setup, ik, bridge_device_setup, "iK", BIND_NOGIL,                                            \
      "setup(device, release_threshold) -> status", BIND_NO_DEFAULTS)                              \
    X(ready, i, bridge_device_ready, "i", BIND_BOOL, "ready(device) -> bool", BIND_NO_DEFAULTS)    \
    X(reassert, i, bridge_reassert, "i", BIND_NOGIL, "reassert(device) -> status",                 \
      BIND_NO_DEFAULTS)                                                                            \
    X(pool_attribute, ii_out_k, bridge_pool_attribute, "ii", BIND_PLAIN,                           \
      "pool_attribute(device, attr) -> (status, value)", BIND_NO_DEFAULTS)                         \
    X(trim, ik, bridge_trim, "i|K", BIND_NOGIL, "trim(device, keep=0) -> status", [1].k = 0)       \
    X(grant_peer_access, i_out_i, bridge_grant_peer_access, "i", BIND_PLAIN,                       \
      "-> (status, peers granted)", BIND_NO_DEFAULTS)                                              \
    X(set_limit, ik, bridge_set_limit, "iK", BIND_PLAIN, "set_limit(device, bytes) -> status",     \
      BIND_NO_DEFAULTS)                                                                            \
    X(forked, v, bridge_forked, BIND_NO_ARGS, BIND_BOOL,                                           \
      "Whether this is a fork child of a process that used CUDA.", BIND_NO_DEFAULTS)               \
    /* blocks shared with other processes */                                                       \
    X(ipc_enable, i, bridge_ipc_enable, "i", BIND_NOGIL,                                           \
      "ipc_enable(device) -> status: allocate from a pool with POSIX fd export from now on",       \
      BIND_NO_DEFAULTS)                                                                            \
    X(ipc_disable, i, bridge_ipc_disable, "i", BIND_NOGIL,                                         \
      "ipc_disable(device) -> status: back to the default pool, the exportable one put away",      \
      BIND_NO_DEFAULTS)                                                                            \
    X(ipc_enabled, i, bridge_ipc_enabled, "i", BIND_BOOL, "ipc_enabled(device) -> bool",           \
      BIND_NO_DEFAULTS)                                                                            \
    H(ipc_export, VARARGS, "ipc_export(ptr) -> (status, handle bytes or None, offset)")            \
    H(ipc_import, VARARGS, "ipc_import(handle, device) -> (status, ptr)")                          \
    X(ipc_release, void_p, bridge_ipc_release, "K", BIND_NOGIL,                                    \
      "ipc_release(ptr): let go of an import", BIND_NO_DEFAULTS)                                   \
    X(ipc_error, str, bridge_ipc_error, BIND_NO_ARGS, BIND_PLAIN,                                  \
      "why this thread's last ipc_* call failed", BIND_NO_DEFAULTS)                                \
    H(ipc_counts, NOARGS,                                                                          \
      "ipc_counts() -> (holds others have here, imports held, connections refused)")               \
    /* the cache */                                                                                \
    X(set_cache, ikk, bridge_set_cache, "iK|K", BIND_NOGIL,                                        \
      "set_cache(device, limit, max_block=256MiB) -> status: the hard cap of cached bytes "        \
      "(0: no cache; emptied) and the largest cached block",                                       \
      [2].k = BRIDGE_CACHE_MAX_BLOCK)                                                              \
    X(set_cache_tiers, ikk, bridge_set_cache_tiers, "i|KK", BIND_PLAIN,                            \
      "set_cache_tiers(device, small_max=1MiB, large_cap=64MiB) -> status: blocks above "          \
      "small_max have their own least-recently-cached order under a fixed cap, "                   \
      "cached_large <= min(limit, large_cap); each tier evicts only its own blocks",               \
      [1].k = BRIDGE_CACHE_SMALL_MAX, [2].k = BRIDGE_CACHE_LARGE_CAP)                              \
    X(set_cache_large_fraction, id, bridge_set_cache_large_fraction, "id", BIND_PLAIN,             \
      "set_cache_large_fraction(device, fraction) -> status: the large tier's cap is also at "     \
      "most this share of the bytes the frameworks hold, but never less than the block being "     \
      "cached: cached_large <= min(limit, large_cap, max(live * fraction, block)) (default "       \
      "1/8; 0: the fixed cap alone)",                                                              \
      BIND_NO_DEFAULTS)                                                                            \
    X(set_cache_fraction, idk, bridge_set_cache_fraction, "id|K", BIND_PLAIN,                      \
      "set_cache_fraction(device, fraction, floor=64MiB) -> status: the cache's cap follows "      \
      "the bytes the frameworks hold, cached <= min(limit, max(floor, live * fraction)); "         \
      "past it the least recently cached blocks go back to the pool (default 1/16, 64 MiB); "      \
      "blocks up to the small tier's largest (set_cache_tiers)",                                   \
      [2].k = BRIDGE_CACHE_FLOOR)                                                                  \
    X(set_cache_segments, ii, bridge_set_cache_segments, "i|p", BIND_PLAIN,                        \
      "set_cache_segments(device, on=True) -> status: the cache's requests carved from pool "      \
      "segments, every emptied one kept under the release rule (off: carving off)",                \
      [1].i = 1)                                                                                   \
    X(set_cache_segments_keep, ik, bridge_set_cache_segments_keep, "iK", BIND_PLAIN,               \
      "set_cache_segments_keep(device, keep) -> status: the bytes of empty segments kept in "      \
      "each class (the rest go back to the pool, the first emptied first)",                        \
      BIND_NO_DEFAULTS)                                                                            \
    X(set_cache_thread_slots, ii, bridge_set_cache_thread_slots, "ip", BIND_PLAIN,                 \
      "set_cache_thread_slots(device, on) -> status: each thread's newest freed block waits "      \
      "in a slot of its own, taken back by that thread without a lock (default on)",               \
      BIND_NO_DEFAULTS)                                                                            \
    X(set_cache_carve, idkkkk, bridge_set_cache_carve, "i|dKKKK", BIND_PLAIN,                      \
      "set_cache_carve(device, share=1/8, min=32 MiB, max=256 MiB, keep=0, small_keep=0) -> "      \
      "status: carve the cache's requests from pool chunks (max 0: off)",                          \
      [1].d = BRIDGE_CARVE_SHARE_Q16 / 65536.0, [2].k = BRIDGE_CARVE_MIN,                          \
      [3].k = BRIDGE_CARVE_MAX, [4].k = 0, [5].k = 0)                                              \
    /* streams */                                                                                  \
    X(register_stream, p, bridge_register_stream, "K", BIND_PLAIN,                                 \
      "register_stream(handle) -> status: blocks freed on it may be cached", BIND_NO_DEFAULTS)     \
    X(forget_stream, p, bridge_forget_stream, "K", BIND_PLAIN,                                     \
      "forget_stream(handle) -> status: no longer cache blocks freed on it", BIND_NO_DEFAULTS)     \
    X(record_stream, pp, bridge_record_stream, "KK", BIND_PLAIN,                                   \
      "record_stream(ptr, stream) -> status", BIND_NO_DEFAULTS)                                    \
    X(set_tag_holds_streams, ii, bridge_set_tag_holds_streams, "ip", BIND_PLAIN,                   \
      "set_tag_holds_streams(tag, holds) -> status: the tag keeps its streams alive until frees",  \
      BIND_NO_DEFAULTS)                                                                            \
    /* captures and graphs */                                                                      \
    H(capture, VARARGS, "capture(begin, device) -> status: a stream capture starts or ends")       \
    H(capture_stream, VARARGS,                                                                     \
      "capture_stream(begin, device, stream_or_pool) -> (status, pool): a stream capture's pool")  \
    X(bind_graph, ikp, bridge_capture_bind_graph, "iKK", BIND_NOGIL,                               \
      "bind_graph(device, pool, stream) -> status: the captured graph's end releases the pool",    \
      BIND_NO_DEFAULTS)                                                                            \
    H(graph_collect, NOARGS,                                                                       \
      "graph_collect() -> [(device, pool)]: capture pools released since the last call")           \
    H(graph, VARARGS, "graph(op, device, id0, id1) -> status")                                     \
    X(graph_begin_on, ikkpi, bridge_graph_begin_on, "iKKKp", BIND_NOGIL,                           \
      "graph_begin_on(device, id0, id1, stream, capture) -> status", BIND_NO_DEFAULTS)             \
    H(alloc_graph, VARARGS, "alloc_graph(device, size, tag, id0, id1, stream=0) -> (status, ptr)") \
    /* tags */                                                                                     \
    X(set_tag_limit, iik, bridge_set_tag_limit, "iiK", BIND_PLAIN,                                 \
      "set_tag_limit(device, tag, bytes) -> status", BIND_NO_DEFAULTS)                             \
    X(set_tag_cached, ii, bridge_set_tag_cached, "ip", BIND_PLAIN,                                 \
      "set_tag_cached(tag, cached) -> status: may the tag's freed blocks be cached",               \
      BIND_NO_DEFAULTS)                                                                            \
    H(set_tag_relieved, VARARGS,                                                                   \
      "set_tag_relieved(tag, relieved) -> status: the tag's threads without the GIL ask the "      \
      "reliever to run the recovery chain")                                                        \
    /* allocation */                                                                               \
    H(alloc, VARARGS, "alloc(device, size, stream, tag) -> (status, ptr)")                         \
    H(alloc_cached, VARARGS,                                                                       \
      "alloc_cached(device, size, stream, tag) -> (status, ptr): from the cache only (MISS)")      \
    H(alloc_block, VARARGS,                                                                        \
      "alloc_block(device, size, stream, tag, stream_object=None) -> (status, Block|None)")        \
    H(block_gil_releases, NOARGS,                                                                  \
      "Frees of Blocks that released the GIL (the cache could not take the block).")               \
    X(free, void_p, bridge_free, "K", BIND_NOGIL, "free(ptr): never raises", BIND_NO_DEFAULTS)     \
    X(free_cached, p, bridge_free_cached, "K", BIND_PLAIN,                                         \
      "free_cached(ptr) -> status: into the cache only (MISS: call free)", BIND_NO_DEFAULTS)       \
    H(lookup, VARARGS, "lookup(ptr) -> (status, size, device, tag)")                               \
    /* figures */                                                                                  \
    X(stats, get, &stats_getter, "i", BIND_NOGIL, "stats(device) -> (status, dict)",               \
      BIND_NO_DEFAULTS)                                                                            \
    X(others, i_out_k, bridge_others, "i", BIND_PLAIN, "others(device) -> (status, bytes)",        \
      BIND_NO_DEFAULTS)                                                                            \
    X(reset_peak, ii, bridge_reset_peak, "i|i", BIND_PLAIN,                                        \
      "reset_peak(device, tag=-1) -> status", [1].i = -1)                                          \
    X(reset_accumulated, ii, bridge_reset_accumulated, "i|i", BIND_PLAIN,                          \
      "reset_accumulated(device, tag=-1) -> status", [1].i = -1)                                   \
    X(live_records, u64, bridge_live_records, BIND_NO_ARGS, BIND_PLAIN,                            \
      "Live allocations, every device.", BIND_NO_DEFAULTS)                                         \
    X(parked_records, u64, bridge_parked_records, BIND_NO_ARGS, BIND_PLAIN,                        \
      "Freed blocks parked in their thread's slot with their record kept (diagnostics).",          \
      BIND_NO_DEFAULTS)                                                                            \
    /* the pressure hook and its reliever */                                                       \
    H(set_pressure_callback, O, "Set the recovery hook (or None).")                                \
    H(relief_loop, NOARGS,                                                                         \
      "Serve pressure requests of non-Python threads (run in a daemon thread).")                   \
    H(stop_relief, NOARGS, "Stop the reliever.")                                                   \
    H(set_relief_timeout, O, "Seconds a relieved tag's thread waits for the reliever.")            \
    /* waiting for memory */                                                                       \
    H(set_main_thread, O,                                                                          \
      "set_main_thread(ident): the thread that receives Ctrl-C; installs the wait hooks.")         \
    H(set_wait, O, "set_wait(seconds) -> status: the process's wait for memory (0: none).")        \
    X(get_wait, dbl, bridge_get_wait, BIND_NO_ARGS, BIND_PLAIN,                                    \
      "The process's wait for memory, seconds.", BIND_NO_DEFAULTS)                                 \
    X(set_thread_wait, idi, bridge_set_thread_wait, "pdi", BIND_PLAIN,                             \
      "set_thread_wait(set, seconds, priority) -> status: this thread's own.", BIND_NO_DEFAULTS)   \
    H(thread_wait, NOARGS, "-> (set, seconds, priority) of this thread.")                          \
    H(last_wait, NOARGS, "-> (seconds, outcome) of this thread's last refused allocation.")        \
    H(wait_holders, VARARGS, "wait_holders(device) -> (status, [(thread, bytes, waiting)])")

BRIDGE_METHOD_TABLE(methods, CORE_FUNCTIONS);

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
#define BRIDGE_ADD_TAG_(name, n)                         \
    if (PyModule_AddIntConstant(m, "TAG_" #name, n) < 0) \
        return -1;
    BRIDGE_FRAMEWORK_TAGS(BRIDGE_ADD_TAG_)
#undef BRIDGE_ADD_TAG_
#define BRIDGE_ADD_ADAPTER_(fn) \
    if (fn(m) < 0)              \
        return -1;
    BRIDGE_ADAPTER_MODULES(BRIDGE_ADD_ADAPTER_)
#undef BRIDGE_ADD_ADAPTER_
    return 0;
}
/* Managed memory on the budget (pymanaged.c). */
int bridge_pymanaged_add(PyObject *m);

/* The core's constants, under their names without BRIDGE_ (pybind.h: BRIDGE_BIND_CONSTANT). */
#define CORE_CONSTANTS(C)                                                                      \
    C(MAX_DEVICES), C(CACHE_DEPTH), C(TAG_OTHER), C(NTAGS), C(RELIEVE_ALL), C(RELIEVE_CACHES), \
        C(RELIEVE_COLLECT), C(WAIT_NONE), C(WAIT_OK), C(WAIT_TIMEOUT), C(WAIT_ALL_WAITING),    \
        C(WAIT_INTERRUPTED), C(WAIT_CAPTURE), C(WAIT_HOPELESS)

static int add_core(PyObject *m)
{
    static const bridge_bind_constant constants[] = {
        CORE_CONSTANTS(BRIDGE_BIND_CONSTANT),
        {NULL, 0},
    };
    if (bridge_pyblock_add(m) < 0 || add_frameworks(m) < 0 ||
        bridge_bind_add(m, NULL, constants) < 0)
        return -1;
    if (bridge_pypinned_add(m) < 0 || bridge_pyviews_add(m) < 0 || bridge_pycallback_add(m) < 0 ||
        bridge_pyshare_add(m) < 0 || bridge_pymanaged_add(m) < 0)
        return -1;
    return 0;
}

PyMODINIT_FUNC PyInit__core(void)
{
    PyObject *m = PyModule_Create(&moduledef);
    if (m && add_core(m) < 0)
        Py_CLEAR(m);
    return m;
}
