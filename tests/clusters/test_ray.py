# SPDX-License-Identifier: Apache-2.0
"""bridge.ray on a local Ray cluster with one GPU declared logically, on the stand-in.

Ray's worker processes inherit the stand-in driver (BRIDGE_CUDA_LIBRARY) and the
share folder of this module from the environment ray.init starts Ray in.
"""

from __future__ import annotations

import faulthandler
import os
import pathlib
import re
import tempfile
import uuid

import pytest

ray = pytest.importorskip("ray")

import bridge  # noqa: E402
from bridge import share  # noqa: E402
from bridge.tools import cli  # noqa: E402

TESTS = pathlib.Path(__file__).resolve().parents[1]  # cluster_util lives there
MIB = 1 << 20
HANG_S = 180  # the module past this dumps the stacks and ends the run: a hang fails
NAME = "ray-" + uuid.uuid4().hex[:8]
CALL_S = 60  # one ray.get


@pytest.fixture(scope="module")
def ray_gpu():
    """A local Ray of 2 CPUs and 1 GPU (logical: Ray has no GPU to see here), every
    worker under bridge.ray.worker_setup(budget="64MiB", share=NAME)."""
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    folder = tempfile.mkdtemp(prefix="bridge-ray-shares-")
    saved = {k: os.environ.get(k) for k in ("BRIDGE_SHARE_DIR", "PYTHONPATH")}
    os.environ["BRIDGE_SHARE_DIR"] = folder
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), saved["PYTHONPATH"]) if p)
    hook = bridge.ray.worker_setup(budget="64MiB", share=NAME)
    ray.init(
        num_cpus=2,
        num_gpus=1,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"worker_process_setup_hook": hook},
    )
    try:
        yield pathlib.Path(folder)
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        faulthandler.cancel_dump_traceback_later()


def test_two_actors_at_half_a_gpu_get_half_the_budget_each_and_are_refused_past_the_whole(
    standin, ray_gpu
):
    import cluster_util

    Holder = ray.remote(num_gpus=0.5, num_cpus=0)(cluster_util.Holder)
    a, b = Holder.remote(), Holder.remote()
    fa, fb = ray.get([a.figures.remote(), b.figures.remote()], timeout=CALL_S)
    assert fa["pid"] != fb["pid"] and os.getpid() not in (fa["pid"], fb["pid"])
    for f in (fa, fb):
        assert f["devices"] == [0]
        assert f["limit"] == 32 * MIB  # half of the 64 MiB budget
        assert f["share"]["name"] == NAME and f["share"]["budget"] == 64 * MIB
        # set up after Ray chose the GPU (the driver reads CUDA_VISIBLE_DEVICES once)
        assert f["setup"] == {"fraction": 0.5, "visible": "0"}

    assert ray.get(a.hold.remote(32 * MIB), timeout=CALL_S) == "ok"
    over = ray.get(a.hold.remote(2 * MIB), timeout=CALL_S)  # past a's half
    assert over.startswith("OutOfMemoryError") and "device 0" in over, over
    assert ray.get(b.hold.remote(32 * MIB), timeout=CALL_S) == "ok"  # the whole, together
    over = ray.get(b.hold.remote(2 * MIB), timeout=CALL_S)
    assert over.startswith("OutOfMemoryError"), over

    # one share of the GPU, both actors its members, named in bridge stats
    (sh,) = [s for s in share.list_shares(str(ray_gpu)) if s.name == NAME]
    alive = [m for m in sh.members if m.alive]
    assert {m.pid for m in alive} == {fa["pid"], fb["pid"]}
    assert sum(m.claim for m in alive) <= 64 * MIB
    text = cli.format_shares([sh])
    assert len(re.findall(r"ray actor \w+ \(0\.5 GPU\)", text)) == 2, text

    # a's half comes back to a once it frees it; b's half stays b's
    assert ray.get(a.release.remote(), timeout=CALL_S) == 1
    assert ray.get(b.hold.remote(2 * MIB), timeout=CALL_S).startswith("OutOfMemoryError")
    assert ray.get(a.hold.remote(32 * MIB), timeout=CALL_S) == "ok"

    # a killed actor's half comes back to the share: a new actor on the GPU gets it
    ray.kill(a)
    c = Holder.remote()
    fc = ray.get(c.figures.remote(), timeout=CALL_S)
    assert fc["pid"] not in (fa["pid"], fb["pid"]) and fc["limit"] == 32 * MIB
    assert ray.get(c.hold.remote(32 * MIB), timeout=CALL_S) == "ok"
    (sh,) = [s for s in share.list_shares(str(ray_gpu)) if s.name == NAME]
    assert {m.pid for m in sh.members if m.alive} == {fb["pid"], fc["pid"]}
    for actor in (b, c):
        ray.kill(actor)


def test_a_task_without_a_gpu_is_left_alone_and_unify_worker_says_why(standin, ray_gpu):
    @ray.remote(num_cpus=1)
    def no_gpu() -> tuple:
        import cluster_util

        from bridge import ray as bridge_ray

        before = cluster_util.figures()["devices"]  # the hook set nothing up
        try:
            bridge_ray.unify_worker()
        except bridge.BridgeError as exc:
            return before, str(exc)
        return before, ""

    before, why = ray.get(no_gpu.remote(), timeout=CALL_S)
    assert before is None
    assert "holds no GPU" in why and "num_gpus=" in why


def test_worker_setup_refuses_what_unify_would_refuse_before_ray_starts_a_worker():
    with pytest.raises(ValueError, match=re.escape("(device=...): not a keyword it takes")):
        bridge.ray.worker_setup(device=1)
    with pytest.raises(ValueError, match="budget"):
        bridge.ray.worker_setup(budget="most")


def test_a_reused_worker_that_held_a_fraction_gets_the_whole_budget_for_a_whole_gpu(
    standin, monkeypatch
):
    """Ray reuses a worker process for tasks of other shapes: after a task at 0.5 GPU,
    a task at num_gpus=1 in the same process gets the whole budget, not the half that
    the earlier task left (unify's same arguments again change nothing)."""
    import importlib

    from bridge import ray as bridge_ray

    monkeypatch.setattr(importlib.import_module("bridge.unify"), "_bridge", None)
    monkeypatch.setattr(bridge_ray, "_settings", None)
    monkeypatch.setattr(bridge_ray, "last_setup", {})
    monkeypatch.setattr(bridge_ray, "_label", lambda fraction: f"test ({fraction:g} GPU)")
    monkeypatch.setattr(bridge_ray.ray, "get_gpu_ids", lambda: [0])
    kw = {"budget": "64MiB", "share": False, "cupy": False, "torch": False, "jax": False}
    for fraction, limit in ((0.5, 32 * MIB), (1.0, 64 * MIB), (0.25, 16 * MIB), (1.0, 64 * MIB)):
        monkeypatch.setattr(bridge_ray, "gpu_fraction", lambda f=fraction: f)
        b = bridge_ray.unify_worker(**kw)
        assert list(b.devices) == [0]
        assert bridge.stats(0).limit == limit, fraction
        assert bridge_ray.last_setup["fraction"] == fraction
