# SPDX-License-Identifier: Apache-2.0
"""JAX, PyTorch and CuPy in one process, one pool, one budget.

Run on a GPU machine:  python examples/jax_torch_cupy.py

What to look at: every framework's bytes in one table (JAX's included), and
torch being refused when JAX already holds most of the budget.
"""

from __future__ import annotations

import sys

import bridge

try:
    bridge.unify(cupy=True, torch=True, jax=True, budget="12GiB")
except bridge.BridgeError as exc:  # no GPU or driver, a framework missing: one line
    sys.exit(f"jax_torch_cupy.py: {exc}")

import cupy  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

GIB = 1 << 30


def table(title: str) -> None:
    s = bridge.stats()
    print(f"-- {title}: used {s.used / GIB:.2f} GiB of {s.limit / GIB:.2f} GiB")
    for name, nbytes in s.by_framework.items():
        print(f"   {name:<6} {nbytes / GIB:6.2f} GiB")


x = jnp.ones((2 * GIB // 4,), dtype=jnp.float32)       # 2 GiB in JAX
a = cupy.ones(3 * GIB, dtype=cupy.uint8)                # 3 GiB in CuPy
t = torch.ones(3 * GIB, dtype=torch.uint8, device="cuda")  # 3 GiB in torch
x.block_until_ready()
table("all three hold memory")

y = jnp.ones((3 * GIB // 4,), dtype=jnp.float32)       # JAX grows: 11 GiB in all
y.block_until_ready()
try:
    torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
except RuntimeError as exc:
    print("torch refused, as it should be:", str(exc).split(". ")[0] + ".")
del a
cupy.cuda.Device().synchronize()
t2 = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")  # fits once CuPy let go
table("after CuPy freed its array, torch got it")
