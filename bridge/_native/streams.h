/* SPDX-License-Identifier: Apache-2.0 */
/* streams.h: what a stream handle means to the core, and the stream a free
 * is issued on (streams.c; internal).  Above device.h, below the ledger. */
#ifndef BRIDGE_STREAMS_H
#define BRIDGE_STREAMS_H

#include "device.h"

/* The key a stream handle is remembered by: the handle itself, except the
 * per-thread default stream (handle 2), which names a different stream on
 * every thread: its key is unique to the calling thread, forever. */
CUstream stream_key(CUstream s);
/* The handle to give the driver for a key, from the calling thread: a
 * per-thread key of another thread becomes the legacy default stream, which
 * waits for every blocking stream's queued work (that thread's included). */
CUstream stream_handle(CUstream key);
/* Whether blocks freed on `key` may be kept and handed to the next
 * allocation on the same key: default streams, per-thread keys and streams
 * registered as living as long as the process (torch's stream pool). */
int stream_long_lived(CUstream key);
/* 1 when a later free of a block `key` used cannot be ordered after that use
 * on any stream the core can name then: `key` is not provably alive at the
 * free (stream_long_lived) and is non-blocking, so the legacy stream, which
 * stands for such streams, does not wait for it.  Asked while the stream is
 * alive (an allocation or a record_stream on it); the block is then marked
 * REC_UNORDERED (ledger_hold). */
int stream_needs_device_order(CUstream key);
/* Remove a registered stream (bridge_forget_stream). */
int stream_forget(CUstream key);
/* 1 when the stream is capturing (or answers a capture error, as the legacy
 * stream does while a blocking stream captures), else 0, also for a handle
 * the driver calls unusable.  Handles 0, 1 and 2 are asked in d's context. */
int stream_capturing(device_state *d, CUstream key);
/* Synchronize the registered streams of `ctx` that are not capturing. */
void stream_sync_long_lived(CUcontext ctx);
/* Make `free_stream` wait for the queued work of every stream recorded in
 * `rec`.  0 when ordered; 1 when a recorded stream is capturing (the free
 * must wait until the capture ends); -1 when a recorded stream could not be
 * used (destroyed, say): the caller must order the free another way. */
int stream_order_after_recorded(const record *rec, CUstream free_stream);

/* The key a block's free is issued on: its own stream when the bridge can
 * prove that stream alive at the free (default and per-thread streams,
 * registered streams, streams of a tag whose framework keeps them alive
 * until the free returns: bridge_set_tag_holds_streams), else the legacy
 * default stream, which is ordered after the queued work of every blocking
 * stream (a block of a non-blocking one is REC_UNORDERED and never freed on
 * a stream: ledger_hold).  A handle the bridge cannot prove alive is never given to the
 * driver: a destroyed stream's handle crashed the driver or named a new
 * stream on an H200. */
CUstream free_key(const record *rec);
/* Whether tag `tag`'s framework keeps a block's stream alive until its free
 * returns (bridge_set_tag_holds_streams). */
int stream_tag_holds(int tag);
#define STREAM_LEGACY ((CUstream)(uintptr_t)1)

/* Let the frees queued on the device's streams land without a host wait
 * that could invalidate a capture, known or not: the legacy stream (after
 * every blocking stream) unless a capture answers there, the side stream
 * and the registered streams that are not capturing; nothing while a
 * capture the core knows of runs. */
void drain_streams(device_state *d);

#endif /* BRIDGE_STREAMS_H */
