# SPDX-License-Identifier: Apache-2.0
"""Lightning on the shared pool: CuPy preprocessing in the DataModule, Trainer.fit, and
Tuner.scale_batch_size finding the largest batch that fits the bridge budget.

Run on a GPU machine:  python examples/lightning_fit.py [BUDGET]      (default 3GiB)

What to look at: CuPy's preprocessing (an FFT low-pass filter of raw signals) and torch's
training share one pool under one budget; the batch-size search ends where the *budget*
refuses memory, not at the GPU's 140 GiB (Lightning recognises the bridge's out-of-memory
error by its message, "CUDA out of memory."); the batch it finds fits, twice that does not.
"""

from __future__ import annotations

import gc
import logging
import sys
import tempfile
import warnings

import bridge

BUDGET = sys.argv[1] if len(sys.argv) > 1 else "3GiB"
if __name__ == "__main__":  # at program start, before anything can start CUDA in torch
    try:
        bridge.unify(torch=True, cupy=True, budget=BUDGET)
    except bridge.BridgeError as exc:  # no GPU or driver, a framework missing: one line
        sys.exit(f"lightning_fit.py: {exc}")

import cupy  # noqa: E402
import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.tuner import Tuner  # noqa: E402
from lightning.pytorch.utilities.memory import is_oom_error  # noqa: E402

N, RAW_LEN, SEQ, CHANNELS, CLASSES = 4096, 512, 128, 32, 10
GIB = 1 << 30


def preprocess_on_gpu(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """CuPy: raw signals, low-pass filtered with an FFT, down-sampled, standardised, labelled.

    Raw data, spectra and cuFFT's work areas (about 1 GiB at the peak) are freed
    here; what stays is the features (64 MiB), handed to torch without a copy (DLPack).
    """
    rs = cupy.random.RandomState(seed)
    y = rs.randint(0, CLASSES, size=n).astype(cupy.int64)
    raw = rs.standard_normal((n, RAW_LEN, CHANNELS), dtype=cupy.float32)
    # each signal's class shows as a level on one of the first CLASSES channels
    raw[:, :, :CLASSES] += cupy.eye(CLASSES, dtype=cupy.float32)[y][:, None, :]
    spec = cupy.fft.rfft(raw, axis=1)
    del raw
    spec[:, SEQ // 2 :, :] = 0  # keep the low frequencies
    smooth = cupy.fft.irfft(spec, n=RAW_LEN, axis=1)[:, :: RAW_LEN // SEQ, :]
    del spec
    x = (smooth - smooth.mean(axis=(0, 1))) / smooth.std(axis=(0, 1))
    x = cupy.ascontiguousarray(x, dtype=cupy.float32)
    del smooth
    # cuFFT plans keep a work area from the pool while cached: give it back for training
    cupy.fft.config.get_plan_cache().clear()
    return torch.from_dlpack(x), torch.from_dlpack(y)


class OnGpu(torch.utils.data.Dataset):
    """Tensors already on the GPU; a whole batch is one gather (DataLoader calls __getitems__)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.as_tensor(indices, device=self.x.device)
        return self.x[i], self.y[i]


def whole_batch(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch  # __getitems__ made the batch already


class SignalData(L.LightningDataModule):
    """The features, made on the GPU by CuPy once; ``batch_size`` is what the Tuner changes."""

    def __init__(self, batch_size: int = 32, n: int = N) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.n = n
        self.x: torch.Tensor | None = None
        self.y: torch.Tensor | None = None

    def setup(self, stage: str) -> None:
        if self.x is None:  # each fit calls setup: preprocess once
            self.x, self.y = preprocess_on_gpu(self.n)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        assert self.x is not None and self.y is not None
        return torch.utils.data.DataLoader(
            OnGpu(self.x, self.y),
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            collate_fn=whole_batch,
        )


class Classifier(L.LightningModule):
    """A small transformer encoder over the signals: memory grows with the batch."""

    def __init__(self, d_model: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(CHANNELS, d_model)
        layer = torch.nn.TransformerEncoderLayer(
            d_model, nhead=8, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True
        )
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d_model, CLASSES)
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.inp(x)).mean(dim=1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def make_trainer(root: str, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="gpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        **kwargs,
    )


def fit(model: Classifier, data: SignalData, batch: int, steps: int, root: str) -> float:
    """``steps`` training steps at ``batch``; the last loss."""
    data.batch_size = batch
    make_trainer(root, max_steps=steps).fit(model, data)
    return model.losses[-1]


def fits(model: Classifier, data: SignalData, batch: int, root: str) -> bool:
    """Whether two training steps at ``batch`` run without running out of memory."""
    try:
        fit(model, data, batch, steps=2, root=root)
        return True
    except RuntimeError as exc:
        if not is_oom_error(exc):  # Lightning's own test: "CUDA" and "out of memory"
            raise
        return False


def find_batch(model: Classifier, data: SignalData, mode: str, root: str) -> int:
    """Lightning's batch-size search ("power" or "binsearch"), from 8 up."""
    found = Tuner(make_trainer(root)).scale_batch_size(
        model, datamodule=data, mode=mode, init_val=8, steps_per_trial=2, max_val=N // 2
    )
    assert found is not None
    return int(found)


def show(what: str) -> None:
    s = bridge.stats()
    fw = "  ".join(f"{k}={v / GIB:5.2f}" for k, v in s.by_framework.items())
    print(f"{what:<34} used={s.used / GIB:5.2f} GiB  budget={s.limit / GIB:5.2f} GiB  | {fw}")


def main() -> None:
    torch.set_float32_matmul_precision("high")
    # the search's tries ("Batch size 64 succeeded, trying batch size 128"), on stdout
    tuner_log = logging.getLogger("lightning.pytorch.tuner.batch_size_scaling")
    tuner_log.setLevel(logging.INFO)
    tuner_log.addHandler(logging.StreamHandler(sys.stdout))
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    data, model = SignalData(), Classifier()
    with tempfile.TemporaryDirectory() as root:
        loss = fit(model, data, batch=32, steps=50, root=root)
        show("after Trainer.fit (50 steps)")
        print(f"loss {model.losses[0]:.3f} -> {loss:.3f}")
        for mode in ("power", "binsearch"):
            # each search starts from a fresh model and data, as a new run would: a search
            # restores the trainer it tuned, and what the last one's tries left behind
            # (their tracebacks hold tensors) goes with the garbage
            del model, data
            gc.collect()
            data, model = SignalData(), Classifier()
            fit(model, data, batch=8, steps=2, root=root)  # optimizer state exists
            show(f"before the {mode} search")
            ooms = bridge.stats().num_ooms
            found = find_batch(model, data, mode, root)
            refused = bridge.stats().num_ooms - ooms
            print(f"scale_batch_size(mode={mode!r}): batch {found} "
                  f"({refused} allocation(s) refused by the budget during the search)")  # fmt: skip
            ok, double = fits(model, data, found, root), fits(model, data, 2 * found, root)
            print(f"  batch {found} fits the budget: {ok}; batch {2 * found}: {double}")
        show("after the searches")


if __name__ == "__main__":
    main()
