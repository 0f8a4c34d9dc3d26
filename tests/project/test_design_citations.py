# SPDX-License-Identifier: Apache-2.0
"""Every citation of docs/design.md in the tree names a heading that exists.

Code, tests, benchmarks and docs cite the design by a note's name ("see Note [Segments]") or by
a heading in quotes (``docs/design.md, "The C core's map"``). A heading renamed or dropped
leaves such a citation dangling; this test names each one, file:line. A citation of an older
design.md through git (``git show b4c11eb:docs/design.md, "..."``) is history and is left alone.
"""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
DESIGN = REPO / "docs" / "design.md"

#: ``Note [Name]``, the name possibly wrapped over lines (and comment markers) in the source.
NOTE = re.compile(r"\bNote\s+\[([^\]]+)\]")
#: ``design.md, "Heading"`` / ``[design.md](design.md), "Heading"`` / ``design.md "Heading"``,
#: not preceded by ``COMMIT:`` (a citation of the file as it was at that commit).
QUOTED = re.compile(r"(?<![0-9a-f]{7}:docs/)(?<![0-9a-f]{7}:)design\.md\)?,?\s+\"([^\"]+)\"")
#: what a wrapped citation may carry between its words: spaces, newlines, comment markers
WRAP = re.compile(r"\s*(?:\n\s*(?://|#:?|\*|--)?\s*)+|\s+")


def _headings(text: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^#{2,4}\s+(.+)$", text, re.M)]


def _tracked_text_files() -> list[pathlib.Path]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    files = []
    for name in out.split("\0"):
        if not name or not name.endswith(
            (".py", ".pyi", ".pyx", ".c", ".h", ".cpp", ".md", ".txt", ".toml", ".cfg", ".sh")
        ):
            continue
        path = REPO / name
        if path.is_file() and path != pathlib.Path(__file__).resolve():  # its own examples
            files.append(path)
    return files


def _flat(s: str) -> str:
    return WRAP.sub(" ", s).strip()


def dangling(files: list[pathlib.Path], headings: list[str]) -> list[str]:
    """file:line and the citation, for each citation that names no heading of ``headings``."""
    notes = {h for h in headings if h.startswith("Note [")}
    bad = []
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        for m in NOTE.finditer(text):
            if text[max(0, m.start() - 3) : m.start()] == "## ":
                continue  # a heading: the note itself
            name = "Note [" + _flat(m.group(1)) + "]"
            if name not in notes:
                line = text.count("\n", 0, m.start()) + 1
                bad.append(f"{rel}:{line}: {name} is no heading of docs/design.md")
        for m in QUOTED.finditer(text):
            cited = _flat(m.group(1))
            if not any(h == cited or h.startswith(cited) for h in headings):
                line = text.count("\n", 0, m.start()) + 1
                bad.append(f'{rel}:{line}: docs/design.md, "{cited}" is no heading of it')
    return bad


def test_every_citation_of_the_design_names_a_heading():
    headings = _headings(DESIGN.read_text())
    bad = dangling(_tracked_text_files(), headings)
    assert not bad, "citations of docs/design.md that name no heading there:\n" + "\n".join(bad)


def test_the_design_is_notes_each_named_once():
    headings = _headings(DESIGN.read_text())
    notes = [h for h in headings if h.startswith("Note [")]
    assert len(notes) >= 10
    assert len(notes) == len(set(notes)), "a note's name is used twice"
    for h in notes:
        assert re.fullmatch(r"Note \[[^\]\n]+\]", h), h


@pytest.mark.parametrize(
    "text, found",
    [
        ('see docs/design.md, "The C core\'s map"', 0),
        ('see docs/design.md, "Segments of the pool"', 1),
        ("(docs/design.md, Note [Segments])", 0),
        ("see Note [Segment]", 1),
        ("/* see Note [Streams,\n * contexts, devices, fork] */", 0),
        ('`git show b4c11eb:docs/design.md`, "A cache of carved small blocks"', 0),
        ('([design.md](design.md), "Waiting for memory others free")', 1),
    ],
)
def test_the_check_finds_what_dangles(tmp_path, text, found):
    path = tmp_path / "cites.c"
    path.write_text(text + "\n")
    assert len(dangling([path], _headings(DESIGN.read_text()))) == found
