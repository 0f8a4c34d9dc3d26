/* SPDX-License-Identifier: Apache-2.0 */
/* managed.c: CUDA managed memory on the budget (managed.h says what it is).
 *
 * A managed block is reserved in the ledger like a pool block (ledger_reserve:
 * the budget, the framework's cap, the share), but never committed: `committed`
 * mirrors what the ledger holds in the pool, from which the bytes of others
 * are read, and managed memory is not there.  The blocks live in a small table
 * of their own (the records table is the pool's: its frees go to
 * cuMemFreeAsync).  The two driver entry points are looked up in the library
 * the core loaded, at the first managed allocation: drivers and stand-ins
 * without them still load.
 *
 * Locks: `lock` guards the table only; no driver call and no ledger call is
 * made under it.
 */
#include "managed.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>

#include "ledger.h"
#include "share.h"
#include "wait.h"

#define CU_MEM_ATTACH_GLOBAL 1

typedef CUresult (*alloc_managed_fn)(CUdeviceptr *dptr, size_t size, unsigned int flags);
typedef CUresult (*free_fn)(CUdeviceptr dptr);

typedef struct managed_block {
    uintptr_t ptr;
    uint64_t size;
    int device;
    int tag;
} managed_block;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static managed_block *blocks; /* n live blocks, unordered; under `lock` */
static size_t n, cap;
static _Atomic uint64_t bytes_of[BRIDGE_MAX_DEVICES]; /* live managed bytes per device */
static _Atomic uint64_t blocks_of[BRIDGE_MAX_DEVICES];

static pthread_once_t entries_once = PTHREAD_ONCE_INIT;
static alloc_managed_fn alloc_managed; /* cuMemAllocManaged, NULL when absent */
static free_fn free_managed;           /* cuMemFree_v2 */

static void find_entries(void)
{
    void *lib = dlopen(bridge_loaded_library(), RTLD_NOW | RTLD_NOLOAD);
    if (!lib)
        return;
    *(void **)&alloc_managed = dlsym(lib, "cuMemAllocManaged");
    *(void **)&free_managed = dlsym(lib, "cuMemFree_v2");
    dlclose(lib); /* the core's own handle keeps it loaded */
}

/* ---- the table ---- */
static int table_put(uintptr_t ptr, uint64_t size, int device, int tag)
{
    pthread_mutex_lock(&lock);
    if (n == cap) {
        size_t ncap = cap ? cap * 2 : 64;
        managed_block *nb = realloc(blocks, ncap * sizeof *nb);
        if (!nb) {
            pthread_mutex_unlock(&lock);
            return -1;
        }
        blocks = nb;
        cap = ncap;
    }
    blocks[n++] = (managed_block){ptr, size, device, tag};
    pthread_mutex_unlock(&lock);
    return 0;
}

/* Take a block out of the table; 0 when it is not there. */
static int table_take(uintptr_t ptr, managed_block *out)
{
    int found = 0;
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < n; i++)
        if (blocks[i].ptr == ptr) {
            *out = blocks[i];
            blocks[i] = blocks[--n];
            found = 1;
            break;
        }
    pthread_mutex_unlock(&lock);
    return found;
}

/* ---- the ledger's side ---- */
/* Give the budget back (the reverse of ledger_reserve without a commit). */
static void give_back(device_state *d, int device, int tag, uint64_t size, int counted)
{
    if (counted) {
        record rec = {.size = size, .tag = (uint8_t)tag, .device = device};
        ledger_count_free(d, &rec); /* the tag's current bytes and the frees */
    } else {
        atomic_fetch_sub_explicit(&d->tag[tag].current, size, RELAXED);
    }
    /* seq_cst, then the waiter count, as the pool's frees (ledger.c's settle) */
    atomic_fetch_sub_explicit(&d->reserved, size, memory_order_seq_cst);
    if (atomic_load(&wait_count[device]))
        wait_freed(device);
}

int bridge_alloc_managed(int device, size_t size, int tag, void **out)
{
    *out = NULL;
    if (tag < 0 || tag >= BRIDGE_NTAGS)
        return BRIDGE_E_INVALID;
    if (bridge_forked())
        return BRIDGE_E_FORKED;
    int rc;
    device_state *d = device_use(device, &rc);
    if (!d)
        return rc;
    if (size == 0)
        return BRIDGE_OK;
    pthread_once(&entries_once, find_entries);
    if (!alloc_managed || !free_managed)
        return BRIDGE_E_DRIVER;
    /* Managed memory may be larger than the device (the driver pages it in and
     * out, as cudaMallocManaged allows): only a budget refuses it.  Past 2^62
     * bytes no address space holds it, and the ledger's sums could wrap. */
    if ((uint64_t)size > ((uint64_t)1 << 62))
        rc = BRIDGE_E_OOM;
    else
        rc = ledger_reserve_oversubscribed(d, tag, size);
    share_member *sm = atomic_load_explicit(&d->share, memory_order_acquire);
    if (rc == BRIDGE_OK && sm)
        share_settle(d, sm, size, 0); /* the pool does not grow for it */
    if (rc != BRIDGE_OK) {
        atomic_fetch_add_explicit(&d->num_ooms, 1, RELAXED);
        atomic_fetch_add_explicit(&d->tag[tag].num_ooms, 1, RELAXED);
        wait_chain_end(); /* the next allocation asks the share afresh */
        return rc;
    }
    ctx_guard g;
    ctx_enter(d, &g);
    CUdeviceptr p = 0;
    CUresult r = alloc_managed(&p, size, CU_MEM_ATTACH_GLOBAL);
    ctx_exit(&g);
    if (r == CUDA_SUCCESS && table_put((uintptr_t)p, size, device, tag) != 0) {
        free_managed(p);
        r = CUDA_ERROR_OUT_OF_MEMORY; /* no host memory for the table */
    }
    if (r != CUDA_SUCCESS) {
        give_back(d, device, tag, size, 0);
        atomic_fetch_add_explicit(&d->num_ooms, 1, RELAXED);
        atomic_fetch_add_explicit(&d->tag[tag].num_ooms, 1, RELAXED);
        bridge_note_driver_error(r);
        return r == CUDA_ERROR_OUT_OF_MEMORY ? BRIDGE_E_OOM : BRIDGE_E_DRIVER;
    }
    ledger_count_granted(d, tag, size);
    atomic_fetch_add(&bytes_of[device], size);
    atomic_fetch_add(&blocks_of[device], 1);
    *out = (void *)p;
    return BRIDGE_OK;
}

int bridge_free_managed(void *ptr)
{
    if (!ptr)
        return BRIDGE_OK;
    if (bridge_forked())
        return BRIDGE_OK; /* the parent's block: nothing of it is this process's */
    managed_block b;
    if (!table_take((uintptr_t)ptr, &b))
        return BRIDGE_E_INVALID;
    device_state *d = device_of(b.device);
    if (!d)
        return BRIDGE_E_DEVICE;
    ctx_guard g;
    ctx_enter(d, &g);
    CUresult r = free_managed((CUdeviceptr)b.ptr);
    ctx_exit(&g);
    if (r != CUDA_SUCCESS) { /* recorded, never raised: the budget goes back all the same */
        bridge_note_driver_error(r);
        atomic_fetch_add_explicit(&d->num_driver_errors, 1, RELAXED);
    }
    atomic_fetch_sub(&bytes_of[b.device], b.size);
    atomic_fetch_sub(&blocks_of[b.device], 1);
    give_back(d, b.device, b.tag, b.size, 1);
    return BRIDGE_OK;
}

int bridge_managed_stats(int device, uint64_t *bytes, uint64_t *nblocks)
{
    *bytes = *nblocks = 0;
    if (device < 0 || device >= BRIDGE_MAX_DEVICES)
        return BRIDGE_E_DEVICE;
    *bytes = atomic_load(&bytes_of[device]);
    *nblocks = atomic_load(&blocks_of[device]);
    return BRIDGE_OK;
}
