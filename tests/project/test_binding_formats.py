# SPDX-License-Identifier: Apache-2.0
"""Every table-made function of bridge._core parses with a format whose units fit its kind.

PyArg_ParseTuple writes through varargs, which no compiler checks: a row whose format says
``K`` where its kind's slot is an ``int`` would write 8 bytes where the call reads 4. The
kinds (bridge/_native/python/pybind.h) name the slot member each unit writes; this test
holds every row of the tables (bridge/_native/python/*.c) to its kind.
"""

from __future__ import annotations

import pathlib
import re

PYTHON = pathlib.Path(__file__).resolve().parents[2] / "bridge" / "_native" / "python"
UNIT_MEMBER = {"i": "i", "p": "i", "K": "k", "d": "d", "s": "s", "z": "s"}


def _joined(path: pathlib.Path) -> str:
    return path.read_text().replace("\\\n", " ")


def kinds() -> dict[str, list[str]]:
    """kind -> the slot members its arguments are parsed into, in order."""
    text = _joined(PYTHON / "pybind.h")
    body = text[text.index("#define BRIDGE_BIND_KINDS(X)") :].split("\n", 1)[0]
    found = {}
    for kind, parsed in re.findall(r"X\((\w+),\s*[^()]*?\([^()]*\),\s*\(([^()]*)\)", body):
        found[kind] = [] if parsed == "NULL" else re.findall(r"&a\[\d\]\.(\w)", parsed)
    found["get"] = ["i"]  # BIND_get: int f(int, T *out)
    return found


def rows() -> list[tuple[str, str, str, str]]:
    """(file, name, kind, format) of every X row of the tables."""
    found = []
    for path in sorted(PYTHON.glob("*.c")):
        for name, kind, fmt in re.findall(
            r"\bX\((\w+),\s*(\w+),\s*&?\w+,\s*(\"[^\"]*\"|BIND_NO_ARGS),", _joined(path)
        ):
            found.append((path.name, name, kind, "" if fmt == "BIND_NO_ARGS" else fmt[1:-1]))
    return found


def test_the_tables_are_found():
    assert len(kinds()) >= 20
    assert len(rows()) >= 50
    assert {kind for _, _, kind, _ in rows()} <= set(kinds())


def test_each_format_unit_writes_the_member_its_kind_reads():
    kind_members = kinds()
    wrong = []
    for file, name, kind, fmt in rows():
        members = [UNIT_MEMBER.get(unit, "?" + unit) for unit in fmt.replace("|", "")]
        if members != kind_members[kind]:
            wrong.append(f"{file}: {name} ({kind}, {fmt!r}): {members} != {kind_members[kind]}")
    assert wrong == []
