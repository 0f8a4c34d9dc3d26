# SPDX-License-Identifier: Apache-2.0
"""The compiled core's ledger on the stand-in driver: exact figures and bad inputs.

Every figure asserted is one a user relies on: bytes per framework, statuses,
what the budget lets through, what the driver was asked to do.  The core is
process-global: tests compare against figures read at their start, free what
they allocate, and undo what they add to the stand-in (the `led` fixture).
"""

from __future__ import annotations

import pytest
from ledger_util import (
    C_FREE,
    DEV,
    GRAPH_BEGIN,
    MIB,
    S1,
    S2,
    TAG_CUPY,
    TAG_OTHER,
    TAG_TORCH,
    others,
    stats,
)

from bridge._errors import Status
from bridge._runtime import core


# ---- exact figures ----
def test_figures_are_exact_per_tag(led):
    s0 = stats()
    pc = led.ok(1000, tag=TAG_CUPY)
    pt = led.ok(3000, tag=TAG_TORCH)
    po = led.ok(500, tag=TAG_OTHER)
    s = stats()
    assert s["used"] == 4500
    assert s["pool_used"] == s0["pool_used"] + 4500
    assert [t["current"] for t in s["tags"]] == [500, 1000, 3000, 0, 0]
    assert [t["peak"] for t in s["tags"]] == [500, 1000, 3000, 0, 0]
    assert s["peak_used"] == 4500
    assert s["num_allocs"] == s0["num_allocs"] + 3
    for i, n in enumerate((500, 1000, 3000)):
        assert s["tags"][i]["allocated"] == s0["tags"][i]["allocated"] + n
        assert s["tags"][i]["num_allocs"] == s0["tags"][i]["num_allocs"] + 1
    assert others() == 0
    assert core.lookup(pc) == (Status.OK, 1000, DEV, TAG_CUPY)
    assert core.lookup(pt) == (Status.OK, 3000, DEV, TAG_TORCH)
    assert core.lookup(po) == (Status.OK, 500, DEV, TAG_OTHER)

    led.free(pt)
    s = stats()
    assert s["used"] == 1500
    assert [t["current"] for t in s["tags"]] == [500, 1000, 0, 0, 0]
    assert s["tags"][TAG_TORCH]["peak"] == 3000
    assert s["tags"][TAG_TORCH]["freed"] == s0["tags"][TAG_TORCH]["freed"] + 3000
    assert s["tags"][TAG_TORCH]["num_frees"] == s0["tags"][TAG_TORCH]["num_frees"] + 1
    assert s["num_frees"] == s0["num_frees"] + 1
    assert s["peak_used"] == 4500
    assert core.lookup(pt)[0] == Status.INVALID
    # the free is queued on its stream: the pool still holds the bytes, and
    # until the stream gets there they count as held by someone else
    assert led.sd.standin_pending_bytes(DEV) == 3000
    assert others() == 3000
    led.sd.standin_sync_all(DEV)
    assert others() == 0
    assert stats()["pool_used"] == s0["pool_used"] + 1500

    led.free(pc)
    led.free(po)
    s = stats()
    assert s["used"] == 0
    assert [t["current"] for t in s["tags"]] == [0] * core.NTAGS
    assert s["num_frees"] == s0["num_frees"] + 3


def test_addresses_are_distinct_and_live_records_counted(led):
    n0 = core.live_records()
    ptrs = [led.ok(4096 + i) for i in range(100)]
    assert len(set(ptrs)) == 100
    assert core.live_records() == n0 + 100
    assert stats()["used"] == sum(4096 + i for i in range(100))
    for p in ptrs:
        led.free(p)
    assert core.live_records() == n0


def test_devices_are_accounted_separately(led):
    p1 = led.ok(7 * MIB, dev=1, tag=TAG_TORCH)
    assert core.lookup(p1) == (Status.OK, 7 * MIB, 1, TAG_TORCH)
    assert stats(1)["used"] == 7 * MIB
    assert stats(0)["used"] == 0
    assert core.set_limit(0, MIB) == Status.OK
    p2 = led.ok(2 * MIB, dev=1)  # device 0's budget does not apply to device 1
    assert stats(1)["used"] == 9 * MIB
    led.free(p1)
    led.free(p2)


def test_block_frees_itself_when_dropped(led):
    s0 = stats()
    rc, block = core.alloc_block(DEV, 3 * MIB, S1, TAG_CUPY)
    assert rc == Status.OK
    assert (block.size, block.device) == (3 * MIB, DEV)
    assert core.lookup(block.ptr) == (Status.OK, 3 * MIB, DEV, TAG_CUPY)
    assert stats()["tags"][TAG_CUPY]["current"] == 3 * MIB
    del block
    s = stats()
    assert s["used"] == 0 and s["tags"][TAG_CUPY]["current"] == 0
    assert s["num_frees"] == s0["num_frees"] + 1


def test_alloc_block_refused_gives_none(led):
    core.set_limit(DEV, MIB)
    rc, block = core.alloc_block(DEV, MIB + 1, S1, TAG_CUPY)
    assert (rc, block) == (Status.BUDGET, None)
    with pytest.raises(ValueError):
        core.alloc_block(DEV, -1, S1, TAG_CUPY)


# ---- bad inputs ----
def test_negative_size_raises_valueerror(led):
    s0 = stats()
    with pytest.raises(ValueError, match="size"):
        core.alloc(DEV, -1, S1, TAG_CUPY)
    with pytest.raises(ValueError, match="size"):
        core.alloc_graph(DEV, -1, TAG_TORCH, 1, 2)
    assert stats()["num_allocs"] == s0["num_allocs"]
    assert stats()["num_ooms"] == s0["num_ooms"]


def test_size_zero_gives_null_and_ok(led):
    s0 = stats()
    assert core.alloc(DEV, 0, S1, TAG_CUPY) == (Status.OK, 0)
    assert core.alloc_graph(DEV, 0, TAG_TORCH, 1, 2) == (Status.OK, 0)
    s = stats()
    assert s["num_allocs"] == s0["num_allocs"] and s["used"] == 0
    core.free(0)  # freeing null is a no-op, not a bad free
    assert stats()["num_bad_frees"] == s0["num_bad_frees"]


@pytest.mark.parametrize("tag", [-1, core.NTAGS, 255])
def test_bad_tag_is_invalid(led, tag):
    s0 = stats()
    assert core.alloc(DEV, MIB, S1, tag) == (Status.INVALID, 0)
    assert core.alloc_graph(DEV, MIB, tag, 1, 2) == (Status.INVALID, 0)
    s = stats()
    assert s["used"] == 0
    assert s["num_ooms"] == s0["num_ooms"]  # a bad argument is not an OOM


@pytest.mark.parametrize("dev", [2, 7, 63, 64, -1, 1000])
def test_bad_device(led, dev):
    assert core.alloc(dev, MIB, S1, TAG_CUPY) == (Status.DEVICE, 0)
    assert core.alloc_graph(dev, MIB, TAG_CUPY, 1, 2) == (Status.DEVICE, 0)
    assert core.stats(dev)[0] == Status.DEVICE
    assert core.others(dev)[0] == Status.DEVICE
    assert core.trim(dev) == Status.DEVICE
    assert core.graph(GRAPH_BEGIN, dev, 1, 2) == Status.DEVICE


def test_double_free_and_unknown_pointer_change_nothing_but_bad_frees(led):
    p = led.ok(2 * MIB)
    keep = led.ok(MIB)
    led.free(p)
    s0 = stats()
    frees = led.counter(C_FREE)
    live = core.live_records()
    core.free(p)  # double free
    core.free(0x7E00DEAD0000)  # never handed out
    core.free(keep + 8)  # inside a live block, not its start
    s = stats()
    assert s["num_bad_frees"] == s0["num_bad_frees"] + 3
    for key in ("used", "num_frees", "num_allocs", "num_driver_errors", "pool_used"):
        assert s[key] == s0[key], key
    assert s["tags"] == s0["tags"]
    assert led.counter(C_FREE) == frees  # nothing reached the driver
    assert core.live_records() == live
    assert core.lookup(keep) == (Status.OK, MIB, DEV, TAG_CUPY)
    led.free(keep)


def test_lookup_and_record_stream_of_unknown_pointer(led):
    assert core.lookup(0x7E00DEAD0000)[0] == Status.INVALID
    assert core.lookup(0)[0] == Status.INVALID
    assert core.record_stream(0x7E00DEAD0000, S2) == Status.INVALID
