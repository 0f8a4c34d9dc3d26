/* SPDX-License-Identifier: Apache-2.0 */
/* share.c: one budget for every bridge process on a GPU (unify(share=...)).
 *
 * Glossary
 *   group    the processes of one user that pass the same share name for the
 *            same physical GPU (found by its UUID: CUDA_VISIBLE_DEVICES may
 *            number it differently in each process).
 *   file     <dir>/bridge-<uid>-<gpu uuid>-<hash of the name>, mode 0600,
 *            mapped by every member: a header and SHARE_SLOTS member slots.
 *   claim    what a member may hold on the device, in SHARE_UNIT units: an
 *            upper bound of its pool's RESERVED_MEM_CURRENT (live blocks,
 *            the bridge's cached blocks, free memory the pool keeps) plus
 *            the growth of its allocations in flight.
 *   word     a slot's one 64-bit atomic: generation | pid | claim units.
 *            Every change of a slot's owner or claim is one compare-and-swap
 *            of it, so no lock exists that a killed process could leave held.
 *
 * Invariant: the sum of the claims never passes the budget.  A member raises
 * its own claim first and then sums every slot; past the budget it takes the
 * raise back (its own allocations see a raise only once it is admitted).
 * Two members racing at the edge may both be refused, never both admitted
 * (each one's sum includes the other's raise: the operations are
 * sequentially consistent).  A member's claim covers its pool because
 * the pool grows only by allocations, each by at most its size rounded up to
 * the pool's growth chunk (SHARE_GROWTH; claimed while the allocation is in
 * flight; checked after each allocation that raised the claim and by the
 * service thread every round; a larger growth is counted in `overshoots` and
 * claimed at once).  An allocation the claim already covers costs one pool
 * attribute read and two atomic adds of this process's own counters.
 *
 * Giving memory back.  A member's pool keeps what its frameworks free (the
 * bridge's release threshold): the claim stays until the member trims.  A
 * member refused by the group (1) takes back the claims of dead members
 * (pid gone, a zombie, or a pid reused by a process with another start
 * time), (2) trims its own pool, (3) raises the other members' trim counters
 * and wakes them (a futex on the shared mapping), waits for their answers
 * (at most SHARE_ANSWER_WAIT_NS), and tries again.  Each member has one
 * service thread per group, asleep on its slot's trim counter: it trims the
 * pool (bridge_trim: the cache, the frees in flight, cuMemPoolTrimTo) and
 * lowers the claim, publishes its figures for `bridge stats`, and every
 * second takes back the claims of dead members.  A member that leaves a
 * request unanswered for SHARE_UNRESPONSIVE_NS is counted unresponsive and
 * not waited for again until it answers.
 *
 * The file is trusted for nothing but numbers: the slot count and sizes are
 * this build's, every index is bounded by them, a header that does not
 * match field by field is refused at join with a message, and sums saturate.
 */
#define _GNU_SOURCE
#include "share.h"
#include "ledger.h"
#include "cache.h"
#include "wait.h"

#include <errno.h>
#include <limits.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* ---- the file's layout (version 1) ---- */
#define SHARE_MAGIC    0x3152485347445242ull /* "BRDGSHR1" */
#define SHARE_VERSION  2u                    /* 2: room for 8 framework tags per slot */
#define SHARE_TAGS     8 /* framework tags a slot has room for (BRIDGE_NTAGS used) */
#define SHARE_SLOTS    64u
#define SHARE_NAME_MAX 63
#define SHARE_UNIT     (2ull << 20) /* claim granule */
/* How much the driver's default pool may grow for one allocation: its size
 * rounded up to this.  Measured on an H200 (CUDA 13 driver): the pool maps
 * memory in 32 MiB chunks (a 512 B request grows it by 32 MiB, 33 MiB by 64
 * MiB; scripts/pool_growth_probe.py).  BRIDGE_SHARE_GROWTH (bytes, a
 * multiple of SHARE_UNIT) sets another, read at join. */
#define SHARE_GROWTH   (32ull << 20)
#define SHARE_SLACK \
    (64ull << 20) /* a claim above the pool by more is lowered after an allocation */
#define SHARE_ANSWER_WAIT_NS  500000000ull  /* how long a refused member waits for trims */
#define SHARE_UNRESPONSIVE_NS 1000000000ull /* a request older than this: unresponsive */
#define SHARE_TICK_NS         250000000ull  /* the service thread's round */
#define SHARE_SCAN_NS         1000000000ull /* its scan for dead members */

/* A test's hook between reclaim_dead's two reads of a slot (tests/native). */
#ifndef SHARE_TEST_BETWEEN_READS
#define SHARE_TEST_BETWEEN_READS(slot) ((void)0)
#endif

#define W_UNIT_BITS 28
#define W_PID_BITS  22
#define W_UNIT_MASK ((1ull << W_UNIT_BITS) - 1)
#define W_PID_MASK  ((1ull << W_PID_BITS) - 1)

typedef struct share_header {
    _Atomic uint64_t magic;        /* SHARE_MAGIC once the header is complete (stored last) */
    uint32_t version;              /* SHARE_VERSION */
    uint32_t header_size;          /* sizeof(share_header) */
    uint32_t slot_size;            /* sizeof(share_slot) */
    uint32_t nslots;               /* SHARE_SLOTS */
    uint64_t unit;                 /* SHARE_UNIT */
    _Atomic uint64_t budget;       /* bytes; the claims never sum above it */
    uint32_t uid;                  /* the owner (also checked with fstat) */
    _Atomic uint32_t answers;      /* futex: +1 after every trim a member served */
    uint8_t uuid[16];              /* the GPU */
    char name[SHARE_NAME_MAX + 1]; /* the share's name, NUL-terminated */
    uint8_t pad[128];
} share_header;

typedef struct share_slot {
    _Atomic uint64_t word;      /* gen:14 | pid:22 | claim units:28; pid 0 = free */
    _Atomic uint64_t start;     /* the owner's start time (/proc/<pid>/stat field 22);
                                    0 while the slot is being set up */
    _Atomic uint32_t trim_req;  /* futex: trims asked of the owner */
    _Atomic uint32_t trim_done; /* trims it served; == trim_req when none waits */
    _Atomic uint64_t asked_at;  /* CLOCK_MONOTONIC ns of the oldest unanswered request; 0: none */
    _Atomic uint64_t heartbeat; /* CLOCK_MONOTONIC ns of the service thread's last round */
    _Atomic uint64_t tag_bytes[SHARE_TAGS]; /* live bytes per framework tag (published) */
    _Atomic uint64_t outside;       /* pool bytes outside the ledger: JAX's, others' (published) */
    _Atomic uint64_t cached;        /* the bridge's cached blocks (published) */
    _Atomic uint64_t pool_reserved; /* RESERVED_MEM_CURRENT (published) */
    _Atomic int32_t device;         /* the owner's ordinal of this GPU */
    _Atomic uint32_t overshoots;    /* growths its claim did not cover in advance */
    _Atomic uint32_t fields_gen;    /* the generation whose owner wrote `start`: until it
                                    equals the word's, `start` is a former owner's */
    uint8_t pad[52];
} share_slot;

_Static_assert(sizeof(share_header) == 256, "share header layout");
_Static_assert(sizeof(share_slot) == 192, "share slot layout");
_Static_assert(BRIDGE_NTAGS <= SHARE_TAGS, "a share slot has room for every framework tag");

#define SHARE_FILE_SIZE (sizeof(share_header) + SHARE_SLOTS * sizeof(share_slot))

static uint64_t w_units(uint64_t w)
{
    return w & W_UNIT_MASK;
}
static uint32_t w_pid(uint64_t w)
{
    return (uint32_t)((w >> W_UNIT_BITS) & W_PID_MASK);
}
static uint32_t w_gen(uint64_t w)
{
    return (uint32_t)(w >> (W_UNIT_BITS + W_PID_BITS));
}
static uint64_t w_make(uint32_t gen, uint32_t pid, uint64_t units)
{
    return ((uint64_t)gen << (W_UNIT_BITS + W_PID_BITS)) |
           (((uint64_t)pid & W_PID_MASK) << W_UNIT_BITS) | (units & W_UNIT_MASK);
}
static uint64_t units_of(uint64_t bytes)
{
    return bytes / SHARE_UNIT + (bytes % SHARE_UNIT != 0);
}

/* a -= v, never below 0 (an allocation that began before the process joined
 * settles after it without having been added) */
static void sub_floor(_Atomic uint64_t *a, uint64_t v)
{
    uint64_t cur = atomic_load(a);
    while (!atomic_compare_exchange_weak(a, &cur, cur > v ? cur - v : 0))
        ;
}

/* ---- this process in a group ---- */
struct share_member {
    share_header *hdr;
    share_slot *slots; /* SHARE_SLOTS of them */
    share_slot *me;
    int device;
    uint32_t pid, gen;         /* the owner word's pid and generation */
    uint64_t budget_units;     /* the budget at join, in units (rounded down) */
    pthread_mutex_t lock;      /* changes of this process's claim */
    _Atomic uint64_t claim;    /* units; == w_units(me->word) but while a raise is being
                                    decided (under `lock`): then the word holds the raise and
                                    this the claim before it, until the raise is admitted */
    _Atomic uint64_t cap;      /* units; while a lowering of the claim is being decided
                                    (under `lock`), the fast path admits no more than this,
                                    its target.  UINT64_MAX: none */
    _Atomic uint64_t inflight; /* bytes (unit-rounded) between share_reserve and settle */
    pthread_t thread;
    _Atomic uint32_t leaving;       /* futex-woken on me->trim_req: the service thread ends */
    struct share_member *left_next; /* the members this process left (under join_lock) */
    _Atomic uint64_t num_refused, num_asks, num_trims_served, num_reclaimed, num_overshoots,
        num_lost;
    _Atomic uint64_t max_overshoot; /* bytes: the most the pool was above the claim */
    uint64_t growth;                /* bytes: SHARE_GROWTH or BRIDGE_SHARE_GROWTH (set at join) */
    char name[SHARE_NAME_MAX + 1];
    char path[512];
    char real[PATH_MAX]; /* the path with links resolved, as /proc/<pid>/maps names it */
};

/* The most the pool may grow for an allocation of `size`. */
static uint64_t growth_of(const share_member *m, uint64_t size)
{
    uint64_t g = m->growth;
    return size / g * g + (size % g ? g : 0);
}

/* BRIDGE_SHARE_GROWTH as Python parsed it (units allowed; 0: not given), for the next join. */
static _Atomic uint64_t growth_given;

int bridge_share_set_growth(uint64_t bytes)
{
    if (bytes && (bytes % SHARE_UNIT || bytes > (1ull << 40)))
        return BRIDGE_E_INVALID;
    atomic_store(&growth_given, bytes);
    return BRIDGE_OK;
}

static uint64_t growth_setting(void)
{
    uint64_t given = atomic_load(&growth_given);
    if (given)
        return given;
    const char *e = getenv("BRIDGE_SHARE_GROWTH");
    char *end = NULL;
    unsigned long long v = e && *e ? strtoull(e, &end, 10) : 0;
    if (!v || (end && *end) || v % SHARE_UNIT || v > (1ull << 40))
        return SHARE_GROWTH;
    return v;
}

static char share_error_text[768];
static pthread_mutex_t join_lock = PTHREAD_MUTEX_INITIALIZER;
/* Members this process left (bridge_share_leave), kept with their mappings
 * for the process's life: a thread that read d->share before may use them. */
static share_member *left_members;

const char *bridge_share_error(void)
{
    return share_error_text;
}

static int fail(const char *fmt, const char *a, const char *b)
{
    snprintf(share_error_text, sizeof share_error_text, fmt, a, b);
    return BRIDGE_E_SHARE;
}

/* ---- small system helpers ---- */
static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* A futex of a MAP_SHARED mapping: not the private kind. */
static void futex_wait(_Atomic uint32_t *word, uint32_t seen, uint64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, seen, &ts, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *word)
{
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
}

/* The start time (clock ticks after boot) and state of a process; 0 when
 * its /proc entry cannot be read. */
static uint64_t proc_start(uint32_t pid, char *state)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%u/stat", pid);
    *state = '?';
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the command may hold spaces and parentheses */
    if (!p || p[1] != ' ')
        return 0;
    p += 2;
    *state = *p;
    /* field 3 is the state; field 22 the start time: 19 more spaces */
    for (int field = 3; field < 22 && p; field++) {
        p = strchr(p, ' ');
        if (p)
            p++;
    }
    return p ? strtoull(p, NULL, 10) : 0;
}

/* Whether process `pid` maps the file `real` (its /proc/<pid>/maps names
 * it); 1 when that cannot be read. */
static int maps_file(uint32_t pid, const char *real)
{
    char path[64], line[4096];
    snprintf(path, sizeof path, "/proc/%u/maps", pid);
    FILE *f = fopen(path, "re");
    if (!f)
        return errno == ENOENT ? 0 : 1;
    size_t n = strlen(real);
    int found = 0;
    while (!found && fgets(line, sizeof line, f)) {
        size_t len = strlen(line);
        while (len && (line[len - 1] == '\n' || line[len - 1] == ' '))
            line[--len] = 0;
        found = len >= n && strcmp(line + len - n, real) == 0;
    }
    fclose(f);
    return found;
}

/* 0 only when the slot's owner is surely gone: no such pid, a zombie, or
 * the pid now names a process that started at another time.  A slot whose
 * start time is 0 is being set up, or was written by someone else: its pid
 * must map the file (`real`) to count as a member. */
static int owner_alive(uint32_t pid, uint64_t start, const char *real)
{
    if (pid == 0)
        return 0;
    if (kill((pid_t)pid, 0) != 0 && errno == ESRCH)
        return 0;
    char state;
    uint64_t st = proc_start(pid, &state);
    if (st == 0)
        return 1; /* cannot tell (no /proc): alive */
    if (state == 'Z' || state == 'X')
        return 0;
    if (start == 0)
        return !real || maps_file(pid, real);
    return st == start;
}

/* ---- claims ---- */
static uint64_t group_units(share_member *m)
{
    uint64_t sum = 0;
    for (uint32_t i = 0; i < SHARE_SLOTS; i++) {
        uint64_t u = w_units(atomic_load(&m->slots[i].word));
        sum = sum + u < sum ? UINT64_MAX : sum + u; /* a corrupt file cannot wrap it */
    }
    return sum;
}

/* Write `units` in this process's slot word (under m->lock), the figure the
 * group sums.  0 when the slot is no longer ours (taken back by a member
 * that thought us dead, or written over): the claim is then lost. */
static int word_set(share_member *m, uint64_t units)
{
    uint64_t o = atomic_load(&m->me->word);
    for (;;) {
        if (w_pid(o) != m->pid || w_gen(o) != m->gen) {
            atomic_fetch_add(&m->num_lost, 1);
            return 0;
        }
        if (atomic_compare_exchange_weak(&m->me->word, &o, w_make(m->gen, m->pid, units)))
            return 1;
    }
}

/* Set this process's claim to `units` (under m->lock): the word, then the
 * figure the fast path reads. */
static int claim_set(share_member *m, uint64_t units)
{
    if (!word_set(m, units))
        return 0;
    atomic_store(&m->claim, units);
    return 1;
}

/* Raise the claim to `want` units (under m->lock); BRIDGE_E_BUDGET when the
 * group's claims would pass the budget (the raise is taken back). */
static int claim_raise(share_member *m, uint64_t want, int force)
{
    uint64_t have = atomic_load(&m->claim);
    if (want <= have)
        return BRIDGE_OK;
    if (want > W_UNIT_MASK)
        return BRIDGE_E_BUDGET;
    if (force)
        return claim_set(m, want) ? BRIDGE_OK : BRIDGE_E_BUDGET;
    /* A raise may be taken back: the group sees it at once (in the word,
     * before the sum is read: see the banner), this process's fast path only
     * once it is admitted (m->claim).  A fast path that read the raised
     * claim before the take-back would admit growth that nothing claims. */
    if (!word_set(m, want))
        return BRIDGE_E_BUDGET;
    if (group_units(m) > m->budget_units) {
        word_set(m, have);
        return BRIDGE_E_BUDGET;
    }
    atomic_store(&m->claim, want);
    return BRIDGE_OK;
}

/* Whether the claim covers `need` units for the fast path (see `cap`). */
static int covered(share_member *m, uint64_t need)
{
    uint64_t cap = atomic_load(&m->cap); /* the cap first: see claim_fit_locked */
    uint64_t claim = atomic_load(&m->claim);
    return need <= (cap < claim ? cap : claim);
}

/* The pool's reserved bytes; a failed read gives UINT64_MAX (refuse) when
 * reserving and 0 never. */
static uint64_t pool_reserved(struct device_state *d)
{
    uint64_t v = 0;
    /* (share_reserve's slow path and the service thread run relaxed already;
     * the fast path is the allocation's: relaxed too) */
    int mode = capture_mode_relax();
    CUresult r = pool_figure(d, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &v);
    capture_mode_exit(mode);
    return r == CUDA_SUCCESS ? v : UINT64_MAX;
}

static uint64_t need_units(struct device_state *d, share_member *m)
{
    /* in flight first, the pool second: an allocation that settles between
     * the two reads has grown the pool by then */
    uint64_t in = atomic_load(&m->inflight);
    uint64_t r = pool_reserved(d);
    if (r == UINT64_MAX || r + in < r)
        return UINT64_MAX;
    return units_of(r + in);
}

/* Lower the claim to what the pool holds plus the growth in flight (under m->lock). */
static void claim_fit_locked(struct device_state *d, share_member *m)
{
    uint64_t have = atomic_load(&m->claim);
    uint64_t target = need_units(d, m);
    if (target < have) {
        /* A thread of this process may have passed the fast path against
         * the old claim after `target` was read.  Cap the fast path at the
         * target first, then read again: such a thread's growth is in flight
         * or in the pool by now (it read the cap before the claim). */
        atomic_store(&m->cap, target);
        uint64_t again = need_units(d, m);
        if (again > target)
            target = again;
        if (target < have)
            claim_set(m, target);
        atomic_store(&m->cap, UINT64_MAX);
    }
}

static void claim_fit(struct device_state *d, share_member *m)
{
    pthread_mutex_lock(&m->lock);
    claim_fit_locked(d, m);
    pthread_mutex_unlock(&m->lock);
}

/* ---- dead members ---- */
/* Take back the claims of members that are gone; how many were. */
static int reclaim_dead(share_member *m)
{
    int n = 0;
    for (uint32_t i = 0; i < SHARE_SLOTS; i++) {
        share_slot *s = &m->slots[i];
        if (s == m->me)
            continue;
        uint64_t o = atomic_load(&s->word);
        if (o == 0 || (w_pid(o) == 0 && w_units(o) == 0))
            continue;
        /* the generation first, then the start time: join writes them in the
         * other order (start, then fields_gen), so a generation that matches
         * here vouches for the start time read after it.  Read the other way
         * round, a former owner's start time could be paired with the new
         * owner's generation, and a live member's slot freed. */
        uint32_t fgen = atomic_load(&s->fields_gen);
        SHARE_TEST_BETWEEN_READS(s);
        uint64_t start = atomic_load(&s->start);
        if (fgen != (w_gen(o) & 0xffffffffu))
            start = 0; /* a former owner's: the new one is still setting up */
        if (atomic_load(&s->word) != o)
            continue; /* changing: look again next time */
        if (w_pid(o) != 0 && owner_alive(w_pid(o), start, m->real))
            continue;
        /* gone (or a claim without an owner, from a corrupt write): free the
         * slot with the next generation, so that a slow reclaimer that saw
         * the old word cannot free it again after a new owner took it */
        if (atomic_compare_exchange_strong(&s->word, &o, w_make(w_gen(o) + 1, 0, 0))) {
            atomic_fetch_add(&m->num_reclaimed, 1);
            n++;
        }
    }
    return n;
}

/* A slot of this pid and start time is this process before an exec(): the
 * old image and its CUDA context are gone (its pid and start time stay, so
 * no reclaimer would ever see it dead).  Free it: joining again would
 * otherwise take a second slot and leave the old claim counted for good. */
static void forget_former_image(share_member *m)
{
    char state;
    uint64_t mine = proc_start(m->pid, &state);
    for (uint32_t i = 0; i < SHARE_SLOTS; i++) {
        share_slot *s = &m->slots[i];
        uint64_t o = atomic_load(&s->word);
        if (w_pid(o) != m->pid)
            continue;
        uint32_t fgen = atomic_load(&s->fields_gen);
        uint64_t start = atomic_load(&s->start);
        if (fgen == (w_gen(o) & 0xffffffffu) && start && mine && start != mine)
            continue; /* another process of this pid (another namespace): not ours */
        if (atomic_compare_exchange_strong(&s->word, &o, w_make(w_gen(o) + 1, 0, 0)))
            atomic_fetch_add(&m->num_reclaimed, 1);
    }
}

/* ---- asking the others to trim ---- */
static void ask_others(share_member *m)
{
    uint32_t target[SHARE_SLOTS];
    uint8_t asked[SHARE_SLOTS] = {0};
    int any = 0;
    uint64_t now = now_ns();
    for (uint32_t i = 0; i < SHARE_SLOTS; i++) {
        share_slot *s = &m->slots[i];
        uint64_t w = atomic_load(&s->word);
        if (s == m->me || w_pid(w) == 0 || w_units(w) == 0)
            continue;
        uint32_t req = atomic_load(&s->trim_req), done = atomic_load(&s->trim_done);
        if (req != done) {
            uint64_t at = atomic_load(&s->asked_at);
            if (at && now > at && now - at > SHARE_UNRESPONSIVE_NS)
                continue; /* unresponsive: asked before and silent since */
        } else {
            uint64_t zero = 0;
            atomic_compare_exchange_strong(&s->asked_at, &zero, now);
        }
        target[i] = atomic_fetch_add(&s->trim_req, 1) + 1;
        futex_wake(&s->trim_req);
        asked[i] = 1;
        any = 1;
    }
    if (!any)
        return;
    atomic_fetch_add(&m->num_asks, 1);
    uint64_t deadline = now + SHARE_ANSWER_WAIT_NS;
    for (;;) {
        uint32_t seen = atomic_load(&m->hdr->answers);
        int waiting = 0;
        for (uint32_t i = 0; i < SHARE_SLOTS; i++)
            if (asked[i] && (int32_t)(atomic_load(&m->slots[i].trim_done) - target[i]) < 0)
                waiting = 1;
        uint64_t t = now_ns();
        if (!waiting || t >= deadline)
            return;
        futex_wait(&m->hdr->answers, seen, deadline - t);
    }
}

/* The bytes the other members hold live (published every round). */
static uint64_t others_live(share_member *m)
{
    uint64_t sum = 0;
    for (uint32_t i = 0; i < SHARE_SLOTS; i++) {
        share_slot *s = &m->slots[i];
        if (s == m->me || !w_pid(atomic_load(&s->word)))
            continue;
        for (int t = 0; t < SHARE_TAGS; t++) {
            uint64_t v = atomic_load(&s->tag_bytes[t]);
            sum = sum + v < sum ? UINT64_MAX : sum + v;
        }
    }
    return sum;
}

/* ---- the ledger's calls ---- */
/* 1 between a share_reserve that raised the claim and its share_settle (the
 * same thread: an allocation reserves and settles on one thread). */
static __thread int claim_raised;
/* This thread's last ask of the others: the refused allocation it was made
 * for (wait.c's wait_chain), the wait it was made in (wait_current; 0 before
 * one) and what the others held live then.  A waiting allocation retries
 * many times; asking on each retry made every other member trim over and
 * over (up to 0.5 s each).  So an allocation asks once, in its first try or
 * its recovery chain, and again during its wait only when the others have
 * freed memory since.  A new allocation asks afresh: the others may have
 * freed into their pools since the last one (their published live bytes lag
 * by up to a round), and skipping the ask refused it with the memory idle in
 * their pools (H200). */
static __thread uint64_t asked_chain, asked_wait, asked_live;
static __thread int asked_once; /* the allocation asked_chain names asked */

static int should_ask(share_member *m)
{
    uint64_t w = wait_current(), chain = wait_chain();
    uint64_t live = others_live(m);
    /* the ask of this allocation's try or recovery chain counts for its wait */
    int same = asked_once && asked_chain == chain && (asked_wait == w || asked_wait == 0);
    if (same && live >= asked_live) {
        asked_wait = w;
        return 0;
    }
    asked_once = 1;
    asked_chain = chain;
    asked_wait = w;
    asked_live = live;
    return 1;
}

int share_reserve(struct device_state *d, share_member *m, uint64_t size)
{
    uint64_t g = growth_of(m, size);
    atomic_fetch_add(&m->inflight, g);
    /* fast path: the claim already covers the pool plus what is in flight
     * (one pool attribute read, one atomic add; nothing shared is written) */
    if (covered(m, need_units(d, m)))
        return BRIDGE_OK;
    int rc = BRIDGE_E_BUDGET;
    /* the slow path's driver calls (pool figures, the trim of step 2) never
     * invalidate a capture, seen or not (another thread's, in global mode) */
    int relaxed = capture_mode_relax();
    for (int step = 0; step < 4 && rc != BRIDGE_OK; step++) {
        if (step == 1 && !reclaim_dead(m))
            continue;
        if (step == 2) {
            /* this pool's own idle memory first: it is counted in the claim */
            ctx_guard cg;
            ctx_enter(d, &cg);
            bridge_drv.cuMemPoolTrimTo(d->pool, 0);
            CUmemoryPool x = atomic_load(&d->ipc_pool);
            if (x)
                bridge_drv.cuMemPoolTrimTo(x, 0);
            ctx_exit(&cg);
        }
        if (step == 3) {
            if (!should_ask(m))
                break;
            ask_others(m);
        }
        pthread_mutex_lock(&m->lock);
        rc = claim_raise(m, need_units(d, m), 0);
        pthread_mutex_unlock(&m->lock);
    }
    capture_mode_exit(relaxed);
    if (rc != BRIDGE_OK) {
        sub_floor(&m->inflight, g);
        atomic_fetch_add(&m->num_refused, 1);
        return rc;
    }
    asked_once = 0; /* admitted: the allocation that asked is over */
    claim_raised = 1;
    return BRIDGE_OK;
}

uint64_t share_room(struct device_state *d, share_member *m)
{
    /* a raise of the claim to `need` + g units is admitted while the other
     * members' claims plus it stay within the budget; the claim above `need`
     * is within that already (the claims never sum above the budget) */
    uint64_t need = need_units(d, m);
    uint64_t group = group_units(m), mine = w_units(atomic_load(&m->me->word));
    uint64_t others = group > mine ? group - mine : 0;
    if (need == UINT64_MAX || others + need < others || others + need >= m->budget_units)
        return 0;
    return (m->budget_units - others - need) * SHARE_UNIT;
}

uint64_t share_budget(const share_member *m)
{
    return m->budget_units * SHARE_UNIT;
}

/* The pool against the claim: a pool above it grew by more than the
 * allocations rounded to a unit (counted, and claimed at once: the memory is
 * taken); a claim above the pool and what is in flight by more than
 * SHARE_SLACK is lowered.  The pool alone is compared for the first: the
 * growth of allocations in flight is in both it and `inflight`.  Under the
 * lock, so that the claim compared is the one of the moment the pool was
 * read: a claim read after it may have been lowered meanwhile, after a trim
 * (another thread's) shrank the pool, and a figure of the pool from before
 * that trim is no overshoot of it. */
static void check_pool(struct device_state *d, share_member *m)
{
    pthread_mutex_lock(&m->lock);
    uint64_t r = pool_reserved(d);
    uint64_t have = atomic_load(&m->claim);
    if (r == UINT64_MAX) {
        /* no figure */
    } else if (units_of(r) > have) {
        atomic_max(&m->max_overshoot, (units_of(r) - have) * SHARE_UNIT);
        claim_raise(m, units_of(r), 1);
        atomic_fetch_add(&m->num_overshoots, 1);
        atomic_fetch_add(&m->me->overshoots, 1);
    } else if (have > units_of(r + atomic_load(&m->inflight)) + SHARE_SLACK / SHARE_UNIT) {
        claim_fit_locked(d, m); /* served from memory the pool held: give the rest back */
    }
    pthread_mutex_unlock(&m->lock);
}

void share_settle(struct device_state *d, share_member *m, uint64_t size, int granted)
{
    sub_floor(&m->inflight, growth_of(m, size));
    int raised = claim_raised;
    claim_raised = 0;
    /* after a fast-path reservation nothing more: the service thread checks
     * the pool against the claim every round */
    if (granted && raised)
        check_pool(d, m);
}

/* ---- the service thread ---- */
static void publish(share_member *m)
{
    device_state *d = &bridge_devices[m->device];
    for (int t = 0; t < BRIDGE_NTAGS; t++) {
        uint64_t bytes;
        ledger_tag_live(d, t, &bytes, NULL);
        atomic_store(&m->me->tag_bytes[t], bytes);
    }
    uint64_t outside = 0;
    bridge_others(m->device, &outside);
    atomic_store(&m->me->outside, outside);
    atomic_store(&m->me->cached, cache_bytes(m->device));
    uint64_t r = pool_reserved(d);
    atomic_store(&m->me->pool_reserved, r == UINT64_MAX ? 0 : r);
    atomic_store(&m->me->heartbeat, now_ns());
}

void share_trimmed(struct device_state *d, share_member *m)
{
    claim_fit(d, m);
    publish(m);
}

static void *serve(void *arg)
{
    share_member *m = arg;
    uint64_t last_scan = 0;
    /* This thread is the bridge's own: every driver call it makes (pool
     * figures, trims) runs in relaxed capture mode, so that none of them
     * invalidates a capture another thread runs in global mode, one the
     * core may not know of (XLA's). */
    capture_mode_relax();
    uint32_t served = atomic_load(&m->me->trim_done);
    for (;;) {
        if (bridge_forked())
            return NULL; /* never in a fork child (no thread survives fork), but cheap */
        if (atomic_load(&m->leaving))
            return NULL; /* bridge_share_leave joins this thread */
        uint32_t req = atomic_load(&m->me->trim_req);
        if (req != served) {
            /* cache, frees in flight, pool; lowers the claim.  bridge_trim
             * never synchronizes while a capture runs, known (ledger.h's
             * sync_enter) or not (drain_streams), and trims in relaxed mode:
             * the answer is given all the same, so that nobody waits. */
            bridge_trim(m->device, 0);
            served = req;
            atomic_store(&m->me->trim_done, req);
            atomic_store(&m->me->asked_at, 0);
            atomic_fetch_add(&m->num_trims_served, 1);
            atomic_fetch_add(&m->hdr->answers, 1);
            futex_wake(&m->hdr->answers);
        }
        publish(m);
        check_pool(&bridge_devices[m->device], m);
        uint64_t now = now_ns();
        if (now - last_scan >= SHARE_SCAN_NS) {
            reclaim_dead(m);
            last_scan = now;
        }
        futex_wait(&m->me->trim_req, req, SHARE_TICK_NS);
    }
    return NULL;
}

/* ---- the file ---- */
static int header_matches(const share_header *h, const uint8_t uuid[16], const char *name,
                          const char *path)
{
    const char *why = NULL;
    if (atomic_load(&h->magic) != SHARE_MAGIC)
        why = "its magic number is not bridge's";
    else if (h->version != SHARE_VERSION)
        why = "it is of another layout version (another bridge version is using it)";
    else if (h->header_size != sizeof(share_header) || h->slot_size != sizeof(share_slot) ||
             h->nslots != SHARE_SLOTS || h->unit != SHARE_UNIT)
        why = "its sizes are not this bridge version's";
    else if (h->uid != (uint32_t)geteuid())
        why = "it names another user";
    else if (memcmp(h->uuid, uuid, 16) != 0)
        why = "it names another GPU";
    else if (strncmp(h->name, name, sizeof h->name) != 0 || !memchr(h->name, 0, sizeof h->name))
        why = "it names another share";
    else if (atomic_load(&h->budget) == 0)
        why = "its budget is 0";
    if (!why)
        return BRIDGE_OK;
    return fail("the share file %s is corrupt or not bridge's (%s). Stop the processes that "
                "use the share and remove the file, or use another share name.",
                path, why);
}

static int live_members(share_member *tmp)
{
    int n = 0;
    for (uint32_t i = 0; i < SHARE_SLOTS; i++) {
        uint64_t w = atomic_load(&tmp->slots[i].word);
        uint64_t start = atomic_load(&tmp->slots[i].fields_gen) == w_gen(w)
                             ? atomic_load(&tmp->slots[i].start)
                             : 0;
        if (w_pid(w) && owner_alive(w_pid(w), start, NULL))
            n++;
    }
    return n;
}

/* Open, create or check the group's file and map it; under flock while the
 * header is written or checked (released by the kernel if we die). */
static int open_file(const char *path, const uint8_t uuid[16], const char *name, uint64_t budget,
                     share_member *m)
{
    int fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
        int e = errno;
        if (e == ELOOP)
            return fail("the share file %s is a symbolic link%s; remove it.", path, "");
        if (e == EACCES || e == EPERM)
            return fail("cannot open the share file %s (%s): it belongs to another user or its "
                        "directory is not writable. Remove it, or set BRIDGE_SHARE_DIR to a "
                        "directory of your own.",
                        path, strerror(e));
        return fail("cannot open the share file %s (%s). Set BRIDGE_SHARE_DIR to a writable "
                    "directory.",
                    path, strerror(e));
    }
    flock(fd, LOCK_EX);
    struct stat st;
    int rc = BRIDGE_OK;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
        rc = fail("the share file %s is not a regular file%s; remove it.", path, "");
    else if (st.st_uid != geteuid())
        rc = fail("the share file %s belongs to another user%s: a share is per user. Remove it "
                  "(as its owner), or set BRIDGE_SHARE_DIR to a directory of your own.",
                  path, "");
    else if (st.st_size != 0 && (st.st_mode & 077))
        rc =
            fail("the share file %s can be read or written by other users%s; remove it.", path, "");
    else if (st.st_size != 0 && st.st_size != (off_t)SHARE_FILE_SIZE)
        rc = fail("the share file %s has the wrong size%s: it is corrupt or not bridge's. Stop "
                  "the processes that use the share and remove it.",
                  path, "");
    int fresh = rc == BRIDGE_OK && st.st_size == 0;
    if (fresh && (fchmod(fd, 0600) != 0 || ftruncate(fd, (off_t)SHARE_FILE_SIZE) != 0))
        rc = fail("cannot size the share file %s (%s).", path, strerror(errno));
    void *map = MAP_FAILED;
    if (rc == BRIDGE_OK) {
        map = mmap(NULL, SHARE_FILE_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (map == MAP_FAILED)
            rc = fail("cannot map the share file %s (%s).", path, strerror(errno));
    }
    if (rc == BRIDGE_OK) {
        share_header *h = map;
        m->hdr = h;
        m->slots = (share_slot *)((char *)map + sizeof(share_header));
        /* A complete file of zeros: its creator died before writing the
         * header (no member can exist without it). */
        if (fresh || atomic_load(&h->magic) == 0) {
            if (!budget) {
                rc = fail("the share '%s' does not exist yet on this GPU%s: the first process "
                          "of a share must give its budget (bridge.unify(budget=..., share=...) "
                          "or BRIDGE_GPU_MEMORY_LIMIT).",
                          name, "");
            } else {
                memset(map, 0, SHARE_FILE_SIZE);
                h->version = SHARE_VERSION;
                h->header_size = sizeof(share_header);
                h->slot_size = sizeof(share_slot);
                h->nslots = SHARE_SLOTS;
                h->unit = SHARE_UNIT;
                atomic_store(&h->budget, budget);
                h->uid = (uint32_t)geteuid();
                memcpy(h->uuid, uuid, 16);
                snprintf(h->name, sizeof h->name, "%s", name);
                atomic_store(&h->magic, SHARE_MAGIC);
            }
        } else if ((rc = header_matches(h, uuid, name, path)) == BRIDGE_OK && budget &&
                   atomic_load(&h->budget) != budget) {
            if (live_members(m)) {
                char a[32], b[32];
                snprintf(a, sizeof a, "%llu", (unsigned long long)atomic_load(&h->budget));
                snprintf(b, sizeof b, "%llu", (unsigned long long)budget);
                snprintf(share_error_text, sizeof share_error_text,
                         "the share '%s' on this GPU has a budget of %s bytes and this process "
                         "asked for %s: every process of a share must give the same budget, or "
                         "none (budget=None adopts the share's).",
                         name, a, b);
                rc = BRIDGE_E_SHARE;
            } else {
                atomic_store(&h->budget, budget); /* nobody uses it: the new budget applies */
            }
        }
    }
    flock(fd, LOCK_UN);
    close(fd); /* the mapping stays */
    if (rc != BRIDGE_OK && map != MAP_FAILED)
        munmap(map, SHARE_FILE_SIZE);
    return rc;
}

/* The ledger's questions and news about this process's pool (ledger.h). */
static void listen_to_the_ledger(void)
{
    const ledger_parts parts = {.reserve_growth = share_reserve,
                                .settle_growth = share_settle,
                                .pool_trimmed = share_trimmed,
                                .room = share_room};
    ledger_listen(&parts);
}

static uint64_t fnv1a(const char *s)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
    return h;
}

/* ---- joining ---- */
int bridge_share_join(int device, const char *name, const char *dir, uint64_t budget)
{
    share_error_text[0] = 0;
    if (!name || !*name || strlen(name) > SHARE_NAME_MAX || !dir || !*dir)
        return fail("a share name must have 1 to 63 characters%s%s", "", "");
    if (bridge_forked())
        return BRIDGE_E_FORKED;
    int rc;
    device_state *d = device_use(device, &rc);
    if (!d)
        return rc;
    pthread_mutex_lock(&join_lock);
    share_member *cur = atomic_load(&d->share);
    if (cur) {
        rc = strcmp(cur->name, name) == 0 && (!budget || budget == atomic_load(&cur->hdr->budget))
                 ? BRIDGE_OK
                 : fail("this process already uses the share '%s' on this GPU; a process "
                        "belongs to one share per GPU, with one budget (asked: '%s').",
                        cur->name, name);
        pthread_mutex_unlock(&join_lock);
        return rc;
    }
    uint8_t uuid[16];
    CUresult r = bridge_drv.cuDeviceGetUuid_v2(uuid, d->dev);
    if (r != CUDA_SUCCESS) {
        pthread_mutex_unlock(&join_lock);
        bridge_note_driver_error(r);
        return BRIDGE_E_DRIVER;
    }
    share_member *m = calloc(1, sizeof *m);
    if (!m) {
        pthread_mutex_unlock(&join_lock);
        return fail("no memory to join the share%s%s", "", "");
    }
    char hex[33];
    for (int i = 0; i < 16; i++)
        snprintf(hex + 2 * i, 3, "%02x", uuid[i]);
    snprintf(m->path, sizeof m->path, "%s/bridge-%u-%s-%016llx", dir, (unsigned)geteuid(), hex,
             (unsigned long long)fnv1a(name));
    snprintf(m->name, sizeof m->name, "%s", name);
    m->device = device;
    m->pid = (uint32_t)getpid();
    m->growth = growth_setting();
    atomic_store(&m->cap, UINT64_MAX);
    pthread_mutex_init(&m->lock, NULL);
    rc = open_file(m->path, uuid, name, budget, m);
    if (rc != BRIDGE_OK) {
        free(m);
        pthread_mutex_unlock(&join_lock);
        return rc;
    }
    if (!realpath(m->path, m->real))
        snprintf(m->real, sizeof m->real, "%s", m->path);
    m->budget_units = atomic_load(&m->hdr->budget) / SHARE_UNIT;
    reclaim_dead(m); /* members that ended since anyone last looked */
    forget_former_image(m);
    /* a free slot: pid 0 -> ours, keeping its generation */
    for (int round = 0; round < 2 && !m->me; round++) {
        for (uint32_t i = 0; i < SHARE_SLOTS && !m->me; i++) {
            share_slot *s = &m->slots[i];
            uint64_t o = atomic_load(&s->word);
            if (w_pid(o) != 0 || w_units(o) != 0)
                continue;
            if (atomic_compare_exchange_strong(&s->word, &o, w_make(w_gen(o), m->pid, 0))) {
                m->me = s;
                m->gen = w_gen(o);
            }
        }
        if (!m->me)
            reclaim_dead(m);
    }
    if (!m->me) {
        munmap(m->hdr, SHARE_FILE_SIZE);
        free(m);
        pthread_mutex_unlock(&join_lock);
        return fail("the share '%s' has %s live members already; no slot is free.", name, "64");
    }
    char state;
    share_slot *s = m->me;
    atomic_store(&s->device, device);
    atomic_store(&s->overshoots, 0);
    atomic_store(&s->asked_at, 0);
    atomic_store(&s->trim_done, atomic_load(&s->trim_req)); /* requests to the last owner */
    atomic_store(&s->start, proc_start(m->pid, &state));
    atomic_store(&s->fields_gen, m->gen); /* `start` is ours from now on */
    publish(m);
    /* what the pool holds already (the bridge used before joining) is claimed
     * as it is, within the budget or not */
    pthread_mutex_lock(&m->lock);
    claim_raise(m, need_units(d, m), 1);
    pthread_mutex_unlock(&m->lock);
    if (pthread_create(&m->thread, NULL, serve, m) != 0) {
        atomic_store(&s->word, w_make(m->gen + 1, 0, 0));
        munmap(m->hdr, SHARE_FILE_SIZE);
        free(m);
        pthread_mutex_unlock(&join_lock);
        return fail("cannot start the share's service thread%s%s", "", "");
    }
    /* joinable: bridge_share_leave waits for it to end */
    /* the ledger calls the share through its table, and only for a device
     * whose `share` it read set: the entries are there before the first is */
    static pthread_once_t listen_once = PTHREAD_ONCE_INIT;
    pthread_once(&listen_once, listen_to_the_ledger);
    atomic_store(&d->share, m);
    pthread_mutex_unlock(&join_lock);
    return BRIDGE_OK;
}

/* ---- leaving ---- */
int bridge_share_leave(int device)
{
    if (bridge_forked())
        return BRIDGE_E_FORKED;
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_DEVICE;
    pthread_mutex_lock(&join_lock);
    share_member *m = atomic_load(&d->share);
    if (!m) {
        pthread_mutex_unlock(&join_lock);
        return BRIDGE_OK;
    }
    /* the ledger asks the share no more (an allocation that read the member
     * before this store goes on with it: its raise finds the slot no longer
     * ours below and is refused, as a claim taken back is) */
    atomic_store(&d->share, NULL);
    atomic_store(&m->leaving, 1);
    atomic_fetch_add(&m->me->trim_req, 1); /* the service thread wakes and ends */
    futex_wake(&m->me->trim_req);
    pthread_join(m->thread, NULL);
    /* the requests to it answered, so that no member waits for its trim */
    atomic_store(&m->me->trim_done, atomic_load(&m->me->trim_req));
    atomic_store(&m->me->asked_at, 0);
    /* the slot free with the next generation: the claim goes back to the
     * group and the member is gone from its slots (as a dead member's is) */
    pthread_mutex_lock(&m->lock);
    uint64_t o = atomic_load(&m->me->word);
    while (w_pid(o) == m->pid && w_gen(o) == m->gen &&
           !atomic_compare_exchange_weak(&m->me->word, &o, w_make(m->gen + 1, 0, 0)))
        ;
    atomic_store(&m->claim, 0);
    pthread_mutex_unlock(&m->lock);
    atomic_fetch_add(&m->hdr->answers, 1); /* a member waiting for this one's trim goes on */
    futex_wake(&m->hdr->answers);
    /* The member and its mapping stay (a few KiB): a thread of this process
     * that read d->share before the store above may still use them. */
    m->left_next = left_members;
    left_members = m;
    pthread_mutex_unlock(&join_lock);
    return BRIDGE_OK;
}

int bridge_share_get(int device, bridge_share_stats *out)
{
    memset(out, 0, sizeof *out);
    device_state *d = device_of(device);
    if (!d)
        return BRIDGE_E_DEVICE;
    share_member *m = atomic_load(&d->share);
    if (!m)
        return BRIDGE_OK;
    out->joined = 1;
    snprintf(out->name, sizeof out->name, "%s", m->name);
    snprintf(out->path, sizeof out->path, "%s", m->path);
    out->budget = m->budget_units * SHARE_UNIT;
    out->claim = atomic_load(&m->claim) * SHARE_UNIT;
    uint64_t g = group_units(m);
    out->group = g > UINT64_MAX / SHARE_UNIT ? UINT64_MAX : g * SHARE_UNIT;
    for (uint32_t i = 0; i < SHARE_SLOTS; i++)
        if (w_pid(atomic_load(&m->slots[i].word)))
            out->members++;
    out->slot = (uint32_t)(m->me - m->slots);
    out->inflight = atomic_load(&m->inflight);
    out->num_refused = atomic_load(&m->num_refused);
    out->num_asks = atomic_load(&m->num_asks);
    out->num_trims_served = atomic_load(&m->num_trims_served);
    out->num_reclaimed = atomic_load(&m->num_reclaimed);
    out->num_overshoots = atomic_load(&m->num_overshoots);
    out->max_overshoot = atomic_load(&m->max_overshoot);
    out->num_lost = atomic_load(&m->num_lost);
    return BRIDGE_OK;
}

int bridge_share_layout(bridge_share_layout_info *out)
{
    out->magic = SHARE_MAGIC;
    out->version = SHARE_VERSION;
    out->file_size = SHARE_FILE_SIZE;
    out->header_size = sizeof(share_header);
    out->slot_size = sizeof(share_slot);
    out->nslots = SHARE_SLOTS;
    out->unit = SHARE_UNIT;
    out->unit_bits = W_UNIT_BITS;
    out->pid_bits = W_PID_BITS;
    out->off_budget = offsetof(share_header, budget);
    out->off_uid = offsetof(share_header, uid);
    out->off_uuid = offsetof(share_header, uuid);
    out->off_name = offsetof(share_header, name);
    out->off_word = offsetof(share_slot, word);
    out->off_start = offsetof(share_slot, start);
    out->off_trim_req = offsetof(share_slot, trim_req);
    out->off_trim_done = offsetof(share_slot, trim_done);
    out->off_asked_at = offsetof(share_slot, asked_at);
    out->off_heartbeat = offsetof(share_slot, heartbeat);
    out->off_tag_bytes = offsetof(share_slot, tag_bytes);
    out->off_outside = offsetof(share_slot, outside);
    out->off_cached = offsetof(share_slot, cached);
    out->off_pool_reserved = offsetof(share_slot, pool_reserved);
    out->off_device = offsetof(share_slot, device);
    out->off_overshoots = offsetof(share_slot, overshoots);
    out->off_fields_gen = offsetof(share_slot, fields_gen);
    return BRIDGE_OK;
}
