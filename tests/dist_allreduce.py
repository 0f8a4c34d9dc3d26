# SPDX-License-Identifier: Apache-2.0
"""One torchrun rank: bridge on its own device, NCCL all-reduce on bridge tensors.

Run by tests/gpu/test_gpu_multi.py as `torchrun --nproc_per_node 2 tests/dist_allreduce.py OUTDIR`.
"""

from __future__ import annotations

import json
import os
import sys

import bridge

rank = int(os.environ["LOCAL_RANK"])
world = int(os.environ["WORLD_SIZE"])
bridge.unify(cupy=True, torch=True, device=rank)  # before torch starts CUDA

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from cuda.bindings import driver as cu  # noqa: E402

from bridge._runtime import core  # noqa: E402

torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
t = torch.full((1 << 20,), float(rank + 1), device="cuda")
rc, size, dev, tag = core.lookup(t.data_ptr())
dist.all_reduce(t)
torch.cuda.synchronize()
expected = float(world * (world + 1) // 2)
others_active = []
for other in range(torch.cuda.device_count()):
    if other != rank:
        err, flags, active = cu.cuDevicePrimaryCtxGetState(other)
        others_active.append(int(active))
result = {
    "rank": rank,
    "sum_ok": bool((t == expected).all().item()),
    "ledger": [rc, size, dev, tag],
    "torch_bytes": bridge.stats(rank).by_framework["torch"],
    "other_devices_active": others_active,
    "bridge_devices": list(bridge.unify(cupy=True, torch=True, device=rank).devices),
}
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
