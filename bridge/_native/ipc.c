/* SPDX-License-Identifier: Apache-2.0 */
/* ipc.c: blocks shared with other processes of the same user.
 *
 * Under unify(ipc=True) each device's allocations come from a pool the
 * bridge creates with POSIX file-descriptor export (bridge_ipc_enable), in
 * the same ledger, budget and cache as the default pool's.  A block is
 * shared by a handle (bridge_ipc_export): the block's export data
 * (cuMemPoolExportPointer), its address and size here, and the name of this
 * process's Unix socket.  The pool's descriptor never travels in the
 * handle: an importer asks the socket for it, and the server thread sends
 * it (SCM_RIGHTS) only to a peer whose credentials (SO_PEERCRED) show this
 * process's user; others are told they are refused and closed.
 *
 * Holds: an importer holds every block it imported over its connection
 * (HOLD when it imports, DROP when it lets go); a block its owner frees
 * while held is freed when the last hold drops, and a connection that
 * closes (the importer let go of everything, exited or was killed) drops
 * its holds.  The block stays in the owner's ledger the whole time (the
 * importer's imports are in no ledger), so the budget counts it once
 * (IPC_HELD, block.h).
 *
 * Importing (bridge_ipc_import): one connection and one imported pool per
 * exporter and device, kept for the process's life; a pointer imported from
 * it, freed in this process by bridge_ipc_release (after this device's work
 * is done), then dropped.
 *
 * Locks: serve_lock (the server's state and the holds) is taken before a
 * records shard lock (a HOLD looks the block up) and under no other lock
 * (the frees ask it first); client_lock (the importer's connections and
 * pointers) is a leaf; driver calls under it are the import's, and
 * bridge_free runs outside both.
 */
#define _GNU_SOURCE /* accept4, struct ucred */
#include "ipc.h"
#include "ledger.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define HANDLE_MAGIC   "BRIDGEIP"
#define HANDLE_VERSION 1u
#define MAX_CONNS      256

typedef struct ipc_handle {
    char magic[8];
    uint32_t version;
    int32_t device; /* the exporter's device ordinal */
    uint64_t ptr;   /* the block, in the exporter */
    uint64_t size;
    char sock[56]; /* the exporter's abstract socket name, NUL-terminated */
    bridge_CUmemPoolPtrExportData data;
} ipc_handle;
_Static_assert(sizeof(ipc_handle) == BRIDGE_IPC_HANDLE_SIZE, "handle size");

enum { OP_POOL = 1, OP_HOLD = 2, OP_DROP = 3 };
enum { ST_OK = 0, ST_REFUSED = 1, ST_NODEVICE = 2, ST_NOBLOCK = 3, ST_DRIVER = 4, ST_FULL = 5 };

typedef struct request {
    uint32_t op;
    int32_t device;
    uint64_t ptr;
} request;

/* Each thread's last failure, in words: on the heap (the core's static TLS
 * block stays small, tls.h), freed when the thread ends. */
#define ERROR_TEXT 320
static pthread_key_t error_key;
static pthread_once_t error_once = PTHREAD_ONCE_INIT;

static void make_error_key(void)
{
    pthread_key_create(&error_key, free);
}

static char *error_text(void)
{
    pthread_once(&error_once, make_error_key);
    char *t = pthread_getspecific(error_key);
    if (!t && (t = calloc(1, ERROR_TEXT)) != NULL && pthread_setspecific(error_key, t) != 0) {
        free(t);
        t = NULL;
    }
    return t;
}

static int fail(int rc, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(int rc, const char *fmt, ...)
{
    char *t = error_text();
    if (t) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(t, ERROR_TEXT, fmt, ap);
        va_end(ap);
    }
    return rc;
}

const char *bridge_ipc_error(void)
{
    const char *t = error_text();
    return t ? t : "out of host memory";
}

/* ---- the exportable pools ---- */
static pthread_mutex_t enable_lock = PTHREAD_MUTEX_INITIALIZER;
/* pools bridge_ipc_disable put away, for the next bridge_ipc_enable of the
 * device (never destroyed: an allocation that read the pool before it was
 * put away may still land in it) */
static CUmemoryPool put_away[BRIDGE_MAX_DEVICES];

void ipc_setup(void);
static int pool_exported(int device);

int bridge_ipc_enable(int device)
{
    ipc_setup();
    int rc = BRIDGE_OK;
    device_state *d = device_use(device, &rc);
    if (!d)
        return rc;
    pthread_mutex_lock(&enable_lock);
    CUmemoryPool again = put_away[device];
    if (!atomic_load(&d->ipc_pool) && again) {
        put_away[device] = NULL;
        uint64_t t = atomic_load(&d->release_threshold);
        bridge_drv.cuMemPoolSetAttribute(again, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &t);
        atomic_store_explicit(&d->ipc_pool, again, memory_order_release);
    }
    if (!atomic_load(&d->ipc_pool)) {
        bridge_CUmemPoolProps props;
        memset(&props, 0, sizeof props);
        props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = d->dev;
        CUmemoryPool p = NULL;
        ctx_guard g;
        ctx_enter(d, &g);
        CUresult r = bridge_drv.cuMemPoolCreate(&p, &props);
        ctx_exit(&g);
        if (r != CUDA_SUCCESS) {
            bridge_note_driver_error(r);
            rc = fail(BRIDGE_E_IPC,
                      "the driver cannot create a pool with POSIX file-descriptor export on "
                      "device %d (%s): leave ipc off, or update the driver",
                      device, bridge_driver_error_name(r));
        } else {
            /* the default pool's release threshold; the peers' access is
             * granted to both pools by bridge_grant_peer_access, which
             * unify() calls after this */
            uint64_t t = atomic_load(&d->release_threshold);
            bridge_drv.cuMemPoolSetAttribute(p, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &t);
            atomic_store_explicit(&d->ipc_pool, p, memory_order_release);
        }
    }
    pthread_mutex_unlock(&enable_lock);
    return rc;
}

int bridge_ipc_disable(int device)
{
    ipc_setup();
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_DEVICE;
    if (!atomic_load(&d->ipc_pool))
        return BRIDGE_OK;
    if (pool_exported(device))
        return fail(BRIDGE_E_IPC,
                    "a block of device %d's exportable pool was shared with another process "
                    "already: the pool stays, so that what was shared stays valid",
                    device);
    /* the cached blocks back to the pool (outside enable_lock, a leaf) */
    int rc = bridge_trim(device, 0);
    if (rc != BRIDGE_OK)
        return rc;
    pthread_mutex_lock(&enable_lock);
    CUmemoryPool p = atomic_load(&d->ipc_pool);
    uint64_t used = 0;
    ctx_guard g;
    ctx_enter(d, &g);
    int mode = capture_mode_relax(); /* as every pool call: no capture invalidated */
    CUresult r = p ? bridge_drv.cuMemPoolGetAttribute(p, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used)
                   : CUDA_SUCCESS;
    if (r != CUDA_SUCCESS) {
        bridge_note_driver_error(r);
        rc = BRIDGE_E_DRIVER;
    } else if (used) {
        rc = fail(BRIDGE_E_IPC,
                  "device %d's exportable pool holds %llu bytes of live blocks: it stays, and "
                  "the allocations go on from it",
                  device, (unsigned long long)used);
    } else if (p) {
        /* new allocations from the default pool; a free needs no pool */
        atomic_store_explicit(&d->ipc_pool, NULL, memory_order_release);
        put_away[device] = p;
        bridge_drv.cuMemPoolTrimTo(p, 0);
    }
    capture_mode_exit(mode);
    ctx_exit(&g);
    pthread_mutex_unlock(&enable_lock);
    return rc;
}

int bridge_ipc_enabled(int device)
{
    device_state *d = device_of(device);
    return d && atomic_load(&d->ipc_pool) != NULL;
}

/* ---- the server: the pools' descriptors and the holds ---- */
typedef struct hold {
    uintptr_t ptr;
    int conn;  /* the connection's fd */
    int count; /* imports of the block over that connection */
} hold;
typedef struct freed_block {
    uintptr_t ptr;
} freed_block;

static pthread_mutex_t serve_lock = PTHREAD_MUTEX_INITIALIZER;
static char sock_name[56];
static int listen_fd = -1;
static int pool_fd[BRIDGE_MAX_DEVICES]; /* exported descriptor + 1; 0: not yet */
static hold *holds;
static size_t nholds, capholds;
static uintptr_t *freed; /* blocks their owner freed while held */
static size_t nfreed, capfreed;
static _Atomic uint64_t num_refused;
_Atomic int bridge_ipc_holding; /* nholds, for the frees' one load */

static int find_hold(uintptr_t ptr, int conn)
{
    for (size_t i = 0; i < nholds; i++)
        if (holds[i].ptr == ptr && (conn < 0 || holds[i].conn == conn))
            return (int)i;
    return -1;
}

static int is_freed(uintptr_t ptr)
{
    for (size_t i = 0; i < nfreed; i++)
        if (freed[i] == ptr)
            return (int)i;
    return -1;
}

int ipc_free_held(uintptr_t ptr)
{
    pthread_mutex_lock(&serve_lock);
    int held = find_hold(ptr, -1) >= 0;
    if (held && is_freed(ptr) < 0) {
        if (nfreed == capfreed) {
            size_t nc = capfreed ? capfreed * 2 : 16;
            uintptr_t *n = realloc(freed, nc * sizeof *n);
            if (!n) {
                held = 0; /* no memory to remember it: freed now (a consumer may still read) */
            } else {
                freed = n;
                capfreed = nc;
            }
        }
        if (held)
            freed[nfreed++] = ptr;
    }
    pthread_mutex_unlock(&serve_lock);
    return held;
}

/* Remove a hold (all of a connection's counts when `all`); the block, when
 * its owner freed it and nobody holds it any more, goes to *out. */
static int drop_hold(int i, int all, uintptr_t *out)
{
    uintptr_t ptr = holds[i].ptr;
    if (!all && --holds[i].count > 0)
        return 0;
    holds[i] = holds[--nholds];
    atomic_store(&bridge_ipc_holding, (int)nholds);
    int f;
    if (find_hold(ptr, -1) < 0 && (f = is_freed(ptr)) >= 0) {
        freed[f] = freed[--nfreed];
        *out = ptr;
        return 1;
    }
    return 0;
}

static int send_status(int fd, int32_t status, int pass_fd)
{
    struct iovec io = {&status, sizeof status};
    struct msghdr m;
    memset(&m, 0, sizeof m);
    m.msg_iov = &io;
    m.msg_iovlen = 1;
    char cbuf[CMSG_SPACE(sizeof(int))];
    if (pass_fd >= 0) {
        memset(cbuf, 0, sizeof cbuf);
        m.msg_control = cbuf;
        m.msg_controllen = sizeof cbuf;
        struct cmsghdr *c = CMSG_FIRSTHDR(&m);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
    }
    ssize_t n;
    do
        n = sendmsg(fd, &m, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    return n == (ssize_t)sizeof status ? 0 : -1;
}

static int export_pool_fd(int device)
{
    device_state *d = device_of(device);
    CUmemoryPool p = d ? atomic_load(&d->ipc_pool) : NULL;
    if (!p)
        return -1;
    pthread_mutex_lock(&serve_lock);
    int fd = pool_fd[device] - 1;
    pthread_mutex_unlock(&serve_lock);
    if (fd >= 0)
        return fd;
    int got = -1;
    ctx_guard g;
    ctx_enter(d, &g);
    CUresult r = bridge_drv.cuMemPoolExportToShareableHandle(
        &got, p, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    ctx_exit(&g);
    if (r != CUDA_SUCCESS) {
        bridge_note_driver_error(r);
        return -1;
    }
    /* kept for this process's life: closed in a program it runs (the driver's
     * descriptor may come without close-on-exec) and in a fork child
     * (forget_after_fork) */
    fcntl(got, F_SETFD, fcntl(got, F_GETFD) | FD_CLOEXEC);
    pthread_mutex_lock(&serve_lock);
    if (pool_fd[device]) { /* another thread's won */
        close(got);
        got = pool_fd[device] - 1;
    } else {
        pool_fd[device] = got + 1;
    }
    pthread_mutex_unlock(&serve_lock);
    return got;
}

/* Whether the pool of `device` was exported (to share a block: the first
 * export exports the pool's descriptor). */
static int pool_exported(int device)
{
    pthread_mutex_lock(&serve_lock);
    int exported = pool_fd[device] != 0;
    pthread_mutex_unlock(&serve_lock);
    return exported;
}

/* One request of connection `fd`; -1 closes it. */
static int serve_request(int fd)
{
    request q;
    ssize_t n;
    do
        n = recv(fd, &q, sizeof q, MSG_WAITALL);
    while (n < 0 && errno == EINTR);
    if (n != (ssize_t)sizeof q)
        return -1;
    if (q.op == OP_POOL) {
        int pfd = q.device >= 0 && q.device < BRIDGE_MAX_DEVICES ? export_pool_fd(q.device) : -1;
        return send_status(fd, pfd >= 0 ? ST_OK : ST_NODEVICE, pfd);
    }
    uintptr_t to_free = 0;
    int32_t st = ST_OK;
    pthread_mutex_lock(&serve_lock);
    if (q.op == OP_HOLD) {
        size_t size;
        int dev, tag;
        int i = find_hold((uintptr_t)q.ptr, fd);
        if (is_freed((uintptr_t)q.ptr) >= 0 ||
            bridge_lookup((void *)(uintptr_t)q.ptr, &size, &dev, &tag) != BRIDGE_OK) {
            st = ST_NOBLOCK;
        } else if (i >= 0) {
            holds[i].count++;
        } else if (nholds == capholds &&
                   !(capholds = capholds ? capholds * 2 : 64,
                     (holds = realloc(holds, capholds * sizeof *holds)) != NULL)) {
            capholds = nholds = 0; /* out of host memory: every hold is lost */
            st = ST_DRIVER;
        } else {
            holds[nholds++] = (hold){(uintptr_t)q.ptr, fd, 1};
            atomic_store(&bridge_ipc_holding, (int)nholds);
        }
    } else if (q.op == OP_DROP) {
        int i = find_hold((uintptr_t)q.ptr, fd);
        if (i < 0)
            st = ST_NOBLOCK;
        else
            drop_hold(i, 0, &to_free);
    } else {
        st = ST_REFUSED;
    }
    pthread_mutex_unlock(&serve_lock);
    if (to_free)
        bridge_free((void *)to_free);
    return send_status(fd, st, -1);
}

static void close_conn(int fd)
{
    uintptr_t *gone = NULL;
    size_t ngone = 0;
    pthread_mutex_lock(&serve_lock);
    for (int i = (int)nholds - 1; i >= 0; i--)
        if (holds[i].conn == fd) {
            uintptr_t p = 0;
            if (drop_hold(i, 1, &p)) {
                uintptr_t *n = realloc(gone, (ngone + 1) * sizeof *n);
                if (n) {
                    gone = n;
                    gone[ngone++] = p;
                }
            }
        }
    pthread_mutex_unlock(&serve_lock);
    for (size_t i = 0; i < ngone; i++)
        bridge_free((void *)gone[i]);
    free(gone);
    close(fd);
}

static void *serve(void *arg)
{
    (void)arg;
    struct pollfd fds[MAX_CONNS + 1];
    int nconn = 0;
    fds[0].fd = listen_fd;
    fds[0].events = POLLIN;
    for (;;) {
        if (poll(fds, (nfds_t)nconn + 1, -1) < 0) {
            if (errno == EINTR)
                continue;
            return NULL;
        }
        for (int i = nconn; i >= 1; i--) {
            if (!fds[i].revents)
                continue;
            if ((fds[i].revents & POLLIN) && serve_request(fds[i].fd) == 0)
                continue;
            close_conn(fds[i].fd);
            fds[i] = fds[nconn--];
        }
        if (fds[0].revents & POLLIN) {
            int c = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);
            if (c < 0)
                continue;
            struct ucred cred;
            socklen_t len = sizeof cred;
            int full = nconn == MAX_CONNS;
            if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.uid != geteuid() ||
                full) {
                atomic_fetch_add(&num_refused, 1);
                send_status(c, full ? ST_FULL : ST_REFUSED, -1);
                close(c);
                continue;
            }
            nconn++;
            fds[nconn].fd = c;
            fds[nconn].events = POLLIN;
            fds[nconn].revents = 0;
        }
    }
}

/* The server, started on the first export: its socket's name in *name. */
static int ensure_server(void)
{
    pthread_mutex_lock(&serve_lock);
    int rc = BRIDGE_OK;
    if (listen_fd < 0) {
        struct sockaddr_un a;
        memset(&a, 0, sizeof a);
        a.sun_family = AF_UNIX;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        snprintf(sock_name, sizeof sock_name, "bridge-ipc-%d-%08lx", (int)getpid(),
                 (unsigned long)(ts.tv_nsec ^ (ts.tv_sec << 20)) & 0xffffffffu);
        memcpy(a.sun_path + 1, sock_name, strlen(sock_name)); /* abstract: no file */
        socklen_t alen =
            (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + strlen(sock_name));
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        pthread_t t;
        pthread_attr_t at;
        if (fd < 0 || bind(fd, (struct sockaddr *)&a, alen) != 0 || listen(fd, 64) != 0) {
            rc = fail(BRIDGE_E_IPC, "cannot open the socket that serves shared blocks: %s",
                      strerror(errno));
            if (fd >= 0)
                close(fd);
        } else {
            listen_fd = fd;
            pthread_attr_init(&at);
            pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
            if (pthread_create(&t, &at, serve, NULL) != 0) {
                rc = fail(BRIDGE_E_IPC, "cannot start the thread that serves shared blocks");
                close(fd);
                listen_fd = -1;
            }
            pthread_attr_destroy(&at);
        }
    }
    pthread_mutex_unlock(&serve_lock);
    return rc;
}

int bridge_ipc_export(void *ptr, unsigned char *out, uint64_t *offset)
{
    ipc_setup();
    *offset = 0;
    size_t size = 0;
    int dev = 0, tag = 0;
    if (bridge_lookup(ptr, &size, &dev, &tag) != BRIDGE_OK)
        return fail(BRIDGE_E_INVALID, "%p is not a block the bridge allocated", ptr);
    device_state *d = device_of(dev);
    if (!d || !atomic_load(&d->ipc_pool))
        return fail(BRIDGE_E_IPC,
                    "device %d allocates from the driver's default pool, whose blocks cannot be "
                    "shared with other processes: call bridge.unify(ipc=True) (or set "
                    "BRIDGE_IPC=1) before the first allocation, or copy it through host memory "
                    "(tensor.cpu())",
                    dev);
    int rc = ensure_server();
    if (rc != BRIDGE_OK)
        return rc;
    /* the driver exports a pointer only from a pool already shared: the
     * pool's descriptor first (once; kept for the importers that ask) */
    if (export_pool_fd(dev) < 0)
        return fail(BRIDGE_E_IPC,
                    "the driver cannot export device %d's exportable pool: leave ipc off, or "
                    "update the driver",
                    dev);
    ipc_handle h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, HANDLE_MAGIC, 8);
    h.version = HANDLE_VERSION;
    h.device = dev;
    h.ptr = (uint64_t)(uintptr_t)ptr;
    h.size = size;
    snprintf(h.sock, sizeof h.sock, "%s", sock_name);
    ctx_guard g;
    ctx_enter(d, &g);
    CUresult r = bridge_drv.cuMemPoolExportPointer(&h.data, (CUdeviceptr)(uintptr_t)ptr);
    ctx_exit(&g);
    if (r != CUDA_SUCCESS) {
        bridge_note_driver_error(r);
        return fail(BRIDGE_E_IPC,
                    "the block at %p (%zu bytes, device %d) cannot be exported (%s): it was "
                    "allocated before bridge.unify(ipc=True), or carved from a chunk "
                    "(BRIDGE_CACHE_CARVE=1 keeps blocks from being shared)",
                    ptr, size, dev, bridge_driver_error_name(r));
    }
    memcpy(out, &h, sizeof h);
    return BRIDGE_OK;
}

uint64_t bridge_ipc_holds(void)
{
    pthread_mutex_lock(&serve_lock);
    uint64_t n = 0;
    for (size_t i = 0; i < nholds; i++)
        n += (uint64_t)holds[i].count;
    pthread_mutex_unlock(&serve_lock);
    return n;
}

uint64_t bridge_ipc_refused(void)
{
    return atomic_load(&num_refused);
}

/* ---- the importer ---- */
typedef struct peer {
    char sock[56];
    int fd;
    CUmemoryPool pools[BRIDGE_MAX_DEVICES]; /* by the exporter's device */
} peer;
typedef struct import {
    uintptr_t ptr; /* here */
    uintptr_t src; /* in the exporter */
    int peer, device;
} import;

static pthread_mutex_t client_lock = PTHREAD_MUTEX_INITIALIZER;
static peer *peers;
static size_t npeers;
static import *imports;
static size_t nimports, capimports;

static int ask(int fd, uint32_t op, int device, uint64_t ptr, int *passed)
{
    request q = {op, device, ptr};
    ssize_t n;
    do
        n = send(fd, &q, sizeof q, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    /* An exporter that refuses a connection (another user's, or serving its
     * most) says why and closes it at once, maybe before the request is sent:
     * the answer is read even then. */
    if (n != (ssize_t)sizeof q && !(n < 0 && (errno == EPIPE || errno == ECONNRESET)))
        return -1;
    int32_t st = -1;
    struct iovec io = {&st, sizeof st};
    char cbuf[CMSG_SPACE(sizeof(int))];
    struct msghdr m;
    memset(&m, 0, sizeof m);
    m.msg_iov = &io;
    m.msg_iovlen = 1;
    m.msg_control = cbuf;
    m.msg_controllen = sizeof cbuf;
    do
        n = recvmsg(fd, &m, MSG_WAITALL | MSG_CMSG_CLOEXEC);
    while (n < 0 && errno == EINTR);
    if (n != (ssize_t)sizeof st)
        return -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            int got;
            memcpy(&got, CMSG_DATA(c), sizeof got);
            if (passed && *passed < 0)
                *passed = got;
            else
                close(got);
        }
    return st;
}

static int connect_peer(const char *sock)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_un a;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    size_t len = strnlen(sock, 55);
    memcpy(a.sun_path + 1, sock, len);
    if (connect(fd, (struct sockaddr *)&a,
                (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + len)) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* The imported pool of the handle's exporter and device (client_lock held). */
static int peer_pool(const ipc_handle *h, int *pi, CUmemoryPool *out)
{
    size_t i = 0;
    for (; i < npeers; i++)
        if (strncmp(peers[i].sock, h->sock, sizeof h->sock) == 0)
            break;
    if (i == npeers) { /* an exporter met first: its slot, connected below */
        peer *n = realloc(peers, (npeers + 1) * sizeof *n);
        if (!n)
            return fail(BRIDGE_E_IPC, "out of host memory");
        peers = n;
        memset(&peers[i], 0, sizeof peers[i]);
        memcpy(peers[i].sock, h->sock, sizeof h->sock);
        peers[i].sock[sizeof peers[i].sock - 1] = '\0';
        peers[i].fd = -1;
        npeers++;
    }
    if (peers[i].fd < 0) { /* met first, or refused or gone before: connect (again) */
        int fd = connect_peer(h->sock);
        if (fd < 0)
            return fail(BRIDGE_E_IPC,
                        "the process that shared this block (socket %s) is gone or serves no "
                        "blocks: keep it running while others use what it shared",
                        h->sock);
        peers[i].fd = fd;
    }
    *pi = (int)i;
    if (peers[i].pools[h->device]) {
        *out = peers[i].pools[h->device];
        return BRIDGE_OK;
    }
    int pfd = -1;
    int st = ask(peers[i].fd, OP_POOL, h->device, 0, &pfd);
    if (st != ST_OK) {
        if (pfd >= 0)
            close(pfd);
        if (st == ST_REFUSED || st == ST_FULL || st < 0) {
            /* the exporter closed the connection: a later import connects
             * again */
            close(peers[i].fd);
            peers[i].fd = -1;
        }
        if (st == ST_FULL)
            return fail(BRIDGE_E_IPC,
                        "the process that shared this block serves %d processes at once "
                        "already: try again once one of them has released what it imported or "
                        "ended, or share through fewer processes",
                        MAX_CONNS);
        if (st == ST_REFUSED)
            return fail(BRIDGE_E_IPC,
                        "the process that shared this block refused this one: it serves only "
                        "processes of its own user (uid %d here)",
                        (int)geteuid());
        if (st < 0)
            return fail(BRIDGE_E_IPC,
                        "the process that shared this block closed the connection (it ended, "
                        "or refused this process): keep it running while others use what it "
                        "shared");
        return fail(BRIDGE_E_IPC, "the process that shared this block cannot export its pool");
    }
    if (pfd < 0)
        return fail(BRIDGE_E_IPC, "the pool's descriptor did not arrive");
    CUmemoryPool p = NULL;
    CUresult r = bridge_drv.cuMemPoolImportFromShareableHandle(
        &p, (void *)(intptr_t)pfd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    close(pfd);
    if (r != CUDA_SUCCESS) {
        bridge_note_driver_error(r);
        return fail(BRIDGE_E_IPC, "the driver cannot import the exporter's pool (%s)",
                    bridge_driver_error_name(r));
    }
    /* the importer's access is its own to set (the pool's device has it
     * already, and a refusal here then changes nothing) */
    int here = 0;
    CUcontext ctx = NULL;
    if (bridge_drv.cuCtxGetCurrent(&ctx) == CUDA_SUCCESS && ctx &&
        bridge_drv.cuCtxGetDevice(&here) == CUDA_SUCCESS) {
        bridge_CUmemAccessDesc desc = {{CU_MEM_LOCATION_TYPE_DEVICE, here},
                                       CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
        bridge_drv.cuMemPoolSetAccess(p, &desc, 1);
    }
    peers[i].pools[h->device] = p;
    *out = p;
    return BRIDGE_OK;
}

int bridge_ipc_import(const unsigned char *handle, size_t len, int device, void **out)
{
    ipc_setup();
    *out = NULL;
    ipc_handle h;
    if (len != sizeof h)
        return fail(BRIDGE_E_INVALID, "a shared block's handle is %d bytes, not %zu",
                    BRIDGE_IPC_HANDLE_SIZE, len);
    memcpy(&h, handle, sizeof h);
    if (memcmp(h.magic, HANDLE_MAGIC, 8) != 0 || h.version != HANDLE_VERSION || h.device < 0 ||
        h.device >= BRIDGE_MAX_DEVICES || !memchr(h.sock, '\0', sizeof h.sock))
        return fail(BRIDGE_E_INVALID,
                    "not a handle of a block the bridge shared (the sending process must run "
                    "the same version of the bridge, under unify(ipc=True))");
    int rc = BRIDGE_OK;
    device_state *d = device_use(device, &rc);
    if (!d)
        return rc;
    pthread_mutex_lock(&client_lock);
    int pi = -1;
    CUmemoryPool pool = NULL;
    ctx_guard g;
    ctx_enter(d, &g);
    rc = peer_pool(&h, &pi, &pool);
    if (rc == BRIDGE_OK && nimports == capimports) {
        size_t nc = capimports ? capimports * 2 : 64;
        import *n = realloc(imports, nc * sizeof *n);
        if (!n)
            rc = fail(BRIDGE_E_IPC, "out of host memory");
        else
            imports = n, capimports = nc;
    }
    if (rc == BRIDGE_OK) {
        int st = ask(peers[pi].fd, OP_HOLD, h.device, h.ptr, NULL);
        if (st != ST_OK)
            rc = fail(BRIDGE_E_IPC,
                      st == ST_NOBLOCK
                          ? "the shared block was freed by the process that shared it before "
                            "it was imported: keep the sender's tensor alive until it is received"
                          : "the process that shared this block did not answer");
    }
    if (rc == BRIDGE_OK) {
        CUdeviceptr p = 0;
        CUresult r = bridge_drv.cuMemPoolImportPointer(&p, pool, &h.data);
        if (r != CUDA_SUCCESS || !p) {
            bridge_note_driver_error(r);
            ask(peers[pi].fd, OP_DROP, h.device, h.ptr, NULL);
            rc = fail(BRIDGE_E_IPC, "the driver cannot import the shared block (%s)",
                      bridge_driver_error_name(r));
        } else {
            imports[nimports++] = (import){(uintptr_t)p, (uintptr_t)h.ptr, pi, device};
            *out = (void *)(uintptr_t)p;
        }
    }
    ctx_exit(&g);
    pthread_mutex_unlock(&client_lock);
    return rc;
}

void bridge_ipc_release(void *ptr)
{
    pthread_mutex_lock(&client_lock);
    size_t i = 0;
    while (i < nimports && imports[i].ptr != (uintptr_t)ptr)
        i++;
    if (i == nimports) {
        pthread_mutex_unlock(&client_lock);
        return;
    }
import im = imports[i];
    imports[i] = imports[--nimports];
    pthread_mutex_unlock(&client_lock);
    device_state *d = device_of(im.device);
    if (d) {
        ctx_guard g;
        ctx_enter(d, &g);
        int mode = capture_mode_relax();
        /* this device's work that may read the block is done before the
         * exporter may reuse it: every stream of the context, unless a
         * capture runs (a synchronization would invalidate it: then torch's
         * own order stands, its consumer synchronizing its stream before
         * it lets the producer's ref count go) */
        if (sync_enter(d))
            bridge_drv.cuCtxSynchronize();
        sync_exit(d);
        /* the core's non-blocking side stream: never ordered after a
         * capturing stream */
        bridge_drv.cuMemFreeAsync((CUdeviceptr)im.ptr, d->side);
        bridge_drv.cuStreamSynchronize(d->side);
        capture_mode_exit(mode);
        ctx_exit(&g);
    }
    pthread_mutex_lock(&client_lock);
    ask(peers[im.peer].fd, OP_DROP, 0, im.src, NULL);
    pthread_mutex_unlock(&client_lock);
}

uint64_t bridge_ipc_imported(void)
{
    pthread_mutex_lock(&client_lock);
    uint64_t n = nimports;
    pthread_mutex_unlock(&client_lock);
    return n;
}

/* ---- fork ---- */
/* The child serves nothing and imports nothing: the parent's socket, its
 * pools' exported descriptors and its connections are closed there (the
 * parent's stay open), no lock taken. */
static void forget_after_fork(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    serve_lock = fresh;
    client_lock = fresh;
    enable_lock = fresh;
    if (listen_fd >= 0)
        close(listen_fd);
    listen_fd = -1;
    for (size_t i = 0; i < npeers; i++)
        if (peers[i].fd >= 0)
            close(peers[i].fd);
    npeers = 0;
    nimports = nholds = nfreed = 0;
    atomic_store(&bridge_ipc_holding, 0);
    for (int i = 0; i < BRIDGE_MAX_DEVICES; i++)
        if (pool_fd[i])
            close(pool_fd[i] - 1);
    memset(pool_fd, 0, sizeof pool_fd);
}

static void register_fork(void)
{
    pthread_atfork(NULL, NULL, forget_after_fork);
}

void ipc_setup(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_fork);
}
