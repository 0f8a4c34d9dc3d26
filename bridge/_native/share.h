/* SPDX-License-Identifier: Apache-2.0 */
/* share.h: one budget for every bridge process on a GPU (internal).
 *
 * The ledger calls in here only where this process's pool may grow (an
 * allocation that is not a cache hit): share_reserve before the driver is
 * asked, share_settle after it answered; its trim calls share_trimmed.  It
 * calls them through its table (ledger_parts, ledger.h), which
 * bridge_share_join fills.
 * The public entry points (bridge_share_*) are in bridge.h; the design is in
 * share.c's banner.
 */
#ifndef BRIDGE_SHARE_H
#define BRIDGE_SHARE_H

#include <stdint.h>

#include "device.h" /* share_member: this process in one group */

/* Before the driver is asked for `size` bytes: make this process's claim
 * cover its pool's growth.  BRIDGE_OK, or BRIDGE_E_BUDGET when the group's
 * budget cannot make room (after taking back the shares of dead members and
 * asking the others to trim).  Every BRIDGE_OK is followed by one
 * share_settle with the same size. */
int share_reserve(struct device_state *d, share_member *m, uint64_t size);
/* After the driver answered (granted: 1 when it gave the block). */
void share_settle(struct device_state *d, share_member *m, uint64_t size, int granted);
/* The bytes this process's pool may still grow by before a reservation
 * would be refused, from the claims as they are now (no lock, no trim, no
 * ask: a figure for sizing, which share_reserve decides again); 0 when the
 * pool's figure cannot be read. */
uint64_t share_room(struct device_state *d, share_member *m);
/* The share's budget in bytes (rounded down to the claim unit, as the
 * claims are counted): no request larger than it can ever be admitted. */
uint64_t share_budget(const share_member *m);
/* The pool was trimmed: lower the claim to what it holds now. */
void share_trimmed(struct device_state *d, share_member *m);

#endif /* BRIDGE_SHARE_H */
