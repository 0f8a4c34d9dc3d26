# SPDX-License-Identifier: Apache-2.0
"""Replay time of a captured training step: native torch vs the bridge.

A whole training step (forward, backward, optimizer step) of an MLP is
captured once with ``torch.cuda.graph`` (the documented whole-network
pattern) and replayed; each configuration runs in its own process, the two
taking turns, and the best round of each is compared.

    python benchmarks/bench_graph_replay.py [--rounds 5] [--replays 200] [--out FILE]

Prints JSON: the replay time per configuration and round, and the ratio
bridge / native of the best rounds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

WORKER = r"""
import sys, time
mode, replays = sys.argv[1], int(sys.argv[2])
if mode == "bridge":
    import bridge
    bridge.unify(cupy=False, torch=True)
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(*[m for _ in range(6)
                              for m in (torch.nn.Linear(2048, 2048), torch.nn.GELU())]).cuda()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(256, 2048, device="cuda")
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
opt.zero_grad(set_to_none=True)
with torch.cuda.graph(g):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
for _ in range(20):
    g.replay()
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(replays):
    g.replay()
torch.cuda.synchronize()
print((time.perf_counter() - t0) / replays * 1e6)
"""


def run(mode: str, replays: int) -> float:
    out = subprocess.run(
        [sys.executable, "-c", WORKER, mode, str(replays)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    times: dict[str, list[float]] = {"native": [], "bridge": []}
    for r in range(args.rounds):
        order = ("native", "bridge") if r % 2 == 0 else ("bridge", "native")
        for mode in order:
            times[mode].append(run(mode, args.replays))
    result = {
        "us_per_replay": times,
        "best": {m: min(v) for m, v in times.items()},
        "ratio_bridge_over_native": min(times["bridge"]) / min(times["native"]),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
