/* SPDX-License-Identifier: Apache-2.0 */
/* views.h: what the core tells tools about memory (views.c; internal).
 *
 * The allocation history: while it is on (bridge_history_set), every
 * allocation, free and refusal that passes through the core is noted in a
 * ring of events, with the id of the caller's Python stack when stacks were
 * asked for and the caller holds the GIL.  While it is off, the hot path
 * pays one relaxed atomic load.
 */
#ifndef BRIDGE_VIEWS_H
#define BRIDGE_VIEWS_H

#include <stdatomic.h>
#include <stdint.h>

#include "bridge.h"
#include "driver.h"

extern atomic_int bridge_history_on; /* 1 while events are recorded */

void history_note(int action, int device, uintptr_t ptr, uint64_t size, CUstream stream, int tag);

/* One relaxed load when the history is off. */
static inline void history_maybe(int action, int device, uintptr_t ptr, uint64_t size,
                                 CUstream stream, int tag)
{
    if (atomic_load_explicit(&bridge_history_on, memory_order_relaxed))
        history_note(action, device, ptr, size, stream, tag);
}

/* A fork child forgets the parent's events without taking a lock. */
void history_forget_after_fork(void);

#endif
