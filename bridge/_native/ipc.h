/* SPDX-License-Identifier: Apache-2.0 */
/* ipc.h: what the core's frees ask of ipc.c (internal). */
#ifndef BRIDGE_IPC_H
#define BRIDGE_IPC_H

#include <stdatomic.h>
#include <stdint.h>

#include "bridge.h"

/* Blocks other processes hold now (0 almost always: the frees' one load). */
extern _Atomic int bridge_ipc_holding;

/* 1: another process holds the block, whose free is done when the last
 * hold drops (the free is taken over); 0: free it now. */
int ipc_free_held(uintptr_t ptr);

static inline int ipc_held(void *ptr)
{
    return atomic_load_explicit(&bridge_ipc_holding, memory_order_relaxed) &&
           ipc_free_held((uintptr_t)ptr);
}

#endif /* BRIDGE_IPC_H */
