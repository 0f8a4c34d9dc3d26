"""bridge.budget: sizes and budgets as users write them (pure Python, no driver)."""

from __future__ import annotations

import math

import pytest

from bridge.budget import GPU_LIMIT_ENV, PINNED_LIMIT_ENV, parse_size, size_from_env

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


@pytest.mark.parametrize("value", [0.5, "50%"])
def test_fraction_without_total_is_refused(value):
    with pytest.raises(ValueError, match="total memory"):
        parse_size(value, total=None)


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
        "0.5",
        "1.0",  # a fraction written as a string: ambiguous
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
        ("0.25", None),
    ],
)
def test_env_values(monkeypatch, raw, expected):
    monkeypatch.setenv(GPU_LIMIT_ENV, raw)
    if expected is None:  # a float fraction in a string is refused like any other string
        with pytest.raises(ValueError, match=GPU_LIMIT_ENV):
            size_from_env(GPU_LIMIT_ENV, total=TOTAL)
    else:
        assert size_from_env(GPU_LIMIT_ENV, total=TOTAL) == expected


@pytest.mark.parametrize("variable", [GPU_LIMIT_ENV, PINNED_LIMIT_ENV])
@pytest.mark.parametrize("raw", ["lots", "-1", "150%", "0.5", "1.5GB!"])
def test_env_bad_value_names_variable_and_value(monkeypatch, variable, raw):
    monkeypatch.setenv(variable, raw)
    with pytest.raises(ValueError) as info:
        size_from_env(variable, total=TOTAL)
    assert f"{variable}={raw!r}" in str(info.value)
