# SPDX-License-Identifier: Apache-2.0
"""CuPy preprocessing, then PyTorch training, on one pool under one budget.

Run on a GPU machine:  python examples/mixed_pipeline.py [OUT_DIR]

What to look at: the per-phase lines (CuPy's bytes go to zero and torch's
rise, while the pool's reserved bytes stay flat: torch reuses what CuPy
freed), and the timeline PNG, which shows the two frameworks trading memory.
"""

from __future__ import annotations

import pathlib
import sys

import bridge

# At program start, before the first CUDA array or tensor.
try:
    bridge.unify(cupy=True, torch=True, budget="60%")
except bridge.BridgeError as exc:  # no GPU or driver, a framework missing: one line
    sys.exit(f"mixed_pipeline.py: {exc}")

import cupy  # noqa: E402
import torch  # noqa: E402

GIB = 1 << 30


def show(phase: str) -> None:
    s = bridge.stats()
    fw = "  ".join(f"{k}={v / GIB:6.2f}" for k, v in s.by_framework.items())
    print(f"{phase:<28} used={s.used / GIB:6.2f} GiB  reserved={s.reserved / GIB:6.2f} GiB  "
          f"budget={s.limit / GIB:6.2f} GiB  | {fw}")


def preprocess(n_images: int) -> torch.Tensor:
    """CuPy: normalise a large raw batch, keep a small feature set, free the rest."""
    raw = cupy.random.random((n_images, 3, 256, 256), dtype=cupy.float32)  # ~24 GiB at 32k
    mean = raw.mean(axis=(0, 2, 3), keepdims=True)
    std = raw.std(axis=(0, 2, 3), keepdims=True)
    normed = (raw - mean) / std
    features = normed[:, :, ::16, ::16].reshape(n_images, -1).copy()  # small
    show("cupy: preprocessing")
    del raw, normed
    cupy.cuda.Device().synchronize()
    return torch.from_dlpack(features)  # zero-copy hand-off


def train(x: torch.Tensor, steps: int) -> float:
    """torch: a model whose activations need the memory CuPy just released."""
    model = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 8192), torch.nn.ReLU(),
                                torch.nn.Linear(8192, 8192), torch.nn.ReLU(),
                                torch.nn.Linear(8192, 10)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    y = torch.randint(0, 10, (x.shape[0],), device="cuda")
    big = torch.empty(int(20 * GIB), dtype=torch.uint8, device="cuda")  # e.g. a replay buffer
    loss = torch.tensor(0.0)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if step == 0:
            show("torch: training")
    del big
    return float(loss.item())


def main() -> None:
    out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    show("start")
    with bridge.record(interval=0.02) as rec:
        rec.mark("cupy")
        x = preprocess(32768)
        show("cupy: done, arrays freed")
        rec.mark("torch")
        loss = train(x, steps=20)
        show("torch: done")
    print(f"final loss {loss:.4f}")
    rec.to_csv(out / "mixed_pipeline.csv")
    try:
        png = rec.plot(out / "mixed_pipeline.png", title="CuPy preprocessing, then torch training")
        print(f"timeline: {png}")
    except ImportError as exc:
        print(f"no plot: {exc}")
    peak = max(s.used for s in rec.samples)
    print(f"peak pool use {peak / GIB:.2f} GiB for the whole pipeline "
          f"(CuPy's working set and torch's were never held at once)")


if __name__ == "__main__":
    main()
