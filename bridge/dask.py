# SPDX-License-Identifier: Apache-2.0
"""Dask: the bridge in every worker, ``client.register_plugin(bridge.dask.BridgePlugin(...))``.

A ``distributed.WorkerPlugin`` that calls :func:`bridge.unify` in each worker
process as the worker starts (and in every worker that joins or is restarted
later: the scheduler keeps the plugin), on the GPU the worker was given:
device 0 of its ``CUDA_VISIBLE_DEVICES``, which dask-cuda's
``LocalCUDACluster`` and ``dask cuda worker`` rotate so that each worker's own
GPU comes first. With ``share=``, the workers on one physical GPU draw from one
budget, and the budget of a worker that dies comes back to the others.

Needs Dask's ``distributed`` (the ``dask`` extra); importing ``bridge`` does not
import it.
"""

from __future__ import annotations

__all__ = ["BridgePlugin", "worker_label"]

from typing import Any

from bridge import share as _share
from bridge.unify import check_keywords, unify

try:
    from distributed import WorkerPlugin
except ImportError as _exc:  # the optional extra is missing: say what to install
    raise ImportError(
        f"bridge.dask needs Dask's distributed, which is not installed ({_exc}). Install it "
        "with pip install 'distributed>=2024.1' (from a checkout of the bridge: "
        "pip install -e '.[dask]'); dask-cuda is optional (LocalCUDACluster)."
    ) from _exc


def worker_label(name: object, address: object) -> str:
    """What ``bridge stats`` says of a Dask worker in a share (its ``worker`` column)."""
    return f"dask worker {name} {address}"


class BridgePlugin(WorkerPlugin):
    """Calls :func:`bridge.unify` in each Dask worker as it starts.

    ``client.register_plugin(BridgePlugin(budget="90%", share=None))`` sets up
    every worker of the cluster, those that join later and those the nanny
    restarts included.

    Parameters
    ----------
    **unify_kwargs
        What :func:`bridge.unify` takes (frameworks, ``budget``, ``share``,
        ``wait``, ...), checked here, in the client, where they can be without
        a GPU (names, the budget's form, the share's name). ``device``
        defaults to 0: the first GPU of the worker's ``CUDA_VISIBLE_DEVICES``,
        its own under dask-cuda. ``share="name"`` makes the workers on one
        physical GPU draw from one budget (``budget`` is then the share's).

    Raises
    ------
    ValueError
        For a keyword ``unify`` does not take, a budget or share name of the
        wrong form. What only a worker can check (a framework already started,
        no GPU) is raised by ``register_plugin`` from the worker's ``unify``.

    Attributes
    ----------
    name : str
        ``"bridge"``: the key distributed registers it under; registering
        another BridgePlugin replaces this one.
    unify_kwargs : dict
        What each worker passes to ``unify``.
    """

    name = "bridge"

    def __init__(self, **unify_kwargs: Any) -> None:
        self.unify_kwargs = check_keywords(unify_kwargs, "BridgePlugin")
        self.unify_kwargs.setdefault("device", 0)

    def setup(self, worker: Any) -> None:
        """In the worker, as it starts: ``unify(**unify_kwargs)``; a share member says
        which worker it is for ``bridge stats``."""
        b = unify(**self.unify_kwargs)
        _share.label_if_member(b.devices, worker_label(worker.name, worker.address))

    def teardown(self, worker: Any) -> None:
        """Nothing to undo: the frameworks keep the pool while the process lives, and a
        share takes a member's budget back when its process ends."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.unify_kwargs.items())
        return f"BridgePlugin({args})"
