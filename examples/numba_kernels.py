# SPDX-License-Identifier: Apache-2.0
"""Numba kernels and CuPy arrays on one pool and one budget.

Run on a GPU machine with numba-cuda and CuPy:  python examples/numba_kernels.py

What to look at: Numba's arrays are counted as ``numba`` next to CuPy's; a
request past the budget raises Numba's own CudaAPIError (out of memory), with
the bridge's message, and the batch is halved; memory CuPy frees is what
Numba gets next.
"""

from __future__ import annotations

import sys

import bridge

try:
    bridge.unify(cupy=True, torch=False, numba=True, budget="4GiB")
except bridge.BridgeError as exc:  # no GPU or driver, a framework missing: one line
    sys.exit(f"numba_kernels.py: {exc}")

import cupy  # noqa: E402
import numpy as np  # noqa: E402

if not hasattr(np, "row_stack"):  # numba-cuda 0.30 with numpy 2.5: see docs/numba.md
    np.row_stack = np.vstack

from numba import cuda  # noqa: E402
from numba.cuda.cudadrv.driver import CudaAPIError  # noqa: E402

GIB = 1 << 30


@cuda.jit
def scale(x, a, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a * x[i]


def show(when: str) -> None:
    by = bridge.stats(0).by_framework
    print(f"{when:<28} numba {by['numba'] / GIB:5.2f} GiB   cupy {by['cupy'] / GIB:5.2f} GiB")


# CuPy preprocessing holds 2 GiB, then lets it go
staged = cupy.random.random(GIB // 4, dtype=cupy.float64)  # 2 GiB
host = cupy.asnumpy(staged[: 1 << 20]).astype(np.float32)
show("CuPy holds its batch")
del staged
show("CuPy freed it")


# Numba takes over the same budget: the largest pair of arrays that fits
def largest_pair(n: int) -> tuple:
    """Two float32 arrays of n elements, halving n until both fit the budget."""
    while n:
        x = out = None  # the last try's arrays go back before the next try
        try:
            x = cuda.device_array(n, dtype=np.float32)
            out = cuda.device_array_like(x)
            return n, x, out
        except CudaAPIError as exc:
            msg = str(exc)[:100]
        x = out = None
        held = bridge.stats(0).by_framework["numba"]
        print(f"{n * 4 / GIB:.2f} GiB per array does not fit (Numba holds {held / GIB:.2f} "
              f"GiB after the try): {msg}...")  # fmt: skip
        n //= 2
    raise SystemExit("not even one element fits the budget")


n, x, out = largest_pair(1 << 30)  # 4 GiB in and 4 GiB out: too much for the budget
x[: host.size].copy_to_device(host)
scale[(n + 255) // 256, 256](x, np.float32(2.0), out)
show(f"Numba: 2 x {n * 4 / GIB:.2f} GiB")
assert np.allclose(out[: host.size].copy_to_host(), 2 * host)
del x, out
show("Numba freed its arrays")
print("ok")
