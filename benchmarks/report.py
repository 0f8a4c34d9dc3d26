# SPDX-License-Identifier: Apache-2.0
"""Turn collected benchmark results into a verdict: results.md and results.png.

    python3 benchmarks/report.py DIR        # rewrites DIR/results.md and DIR/results.png

No GPU framework is imported (matplotlib only for the PNG): the report can be rebuilt
anywhere from a results.json. ``summarize(results)`` adds ``alloc.summary``,
``e2e.summary`` and ``checks`` (every target with its value and pass / fail / missing) to
what run_all.py collected; ``markdown`` and ``write_png`` render them.
"""

from __future__ import annotations

import json
import math
import operator
import os
import sys
from collections.abc import Iterable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median, size_label, spread  # noqa: E402

LABELS = {
    "torch": {"native": "native caching", "async": "backend:cudaMallocAsync",
              "rmm": "RMM (CudaAsyncMemoryResource)", "bridge": "bridge"},
    "cupy": {"native": "MemoryPool", "async": "MemoryAsyncPool",
             "rmm": "RMM rmm_cupy_allocator", "bridge": "bridge"},
}
SHORT = {"torch": {"native": "native", "async": "cudaMallocAsync", "rmm": "RMM"},
         "cupy": {"native": "MemoryPool", "async": "MemoryAsyncPool", "rmm": "RMM"}}

#: (framework, baseline config, op, target): bridge ns / baseline ns must satisfy op target.
#: In turns the figure is the median of the round-by-round ratios (issues 29 and 34: torch
#: and CuPy at <= 0.90 of their own caching pools); from separate processes, best against best.
ALLOC_TARGETS = (
    ("torch", "native", "<=", 0.90),
    ("torch", "async", "<", 1.00),
    ("torch", "rmm", "<", 1.00),
    ("cupy", "native", "<=", 0.90),
    ("cupy", "async", "<", 1.00),
    ("cupy", "rmm", "<", 1.00),
)
MIXED_TARGET = ("<=", 1.02)   # bridge: (used - baseline) / live with torch holding N
E2E_TARGET = (">=", 0.98)     # bridge steps/s / native steps/s
PINNED_TARGET = (">=", 0.95)  # bridge pinned / torch pinned
TRACE_TIME_TARGET = ("<=", 1.00)      # bench_trace.py: bridge ns per event / native's
TRACE_FRAG_TARGET = ("<=", 1.05)      # bridge peak reserved / peak live
TRACE_VS_NATIVE_TARGET = ("<=", 1.00)  # bridge reserved/live over native reserved/live
#: The trace time's verdict: the median of at least this many round-by-round ratios.
TRACE_MIN_ROUNDS = 9
CAPACITY_TARGET = (">=", 1.8)  # bench_capacity.py: bridge batch / best native split's batch
WAIT_TARGET = (">=", 0.9)      # bench_wait.py: tight budget with waiting / unlimited, steps/s
SHARE_TARGET = ("<=", 1.05)    # bench_share.py: share / own at cache hits, median per size
RMM_TARGET = ("<=", 1.05)      # bench_rmm.py: bridge's RMM resource / RMM's async, worst size
#: The traces run_all.py replays: each has its checks, "missing" when it did not run.
TRACES = ("gpt2", "resnet50", "cupy-fft", "mixed")
#: Traces with CuPy's events too (bench_trace.py replays those through CuPy): no RMM there.
MIXED_TRACES = ("mixed",)

OK_STATUSES = ("ok", "partial")


OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt}


def _state(d: dict, n: int = 120) -> str:
    """'status: reason or error' of a result that holds no figure, at most n characters."""
    return f"{d.get('status', '?')}: {d.get('reason') or d.get('error') or ''}"[:n]


def _check(cid: str, label: str, value: float | None, op: str, target: float,
           note: str = "", group: str = "") -> dict:
    ok = value is not None and not math.isnan(value)
    return {"id": cid, "label": label, "group": group, "op": op, "target": target,
            "value": round(value, 4) if ok else None,
            "status": ("pass" if OPS[op](value, target) else "fail") if ok else "missing",
            "note": note}


def _why_missing(runs: Iterable[dict], framework: str | None, config: str) -> str:
    """The reason a configuration has no figure: its skip reason or its error."""
    for r in runs:
        if r.get("config", r.get("mode")) == config and (framework is None
                                                         or r.get("framework") == framework):
            if r.get("status") == "skipped":
                return f"skipped: {r.get('reason', '')}"[:160]
            if r.get("status") not in OK_STATUSES:
                return f"error: {r.get('error', r.get('status'))}"[:160]
    return "not run"


# ---- summary ----

def summarize_alloc(alloc: dict) -> dict:
    """{framework: {config: {size: spread of per-process medians}}}."""
    summary: dict = {}
    for r in alloc.get("runs", []):
        if r.get("status") not in OK_STATUSES or r.get("config") == "all":
            continue
        if _is_number(r.get("floor_ns")):
            summary.setdefault(r["framework"], {}).setdefault(r["config"], {}) \
                .setdefault("floor", []).append(float(r["floor_ns"]))
        for size, ns in (r.get("ns_per_pair") or {}).items():
            summary.setdefault(r["framework"], {}).setdefault(r["config"], {}) \
                .setdefault(str(size), []).append(float(ns))
    return {fw: {c: {s: spread(v, 2) for s, v in sizes.items()} for c, sizes in cfgs.items()}
            for fw, cfgs in summary.items()}


def _turns_value(turns: dict | None, base: str, size: str) -> tuple[float | None, str]:
    """bridge / base from bench_turns.py: the median of the round-by-round ratios (the best
    loop against the best loop where no round has both), and a note with the best loops' ratio
    and, over generations of workers, their medians' median and range."""
    if not turns or turns.get("status") not in OK_STATUSES:
        return None, ""
    cfg = turns.get("configs", {})
    b = cfg.get("bridge", {}).get("ns_per_pair", {}).get(size)
    n = cfg.get(base, {}).get("ns_per_pair", {}).get(size)
    if not b or not n:
        return None, ""
    r = turns.get("turn_ratios", {}).get(base, {}).get(size)
    if not r or not _is_number(r.get("median")):
        return b / n, "taking turns; best loop against best loop (no round-by-round ratios)"
    note = (f"taking turns; median of {r['n']} rounds [{r['min']:.3f}-{r['max']:.3f}]; "
            f"best loops {b / n:.3f}")
    gens = [g for g in r.get("process_medians") or [] if _is_number(g)]
    if gens:
        note += (f"; {len(gens)} generations' medians: median {median(gens):.3f} "
                 f"[{min(gens):.3f}-{max(gens):.3f}]")
    return float(r["median"]), note


def alloc_checks(alloc: dict, turns: dict | None = None) -> list[dict]:
    """The allocation targets: from the allocators taking turns (bench_turns.py) where that
    ran, otherwise from the separate processes."""
    summary = alloc.get("summary", {})
    runs = alloc.get("runs", [])
    sizes = [str(s) for s in alloc.get("sizes", [])]
    checks = []
    for fw, base, op, target in ALLOC_TARGETS:
        for size in sizes:
            value, note = _turns_value((turns or {}).get(fw), base, size)
            b = summary.get(fw, {}).get("bridge", {}).get(size)
            n = summary.get(fw, {}).get(base, {}).get(size)
            if value is not None:
                pass
            elif b and n:
                # best process against best process: the noise on a shared VM is
                # one-sided (a process only ever runs slower), so the minimum is
                # the estimate of each allocator's own cost
                value, note = b["min"] / n["min"], "separate processes"
            else:
                note = "; ".join(f"{c}: {_why_missing(runs, fw, c)}"
                                 for c, s in (("bridge", b), (base, n)) if not s)
                t = (turns or {}).get(fw)
                if t:
                    why = t.get("configs", {}).get(base, {})
                    why_text = why.get("reason") or why.get("error") or t.get("error") or ""
                    note += f"; turns: {t.get('status')} {why_text}"
            checks.append(_check(f"{fw}.alloc.{base}.{size}",
                                 f"{fw} {size_label(int(size))}: bridge / {SHORT[fw][base]}",
                                 value, op, target, note[:300], group=f"{fw} alloc"))
    return checks


def mixed_checks(mixed: dict) -> list[dict]:
    runs = [r for r in mixed.get("runs", []) if r.get("mode") == "bridge"]
    ok = [r for r in runs if r.get("status") == "ok" and r.get("outcome") == "ok"]
    if ok:
        value, note = ok[-1].get("used_over_live"), ""
        raw = ok[-1].get("raw_used_over_live")
        if raw is not None:
            note = f"raw used/live {raw:.3f} (contexts included)"
    else:
        value = None
        if runs and runs[-1].get("outcome") == "oom":
            note = f"bridge outcome oom: {runs[-1].get('oom', '')}"
        else:
            note = _why_missing(runs, None, "bridge")
    return [_check("mixed.bridge.used_over_live", "mixed phases: bridge used / live", value,
                   *MIXED_TARGET, note[:300], group="mixed")]


def e2e_checks(e2e: dict, turns: dict | None = None) -> list[dict]:
    """bridge / native steps/s: from the modes taking turns where that ran (best run against
    best run), otherwise from the separate processes (best process against best process)."""
    runs = e2e.get("runs", [])
    per_mode: dict = {}
    for r in runs:
        if r.get("status") == "ok" and r.get("steps_per_s"):
            per_mode.setdefault(r["mode"], []).append(float(r["steps_per_s"]))
    e2e["summary"] = {m: spread(v, 2) for m, v in per_mode.items()}
    s = e2e["summary"]
    value, note = None, ""
    modes = (turns or {}).get("modes", {}) if (turns or {}).get("status") in OK_STATUSES else {}
    b, n = (modes.get(m, {}).get("best_steps_per_s") for m in ("bridge", "native"))
    if b and n:
        value, note = b / n, "taking turns"
        r = (turns or {}).get("turn_ratios", {}).get("native")
        if r:
            note += (f"; per round: median {r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}], "
                     f"n={r['n']}")
    elif "bridge" in s and "native" in s:
        # best process against best process, as for allocation: the step is mostly
        # CPU-bound (see issue_ms) and a process only ever runs slower than its best
        value, note = s["bridge"]["max"] / s["native"]["max"], "separate processes"
    else:
        note = "; ".join(f"{m}: {_why_missing(runs, None, m)}" for m in ("native", "bridge")
                         if m not in s)
        if turns:
            note += f"; turns: {turns.get('status')} {turns.get('error', '')}"
    return [_check("e2e.bridge_over_native", "end to end: bridge / native steps/s", value,
                   *E2E_TARGET, note[:300], group="e2e")]


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def pinned_checks(pinned: dict) -> list[dict]:
    """bench_pinned.py's 'ratio': the smallest of its bridge / torch pinned bandwidths
    (bridge_over_torch_pinned, per direction and size)."""
    status = pinned.get("status", "not run")
    data = _data(pinned)
    by = data.get("bridge_over_torch_pinned") or {}
    value = data.get("ratio") if status in OK_STATUSES and _is_number(data.get("ratio")) else None
    if status not in OK_STATUSES:
        note = _state({"status": status, **pinned}, 300)
    elif value is None:
        note = "no ratio in bench_pinned.py's result"
    else:
        note = f"smallest of {len(by)}: {min(by, key=by.__getitem__)}" if by else "ratio"
    if status == "partial":
        note += f" ({status}: {data.get('errors', '')})"
    return [_check("pinned.bridge_over_torch", "pinned: bridge / torch pinned", value,
                   *PINNED_TARGET, note[:300], group="pinned")]


# ---- the later sections: trace, capacity, wait, share, rmm ----

def _not_ok(section: Any) -> str | None:
    """Why a section's result holds no figures ("not run" when absent), or None."""
    if not isinstance(section, dict) or not section:
        return "not run"
    status = section.get("status", "not run")
    if status in OK_STATUSES:
        return None
    why = section.get("reason") or section.get("error") or ""
    return f"{status}: {why}".strip().rstrip(":")[:300]


def _data(section: Any) -> dict:
    d = section.get("data") if isinstance(section, dict) else None
    return d if isinstance(d, dict) else {}


def trace_replays(trace: dict | None) -> tuple[dict, dict]:
    """({trace name: {config: best replay}}, {trace name: why it has none}) from the
    per-trace results run_all stored (each child's bench_trace.py JSON under "data")."""
    replays: dict = {}
    why: dict = {}
    for name, r in (trace or {}).items():
        bad = _not_ok(r)
        if bad:
            why[name] = bad
            continue
        for tname, configs in _data(r).items():
            if isinstance(configs, dict):
                replays[tname] = configs
    return replays, why


def _ratio_spread_text(entry: dict) -> str:
    """'median 0.950 of 21 round-by-round ratios (quartiles 0.93-0.97, range 0.90-1.40)'."""
    ratios = [x for x in entry.get("round_ratios") or [] if _is_number(x)]
    s = entry.get("ratio_spread") or {}
    text = f"median {median(ratios):.3f} of {len(ratios)} round-by-round ratios" if ratios \
        else "no round-by-round ratios"
    if all(_is_number(s.get(k)) for k in ("q1", "q3", "min", "max")):
        text += f" (quartiles {s['q1']:.3f}-{s['q3']:.3f}, range {s['min']:.3f}-{s['max']:.3f})"
    return text


#: The bridge's configurations whose trace replays are checked: the default, and carving
#: (off by default; BRIDGE_CACHE_CARVE=1) where the run replayed it. (config, id part).
TRACE_CHECKED = (("bridge", ""), ("bridge-carve", "carve."))


def trace_checks(trace: dict | None) -> list[dict]:
    """Per trace and checked configuration: its ns per event over native's, its reserved /
    live, and its reserved / live over native's (the same trace: over native's peak
    reserved). Carving's checks only where some trace replayed it."""
    replays, why = trace_replays(trace)
    checked = [(c, part) for c, part in TRACE_CHECKED
               if not part or any(c in cfg for cfg in replays.values())]
    checks = []
    for name in list(TRACES) + sorted(set(replays) - set(TRACES)):
        cfg = replays.get(name, {})
        n = cfg.get("native") or {}
        for config, part in checked:
            checks += _trace_config_checks(name, config, f"trace.{name}.{part}",
                                           cfg.get(config) or {}, n, name in replays,
                                           why.get(name, "not run"))
    return checks


def _trace_config_checks(name: str, config: str, cid: str, b: dict, n: dict, ran: bool,
                         why: str) -> list[dict]:
    """trace_checks' three checks of one configuration (b) against native (n)."""

    def miss(entry: dict, label: str) -> str:
        if not ran:
            return why
        if not entry:
            return f"{label}: not run"
        return f"{label}: {entry.get('status', '?')} {entry.get('error', '')}"[:200]

    bt, nt = b.get("ns_per_event"), n.get("ns_per_event")
    time_v = bt / nt if _is_number(bt) and _is_number(nt) and nt else None
    time_note = (f"{bt:,.0f} / {nt:,.0f} ns per event, best pass" if time_v is not None
                 else "; ".join(miss(e, c) for c, e in ((config, b), ("native", n))
                                if not _is_number(e.get("ns_per_event"))))
    # rounds in turns: the median of the round-by-round ratios decides, over enough rounds
    ratios = [x for x in b.get("round_ratios") or [] if _is_number(x)]
    enough = len(ratios) >= TRACE_MIN_ROUNDS and _is_number(b.get("median_ratio_to_native"))
    if time_v is not None and enough:
        time_v = b["median_ratio_to_native"]
        time_note = f"{_ratio_spread_text(b)}; " + time_note
    elif time_v is not None:  # best pass against best pass decides nothing
        time_v = None
        time_note = (f"{len(ratios)} round-by-round ratios, fewer than {TRACE_MIN_ROUNDS}: "
                     f"no verdict; " + time_note)
    bf, nf = b.get("reserved_over_live"), n.get("reserved_over_live")
    frag_note = (f"peak reserved {b['peak_reserved'] / 2**30:.2f} GiB, live "
                 f"{b['peak_live'] / 2**30:.2f} GiB" if _is_number(bf)
                 and _is_number(b.get("peak_reserved")) and _is_number(b.get("peak_live"))
                 else miss(b, config) if not _is_number(bf) else "")
    vs_v = bf / nf if _is_number(bf) and _is_number(nf) and nf else None
    vs_note = (f"{bf:.3f} / {nf:.3f}" if vs_v is not None else
               "; ".join(miss(e, c) for c, e, v in ((config, b, bf), ("native", n, nf))
                         if not _is_number(v)))
    return [
        _check(f"{cid}time", f"trace {name}: {config} / native ns per event", time_v,
               *TRACE_TIME_TARGET, time_note, group="trace"),
        _check(f"{cid}reserved_over_live", f"trace {name}: {config} reserved / live",
               bf if _is_number(bf) else None, *TRACE_FRAG_TARGET, frag_note, group="trace"),
        _check(f"{cid}reserved_vs_native", f"trace {name}: {config} / native reserved/live",
               vs_v, *TRACE_VS_NATIVE_TARGET, vs_note, group="trace"),
    ]


def capacity_value(capacity: dict | None) -> tuple[float | None, str]:
    """bridge batch / best native split's batch from bench_capacity.py, and a note."""
    bad = _not_ok(capacity)
    if bad:
        return None, bad
    d = _data(capacity)
    runs = [r for r in d.get("runs", []) if isinstance(r, dict)]
    bridge = next((r for r in runs if r.get("mode") == "bridge"), runs[-1] if runs else {})
    if bridge.get("status") == "error":
        return None, f"bridge run: error {bridge.get('error', '')}"[:300]
    natives = [r for r in runs if r is not bridge]
    failed = sum(r.get("status") == "error" for r in natives)
    b, n = d.get("bridge_batch"), d.get("native_batch")
    if not _is_number(b) or not _is_number(n) or not n:
        return None, (f"no native split fitted a batch ({failed} of {len(natives)} failed)"
                      if natives else "no runs")
    note = f"bridge {b} / native {n} (split {d.get('native_best_split')})"
    if failed:
        note += f"; {failed} of {len(natives)} native splits failed"
    return b / n, note


def wait_value(wait: dict | None) -> tuple[float | None, str]:
    """The median over rounds of tight steps/s / unlimited steps/s (the two runs of a round
    took turns), from rounds whose runs had no errors; the best tight run over the best
    unlimited one when no round has both."""
    bad = _not_ok(wait)
    if bad:
        return None, bad
    runs = _data(wait).get("runs", {})
    best, notes = {}, []
    for mode in ("tight", "unlimited"):
        mine = [r for r in runs.get(mode, []) if isinstance(r, dict)]
        clean = [r["steps_per_s"] for r in mine if not r.get("errors")
                 and _is_number(r.get("steps_per_s"))]
        if clean:
            best[mode] = max(clean)
        errs = sum(bool(r.get("errors")) for r in mine)
        if errs:
            notes.append(f"{mode}: {errs} of {len(mine)} runs with errors (left out)")
    if len(best) < 2:
        return None, "; ".join(notes + [f"{m}: no run without errors" for m in
                                        ("tight", "unlimited") if m not in best])
    tight = [r for r in runs.get("tight", []) if isinstance(r, dict)]
    waits = sum(r.get("num_waits", 0) for r in tight if _is_number(r.get("num_waits")))
    notes.insert(0, f"best {best['tight']:.1f} / {best['unlimited']:.1f} steps/s; "
                    f"{waits} waits in the tight runs")
    ratios = [t["steps_per_s"] / u["steps_per_s"]
              for t, u in zip(tight, runs.get("unlimited", []), strict=False)
              if isinstance(u, dict) and not t.get("errors") and not u.get("errors")
              and _is_number(t.get("steps_per_s")) and _is_number(u.get("steps_per_s"))
              and u["steps_per_s"]]  # fmt: skip
    if ratios:
        notes.insert(0, f"median of {len(ratios)} rounds' ratios")
        return median(ratios), "; ".join(notes)
    return best["tight"] / best["unlimited"], "; ".join(notes)


def share_checks(share: dict | None, sizes: Iterable[int | str] | None = None) -> list[dict]:
    """share / own (cache hits) per size: the median of the round-by-round ratios."""
    bad = _not_ok(share)
    d = _data(share)
    ratios = (d.get("ratios") or {}).get("share/own", {}) if not bad else {}
    keys = [str(s) for s in (d.get("sizes") or sizes or [512, 1 << 20, 64 << 20])]
    keys += [k for k in ratios if k not in keys]
    checks = []
    for size in keys:
        r = ratios.get(size)
        if isinstance(r, dict) and _is_number(r.get("median")):
            value = r["median"]
            note = f"round by round: [{r['min']:.3f}-{r['max']:.3f}], n={r['n']}"
        else:
            value, note = None, bad or "no share/own figure for this size"
        label = size_label(int(size)) if size.isdigit() else size
        checks.append(_check(f"share.share_over_own.{size}",
                             f"share {label}: share / own budget (cache hits)", value,
                             *SHARE_TARGET, note, group="share"))
    return checks


def rmm_value(rmm: dict | None) -> tuple[float | None, str]:
    """The largest bridge / RMM-async ratio over the sizes (bench_rmm.py's worst_ratio,
    recomputed from its per-size figures where they are there)."""
    bad = _not_ok(rmm)
    if bad:
        return None, bad
    per = _data(rmm).get("ns_per_pair") or {}
    ratios = {s: e["ratio"] for s, e in per.items() if isinstance(e, dict)
              and _is_number(e.get("ratio"))}
    if ratios:
        worst = max(ratios, key=lambda k: ratios[k])
        return ratios[worst], f"worst at {worst}"
    w = _data(rmm).get("worst_ratio")
    return (float(w), "worst_ratio") if _is_number(w) else (None, "no ratio in the result")


def later_checks(results: dict) -> list[dict]:
    """The checks of trace, capacity, wait, share and rmm ("missing" where not run)."""
    checks = trace_checks(results.get("trace"))
    value, note = capacity_value(results.get("capacity"))
    checks.append(_check("capacity.bridge_over_native", "capacity: bridge / best native batch",
                         value, *CAPACITY_TARGET, note, group="capacity"))
    value, note = wait_value(results.get("wait"))
    checks.append(_check("wait.tight_over_unlimited", "wait: tight / unlimited steps/s",
                         value, *WAIT_TARGET, note, group="wait"))
    checks += share_checks(results.get("share"), results.get("alloc", {}).get("sizes"))
    value, note = rmm_value(results.get("rmm"))
    checks.append(_check("rmm.worst_ratio", "RMM: bridge resource / CudaAsyncMemoryResource",
                         value, *RMM_TARGET, note, group="rmm"))
    return checks


def summarize(results: dict) -> dict:
    """Add alloc.summary, e2e.summary and checks to results (in place); return it."""
    alloc = results.setdefault("alloc", {})
    alloc["summary"] = summarize_alloc(alloc)
    checks = alloc_checks(alloc, results.get("alloc_turns"))
    checks += mixed_checks(results.setdefault("mixed", {}))
    checks += e2e_checks(results.setdefault("e2e", {}), results.get("e2e_turns"))
    checks += pinned_checks(results.get("pinned") or {"status": "not run"})
    checks += later_checks(results)
    results["checks"] = checks
    results["verdict"] = {k: sum(c["status"] == k for c in checks)
                          for k in ("pass", "fail", "missing")}
    return results


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


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _md_meta(meta: dict) -> list[str]:
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
    return _table(["", ""], rows) if rows else []


def _md_turns(results: dict) -> list[str]:
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
            out += [f"{fw}: {_state(t, 400)}", ""]
            continue
        cfg = t.get("configs", {})
        rows = []
        for config in ("native", "async", "rmm", "bridge"):
            c = cfg.get(config)
            if c is None:
                continue
            if c.get("status") != "ok":
                rows.append([LABELS[fw][config], _state(c)] + [""] * len(sizes))
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
        out += _table([f"{fw} allocator"] + [size_label(int(s)) for s in sizes]
                      + ["no-alloc op"], rows) + [""]
    return out


def _md_alloc(results: dict) -> list[str]:
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
                cells = [_why_missing(runs, fw, config)] + [""] * (len(sizes) - 1)
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
        out += _table(header, rows) + [""]
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
            out += _table(["cupy allocator"] + [size_label(int(s)) for s in sizes], rows)
            skipped = (same.get("info") or {}).get("skipped")
            if skipped:
                out += ["", f"Left out: {skipped}"]
        else:
            out += [f"Not measured: {_state(same, 400)}"]
        out += [""]
    return out


def _md_mixed(results: dict) -> list[str]:
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
    return out + _table(["mode", "N GiB", "outcome", "used GiB (torch holds N)", "used/live",
                         "raw used/live"], rows) + [""]


def _e2e_row(mode: str, best: float, med: float, spread_text: str, n: str,
             runs: list[dict]) -> list[str]:
    issue = [r["issue_ms"] for r in runs if _is_number(r.get("issue_ms"))]
    step = [r["synced_step_ms"] for r in runs if _is_number(r.get("synced_step_ms"))]
    per_step = runs[-1].get("per_step") if runs else None
    counts = ", ".join(f"{k} {v:g}" for k, v in (per_step or {}).items() if _is_number(v))
    return [mode, f"{best:.1f}", f"{med:.1f}", spread_text, n,
            f"{median(issue):.2f}" if issue else "-", f"{median(step):.2f}" if step else "-",
            counts or "-"]


def _md_e2e(results: dict) -> list[str]:
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
                    rows.append([mode, "-", "-", _state(m), "0", "-", "-", "-"])
            out += _table(header, rows)
            r = turns.get("turn_ratios", {}).get("native")
            if r:
                out += ["", f"bridge / native round by round: median {r['median']:.3f}, "
                        f"min {r['min']:.3f}, max {r['max']:.3f} ({r['n']} rounds)"]
        else:
            out += [_state(turns, 400)]
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
            rows.append([mode, "-", "-", _why_missing(runs, None, mode), "0", "-", "-", "-"])
    return out + _table(header, rows) + [""]


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
        if _is_number(v):
            return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
        return "-" if v is None else str(v)[:80].replace("|", "/")

    body = [[str(k)] + [cell(r.get(c)) for c in cols] for k, r in rows.items()
            if isinstance(r, dict)]
    return _table([first] + cols, body) if body and cols else []


def _md_pinned(results: dict) -> list[str]:
    p = results.get("pinned", {})
    out = ["## Pinned host memory", ""]
    if p.get("status") not in OK_STATUSES:
        return out + [_state({"status": "not run", **p}, 600), ""]
    data = p.get("data") if isinstance(p.get("data"), dict) else {}
    out.append(f"bench_pinned.py output: {', '.join(p.get('files', [])) or 'no JSON file'}")
    by = data.get("bridge_over_torch_pinned") or {}
    if by:
        out += [""] + _table(["bridge / torch pinned", "ratio"], [[k, f"{v:.3f}"]
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
    why = _not_ok(section)
    return [f"Not run ({why})." if why != "not run" else "Not run.", ""] if why else []


def _gib(v: Any) -> str:
    return f"{v / 2**30:.2f}" if _is_number(v) else "-"


def _md_trace(results: dict) -> list[str]:
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
            if not _is_number(r.get("ns_per_event")):
                rows.append([name, config, _state(r).replace("\n", " ")] + ["-"] * 6)
                continue
            rol = r.get("reserved_over_live")
            sp = r.get("ratio_spread") or {}
            ratio = (f"{sp['median']:.3f} [{sp['q1']:.3f}-{sp['q3']:.3f}] "
                     f"({sp['min']:.3f}-{sp['max']:.3f}), n={sp['n']}"
                     if all(_is_number(sp.get(k)) for k in ("median", "q1", "q3", "min", "max"))
                     else "-")
            hits = (f"{r['cache_hits'] / r['allocs']:.1%}" if _is_number(r.get("cache_hits"))
                    and _is_number(r.get("allocs")) and r["allocs"] else "-")
            rows.append([name, config, f"{r['ns_per_event']:,.0f}", ratio,
                         _gib(r.get("peak_reserved")), _gib(r.get("peak_live")),
                         f"{rol:.3f}" if _is_number(rol) else "-", hits,
                         f"{r.get('rounds', '-')} / {len(r.get('processes') or []) or '-'}"])
    out += _table(["trace", "allocator", "ns / event (best)",
                   "/ first config, per round: median [quartiles] (range)", "peak reserved GiB",
                   "peak live GiB", "reserved / live", "cache hits", "rounds / processes"],
                  rows) + [""]
    return out


def _md_capacity(results: dict) -> list[str]:
    cap = results.get("capacity")
    d = _data(cap)
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
        rows.append([mode, f"{split:.2f}" if _is_number(split) else "-", str(r.get("batch")),
                     f"{r.get('seconds', '-')}", str(len(r.get("tries", [])))])
    out += _table(["mode", "CuPy share", "largest batch", "seconds", "tries"], rows) + [""]
    return out


def _md_wait(results: dict) -> list[str]:
    w = results.get("wait")
    out = ["## Waiting at a tight budget (bench_wait.py)", "",
           "A CuPy producer and a torch trainer (512 MiB batches): about two batches' budget "
           "with wait=30 (tight) vs none (unlimited), processes in turns. Target: the median "
           "over rounds of tight / unlimited steps/s "
           f"{WAIT_TARGET[0]} {WAIT_TARGET[1]}.", ""]
    if missing := _section_missing(w):
        return out + missing
    rows = []
    for mode, runs in (_data(w).get("runs") or {}).items():
        for i, r in enumerate(runs if isinstance(runs, list) else []):
            if not isinstance(r, dict):
                continue
            sps = r.get("steps_per_s")
            rows.append([mode, str(i + 1), f"{sps:.1f}" if _is_number(sps) else "-",
                         _gib(r.get("budget")) if r.get("budget") else "none",
                         str(r.get("num_waits", "-")),
                         f"{r['wait_seconds']:.2f}" if _is_number(r.get("wait_seconds"))
                         else "-", str(r.get("num_ooms", "-")),
                         "; ".join(r.get("errors") or [])[:120].replace("|", "/") or "-"])
    out += _table(["mode", "round", "steps/s", "budget GiB", "waits", "wait s", "OOMs",
                   "errors"], rows) + [""]
    return out


def _md_share(results: dict) -> list[str]:
    sh = results.get("share")
    d = _data(sh)
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
            rows.append([c, _state(e)] + [""] * (len(sizes) - 1))
            continue
        rows.append([c] + [f"{ns[s]:,.0f}" if _is_number(ns.get(s)) else "-" for s in sizes])
    for name, per in (d.get("ratios") or {}).items():
        rows.append([name] + [f"{per[s]['median']:.3f} [{per[s]['min']:.2f}-{per[s]['max']:.2f}]"
                              if isinstance(per.get(s), dict) else "-" for s in sizes])
    out += _table(["configuration"] + [size_label(int(s)) for s in sizes], rows) + [""]
    return out


def _md_rmm(results: dict) -> list[str]:
    r = results.get("rmm")
    d = _data(r)
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
                      if _is_number(e.get(c)) else "-" for c in cols]
            for size, e in (d.get("ns_per_pair") or {}).items() if isinstance(e, dict)]
    out += _table(["size", *cols], rows) + [""]
    return out


def markdown(results: dict) -> str:
    checks = results.get("checks", [])
    v = results.get("verdict", {})
    lines = ["# bridge benchmarks", ""]
    lines += _md_meta(results.get("meta", {})) + [""]
    lines += [f"## Targets: {v.get('pass', 0)} pass, {v.get('fail', 0)} fail, "
              f"{v.get('missing', 0)} missing", ""]
    lines += _table(["metric", "value", "target", "result", "note"], [
        [c["label"], "-" if c["value"] is None else f"{c['value']:.3f}",
         f"{c['op']} {c['target']:.2f}",
         {"pass": "pass", "fail": "**FAIL**", "missing": "missing"}[c["status"]],
         c.get("note", "").replace("|", "/").replace("\n", " ")] for c in checks]) + [""]
    lines += _md_turns(results) + _md_alloc(results) + _md_mixed(results)
    lines += _md_e2e(results) + _md_pinned(results)
    for group, section in (("trace", _md_trace), ("capacity", _md_capacity), ("wait", _md_wait),
                           ("share", _md_share), ("rmm", _md_rmm)):
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
