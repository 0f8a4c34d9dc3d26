# SPDX-License-Identifier: Apache-2.0
"""``bridge doctor``: what this machine offers the bridge, and what is in its way.

Nothing here imports CuPy, PyTorch or JAX: installed versions come from
``importlib.metadata`` and capabilities from the packages' source files, so
that the doctor never starts a framework's CUDA runtime (which would itself
be one of the problems it looks for).  The driver's figures come from the
compiled core; only GPU names and compute capabilities, which the core does
not offer, are read from the driver library the core already loaded.

A report's :attr:`Report.errors` decide the exit status of ``bridge doctor``:
0 without errors (warnings allowed), 1 with at least one.
"""

from __future__ import annotations

__all__ = [
    "Finding",
    "Framework",
    "Report",
    "collect",
    "render",
    "CONFLICTING_ENV",
    "BRIDGE_ENV",
    "cuda_majors",
]

import ctypes
import dataclasses
import difflib
import functools
import importlib
import importlib.metadata as metadata
import importlib.util
import os
import pathlib
import platform
import re
import sys

from bridge import _runtime
from bridge._errors import BridgeError, format_bytes
from bridge._pinned_backend import BACKEND_ENV, BACKENDS, host_memory_total
from bridge._runtime import CACHE_LIMIT_ENV, DRIVER_LIBRARY_ENV, core
from bridge._version import __version__
from bridge.budget import DEVICE_MEMORY, GPU_LIMIT_ENV, HOST_MEMORY, PINNED_LIMIT_ENV, parse_size

LEVELS = ("ok", "info", "warn", "error")

# Every variable the library reads (a BRIDGE_* variable not here is a typo or a test's)
BRIDGE_ENV = (
    GPU_LIMIT_ENV,
    CACHE_LIMIT_ENV,
    PINNED_LIMIT_ENV,
    BACKEND_ENV,
    DRIVER_LIBRARY_ENV,
)

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
class Finding:
    """One line of the report: a subject, a level in LEVELS, and what to do."""

    level: str
    subject: str
    text: str


@dataclasses.dataclass
class Framework:
    """What the doctor found of one installed framework, without importing it."""

    name: str
    installed: bool = False
    version: str | None = None
    detail: str = ""  # the distributions, jaxlib and plugins
    usable: bool | None = None  # None: not a framework the bridge plugs into
    findings: list[Finding] = dataclasses.field(default_factory=list)

    def add(self, level: str, text: str) -> None:
        """Note a finding about this framework."""
        self.findings.append(Finding(level, self.name, text))


@dataclasses.dataclass
class Report:
    """Everything ``python -m bridge doctor`` found (``as_dict`` for ``--json``)."""

    python: dict
    bridge: dict
    driver: dict
    devices: list[dict]
    frameworks: list[Framework]
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


# The core offers no GPU name and no compute capability: these come from the
# driver library the core loaded, looked up with RTLD_NOLOAD (a handle on the
# library already in the process; nothing is loaded a second time).
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


@functools.cache
def _loaded_driver() -> ctypes.CDLL | None:
    """The driver library the core loaded, or None (never loads one)."""
    path = core.loaded_library()
    if not path:
        return None
    try:
        return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None


def _driver_call(name: str, *args: object) -> int | None:
    """Call an entry point of the core's driver by name; its CUresult, or None."""
    lib = _loaded_driver()
    fn = getattr(lib, name, None) if lib is not None else None
    return None if fn is None else int(fn(*args))


def _device_name(index: int) -> tuple[str | None, str | None]:
    """(name, compute capability) from the loaded driver; None where it cannot tell."""
    dev = ctypes.c_int()
    if _driver_call("cuDeviceGet", ctypes.byref(dev), index) != 0:
        return None, None
    buf = ctypes.create_string_buffer(256)
    name = (
        buf.value.decode(errors="replace")
        if _driver_call("cuDeviceGetName", buf, 256, dev) == 0
        else ""
    )
    major, minor = ctypes.c_int(), ctypes.c_int()
    cc = None
    if (
        _driver_call(
            "cuDeviceGetAttribute",
            ctypes.byref(major),
            CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            dev,
        )
        == 0
        and _driver_call(
            "cuDeviceGetAttribute",
            ctypes.byref(minor),
            CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            dev,
        )
        == 0
        and major.value > 0
    ):
        cc = f"{major.value}.{minor.value}"
    return name or None, cc


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


# ---- installed frameworks, read without importing them ----
def _distributions() -> dict[str, str]:
    """Normalized distribution name -> version, for everything installed."""
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(re.sub(r"[-_.]+", "-", name).lower(), dist.version)
    return found


def _package_file(package: str, relative: str) -> str | None:
    """The text of a file inside an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = pathlib.Path(root) / relative
        if path.is_file():
            try:
                return path.read_text(errors="replace")
            except OSError:
                return None
    return None


def _cuda_major_check(fw: Framework, major: int | None, driver: dict) -> None:
    drv = driver["version"]
    if major is not None and drv and major > drv // 1000:
        fw.add(
            "warn",
            f"built for CUDA {major}, but the driver supports CUDA "
            f"{driver['version_text']}: update the NVIDIA driver or install "
            f"{fw.name}'s CUDA {drv // 1000} build.",
        )


def _torch(dists: dict[str, str], driver: dict) -> Framework:
    fw = Framework("torch", "torch" in dists, dists.get("torch"))
    if not fw.installed:
        return fw
    version_py = _package_file("torch", "version.py") or ""
    cuda = _torch_cuda()
    pluggable = "CUDAPluggableAllocator" in (_package_file("torch", "cuda/memory.py") or "")
    if re.search(r"^hip\s*(?::[^=]*)?=\s*['\"]", version_py, re.M):
        fw.add(
            "error",
            "a ROCm build: the bridge manages CUDA memory only; install a CUDA build of torch.",
        )
    elif not cuda:
        fw.add(
            "warn",
            "a CPU-only build: torch cannot use the GPU; install a CUDA build "
            "(https://pytorch.org/get-started/locally/).",
        )
    elif not pluggable:
        fw.add(
            "error",
            "has no torch.cuda.memory.CUDAPluggableAllocator, which the bridge "
            "plugs into: upgrade torch (2.1 or newer).",
        )
    else:
        fw.usable = True
        fw.add(
            "ok",
            f"CUDA {cuda} build with CUDAPluggableAllocator; call "
            "bridge.unify(torch=True) before the first CUDA tensor.",
        )
        _cuda_major_check(fw, int(cuda.split(".")[0]), driver)
    return fw


def _cupy(dists: dict[str, str], driver: dict) -> Framework:
    names = sorted(n for n in dists if re.fullmatch(r"cupy(-cuda\d+x?|-rocm[-\d]*)?", n))
    fw = Framework("cupy", bool(names), dists[names[0]] if names else None, detail=", ".join(names))
    if not names:
        return fw
    if len(names) > 1:
        fw.add(
            "error",
            f"several CuPy packages are installed ({', '.join(names)}): they "
            "overwrite each other; uninstall all of them and install the one for your "
            "CUDA version.",
        )
    if any(n.startswith("cupy-rocm") for n in names):
        fw.add("error", "a ROCm build: the bridge manages CUDA memory only.")
    elif "set_allocator" not in (_package_file("cupy", "cuda/__init__.py") or ""):
        fw.add(
            "error",
            "cupy.cuda.set_allocator was not found in this CuPy: reinstall or upgrade CuPy.",
        )
    else:
        fw.usable = len(names) == 1
        fw.add(
            "ok",
            "has cupy.cuda.set_allocator; bridge.unify(cupy=True) replaces its "
            "allocator (arrays made before the call stay in CuPy's own pool).",
        )
    m = re.search(r"cuda(\d+)", names[0])
    if m:  # cupy-cuda12x -> 12; the old cupy-cuda117 -> 11
        digits = m.group(1)
        _cuda_major_check(fw, int(digits[:2] if len(digits) > 2 else digits), driver)
    return fw


def _jax(dists: dict[str, str], driver: dict) -> Framework:
    fw = Framework("jax", "jax" in dists, dists.get("jax"))
    if not fw.installed:
        return fw
    jaxlib = dists.get("jaxlib")
    plugins = sorted(n for n in dists if re.fullmatch(r"jax-cuda\d+-(plugin|pjrt)", n))
    fw.detail = ", ".join([f"jaxlib {jaxlib}"] + [f"{n} {dists[n]}" for n in plugins])
    legacy = re.search(r"\+cuda(\d+)", jaxlib or "")  # jaxlib 0.4.7+cuda12.cudnn88
    if not jaxlib:
        fw.add(
            "error", "jax is installed without jaxlib: pip install -U 'jax[cuda13]' (or cuda12)."
        )
    elif not plugins and not legacy:
        fw.add(
            "warn",
            "no CUDA plugin (jax-cuda12-plugin / jax-cuda13-plugin): JAX runs on "
            "the CPU and the bridge has nothing to do for it. pip install -U "
            "'jax[cuda13]' (or cuda12).",
        )
    else:
        fw.usable = True
        digits = legacy.group(1)[:2] if legacy else re.sub(r"\D", "", plugins[0])
        fw.add(
            "ok",
            "has a CUDA backend; call bridge.unify(jax=True) before JAX's first GPU "
            "operation (it sets XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async without "
            "preallocation).",
        )
        _cuda_major_check(fw, int(digits), driver)
    return fw


def _cuda_python(dists: dict[str, str]) -> Framework:
    names = [n for n in ("cuda-python", "cuda-bindings", "cuda-core") if n in dists]
    fw = Framework("cuda-python", bool(names), ", ".join(f"{n} {dists[n]}" for n in names) or None)
    if names:
        fw.add("info", "optional: the bridge loads the driver itself and does not need it.")
    return fw


# ---- the frameworks together ----
def _torch_cuda() -> str | None:
    """torch.version.cuda, read from torch/version.py without importing torch."""
    version_py = _package_file("torch", "version.py") or ""
    m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([\d.]+)['\"]", version_py, re.M)
    return m.group(1) if m else None


_MAJOR_OF = (  # distribution name -> the CUDA major it was built for
    (re.compile(r"cupy-cuda(\d+)x?"), lambda d: int(d[:2] if len(d) > 2 else d)),
    (re.compile(r"jax-cuda(\d+)-(?:plugin|pjrt)"), int),
    (re.compile(r"nvidia-.+-cu(\d+)"), int),
)


def cuda_majors(dists: dict[str, str], torch_cuda: str | None) -> dict[int, list[str]]:
    """CUDA major version -> the installed packages built for it.

    Parameters
    ----------
    dists : dict[str, str]
        Normalized distribution name -> version (``cupy-cuda12x``,
        ``jax-cuda13-plugin``, ``nvidia-cublas-cu12``, ...).
    torch_cuda : str or None
        ``torch.version.cuda`` (``"13.0"``), None for no torch or a CPU build.

    Returns
    -------
    dict[int, list[str]]
        Each major with what targets it; ``nvidia-*`` runtime wheels are
        counted as one entry per major.
    """
    found: dict[int, list[str]] = {}
    nvidia: dict[int, int] = {}
    for name in sorted(dists):
        for pattern, major_of in _MAJOR_OF:
            m = pattern.fullmatch(name)
            if m:
                major = major_of(m.group(1))
                if name.startswith("nvidia-"):
                    nvidia[major] = nvidia.get(major, 0) + 1
                else:
                    found.setdefault(major, []).append(name)
                break
    if torch_cuda:
        found.setdefault(int(torch_cuda.split(".")[0]), []).append(f"torch (CUDA {torch_cuda})")
    for major, n in nvidia.items():
        found.setdefault(major, []).append(f"nvidia-*-cu{major} ({n} package{'s' * (n > 1)})")
    return found


def _stack(dists: dict[str, str]) -> list[Finding]:
    """One warning when the installed frameworks target different CUDA majors."""
    majors = cuda_majors(dists, _torch_cuda() if "torch" in dists else None)
    if len(majors) < 2:
        return []
    listed = "; ".join(f"CUDA {m}: {', '.join(who)}" for m, who in sorted(majors.items()))
    return [
        Finding(
            "warn",
            "CUDA versions",
            f"the packages here target different CUDA major versions ({listed}): one process "
            "would load two CUDA runtimes and their libraries, which wastes GPU memory and "
            "can fail. Install one set: pip install 'bridge[cuda12]' or 'bridge[cuda13]' "
            "(uninstall the other major's packages first).",
        )
    ]


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


def _size_finding(
    name: str, raw: str, total: int | None, of: str, who: str, device_totals: list[int]
) -> Finding:
    """The verdict on a size variable: error when the library would raise on it."""
    try:
        size = parse_size(raw, total=total, name=name, of=of)
    except ValueError as exc:
        return Finding(
            "error", f"{name}={raw}", f"{exc} {who} raise ValueError on it: fix or unset it."
        )
    if name == GPU_LIMIT_ENV and device_totals and size and size > max(device_totals):
        return Finding(
            "warn",
            f"{name}={raw}",
            f"{format_bytes(size)} is above the GPUs' memory ({format_bytes(max(device_totals))}): "
            "it limits nothing. Use a size below it or a percentage such as 90%.",
        )
    if name == GPU_LIMIT_ENV and device_totals:
        what = f"a budget of {format_bytes(size)} per device" if size else "no limit"
    elif name == CACHE_LIMIT_ENV:
        what = f"a cache of {format_bytes(size)} per device" if size else "no cache"
    else:
        what = format_bytes(size) if size else "no limit"
    return Finding("ok", f"{name}={raw}", f"valid: {what}.")


def _environment(devices: list[dict]) -> list[Finding]:
    env = os.environ
    found = []
    for name, (level, advice) in CONFLICTING_ENV.items():
        if name in env:
            found.append(Finding(level, f"{name}={env[name]}", advice))
    # the rules of the JAX adapter, which refuses other values
    for name, want in _jax_shared_env().items():
        have = env.get(name)
        if have is not None and have.lower() != want:
            found.append(Finding("warn", f"{name}={have}", _XLA_ADVICE[name].format(want=want)))
    totals = [d["total"] for d in devices if d["total"]]
    device_total = min(totals) if totals else None
    sizes = (
        (GPU_LIMIT_ENV, device_total, DEVICE_MEMORY, "bridge.unify() and bridge.pool()"),
        (CACHE_LIMIT_ENV, device_total, DEVICE_MEMORY, "bridge.unify() and bridge.pool()"),
        (PINNED_LIMIT_ENV, host_memory_total(), HOST_MEMORY, "bridge's pinned-memory functions"),
    )
    for name, total, of, who in sizes:
        raw = env.get(name)
        if raw is not None and raw.strip():
            # without a GPU a share of the device is still checked for its form
            found.append(_size_finding(name, raw, total or 1 << 40, of, who, totals))
    backend = env.get(BACKEND_ENV)
    if backend is not None and backend.strip():
        if backend.strip().lower() in BACKENDS:
            found.append(Finding("ok", f"{BACKEND_ENV}={backend}", "valid."))
        else:
            found.append(
                Finding(
                    "error",
                    f"{BACKEND_ENV}={backend}",
                    f"not a pinned backend: use one of {', '.join(sorted(BACKENDS))}. bridge's "
                    "pinned-memory functions raise ValueError on it: fix or unset it.",
                )
            )
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
    if env.get(DRIVER_LIBRARY_ENV):
        found.append(
            Finding(
                "info",
                f"{DRIVER_LIBRARY_ENV}={env[DRIVER_LIBRARY_ENV]}",
                "the bridge loads this library instead of libcuda.so.1.",
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
    dists = _distributions()
    frameworks = [
        _cupy(dists, driver),
        _torch(dists, driver),
        _jax(dists, driver),
        _cuda_python(dists),
    ]
    return Report(
        python={"version": platform.python_version(), "executable": sys.executable},
        bridge={"version": __version__, "path": str(pathlib.Path(__file__).resolve().parent)},
        driver=driver,
        devices=devices,
        frameworks=frameworks,
        environment=_environment(devices),
        stack=_stack(dists),
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
