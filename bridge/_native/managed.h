/* SPDX-License-Identifier: Apache-2.0 */
/* managed.h: CUDA managed (unified) memory on the budget (managed.c).
 *
 * Managed memory is outside the stream-ordered pool: cuMemAllocManaged and
 * cuMemFree, never cached, never ordered on a stream (cuMemFree waits for
 * the device's work on the block).  Its bytes count in the ledger under the
 * framework's tag, so the budget refuses what would pass it, stats().by_framework
 * shows them and a wait for memory can be ended by their free; they are not in
 * the pool's figures (used, reserved) nor in a share's claims, which follow the
 * pool.  Waiting (wait.c) does not count a thread that holds only managed memory
 * among the holders it could wait for: with every other holder waiting, a wait
 * is refused at once rather than left to hang.
 */
#ifndef BRIDGE_MANAGED_H
#define BRIDGE_MANAGED_H

#include <stddef.h>
#include <stdint.h>

/* Allocate `size` managed bytes for framework `tag` on `device` (its
 * context current for the call; CU_MEM_ATTACH_GLOBAL).  size 0 gives
 * *out = NULL.  BRIDGE_E_BUDGET, _TAG_LIMIT or _OOM when refused (counted
 * as an OOM); BRIDGE_E_DRIVER when the driver has no managed memory.  A
 * block larger than the device is not refused for that (the driver pages
 * managed memory in and out): only a budget or the driver refuses it. */
int bridge_alloc_managed(int device, size_t size, int tag, void **out);
/* Free a block of bridge_alloc_managed.  BRIDGE_E_INVALID for a pointer it
 * did not give (nothing is freed); a failing driver free is counted, and the
 * budget is given back all the same. */
int bridge_free_managed(void *ptr);
/* The managed bytes and blocks live on `device` now. */
int bridge_managed_stats(int device, uint64_t *bytes, uint64_t *blocks);

#endif /* BRIDGE_MANAGED_H */
