"""Sizes and budgets as users write them: bytes, units, fractions, percentages."""

from __future__ import annotations

__all__ = ["parse_size", "size_from_env", "limit_from", "GPU_LIMIT_ENV", "PINNED_LIMIT_ENV"]

import os
import re

GPU_LIMIT_ENV = "BRIDGE_GPU_MEMORY_LIMIT"
PINNED_LIMIT_ENV = "BRIDGE_PINNED_MEMORY_LIMIT"

SizeLike = int | float | str | None

MAX_SIZE = 2**64 - 1  # the core holds sizes as uint64: anything larger would wrap

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*$")


def _bad(name: str, value: object, why: str = "") -> ValueError:
    return ValueError(
        f"{name}={value!r} is not a valid size{': ' + why if why else ''}. Use bytes "
        "(1073741824), a size with a unit (40GiB, 512MiB, 40GB), a percentage of the "
        "device's memory ('80%'), or a float fraction in (0, 1] (0.8)."
    )


def parse_size(value: SizeLike, *, total: int | None = None, name: str = "budget") -> int | None:
    """Turn a user's size into bytes.

    Parameters
    ----------
    value : int, float, str or None
        ``None`` -> ``None`` (not given). ``int``: bytes (0 = no limit).
        ``float`` in (0, 1]: fraction of ``total``. ``str``: ``"80%"``,
        ``"40GiB"``, ``"512MiB"``, ``"40GB"``, ``"1073741824"``.
    total : int, optional
        The memory that fractions and percentages are of.
    name : str
        What the value is called in error messages (an argument or variable).

    Returns
    -------
    int or None

    Raises
    ------
    ValueError
        For anything else, naming ``name`` and the value.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise _bad(name, value, "a bool is not a size")
    if isinstance(value, int):
        if value < 0:
            raise _bad(name, value, "sizes are >= 0")
        return _checked(value, name, value)
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise _bad(name, value, "a float is a fraction and must be in (0, 1]")
        return _fraction(value, total, name, value)
    if isinstance(value, str):
        m = _PERCENT.match(value)
        if m:
            pct = float(m.group(1))
            if not 0.0 < pct <= 100.0:
                raise _bad(name, value, "a percentage must be in (0, 100]")
            return _fraction(pct / 100.0, total, name, value)
        m = _SIZE.match(value)
        if m and m.group(2).lower() in _UNITS:
            number, unit = m.group(1), m.group(2).lower()
            if unit == "" and "." in number:
                raise _bad(name, value, "write a fraction as a percentage ('50%') or a float")
            # whole numbers stay exact (a float would round past 2**53 bytes)
            n = (
                int(number) * _UNITS[unit]
                if "." not in number
                else int(float(number) * _UNITS[unit])
            )
            return _checked(n, name, value)
        raise _bad(name, value)
    raise _bad(name, value, f"a {type(value).__name__} is not a size")


def _checked(n: int, name: str, value: object) -> int:
    if n > MAX_SIZE:
        raise _bad(name, value, "sizes are < 2**64 bytes")
    return n


def _fraction(f: float, total: int | None, name: str, value: object) -> int:
    if total is None:
        raise _bad(name, value, "a fraction needs the device's total memory")
    return int(f * total)


def size_from_env(variable: str, *, total: int | None) -> int | None:
    """The size in environment variable ``variable``, or ``None`` when unset or empty."""
    raw = os.environ.get(variable)
    if raw is None or raw.strip() == "":
        return None
    return parse_size(raw, total=total, name=variable)


def limit_from(size: SizeLike, fraction: float | None, *, total: int | None) -> int:
    """A pool's ``set_limit(size=None, fraction=None)`` arguments as bytes (0 = no limit).

    Parameters
    ----------
    size : int, str or None
        Bytes or a size such as ``"40GiB"`` or ``"25%"`` (of ``total``).
    fraction : float or None
        Fraction of ``total``, in [0, 1].
    total : int or None
        The memory that fractions are of; None when it is unknown.

    Raises
    ------
    ValueError
        When both are given, either is out of range, or a fraction is given
        and ``total`` is unknown.
    """
    if size is not None and fraction is not None:
        raise ValueError("set_limit takes size or fraction, not both")
    if fraction is None:
        return parse_size(size, total=total, name="size") or 0
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, (int, float))
        or not 0.0 <= float(fraction) <= 1.0
    ):
        raise ValueError(f"fraction={fraction!r} must be a number in [0, 1]")
    if total is None:
        raise ValueError("fraction: the memory size is unknown; pass size")
    return int(float(fraction) * total)
