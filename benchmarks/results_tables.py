# SPDX-License-Identifier: Apache-2.0
"""One small table per benchmark: its latest figures, with the versions and the card.

    python3 benchmarks/results_tables.py RUN_DIR [--dest benchmarks/results]

Writes DEST/<benchmark>.md, for every benchmark with a figure in RUN_DIR/results.json (its
checks recomputed by checks.py): the run's date, git revision, card, versions, each target
with its value and result, and the benchmark's table from results.md. The others keep their
table, so that a part run (``--only``) refreshes only its own and git holds the history. It
overwrites only files whose first line is MARKER (its own) or TRANSCRIBED (copied by hand
from older run records). ``run_all.py --tables DEST`` calls it at the end of a run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checks  # noqa: E402
import report  # noqa: E402

#: The first line of every table this script writes (it overwrites only such files and
#: TRANSCRIBED ones).
MARKER = "<!-- written by benchmarks/results_tables.py from a run's results.json; do not edit -->"
#: The first line of a table transcribed by hand from run records older than results.json
#: (it may be overwritten too: the next run with that benchmark's figures replaces it).
TRANSCRIBED = ("<!-- transcribed from the run records it names, not from a results.json; "
               "benchmarks/results_tables.py replaces it with a run's table -->")  # fmt: skip

#: benchmark (the file's name) -> (its check groups in checks.py, its results.md sections)
BENCHMARKS: dict[str, tuple[tuple[str, ...], Callable[[dict], list[str]]]] = {
    "alloc": (("torch alloc", "cupy alloc"), lambda r: report.md_turns(r) + report.md_alloc(r)),
    "mixed": (("mixed",), report.md_mixed),
    "e2e": (("e2e",), report.md_e2e),
    "pinned": (("pinned",), report.md_pinned),
    "trace": (("trace",), report.md_trace),
    "capacity": (("capacity",), report.md_capacity),
    "wait": (("wait",), report.md_wait),
    "share": (("share",), report.md_share),
    "rmm": (("rmm",), report.md_rmm),
}

#: benchmark -> the run_all.py sections that measure it (a part run names its sections)
SECTIONS = {"alloc": ("alloc_turns", "alloc", "alloc_same_process"), "e2e": ("e2e_turns", "e2e")}

#: the distributions a table names, in this order, where the run recorded them
VERSIONS = ("bridge", "torch", "cupy", "cupy-cuda13x", "cupy-cuda12x", "jax", "jaxlib",
            "rmm-cu13", "numpy", "cuda-bindings", "cuda-core")  # fmt: skip


def card(meta: dict) -> str:
    """'NVIDIA H200, 139.8 GiB, driver 580.159 (CUDA 13.0 driver API)' from a run's meta."""
    parts = [str(meta.get("gpu_name") or "GPU unknown")]
    total = meta.get("gpu_total_bytes")
    if isinstance(total, (int, float)) and total:
        parts.append(f"{total / 2**30:.1f} GiB")
    driver = f"driver {meta['driver_version']}" if meta.get("driver_version") else ""
    if meta.get("cuda_driver_api"):
        driver += f" (CUDA {meta['cuda_driver_api']} driver API)"
    return ", ".join(parts + ([driver.strip()] if driver else []))


def versions(meta: dict) -> str:
    have = dict(meta.get("versions") or {})
    if meta.get("bridge_version"):
        have.setdefault("bridge", meta["bridge_version"])
    names = [n for n in VERSIONS if n in have] + sorted(set(have) - set(VERSIONS))
    return ", ".join(f"{n} {have[n]}" for n in names) or "not recorded"


def measured_by(name: str, meta: dict) -> tuple[str, str]:
    """(date, command) of the part runs that measured this benchmark: every part whose --only
    names one of its sections, the earliest one's date; a run without parts, or a benchmark
    no part names: the run's own."""
    mine = set(SECTIONS.get(name, (name,)))
    parts = []
    for part in meta.get("parts") or []:
        only = part.get("only")
        names = set(only.split(",")) if isinstance(only, str) else set(only or ())
        if names & mine:
            parts.append(part)
    if not parts:
        return str(meta.get("date", "?")), f"`{meta.get('command', '?')}`"
    return str(parts[0].get("date", "?")), "; ".join(f"`{p.get('command', '?')}`" for p in parts)


def table(name: str, results: dict, source: str) -> str | None:
    """The markdown table of one benchmark, or None when the run has no figure of it."""
    groups, section = BENCHMARKS[name]
    checks = [c for c in results.get("checks", []) if c.get("group") in groups]
    if not any(c.get("value") is not None for c in checks):
        return None
    meta = results.get("meta", {})
    date, command = measured_by(name, meta)
    lines = [MARKER, "", f"# {name}: the latest figures", "",
             f"- run: {date}, git {meta.get('git') or '?'}"
             f"{', quick' if meta.get('quick') else ''} (from {source})",
             f"- card: {card(meta)}", f"- versions: {versions(meta)}",
             f"- command: {command}", ""]  # fmt: skip
    lines += report.table(
        ["metric", "value", "target", "result", "note"],
        [[c["label"], "-" if c["value"] is None else f"{c['value']:.3f}",
          f"{c['op']} {c['target']:g}", c["status"],
          str(c.get("note", "")).replace("|", "/").replace("\n", " ")[:300]]
         for c in checks])  # fmt: skip
    detail = section(results)
    if detail and detail[0].startswith("## "):
        detail[0] = "#" + detail[0]  # a subsection of this table's page
    return "\n".join(lines + [""] + detail).rstrip() + "\n"


def write_tables(results: dict, dest: str, source: str) -> dict[str, str]:
    """Write dest/<benchmark>.md for each benchmark with figures in results (summarized
    here); returns {benchmark: what happened} ("written", "no figure: kept", or why not)."""
    checks.summarize(results)
    os.makedirs(dest, exist_ok=True)
    done: dict[str, str] = {}
    for name in BENCHMARKS:
        text = table(name, results, source)
        path = os.path.join(dest, f"{name}.md")
        if text is None:
            done[name] = "no figure in this run: kept as it was"
            continue
        if os.path.exists(path):
            with open(path) as f:
                if f.readline().rstrip("\n") not in (MARKER, TRANSCRIBED):
                    done[name] = f"not written: {path} was not written by results_tables.py"
                    continue
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        done[name] = "written"
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a run_all.py --out directory (holding results.json)")
    ap.add_argument("--dest", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                   "results"),
                    help="where the tables go (default: benchmarks/results)")  # fmt: skip
    ap.add_argument("--source", default=None,
                    help="where the run's files are kept, as the tables should say it (e.g. "
                         "'git show COMMIT:benchmarks/results/FOLDER/results.json'; default: "
                         "the run directory, relative to --dest)")
    args = ap.parse_args(argv)
    with open(os.path.join(args.run, "results.json")) as f:
        results = json.load(f)
    source = args.source or os.path.relpath(os.path.abspath(args.run),
                                            os.path.abspath(args.dest))
    for name, what in write_tables(results, args.dest, source).items():
        print(f"{name:>9}: {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
