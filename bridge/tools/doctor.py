# SPDX-License-Identifier: Apache-2.0
"""``bridge doctor``: what this machine offers the bridge, and what is in its way.

Nothing here imports CuPy, PyTorch or JAX: installed versions come from
``importlib.metadata`` and capabilities from the packages' source files
(``bridge.tools.doctor_frameworks``), so that the doctor never starts a
framework's CUDA runtime (which would itself be one of the problems it looks
for).  The driver's figures come from the
compiled core; only GPU names and compute capabilities, which the core does
not offer, are read from the driver library the core already loaded.

A report's :attr:`Report.errors` decide the exit status of ``bridge doctor``:
0 without errors (warnings allowed), 1 with at least one.
"""

from __future__ import annotations

__all__ = [
    "Finding",
    "FrameworkCheck",
    "Report",
    "collect",
    "render",
    "CONFLICTING_ENV",
    "BRIDGE_ENV",
    "cuda_majors",
]

import dataclasses
import difflib
import importlib
import os
import pathlib
import platform
import sys

from bridge import _env, _runtime
from bridge._errors import BridgeError, format_bytes
from bridge._runtime import DRIVER_LIBRARY_ENV, core
from bridge._version import __version__
from bridge.pinned._backend import host_memory_total
from bridge.tools.doctor_frameworks import (
    Finding,
    FrameworkCheck,
    cuda_majors,
    distributions,
    frameworks,
    stack,
)

LEVELS = ("ok", "info", "warn", "error")

# Every variable the library reads (a BRIDGE_* variable not here is a typo or a test's)
BRIDGE_ENV = _env.NAMES

# Variables whose mere presence deserves a sentence: name -> (level, advice).
CONFLICTING_ENV: dict[str, tuple[str, str]] = {
    "PYTORCH_CUDA_ALLOC_CONF": (
        "warn",
        "under bridge.unify(torch=True) torch allocates through the bridge, so torch's "
        "caching-allocator options (backend, expandable_segments, max_split_size_mb, ...) "
        "have no effect; without unify() torch's own allocator uses them outside the "
        "budget. Unset it.",
    ),
    "XLA_PYTHON_CLIENT_MEM_FRACTION": (
        "warn",
        "XLA's cuda_async allocator, which the bridge gives JAX, enforces no byte limit: "
        "this fraction limits nothing. Set the shared budget instead "
        "(bridge.unify(budget=...) or BRIDGE_GPU_MEMORY_LIMIT).",
    ),
    "CUPY_GPU_MEMORY_LIMIT": (
        "warn",
        "this limits CuPy's own memory pool, which bridge.unify(cupy=True) replaces: it has "
        "no effect on the shared pool. Use BRIDGE_GPU_MEMORY_LIMIT (same syntax) instead.",
    ),
}


@dataclasses.dataclass
class Report:
    """Everything ``python -m bridge doctor`` found (``as_dict`` for ``--json``)."""

    python: dict
    bridge: dict
    driver: dict
    devices: list[dict]
    frameworks: list[FrameworkCheck]
    environment: list[Finding]
    stack: list[Finding] = dataclasses.field(default_factory=list)  # frameworks together

    @property
    def problems(self) -> list[Finding]:
        """Findings at level warn or error, from every section."""
        found = []
        if not self.driver["loaded"]:
            found.append(Finding("error", "driver", self.driver["error"]))
        elif not self.devices:
            found.append(Finding("error", "GPUs", NO_GPU))
        for dev in self.devices:
            if not dev["pools"]:
                found.append(Finding("error", f"device {dev['index']}", dev["error"] or ""))
        for fw in self.frameworks:
            found += [f for f in fw.findings if f.level in ("warn", "error")]
        found += [f for f in self.stack if f.level in ("warn", "error")]
        found += [f for f in self.environment if f.level in ("warn", "error")]
        return found

    @property
    def errors(self) -> list[Finding]:
        """Findings at level error: ``bridge doctor`` exits 1 when there is one."""
        return [f for f in self.problems if f.level == "error"]

    @property
    def exit_status(self) -> int:
        """0 without errors (warnings allowed), 1 with at least one."""
        return 1 if self.errors else 0

    def as_dict(self) -> dict:
        """The report as plain data."""
        d = dataclasses.asdict(self)
        d["problems"] = [dataclasses.asdict(f) for f in self.problems]
        d["exit_status"] = self.exit_status
        return d


NO_GPU = (
    "the driver loaded but sees no GPU: the bridge cannot run in this process. "
    "Check CUDA_VISIBLE_DEVICES and `nvidia-smi`."
)


# ---- the driver and the GPUs ----
def _version_text(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _driver() -> dict:
    info = {
        "loaded": False,
        "library": os.environ.get(DRIVER_LIBRARY_ENV) or "libcuda.so.1",
        "error": "",
        "version": None,
        "version_text": "",
        "devices": 0,
    }
    try:
        _runtime.ensure_driver()
    except BridgeError:
        info["error"] = (
            f"no usable CUDA driver ({core.load_error() or 'cuInit failed'}). "
            "The bridge needs an NVIDIA GPU and its driver to manage GPU memory; "
            "check `nvidia-smi` and CUDA_VISIBLE_DEVICES. The framework checks "
            "below still apply."
        )
        return info
    info["loaded"] = True
    info["library"] = core.loaded_library()
    rc, version = core.driver_version()
    if rc == 0:
        info["version"], info["version_text"] = version, _version_text(version)
    rc, n = core.device_count()
    info["devices"] = n if rc == 0 else 0
    if rc != 0:
        code, name = core.last_driver_error()
        info["error"] = f"counting the GPUs failed: {name} (code {code})"
    return info


def _device_name(index: int) -> tuple[str | None, str | None]:
    """(name, compute capability) from the driver; None where it cannot tell."""
    rc, name, major, minor, _total = core.device_info(index)
    if rc != 0:
        return None, None
    return name or None, (f"{major}.{minor}" if major > 0 else None)


def _devices(count: int) -> list[dict]:
    devices = []
    for d in range(count):
        name, cc = _device_name(d)
        dev = {
            "index": d,
            "name": name,
            "compute_capability": cc,
            "pools": False,
            "total": None,
            "error": None,
        }
        try:
            _runtime.ensure_device(d)
        except ValueError:
            pass  # the pool is set up; the bad budget variable is reported with the environment
        except BridgeError as exc:
            dev["error"] = str(exc)
        if core.ready(d):
            dev["pools"] = True
            rc, raw = core.stats(d)
            if rc == 0:
                dev["total"] = int(raw["total"])
        devices.append(dev)
    return devices


# ---- the environment ----
_XLA_ADVICE = {  # what JAX would do with another value; bridge.unify(jax=True) refuses it
    "XLA_PYTHON_CLIENT_PREALLOCATE": (
        "JAX would reserve most of the GPU at start (0.75 of it with cuda_async) before any "
        "other framework can use it, and bridge.unify(jax=True) refuses to start with it. "
        "Unset it (the bridge sets {want})."
    ),
    "XLA_PYTHON_CLIENT_ALLOCATOR": (
        "JAX would allocate from its own arena outside the shared pool and budget, and "
        "bridge.unify(jax=True) refuses to start with it. Unset it (the bridge sets {want}); "
        "bridge.unify(jax=True, jax_memory=...) gives JAX an arena of its own deliberately."
    ),
}


def _jax_shared_env() -> dict[str, str]:
    """What the JAX adapter sets (``bridge.adapters.jax.SHARED_ENV``); it imports no JAX."""
    return dict(importlib.import_module("bridge.adapters.jax").SHARED_ENV)


def _without_prefix(name: str, raw: str, text: str) -> str:
    """An error's words without the ``NAME='raw'`` it starts with (the line names it)."""
    for prefix in (f"{name}={raw!r}", f"{name}={raw}"):
        if text.startswith(prefix):
            return text[len(prefix) :].lstrip(" :").removeprefix("is ")
    return text


def _variable_finding(var: _env.Variable, raw: str, totals: _env.Totals) -> Finding:
    """The verdict on one variable, by the library's own reader: error when it raises."""
    subject = f"{var.name}={raw}"
    try:
        value = var.read(totals)
    except ValueError as exc:
        why = _without_prefix(var.name, raw, str(exc)).rstrip(".")
        text = f"{why}. {var.who}: fix or unset it."
        return Finding("error", subject, text)
    level, text = var.describe(value, totals)
    return Finding(level, subject, text)


NUMBA_MANAGER_ENV = "NUMBA_CUDA_MEMORY_MANAGER"
NUMBA_BRIDGE_MANAGER = "bridge.adapters.numba"


def _environment(devices: list[dict]) -> list[Finding]:
    env = os.environ
    found = []
    for name, (level, advice) in CONFLICTING_ENV.items():
        if name in env:
            found.append(Finding(level, f"{name}={env[name]}", advice))
    manager = env.get(NUMBA_MANAGER_ENV, "").strip()
    if manager and manager not in ("default", NUMBA_BRIDGE_MANAGER):
        found.append(
            Finding(
                "warn",
                f"{NUMBA_MANAGER_ENV}={manager}",
                "Numba allocates through this memory manager, outside the bridge's budget, "
                f"and bridge.unify(numba=True) replaces it. Set it to {NUMBA_BRIDGE_MANAGER} "
                "or unset it.",
            )
        )
    # the rules of the JAX adapter, which refuses other values
    agrees = importlib.import_module("bridge.adapters.jax").agrees
    for name, want in _jax_shared_env().items():
        have = env.get(name)
        if have is not None and not agrees(name, have):
            found.append(Finding("warn", f"{name}={have}", _XLA_ADVICE[name].format(want=want)))
    device_totals = tuple(d["total"] for d in devices if d["total"])
    totals = _env.Totals(
        device=min(device_totals) if device_totals else None,
        host=host_memory_total(),
        devices=device_totals,
    )
    for var in _env.VARIABLES:  # what the library reads, checked by its own readers
        raw = env.get(var.name)
        if raw is not None and raw.strip():  # empty or blank: unset, for every variable
            found.append(_variable_finding(var, raw, totals))
    for name in sorted(env):
        if name.startswith("BRIDGE_") and name not in BRIDGE_ENV:
            close = difflib.get_close_matches(name, BRIDGE_ENV, n=1, cutoff=0.85)
            if close:
                found.append(
                    Finding(
                        "warn",
                        f"{name}={env[name]}",
                        f"bridge reads no such variable; did you mean {close[0]}?",
                    )
                )
    if "CUDA_VISIBLE_DEVICES" in env:
        found.append(
            Finding(
                "info",
                f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}",
                "only these GPUs are visible to this process.",
            )
        )
    return found


def collect() -> Report:
    """Look at the driver, GPUs, frameworks and environment; import no framework.

    Returns
    -------
    Report
    """
    driver = _driver()
    devices = _devices(driver["devices"]) if driver["loaded"] else []
    dists = distributions()
    return Report(
        python={"version": platform.python_version(), "executable": sys.executable},
        # the package, which holds this module in its tools/ folder
        bridge={"version": __version__, "path": str(pathlib.Path(__file__).resolve().parents[1])},
        driver=driver,
        devices=devices,
        frameworks=frameworks(dists, driver),
        environment=_environment(devices),
        stack=stack(dists),
    )


def _tag(level: str) -> str:
    return f"[{level}]".ljust(8)


def render(report: Report) -> str:
    """The report as the text ``bridge doctor`` prints."""
    out = [
        "bridge doctor",
        "",
        f"  Python       {report.python['version']} ({report.python['executable']})",
        f"  bridge       {report.bridge['version']} ({report.bridge['path']})",
        "",
        "Driver",
    ]
    drv = report.driver
    if drv["loaded"]:
        out.append(
            f"  {_tag('ok')}loaded {drv['library']}; CUDA driver "
            f"{drv['version_text'] or 'version unknown'} ({drv['version']})"
        )
        why = f" ({drv['error']})" if drv["error"] else ""
        out.append(
            f"  GPUs: {drv['devices']}"
            if drv["devices"]
            else f"  {_tag('error')}GPUs: 0 - the driver loaded but sees no GPU{why}; check "
            "CUDA_VISIBLE_DEVICES and `nvidia-smi`."
        )
    else:
        out.append(f"  {_tag('error')}{drv['error']}")
    for dev in report.devices:
        label = dev["name"] or "name unavailable"
        if dev["compute_capability"]:
            label += f", compute capability {dev['compute_capability']}"
        total = format_bytes(dev["total"]) if dev["total"] else "memory unknown"
        pools = "memory pools: yes" if dev["pools"] else f"memory pools: NO - {dev['error']}"
        out.append(
            f"  {_tag('ok' if dev['pools'] else 'error')}"
            f"device {dev['index']}: {label}; {total}; {pools}"
        )
    out += ["", "Frameworks (read from package metadata; none was imported)"]
    for fw in report.frameworks:
        if not fw.installed:
            out.append(f"  {fw.name:<12} not installed")
            continue
        out.append(f"  {fw.name:<12} {fw.version}" + (f" ({fw.detail})" if fw.detail else ""))
        for f in fw.findings:
            out.append(f"    {_tag(f.level)}{f.text}")
    for f in report.stack:
        out.append(f"  {_tag(f.level)}{f.subject}: {f.text}")
    out += ["", "Environment"]
    if not report.environment:
        out.append(f"  {_tag('ok')}no variable that concerns the bridge is set.")
    for f in report.environment:
        out.append(f"  {_tag(f.level)}{f.subject}: {f.text}")
    out += ["", _summary(report)]
    return "\n".join(out)


def _summary(report: Report) -> str:
    problems = report.problems
    if not report.driver["loaded"]:
        head, counted = "no GPU stack here; the bridge cannot run on this machine", 1
    elif not report.devices:
        head, counted = "the driver sees no GPU; the bridge cannot run in this process", 1
    else:
        head, counted = "", 0
    rest = len(problems) - counted
    if head:
        more = f"; {rest} more thing(s) to look at above ([warn], [error])" if rest else ""
        text = f"Summary: {head}{more}."
    elif problems:
        text = f"Summary: {len(problems)} thing(s) to look at above ([warn], [error])."
    else:
        text = "Summary: ready; bridge.unify() can run here."
    n = len(report.errors)
    if n:
        text += f" Exit status 1: {n} error(s) reported."
    return text
