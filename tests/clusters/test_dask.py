# SPDX-License-Identifier: Apache-2.0
"""bridge.dask.BridgePlugin on a Dask LocalCluster of worker processes, on the stand-in.

Each worker process loads its own stand-in driver (BRIDGE_CUDA_LIBRARY, inherited);
what two workers on one stand-in GPU share is the share file (BRIDGE_SHARE_DIR).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import pathlib
import re
import signal
import time
import uuid

import pytest

distributed = pytest.importorskip("distributed")

import bridge  # noqa: E402
from bridge import share  # noqa: E402
from bridge.tools import cli  # noqa: E402

TESTS = pathlib.Path(__file__).resolve().parents[1]  # cluster_util lives there
MIB = 1 << 20
HANG_S = 120  # a test past this dumps the stacks and ends the run: a hang fails, never blocks


@pytest.fixture
def client(standin, tmp_path, monkeypatch):
    """A client of a LocalCluster of two worker processes (one thread each, with a nanny
    that restarts a worker that dies), inheriting the stand-in and a share folder of
    this test."""
    monkeypatch.setenv("BRIDGE_SHARE_DIR", str(tmp_path))
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    cluster = distributed.LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        silence_logs=logging.ERROR,
    )
    c = distributed.Client(cluster)
    try:
        yield c
    finally:
        c.close()
        cluster.close()
        faulthandler.cancel_dump_traceback_later()


def _workers(client) -> list[str]:
    addrs = sorted(client.scheduler_info()["workers"])
    assert len(addrs) == 2, addrs
    return addrs


def _on(client, addr: str, fn: str, *args: object) -> object:
    import cluster_util

    return client.run(getattr(cluster_util, fn), *args, workers=[addr])[addr]


def test_each_worker_is_unified_with_the_budget_on_its_own_gpu(client):
    client.register_plugin(bridge.dask.BridgePlugin(budget="64MiB"))
    seen = [_on(client, a, "figures") for a in _workers(client)]
    assert len({f["pid"] for f in seen} | {os.getpid()}) == 3  # two processes, not this one
    for f in seen:
        assert f["devices"] == [0]  # the worker's own GPU: the first it sees
        assert f["limit"] == 64 * MIB
        assert f["share"] is None  # share=None: each worker its own budget
    a, b = _workers(client)
    assert _on(client, a, "hold", 48 * MIB) == "ok"
    assert _on(client, b, "hold", 48 * MIB) == "ok"  # no share: b's budget is its own
    assert _on(client, a, "hold", 32 * MIB).startswith("OutOfMemoryError")


def test_a_bad_budget_is_refused_in_the_client_before_any_worker_is_touched(client):
    with pytest.raises(ValueError, match="budget"):
        bridge.dask.BridgePlugin(budget="lots")
    with pytest.raises(
        ValueError, match=re.escape("BridgePlugin(budgett=...): not a keyword it takes")
    ):
        bridge.dask.BridgePlugin(budgett="64MiB")
    with pytest.raises(ValueError, match="share"):
        bridge.dask.BridgePlugin(share="")
    import cluster_util

    assert [f["devices"] for f in client.run(cluster_util.figures).values()] == [None, None]


def test_workers_sharing_a_gpu_are_refused_past_the_share_and_a_killed_workers_share_comes_back(
    client, tmp_path
):
    name = "dask-" + uuid.uuid4().hex[:8]
    client.register_plugin(bridge.dask.BridgePlugin(budget="64MiB", share=name))
    a, b = _workers(client)
    fa, fb = _on(client, a, "figures"), _on(client, b, "figures")
    assert fa["share"]["name"] == fb["share"]["name"] == name
    assert fa["share"]["budget"] == fb["share"]["budget"] == 64 * MIB

    assert _on(client, a, "hold", 40 * MIB) == "ok"
    refused = _on(client, b, "hold", 40 * MIB)
    assert refused.startswith("OutOfMemoryError"), refused  # 80 MiB together: past the share
    assert _on(client, b, "hold", 24 * MIB) == "ok"  # 64 MiB together: the whole share

    # bridge stats lists both workers of the share, each with its name and address
    (sh,) = [s for s in share.list_shares(str(tmp_path)) if s.name == name]
    text = cli.format_shares([sh])
    assert {m.pid for m in sh.members if m.alive} == {fa["pid"], fb["pid"]}
    for addr in (a, b):
        assert addr in text, text
    assert "dask worker" in text and "worker" in text.splitlines()[1]

    os.kill(fa["pid"], signal.SIGKILL)  # a's 40 MiB come back to the share at once
    assert _on(client, b, "hold", 40 * MIB) == "ok"
    assert _on(client, b, "figures")["held"] == 64 * MIB

    # the nanny restarts a; the scheduler's plugin puts the new process in the share
    deadline = time.monotonic() + 60
    while True:
        addrs = sorted(client.scheduler_info()["workers"])
        if len(addrs) == 2:
            new = [x for x in addrs if x != b][0]
            try:
                f = _on(client, new, "figures")
            except (KeyError, OSError, distributed.comm.CommClosedError):
                f = None
            if f is not None and f["pid"] != fa["pid"]:
                break
        assert time.monotonic() < deadline, "the killed worker was not restarted"
        time.sleep(0.2)
    assert f["share"]["name"] == name and f["limit"] == 64 * MIB
    assert _on(client, new, "hold", 2 * MIB).startswith("OutOfMemoryError")  # b holds it all
    assert _on(client, b, "release") == 2  # its 24 and 40 MiB
    assert _on(client, new, "hold", 40 * MIB) == "ok"


def test_what_only_a_worker_can_check_is_raised_by_register_plugin(client):
    # the stand-in has two GPUs: device 5 is checked in the worker, and refused there
    with pytest.raises(ValueError, match=re.escape("device=5: every device must be an int in")):
        client.register_plugin(bridge.dask.BridgePlugin(device=5, budget="64MiB"))
    import cluster_util

    assert [f["devices"] for f in client.run(cluster_util.figures).values()] == [None, None]
