# SPDX-License-Identifier: Apache-2.0
"""What ``bridge doctor`` finds of the installed frameworks, without importing any.

Versions come from ``importlib.metadata`` and capabilities from the packages'
source files (``torch/version.py``, ``cupy/cuda/__init__.py``), so that the
doctor never starts a framework's CUDA runtime.
"""

from __future__ import annotations

__all__ = [
    "Finding",
    "FrameworkCheck",
    "distributions",
    "frameworks",
    "cuda_majors",
    "stack",
]

import dataclasses
import importlib.metadata as metadata
import importlib.util
import pathlib
import re

from bridge import frameworks as registry
from bridge._install import install_command, own_index_command

_ALL = ["cupy", "torch", "jax"]


@dataclasses.dataclass
class Finding:
    """One line of the report: a subject, a level in LEVELS, and what to do."""

    level: str
    subject: str
    text: str


@dataclasses.dataclass
class FrameworkCheck:
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


def distributions() -> dict[str, str]:
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


def _cuda_major_check(fw: FrameworkCheck, major: int | None, driver: dict) -> None:
    drv = driver["version"]
    if major is not None and drv and major > drv // 1000:
        fw.add(
            "warn",
            f"built for CUDA {major}, but the driver supports CUDA "
            f"{driver['version_text']}: update the NVIDIA driver or install "
            f"{fw.name}'s CUDA {drv // 1000} build.",
        )


def _torch(dists: dict[str, str], driver: dict) -> FrameworkCheck:
    fw = FrameworkCheck("torch", "torch" in dists, dists.get("torch"))
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
            f"CUDA {cuda} build; call bridge.unify(torch=True) before the first CUDA tensor.",
        )
        _cuda_major_check(fw, int(cuda.split(".")[0]), driver)
        _built(fw, "bridge.adapters.torch_build")  # which allocator: the C++ one or pluggable
    return fw


def _built(fw: FrameworkCheck, builder: str) -> None:
    """What an adapter's module built on first use says will run, and why (its describe)."""
    import importlib

    level, text = importlib.import_module(builder).describe()
    fw.add(level, text)


def _cupy(dists: dict[str, str], driver: dict) -> FrameworkCheck:
    names = sorted(n for n in dists if re.fullmatch(r"cupy(-cuda\d+x?|-rocm[-\d]*)?", n))
    fw = FrameworkCheck(
        "cupy", bool(names), dists[names[0]] if names else None, detail=", ".join(names)
    )
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


def _jax(dists: dict[str, str], driver: dict) -> FrameworkCheck:
    fw = FrameworkCheck("jax", "jax" in dists, dists.get("jax"))
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


def _numba(dists: dict[str, str], driver: dict) -> FrameworkCheck:
    fw = FrameworkCheck("numba", "numba-cuda" in dists, dists.get("numba-cuda"))
    if not fw.installed:
        if "numba" in dists:  # numba alone: its old CUDA target has no usable EMM plugin API
            fw.version = dists["numba"]
            fw.detail = "numba without numba-cuda"
            fw.add(
                "info",
                "numba-cuda is not installed: bridge.unify(numba=True) needs it "
                "(pip install 'numba-cuda[cu13]', or cu12).",
            )
        return fw
    fw.detail = f"numba {dists['numba']}" if "numba" in dists else ""
    if "set_memory_manager" not in (_package_file("numba", "cuda/cudadrv/driver.py") or ""):
        fw.add("error", "numba.cuda.set_memory_manager was not found: upgrade numba-cuda.")
        return fw
    fw.usable = True
    fw.add(
        "ok",
        "has the External Memory Management interface; call bridge.unify(numba=True) "
        "before Numba's first CUDA call, or set "
        "NUMBA_CUDA_MEMORY_MANAGER=bridge.adapters.numba.",
    )
    return fw


def _rmm(dists: dict[str, str], driver: dict) -> FrameworkCheck:
    names = sorted(n for n in dists if re.fullmatch(r"rmm(-cu\d+)?", n))
    fw = FrameworkCheck(
        "rmm", bool(names), dists[names[0]] if names else None, detail=", ".join(names)
    )
    if not names:
        return fw
    if "CallbackMemoryResource" not in (
        _package_file("rmm", "mr/__init__.py") or ""
    ) and "CallbackMemoryResource" not in (_package_file("rmm", "mr.py") or ""):
        fw.add("error", "rmm.mr.CallbackMemoryResource was not found: upgrade RMM.")
        return fw
    fw.usable = True
    fw.add(
        "ok",
        "has rmm.mr.CallbackMemoryResource; bridge.unify(rmm=True) makes every device's RMM "
        "resource allocate from the shared pool (call it after rmm.reinitialize(), which "
        "would replace it).",
    )
    _built(fw, "bridge.adapters.rmm_build")  # which resource: the C++ one or the callback
    m = re.search(r"cu(\d+)", names[0])
    if m:
        _cuda_major_check(fw, int(m.group(1)), driver)
    return fw


def _cuda_python(dists: dict[str, str]) -> FrameworkCheck:
    names = [n for n in ("cuda-python", "cuda-bindings", "cuda-core") if n in dists]
    fw = FrameworkCheck(
        "cuda-python", bool(names), ", ".join(f"{n} {dists[n]}" for n in names) or None
    )
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
    (re.compile(r"rmm-cu(\d+)"), int),
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


def stack(dists: dict[str, str]) -> list[Finding]:
    """One warning when the installed frameworks target different CUDA majors."""
    majors = cuda_majors(dists, _torch_cuda() if "torch" in dists else None)
    if list(majors) == [12] and "torch" not in dists:
        return [
            Finding(
                "info",
                "torch for CUDA 12",
                "the frameworks here are CUDA 12 builds and torch is not installed; PyPI's "
                f"torch is a CUDA 13 build, so take a CUDA 12 torch from PyTorch's index: "
                f"{own_index_command(12)}.",
            )
        ]
    if len(majors) < 2:
        return []
    listed = "; ".join(f"CUDA {m}: {', '.join(who)}" for m, who in sorted(majors.items()))
    return [
        Finding(
            "warn",
            "CUDA versions",
            f"the packages here target different CUDA major versions ({listed}): one process "
            "would load two CUDA runtimes and their libraries, which wastes GPU memory and "
            "can fail. Install one set (uninstall the other major's packages first): for "
            f"for CUDA 13, {install_command(_ALL, 13)} (from a checkout: pip install -e "
            f"'.[cuda13]'); for CUDA 12, {install_command(_ALL, 12)} (from a checkout: "
            f"{own_index_command(12)}, then pip install -e '.[cuda12]').",
        )
    ]


#: The frameworks with checks of their own here; every other row of the registry gets
#: :func:`_registered`'s.
_CHECKS = {"cupy": _cupy, "torch": _torch, "jax": _jax, "numba": _numba, "rmm": _rmm}


def _registered(name: str, dists: dict[str, str], driver: dict) -> FrameworkCheck:
    """A framework of the registry without a check of its own here: whether it is
    installed (found, not imported), its distributions and version, and the call."""
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    fw = FrameworkCheck(name, found)
    if not found:
        return fw
    owners = metadata.packages_distributions().get(name, [])
    names = sorted({re.sub(r"[-_.]+", "-", n).lower() for n in owners})
    fw.version = next((dists[n] for n in names if n in dists), "(version unknown)")
    fw.detail = ", ".join(names)
    fw.usable = True
    fw.add("ok", f"call bridge.unify({name}=True) to put it on the shared pool.")
    return fw


def frameworks(dists: dict[str, str], driver: dict) -> list[FrameworkCheck]:
    """What was found of each framework the bridge plugs into (the registry's, in
    bridge.frameworks.FRAMEWORKS order), and of cuda-python."""
    found = []
    for name in registry.FRAMEWORKS:
        if name not in registry.NAMES:  # "other": no framework
            continue
        check = _CHECKS.get(name)
        found.append(check(dists, driver) if check else _registered(name, dists, driver))
    return found + [_cuda_python(dists)]
