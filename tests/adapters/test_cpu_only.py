# SPDX-License-Identifier: Apache-2.0
"""A framework installed without CUDA (a CPU-only torch or jax) under bridge.unify().

A bare unify() leaves it alone and says so once a process; asked for, it is a BridgeError
naming the build and what to install, and the call changes nothing (no variable, no
budget, no started backend; JAX is not even imported), so a later call works.

Each test runs in a fresh process on the stand-in driver, with the frameworks either the
stand-ins of fake_frameworks/cpu (CI has no torch and no jax; see its README) or the real
CPU-only builds where they are installed (skipped elsewhere).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from bridge.adapters import jax as jax_adapter

FAKES = pathlib.Path(__file__).resolve().parent / "fake_frameworks"
XLA_VARS = (
    "XLA_PYTHON_CLIENT_ALLOCATOR",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
)
GIB = 1 << 30
INSTALL_TORCH = (
    "pip uninstall torch, then for CUDA 13: pip install torch; for CUDA 12: pip install torch "
    "--index-url https://download.pytorch.org/whl/cu129"
)
INSTALL_JAX = "for CUDA 13: pip install 'jax[cuda13]'; for CUDA 12: pip install 'jax[cuda12]'"

# In the fresh process: the bridge, and one attempt at unify() reported as data.
PRELUDE = """
import importlib, json, os, sys, warnings
import bridge
from bridge.adapters import torch_build
unify_mod = importlib.import_module("bridge.unify")
loads = []  # every call of torch_build.load: what compiles the torch allocator
_load = torch_build.load
def _counted_load(**kwargs):
    loads.append(kwargs)
    return _load(**kwargs)
torch_build.load = _counted_load

def attempt(**kwargs):
    try:
        bridge.unify(**kwargs)
    except Exception as exc:
        return [f"{type(exc).__module__}.{type(exc).__name__}", str(exc)]
    return None

def state():
    return {
        "xla": {k: v for k, v in os.environ.items() if k.startswith("XLA_")},
        "limit": bridge.pool(0).get_limit(),
        "threshold": bridge.stats(0).release_threshold,
        "cache": bridge._runtime.core.stats(0)[1]["cache_limit"],
        "bridge": unify_mod.current() is not None,
        "jax_imported": "jax" in sys.modules,
        "torch_loads": len(loads),
    }
"""


def _real_cpu_torch() -> str | None:
    """Why the real-torch tests cannot run here (None: a CPU-only torch is installed)."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if torch.version.cuda is not None:
        return f"torch {torch.__version__} is a CUDA build"
    return None


def _real_cpu_jax() -> str | None:
    """Why the real-jax tests cannot run here (None: a jax without a CUDA plugin)."""
    if importlib.util.find_spec("jax") is None or importlib.util.find_spec("jaxlib") is None:
        return "jax is not installed"
    plugins = [m for m in ("jax_cuda13_plugin", "jax_cuda12_plugin") if importlib.util.find_spec(m)]
    if plugins:
        return f"jax has a CUDA plugin here ({plugins[0]})"
    return None


@pytest.fixture(params=["stand-in", "real"])
def cpu_torch(request, standin):
    """(PYTHONPATH to put first, torch's version) for a CPU-only torch."""
    if request.param == "stand-in":
        return str(FAKES / "cpu"), "2.13.0+cpu"
    why = _real_cpu_torch()
    if why:
        pytest.skip(f"no real CPU-only torch: {why}")
    import torch

    return None, torch.__version__


@pytest.fixture(params=["stand-in", "real"])
def cpu_jax(request, standin):
    """(PYTHONPATH to put first, 'jax X (jaxlib Y)') for a jax without a CUDA plugin."""
    if request.param == "stand-in":
        return str(FAKES / "cpu"), "jax 0.10.2 (jaxlib 0.10.2)"
    why = _real_cpu_jax()
    if why:
        pytest.skip(f"no real CPU-only jax: {why}")
    version = importlib.metadata.version
    return None, f"jax {version('jax')} (jaxlib {version('jaxlib')})"


def _run(code: str, path: str | None, **env: str) -> tuple[dict, str]:
    """Run ``code`` after PRELUDE in a fresh process; its last line of output, as JSON."""
    e = dict(os.environ)  # the stand-in driver (tests/conftest.py)
    for var in XLA_VARS:
        e.pop(var, None)
    if path:
        e["PYTHONPATH"] = os.pathsep.join(p for p in (path, e.get("PYTHONPATH")) if p)
    e.update(env)
    r = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        env=e,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


# ---- torch ----
def test_a_bare_unify_leaves_a_cpu_only_torch_alone_and_says_so_once(cpu_torch):
    path, version = cpu_torch
    out, err = _run(
        """
        before = state()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # every warning the bridge gives, not Python's once
            b = bridge.unify()
            same = bridge.unify() is b
            other = bridge.unify(peer_access=False) is b  # other arguments: no second word
        from bridge.adapters import torch as adapter
        print(json.dumps({
            "frameworks": sorted(b.frameworks), "same": same, "other": other,
            "words": [[w.category.__name__, str(w.message), w.filename] for w in caught],
            "installed": adapter.installed(), "path": adapter.path(),
            "before": before, "after": state(),
        }))
        """,
        path,
    )
    assert "torch" not in out["frameworks"] and out["same"] and out["other"]
    assert not out["installed"] and out["path"] == ""  # no allocator installed
    assert out["after"]["torch_loads"] == 0 and "compiling" not in err  # nothing compiled
    assert len(out["words"]) == 1, out["words"]  # once a process, not once a call
    category, text, filename = out["words"][0]
    assert category == "UserWarning" and filename == "<string>"  # the caller's line
    assert text.startswith(
        f"bridge.unify() left torch out: torch {version} is a CPU-only build "
        "(torch.version.cuda is None)"
    )
    assert INSTALL_TORCH in text and "pass torch=False" in text
    assert out["after"]["xla"] == out["before"]["xla"] == {}


def test_torch_true_with_a_cpu_only_torch_is_a_bridgeerror_that_changes_nothing(cpu_torch):
    path, version = cpu_torch
    out, err = _run(
        """
        before = state()
        first = attempt(torch=True, budget="1GiB", release_threshold="1GiB")
        after = state()
        again = attempt(torch=True)
        from bridge.adapters import torch as adapter
        try:
            adapter.install([0])  # the adapter's own entry refuses it the same way
            direct = None
        except bridge.BridgeError as exc:
            direct = str(exc)
        b = bridge.unify(torch=False, budget="1GiB")  # the way out works
        print(json.dumps({
            "first": first, "again": again, "direct": direct, "before": before,
            "after": after, "frameworks": sorted(b.frameworks),
            "limit": bridge.pool(0).get_limit(), "installed": adapter.installed(),
            "loads": len(loads),
        }))
        """,
        path,
    )
    kind, text = out["first"]
    assert kind == "bridge._errors.BridgeError"
    assert text.startswith(
        f"bridge.unify(torch=True): torch {version} is a CPU-only build "
        "(torch.version.cuda is None): it has no CUDA allocator to put on the shared pool."
    )
    assert INSTALL_TORCH in text
    assert text.endswith("Or pass torch=False to keep it on the CPU, off the shared pool.")
    assert out["after"] == out["before"]  # no budget, no threshold, no Bridge, no variable
    assert not out["after"]["bridge"] and out["after"]["limit"] == 0
    assert out["again"] == out["first"]  # a retry says the same, not "call it earlier"
    assert out["direct"].startswith(f"bridge.unify(torch=True): torch {version} is a CPU-only")
    assert out["loads"] == 0 and "compiling" not in err and not out["installed"]
    assert out["frameworks"] == [] and out["limit"] == GIB


def test_without_a_driver_that_is_what_is_said_first(cpu_torch, tmp_path):
    """A machine without a GPU: installing a CUDA torch would not help, the driver first."""
    path, _ = cpu_torch
    code = 'print(json.dumps({"err": attempt(torch=True), "bare": attempt()}))'
    out, _ = _run(code, path, BRIDGE_CUDA_LIBRARY=str(tmp_path / "no-libcuda.so.1"))
    for kind, text in (out["err"], out["bare"]):
        assert kind == "bridge._errors.BridgeError" and "no usable CUDA driver" in text


def test_a_rocm_torch_is_named_as_one(standin):
    path = str(FAKES / "cpu")
    env = {
        "BRIDGE_TEST_FAKE_TORCH_HIP": "6.4.43482",
        "BRIDGE_TEST_FAKE_TORCH_VERSION": "2.13.0+rocm6.4",
    }
    out, _ = _run('print(json.dumps({"err": attempt(torch=True)}))', path, **env)
    assert out["err"][1].startswith(
        "bridge.unify(torch=True): torch 2.13.0+rocm6.4 is a ROCm build "
        "(torch.version.hip is '6.4.43482'): it has no CUDA allocator"
    )


TOO_OLD = (
    "CUDA initialization: The NVIDIA driver on your system is too old (found version 12040). "
    "Please update your GPU driver."
)


@pytest.fixture(params=["stand-in", "real"])
def unusable_cuda_torch(request, standin):
    """(PYTHONPATH to put first, environment, torch's version, its CUDA) for a CUDA build of
    torch that cannot use the GPU here: the stand-in's warns as torch does of an old driver;
    a real CUDA torch on the stand-in driver finds no GPU of its own."""
    if request.param == "stand-in":
        env = {
            "BRIDGE_TEST_FAKE_TORCH_VERSION": "2.15.0+cu130",
            "BRIDGE_TEST_FAKE_TORCH_CUDA": "13.0",
            "BRIDGE_TEST_FAKE_TORCH_CUDA_WARNING": TOO_OLD,
        }
        return str(FAKES / "cpu"), env, "2.15.0+cu130", "13.0"
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    import torch

    if torch.version.cuda is None:
        pytest.skip(f"torch {torch.__version__} is a CPU-only build")
    if os.environ.get("BRIDGE_TEST_GPU") == "1":
        pytest.skip("stand-in test; this is a GPU run")
    return None, {}, torch.__version__, torch.version.cuda


def test_a_cuda_torch_that_cannot_use_the_gpu_is_left_out_or_refused(unusable_cuda_torch):
    """A CUDA torch whose CUDA the driver cannot run (a cu130 wheel on an older driver):
    torch.cuda.is_available() is False. A bare unify() failed inside torch (its error on the
    first torch stream); it leaves torch out and says why once, and torch=True is a
    BridgeError naming torch's reason that changes nothing."""
    path, env, version, cuda = unusable_cuda_torch
    out, err = _run(
        """
        before = state()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            b = bridge.unify(budget="1GiB")
        words = [str(w.message) for w in caught if "left torch out" in str(w.message)]
        bare = {"frameworks": sorted(b.frameworks), "limit": bridge.pool(0).get_limit()}
        unify_mod._bridge = None  # a fresh start for the call that asks for torch
        bridge.pool(0).set_limit(0)
        first = attempt(torch=True, budget="2GiB")
        from bridge.adapters import torch as adapter
        print(json.dumps({"bare": bare, "words": words, "first": first, "before": before,
                          "after": state(), "installed": adapter.installed()}))
        """,
        path,
        **env,
    )
    assert "torch" not in out["bare"]["frameworks"] and out["bare"]["limit"] == GIB
    (word,) = out["words"]
    assert word.startswith(
        f"bridge.unify() left torch out: torch {version} is a CUDA {cuda} build that cannot "
        "use this machine's GPU (torch.cuda.is_available() is False"
    )
    kind, text = out["first"]
    assert kind == "bridge._errors.BridgeError", out
    assert text.startswith(f"bridge.unify(torch=True): torch {version} is a CUDA {cuda} build")
    assert f"Install an NVIDIA driver for CUDA {cuda}" in text and INSTALL_TORCH in text
    if env:
        assert TOO_OLD in word and TOO_OLD in text  # torch's own reason
    assert text.endswith("Or pass torch=False to keep it on the CPU, off the shared pool.")
    assert out["after"]["limit"] == 0 and not out["installed"]
    assert out["after"]["torch_loads"] == 0 and "compiling" not in err


# ---- jax ----
def test_jax_true_with_a_cpu_only_jax_is_a_bridgeerror_and_jax_stays_unstarted(cpu_jax):
    path, build = cpu_jax
    out, _ = _run(
        """
        before = state()
        first = attempt(jax=True, budget="1GiB", release_threshold="1GiB")
        after = state()
        again = attempt(jax=True)  # a retry: the same words, not "call it before JAX starts"
        both = attempt(jax=True, torch=False, cupy=False, jax_memory="1GiB")
        b = bridge.unify(jax=False, budget="1GiB")  # the way out works
        import jax
        from jax._src import xla_bridge
        started = xla_bridge.backends_are_initialized()  # jax imported now, not yet started
        platforms = sorted({str(getattr(d, "platform", d)).split(":")[0] for d in jax.devices()})
        print(json.dumps({
            "first": first, "again": again, "both": both, "before": before, "after": after,
            "started": started, "platforms": platforms, "frameworks": sorted(b.frameworks),
            "limit": bridge.pool(0).get_limit(), "xla": state()["xla"],
        }))
        """,
        path,
    )
    kind, text = out["first"]
    assert kind == "bridge._errors.BridgeError"
    assert text.startswith(
        f"bridge.unify(jax=True): {build} is a CPU-only build: no CUDA plugin is installed "
        "(jax-cuda13-plugin or jax-cuda12-plugin), so JAX has no GPU backend"
    )
    assert f"Install one: {INSTALL_JAX}." in text
    assert text.endswith("Or pass jax=False to keep it on the CPU, off the shared pool.")
    assert out["after"] == out["before"]  # no variable, no budget, no Bridge
    assert out["after"]["xla"] == {} and not out["after"]["jax_imported"]
    assert out["again"] == out["first"] and out["both"] == out["first"]
    assert out["started"] is False  # the bridge started no backend
    assert out["platforms"] == ["cpu"]  # JAX itself runs, on its CPU
    assert out["frameworks"] == [] and out["limit"] == GIB and out["xla"] == {}


def test_a_jax_that_fails_to_start_on_the_gpu_is_put_back(cpu_jax):
    """A CUDA plugin is found but JAX has no GPU: its variables and backends are put back."""
    path, _ = cpu_jax
    path = os.pathsep.join(p for p in (str(FAKES / "cuda_plugin"), path) if p)
    out, _ = _run(
        """
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # the user's, and agreeing
        before = state()
        first = attempt(jax=True, budget="1GiB")
        after = state()
        from jax._src import xla_bridge
        print(json.dumps({
            "first": first, "before": before, "after": after,
            "started": xla_bridge.backends_are_initialized(),
            "frameworks": sorted(bridge.unify(jax=False).frameworks),
        }))
        """,
        path,
    )
    kind, text = out["first"]
    assert kind == "bridge._errors.BridgeError"
    assert text.startswith("bridge.unify(jax=True): JAX did not start on the GPU (")
    assert "Unknown backend" in text and "put back the XLA_PYTHON_CLIENT_* variables" in text
    assert out["after"]["xla"] == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # as it was
    # the budget and the cache (turned off for JAX) put back too
    assert out["after"] == out["before"] | {"jax_imported": True}
    assert out["after"]["cache"] > 0
    assert out["started"] is False  # the backends this call started are cleared
    assert out["frameworks"] == []


def test_a_jax_whose_backend_started_is_refused_before_a_share_is_joined(cpu_jax):
    """unify(jax=True, share=...) after JAX's backend started: refused before anything
    changes; the share was joined first and stayed joined, its budget applying."""
    path, _ = cpu_jax
    path = os.pathsep.join(p for p in (str(FAKES / "cuda_plugin"), path) if p)
    out, _ = _run(
        """
        import jax
        jax.devices("cpu")  # the backends start
        before = state()
        first = attempt(jax=True, budget="1GiB", share="late")
        print(json.dumps({"first": first, "before": before, "after": state(),
                          "share": bridge.stats(0).share}))
        """,
        path,
    )
    kind, text = out["first"]
    assert kind == "bridge._errors.BridgeError"
    assert text.startswith("call bridge.unify(jax=True) before JAX's GPU backend starts")
    assert out["share"] is None and out["after"] == out["before"]


@pytest.mark.parametrize("raw", ["", "  "])
def test_a_blank_cache_limit_leaves_jax_without_the_cache_as_unset(cpu_jax, raw):
    """unify(jax=True) turns the cache off (XLA cannot ask it to give memory back) unless
    BRIDGE_CACHE_LIMIT asks for one; a blank value asked for the default 1 GiB cache."""
    path, _ = cpu_jax
    path = os.pathsep.join(p for p in (str(FAKES / "cuda_plugin"), path) if p)
    out, _ = _run(
        """
        from bridge.adapters import jax as jax_adapter
        jax_adapter._start = lambda devices: None  # JAX "starts": no GPU here
        first = attempt(cupy=False, torch=False, jax=True)
        print(json.dumps({"first": first, "after": state()}))
        """,
        path,
        BRIDGE_CACHE_LIMIT=raw,
    )
    assert out["first"] is None, out
    assert out["after"]["cache"] == 0


def test_a_jax_partition_that_fails_to_start_puts_the_budget_back(cpu_jax):
    """jax_memory takes JAX's partition out of the budget before JAX starts: a start that
    fails put back the variables and the cache but left a budget from before the call (the
    environment's, an earlier call's) short by the partition for CuPy and torch."""
    path, _ = cpu_jax
    path = os.pathsep.join(p for p in (str(FAKES / "cuda_plugin"), path) if p)
    out, _ = _run(
        """
        before = state()
        first = attempt(jax=True, jax_memory="2GiB")
        print(json.dumps({"first": first, "before": before, "after": state()}))
        """,
        path,
        BRIDGE_GPU_MEMORY_LIMIT="8GiB",
    )
    kind, text = out["first"]
    assert kind == "bridge._errors.BridgeError", out
    assert text.startswith("bridge.unify(jax=True): JAX did not start on the GPU ("), text
    assert out["before"]["limit"] == 8 * GIB
    assert out["after"] == out["before"] | {"jax_imported": True}


def _fraction_jax_reads(env: dict) -> float | None:
    """JAX's memory fraction from its environment, as jaxlib reads it when its CUDA backend
    starts (jaxlib/xla_client.py, generate_pjrt_gpu_plugin_options, jax 0.11): the name
    XLA_CLIENT_MEM_FRACTION first, else the older one; both set is a ValueError."""
    new = env.get("XLA_CLIENT_MEM_FRACTION", "")
    old = env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
    if new and old:
        raise ValueError("XLA_CLIENT_MEM_FRACTION is specified together with the old name")
    return float(new or old) if new or old else None


@pytest.mark.parametrize("var", ["XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"])
def test_a_jax_partition_is_the_fraction_jax_reads_under_either_name(cpu_jax, var):
    """jax_memory sizes JAX's arena by the memory fraction JAX reads as it starts. A user's
    XLA_CLIENT_MEM_FRACTION (the name JAX documents now) was left as it was, beside the
    bridge's XLA_PYTHON_CLIENT_MEM_FRACTION: JAX refuses to start with both, and would
    otherwise have taken the user's fraction while the budget shrank by the partition."""
    path, _ = cpu_jax
    path = os.pathsep.join(p for p in (str(FAKES / "cuda_plugin"), path) if p)
    out, _ = _run(
        """
        from bridge.adapters import jax as jax_adapter
        seen = {}
        def start(devices):  # JAX "starts" here: what it would read then
            seen.update({k: v for k, v in os.environ.items() if "MEM_FRACTION" in k})
        jax_adapter._start = start
        first = attempt(cupy=False, torch=False, jax=True, jax_memory="2GiB")
        total = bridge._runtime.core.stats(0)[1]["total"]
        print(json.dumps({"first": first, "seen": seen, "total": total}))
        """,
        path,
        **{var: "0.9"},
    )
    assert out["first"] is None, out
    assert _fraction_jax_reads(out["seen"]) == pytest.approx(2 * GIB / out["total"], abs=1e-6)


def test_a_memory_fraction_under_jax_s_current_name_is_warned_about(cpu_jax):
    """On the shared pool XLA's cuda_async allocator enforces no fraction: unify(jax=True)
    warned for XLA_PYTHON_CLIENT_MEM_FRACTION but said nothing of XLA_CLIENT_MEM_FRACTION,
    the name JAX documents now, which limits nothing either."""
    path, _ = cpu_jax
    path = os.pathsep.join(p for p in (str(FAKES / "cuda_plugin"), path) if p)
    out, _ = _run(
        """
        from bridge.adapters import jax as jax_adapter
        jax_adapter._start = lambda devices: None  # JAX "starts": no GPU here
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = attempt(cupy=False, torch=False, jax=True)
        print(json.dumps({"first": first, "warned": [str(w.message) for w in caught]}))
        """,
        path,
        XLA_CLIENT_MEM_FRACTION="0.5",
    )
    assert out["first"] is None, out
    assert [w for w in out["warned"] if w.startswith("XLA_CLIENT_MEM_FRACTION has no effect")]


@pytest.mark.parametrize("cache_env", [None, "256MiB"])
def test_a_device_set_up_after_jax_joined_the_pool_keeps_no_cache(cpu_jax, cache_env):
    """JAX allocates from the pool on every visible device and cannot ask the bridge to
    flush, so unify(jax=True) turns the cache off. A device outside unify(device=...), set up
    later by CuPy or torch, kept the default cache (1 GiB and segments), memory JAX there
    could not have. BRIDGE_CACHE_LIMIT, set, still sizes it; a JAX that failed to start
    leaves later devices their cache."""
    path, _ = cpu_jax
    path = os.pathsep.join(p for p in (str(FAKES / "cuda_plugin"), path) if p)
    code = """
        from bridge.adapters import jax as jax_adapter
        from bridge._runtime import core, ensure_device
        START
        first = attempt(cupy=False, torch=False, jax=True, device=0)
        ensure_device(1)  # what CuPy's or torch's first allocation there does
        print(json.dumps({"first": first, "caches": [core.stats(d)[1]["cache_limit"]
                                                     for d in (0, 1)]}))
        """
    env = {"BRIDGE_STANDIN_DEVICES": "2"}
    if cache_env:
        env["BRIDGE_CACHE_LIMIT"] = cache_env
    out, _ = _run(code.replace("START", "jax_adapter._start = lambda devices: None"), path, **env)
    assert out["first"] is None, out
    want = 256 * (1 << 20) if cache_env else 0
    assert out["caches"] == [want, want]
    if cache_env:
        return
    out, _ = _run(code.replace("START", ""), path, **env)  # JAX fails to start here
    assert out["first"][0] == "bridge._errors.BridgeError", out
    assert out["caches"][1] > 0 and out["caches"][0] == out["caches"][1]


def test_a_jax_whose_backends_were_cleared_after_a_start_is_refused(cpu_jax):
    """JAX reads its XLA_PYTHON_CLIENT_* variables once, as its PJRT plugins register when
    its backends first start, and keeps those options when the backends are cleared
    (jax.extend.backend.clear_backends()): unify(jax=True) then went ahead, and JAX came
    back with its own allocator while the bridge counted it on the shared pool. A
    BridgeError saying so, before anything changes."""
    path, _ = cpu_jax
    path = os.pathsep.join(p for p in (str(FAKES / "cuda_plugin"), path) if p)
    out, _ = _run(
        """
        from bridge.adapters import jax as jax_adapter
        jax_adapter._start = lambda devices: None  # JAX would "start" here
        import jax
        from jax._src import xla_bridge
        jax.devices()  # JAX starts: its plugins register, reading the environment
        xla_bridge._plugins_registered = True  # (jax 0.11's flag; the stand-in has none)
        xla_bridge._clear_backends()  # what jax.extend.backend.clear_backends() does
        before = state()
        first = attempt(cupy=False, torch=False, jax=True, budget="1GiB")
        print(json.dumps({"first": first, "before": before, "after": state()}))
        """,
        path,
    )
    kind, text = out["first"]
    assert kind == "bridge._errors.BridgeError", out
    assert "JAX keeps the allocator settings it read then" in text, text
    assert out["after"] == out["before"]


def test_a_device_set_up_before_jax_joined_the_pool_is_jax_s_too(cpu_jax):
    """JAX starts on every visible device. One outside unify(device=...) that the bridge had
    set up already (torch or CuPy used it) kept its cache beside JAX, and XLA's release
    threshold written at JAX's start: it is turned off and re-asserted as unify's are."""
    path, _ = cpu_jax
    path = os.pathsep.join(p for p in (str(FAKES / "cuda_plugin"), path) if p)
    out, _ = _run(
        """
        from bridge.adapters import jax as jax_adapter
        from bridge._runtime import core, ensure_device
        started = []
        jax_adapter._start = started.append  # JAX "starts"; the devices re-asserted
        ensure_device(1)  # torch or CuPy used device 1 before
        before = core.stats(1)[1]["cache_limit"]
        first = attempt(cupy=False, torch=False, jax=True, device=0)
        print(json.dumps({"first": first, "before": before, "started": started,
                          "caches": [core.stats(d)[1]["cache_limit"] for d in (0, 1)]}))
        """,
        path,
        BRIDGE_STANDIN_DEVICES="2",
    )
    assert out["first"] is None, out
    assert out["before"] > 0 and out["caches"] == [0, 0]
    assert out["started"] == [[0, 1]]


def test_a_device_set_up_after_jax_took_its_arena_gives_it_up_from_its_budget(cpu_jax):
    """JAX's arena (jax_memory) is taken on every visible device, outside the pool, and out
    of the budget of the devices unify() sets up. A device outside unify(device=...) set up
    later kept the whole BRIDGE_GPU_MEMORY_LIMIT for CuPy and torch beside JAX's arena there,
    which the budget does not see. A JAX that failed to start leaves later budgets whole."""
    path, _ = cpu_jax
    path = os.pathsep.join(p for p in (str(FAKES / "cuda_plugin"), path) if p)
    code = """
        from bridge.adapters import jax as jax_adapter
        from bridge._runtime import core, ensure_device
        START
        first = attempt(cupy=False, torch=False, jax=True, device=0, jax_memory="2GiB")
        ensure_device(1)  # what CuPy's or torch's first allocation there does
        print(json.dumps({"first": first, "limits": [core.stats(d)[1]["limit"]
                                                     for d in (0, 1)]}))
        """
    env = {"BRIDGE_STANDIN_DEVICES": "2", "BRIDGE_GPU_MEMORY_LIMIT": "8GiB"}
    out, _ = _run(code.replace("START", "jax_adapter._start = lambda devices: None"), path, **env)
    assert out["first"] is None, out
    assert out["limits"] == [6 * GIB, 6 * GIB]
    out, _ = _run(code.replace("START", ""), path, **env)  # JAX fails to start here
    assert out["first"][0] == "bridge._errors.BridgeError", out
    assert out["limits"] == [8 * GIB, 8 * GIB]


def test_a_jax_partition_as_large_as_the_budget_is_refused_before_anything_changes(cpu_jax):
    """JAX's partition is taken out of the budget: jax_memory at or above the budget (given,
    or from BRIDGE_GPU_MEMORY_LIMIT) left CuPy and torch a budget of 1 byte, refusing every
    allocation.  It is a ValueError naming both, before any variable, budget or backend."""
    path, _ = cpu_jax
    path = os.pathsep.join(p for p in (str(FAKES / "cuda_plugin"), path) if p)
    out, _ = _run(
        """
        before = state()
        given = attempt(jax=True, budget="4GiB", jax_memory="4GiB")
        mid = state()
        os.environ["BRIDGE_GPU_MEMORY_LIMIT"] = "2GiB"
        bridge.pool(0).set_limit("2GiB")  # the budget the environment gave
        from_env = attempt(jax=True, jax_memory="3GiB")
        print(json.dumps({"given": given, "from_env": from_env, "before": before, "mid": mid,
                          "after": state()}))
        """,
        path,
    )
    for key, budget, part in (
        ("given", "4.00 GiB", "4.00 GiB"),
        ("from_env", "2.00 GiB", "3.00 GiB"),
    ):
        kind, text = out[key]
        assert kind == "builtins.ValueError", out[key]
        assert f"is {part}, not below device 0's budget of {budget}" in text, text
    assert out["mid"] == out["before"]  # nothing changed: not even JAX imported
    assert out["after"] == out["before"] | {"limit": 2 * GIB}
    assert out["after"]["jax_imported"] is False


def test_a_budget_given_again_keeps_jax_arena_out_of_it(cpu_jax):
    """JAX's partition from an earlier call stays JAX's (its install() returns at once): a
    later unify() that gives the budget again took the budget back up to it whole, so that
    CuPy and torch could hold the whole budget beside JAX's arena.  It is taken down by the
    arena, as the first call took it down; a budget the arena fills is a ValueError."""
    path, _ = cpu_jax
    path = os.pathsep.join(p for p in (str(FAKES / "cuda_plugin"), path) if p)
    out, _ = _run(
        """
        from bridge.adapters import jax as jax_adapter
        jax_adapter._start = lambda devices: None  # JAX "starts": no GPU here
        first = attempt(cupy=False, torch=False, jax=True, budget="8GiB", jax_memory="2GiB")
        after_first = state()["limit"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            again = attempt(cupy=False, torch=False, jax=True, budget="8GiB", wait=1)
        after_again = state()["limit"]
        bigger = attempt(cupy=False, torch=False, jax=True, budget="10GiB")
        after_bigger = state()["limit"]
        full = attempt(cupy=False, torch=False, jax=True, budget="2GiB")
        print(json.dumps({"first": first, "again": again, "bigger": bigger, "full": full,
                          "limits": [after_first, after_again, after_bigger, state()["limit"]],
                          "warned": [str(w.message) for w in caught]}))
        """,
        path,
    )
    assert out["first"] is None and out["again"] is None and out["bigger"] is None, out
    assert out["limits"] == [6 * GIB, 6 * GIB, 8 * GIB, 8 * GIB], out
    assert not [w for w in out["warned"] if "changed the budget" in w], out  # 8 GiB again
    kind, text = out["full"]
    assert kind == "builtins.ValueError", out
    assert "JAX's arena (from an earlier call) is 2.00 GiB, not below device 0's budget" in text


def test_a_jax_partition_asked_for_after_jax_started_is_refused(cpu_jax):
    """JAX's allocator is fixed once its backend has started (an earlier unify(jax=True)):
    jax_memory asked for then, or another size than the arena JAX has, was dropped without
    a word (JAX kept the shared pool or its first arena, the budget stayed as it was). It
    is a ValueError before anything changes; the arena JAX has, asked for again, is not."""
    path, _ = cpu_jax
    path = os.pathsep.join(p for p in (str(FAKES / "cuda_plugin"), path) if p)
    out, _ = _run(
        """
        from bridge.adapters import jax as jax_adapter
        jax_adapter._start = lambda devices: None  # JAX "starts": no GPU here
        shared = attempt(cupy=False, torch=False, jax=True, budget="8GiB")
        before = state()
        later = attempt(cupy=False, torch=False, jax=True, budget="8GiB", jax_memory="2GiB")
        after = state()
        print(json.dumps({"shared": shared, "later": later, "before": before, "after": after,
                          "partition": jax_adapter.partition()}))
        """,
        path,
    )
    assert out["shared"] is None, out
    kind, text = out["later"]
    assert kind == "builtins.ValueError", out
    assert "jax_memory='2GiB'" in text and "shares the pool" in text, text
    assert out["after"] == out["before"] and out["partition"] is None

    out, _ = _run(
        """
        from bridge.adapters import jax as jax_adapter
        jax_adapter._start = lambda devices: None
        first = attempt(cupy=False, torch=False, jax=True, budget="8GiB", jax_memory="2GiB")
        before = state()
        other = attempt(cupy=False, torch=False, jax=True, budget="8GiB", jax_memory="3GiB")
        mid = state()
        same = attempt(cupy=False, torch=False, jax=True, budget="8GiB", jax_memory="2GiB",
                       wait=1)
        print(json.dumps({"first": first, "other": other, "same": same, "before": before,
                          "mid": mid, "after": state()}))
        """,
        path,
    )
    assert out["first"] is None and out["same"] is None, out
    kind, text = out["other"]
    assert kind == "builtins.ValueError", out
    assert "jax_memory='3GiB'" in text and "2.00 GiB" in text, text
    assert out["mid"] == out["before"] == out["after"]
    assert out["after"]["limit"] == 6 * GIB


# ---- how a JAX with CUDA is told from one without, from the installed files alone ----
@pytest.mark.parametrize(
    "files, cuda",
    [
        ({"jax_cuda13_plugin/__init__.py": ""}, True),  # jax-cuda13-plugin
        ({"jax_cuda12_plugin/__init__.py": ""}, True),
        ({"jax_plugins/xla_cuda13/__init__.py": ""}, True),  # jax-cuda13-pjrt (namespace)
        ({"jaxlib/__init__.py": "", "jaxlib/cuda/__init__.py": ""}, True),  # an older jaxlib
        (
            {
                "jaxlib/__init__.py": "",
                "jaxlib-0.4.7+cuda12.cudnn88.dist-info/METADATA": (
                    "Metadata-Version: 2.1\nName: jaxlib\nVersion: 0.4.7+cuda12.cudnn88\n"
                ),
            },
            True,
        ),
        ({"jaxlib/__init__.py": "", "jaxlib/cpu/__init__.py": ""}, False),  # CPU only
        ({"jaxlib/__init__.py": "", "jax_plugins/xla_rocm7/__init__.py": ""}, False),
    ],
)
def test_a_cuda_jax_is_told_from_its_installed_files(tmp_path, monkeypatch, files, cuda):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    # only these files and the standard library on the path; nothing of them imported
    monkeypatch.setattr(
        sys, "path", [str(tmp_path)] + [p for p in sys.path if "-packages" not in p]
    )
    for name in ("jaxlib", "jax_plugins", "jax_cuda13_plugin", "jax_cuda12_plugin"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    importlib.invalidate_caches()
    assert jax_adapter._has_cuda() is cuda
    assert not {"jaxlib", "jax_plugins", "jax_cuda13_plugin", "jax_cuda12_plugin"} & set(
        sys.modules
    )


def test_build_torch_with_a_cpu_only_torch_says_so_at_once_and_compiles_nothing(
    cpu_torch, tmp_path
):
    path, version = cpu_torch
    e = dict(os.environ, BRIDGE_CACHE_DIR=str(tmp_path / "cache"))
    if path:
        e["PYTHONPATH"] = os.pathsep.join(p for p in (path, e.get("PYTHONPATH")) if p)
    r = subprocess.run(
        [sys.executable, "-m", "bridge", "build-torch"],
        env=e,
        capture_output=True,
        text=True,
        timeout=120,
    )
    words = r.stdout + r.stderr
    assert r.returncode == 1, words
    assert f"torch {version} is built without CUDA (torch.version.cuda is None)" in words
    assert "pip uninstall torch, then pip install torch" in words
    assert "compiling" not in words and "Traceback" not in words
    # nothing to fall back to: unify leaves a CPU-only torch alone, on no allocator of ours
    assert "CUDAPluggableAllocator" not in words
    assert not (tmp_path / "cache").exists()  # nothing built, nothing kept
