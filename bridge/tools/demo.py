# SPDX-License-Identifier: Apache-2.0
"""``bridge demo``: the native allocators and the bridge, side by side, on this GPU.

The mixed case the bridge exists for: CuPy holds N GiB and frees it, then
torch asks for N GiB. It runs twice, each time in a fresh child process on
device 0 (``CUDA_VISIBLE_DEVICES`` picks another): once with each
framework's own allocator, once with both on the bridge. N defaults to 60%
of the GPU, so that the native run needs more than the GPU has (CuPy's pool
keeps what CuPy freed, and torch cannot use it) while the bridge run needs
N GiB once. Each child samples the GPU's used memory as the driver reports it
(``cudaMemGetInfo``: every process and context on the GPU included), and what
each framework holds. The parent prints both outcomes side by side and draws
both timelines in a PNG (matplotlib), or says that matplotlib is missing; the
samples are written as CSV beside the PNG either way.

Exit status: 0 when the bridge run got torch its memory; 1 when there is no
usable GPU, CuPy or PyTorch is missing, ``--size`` does not fit the GPU, or a
run failed or the bridge run ran out of memory; 2 for a usage error.
"""

from __future__ import annotations

__all__ = ["add_parser", "run", "RunResult", "format_report", "write_csv", "plot"]

import argparse
import csv
import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from bridge._errors import BridgeError
from bridge._install import install_hint
from bridge._version import DISTRIBUTION
from bridge.budget import GPU_LIMIT_ENV, parse_size

GIB = 1 << 30
DEFAULT_SHARE = 0.6  # of the GPU: native needs 2 x 60% (fails), the bridge 60% (fits)
MAX_SHARE = 0.9  # above this even the bridge run cannot fit beside the contexts
MODES = ("native", "bridge")
CHILD_TIMEOUT = 240.0  # seconds per run; a run normally takes 5 to 20
PAUSE = 0.4  # seconds each phase is held, so that the timeline shows it
RESULT_PREFIX = "BRIDGE-DEMO-RESULT "
EXIT_OK, EXIT_ERROR = 0, 1
# sample columns, in order: seconds, GPU used (driver), cupy, torch, pool idle
SAMPLE_FIELDS = ("t", "used", "cupy", "torch", "idle")


# ---- the command line ----
def number_arg(
    convert: Callable[[str], Any], what: str, ok: Callable[[Any], bool], rule: str
) -> Callable[[str], Any]:
    """An argparse ``type``: ``convert(text)``, refused as not ``what`` when it cannot be
    read and with ``rule`` when ``ok(value)`` is false (also for the ``stats`` command)."""

    def parse(text: str) -> Any:
        try:
            v = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"{text!r}: {rule}")
        return v

    return parse


def _gib(text: str) -> float:
    """``--size``: a size as everywhere in the library (``40GiB``, ``512MiB``, bytes with a
    unit), in GiB; a bare number is a number of GiB (``40``, ``0.5``)."""
    try:
        v = float(text)
    except ValueError:
        try:
            n = parse_size(text, name="--size", of=None)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a size: write a number of GiB (40, 0.5) or a size with a "
                "unit (40GiB, 512MiB, 40GB)"
            ) from None
        v = (n or 0) / GIB
    if not 0 < v < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be more than 0")
    return v


_interval = number_arg(float, "a number of seconds", lambda v: 0 < v <= 1,
                       "the interval must be in (0, 1] seconds")  # fmt: skip


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``demo`` command to the command line's subparsers."""
    p: argparse.ArgumentParser = sub.add_parser(
        "demo",
        help="native allocators vs the bridge on this GPU, side by side and plotted",
        description="CuPy holds N GiB and frees it, then torch asks for N GiB: once with "
        "each framework's own allocator, once on the bridge, each in a child process on "
        "device 0. Prints both outcomes side by side and writes a PNG of both memory "
        "timelines (a CSV of the samples beside it). Needs a GPU, CuPy and PyTorch; "
        "matplotlib for the PNG. Exits 0 when the bridge run got torch its memory, 1 "
        "otherwise (no GPU included), 2 for a usage error.",
    )
    p.add_argument(
        "--size",
        type=_gib,
        default=None,
        metavar="SIZE",
        help="N: a size with a unit (40GiB, 512MiB) or a number of GiB (default "
        f"{DEFAULT_SHARE:.0%}% of the GPU, so that the native run "
        f"runs out; at most {MAX_SHARE:.0%}% of the GPU)",
    )
    p.add_argument(
        "--out",
        default="bridge-demo.png",
        metavar="PNG",
        help="where to write the timelines (default bridge-demo.png; the CSV goes beside it)",
    )
    p.add_argument(
        "--interval",
        type=_interval,
        default=0.02,
        metavar="SECONDS",
        help="seconds between memory samples (default 0.02)",
    )
    return p


# ---- what a run reports ----
@dataclasses.dataclass
class RunResult:
    """What one child process reported (or why it reported nothing).

    Attributes
    ----------
    mode : str
        ``"native"`` or ``"bridge"``.
    ok : bool
        torch got its N GiB.
    error : str
        torch's error when it did not (first line), or why the run failed.
    failed : bool
        The run itself failed (crashed, timed out, reported nothing): no outcome.
    size, total : int
        N and the GPU's memory, in bytes.
    used_at_ask, used_at_end, peak_used : int
        The GPU's used bytes (driver) when torch asked, right after torch's
        answer, and the highest sample.
    cupy_after_free : int
        Bytes CuPy still held after it freed its array: its pool's bytes
        (native), its live bytes in the shared pool (bridge).
    seconds : float
        From the first sample to the last.
    samples : list of list
        ``[t, used, cupy, torch, idle]`` rows (:data:`SAMPLE_FIELDS`).
    marks : list of list
        ``[t, label]`` rows: the phases.
    """

    mode: str
    ok: bool = False
    error: str = ""
    failed: bool = False
    size: int = 0
    total: int = 0
    used_at_ask: int = 0
    used_at_end: int = 0
    peak_used: int = 0
    cupy_after_free: int = 0
    seconds: float = 0.0
    samples: list = dataclasses.field(default_factory=list)
    marks: list = dataclasses.field(default_factory=list)

    @classmethod
    def from_dict(cls, doc: dict) -> RunResult:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in names})


def _g(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _outcome(r: RunResult) -> str:
    if r.failed:
        return "the run failed"
    return "done" if r.ok else "out of memory"


def format_report(native: RunResult, bridged: RunResult) -> str:
    """Both outcomes side by side, then where native ran out and where the bridge finished.

    Parameters
    ----------
    native, bridged : RunResult

    Returns
    -------
    str
    """
    size = bridged.size or native.size
    rows = [
        ("", "native allocators", "bridge (one pool)"),
        (f"torch asks for {_g(size)}", _outcome(native), _outcome(bridged)),
    ]

    def fig(r: RunResult, n: int) -> str:
        return "-" if r.failed else _g(n)

    rows += [
        ("GPU in use when torch asked", fig(native, native.used_at_ask),
         fig(bridged, bridged.used_at_ask)),
        ("GPU in use after its answer", fig(native, native.used_at_end),
         fig(bridged, bridged.used_at_end)),
        ("GPU in use at the peak", fig(native, native.peak_used), fig(bridged, bridged.peak_used)),
        ("CuPy held after its free", fig(native, native.cupy_after_free),
         fig(bridged, bridged.cupy_after_free)),
        ("seconds", "-" if native.failed else f"{native.seconds:.1f}",
         "-" if bridged.failed else f"{bridged.seconds:.1f}"),
    ]  # fmt: skip
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"{a:<{w0}}  {b:<{w1}}  {c}".rstrip() for a, b, c in rows]
    lines.append("")
    lines.append(_verdict(native, "native"))
    lines.append(_verdict(bridged, "the bridge"))
    return "\n".join(lines)


def _verdict(r: RunResult, who: str) -> str:
    if r.failed:
        return f"{who}: the run failed: {r.error}"
    if r.ok:
        return f"{who} finishes at {_g(r.used_at_end)} in use: torch got its {_g(r.size)}."
    return (
        f"{who} runs out at {_g(r.used_at_end)} in use: torch could not get {_g(r.size)} "
        f"while CuPy held {_g(r.cupy_after_free)} it had freed ({r.error})"
    )


def write_csv(results: Sequence[RunResult], path: str | os.PathLike) -> pathlib.Path:
    """Every run's samples and marks as CSV: ``mode, t, label, used, cupy, torch, idle``.

    Returns
    -------
    pathlib.Path
    """
    path = pathlib.Path(path)
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(("mode", "t", "label", "used", "cupy", "torch", "idle"))
        for r in results:
            for t, used, cupy, torch, idle in r.samples:
                w.writerow((r.mode, repr(t), "", used, cupy, torch, idle))
            for t, label in r.marks:
                w.writerow((r.mode, repr(t), label, "", "", "", ""))
    return path


LAYERS = {  # mode -> (sample column, legend label, colour) stacked under the driver's line
    "native": (
        (2, "CuPy's own pool", "#4c72b0"),
        (3, "torch's own cache", "#dd8452"),
    ),
    "bridge": (
        (2, "cupy (shared pool)", "#4c72b0"),
        (3, "torch (shared pool)", "#dd8452"),
        (4, "shared pool, idle", "#c9c9c9"),
    ),
}


def plot(results: Sequence[RunResult], path: str | os.PathLike, *, dpi: int = 120) -> pathlib.Path:
    """A PNG, one panel per run: the GPU's used memory over time, each framework, the phases.

    Raises
    ------
    ImportError
        When matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "the demo's PNG needs matplotlib, which is not installed: pip install "
            f"'{DISTRIBUTION}[plot]' (or pip install matplotlib)"
        ) from exc
    fig = Figure(figsize=(12, 3.4 * len(results)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(results), 1, squeeze=False)[:, 0]
    top = max([r.total for r in results] + [1]) / GIB * 1.05
    for ax, r in zip(axes, results, strict=True):
        title = f"{'native allocators' if r.mode == 'native' else 'bridge'}: {_outcome(r)}"
        if r.samples:
            t = [s[0] for s in r.samples]
            layers = LAYERS.get(r.mode, ())
            ax.stackplot(
                t,
                *[[s[col] / GIB for s in r.samples] for col, _, _ in layers],
                labels=[name for _, name, _ in layers],
                colors=[c for _, _, c in layers],
                alpha=0.8,
                step="post",
            )
            ax.step(t, [s[1] / GIB for s in r.samples], where="post", color="black",
                    linewidth=1.6, label="GPU in use (driver)")  # fmt: skip
        if r.total:
            ax.axhline(r.total / GIB, color="#c44e52", linestyle="--", linewidth=1.2,
                       label="GPU memory")  # fmt: skip
        for i, (mt, label) in enumerate(r.marks):  # staggered: torch's two marks are close
            ax.axvline(mt, color="black", linewidth=0.7, linestyle=":")
            y = 0.97 if i % 2 == 0 else 0.6
            ax.annotate(label, (mt, y), xycoords=("data", "axes fraction"), rotation=90,
                        va="top", ha="right", fontsize=8)  # fmt: skip
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_ylabel("GiB")
        ax.set_ylim(0, top)
        ax.grid(alpha=0.3)
        if r.failed:
            ax.text(0.5, 0.5, r.error[:120], transform=ax.transAxes, ha="center", fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    axes[-1].set_xlabel("seconds since the run's first sample")
    size = max(r.size for r in results)
    fig.suptitle(f"CuPy holds {_g(size)} and frees it, then torch asks for {_g(size)}")
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=dpi, format="png")
    return path


# ---- the parent ----
def _device_total(device: int = 0) -> int:
    """The GPU's memory from the driver, without starting a context (none of the
    children's memory goes to this process)."""
    from bridge._runtime import core

    rc, _name, _major, _minor, total = core.device_info(device)
    if rc != 0 or not total:
        raise BridgeError(f"the CUDA driver did not report device {device}'s memory")
    return int(total)


def _check_gpu() -> int:
    """The GPU's memory in bytes; BridgeError saying why there is no usable GPU."""
    from bridge import _runtime

    n = _runtime.device_count()  # BridgeError without a driver
    if n == 0:
        raise BridgeError("the CUDA driver reports no GPU (check CUDA_VISIBLE_DEVICES)")
    return _device_total(0)


def _missing_frameworks() -> list[str]:
    return [name for name in ("cupy", "torch") if importlib.util.find_spec(name) is None]


Child = Callable[[str, int, float], RunResult]


def _run_child(mode: str, size: int, interval: float) -> RunResult:
    """Run one mode in a fresh Python process; its report, or why there is none."""
    cmd = [sys.executable, "-m", "bridge.tools.demo", "--child", mode, str(size), repr(interval)]
    env = {k: v for k, v in os.environ.items() if k != GPU_LIMIT_ENV}  # no budget: see run()
    env.setdefault("PYTHONUNBUFFERED", "1")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT, env=env)
    except subprocess.TimeoutExpired:
        return RunResult(mode, failed=True, size=size,
                         error=f"no answer within {CHILD_TIMEOUT:.0f} s")  # fmt: skip
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if r.returncode != 0 or not lines:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        return RunResult(mode, failed=True, size=size,
                         error=f"exit status {r.returncode}: " + " | ".join(tail))  # fmt: skip
    return RunResult.from_dict(json.loads(lines[-1][len(RESULT_PREFIX) :]))


def run(args: argparse.Namespace, out: TextIO, err: TextIO, *, child: Child | None = None) -> int:
    """Run the demo (the ``demo`` command); the exit status.

    Parameters
    ----------
    args : argparse.Namespace
        ``size`` (GiB or None), ``out`` (the PNG's path), ``interval``.
    out, err : file
    child : callable, optional
        ``child(mode, size_bytes, interval) -> RunResult``; a fresh process per
        mode when None.

    Returns
    -------
    int
        0 when the bridge run got torch its memory, else 1.
    """
    try:
        total = _check_gpu()
    except BridgeError as exc:
        err.write(f"bridge demo: no usable GPU here, so there is nothing to show: {exc}\n")
        return EXIT_ERROR
    size = int(args.size * GIB) if args.size is not None else int(total * DEFAULT_SHARE)
    if size > total * MAX_SHARE:
        err.write(
            f"bridge demo: --size {args.size:g} is {_g(size)}, more than {MAX_SHARE:.0%} of this "
            f"GPU's {_g(total)}: even the bridge run could not fit it. Pass --size "
            f"{math.floor(total * MAX_SHARE / GIB * 10) / 10:g} or less (or leave --size out).\n"
        )
        return EXIT_ERROR
    missing = _missing_frameworks()
    if child is None and missing:
        err.write(
            f"bridge demo: needs CuPy and PyTorch; {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not installed ({install_hint(missing)}).\n"
        )
        return EXIT_ERROR
    png = pathlib.Path(args.out)
    if png.parent and not png.parent.exists():
        err.write(f"bridge demo: --out {args.out}: the folder {png.parent} does not exist\n")
        return EXIT_ERROR
    run_one = child or _run_child
    out.write(
        f"bridge demo: CuPy holds {_g(size)} and frees it, then torch asks for {_g(size)}, "
        f"on device 0 ({_g(total)}); first with the native allocators, then on the bridge, "
        "each in a fresh process.\n"
    )
    if os.environ.get(GPU_LIMIT_ENV):
        out.write(f"  ({GPU_LIMIT_ENV} is left out of both runs: the demo shows sharing, "
                  "without a budget)\n")  # fmt: skip
    out.flush()
    results = []
    for mode in MODES:
        out.write(f"  running with {'the native allocators' if mode == 'native' else 'the bridge'}"
                  "...\n")  # fmt: skip
        out.flush()
        results.append(run_one(mode, size, args.interval))
    native, bridged = results
    out.write("\n" + format_report(native, bridged) + "\n\n")
    table = write_csv(results, png.with_suffix(".csv"))
    try:
        plot(results, png)
        out.write(f"timelines: {png} (samples: {table})\n")
    except ImportError as exc:
        out.write(f"no PNG: {exc}. The samples are in {table}.\n")
    out.flush()
    return EXIT_OK if bridged.ok and not bridged.failed else EXIT_ERROR


# ---- the child ----
class _Sampler:
    """Reads the GPU's used memory and each framework's bytes every interval, in a thread."""

    def __init__(self, read: Callable[[], tuple[int, int, int, int]], interval: float) -> None:
        self.read = read
        self.interval = interval
        self.samples: list[list] = []
        self.marks: list[list] = []
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="bridge-demo", daemon=True)

    def sample(self) -> tuple[int, int, int, int]:
        figures = self.read()
        with self._lock:
            self.samples.append([time.monotonic() - self.t0, *figures])
        return figures

    def mark(self, label: str) -> int:
        """A labelled sample now; the GPU's used bytes."""
        used = self.sample()[0]
        with self._lock:
            self.marks.append([self.samples[-1][0], label])
        return used

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> _Sampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def _child(mode: str, size: int, interval: float) -> dict:
    """The mixed case in this process, with the native allocators or on the bridge."""
    if mode == "bridge":
        import bridge

        bridge.unify(cupy=True, torch=True)
    import cupy
    import torch

    cupy.cuda.Device(0).use()
    cupy.zeros(1)  # both frameworks' contexts and libraries start before the first sample
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    free, total = cupy.cuda.runtime.memGetInfo()

    def read() -> tuple[int, int, int, int]:
        free, total = cupy.cuda.runtime.memGetInfo()
        if mode == "bridge":
            s = bridge.stats(0)
            by = s.by_framework
            return total - free, by["cupy"], by["torch"], max(0, s.reserved - s.used)
        pool = cupy.get_default_memory_pool().total_bytes()
        return total - free, pool, torch.cuda.memory_reserved(0), 0

    result: dict[str, Any] = {"mode": mode, "size": size, "total": int(total)}
    with _Sampler(read, interval) as rec:
        rec.mark("start")
        a = cupy.ones(size, dtype=cupy.uint8)
        cupy.cuda.Device(0).synchronize()
        rec.mark(f"CuPy holds {_g(size)}")
        time.sleep(PAUSE)
        del a
        cupy.cuda.Device(0).synchronize()
        rec.mark("CuPy frees it")
        result["cupy_after_free"] = read()[1]
        time.sleep(PAUSE)
        result["used_at_ask"] = rec.mark(f"torch asks for {_g(size)}")
        t = None
        try:
            t = torch.ones(size, dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
            result["ok"] = int(t[-1].item()) == 1
            result["used_at_end"] = rec.mark("torch has it")
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError, or the bridge's RuntimeError
            if "out of memory" not in str(exc):
                raise
            result["ok"] = False
            result["error"] = str(exc).splitlines()[0][:160]
            result["used_at_end"] = rec.mark("torch: out of memory")
        time.sleep(PAUSE)
        del t
    result["samples"] = rec.samples
    result["marks"] = rec.marks
    result["peak_used"] = max(s[1] for s in rec.samples)
    result["seconds"] = rec.samples[-1][0] - rec.samples[0][0]
    return result


def _child_main(argv: Sequence[str]) -> int:
    mode, size, interval = argv[0], int(argv[1]), float(argv[2])
    if mode not in MODES:
        raise SystemExit(f"bridge.tools.demo --child: mode {mode!r} is not one of {MODES}")
    doc = _child(mode, size, interval)
    print(RESULT_PREFIX + json.dumps(doc), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        sys.exit(_child_main(sys.argv[2:]))
    sys.exit(
        "bridge.tools.demo is run by `python -m bridge demo`; see `python -m bridge demo --help`"
    )
