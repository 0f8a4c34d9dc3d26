# SPDX-License-Identifier: Apache-2.0
"""Loading the driver (bridge/_native/driver.c) on the stand-in: what a user sees when the
driver is too old, when no GPU is visible, and a fork made while another thread starts it.

Each case runs in a child process: the driver is loaded once per process.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import sysconfig
import textwrap

import pytest

HERE = pathlib.Path(__file__).resolve().parent.parent


def _run(code: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ)
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full,
    )


UNIFY = """
    import bridge
    try:
        bridge.unify()
    except bridge.BridgeError as e:
        print(e)
    else:
        print("started")
"""


@pytest.fixture(scope="module")
def old_driver(tmp_path_factory) -> pathlib.Path:
    """The stand-in without cuGraphRetainUserObject, as a driver older than CUDA 11.3."""
    if "BRIDGE_CUDA_LIBRARY" not in os.environ or os.environ.get("BRIDGE_TEST_GPU") == "1":
        pytest.skip("stand-in driver test; this is a GPU run")
    out = tmp_path_factory.mktemp("old-driver")
    script = out / "hide.map"
    script.write_text("{ global: *; local: cuGraphRetainUserObject; };\n")
    lib = out / "libold_cuda.so"
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    subprocess.run(
        cc.split()
        + ["-O1", "-shared", "-fPIC", "-o", str(lib), str(HERE / "standin" / "standin_cuda.c")]
        + ["-lpthread", f"-Wl,--version-script={script}"],
        check=True,
    )
    return lib


def test_a_driver_too_old_is_named_with_what_to_do(standin, old_driver):
    """Issue: a libcuda without an entry point the bridge needs gave "lacks a driver entry
    point the bridge needs (driver too old?)": no entry point named, no version, nothing
    to do but "run on a machine with an NVIDIA GPU", which the user has."""
    r = _run(UNIFY, BRIDGE_CUDA_LIBRARY=str(old_driver))
    assert r.returncode == 0, r.stderr
    msg = r.stdout
    assert "lacks the entry point cuGraphRetainUserObject" in msg, msg
    assert "(a CUDA 13.0 driver)" in msg, msg  # the stand-in's cuDriverGetVersion
    assert "update the NVIDIA driver to one for CUDA 12 or newer" in msg, msg
    assert "run on a machine with an NVIDIA GPU" not in msg.lower(), msg  # it has one


def test_no_driver_library_says_to_run_where_there_is_one(standin, tmp_path):
    r = _run(UNIFY, BRIDGE_CUDA_LIBRARY=str(tmp_path / "libcuda.so.1"))
    assert r.returncode == 0, r.stderr
    msg = r.stdout
    assert "no usable CUDA driver" in msg and "cannot open shared object file" in msg, msg
    assert "run on a machine with an NVIDIA GPU and its driver" in msg, msg


@pytest.mark.parametrize("visible", [None, "", "-1"])
def test_no_visible_gpu_says_so_and_names_cuda_visible_devices(standin, visible):
    """Issue: with CUDA_VISIBLE_DEVICES hiding every GPU the driver's cuInit fails with
    CUDA_ERROR_NO_DEVICE, and the bridge said only "cuInit failed: CUDA_ERROR_NO_DEVICE
    (code 100)" and to run on a machine with a GPU."""
    code = textwrap.dedent(
        """
        import ctypes, os
        ctypes.CDLL(os.environ["BRIDGE_CUDA_LIBRARY"]).standin_fail(b"cuInit", 100, 1)
        """
    ) + textwrap.dedent(UNIFY)
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert r.returncode == 0, r.stderr
    msg = r.stdout
    assert "CUDA_ERROR_NO_DEVICE (code 100)" in msg, msg
    if visible is None:
        assert "the driver sees no GPU in this machine or container" in msg, msg
    else:
        assert f'CUDA_VISIBLE_DEVICES="{visible}" leaves no GPU visible' in msg, msg
        assert "unset it or name GPUs that `nvidia-smi -L` lists" in msg, msg


def test_a_fork_while_another_thread_starts_the_driver_never_hangs(standin):
    """Issue: a child forked while another thread was inside bridge_init (cuInit takes
    seconds on a machine of many GPUs) inherited the held load lock, and its first call
    (unify, stats) hung forever.  The child now refuses as any fork child of a process that
    started CUDA does: the driver's state it inherited is unknown."""
    r = _run(
        """
        import os, sys, threading, time
        from bridge._runtime import core
        from bridge._errors import Status
        lib = os.environ["BRIDGE_CUDA_LIBRARY"]
        t = threading.Thread(target=core.init, args=(lib,))
        t.start()
        time.sleep(0.3)  # inside the stand-in's cuInit, the load lock held
        pid = os.fork()
        if pid == 0:
            rc = core.init(lib)
            os._exit(0 if rc == Status.FORKED and core.forked() else 20 + rc)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            print("child hung")
            sys.exit(0)
        t.join()
        assert core.init(lib) == Status.OK and not core.forked()  # the parent goes on
        print("child exit", os.WEXITSTATUS(status))
        """,
        BRIDGE_STANDIN_INIT_DELAY_MS="1500",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "child exit 0", r.stdout


def test_a_fork_child_reading_a_pool_is_told_it_was_forked(standin):
    """Issue: in a fork child, a Pool of the parent's answered "the CUDA driver is not
    loaded yet; call bridge.unify() first" (stats, get_limit, set_limit), which unify()
    there refuses, and free_all_blocks "no such CUDA device ... or it is not set up". Each
    now says the process was forked and to use 'spawn'; the parent's block is freed
    without a word."""
    r = _run(
        """
        import os
        import bridge
        from bridge._runtime import core
        bridge.unify()
        pool = bridge.pool(0)
        block = pool.malloc(1 << 20)
        pid = os.fork()
        if pid == 0:
            calls = {
                "stats": pool.stats,
                "used_bytes": pool.used_bytes,
                "get_limit": pool.get_limit,
                "set_limit": lambda: pool.set_limit(1 << 30),
                "free_all_blocks": pool.free_all_blocks,
                "device_count": lambda: bridge._runtime.check(
                    core.device_count()[0], what="counting"
                ),
            }
            wrong = []
            for name, call in calls.items():
                try:
                    call()
                    wrong.append(f"{name}: no error")
                except bridge.BridgeError as e:
                    if "forked" not in str(e) or "'spawn'" not in str(e):
                        wrong.append(f"{name}: {e}")
            del block  # the parent's: nothing to free here, nothing raised
            print(wrong, flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
