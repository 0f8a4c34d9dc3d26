# SPDX-License-Identifier: Apache-2.0
"""bridge.budget: sizes and budgets as users write them (pure Python, no driver)."""

from __future__ import annotations

import math
import warnings

import pytest

from bridge.budget import (
    GPU_LIMIT_ENV,
    HOST_MEMORY,
    PINNED_LIMIT_ENV,
    limit_from,
    parse_size,
    size_from_env,
    warn_if_above,
)

KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
TOTAL = 16 * GIB


# ---- what parses, and to how many bytes ----
@pytest.mark.parametrize(
    "value, expected",
    [
        (0, 0),  # 0 = no limit
        (1, 1),
        (1073741824, GIB),
        (2**64 - 1, 2**64 - 1),  # the largest budget the core can hold
        ("1073741824", GIB),
        ("9007199254740993", 2**53 + 1),  # exact: not rounded through a float
        ("18446744073709551615", 2**64 - 1),
        ("0", 0),
        ("40GiB", 40 * GIB),
        ("512MiB", 512 * MIB),
        ("40GB", 40 * 1000**3),
        ("40gib", 40 * GIB),  # units are case-insensitive
        ("4k", 4 * KIB),
        ("4KB", 4000),
        ("2T", 2 * TIB),
        ("2TB", 2 * 1000**4),
        ("100b", 100),
        (" 2 GiB ", 2 * GIB),  # spaces around and between
        ("1.5GiB", GIB + GIB // 2),
        (".5GiB", GIB // 2),
    ],
)
def test_sizes_in_bytes(value, expected):
    assert parse_size(value, total=TOTAL) == expected
    assert isinstance(parse_size(value, total=TOTAL), int)


@pytest.mark.parametrize(
    "value, expected",
    [
        (1.0, TOTAL),
        (0.5, TOTAL // 2),
        (0.25, TOTAL // 4),
        ("80%", int(0.8 * TOTAL)),
        ("100%", TOTAL),
        ("12.5%", TOTAL // 8),
        (" 50 % ", TOTAL // 2),
    ],
)
def test_fractions_and_percentages_of_total(value, expected):
    assert parse_size(value, total=TOTAL) == expected


def test_none_means_not_given():
    assert parse_size(None) is None
    assert parse_size(None, total=TOTAL) is None


@pytest.mark.parametrize("value", [0.5, "50%", "0.5"])
def test_fraction_without_total_is_refused(value):
    with pytest.raises(ValueError, match="total memory it is of"):
        parse_size(value, total=None)


@pytest.mark.parametrize(
    "value, expected",
    [("0.8", int(0.8 * TOTAL)), ("1.0", TOTAL), (" .25 ", TOTAL // 4), ("1", 1)],
)
def test_a_decimal_string_is_a_fraction_as_the_float_is(value, expected):
    # '0.8' is what a user writes for 0.8 where only text fits; '1' stays one byte
    assert parse_size(value, total=TOTAL) == expected


def test_the_hint_never_suggests_what_was_refused():
    with pytest.raises(ValueError) as info:
        parse_size("1.5", total=TOTAL, name="budget")
    msg = str(info.value)
    assert "budget='1.5'" in msg and "must be in (0, 1]" in msg
    assert "write bytes as a whole number" in msg
    # the forms it offers all parse
    for offered in ("1073741824", "40GiB", "80%", 0.8, "0.8"):
        assert offered in msg if isinstance(offered, str) else "0.8" in msg
        assert parse_size(offered, total=TOTAL)


def test_a_value_that_takes_no_share_says_so():
    with pytest.raises(ValueError) as info:
        parse_size("50%", total=TOTAL, name="release_threshold", of=None)
    msg = str(info.value)
    assert msg.startswith("release_threshold='50%' is not a valid size")
    assert "takes bytes, not a percentage or fraction" in msg
    assert "80%" not in msg and "40GiB" in msg
    with pytest.raises(ValueError, match="not a percentage or fraction"):
        parse_size(0.5, total=TOTAL, name="release_threshold", of=None)
    assert parse_size("4GiB", name="release_threshold", of=None) == 4 * GIB


def test_warn_if_above_names_both_sizes():
    with pytest.warns(UserWarning) as record:
        assert warn_if_above(
            40 * GIB, TOTAL, name="budget='40GiB'", of="the device's memory", stacklevel=1
        )
    msg = str(record[0].message)
    assert "budget='40GiB'" in msg and "40.00 GiB" in msg and "16.00 GiB" in msg
    assert "larger than the device's memory" in msg and "limits nothing" in msg
    assert record[0].filename == __file__  # points at the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_if_above(TOTAL, TOTAL, name="b", of="x")  # 100% is fine
        assert not warn_if_above(0, TOTAL, name="b", of="x")  # no limit
        assert not warn_if_above(40 * GIB, None, name="b", of="x")  # unknown total


# ---- what is refused, and how the refusal reads ----
@pytest.mark.parametrize(
    "value",
    [
        True,
        False,  # a bool is not a size, though it is an int
        -1,
        -GIB,
        "abc",
        "",
        "GiB",
        "40XB",
        "1e9",
        "-5GiB",
        "5 GiB 3",
        "1.5",  # a decimal without a unit is a fraction: past 1
        "0.0",
        "150%",
        "0%",
        "-10%",
        "%",
        1.5,
        0.0,
        -0.5,
        math.nan,
        math.inf,
        2**64,  # the core cannot hold it: would wrap to 0
        "16777217TiB",  # 2**64 + 2**40 bytes: would wrap to 1 TiB
        [GIB],
        {"size": GIB},
        b"1GiB",
    ],
)
def test_bad_values_raise_valueerror_naming_name_and_value(value):
    with pytest.raises(ValueError) as info:
        parse_size(value, total=TOTAL, name="budget")
    msg = str(info.value)
    assert f"budget={value!r}" in msg
    # the message says what would have been accepted
    assert "40GiB" in msg and "80%" in msg


def test_error_uses_the_callers_name():
    with pytest.raises(ValueError, match=r"^size='lots'"):
        parse_size("lots", total=TOTAL, name="size")


# ---- environment variables ----
@pytest.mark.parametrize("variable", [GPU_LIMIT_ENV, PINNED_LIMIT_ENV])
def test_env_unset_or_empty_means_none(monkeypatch, variable):
    monkeypatch.delenv(variable, raising=False)
    assert size_from_env(variable, total=TOTAL) is None
    monkeypatch.setenv(variable, "   ")
    assert size_from_env(variable, total=TOTAL) is None


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("1073741824", GIB),
        ("40GiB", 40 * GIB),
        ("512MiB", 512 * MIB),
        ("40GB", 40 * 1000**3),
        ("50%", TOTAL // 2),
        ("0.25", TOTAL // 4),  # a fraction, written as text
    ],
)
def test_env_values(monkeypatch, raw, expected):
    monkeypatch.setenv(GPU_LIMIT_ENV, raw)
    assert size_from_env(GPU_LIMIT_ENV, total=TOTAL) == expected


@pytest.mark.parametrize("variable", [GPU_LIMIT_ENV, PINNED_LIMIT_ENV])
@pytest.mark.parametrize("raw", ["lots", "-1", "150%", "1.5", "1.5GB!"])
def test_env_bad_value_names_variable_and_value(monkeypatch, variable, raw):
    monkeypatch.setenv(variable, raw)
    with pytest.raises(ValueError) as info:
        size_from_env(variable, total=TOTAL)
    assert f"{variable}={raw!r}" in str(info.value)


def test_env_hint_is_written_as_a_variable_holds_it(monkeypatch):
    monkeypatch.setenv(GPU_LIMIT_ENV, "lots")
    with pytest.raises(ValueError) as info:
        size_from_env(GPU_LIMIT_ENV, total=TOTAL)
    msg = str(info.value)
    # no Python float, no quotes: what `export BRIDGE_GPU_MEMORY_LIMIT=...` takes
    assert "Write bytes (1073741824) or a size with a unit (40GiB, 512MiB, 40GB)" in msg
    assert "a percentage (80%) or a fraction (0.8)" in msg and "'80%'" not in msg


def test_pinned_env_speaks_of_the_host(monkeypatch):
    monkeypatch.setenv(PINNED_LIMIT_ENV, "abc")
    with pytest.raises(ValueError) as info:
        size_from_env(PINNED_LIMIT_ENV, total=TOTAL, of=HOST_MEMORY)
    msg = str(info.value)
    assert msg.startswith("BRIDGE_PINNED_MEMORY_LIMIT='abc' is not a valid size")
    assert "the host's memory" in msg and "device" not in msg


def test_limit_from_names_what_the_fraction_is_of():
    assert limit_from(None, 0.5, total=TOTAL) == TOTAL // 2
    assert limit_from("0.5", None, total=TOTAL) == TOTAL // 2
    with pytest.raises(ValueError, match="the size of the host's memory is unknown"):
        limit_from(None, 0.5, total=None, of=HOST_MEMORY)
    with pytest.raises(ValueError, match="not both"):
        limit_from("1GiB", 0.5, total=TOTAL)


def test_without_a_name_the_message_names_the_value_alone():
    with pytest.raises(ValueError) as info:
        parse_size("80%")
    msg = str(info.value)
    assert msg.startswith("'80%' is not a valid size: a share needs the total memory")
    assert "budget" not in msg


def test_a_fraction_out_of_range_says_the_range_budgets_take():
    from bridge.budget import limit_from

    with pytest.raises(ValueError) as info:
        limit_from(None, 1.5, total=TOTAL)
    assert "(0, 1]" in str(info.value) and "[0, 1]" not in str(info.value)
    assert limit_from(None, 0, total=TOTAL) == 0


def test_numpys_integers_are_bytes_as_ints_are():
    """``np.prod(shape) * 4`` is an ``np.int64``: bytes, as CuPy's ``set_limit`` takes it
    (it was refused as "not a size"); numpy's floats are fractions already (float)."""
    np = pytest.importorskip("numpy")
    for kind in (np.int64, np.uint64, np.int32):
        assert parse_size(kind(GIB // 2), total=TOTAL) == GIB // 2
        assert type(parse_size(kind(GIB // 2), total=TOTAL)) is int
    assert limit_from(np.int64(GIB), None, total=TOTAL) == GIB
    with pytest.raises(ValueError, match=r"budget=-1 is not a valid size: sizes are >= 0"):
        parse_size(np.int64(-1), total=TOTAL, name="budget")
    with pytest.raises(ValueError, match="a bool is not a size|a bool_ is not a size"):
        parse_size(np.bool_(True), total=TOTAL, name="budget")
