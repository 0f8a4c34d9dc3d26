/* SPDX-License-Identifier: Apache-2.0 */
/* dlpack.h: DLPack export of host memory blocks (dlpack.c), for pypinned.c. */
#ifndef BRIDGE_DLPACK_H
#define BRIDGE_DLPACK_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "bridge.h"

enum { kDLCPU = 1, kDLCUDAHost = 3 };

/* What a __dlpack__(stream=None, max_version=None, dl_device=None, copy=None)
 * call asks for; -1 with a BufferError (or TypeError) when it asks wrongly. */
typedef struct {
    int device_type; /* kDLCPU or kDLCUDAHost (see dlpack.c: export_device) */
    int versioned;   /* a DLManagedTensorVersioned capsule */
    int copy;        /* copy=True */
} bridge_dlpack_request;
int bridge_dlpack_parse(PyObject *args, PyObject *kw, bridge_dlpack_request *req);

/* A capsule of `size` uint8 bytes at `data`, owning one reference to `b`
 * (released by the consumer's deleter, or by the capsule if never consumed;
 * released here on failure).  NULL with an exception on failure. */
PyObject *bridge_dlpack_capsule(bridge_pinned_block *b, void *data, Py_ssize_t size,
                                const bridge_dlpack_request *req);

#endif /* BRIDGE_DLPACK_H */
