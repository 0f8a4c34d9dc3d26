# SPDX-License-Identifier: Apache-2.0
"""The benchmarks' targets and the checks of collected results against them.

``summarize(results)`` adds ``alloc.summary``, ``e2e.summary`` and ``checks`` (every target
with its value and pass / fail / missing) to what run_all.py collected, and ``verdict`` (how
many of each). The figures themselves are the benchmarks' own; this module only reads
them, and report.py renders them. No GPU framework is imported.
"""

from __future__ import annotations

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
TRACES = ("gpt2", "resnet50", "cupy-fft", "mixed", "attention")
#: Traces with CuPy's events too (bench_trace.py replays those through CuPy): no RMM there.
MIXED_TRACES = ("mixed",)

OK_STATUSES = ("ok", "partial")


OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt}


def status_text(d: dict, n: int = 120) -> str:
    """'status: reason or error' of a result that holds no figure, at most n characters."""
    return f"{d.get('status', '?')}: {d.get('reason') or d.get('error') or ''}"[:n]


def make_check(cid: str, label: str, value: float | None, op: str, target: float,
           note: str = "", group: str = "") -> dict:
    ok = value is not None and not math.isnan(value)
    return {"id": cid, "label": label, "group": group, "op": op, "target": target,
            "value": round(value, 4) if ok else None,
            "status": ("pass" if OPS[op](value, target) else "fail") if ok else "missing",
            "note": note}


def why_missing(runs: Iterable[dict], framework: str | None, config: str) -> str:
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
        if is_number(r.get("floor_ns")):
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
    if not r or not is_number(r.get("median")):
        return b / n, "taking turns; best loop against best loop (no round-by-round ratios)"
    note = (f"taking turns; median of {r['n']} rounds [{r['min']:.3f}-{r['max']:.3f}]; "
            f"best loops {b / n:.3f}")
    gens = [g for g in r.get("process_medians") or [] if is_number(g)]
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
                note = "; ".join(f"{c}: {why_missing(runs, fw, c)}"
                                 for c, s in (("bridge", b), (base, n)) if not s)
                t = (turns or {}).get(fw)
                if t:
                    why = t.get("configs", {}).get(base, {})
                    why_text = why.get("reason") or why.get("error") or t.get("error") or ""
                    note += f"; turns: {t.get('status')} {why_text}"
            checks.append(make_check(f"{fw}.alloc.{base}.{size}",
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
            note = why_missing(runs, None, "bridge")
    return [make_check("mixed.bridge.used_over_live", "mixed phases: bridge used / live", value,
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
        note = "; ".join(f"{m}: {why_missing(runs, None, m)}" for m in ("native", "bridge")
                         if m not in s)
        if turns:
            note += f"; turns: {turns.get('status')} {turns.get('error', '')}"
    return [make_check("e2e.bridge_over_native", "end to end: bridge / native steps/s", value,
                   *E2E_TARGET, note[:300], group="e2e")]


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def pinned_checks(pinned: dict) -> list[dict]:
    """bench_pinned.py's 'ratio': the smallest of its bridge / torch pinned bandwidths
    (bridge_over_torch_pinned, per direction and size)."""
    status = pinned.get("status", "not run")
    data = section_data(pinned)
    by = data.get("bridge_over_torch_pinned") or {}
    value = data.get("ratio") if status in OK_STATUSES and is_number(data.get("ratio")) else None
    if status not in OK_STATUSES:
        note = status_text({"status": status, **pinned}, 300)
    elif value is None:
        note = "no ratio in bench_pinned.py's result"
    else:
        note = f"smallest of {len(by)}: {min(by, key=by.__getitem__)}" if by else "ratio"
    if status == "partial":
        note += f" ({status}: {data.get('errors', '')})"
    return [make_check("pinned.bridge_over_torch", "pinned: bridge / torch pinned", value,
                   *PINNED_TARGET, note[:300], group="pinned")]


# ---- the later sections: trace, capacity, wait, share, rmm ----

def not_ok(section: Any) -> str | None:
    """Why a section's result holds no figures ("not run" when absent), or None."""
    if not isinstance(section, dict) or not section:
        return "not run"
    status = section.get("status", "not run")
    if status in OK_STATUSES:
        return None
    why = section.get("reason") or section.get("error") or ""
    return f"{status}: {why}".strip().rstrip(":")[:300]


def section_data(section: Any) -> dict:
    d = section.get("data") if isinstance(section, dict) else None
    return d if isinstance(d, dict) else {}


def trace_replays(trace: dict | None) -> tuple[dict, dict]:
    """({trace name: {config: best replay}}, {trace name: why it has none}) from the
    per-trace results run_all stored (each child's bench_trace.py JSON under "data")."""
    replays: dict = {}
    why: dict = {}
    for name, r in (trace or {}).items():
        bad = not_ok(r)
        if bad:
            why[name] = bad
            continue
        for tname, configs in section_data(r).items():
            if isinstance(configs, dict):
                replays[tname] = configs
    return replays, why


def _ratio_spread_text(entry: dict) -> str:
    """'median 0.950 of 21 round-by-round ratios (quartiles 0.93-0.97, range 0.90-1.40)'."""
    ratios = [x for x in entry.get("round_ratios") or [] if is_number(x)]
    s = entry.get("ratio_spread") or {}
    text = f"median {median(ratios):.3f} of {len(ratios)} round-by-round ratios" if ratios \
        else "no round-by-round ratios"
    if all(is_number(s.get(k)) for k in ("q1", "q3", "min", "max")):
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
    time_v = bt / nt if is_number(bt) and is_number(nt) and nt else None
    time_note = (f"{bt:,.0f} / {nt:,.0f} ns per event, best pass" if time_v is not None
                 else "; ".join(miss(e, c) for c, e in ((config, b), ("native", n))
                                if not is_number(e.get("ns_per_event"))))
    # rounds in turns: the median of the round-by-round ratios decides, over enough rounds
    ratios = [x for x in b.get("round_ratios") or [] if is_number(x)]
    enough = len(ratios) >= TRACE_MIN_ROUNDS and is_number(b.get("median_ratio_to_native"))
    if time_v is not None and enough:
        time_v = b["median_ratio_to_native"]
        time_note = f"{_ratio_spread_text(b)}; " + time_note
    elif time_v is not None:  # best pass against best pass decides nothing
        time_v = None
        time_note = (f"{len(ratios)} round-by-round ratios, fewer than {TRACE_MIN_ROUNDS}: "
                     f"no verdict; " + time_note)
    bf, nf = b.get("reserved_over_live"), n.get("reserved_over_live")
    frag_note = (f"peak reserved {b['peak_reserved'] / 2**30:.2f} GiB, live "
                 f"{b['peak_live'] / 2**30:.2f} GiB" if is_number(bf)
                 and is_number(b.get("peak_reserved")) and is_number(b.get("peak_live"))
                 else miss(b, config) if not is_number(bf) else "")
    vs_v = bf / nf if is_number(bf) and is_number(nf) and nf else None
    vs_note = (f"{bf:.3f} / {nf:.3f}" if vs_v is not None else
               "; ".join(miss(e, c) for c, e, v in ((config, b, bf), ("native", n, nf))
                         if not is_number(v)))
    return [
        make_check(f"{cid}time", f"trace {name}: {config} / native ns per event", time_v,
               *TRACE_TIME_TARGET, time_note, group="trace"),
        make_check(f"{cid}reserved_over_live", f"trace {name}: {config} reserved / live",
               bf if is_number(bf) else None, *TRACE_FRAG_TARGET, frag_note, group="trace"),
        make_check(f"{cid}reserved_vs_native", f"trace {name}: {config} / native reserved/live",
               vs_v, *TRACE_VS_NATIVE_TARGET, vs_note, group="trace"),
    ]


def capacity_value(capacity: dict | None) -> tuple[float | None, str]:
    """bridge batch / best native split's batch from bench_capacity.py, and a note."""
    bad = not_ok(capacity)
    if bad:
        return None, bad
    d = section_data(capacity)
    runs = [r for r in d.get("runs", []) if isinstance(r, dict)]
    bridge = next((r for r in runs if r.get("mode") == "bridge"), runs[-1] if runs else {})
    if bridge.get("status") == "error":
        return None, f"bridge run: error {bridge.get('error', '')}"[:300]
    natives = [r for r in runs if r is not bridge]
    failed = sum(r.get("status") == "error" for r in natives)
    b, n = d.get("bridge_batch"), d.get("native_batch")
    if not is_number(b) or not is_number(n) or not n:
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
    bad = not_ok(wait)
    if bad:
        return None, bad
    runs = section_data(wait).get("runs", {})
    best, notes = {}, []
    for mode in ("tight", "unlimited"):
        mine = [r for r in runs.get(mode, []) if isinstance(r, dict)]
        clean = [r["steps_per_s"] for r in mine if not r.get("errors")
                 and is_number(r.get("steps_per_s"))]
        if clean:
            best[mode] = max(clean)
        errs = sum(bool(r.get("errors")) for r in mine)
        if errs:
            notes.append(f"{mode}: {errs} of {len(mine)} runs with errors (left out)")
    if len(best) < 2:
        return None, "; ".join(notes + [f"{m}: no run without errors" for m in
                                        ("tight", "unlimited") if m not in best])
    tight = [r for r in runs.get("tight", []) if isinstance(r, dict)]
    waits = sum(r.get("num_waits", 0) for r in tight if is_number(r.get("num_waits")))
    notes.insert(0, f"best {best['tight']:.1f} / {best['unlimited']:.1f} steps/s; "
                    f"{waits} waits in the tight runs")
    ratios = [t["steps_per_s"] / u["steps_per_s"]
              for t, u in zip(tight, runs.get("unlimited", []), strict=False)
              if isinstance(u, dict) and not t.get("errors") and not u.get("errors")
              and is_number(t.get("steps_per_s")) and is_number(u.get("steps_per_s"))
              and u["steps_per_s"]]  # fmt: skip
    if ratios:
        notes.insert(0, f"median of {len(ratios)} rounds' ratios")
        return median(ratios), "; ".join(notes)
    return best["tight"] / best["unlimited"], "; ".join(notes)


def share_checks(share: dict | None, sizes: Iterable[int | str] | None = None) -> list[dict]:
    """share / own (cache hits) per size: the median of the round-by-round ratios."""
    bad = not_ok(share)
    d = section_data(share)
    ratios = (d.get("ratios") or {}).get("share/own", {}) if not bad else {}
    keys = [str(s) for s in (d.get("sizes") or sizes or [512, 1 << 20, 64 << 20])]
    keys += [k for k in ratios if k not in keys]
    checks = []
    for size in keys:
        r = ratios.get(size)
        if isinstance(r, dict) and is_number(r.get("median")):
            value = r["median"]
            note = f"round by round: [{r['min']:.3f}-{r['max']:.3f}], n={r['n']}"
        else:
            value, note = None, bad or "no share/own figure for this size"
        label = size_label(int(size)) if size.isdigit() else size
        checks.append(make_check(f"share.share_over_own.{size}",
                             f"share {label}: share / own budget (cache hits)", value,
                             *SHARE_TARGET, note, group="share"))
    return checks


def rmm_value(rmm: dict | None) -> tuple[float | None, str]:
    """The largest bridge / RMM-async ratio over the sizes (bench_rmm.py's worst_ratio,
    recomputed from its per-size figures where they are there)."""
    bad = not_ok(rmm)
    if bad:
        return None, bad
    per = section_data(rmm).get("ns_per_pair") or {}
    ratios = {s: e["ratio"] for s, e in per.items() if isinstance(e, dict)
              and is_number(e.get("ratio"))}
    if ratios:
        worst = max(ratios, key=lambda k: ratios[k])
        return ratios[worst], f"worst at {worst}"
    w = section_data(rmm).get("worst_ratio")
    return (float(w), "worst_ratio") if is_number(w) else (None, "no ratio in the result")


def later_checks(results: dict) -> list[dict]:
    """The checks of trace, capacity, wait, share and rmm ("missing" where not run)."""
    checks = trace_checks(results.get("trace"))
    value, note = capacity_value(results.get("capacity"))
    checks.append(make_check("capacity.bridge_over_native", "capacity: bridge / best native batch",
                         value, *CAPACITY_TARGET, note, group="capacity"))
    value, note = wait_value(results.get("wait"))
    checks.append(make_check("wait.tight_over_unlimited", "wait: tight / unlimited steps/s",
                         value, *WAIT_TARGET, note, group="wait"))
    checks += share_checks(results.get("share"), results.get("alloc", {}).get("sizes"))
    value, note = rmm_value(results.get("rmm"))
    checks.append(make_check("rmm.worst_ratio", "RMM: bridge resource / CudaAsyncMemoryResource",
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
