# SPDX-License-Identifier: Apache-2.0
"""Carving (BRIDGE_CACHE_CARVE=1: blocks carved from pool chunks) and segments
(BRIDGE_CACHE_SEGMENTS=1: carving with every emptied segment kept under the release rule)
on a real GPU. (scripts/gpu-test)

Every scenario runs in fresh processes with the native allocators (the power check), on
the bridge with carving on, and with segments on: ranges of a chunk handed out again only
in stream order, after the streams recorded against them, no two live blocks sharing
bytes, and CUDA graphs captured beside it.
"""

from __future__ import annotations

import pytest
from gpu_util import run_mode

pytestmark = pytest.mark.gpu
MODES = ("native", "carve", "segments")
ENV = {"carve": {"BRIDGE_CACHE_CARVE": "1"}, "segments": {"BRIDGE_CACHE_SEGMENTS": "1"}}


def run(code: str, mode: str) -> dict:
    return run_mode(code, "native" if mode == "native" else "bridge", env=ENV.get(mode))


TORCH_SETUP = """
import torch
if MODE == "bridge":
    import bridge
    bridge.unify(torch=True)
    from bridge._runtime import core
    assert core.stats(0)[1]["carve_on"] == 1
def raw(key):
    from bridge._runtime import core
    return core.stats(0)[1][key] if MODE == "bridge" else None
def carve_held():
    return raw("carve_held")
"""

RECORDED = (
    TORCH_SETUP
    + """
side = torch.cuda.Stream()
wrong = held = 0
for i in range(40):
    for n in (1 << 16, 1 << 20):  # 256 KiB (the small class) and 4 MiB floats
        keep = torch.ones(n, device="cuda")  # the chunk stays in use
        x = torch.full((n,), float(i), device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(3_000_000)  # the side stream is busy ...
            y = x * 2  # ... before it reads x
        x.record_stream(side)
        del x  # freed on the default stream while the side stream still reads it
        z = torch.full((n,), -7.0, device="cuda")  # x's bytes again, on the default stream
        torch.cuda.synchronize()
        wrong += int((y != 2 * i).sum()) + int((z != -7).sum())
        held = max(held, carve_held() or 0)  # while blocks are live (none is kept empty)
        del y, z, keep
report(wrong=wrong, held=held)
"""
)


@pytest.mark.parametrize("mode", MODES)
def test_a_block_used_on_another_stream_is_not_handed_out_before_that_streams_work(mode):
    out = run(RECORDED, mode)
    assert out["wrong"] == 0
    if mode != "native":
        assert out["held"] > 0  # the blocks were carved


CHURN = (
    TORCH_SETUP
    + """
import random
rng = random.Random(7)
live = {}
wrong = 0
hits0 = raw("num_cache_hits")
for step in range(3000):
    if live and (len(live) > 60 or rng.random() < 0.45):
        k = rng.choice(list(live))
        t, v = live.pop(k)
        wrong += int((t != v).sum())  # nothing else wrote its bytes
        del t
    else:
        n = rng.choice((rng.randrange(1, 4096), rng.randrange(4096, 1 << 18),
                        rng.randrange(1 << 18, 1 << 24)))
        v = step % 127
        live[step] = (torch.full((n,), v, dtype=torch.uint8, device="cuda"), v)
for t, v in live.values():
    wrong += int((t != v).sum())
hits = raw("num_cache_hits") - hits0 if MODE == "bridge" else None
report(wrong=wrong, hits=hits, held=carve_held())
"""
)


@pytest.mark.parametrize("mode", MODES)
def test_live_blocks_of_many_sizes_never_share_bytes(mode):
    out = run(CHURN, mode)
    assert out["wrong"] == 0
    if mode != "native":
        assert out["held"] > 0 and out["hits"] > 1000  # carved, mostly without a driver call


GRAPH = (
    TORCH_SETUP
    + """
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                            torch.nn.Linear(512, 64)).cuda()
x = torch.randn(32, 256, device="cuda")
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3):
        model(x)  # warm-up on a side stream, as torch's docs do
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    out = model(x)
diffs = []
for k in range(5):
    x.copy_(torch.randn(32, 256, device="cuda"))
    g.replay()
    ref = model(x)  # eager, beside the graph, carved on the bridge
    torch.cuda.synchronize()
    diffs.append(float((out - ref).abs().max()))
report(diff=max(diffs))
"""
)


@pytest.mark.parametrize("mode", MODES)
def test_a_captured_graph_replays_as_eager_beside_carved_blocks(mode):
    assert run(GRAPH, mode)["diff"] < 1e-5


CUPY = """
import cupy as cp
if MODE == "bridge":
    import bridge
    from bridge._runtime import core
    bridge.unify(cupy=True, torch=False)
held = 0
streams = [cp.cuda.Stream(non_blocking=True) for _ in range(3)]
wrong = 0
for rep in range(30):
    for k, s in enumerate([cp.cuda.Stream.null, *streams]):
        with s:
            for n in (1000, 1 << 18, 3 << 20):
                a = cp.full(n, rep * 4 + k, dtype=cp.int32)
                b = a * 2
                wrong += int((b != 2 * (rep * 4 + k)).sum())
                if MODE == "bridge":  # while a and b are live (no chunk is kept empty)
                    held = max(held, core.stats(0)[1]["carve_held"])
                del a, b
report(wrong=wrong, held=held if MODE == "bridge" else None)
"""


@pytest.mark.parametrize("mode", MODES)
def test_cupy_arrays_on_carved_blocks_and_on_its_own_streams_are_correct(mode):
    pytest.importorskip("cupy")
    out = run(CUPY, mode)
    assert out["wrong"] == 0
    if mode != "native":
        assert out["held"] > 0  # the default stream's arrays were carved
