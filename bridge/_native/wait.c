/* SPDX-License-Identifier: Apache-2.0 */
/* wait.c: an allocation the budget refuses waits for memory others free.
 *
 * Glossary
 *   waiter     a thread whose allocation was refused after the recovery chain
 *              (bridge_alloc) and whose wait time is above 0: it sleeps on
 *              `cv` without the GIL and without spinning, and retries when a
 *              free lowers the ledger of its device (wait_freed), and at a
 *              modest interval (1 ms growing to 16 ms) for memory freed
 *              outside the bridge (JAX, stream-ordered frees the pool still
 *              counts as used: the budget check reads the pool, so a retry
 *              passes only once the bytes are really free).
 *   queue      per device, the waiters in order of arrival (tickets).
 *   order      only the first waiter of a queue retries freely; a waiter
 *              behind it retries only when its request fits the budget
 *              together with the first one's, so a stream of small waiters
 *              cannot take what a large one waits for (without a budget, the
 *              driver decides: only the first retries).  A thread that is not
 *              waiting is not held back for a waiter: it may be the one that
 *              will free (a trainer whose step frees the batch a producer
 *              waits for); held back, it would wait too, and every holder
 *              waiting ends in a refusal (below).
 *   holder     a thread that allocated bytes on the device that are still
 *              live (each record names its allocating thread).  When every
 *              holder of the device is waiting (on any device), nobody will
 *              free: the waiter of lowest priority (then the newest) is
 *              refused at once instead of everyone waiting for its time.
 *              Holders are counted by sweeping the records table: the cost
 *              is on this slow path, nothing is counted per allocation.
 *   collection the pressure hook's garbage collection (gc.collect(): about
 *              0.1 s holding the GIL, every Python thread stopped) is left
 *              out of the chain before a wait; a waiter runs it once, when
 *              it has waited COLLECT_AFTER, or before its wait ends in a
 *              refusal (timeout, all waiting).  A partner's free usually
 *              comes in milliseconds: then nobody pays for a collection.
 * Locking: `mu` guards the queues, tickets, generations and victims; it is
 * never held while the records table is swept or the ledger is called.
 */
#include "wait.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cache.h"
#include "share.h"

#define MS            1000000ull
#define POLL_MIN      (1 * MS)   /* first re-read after a refusal */
#define POLL_MAX      (16 * MS)  /* the interval doubles up to this while nothing is freed */
#define CHECK_EVERY   (50 * MS)  /* all-waiting check and Ctrl-C check */
#define CONFIRM       (100 * MS) /* all waiting, and no free on the device, for this long */
#define COLLECT_AFTER (100 * MS) /* waited this long: run the garbage collection */
#define MAX_HOLDERS   256        /* distinct threads counted; beyond: "not all waiting" */

typedef struct waiter {
    struct waiter *next;
    uint64_t ticket; /* order of arrival, every device */
    unsigned long thread;
    int device, priority;
    uint64_t size;
    int victim; /* chosen by the all-waiting check: give up now */
} waiter;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv; /* CLOCK_MONOTONIC; broadcast on every change */
static pthread_once_t cv_once = PTHREAD_ONCE_INIT;
static waiter *queue[BRIDGE_MAX_DEVICES]; /* first waiter; FIFO */
static uint64_t next_ticket;
static uint64_t freed_gen[BRIDGE_MAX_DEVICES];     /* frees seen while waiters waited */
static int victim_chosen[BRIDGE_MAX_DEVICES];      /* a victim has not left yet */
static uint64_t suspect_since[BRIDGE_MAX_DEVICES]; /* all holders seen waiting since; 0 = not */
static uint64_t suspect_gen[BRIDGE_MAX_DEVICES];   /* freed_gen then */

/* figures */
static _Atomic uint64_t num_waits[BRIDGE_MAX_DEVICES], wait_ns[BRIDGE_MAX_DEVICES],
    num_timeouts[BRIDGE_MAX_DEVICES], num_all_waiting[BRIDGE_MAX_DEVICES],
    num_interrupts[BRIDGE_MAX_DEVICES];

/* settings */
static _Atomic uint64_t default_wait_ns;
static _Thread_local int tl_set;
static _Thread_local uint64_t tl_wait_ns;
static _Thread_local int tl_priority;
static _Thread_local double tl_last_waited;
static _Thread_local int tl_last_outcome;
static _Thread_local uint64_t tl_wait_now; /* wait_current */
static _Atomic uint64_t wait_serial;

uint64_t wait_current(void)
{
    return tl_wait_now;
}

static _Thread_local uint64_t tl_chain; /* wait_chain */

uint64_t wait_chain(void)
{
    return tl_chain;
}

void wait_chain_end(void)
{
    tl_chain++;
}
static bridge_wait_hooks hooks; /* set once by pymod.c before any wait */

static void init_cv(void)
{
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(&cv, &a);
    pthread_condattr_destroy(&a);
}

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static uint64_t ns_of(double seconds)
{
    if (!(seconds > 0))
        return 0;
    if (seconds > 1e9)
        seconds = 1e9; /* about 31 years: "as long as it takes", without overflow */
    return (uint64_t)(seconds * 1e9);
}

/* ---- settings ---- */
int bridge_set_wait(double seconds)
{
    if (isnan(seconds) || seconds < 0)
        return BRIDGE_E_INVALID;
    atomic_store(&default_wait_ns, ns_of(seconds));
    return BRIDGE_OK;
}

double bridge_get_wait(void)
{
    return (double)atomic_load(&default_wait_ns) / 1e9;
}

int bridge_set_thread_wait(int set, double seconds, int priority)
{
    if (set && (isnan(seconds) || seconds < 0))
        return BRIDGE_E_INVALID;
    tl_set = set != 0;
    tl_wait_ns = set ? ns_of(seconds) : 0;
    tl_priority = set ? priority : 0;
    return BRIDGE_OK;
}

void bridge_get_thread_wait(int *set, double *seconds, int *priority)
{
    *set = tl_set;
    *seconds = (double)tl_wait_ns / 1e9;
    *priority = tl_priority;
}

void wait_refused(void)
{
    tl_last_waited = 0;
    tl_last_outcome = BRIDGE_WAIT_NONE;
}

void bridge_last_wait(double *seconds, int *outcome)
{
    *seconds = tl_last_waited;
    *outcome = tl_last_outcome;
}

void bridge_set_wait_hooks(const bridge_wait_hooks *h)
{
    pthread_mutex_lock(&mu);
    hooks = h ? *h : (bridge_wait_hooks){0};
    pthread_mutex_unlock(&mu);
}

/* ---- frees ---- */
void wait_freed(int device)
{
    pthread_once(&cv_once, init_cv);
    pthread_mutex_lock(&mu);
    freed_gen[device]++;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

/* ---- holders ---- */
typedef struct holders {
    int device;
    int n, overflow;
    unsigned long thread[MAX_HOLDERS];
    uint64_t bytes[MAX_HOLDERS];
} holders;

static int count_holder(record *r, void *arg)
{
    holders *h = arg;
    /* a graph block the user freed is the graph's, not a thread's */
    if (r->device != h->device || (r->flags & REC_USER_FREED))
        return 0;
    for (int i = 0; i < h->n; i++)
        if (h->thread[i] == r->owner) {
            h->bytes[i] += r->size;
            return 0;
        }
    if (h->n == MAX_HOLDERS)
        h->overflow = 1;
    else {
        h->thread[h->n] = r->owner;
        h->bytes[h->n++] = r->size;
    }
    return 0;
}

/* Under mu: whether `thread` waits on any device. */
static int is_waiting(unsigned long thread)
{
    for (int d = 0; d < BRIDGE_MAX_DEVICES; d++)
        for (waiter *w = queue[d]; w; w = w->next)
            if (w->thread == thread)
                return 1;
    return 0;
}

int bridge_wait_holders(int device, bridge_holder *out, int max, int *n)
{
    *n = 0;
    if (!device_of(device) || max < 0)
        return BRIDGE_E_DEVICE;
    static holders h; /* large: not on the stack; under hold_lock */
    static pthread_mutex_t hold_lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&hold_lock);
    h.device = device;
    h.n = h.overflow = 0;
    records_sweep(count_holder, &h);
    pthread_mutex_lock(&mu);
    for (int i = 0; i < h.n && *n < max; i++)
        out[(*n)++] = (bridge_holder){h.thread[i], h.bytes[i], is_waiting(h.thread[i])};
    pthread_mutex_unlock(&mu);
    pthread_mutex_unlock(&hold_lock);
    return BRIDGE_OK;
}

static uint64_t now_ns(void);

/* When every thread holding memory on `device` waits, nobody will free it:
 * the device's waiter of lowest priority, the newest among equals, gives up.
 * The verdict needs two looks CONFIRM apart with no free on the device in
 * between: a thread that frees what another allocated (a consumer of a
 * producer's batches) holds nothing itself, and its first free may come
 * just after the producer began to wait.  Memory held outside the bridge
 * (JAX) or by nobody (the cache, deferred frees, graphs) is no thread's:
 * then the waiters wait their time. */
static void check_all_waiting(int device)
{
    holders *h = malloc(sizeof *h);
    if (!h)
        return; /* no verdict: the waits end at their time */
    h->device = device;
    h->n = h->overflow = 0;
    records_sweep(count_holder, h);
    pthread_mutex_lock(&mu);
    int all = h->n > 0 && !h->overflow && queue[device] && !victim_chosen[device];
    for (int i = 0; all && i < h->n; i++)
        all = is_waiting(h->thread[i]);
    uint64_t now = now_ns();
    if (all && (!suspect_since[device] || suspect_gen[device] != freed_gen[device])) {
        suspect_since[device] = now; /* first look (or a free since): look again later */
        suspect_gen[device] = freed_gen[device];
        all = 0;
    } else if (!all) {
        suspect_since[device] = 0;
    }
    if (all && now - suspect_since[device] >= CONFIRM) {
        suspect_since[device] = 0;
        waiter *v = NULL;
        for (waiter *w = queue[device]; w; w = w->next)
            if (!v || w->priority < v->priority ||
                (w->priority == v->priority && w->ticket > v->ticket))
                v = w;
        v->victim = 1;
        victim_chosen[device] = 1;
        pthread_cond_broadcast(&cv);
    }
    pthread_mutex_unlock(&mu);
    free(h);
}

/* ---- the queue ---- */
/* Whether a waiter behind the first may retry: its request fits the budget
 * with the first waiter's (`first`) counted as if it were served. */
static int fits_behind(device_state *d, int device, uint64_t first, uint64_t size)
{
    uint64_t limit = atomic_load(&d->limit), others = 0;
    if (!limit)
        return 0;
    uint64_t r = atomic_load(&d->reserved) + first + size;
    bridge_others(device, &others);
    return r <= limit && others <= limit - r;
}

static void leave(waiter *w)
{
    pthread_mutex_lock(&mu);
    for (waiter **p = &queue[w->device]; *p; p = &(*p)->next)
        if (*p == w) {
            *p = w->next;
            break;
        }
    if (w->victim)
        victim_chosen[w->device] = 0;
    if (!queue[w->device])
        suspect_since[w->device] = 0; /* the next waiters look afresh */
    atomic_fetch_sub(&wait_count[w->device], 1);
    pthread_cond_broadcast(&cv); /* the next in line becomes first */
    pthread_mutex_unlock(&mu);
    cache_hold(w->device, 0);
}

static int retryable(int rc)
{
    return rc == BRIDGE_E_BUDGET || rc == BRIDGE_E_OOM;
}

static void deadline_of(struct timespec *ts, uint64_t at)
{
    ts->tv_sec = (time_t)(at / 1000000000ull);
    ts->tv_nsec = (long)(at % 1000000000ull);
}

/* The calling thread's wait time for a refused request of `size`; 0 when it
 * will not wait, with *why the outcome that says so (NONE: no wait set). */
static uint64_t wait_time_for(device_state *d, size_t size, int *why)
{
    *why = BRIDGE_WAIT_NONE;
    uint64_t budget_ns = tl_set ? tl_wait_ns : atomic_load_explicit(&default_wait_ns, RELAXED);
    if (!budget_ns)
        return 0;
    /* A capture on the device: never block it (nor a capturing thread). */
    if (atomic_load(&d->captures_active)) {
        *why = BRIDGE_WAIT_CAPTURE;
        return 0;
    }
    uint64_t limit = atomic_load(&d->limit);
    share_member *sm = atomic_load_explicit(&d->share, memory_order_acquire);
    if (size > d->total || (limit && size > limit) || (sm && size > share_budget(sm))) {
        *why = BRIDGE_WAIT_HOPELESS; /* no free can make room (the share's budget too) */
        return 0;
    }
    return budget_ns;
}

void wait_refused_graph(device_state *d, size_t size)
{
    int why;
    wait_refused();
    if (!wait_time_for(d, size, &why))
        tl_last_outcome = why;
}

/* The wait of one refused allocation, as a state machine (enum wait_state;
 * the loop below switches on it).  Each TRY calls `retry` (the allocation
 * again) unless a waiter ahead of this one would not fit beside it
 * (`fits_behind`); its flags say whether a free woke us (WAIT_RETRY_FREED)
 * and whether this try runs the garbage collection first
 * (WAIT_RETRY_COLLECT: once per wait).  Transitions:
 *
 *   QUEUED                          -> TRY (after a first check_all_waiting)
 *   TRY ok                          -> LEFT, BRIDGE_WAIT_OK
 *   TRY refused, not retryable      -> LEFT, BRIDGE_WAIT_NONE (a cap, a driver error)
 *   TRY, chosen as the victim       -> LAST, ALL_WAITING (read as the try begins)
 *   TRY refused, past the deadline  -> LAST if the collection did not run yet,
 *                                      else LEFT, TIMEOUT
 *   TRY refused, every CHECK_EVERY: Ctrl-C -> LEFT, INTERRUPTED
 *   TRY refused, every CHECK_EVERY otherwise: check_all_waiting (may choose
 *                                      a victim), then SLEEP
 *   TRY refused                     -> SLEEP
 *   LAST                            -> one more try, with the collection,
 *                                      if it did not run yet (else LEFT at
 *                                      once); then LEFT: BRIDGE_WAIT_OK when
 *                                      it got the memory, else the outcome
 *                                      that made it LAST (or NONE, as TRY)
 *   SLEEP                           -> TRY, woken on cv by a free on the
 *                                      device (freed_gen moves), the victim
 *                                      mark, the poll interval (1 ms
 *                                      doubling to 16 ms while nothing
 *                                      frees), the next check or the
 *                                      deadline, whichever comes first
 *
 * Past COLLECT_AFTER the next TRY runs the collection.  `mu` is taken only to
 * read or change the queue and the generations, never across `retry` or the
 * sleep's wake-up work (cond_timedwait drops it). */
enum wait_state {
    WAIT_QUEUED, /* in queue[device], GIL released, the cache held so frees reach the pool */
    WAIT_TRY,    /* one try of the allocation (retry) */
    WAIT_LAST,   /* the last try: the victim, or past the deadline */
    WAIT_SLEEP,  /* on cv until a free, the victim mark, the poll, the check or the deadline */
    WAIT_LEFT,   /* the outcome decided: off the queue, GIL back, figures counted */
};

int wait_for_room(device_state *d, int device, size_t size, int rc, wait_retry_fn retry, void *ctx,
                  void **out)
{
    wait_refused();
    if (!retryable(rc))
        return rc;
    int why;
    uint64_t budget_ns = wait_time_for(d, size, &why);
    /* the frameworks' relief first; a thread that will wait leaves their
     * garbage collection to its wait */
    rc = retry(ctx, WAIT_RETRY_RELIEVE | (budget_ns ? 0 : WAIT_RETRY_COLLECT), out);
    if (!retryable(rc))
        return rc; /* BRIDGE_OK, a cap or a driver error: no wait */
    if (!budget_ns) {
        tl_last_outcome = why;
        return rc;
    }
    pthread_once(&cv_once, init_cv);
    pthread_mutex_lock(&mu);
    bridge_wait_hooks h = hooks;
    waiter w = {.thread = thread_self(),
                .device = device,
                .priority = tl_priority,
                .size = size,
                .ticket = ++next_ticket};
    waiter **p = &queue[device];
    while (*p)
        p = &(*p)->next;
    *p = &w;
    atomic_fetch_add(&wait_count[device], 1); /* seq_cst: see ledger.h */
    pthread_mutex_unlock(&mu);
    cache_hold(device, 1);
    atomic_fetch_add_explicit(&num_waits[device], 1, RELAXED);
    void *gil = h.release_gil ? h.release_gil() : NULL;
    enum wait_state state = WAIT_QUEUED;

    tl_wait_now = atomic_fetch_add_explicit(&wait_serial, 1, RELAXED) + 1;
    uint64_t t0 = now_ns(), now = t0, deadline = t0 + budget_ns;
    if (deadline < t0)
        deadline = UINT64_MAX;
    uint64_t poll = POLL_MIN, next_check = t0 + CHECK_EVERY, collect_at = t0 + COLLECT_AFTER;
    uint64_t gen = 0; /* freed_gen as the last try began: a SLEEP ends when it moves */
    int outcome = BRIDGE_WAIT_TIMEOUT, freed = 0, collected = 0;
    check_all_waiting(device);
    state = WAIT_TRY;
    while (state != WAIT_LEFT) {
        switch (state) {
        case WAIT_TRY:
        case WAIT_LAST: {
            pthread_mutex_lock(&mu);
            int victim = w.victim;
            gen = freed_gen[device];
            uint64_t first = queue[device] == &w ? 0 : queue[device]->size;
            pthread_mutex_unlock(&mu);
            if (victim) {
                outcome = BRIDGE_WAIT_ALL_WAITING;
                state = WAIT_LAST;
            }
            int r = rc, flags = freed ? WAIT_RETRY_FREED : 0;
            /* the collection: past the grace, or this is the last try */
            if (!collected && (state == WAIT_LAST || now >= collect_at)) {
                flags |= WAIT_RETRY_COLLECT | WAIT_RETRY_FREED;
                collected = 1;
            } else if (state == WAIT_LAST) {
                state = WAIT_LEFT; /* collected already: the refusal stands */
                break;
            }
            if (!first || fits_behind(d, device, first, size))
                r = retry(ctx, flags, out);
            if (r == BRIDGE_OK) {
                outcome = BRIDGE_WAIT_OK;
                state = WAIT_LEFT;
                break;
            }
            rc = r;
            if (!retryable(r)) {
                outcome = BRIDGE_WAIT_NONE; /* a framework cap or a driver error: no wait helps */
                state = WAIT_LEFT;
                break;
            }
            if (state == WAIT_LAST) {
                state = WAIT_LEFT; /* the collection did not make room either */
                break;
            }
            now = now_ns();
            if (now >= deadline) {
                /* one more try, after the collection; else BRIDGE_WAIT_TIMEOUT */
                state = collected ? WAIT_LEFT : WAIT_LAST;
                break;
            }
            if (now >= next_check) {
                next_check = now + CHECK_EVERY;
                if (h.interrupted && h.interrupted()) {
                    outcome = BRIDGE_WAIT_INTERRUPTED;
                    state = WAIT_LEFT;
                    break;
                }
                check_all_waiting(device);
            }
            state = WAIT_SLEEP;
            break;
        }
        case WAIT_SLEEP: {
            uint64_t wake = now + poll;
            if (wake > deadline)
                wake = deadline;
            if (wake > next_check)
                wake = next_check;
            struct timespec ts;
            deadline_of(&ts, wake);
            pthread_mutex_lock(&mu);
            int woke = 0;
            while (!w.victim && !(woke = freed_gen[device] != gen) &&
                   pthread_cond_timedwait(&cv, &mu, &ts) != ETIMEDOUT)
                ;
            woke = woke || freed_gen[device] != gen;
            freed = woke;
            pthread_mutex_unlock(&mu);
            poll = woke ? POLL_MIN : (poll * 2 > POLL_MAX ? POLL_MAX : poll * 2);
            state = WAIT_TRY;
            break;
        }
        case WAIT_QUEUED:
        case WAIT_LEFT:
            break; /* QUEUED is left before the loop; LEFT ends it */
        }
    }
    leave(&w);
    tl_wait_now = 0;
    now = now_ns();
    if (h.reacquire_gil && gil)
        h.reacquire_gil(gil);
    atomic_fetch_add_explicit(&wait_ns[device], now - t0, RELAXED);
    if (outcome == BRIDGE_WAIT_TIMEOUT)
        atomic_fetch_add_explicit(&num_timeouts[device], 1, RELAXED);
    else if (outcome == BRIDGE_WAIT_ALL_WAITING)
        atomic_fetch_add_explicit(&num_all_waiting[device], 1, RELAXED);
    else if (outcome == BRIDGE_WAIT_INTERRUPTED)
        atomic_fetch_add_explicit(&num_interrupts[device], 1, RELAXED);
    tl_last_waited = (double)(now - t0) / 1e9;
    tl_last_outcome = outcome;
    return outcome == BRIDGE_WAIT_OK ? BRIDGE_OK : rc;
}

/* ---- figures ---- */
void wait_fill_stats(int device, bridge_stats *out)
{
    out->num_waits = atomic_load(&num_waits[device]);
    out->wait_ns = atomic_load(&wait_ns[device]);
    out->num_wait_timeouts = atomic_load(&num_timeouts[device]);
    out->num_wait_all_waiting = atomic_load(&num_all_waiting[device]);
    out->num_wait_interrupts = atomic_load(&num_interrupts[device]);
    out->waiting = (uint64_t)atomic_load(&wait_count[device]);
}

void wait_forget_after_fork(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pthread_once_t fresh_once = PTHREAD_ONCE_INIT;
    mu = fresh;
    cv_once = fresh_once; /* the condition variable is made again at the first wait */
    for (int i = 0; i < BRIDGE_MAX_DEVICES; i++) {
        queue[i] = NULL;
        victim_chosen[i] = 0;
        atomic_store(&wait_count[i], 0);
    }
}
