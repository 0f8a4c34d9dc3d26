# SPDX-License-Identifier: Apache-2.0
"""Building small C benchmarks against the core's sources, of this tree or of a revision.

Used by bench_tables.py and bench_hotpath.py: each copies bridge/_native's
files (as they are now, or ``git show REV:...``) into a scratch folder,
compiles its C program with them, runs it once per revision and prints one
JSON object: revision -> the program's JSON lines.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
from collections.abc import Callable, Iterable

ROOT = pathlib.Path(__file__).resolve().parent.parent
NATIVE = "bridge/_native"


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                          check=True).stdout  # fmt: skip


def sources(rev: str | None, dest: pathlib.Path) -> list[str]:
    """Copy the core's C files and headers of ``rev`` (None: this tree) into dest."""
    dest.mkdir(parents=True)
    if rev is None:
        names = sorted(p.name for p in (ROOT / NATIVE).iterdir() if p.suffix in (".c", ".h"))
    else:
        names = [x for x in _git("ls-tree", "--name-only", f"{rev}:{NATIVE}").split()
                 if x.endswith((".c", ".h"))]  # fmt: skip
    for name in names:
        text = (ROOT / NATIVE / name).read_text() if rev is None else _git(
            "show", f"{rev}:{NATIVE}/{name}")  # fmt: skip
        (dest / name).write_text(text)
    return names


def compile_c(out: pathlib.Path, files: Iterable[str], *flags: str,
              libs: Iterable[str] = ("-lpthread",)) -> pathlib.Path:  # fmt: skip
    """cc -O2 FLAGS -o OUT FILES LIBS (libraries after the files that need them)."""
    cc = os.environ.get("CC", "cc").split()
    subprocess.run([*cc, "-O2", "-std=gnu11", *flags, "-o", str(out), *files, *libs],
                   check=True)  # fmt: skip
    return out


def compare(revs: Iterable[str | None], run: Callable[[str | None], str],
            out: str | None) -> int:  # fmt: skip
    """``run(rev)`` gives a program's output (JSON lines); print all as one JSON object."""
    results = {rev or "working tree": [json.loads(x) for x in run(rev).splitlines()]
               for rev in revs}  # fmt: skip
    text = json.dumps(results, indent=2)
    print(text)
    if out:
        pathlib.Path(out).write_text(text + "\n")
    return 0
