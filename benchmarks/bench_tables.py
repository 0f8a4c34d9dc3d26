# SPDX-License-Identifier: Apache-2.0
"""Build and run benchmarks/bench_tables.c: the core's hash tables on aligned keys.

    python benchmarks/bench_tables.py [--n 1000000] [--rev GITREV ...] [--out FILE]

Runs on the CPU (no driver). ``--rev`` also builds the tables of an earlier
git revision (records.c, cache.c and their headers from ``git show``) for a
side-by-side; the output is one JSON object per revision.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
NATIVE = "bridge/_native"
FILES = ("records.c", "records.h", "cache.c", "cache.h", "bridge.h", "driver.h")


def build(rev: str | None, work: pathlib.Path) -> pathlib.Path:
    src = work / (rev or "tree")
    src.mkdir()
    for name in FILES:
        if rev is None:
            text = (ROOT / NATIVE / name).read_text()
        else:
            text = subprocess.run(
                ["git", "-C", str(ROOT), "show", f"{rev}:{NATIVE}/{name}"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        (src / name).write_text(text)
    exe = src / "bench_tables"
    cc = os.environ.get("CC", "cc").split()
    subprocess.run(
        [*cc, "-O2", "-std=gnu11", f"-I{src}", "-o", str(exe),
         str(ROOT / "benchmarks" / "bench_tables.c"), str(src / "records.c"),
         str(src / "cache.c"), "-lpthread"],
        check=True,
    )  # fmt: skip
    return exe


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="live records")
    ap.add_argument("--rev", action="append", default=[], help="also an earlier revision")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rev in [None, *args.rev]:
            exe = build(rev, pathlib.Path(tmp))
            out = subprocess.run([str(exe), str(args.n)], capture_output=True, text=True,
                                 check=True, timeout=1800).stdout  # fmt: skip
            results[rev or "working tree"] = [json.loads(x) for x in out.splitlines()]
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
