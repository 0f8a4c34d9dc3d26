# SPDX-License-Identifier: Apache-2.0
"""Build and run benchmarks/bench_tables.c: the core's hash tables on aligned keys.

    python benchmarks/bench_tables.py [--n 1000000] [--rev GITREV ...] [--out FILE]

Runs on the CPU (no driver). ``--rev`` also builds the tables of an earlier
git revision for a side-by-side; the output is one JSON object per revision.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _native import ROOT, compare, compile_c, sources  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="live records")
    ap.add_argument("--rev", action="append", default=[], help="also an earlier revision")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:

        def run(rev: str | None) -> str:
            src = pathlib.Path(tmp) / (rev or "tree")
            names = sources(rev, src)
            core = [str(src / c) for c in ("records.c", "cache.c", "carve.c") if c in names]
            flags = [f"-I{src}"]
            if "park.h" in names:  # cache_take tells whether its block kept its record
                flags.append("-DHAVE_PARK")
            exe = compile_c(src / "bench_tables", [str(ROOT / "benchmarks" / "bench_tables.c"),
                            *core], *flags)  # fmt: skip
            return subprocess.run([str(exe), str(args.n)], capture_output=True, text=True,
                                  check=True, timeout=1800).stdout  # fmt: skip

        return compare([None, *args.rev], run, args.out)


if __name__ == "__main__":
    sys.exit(main())
