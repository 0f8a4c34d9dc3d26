# SPDX-License-Identifier: Apache-2.0
"""Allocation traces of real work, recorded once and replayed under each allocator.

    python benchmarks/bench_trace.py record gpt2 --out traces/gpt2.json.gz    (GPU)
    python benchmarks/bench_trace.py replay traces/gpt2.json.gz --config bridge --json out.json
    python benchmarks/bench_trace.py run traces/*.json.gz --rounds 21 --cpu 3 --out results.json
    python benchmarks/bench_trace.py summary traces/*.json.gz                (CPU)

A trace is the sequence of allocations and frees (size, stream, order) a program made with
the native allocators: ``gpt2`` trains a 6-layer, width-768 GPT-2 for six steps at sequence
lengths 64 to 512 (torch's memory history), ``resnet50`` ResNet-50 training steps (needs
torchvision), ``cupy-fft`` a CuPy FFT pipeline at varying batch sizes (a logging CuPy
allocator over CuPy's pool), ``mixed`` one process where CuPy prepares each batch (decode,
flips, crops, an FFT low-pass, normalisation) and hands it to torch through DLPack for a
training step of a small CNN: both frameworks' events in one order, which only a single
allocator under both sees, so it is recorded under the bridge's own history (the sizes are
the frameworks' requests, which no allocator changes). A mixed trace's ALLOC events name
their framework (a fifth field, ``CUPY``); its replay sends those through ``cupy.empty`` on
the same streams, so ``native`` is torch's caching allocator beside CuPy's ``MemoryPool``
(what a mixed program holds today), ``async`` torch's cudaMallocAsync beside CuPy's
``MemoryAsyncPool``, and ``bridge`` one ``unify(cupy=True, torch=True)``. A replay
(``torch.empty``/``del`` of uint8 tensors, each on its recorded stream) gives the time per
event (best pass) and the allocator's peak reserved memory against the trace's peak of live
bytes (``reserved / live``: the fragmentation).

``run`` times the configurations in turns (trace_turns.py): one warm worker process per
configuration (its timing thread pinned to ``--cpu``, the garbage collector off), asked in
turn for ``--passes`` passes a round, the order rotating; the ``--rounds`` are split among
``--processes`` generations of fresh workers, so that one slow process holds a third of
them. Against the first configuration: ``round_ratios``, their ``ratio_spread`` and
``median_ratio_to_native``, the verdict (checks.py, over at least MIN_ROUNDS rounds).
Memory is each process's own; a configuration's figure is the largest. Configurations:

- ``native``: torch's own caching allocator; ``async``: its cudaMallocAsync backend;
  ``rmm``: RMM's CudaAsyncMemoryResource (when installed); ``bridge``: the bridge as shipped
  (segments of the pool).
- ``bridge-nocache``: the cache off (``BRIDGE_CACHE_LIMIT=0``): every event a driver call.
- ``bridge-allhits``: the cache as large as it can be (``ALLHITS_ENV``, and the largest
  cached block lifted to the limit): the bridge's cost with the fewest misses (its table of
  2,048 keys of 64 blocks still bounds the hits; ``cache_hits`` of ``allocs`` says how close).
- ``bridge-onetier``: one order of caching for every size (``ONETIER_ENV``), as before the
  two tiers.
- ``bridge-fixedlarge``: the large tier under its fixed cap alone (``FIXEDLARGE_ENV``), as
  before its cap followed the live bytes.
- ``bridge-carve``: blocks carved from pool chunks (``CARVE_ENV``: ``BRIDGE_CACHE_CARVE=1``,
  off by default; docs/design.md, Note [Segments]).
- ``bridge-segments``: segments of the pool, every emptied one kept under one release rule
  (``SEGMENTS_ENV``: ``BRIDGE_CACHE_SEGMENTS=1``, the default, so ``bridge`` too unless the
  shell turns it off; docs/design.md, Note [Segments]).
- ``bridge-tiers``: the exact-size tiers alone (``TIERS_ENV``: ``BRIDGE_CACHE_SEGMENTS=0``),
  the cache by default before segments, for comparison.
- ``bridge-pluggable``: torch through its ``CUDAPluggableAllocator`` over the same core
  (``PLUGGABLE_ENV``, the fallback where the C++ allocator cannot be built): against
  ``bridge``, what the C++ torch allocator changes, memory included.
- ``null-pluggable``: torch's ``CUDAPluggableAllocator`` on ``null_alloc.c``: one region
  taken with cuMemAlloc at setup, per-size LIFO lists, no driver call per event. ``native``
  against ``null-pluggable`` is torch's allocator against its pluggable path with a free
  allocator behind; ``null-pluggable`` against ``bridge`` is what the bridge costs beyond
  that path, its misses' driver calls included. Its "reserved" is the bump pointer's
  high-water mark (``null_footprint``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import gzip
import json
import os
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import MIB, config_env, pin_cpu, run_guarded, serve, write_json  # noqa: E402
from _native import compile_c  # noqa: E402
from trace_turns import MIN_ROUNDS, run_trace  # noqa: E402

ALLOC, FREE = 0, 1
#: An ALLOC event's optional fifth field: the framework that made it (absent: torch).
TORCH, CUPY = 0, 1
#: Configurations that replay only torch (a mixed trace's CuPy events need CuPy's own allocators).
TORCH_ONLY = ("rmm", "null-pluggable")
CONFIGS = ("native", "async", "rmm", "bridge", "bridge-nocache", "bridge-allhits",
           "bridge-onetier", "bridge-fixedlarge", "bridge-carve", "bridge-segments",
           "bridge-tiers", "bridge-pluggable", "null-pluggable")  # fmt: skip


# ---- traces ----
def make_trace(name: str, source: str, events: list[list[int]]) -> dict:
    """A trace: events are ``[ALLOC, id, size, stream]`` and ``[FREE, id]``."""
    streams = 1 + max((e[3] for e in events if e[0] == ALLOC), default=0)
    return {"name": name, "source": source, "streams": streams, "events": events}


def from_snapshot(snapshot: dict, name: str, device: int = 0) -> dict:
    """A trace from ``torch.cuda.memory._snapshot()``'s device trace.

    'alloc' starts a block, 'free_requested' ends it (when the program freed
    it; 'free_completed' comes later, when its streams allow reuse). Frees of
    blocks allocated before the recording began are dropped; streams are
    numbered in order of first use.
    """
    stream_ix: dict[int, int] = {}
    live: dict[int, int] = {}  # address -> id
    events: list[list[int]] = []
    next_id = 0
    for entry in snapshot["device_traces"][device]:
        action, addr = entry["action"], entry["addr"]
        if action == "alloc":
            s = stream_ix.setdefault(entry.get("stream", 0), len(stream_ix))
            live[addr] = next_id
            events.append([ALLOC, next_id, int(entry["size"]), s])
            next_id += 1
        elif action == "free_requested" and addr in live:
            events.append([FREE, live.pop(addr)])
    return make_trace(name, "torch memory history", events)


def from_history(events: Iterable[tuple], name: str, frameworks: dict[int, int],
                 actions: tuple[int, int], device: int = 0) -> dict:
    """A trace from the bridge's own history (``bridge._core.history_events()``).

    ``frameworks`` maps a ledger tag to TORCH or CUPY (other tags are dropped),
    ``actions`` is (the history's alloc action, its free action). Each event is
    ``(time_us, action, device, ptr, size, stream, ...)`` plus its tag at index 7;
    frees of blocks allocated before the recording began are dropped, streams are
    numbered in order of first use (the legacy stream, handle 0, is one stream for both
    frameworks, as it is on the GPU), and an ALLOC of CuPy carries CUPY as a fifth field.
    """
    ev_alloc, ev_free = actions
    stream_ix: dict[int, int] = {}
    live: dict[int, int] = {}  # address -> id
    out: list[list[int]] = []
    next_id = 0
    for e in events:
        action, dev, ptr, size, stream, tag = e[1], e[2], e[3], e[4], e[5], e[7]
        if dev != device or tag not in frameworks:
            continue
        if action == ev_alloc:
            s = stream_ix.setdefault(stream, len(stream_ix))
            live[ptr] = next_id
            event = [ALLOC, next_id, int(size), s]
            if frameworks[tag] != TORCH:
                event.append(frameworks[tag])
            out.append(event)
            next_id += 1
        elif action == ev_free and ptr in live:
            out.append([FREE, live.pop(ptr)])
    return make_trace(name, "bridge history", out)


def is_mixed(trace: dict) -> bool:
    """Whether some of the trace's allocations are CuPy's (replayed through CuPy)."""
    return any(e[0] == ALLOC and len(e) > 4 and e[4] == CUPY for e in trace["events"])


def peak_live(trace: dict) -> int:
    """The most bytes live at once in the trace."""
    live: dict[int, int] = {}
    cur = peak = 0
    for e in trace["events"]:
        if e[0] == ALLOC:
            live[e[1]] = e[2]
            cur += e[2]
            peak = max(peak, cur)
        else:
            cur -= live.pop(e[1])
    return peak


def save(trace: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump(trace, f, separators=(",", ":"))


def load(path: str) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def summary(trace: dict) -> dict:
    sizes = {e[2] for e in trace["events"] if e[0] == ALLOC}
    return {
        "name": trace["name"],
        "events": len(trace["events"]),
        "sizes": len(sizes),
        "streams": trace["streams"],
        "peak_live": peak_live(trace),
        **({"cupy_events": sum(1 for e in trace["events"] if len(e) > 4 and e[4] == CUPY)}
           if is_mixed(trace) else {}),
    }


# ---- recording (GPU, native allocators) ----
def record_gpt2(steps: int = 6) -> dict:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=6, n_embd=768, n_head=12, n_positions=512, vocab_size=50257)
    model = GPT2LMHeadModel(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lengths = [64, 512, 128, 384, 256, 96, 448, 192][:steps]
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    for n in lengths:
        ids = torch.randint(0, cfg.vocab_size, (8, n), device="cuda")
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return from_snapshot(snap, "gpt2")


def record_resnet50(steps: int = 4) -> dict:
    import torch
    import torchvision

    model = torchvision.models.resnet50().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    for _ in range(steps):
        x = torch.randn(64, 3, 224, 224, device="cuda")
        y = torch.randint(0, 1000, (64,), device="cuda")
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return from_snapshot(snap, "resnet50")


def record_cupy_fft(batches: Iterable[int] = (16, 32, 24, 64, 48, 32, 16, 64)) -> dict:
    import cupy as cp

    pool = cp.get_default_memory_pool()
    events: list[list[int]] = []
    streams: dict[int, int] = {}
    counter = [0]

    class Logged:  # owns the pool's block; its end is the free
        def __init__(self, mem: Any, i: int) -> None:
            self.mem, self.i = mem, i

        def __del__(self) -> None:
            events.append([FREE, self.i])

    def logging_alloc(size: int) -> Any:
        mem = pool.malloc(size)
        i = counter[0]
        counter[0] += 1
        s = streams.setdefault(cp.cuda.get_current_stream().ptr, len(streams))
        events.append([ALLOC, i, int(size), s])
        owner = Logged(mem, i)
        # the device named: CuPy refuses a null pointer (a 0-byte block) without it
        mem_view = cp.cuda.UnownedMemory(mem.ptr, size, owner, cp.cuda.Device().id)
        return cp.cuda.MemoryPointer(mem_view, 0)

    cp.cuda.set_allocator(logging_alloc)
    try:
        for b in batches:
            img = cp.random.random((b, 512, 512), dtype=cp.float32)
            f = cp.fft.rfft2(img)
            ky = cp.fft.fftfreq(512)[:, None]
            kx = cp.fft.rfftfreq(512)[None, :]
            f *= cp.exp(-(kx**2 + ky**2) * 40.0)
            out = cp.fft.irfft2(f, s=(512, 512))
            out = (out - out.mean(axis=(1, 2), keepdims=True)) / (
                out.std(axis=(1, 2), keepdims=True) + 1e-6
            )
            del img, f, ky, kx, out
        cp.cuda.Device().synchronize()
    finally:
        cp.cuda.set_allocator(pool.malloc)
    return make_trace("cupy-fft", "CuPy allocator log", events)


def record_mixed(batches: Iterable[int] = (32, 64, 48, 96, 32, 80, 64, 48)) -> dict:
    """CuPy preprocessing feeding torch training in one process, under the bridge's history."""
    import bridge

    bridge.unify(cupy=True, torch=True)
    import cupy as cp
    import torch
    from torch import nn

    from bridge._runtime import core

    torch.manual_seed(0)
    rs = cp.random.RandomState(0)

    def block(cin: int, cout: int, stride: int) -> list:
        return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    model = nn.Sequential(*block(3, 32, 1), *block(32, 64, 2), *block(64, 128, 2),
                          *block(128, 256, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(256, 10)).cuda()  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    side, crop = 160, 128
    ky = cp.fft.fftfreq(crop)[:, None]
    kx = cp.fft.rfftfreq(crop)[None, :]
    lowpass = cp.exp(-(kx**2 + ky**2) * 30.0).astype(cp.float32)
    mean = cp.asarray([0.485, 0.456, 0.406], dtype=cp.float32)[:, None, None]
    std = cp.asarray([0.229, 0.224, 0.225], dtype=cp.float32)[:, None, None]
    tags = {core.TAG_TORCH: TORCH, core.TAG_CUPY: CUPY}
    if core.history(True, False, 1_000_000, True) != 0:
        raise RuntimeError("the bridge's history could not be turned on")
    try:
        for b in batches:
            raw = rs.randint(0, 256, (b, 3, side, side), dtype=cp.uint8)  # "decoded" images
            y0, x0 = (int(v) for v in rs.randint(0, side - crop, 2))
            x = raw[:, :, y0:y0 + crop, x0:x0 + crop].astype(cp.float32) / 255.0
            flip = rs.random_sample(b) < 0.5
            x[flip] = x[flip][..., ::-1]
            x = cp.fft.irfft2(cp.fft.rfft2(x) * lowpass, s=(crop, crop))
            x = cp.ascontiguousarray((x - mean) / std, dtype=cp.float32)
            labels = rs.randint(0, 10, b).astype(cp.int64)
            del raw, flip
            xt, yt = torch.from_dlpack(x), torch.from_dlpack(labels)
            del x, labels
            loss = nn.functional.cross_entropy(model(xt), yt)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del xt, yt, loss
        torch.cuda.synchronize()
        events = core.history_events()
    finally:
        core.history(False, False, 0, True)
    return from_history(events, "mixed", tags, (core.EV_ALLOC, core.EV_FREE))


def record_attention(requests: int = 24, seed: int = 0) -> dict:
    """Variable-shape inference: a decoder answering requests of changing batch size and
    prompt length, a few tokens each (no two requests share a shape), fp16, no KV cache."""
    import random

    import torch

    rng = random.Random(seed)
    torch.manual_seed(seed)
    width, heads, depth, vocab = 1024, 16, 8, 32000
    embed = torch.nn.Embedding(vocab, width).cuda().half()
    layer = torch.nn.TransformerEncoderLayer(
        width, heads, 4 * width, batch_first=True, norm_first=True
    )
    body = torch.nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
    body = body.cuda().half().eval()
    head = torch.nn.Linear(width, vocab, bias=False).cuda().half()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    with torch.inference_mode():
        for _ in range(requests):
            batch, prompt = rng.choice((1, 2, 4, 8, 16)), rng.randint(16, 1024)
            ids = torch.randint(0, vocab, (batch, prompt), device="cuda")
            for _ in range(rng.randint(2, 6)):
                mask = torch.nn.Transformer.generate_square_subsequent_mask(
                    ids.shape[1], device="cuda", dtype=torch.float16
                )
                hidden = body(embed(ids), mask=mask, is_causal=True)
                ids = torch.cat([ids, head(hidden[:, -1]).argmax(-1, keepdim=True)], dim=1)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return from_snapshot(snap, "attention")


RECORDERS = {"gpt2": record_gpt2, "resnet50": record_resnet50, "cupy-fft": record_cupy_fft,
             "mixed": record_mixed, "attention": record_attention}


# ---- null-pluggable: a trivial allocator behind torch's pluggable path ----
NULL_SOURCE = pathlib.Path(__file__).resolve().parent / "null_alloc.c"
NULL_ALIGN = 512
NULL_SLACK = 64 * MIB  # beyond what the trace needs: for anything torch allocates itself
#: null_get_stats's values, in order (the ST_ enum of null_alloc.c)
NULL_STATS = ("region", "high_water", "allocs", "bumps", "reuses", "frees", "failed",
              "dropped", "foreign", "live", "peak_live", "classes")  # fmt: skip


def null_rounded(size: int) -> int:
    """The size null_alloc.c serves for ``size``: up to 512 B (0 B counts as 512)."""
    return max(NULL_ALIGN, -(-size // NULL_ALIGN) * NULL_ALIGN)


def null_footprint(trace: dict) -> int:
    """Bytes null_alloc's bump pointer reaches replaying the trace (any number of passes).

    A size's list holds every block of that size not live, so the pointer moves
    only when more blocks of a size are live at once than ever before: the sum
    over rounded sizes of the most live at once, times the size."""
    size_of: dict[int, int] = {}
    count: dict[int, int] = {}
    most: dict[int, int] = {}
    for e in trace["events"]:
        if e[0] == ALLOC:
            r = size_of[e[1]] = null_rounded(e[2])
            count[r] = count.get(r, 0) + 1
            most[r] = max(most.get(r, 0), count[r])
        else:
            count[size_of.pop(e[1])] -= 1
    return sum(r * n for r, n in most.items())


def null_region(trace: dict) -> int:
    """The region the null-pluggable replay takes: enough for the trace, with room to spare.

    Twice the peak of live bytes or the exact footprint, whichever is larger,
    plus NULL_SLACK, rounded to 2 MiB."""
    need = max(null_footprint(trace), 2 * peak_live(trace)) + NULL_SLACK
    return -(-need // (2 * MIB)) * (2 * MIB)


def build_null_alloc(dest: str | os.PathLike | None = None) -> pathlib.Path:
    """Compile null_alloc.c into a shared library (in dest, else a new temporary folder)."""
    folder = pathlib.Path(dest) if dest is not None else pathlib.Path(
        tempfile.mkdtemp(prefix="null_alloc-"))  # fmt: skip
    return compile_c(folder / "libnull_alloc.so", [str(NULL_SOURCE)], "-shared", "-fPIC",
                     "-Wall", "-Wextra", "-Werror")  # fmt: skip


class NullAllocator:
    """null_alloc.c's library through ctypes: init, alloc, free and the counters.

    ``ctypes.CDLL`` of the path torch's CUDAPluggableAllocator loaded gives the
    same library (the same counters)."""

    def __init__(self, path: str | os.PathLike) -> None:
        lib = self.lib = ctypes.CDLL(str(path))
        lib.null_init.argtypes = [ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int]
        lib.null_init.restype = ctypes.c_int
        lib.null_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.null_alloc.restype = ctypes.c_void_p
        lib.null_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                  ctypes.c_void_p]  # fmt: skip
        lib.null_free.restype = None
        lib.null_get_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]
        lib.null_get_stats.restype = ctypes.c_int

    def init(self, base: int, size: int, abort_on_exhaustion: bool = False) -> None:
        if self.lib.null_init(base, size, int(abort_on_exhaustion)) != 0:
            raise ValueError(f"null_init: no region at {base:#x} of {size} bytes")

    def alloc(self, size: int) -> int:
        """A block's address, or 0 when the region is exhausted."""
        return self.lib.null_alloc(size, 0, None) or 0

    def free(self, ptr: int, size: int) -> None:
        self.lib.null_free(ptr or None, size, 0, None)

    def stats(self) -> dict[str, int]:
        out = (ctypes.c_uint64 * len(NULL_STATS))()
        n = self.lib.null_get_stats(out, len(NULL_STATS))
        if n != len(NULL_STATS):
            raise RuntimeError(f"null_alloc.c has {n} counters, bench_trace.py names "
                               f"{len(NULL_STATS)}")  # fmt: skip
        return dict(zip(NULL_STATS, map(int, out), strict=True))


def _cu_check(result: Any, what: str) -> Any:
    """The values of a cuda.bindings call after its status; raises on an error."""
    from cuda.bindings import driver as cu

    err, *rest = result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what}: {err}")
    return rest[0] if len(rest) == 1 else rest


def _setup_null(trace: dict) -> tuple[Callable[[], int], Callable[[], dict]]:
    """torch on null_alloc.c, its region taken with cuMemAlloc (before torch starts CUDA)."""
    import torch
    from cuda.bindings import driver as cu

    path = build_null_alloc()
    alloc = torch.cuda.memory.CUDAPluggableAllocator(str(path), "null_alloc", "null_free")
    torch.cuda.memory.change_current_allocator(alloc)
    _cu_check(cu.cuInit(0), "cuInit")
    dev = _cu_check(cu.cuDeviceGet(0), "cuDeviceGet")
    ctx = _cu_check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    _cu_check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    size = null_region(trace)
    base = int(_cu_check(cu.cuMemAlloc(size), f"cuMemAlloc of the {size}-byte region"))
    null = NullAllocator(path)
    null.init(base, size, abort_on_exhaustion=True)  # torch does not check for NULL
    footprint = null_footprint(trace)

    def extra() -> dict:
        st = null.stats()
        if st["failed"]:
            raise RuntimeError(f"null_alloc refused {st['failed']} allocations: {st}")
        return {"null_alloc": {**st, "footprint_predicted": footprint,
                               "reuse_fraction": st["reuses"] / max(1, st["allocs"])}}

    return (lambda: null.stats()["high_water"]), extra


def lift_cache_max_block(device: int) -> int:
    """bridge-allhits: let the cache keep blocks of any size up to its limit (the
    environment cannot lift the 256 MiB default); returns the new largest block."""
    from bridge._runtime import core

    rc, st = core.stats(device)
    limit = st["cache_limit"]
    rc = rc or core.set_cache(device, limit, limit)
    if rc != 0:
        raise RuntimeError(f"core.set_cache({device}, {limit}, {limit}): status {rc}")
    return int(limit)


# ---- replay (one allocator per process) ----
def _setup(config: str, trace: dict | None = None) -> tuple[Callable[[], Any],
                                                            Callable[[], dict]]:  # fmt: skip
    """Install the configuration's allocator; returns a function giving the held peak
    and one giving what else the result should carry (read after the replay)."""
    mixed = trace is not None and is_mixed(trace)
    if mixed and config in TORCH_ONLY:
        raise ValueError(f"configuration {config!r} replays torch only; the trace "
                         f"{trace['name']!r} has CuPy's events too (use native, async or a "
                         "bridge configuration)")  # fmt: skip
    if config == "null-pluggable":
        assert trace is not None, "null-pluggable sizes its region from the trace"
        return _setup_null(trace)
    info: dict[str, Any] = {}  # what the result carries beside the times
    if config.startswith("bridge"):
        import bridge

        os.environ.update(config_env("torch", config))  # replay run by hand
        bridge.unify(cupy=mixed, torch=True)
        if config == "bridge-allhits":
            info["cache_max_block"] = lift_cache_max_block(0)
    elif config == "rmm":
        import rmm
        from rmm.allocators.torch import rmm_torch_allocator

        rmm.mr.set_current_device_resource(rmm.mr.CudaAsyncMemoryResource())
        import torch

        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
    import torch

    if mixed and config == "async":  # CuPy on the device's pool too, beside torch's backend
        import cupy

        cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc)

    def extra() -> dict:
        return dict(info)

    if config == "native":
        torch.cuda.reset_peak_memory_stats()
        if mixed:
            # torch's cache and CuPy's pool each only grow during a replay (each gives
            # memory back only on an OOM, and a replay has none), so their sum at the end
            # is the most they held together
            import cupy

            pool = cupy.get_default_memory_pool()
            return (lambda: torch.cuda.max_memory_reserved() + pool.total_bytes()), extra
        return (lambda: torch.cuda.max_memory_reserved()), extra
    if config == "rmm":
        return (lambda: None), extra  # RMM's pool is its own, with no high-water mark here
    # async and bridge allocate from the device's default pool: its high-water mark
    from cuda.bindings import driver as cu

    cu.cuInit(0)
    err, pool = cu.cuDeviceGetDefaultMemPool(0)
    attr = cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH
    torch.zeros(1, device="cuda")  # the pool and the context exist

    def high() -> int:
        err, v = cu.cuMemPoolGetAttribute(pool, attr)
        return int(v)

    cu.cuMemPoolSetAttribute(pool, attr, cu.cuuint64_t(0))  # reset the mark
    return high, extra


def timed_passes(passes: int, events: list, one_pass: Callable[[], None],
                 synchronize: Callable[[], None]) -> list[float]:
    """ns per event of each of ``passes`` calls of one_pass (each ends with a synchronize)."""
    times = []
    for _ in range(passes):
        t0 = time.perf_counter_ns()
        one_pass()
        synchronize()
        times.append((time.perf_counter_ns() - t0) / len(events))
    return times


def replay_events(torch: Any, trace: dict, streams: list[Any], passes: int) -> list[float]:
    """Replay the trace ``passes`` times; ns per event of each pass."""
    events = trace["events"]

    def one_pass() -> None:
        live: dict[int, Any] = {}
        current = None
        for e in events:
            if e[0] == ALLOC:
                s = streams[e[3]]
                if s is not current:
                    torch.cuda.set_stream(s)
                    current = s
                live[e[1]] = torch.empty(e[2], dtype=torch.uint8, device="cuda")
            else:
                del live[e[1]]
        live.clear()

    times = timed_passes(passes, events, one_pass, torch.cuda.synchronize)
    torch.cuda.set_stream(streams[0])
    return times


def replay_mixed_events(torch: Any, cupy: Any, trace: dict, streams: list[Any],
                        cupy_streams: list[Any], passes: int) -> list[float]:
    """replay_events for a mixed trace: CuPy's events through ``cupy.empty`` on
    ``cupy_streams`` (the same streams as ``streams``), torch's through ``torch.empty``."""
    events = trace["events"]
    t_empty, c_empty, u8, c_u8 = torch.empty, cupy.empty, torch.uint8, cupy.uint8

    def one_pass() -> None:
        live: dict[int, Any] = {}
        current = ccurrent = None
        for e in events:
            if e[0] == ALLOC:
                if len(e) > 4 and e[4] == CUPY:
                    cs = cupy_streams[e[3]]
                    if cs is not ccurrent:
                        cs.use()
                        ccurrent = cs
                    live[e[1]] = c_empty(e[2], dtype=c_u8)
                else:
                    s = streams[e[3]]
                    if s is not current:
                        torch.cuda.set_stream(s)
                        current = s
                    live[e[1]] = t_empty(e[2], dtype=u8, device="cuda")
            else:
                del live[e[1]]
        live.clear()

    times = timed_passes(passes, events, one_pass, torch.cuda.synchronize)
    torch.cuda.set_stream(streams[0])
    cupy_streams[0].use()
    return times


def replayer(trace: dict, config: str, cpu: int | None, info: dict) -> tuple[Callable, Callable]:
    """The configuration's allocator set up for the trace, the timing thread pinned to
    ``cpu`` and the garbage collector off: (timed(n): ns per event of each of n passes,
    stats(): the held peak and the allocator's counters, read after the passes)."""
    held, extra = _setup(config, trace)
    pin_cpu(cpu, info)  # after the setup: the threads it started keep their CPUs
    import torch

    streams = [torch.cuda.current_stream()]
    streams += [torch.cuda.Stream() for _ in range(trace["streams"] - 1)]
    mixed = is_mixed(trace)
    if mixed:
        import cupy

        # stream 0 is the legacy stream for both; the others are torch's, shared
        cupy_streams = [cupy.cuda.Stream.null]
        cupy_streams += [cupy.cuda.ExternalStream(s.cuda_stream) for s in streams[1:]]
    gc.disable()
    passes = [0]

    def timed(n: int) -> list[float]:
        passes[0] += n
        if mixed:
            return replay_mixed_events(torch, cupy, trace, streams, cupy_streams, n)
        return replay_events(torch, trace, streams, n)

    def stats() -> dict:
        peak, live = held(), peak_live(trace)
        out = {"peak_reserved": peak, "peak_live": live, "passes": passes[0],
               "reserved_over_live": (peak / live) if peak else None,
               "torch": getattr(torch, "__version__", "?"), "pid": os.getpid(), **extra()}
        if config.startswith("bridge"):  # how often the cache served, over all passes
            from bridge._runtime import core

            raw = core.stats(0)[1]
            out.update(allocs=raw["num_allocs"], cache_hits=raw["num_cache_hits"],
                       cache_limit=raw["cache_limit"])
        return out

    return timed, stats


def replay(path: str, config: str, passes: int, json_path: str | None,
           cpu: int | None = None) -> int:
    """One replay in this process: ``passes`` passes, the best one's ns per event."""
    trace = load(path)

    def body(result: dict) -> None:
        timed, stats = replayer(trace, config, cpu, result)
        times = timed(passes)
        result.update(ns_per_event=min(times), ns_per_pass=times, **stats())

    base = {"bench": "trace", "trace": trace["name"], "config": config,
            "events": len(trace["events"])}
    return run_guarded(json_path, base, body)


def worker_setup(path: str, config: str, cpu: int | None) -> Callable[[dict], dict]:
    """serve()'s setup for one configuration (trace_turns.py drives the workers): commands
    ``warm N`` (N passes, untimed), ``time N`` (ns per event of N passes), ``stats``."""

    def setup(info: dict) -> dict:
        timed, stats = replayer(load(path), config, cpu, info)
        info.update(pid=os.getpid(), config=config)
        return {"warm": lambda n: (timed(n), None)[1], "time": timed, "stats": stats}

    return setup


def run(paths: list[str], configs: list[str], rounds: int, passes: int,
        out_path: str | None = None, cpu: int | None = None, processes: int = 3,
        warmup: int = 1) -> dict:  # fmt: skip
    """Every trace under every configuration in turns (trace_turns.run_trace); with ``out_path`` the
    results so far are written after each trace (a run cut short keeps what it measured)."""
    out: dict[str, Any] = {}
    for path in paths:
        name = load(path)["name"]
        out[name] = run_trace(path, configs, rounds, passes, processes, warmup, cpu)
        if out_path:
            write_json(out_path, out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="record a trace with the native allocators (GPU)")
    rec.add_argument("workload", choices=sorted(RECORDERS))
    rec.add_argument("--out", required=True)
    rep = sub.add_parser("replay", help="replay one trace under one allocator (GPU)")
    rep.add_argument("trace")
    rep.add_argument("--config", choices=CONFIGS, required=True)
    rep.add_argument("--passes", type=int, default=5)
    rep.add_argument("--json", default=None)
    rep.add_argument("--cpu", type=int, default=None, help="the CPU the replay runs on")
    rn = sub.add_parser("run", help="every trace under every configuration, in turns (GPU)")
    rn.add_argument("traces", nargs="+")
    rn.add_argument("--configs", default=",".join(CONFIGS),
                    help="comma list; the first is the baseline of the ratios")
    rn.add_argument("--rounds", type=int, default=21,
                    help=f"rounds in turns, split among the processes (>= {MIN_ROUNDS} for "
                         "a verdict)")  # fmt: skip
    rn.add_argument("--passes", type=int, default=3,
                    help="passes of the trace per worker per round (the best counts)")
    rn.add_argument("--processes", type=int, default=3,
                    help="generations of fresh workers the rounds are split among")
    rn.add_argument("--warmup", type=int, default=1, help="untimed passes per worker first")
    rn.add_argument("--out", default=None)
    rn.add_argument("--cpu", type=int, default=None,
                    help="the CPU every worker's timing thread runs on (processes differ by "
                         "up to 2x unpinned)")  # fmt: skip
    wk = sub.add_parser("worker", help=argparse.SUPPRESS)
    wk.add_argument("trace")
    wk.add_argument("--config", choices=CONFIGS, required=True)
    wk.add_argument("--cpu", type=int, default=None)
    sm = sub.add_parser("summary", help="what a trace holds (CPU)")
    sm.add_argument("traces", nargs="+")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        trace = RECORDERS[args.workload]()
        save(trace, args.out)
        print(json.dumps(summary(trace)))
        return 0
    if args.cmd == "replay":
        return replay(args.trace, args.config, args.passes, args.json, args.cpu)
    if args.cmd == "summary":
        for path in args.traces:
            print(json.dumps(summary(load(path))))
        return 0
    if args.cmd == "worker":
        return serve(worker_setup(args.trace, args.config, args.cpu))
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or len(set(configs)) != len(configs) or len(configs) < 2:
        ap.error(f"--configs: two or more distinct names from {', '.join(CONFIGS)} "
                 f"(got {configs})")  # fmt: skip
    if min(args.rounds, args.passes, args.processes) < 1 or args.warmup < 0:
        ap.error("--rounds, --passes and --processes must be >= 1, --warmup >= 0")
    result = run(args.traces, configs, args.rounds, args.passes, args.out, args.cpu,
                 args.processes, args.warmup)  # fmt: skip
    if not args.out:
        write_json(None, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
