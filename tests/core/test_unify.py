# SPDX-License-Identifier: Apache-2.0
"""bridge.unify() on the stand-in driver, and start-up errors in a fresh process."""

from __future__ import annotations

import importlib
import importlib.abc
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

import bridge
from bridge._errors import BridgeError, Status
from bridge._runtime import MAX_THRESHOLD, core

MIB = 1 << 20
GIB = 1 << 30
TOTAL = 16 * GIB  # the stand-in's device memory
unify_mod = importlib.import_module("bridge.unify")  # `bridge.unify` is the function


def limits() -> tuple[int, int]:
    return tuple(core.stats(d)[1]["limit"] for d in (0, 1))


@pytest.fixture
def fresh(standin, monkeypatch):
    """As if unify() had never been called in this process (restored afterwards)."""
    monkeypatch.setattr(unify_mod, "_bridge", None)
    # the JAX adapter writes these before it imports jax
    for var in (
        "XLA_PYTHON_CLIENT_ALLOCATOR",
        "XLA_PYTHON_CLIENT_PREALLOCATE",
        "XLA_PYTHON_CLIENT_MEM_FRACTION",
    ):
        monkeypatch.setenv(var, "")  # records the value to restore, even "unset"
        monkeypatch.delenv(var)
    yield standin


class FakeAdapter:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def install(self, devices, **kw):
        self.log.append((self.name, tuple(devices)))


@pytest.fixture
def fake_adapters(fresh, monkeypatch):
    """Frameworks 'installed' without touching a real one: records install calls."""
    log: list = []
    adapters = {n: FakeAdapter(n, log) for n in ("cupy", "torch", "jax")}
    monkeypatch.setattr(unify_mod, "_adapter", lambda name: adapters[name])
    return log


class _Missing(importlib.abc.MetaPathFinder):
    """Makes `import <name>` fail as it does where the package is not installed."""

    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


@pytest.fixture
def not_installed(monkeypatch):
    def hide(*names):
        for mod in list(sys.modules):
            if mod.split(".")[0] in names or mod in {f"bridge.adapters.{n}" for n in names}:
                monkeypatch.delitem(sys.modules, mod)
        monkeypatch.setattr(sys, "meta_path", [_Missing(names)] + sys.meta_path)

    return hide


# ---- the returned object ----
def test_returns_the_same_object_on_repeat(fresh):
    b = bridge.unify(cupy=False, torch=False)
    assert isinstance(b, bridge.Bridge)
    assert bridge.unify(cupy=False, torch=False) is b
    assert unify_mod.current() is b
    assert b.devices == (0, 1)  # every visible device
    assert b.frameworks == frozenset()
    # other arguments: still the same object, updated (and it says what it changed)
    with pytest.warns(UserWarning, match="changed the budget"):
        assert bridge.unify(cupy=False, torch=False, budget="1GiB") is b
    assert "frameworks=[none]" in repr(b)


def test_budget_is_applied_per_device(fresh):
    bridge.unify(cupy=False, torch=False, budget="1GiB")
    assert limits() == (GIB, GIB)
    assert bridge.pool(0).get_limit() == bridge.pool(1).get_limit() == GIB
    # the budget is enforced on each device
    for d in (0, 1):
        assert core.alloc(d, GIB + 1, 0, core.TAG_CUPY) == (Status.BUDGET, 0)


@pytest.mark.parametrize(
    "budget, expected",
    [
        (123456789, 123456789),
        (0.25, TOTAL // 4),
        ("0.25", TOTAL // 4),
        ("50%", TOTAL // 2),
        ("512MiB", 512 * MIB),
        ("4GB", 4 * 1000**3),
        ("1073741824", GIB),
        (0, 0),
    ],
)
def test_budget_forms(fresh, budget, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these is above the device
        bridge.unify(cupy=False, torch=False, budget=budget)
    assert limits() == (expected, expected)


def test_a_budget_above_the_device_warns_naming_both_sizes(fresh):
    with pytest.warns(UserWarning) as record:
        bridge.unify(cupy=False, torch=False, budget="40GB")
    assert len(record) == 1  # one warning for the two same-sized devices
    msg = str(record[0].message)
    assert msg.startswith("budget='40GB' on devices [0, 1]: a limit of 37.25 GiB")
    assert "larger than the device's memory (16.00 GiB, 17179869184 bytes)" in msg
    assert record[0].filename == __file__
    assert limits() == (40 * 1000**3, 40 * 1000**3)  # applied all the same


def test_budget_for_chosen_devices_only(fresh):
    b = bridge.unify(cupy=False, torch=False, budget="2GiB", device=1)
    assert b.devices == (1,)
    assert limits() == (0, 2 * GIB)
    with pytest.warns(UserWarning, match=r"device 1: 2\.00 GiB -> 3\.00 GiB\)"):
        b2 = bridge.unify(cupy=False, torch=False, budget="3GiB", device=[1, 0, 1])
    assert b2 is b
    assert b.devices == (0, 1)
    assert limits() == (3 * GIB, 3 * GIB)


def test_no_budget_keeps_the_limit_set_earlier(fresh):
    bridge.pool(0).set_limit(size=5 * MIB)
    bridge.unify(cupy=False, torch=False)
    assert limits() == (5 * MIB, 0)


def test_same_arguments_change_nothing(fresh):
    b = bridge.unify(cupy=False, torch=False, budget="1GiB")
    bridge.pool(0).set_limit(size="3GiB")  # the user changed it since
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bridge.unify(cupy=False, torch=False, budget="1GiB") is b
    assert limits() == (3 * GIB, GIB)


def test_a_second_budget_applies_and_says_so(fresh):
    b = bridge.unify(cupy=False, torch=False, budget="1GiB")
    with pytest.warns(UserWarning) as record:
        assert bridge.unify(cupy=False, torch=False, budget="2GiB") is b
    assert limits() == (2 * GIB, 2 * GIB)  # the new budget applies
    msg = str(record[0].message)
    assert msg.startswith("bridge.unify(budget='2GiB') changed the budget")
    assert "device 0: 1.00 GiB -> 2.00 GiB; device 1: 1.00 GiB -> 2.00 GiB" in msg
    assert "bridge.pool(device).set_limit(...)" in msg  # the deliberate way
    assert record[0].filename == __file__
    # no budget: the one in place stays, without a word
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bridge.unify(cupy=False, torch=False, budget=None)
        bridge.unify(cupy=False, torch=False, budget="2GiB", peer_access=False)  # no change
    assert limits() == (2 * GIB, 2 * GIB)


def test_the_first_budget_replaces_the_environments_without_a_word(fresh):
    bridge.pool(0).set_limit(size="5GiB")  # as BRIDGE_GPU_MEMORY_LIMIT would
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bridge.unify(cupy=False, torch=False, budget="1GiB")
    assert limits() == (GIB, GIB)


def test_budget_from_the_environment_when_none_given(standin, monkeypatch):
    """BRIDGE_GPU_MEMORY_LIMIT is read when a device is set up: a fresh process."""
    script = textwrap.dedent("""
        import bridge
        b = bridge.unify(cupy=False, torch=False)
        print([bridge.pool(d).get_limit() for d in b.devices])
        b = bridge.unify(cupy=False, torch=False, budget="1GiB")  # an argument wins
        print([bridge.pool(d).get_limit() for d in b.devices])
    """)
    out = _run(script, BRIDGE_GPU_MEMORY_LIMIT="25%")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == [f"[{TOTAL // 4}, {TOTAL // 4}]", f"[{GIB}, {GIB}]"]


def test_an_environment_budget_above_the_device_warns(standin):
    """The variable's value is applied, with a warning naming both sizes."""
    out = _run("import bridge; print(bridge.pool(0).get_limit())", BRIDGE_GPU_MEMORY_LIMIT="64GiB")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(64 * GIB)
    assert "UserWarning" in out.stderr and "BRIDGE_GPU_MEMORY_LIMIT on device 0" in out.stderr


@pytest.mark.parametrize("raw", ["lots", "150%", "-1", "1.5"])
def test_bad_environment_budget_names_the_variable(standin, raw):
    out = _run("import bridge; bridge.stats(0)", BRIDGE_GPU_MEMORY_LIMIT=raw)
    assert out.returncode != 0
    assert "ValueError" in out.stderr
    assert f"BRIDGE_GPU_MEMORY_LIMIT={raw!r}" in out.stderr


# ---- bad arguments change nothing ----
@pytest.mark.parametrize("budget", ["abc", "150%", "1.5", -1, True, 1.5, 2**64, [1]])
def test_bad_budget_raises_valueerror_and_changes_nothing(fresh, budget):
    bridge.pool(0).set_limit(size=7 * MIB)
    with pytest.raises(ValueError, match="budget="):
        bridge.unify(cupy=False, torch=False, budget=budget)
    assert limits() == (7 * MIB, 0)
    assert unify_mod.current() is None


def test_bad_budget_after_a_good_call_keeps_the_bridge(fresh):
    b = bridge.unify(cupy=False, torch=False, budget="1GiB")
    with pytest.raises(ValueError):
        bridge.unify(cupy=False, torch=False, budget="lots")
    assert unify_mod.current() is b
    assert limits() == (GIB, GIB)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(jax=True, jax_memory="abc"), "jax_memory='abc'"),
        (dict(jax=True, jax_memory="150%"), "jax_memory='150%'"),
        (dict(jax=True, jax_memory="20GiB"), "below the device's memory"),  # 16 GiB here
        (dict(jax=True, jax_memory=0), "more than 0"),
        (dict(jax=False, jax_memory="1GiB"), "pass jax=True with it"),
        (dict(release_threshold="50%"), "takes bytes, not a percentage"),
        (dict(release_threshold="lots"), "release_threshold='lots'"),
    ],
)
def test_every_argument_is_checked_before_anything_changes(fake_adapters, kwargs, match):
    bridge.pool(0).set_limit(size=7 * MIB)
    threshold = bridge.stats(0).release_threshold
    with pytest.raises(ValueError, match=match):
        bridge.unify(cupy=True, torch=True, budget="1GiB", **kwargs)
    assert unify_mod.current() is None  # no Bridge left behind
    assert fake_adapters == []  # no framework installed
    assert limits() == (7 * MIB, 0)  # no budget
    assert bridge.stats(0).release_threshold == threshold


def test_a_framework_that_refuses_puts_the_budget_back(fresh, monkeypatch):
    class TooLate:
        def install(self, devices, **kw):
            raise BridgeError("call bridge.unify(torch=True) before the first CUDA tensor")

    monkeypatch.setattr(unify_mod, "_adapter", lambda name: TooLate())
    with pytest.raises(BridgeError, match="before the first CUDA tensor"):
        bridge.unify(cupy=False, torch=True, budget="1GiB", release_threshold="1GiB")
    assert limits() == (0, 0)
    assert unify_mod.current() is None
    assert bridge.stats(0).release_threshold == MAX_THRESHOLD


@pytest.mark.parametrize("device", [2, -1, [0, 5], True, "0", [0, "1"], 1.0, [], ()])
def test_bad_device_raises_valueerror_and_changes_nothing(fresh, device):
    with pytest.raises(ValueError, match="device"):
        bridge.unify(cupy=False, torch=False, budget="1GiB", device=device)
    assert limits() == (0, 0)
    assert unify_mod.current() is None


def test_an_empty_list_of_devices_is_refused_naming_what_to_pass(fresh):
    """unify(device=[], budget=...) returned a Bridge of no device: the budget held
    nowhere, and the frameworks allocated on every device without one."""
    with pytest.raises(ValueError, match=r"^device=\[\]: name at least one device, or pass None$"):
        bridge.unify(cupy=False, torch=False, budget="1GiB", device=[])
    assert limits() == (0, 0) and unify_mod.current() is None


def test_numpys_integers_are_devices(fresh):
    """``device=np.int64(1)`` or ``np.arange(2)`` (np.where's indices): devices, as ints are;
    the array was refused saying its devices must be ints in [0, 2), which they were."""
    np = pytest.importorskip("numpy")
    assert bridge.unify(cupy=False, torch=False, budget="1GiB", device=np.int64(1)).devices == (1,)
    assert limits() == (0, GIB)
    with pytest.warns(UserWarning, match=r"device 1: 1\.00 GiB -> 2\.00 GiB\)"):
        b = bridge.unify(cupy=False, torch=False, budget="2GiB", device=np.arange(2))
    assert b.devices == (0, 1) and limits() == (2 * GIB, 2 * GIB)
    assert bridge.pool(np.int64(1)) is bridge.pool(1)
    assert bridge.stats(np.int32(1)).device == 1
    with pytest.raises(ValueError, match=r"every device must be an int in \[0, 2\)"):
        bridge.unify(cupy=False, torch=False, device=np.array([0, 2]))


@pytest.mark.parametrize("flag", ["cupy", "torch", "jax", "numba", "rmm", "peer_access"])
def test_flags_must_be_bool(fresh, flag):
    kwargs = {"cupy": False, "torch": False, flag: "yes"}
    with pytest.raises(ValueError, match=flag):
        bridge.unify(**kwargs)
    assert unify_mod.current() is None


def test_peer_access_is_granted_between_devices(fresh):
    before = [fresh.standin_access_grants(d) for d in (0, 1)]
    bridge.unify(cupy=False, torch=False)
    assert [fresh.standin_access_grants(d) - before[d] for d in (0, 1)] == [1, 1]


def test_a_device_added_by_a_later_call_and_the_earlier_one_read_each_other(fresh):
    """unify(device=0) then unify(device=1): both pools granted to the peer, as after
    unify(device=[0, 1]) (a kernel of one device reading the other's array faulted)."""
    before = [fresh.standin_access_grants(d) for d in (0, 1)]
    bridge.unify(cupy=False, torch=False, device=0)
    assert [fresh.standin_access_grants(d) - before[d] for d in (0, 1)] == [0, 0]  # alone
    assert bridge.unify(cupy=False, torch=False, device=1).devices == (0, 1)
    assert [fresh.standin_access_grants(d) - before[d] for d in (0, 1)] == [1, 1]


# ---- frameworks ----
@pytest.mark.parametrize("name", ["jax", "cupy", "torch", "numba", "rmm"])
def test_framework_not_installed_raises_bridgeerror_saying_how_to_fix(fresh, not_installed, name):
    not_installed(name)
    flags = {"cupy": False, "torch": False, "jax": False, name: True}
    with pytest.raises(BridgeError) as info:
        bridge.unify(**flags)
    msg = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert f"{name} is not installed" in msg
    # packages that exist, one CUDA major per command (no 'bridge[...]' that finds nothing)
    assert "bridge[" not in msg
    assert "for CUDA 13: pip install " in msg and "for CUDA 12: pip install " in msg
    assert "pip install -e '.[cuda13]'" in msg
    assert f"{name}=False" in msg
    # the way out works
    b = bridge.unify(cupy=False, torch=False, jax=False)
    assert name not in b.frameworks


def test_missing_frameworks_are_named_in_one_error(fresh, not_installed):
    not_installed("cupy", "torch")
    with pytest.raises(BridgeError) as info:
        bridge.unify(cupy=True, torch=True, budget="1GiB")
    msg = str(info.value)
    assert msg.startswith("bridge.unify(torch=True, cupy=True): torch and cupy are not installed")
    assert (
        "for CUDA 13: pip install torch cupy-cuda13x; for CUDA 12: pip install cupy-cuda12x "
        "and pip install torch --index-url https://download.pytorch.org/whl/cu129" in msg
    )
    assert "pass torch=False, cupy=False" in msg
    assert limits() == (0, 0) and unify_mod.current() is None  # nothing changed


@pytest.fixture
def fails_to_import(monkeypatch, tmp_path):
    """Makes a framework installed (found) whose import fails, as a CuPy built for CUDA
    libraries that are missing fails."""

    def broken(name):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"raise ImportError('{name} failed to load libnvrtc.so.12')\n"
        )
        for mod in list(sys.modules):
            if mod.split(".")[0] == name or mod == f"bridge.adapters.{name}":
                monkeypatch.delitem(sys.modules, mod)
        monkeypatch.syspath_prepend(str(tmp_path))

    return broken


@pytest.mark.parametrize(
    "given, call", [({}, "bridge.unify()"), ({"cupy": True}, "bridge.unify(cupy=True)")]
)
def test_an_installed_framework_that_fails_to_import_is_not_called_missing(
    fresh, fails_to_import, given, call
):
    """A bare unify() with a broken CuPy said "bridge.unify(cupy=True): cupy is not
    installed", and to leave it out, which the call had done."""
    fails_to_import("cupy")
    with pytest.raises(BridgeError) as info:
        bridge.unify(torch=False, budget="1GiB", **given)
    msg = str(info.value)
    assert msg.startswith(f"{call}: cupy is installed but importing it failed")
    assert "ImportError: cupy failed to load libnvrtc.so.12" in msg  # the import's error
    assert "not installed" not in msg and "leave it out" not in msg
    assert "for CUDA 13: pip install cupy-cuda13x" in msg and "pass cupy=False" in msg
    assert limits() == (0, 0) and unify_mod.current() is None  # nothing changed
    assert bridge.unify(cupy=False, torch=False).frameworks == frozenset()  # the way out


def test_bare_unify_sets_up_the_frameworks_that_are_installed(fresh, not_installed):
    not_installed("cupy", "torch")
    b = bridge.unify(budget="1GiB")  # neither installed: no error, the budget still holds
    assert b.frameworks == frozenset()
    assert limits() == (GIB, GIB)


def test_bare_unify_takes_an_installed_framework_and_skips_a_missing_one(
    fake_adapters, monkeypatch
):
    monkeypatch.setattr(unify_mod, "_installed", lambda name: name == "torch")
    b = bridge.unify()
    assert b.frameworks == frozenset({"torch"}) and fake_adapters == [("torch", (0, 1))]
    # the same frameworks named explicitly are the same call: nothing changes
    assert bridge.unify(torch=True, cupy=False) is b and len(fake_adapters) == 1


def test_an_explicit_true_for_a_missing_framework_stays_an_error(fresh, not_installed):
    not_installed("cupy")
    with pytest.raises(BridgeError, match="cupy is not installed"):
        bridge.unify(cupy=True)
    assert unify_mod.current() is None


def test_the_old_positional_form_still_works(fake_adapters):
    b = bridge.unify(True, False, False)
    assert b.frameworks == frozenset({"cupy"})


def test_frameworks_are_installed_once_in_order(fake_adapters):
    log = fake_adapters
    b = bridge.unify(cupy=True, torch=True, jax=True)
    assert log == [("jax", (0, 1)), ("torch", (0, 1)), ("cupy", (0, 1))]  # JAX first
    assert b.frameworks == frozenset({"cupy", "torch", "jax"})
    assert bridge.unify(cupy=True, torch=True, jax=True) is b
    assert len(log) == 3


def test_a_later_call_adds_a_framework(fake_adapters):
    log = fake_adapters
    b = bridge.unify(cupy=True, torch=False)
    assert b.frameworks == frozenset({"cupy"}) and log == [("cupy", (0, 1))]
    assert bridge.unify(cupy=True, torch=True) is b
    assert b.frameworks == frozenset({"cupy", "torch"})
    assert log == [("cupy", (0, 1)), ("torch", (0, 1))]  # cupy not installed twice
    assert "frameworks=[cupy, torch]" in repr(b)


def test_adapter_refusal_is_not_recorded_as_installed(fresh, monkeypatch):
    class TooLate:
        def install(self, devices, **kw):
            raise BridgeError("call bridge.unify(torch=True) before the first CUDA tensor")

    monkeypatch.setattr(unify_mod, "_adapter", lambda name: TooLate())
    with pytest.raises(BridgeError, match="before the first CUDA tensor"):
        bridge.unify(cupy=False, torch=True)
    b = bridge.unify(cupy=False, torch=False)
    assert "torch" not in b.frameworks


_STARTED_TORCH = {
    "torch/__init__.py": "from torch import cuda, version\n__version__ = '2.13.0'\n",
    "torch/version.py": "cuda = '13.0'\nhip = None\n",
    "torch/cuda/__init__.py": (
        "def is_initialized():\n    return True\n\n\ndef is_available():\n    return True\n"
    ),
}


def test_a_torch_that_started_cuda_is_refused_before_a_share_is_joined(standin, tmp_path):
    """unify(torch=True, share=...) after torch started CUDA: refused before anything
    changes. The share was joined first and stayed joined (its budget applying, another
    budget refused) and ipc=True's pools stayed made, though the call "changed nothing"."""
    for rel, text in _STARTED_TORCH.items():  # a CUDA torch that has started CUDA
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    script = textwrap.dedent("""
        import json
        import bridge
        from bridge._runtime import core
        try:
            bridge.unify(cupy=False, torch=True, budget="1GiB", share="late", ipc=True)
        except bridge.BridgeError as e:
            error = str(e)
        print(json.dumps({
            "error": error, "share": bridge.stats(0).share, "limit": bridge.pool(0).get_limit(),
            "ipc": core.ipc_enabled(0),
            "again": str(bridge.unify(cupy=False, torch=False, budget="2GiB").devices),
        }))
    """)
    out = _run(script, PYTHONPATH=str(tmp_path))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["error"].startswith("call bridge.unify(torch=True) before the first CUDA tensor")
    assert got["share"] is None and got["limit"] == 0 and got["ipc"] is False
    assert got["again"] == "(0, 1)"  # another budget: no share's in the way


# ---- start-up failures, in a fresh process ----
def _run(script: str, **env) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env)
    return subprocess.run(
        [sys.executable, "-c", script], env=e, capture_output=True, text=True, timeout=120
    )


def test_no_driver_raises_bridgeerror_with_a_clear_message():
    missing = "/nonexistent/libcuda.so.1"
    out = _run("import bridge; print(bridge.stats())", BRIDGE_CUDA_LIBRARY=missing)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("bridge._errors.BridgeError: ")
    assert "no usable CUDA driver" in last
    assert missing in last  # what was tried
    assert "nvidia-smi" in last  # what to do
    assert "python -m bridge doctor" in last


def test_no_driver_import_still_works_and_unify_raises():
    script = textwrap.dedent("""
        import bridge
        try:
            bridge.unify(cupy=False, torch=False)
        except bridge.BridgeError as e:
            print("BridgeError:", e)
    """)
    out = _run(script, BRIDGE_CUDA_LIBRARY="/nonexistent/libcuda.so.1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("BridgeError:") and "no usable CUDA driver" in out.stdout


def test_no_gpu_raises_bridgeerror(standin):
    script = textwrap.dedent("""
        import bridge
        try:
            bridge.unify(cupy=False, torch=False)
        except bridge.BridgeError as e:
            print("BridgeError:", e)
    """)
    out = _run(script, BRIDGE_STANDIN_DEVICES="0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("BridgeError:")
    assert "no CUDA device" in out.stdout and "CUDA_VISIBLE_DEVICES" in out.stdout


def test_driver_without_memory_pools_raises_bridgeerror(standin):
    script = textwrap.dedent("""
        import ctypes, os
        import bridge
        from bridge import _runtime
        _runtime.ensure_driver()
        ctypes.CDLL(os.environ["BRIDGE_CUDA_LIBRARY"]).standin_set_pools_supported(0, 0)
        try:
            bridge.unify(cupy=False, torch=False, device=0)
        except bridge.BridgeError as e:
            print("BridgeError:", e)
        b = bridge.unify(cupy=False, torch=False, device=1)  # the other device is fine
        print(b.devices)
    """)
    out = _run(script)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("BridgeError:") and "memory pools" in lines[0]
    assert "driver" in lines[0] and "on device 0" in lines[0]
    assert lines[1] == "(1,)"


def test_a_bad_bridge_torch_pluggable_is_refused_before_anything_changes(standin, monkeypatch):
    import bridge

    monkeypatch.setenv("BRIDGE_TORCH_PLUGGABLE", "yes")
    with pytest.raises(ValueError, match="BRIDGE_TORCH_PLUGGABLE='yes' is not 0 or 1"):
        bridge.unify(cupy=False, torch=True, budget="1GiB")
    assert bridge.pool(0).get_limit() == 0  # the budget was not applied: nothing changed
    # torch left out: the variable is not read
    assert bridge.unify(cupy=False, torch=False).frameworks == frozenset()
