/* SPDX-License-Identifier: Apache-2.0 */
/* tls.h: how the core keeps per-thread state that its hot path reads.
 *
 * Python loads the core with dlopen.  A _Thread_local of such a library is
 * in the dynamic TLS model by default: each function that reads one calls
 * __tls_get_addr (11 instructions, and a call that clobbers the caller-saved
 * registers).  A cache-hit pair read three such variables in eight places,
 * about 90 of its 590 instructions (callgrind, the core built as Python
 * builds it).  In the initial-exec model (BRIDGE_TLS_ONE_LOAD) a read is one
 * load off the thread pointer.
 *
 * The cost: a library with any initial-exec variable has its whole TLS
 * block in the static TLS area, and glibc keeps only a small surplus there
 * for libraries loaded later, shared by all of them (1,520 bytes by its
 * defaults; libgomp, which torch loads, takes some).  So every _Thread_local
 * of the core stays small: the per-thread tables (a thread's cache slots and
 * count copies by device, its memo) live on the heap, made at the thread's
 * first use and freed by the key destructor of the file that owns them, and
 * the variable is the pointer.  The block is 124 bytes built with gcc 12
 * and 144 with gcc 13 (whose libstdc++ adds a 16-byte thread_local to the
 * C++ part); tests/core/test_tls.py holds it within the 144 bytes that
 * glibc budgets for one such library (its OTHER_IE_TLS).  Where it does not
 * fit (many libraries with static TLS loaded before the core), the import
 * fails with "cannot allocate memory in static TLS block": import bridge
 * earlier, or raise GLIBC_TUNABLES=glibc.rtld.optional_static_tls.
 */
#ifndef BRIDGE_TLS_H
#define BRIDGE_TLS_H

#define BRIDGE_TLS_ONE_LOAD __attribute__((tls_model("initial-exec")))

#endif
