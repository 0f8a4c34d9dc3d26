# SPDX-License-Identifier: Apache-2.0
"""Pinned staging buffers from one pool, shared without copies.

Run on a GPU machine:  python examples/pinned_staging.py

What to look at: the same host address in numpy, torch and JAX, the
host-to-device rate from a pooled pinned buffer, and the pinned pool's figures
(a freed buffer is reused, not re-pinned).
"""

from __future__ import annotations

import sys
import time

import numpy as np

import bridge

try:
    bridge.unify(cupy=True, torch=True, jax=True)
except bridge.BridgeError as exc:  # no GPU or driver, a framework missing: one line
    sys.exit(f"pinned_staging.py: {exc}")

import cupy  # noqa: E402
import jax  # noqa: E402
import torch  # noqa: E402

MIB = 1 << 20
n = 256 * MIB
dev = torch.empty(n, dtype=torch.uint8, device="cuda")  # torch's CUDA is up: is_pinned() answers

buf = bridge.pinned_buffer(n)
host = np.from_dlpack(buf)                 # numpy view, kDLCUDAHost
host[:] = np.arange(n, dtype=np.uint8)
t_host = torch.from_dlpack(buf)            # CPU tensor, pinned
j_host = jax.dlpack.from_dlpack(buf)       # JAX array in pinned_host memory
print("addresses:", hex(host.ctypes.data), hex(t_host.data_ptr()),
      hex(j_host.unsafe_buffer_pointer()))
print("torch sees pinned memory:", t_host.is_pinned())
assert host.ctypes.data == t_host.data_ptr() == j_host.unsafe_buffer_pointer() and t_host.is_pinned()

torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(10):
    dev.copy_(t_host, non_blocking=True)
torch.cuda.synchronize()
print(f"host to device: {10 * n / (time.perf_counter() - start) / 1e9:.1f} GB/s")
assert int(dev[-1].item()) == int(host[-1])

c = cupy.asarray(host)                     # CuPy copies from the pinned numpy view
assert int(c[12345]) == int(host[12345])

pp = bridge.pinned_pool()
print(f"pinned pool: used {pp.used_bytes() / MIB:.0f} MiB, total {pp.total_bytes() / MIB:.0f} MiB")
del host, t_host, j_host, buf
a = bridge.empty_pinned((n,), dtype=np.uint8)   # reuses the freed block
print(f"after reuse: used {pp.used_bytes() / MIB:.0f} MiB, total {pp.total_bytes() / MIB:.0f} MiB, "
      f"free blocks {pp.n_free_blocks()}")
