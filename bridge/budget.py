# SPDX-License-Identifier: Apache-2.0
"""Sizes and budgets as users write them: bytes, units, fractions, percentages."""

from __future__ import annotations

__all__ = [
    "parse_size",
    "size_from_env",
    "limit_from",
    "warn_if_above",
    "GPU_LIMIT_ENV",
    "PINNED_LIMIT_ENV",
    "DEVICE_MEMORY",
    "HOST_MEMORY",
]

import operator
import os
import re
import warnings
from collections.abc import Callable
from typing import Any

from bridge._errors import format_bytes

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


DEVICE_MEMORY = "the device's memory"
HOST_MEMORY = "the host's memory"


def _hint(of: str | None, env: bool) -> str:
    """What would have been accepted, in the words of where the value was written."""
    if env:  # an environment variable holds text: no Python float, no quotes
        units = "bytes (1073741824) or a size with a unit (40GiB, 512MiB, 40GB)"
        share = f", or a share of {of}: a percentage (80%) or a fraction (0.8)" if of else ""
        return f"Write {units}{share}."
    units = "bytes (1073741824) or a size with a unit ('40GiB', '512MiB', '40GB')"
    if of is None:
        return f"Pass {units}."
    return (
        f"Pass {units}, or a share of {of}: a percentage ('80%') or a fraction in (0, 1] "
        "(0.8 or '0.8')."
    )


def _bad(
    name: str | None, value: object, why: str = "", *, of: str | None, env: bool
) -> ValueError:
    what = f"{name}={value!r}" if name else repr(value)
    return ValueError(f"{what} is not a valid size{': ' + why if why else ''}. {_hint(of, env)}")


def parse_size(
    value: SizeLike,
    *,
    total: int | None = None,
    name: str | None = None,
    of: str | None = DEVICE_MEMORY,
) -> int | None:
    """Turn a user's size into bytes.

    Parameters
    ----------
    value : int, float, str or None
        ``None`` -> ``None`` (not given). ``int``: bytes (0 = no limit).
        ``float`` in (0, 1]: fraction of ``total``. ``str``: ``"80%"``,
        ``"0.8"`` (a number with a decimal point and no unit is a fraction),
        ``"40GiB"``, ``"512MiB"``, ``"40GB"``, ``"1073741824"``.
    total : int, optional
        The memory that fractions and percentages are of.
    name : str, optional
        What the value is called in error messages (an argument or variable);
        when None, messages name the value alone.
    of : str or None
        What ``total`` is, for messages (``"the device's memory"``, ``"the
        host's memory"``); None when the value takes no fraction or
        percentage at all (then both are refused).

    Returns
    -------
    int or None

    Raises
    ------
    ValueError
        For anything else, naming ``name`` and the value and saying what
        would have been accepted.
    """
    return _parse(value, total=total, name=name, of=of, env=False)


def _parse(
    value: SizeLike, *, total: int | None, name: str | None, of: str | None, env: bool
) -> int | None:
    def bad(why: str = "") -> ValueError:
        return _bad(name, value, why, of=of, env=env)

    def share(fraction: float) -> int:
        if of is None:
            raise bad(f"{name or 'it'} takes bytes, not a percentage or fraction")
        if total is None:
            raise bad(f"a share needs the total memory it is of ({of}), which is unknown here")
        return int(fraction * total)

    if value is None:
        return None
    if isinstance(value, bool):
        raise bad("a bool is not a size")
    value = as_int(value)
    if isinstance(value, int):
        if value < 0:
            raise bad("sizes are >= 0")
        return _checked(value, bad)
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise bad("a float is a fraction and must be in (0, 1]")
        return share(value)
    if isinstance(value, str):
        m = _PERCENT.match(value)
        if m:
            pct = float(m.group(1))
            if not 0.0 < pct <= 100.0:
                raise bad("a percentage must be in (0, 100]")
            return share(pct / 100.0)
        m = _SIZE.match(value)
        if m and m.group(2).lower() in _UNITS:
            number, unit = m.group(1), m.group(2).lower()
            if unit == "" and "." in number:  # '0.8': a fraction, as the float 0.8
                if not 0.0 < float(number) <= 1.0:
                    raise bad(
                        "a number with a decimal point and no unit is a fraction and must be "
                        "in (0, 1]; write bytes as a whole number"
                    )
                return share(float(number))
            # whole numbers stay exact (a float would round past 2**53 bytes)
            n = (
                int(number) * _UNITS[unit]
                if "." not in number
                else int(float(number) * _UNITS[unit])
            )
            return _checked(n, bad)
        raise bad()
    raise bad(f"a {type(value).__name__} is not a size")


def as_int(value: Any) -> Any:
    """An integer of another type (numpy's ``np.int64``, as ``np.prod`` gives) as a Python
    int, as CuPy's ``size_t`` arguments take it; anything else as it is."""
    if isinstance(value, (bool, int, float, str)):
        return value
    try:
        return operator.index(value)
    except TypeError:  # no integer (numpy's bool_ among them)
        return value


def _checked(n: int, bad: Callable[[str], ValueError]) -> int:
    if n > MAX_SIZE:
        raise bad("sizes are < 2**64 bytes")
    return n


def size_from_env(
    variable: str, *, total: int | None, of: str | None = DEVICE_MEMORY
) -> int | None:
    """The size in environment variable ``variable``, or ``None`` when unset or empty.

    Parameters
    ----------
    variable : str
        The variable's name.
    total : int or None
        The memory that a percentage or fraction is of; None when unknown.
    of : str or None
        What ``total`` is, for messages (see :func:`parse_size`).

    Raises
    ------
    ValueError
        Naming the variable and its value, with the forms a variable can hold.
    """
    raw = os.environ.get(variable)
    if raw is None or raw.strip() == "":
        return None
    return _parse(raw, total=total, name=variable, of=of, env=True)


def warn_if_above(
    limit: int, total: int | None, *, name: str, of: str, stacklevel: int = 2
) -> bool:
    """Warn when a limit is larger than the memory it limits: it then limits nothing.

    Parameters
    ----------
    limit : int
        The limit in bytes (0 = none: never warned about).
    total : int or None
        The memory it limits; None when unknown (no warning).
    name : str
        How the limit was given, for the message.
    of : str
        What ``total`` is (``"the device's memory"``).
    stacklevel : int
        As for :func:`warnings.warn`, counted from the caller of this function.

    Returns
    -------
    bool
        Whether it warned.
    """
    if not limit or not total or limit <= total:
        return False
    warnings.warn(
        f"{name}: a limit of {format_bytes(limit)} ({limit} bytes) is larger than {of} "
        f"({format_bytes(total)}, {total} bytes): it limits nothing. Pass a size below it or a "
        "percentage such as '90%'.",
        UserWarning,
        stacklevel=stacklevel + 1,
    )
    return True


def limit_from(
    size: SizeLike, fraction: float | None, *, total: int | None, of: str = DEVICE_MEMORY
) -> int:
    """A pool's ``set_limit(size=None, fraction=None)`` arguments as bytes (0 = no limit).

    Parameters
    ----------
    size : int, str or None
        Bytes or a size such as ``"40GiB"`` or ``"25%"`` (of ``total``).
    fraction : float or None
        Fraction of ``total``, in (0, 1]; 0 removes the limit.
    total : int or None
        The memory that fractions are of; None when it is unknown.
    of : str
        What ``total`` is, for messages.

    Raises
    ------
    ValueError
        When both are given, either is out of range, or a fraction is given
        and ``total`` is unknown.
    """
    if size is not None and fraction is not None:
        raise ValueError("set_limit takes size or fraction, not both")
    if fraction is None:
        return parse_size(size, total=total, name="size", of=of) or 0
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, (int, float))
        or not 0.0 <= float(fraction) <= 1.0
    ):
        raise ValueError(
            f"fraction={fraction!r} must be a number in (0, 1] (a fraction of {of}), or 0 to "
            "remove the limit"
        )
    if total is None:
        raise ValueError(f"fraction={fraction!r}: the size of {of} is unknown here; pass size")
    return int(float(fraction) * total)
