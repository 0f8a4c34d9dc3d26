/* SPDX-License-Identifier: Apache-2.0 */
/* streams.c: what a stream handle means to the core.
 *
 * Stream order is what makes reuse safe: a block freed on stream S may be
 * handed to the next allocation on S at once, because S runs the new user's
 * work after the old user's.  That holds only while the handle names ONE
 * stream that is still alive:
 *   - handle 0 and 1 name the legacy default stream of the context, for
 *     every thread and for the life of the process;
 *   - handle 2 (CU_STREAM_PER_THREAD) names a different stream on every
 *     thread, so it is keyed by thread here (CuPy does the same with
 *     CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1);
 *   - any other handle is a stream somebody created, and may be destroyed
 *     while a block freed on it is still remembered, after which a new
 *     stream can get the same address.  Only streams registered as living
 *     as long as the process (torch's stream pool) are treated as stable.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "streams.h"

#define LEGACY     ((CUstream)(uintptr_t)1)
#define PER_THREAD ((CUstream)(uintptr_t)2)

/* ---- per-thread keys ---- */
/* Odd and above 0xF: never a real handle (those are aligned pointers), never
 * 0, 1 or 2; unique for the life of the process (never reused by a later
 * thread, whose per-thread stream is another stream). */
#define THREAD_KEY_TAG 0xBu
static _Atomic uint64_t next_thread;
static _Thread_local uintptr_t my_key;

static inline int is_thread_key(CUstream k)
{
    uintptr_t v = (uintptr_t)k;
    return v > 0xF && (v & 0xF) == THREAD_KEY_TAG;
}

static uintptr_t thread_key(void)
{
    if (!my_key)
        my_key = (uintptr_t)((atomic_fetch_add_explicit(&next_thread, 1, RELAXED) + 1) << 4) |
                 THREAD_KEY_TAG;
    return my_key;
}

CUstream stream_key(CUstream s)
{
    return s == PER_THREAD ? (CUstream)thread_key() : s;
}

CUstream stream_handle(CUstream key)
{
    if (!is_thread_key(key))
        return key;
    return (uintptr_t)key == thread_key() ? PER_THREAD : LEGACY;
}

/* ---- streams that live as long as the process ---- */
/* An open-addressing set (linear probing); lookups take no lock.  A
 * forgotten handle leaves a tombstone (the legacy handle, never a member),
 * which a later registration probing past it takes; a tombstone that ends
 * its probe run (the next slot empty) is emptied, since no lookup goes
 * through it to a member beyond.  So CuPy's register and forget of a
 * capture's stream for each graph never fills the set. */
#define LONG_LIVED_SLOTS 4096 /* power of two; at most half used, tombstones included */
#define TOMBSTONE        ((uintptr_t)1)
static _Atomic uintptr_t long_lived[LONG_LIVED_SLOTS];
static unsigned long_lived_count; /* slots not empty (tombstones too), under long_lived_lock */
static pthread_mutex_t long_lived_lock = PTHREAD_MUTEX_INITIALIZER;

static inline size_t slot_of(uintptr_t s)
{
    /* Handles are aligned pointers: mix every bit into the top ones, use those. */
    return (size_t)(((uint64_t)s * 0x9E3779B97F4A7C15ull) >> 52) & (LONG_LIVED_SLOTS - 1);
}

int bridge_register_stream(void *stream)
{
    uintptr_t s = (uintptr_t)stream;
    if (s <= 2 || is_thread_key((CUstream)s))
        return BRIDGE_OK; /* default streams are long-lived already */
    int rc = BRIDGE_OK;
    pthread_mutex_lock(&long_lived_lock);
    size_t i = slot_of(s), tomb = LONG_LIVED_SLOTS;
    for (;; i = (i + 1) & (LONG_LIVED_SLOTS - 1)) {
        uintptr_t cur = atomic_load_explicit(&long_lived[i], RELAXED);
        if (cur == s)
            break;
        if (cur == TOMBSTONE && tomb == LONG_LIVED_SLOTS)
            tomb = i; /* the first on the way: taken if `s` is not a member */
        if (!cur) {
            /* not a member: the first tombstone on its probe run (a lookup
             * finds it there, before the end of the run), else this slot */
            if (tomb != LONG_LIVED_SLOTS) {
                atomic_store_explicit(&long_lived[tomb], s, memory_order_release);
                break;
            }
            if (long_lived_count >= LONG_LIVED_SLOTS / 2) {
                rc = BRIDGE_E_OOM;
                break;
            }
            atomic_store_explicit(&long_lived[i], s, memory_order_release);
            long_lived_count++;
            break;
        }
    }
    pthread_mutex_unlock(&long_lived_lock);
    return rc;
}

int bridge_stream_registered(void *stream)
{
    return stream_long_lived(stream_key((CUstream)stream));
}

int stream_forget(CUstream key)
{
    void *stream = key;
    uintptr_t s = (uintptr_t)stream;
    if (s <= 2)
        return BRIDGE_OK;
    pthread_mutex_lock(&long_lived_lock);
    for (size_t i = slot_of(s);; i = (i + 1) & (LONG_LIVED_SLOTS - 1)) {
        uintptr_t cur = atomic_load_explicit(&long_lived[i], RELAXED);
        if (!cur)
            break;
        if (cur == s) {
            atomic_store_explicit(&long_lived[i], TOMBSTONE, memory_order_release);
            /* Tombstones that end their run back to empty, last first: a
             * lookup stops at an empty slot, and none passed through these
             * to a member (the next slot is empty), so every answer stays. */
            size_t j = i;
            while (atomic_load_explicit(&long_lived[j], RELAXED) == TOMBSTONE &&
                   !atomic_load_explicit(&long_lived[(j + 1) & (LONG_LIVED_SLOTS - 1)], RELAXED)) {
                atomic_store_explicit(&long_lived[j], 0, memory_order_release);
                long_lived_count--;
                j = (j - 1) & (LONG_LIVED_SLOTS - 1);
            }
            break;
        }
    }
    pthread_mutex_unlock(&long_lived_lock);
    return BRIDGE_OK;
}

int stream_long_lived(CUstream key)
{
    uintptr_t s = (uintptr_t)key;
    if (s <= 1 || is_thread_key(key))
        return 1;
    for (size_t i = slot_of(s);; i = (i + 1) & (LONG_LIVED_SLOTS - 1)) {
        uintptr_t cur = atomic_load_explicit(&long_lived[i], memory_order_acquire);
        if (cur == s)
            return 1;
        if (!cur)
            return 0;
    }
}

/* ---- streams only a device-wide synchronization orders after ---- */
int stream_needs_device_order(CUstream key)
{
    if (stream_long_lived(key))
        return 0; /* named at the free: the free is ordered on it */
    CUstream h = stream_handle(key);
    if ((uintptr_t)h <= 2)
        return 0;
    /* Alive now (its framework allocates or records on it), maybe not at the
     * free.  A blocking stream is ordered before the legacy stream's later
     * work, which stands for it then; a non-blocking one (torch's pooled
     * streams of a device nobody registered, cupy.cuda.Stream(non_blocking=
     * True) behind an ExternalStream, any cudaStreamNonBlocking stream) is
     * not.  No answer: treated as non-blocking. */
    unsigned flags = 0;
    if (bridge_drv.cuStreamGetFlags(h, &flags) != CUDA_SUCCESS)
        return 1;
    return (flags & CU_STREAM_NON_BLOCKING) != 0;
}

/* ---- capture status ---- */
/* Capture errors (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED .. _WRONG_THREAD and
 * CUDA_ERROR_CAPTURED_EVENT): the legacy stream answers one while a blocking
 * stream captures, since work on it would join the capture. */
static int capture_error(CUresult r)
{
    return r >= 900 && r <= 909;
}

int stream_capturing(device_state *d, CUstream key)
{
    int status = CU_STREAM_CAPTURE_STATUS_NONE;
    CUstream h = stream_handle(key);
    /* handles 0, 1 and 2 mean the current context's stream: the device's */
    ctx_guard g = {0};
    if ((uintptr_t)h <= 2)
        ctx_enter(d, &g);
    int mode = capture_mode_relax();
    CUresult r = bridge_drv.cuStreamIsCapturing(h, &status);
    bridge_drv.cuThreadExchangeStreamCaptureMode(&mode);
    if ((uintptr_t)h <= 2)
        ctx_exit(&g);
    /* another error: the handle is unusable (a stream destroyed under the
     * bridge's feet), not capturing; the free that asked goes its own way */
    return capture_error(r) || (r == CUDA_SUCCESS && status != CU_STREAM_CAPTURE_STATUS_NONE);
}

/* ---- ordering a free after the streams recorded against the block ---- */
/* One event per recorded stream, created and recorded in that stream's
 * context (a stream of another device cannot record an event of this one),
 * then waited on by the stream the free is issued on IN THE CALLER'S
 * CONTEXT, the block's: handles 0, 1 and 2 name the current context's
 * stream, so waiting under the recorded stream's context would order that
 * other device's default stream instead (seen on the stand-in and on an
 * H200).  An event may be waited on from another context. */
static int order_after(CUstream recorded, CUstream free_stream)
{
    int status = CU_STREAM_CAPTURE_STATUS_NONE;
    int mode = capture_mode_relax();
    CUresult r = bridge_drv.cuStreamIsCapturing(recorded, &status);
    bridge_drv.cuThreadExchangeStreamCaptureMode(&mode);
    if (capture_error(r))
        return 1;
    if (r != CUDA_SUCCESS)
        return -1;
    if (status != CU_STREAM_CAPTURE_STATUS_NONE)
        return 1;
    CUcontext sctx = NULL, prev = NULL;
    if (bridge_drv.cuStreamGetCtx(recorded, &sctx) != CUDA_SUCCESS || !sctx)
        return -1;
    bridge_drv.cuCtxGetCurrent(&prev);
    if (prev != sctx)
        bridge_drv.cuCtxSetCurrent(sctx);
    CUevent ev = NULL;
    int recorded_ok = 0;
    if (bridge_drv.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS)
        recorded_ok = bridge_drv.cuEventRecord(ev, recorded) == CUDA_SUCCESS;
    if (prev != sctx)
        bridge_drv.cuCtxSetCurrent(prev); /* the free stream's handle means prev's stream */
    int rc = -1;
    if (ev) {
        if (recorded_ok && bridge_drv.cuStreamWaitEvent(free_stream, ev, 0) == CUDA_SUCCESS)
            rc = 0;
        bridge_drv.cuEventDestroy_v2(ev); /* released once it completes */
    }
    return rc;
}

int stream_order_after_recorded(const record *rec, CUstream free_stream)
{
    int worst = 0;
    for (uint16_t i = 0; i < rec->nrec; i++) {
        /* A recorded stream the bridge cannot prove alive is never given to
         * the driver (it may be destroyed, its handle another stream's now):
         * the legacy stream stands for it, which waits for the queued work
         * of every blocking stream before its own.  A non-blocking one was
         * marked when it was recorded (REC_UNORDERED): its block never gets
         * here, only a device-wide synchronization orders it (ledger_hold). */
        CUstream s = rec->recs[i];
        if (!stream_long_lived(s))
            s = LEGACY;
        int rc = order_after(s, free_stream);
        if (rc == 1)
            return 1; /* wait for the capture: nothing else matters yet */
        if (rc < 0)
            worst = -1;
    }
    return worst;
}

/* ---- letting queued frees land without a device-wide synchronization ---- */
/* Synchronize the registered streams of `ctx` that are not capturing (a
 * synchronization of a capturing stream would invalidate its capture).  In
 * relaxed capture mode (the caller's). */
void stream_sync_long_lived(CUcontext ctx)
{
    for (size_t i = 0; i < LONG_LIVED_SLOTS; i++) {
        uintptr_t s = atomic_load_explicit(&long_lived[i], memory_order_acquire);
        if (s <= TOMBSTONE)
            continue;
        CUcontext sctx = NULL;
        int status = CU_STREAM_CAPTURE_STATUS_NONE;
        if (bridge_drv.cuStreamGetCtx((CUstream)s, &sctx) != CUDA_SUCCESS || sctx != ctx ||
            bridge_drv.cuStreamIsCapturing((CUstream)s, &status) != CUDA_SUCCESS ||
            status != CU_STREAM_CAPTURE_STATUS_NONE)
            continue;
        bridge_drv.cuStreamSynchronize((CUstream)s);
    }
}

void drain_streams(device_state *d)
{
    if (!sync_enter(d))
        return;
    ctx_guard g;
    ctx_enter(d, &g);
    int mode = capture_mode_relax();
    int status = CU_STREAM_CAPTURE_STATUS_NONE;
    /* never cuCtxSynchronize: it would invalidate a capture the core cannot
     * see (XLA's); the legacy stream answers an error while a blocking
     * stream captures, and then is left alone too */
    if (bridge_drv.cuStreamIsCapturing(STREAM_LEGACY, &status) == CUDA_SUCCESS &&
        status == CU_STREAM_CAPTURE_STATUS_NONE)
        bridge_drv.cuStreamSynchronize(STREAM_LEGACY);
    bridge_drv.cuStreamSynchronize(d->side);
    stream_sync_long_lived(d->ctx);
    capture_mode_exit(mode);
    ctx_exit(&g);
    sync_exit(d);
}

/* ---- the stream a free is issued on (streams.h) ---- */
/* Bit t set: tag t keeps its blocks' streams alive until their frees return
 * (bridge_set_tag_holds_streams).  CuPy's, set by its adapter's C when the
 * module loads: its allocator (adapters/_cupy_alloc.c) gives each block a
 * reference to its Stream, dropped after the free has returned (pyblock.c). */
static _Atomic unsigned holding_tags = 0;

int stream_tag_holds(int tag)
{
    return (atomic_load_explicit(&holding_tags, RELAXED) >> tag) & 1u;
}

CUstream free_key(const record *rec)
{
    if (stream_long_lived(rec->stream) || stream_tag_holds(rec->tag))
        return rec->stream;
    return STREAM_LEGACY;
}

int bridge_set_tag_holds_streams(int tag, int holds)
{
    if (tag < 0 || tag >= BRIDGE_NTAGS)
        return BRIDGE_E_INVALID;
    if (holds)
        atomic_fetch_or(&holding_tags, 1u << tag);
    else
        atomic_fetch_and(&holding_tags, ~(1u << tag));
    return BRIDGE_OK;
}
