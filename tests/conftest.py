# SPDX-License-Identifier: Apache-2.0
"""Test modes.

CPU (default, CI): the core is pointed at the stand-in driver built from
tests/standin/standin_cuda.c; `gpu` tests are skipped.  GPU
(BRIDGE_TEST_GPU=1, set by scripts/gpu-test): the real driver; stand-in tests
are skipped.  The stand-in is never evidence that anything works on a GPU.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import re
import subprocess
import sys
import sysconfig
import tempfile

import pytest

HERE = pathlib.Path(__file__).resolve().parent
# the helpers (gpu_util, ledger_util, the share workers) import from every group of tests
sys.path.insert(0, str(HERE))
GPU_MODE = os.environ.get("BRIDGE_TEST_GPU") == "1"


def build_standin(out_dir: pathlib.Path) -> pathlib.Path:
    """Compile the stand-in driver (once per source change) and return its path."""
    src = HERE / "standin" / "standin_cuda.c"
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / "libstandin_cuda.so"
    if not lib.exists() or lib.stat().st_mtime < src.stat().st_mtime:
        cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
        cmd = cc.split() + [
            "-O1",
            "-g",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-shared",
            "-fPIC",
            "-o",
            str(lib) + ".tmp",
            str(src),
            "-lpthread",
        ]
        subprocess.run(cmd, check=True)
        os.replace(str(lib) + ".tmp", lib)
    return lib


# Share files (bridge.unify(share=...)) of the tests go to a directory of this
# run, never to the user's /dev/shm; a BRIDGE_SHARE of the caller's is ignored.
os.environ["BRIDGE_SHARE_DIR"] = tempfile.mkdtemp(prefix="bridge-test-shares-")
os.environ.pop("BRIDGE_SHARE", None)
if not GPU_MODE:
    # the stand-in's pool grows by exactly what is allocated (a GPU's default
    # pool grows in 32 MiB chunks, the share's default): the tests' budgets of
    # a few MiB stay meaningful
    os.environ["BRIDGE_SHARE_GROWTH"] = str(2 << 20)

STANDIN: ctypes.CDLL | None = None
if not GPU_MODE:
    _lib = build_standin(
        HERE / "standin" / "build" / f"py{sys.version_info[0]}{sys.version_info[1]}"
    )
    os.environ["BRIDGE_CUDA_LIBRARY"] = str(_lib)
    os.environ.setdefault("BRIDGE_STANDIN_DEVICES", "2")
    STANDIN = ctypes.CDLL(str(_lib))
    STANDIN.standin_set_capacity.argtypes = [ctypes.c_int, ctypes.c_uint64]
    STANDIN.standin_add_foreign.argtypes = [ctypes.c_int, ctypes.c_int64]
    STANDIN.standin_fail.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    STANDIN.standin_pending_bytes.restype = ctypes.c_uint64
    STANDIN.standin_live_count.restype = ctypes.c_uint64
    STANDIN.standin_counter.restype = ctypes.c_uint64
    STANDIN.standin_access_grants.restype = ctypes.c_uint64
    STANDIN.standin_set_capturing.argtypes = [ctypes.c_void_p]
    STANDIN.standin_pending_on.argtypes = [ctypes.c_int, ctypes.c_void_p]
    STANDIN.standin_pending_on.restype = ctypes.c_uint64
    STANDIN.standin_adopt_stream.argtypes = [ctypes.c_void_p, ctypes.c_int]
    STANDIN.standin_last_wait.argtypes = [ctypes.POINTER(ctypes.c_int)]
    STANDIN.standin_last_wait.restype = ctypes.c_void_p
    STANDIN.standin_set_global_capture.argtypes = [ctypes.c_int, ctypes.c_void_p]
    STANDIN.standin_new_stream.restype = ctypes.c_void_p
    STANDIN.standin_new_stream_flags.argtypes = [ctypes.c_int, ctypes.c_uint]
    STANDIN.standin_new_stream_flags.restype = ctypes.c_void_p
    STANDIN.standin_launch.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_int]
    STANDIN.standin_queued_kernels.restype = ctypes.c_uint64
    STANDIN.cuStreamCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
    STANDIN.cuStreamDestroy_v2.argtypes = [ctypes.c_void_p]
    # captures, graphs and user objects (as CuPy's Stream and Graph call them)
    STANDIN.cuStreamBeginCapture_v2.argtypes = [ctypes.c_void_p, ctypes.c_int]
    STANDIN.cuStreamEndCapture.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    STANDIN.cuGraphInstantiateWithFlags.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_void_p,
        ctypes.c_ulonglong,
    ]
    STANDIN.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    STANDIN.cuGraphExecDestroy.argtypes = [ctypes.c_void_p]
    STANDIN.cuGraphDestroy.argtypes = [ctypes.c_void_p]
    STANDIN.standin_wait_destructors.restype = ctypes.c_uint64
    STANDIN.standin_queued_destructors.restype = ctypes.c_uint64
    STANDIN.standin_live_user_objects.restype = ctypes.c_uint64
    # the environment variables are read at the first init: none has happened yet
    os.environ.pop("BRIDGE_GPU_MEMORY_LIMIT", None)
    os.environ.pop("BRIDGE_PINNED_MEMORY_LIMIT", None)


def _gpu_present() -> str | None:
    """None when a CUDA GPU is usable, else why not."""
    if not GPU_MODE:
        return "no GPU in this run: scripts/gpu-test runs the gpu tests on a GPU machine"
    try:
        from bridge import _runtime

        if _runtime.device_count() == 0:
            return "the CUDA driver reports no GPU"
    except Exception as exc:  # noqa: BLE001
        return f"no usable CUDA driver: {exc}"
    return None


class _CheckoutAsFolder:
    """Collect the checkout's top folder as a plain folder, not as a package.

    The top folder holds an ``__init__.py`` (so that a checkout named ``bridge`` never imports
    as an empty namespace package), and pytest imports a package's ``__init__.py`` on the way
    to its tests, putting the folder *above* the checkout first on ``sys.path``: every sibling
    of the checkout there (another project's ``numpy`` or ``packaging`` source, say) would then
    shadow the installed module of that name, in the tests and in the processes they start.
    """

    @pytest.hookimpl(tryfirst=True)
    def pytest_collect_directory(self, path, parent):
        if path == HERE.parent:
            return pytest.Dir.from_parent(parent, path=path)
        return None


def pytest_configure(config):
    if hasattr(pytest, "Dir"):  # pytest 8 and later collect folders through this hook
        config.pluginmanager.register(_CheckoutAsFolder(), "bridge-checkout-as-folder")


def pytest_collection_modifyitems(config, items):
    gpu_skip = _gpu_present()
    for item in items:
        if "gpu" in item.keywords and gpu_skip:
            item.add_marker(pytest.mark.skip(reason=gpu_skip))
        if "gpu" not in item.keywords and GPU_MODE and "standin" in item.fixturenames:
            item.add_marker(pytest.mark.skip(reason="stand-in driver test; this is a GPU run"))


GIB = 1 << 30


@pytest.fixture
def standin():
    """The stand-in driver, reset: 16 GiB per device, no faults, no limits."""
    if STANDIN is None:
        pytest.skip("stand-in driver test; this is a GPU run")
    from bridge import _runtime
    from bridge._runtime import core

    STANDIN.standin_clear_faults()
    STANDIN.standin_set_capturing(None)
    STANDIN.standin_set_global_capture(0, None)
    STANDIN.standin_hold_syncs(0)
    STANDIN.standin_hold_destructors(0)
    STANDIN.standin_wait_destructors()
    core.graph_collect()  # what an earlier test's dead graphs left
    # no context current on this thread, whatever an earlier test (Numba's) left current
    STANDIN.cuCtxSetCurrent(None)
    _runtime.reset_process_state()  # every module singleton: devices, Bridge, recovery
    n = _runtime.device_count()
    for d in range(n):
        _runtime.ensure_device(d)
        STANDIN.standin_set_capacity(d, 16 * GIB)
        STANDIN.standin_sync_all(d)
        core.set_limit(d, 0)
        core.set_cache(d, 0)  # off by default here: tests of the cache turn it on
        core.set_cache_fraction(d, 1 / 16, 64 << 20)  # the cap's defaults
        core.set_cache_tiers(d, 1 << 20, 64 << 20)  # the tiers' defaults
        # the large tier's fixed cap, as most tests assume; tests of its share set one
        core.set_cache_large_fraction(d, 0)
        core.set_cache_carve(d, 0, 0, 0)  # carving off, its empty chunks returned
        for tag in range(core.NTAGS):
            core.set_tag_limit(d, tag, 0)
            core.set_tag_cached(tag, True)
        core.reset_peak(d, -1)
        core.reset_accumulated(d, -1)
    core.set_pressure_callback(None)
    yield STANDIN
    STANDIN.standin_clear_faults()
    STANDIN.standin_set_capturing(None)
    STANDIN.standin_set_global_capture(0, None)
    core.set_pressure_callback(None)
    # frees held for a device-wide synchronization (a released graph pool's blocks)
    # go back now, not into the next test's figures
    for d in range(_runtime.device_count()):
        if core.ready(d):
            core.trim(d, 0)
    _runtime.reset_process_state()


@pytest.fixture
def led(standin):
    """A Ledger (tests/ledger_util.py) on the reset stand-in; the core holds nothing after."""
    import ledger_util

    from bridge._runtime import core

    standin.standin_adopt_stream.argtypes = [ctypes.c_void_p, ctypes.c_int]
    # made-up handles the driver should know as streams
    for s_ in (ledger_util.S1, ledger_util.S2, ledger_util.S3):
        standin.standin_adopt_stream(s_, ledger_util.DEV)
    led = ledger_util.Ledger(standin)
    live_before = core.live_records()
    yield led
    led.close()
    # whatever a test did, the core ends it holding nothing (frees held for a
    # device-wide synchronization, a released graph pool's, go back at a trim)
    assert core.live_records() == live_before
    for dev in (0, 1):
        if core.ready(dev):
            core.trim(dev, 0)
        s = ledger_util.stats(dev)
        assert s["used"] == 0, f"device {dev}: {s['used']} bytes still counted"
        assert s["num_deferred"] == 0 and s["graph_bytes"] == 0
        assert [t["current"] for t in s["tags"]] == [0] * core.NTAGS


def pytest_runtest_logreport(report):
    """On the GPU machine, a failure is written out at once: scripts/gpu-test
    limits each file's time, and a run stopped there never reaches pytest's
    summary, which would have said why the earlier tests failed."""
    if GPU_MODE and report.failed:
        out = sys.__stderr__
        out.write(f"\n===== FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n")
        out.flush()


def _skip_kind(reason: str) -> str:
    """What a skip reason is about, in a word: ``gpu``, a missing module, or ``other``."""
    if reason.startswith("no GPU in this run") or "GPU run" in reason:
        return "gpu"
    m = re.match(r"could not import '([^'.]+)", reason)
    return f"module {m.group(1)}" if m else "other"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line for the skips (``-rs`` lists each), instead of a line per skip."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped or "s" in (config.option.reportchars or "").replace("fE", ""):
        return
    kinds: dict[str, int] = {}
    for rep in skipped:
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        kind = _skip_kind(reason.removeprefix("Skipped: "))
        kinds[kind] = kinds.get(kind, 0) + 1
    gpu = kinds.pop("gpu", 0)
    modules = sorted(k.split(" ", 1)[1] for k in kinds if k.startswith("module "))
    parts = []
    if gpu:
        parts.append(f"{gpu} need a GPU (scripts/gpu-test runs them on a GPU machine)")
    n_mod = sum(v for k, v in kinds.items() if k.startswith("module "))
    if n_mod:
        parts.append(f"{n_mod} need a module not installed here ({', '.join(modules)})")
    if kinds.get("other"):
        parts.append(f"{kinds['other']} for other reasons")
    terminalreporter.write_line(
        f"skipped {len(skipped)}: {'; '.join(parts)}. `pytest -rs` lists each reason."
    )
