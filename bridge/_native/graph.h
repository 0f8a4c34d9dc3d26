/* SPDX-License-Identifier: Apache-2.0 */
/* graph.h: CUDA graph pools (graph.c; internal), above the ledger: what
 * the allocation entry points (alloc.c) ask of them. */
#ifndef BRIDGE_GRAPH_H
#define BRIDGE_GRAPH_H

#include "device.h"

/* A graph block the user freed: onto its pool's free list (bridge_free
 * meets graph blocks first). */
void graph_block_freed(device_state *d, const record *rec);
/* The CuPy capture pool bound to a capturing stream key (its id1; id0 is
 * BRIDGE_STREAM_POOL): 1 when there is one. */
int graph_pool_of_stream(device_state *d, CUstream key, uint64_t *id1);
/* A block the graph pool of `want` (graph0, graph1) freed earlier, reused
 * for `want` (best fit for its size on its stream key, no driver call): live
 * again for want->tag and counted; 0 when the pool has none. */
uintptr_t graph_reuse(device_state *d, const record *want);
/* The pools of CuPy graphs that died (their user objects' destructors ran:
 * bridge_capture_bind_graph) are released now; how many.  Nothing pending:
 * one relaxed load.  Called with no lock of the core held (it takes the
 * capture lock and the records' shard locks, and frees blocks). */
int graph_collect_dead(void);
/* A torch allocation into pool (id0, id1) on stream `key` during its
 * capture: the first one names the stream and the capture id that
 * graph_reap_ended watches (a registered stream only). */
void graph_watch(device_state *d, uint64_t id0, uint64_t id1, CUstream key);
/* Captures begun by the calling thread whose stream has left the capture
 * without the end hook (torch 2.11 after an invalidated capture): ended,
 * their pools' uses dropped (released at the last), the frees they held
 * back issued; how many.  No capture counted: one relaxed load.  Without
 * `force` at most one look a millisecond per device.  Called with no lock
 * of the core held. */
int graph_reap_ended(device_state *d, int force);
/* A fork child: the parent's dead graphs and released ids are forgotten. */
void graph_forget_after_fork(void);

#endif /* BRIDGE_GRAPH_H */
