# SPDX-License-Identifier: Apache-2.0
"""The module functions made from the bindings' tables (bridge/_native/python/pybind.h).

One C body serves every row of a table, by the row's kind; these tests hold the
Python face of each kind to what the hand-written wrappers gave: plain builtins of
bridge._core, the argument conventions (counts, defaults, types), the shapes of the
results (status, bool, (status, out), str, None) and the errors of bad arguments.
"""

from __future__ import annotations

import types

import pytest

from bridge._errors import Status
from bridge._runtime import core
from bridge.pool import POOL_ATTR_RELEASE_THRESHOLD

MIB = 1 << 20


def test_every_function_is_a_plain_builtin_of_the_module() -> None:
    functions = [
        getattr(core, n)
        for n in dir(core)
        if isinstance(getattr(core, n), types.BuiltinFunctionType)
    ]
    assert len(functions) > 60
    for f in functions:
        assert f.__self__ is core, f
        assert f.__module__ == "bridge._core", f
        assert repr(f) == f"<built-in function {f.__name__}>"
        assert f.__doc__, f"{f.__name__} has no docstring"


def test_docstrings_of_table_rows() -> None:
    assert core.trim.__doc__ == "trim(device, keep=0) -> status"
    assert core.device_count.__doc__ == "-> (status, count)"
    assert core.init.__doc__ == "init(path=None) -> status: load the driver."
    assert core.pinned_trim.__doc__ == "pinned_trim() -> status"


def test_bool_results(standin: object) -> None:
    for value in (core.ready(0), core.ipc_enabled(0), core.initialized(), core.forked()):
        assert type(value) is bool
    assert core.ready(0) is True
    assert core.initialized() is True
    assert core.ready(99) is False


def test_status_and_out_pairs(standin: object) -> None:
    assert core.device_count() == (Status.OK, 2)  # the stand-in's BRIDGE_STANDIN_DEVICES
    rc, version = core.driver_version()
    assert rc == Status.OK and isinstance(version, int) and version > 0
    rc, _ = core.grant_peer_access(0)
    assert rc == Status.OK
    assert core.others(0) == (Status.OK, 0)
    rc, threshold = core.pool_attribute(0, POOL_ATTR_RELEASE_THRESHOLD)
    assert rc == Status.OK and isinstance(threshold, int)
    assert core.pinned_setup(core.PINNED_CACHED) == (Status.OK, core.PINNED_CACHED)


def test_status_results_carry_the_core_s_code(standin: object) -> None:
    assert core.reassert(0) == Status.OK
    assert core.reassert(99) == Status.DEVICE
    assert core.set_limit(99, 0) == Status.DEVICE
    assert core.set_tag_limit(0, 99, 0) == Status.INVALID
    assert core.record_stream(0x1234, 0) != Status.OK  # not an allocation


def test_optional_arguments_take_the_documented_defaults(standin: object) -> None:
    core.set_cache_tiers(0, 4 * MIB, 32 * MIB)
    assert core.set_cache_tiers(0) == Status.OK
    raw = core.stats(0)[1]
    assert (raw["cache_small_max"], raw["cache_large_cap"]) == (MIB, 64 * MIB)
    core.set_cache_fraction(0, 1 / 8, 8 * MIB)
    assert core.set_cache_fraction(0, 1 / 4) == Status.OK
    raw = core.stats(0)[1]
    assert (raw["cache_fraction"], raw["cache_floor"]) == (0.25, 64 * MIB)
    assert core.trim(0) == Status.OK
    assert core.reset_peak(0) == Status.OK
    assert core.reset_accumulated(0) == Status.OK
    assert core.set_cache_segments(0) == Status.OK


def test_pointers_go_through_as_addresses(standin: object) -> None:
    before = core.live_records()
    rc, p = core.alloc(0, MIB, 0, core.TAG_OTHER)
    assert rc == Status.OK and p
    assert core.live_records() == before + 1
    assert core.record_stream(p, 0x5000) == Status.OK
    assert core.free(p) is None
    assert core.live_records() == before
    assert core.free(0) is None  # never raises
    assert core.ipc_release(0) is None


def test_struct_getters_give_status_and_their_converters_result(standin: object) -> None:
    # the `get` kind: parse the device, fill the core's struct, convert it
    rc, raw = core.stats(0)
    assert rc == Status.OK and isinstance(raw, dict)
    assert len(raw["tags"]) == core.NTAGS and raw["cache_small_max"] == MIB
    rc, info = core.mem_info(0)
    assert rc == Status.OK and info["total"] > 0 and set(info) >= {"free", "held", "limit"}
    assert core.share_stats(0) == (Status.OK, None)  # not joined
    # a refused call still converts what the core left: zeros
    rc, raw = core.stats(99)
    assert rc == Status.DEVICE and raw["cache_small_max"] == 0 and raw["tags"][0]["peak"] == 0
    assert core.mem_info(99)[0] == Status.DEVICE
    assert core.share_stats(99) == (Status.DEVICE, None)


def test_rows_of_more_arguments(standin: object) -> None:
    assert isinstance(core.get_wait(), float)
    assert core.set_thread_wait(False, 0.0, 0) == Status.OK
    assert core.set_cache_carve(0) == Status.OK  # every optional argument at its default
    assert core.set_cache_carve(0, 0.0) == Status.OK  # max 0: off
    assert core.history(True, False, 16, True) == Status.OK
    rc, p = core.alloc(0, MIB, 0, core.TAG_OTHER)
    assert rc == Status.OK
    core.free(p)
    events = core.history_events()
    assert [e[0:1] + e[2:5] for e in events][-2:] == [
        (events[-2][0], 0, p, MIB),
        (events[-1][0], 0, p, MIB),
    ]
    assert [e[1] for e in events[-2:]] == [core.EV_ALLOC, core.EV_FREE]
    assert core.history(False, False, 16, True) == Status.OK
    assert core.pinned_record(0x1234, 0) != Status.OK  # not a pinned block


def test_strings(standin: object) -> None:
    assert isinstance(core.loaded_library(), str) and core.loaded_library()
    assert isinstance(core.load_error(), str)
    assert isinstance(core.ipc_error(), str)
    assert isinstance(core.share_error(), str)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: core.reassert(), "function takes exactly 1 argument (0 given)"),
        (lambda: core.set_limit(0), "function takes exactly 2 arguments (1 given)"),
        (lambda: core.trim(), "function takes at least 1 argument (0 given)"),
        (lambda: core.trim(0, 0, 0), "function takes at most 2 arguments (3 given)"),
        (lambda: core.reassert("0"), "'str' object cannot be interpreted as an integer"),
        (lambda: core.free(None), "int"),
        (lambda: core.set_cache_large_fraction(0, "x"), "must be real number, not str"),
        (lambda: core.initialized(0), "initialized() takes no arguments (1 given)"),
        (lambda: core.init(0), "str or None"),
        (lambda: core.set_cache_carve(0, 1.0, 1, 2, 3, 4, 5), "at most 6 arguments (7 given)"),
        (lambda: core.set_thread_wait(True), "exactly 3 arguments (1 given)"),
        (lambda: core.share_join(0, "n"), "exactly 4 arguments (2 given)"),
        (lambda: core.stats(), "exactly 1 argument (0 given)"),
        (lambda: core.get_wait(1), "get_wait() takes no arguments (1 given)"),
    ],
)
def test_bad_arguments_raise_type_error(call: object, message: str) -> None:
    with pytest.raises(TypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call()  # type: ignore[operator]


def test_an_int_past_the_c_int_raises_overflow_error() -> None:
    with pytest.raises(OverflowError):
        core.set_limit(1 << 40, 0)


def test_a_block_says_its_address_size_and_device(standin: object) -> None:
    # on Python 3.10 and 3.11 PyUnicode_FromFormat knows no %zx: the repr is made without it
    rc, block = core.alloc_block(0, MIB, 0, core.TAG_OTHER)
    assert rc == Status.OK and block is not None
    assert repr(block) == f"<bridge block {hex(block.ptr)}, {MIB} bytes, device 0>"
    del block
