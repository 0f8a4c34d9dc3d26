# SPDX-License-Identifier: Apache-2.0
"""CUDA tensors sent between processes under bridge.unify(ipc=True). (scripts/gpu-test)

Each scenario runs in fresh processes, with torch's own allocator (the power
check: the scenario is right and passes there) and on the bridge with
``ipc=True``, whose consumer runs under the bridge too (it imports the
producer's pool).  The CPU tests of the same machinery on the stand-in are
tests/core/test_ipc.py.
"""

from __future__ import annotations

import pytest
from gpu_util import PEER_READ_SNIPPET, run_mode

pytestmark = pytest.mark.gpu
MODES = ("native", "bridge")

# The child module both sides import: the consumer sets its allocator up
# before it unpickles a CUDA tensor.
CHILD = """
import tempfile, textwrap
import torch.multiprocessing as mp
folder = tempfile.mkdtemp()
with open(os.path.join(folder, "ipc_child.py"), "w") as f:
    f.write(textwrap.dedent('''
        import os
        def setup(mode):
            if mode == "bridge":
                import bridge
                bridge.unify(cupy=False, torch=True)
            import torch
            return torch
        def modify(mode, q, done):
            torch = setup(mode)
            t = q.get()
            total = float(t.double().sum().item())
            t.add_(1)  # in place: the producer sees it
            torch.cuda.synchronize()
            done.put(total)
            del t
            done.put("dropped")
        def drain(mode, q, done):
            torch = setup(mode)
            n = 0
            while True:
                t = q.get()
                if t is None:
                    break
                n += int(t[0].item() == t.numel())
                del t
            done.put(n)
        def hold_and_wait(mode, q, done):
            torch = setup(mode)
            t = q.get()
            done.put(float(t.double().sum().item()))
            import time
            time.sleep(600)  # killed while it holds t
    '''))
sys.path.insert(0, folder)
import ipc_child
ctx = mp.get_context("spawn")
"""

SETUP = """
if MODE == "bridge":
    import bridge
    from bridge.adapters import torch as torch_adapter
    bridge.unify(cupy=False, torch=True, ipc=True)
import torch
def ipc_holds():
    from bridge._runtime import core
    return core.ipc_counts()
"""


def run(code: str, mode: str, *, timeout: int = 300) -> dict:
    return run_mode(SETUP + CHILD + code, mode, timeout=timeout)


QUEUE = """
q, done = ctx.Queue(), ctx.Queue()
proc = ctx.Process(target=ipc_child.modify, args=(MODE, q, done))
proc.start()
t = torch.arange(1000, device="cuda", dtype=torch.float32)
q.put(t)
read = done.get(timeout=120)
dropped = done.get(timeout=120)
torch.cuda.synchronize()
proc.join(60)
report(read=read, dropped=dropped, after=float(t.double().sum().item()), exit=proc.exitcode,
       path=torch_adapter.path() if MODE == "bridge" else "native")
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_cuda_tensor_through_a_queue_is_read_and_modified_in_the_child(mode):
    r = run(QUEUE, mode)
    assert r["read"] == 499500.0, r
    assert r["dropped"] == "dropped" and r["exit"] == 0, r
    assert r["after"] == 499500.0 + 1000, r  # the child's add_ reached the producer's memory
    if mode == "bridge":
        assert r["path"] == "bridge", r


ROUND_TRIPS = """
import gc
def held():
    if MODE == "bridge":
        return bridge.stats(0).used
    return torch.cuda.memory_allocated(0)
q, done = ctx.Queue(), ctx.Queue()
proc = ctx.Process(target=ipc_child.drain, args=(MODE, q, done))
proc.start()
warm = torch.full((256 * 1024,), 256 * 1024, device="cuda", dtype=torch.float32)
q.put(warm)
del warm
torch.cuda.synchronize()
base = None
for i in range(1000):
    t = torch.full((256 * 1024,), 256 * 1024, device="cuda", dtype=torch.float32)  # 1 MiB
    q.put(t)
    del t
    if i == 99:
        torch.cuda.ipc_collect()
        base = held()
q.put(None)
n = done.get(timeout=240)
proc.join(60)
gc.collect()
torch.cuda.ipc_collect()
torch.cuda.synchronize()
holds = ipc_holds()[0] if MODE == "bridge" else 0
report(n=n, base=base, end=held(), holds=holds, exit=proc.exitcode)
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_thousand_round_trips_do_not_grow(mode):
    r = run(ROUND_TRIPS, mode, timeout=540)
    assert r["n"] == 1001 and r["exit"] == 0, r
    assert r["holds"] == 0, r
    # everything sent was let go: the producer holds no more than after the first hundred
    assert r["end"] <= r["base"], r


KILLED = """
import signal
q, done = ctx.Queue(), ctx.Queue()
proc = ctx.Process(target=ipc_child.hold_and_wait, args=(MODE, q, done))
proc.start()
t = torch.ones(1 << 20, device="cuda")
q.put(t)
read = done.get(timeout=120)
holds_before = ipc_holds()[0] if MODE == "bridge" else 1
os.kill(proc.pid, signal.SIGKILL)
proc.join(60)
import time
end = time.monotonic() + 30
holds = holds_before
while MODE == "bridge" and holds and time.monotonic() < end:
    time.sleep(0.1)
    holds = ipc_holds()[0]
u = torch.ones(1 << 20, device="cuda")  # the producer goes on
report(read=read, holds_before=holds_before, holds_after=holds,
       still=float((t + u).sum().item()))
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_killed_consumer_leaves_the_producer_working(mode):
    r = run(KILLED, mode)
    assert r["read"] == float(1 << 20), r
    assert r["still"] == float(2 << 20), r
    if mode == "bridge":
        assert r["holds_before"] == 1 and r["holds_after"] == 0, r


DESCRIPTORS = """
def fds():
    return {int(f) for f in os.listdir("/proc/self/fd")}
def program_fds():
    out = os.path.join(folder, "fds.txt")
    os.system(f"ls /proc/self/fd > {out}")  # a program started from here: what it inherits
    with open(out) as f:
        return {int(x) for x in f.read().split()}
q, done = ctx.Queue(), ctx.Queue()
proc = ctx.Process(target=ipc_child.modify, args=(MODE, q, done))
proc.start()
t = torch.arange(1000, device="cuda", dtype=torch.float32)
torch.cuda.synchronize()
program_fds()
before = fds()
q.put(t)
read = done.get(timeout=120)
dropped = done.get(timeout=120)
proc.join(60)
opened = fds() - before
report(read=read, exit=proc.exitcode, opened=sorted(opened),
       inherited=sorted(opened & program_fds()))
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_program_started_after_a_send_inherits_none_of_its_descriptors(mode):
    """The send opens descriptors in the producer (on the bridge: its socket and the
    exported pool's); a program the producer runs later (os.system, subprocess
    without close_fds) holds none of them."""
    r = run(DESCRIPTORS, mode)
    assert r["read"] == 499500.0 and r["exit"] == 0, r
    assert r["inherited"] == [], r


PAIR = """
import time
from bridge._runtime import core
def pairs(n):
    t0 = time.perf_counter_ns()
    for _ in range(n):
        rc, p = core.alloc(0, 1 << 20, 0, 0)
        assert rc == 0
        core.free(p)
    return (time.perf_counter_ns() - t0) / n
core.set_cache(0, 0, 0)  # every pair reaches the pool: what the pool itself costs
pairs(1000)
report(ipc=core.ipc_enabled(0), ns=min(pairs(20000) for _ in range(5)))
"""


def test_the_allocation_pair_on_the_exportable_pool_against_the_default_pool():
    """The figure docs/user-guide.md quotes: a pool allocation and free of 1 MiB, cache off."""
    default = run_mode("import bridge\nbridge.unify(cupy=False, torch=False)\n" + PAIR, "bridge")
    ipc = run_mode(
        "import bridge\nbridge.unify(cupy=False, torch=False, ipc=True)\n" + PAIR, "bridge"
    )
    assert default["ipc"] is False and ipc["ipc"] is True
    print(f"pair, default pool: {default['ns']:.0f} ns; exportable pool: {ipc['ns']:.0f} ns")
    assert ipc["ns"] < 20 * default["ns"], (default, ipc)


PEER = (
    PEER_READ_SNIPPET
    + """
import cupy
if cupy.cuda.runtime.getDeviceCount() < 2:
    report(skip=True)
    sys.exit(0)
exportable = None
if MODE == "bridge":
    import bridge
    from bridge._runtime import core
    bridge.unify(cupy=True, torch=False, device=[0, 1], ipc=True)  # peer_access=True
with cupy.cuda.Device(1):
    try:
        cupy.cuda.runtime.deviceEnablePeerAccess(0)  # what a peer read needs natively
    except cupy.cuda.runtime.CUDARuntimeError:
        pass  # already enabled
with cupy.cuda.Device(0):
    src = cupy.arange(1 << 20, dtype=cupy.float32)
    if MODE == "bridge":
        exportable = core.ipc_export(src.data.ptr)[0] == 0  # from the exportable pool
ok = doubled_by_device_1(cupy, src)  # device 1 reads device 0's memory
report(skip=False, ok=ok, exportable=exportable)
"""
)


@pytest.mark.parametrize("mode", MODES)
def test_a_kernel_of_one_device_reads_anothers_block_of_the_exportable_pool(mode):
    """unify(device=[0, 1], ipc=True) grants each device access to the other's
    exportable pool, as to its default pool: a peer's kernel reads the block."""
    pytest.importorskip("cupy")
    r = run_mode(PEER, mode)
    if r["skip"]:
        pytest.skip("needs two GPUs")
    assert r["ok"] is True, r
    if mode == "bridge":
        assert r["exportable"] is True, r


# A unify(ipc=True, share=...) whose torch refuses as it is installed (a refusal no
# too_late() tells ahead, made here by a refusing adapter), then the real one.
REFUSED_FIRST = """
refused, undone = None, {}
if MODE == "bridge":
    import importlib
    import bridge
    from bridge._runtime import core
    unify_mod = importlib.import_module("bridge.unify")
    real_adapter = unify_mod._adapter
    class Refuses:
        def install(self, devices, **kw):
            raise bridge.BridgeError("refused as it was installed")
    unify_mod._adapter = lambda name: Refuses()
    try:
        bridge.unify(
            cupy=False, torch=True, ipc=True, budget="8GiB", share=f"refused-{os.getpid()}"
        )
    except bridge.BridgeError as exc:
        refused = str(exc)
    undone = dict(
        ipc=core.ipc_enabled(0), share=bridge.stats(0).share, limit=bridge.pool(0).get_limit()
    )
    unify_mod._adapter = real_adapter
    bridge.unify(cupy=False, torch=True, ipc=True)
    from bridge.adapters import torch as torch_adapter
import torch
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_refused_unify_puts_its_pool_away_and_a_later_one_sends_tensors(mode, tmp_path):
    """The refused call leaves the share it joined and puts its exportable pool away
    (it stayed, with the share: the process a member with no framework on the pool); the
    next unify(ipc=True) takes the pool back and a tensor goes through a queue as with
    torch's own allocator (native: the same queue, without the bridge)."""
    code = (
        REFUSED_FIRST + CHILD + QUEUE.replace("report(", "report(refused=refused, undone=undone, ")
    )
    r = run_mode(code, mode, env={"BRIDGE_SHARE_DIR": str(tmp_path)})
    assert r["read"] == 499500.0 and r["after"] == 499500.0 + 1000, r
    assert r["dropped"] == "dropped" and r["exit"] == 0, r
    if mode == "bridge":
        assert r["refused"] == "refused as it was installed", r
        assert r["undone"] == {"ipc": False, "share": None, "limit": 0}, r
        assert r["path"] == "bridge", r
