# SPDX-License-Identifier: Apache-2.0
"""The command line: ``bridge doctor``, ``stats`` and ``demo`` (or ``python -m bridge ...``).

``doctor`` reports the driver, the GPUs, the installed frameworks and the
settings that conflict with the bridge. ``stats`` prints every device's pool
figures. Pools belong to a process: run from a shell, ``stats`` shows this
new process's pools (device memory and budget, nothing allocated yet); call
``bridge.cli.main(["stats"])`` or :func:`bridge.stats` inside a program to see
that program's figures. Below them it lists every share of this user
(``unify(share=...)``): each member process with its device, claim and bytes
per framework, read from the share files. ``demo`` runs the mixed case with the
native allocators and on the bridge (:mod:`bridge.tools.demo`).

Exit status: 0 when all is well; 1 when ``doctor`` reported an error (an
``[error]`` line: no driver, no GPU, a bad variable, an unusable framework),
when ``stats`` or ``demo`` found no usable GPU, when ``demo``'s bridge run did
not finish, or when the reader of the output went away
(``bridge stats --watch | head``); 2 for a usage error.
"""

from __future__ import annotations

__all__ = ["main", "format_table", "format_shares", "snapshot"]

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from bridge import _runtime
from bridge import share as _share
from bridge._errors import BridgeError, format_bytes
from bridge._version import DISTRIBUTION, __version__
from bridge.pool import FRAMEWORKS, Stats, stats
from bridge.tools import demo
from bridge.tools import doctor as _doctor

EXIT_OK = 0
EXIT_ERROR = 1  # doctor reported an error; stats found no GPU; the reader went away
EXIT_USAGE = 2  # argparse's own
EXIT_STATUS_HELP = (
    "exit status: 0 all is well; 1 doctor reported an [error] (no driver, no GPU, a bad "
    "variable, an unusable framework), stats or demo found no usable GPU, demo's bridge run "
    "did not finish, build-torch or build-rmm could not build, or the reader of the output went "
    "away; 2 a usage error"
)

COLUMNS = ("device",) + FRAMEWORKS + ("used", "reserved", "budget", "peak", "total", "ooms")


def _row(s: Stats) -> list[str]:
    return (
        [str(s.device)]
        + [format_bytes(s.by_framework.get(f, 0)) for f in FRAMEWORKS]
        + [
            format_bytes(s.used),
            format_bytes(s.reserved),
            format_bytes(s.limit) if s.limit else "none",
            format_bytes(s.peak_used),
            format_bytes(s.total),
            str(s.num_ooms),
        ]
    )


def format_table(snapshots: Sequence[Stats]) -> str:
    """Stats of several devices as an aligned text table, one row per device.

    Parameters
    ----------
    snapshots : sequence of Stats

    Returns
    -------
    str
        A header line and one line per device: bytes per framework
        (``cupy``, ``torch``, ``jax``, ``other``), then ``used``, ``reserved``,
        ``budget`` (``none`` without a limit), ``peak`` (of ``used``),
        ``total`` and refused allocations (``ooms``).
    """
    rows = [list(COLUMNS)] + [_row(s) for s in snapshots]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)
    return "\n".join(line.rstrip() for line in lines)


SHARE_COLUMNS = ("pid", "device", "claim", "cupy", "torch", "other", "cached", "state")


def _member_state(m: _share.Member) -> str:
    if not m.alive:
        return "gone"
    return "unresponsive" if m.unresponsive else "ok"


def format_shares(shares: Sequence[_share.Share]) -> str:
    """Shares as text: a line per share, then a table of its member processes.

    Parameters
    ----------
    shares : sequence of bridge.share.Share

    Returns
    -------
    str
        Per share: its name, GPU, budget and what its members claim together;
        then one row per member: ``pid``, ``device`` (the GPU's ordinal in that
        process), ``claim``, bytes per framework (``cupy``, ``torch``,
        ``other``), ``cached`` and ``state`` (``ok``, ``unresponsive``: a trim
        request unanswered for a second, ``gone``: the process has ended and
        its claim is taken back at the next look), and ``worker`` where a member
        said what it is (a Dask worker's name and address, a Ray actor: see
        ``bridge.dask`` and ``bridge.ray``).
    """
    out = []
    for sh in shares:
        if sh.error is not None:
            out.append(f"share file {sh.path}: {sh.error}")
            continue
        # a member that ended is no member: listed only while its claim is not yet taken back
        alive = [m for m in sh.members if m.alive]
        ended = [m for m in sh.members if not m.alive and m.claim]
        claimed = sum(m.claim for m in alive)
        line = (
            f"share {sh.name!r} on {sh.uuid}: budget {format_bytes(sh.budget)}, claimed "
            f"{format_bytes(claimed)} by {len(alive)} process{'' if len(alive) == 1 else 'es'}"
        )
        if ended:
            left = sum(m.claim for m in ended)
            line += (
                f"; {format_bytes(left)} still claimed by {len(ended)} ended process"
                f"{'' if len(ended) == 1 else 'es'} (taken back at the next allocation)"
            )
        out.append(line)
        # the worker column (a Dask worker, a Ray actor: bridge.share.set_worker_label) only
        # where a member said what it is
        named = any(m.worker for m in alive + ended)
        rows = [list(SHARE_COLUMNS) + (["worker"] if named else [])] + [
            [str(m.pid), str(m.device), format_bytes(m.claim)]
            + [format_bytes(m.by_framework.get(f, 0)) for f in ("cupy", "torch", "other")]
            + [format_bytes(m.cached), _member_state(m)]
            + ([m.worker] if named else [])
            for m in alive + ended
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        out += [  # figures to the right, the worker's words to the left
            "  "
            + "  ".join(
                c.ljust(w) if i == len(SHARE_COLUMNS) else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip()
            for r in rows
        ]
    return "\n".join(out)


def snapshot(devices: Sequence[int] | None = None) -> list[Stats]:
    """Stats of the given devices, every visible device when None.

    Raises
    ------
    BridgeError
        When there is no CUDA driver or no GPU.
    ValueError
        For a device that does not exist, or a bad ``BRIDGE_GPU_MEMORY_LIMIT``.
    """
    return [stats(d) for d in _runtime.resolve_devices(devices)]


def _doctor_cmd(args: argparse.Namespace, out: TextIO) -> int:
    report = _doctor.collect()
    if args.json:
        out.write(json.dumps(report.as_dict(), indent=2) + "\n")
    else:
        out.write(_doctor.render(report) + "\n")
    out.flush()
    return EXIT_ERROR if report.errors else EXIT_OK


def _built_line(package: str, builder: str) -> str | None:
    """What an adapter's build module says will run (``describe``); None without the package."""
    try:
        if importlib.util.find_spec(package) is None:
            return None
    except (ImportError, ValueError):  # a package in sys.modules without a spec
        return None
    _, text = importlib.import_module(builder).describe()
    return str(text)


def _torch_allocator_line() -> str | None:
    """Which torch allocator a ``unify(torch=True)`` here installs, and why; None without torch."""
    return _built_line("torch", "bridge.adapters.torch_build")


def _rmm_resource_line() -> str | None:
    """Which RMM resource a ``unify(rmm=True)`` here installs, and why; None without RMM."""
    return _built_line("rmm", "bridge.adapters.rmm_build")


def _print_stats(snaps: list[Stats], args: argparse.Namespace, out: TextIO, tty: bool) -> None:
    shares = _share.list_shares()
    built = {"torch": _torch_allocator_line(), "rmm": _rmm_resource_line()}
    keys = {"torch": "torch_allocator", "rmm": "rmm_resource"}
    if args.json:
        doc: dict = {"time": time.time(), "devices": [s.as_dict() for s in snaps]}
        if shares:
            doc["shares"] = [sh.as_dict() for sh in shares]
        doc.update({keys[name]: line for name, line in built.items() if line})
        out.write(json.dumps(doc, separators=(",", ":")) + "\n")
    else:
        if tty:
            out.write("\x1b[H\x1b[2J")  # clear the terminal between refreshes
        out.write(time.strftime("%Y-%m-%d %H:%M:%S") + "  bridge pool figures (this process)\n")
        out.write(format_table(snaps) + "\n")
        if shares:
            out.write("\n" + format_shares(shares) + "\n")
        for name, line in built.items():
            if line:
                out.write(f"{name}: {line}\n")
        if args.watching:
            out.write("\n")
    out.flush()


def _stats_cmd(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    devices = None if args.device is None else [args.device]
    count = args.count if args.count is not None else (None if args.watch is not None else 1)
    args.watching = count != 1
    interval = args.watch if args.watch is not None else 1.0
    tty = bool(getattr(out, "isatty", lambda: False)()) and args.watching and not args.json
    shown = 0
    try:
        while count is None or shown < count:
            if shown:
                time.sleep(interval)
            try:
                snaps = snapshot(devices)
            except (BridgeError, ValueError) as exc:
                err.write(f"bridge stats: {exc}\n")
                return EXIT_ERROR
            _print_stats(snaps, args, out, tty)
            shown += 1
    except KeyboardInterrupt:
        out.write("\n")
    return EXIT_OK


_positive = demo.number_arg(float, "a number of seconds", lambda v: v > 0,
                            "the interval must be > 0 seconds")  # fmt: skip
_count = demo.number_arg(int, "a whole number", lambda v: v >= 1, "the count must be >= 1")


def _prog() -> str:
    """How the user ran the command line: the ``bridge`` script, or ``python -m bridge``."""
    return "bridge" if os.path.basename(sys.argv[0] or "") == "bridge" else "python -m bridge"


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="One GPU memory pool and one budget for CuPy, PyTorch and JAX.",
        epilog=EXIT_STATUS_HELP,
    )
    p.add_argument("--version", action="version", version=f"bridge {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    d = sub.add_parser(
        "doctor",
        help="check the driver, GPUs, frameworks and environment",
        description="Check what this machine offers the bridge. Imports no framework. "
        "Exits 0 when no [error] was reported (warnings allowed), 1 when one was "
        "(no driver or GPU included).",
    )
    d.add_argument("--json", action="store_true", help="print the report as JSON")
    s = sub.add_parser(
        "stats",
        help="print every device's pool figures",
        description="Print every device's pool figures: bytes per framework, "
        "used, reserved, budget, peak; then every share of this user (unify(share=...)) "
        "with its member processes: pid, device, claim, bytes per framework. Exits 1 "
        "without a usable GPU, and when the reader of the output goes away "
        "(stats --watch | head).",
    )
    s.add_argument(
        "--watch",
        nargs="?",
        type=_positive,
        const=1.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 1) until Ctrl-C",
    )
    s.add_argument(
        "--count",
        type=_count,
        default=None,
        metavar="N",
        help="print N times, then stop (with --watch, or alone: every second)",
    )
    s.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per refresh: {time, devices: [stats...], shares: [...]}",
    )
    s.add_argument("--device", type=int, default=None, help="only this device")
    b = sub.add_parser(
        "build-torch",
        help="build the bridge's torch allocator for the installed torch",
        description="Compile the bridge's torch allocator (C++ over torch's allocator "
        "interface) for the installed torch into the cache, so the first "
        "bridge.unify(torch=True) does not; say where it is, or what the build lacks. "
        "Exits 1 when it cannot be built (the pluggable fallback would run).",
    )
    b.add_argument("--verbose", action="store_true", help="show the compiler's output")
    r = sub.add_parser(
        "build-rmm",
        help="build the bridge's C++ RMM resource for the installed RMM",
        description="Compile the bridge's C++ RMM resource (an rmm.mr.DeviceMemoryResource "
        "over the core, with Cython and a C++ compiler) for the installed RMM into the "
        "cache, so the first bridge.unify(rmm=True) does not; say where it is, or what the "
        "build lacks. Exits 1 when it cannot be built (the callback fallback would run).",
    )
    r.add_argument("--verbose", action="store_true", help="show Cython's and the compiler's output")
    demo.add_parser(sub)
    return p


# command -> (build module, what it builds, the fallback's words, the framework's version)
_BUILDS: dict[str, tuple[str, str, str, Callable[[Any], str]]] = {
    "build-torch": (
        "bridge.adapters.torch_build",
        "the bridge's torch allocator",
        "bridge.unify(torch=True) would use torch's CUDAPluggableAllocator.",
        lambda m: f"torch {m._torch().__version__}",
    ),
    "build-rmm": (
        "bridge.adapters.rmm_build",
        "the bridge's C++ RMM resource",
        "bridge.unify(rmm=True) would use RMM's CallbackMemoryResource.",
        lambda m: f"RMM {m.version()}",
    ),
}


# command -> the framework's import name and how to install it, where the build module
# needs the framework imported to say more (rmm_build reads RMM's files: it says itself)
_INSTALL = {
    "build-torch": (
        "torch",
        f"pip install torch (PyPI's CUDA build), or pip install '{DISTRIBUTION}[torch]'",
    ),
}


def _build_cmd(args: argparse.Namespace, out: TextIO) -> int:
    name, what, fallback, version = _BUILDS[args.command]
    framework = args.command.split("-", 1)[1]
    package, how = _INSTALL.get(args.command, ("", ""))
    try:
        found = not package or importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a package in sys.modules without a spec
        found = package in sys.modules
    if not found:
        print(
            f"{framework} is not installed in this Python ({sys.executable}), so there is "
            f"nothing to build {what} against: {how}, then run {args.command} again.",
            file=out,
        )
        return EXIT_ERROR
    try:
        builder: Any = importlib.import_module(name)
    except ImportError as exc:
        print(f"{framework} is not importable ({exc}): install {framework} first.", file=out)
        return EXIT_ERROR
    module = builder.load(verbose=args.verbose)
    if module is None:
        print(f"{what} is not available: {builder.reason}.", file=out)
        if not getattr(builder, "without_cuda", False):  # a CPU-only torch has no fallback
            print(fallback, file=out)
        return EXIT_ERROR
    how = (
        "found in the cache"
        if builder.built_from_cache
        else (f"built in {builder.build_seconds:.1f} s")
    )
    print(f"{what} for {version(builder)}: {how}, in {builder.location}", file=out)
    return 0


def main(
    argv: Sequence[str] | None = None,
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    prog: str | None = None,
) -> int:
    """Run the command line.

    Parameters
    ----------
    argv : sequence of str, optional
        The arguments after ``bridge``; ``sys.argv[1:]`` when None.
    stdout, stderr : file, optional
        Where to write; ``sys.stdout`` and ``sys.stderr`` when None.
    prog : str, optional
        The program's name in usage lines: ``bridge`` when run as the
        ``bridge`` script, else ``python -m bridge``.

    Returns
    -------
    int
        The exit status: 0 when all is well; 1 when ``doctor`` reported an
        error, ``stats`` found no usable GPU, or the reader of the output
        went away (a closed pipe); 2 for a usage error.
    """
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    parser = _parser(prog or _prog())
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse's own exit (usage error, --help, --version)
        return int(exc.code or 0)
    try:
        if args.command == "doctor":
            return _doctor_cmd(args, out)
        if args.command == "stats":
            return _stats_cmd(args, out, err)
        if args.command == "demo":
            return demo.run(args, out, err)
        if args.command in _BUILDS:
            return _build_cmd(args, out)
        parser.print_help(out)
        return EXIT_USAGE
    except BrokenPipeError:
        # The reader went away (`bridge stats --watch | head -5`). As CPython's
        # documentation recommends (signal module, "Note on SIGPIPE"): point
        # stdout at devnull so the interpreter's flush at exit stays quiet, and
        # exit 1.
        if out is sys.stdout:
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
            except (OSError, ValueError):  # not a file descriptor (a test's stream)
                pass
        return EXIT_ERROR
