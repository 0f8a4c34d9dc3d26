# SPDX-License-Identifier: Apache-2.0
"""Memory snapshots in torch's format, of every framework's live blocks on the bridge.

torch's own ``torch.cuda.memory._record_memory_history`` raises under any
pluggable allocator ("CUDAPluggableAllocator does not yet support
recordHistory"), so the bridge writes the same snapshot itself, from its
table of live allocations and its history of events:

>>> bridge.record_memory_history()            # events from now on, Python stacks
>>> train_step()
>>> bridge.dump_snapshot("snapshot.pickle")   # opens in pytorch.org/memory_viz

With ``bridge.unify(torch=True)`` torch's own calls work again too:
``torch.cuda.memory._record_memory_history``, ``_snapshot``,
``_dump_snapshot`` and ``torch.cuda.memory_snapshot`` answer from here.

What a snapshot holds (the keys of torch's ``_snapshot()``):

- ``segments``: one segment per live allocation of every framework that
  allocates through the bridge (CuPy, torch, Numba, RMM), each with one
  block. With segments (the default cache) several allocations may lie in
  one segment of the bridge's: each is still shown as a segment of its own,
  and the free ranges of the bridge's segments are not listed (their bytes
  are in the ``bridge`` key's ``cached``). A graph block that the user freed
  but its graph keeps is an ``inactive`` block. Each segment and block also
  carries ``framework`` (``"cupy"``, ``"torch"``, ``"numba"``, ``"rmm"``,
  ``"other"``), a key torch's tools ignore.
- ``device_traces``: per device, the events recorded since
  :func:`record_memory_history` (``alloc``, ``free_requested`` and
  ``free_completed`` together, ``oom`` with ``device_free``).
- ``frames``: the Python stack of an allocation, innermost frame first, when
  stacks were asked for: the allocating thread's stack, on any thread Python
  runs on (torch's operators and CuPy's allocator release the GIL around the
  allocation; while stacks are recorded the allocating thread takes it back,
  as torch's own recorder does); none for a thread Python never ran on.
- ``bridge``: each device's figures (:class:`bridge.Stats` as a dict), with
  what the snapshot cannot list block by block: JAX's bytes (XLA allocates
  from the pool without the bridge) and the bridge's cache of freed blocks.
"""

from __future__ import annotations

__all__ = [
    "record_memory_history",
    "memory_snapshot",
    "dump_snapshot",
    "problems",
    "torch_record_history",
    "torch_record_history_legacy",
    "torch_memory_snapshot",
    "FRAMEWORK_OF_TAG",
]

import os
import pickle
import sys
import threading
from types import FrameType
from typing import Any

from bridge import _runtime
from bridge._errors import check
from bridge._runtime import core
from bridge.pool import TAG_NAMES

FRAMEWORK_OF_TAG = TAG_NAMES  # the core's tags by framework name (bridge.pool)
REC_GRAPH, REC_USER_FREED = 1, 2  # a record's flags (records.h)
LARGE = 1 << 20  # torch's small pool serves requests of up to 1 MiB: larger ones are "large"
ENABLED = (None, "state", "all")
CONTEXTS = (None, "state", "alloc", "all")
STACKS = ("python", "all")

STATE_EVENTS = 1 << 20  # events kept in "state" mode: enough to find live blocks' stacks

# Re-entrant: a stack is taken inside an allocation or a free, and a garbage
# collection inside a locked region may free a tensor, which takes a stack.
_lock = threading.RLock()
_Stack = tuple[tuple[str, int, str], ...]  # (filename, line, name), innermost first
_stacks: dict[int, _Stack] = {}  # stack id -> frames: each distinct stack once
_stack_ids: dict[_Stack, int] = {}
_settings: dict[str, Any] = {"enabled": None, "context": None}


@_runtime.on_reset
def _forget() -> None:
    with _lock:
        _stacks.clear()
        _stack_ids.clear()
        _settings.update(enabled=None, context=None)


def _capture_stack() -> int:
    """The stack hook: the calling thread's Python stack, innermost first, as an id.

    Called by the core (with the GIL, from inside an allocation or a free)
    for each event while stacks are on; must never raise.
    """
    frames = []
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        code = f.f_code
        frames.append((code.co_filename, f.f_lineno or 0, code.co_name))
        f = f.f_back
    stack = tuple(frames)
    with _lock:
        sid = _stack_ids.get(stack)
        if sid is None:  # a stack seen before costs no memory
            sid = _stack_ids[stack] = len(_stack_ids) + 1
            _stacks[sid] = stack
    return sid


def record_memory_history(
    enabled: str | None = "all",
    context: str | None = "all",
    stacks: str = "python",
    max_entries: int = sys.maxsize,
    clear_history: bool = False,
) -> None:
    """Start (or stop) recording the allocations of every framework on the bridge.

    The arguments are torch's (``torch.cuda.memory._record_memory_history``).

    Parameters
    ----------
    enabled : {"all", "state", None}
        ``"all"``: keep a history of allocations, frees and refusals (the
        snapshot's ``device_traces``); ``"state"``: only what is needed to
        give live blocks their stacks; ``None``: stop recording.
    context : {"all", "alloc", "state", None}
        Which events keep a Python stack: ``"all"`` allocations and frees,
        ``"alloc"`` and ``"state"`` allocations, ``None`` none (no Python
        call at all on the allocation path).
    stacks : {"python", "all"}
        Python frames (the bridge records no C++ frames: ``"all"`` is the same).
    max_entries : int
        Events kept; older ones are overwritten. Each distinct stack is kept
        once, whatever the number of events. With ``"state"`` at most
        ``STATE_EVENTS`` (about a million) events are kept: a block
        allocated before them has no stack in the snapshot.
    clear_history : bool
        Forget the events recorded so far.

    Raises
    ------
    ValueError
        For a value outside those above; nothing changes then.
    """
    if enabled not in ENABLED:
        raise ValueError(f"enabled={enabled!r}: pass 'all', 'state' or None")
    if context not in CONTEXTS:
        raise ValueError(f"context={context!r}: pass 'all', 'alloc', 'state' or None")
    if stacks not in STACKS:
        raise ValueError(f"stacks={stacks!r}: pass 'python' or 'all'")
    if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
        raise ValueError(f"max_entries={max_entries!r}: pass a positive int")
    on = enabled is not None
    with_stacks = on and context is not None
    cap = min(max_entries, (1 << 63) - 1, STATE_EVENTS if enabled == "state" else 1 << 63)
    with _lock:
        if clear_history:
            _stacks.clear()
            _stack_ids.clear()
        _settings.update(enabled=enabled, context=context if on else _settings["context"])
    core.set_stack_callback(_capture_stack if with_stacks else None)
    check(core.history(on, with_stacks, cap, bool(clear_history)), what="recording history")


def _frames(sid: int) -> list[dict[str, Any]]:
    with _lock:
        stack = _stacks.get(sid, ())
    return [{"filename": fn, "line": line, "name": name} for fn, line, name in stack]


def _segment(block: tuple, frames: list[dict[str, Any]]) -> dict[str, Any]:
    ptr, size, stream, device, tag, flags, g0, g1 = block
    state = "inactive" if flags & REC_USER_FREED else "active_allocated"
    active = size if state == "active_allocated" else 0
    framework = FRAMEWORK_OF_TAG.get(tag, "other")
    return {
        "device": device,
        "address": ptr,
        "total_size": size,
        "allocated_size": active,
        "active_size": active,
        "requested_size": active,
        "stream": stream,
        "segment_type": "large" if size > LARGE else "small",
        "segment_pool_id": (g0, g1) if flags & REC_GRAPH else (0, 0),
        "is_expandable": False,
        "frames": frames,
        "framework": framework,
        "blocks": [
            {
                "address": ptr,
                "size": size,
                "requested_size": active if active else size,
                "state": state,
                "frames": frames,
                "framework": framework,
            }
        ],
    }


def _trace(events: list[tuple], context: str | None) -> tuple[list[list[dict]], dict[int, int]]:
    """Events as torch's trace entries per device, and each live pointer's stack id."""
    traces: dict[int, list[dict]] = {}
    stack_of: dict[int, int] = {}
    free_frames = context == "all"
    for t, action, device, ptr, size, stream, sid, tag, extra in events:
        out = traces.setdefault(device, [])
        base = {"addr": ptr, "size": size, "stream": stream, "time_us": t}
        base["framework"] = FRAMEWORK_OF_TAG.get(tag, "other")
        if action == core.EV_ALLOC:
            stack_of[ptr] = sid
            out.append(dict(base, action="alloc", frames=_frames(sid)))
        elif action == core.EV_FREE:
            stack_of.pop(ptr, None)
            frames = _frames(sid) if free_frames else []
            out.append(dict(base, action="free_requested", frames=frames))
            out.append(dict(base, action="free_completed", frames=list(frames)))
        elif action == core.EV_OOM:
            out.append(dict(base, action="oom", addr=0, device_free=extra, frames=_frames(sid)))
    n = max(traces, default=-1) + 1
    return [traces.get(d, []) for d in range(n)], stack_of


def _device_figures() -> dict[int, dict[str, Any]]:
    from bridge.pool import stats

    out = {}
    for d in range(core.MAX_DEVICES):
        if core.ready(d):
            try:
                out[d] = stats(d).as_dict()
            except Exception:  # noqa: BLE001 - figures are extra: a snapshot never fails for them
                continue
    return out


def memory_snapshot(device: int | None = None) -> dict[str, Any]:
    """A snapshot of every framework's live blocks on the bridge, in torch's format.

    Parameters
    ----------
    device : int, optional
        Only this device's segments and trace (the others' traces empty);
        every device when None.

    Returns
    -------
    dict
        ``{"segments": [...], "device_traces": [[...], ...], "bridge": {...}}``,
        as ``torch.cuda.memory._snapshot()`` returns it (see the module's
        docstring); ``pickle`` it for pytorch.org/memory_viz, or use
        :func:`dump_snapshot`.
    """
    blocks = core.live_blocks()
    with _lock:
        enabled, context = _settings["enabled"], _settings["context"]
    traces, stack_of = _trace(core.history_events(), context)
    segments = []
    for block in sorted(blocks, key=lambda b: (b[3], b[0])):
        if device is not None and block[3] != device:
            continue
        sid = stack_of.get(block[0], 0)
        segments.append(_segment(block, _frames(sid) if sid and context is not None else []))
    if enabled != "all":
        traces = [[] for _ in traces]
    if device is not None:
        traces = [t if d == device else [] for d, t in enumerate(traces)]
    n = max(len(traces), 1 + max((s["device"] for s in segments), default=-1))
    traces += [[] for _ in range(n - len(traces))]
    return {"segments": segments, "device_traces": traces, "bridge": _device_figures()}


def dump_snapshot(path: str | os.PathLike = "dump_snapshot.pickle") -> None:
    """Write :func:`memory_snapshot` as a pickle: the file torch's memory viewer opens."""
    snap = memory_snapshot()
    with open(path, "wb") as f:
        pickle.dump(snap, f)


# ---- torch's entry points (the torch adapter points torch._C's at these) ----
_MAX_ENTRIES = (1 << 63) - 1


def torch_record_history(
    enabled: Any = "all",
    context: Any = "all",
    stacks: Any = "all",
    max_entries: Any = None,
    clear_history: Any = False,
    *rest: Any,
    **kw: Any,
) -> None:
    """``torch._C._cuda_record_memory_history`` (what ``_record_memory_history`` calls)."""
    record_memory_history(
        enabled, context, "python", max_entries or _MAX_ENTRIES, bool(clear_history)
    )


def torch_record_history_legacy(
    enabled: Any,
    record_context: Any = True,
    trace_alloc_max_entries: Any = 1,
    trace_alloc_record_context: Any = False,
    record_context_cpp: Any = False,
    clear_history: Any = False,
    *rest: Any,
    **kw: Any,
) -> None:
    """The boolean form (``_record_memory_history(True, ...)``)."""
    history = "all" if int(trace_alloc_max_entries or 1) > 1 else "state"
    context = ("all" if trace_alloc_record_context else "state") if record_context else None
    record_memory_history(
        history if enabled else None,
        context,
        "python",
        max(1, int(trace_alloc_max_entries or 1)),
        bool(clear_history),
    )


def torch_memory_snapshot(mempool_id: Any = None, *rest: Any, **kw: Any) -> dict:
    """``torch._C._cuda_memorySnapshot``: the bridge's snapshot (bridge.snapshot)."""
    snap = memory_snapshot()
    if mempool_id is not None:
        pool_id = tuple(int(x) for x in mempool_id)
        snap["segments"] = [s for s in snap["segments"] if s["segment_pool_id"] == pool_id]
    return snap


_SEGMENT_KEYS = {
    "device": int,
    "address": int,
    "total_size": int,
    "allocated_size": int,
    "active_size": int,
    "requested_size": int,
    "stream": int,
    "segment_type": str,
    "segment_pool_id": tuple,
    "blocks": list,
}
_BLOCK_KEYS = {"address": int, "size": int, "requested_size": int, "state": str, "frames": list}
_FRAME_KEYS = {"filename": str, "line": int, "name": str}
_ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom",
            "snapshot"}  # fmt: skip


def problems(snapshot: Any) -> list[str]:
    """What in a snapshot does not follow torch's format (an empty list: none).

    Checks the keys and types that torch's ``_memory_viz`` and memory viewer
    read, and that each segment's blocks fill it exactly (``segsum`` asserts it).
    """
    out: list[str] = []

    def keys(where: str, obj: Any, spec: dict[str, type]) -> bool:
        if not isinstance(obj, dict):
            out.append(f"{where}: not a dict")
            return False
        for k, typ in spec.items():
            if k not in obj:
                out.append(f"{where}: no {k!r}")
            elif not isinstance(obj[k], typ) or isinstance(obj[k], bool):
                out.append(f"{where}.{k}: {type(obj[k]).__name__}, not {typ.__name__}")
        return True

    def frames(where: str, fs: Any) -> None:
        for i, fr in enumerate(fs if isinstance(fs, list) else []):
            keys(f"{where}.frames[{i}]", fr, _FRAME_KEYS)

    if not isinstance(snapshot, dict):
        return ["the snapshot is not a dict"]
    for k in ("segments", "device_traces"):
        if not isinstance(snapshot.get(k), list):
            out.append(f"no list {k!r}")
    if out:
        return out
    for i, seg in enumerate(snapshot["segments"]):
        w = f"segments[{i}]"
        if not keys(w, seg, _SEGMENT_KEYS) or not isinstance(seg.get("blocks"), list):
            continue
        total = 0
        for j, b in enumerate(seg["blocks"]):
            if keys(f"{w}.blocks[{j}]", b, _BLOCK_KEYS):
                total += b.get("size", 0) if isinstance(b.get("size"), int) else 0
                if b.get("state") not in ("active_allocated", "active_awaiting_free", "inactive"):
                    out.append(f"{w}.blocks[{j}].state: {b.get('state')!r}")
                frames(f"{w}.blocks[{j}]", b.get("frames"))
        if total != seg.get("total_size"):
            out.append(f"{w}: blocks hold {total} bytes of {seg.get('total_size')}")
    for d, trace in enumerate(snapshot["device_traces"]):
        if not isinstance(trace, list):
            out.append(f"device_traces[{d}]: not a list")
            continue
        for i, e in enumerate(trace):
            w = f"device_traces[{d}][{i}]"
            if not keys(w, e, {"action": str, "size": int, "stream": int, "frames": list}):
                continue
            if e["action"] not in _ACTIONS:
                out.append(f"{w}.action: {e['action']!r}")
            if e["action"] == "oom" and not isinstance(e.get("device_free"), int):
                out.append(f"{w}: an oom without 'device_free'")
            if e["action"] != "oom" and not isinstance(e.get("addr"), int):
                out.append(f"{w}: no 'addr'")
            frames(w, e.get("frames"))
    return out
