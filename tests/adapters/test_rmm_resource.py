# SPDX-License-Identifier: Apache-2.0
"""The bridge's C++ RMM resource (adapters/_rmm_resource.pyx): its build, key and fallback.

Without RMM, Cython or a compiler (CI) these check rmm_build's logic on a fake RMM
tree (its Cython declarations as files on sys.path) and the adapter's choice of
resource on a fake build module. Where RMM's wheels, Cython and a C++ compiler are
installed, the last test builds the real module and runs it on the stand-in driver
in a fresh process: RMM's own C++ (``DeviceMemoryResource.allocate``) calls the
resource's C callbacks, which call the core. That shows the module is built, loads
and reaches the core as RMM calls it; never that it works on a GPU
(tests/gpu/test_gpu_rmm.py does).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import types
import warnings

import pytest
from rmm_util import CallbackMemoryResource, forget_fake_rmm, install_fake_rmm

import bridge
from bridge.adapters import native_build, rmm_build

PXD = "rmm/pylibrmm/memory_resource/_memory_resource.pxd"
LIBRMM_PXD = "rmm/librmm/memory_resource.pxd"
RMM_C_REF = "    cdef optional[device_async_resource_ref] c_ref\n"
REAL_LIBRMM_PXD = """\
cdef extern from "rmm/mr/callback_memory_resource.hpp" namespace "rmm::mr" nogil:
    cdef cppclass callback_memory_resource:
        pass
cdef extern from *:
    optional[device_async_resource_ref] make_device_async_resource_ref(
        callback_memory_resource&) except +
    void throw_cpp_except(CppExcept) nogil
"""


@pytest.fixture
def fake_tree(tmp_path, monkeypatch):
    """An RMM 26.x tree of declarations on sys.path (no real RMM), a fresh cache folder."""
    site = tmp_path / "site"
    for rel, text in (
        (PXD, "cdef class DeviceMemoryResource:\n" + RMM_C_REF),
        (LIBRMM_PXD, REAL_LIBRMM_PXD),
        ("rmm/librmm/cuda_stream_ref.pxd", "# stream_ref\n"),
        ("rmm/VERSION", "26.10.00\n"),
    ):
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    monkeypatch.setattr(
        sys, "path", [str(site), *[p for p in sys.path if "site-packages" not in p]]
    )
    monkeypatch.setenv("BRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(rmm_build.CALLBACK_ENV, raising=False)
    return site


def test_the_callback_variable_is_0_or_1(monkeypatch):
    for raw, want in (("", False), ("0", False), ("1", True), (" 1 ", True)):
        monkeypatch.setenv(rmm_build.CALLBACK_ENV, raw)
        assert rmm_build.callback_from_env() is want
    monkeypatch.setenv(rmm_build.CALLBACK_ENV, "yes")
    with pytest.raises(ValueError, match="BRIDGE_RMM_CALLBACK='yes' is not 0 or 1"):
        rmm_build.callback_from_env()


def test_a_bad_callback_variable_is_refused_before_anything_changes(standin, monkeypatch):
    monkeypatch.setenv(rmm_build.CALLBACK_ENV, "yes")
    with pytest.raises(ValueError, match="BRIDGE_RMM_CALLBACK='yes' is not 0 or 1"):
        bridge.unify(cupy=False, torch=False, rmm=True, budget="1GiB")
    assert bridge.pool(0).get_limit() == 0  # the budget was not applied: nothing changed


def test_the_key_follows_rmm_s_declarations_and_version_and_names_cython(fake_tree):
    assert rmm_build._api_problem() == "" and rmm_build.version() == "26.10.00"
    first = rmm_build.key()
    assert len(first) == 16 and rmm_build.key() == first  # stable
    (fake_tree / "rmm" / "VERSION").write_text("26.12.00\n")
    second = rmm_build.key()
    assert second != first
    (fake_tree / PXD).write_text((fake_tree / PXD).read_text() + "    cdef int more\n")
    assert rmm_build.key() != second  # the class's layout changed: another module
    name = rmm_build._name("3.3.1")
    assert name == f"bridge_rmm_{rmm_build.key()}_cy331" and name.isidentifier()


def test_an_rmm_without_the_declarations_is_named_as_the_reason(fake_tree):
    (fake_tree / PXD).write_text("cdef class DeviceMemoryResource:\n    cdef object c_obj\n")
    problem = rmm_build._api_problem()
    assert "does not declare what the bridge's resource is built on" in problem
    assert "c_ref" in problem and "26.10.00" in problem
    assert rmm_build.load() is None and rmm_build.reason == problem
    level, text = rmm_build.describe()
    assert level == "warn" and "cannot be built here" in text and "CallbackMemoryResource" in text
    (fake_tree / PXD).unlink()
    assert "were not found" in rmm_build._api_problem()


def test_an_rmm_older_than_26_10_is_named_as_the_reason_without_a_build(fake_tree):
    """RMM 26.02 to 26.08 have no rmm/librmm/cuda_stream_ref.pxd, which the resource cimports.
    It was not among the declarations checked: every first unify(rmm=True) of a process
    announced a build, ran Cython into the missing file and fell back with Cython's error,
    and doctor said the resource would be built."""
    (fake_tree / "rmm" / "librmm" / "cuda_stream_ref.pxd").unlink()
    (fake_tree / "rmm" / "VERSION").write_text("26.08.00\n")
    problem = rmm_build._api_problem()
    assert "rmm/librmm/cuda_stream_ref.pxd" in problem and "older than 26.10" in problem
    assert rmm_build.missing_tools() == problem
    assert rmm_build.load() is None and rmm_build.reason == problem
    assert not rmm_build.cached_builds()  # nothing was compiled
    level, text = rmm_build.describe()
    assert level == "warn" and "cannot be built here" in text


def test_the_callback_variable_skips_the_build(fake_tree, monkeypatch):
    monkeypatch.setenv(rmm_build.CALLBACK_ENV, "1")
    assert rmm_build.load() is None
    assert rmm_build.reason == "BRIDGE_RMM_CALLBACK=1 asks for RMM's CallbackMemoryResource"
    level, text = rmm_build.describe()
    assert level == "warn" and text.startswith("BRIDGE_RMM_CALLBACK is set: RMM would run on")


def test_describe_says_what_the_build_lacks_what_is_built_and_what_will_be(fake_tree, monkeypatch):
    monkeypatch.setattr(rmm_build, "missing_tools", lambda: "Cython is not installed (pip x)")
    level, text = rmm_build.describe()
    assert level == "warn" and "cannot be built here: Cython is not installed" in text
    assert "1.16-1.41x" in text  # what the fallback costs
    monkeypatch.setattr(rmm_build, "missing_tools", lambda: "")
    level, text = rmm_build.describe()
    assert level == "ok" and "compiled for this RMM on the first unify(rmm=True)" in text
    assert "python -m bridge build-rmm" in text
    (native_build.cache_dir() / "bridge_rmm_0123456789abcdef_cy331").mkdir(parents=True)
    (native_build.cache_dir() / "bridge_rmm_0123456789abcdef_cy331.building-1").mkdir()
    (native_build.cache_dir() / "bridge_torch_0123456789abcdef").mkdir()  # not RMM's
    level, text = rmm_build.describe()
    assert level == "ok" and "1 build(s) in" in text
    monkeypatch.setattr(rmm_build, "missing_tools", lambda: "no C++ compiler (x)")
    assert rmm_build.describe()[0] == "ok"  # built already: no compiler needed


def test_missing_tools_names_cython_and_the_headers(fake_tree, monkeypatch):
    monkeypatch.setattr(rmm_build, "_cython_version", lambda: "")
    assert rmm_build.missing_tools() == "Cython is not installed (pip install cython)"
    monkeypatch.setattr(rmm_build, "_cython_version", lambda: "3.3.1")
    monkeypatch.setattr(rmm_build, "cxx", lambda: None)
    assert rmm_build.missing_tools().startswith("no C++ compiler")
    monkeypatch.setattr(rmm_build, "cxx", lambda: "/usr/bin/c++")
    monkeypatch.setattr(rmm_build, "_python_include", lambda: [str(fake_tree)])
    (fake_tree / "Python.h").write_text("")
    assert "librmm's C++ headers" in rmm_build.missing_tools()  # the fake tree has none


def test_without_cython_a_build_of_any_cython_for_the_key_is_loaded(fake_tree, monkeypatch):
    seen = []

    def fake_import(name, folder):
        seen.append(name)
        return types.SimpleNamespace(name=name) if name.endswith("_cy300") else None

    monkeypatch.setattr(rmm_build, "import_built", fake_import)
    for version in ("3.0.0", "2.9.0"):
        (native_build.cache_dir() / rmm_build._name(version)).mkdir(parents=True)
    module, folder = rmm_build._from_cache("")
    assert module is not None and folder.name == rmm_build._name("3.0.0")
    module, folder = rmm_build._from_cache("3.1.0")  # with Cython: its own build only
    assert module is None and folder.name == rmm_build._name("3.1.0")


def test_a_failed_build_leaves_no_module_and_says_why(fake_tree, monkeypatch):
    monkeypatch.setitem(sys.modules, "rmm", types.ModuleType("rmm"))
    monkeypatch.setattr(rmm_build, "missing_tools", lambda: "")

    def broken(name, stage, verbose):
        (stage / "half.o").write_text("")
        raise RuntimeError("g++: x.cpp:1:1: error: something\nmore")

    monkeypatch.setattr(rmm_build, "_compile", broken)
    # the compiler's first error, not the last line of its output
    assert rmm_build.load() is None
    assert rmm_build.reason == "building it failed: g++: x.cpp:1:1: error: something"
    assert rmm_build.cached_builds() == [] and not any(native_build.cache_dir().iterdir())
    assert rmm_build.load(build=False) is None and "not built yet" in rmm_build.reason
    assert rmm_build._first_error("a\nx.cpp:1: error: bad\nb") == "x.cpp:1: error: bad"


# ---- the adapter's choice of resource, on a fake RMM and a fake build ----
@pytest.fixture
def adapter(standin, monkeypatch):
    """bridge.adapters.rmm imported fresh on a stand-in rmm (rmm_build's load is faked)."""
    monkeypatch.delenv(rmm_build.CALLBACK_ENV, raising=False)
    install_fake_rmm(monkeypatch)
    yield importlib.import_module("bridge.adapters.rmm")  # fresh: unify finds this one
    forget_fake_rmm()


class FakeBuilt:
    """What rmm_build.load returns: load_core, then BridgeResource(device, tag, on_failure)."""

    def __init__(self, core_error: str = "") -> None:
        self.core_error = core_error
        self.cores: list[str] = []

    def load_core(self, path: str) -> None:
        if self.core_error:
            raise RuntimeError(self.core_error)
        self.cores.append(path)

    class BridgeResource:
        def __init__(self, device, tag, on_failure) -> None:
            self.device, self.tag, self.on_failure = device, tag, on_failure


def test_the_adapter_installs_the_cpp_resource_where_it_builds(adapter, monkeypatch):
    from bridge._runtime import core

    built = FakeBuilt()
    monkeypatch.setattr(rmm_build, "load", lambda **kw: built)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the C++ path says nothing
        bridge.unify(cupy=False, torch=False, rmm=True)
    assert adapter.path() == "bridge" and adapter.path_reason() == ""
    assert built.cores == [core.__file__]
    mr = adapter.resource(0)
    assert isinstance(mr, FakeBuilt.BridgeResource) and adapter.installed(0)
    assert (mr.device, mr.tag, mr.on_failure) == (0, core.TAG_RMM, adapter._on_failure)
    assert adapter.resource(1).device == 1


@pytest.mark.parametrize(
    "built, reason, why",
    [
        (None, "Cython is not installed (pip install cython)", "Cython is not installed"),
        (FakeBuilt("the core x has no bridge_alloc"), "", "cannot reach the core"),
    ],
)
def test_where_it_does_not_build_the_callback_resource_runs_and_says_why_once(
    adapter, monkeypatch, built, reason, why
):
    from bridge._runtime import core

    def load(**kw):
        rmm_build.reason = reason
        return built

    monkeypatch.setattr(rmm_build, "load", load)
    with pytest.warns(RuntimeWarning, match="RMM runs on RMM's CallbackMemoryResource") as w:
        bridge.unify(cupy=False, torch=False, rmm=True)
    assert len(w) == 1 and why in str(w[0].message) and "build-rmm" in str(w[0].message)
    assert adapter.path() == "callback" and why in adapter.path_reason()
    mr = adapter.resource(0)
    assert isinstance(mr, CallbackMemoryResource)
    assert mr.deallocate_func is core.stream_free
    assert isinstance(mr.allocate_func, core.StreamAllocator)


# ---- the real module, where it can be built ----
SCENARIO = r"""
import ctypes, json, os
import bridge
from bridge._runtime import core
from bridge.adapters import rmm_build
missing = rmm_build.missing_tools()
if missing:  # the build's tools are not here; a build that fails with them is a failure
    print("RESULT " + json.dumps({"skip": missing})); raise SystemExit
import rmm, rmm.mr
from rmm.pylibrmm.stream import Stream
sd = ctypes.CDLL(os.environ["BRIDGE_CUDA_LIBRARY"])
sd.standin_pending_on.argtypes = [ctypes.c_int, ctypes.c_void_p]
sd.standin_pending_on.restype = ctypes.c_uint64
class S:  # a stream as the CUDA stream protocol hands it to RMM
    def __init__(self, handle): self.handle = handle
    def __cuda_stream__(self): return (0, self.handle)
MIB, S1, S2 = 1 << 20, 0xA1000, 0xA2000
bridge.unify(cupy=False, torch=False, rmm=True, budget=64 * MIB, device=0)
from bridge.adapters import rmm as adapter
out = {"path": adapter.path(), "reason": adapter.path_reason()}
mr = rmm.mr.get_per_device_resource(0)
out["repr"] = repr(mr)
out["is_rmm_resource"] = isinstance(mr, rmm.mr.DeviceMemoryResource)
p = mr.allocate(3 * MIB, Stream(S(S1)))
out["lookup"] = list(core.lookup(p))
out["held"] = bridge.stats(0).by_framework["rmm"]
mr.deallocate(p, 3 * MIB, Stream(S(S2)))  # freed on the stream RMM frees on
out["pending_s2"] = sd.standin_pending_on(0, S2)
out["freed"] = bridge.stats(0).by_framework["rmm"]
keep = mr.allocate(40 * MIB)
try:
    mr.allocate(40 * MIB)
    out["oom"] = None
except MemoryError as e:
    out["oom"] = [type(e).__name__, str(e)]
out["after_oom"] = bridge.stats(0).by_framework["rmm"]
mr.deallocate(keep, 40 * MIB)
one = rmm.mr.get_per_device_resource(1)  # device 1: set up by its first allocation
q = one.allocate(MIB)
out["device1"] = list(core.lookup(q))
one.deallocate(q, MIB)
out["used"] = [bridge.stats(d).used for d in (0, 1)]
print("RESULT " + json.dumps(out))
"""


def test_the_built_module_allocates_through_the_core_as_rmm_calls_it(standin):
    pytest.importorskip("rmm")  # imports here on the CPU; the scenario imports it afresh
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCENARIO)],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ.copy(),
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    if "skip" in out:
        pytest.skip(f"the RMM resource cannot be built here: {out['skip']}")
    assert out["path"] == "bridge", out["reason"]
    assert out["repr"].startswith("<bridge RMM resource (C++) device 0") and out["is_rmm_resource"]
    from bridge._runtime import core

    assert out["lookup"] == [0, 3 << 20, 0, core.TAG_RMM] and out["held"] == 3 << 20
    assert out["pending_s2"] == 3 << 20 and out["freed"] == 0
    kind, message = out["oom"]
    assert kind == "MemoryError" and "for rmm on device 0" in message
    assert "budget is 64.00 MiB" in message and out["after_oom"] == 40 << 20
    assert out["device1"] == [0, 1 << 20, 1, core.TAG_RMM]
    assert out["used"] == [0, 0]
