/* SPDX-License-Identifier: Apache-2.0 */
/* device.c: the core's ground floor: the devices' state, the calling
 * thread's context and capture mode, and the announcements of the core's
 * synchronizations and of captures (device.h).  It calls the driver only. */
#include "device.h"

#include <time.h>

device_state bridge_devices[BRIDGE_MAX_DEVICES];

/* ---- the current context ---- */
void ctx_enter(device_state *d, ctx_guard *g)
{
    g->prev = NULL;
    g->changed = 0;
    CUresult r = bridge_drv.cuCtxGetCurrent(&g->prev);
    if (r != CUDA_SUCCESS || g->prev != d->ctx) {
        bridge_drv.cuCtxSetCurrent(d->ctx);
        /* A thread with no current context on device 0 keeps device 0's
         * primary context: that is the runtime's device for such a thread,
         * and its first runtime call would make the same context current.
         * Put back "none", it paid the runtime's context-less path on every
         * call after (cudaGetDevice about 1.15 us instead of 50 ns on an
         * H200: a CuPy allocation asks it twice) until a runtime call that
         * binds one, which CuPy on the bridge may never make. */
        g->changed = !(r == CUDA_SUCCESS && !g->prev && d == &bridge_devices[0]);
    }
}

void ctx_exit(ctx_guard *g)
{
    /* "None" is put back on any other device: a thread left with its
     * context would send its next runtime call (torch.empty(device="cuda"))
     * to that device, not to device 0. */
    if (g->changed)
        bridge_drv.cuCtxSetCurrent(g->prev);
}

/* Always, not only while a capture the core knows of runs: another thread's
 * capture in global mode (torch.cuda.graph's default, with torch's own
 * allocator, or XLA's) is invisible here, and a pool allocation or free in
 * global mode then fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (seen on
 * an H200: a CuPy allocation on a side stream during a torch capture). */
int capture_mode_relax(void)
{
    int mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    bridge_drv.cuThreadExchangeStreamCaptureMode(&mode);
    return mode;
}

void capture_mode_exit(int mode)
{
    if (mode >= 0)
        bridge_drv.cuThreadExchangeStreamCaptureMode(&mode);
}

/* ---- synchronizations and captures (ledger.h) ---- */
int sync_enter(device_state *d)
{
    atomic_fetch_add(&d->syncs, 1);
    if (!atomic_load(&d->captures_active))
        return 1;
    atomic_fetch_sub(&d->syncs, 1);
    return 0;
}

void sync_exit(device_state *d)
{
    atomic_fetch_sub(&d->syncs, 1);
}

void capture_announce(device_state *d)
{
    atomic_fetch_add(&d->captures_active, 1);
    /* a synchronization that did not see the capture is under way: it ends
     * before the capture begins (rare: a trim or a refusal's retry) */
    struct timespec ts = {0, 50000};
    while (atomic_load(&d->syncs))
        nanosleep(&ts, NULL);
}
