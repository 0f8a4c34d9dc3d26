# SPDX-License-Identifier: Apache-2.0
"""Hugging Face on the shared pool (H200): Trainer(auto_find_batch_size=True) and
accelerate's find_executable_batch_size under a budget, and a sentence-transformers encode
beside CuPy work. (Run by scripts/gpu-test.)

Each scenario runs in fresh processes with the native allocators and on the bridge. The
native runs are the power check: torch's ``set_per_process_memory_fraction`` stands for the
budget there, and the searches must end at an out-of-memory error there too. Models come
from configs (examples/hf_trainer.py); nothing is downloaded.
"""

from __future__ import annotations

import math
import pathlib

import pytest
from gpu_util import GIB, MIB, run_mode

pytestmark = pytest.mark.gpu
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
BUDGET = 2 * GIB
CUPY_HOLDS = 512 * MIB  # a CuPy array held through the search: the budget covers it too
START = 256

PRELUDE = f"""
import math, os, sys, tempfile, warnings
os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, {str(EXAMPLES)!r})
BUDGET, CUPY_HOLDS = {BUDGET}, {CUPY_HOLDS}
if MODE == "bridge":
    import bridge
    bridge.unify(torch=True, cupy=True, budget=BUDGET)
import cupy, torch
import hf_trainer as ex
warnings.filterwarnings("ignore")
if MODE == "native":  # torch's own cap stands for what the budget leaves beside CuPy
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((BUDGET - CUPY_HOLDS) / total, 0)
held = cupy.ones(CUPY_HOLDS, dtype=cupy.uint8)
def refused():
    return bridge.stats(0).num_ooms if MODE == "bridge" else 0
def figures():
    if MODE != "bridge":
        return {{}}
    s = bridge.stats(0)
    return {{"cupy": s.by_framework["cupy"], "torch": s.by_framework["torch"],
            "limit": s.limit, "ledger_peak": s.ledger_peak}}
"""


@pytest.fixture(autouse=True)
def _hf():
    for name in ("cupy", "torch", "transformers", "accelerate"):
        pytest.importorskip(name)


def check_search(tried: list[int], name: str) -> None:
    assert tried[0] == START, (name, tried)
    assert len(tried) >= 2, (name, tried)  # the start did not fit: the search ran
    assert tried == sorted(set(tried), reverse=True), (name, tried)  # it only went down
    assert tried[-1] >= 1, (name, tried)


def test_trainer_auto_find_batch_size_under_the_budget():
    code = (
        PRELUDE
        + f"""
import transformers
seen_figures = []

class Watch(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        seen_figures.append(figures())

before = refused()
loss, seen, found = ex.train_with_trainer(tempfile.mkdtemp(), start={START}, steps=3,
                                          callbacks=[Watch()])
tried = ex.tries(seen)
report(loss=loss, tried=tried, found=found, at_found=seen.count(tried[-1]),
       refused=refused() - before,
       during=seen_figures[-1], after=figures())
"""
    )
    native = run_mode(code, "native", timeout=300)
    bridged = run_mode(code, "bridge", timeout=300)
    for name, r in (("native", native), ("bridge", bridged)):
        check_search(r["tried"], name)
        assert r["at_found"] == 3, (name, r)  # it trained its 3 steps at the batch it found
        assert r["found"] == r["tried"][-1], (name, r)  # and says so in trainer.state
        assert math.isfinite(r["loss"]), (name, r)
    d = bridged["during"]
    assert d["cupy"] >= CUPY_HOLDS and d["torch"] > 0, d  # both counted, in one budget
    assert d["limit"] == BUDGET and bridged["after"]["ledger_peak"] <= BUDGET
    assert bridged["refused"] >= len(bridged["tried"]) - 1  # each failed try: a refusal
    n, b = native["tried"][-1], bridged["tried"][-1]
    assert n / 2 <= b <= n * 2, (native["tried"], bridged["tried"])


def test_accelerate_find_executable_batch_size_under_the_budget():
    code = (
        PRELUDE
        + f"""
before = refused()
batch, loss, tried = ex.train_with_accelerate(start={START}, steps=3)
report(batch=batch, loss=loss, tried=tried, refused=refused() - before, after=figures())
"""
    )
    native = run_mode(code, "native", timeout=300)
    bridged = run_mode(code, "bridge", timeout=300)
    for name, r in (("native", native), ("bridge", bridged)):
        check_search(r["tried"], name)
        assert r["batch"] == r["tried"][-1] and math.isfinite(r["loss"]), (name, r)
    assert bridged["refused"] >= len(bridged["tried"]) - 1
    assert bridged["after"]["ledger_peak"] <= BUDGET
    n, b = native["batch"], bridged["batch"]
    assert n / 2 <= b <= n * 2, (native["tried"], bridged["tried"])


def test_sentence_transformers_encode_beside_cupy():
    pytest.importorskip("sentence_transformers")
    code = (
        PRELUDE
        + """
from sentence_transformers import SentenceTransformer
path = ex.build_encoder(os.path.join(tempfile.mkdtemp(), "encoder"))
texts = ex.sentences(256)
st = SentenceTransformer(path, device="cuda", local_files_only=True)
rs = cupy.random.RandomState(0)
index = rs.standard_normal((1 << 19, ex.HIDDEN), dtype=cupy.float32)  # 256 MiB held by CuPy
index /= cupy.linalg.norm(index, axis=1, keepdims=True)
emb = st.encode(texts, batch_size=64, convert_to_tensor=True, normalize_embeddings=True)
during = figures()
scores = cupy.from_dlpack(emb.detach()) @ index.T
best = cupy.asnumpy(scores.argmax(axis=1)).tolist()
del scores
oom = ""
if MODE == "bridge":  # a batch over the budget: the error torch users catch
    # the cache emptied first: its idle bytes (the scores CuPy freed) count in the budget and
    # would serve the batch within it
    bridge.pool(0).free_all_blocks()
    bridge.pool(0).set_limit(bridge.stats(0).used + 4 * (1 << 20))
    try:
        st.encode(texts * 16, batch_size=4096, convert_to_tensor=True)
    except RuntimeError as exc:
        oom = str(exc)
    bridge.pool(0).set_limit(BUDGET)
again = st.encode(texts[:8], batch_size=8, convert_to_tensor=True, normalize_embeddings=True)
report(emb=emb.float().cpu().tolist(), best=best, during=during, oom=oom[:300],
       again=float((again - emb[:8]).abs().max()))
"""
    )
    native = run_mode(code, "native", timeout=300)
    bridged = run_mode(code, "bridge", timeout=300)
    # the same embeddings and the same nearest rows with either allocator
    worst = max(
        abs(a - b)
        for ra, rb in zip(native["emb"], bridged["emb"], strict=True)
        for a, b in zip(ra, rb, strict=True)
    )
    assert worst < 1e-4, worst
    same = sum(a == b for a, b in zip(native["best"], bridged["best"], strict=True))
    assert same >= len(native["best"]) - 2, same  # near-ties aside
    d = bridged["during"]
    assert d["cupy"] >= 256 * MIB + CUPY_HOLDS and d["torch"] > MIB, d
    assert d["ledger_peak"] <= BUDGET
    assert bridged["oom"].startswith("CUDA out of memory."), bridged["oom"]
    assert bridged["again"] < 1e-4 and native["again"] < 1e-4  # encode works after the OOM
