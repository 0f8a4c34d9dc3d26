/* SPDX-License-Identifier: Apache-2.0 */
/* carve.c: blocks carved from pool chunks (see carve.h).
 *
 * Per device, under its lock: the chunks, sorted by base address (a free
 * finds its chunk by a binary search); per chunk its free ranges sorted by
 * offset (a freed block finds its neighbours); per (stream, class) the free
 * ranges of that stream's chunks sorted by (size, chunk number, offset), so
 * the best fit is a binary search.  Arrays, not trees: a stream has tens of
 * free ranges on the traces, and an insert moves a few hundred bytes. */
#include "carve.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "bridge.h"

#define RELAXED memory_order_relaxed

enum { SMALL, LARGE, CLASSES };

typedef struct range {
    uint64_t off, size;
} range;

typedef struct chunk {
    uintptr_t base;
    uint64_t bytes;
    CUstream key;
    int cls;
    int orphan;         /* its stream was forgotten: carve nothing more from it */
    uint64_t no;        /* the order chunks were taken in (a best fit's tie-break) */
    uint64_t empty_seq; /* when it last became empty; 0 while a block is carved from it */
    uint32_t nlive;     /* blocks carved from it and live */
    range *free;        /* sorted by offset */
    uint32_t nfree, capfree;
} chunk;

typedef struct fit {
    uint64_t size, no, off;
    chunk *c;
} fit;

typedef struct fits {
    CUstream key;
    int cls;
    fit *v; /* sorted by (size, no, off) */
    uint32_t n, cap;
} fits;

typedef struct dcarve {
    pthread_mutex_t lock;
    chunk **chunks; /* sorted by base */
    uint32_t nchunks, capchunks;
    fits *lists;
    uint32_t nlists, caplists;
    uint64_t next_no, seq;
    uint64_t empty[CLASSES]; /* bytes of the class's empty chunks */
    _Atomic uint64_t held;   /* bytes of every chunk; written under the lock */
    _Atomic uint64_t carved; /* requested bytes of the live carved blocks; ditto */
    _Atomic uint64_t share, min, max, keep, small_keep;
    _Atomic uint64_t slack_pm; /* the release rule's slack, per mille; 0: no rule */
    _Atomic uint64_t hwm;      /* the most `carved` bytes live at once; written under
                                  the lock */
} dcarve;

static dcarve carves[BRIDGE_MAX_DEVICES] = {
    [0 ... BRIDGE_MAX_DEVICES - 1] = {.lock = PTHREAD_MUTEX_INITIALIZER}};

static inline void add_locked(_Atomic uint64_t *v, uint64_t delta)
{
    atomic_store_explicit(v, atomic_load_explicit(v, RELAXED) + delta, RELAXED);
}

static inline uint64_t rounded(uint64_t size)
{
    uint64_t n = (size + 511) & ~(uint64_t)511;
    return n < 512 ? 512 : n;
}

static inline int class_of(uint64_t size)
{
    return size <= BRIDGE_CARVE_SMALL_MAX ? SMALL : LARGE;
}

/* Room for one more element of `size` bytes in *v (n used of *cap). */
static int grow(void **v, uint32_t n, uint32_t *cap, size_t size)
{
    if (n < *cap)
        return 0;
    uint32_t want = *cap ? *cap * 2 : 8;
    void *p = realloc(*v, (size_t)want * size);
    if (!p)
        return -1;
    *v = p;
    *cap = want;
    return 0;
}

/* ---- the (stream, class) lists of free ranges ---- */
static fits *list_of(dcarve *c, CUstream key, int cls, int make)
{
    for (uint32_t i = 0; i < c->nlists; i++)
        if (c->lists[i].key == key && c->lists[i].cls == cls)
            return &c->lists[i];
    if (!make || grow((void **)&c->lists, c->nlists, &c->caplists, sizeof(fits)))
        return NULL;
    fits *l = &c->lists[c->nlists++];
    *l = (fits){.key = key, .cls = cls};
    return l;
}

static inline int fit_less(const fit *a, uint64_t size, uint64_t no, uint64_t off)
{
    if (a->size != size)
        return a->size < size;
    if (a->no != no)
        return a->no < no;
    return a->off < off;
}

/* The first entry not less than (size, no, off). */
static uint32_t fit_lower(const fits *l, uint64_t size, uint64_t no, uint64_t off)
{
    uint32_t lo = 0, hi = l->n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (fit_less(&l->v[mid], size, no, off))
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static void fit_remove(fits *l, const chunk *ch, uint64_t off, uint64_t size)
{
    uint32_t i = fit_lower(l, size, ch->no, off);
    if (i < l->n && l->v[i].c == ch && l->v[i].off == off) {
        memmove(&l->v[i], &l->v[i + 1], (l->n - i - 1) * sizeof(fit));
        l->n--;
    }
}

static int fit_insert(fits *l, chunk *ch, uint64_t off, uint64_t size)
{
    if (grow((void **)&l->v, l->n, &l->cap, sizeof(fit)))
        return -1;
    uint32_t i = fit_lower(l, size, ch->no, off);
    memmove(&l->v[i + 1], &l->v[i], (l->n - i) * sizeof(fit));
    l->v[i] = (fit){size, ch->no, off, ch};
    l->n++;
    return 0;
}

/* ---- a chunk's free ranges ---- */
/* The index of the first free range at an offset above `off`. */
static uint32_t range_after(const chunk *ch, uint64_t off)
{
    uint32_t lo = 0, hi = ch->nfree;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (ch->free[mid].off <= off)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* A free range leaves both the chunk and its list (the list: not for an orphan). */
static void unlink_range(dcarve *c, chunk *ch, uint32_t i)
{
    range r = ch->free[i];
    fits *l = ch->orphan ? NULL : list_of(c, ch->key, ch->cls, 0);
    if (l)
        fit_remove(l, ch, r.off, r.size);
    memmove(&ch->free[i], &ch->free[i + 1], (ch->nfree - i - 1) * sizeof(range));
    ch->nfree--;
}

/* A free range joins both; -1 when the host has no memory for it (the range
 * is then lost to carving until the chunk is flushed: never handed out twice). */
static int link_range(dcarve *c, chunk *ch, uint64_t off, uint64_t size)
{
    if (grow((void **)&ch->free, ch->nfree, &ch->capfree, sizeof(range)))
        return -1;
    uint32_t i = range_after(ch, off);
    memmove(&ch->free[i + 1], &ch->free[i], (ch->nfree - i) * sizeof(range));
    ch->free[i] = (range){off, size};
    ch->nfree++;
    if (ch->orphan)
        return 0;
    fits *l = list_of(c, ch->key, ch->cls, 1);
    if (!l || fit_insert(l, ch, off, size)) {
        memmove(&ch->free[i], &ch->free[i + 1], (ch->nfree - i - 1) * sizeof(range));
        ch->nfree--;
        return -1;
    }
    return 0;
}

/* ---- chunks ---- */
static uint32_t chunk_index(const dcarve *c, uintptr_t base)
{
    uint32_t lo = 0, hi = c->nchunks;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (c->chunks[mid]->base < base)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* The chunk holding ptr, or NULL. */
static chunk *chunk_of(const dcarve *c, uintptr_t ptr)
{
    uint32_t i = chunk_index(c, ptr + 1); /* the first chunk based above ptr */
    if (!i)
        return NULL;
    chunk *ch = c->chunks[i - 1];
    return ptr < ch->base + ch->bytes ? ch : NULL;
}

/* Take an empty chunk out (its one free range, the whole chunk, leaves the
 * lists); its pool block goes to out. */
static void drop_chunk(dcarve *c, chunk *ch, cache_block *out)
{
    while (ch->nfree)
        unlink_range(c, ch, ch->nfree - 1);
    uint32_t i = chunk_index(c, ch->base);
    memmove(&c->chunks[i], &c->chunks[i + 1], (c->nchunks - i - 1) * sizeof(chunk *));
    c->nchunks--;
    if (ch->empty_seq)
        c->empty[ch->cls] -= ch->bytes;
    add_locked(&c->held, -ch->bytes);
    *out = (cache_block){ch->base, ch->bytes, ch->key, 0, 0};
    free(ch->free);
    free(ch);
}

/* The oldest empty chunk of a class, or NULL. */
static chunk *oldest_empty(const dcarve *c, int cls)
{
    chunk *best = NULL;
    for (uint32_t i = 0; i < c->nchunks; i++) {
        chunk *ch = c->chunks[i];
        if (ch->cls == cls && ch->empty_seq && (!best || ch->empty_seq < best->empty_seq))
            best = ch;
    }
    return best;
}

/* The empty chunk that emptied first, of either class, or NULL. */
static chunk *first_emptied(const dcarve *c)
{
    chunk *best = NULL;
    for (uint32_t i = 0; i < c->nchunks; i++) {
        chunk *ch = c->chunks[i];
        if (ch->empty_seq && (!best || ch->empty_seq < best->empty_seq))
            best = ch;
    }
    return best;
}

/* Carve n bytes from the free range l->v[i]. */
static uintptr_t carve_from(dcarve *c, fits *l, uint32_t i, uint64_t n, uint64_t size)
{
    fit f = l->v[i];
    chunk *ch = f.c;
    uint32_t r = range_after(ch, f.off) - 1; /* the range at f.off */
    unlink_range(c, ch, r);
    if (f.size > n)
        (void)link_range(c, ch, f.off + n, f.size - n); /* no host memory: the rest is not
                                                          carved until the chunk empties */
    if (ch->empty_seq) {
        c->empty[ch->cls] -= ch->bytes;
        ch->empty_seq = 0;
    }
    ch->nlive++;
    add_locked(&c->carved, size);
    uint64_t carved = atomic_load_explicit(&c->carved, RELAXED);
    if (carved > atomic_load_explicit(&c->hwm, RELAXED))
        atomic_store_explicit(&c->hwm, carved, RELAXED);
    return ch->base + f.off;
}

/* The best fit for a request of `size` on `key`, under the lock; 0 when none. */
static uintptr_t take_locked(dcarve *c, CUstream key, uint64_t size)
{
    uint64_t n = rounded(size);
    fits *l = list_of(c, key, class_of(size), 0);
    if (!l)
        return 0;
    uint32_t i = fit_lower(l, n, 0, 0);
    return i < l->n ? carve_from(c, l, i, n, size) : 0;
}

int carve_on(int device)
{
    return atomic_load_explicit(&carves[device].max, RELAXED) != 0;
}

void carve_set(int device, uint64_t share_q16, uint64_t min, uint64_t max, uint64_t keep,
               uint64_t small_keep)
{
    dcarve *c = &carves[device];
    pthread_mutex_lock(&c->lock);
    atomic_store(&c->share, share_q16);
    atomic_store(&c->min, min);
    atomic_store(&c->keep, keep);
    atomic_store(&c->small_keep, small_keep);
    atomic_store(&c->max, max);
    pthread_mutex_unlock(&c->lock);
}

uintptr_t carve_take(int device, CUstream key, uint64_t size)
{
    dcarve *c = &carves[device];
    if (!atomic_load_explicit(&c->held, RELAXED))
        return 0; /* no chunk: no lock */
    pthread_mutex_lock(&c->lock);
    uintptr_t p = take_locked(c, key, size);
    pthread_mutex_unlock(&c->lock);
    return p;
}

uint64_t carve_chunk_bytes(int device, uint64_t size, uint64_t live)
{
    dcarve *c = &carves[device];
    uint64_t n = rounded(size), chunk;
    if (class_of(size) == SMALL) {
        chunk = BRIDGE_CARVE_SMALL_CHUNK;
    } else {
        uint64_t lo = atomic_load_explicit(&c->min, RELAXED);
        uint64_t hi = atomic_load_explicit(&c->max, RELAXED);
        uint64_t q16 = atomic_load_explicit(&c->share, RELAXED);
        unsigned __int128 want = ((unsigned __int128)live * q16) >> 16;
        chunk = want < 1 ? 1 : want > (1ull << 62) ? (1ull << 62) : (uint64_t)want;
        uint64_t p2 = 1;
        while (p2 < chunk)
            p2 <<= 1; /* up to a power of two */
        chunk = p2 < lo ? lo : p2 > hi ? hi : p2;
    }
    uint64_t own = (n + BRIDGE_CARVE_ROUND - 1) / BRIDGE_CARVE_ROUND * BRIDGE_CARVE_ROUND;
    return own > chunk ? own : chunk;
}

uint64_t carve_chunk_least(uint64_t size)
{
    uint64_t n = rounded(size);
    return (n + BRIDGE_CARVE_ROUND - 1) / BRIDGE_CARVE_ROUND * BRIDGE_CARVE_ROUND;
}

uintptr_t carve_add(int device, CUstream key, uintptr_t base, uint64_t bytes, uint64_t size,
                    cache_release_fn release)
{
    dcarve *c = &carves[device];
    chunk *ch = calloc(1, sizeof *ch);
    uintptr_t p = 0;
    pthread_mutex_lock(&c->lock);
    if (ch && !grow((void **)&c->chunks, c->nchunks, &c->capchunks, sizeof(chunk *))) {
        *ch = (chunk){
            .base = base, .bytes = bytes, .key = key, .cls = class_of(size), .no = c->next_no++};
        uint32_t i = chunk_index(c, base);
        memmove(&c->chunks[i + 1], &c->chunks[i], (c->nchunks - i) * sizeof(chunk *));
        c->chunks[i] = ch;
        c->nchunks++;
        add_locked(&c->held, bytes);
        /* from the new chunk itself (another thread's free may have made a
         * fit elsewhere meanwhile: then the new chunk would sit unused) */
        fits *l = link_range(c, ch, 0, bytes) ? NULL : list_of(c, key, ch->cls, 0);
        uint32_t at = l ? fit_lower(l, bytes, ch->no, 0) : 0;
        if (l && at < l->n && l->v[at].c == ch) {
            p = carve_from(c, l, at, rounded(size), size);
        } else {
            cache_block out; /* no host memory for its range: the chunk goes back whole */
            drop_chunk(c, ch, &out);
        }
        ch = NULL; /* the table's, or freed by drop_chunk */
    }
    pthread_mutex_unlock(&c->lock);
    if (!p) {
        free(ch);
        release(device, base, bytes, key);
    }
    return p;
}

/* Give back the empty chunks of a class past `keep`, oldest first, into out[]
 * (at most max); returns how many. */
static int trim_class(dcarve *c, int cls, uint64_t keep, cache_block *out, int max)
{
    int k = 0;
    chunk *ch;
    while (k < max && c->empty[cls] > keep && (ch = oldest_empty(c, cls)))
        drop_chunk(c, ch, &out[k++]);
    return k;
}

void carve_give(int device, uintptr_t ptr, uint64_t size, int keep_none, cache_release_fn release)
{
    dcarve *c = &carves[device];
    cache_block out[BRIDGE_CACHE_EVICT_MAX];
    int k = 0;
    pthread_mutex_lock(&c->lock);
    chunk *ch = chunk_of(c, ptr);
    if (ch) {
        uint64_t off = ptr - ch->base, n = rounded(size);
        uint32_t i = range_after(ch, off);
        if (i < ch->nfree && off + n == ch->free[i].off) { /* the free range after it */
            n += ch->free[i].size;
            unlink_range(c, ch, i);
        }
        if (i && ch->free[i - 1].off + ch->free[i - 1].size == off) { /* the one before */
            off = ch->free[i - 1].off;
            n += ch->free[i - 1].size;
            unlink_range(c, ch, i - 1);
        }
        (void)link_range(c, ch, off, n); /* no host memory: the range is lost until a flush */
        ch->nlive--;
        add_locked(&c->carved, -size);
        if (!ch->nlive) {
            ch->empty_seq = ++c->seq;
            c->empty[ch->cls] += ch->bytes;
            if (ch->orphan) {
                drop_chunk(c, ch, &out[k++]);
            } else {
                int on = atomic_load_explicit(&c->max, RELAXED) != 0;
                uint64_t keep = keep_none || !on   ? 0
                                : ch->cls == SMALL ? atomic_load_explicit(&c->small_keep, RELAXED)
                                                   : atomic_load_explicit(&c->keep, RELAXED);
                k += trim_class(c, ch->cls, keep, out + k, BRIDGE_CACHE_EVICT_MAX - k);
            }
        }
    }
    pthread_mutex_unlock(&c->lock);
    for (int j = 0; j < k; j++)
        release(device, out[j].ptr, out[j].size, out[j].stream);
}

void carve_set_slack(int device, uint64_t slack_pm)
{
    dcarve *c = &carves[device];
    pthread_mutex_lock(&c->lock);
    atomic_store(&c->slack_pm, slack_pm);
    atomic_store(&c->hwm, atomic_load(&c->carved)); /* the mark starts again */
    pthread_mutex_unlock(&c->lock);
}

uint64_t carve_make_room(int device, uint64_t bytes, uint64_t size, cache_release_fn release)
{
    dcarve *c = &carves[device];
    uint64_t slack = atomic_load_explicit(&c->slack_pm, RELAXED), out_bytes = 0;
    if (!slack)
        return 0;
    for (;;) {
        cache_block out[BRIDGE_CACHE_EVICT_MAX];
        int k = 0;
        pthread_mutex_lock(&c->lock);
        uint64_t hwm = atomic_load_explicit(&c->carved, RELAXED) + size;
        if (hwm < atomic_load_explicit(&c->hwm, RELAXED))
            hwm = atomic_load_explicit(&c->hwm, RELAXED);
        else
            atomic_store_explicit(&c->hwm, hwm, RELAXED);
        chunk *ch;
        while (k < BRIDGE_CACHE_EVICT_MAX &&
               (unsigned __int128)(atomic_load_explicit(&c->held, RELAXED) + bytes) * 1000 >
                   (unsigned __int128)hwm * slack &&
               (ch = first_emptied(c)))
            drop_chunk(c, ch, &out[k++]);
        pthread_mutex_unlock(&c->lock);
        for (int j = 0; j < k; j++) {
            release(device, out[j].ptr, out[j].size, out[j].stream);
            out_bytes += out[j].size;
        }
        if (k < BRIDGE_CACHE_EVICT_MAX)
            return out_bytes;
    }
}

uint64_t carve_hwm(int device)
{
    return atomic_load(&carves[device].hwm);
}

uint64_t carve_slack(int device)
{
    return atomic_load(&carves[device].slack_pm);
}

uint64_t carve_flush(int device, cache_release_fn release)
{
    dcarve *c = &carves[device];
    uint64_t bytes = 0;
    if (!atomic_load(&c->held))
        return 0;
    for (;;) {
        cache_block out[BRIDGE_CACHE_EVICT_MAX];
        int k = 0;
        pthread_mutex_lock(&c->lock);
        for (int cls = 0; cls < CLASSES; cls++)
            k += trim_class(c, cls, 0, out + k, BRIDGE_CACHE_EVICT_MAX - k);
        pthread_mutex_unlock(&c->lock);
        for (int j = 0; j < k; j++) {
            release(device, out[j].ptr, out[j].size, out[j].stream);
            bytes += out[j].size;
        }
        if (k < BRIDGE_CACHE_EVICT_MAX)
            return bytes;
    }
}

void carve_set_keep(int device, uint64_t keep, uint64_t small_keep, cache_release_fn release)
{
    dcarve *c = &carves[device];
    for (int first = 1;; first = 0) {
        cache_block out[BRIDGE_CACHE_EVICT_MAX];
        int k = 0;
        pthread_mutex_lock(&c->lock);
        if (first) {
            atomic_store(&c->keep, keep);
            atomic_store(&c->small_keep, small_keep);
        }
        k += trim_class(c, LARGE, keep, out + k, BRIDGE_CACHE_EVICT_MAX - k);
        k += trim_class(c, SMALL, small_keep, out + k, BRIDGE_CACHE_EVICT_MAX - k);
        pthread_mutex_unlock(&c->lock);
        for (int j = 0; j < k; j++)
            release(device, out[j].ptr, out[j].size, out[j].stream);
        if (k < BRIDGE_CACHE_EVICT_MAX)
            return;
    }
}

void carve_forget_stream(int device, CUstream key, cache_release_fn release)
{
    dcarve *c = &carves[device];
    if (!atomic_load(&c->held))
        return;
    for (;;) {
        cache_block out[BRIDGE_CACHE_EVICT_MAX];
        int k = 0;
        pthread_mutex_lock(&c->lock);
        for (uint32_t i = 0; i < c->nchunks && k < BRIDGE_CACHE_EVICT_MAX;) {
            chunk *ch = c->chunks[i];
            if (ch->key != key) {
                i++;
            } else if (!ch->nlive) {
                drop_chunk(c, ch, &out[k++]); /* the array moved down: same i */
            } else {
                if (!ch->orphan) { /* its ranges leave the stream's list, stay in the chunk */
                    fits *l = list_of(c, key, ch->cls, 0);
                    for (uint32_t r = 0; l && r < ch->nfree; r++)
                        fit_remove(l, ch, ch->free[r].off, ch->free[r].size);
                    ch->orphan = 1;
                }
                i++;
            }
        }
        pthread_mutex_unlock(&c->lock);
        for (int j = 0; j < k; j++)
            release(device, out[j].ptr, out[j].size, out[j].stream);
        if (k < BRIDGE_CACHE_EVICT_MAX)
            return;
    }
}

uint64_t carve_held(int device)
{
    return atomic_load(&carves[device].held);
}

uint64_t carve_idle(int device)
{
    dcarve *c = &carves[device];
    uint64_t held = atomic_load(&c->held), carved = atomic_load(&c->carved);
    return held > carved ? held - carved : 0;
}

void carve_forget_after_fork(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    for (int i = 0; i < BRIDGE_MAX_DEVICES; i++) {
        dcarve *c = &carves[i];
        c->lock = fresh;
        c->chunks = NULL; /* the parent's bookkeeping: left, not freed, as the cache's
                             nodes are (the child owns none of the parent's chunks) */
        c->nchunks = c->capchunks = 0;
        c->lists = NULL;
        c->nlists = c->caplists = 0;
        c->empty[SMALL] = c->empty[LARGE] = 0;
        atomic_store(&c->held, 0);
        atomic_store(&c->carved, 0);
        atomic_store(&c->hwm, 0);
    }
}
