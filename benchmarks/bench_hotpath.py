# SPDX-License-Identifier: Apache-2.0
"""Build and run benchmarks/bench_hotpath.c: the core's cache-hit path on the stand-in.

    python benchmarks/bench_hotpath.py [--rev GITREV ...] [--out FILE]

CPU only: the stand-in driver (tests/standin/standin_cuda.c) stands behind the
core, and the pairs timed make no driver call. ``--rev`` also builds the core
of an earlier git revision (its bridge/_native C files) for a side-by-side.
The GPU's own figures come from bench_turns.py / run_all.py.
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
CORE_C = ("driver.c", "records.c", "cache.c", "streams.c", "ledger.c", "graph.c", "pinned.c")


def _files(rev: str | None) -> list[str]:
    if rev is None:
        return sorted(p.name for p in (ROOT / NATIVE).iterdir() if p.suffix in (".c", ".h"))
    out = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:{NATIVE}"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return [x for x in out.split() if x.endswith((".c", ".h"))]


def build(rev: str | None, work: pathlib.Path) -> pathlib.Path:
    src = work / (rev or "tree")
    src.mkdir()
    names = _files(rev)
    for name in names:
        if rev is None:
            text = (ROOT / NATIVE / name).read_text()
        else:
            text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{NATIVE}/{name}"],
                                  capture_output=True, text=True, check=True).stdout  # fmt: skip
        (src / name).write_text(text)
    core = [str(src / c) for c in CORE_C if c in names]
    has_register = "bridge_register_stream" in (src / "bridge.h").read_text()
    exe = src / "bench_hotpath"
    cc = os.environ.get("CC", "cc").split()
    cmd = [*cc, "-O2", "-std=gnu11", f"-I{src}", "-o", str(exe),
           str(ROOT / "benchmarks" / "bench_hotpath.c"), *core, "-ldl", "-lpthread"]  # fmt: skip
    if has_register:
        cmd.insert(1, "-DHAVE_REGISTER")
    subprocess.run(cmd, check=True)
    return exe


def standin(work: pathlib.Path) -> pathlib.Path:
    lib = work / "libstandin_cuda.so"
    cc = os.environ.get("CC", "cc").split()
    subprocess.run([*cc, "-O2", "-shared", "-fPIC", "-o", str(lib),
                    str(ROOT / "tests" / "standin" / "standin_cuda.c"), "-lpthread"],
                   check=True)  # fmt: skip
    return lib


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", action="append", default=[])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        lib = standin(work)
        env = dict(os.environ, BRIDGE_STANDIN_DEVICES="1")
        for rev in [None, *args.rev]:
            exe = build(rev, work)
            out = subprocess.run([str(exe), str(lib)], capture_output=True, text=True,
                                 check=True, env=env, timeout=600).stdout  # fmt: skip
            results[rev or "working tree"] = [json.loads(x) for x in out.splitlines()]
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
