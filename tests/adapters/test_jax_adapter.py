# SPDX-License-Identifier: Apache-2.0
"""bridge.adapters.jax: conflicts and call order (CPU), partition and order on a GPU."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from bridge import BridgeError
from bridge.adapters import jax as adapter


@pytest.fixture
def clean_env(monkeypatch):
    for var in (
        "XLA_PYTHON_CLIENT_ALLOCATOR",
        "XLA_PYTHON_CLIENT_PREALLOCATE",
        "XLA_PYTHON_CLIENT_MEM_FRACTION",
    ):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_no_conflict_on_a_clean_environment(clean_env):
    assert adapter._conflicts(None) == []


@pytest.mark.parametrize(
    "var,value",
    [
        ("XLA_PYTHON_CLIENT_ALLOCATOR", "platform"),
        ("XLA_PYTHON_CLIENT_ALLOCATOR", "bfc"),
        ("XLA_PYTHON_CLIENT_PREALLOCATE", "true"),
    ],
)
def test_conflicting_settings_are_named(clean_env, var, value):
    clean_env.setenv(var, value)
    problems = adapter._conflicts(None)
    assert len(problems) == 1 and var in problems[0] and value in problems[0]


def test_settings_that_agree_are_not_conflicts(clean_env):
    clean_env.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "cuda_async")
    clean_env.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    assert adapter._conflicts(None) == []


@pytest.mark.parametrize("value", ["false", "False", "0"])
def test_no_preallocation_as_jax_reads_it_is_no_conflict(clean_env, value):
    """jaxlib reads XLA_PYTHON_CLIENT_PREALLOCATE "false", "False" and "0" as no
    preallocation (jaxlib/xla_client.py, jax 0.11): "0" was refused as a conflict, saying
    JAX would reserve most of the GPU, and unify(jax=True) did not start."""
    clean_env.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", value)
    assert adapter._conflicts(None) == []


def test_partition_refuses_the_async_allocator(clean_env):
    clean_env.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "cuda_async")
    assert "BFC" in adapter._conflicts(1 << 30)[0]


def test_install_reports_conflicts_and_changes_nothing(standin, clean_env):
    clean_env.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    with pytest.raises(BridgeError, match="XLA_PYTHON_CLIENT_ALLOCATOR=platform"):
        adapter.install([0])
    import os

    assert os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] == "platform"
    assert not adapter.installed()


def _run(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.gpu
def test_unify_after_jax_started_says_before():
    r = _run("""
        import jax, bridge
        jax.devices()
        try:
            bridge.unify(cupy=False, torch=False, jax=True)
        except bridge.BridgeError as e:
            print("ERR", e)
        """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("ERR") and "before" in r.stdout


@pytest.mark.gpu
def test_hard_partition_gives_jax_its_own_arena():
    r = _run("""
        import bridge
        GIB = 1 << 30
        bridge.unify(cupy=False, torch=True, jax=True, budget="20GiB", jax_memory="4GiB")
        import os, jax.numpy as jnp, torch
        print("ALLOC", os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR"))
        print("LIMIT", bridge.stats().limit // GIB)
        x = jnp.ones((GIB // 4,), dtype=jnp.float32); x.block_until_ready()   # 1 GiB in JAX's arena
        print("JAXPOOL", bridge.stats().by_framework["jax"])
        try:
            jnp.ones((6 * GIB // 4,), dtype=jnp.float32).block_until_ready()  # past its 4 GiB
            print("JAXBIG ok")
        except Exception as e:
            print("JAXBIG", "RESOURCE_EXHAUSTED" in str(e))
        t = torch.empty(15 * GIB, dtype=torch.uint8, device="cuda")
        print("TORCH", t.numel() // GIB)
        """)
    assert r.returncode == 0, r.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in r.stdout.strip().splitlines())
    assert out["ALLOC"] == "None"
    assert out["LIMIT"] == "16"  # 20 GiB budget less JAX's 4 GiB
    assert out["JAXPOOL"] == "0"  # JAX's arena is not in the shared pool
    assert out["JAXBIG"] == "True"  # capped by XLA: RESOURCE_EXHAUSTED
    assert out["TORCH"] == "15"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["native", "bridge"])
def test_a_partition_beside_xla_client_mem_fraction_is_jax_s_arena(mode):
    """A user's XLA_CLIENT_MEM_FRACTION (the name JAX documents now, read before the older
    XLA_PYTHON_CLIENT_MEM_FRACTION): jax_memory="4GiB" still gives JAX a 4 GiB arena. The
    native half: JAX alone with that fraction under that name gets the same arena."""
    import os

    code = f"""
        import ctypes, os
        GIB = 1 << 30
        if {mode!r} == "bridge":
            os.environ["XLA_CLIENT_MEM_FRACTION"] = "0.9"  # the user's
            import bridge
            bridge.unify(cupy=False, torch=False, jax=True, jax_memory="4GiB")
        else:
            cu = ctypes.CDLL("libcuda.so.1")
            dev, total = ctypes.c_int(), ctypes.c_size_t()
            assert cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
            assert cu.cuDeviceTotalMem_v2(ctypes.byref(total), dev) == 0
            os.environ["XLA_CLIENT_MEM_FRACTION"] = f"{{4 * GIB / total.value:.6f}}"
        import jax
        print("LIMIT", jax.devices("gpu")[0].memory_stats()["bytes_limit"])
        """
    r = _run(code, env={k: v for k, v in os.environ.items() if "XLA_" not in k})
    assert r.returncode == 0, r.stderr[-3000:]
    limit = int(r.stdout.split("LIMIT ", 1)[1].split()[0])
    assert abs(limit - (4 << 30)) < 64 << 20, limit


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["native", "bridge"])
def test_jax_keeps_the_allocator_it_started_with_after_clear_backends(mode):
    """JAX reads XLA_PYTHON_CLIENT_* once, when its plugins register at its first start, and
    keeps them after jax.extend.backend.clear_backends(). Native half: the premise (JAX
    restarted with cuda_async asked for keeps its preallocated BFC arena, bytes_limit > 0;
    under cuda_async it is 0). Bridge half: unify(jax=True) then says so instead of counting
    JAX as shared."""
    import os

    code = f"""
        import os
        import jax, jax.numpy as jnp
        jnp.zeros((1,)).block_until_ready()  # JAX's own allocator (BFC)
        from jax.extend.backend import clear_backends
        clear_backends()
        if {mode!r} == "bridge":
            import bridge
            try:
                bridge.unify(cupy=False, torch=False, jax=True)
                print("OK")
            except bridge.BridgeError as e:
                print("ERR", e)
        else:
            os.environ.update(XLA_PYTHON_CLIENT_ALLOCATOR="cuda_async",
                              XLA_PYTHON_CLIENT_PREALLOCATE="false")
            jnp.zeros((1,)).block_until_ready()
            print("LIMIT", jax.devices("gpu")[0].memory_stats()["bytes_limit"])
        """
    r = _run(code, env={k: v for k, v in os.environ.items() if "XLA_" not in k})
    assert r.returncode == 0, r.stderr[-3000:]
    if mode == "native":
        assert int(r.stdout.split("LIMIT ", 1)[1].split()[0]) > 0, r.stdout
    else:
        assert r.stdout.startswith("ERR"), r.stdout
        assert "keeps the allocator settings it read then" in r.stdout
