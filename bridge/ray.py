# SPDX-License-Identifier: Apache-2.0
"""Ray: fractional ``num_gpus`` made an enforced budget.

``ray.init(runtime_env={"worker_process_setup_hook": bridge.ray.worker_setup(budget="90%")})``

Ray's GPU fractions are logical: an actor at ``num_gpus=0.5`` may use the whole
card. Under :func:`worker_setup`, each worker that Ray gives GPUs calls
:func:`bridge.unify` before the task or actor's code runs, with

- its share of the budget as its own: ``fraction * budget`` (``budget``: the
  GPU's, default its whole memory), so two actors at 0.5 get half each;
- one share (``share=``, default ``"ray"``) for every worker on that physical
  GPU, whose budget is the whole one: together they are refused past it, and
  the budget of a worker that dies comes back to the others.

Ray starts a worker process before it gives it a task: the setup hook cannot
know the fraction and must not start CUDA (Ray sets ``CUDA_VISIBLE_DEVICES``
when it hands over the task, and the driver reads it once). So the hook only
records the settings; the bridge is set up right after Ray has set
``CUDA_VISIBLE_DEVICES`` for the first task or actor that holds GPUs. Where
that moment cannot be found (a Ray without ``ray._private.utils
.set_visible_accelerator_ids``), the hook warns, and :func:`unify_worker`,
called first thing in the actor's ``__init__`` or the task, does the same.

Needs Ray (the ``ray`` extra); importing ``bridge`` does not import it.
"""

from __future__ import annotations

__all__ = [
    "WorkerSetup",
    "worker_setup",
    "unify_worker",
    "gpu_fraction",
    "last_setup",
    "DEFAULT_SHARE",
]

import functools
import importlib
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

from bridge import share as _share
from bridge._errors import BridgeError
from bridge.budget import GPU_LIMIT_ENV, parse_size, size_from_env
from bridge.pool import pool, stats
from bridge.unify import Bridge, check_keywords, unify

try:
    import ray
except ImportError as _exc:  # the optional extra is missing: say what to install
    raise ImportError(
        f"bridge.ray needs Ray, which is not installed ({_exc}). Install it with "
        "pip install 'ray>=2.9' (from a checkout of the bridge: pip install -e '.[ray]')."
    ) from _exc

DEFAULT_SHARE = "ray"  # the share of the workers on one GPU when share= is not given
_lock = threading.Lock()
_settings: dict[str, Any] | None = None  # what the setup hook recorded in this worker
# what the last unify_worker() saw: the fraction and CUDA_VISIBLE_DEVICES (Ray's GPUs)
last_setup: dict[str, Any] = {}


class WorkerSetup:
    """The callable :func:`worker_setup` returns (Ray pickles it into every worker).

    Attributes
    ----------
    unify_kwargs : dict
        What each worker passes to :func:`unify_worker`.
    """

    def __init__(self, **unify_kwargs: Any) -> None:
        self.unify_kwargs = check_keywords(unify_kwargs, "bridge.ray.worker_setup", but="device")
        self.__name__ = "bridge.ray.worker_setup"  # Ray names the hook by it in its messages

    def __call__(self) -> None:
        """In a Ray worker, at its start: record the settings and watch for GPUs."""
        global _settings
        with _lock:
            _settings = dict(self.unify_kwargs)
        if not _watch_gpu_assignments():
            warnings.warn(
                "bridge.ray: this Ray has no ray._private.utils.set_visible_accelerator_ids, "
                "so the bridge cannot set itself up when a task or actor gets its GPUs; call "
                "bridge.ray.unify_worker() first thing in each actor's __init__ and task",
                RuntimeWarning,
                stacklevel=2,
            )

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.unify_kwargs.items())
        return f"bridge.ray.worker_setup({args})"


def worker_setup(**unify_kwargs: Any) -> WorkerSetup:
    """A ``worker_process_setup_hook`` for Ray that enforces fractional ``num_gpus``.

    Parameters
    ----------
    **unify_kwargs
        What :func:`bridge.unify` takes but ``device`` (Ray gives the GPUs).
        ``budget``: the whole GPU's (default ``BRIDGE_GPU_MEMORY_LIMIT`` if set,
        else the GPU's memory); a worker holding a fraction of a GPU gets that
        fraction of it as its own. ``share``: the share of the workers on one
        GPU (default ``"ray"``; ``False`` for none: then only the fractions hold).

    Returns
    -------
    WorkerSetup
        A callable for ``runtime_env={"worker_process_setup_hook": ...}``.

    Raises
    ------
    ValueError
        For a keyword ``unify`` does not take, ``device``, or a budget or share
        name of the wrong form (checked here, before any worker starts).
    """
    return WorkerSetup(**unify_kwargs)


def gpu_fraction() -> float | None:
    """The GPUs Ray gave the current task or actor (``0.5``, ``2.0``); None when none."""
    gpus = ray.get_runtime_context().get_assigned_resources().get("GPU")
    return float(gpus) if gpus else None


def unify_worker(**unify_kwargs: Any) -> Bridge:
    """:func:`bridge.unify` for the current Ray task or actor, its GPU fraction enforced.

    Called by the setup hook of :func:`worker_setup` when Ray gives a worker
    GPUs; call it yourself first thing in an actor's ``__init__`` or a task where
    the hook is not used. The settings are the hook's, updated by
    ``unify_kwargs``. A worker holding a fraction ``f < 1`` of a GPU is set up
    on that GPU (its device 0) with ``f * budget`` as its own budget; one holding
    whole GPUs, on those, with ``budget`` each. Either way it joins the share
    (default ``"ray"``) whose budget is ``budget``. A worker process that Ray
    reuses for a task holding another fraction takes that fraction's budget.

    Returns
    -------
    Bridge
        What :func:`bridge.unify` returned.

    Raises
    ------
    BridgeError
        When the current task or actor holds no GPU (give it ``num_gpus=``), or
        from :func:`bridge.unify`.
    ValueError
        As :func:`worker_setup`.
    """
    fraction = gpu_fraction()
    if fraction is None:
        raise BridgeError(
            "bridge.ray.unify_worker(): this Ray task or actor holds no GPU, so there is no "
            "fraction to enforce and no GPU to set up; give it num_gpus= (such as "
            "@ray.remote(num_gpus=0.5)), or call bridge.unify() for a process of your own"
        )
    with _lock:
        kwargs = dict(_settings or {})
    kwargs.update(check_keywords(unify_kwargs, "bridge.ray.unify_worker", but="device"))
    share = kwargs.pop("share", None)
    share = DEFAULT_SHARE if share is None else share
    whole = kwargs.pop("budget", None)
    if whole is None and not os.environ.get(GPU_LIMIT_ENV, "").strip():
        whole = 1.0  # the whole GPU: the first member of a share must give its budget
    devices = list(range(max(1, len(ray.get_gpu_ids())))) if fraction >= 1 else [0]
    b = unify(device=devices, budget=whole, share=share, **kwargs)
    # a process that held a fraction before (Ray reuses workers) and now whole GPUs: unify's
    # same arguments again change nothing, so the whole budget is set back here
    was_fraction = last_setup.get("fraction", 1) < 1
    if fraction < 1 or was_fraction:
        for d in devices:
            total = stats(d).total
            full = (
                parse_size(whole, total=total, name="budget")
                if whole is not None
                else size_from_env(GPU_LIMIT_ENV, total=total)
            ) or total
            # rounded down to the share's granule, so that fractions summing to 1 fit it
            own = int(full * fraction) // _share.SHARE_UNIT * _share.SHARE_UNIT
            pool(d).set_limit(size=own if fraction < 1 else full)
    _share.label_if_member(devices, _label(fraction))
    last_setup.update(fraction=fraction, visible=os.environ.get("CUDA_VISIBLE_DEVICES"))
    return b


def _label(fraction: float) -> str:
    ctx = ray.get_runtime_context()
    actor = ctx.get_actor_id()
    who = f"ray actor {actor[:16]}" if actor else f"ray task {ctx.get_task_id()[:16]}"
    return f"{who} ({fraction:g} GPU)"


def _watch_gpu_assignments() -> bool:
    """Set the bridge up right after Ray sets ``CUDA_VISIBLE_DEVICES`` for a task or actor
    that holds GPUs; False where this Ray does that elsewhere."""
    try:
        utils: Any = importlib.import_module("ray._private.utils")
    except ImportError:
        return False
    original = getattr(utils, "set_visible_accelerator_ids", None)
    if original is None:
        return False
    if getattr(original, "_bridge_watch", False):
        return True
    utils.set_visible_accelerator_ids = _after(original)
    return True


def _after(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def set_visible_accelerator_ids(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        if gpu_fraction() is not None:
            unify_worker()
        return out

    set_visible_accelerator_ids._bridge_watch = True  # type: ignore[attr-defined]
    return set_visible_accelerator_ids
