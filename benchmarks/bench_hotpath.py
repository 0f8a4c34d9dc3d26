# SPDX-License-Identifier: Apache-2.0
"""Build and run benchmarks/bench_hotpath.c: the core's cache-hit path on the stand-in.

    python benchmarks/bench_hotpath.py [--rev GITREV ...] [--out FILE]

CPU only: the stand-in driver (tests/standin/standin_cuda.c) stands behind the
core, and the pairs timed make no driver call. ``--rev`` also builds the core
of an earlier git revision for a side-by-side. The GPU's own figures come from
bench_turns.py / run_all.py.
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

CORE_C = ("driver.c", "counts.c", "records.c", "cache.c", "carve.c", "streams.c", "ledger.c",
          "graph.c", "wait.c", "share.c", "pinned.c", "views.c", "device.c", "alloc.c", "ipc.c")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", action="append", default=[])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        lib = work / "libstandin_cuda.so"
        compile_c(lib, [str(ROOT / "tests" / "standin" / "standin_cuda.c")], "-shared", "-fPIC")
        env = dict(os.environ, BRIDGE_STANDIN_DEVICES="1")

        def run(rev: str | None) -> str:
            src = work / (rev or "tree")
            names = sources(rev, src)
            core = [str(src / c) for c in CORE_C if c in names]
            flags = [f"-I{src}"]
            header = (src / "bridge.h").read_text()
            if "bridge_register_stream" in header:
                flags.append("-DHAVE_REGISTER")
            if "bridge_free_cached" in header:
                flags.append("-DHAVE_FREE_CACHED")
            if "bridge_set_cache_segments" in header:
                flags.append("-DHAVE_SEGMENTS")
            # the core as a shared library, as Python loads it (its thread-local
            # variables and its calls into itself cost what they cost there)
            so = compile_c(src / "libcore.so", core, *flags, "-fPIC", "-shared",
                           libs=("-ldl", "-lpthread", "-Wl,-Bsymbolic-functions"))  # fmt: skip
            main_c = str(ROOT / "benchmarks" / "bench_hotpath.c")
            exe = compile_c(src / "bench_hotpath", [main_c], *flags,
                            libs=(str(so), f"-Wl,-rpath,{src}"))  # fmt: skip
            return subprocess.run([str(exe), str(lib)], capture_output=True, text=True,
                                  check=True, env=env, timeout=600).stdout  # fmt: skip

        return compare([None, *args.rev], run, args.out)


if __name__ == "__main__":
    sys.exit(main())
