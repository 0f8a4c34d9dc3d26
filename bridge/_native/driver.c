/* SPDX-License-Identifier: Apache-2.0 */
/* driver.c: find and load the CUDA driver at run time.
 *
 * The library is libcuda.so.1 unless `path` (or BRIDGE_CUDA_LIBRARY, read by
 * the Python layer) names another: the tests point it at a stand-in driver
 * built from tests/standin/standin_cuda.c.
 */
#include "bridge.h"
#include "driver.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bridge_driver bridge_drv;

/* ---- state ---- */
static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_int init_done;               /* 1 once bridge_drv is complete */
static atomic_int init_busy;               /* 1 while a thread loads it (init_lock held) */
static int init_status = BRIDGE_E_NOTINIT; /* result of the first full init */
static char loaded_path[512];              /* the library that was loaded */
static atomic_int last_error;              /* last failing CUresult seen */
static char load_error[512];               /* why the last bridge_init failed */

CUresult bridge_note_driver_error(CUresult r)
{
    if (r != CUDA_SUCCESS)
        atomic_store_explicit(&last_error, r, memory_order_relaxed);
    return r;
}

int bridge_last_driver_error(void)
{
    return atomic_load_explicit(&last_error, memory_order_relaxed);
}

const char *bridge_driver_error_name(int code)
{
    const char *s = NULL;
    if (atomic_load(&init_done) && bridge_drv.cuGetErrorName &&
        bridge_drv.cuGetErrorName(code, &s) == CUDA_SUCCESS && s)
        return s;
    return "CUDA_ERROR_UNKNOWN";
}

const char *bridge_load_error(void)
{
    return load_error;
}

const char *bridge_loaded_library(void)
{
    return atomic_load(&init_done) ? loaded_path : "";
}

/* ---- loading ---- */
/* *missing: the first entry point the library lacks. */
static int load_entries(void *lib, const char **missing)
{
#define BRIDGE_LOAD_ENTRY(name, args)                 \
    *(void **)(&bridge_drv.name) = dlsym(lib, #name); \
    if (!bridge_drv.name) {                           \
        *missing = #name;                             \
        return BRIDGE_E_NODRIVER;                     \
    }
    BRIDGE_DRIVER_ENTRIES(BRIDGE_LOAD_ENTRY)
#undef BRIDGE_LOAD_ENTRY
    return BRIDGE_OK;
}

/* Why a library without one of the entry points cannot be used, and what to
 * do: its driver is older than the newest entry point the table names
 * (cuDeviceGetUuid_v2, CUDA 11.4).  The version is asked of the library
 * itself (cuDriverGetVersion exists in every driver since CUDA 2.2). */
static void note_missing_entry(void *lib, const char *name, const char *missing)
{
    CUresult (*get_version)(int *) = NULL;
    *(void **)(&get_version) = dlsym(lib, "cuDriverGetVersion");
    int v = 0;
    char version[64] = "";
    if (get_version && get_version(&v) == CUDA_SUCCESS && v > 0)
        snprintf(version, sizeof version, " (a CUDA %d.%d driver)", v / 1000, v % 1000 / 10);
    snprintf(load_error, sizeof load_error,
             "%s%s lacks the entry point %s: the driver is too old for the bridge; update the "
             "NVIDIA driver to one for CUDA 12 or newer (`nvidia-smi` shows its CUDA version)",
             name, version, missing);
}

/* Why cuInit failed, and what to do where the cause is known. */
static void note_init_error(CUresult r)
{
    const char *en = NULL;
    if (bridge_drv.cuGetErrorName(r, &en) != CUDA_SUCCESS || !en)
        en = "unknown error";
    /* The driver answers so when no GPU is visible to the process: none in
     * the machine or container, or CUDA_VISIBLE_DEVICES hiding every one
     * ("", "-1", or ordinals or UUIDs that do not exist). */
    const char *visible = getenv("CUDA_VISIBLE_DEVICES");
    if (r == CUDA_ERROR_NO_DEVICE && visible)
        snprintf(load_error, sizeof load_error,
                 "cuInit failed: %s (code %d): CUDA_VISIBLE_DEVICES=\"%s\" leaves no GPU visible; "
                 "unset it or name GPUs that `nvidia-smi -L` lists",
                 en, r, visible);
    else if (r == CUDA_ERROR_NO_DEVICE)
        snprintf(load_error, sizeof load_error,
                 "cuInit failed: %s (code %d): the driver sees no GPU in this machine or "
                 "container",
                 en, r);
    else
        snprintf(load_error, sizeof load_error, "cuInit failed: %s (code %d)", en, r);
}

/* ---- fork ---- */
static void after_fork_in_child(void);
static void register_atfork(void)
{
    pthread_atfork(NULL, NULL, after_fork_in_child);
}

/* CUDA cannot be used in a child forked after the driver was initialized,
 * and the child owns none of the parent's blocks: the child refuses every
 * allocation with BRIDGE_E_FORKED, and frees of the parent's blocks are
 * ignored.  This handler only marks the child; the ledger and the pinned
 * pool register their own (after this one, so they run after it), which
 * forget their tables without taking a lock (a thread that held one is
 * gone). */
static atomic_int forked;

static void after_fork_in_child(void)
{
    /* The load lock may be held by a thread the child does not have. */
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    init_lock = fresh;
    /* A load under way in another thread at the fork (cuInit takes seconds
     * on a machine of many GPUs) may have started the driver: the child
     * refuses as after a finished one. */
    if (!atomic_load(&init_done) && !atomic_load(&init_busy))
        return; /* nothing was set up: the child may start the driver itself */
    atomic_store(&init_busy, 0);
    atomic_store(&forked, 1);
    atomic_store(&init_done, 0);
    init_status = BRIDGE_E_FORKED;
    snprintf(load_error, sizeof load_error,
             "this process was forked from one that had started CUDA; CUDA cannot be used in a "
             "forked child");
}

int bridge_forked(void)
{
    return atomic_load_explicit(&forked, memory_order_relaxed);
}

int bridge_init(const char *path)
{
    if (atomic_load(&init_done) || atomic_load(&forked))
        return init_status;
    static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
    pthread_once(&atfork_once, register_atfork);
    pthread_mutex_lock(&init_lock);
    atomic_store(&init_busy, 1);
    if (!atomic_load(&init_done)) {
        const char *name = (path && path[0]) ? path : "libcuda.so.1";
        void *lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
        int rc = BRIDGE_E_NODRIVER;
        const char *missing = "";
        if (!lib) {
            const char *e = dlerror();
            snprintf(load_error, sizeof load_error,
                     "%s: no NVIDIA driver here; run on a machine with an NVIDIA GPU and its "
                     "driver, or a container with the GPU mounted",
                     e ? e : "dlopen failed");
        } else if ((rc = load_entries(lib, &missing)) != BRIDGE_OK) {
            note_missing_entry(lib, name, missing);
        } else {
            CUresult r = bridge_drv.cuInit(0);
            if (r != CUDA_SUCCESS) {
                bridge_note_driver_error(r);
                note_init_error(r);
                rc = BRIDGE_E_NODRIVER;
            }
        }
        if (rc == BRIDGE_OK) {
            snprintf(loaded_path, sizeof loaded_path, "%s", name);
            init_status = BRIDGE_OK;
            atomic_store(&init_done, 1);
        } else {
            /* Leave nothing half-loaded: a later call may try again. */
            memset(&bridge_drv, 0, sizeof bridge_drv);
            if (lib)
                dlclose(lib);
            init_status = rc;
        }
    }
    int rc = init_status;
    atomic_store(&init_busy, 0);
    pthread_mutex_unlock(&init_lock);
    return rc;
}

int bridge_initialized(void)
{
    return atomic_load(&init_done);
}

int bridge_device_count(int *count)
{
    *count = 0;
    if (!atomic_load(&init_done))
        return BRIDGE_E_NOTINIT;
    CUresult r = bridge_drv.cuDeviceGetCount(count);
    if (r == CUDA_ERROR_NO_DEVICE) {
        *count = 0;
        return BRIDGE_OK;
    }
    return r == CUDA_SUCCESS ? BRIDGE_OK : (bridge_note_driver_error(r), BRIDGE_E_DRIVER);
}

int bridge_device_info(int device, char *name, int len, int *cc_major, int *cc_minor,
                       uint64_t *total)
{
    if (len > 0)
        name[0] = '\0';
    *cc_major = *cc_minor = 0;
    *total = 0;
    if (!atomic_load(&init_done))
        return BRIDGE_E_NOTINIT;
    CUdevice dev = 0;
    CUresult r = bridge_drv.cuDeviceGet(&dev, device);
    if (r == CUDA_SUCCESS)
        r = bridge_drv.cuDeviceGetName(name, len, dev);
    if (r == CUDA_SUCCESS)
        r = bridge_drv.cuDeviceGetAttribute(cc_major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                            dev);
    if (r == CUDA_SUCCESS)
        r = bridge_drv.cuDeviceGetAttribute(cc_minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                                            dev);
    size_t bytes = 0;
    if (r == CUDA_SUCCESS)
        r = bridge_drv.cuDeviceTotalMem_v2(&bytes, dev);
    *total = bytes;
    if (r == CUDA_ERROR_INVALID_DEVICE)
        return BRIDGE_E_DEVICE;
    return r == CUDA_SUCCESS ? BRIDGE_OK : (bridge_note_driver_error(r), BRIDGE_E_DRIVER);
}

int bridge_driver_version(int *version)
{
    *version = 0;
    if (!atomic_load(&init_done))
        return BRIDGE_E_NOTINIT;
    CUresult r = bridge_drv.cuDriverGetVersion(version);
    return r == CUDA_SUCCESS ? BRIDGE_OK : (bridge_note_driver_error(r), BRIDGE_E_DRIVER);
}

int bridge_current_device(int *device)
{
    *device = 0;
    if (!atomic_load(&init_done))
        return BRIDGE_E_NOTINIT;
    CUcontext ctx = NULL;
    if (bridge_drv.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx)
        return BRIDGE_OK;
    CUdevice dev = 0;
    if (bridge_drv.cuCtxGetDevice(&dev) == CUDA_SUCCESS)
        *device = dev;
    return BRIDGE_OK;
}
