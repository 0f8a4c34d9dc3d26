/* SPDX-License-Identifier: Apache-2.0 */
/* cache.c: exact-size, per-stream cache of freed blocks with least-recently-
 * cached eviction in two tiers (see cache.h).
 *
 * Each cached block is a node of a per-device array (allocated on the first
 * put, recycled through a free list).  A node is on two doubly-linked lists:
 * its tier's order of caching (newest .. oldest), and its key's blocks
 * (top = newest .. bottom = oldest), the key being (stream, size) in an
 * open-addressed table.  A take pops the top of its key; an eviction removes
 * the tier's oldest block, wherever its key is: both O(1).  The node keeps
 * its tier, so a change of the boundary leaves every block where it was.
 *
 * In front of the lists, each thread has a slot per device that holds the
 * block it freed last (the thread slots, below): logically the newest end of
 * that block's tier and key, reached without the lock.
 *
 * A slot may instead hold a carved block (carve.c, segments: cache_park_carved),
 * in no tier and no list: its bytes are `parked_carved`.  The states a block
 * takes here (SLOT, CACHED, PARKED, PARKED_CARVED), their figures and who
 * moves a block between them are block.h's. */
#include "cache.h"
#include "carve.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "bridge.h"
#include "tls.h"

#define SLOT_BITS 12
#define SLOTS     (1u << SLOT_BITS)   /* (stream, size) keys per device */
#define DEPTH     BRIDGE_CACHE_DEPTH  /* blocks kept per key */
#define NODES     (DEPTH * SLOTS / 2) /* every key that may hold blocks, full */
#define NONE      UINT32_MAX

typedef struct node {
    uintptr_t ptr;
    uint64_t size;
    CUstream stream;
    uint32_t newer, older;   /* the device's order of caching; `older` also
                                links the free list */
    uint32_t knewer, kolder; /* the blocks of the same key */
    uint32_t tier;           /* TIER_SMALL or TIER_LARGE: the order it is on */
} node;

typedef struct slot {
    CUstream stream; /* key part 1 */
    uint64_t size;   /* key part 2; 0 = never used */
    uint32_t n;      /* blocks of the key */
    uint32_t top;    /* its newest block (NONE when n == 0) */
    uint32_t bottom; /* its oldest */
} slot;

enum { TIER_SMALL, TIER_LARGE, TIERS };

/* ---- each thread's newest freed block: the thread slots ----
 * The block a thread freed last on a device waits in that thread's slot, not
 * in the lists: the thread's next allocation of that size and stream takes it
 * back with one compare-and-swap, and a free into an empty slot that fits
 * under its tier's cap takes a few relaxed loads and one locked add, no lock.
 *
 * The slot is the newest end of its tier's order and of its key: a free into
 * an occupied slot moves the slot's block into the lists, under the lock, as
 * their newest (and takes the slot itself when it is kept), so the lists and
 * the slots together are in the order of caching the lists alone had; a take
 * of the slot's key gets that key's newest block, as the lists' top would
 * be.  A slot's bytes are its tier's (`parked`): every cap, figure and budget
 * view counts them.  Evictions and trims reach the slots last (each holds its
 * tier's newest block of its thread); a flush, a stream's end and an
 * allocation that missed the lists reach every thread's slot.
 *
 * Protocol.  Only the owner writes size, stream and tier, and only while ptr
 * is 0; it publishes them with a release store of ptr, and takes its block
 * back with a compare-and-swap of ptr to 0.  Another thread claims a slot
 * with a compare-and-swap of ptr to SLOT_BUSY, reads the fields (stable
 * then), and stores 0 (or the pointer again, when it does not want the
 * block).  A slot outlives its thread: at the thread's exit it is left
 * unowned, its block in it, and the next thread to need one takes it over.
 * Slots are listed per device (pushed, never removed), so a walk takes no
 * lock. */
#define SLOT_BUSY ((uintptr_t)1)

typedef struct tslot {
    _Atomic uintptr_t ptr; /* 0: empty; SLOT_BUSY: another thread is claiming it */
    park_words park;       /* a block parked here with its record (park.h) */
    _Atomic uint64_t size;
    _Atomic(CUstream) stream;
    _Atomic uint32_t tier;
    _Atomic int carved; /* the block is carved (carve.c), parked with its record */
    _Atomic int owned;  /* a live thread's */
    struct tslot *next; /* the device's list */
} tslot;

/* One order of caching and its bytes.  Every write is made under the
 * device's lock (a plain load and store: no locked instruction on the hot
 * path); the atomics let figures be read without it. */
typedef struct tier {
    uint32_t newest, oldest; /* ends of the tier's order of caching */
    _Atomic uint64_t bytes;  /* the tier's cached bytes */
} tier;

typedef struct dcache {
    pthread_mutex_t lock;
    slot *slots;                     /* SLOTS entries, allocated on first put */
    node *nodes;                     /* NODES entries, allocated with slots */
    uint32_t nused;                  /* nodes[0..nused) were handed out */
    uint32_t free_head;              /* nodes given back, linked by `older` */
    tier tiers[TIERS];               /* blocks <= small_max, and the larger ones */
    _Atomic uint64_t bytes;          /* cached bytes, both tiers; written under the lock */
    _Atomic uint64_t limit;          /* hard cap of `bytes`; 0 = caching off */
    _Atomic uint64_t max_block;      /* larger blocks are never cached */
    _Atomic uint64_t fraction;       /* the small tier's share of live bytes, x 65536 */
    _Atomic uint64_t floor;          /* the small tier's cap is at least this */
    _Atomic uint64_t small_max;      /* the largest block of the small tier */
    _Atomic uint64_t large_cap;      /* the large tier's cap ... */
    _Atomic uint64_t large_fraction; /* ... and its share of live, x 65536; 0: none */
    uint32_t keys;                   /* slots with size != 0; <= SLOTS / 2 */
    uint32_t live_keys;              /* slots with n > 0; <= keys */
    _Atomic int held;                /* threads waiting for memory (wait.c): while > 0
                                  nothing is cached, freed bytes go to the pool;
                                  written under the lock */
    _Atomic uint64_t parked[TIERS];  /* bytes in the thread slots, by tier */
    _Atomic uint64_t parked_carved;  /* carved blocks' bytes in the thread slots (in no tier) */
    _Atomic(tslot *) tslots;         /* every thread slot of the device */
    _Atomic int slots_on;            /* 0: frees go to the lists alone */
} dcache;

#define DEFAULT_LIMIT (1ull << 30)
static dcache caches[BRIDGE_MAX_DEVICES] = {
    [0 ... BRIDGE_MAX_DEVICES - 1] = {.lock = PTHREAD_MUTEX_INITIALIZER,
                                      .free_head = NONE,
                                      .tiers = {{NONE, NONE, 0}, {NONE, NONE, 0}},
                                      .limit = DEFAULT_LIMIT,
                                      .max_block = BRIDGE_CACHE_MAX_BLOCK,
                                      .fraction = BRIDGE_CACHE_FRACTION_Q16,
                                      .floor = BRIDGE_CACHE_FLOOR,
                                      .small_max = BRIDGE_CACHE_SMALL_MAX,
                                      .large_cap = BRIDGE_CACHE_LARGE_CAP,
                                      .large_fraction = BRIDGE_CACHE_LARGE_FRACTION_Q16,
                                      .slots_on = 1}};

#define RELAXED memory_order_relaxed

/* bytes += delta (a two's complement delta subtracts), for a counter written
 * only under the device's lock */
static inline void add_locked(_Atomic uint64_t *v, uint64_t delta)
{
    atomic_store_explicit(v, atomic_load_explicit(v, RELAXED) + delta, RELAXED);
}

/* A tier's cached bytes (the lists' and the slots'), and every cached byte. */
static inline uint64_t tier_bytes(dcache *c, int t)
{
    return atomic_load_explicit(&c->tiers[t].bytes, RELAXED) +
           atomic_load_explicit(&c->parked[t], RELAXED);
}

static inline uint64_t all_bytes(dcache *c)
{
    return atomic_load_explicit(&c->bytes, RELAXED) +
           atomic_load_explicit(&c->parked[TIER_SMALL], RELAXED) +
           atomic_load_explicit(&c->parked[TIER_LARGE], RELAXED);
}

static void reset_tiers(dcache *c)
{
    for (int t = 0; t < TIERS; t++) {
        c->tiers[t].newest = c->tiers[t].oldest = NONE;
        atomic_store(&c->tiers[t].bytes, 0);
    }
}

/* The slot index comes from the TOP bits of a 64-bit multiplicative hash:
 * sizes that are multiples of 1 MiB and aligned stream handles have low
 * bits that are all zero, and the low bits of a product of them are too (the
 * old index took those and piled such keys onto a few slots). */
static inline uint64_t hash(CUstream s, uint64_t size)
{
    uint64_t h = ((uint64_t)(uintptr_t)s ^ (size * 0xC2B2AE3D27D4EB4Full)) * 0x9E3779B97F4A7C15ull;
    return h >> (64 - SLOT_BITS);
}

/* The slot of (s, size), or the empty slot where it would go; NULL if full. */
static slot *find(dcache *c, CUstream s, uint64_t size, int insert)
{
    uint64_t h = hash(s, size);
    for (uint32_t i = 0; i < SLOTS; i++) {
        slot *sl = &c->slots[(h + i) & (SLOTS - 1)];
        if (sl->size == size && sl->stream == s)
            return sl;
        if (sl->size == 0) {
            if (!insert || c->keys >= SLOTS / 2)
                return NULL;
            sl->size = size;
            sl->stream = s;
            sl->n = 0;
            sl->top = sl->bottom = NONE;
            c->keys++;
            return sl;
        }
    }
    return NULL;
}

/* Drop the keys whose blocks were all taken again, so new (stream, size)
 * pairs find room.  Only when at most a quarter of the table holds blocks:
 * the next compaction is then SLOTS / 4 new keys away (amortized O(1)).
 * Nodes do not point at slots, so they stay as they are. */
static int compact(dcache *c)
{
    if (c->live_keys >= SLOTS / 4)
        return 0;
    slot *fresh = calloc(SLOTS, sizeof(slot));
    if (!fresh)
        return 0;
    slot *old = c->slots;
    c->slots = fresh;
    c->keys = 0;
    for (uint32_t i = 0; i < SLOTS; i++)
        if (old[i].n)
            *find(c, old[i].stream, old[i].size, 1) = old[i];
    free(old);
    return 1;
}

/* Node i becomes the newest of its tier and of its key. */
static void link_node(dcache *c, slot *sl, uint32_t i)
{
    node *nd = &c->nodes[i];
    tier *t = &c->tiers[nd->tier];
    nd->newer = NONE;
    nd->older = t->newest;
    if (t->newest != NONE)
        c->nodes[t->newest].newer = i;
    else
        t->oldest = i;
    t->newest = i;
    nd->knewer = NONE;
    nd->kolder = sl->top;
    if (sl->top != NONE)
        c->nodes[sl->top].knewer = i;
    else
        sl->bottom = i;
    sl->top = i;
    if (!sl->n++)
        c->live_keys++;
}

/* Node i leaves both lists and goes to the free list. */
static inline __attribute__((always_inline)) void unlink_node(dcache *c, slot *sl, uint32_t i)
{
    node *nd = &c->nodes[i];
    tier *t = &c->tiers[nd->tier];
    if (nd->newer != NONE)
        c->nodes[nd->newer].older = nd->older;
    else
        t->newest = nd->older;
    if (nd->older != NONE)
        c->nodes[nd->older].newer = nd->newer;
    else
        t->oldest = nd->newer;
    if (nd->knewer != NONE)
        c->nodes[nd->knewer].kolder = nd->kolder;
    else
        sl->top = nd->kolder;
    if (nd->kolder != NONE)
        c->nodes[nd->kolder].knewer = nd->knewer;
    else
        sl->bottom = nd->knewer;
    if (!--sl->n)
        c->live_keys--;
    nd->older = c->free_head;
    c->free_head = i;
    add_locked(&t->bytes, -nd->size);
    add_locked(&c->bytes, -nd->size);
}

static uint32_t new_node(dcache *c)
{
    uint32_t i = c->free_head;
    if (i != NONE)
        c->free_head = c->nodes[i].older;
    else if (c->nused < NODES)
        i = c->nused++;
    return i;
}

/* live * q16 / 65536, without overflow */
static inline uint64_t share_of(uint64_t live, uint64_t q16)
{
    unsigned __int128 share = ((unsigned __int128)live * q16) >> 16;
    return share > UINT64_MAX ? UINT64_MAX : (uint64_t)share;
}

/* The cap of each tier; `held`: the device's committed bytes, the cached ones
 * included (live = held - cached); `size`: the block being cached (0 for a
 * trim).  The limit bounds both tiers together: each has the room under it
 * that the other leaves.
 *     small: cached_small <= min(limit - cached_large, max(floor, live * fraction))
 *     large: cached_large <= min(limit - cached_small, large_cap,
 *                                max(live * large_fraction, size))
 * The large tier's share keeps large blocks from pinning the pool's chunks
 * where little else is live; with `size` as its floor, a block up to
 * large_cap always fits, evicting the tier's older blocks (a loop of one large
 * size hits as before).  large_fraction 0: the fixed cap alone. */
static uint64_t cap_for(dcache *c, int t, uint64_t held, uint64_t size)
{
    uint64_t limit = atomic_load_explicit(&c->limit, RELAXED);
    uint64_t other = tier_bytes(c, !t);
    uint64_t room = limit > other ? limit - other : 0;
    uint64_t cached = all_bytes(c);
    uint64_t live = held > cached ? held - cached : 0;
    uint64_t cap;
    if (t == TIER_LARGE) {
        cap = atomic_load_explicit(&c->large_cap, RELAXED);
        uint64_t q16 = atomic_load_explicit(&c->large_fraction, RELAXED);
        if (q16) {
            uint64_t share = share_of(live, q16);
            if (share < size)
                share = size;
            if (share < cap)
                cap = share;
        }
    } else {
        uint64_t floor = atomic_load_explicit(&c->floor, RELAXED);
        uint64_t share = share_of(live, atomic_load_explicit(&c->fraction, RELAXED));
        cap = share > floor ? (share > room ? room : share) : floor;
    }
    return cap < room ? cap : room;
}

/* Move tier t's oldest blocks to `out` (at most `max`) until its bytes + extra
 * <= cap. */
static __attribute__((noinline)) int evict(dcache *c, int t, uint64_t cap, uint64_t extra,
                                           cache_block *out, int max)
{
    tier *tr = &c->tiers[t];
    int k = 0;
    while (k < max && tr->oldest != NONE && tier_bytes(c, t) + extra > cap) {
        uint32_t i = tr->oldest;
        node *nd = &c->nodes[i];
        out[k++] = (cache_block){nd->ptr, nd->size, nd->stream, 0, 0};
        unlink_node(c, find(c, nd->stream, nd->size, 0), i);
    }
    return k;
}

static inline int tier_of(dcache *c, uint64_t size)
{
    return size > atomic_load_explicit(&c->small_max, RELAXED) ? TIER_LARGE : TIER_SMALL;
}

/* The cap a block of `size` is held to in tier t whose bytes are `bytes`
 * (cache_put's rule).  Under the floor and the limit the small tier is under
 * its cap whatever the live bytes (the large tier's bytes are part of what
 * the limit holds). */
static uint64_t put_cap(dcache *c, int t, uint64_t held, uint64_t size, uint64_t bytes)
{
    if (t == TIER_SMALL) {
        uint64_t low = atomic_load_explicit(&c->floor, RELAXED);
        uint64_t limit = atomic_load_explicit(&c->limit, RELAXED);
        uint64_t large = tier_bytes(c, TIER_LARGE);
        limit = limit > large ? limit - large : 0;
        low = low < limit ? low : limit;
        if (bytes + size <= low)
            return low;
    }
    return cap_for(c, t, held, size);
}

/* Does a block of `size` fit tier t whose bytes are `bytes` (put_cap's rule)?
 * An empty large tier takes any block up to its fixed cap that the limit has
 * room for: its cap is never below min(room, large_cap, size) (cap_for), so
 * a block that loops alone in its thread's slot needs no share computed. */
static inline int put_fits(dcache *c, int t, uint64_t held, uint64_t size, uint64_t bytes)
{
    if (t == TIER_LARGE && !bytes && size <= atomic_load_explicit(&c->large_cap, RELAXED)) {
        uint64_t limit = atomic_load_explicit(&c->limit, RELAXED);
        uint64_t other = tier_bytes(c, TIER_SMALL);
        if (other <= limit && size <= limit - other)
            return 1;
    }
    return bytes + size <= put_cap(c, t, held, size, bytes);
}

/* ---- the thread slots (see the banner at struct tslot) ---- */
static _Atomic(cache_detach_fn) detach_hook;
static _Atomic(cache_carved_fn) carved_hook;

void cache_set_detach(cache_detach_fn fn)
{
    atomic_store(&detach_hook, fn);
}

void cache_set_carved_return(cache_carved_fn fn)
{
    atomic_store(&carved_hook, fn);
}

/* A carved block out of its slot goes back to its segment (alloc.c), never
 * into the lists nor to the pool; no cache lock held. */
static inline void carved_leaves(int device, const cache_block *b)
{
    cache_carved_fn fn = atomic_load_explicit(&carved_hook, memory_order_acquire);
    if (fn)
        fn(device, b);
}

/* A block parked with its record leaves its slot for anything but its
 * owner's allocation: its record out of the table first (no cache lock held). */
static inline void detach(int device, cache_block *b)
{
    if (b->kept) {
        cache_detach_fn fn = atomic_load_explicit(&detach_hook, memory_order_acquire);
        if (fn)
            fn(device, b->ptr);
        b->kept = 0;
    }
}

/* What a claim wants of a slot's block: any block, one of a key, of a
 * stream, of a tier (these two: a plain block), or a carved one. */
enum { WANT_ANY, WANT_KEY, WANT_STREAM, WANT_TIER, WANT_CARVED };

/* The calling thread's slots by device: a table on the heap (tls.h), made
 * at the thread's first slot, NULL before; slot_key's value. */
static _Thread_local tslot **my_slots BRIDGE_TLS_ONE_LOAD;
static pthread_key_t slot_key;
static pthread_once_t slot_once = PTHREAD_ONCE_INIT;
static int slot_key_ok;

static inline tslot *my_slot(int device)
{
    tslot **t = my_slots;
    return t ? t[device] : NULL;
}

/* At a thread's exit its slots are left unowned, each with its block, and
 * its table freed (a later destructor that frees into a slot makes both
 * anew, and sets the key again: this runs once more). */
static int slot_claim(dcache *c, tslot *s, int want, CUstream stream, uint64_t size, int t,
                      cache_block *out);

static void slots_thread_ended(void *table)
{
    tslot **t = table;
    my_slots = NULL;
    for (int d = 0; d < BRIDGE_MAX_DEVICES; d++) {
        if (!t[d])
            continue;
        /* a carved block goes back to its segment: no other thread's
         * allocation would take it back (a plain block stays, in its tier) */
        cache_block b;
        if (slot_claim(&caches[d], t[d], WANT_CARVED, NULL, 0, 0, &b))
            carved_leaves(d, &b);
        atomic_store_explicit(&t[d]->owned, 0, memory_order_release);
    }
    free(t);
}

static void make_slot_key(void)
{
    slot_key_ok = pthread_key_create(&slot_key, slots_thread_ended) == 0;
}

/* The calling thread's slot on the device: an unowned one taken over, or a
 * new one; NULL without host memory or a thread key (frees then go to the
 * lists, as with the slots off). */
static tslot *slot_attach(dcache *c, int device)
{
    pthread_once(&slot_once, make_slot_key);
    if (!slot_key_ok)
        return NULL;
    tslot **table = my_slots;
    if (!table) {
        table = calloc(BRIDGE_MAX_DEVICES, sizeof *table);
        if (!table)
            return NULL;
        if (pthread_setspecific(slot_key, table) != 0) {
            free(table);
            return NULL;
        }
        my_slots = table;
    }
    tslot *s = atomic_load_explicit(&c->tslots, memory_order_acquire);
    for (; s; s = s->next) {
        int free_ = 0;
        if (!atomic_load_explicit(&s->owned, RELAXED) &&
            atomic_compare_exchange_strong(&s->owned, &free_, 1))
            break;
    }
    if (!s) {
        /* a line of its own: no two threads' slots share a cache line */
        size_t bytes = (sizeof *s + 63) & ~(size_t)63;
        s = aligned_alloc(64, bytes);
        if (!s)
            return NULL;
        memset(s, 0, bytes);
        atomic_store(&s->owned, 1);
        tslot *head = atomic_load_explicit(&c->tslots, RELAXED);
        do
            s->next = head;
        while (!atomic_compare_exchange_weak_explicit(&c->tslots, &head, s, memory_order_release,
                                                      RELAXED));
    }
    table[device] = s;
    return s;
}

/* Another thread's claim of slot s: 1 with its block in *out (and out of the
 * slot and the tier's bytes) when it holds one that the claim wants, else 0
 * (the slot as it was). */
static inline int slot_wanted(tslot *s, int want, CUstream stream, uint64_t size, int t)
{
    int carved = atomic_load_explicit(&s->carved, RELAXED);
    switch (want) {
    case WANT_KEY: /* a carved block is its owner's alone */
        return !carved && atomic_load_explicit(&s->size, RELAXED) == size &&
               atomic_load_explicit(&s->stream, RELAXED) == stream;
    case WANT_STREAM:
        return atomic_load_explicit(&s->stream, RELAXED) == stream;
    case WANT_TIER:
        return !carved && (int)atomic_load_explicit(&s->tier, RELAXED) == t;
    case WANT_CARVED:
        return carved;
    default:
        return 1;
    }
}

static int slot_claim(dcache *c, tslot *s, int want, CUstream stream, uint64_t size, int t,
                      cache_block *out)
{
    uintptr_t p = atomic_load_explicit(&s->ptr, memory_order_acquire);
    /* a first look at the fields (they may change until the claim holds the
     * slot), so that a slot of another key costs no locked instruction */
    if (p <= SLOT_BUSY || !slot_wanted(s, want, stream, size, t))
        return 0;
    if (!atomic_compare_exchange_strong_explicit(&s->ptr, &p, SLOT_BUSY, memory_order_acquire,
                                                 RELAXED))
        return 0;
    uint64_t sz = atomic_load_explicit(&s->size, RELAXED);
    CUstream st = atomic_load_explicit(&s->stream, RELAXED);
    uint32_t tr = atomic_load_explicit(&s->tier, RELAXED);
    int carved = atomic_load_explicit(&s->carved, RELAXED);
    if (!slot_wanted(s, want, stream, size, t)) {
        atomic_store_explicit(&s->ptr, p, memory_order_release);
        return 0;
    }
    atomic_fetch_sub_explicit(carved ? &c->parked_carved : &c->parked[tr], sz, RELAXED);
    *out = (cache_block){p, sz, st, atomic_load_explicit(&s->park.kept, memory_order_acquire) == p,
                         carved};
    atomic_store_explicit(&s->ptr, 0, memory_order_release);
    return 1;
}

/* Claim blocks of every thread's slot on the device that `want` accepts, at
 * most `max`, into out; the number claimed. */
static int claim_slots(dcache *c, int want, CUstream stream, uint64_t size, int t, cache_block *out,
                       int max)
{
    int n = 0;
    if (!atomic_load_explicit(&c->parked[TIER_SMALL], RELAXED) &&
        !atomic_load_explicit(&c->parked[TIER_LARGE], RELAXED) &&
        !atomic_load_explicit(&c->parked_carved, RELAXED))
        return 0;
    for (tslot *s = atomic_load_explicit(&c->tslots, memory_order_acquire); s && n < max;
         s = s->next)
        n += slot_claim(c, s, want, stream, size, t, &out[n]);
    return n;
}

/* The owner's take of its own block: 1 when the slot held `ptr`. */
static inline int slot_take_back(dcache *c, tslot *s, uintptr_t ptr)
{
    if (!atomic_compare_exchange_strong_explicit(&s->ptr, &ptr, 0, memory_order_acquire, RELAXED))
        return 0;
    atomic_fetch_sub_explicit(atomic_load_explicit(&s->carved, RELAXED)
                                  ? &c->parked_carved
                                  : &c->parked[atomic_load_explicit(&s->tier, RELAXED)],
                              atomic_load_explicit(&s->size, RELAXED), RELAXED);
    return 1;
}

/* The owner's block p (as read from its slot) taken back when it is of this
 * key and carved or not as `carved` says: p, *kept set as cache_take's; else
 * 0 (the slot as it was). */
static inline uintptr_t mine_take_back(dcache *c, tslot *mine, uintptr_t p, CUstream stream,
                                       uint64_t size, int carved, int *kept)
{
    if (p <= SLOT_BUSY || atomic_load_explicit(&mine->carved, RELAXED) != carved ||
        atomic_load_explicit(&mine->size, RELAXED) != size ||
        atomic_load_explicit(&mine->stream, RELAXED) != stream || !slot_take_back(c, mine, p))
        return 0;
    *kept = atomic_load_explicit(&mine->park.kept, memory_order_acquire) == p;
    return p;
}

/* The owner's slot gets a block (the slot is empty and the owner's). */
static inline void slot_fill(dcache *c, tslot *s, uintptr_t ptr, uint64_t size, CUstream stream,
                             int t, int carved)
{
    atomic_store_explicit(&s->size, size, RELAXED);
    atomic_store_explicit(&s->stream, stream, RELAXED);
    atomic_store_explicit(&s->tier, (uint32_t)t, RELAXED);
    atomic_store_explicit(&s->carved, carved, RELAXED);
    atomic_fetch_add_explicit(carved ? &c->parked_carved : &c->parked[t], size, RELAXED);
    atomic_store_explicit(&s->ptr, ptr, memory_order_release);
}

static uintptr_t take_listed(dcache *c, CUstream stream, uint64_t size);

uintptr_t cache_take(int device, CUstream stream, uint64_t size, int *kept)
{
    dcache *c = &caches[device];
    *kept = 0;
    /* fastest: the block this thread freed last, when it is of this key */
    tslot *mine = my_slot(device);
    if (mine) {
        uintptr_t p = atomic_load_explicit(&mine->ptr, memory_order_acquire);
        if (mine_take_back(c, mine, p, stream, size, 0, kept))
            return p;
    }
    uintptr_t got = take_listed(c, stream, size);
    if (got)
        return got;
    /* another thread's slot: what the lists would have handed out */
    cache_block b;
    if (!claim_slots(c, WANT_KEY, stream, size, 0, &b, 1))
        return 0;
    detach(device, &b);
    return b.ptr;
}

uintptr_t cache_take_back(int device, const park_words *pw, uintptr_t ptr, CUstream stream,
                          uint64_t size, int carved, int *kept)
{
    tslot *mine = my_slot(device);
    *kept = 0;
    if (!mine || &mine->park != pw || atomic_load_explicit(&mine->ptr, RELAXED) != ptr)
        return 0;
    return mine_take_back(&caches[device], mine, ptr, stream, size, carved, kept);
}

park_words *cache_park_words(int device)
{
    tslot *mine = my_slot(device);
    return mine ? &mine->park : NULL;
}

park_words *cache_park_words_made(int device)
{
    dcache *c = &caches[device];
    tslot *mine = my_slot(device);
    if (!mine && atomic_load_explicit(&c->slots_on, RELAXED))
        mine = slot_attach(c, device);
    return mine ? &mine->park : NULL;
}

int cache_park(int device, CUstream stream, uint64_t size, uintptr_t ptr, int tag, uint64_t held,
               park_words *pw)
{
    dcache *c = &caches[device];
    tslot *mine = my_slot(device);
    if (!mine || &mine->park != pw || !atomic_load_explicit(&c->slots_on, RELAXED) ||
        !atomic_load_explicit(&c->limit, RELAXED) ||
        size > atomic_load_explicit(&c->max_block, RELAXED) ||
        atomic_load_explicit(&c->held, RELAXED) || atomic_load_explicit(&mine->ptr, RELAXED) ||
        atomic_load_explicit(&mine->park.kept, RELAXED))
        return 0;
    int t = tier_of(c, size);
    if (!put_fits(c, t, held, size, tier_bytes(c, t)))
        return 0;
    /* absent to the table's readers (and out of the tag's figures, for
     * cache_kept's readers) before any thread can claim it */
    atomic_store_explicit(&mine->park.size, size, RELAXED);
    atomic_store_explicit(&mine->park.tag, tag, RELAXED);
    atomic_store_explicit(&mine->park.kept, ptr, memory_order_release);
    slot_fill(c, mine, ptr, size, stream, t, 0);
    return 1;
}

int cache_park_carved(int device, CUstream stream, uint64_t size, uintptr_t ptr, int tag,
                      park_words *pw, int evict)
{
    dcache *c = &caches[device];
    tslot *mine = my_slot(device);
    if (!mine || &mine->park != pw || !atomic_load_explicit(&c->slots_on, RELAXED) ||
        !atomic_load_explicit(&c->limit, RELAXED) || atomic_load_explicit(&c->held, RELAXED))
        return 0;
    uintptr_t a = atomic_load_explicit(&mine->ptr, RELAXED);
    if (a) {
        /* the slot's carved block back to its segment first (its record out
         * of the table clears the slot's `kept` word); a plain block stays */
        cache_block old;
        if (!evict || a == SLOT_BUSY || !atomic_load_explicit(&mine->carved, RELAXED) ||
            !slot_claim(c, mine, WANT_CARVED, NULL, 0, 0, &old))
            return 0;
        carved_leaves(device, &old);
    }
    if (atomic_load_explicit(&mine->park.kept, RELAXED))
        return 0; /* another thread's claim of the slot's block is detaching it */
    atomic_store_explicit(&mine->park.size, size, RELAXED);
    atomic_store_explicit(&mine->park.tag, tag, RELAXED);
    atomic_store_explicit(&mine->park.kept, ptr, memory_order_release);
    slot_fill(c, mine, ptr, size, stream, TIER_SMALL, 1);
    return 1;
}

uint64_t cache_parked_carved(int device)
{
    return atomic_load(&caches[device].parked_carved);
}

void cache_release_mine_carved(int device)
{
    tslot *mine = my_slot(device);
    cache_block b;
    if (mine && atomic_load_explicit(&mine->ptr, RELAXED) > SLOT_BUSY &&
        atomic_load_explicit(&mine->carved, RELAXED) &&
        slot_claim(&caches[device], mine, WANT_CARVED, NULL, 0, 0, &b))
        carved_leaves(device, &b);
}

uint64_t cache_release_carved(int device)
{
    dcache *c = &caches[device];
    uint64_t bytes = 0;
    if (!atomic_load_explicit(&c->parked_carved, RELAXED))
        return 0;
    for (tslot *s = atomic_load_explicit(&c->tslots, memory_order_acquire); s; s = s->next) {
        cache_block b;
        if (slot_claim(c, s, WANT_CARVED, NULL, 0, 0, &b)) {
            carved_leaves(device, &b);
            bytes += b.size;
        }
    }
    return bytes;
}

void cache_kept(int device, int tag, uint64_t *bytes, int64_t *count)
{
    uint64_t b = 0;
    int64_t n = 0;
    for (tslot *s = atomic_load_explicit(&caches[device].tslots, memory_order_acquire); s;
         s = s->next) {
        if (!atomic_load_explicit(&s->park.kept, memory_order_acquire) ||
            atomic_load_explicit(&s->park.tag, RELAXED) != tag)
            continue;
        b += atomic_load_explicit(&s->park.size, RELAXED);
        n++;
    }
    *bytes = b;
    *count = n;
}

/* The lists' newest block of the key, under the lock; 0 when none. */
static uintptr_t take_listed(dcache *c, CUstream stream, uint64_t size)
{
    if (!atomic_load_explicit(&c->bytes, memory_order_relaxed))
        return 0; /* nothing cached: no lock */
    uintptr_t p = 0;
    pthread_mutex_lock(&c->lock);
    slot *sl = c->slots ? find(c, stream, size, 0) : NULL;
    if (sl && sl->n) {
        /* the newest block of the key: the top of its list */
        uint32_t i = sl->top;
        node *nd = &c->nodes[i];
        tier *t = &c->tiers[nd->tier];
        p = nd->ptr;
        if (nd->newer != NONE)
            c->nodes[nd->newer].older = nd->older;
        else
            t->newest = nd->older;
        if (nd->older != NONE)
            c->nodes[nd->older].newer = nd->newer;
        else
            t->oldest = nd->newer;
        sl->top = nd->kolder;
        if (sl->top != NONE)
            c->nodes[sl->top].knewer = NONE;
        else
            sl->bottom = NONE;
        if (!--sl->n)
            c->live_keys--;
        nd->older = c->free_head;
        c->free_head = i;
        add_locked(&t->bytes, -size);
        add_locked(&c->bytes, -size);
    }
    pthread_mutex_unlock(&c->lock);
    return p;
}

/* The lists' arrays, allocated on the first put (under the lock). */
static void ensure_lists(dcache *c)
{
    if (!c->slots) {
        c->slots = calloc(SLOTS, sizeof(slot));
        c->nodes = c->slots ? malloc(NODES * sizeof(node)) : NULL;
        if (!c->nodes) {
            free(c->slots);
            c->slots = NULL;
        }
        c->nused = 0;
        c->free_head = NONE;
        reset_tiers(c);
    }
}

/* A block into the lists (the thread slots off, or this thread's slot being
 * claimed): `evicted` NULL means evict nothing, decline when the block does
 * not fit as the cache is. */
static int put_listed(dcache *c, CUstream stream, uint64_t size, uintptr_t ptr, uint64_t held,
                      cache_block *evicted, int *nevicted)
{
    int kept = 0;
    pthread_mutex_lock(&c->lock);
    ensure_lists(c);
    /* c->held: read under the lock already taken (no cost when nobody waits) */
    if (c->slots && !atomic_load_explicit(&c->held, RELAXED)) {
        /* the block's tier decides the cap it is held to (and the only
         * blocks it may evict: the other tier keeps its own) */
        int t = tier_of(c, size);
        tier *tr = &c->tiers[t];
        uint64_t bytes = tier_bytes(c, t);
        uint64_t cap = put_cap(c, t, held, size, bytes);
        /* no eviction allowed: no room in the block's tier as it is, no change
         * (not even a new key) */
        int room = evicted || bytes + size <= cap;
        slot *sl = NULL;
        if (room && size <= cap) {
            sl = find(c, stream, size, 1);
            if (!sl && compact(c))
                sl = find(c, stream, size, 1);
            if (sl && sl->n >= DEPTH)
                sl = NULL;
        }
        /* room for the block when it is kept; else back under the cap (the
         * block's own tier only: the other tier keeps its blocks) */
        if (evicted && bytes + size > cap)
            *nevicted = evict(c, t, cap, sl ? size : 0, evicted, BRIDGE_CACHE_EVICT_MAX);
        if (sl && tier_bytes(c, t) + size <= cap) {
            uint32_t i = new_node(c);
            if (i != NONE) {
                c->nodes[i].ptr = ptr;
                c->nodes[i].size = size;
                c->nodes[i].stream = stream;
                c->nodes[i].tier = (uint32_t)t;
                link_node(c, sl, i);
                add_locked(&tr->bytes, size);
                add_locked(&c->bytes, size);
                kept = 1;
            }
        }
    }
    pthread_mutex_unlock(&c->lock);
    return kept;
}

/* The slot's block `a` goes into the lists as their newest (under the lock):
 * 1 when linked, 0 when its key has no room (the caller evicts it). */
static int link_from_slot(dcache *c, const cache_block *a, int t)
{
    slot *sl = find(c, a->stream, a->size, 1);
    if (!sl && compact(c))
        sl = find(c, a->stream, a->size, 1);
    if (!sl || sl->n >= DEPTH)
        return 0;
    uint32_t i = new_node(c);
    if (i == NONE)
        return 0;
    c->nodes[i] = (node){.ptr = a->ptr, .size = a->size, .stream = a->stream, .tier = (uint32_t)t};
    link_node(c, sl, i);
    add_locked(&c->tiers[t].bytes, a->size);
    add_locked(&c->bytes, a->size);
    atomic_fetch_sub_explicit(&c->parked[t], a->size, RELAXED);
    return 1;
}

/* A freed block into the calling thread's slot, as the newest of its tier:
 * put_listed's rule, with the slot's earlier block (if any) the newest below
 * it.  No lock when the slot is empty and the block fits under its cap. */
static int put_via_slot(dcache *c, tslot *mine, CUstream stream, uint64_t size, uintptr_t ptr,
                        uint64_t held, cache_block *evicted, int *nevicted)
{
    if (atomic_load_explicit(&c->held, RELAXED))
        return 0; /* threads wait for memory: nothing is kept */
    int t = tier_of(c, size);
    uintptr_t a = atomic_load_explicit(&mine->ptr, memory_order_acquire);
    if (a > SLOT_BUSY && atomic_load_explicit(&mine->carved, RELAXED)) {
        /* a carved block goes back to its segment (a detach and the carve
         * lock: not for a free that evicts nothing, which may hold a shard
         * lock); the slot is then empty */
        cache_block old;
        if (!evicted || !slot_claim(c, mine, WANT_CARVED, NULL, 0, 0, &old))
            return put_listed(c, stream, size, ptr, held, evicted, nevicted);
        carved_leaves((int)(c - caches), &old);
        a = atomic_load_explicit(&mine->ptr, memory_order_acquire);
    }
    if (!a && put_fits(c, t, held, size, tier_bytes(c, t))) {
        slot_fill(c, mine, ptr, size, stream, t, 0);
        return 1;
    }
    /* The slot's block leaves it, still counted in its tier (`parked`) until
     * it is linked, evicted or put back; a claim under way: the lists. */
    cache_block old = {0, 0, NULL, 0, 0};
    int ot = 0;
    if (a) {
        /* a block parked with its record: detaching it takes a shard lock,
         * which a free that evicts nothing may hold already (bridge_free_cached) */
        int parked = a != SLOT_BUSY && atomic_load_explicit(&mine->park.kept, RELAXED) == a;
        if (a == SLOT_BUSY || (parked && !evicted) ||
            !atomic_compare_exchange_strong_explicit(&mine->ptr, &a, 0, memory_order_acquire,
                                                     RELAXED))
            return put_listed(c, stream, size, ptr, held, evicted, nevicted);
        old = (cache_block){a, atomic_load_explicit(&mine->size, RELAXED),
                            atomic_load_explicit(&mine->stream, RELAXED), parked, 0};
        ot = (int)atomic_load_explicit(&mine->tier, RELAXED);
        detach((int)(c - caches), &old);
    }
    int kept = 0;
    pthread_mutex_lock(&c->lock);
    ensure_lists(c);
    if (c->slots && !atomic_load_explicit(&c->held, RELAXED)) {
        uint64_t bytes = tier_bytes(c, t);
        uint64_t cap = put_cap(c, t, held, size, bytes);
        int want = (evicted || bytes + size <= cap) && size <= cap;
        if (evicted && bytes + size > cap) {
            uint64_t extra = want ? size : 0;
            *nevicted = evict(c, t, cap, extra, evicted, BRIDGE_CACHE_EVICT_MAX);
            /* the slot's block is the newest below this one: evicted last */
            if (old.ptr && ot == t && tier_bytes(c, t) + extra > cap &&
                *nevicted < BRIDGE_CACHE_EVICT_MAX) {
                evicted[(*nevicted)++] = old;
                atomic_fetch_sub_explicit(&c->parked[ot], old.size, RELAXED);
                old.ptr = 0;
            }
        }
        if (want && tier_bytes(c, t) + size <= cap) {
            kept = 1;
            if (old.ptr && !link_from_slot(c, &old, ot)) {
                if (evicted && *nevicted < BRIDGE_CACHE_EVICT_MAX) {
                    evicted[(*nevicted)++] = old;
                    atomic_fetch_sub_explicit(&c->parked[ot], old.size, RELAXED);
                } else {
                    kept = 0; /* no room for the older block: this one is not kept */
                }
            }
            if (kept) {
                slot_fill(c, mine, ptr, size, stream, t, 0);
                old.ptr = 0;
            }
        }
    }
    if (old.ptr) /* still the slot's */
        atomic_store_explicit(&mine->ptr, old.ptr, memory_order_release);
    pthread_mutex_unlock(&c->lock);
    return kept;
}

/* cache_put and cache_put_no_evict: `evicted` NULL means evict nothing,
 * decline when the block does not fit as the cache is. */
static int put(int device, CUstream stream, uint64_t size, uintptr_t ptr, uint64_t held,
               cache_block *evicted, int *nevicted)
{
    dcache *c = &caches[device];
    if (!atomic_load_explicit(&c->limit, memory_order_relaxed) ||
        size > atomic_load_explicit(&c->max_block, memory_order_relaxed))
        return 0;
    tslot *mine = NULL;
    if (atomic_load_explicit(&c->slots_on, RELAXED) && !(mine = my_slot(device)))
        mine = slot_attach(c, device);
    if (mine)
        return put_via_slot(c, mine, stream, size, ptr, held, evicted, nevicted);
    return put_listed(c, stream, size, ptr, held, evicted, nevicted);
}

int cache_put(int device, CUstream stream, uint64_t size, uintptr_t ptr, uint64_t held,
              cache_block *evicted, int *nevicted)
{
    *nevicted = 0;
    return put(device, stream, size, ptr, held, evicted, nevicted);
}

int cache_put_no_evict(int device, CUstream stream, uint64_t size, uintptr_t ptr, uint64_t held)
{
    return put(device, stream, size, ptr, held, NULL, NULL);
}

int cache_trim(int device, uint64_t held, cache_block *evicted)
{
    dcache *c = &caches[device];
    if (!all_bytes(c))
        return 0;
    int k = 0;
    pthread_mutex_lock(&c->lock);
    /* each tier down to its cap, the small one first (the large tier's cap
     * is then read with the small tier's bytes after the eviction); the
     * slots last, their blocks being the newest */
    for (int t = 0; t < TIERS && k < BRIDGE_CACHE_EVICT_MAX; t++) {
        if (c->slots)
            k += evict(c, t, cap_for(c, t, held, 0), 0, evicted + k, BRIDGE_CACHE_EVICT_MAX - k);
        while (k < BRIDGE_CACHE_EVICT_MAX && tier_bytes(c, t) > cap_for(c, t, held, 0) &&
               claim_slots(c, WANT_TIER, NULL, 0, t, evicted + k, 1))
            k++;
    }
    pthread_mutex_unlock(&c->lock);
    return k;
}

/* Every thread's slot block that `want` accepts, handed to `release`; the bytes. */
static uint64_t release_slots(dcache *c, int device, int want, CUstream stream,
                              cache_release_fn release)
{
    enum { BATCH = 64 };
    cache_block out[BATCH];
    uint64_t bytes = 0;
    int n;
    do {
        n = claim_slots(c, want, stream, 0, 0, out, BATCH);
        for (int k = 0; k < n; k++) {
            bytes += out[k].size;
            if (out[k].carved) { /* to its segment, in stream order */
                carved_leaves(device, &out[k]);
                continue;
            }
            detach(device, &out[k]);
            release(device, out[k].ptr, out[k].size, out[k].stream);
        }
    } while (n == BATCH);
    return bytes;
}

uint64_t cache_flush(int device, cache_release_fn release)
{
    dcache *c = &caches[device];
    if (!atomic_load(&c->bytes))
        return release_slots(c, device, WANT_ANY, NULL, release);
    /* Take the blocks out under the lock, release them after it. */
    pthread_mutex_lock(&c->lock);
    slot *old = c->slots;
    node *nodes = c->nodes;
    uint32_t first[TIERS];
    for (int t = 0; t < TIERS; t++)
        first[t] = c->tiers[t].oldest;
    c->slots = NULL;
    c->nodes = NULL;
    c->free_head = NONE;
    reset_tiers(c);
    c->nused = 0;
    c->keys = 0;
    c->live_keys = 0;
    uint64_t bytes = atomic_exchange(&c->bytes, 0);
    pthread_mutex_unlock(&c->lock);
    for (int t = 0; nodes && t < TIERS; t++)
        for (uint32_t i = first[t]; i != NONE; i = nodes[i].newer)
            release(device, nodes[i].ptr, nodes[i].size, nodes[i].stream);
    free(nodes);
    free(old);
    return bytes + release_slots(c, device, WANT_ANY, NULL, release);
}

uint64_t cache_flush_stream(int device, CUstream stream, cache_release_fn release)
{
    dcache *c = &caches[device];
    uint64_t bytes = release_slots(c, device, WANT_STREAM, stream, release);
    if (!atomic_load(&c->bytes))
        return bytes;
    enum { BATCH = 64 };
    cache_block out[BATCH];
    for (;;) {
        /* a batch at a time, oldest first: taken under the lock, released after */
        int n = 0;
        pthread_mutex_lock(&c->lock);
        for (int t = 0; c->slots && t < TIERS; t++) {
            for (uint32_t i = c->tiers[t].oldest; i != NONE && n < BATCH;) {
                node *nd = &c->nodes[i];
                uint32_t next = nd->newer;
                if (nd->stream == stream) {
                    out[n++] = (cache_block){nd->ptr, nd->size, nd->stream, 0, 0};
                    unlink_node(c, find(c, nd->stream, nd->size, 0), i);
                }
                i = next;
            }
        }
        pthread_mutex_unlock(&c->lock);
        for (int k = 0; k < n; k++) {
            release(device, out[k].ptr, out[k].size, out[k].stream);
            bytes += out[k].size;
        }
        if (n < BATCH)
            return bytes;
    }
}

void cache_hold(int device, int on)
{
    dcache *c = &caches[device];
    pthread_mutex_lock(&c->lock);
    atomic_fetch_add_explicit(&c->held, on ? 1 : -1, RELAXED);
    pthread_mutex_unlock(&c->lock);
}

uint64_t cache_blocks(int device)
{
    dcache *c = &caches[device];
    uint64_t n = 0;
    pthread_mutex_lock(&c->lock);
    for (int t = 0; c->nodes && t < TIERS; t++)
        for (uint32_t i = c->tiers[t].oldest; i != NONE; i = c->nodes[i].newer)
            n++;
    pthread_mutex_unlock(&c->lock);
    for (tslot *s = atomic_load_explicit(&c->tslots, memory_order_acquire); s; s = s->next)
        n += atomic_load_explicit(&s->ptr, RELAXED) > SLOT_BUSY &&
             !atomic_load_explicit(&s->carved, RELAXED); /* a carved one is a segment's */
    return n;
}

uint64_t cache_bytes(int device)
{
    /* the carved classes' idle bytes too, and the carved blocks parked in
     * thread slots (still carved, so not in carve_idle): every byte kept for
     * reuse */
    return all_bytes(&caches[device]) +
           atomic_load_explicit(&caches[device].parked_carved, RELAXED) + carve_idle(device);
}

uint64_t cache_limit(int device)
{
    return atomic_load(&caches[device].limit);
}

void cache_set_limits(int device, uint64_t limit, uint64_t max_block)
{
    atomic_store(&caches[device].limit, limit);
    atomic_store(&caches[device].max_block, max_block);
}

void cache_set_share(int device, uint64_t fraction_q16, uint64_t floor)
{
    atomic_store(&caches[device].fraction, fraction_q16);
    atomic_store(&caches[device].floor, floor);
}

uint64_t cache_fraction_q16(int device)
{
    return atomic_load(&caches[device].fraction);
}

uint64_t cache_floor(int device)
{
    return atomic_load(&caches[device].floor);
}

void cache_set_tiers(int device, uint64_t small_max, uint64_t large_cap)
{
    atomic_store(&caches[device].small_max, small_max);
    atomic_store(&caches[device].large_cap, large_cap);
}

uint64_t cache_small_max(int device)
{
    return atomic_load(&caches[device].small_max);
}

uint64_t cache_large_cap(int device)
{
    return atomic_load(&caches[device].large_cap);
}

void cache_set_large_fraction(int device, uint64_t fraction_q16)
{
    atomic_store(&caches[device].large_fraction, fraction_q16);
}

uint64_t cache_large_fraction_q16(int device)
{
    return atomic_load(&caches[device].large_fraction);
}

uint64_t cache_tier_bytes(int device, int large)
{
    return tier_bytes(&caches[device], large ? TIER_LARGE : TIER_SMALL);
}

/* A fork child forgets the parent's cached blocks without taking a lock. */
void cache_forget_after_fork(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    for (int i = 0; i < BRIDGE_MAX_DEVICES; i++) {
        caches[i].lock = fresh;
        caches[i].slots = NULL;
        caches[i].nodes = NULL;
        caches[i].nused = 0;
        caches[i].free_head = NONE;
        reset_tiers(&caches[i]);
        caches[i].keys = caches[i].live_keys = 0;
        caches[i].held = 0;
        atomic_store(&caches[i].bytes, 0);
        /* the parent's slots (and their blocks) are forgotten with it */
        atomic_store(&caches[i].tslots, NULL);
        for (int t = 0; t < TIERS; t++)
            atomic_store(&caches[i].parked[t], 0);
        atomic_store(&caches[i].parked_carved, 0);
    }
    /* the forking thread's slots, the child's only thread */
    if (my_slots)
        memset(my_slots, 0, BRIDGE_MAX_DEVICES * sizeof *my_slots);
}

void cache_set_thread_slots(int device, int on)
{
    atomic_store(&caches[device].slots_on, on != 0);
}

int cache_thread_slots(int device)
{
    return atomic_load(&caches[device].slots_on);
}
