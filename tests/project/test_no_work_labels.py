# SPDX-License-Identifier: Apache-2.0
"""The project speaks of itself, not of the rounds of work that made it.

A label such as "the twelfth session", "(24th session)", "session 12", "h200-session22" or
"round 3 of work" says nothing to a reader who was not there: where time matters the text
gives a date (2026-12-05) or a commit, and otherwise the label goes. This test fails on such a
label in a tracked text file (docs, code, tests, benchmarks, the changelog), naming file:line.
Ordinary uses of the word stay: "a Ray session", "the pytest session", ``sessionmaker``,
``session = Session(...)``. Commit subjects of the past are git's and are not read here.
"""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

_UNITS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth"
)
_TENS = "twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety"
_TENTHS = "twentieth|thirtieth|fortieth|fiftieth|sixtieth|seventieth|eightieth|ninetieth"
#: first..ninety-ninth in words, or 1st..99th in digits
ORDINAL = rf"(?:(?:{_TENS})[- ]?(?:{_UNITS})|{_TENTHS}|{_UNITS}|[1-9]?[0-9](?:st|nd|rd|th))"
_ROUND = r"(?:session|round of work|work round)"
LABEL = re.compile(
    "|".join(
        [
            # "the twelfth session", "the 24th session's", "twenty-fourth and twenty-fifth sessions"
            rf"\b{ORDINAL}(?:'s)?(?:\s+(?:and|or|to)\s+{ORDINAL})?\s+{_ROUND}s?\b",
            # "session 12", "session12", "h200-session22", "sessions 24-25", "session #3"
            r"\bsessions?[ _-]?#?[0-9]+[a-z]?\b",
            # "round 3 of work", "rounds 2-4 of the work"
            r"\brounds?\s+[0-9]+(?:\s*[-–]\s*[0-9]+)?\s+of\s+(?:the\s+)?work\b",
            # "this session's change": a label too, where it stands for the work itself
            r"\b(?:this|last|next|previous|earlier|later|that)\s+session(?:'s)?\s+"
            r"(?:change|work|run|runs|figures|commit|library|measurement)s?\b",
        ]
    ),
    re.I,
)

#: where tracked text lives: every file git knows, but binaries and data
_TEXT = (
    ".py", ".pyi", ".pyx", ".c", ".h", ".cpp", ".md", ".txt", ".toml", ".cfg", ".ini",
    ".sh", ".yml", ".yaml", ".json", ".rst", ".in",
)  # fmt: skip


def _tracked() -> list[pathlib.Path]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    here = pathlib.Path(__file__).resolve()
    files = []
    for name in out.split("\0"):
        path = REPO / name
        keep = name.endswith(_TEXT) or "/" not in name and "." not in name  # run, Makefile
        keep = keep or name.startswith(("scripts/", ".ci/"))
        if name and keep and path.is_file() and path != here:
            files.append(path)
    return files


def labels(paths: list[pathlib.Path]) -> list[str]:
    """``file:line: text`` for each label of a round of work in ``paths``."""
    found = []
    for path in paths:
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        for number, line in enumerate(text.splitlines(), 1):
            for m in LABEL.finditer(line):
                found.append(f"{rel}:{number}: {m.group(0)!r} in {line.strip()[:120]!r}")
    return found


def test_no_label_of_a_round_of_work_in_the_tree():
    found = labels(_tracked())
    assert not found, (
        "labels of rounds of work (give a date such as 2026-12-05 or a commit, or drop them):\n"
        + "\n".join(found)
    )


@pytest.mark.parametrize(
    "text",
    [
        "measured in the twelfth session",
        "(Eighteenth session, one H200)",
        "the twenty-fourth and twenty-fifth sessions",
        "twenty seventh session",
        "the 24th session's runs",
        "the ninety-ninth session",
        "see session 12",
        "git show 70eb211:benchmarks/results/2026-12-03-h200-session22/README.md",
        "sessions 24-25",
        "in round 3 of work",
        "the library of this session's change",
    ],
)
def test_the_check_finds_a_label(tmp_path, text):
    path = tmp_path / "doc.md"
    path.write_text("before\n" + text + "\n")
    found = labels([path])
    assert len(found) == 1 and ":2:" in found[0], found


@pytest.mark.parametrize(
    "text",
    [
        "a Ray session starts the workers",
        "the pytest session compiles the stand-in",
        "from sqlalchemy.orm import sessionmaker",
        "session = Session(args, args.mode, info)",
        "scope='session'",
        "round 2 of the turns",
        "the first round of the turns",
        "7 fails in round 2 and is dropped",
        "a 2nd pass",
    ],
)
def test_the_check_leaves_ordinary_words(tmp_path, text):
    path = tmp_path / "doc.md"
    path.write_text(text + "\n")
    assert labels([path]) == []
