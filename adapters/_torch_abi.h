/* SPDX-License-Identifier: Apache-2.0 */
/* _torch_abi.h: torch's CUDAPluggableAllocator entry points in bridge._core
 * (_torch_abi.cpp, compiled into the core by setup.py), for the torch adapter's
 * own allocator (_torch_allocator.cpp) and whoever loads them by name. */
#ifndef BRIDGE_TORCH_ABI_H
#define BRIDGE_TORCH_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

void *bridge_torch_alloc(size_t size, int device, void *stream);
void bridge_torch_free(void *ptr, size_t size, int device, void *stream);
/* The words of a refused torch allocation, for both torch paths: into buf
 * (NUL-terminated within len); returns the message's length; *oom is 1 for an
 * out-of-memory (torch.cuda.OutOfMemoryError), 0 for another CUDA error. */
/* torch.cuda.set_per_process_memory_fraction's cap of `device` in bytes, as
 * torch's own allocator sets it (fraction of the device's memory): 0 (no
 * cap) for 1.0, BRIDGE_TAG_LIMIT_ZERO (every allocation refused) for a
 * fraction that leaves no bytes.  From the driver: the device need not be
 * set up. */
uint64_t bridge_torch_fraction_cap(double fraction, int device);
size_t bridge_torch_failure_message(int rc, size_t size, int device, char *buf, size_t len,
                                    int *oom);

#ifdef __cplusplus
}
#endif
#endif /* BRIDGE_TORCH_ABI_H */
