# SPDX-License-Identifier: Apache-2.0
"""Segments (the default cache) at the edges a stand-in test found wrong on 9a0afa4, on a
real GPU. (scripts/gpu-test)

Each scenario runs in a fresh process with torch's native allocator (the power check: the
same code must pass there) and on the bridge with its defaults:

- at a tight budget, a request is served from a range of its own stream's segment that
  another thread freed (parked in that thread's slot), not refused while those bytes are
  idle (tests/core/test_segments.py's stand-in test of the same);
- with the cache turned off while blocks live (what ``unify(jax=True)`` does: XLA takes its
  memory from the pool itself), what torch frees goes back to the pool at once.
"""

from __future__ import annotations

import pytest
from gpu_util import run_mode

pytestmark = pytest.mark.gpu
MODES = ("native", "bridge")

TIGHT_BUDGET = """
import threading
import torch
MIB = 1 << 20
if MODE == "bridge":
    import bridge
    bridge.unify(torch=True)
    from bridge._runtime import core
    assert core.stats(0)[1]["carve_on"] == 1
    bridge.pool(0).set_limit(bridge.stats(0).used + 128 * MIB)
else:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 128 * MIB) / total)
n = 30 * MIB // 4  # 30 MiB of floats
parked, done = threading.Event(), threading.Event()

def other():
    a = torch.empty(n, device="cuda")  # bridge: the start of a 64 MiB segment
    del a  # freed by the thread that allocated it: parked in its slot, still carved
    parked.set()
    done.wait(120)

t = threading.Thread(target=other)
t.start()
assert parked.wait(120)
b = torch.full((n,), 1.0, device="cuda")  # bridge: beside a, in the same segment
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    c = torch.full((2 * n,), 2.0, device="cuda")  # 60 MiB on another stream
torch.cuda.synchronize()
try:
    d = torch.full((n,), 3.0, device="cuda")  # bridge: a's range, idle
    torch.cuda.synchronize()
    ok = True
    values = [x.min().item() for x in (b, c, d)] + [x.max().item() for x in (b, c, d)]
except RuntimeError as e:
    assert "out of memory" in str(e), e
    ok, values = False, []
done.set()
t.join()
report(ok=ok, values=values)
"""


@pytest.mark.parametrize("mode", MODES)
def test_at_a_tight_budget_a_range_of_the_streams_segment_serves_before_a_refusal(mode):
    out = run_mode(TIGHT_BUDGET, mode)
    assert out["ok"]  # 30 + 60 + 30 MiB live under 128 MiB: no out-of-memory error
    assert out["values"] == [1.0, 2.0, 3.0, 1.0, 2.0, 3.0]


CACHE_OFF = """
import torch
MIB = 1 << 20
if MODE == "bridge":
    import bridge
    bridge.unify(torch=True)
    from bridge._runtime import core
keep = [torch.ones(n, device="cuda") for n in (1024, 3 * MIB // 4, 40 * MIB // 4)]
torch.cuda.synchronize()
held_live = 0
if MODE == "bridge":
    held_live = core.stats(0)[1]["carve_held"]  # the blocks were carved
    core.set_cache(0, 0)  # what unify(jax=True) does (adapters/jax.py's _configure)
del keep
torch.cuda.synchronize()
report(
    reserved=torch.cuda.memory_reserved(),
    held_live=held_live,
    held=core.stats(0)[1]["carve_held"] if MODE == "bridge" else 0,
    cached=bridge.stats(0).cached if MODE == "bridge" else 0,
)
"""


@pytest.mark.parametrize("mode", MODES)
def test_with_the_cache_turned_off_freed_blocks_go_back_to_the_pool_at_once(mode):
    # native: torch with its caching off stands for the bridge's cache turned off
    env = {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"} if mode == "native" else None
    out = run_mode(CACHE_OFF, mode, env=env)
    assert out["reserved"] == 0 and out["cached"] == 0 and out["held"] == 0
    if mode == "bridge":
        assert out["held_live"] > 0
