# SPDX-License-Identifier: Apache-2.0
# gpu-test: alone (fills most of the device)
"""Figures users read after an out-of-memory error, on a real GPU. (scripts/gpu-test)

Each scenario runs in fresh processes: with torch's own allocator (the power check:
the scenario is right and passes there) and on the bridge.
"""

from __future__ import annotations

import os

import pytest
from gpu_util import GIB, run_mode

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


# In a share, a tool that sizes itself by torch.cuda.mem_get_info (vLLM's
# gpu_memory_utilization, accelerate's device_map="auto") in one member must be told
# only what the share still gives it: the other members' memory is what refuses it.
HOLDER = """
import sys, torch
if MODE == "bridge":
    import bridge
    bridge.unify(cupy=False, torch=True, budget="8GiB", share=SHARE)
x = torch.empty(5 << 30, dtype=torch.uint8, device="cuda")
x.fill_(1)
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()
"""

SIZER = """
import torch
if MODE == "bridge":
    import bridge
    bridge.unify(cupy=False, torch=True, share=SHARE)  # adopts the share's budget
free, total = torch.cuda.mem_get_info()
y = torch.empty(int(free * 0.9), dtype=torch.uint8, device="cuda")  # 90% of what is free
y.fill_(2)
torch.cuda.synchronize()
report(free=free, total=total, got=y.numel())
"""


@pytest.mark.parametrize("mode", ["native", "bridge"])
def test_a_share_member_sizing_itself_by_free_memory_is_served(mode, tmp_path):
    import subprocess
    import sys
    import uuid

    name = "figures-" + uuid.uuid4().hex[:8]
    env = dict(os.environ, BRIDGE_SHARE_DIR=str(tmp_path))
    env.pop("BRIDGE_GPU_MEMORY_LIMIT", None)
    env.pop("BRIDGE_SHARE", None)
    head = f"MODE = {mode!r}\nSHARE = {name!r}\n"
    holder = subprocess.Popen(
        [sys.executable, "-c", head + HOLDER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        own = {"BRIDGE_SHARE_DIR": str(tmp_path), "BRIDGE_GPU_MEMORY_LIMIT": "", "BRIDGE_SHARE": ""}
        r = run_mode(f"SHARE = {name!r}\n" + SIZER, mode, env=own)
    finally:
        holder.kill()
        holder.wait(60)
    assert r["got"] > 0, r
    if mode == "bridge":
        assert r["total"] == 8 * GIB, r
        assert r["free"] <= 3 * GIB, r  # the share's 8 GiB less the holder's 5 GiB
