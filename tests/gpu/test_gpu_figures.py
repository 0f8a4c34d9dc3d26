# SPDX-License-Identifier: Apache-2.0
# gpu-test: alone (fills most of the device)
"""Figures users read after an out-of-memory error, on a real GPU. (scripts/gpu-test)

Each scenario runs in fresh processes: with torch's own allocator (the power check:
the scenario is right and passes there) and on the bridge.
"""

from __future__ import annotations

import pytest
from gpu_util import run_mode

pytestmark = pytest.mark.gpu

# A batch-size search (Lightning's BatchSizeFinder, accelerate's
# find_executable_batch_size) catches the OOM of a too-large step and reads the peak
# of what did fit: an allocation the device refused was never live.
PEAK_AFTER_OOM = """
import torch
if MODE == "bridge":
    import bridge
    bridge.unify(cupy=False, torch=True)  # no budget: the device itself refuses
free, total = torch.cuda.mem_get_info()
a = torch.empty(int(free * 0.6), dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
held = torch.cuda.memory_allocated()
peak0 = torch.cuda.max_memory_allocated()
try:
    b = torch.empty(int(free * 0.6), dtype=torch.uint8, device="cuda")
    oom = False
except torch.OutOfMemoryError:
    oom = True
report(oom=oom, held=held, peak0=peak0, peak=torch.cuda.max_memory_allocated(),
       stats_peak=torch.cuda.memory_stats()["allocated_bytes.all.peak"],
       allocated=torch.cuda.memory_allocated())
"""


@pytest.mark.parametrize("mode", ["native", "bridge"])
def test_an_allocation_the_device_refused_does_not_raise_torchs_peak(mode):
    r = run_mode(PEAK_AFTER_OOM, mode)
    assert r["oom"] is True, r
    assert r["held"] > 0 and r["allocated"] == r["held"], r
    assert r["peak"] == r["peak0"] == r["held"] == r["stats_peak"], r
