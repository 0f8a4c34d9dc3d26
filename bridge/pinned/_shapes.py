# SPDX-License-Identifier: Apache-2.0
"""Shapes, orders and byte counts as the pinned functions accept them."""

from __future__ import annotations

__all__ = ["ShapeLike", "shape", "order", "nbytes", "as_buffer"]

import operator
from collections.abc import Sequence
from typing import Any, Literal, Union, cast

import numpy

ShapeLike = Union[int, Sequence[int]]  # noqa: UP007 - a runtime alias on 3.10


def _dim(d: Any) -> int:
    if isinstance(d, bool):
        raise TypeError("a bool is not a dimension")
    return operator.index(d)


def shape(value: ShapeLike) -> tuple[int, ...]:
    """An int or a sequence of ints as a shape tuple.

    Raises
    ------
    ValueError
        For anything else, or a negative dimension.
    """
    dims: tuple[int, ...]
    try:
        dims = (_dim(value),)
    except TypeError:
        try:
            dims = tuple(_dim(d) for d in value)  # type: ignore[union-attr]
        except TypeError:
            raise ValueError(f"shape={value!r}: pass an int or a sequence of ints") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"shape={value!r}: dimensions must be >= 0")
    return dims


def order(value: str) -> Literal["C", "F"]:
    """``"C"`` or ``"F"``; ValueError for anything else."""
    if value == "C":
        return "C"
    if value == "F":
        return "F"
    raise ValueError(f"order={value!r}: use 'C' or 'F'")


def nbytes(value: Any) -> int:
    """A byte count (an int >= 0, numpy integers included); ValueError for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, numpy.integer)):
        raise ValueError(f"nbytes={value!r}: pass an int >= 0")
    if value < 0:
        raise ValueError(f"nbytes={value}: must be >= 0")
    return int(value)


def as_buffer(buf: Any) -> Any:
    """The buffer itself, typed for numpy (whose stubs list the builtin buffer types only):
    arrays made on it keep it as their ``base``."""
    return cast(Any, buf)
