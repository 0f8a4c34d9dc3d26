# SPDX-License-Identifier: Apache-2.0
"""RMM (and what is built on it) on the shared pool, beside torch.

Run on a GPU machine with RMM, CuPy and torch:  python examples/rmm_buffers.py

What to look at: ``rmm.DeviceBuffer`` and RMM-backed CuPy arrays (the way
cuDF and cuML allocate) are counted as ``rmm``, torch's tensors as ``torch``,
under one budget; past it RMM raises its usual MemoryError with the bridge's
message.
"""

from __future__ import annotations

import sys

import bridge

try:
    bridge.unify(cupy=False, torch=True, rmm=True, budget="6GiB")
except bridge.BridgeError as exc:  # no GPU or driver, a framework missing: one line
    sys.exit(f"rmm_buffers.py: {exc}")

import cupy  # noqa: E402
import rmm  # noqa: E402
import torch  # noqa: E402
from rmm.allocators.cupy import rmm_cupy_allocator  # noqa: E402

GIB = 1 << 30


def show(when: str) -> None:
    by = bridge.stats(0).by_framework
    print(f"{when:<30} rmm {by['rmm'] / GIB:5.2f} GiB   torch {by['torch'] / GIB:5.2f} GiB")


cupy.cuda.set_allocator(rmm_cupy_allocator)  # CuPy through RMM, as RAPIDS sets it up
buf = rmm.DeviceBuffer(size=GIB)
table = cupy.arange(GIB // 8, dtype=cupy.float64)  # 1 GiB, RMM-backed
show("RMM buffer and a CuPy column")
weights = torch.randn(GIB // 4, device="cuda")  # 1 GiB
show("torch joins")
try:
    rmm.DeviceBuffer(size=4 * GIB)
except MemoryError as exc:
    print(f"RMM refused 4 GiB: {str(exc)[:160]}...")
total = float(table.sum())
del buf, table
show("RMM's memory freed")
more = torch.empty(4 * GIB, dtype=torch.uint8, device="cuda")  # fits now
show("torch uses what RMM freed")
assert total == float((GIB // 8) * (GIB // 8 - 1) // 2)
print("ok")
