# SPDX-License-Identifier: Apache-2.0
# gpu-test: alone (holds most of the device)
"""CuPy, PyTorch and JAX in one process on one pool and one budget (H200).
(Run by scripts/gpu-test.)"""

from __future__ import annotations

import pytest
from gpu_util import GIB, MIB, THRESHOLD, driver_pool_attr

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def fw():
    cupy = pytest.importorskip("cupy")
    torch = pytest.importorskip("torch")
    pytest.importorskip("jax")
    import bridge

    b = bridge.unify(cupy=True, torch=True, jax=True)
    assert b.frameworks == {"cupy", "torch", "jax"}
    import jax
    import jax.numpy as jnp

    yield cupy, torch, jax, jnp
    bridge.pool(0).set_limit(0)


@pytest.fixture
def fresh(fw):
    import bridge

    cupy, torch, jax, jnp = fw
    bridge.pool(0).set_limit(0)
    torch.cuda.synchronize()
    yield fw
    bridge.pool(0).set_limit(0)
    torch.cuda.synchronize()


def test_release_threshold_survives_jax_start(fresh):
    import bridge

    assert driver_pool_attr(THRESHOLD) == bridge.pool(0).release_threshold == 2**64 - 1


def test_cupy_frees_80_gib_and_torch_gets_80_gib(fresh):
    cupy, torch, jax, jnp = fresh
    a = cupy.ones(80 * GIB, dtype=cupy.uint8)
    assert int(a[-1]) == 1
    del a
    cupy.cuda.Device().synchronize()
    t = torch.ones(80 * GIB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    used_gib = (total - free) / GIB
    assert int(t[-1].item()) == 1
    assert used_gib < 100, f"device used {used_gib:.1f} GiB: memory was not shared"
    del t
    torch.cuda.synchronize()


def test_jax_bytes_count_against_the_budget(fresh):
    import bridge

    cupy, torch, jax, jnp = fresh
    bridge.pool(0).free_all_blocks()
    base = bridge.stats(0).used
    bridge.pool(0).set_limit(base + 6 * GIB)
    x = jnp.ones((GIB,), dtype=jnp.float32)  # 4 GiB held by JAX
    x.block_until_ready()
    s = bridge.stats(0)
    assert s.by_framework["jax"] >= 4 * GIB
    with pytest.raises(RuntimeError) as info:
        torch.empty(3 * GIB, dtype=torch.uint8, device="cuda")
    assert str(info.value).startswith("CUDA out of memory.")
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
        cupy.empty(3 * GIB, dtype=cupy.uint8)
    t = torch.empty(1 * GIB, dtype=torch.uint8, device="cuda")
    assert t.numel() == GIB
    del t, x


def test_jax_oom_stays_resource_exhausted(fresh):
    cupy, torch, jax, jnp = fresh
    with pytest.raises(Exception) as info:
        jnp.ones((200 * GIB // 4,), dtype=jnp.float32).block_until_ready()
    assert "RESOURCE_EXHAUSTED" in str(info.value)


def test_stats_show_every_framework(fresh):
    import bridge

    cupy, torch, jax, jnp = fresh
    a = cupy.ones(64 * MIB, dtype=cupy.uint8)
    t = torch.ones(32 * MIB, dtype=torch.uint8, device="cuda")
    x = jnp.ones((16 * MIB // 4,), dtype=jnp.float32)
    x.block_until_ready()
    by = bridge.stats(0).by_framework
    assert by["cupy"] >= 64 * MIB and by["torch"] >= 32 * MIB and by["jax"] >= 16 * MIB
    del a, t, x


def test_dlpack_handoff_cupy_to_torch_is_zero_copy(fresh):
    cupy, torch, jax, jnp = fresh
    a = cupy.arange(1 << 20, dtype=cupy.float32)
    t = torch.from_dlpack(a)
    assert t.data_ptr() == a.data.ptr
    del a
    assert float(t[-1].item()) == float((1 << 20) - 1)
