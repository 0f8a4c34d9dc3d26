# SPDX-License-Identifier: Apache-2.0
"""One budget for several processes (bridge.unify(share=...)), on the stand-in.

Members are separate processes (tests/share_worker.py), each with its own
stand-in driver: what they share is the share file. Joining a share is for
the life of a process, so this test process itself never joins one (only
joins that fail, which change nothing, run here).
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import select
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from bridge import share
from bridge._errors import BridgeError, Status
from bridge._runtime import core

HERE = pathlib.Path(__file__).resolve().parents[1]  # tests/: the helpers
MIB = 1 << 20
UNIT = 2 * MIB
LAYOUT = core.share_layout()


class Worker:
    """A member process driven over a pipe (one JSON line each way)."""

    def __init__(self, **env: str) -> None:
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "share_worker.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
            bufsize=1,
            env=dict(os.environ, **env),
        )
        self.pid = self._read(60)["pid"]

    def _read(self, timeout: float) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise AssertionError(f"worker {self.proc.pid} did not answer in {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            self.err.seek(0)
            raise AssertionError(f"worker {self.proc.pid} died: {self.err.read()}")
        return json.loads(line)

    def send(self, op: str, **kw: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(dict(op=op, **kw)) + "\n")
        self.proc.stdin.flush()

    def call(self, op: str, timeout: float = 60, **kw: object) -> dict:
        self.send(op, **kw)
        out = self._read(timeout)
        assert "error" not in out, out["error"]
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)

    def close(self) -> None:
        self.kill()
        self.err.close()


@pytest.fixture
def workers(standin):
    made: list[Worker] = []

    def make(**env: str) -> Worker:
        w = Worker(**env)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


@pytest.fixture
def share_dir(standin, monkeypatch):
    d = tempfile.mkdtemp(prefix="bridge-share-test-")
    monkeypatch.setenv("BRIDGE_SHARE_DIR", d)
    return pathlib.Path(d)


def _name() -> str:
    return "t-" + uuid.uuid4().hex[:12]


def _stop(pid: int) -> None:
    """SIGSTOP `pid` and wait until every one of its threads is stopped.  kill()
    returns before they are: the signal wakes one thread, which stops the others
    only once it runs, and meanwhile another (the share's service thread) may
    still answer a request (trim, lower its claim)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while True:
        states = []
        for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except (FileNotFoundError, ProcessLookupError):
                pass
        if states and all(st in ("T", "t") for st in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: {states}"
        time.sleep(0.005)


def _only_file(d: pathlib.Path) -> pathlib.Path:
    files = list(d.iterdir())
    assert len(files) == 1, files
    return files[0]


# ---- joining, the file ----


def test_the_share_file_is_the_users_own_mode_0600_even_with_umask_0(workers, share_dir):
    w = workers(BRIDGE_SHARE_DIR=str(share_dir))
    os.umask(old := os.umask(0))
    try:
        w2 = workers(BRIDGE_SHARE_DIR=str(share_dir))  # started with umask 0
    finally:
        os.umask(old)
    name = _name()
    w2.call("join", name=name, budget=64 * MIB)
    w.call("join", name=name)  # budget 0: adopts the share's
    f = _only_file(share_dir)
    st = f.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.geteuid()
    assert f.name.startswith(f"bridge-{os.geteuid()}-")
    assert st.st_size == LAYOUT["file_size"]
    s1, s2 = w.call("stats")["share"], w2.call("stats")["share"]
    assert s1["path"] == s2["path"] == str(f)
    assert s1["budget"] == 64 * MIB and s1["members"] == 2


def test_the_first_member_must_give_a_budget(workers, share_dir):
    w = workers()
    w.send("join", name=_name())
    out = w._read(30)
    assert "BridgeError" in out["error"] and "must give its budget" in out["error"]


def test_a_member_asking_another_budget_is_refused_and_none_adopts_it(workers, share_dir):
    a, b = workers(), workers()
    name = _name()
    a.call("join", name=name, budget=64 * MIB)
    b.send("join", name=name, budget=32 * MIB)
    out = b._read(30)
    assert "BridgeError" in out["error"]
    assert str(64 * MIB) in out["error"] and str(32 * MIB) in out["error"]
    b.call("join", name=name, budget=0)
    assert b.call("stats")["share"]["budget"] == 64 * MIB


def test_one_gpu_numbered_differently_in_two_processes_is_one_share(workers, share_dir):
    # as with CUDA_VISIBLE_DEVICES=1: the same physical GPU is device 0 in one
    # process and device 1 in the other; the UUID decides
    a = workers(WORKER_DEVICE="1")
    b = workers(WORKER_DEVICE="0", BRIDGE_STANDIN_UUID_BASE="1")
    c = workers(WORKER_DEVICE="0")  # another physical GPU
    name = _name()
    a.call("join", name=name, budget=8 * MIB)
    b.call("join", name=name, budget=8 * MIB)
    c.call("join", name=name, budget=8 * MIB)
    pa, pb, pc = (w.call("stats")["share"]["path"] for w in (a, b, c))
    assert pa == pb != pc
    assert a.call("alloc", size=8 * MIB)["rc"] == Status.OK
    assert b.call("alloc", size=2 * MIB)["rc"] == Status.BUDGET  # a holds it all
    assert c.call("alloc", size=8 * MIB)["rc"] == Status.OK  # another GPU's budget


def test_a_unify_whose_framework_refuses_leaves_the_share_and_the_exportable_pool(
    workers, share_dir
):
    """unify(torch=True, share=..., ipc=True) whose torch refuses as it is installed (a
    refusal no too_late() tells ahead) put back the budget but stayed in the share, its
    budget applying (another budget refused) and its slot listed, and kept the exportable
    pool with the segments off. Now the call leaves no member and no exportable pool."""
    w = workers(**SEGMENTS)
    name = _name()
    assert w.call("stats")["carve_on"] == 1
    out = w.call("unify", name=name, budget=64 * MIB, refuse=True, ipc=True)
    assert out["refused"] == "the framework refused as it was installed"
    assert out["share"] is None and out["limit"] == 0
    assert out["ipc"] is False and out["carve_on"] == 1  # the default pool, segments back
    (sh,) = share.list_shares(str(share_dir))
    assert sh.name == name and sh.members == () and sh.claimed == 0
    # another budget for the share works now: nobody is in it
    again = w.call("unify", name=name, budget=128 * MIB)
    assert again["refused"] is None and again["share"]["budget"] == 128 * MIB
    assert again["share"]["members"] == 1


def test_a_refused_unify_ipc_puts_the_exportable_pool_away_and_a_later_one_takes_it(
    workers, share_dir
):
    w = workers(**SEGMENTS)
    out = w.call("unify", name=None, refuse=True, ipc=True)
    assert out["refused"] is not None
    assert out["ipc"] is False and out["carve_on"] == 1
    assert w.call("alloc", size=4 * MIB)["rc"] == Status.OK  # from the default pool
    again = w.call("unify", name=None, ipc=True)
    assert again["refused"] is None and again["ipc"] is True and again["carve_on"] == 0
    assert w.call("alloc", size=4 * MIB)["rc"] == Status.OK


def test_a_member_sees_a_refused_unify_leave_and_gets_its_claim_back(workers, share_dir):
    """The other members' view: the process that joined in a refused unify() is no
    member any more, and what it claimed (its pool, held before it joined) is theirs."""
    a, b = workers(), workers()
    name = _name()
    a.call("join", name=name, budget=64 * MIB)
    assert a.call("alloc", size=16 * MIB)["rc"] == Status.OK
    assert b.call("alloc", size=40 * MIB)["rc"] == Status.OK  # claimed as it is at join
    out = b.call("unify", name=name, refuse=True)  # the share's budget adopted
    assert out["refused"] is not None and out["share"] is None
    mine = a.call("stats")["share"]
    assert mine["members"] == 1 and mine["group"] == mine["claim"]
    (sh,) = share.list_shares(str(share_dir))
    assert [m.pid for m in sh.members] == [a.pid]
    # 16 + 40 MiB of a's own fit the budget only without b's 40 MiB claim (b lives on)
    assert a.call("alloc", size=40 * MIB)["rc"] == Status.OK
    assert b.proc.poll() is None


def test_a_refused_unify_keeps_the_share_an_earlier_call_joined(workers, share_dir):
    w = workers()
    name = _name()
    assert w.call("unify", name=name, budget=64 * MIB)["share"]["budget"] == 64 * MIB
    out = w.call("unify", name=name, refuse=True)
    assert out["refused"] is not None
    assert out["share"]["name"] == name and out["share"]["budget"] == 64 * MIB
    (sh,) = share.list_shares(str(share_dir))
    assert [m.pid for m in sh.members] == [w.pid]


# ---- exactness ----


def test_exactly_at_the_budget_passes_one_byte_over_is_refused(workers, share_dir):
    a, b = workers(), workers()
    name = _name()
    a.call("join", name=name, budget=64 * MIB)
    b.call("join", name=name)
    assert a.call("alloc", size=40 * MIB)["rc"] == Status.OK
    assert b.call("alloc", size=24 * MIB + 1)["rc"] == Status.BUDGET
    assert b.call("alloc", size=24 * MIB)["rc"] == Status.OK
    assert b.call("stats")["share"]["group"] == 64 * MIB
    assert a.call("alloc", size=1)["rc"] == Status.BUDGET


# ---- segments of the pool (BRIDGE_CACHE_SEGMENTS=1) ----

SEGMENTS = {"BRIDGE_CACHE_SEGMENTS": "1"}


def test_segments_a_request_that_fits_the_shares_room_is_served(workers, share_dir):
    """A segment's idle bytes go back only once every block carved from it is freed, so a
    member takes a segment larger than its request only while it is at most half the room
    the share leaves: at a 64 MiB budget, 40 MiB takes a segment of 40 MiB (its size with
    room to spare is 64 MiB, which would strand 24 MiB), and the other member's 24 MiB,
    exactly what is left, is served."""
    a, b = workers(**SEGMENTS), workers(**SEGMENTS)
    name = _name()
    a.call("join", name=name, budget=64 * MIB)
    b.call("join", name=name)
    assert a.call("stats")["carve_on"] == 1
    assert a.call("alloc", size=40 * MIB)["rc"] == Status.OK
    assert a.call("stats")["carve_held"] == 40 * MIB
    assert b.call("alloc", size=24 * MIB + 1)["rc"] == Status.BUDGET
    assert b.call("alloc", size=24 * MIB)["rc"] == Status.OK
    s = b.call("stats")
    assert s["carve_held"] == 24 * MIB and s["share"]["group"] == 64 * MIB
    assert a.call("alloc", size=1)["rc"] == Status.BUDGET
    # with room to spare the segment is larger than its request and serves the next one
    c = workers(**SEGMENTS)
    c.call("join", name=_name(), budget=1 << 30)
    assert c.call("alloc", size=40 * MIB)["rc"] == Status.OK
    assert c.call("alloc", size=20 * MIB)["rc"] == Status.OK
    assert c.call("stats")["carve_held"] == 64 * MIB


def test_segments_a_members_idle_segments_go_back_before_it_asks_the_others(workers, share_dir):
    """At a tight share a member's own empty segments go back to the pool (and the pool
    is trimmed) before the other members are asked to trim: the request is served and no
    ask is made.  Its segment of 4 MiB stays kept by the release rule (4 + 54 MiB is
    within 1.05 x its high-water mark of 60 MiB); the share's room, not the rule, sends
    it back."""
    a, b = workers(**SEGMENTS), workers(**SEGMENTS)
    name = _name()
    a.call("join", name=name, budget=64 * MIB)
    b.call("join", name=name)
    a.call("free", ptr=a.call("alloc", size=60 * MIB)["ptr"])  # the high-water mark: 60 MiB
    # b's 8 MiB asks a, whose service thread gives its empty segment back
    assert b.call("alloc", size=8 * MIB)["rc"] == Status.OK
    assert a.call("stats")["carve_held"] == 0
    a.call("free", ptr=a.call("alloc", size=4 * MIB)["ptr"])
    s = a.call("stats")
    assert s["carve_held"] == s["cached"] == 4 * MIB  # empty, kept
    asks, trims = s["share"]["num_asks"], b.call("stats")["share"]["num_trims_served"]
    assert a.call("alloc", size=54 * MIB)["rc"] == Status.OK  # 64 - 8 - 4 < 54
    s = a.call("stats")
    assert s["share"]["num_asks"] == asks and s["carve_held"] == 54 * MIB
    assert b.call("stats")["share"]["num_trims_served"] == trims
    assert s["share"]["group"] <= 64 * MIB


def test_processes_hammering_the_edge_never_hold_more_than_the_budget(workers, share_dir):
    budget, block, n = 64 * MIB, 4 * MIB, 4
    counter = share_dir / "oracle"
    counter.write_bytes(struct.pack("<q", 0))
    ws = [workers() for _ in range(n)]
    name = _name()
    for w in ws:
        w.call("join", name=name, budget=budget)
    for i, w in enumerate(ws):
        w.send("hammer", seconds=3.0, block=block, budget=budget, counter=str(counter), seed=i)
    results = [w._read(120) for w in ws]
    for r in results:
        assert "error" not in r, r
    assert sum(r["violations"] for r in results) == 0, results
    assert all(r["ok"] > 0 for r in results), results  # every member got memory
    assert sum(r["refused"] for r in results) > 0, results  # the edge was reached
    # memory went from member to member: together they held (nearly) all of it
    assert max(r["high"] for r in results) >= budget - block, results
    assert struct.unpack("<q", counter.read_bytes())[0] == 0
    group = ws[0].call("stats")["share"]["group"]
    assert group <= budget


def test_memory_one_member_frees_is_used_by_another(workers, share_dir):
    a, b = workers(), workers()
    name = _name()
    a.call("join", name=name, budget=64 * MIB)
    b.call("join", name=name)
    assert a.call("alloc", size=64 * MIB)["rc"] == Status.OK
    a.call("free")  # a's pool keeps it: a's claim stays until a trims
    assert a.call("stats")["share"]["claim"] == 64 * MIB
    out = b.call("alloc", size=64 * MIB)  # b asks a to trim, then gets it
    assert out["rc"] == Status.OK
    sa, sb = a.call("stats")["share"], b.call("stats")["share"]
    assert sa["num_trims_served"] >= 1 and sb["num_asks"] >= 1
    assert sa["claim"] == 0 and sb["claim"] == 64 * MIB


# ---- dead and silent members ----


def test_a_member_killed_mid_allocation_gives_its_share_back_within_2s(workers, share_dir):
    a, b = workers(), workers()
    name = _name()
    a.call("join", name=name, budget=64 * MIB)
    b.call("join", name=name)
    a.call("alloc", size=32 * MIB)  # held until the end
    a.send("spin", size=32 * MIB)  # and the rest, allocated and freed in a loop
    assert a._read(30)["rc"] == Status.OK
    time.sleep(0.2)
    os.kill(a.pid, signal.SIGKILL)  # not reaped: a zombie for now
    t0 = time.monotonic()
    out = b.call("alloc_until", size=64 * MIB, seconds=5.0)
    elapsed = time.monotonic() - t0
    assert out["rc"] == Status.OK, out
    assert elapsed < 2.0, out
    assert b.call("stats")["share"]["num_reclaimed"] >= 1
    a.kill()
    # the slot is free for a newcomer
    c = workers()
    c.call("join", name=name)
    assert c.call("stats")["share"]["members"] == 2


def test_a_member_that_stops_answering_is_noticed_and_not_waited_for(workers, share_dir):
    a, b = workers(), workers()
    name = _name()
    a.call("join", name=name, budget=64 * MIB)
    b.call("join", name=name)
    assert a.call("alloc", size=64 * MIB)["rc"] == Status.OK
    a.call("free")  # idle in a's pool: a would give it back if it could
    _stop(a.pid)
    try:
        t0 = time.monotonic()
        assert b.call("alloc", size=64 * MIB)["rc"] == Status.BUDGET
        first = time.monotonic() - t0
        assert first < 3.0  # bounded waits, never a hang
        time.sleep(1.2)
        (sh,) = share.list_shares(str(share_dir))
        state = {m.pid: m for m in sh.members}
        assert state[a.pid].unresponsive and state[a.pid].alive
        assert not state[b.pid].unresponsive
        t0 = time.monotonic()
        assert b.call("alloc", size=64 * MIB)["rc"] == Status.BUDGET
        assert time.monotonic() - t0 < first  # not waited for again
    finally:
        os.kill(a.pid, signal.SIGCONT)
    out = b.call("alloc_until", size=64 * MIB, seconds=5.0)  # a answers again
    assert out["rc"] == Status.OK, out


# ---- the stats listing ----


def test_stats_lists_every_member_with_pid_device_and_bytes(workers, share_dir):
    a, b = workers(), workers(WORKER_DEVICE="1", BRIDGE_STANDIN_UUID_BASE="-1")
    name = _name()
    a.call("join", name=name, budget=64 * MIB)
    b.call("join", name=name)
    a.call("alloc", size=6 * MIB)
    b.call("alloc", size=10 * MIB)
    time.sleep(0.6)  # the service threads publish every 250 ms
    env = dict(os.environ, BRIDGE_SHARE_DIR=str(share_dir))
    r = subprocess.run(
        [sys.executable, "-m", "bridge", "stats", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    (sh,) = json.loads(r.stdout)["shares"]
    assert sh["name"] == name and sh["budget"] == 64 * MIB
    members = {m["pid"]: m for m in sh["members"]}
    assert set(members) == {a.pid, b.pid}
    assert members[a.pid]["device"] == 0 and members[b.pid]["device"] == 1
    assert members[a.pid]["by_framework"]["cupy"] == 6 * MIB
    assert members[b.pid]["by_framework"]["cupy"] == 10 * MIB
    assert all(m["alive"] for m in members.values())
    text = subprocess.run(
        [sys.executable, "-m", "bridge", "stats"], capture_output=True, text=True, env=env
    ).stdout
    assert f"share {name!r}" in text and str(a.pid) in text and str(b.pid) in text


def test_a_slot_naming_a_process_that_does_not_map_the_file_is_not_believed(workers, share_dir):
    a = workers()
    name = _name()
    a.call("join", name=name, budget=64 * MIB)
    f = _only_file(share_dir)
    # a process of this user writes a slot for this test process (alive, but
    # not a member): listed as not alive, and its claim taken back by the
    # member's next scan (every second)
    slot = LAYOUT["header_size"] + 5 * LAYOUT["slot_size"]
    word = (os.getpid() << LAYOUT["unit_bits"]) | 8
    with open(f, "r+b") as fh:
        fh.seek(slot + LAYOUT["off_word"])
        fh.write(struct.pack("<Q", word))
    (sh,) = share.list_shares(str(share_dir))
    fake = [m for m in sh.members if m.pid == os.getpid()]
    assert fake and not fake[0].alive
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and a.call("stats")["share"]["num_reclaimed"] < 1:
        time.sleep(0.1)
    (sh,) = share.list_shares(str(share_dir))
    assert [m.pid for m in sh.members] == [a.pid]


# ---- corrupt and foreign files (joins that fail change nothing: in-process) ----


def _path_for(share_dir: pathlib.Path, name: str) -> pathlib.Path:
    """The file a join of `name` on device 0 uses (learned from a worker)."""
    w = Worker(BRIDGE_SHARE_DIR=str(share_dir))
    try:
        w.call("join", name=name, budget=64 * MIB)
        path = pathlib.Path(w.call("stats")["share"]["path"])
    finally:
        w.close()
    return path


def _join_error(name: str, budget: int = 64 * MIB) -> str:
    with pytest.raises(BridgeError) as exc:
        share.join(0, name, budget)
    return str(exc.value)


def test_corrupt_files_give_a_clear_error_never_a_crash(standin, share_dir):
    name = _name()
    path = _path_for(share_dir, name)
    good = path.read_bytes()
    bad_magic = b"\xff" * 8 + good[8:]
    cases = {
        "magic number": bad_magic,
        "layout version": good[:8] + struct.pack("<I", 99) + good[12:],
        "wrong size": good[:100],
        "names another share": good[: LAYOUT["off_name"]]
        + b"other\0".ljust(64, b"\0")
        + good[LAYOUT["off_name"] + 64 :],
    }
    for why, data in cases.items():
        path.write_bytes(data)
        msg = _join_error(name)
        assert why in msg and str(path) in msg and "remove" in msg, (why, msg)
        (sh,) = share.list_shares(str(share_dir))
        if why != "names another share":  # the reader shows that one as it is
            assert sh.error is not None and not sh.members, why
    assert core.share_stats(0) == (Status.OK, None)  # nothing joined


def test_damaged_headers_are_refused_and_random_bytes_never_crash_the_reader(standin, share_dir):
    name = _name()
    path = _path_for(share_dir, name)
    rng = random.Random(7)
    good = path.read_bytes()
    checked = list(range(32)) + list(range(LAYOUT["off_uuid"], LAYOUT["off_uuid"] + 16))
    for _ in range(50):
        data = bytearray(good)
        i = rng.choice(checked)
        data[i] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        with pytest.raises(BridgeError, match="corrupt or not bridge's"):
            share.join(0, name, 64 * MIB)
        for _ in range(rng.randrange(1, 64)):  # anywhere now: the reader never raises
            data[rng.randrange(len(data))] = rng.randrange(256)
        path.write_bytes(bytes(data))
        for sh in share.list_shares(str(share_dir)):
            assert sh.error is not None or sh.claimed >= 0
    assert core.share_stats(0) == (Status.OK, None)  # nothing joined


def test_garbage_claims_in_the_slots_are_taken_back(workers, share_dir):
    name = _name()
    path = _path_for(share_dir, name)  # its member has exited
    data = bytearray(path.read_bytes())
    ub = LAYOUT["unit_bits"]
    garbage = [
        (0 << ub) | 16,  # a claim without an owner
        (4_000_000 << ub) | 16,  # a pid that does not exist
        (os.getpid() << ub) | 16,  # a live pid whose start time is not the slot's
    ]
    for i, word in enumerate(garbage):
        o = LAYOUT["header_size"] + (10 + i) * LAYOUT["slot_size"]
        struct.pack_into("<Q", data, o + LAYOUT["off_word"], word)
        struct.pack_into("<Q", data, o + LAYOUT["off_start"], 12345)
    path.write_bytes(bytes(data))
    w = workers()
    w.call("join", name=name)
    assert w.call("alloc", size=64 * MIB)["rc"] == Status.OK
    assert w.call("stats")["share"]["num_reclaimed"] >= 3


def test_a_member_survives_its_file_being_scribbled_on(workers, share_dir):
    w = workers()
    name = _name()
    w.call("join", name=name, budget=64 * MIB)
    path = _only_file(share_dir)
    with open(path, "r+b") as f:  # in place: the member's mapping sees it
        f.write(bytes(range(256)) * (LAYOUT["file_size"] // 256))
    for _ in range(20):
        out = w.call("alloc", size=2 * MIB)
        assert out["rc"] in (Status.OK, Status.BUDGET)
    w.call("free")
    w.call("trim")
    (sh,) = share.list_shares(str(share_dir))
    assert sh.error is not None and "corrupt" in sh.error


def test_a_file_other_users_can_read_is_refused(standin, share_dir):
    name = _name()
    path = _path_for(share_dir, name)
    path.chmod(0o644)
    msg = _join_error(name)
    assert "other users" in msg and "remove" in msg
    (sh,) = share.list_shares(str(share_dir))
    assert sh.error is not None and "mode 644" in sh.error


def test_a_symbolic_link_is_refused(standin, share_dir):
    name = _name()
    path = _path_for(share_dir, name)
    target = share_dir / "elsewhere"
    path.rename(target)
    path.symlink_to(target)
    msg = _join_error(name)
    assert "symbolic link" in msg


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")
def test_a_file_of_another_user_is_refused(standin, share_dir):
    name = _name()
    path = _path_for(share_dir, name)
    os.chown(path, 65534, 65534)
    msg = _join_error(name)
    assert "another user" in msg
    (sh,) = share.list_shares(str(share_dir))
    assert sh.error is not None and "uid 65534" in sh.error


def test_only_this_users_files_are_listed(standin, share_dir):
    (share_dir / "bridge-99999-x-y").write_bytes(b"not ours")
    (share_dir / "unrelated").write_bytes(b"x")
    assert share.list_shares(str(share_dir)) == []
    assert share.list_shares(str(share_dir / "missing")) == []


# ---- names ----


@pytest.mark.parametrize("bad", ["", "x" * 64, "tab\there", 3, b"bytes"])
def test_bad_share_names_are_refused(bad):
    with pytest.raises(ValueError, match="share"):
        share.share_name(bad)


def test_share_names_from_arguments_and_environment(monkeypatch):
    monkeypatch.delenv("BRIDGE_SHARE", raising=False)
    assert share.share_name(None) is None
    assert share.share_name(False) is None
    assert share.share_name(True) == "default"
    assert share.share_name("workers") == "workers"
    monkeypatch.setenv("BRIDGE_SHARE", "from-env")
    assert share.share_name(None) == "from-env"
    assert share.share_name(False) is None
    monkeypatch.setenv("BRIDGE_SHARE", "x" * 64)
    with pytest.raises(ValueError, match="BRIDGE_SHARE"):
        share.share_name(None)


def test_unify_with_a_share_joins_it(share_dir):
    script = (
        "import bridge\n"
        "b = bridge.unify(cupy=False, torch=False, budget='64MiB', share='u1')\n"
        "assert bridge.unify(cupy=False, torch=False, budget='64MiB', share='u1') is b\n"
        "from bridge import share\n"
        "m = share.membership(0)\n"
        "assert m['name'] == 'u1' and m['budget'] == 64 << 20, m\n"
        "s = bridge.stats(0)\n"
        "assert s.share['name'] == 'u1' and s.share['members'] == 1, s.share\n"
        "from bridge._errors import Status, oom_message\n"
        "msg = oom_message(0, 1 << 30, Status.BUDGET, framework='cupy')\n"
        "assert \"the share 'u1' (1 process on this GPU)\" in msg, msg\n"
        "print('ok')\n"
    )
    env = dict(os.environ, BRIDGE_SHARE_DIR=str(share_dir))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    env["BRIDGE_SHARE"] = "u1"
    script = "import bridge\nbridge.unify(cupy=False, torch=False)\n" + script.split("\n", 3)[3]
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_unify_refuses_a_bad_share_before_changing_anything():
    import bridge
    from bridge.unify import current

    before = current()
    with pytest.raises(ValueError, match="share"):
        bridge.unify(cupy=False, torch=False, budget="1GiB", share="")
    assert current() is before


def test_the_stats_keys_match_the_stub(workers, share_dir):
    from test_core_stub import _typed_dict_keys

    w = workers()
    w.call("join", name=_name(), budget=8 * MIB)
    assert set(w.call("stats")["share"]) == _typed_dict_keys("ShareStats")


def test_the_share_benchmark_runs_on_the_standin(standin, tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run(
        [
            sys.executable,
            str(HERE.parent / "benchmarks" / "bench_share.py"),
            "--framework=core",
            "--iters=200",
            "--repeats=2",
            "--warmup=20",
            f"--json={out}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, BRIDGE_SHARE_DIR=tempfile.mkdtemp()),
    )
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["status"] == "ok", res
    assert set(res["configs"]) == {"own", "share", "own-pool", "share-pool"}
    assert res["configs"]["share"]["info"]["share"]["members"] == 1
    assert res["configs"]["own"]["info"]["share"] is None
    assert set(res["ratios"]) == {"share/own", "share-pool/own-pool"}


def test_a_new_owners_slot_is_not_judged_by_its_former_owners_start_time(workers, share_dir):
    a = workers()
    name = _name()
    a.call("join", name=name, budget=64 * MIB)
    f = _only_file(share_dir)
    o = LAYOUT["header_size"] + 7 * LAYOUT["slot_size"]
    gen_shift = LAYOUT["unit_bits"] + LAYOUT["pid_bits"]
    word = (3 << gen_shift) | (a.pid << LAYOUT["unit_bits"]) | 1
    with open(f, "r+b") as fh:  # as a member of generation 3 looks while it sets up:
        fh.seek(o + LAYOUT["off_start"])  # the start time and its generation are the
        fh.write(struct.pack("<Q", 12345))  # former owner's (generation 2)
        fh.seek(o + LAYOUT["off_fields_gen"])
        fh.write(struct.pack("<I", 2))
        fh.seek(o + LAYOUT["off_word"])
        fh.write(struct.pack("<Q", word))
    time.sleep(1.5)  # a's service thread looks every second
    (sh,) = share.list_shares(str(share_dir))
    assert [m.alive for m in sh.members if m.pid == a.pid] == [True, True]
    assert a.call("stats")["share"]["num_reclaimed"] == 0
    with open(f, "r+b") as fh:  # now the start time is the owner's own: a wrong one
        fh.seek(o + LAYOUT["off_fields_gen"])
        fh.write(struct.pack("<I", 3))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and a.call("stats")["share"]["num_reclaimed"] < 1:
        time.sleep(0.1)
    (sh,) = share.list_shares(str(share_dir))
    assert [m.pid for m in sh.members] == [a.pid]


def test_an_allocation_claims_the_pools_growth_chunk_while_in_flight(workers, share_dir):
    """A GPU's default pool grows in 32 MiB chunks (H200): by default a 1 MiB
    allocation must be able to claim 32 MiB, so a share of 16 MiB refuses it;
    with BRIDGE_SHARE_GROWTH at 2 MiB (this stand-in's pool grows by what is
    allocated) it fits, written in bytes or with a unit as every size; a setting that is not
    a multiple of 2 MiB is refused at join (as doctor refuses it), never ignored."""
    name = _name()
    default = workers(BRIDGE_SHARE_GROWTH="")
    default.call("join", name=name, budget=16 * MIB)
    assert default.call("alloc", size=MIB)["rc"] == Status.BUDGET
    odd = workers(BRIDGE_SHARE_GROWTH="3MiB")
    odd.send("join", name=name, budget=16 * MIB)
    err = odd._read(60)["error"]
    assert err.startswith("ValueError: BRIDGE_SHARE_GROWTH='3MiB' is not a valid growth")
    assert odd.call("stats")["share"] is None  # refused before joining
    for growth in (str(2 << 20), "2MiB"):
        small = workers(BRIDGE_SHARE_GROWTH=growth)
        small.call("join", name=name, budget=16 * MIB)
        assert small.call("alloc", size=MIB)["rc"] == Status.OK
        assert small.call("stats")["share"]["claim"] <= 4 * MIB


def test_one_truth_in_a_share_what_stats_show_is_what_refuses(share_dir):
    """In a share of 2 GiB, a later budget of 8 GiB is refused naming both budgets (it
    could not apply: the share refuses first), and stats show the share's 2 GiB."""
    script = (
        "import bridge, pytest\n"
        "from bridge import BridgeError\n"
        "b = bridge.unify(cupy=False, torch=False, budget='2GiB', share='s1')\n"
        "assert bridge.stats(0).limit == 2 << 30 and bridge.pool(0).get_limit() == 2 << 30\n"
        "for call in (dict(budget='8GiB'), dict(budget='3GiB', share='s1')):\n"
        "    with pytest.raises(BridgeError) as info:\n"
        "        bridge.unify(cupy=False, torch=False, **call)\n"
        "    msg = str(info.value)\n"
        "    assert \"the share 's1'\" in msg and '2.00 GiB' in msg, msg\n"
        "    assert ('8.00 GiB' in msg) or ('3.00 GiB' in msg), msg\n"
        "    assert bridge.stats(0).limit == 2 << 30\n"
        "with pytest.raises(BridgeError, match=\"already uses the share 's1'.*2.00 GiB\"):\n"
        "    bridge.unify(cupy=False, torch=False, share='s2')\n"
        "assert bridge.unify(cupy=False, torch=False, budget='2GiB', share='s1') is b\n"
        "print('ok')\n"
    )
    env = dict(os.environ, BRIDGE_SHARE_DIR=str(share_dir))
    env.pop("BRIDGE_SHARE", None)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_a_member_joining_without_a_budget_shows_the_shares_budget(workers, share_dir):
    a, b = workers(), workers()
    name = _name()
    a.call("join", name=name, budget=64 * MIB)
    b.call("join", name=name)  # adopts the share's budget; its own limit stays 0
    assert b.call("stats")["share"]["budget"] == 64 * MIB
    from bridge.pool import effective_limit

    assert effective_limit(0, {"budget": 64 * MIB}) == 64 * MIB
    assert effective_limit(8 << 30, {"budget": 64 * MIB}) == 64 * MIB
    assert effective_limit(32 * MIB, {"budget": 64 * MIB}) == 32 * MIB
    assert effective_limit(0, None) == 0


def test_stats_do_not_list_an_ended_process_as_a_member(workers, share_dir):
    from bridge.tools import cli

    a, b = workers(), workers()
    name = _name()
    a.call("join", name=name, budget=64 * MIB)
    b.call("join", name=name)
    a.call("alloc", size=6 * MIB)
    time.sleep(0.6)
    b.proc.kill()
    b.proc.wait()
    (sh,) = [s for s in share.list_shares(str(share_dir)) if s.name == name]
    text = cli.format_shares([sh])
    head = text.splitlines()[0]
    assert "by 1 process" in head, text
    ended = [m for m in sh.members if not m.alive]
    if any(m.claim for m in ended):  # not yet taken back: said apart, never as a member
        assert "ended process" in head
    else:
        assert str(b.pid) not in text


def test_a_process_that_calls_exec_and_joins_again_holds_one_slot(workers, share_dir):
    """Issue 30, item 6: after exec() the pid and the start time stay, so nobody saw
    the old image's slot as dead, and joining from the new image took a second one:
    the old claim stayed counted against the budget for good."""
    a = workers()
    name = _name()
    a.call("join", name=name, budget=64 * MIB)
    assert a.call("alloc", size=8 * MIB)["rc"] == Status.OK
    assert a.call("exec")["pid"] == a.pid  # the new image says it is ready
    a.call("join", name=name)
    (sh,) = share.list_shares(str(share_dir))
    assert [m.pid for m in sh.members] == [a.pid]
    assert a.call("stats")["share"]["claim"] < 8 * MIB  # the old image's claim is gone
    b = workers()
    b.call("join", name=name)
    assert b.call("alloc", size=56 * MIB)["rc"] == Status.OK


def test_a_waiting_allocation_asks_the_others_to_trim_once(workers, share_dir):
    """Issue 30, item 7: each retry of a waiting allocation made every other member
    trim (cache flush, synchronization, pool trim; up to 0.5 s each ask)."""
    name = _name()
    holder, waiter = workers(), workers()
    holder.call("join", name=name, budget=16 * MIB)
    waiter.call("join", name=name)
    assert holder.call("alloc", size=12 * MIB)["rc"] == Status.OK  # live: no trim helps
    served0 = holder.call("stats")["share"]["num_trims_served"]
    out = waiter.call("alloc_wait", size=8 * MIB, seconds=2.0)
    assert out["rc"] == Status.BUDGET and out["elapsed"] >= 1.5
    st = waiter.call("stats")["share"]
    assert st["num_asks"] <= 2, st  # before the wait (and its last try), not every retry
    assert holder.call("stats")["share"]["num_trims_served"] - served0 <= 2
    holder.call("free")
    # once the holder freed memory, an ask is worth it again: the next wait gets it
    assert waiter.call("alloc_wait", size=8 * MIB, seconds=2.0)["rc"] == Status.OK


def test_a_new_allocation_right_after_a_refusal_asks_again(workers, share_dir):
    """Issue (H200, 2026-12-02: test_gpu_share's 6 GiB hold refused though the
    others held only cached memory): a refused allocation asked the others to trim;
    they freed within the second after, and the next allocation did not ask (asked
    under a second ago, and their published live bytes were not yet lower), so it
    was refused with the memory idle in their pools."""
    name = _name()
    a, b = workers(), workers()
    a.call("join", name=name, budget=64 * MIB)
    b.call("join", name=name)
    assert a.call("alloc", size=64 * MIB)["rc"] == Status.OK  # live: no trim helps b
    assert b.call("alloc", size=32 * MIB)["rc"] == Status.BUDGET  # b asked a
    a.call("free")  # a's pool keeps it: a's claim stays until a trims
    out = b.call("alloc", size=32 * MIB)  # within the second: b must ask a again
    assert out["rc"] == Status.OK, (out, b.call("stats")["share"])
    assert b.call("stats")["share"]["num_asks"] >= 2


# ---- what each member is (the cluster plugins' labels, for bridge stats) ----


def test_a_label_names_its_living_process_only_and_an_ended_ones_goes(share_dir):
    share.set_worker_label("dask worker 0\ntcp://127.0.0.1:1 " + "x" * 300)
    (label,) = share.worker_labels().values()
    assert list(share.worker_labels()) == [os.getpid()]
    assert label.startswith("dask worker 0 tcp://127.0.0.1:1 x") and len(label) == 200
    # a process that labelled itself and ended: its label is not believed, and goes
    code = "from bridge import share; share.set_worker_label('ray actor 1 (0.5 GPU)')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    folder = share_dir / f"bridge-{os.geteuid()}.workers"
    assert len(list(folder.iterdir())) == 2
    assert list(share.worker_labels()) == [os.getpid()]
    share.set_worker_label("dask worker 0")
    assert [p.name for p in folder.iterdir()] == [str(os.getpid())]
    # a label of a living pid with another start time is a former process's (pid reused)
    (folder / str(os.getppid())).write_text(json.dumps({"start": 1, "label": "old"}))
    assert os.getppid() not in share.worker_labels()
    # no share file is a label: list_shares reads none of them
    assert share.list_shares(str(share_dir)) == []


_LABEL_WRITER = """
import sys
from bridge import share
for line in sys.stdin:
    share.set_worker_label("worker " + line.strip())
    print("written", flush=True)
"""


def test_labels_written_at_once_by_several_workers_all_stay(share_dir):
    """Workers of a cluster start together and write their first labels at once; the
    cleanup of ended processes' labels that each write does must never take another
    living worker's label for an ended one (one written between the cleanup's two
    readings of the folder was deleted, and `bridge stats` showed that worker unnamed)."""
    n, rounds = 6, 100
    folder = share_dir / f"bridge-{os.geteuid()}.workers"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _LABEL_WRITER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    try:
        for r in range(rounds):
            for i, p in enumerate(procs):  # every worker writes its label at once
                p.stdin.write(f"{i} round {r}\n")
                p.stdin.flush()
            for p in procs:
                assert p.stdout.readline() == "written\n"
            labels = share.worker_labels()
            assert labels == {p.pid: f"worker {i} round {r}" for i, p in enumerate(procs)}, r
            for label in folder.iterdir():  # the next round writes first labels again,
                label.unlink()  # as the workers of a cluster that starts do
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)


def test_free_memory_queries_answer_within_the_shares_budget(workers, share_dir):
    """torch.cuda.mem_get_info and CuPy's memGetInfo (bridge.mem_get_info) answer within the
    share's budget, less what the other members claim: a tool sizing itself by them (90% of
    what is free) must not be told of memory the share refuses.  A member that adopted the
    share's budget (no budget of its own) and one that gave it alike."""
    a, b = workers(), workers()
    name = _name()
    a.call("join", name=name, budget=64 * MIB)
    b.call("join", name=name)  # adopts the share's budget; its own limit stays 0
    assert a.call("alloc", size=40 * MIB)["rc"] == Status.OK
    info = b.call("mem_info")
    assert (info["free"], info["total"]) == (24 * MIB, 64 * MIB), info
    assert info["view"] == [24 * MIB, 64 * MIB], info  # what the frameworks' queries answer
    assert b.call("alloc", size=info["free"] + 1)["rc"] == Status.BUDGET
    assert b.call("alloc", size=info["free"])["rc"] == Status.OK
    info = a.call("mem_info")
    assert (info["free"], info["total"]) == (0, 64 * MIB), info
    b.call("free")
    b.call("trim")  # b's pool gives the memory back: its claim goes with it
    info = a.call("mem_info")
    assert (info["free"], info["total"]) == (24 * MIB, 64 * MIB), info


def test_a_request_larger_than_the_shares_budget_does_not_wait(workers, share_dir):
    """No free can make room for a request larger than the share's budget: it is refused
    at once, as one larger than the process's own budget is (WAIT_HOPELESS, which the
    out-of-memory message words), not after the whole wait."""
    a = workers()
    a.call("join", name=_name(), budget=16 * MIB)  # the share's budget; no budget of its own
    out = a.call("alloc_wait", size=16 * MIB + 1, seconds=5.0)
    assert out["rc"] == Status.BUDGET and out["outcome"] == core.WAIT_HOPELESS, out
    assert out["elapsed"] < 2.0, out
    out = a.call("alloc_wait", size=16 * MIB, seconds=5.0)  # at the budget: served
    assert out["rc"] == Status.OK, out
