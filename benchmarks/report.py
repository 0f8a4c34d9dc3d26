# SPDX-License-Identifier: Apache-2.0
"""Render collected benchmark results: results.md and results.png.

    python3 benchmarks/report.py DIR        # rewrites DIR/results.md and DIR/results.png

No GPU framework is imported (matplotlib only for the PNG): the report can be rebuilt
anywhere from a results.json. checks.py compares the figures with their targets
(``summarize``); ``markdown`` and ``write_png`` render them, and ``md_<benchmark>`` each
benchmark's section (results_tables.py writes one table per benchmark from them).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median, size_label  # noqa: E402
from checks import (  # noqa: E402
    ALLOC_TARGETS,
    CAPACITY_TARGET,
    LABELS,
    OK_STATUSES,
    RMM_TARGET,
    SHARE_TARGET,
    SHORT,
    TRACE_FRAG_TARGET,
    TRACE_MIN_ROUNDS,
    TRACES,
    WAIT_TARGET,
    is_number,
    not_ok,
    section_data,
    status_text,
    summarize,
    trace_replays,
    why_missing,
)

# ---- markdown ----

def _fmt_ns(s: dict | None) -> str:
    if not s:
        return "-"
    if s["n"] > 1:
        return f"{s['median']:,.0f} [{s['min']:,.0f}-{s['max']:,.0f}]"
    return f"{s['median']:,.0f}"


def _fmt_check(c: dict) -> str:
    if c["value"] is None:
        return "n/a"
    mark = "pass" if c["status"] == "pass" else "**FAIL**"
    return f"{c['value']:.3f} {mark}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def md_meta(meta: dict) -> list[str]:
    keys = ("date", "gpu_name", "driver_version", "cuda_driver_api", "bridge_version",
            "quick", "wall_s", "budget_s", "git")
    rows = [[k, str(meta[k])] for k in keys if k in meta]
    versions = meta.get("versions") or {}
    if versions:
        rows.append(["versions", ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))])
    if meta.get("rmm"):
        rows.append(["RMM", str(meta["rmm"])])
    parts = meta.get("parts") or []
    if len(parts) > 1:
        rows.append(["part runs (--only)", "; ".join(
            f"{p.get('date', '?')}: {p.get('only') or 'all'}" for p in parts)])
    if meta.get("env_removed"):
        rows.append(["removed from the environment", ", ".join(meta["env_removed"])])
    if meta.get("probe_error"):
        rows.append(["probe error", str(meta["probe_error"])[:300]])
    return table(["", ""], rows) if rows else []


def md_turns(results: dict) -> list[str]:
    turns = results.get("alloc_turns") or {}
    sizes = [str(s) for s in results.get("alloc", {}).get("sizes", [])]
    if not turns or not sizes:
        return []
    checks = {c["id"]: c for c in results.get("checks", [])}
    out = ["## Allocation, allocators taking turns (the verdict)", "",
           "bench_turns.py: one process per allocator, all on one CPU, each in turn timing one "
           "loop per size, the order rotating every round. Cells: ns per alloc+free pair, best "
           "loop (median loop). Ratios: the median of the round-by-round ratios (the verdict), "
           "then the best loop against the best loop and the rounds' range.", ""]
    for fw in ("torch", "cupy"):
        t = turns.get(fw)
        if not t:
            continue
        if t.get("status") not in OK_STATUSES:
            out += [f"{fw}: {status_text(t, 400)}", ""]
            continue
        cfg = t.get("configs", {})
        rows = []
        for config in ("native", "async", "rmm", "bridge"):
            c = cfg.get(config)
            if c is None:
                continue
            if c.get("status") != "ok":
                rows.append([LABELS[fw][config], status_text(c)] + [""] * len(sizes))
                continue
            cells = []
            for s in sizes:
                v = c.get("ns_samples", {}).get(s)
                cells.append(f"{min(v):,.0f} ({median(v):,.0f})" if v else "-")
            floor = c.get("floor_ns")
            rows.append([LABELS[fw][config]] + cells + [f"{floor:,.0f}" if floor else "-"])
        for f2, base, op, target in ALLOC_TARGETS:
            if f2 != fw or cfg.get(base, {}).get("status") != "ok":
                continue
            ratios = t.get("turn_ratios", {}).get(base, {})
            rows.append([f"bridge / {SHORT[fw][base]} (target {op} {target:.2f})"] +
                        [_fmt_check(checks[f"{fw}.alloc.{base}.{s}"]) for s in sizes] + [""])
            best = {s: cfg["bridge"]["ns_per_pair"][s] / cfg[base]["ns_per_pair"][s]
                    for s in sizes if cfg.get("bridge", {}).get("ns_per_pair", {}).get(s)
                    and cfg[base].get("ns_per_pair", {}).get(s)}
            rows.append(["  best loops; rounds [min-max]"] + [
                (f"{best[s]:.3f}" if s in best else "-") +
                (f"; [{ratios[s]['min']:.3f}-{ratios[s]['max']:.3f}]" if s in ratios else "")
                for s in sizes] + [""])
        gens = t.get("processes") or 1
        out += [f"{fw}: {t.get('repeats')} rounds of {t.get('iters'):,} pairs per loop"
                + (f" in each of {gens} generations of fresh workers" if gens > 1 else "")
                + f", CPU {t.get('cpu')}", ""]
        out += table([f"{fw} allocator"] + [size_label(int(s)) for s in sizes]
                      + ["no-alloc op"], rows) + [""]
    return out


def md_alloc(results: dict) -> list[str]:
    alloc = results.get("alloc", {})
    summary, sizes = alloc.get("summary", {}), [str(s) for s in alloc.get("sizes", [])]
    checks = {c["id"]: c for c in results.get("checks", [])}
    runs = alloc.get("runs", [])
    out = ["## Allocation, one process after another: ns per alloc+free pair",
           "",
           "Fresh processes one after another, each pinned to the CPU fastest just before it "
           "started; a cell is the median over processes of each one's best loop (min-max). "
           "Ratios (the verdict only where the turns did not run): the best process of each, "
           "as noise only slows a process down. Last column: the best loop of an op that "
           "allocates nothing (x.add_(1)), the speed each process ran at.", ""]
    for fw in ("torch", "cupy"):
        header = [f"{fw} allocator"] + [size_label(int(s)) for s in sizes] + ["no-alloc op"]
        rows = []
        for config in ("native", "async", "rmm", "bridge"):
            cells = [_fmt_ns(summary.get(fw, {}).get(config, {}).get(s)) for s in sizes]
            if all(c == "-" for c in cells):
                cells = [why_missing(runs, fw, config)] + [""] * (len(sizes) - 1)
            floor = _fmt_ns(summary.get(fw, {}).get(config, {}).get("floor"))
            rows.append([LABELS[fw][config]] + cells + [floor])
        for f2, base, op, target in ALLOC_TARGETS:
            if f2 != fw:
                continue
            decided = [checks[f"{fw}.alloc.{base}.{s}"] for s in sizes]
            if all(c.get("note", "").startswith("taking turns") for c in decided):
                # the turns decided: these processes are context, their ratio shown plainly
                cells = []
                for s in sizes:
                    b = summary.get(fw, {}).get("bridge", {}).get(s)
                    n = summary.get(fw, {}).get(base, {}).get(s)
                    cells.append(f"{b['min'] / n['min']:.3f}" if b and n else "-")
                rows.append([f"bridge / {SHORT[fw][base]} (context)"] + cells + [""])
            else:
                rows.append([f"bridge / {SHORT[fw][base]} (target {op} {target:.2f})"] +
                            [_fmt_check(c) for c in decided] + [""])
        out += table(header, rows) + [""]
    same = results.get("alloc_same_process")
    if same:
        out += ["### CuPy, all allocators in ONE process (cross-check)", ""]
        if same.get("status") in OK_STATUSES and same.get("configs"):
            cfgs = same["configs"]
            rows = []
            for config in ("native", "async", "rmm", "bridge"):
                if config in cfgs:
                    rows.append([LABELS["cupy"][config]] +
                                [f"{cfgs[config]['ns_per_pair'].get(s, float('nan')):,.0f}"
                                 for s in sizes])
            if "bridge" in cfgs:
                for base in ("native", "async", "rmm"):
                    if base in cfgs:
                        rows.append([f"bridge / {SHORT['cupy'][base]}"] + [
                            f"{cfgs['bridge']['ns_per_pair'][s] / cfgs[base]['ns_per_pair'][s]:.3f}"
                            if s in cfgs["bridge"]["ns_per_pair"]
                            and s in cfgs[base]["ns_per_pair"] else "-" for s in sizes])
            out += table(["cupy allocator"] + [size_label(int(s)) for s in sizes], rows)
            skipped = (same.get("info") or {}).get("skipped")
            if skipped:
                out += ["", f"Left out: {skipped}"]
        else:
            out += [f"Not measured: {status_text(same, 400)}"]
        out += [""]
    return out


def md_mixed(results: dict) -> list[str]:
    runs = results.get("mixed", {}).get("runs", [])
    out = ["## Mixed phases: CuPy holds N GiB and frees it, then torch asks for N GiB", "",
           "used = device total - free (torch.cuda.mem_get_info); used/live = (used - baseline) / "
           "live, baseline = used after both frameworks started CUDA.", ""]
    rows = []
    for r in runs:
        mode = r.get("mode", "?")
        if r.get("status") != "ok":
            rows.append([mode, "-", f"error: {r.get('error', r.get('status'))}"[:200],
                         "-", "-", "-"])
            continue
        phases = {p["phase"]: p for p in r.get("phases", [])}
        held = phases.get("cupy holds N", {})
        final = phases.get("torch holds N")
        if r.get("outcome") == "oom":
            used = r.get("used_at_oom")
            outcome = f"torch OOM ({(r.get('oom') or '')[:120]})"
            cols = [f"{used / 2**30:.1f} at OOM" if used else "-", "-", "-"]
        else:
            outcome = "ok"
            cols = [f"{final['used_gib']:.1f}", f"{final.get('used_over_live', float('nan')):.3f}",
                    f"{final.get('raw_used_over_live', float('nan')):.3f}"] if final else \
                ["-", "-", "-"]
        rows.append([mode, f"{r.get('n_gib', 0):.0f}",
                     outcome + (f"; cupy phase used {held['used_gib']:.1f} GiB" if held else ""),
                     *cols])
    if not rows:
        return out + ["Not run.", ""]
    return out + table(["mode", "N GiB", "outcome", "used GiB (torch holds N)", "used/live",
                         "raw used/live"], rows) + [""]


def _e2e_row(mode: str, best: float, med: float, spread_text: str, n: str,
             runs: list[dict]) -> list[str]:
    issue = [r["issue_ms"] for r in runs if is_number(r.get("issue_ms"))]
    step = [r["synced_step_ms"] for r in runs if is_number(r.get("synced_step_ms"))]
    per_step = runs[-1].get("per_step") if runs else None
    counts = ", ".join(f"{k} {v:g}" for k, v in (per_step or {}).items() if is_number(v))
    return [mode, f"{best:.1f}", f"{med:.1f}", spread_text, n,
            f"{median(issue):.2f}" if issue else "-", f"{median(step):.2f}" if step else "-",
            counts or "-"]


def md_e2e(results: dict) -> list[str]:
    e2e = results.get("e2e", {})
    s = e2e.get("summary", {})
    runs = e2e.get("runs", [])
    turns = results.get("e2e_turns") or {}
    out = ["## End to end: CuPy preprocessing -> DLPack -> torch training step", "",
           "issue ms: time to issue one step; step ms: until it finished (issue close to step: "
           "the step is bound by the CPU). per step: allocation counters.", ""]
    header = ["mode", "steps/s (best)", "median", "min-max", "n", "issue ms", "step ms",
              "per step"]
    if turns:
        out += ["### Taking turns (the verdict)", "",
                f"One process per mode on one CPU, runs of {turns.get('steps', '?')} steps in "
                "turns; the ratio: best run against best run.", ""]
        modes = turns.get("modes", {})
        if turns.get("status") in OK_STATUSES and modes:
            rows = []
            for mode in ("native", "bridge"):
                m = modes.get(mode, {})
                v = m.get("steps_per_s_samples")
                if v:
                    rows.append(_e2e_row(mode, max(v), median(v), f"{min(v):.1f}-{max(v):.1f}",
                                         str(len(v)), [m]))
                else:
                    rows.append([mode, "-", "-", status_text(m), "0", "-", "-", "-"])
            out += table(header, rows)
            r = turns.get("turn_ratios", {}).get("native")
            if r:
                out += ["", f"bridge / native round by round: median {r['median']:.3f}, "
                        f"min {r['min']:.3f}, max {r['max']:.3f} ({r['n']} rounds)"]
        else:
            out += [status_text(turns, 400)]
        out += ["", "### One process after another (context)", ""]
    if not runs:
        return out + ["Not run.", ""]
    rows = []
    for mode in ("native", "bridge"):
        if mode in s:
            x = s[mode]
            ok = [r for r in runs if r.get("mode") == mode and r.get("status") == "ok"]
            rows.append(_e2e_row(mode, x["max"], x["median"], f"{x['min']:.1f}-{x['max']:.1f}",
                                 str(x["n"]), ok))
        else:
            rows.append([mode, "-", "-", why_missing(runs, None, mode), "0", "-", "-", "-"])
    return out + table(header, rows) + [""]


def _grid(rows: dict, first: str) -> list[str]:
    """{row: {column: value}} as a table; numbers formatted, other values as text."""
    cols: list[str] = []
    for r in rows.values():
        for c in r if isinstance(r, dict) else ():
            if c not in cols:
                cols.append(c)

    def cell(v: Any) -> str:
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        if is_number(v):
            return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
        return "-" if v is None else str(v)[:80].replace("|", "/")

    body = [[str(k)] + [cell(r.get(c)) for c in cols] for k, r in rows.items()
            if isinstance(r, dict)]
    return table([first] + cols, body) if body and cols else []


def md_pinned(results: dict) -> list[str]:
    p = results.get("pinned", {})
    out = ["## Pinned host memory", ""]
    if p.get("status") not in OK_STATUSES:
        return out + [status_text({"status": "not run", **p}, 600), ""]
    data = p.get("data") if isinstance(p.get("data"), dict) else {}
    out.append(f"bench_pinned.py output: {', '.join(p.get('files', [])) or 'no JSON file'}")
    by = data.get("bridge_over_torch_pinned") or {}
    if by:
        out += [""] + table(["bridge / torch pinned", "ratio"], [[k, f"{v:.3f}"]
                                                                  for k, v in by.items()])
    bw = data.get("bandwidth")
    if isinstance(bw, dict):
        for direction in ("h2d", "d2h"):
            if isinstance(bw.get(direction), dict) and bw[direction]:
                out += ["", f"{direction} copy bandwidth, GB/s:", ""]
                out += _grid(bw[direction], "size")
    alloc = data.get("alloc_ns")
    if isinstance(alloc, dict) and alloc:
        out += ["", "pinned allocate + drop, ns per pair:", ""] + _grid(alloc, "size")
    if data.get("errors"):
        out += ["", f"errors: {data['errors']}"[:600]]
    return out + [""]


def _verdict_line(results: dict, group: str) -> list[str]:
    """"Verdict: ..." for one section's checks: pass / FAIL / missing with values."""
    mine = [c for c in results.get("checks", []) if c.get("group") == group]
    if not mine:
        return []
    counts = {k: sum(c["status"] == k for c in mine) for k in ("pass", "fail", "missing")}
    if counts["missing"] == len(mine):
        head = next((h for h in ("not run", "skipped")
                     if all(c.get("note", "").startswith(h) for c in mine)), "missing")
        return [f"Verdict: {head} ({len(mine)} target{'s' if len(mine) > 1 else ''} "
                f"missing{': ' + mine[0]['note'] if head != 'not run' else ''}).", ""]
    head = "**FAIL**" if counts["fail"] else "incomplete" if counts["missing"] else "pass"
    parts = [f"{c['label']} {'-' if c['value'] is None else format(c['value'], '.3f')} "
             f"({c['op']} {c['target']:g}: {c['status']})" for c in mine]
    return [f"Verdict: {head} ({counts['pass']} pass, {counts['fail']} fail, "
            f"{counts['missing']} missing): " + "; ".join(parts), ""]


def _section_missing(section: Any) -> list[str]:
    why = not_ok(section)
    return [f"Not run ({why})." if why != "not run" else "Not run.", ""] if why else []


def _gib(v: Any) -> str:
    return f"{v / 2**30:.2f}" if is_number(v) else "-"


def md_trace(results: dict) -> list[str]:
    out = ["## Allocation traces replayed (bench_trace.py)", "",
           "The committed traces replayed (torch.empty / del) by one warm worker per "
           "allocator, in turns: ns per event of the best pass; peak reserved (the largest of "
           "its processes) / the trace's peak live. Targets: bridge / native ns per event <= 1 "
           f"(the median of >= {TRACE_MIN_ROUNDS} round-by-round ratios); bridge reserved / "
           f"live {TRACE_FRAG_TARGET[0]} {TRACE_FRAG_TARGET[1]:.2f} and <= native's.", ""]
    trace = results.get("trace") or {}
    replays, why = trace_replays(trace)
    rows = []
    for name in list(TRACES) + sorted(set(replays) - set(TRACES)):
        if name not in replays:
            rows.append([name, why.get(name, "not run")] + ["-"] * 7)
            continue
        for config, r in replays[name].items():
            if not isinstance(r, dict):
                continue
            if not is_number(r.get("ns_per_event")):
                rows.append([name, config, status_text(r).replace("\n", " ")] + ["-"] * 6)
                continue
            rol = r.get("reserved_over_live")
            sp = r.get("ratio_spread") or {}
            ratio = (f"{sp['median']:.3f} [{sp['q1']:.3f}-{sp['q3']:.3f}] "
                     f"({sp['min']:.3f}-{sp['max']:.3f}), n={sp['n']}"
                     if all(is_number(sp.get(k)) for k in ("median", "q1", "q3", "min", "max"))
                     else "-")
            hits = (f"{r['cache_hits'] / r['allocs']:.1%}" if is_number(r.get("cache_hits"))
                    and is_number(r.get("allocs")) and r["allocs"] else "-")
            rows.append([name, config, f"{r['ns_per_event']:,.0f}", ratio,
                         _gib(r.get("peak_reserved")), _gib(r.get("peak_live")),
                         f"{rol:.3f}" if is_number(rol) else "-", hits,
                         f"{r.get('rounds', '-')} / {len(r.get('processes') or []) or '-'}"])
    out += table(["trace", "allocator", "ns / event (best)",
                   "/ first config, per round: median [quartiles] (range)", "peak reserved GiB",
                   "peak live GiB", "reserved / live", "cache hits", "rounds / processes"],
                  rows) + [""]
    return out


def md_capacity(results: dict) -> list[str]:
    cap = results.get("capacity")
    d = section_data(cap)
    budget = d.get("budget")
    out = ["## Capacity: the largest batch of a mixed pipeline under one budget "
           "(bench_capacity.py)", "",
           "CuPy preprocessing, then torch training; native: the budget split between CuPy's "
           "set_limit and torch's memory fraction (the best split counts); bridge: one budget. "
           "Target: bridge batch / best native batch "
           f"{CAPACITY_TARGET[0]} {CAPACITY_TARGET[1]}." +
           (f" Budget {_gib(budget)} GiB, {d.get('steps', '?')} steps per try." if budget
            else ""), ""]
    if missing := _section_missing(cap):
        return out + missing
    rows = []
    for r in d.get("runs", []):
        if not isinstance(r, dict):
            continue
        mode = r.get("mode", "?")
        if r.get("status") == "error" or "batch" not in r:
            rows.append([mode, "-", "-", "-", f"error: {r.get('error', '')}"[-160:]
                         .replace("\n", " ")])
            continue
        split = r.get("split")
        rows.append([mode, f"{split:.2f}" if is_number(split) else "-", str(r.get("batch")),
                     f"{r.get('seconds', '-')}", str(len(r.get("tries", [])))])
    out += table(["mode", "CuPy share", "largest batch", "seconds", "tries"], rows) + [""]
    return out


def md_wait(results: dict) -> list[str]:
    w = results.get("wait")
    out = ["## Waiting at a tight budget (bench_wait.py)", "",
           "A CuPy producer and a torch trainer (512 MiB batches): about two batches' budget "
           "with wait=30 (tight) vs none (unlimited), processes in turns. Target: the median "
           "over rounds of tight / unlimited steps/s "
           f"{WAIT_TARGET[0]} {WAIT_TARGET[1]}.", ""]
    if missing := _section_missing(w):
        return out + missing
    rows = []
    for mode, runs in (section_data(w).get("runs") or {}).items():
        for i, r in enumerate(runs if isinstance(runs, list) else []):
            if not isinstance(r, dict):
                continue
            sps = r.get("steps_per_s")
            rows.append([mode, str(i + 1), f"{sps:.1f}" if is_number(sps) else "-",
                         _gib(r.get("budget")) if r.get("budget") else "none",
                         str(r.get("num_waits", "-")),
                         f"{r['wait_seconds']:.2f}" if is_number(r.get("wait_seconds"))
                         else "-", str(r.get("num_ooms", "-")),
                         "; ".join(r.get("errors") or [])[:120].replace("|", "/") or "-"])
    out += table(["mode", "round", "steps/s", "budget GiB", "waits", "wait s", "OOMs",
                   "errors"], rows) + [""]
    return out


def md_share(results: dict) -> list[str]:
    sh = results.get("share")
    d = section_data(sh)
    out = ["## A cross-process share vs an own budget (bench_share.py)", "",
           f"{d.get('framework', 'torch')}, one worker per configuration, in turns; -pool: the "
           "cache off (every allocation passes the budget check). Cells: ns per alloc+free "
           "pair, best loop; ratios: median of the rounds' [min-max]. Target: share / "
           f"own (cache hits) {SHARE_TARGET[0]} {SHARE_TARGET[1]:.2f} at every size.", ""]
    if missing := _section_missing(sh):
        return out + missing
    sizes = [str(s) for s in d.get("sizes", [])]
    configs = d.get("configs") or {}
    rows = []
    for c in ("own", "share", "own-pool", "share-pool"):
        e = configs.get(c)
        if not isinstance(e, dict):
            continue
        ns = e.get("ns_per_pair") or {}
        if not ns:
            rows.append([c, status_text(e)] + [""] * (len(sizes) - 1))
            continue
        rows.append([c] + [f"{ns[s]:,.0f}" if is_number(ns.get(s)) else "-" for s in sizes])
    for name, per in (d.get("ratios") or {}).items():
        rows.append([name] + [f"{per[s]['median']:.3f} [{per[s]['min']:.2f}-{per[s]['max']:.2f}]"
                              if isinstance(per.get(s), dict) else "-" for s in sizes])
    out += table(["configuration"] + [size_label(int(s)) for s in sizes], rows) + [""]
    return out


def md_rmm(results: dict) -> list[str]:
    r = results.get("rmm")
    d = section_data(r)
    out = ["## RMM: the bridge's resource vs RMM's CudaAsyncMemoryResource (bench_rmm.py)", "",
           "One process, in turns; ns per allocate + free pair, median of the rounds: buffer_* "
           "an rmm.DeviceBuffer, mr_* the resource's allocate/deallocate; *_bridge on the "
           "resource unify(rmm=True) installs"
           + (f" ({d['resource']}, path {d['path']})" if d.get("path") else "")
           + ", *_callback on the callback fallback. "
           f"Target: the worst size's buffer_bridge / buffer_async {RMM_TARGET[0]} "
           f"{RMM_TARGET[1]:.2f}." + (f" RMM {d['rmm']}." if d.get("rmm") else ""), ""]
    if missing := _section_missing(r):
        return out + missing
    cols = ("buffer_async", "buffer_bridge", "ratio", "buffer_callback", "callback_ratio",
            "mr_async", "mr_bridge", "mr_ratio")
    rows = [[size] + [(f"{e[c]:.3f}" if "ratio" in c else f"{e[c]:,.0f}")
                      if is_number(e.get(c)) else "-" for c in cols]
            for size, e in (d.get("ns_per_pair") or {}).items() if isinstance(e, dict)]
    out += table(["size", *cols], rows) + [""]
    return out


def markdown(results: dict) -> str:
    checks = results.get("checks", [])
    v = results.get("verdict", {})
    lines = ["# bridge benchmarks", ""]
    lines += md_meta(results.get("meta", {})) + [""]
    lines += [f"## Targets: {v.get('pass', 0)} pass, {v.get('fail', 0)} fail, "
              f"{v.get('missing', 0)} missing", ""]
    lines += table(["metric", "value", "target", "result", "note"], [
        [c["label"], "-" if c["value"] is None else f"{c['value']:.3f}",
         f"{c['op']} {c['target']:.2f}",
         {"pass": "pass", "fail": "**FAIL**", "missing": "missing"}[c["status"]],
         c.get("note", "").replace("|", "/").replace("\n", " ")] for c in checks]) + [""]
    lines += md_turns(results) + md_alloc(results) + md_mixed(results)
    lines += md_e2e(results) + md_pinned(results)
    for group, section in (("trace", md_trace), ("capacity", md_capacity), ("wait", md_wait),
                           ("share", md_share), ("rmm", md_rmm)):
        lines += section(results) + _verdict_line(results, group)
    problems = results.get("problems", [])
    if problems:
        lines += ["## Problems during the run", ""] + [f"- {p}" for p in problems] + [""]
    return "\n".join(lines)


def write_markdown(results: dict, path: str) -> None:
    with open(path, "w") as f:
        f.write(markdown(results))


# ---- chart ----

def write_png(results: dict, path: str) -> bool:
    """A horizontal bar per target: the measured ratio, with its target marked. False when
    matplotlib is missing (nothing written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        return False
    checks = results.get("checks", [])
    n = max(1, len(checks))
    fig, ax = plt.subplots(figsize=(10, 0.42 * n + 1.6))
    colors = {"pass": "#3a923a", "fail": "#c0392b", "missing": "#bbbbbb"}
    top = 1.6
    for i, c in enumerate(checks):
        y = n - 1 - i
        value = c["value"]
        ax.barh(y, value if value is not None else 0.0, color=colors[c["status"]], height=0.6)
        ax.plot([c["target"], c["target"]], [y - 0.4, y + 0.4], color="black", lw=2)
        text = "missing" if value is None else f"{value:.3f}"
        ax.text(max(value or 0.0, c["target"]) + 0.02, y, text, va="center", fontsize=8)
        top = max(top, (value or 0.0) * 1.2, c["target"] * 1.2)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"{c['label']} ({c['op']} {c['target']:.2f})" for c in reversed(checks)],
                       fontsize=8)
    ax.set_xlim(0, top)
    ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("ratio (black tick: target; green pass, red fail, grey missing)")
    meta = results.get("meta", {})
    ax.set_title(f"bridge vs native allocators and RMM: {meta.get('gpu_name', 'GPU ?')}, "
                 f"{meta.get('date', '')[:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_all(results: dict, out_dir: str, png: bool = True) -> None:
    """summarize, then results.json, results.md and (png=True) results.png in out_dir."""
    summarize(results)
    os.makedirs(out_dir, exist_ok=True)
    if png and not write_png(results, os.path.join(out_dir, "results.png")):
        note = "matplotlib missing: no results.png"
        if note not in results.setdefault("problems", []):
            results["problems"].append(note)
    tmp = os.path.join(out_dir, "results.json.tmp")
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True, default=str)
    os.replace(tmp, os.path.join(out_dir, "results.json"))
    write_markdown(results, os.path.join(out_dir, "results.md"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python3 benchmarks/report.py DIR   (DIR holds results.json)", file=sys.stderr)
        return 2
    with open(os.path.join(argv[0], "results.json")) as f:
        results = json.load(f)
    write_all(results, argv[0])
    print(os.path.join(argv[0], "results.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
