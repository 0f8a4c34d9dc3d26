/* SPDX-License-Identifier: Apache-2.0 */
/* share_order.c: the order in which a reclaimer reads a slot (issue 30, item 6).
 *
 * A member that joins writes its slot's start time, then the generation that
 * vouches for it (fields_gen).  A reclaimer (another member's service thread,
 * or a refused member) must read them in the other order: the generation,
 * then the start time.  Read start-first, it can pair the former owner's
 * start time with the new owner's generation, judge the new owner dead (its
 * start time does not match) and free a live member's slot.
 *
 * The interleaving is made deterministic: share.c is compiled into this
 * program with SHARE_TEST_BETWEEN_READS defined, a hook reclaim_dead calls
 * between its two reads of a slot; the hook completes the new owner's set-up
 * (start time, then generation) right there.  Built and run by
 * scripts/sanitize with each sanitizer (and the stand-in driver).
 *
 * Usage: share_order <libstandin_cuda.so>
 */
#define SHARE_TEST_BETWEEN_READS(slot) between_reads(slot)
struct share_slot;
static void between_reads(struct share_slot *slot);

#include "share.c"

#include <sys/wait.h>

static struct share_slot *_Atomic armed; /* the slot whose set-up the hook completes */
static uint64_t new_start;
static uint32_t new_gen;

static void between_reads(struct share_slot *slot)
{
    struct share_slot *want = slot;
    if (!atomic_compare_exchange_strong(&armed, &want, NULL))
        return;
    /* the new owner finishes setting up, in join's order */
    atomic_store(&slot->start, new_start);
    atomic_store(&slot->fields_gen, new_gen);
}

#define CHECK(cond, ...)                                                                          \
    do {                                                                                          \
        if (!(cond)) {                                                                            \
            fprintf(stderr, "share_order: %s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                                         \
            fputc('\n', stderr);                                                                  \
            abort();                                                                              \
        }                                                                                         \
    } while (0)

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s <libstandin_cuda.so>\n", argv[0]);
        return 2;
    }
    CHECK(bridge_init(argv[1]) == BRIDGE_OK, "init: %s", bridge_load_error());
    CHECK(bridge_device_setup(0, UINT64_MAX) == BRIDGE_OK, "device setup");
    char dir[] = "/tmp/bridge-share-order-XXXXXX";
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    setenv("BRIDGE_SHARE_GROWTH", "2097152", 1);
    CHECK(bridge_share_join(0, "order", dir, 64ull << 20) == BRIDGE_OK, "join: %s",
          bridge_share_error());
    share_member *m = atomic_load(&bridge_devices[0].share);
    CHECK(m != NULL, "no membership");

    /* a live process that maps the file: this one (its own slot is another) */
    uint32_t live = (uint32_t)getpid();
    char state;
    uint64_t live_start = proc_start(live, &state);
    CHECK(live_start != 0, "the start time");

    /* a slot the live process is taking over from a former owner of generation 4:
     * its word says generation 5, its start time and fields_gen are still
     * the former owner's */
    share_slot *s = &m->slots[(m->me - m->slots + 7) % SHARE_SLOTS];
    CHECK(atomic_load(&s->word) == 0, "slot in use");
    atomic_store(&s->start, 12345);
    atomic_store(&s->fields_gen, 4);
    uint64_t word = w_make(5, live, 1);
    atomic_store(&s->word, word);
    new_start = live_start;
    new_gen = 5;
    int rounds = 0;
    for (; rounds < 50; rounds++) {
        atomic_store(&armed, s);
        reclaim_dead(m); /* this thread, or the service thread's round, meets the hook */
        if (!atomic_load(&armed))
            break;
    }
    CHECK(!atomic_load(&armed), "the hook never ran");
    CHECK(atomic_load(&s->word) == word,
          "a live member's slot was freed: its start time, read before its generation, "
          "was the former owner's (word %llx)",
          (unsigned long long)atomic_load(&s->word));
    /* and a later look, with everything settled, keeps it too */
    reclaim_dead(m);
    CHECK(atomic_load(&s->word) == word, "a settled live member's slot was freed");

    /* a member that is gone (a reaped child's pid): the next look takes it back */
    pid_t child = fork();
    CHECK(child >= 0, "fork");
    if (child == 0)
        _exit(0);
    waitpid(child, NULL, 0);
    atomic_store(&s->word, w_make(6, (uint32_t)child, 1));
    reclaim_dead(m);
    CHECK(w_pid(atomic_load(&s->word)) == 0, "a dead member's slot was kept");
    printf("share_order: a reclaimer reads the generation before the start time\n");
    unlink(m->path);
    rmdir(dir);
    return 0;
}
