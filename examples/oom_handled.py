# SPDX-License-Identifier: Apache-2.0
"""An out-of-memory handled gracefully: pressure callbacks, then a smaller batch.

Run on a GPU machine:  python examples/oom_handled.py

What to look at: the pressure callback runs before the bridge refuses a
request; the OOM message names the device, the request, the budget and what
each framework holds; the loop halves the batch and carries on.
"""

from __future__ import annotations

import sys

import bridge

try:
    bridge.unify(cupy=True, torch=True, budget="8GiB")
except bridge.BridgeError as exc:  # no GPU or driver, a framework missing: one line
    sys.exit(f"oom_handled.py: {exc}")

import cupy  # noqa: E402
import torch  # noqa: E402

GIB = 1 << 30
cache = [cupy.ones(2 * GIB, dtype=cupy.uint8)]  # something we can drop under pressure


@bridge.on_pressure
def drop_cache(device: int, nbytes: int) -> None:
    if cache:
        print(f"pressure on device {device} ({nbytes / GIB:.1f} GiB wanted): dropping a cache")
        cache.clear()


batch = 16
while batch:
    try:
        x = torch.empty(batch * GIB // 2, dtype=torch.uint8, device="cuda")
        print(f"batch {batch}: ok ({x.numel() / GIB:.1f} GiB)")
        break
    except RuntimeError as exc:
        if not str(exc).startswith("CUDA out of memory."):
            raise
        print(f"batch {batch}: {exc}")
        batch //= 2
print(bridge.stats())
