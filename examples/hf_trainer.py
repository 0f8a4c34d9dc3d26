# SPDX-License-Identifier: Apache-2.0
"""Hugging Face on the shared pool: Trainer(auto_find_batch_size=True) and accelerate's
find_executable_batch_size under a bridge budget, and a sentence-transformers encode beside
CuPy work. Every model is built from a config (no download; works offline).

Run on a GPU machine:  python examples/hf_trainer.py [BUDGET]      (default 3GiB)

What to look at: CuPy holds 1 GiB while the Trainer searches; the batch it settles on is the
largest (in accelerate's steps of 0.9) that fits beside it in the budget, and each refused
try ends in "CUDA out of memory.", which accelerate recognises. Then a sentence-transformers
model encodes sentences and CuPy scores them against an index it holds, on one pool.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local: never ask the Hub

import gc
import pathlib
import sys
import tempfile

import bridge

BUDGET = sys.argv[1] if len(sys.argv) > 1 else "3GiB"
if __name__ == "__main__":  # at program start, before anything can start CUDA in torch
    try:
        bridge.unify(torch=True, cupy=True, budget=BUDGET)
    except bridge.BridgeError as exc:  # no GPU or driver, a framework missing: one line
        sys.exit(f"hf_trainer.py: {exc}")

import cupy  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import find_executable_batch_size  # noqa: E402

GIB = 1 << 30
SEQ, VOCAB = 256, 8192
HIDDEN = 128  # the sentence encoder's embedding size


# ---- a causal language model and its data ----
class RandomTokens(torch.utils.data.Dataset):
    """Token ids for a causal LM (random: what matters here is memory, not text)."""

    def __init__(self, n: int = 4096, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2(seed: int = 0) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=256, n_layer=4,
                                  n_head=4)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def batch_sizes_seen(model: torch.nn.Module) -> list[int]:
    """A list that gets the batch size of every forward pass of ``model``."""
    seen: list[int] = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen.append(int(ids.shape[0]))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def train_with_trainer(out_dir: str, start: int = 256, steps: int = 3, callbacks=None):
    """Trainer(auto_find_batch_size=True) from ``start``.

    Returns (loss, the batch size of every forward pass, the Trainer's batch size at the end).
    """
    model = tiny_gpt2()
    seen = batch_sizes_seen(model)
    args = transformers.TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=start,
        auto_find_batch_size=True,
        max_steps=steps,
        learning_rate=1e-4,
        logging_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_pin_memory=False,
        seed=0,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=RandomTokens(), callbacks=callbacks
    )
    out = trainer.train()
    loss, found = float(out.training_loss), trainer.state.train_batch_size
    del trainer, model
    gc.collect()
    torch.cuda.empty_cache()
    return loss, seen, found


def train_with_accelerate(start: int = 256, steps: int = 3):
    """accelerate's documented pattern: the training loop in find_executable_batch_size.

    Returns (batch size that ran, last loss, batch sizes tried).
    """
    accelerator = Accelerator()
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=start)
    def loop(batch_size: int):
        tried.append(batch_size)
        accelerator.free_memory()  # what the failed try prepared goes
        model = tiny_gpt2()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        data = torch.utils.data.DataLoader(RandomTokens(), batch_size=batch_size, shuffle=True)
        model, opt, data = accelerator.prepare(model, opt, data)
        loss = None
        for _, batch in zip(range(steps), data, strict=False):
            loss = model(**batch).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        return batch_size, float(loss)

    batch, loss = loop()
    accelerator.free_memory()
    gc.collect()
    torch.cuda.empty_cache()
    return batch, loss, tried


# ---- sentence-transformers beside CuPy ----
WORDS = ("the a of to and in is it that for on with as was at by this be from or an are "
         "gpu memory pool budget cupy torch model batch data train fast slow one shared "
         "frees asks holds array tensor kernel stream device cache").split()  # fmt: skip


def build_encoder(path: str | os.PathLike) -> str:
    """A small BERT and a WordPiece tokenizer, saved where sentence-transformers can load them."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = list(dict.fromkeys(special + letters + [f"##{c}" for c in letters] + list(WORDS)))
    vocab = {t: i for i, t in enumerate(tokens)}  # ids 0..n-1: "a" is a letter and a word
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]", model_max_length=128,
    )  # fmt: skip
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=HIDDEN, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=512,
                                  max_position_embeddings=128)  # fmt: skip
    transformers.BertModel(cfg).save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)


def sentences(n: int = 256) -> list[str]:
    g = torch.Generator().manual_seed(1)
    picks = torch.randint(0, len(WORDS), (n, 12), generator=g).tolist()
    return [" ".join(WORDS[i] for i in row) for row in picks]


def encode_beside_cupy(path: str, texts: list[str], index_rows: int = 1 << 20):
    """CuPy holds an index of vectors; sentence-transformers encodes; CuPy scores.

    Returns (embeddings as a torch tensor on the GPU, best index row per sentence).
    """
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(path, device="cuda", local_files_only=True)
    rs = cupy.random.RandomState(0)
    index = rs.standard_normal((index_rows, HIDDEN), dtype=cupy.float32)  # 512 MiB at 1M x 128
    index /= cupy.linalg.norm(index, axis=1, keepdims=True)
    emb = st.encode(texts, batch_size=64, convert_to_tensor=True, normalize_embeddings=True)
    scores = cupy.from_dlpack(emb.detach()) @ index.T  # CuPy reads torch's tensor, no copy
    best = cupy.asnumpy(scores.argmax(axis=1))
    del scores, index, st
    return emb, best


def show(what: str) -> None:
    s = bridge.stats()
    fw = "  ".join(f"{k}={v / GIB:5.2f}" for k, v in s.by_framework.items())
    print(f"{what:<38} used={s.used / GIB:5.2f} GiB  budget={s.limit / GIB:5.2f} GiB  | {fw}")


def tries(seen: list[int]) -> list[int]:
    """The batch sizes in the order tried (consecutive forwards at one size are one try)."""
    return [b for i, b in enumerate(seen) if i == 0 or seen[i - 1] != b]


def main() -> None:
    cache = cupy.ones(GIB, dtype=cupy.uint8)  # CuPy work that stays while training
    with tempfile.TemporaryDirectory() as tmp:
        ooms = bridge.stats().num_ooms
        loss, seen, _ = train_with_trainer(tmp)
        t = tries(seen)
        refused = bridge.stats().num_ooms - ooms
        print(f"Trainer(auto_find_batch_size=True): tried {t}; trained at {t[-1]} "
              f"(loss {loss:.3f}); {refused} allocation(s) refused by the budget")  # fmt: skip
        batch, loss, tried = train_with_accelerate()
        print(f"accelerate find_executable_batch_size: tried {tried}; ran at {batch} "
              f"(loss {loss:.3f})")  # fmt: skip
        show("with CuPy's 1 GiB still held")
        del cache
        path = build_encoder(pathlib.Path(tmp) / "encoder")
        texts = sentences()
        emb, best = encode_beside_cupy(path, texts)
        show("after encode and CuPy scoring")
        print(f"encoded {emb.shape[0]} sentences to {emb.shape[1]} dims; "
              f"best index row of the first: {int(best[0])}")  # fmt: skip


if __name__ == "__main__":
    main()
