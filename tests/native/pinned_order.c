/* SPDX-License-Identifier: Apache-2.0 */
/* pinned_order.c: recording by address against a block whose last view is being dropped.
 *
 * bridge_pinned_record finds the block by address (bridge.pinned_record(int, stream)) and
 * holds a reference of its own while it records.  The last release decrements the count to 0
 * and only then takes the pool's lock to move the block to the free lists; in between, the
 * block is still in the table of lent blocks.  A record that took a reference there (0 -> 1)
 * released it again, and the block went onto the free lists twice: lent to two owners, the
 * figures off by its size, freed twice by a trim.  A record now takes a reference only from
 * a count that is not 0, and finds no lent block there (BRIDGE_E_INVALID).
 *
 * The interleaving is made deterministic: pinned.c is compiled into this program with
 * PIN_TEST_AFTER_LAST_RELEASE defined, a hook bridge_pinned_release calls between its last
 * decrement and its lock; the hook records against the block's address right there, as
 * another thread would.  Built and run by scripts/sanitize with each sanitizer (and the
 * stand-in driver).
 *
 * Usage: pinned_order <libstandin_cuda.so>
 */
#define PIN_TEST_AFTER_LAST_RELEASE(b) after_last_release(b)
struct bridge_pinned_block;
static void after_last_release(struct bridge_pinned_block *b);

#include "pinned.c"

#include <inttypes.h>
#include <stdio.h>

static struct bridge_pinned_block *_Atomic armed; /* the block the hook records against */
static int record_rc = -1000, lookup_rc = -1000;

static void after_last_release(struct bridge_pinned_block *b)
{
    struct bridge_pinned_block *want = b;
    if (!atomic_compare_exchange_strong(&armed, &want, NULL))
        return;
    /* another thread records a copy against the block's address, by address alone */
    record_rc = bridge_pinned_record((char *)b->ptr + 100, NULL);
    void *base;
    size_t size;
    lookup_rc = bridge_pinned_lookup((char *)b->ptr + 100, &base, &size);
}

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "pinned_order: %s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s <libstandin_cuda.so>\n", argv[0]);
        return 2;
    }
    CHECK(bridge_init(argv[1]) == BRIDGE_OK, "init: %s", bridge_load_error());
    int chosen = -1;
    CHECK(bridge_pinned_setup(BRIDGE_PINNED_CACHED, &chosen) == BRIDGE_OK, "pinned setup");

    const size_t size = 64 * 1024;
    bridge_pinned_block *b = NULL;
    CHECK(bridge_pinned_alloc(size, 1, &b) == BRIDGE_OK && b, "alloc");
    size_t cap = b->capacity;
    atomic_store(&armed, b);
    bridge_pinned_release(b); /* the last view is dropped; the hook records meanwhile */
    CHECK(atomic_load(&armed) == NULL, "the hook did not run");

    /* the block went back once */
    bridge_pinned_stats s;
    CHECK(bridge_pinned_get_stats(&s) == BRIDGE_OK, "stats");
    CHECK(s.used == 0 && s.n_live_blocks == 0, "%" PRIu64 " bytes, %" PRIu64 " blocks still lent",
          s.used, s.n_live_blocks);
    CHECK(s.n_free_blocks == 1 && s.free == cap && s.total == cap,
          "%" PRIu64 " free blocks of %" PRIu64 " bytes (total %" PRIu64 "), not 1 of %zu",
          s.n_free_blocks, s.free, s.total, cap);

    /* two owners get two blocks */
    bridge_pinned_block *x = NULL, *y = NULL;
    CHECK(bridge_pinned_alloc(size, 1, &x) == BRIDGE_OK && x, "alloc x");
    CHECK(bridge_pinned_alloc(size, 1, &y) == BRIDGE_OK && y, "alloc y");
    CHECK(x != y && bridge_pinned_ptr(x) != bridge_pinned_ptr(y), "one block lent twice: %p",
          bridge_pinned_ptr(x));

    /* the record found no lent block there, and said so */
    CHECK(record_rc == BRIDGE_E_INVALID, "record against a dropped block gave %d", record_rc);
    CHECK(lookup_rc == BRIDGE_E_INVALID, "lookup of a dropped block gave %d", lookup_rc);

    bridge_pinned_release(x);
    bridge_pinned_release(y);
    CHECK(bridge_pinned_trim() == BRIDGE_OK, "trim");
    CHECK(bridge_pinned_get_stats(&s) == BRIDGE_OK, "stats");
    CHECK(s.total == 0 && s.used == 0 && s.free == 0 && s.n_free_blocks == 0,
          "after a trim: total %" PRIu64 " used %" PRIu64 " free %" PRIu64, s.total, s.used,
          s.free);
    CHECK(s.num_base_frees == s.num_base_allocs, "%" PRIu64 " frees of %" PRIu64 " allocations",
          s.num_base_frees, s.num_base_allocs);
    printf("pinned_order: a record against a block being dropped found none; it went back once\n");
    return 0;
}
