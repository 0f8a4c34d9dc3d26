/* SPDX-License-Identifier: Apache-2.0 */
/* driver.h: the CUDA driver entry points the core uses, loaded at run time.
 *
 * No CUDA toolkit is needed to build: the types below are the driver API's
 * (opaque handles and plain integers) and every entry point is looked up by
 * its exact exported name in libcuda.so.1, names that CUDA 12 and 13 drivers
 * both export, so one build runs on either.
 */
#ifndef BRIDGE_DRIVER_H
#define BRIDGE_DRIVER_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef void *CUmemoryPool;
typedef void *CUgraph;
typedef void *CUuserObject;
typedef void (*CUhostFn)(void *user_data);
typedef unsigned long long CUdeviceptr;

#define CUDA_SUCCESS               0
#define CUDA_ERROR_INVALID_VALUE   1
#define CUDA_ERROR_OUT_OF_MEMORY   2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_NO_DEVICE       100
#define CUDA_ERROR_INVALID_DEVICE  101
#define CUDA_ERROR_NOT_SUPPORTED   801

#define CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED   115
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR 76

#define CU_MEMPOOL_ATTR_RELEASE_THRESHOLD    4
#define CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT 5
#define CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH    6
#define CU_MEMPOOL_ATTR_USED_MEM_CURRENT     7
#define CU_MEMPOOL_ATTR_USED_MEM_HIGH        8

#define CU_MEM_ALLOCATION_TYPE_PINNED            1
#define CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 1
#define CU_MEM_LOCATION_TYPE_DEVICE              1
#define CU_MEM_ACCESS_FLAGS_PROT_READWRITE       3

#define CU_STREAM_NON_BLOCKING          1
#define CU_EVENT_DISABLE_TIMING         2
#define CU_STREAM_CAPTURE_STATUS_NONE   0
#define CU_STREAM_CAPTURE_MODE_RELAXED  2
#define CU_STREAM_CAPTURE_STATUS_ACTIVE 1

#define CU_USER_OBJECT_NO_DESTRUCTOR_SYNC 1 /* required: the only flag */
#define CU_GRAPH_USER_OBJECT_MOVE         1 /* the caller's references move to the graph */

/* CUmemAccessDesc: a location (type, id) and the access flags. */
typedef struct {
    int type; /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
    int id;
} bridge_CUmemLocation;
typedef struct {
    bridge_CUmemLocation location;
    int flags; /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 */
} bridge_CUmemAccessDesc;

/* CUmemPoolProps (88 bytes in CUDA 11.2 to 13). */
typedef struct {
    int allocType;                 /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
    int handleTypes;               /* CU_MEM_HANDLE_TYPE_NONE = 0 */
    bridge_CUmemLocation location; /* HOST = 2 (id ignored), HOST_NUMA = 3 (id = node) */
    void *win32SecurityAttributes;
    size_t maxSize; /* 0 = the system's default */
    unsigned short usage;
    unsigned char reserved[54];
} bridge_CUmemPoolProps;

/* CUmemPoolPtrExportData: what cuMemPoolExportPointer writes. */
typedef struct {
    unsigned char reserved[64];
} bridge_CUmemPoolPtrExportData;

/* The table of entry points.  X(name, return, args) */
#define BRIDGE_DRIVER_ENTRIES(X)                                                                \
    X(cuInit, (unsigned int flags))                                                             \
    X(cuDriverGetVersion, (int *version))                                                       \
    X(cuGetErrorName, (CUresult error, const char **str))                                       \
    X(cuDeviceGetCount, (int *count))                                                           \
    X(cuDeviceGet, (CUdevice * dev, int ordinal))                                               \
    X(cuDeviceGetName, (char *name, int len, CUdevice dev))                                     \
    X(cuDeviceGetAttribute, (int *pi, int attrib, CUdevice dev))                                \
    X(cuDeviceTotalMem_v2, (size_t * bytes, CUdevice dev))                                      \
    X(cuMemGetInfo_v2, (size_t * free, size_t * total))                                         \
    X(cuDeviceGetUuid_v2, (unsigned char *uuid16, CUdevice dev))                                \
    X(cuDeviceCanAccessPeer, (int *can, CUdevice dev, CUdevice peer))                           \
    X(cuDevicePrimaryCtxRetain, (CUcontext * pctx, CUdevice dev))                               \
    X(cuCtxGetCurrent, (CUcontext * pctx))                                                      \
    X(cuCtxSetCurrent, (CUcontext ctx))                                                         \
    X(cuCtxSynchronize, (void))                                                                 \
    X(cuCtxGetDevice, (CUdevice * dev))                                                         \
    X(cuDeviceGetDefaultMemPool, (CUmemoryPool * pool, CUdevice dev))                           \
    X(cuMemPoolGetAttribute, (CUmemoryPool pool, int attr, void *value))                        \
    X(cuMemPoolSetAttribute, (CUmemoryPool pool, int attr, void *value))                        \
    X(cuMemPoolTrimTo, (CUmemoryPool pool, size_t keep))                                        \
    X(cuMemPoolSetAccess, (CUmemoryPool pool, const bridge_CUmemAccessDesc *map, size_t count)) \
    X(cuMemAllocFromPoolAsync,                                                                  \
      (CUdeviceptr * dptr, size_t size, CUmemoryPool pool, CUstream stream))                    \
    X(cuMemFreeAsync, (CUdeviceptr dptr, CUstream stream))                                      \
    X(cuStreamCreate, (CUstream * stream, unsigned int flags))                                  \
    X(cuStreamSynchronize, (CUstream stream))                                                   \
    X(cuStreamIsCapturing, (CUstream stream, int *status))                                      \
    X(cuStreamGetFlags, (CUstream stream, unsigned int *flags))                                 \
    X(cuStreamWaitEvent, (CUstream stream, CUevent event, unsigned int flags))                  \
    X(cuEventCreate, (CUevent * event, unsigned int flags))                                     \
    X(cuEventRecord, (CUevent event, CUstream stream))                                          \
    X(cuEventDestroy_v2, (CUevent event))                                                       \
    X(cuThreadExchangeStreamCaptureMode, (int *mode))                                           \
    X(cuStreamGetCtx, (CUstream stream, CUcontext * pctx))                                      \
    X(cuEventQuery, (CUevent event))                                                            \
    X(cuMemHostAlloc, (void **pp, size_t bytes, unsigned int flags))                            \
    X(cuMemFreeHost, (void *p))                                                                 \
    X(cuMemPoolCreate, (CUmemoryPool * pool, const bridge_CUmemPoolProps *props))               \
    X(cuMemPoolDestroy, (CUmemoryPool pool))                                                    \
    X(cuMemPoolExportToShareableHandle,                                                         \
      (void *handle, CUmemoryPool pool, int type, unsigned long long flags))                    \
    X(cuMemPoolImportFromShareableHandle,                                                       \
      (CUmemoryPool * pool, void *handle, int type, unsigned long long flags))                  \
    X(cuMemPoolExportPointer, (bridge_CUmemPoolPtrExportData * data, CUdeviceptr ptr))          \
    X(cuMemPoolImportPointer,                                                                   \
      (CUdeviceptr * ptr, CUmemoryPool pool, bridge_CUmemPoolPtrExportData * data))             \
    X(cuStreamGetCaptureInfo_v2, (CUstream stream, int *status, uint64_t *id, CUgraph *graph,   \
                                  const void **deps, size_t *ndeps))                            \
    X(cuUserObjectCreate, (CUuserObject * obj, void *ptr, CUhostFn destroy,                     \
                           unsigned int initial_refcount, unsigned int flags))                  \
    X(cuUserObjectRelease, (CUuserObject obj, unsigned int count))                              \
    X(cuGraphRetainUserObject,                                                                  \
      (CUgraph graph, CUuserObject obj, unsigned int count, unsigned int flags))

#define BRIDGE_DECLARE_ENTRY(name, args) CUresult(*name) args;
typedef struct bridge_driver {
    BRIDGE_DRIVER_ENTRIES(BRIDGE_DECLARE_ENTRY)
} bridge_driver;
#undef BRIDGE_DECLARE_ENTRY

/* Filled by bridge_init; read-only afterwards. */
extern bridge_driver bridge_drv;

/* Remember a failing driver result for diagnostics; returns it unchanged. */
CUresult bridge_note_driver_error(CUresult r);

#endif /* BRIDGE_DRIVER_H */
