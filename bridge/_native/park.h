/* SPDX-License-Identifier: Apache-2.0 */
/* park.h: the two words by which a thread's slot (cache.c) and the records
 * table (records.c) agree on a block whose record stays in the table while
 * the block waits in the slot, so that a block cycling through one thread's
 * allocation and free takes neither shard lock.  The states they encode
 * (PARKED, PARKED_CARVED, and MEMO, a sub-state of LIVE), their figures and
 * their transitions are block.h's; these are the words.
 *
 * Each thread slot has one park_words; each record points to the words of
 * the slot of the thread that allocated it (NULL: none).
 *   kept  the block parked in the slot with its record: every reader of the
 *         table takes that record for absent (a freed block) until the word
 *         changes.  Set by the slot's owner, only while it is 0, before the
 *         block is published in the slot; cleared by the owner taking the
 *         block back live, or by whoever takes the record out of the table
 *         (records_take_parked, under the shard lock).
 *         While it names a block, `size` and `tag` are that block's: the block
 *         stays counted in its tag's live bytes and allocations (tag_state's
 *         `current` and `count`), and every reader of those figures takes
 *         the parked blocks out (cache_kept, a walk of the slots), so that
 *         neither the park nor the take back changes a shared figure.
 *   memo  the block the owner allocated last, of which it keeps a copy of
 *         the record: the owner's free may use that copy instead of the
 *         table while the word still names the block, and sets it to 0.
 *         Any change of the record in the table clears the word first
 *         (records.c, under the shard lock), so a copy found named is the
 *         table's own.
 */
#ifndef BRIDGE_PARK_H
#define BRIDGE_PARK_H

#include <stdatomic.h>
#include <stdint.h>

typedef struct park_words {
    _Atomic uintptr_t kept;
    _Atomic uintptr_t memo;
    _Atomic uint64_t size; /* the kept block's bytes, written before `kept` */
    _Atomic int tag;       /* the kept block's tag, written before `kept` */
} park_words;

#endif
