# SPDX-License-Identifier: Apache-2.0
"""Blocks shared between processes (bridge.unify(ipc=True)), on the stand-in.

Producer and consumer are separate processes (tests/ipc_worker.py), each with
its own stand-in driver; the stand-in backs an exportable pool with a memfd,
so the descriptor the producer sends over its socket maps the same bytes in
the consumer.  unify(ipc=True) is for the life of a process, so this test
process never turns it on.  The stand-in is never evidence that anything
works on a GPU (tests/gpu/test_gpu_ipc.py is).
"""

from __future__ import annotations

import json
import os
import pathlib
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

import pytest

from bridge._errors import Status

HERE = pathlib.Path(__file__).resolve().parents[1]  # tests/: the helpers
MIB = 1 << 20
SOCK_AT = 32  # the socket's name in the handle: after magic, version, device, ptr, size


class Worker:
    """A process driven over a pipe (one JSON line each way)."""

    def __init__(self) -> None:
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "ipc_worker.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
            bufsize=1,
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
            raise AssertionError(f"worker {self.proc.pid} ended: {self.err.read()}")
        return json.loads(line)

    def __call__(self, op: str, **kw: object) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        return self._read(60)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(30)
        self.err.close()


@pytest.fixture
def workers(standin):
    made: list[Worker] = []

    def make() -> Worker:
        w = Worker()
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


def shared(producer: Worker, size: int, data: bytes) -> tuple[int, str]:
    """A block of the producer's exportable pool holding `data`, and its handle."""
    assert producer("unify", ipc=True)["ipc"] is True
    a = producer("alloc", size=size)
    assert a["rc"] == Status.OK
    producer("write", ptr=a["ptr"], hex=data.hex())
    e = producer("export", ptr=a["ptr"])
    assert e["rc"] == Status.OK, e
    assert e["offset"] == 0
    return a["ptr"], e["handle"]


def wait_for(fn, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not fn():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def served_connection(name: bytes) -> socket.socket:
    """A connection to the exporter's socket `name` that asked for device 0's pool and was
    given its descriptor (closed here); the connection stays open."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(b"\0" + name)
    s.sendall(struct.pack("<IiQ", 1, 0, 0))
    msg, anc, _, _ = s.recvmsg(4, socket.CMSG_SPACE(4))
    assert struct.unpack("<i", msg)[0] == 0 and len(anc) == 1
    os.close(struct.unpack("i", anc[0][2][:4])[0])
    return s


def test_a_spawned_process_reads_and_writes_the_block_through_its_handle(workers):
    p, c = workers(), workers()
    data = bytes(range(256)) * 16
    ptr, handle = shared(p, 4096, data)
    c("unify")  # the consumer needs no ipc=True of its own to import
    got = c("import", handle=handle)
    assert got["rc"] == Status.OK, got
    assert got["ptr"] != 0
    assert bytes.fromhex(c("read", ptr=got["ptr"], n=4096)["hex"]) == data
    c("write", ptr=got["ptr"], hex="c0ffee")  # the same bytes, not a copy
    assert p("read", ptr=ptr, n=3)["hex"] == "c0ffee"
    assert p("counts")["holds"] == 1
    assert c("release", ptr=got["ptr"])["imported"] == 0
    assert p("counts")["holds"] == 0


def test_the_exporters_descriptors_stay_out_of_its_children(workers):
    """The first export opens the server's socket and the pool's descriptor; neither
    stays open in a child the exporter forks (a DataLoader worker, a fork-started
    process: it serves nothing) nor in a program it runs (os.system, subprocess)."""
    p = workers()
    assert p("unify", ipc=True)["ipc"] is True
    ptr = p("alloc", size=4096)["ptr"]
    before = p("fds")
    assert p("export", ptr=ptr)["rc"] == Status.OK
    after = p("fds")
    opened = set(after["here"]) - set(before["here"])  # "number target"
    assert len(opened) == 2, (before, after)  # the socket and the pool's descriptor
    assert not opened & set(after["forked"]), after
    assert not opened & set(after["program"]), after


def test_every_block_is_exportable_under_ipc_whatever_the_cache_does(workers):
    """The cache carves segments by default; a block carved from a segment is not an
    allocation of the pool of its own and cannot be exported, so unify(ipc=True) turns
    segments off: blocks of every size, allocated and freed in any order, export."""
    p = workers()
    assert p("unify", ipc=True)["ipc"] is True
    ptrs = [p("alloc", size=n)["ptr"] for n in (4096, 4096, 3 << 20, 3 << 20)]
    p("free", ptr=ptrs[0])
    ptrs[0] = p("alloc", size=2048)["ptr"]
    for ptr in ptrs:
        e = p("export", ptr=ptr)
        assert e["rc"] == Status.OK, e
        assert e["offset"] == 0
    assert p("stats")["carve_held"] == 0  # nothing carved


def test_a_block_of_the_default_pool_is_refused_with_what_to_do(workers):
    p = workers()
    assert p("unify")["ipc"] is False
    a = p("alloc", size=4096)
    e = p("export", ptr=a["ptr"])
    assert e["rc"] == Status.IPC
    assert "unify(ipc=True)" in e["error"] and "BRIDGE_IPC=1" in e["error"]


def test_the_exportable_pools_grant_the_other_devices_access_as_the_default_pools(workers):
    """unify(device=[0, 1], ipc=True) (peer_access=True by default): each device's
    tensors are read by the other's kernels, whichever pool they come from."""
    p = workers()
    assert p("unify", ipc=True, devices=[0, 1])["ipc"] is True
    for d in (0, 1):
        g = p("grants", device=d)
        assert g["default"] == 1, g
        assert g["exportable"] == g["default"], (d, g)


def test_the_environment_turns_it_on(workers, monkeypatch):
    monkeypatch.setenv("BRIDGE_IPC", "1")
    assert workers()("unify")["ipc"] is True
    monkeypatch.setenv("BRIDGE_IPC", "maybe")
    bad = workers()("unify")
    assert bad["exception"] == "ValueError" and "BRIDGE_IPC='maybe'" in bad["message"]


def test_a_garbage_handle_is_refused(workers):
    c = workers()
    c("unify")
    got = c("import", handle=(b"x" * 152).hex())
    assert got["rc"] == Status.INVALID and "not a handle" in got["error"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_a_process_of_another_user_gets_no_descriptor(workers):
    p = workers()
    _, handle = shared(p, 4096, b"secret")
    name = bytes.fromhex(handle)[SOCK_AT : SOCK_AT + 56].split(b"\0")[0]
    # a forked child of this process turned into user 65534 asks for the pool's descriptor
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(b"\0" + name)
            try:
                s.sendall(struct.pack("<IiQ", 1, 0, 0))
            except BrokenPipeError:
                pass  # the refusal may close the connection first; its status is there
            msg, anc, _, _ = s.recvmsg(4, socket.CMSG_SPACE(4))
            st = struct.unpack("<i", msg)[0] if len(msg) == 4 else -1
            os.write(w, f"{st} {len(anc)}".encode())
        except BaseException as e:
            os.write(w, repr(e).encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        assert f.read().split() == ["1", "0"]  # refused, no descriptor passed
    assert p("counts")["refused"] == 1
    # the same request from this user gets the descriptor
    served_connection(name).close()
    assert p("counts")["refused"] == 1


def test_an_exporter_serving_its_most_processes_says_so_and_serves_again_once_one_leaves(
    workers,
):
    """An exporter serves 256 connections (one per importing process) at once: the next
    importer is told that, not that it is another user's, and imports once one closes."""
    p, c = workers(), workers()
    _, handle = shared(p, 4096, b"\x33")
    name = bytes.fromhex(handle)[SOCK_AT : SOCK_AT + 56].split(b"\0")[0]
    held = []
    try:
        for _ in range(256):  # the server's every connection, each asked once (accepted)
            held.append(served_connection(name))
        c("unify")
        got = c("import", handle=handle)
        assert got["rc"] == Status.IPC
        assert "256" in got["error"] and "user" not in got["error"], got
    finally:
        for s in held:
            s.close()
    wait_for(lambda: c("import", handle=handle)["rc"] == Status.OK)


def test_a_held_block_is_not_reused_until_the_consumer_lets_go(workers):
    p, c = workers(), workers()
    ptr, handle = shared(p, 64 * 1024, b"\x11" * 64)
    c("unify")
    got = c("import", handle=handle)
    assert got["rc"] == Status.OK
    p("free", ptr=ptr)  # the owner is done with it; the consumer is not
    others = [p("alloc", size=64 * 1024)["ptr"] for _ in range(4)]
    assert ptr not in others
    assert c("read", ptr=got["ptr"], n=64)["hex"] == "11" * 64
    c("release", ptr=got["ptr"])
    assert p("counts")["holds"] == 0
    # now it is free: the next allocation of its size gets it back
    assert p("alloc", size=64 * 1024)["ptr"] == ptr
    for q in others:
        p("free", ptr=q)


def test_a_killed_consumer_releases_its_hold(workers):
    p, c = workers(), workers()
    ptr, handle = shared(p, 2 * MIB, b"\x22")
    c("unify")
    assert c("import", handle=handle)["rc"] == Status.OK
    p("free", ptr=ptr)
    used_held = p("stats")["used"]
    assert used_held >= 2 * MIB  # still the producer's, counted
    c.kill()
    wait_for(lambda: p("counts")["holds"] == 0)
    wait_for(lambda: p("stats")["used"] == used_held - 2 * MIB)
    assert p("alloc", size=2 * MIB)["ptr"] == ptr


def test_the_budget_counts_a_shared_block_once(workers):
    p, c = workers(), workers()
    p("unify", ipc=True, budget=str(8 * MIB))
    a = p("alloc", size=6 * MIB)
    assert a["rc"] == Status.OK
    handle = p("export", ptr=a["ptr"])["handle"]
    c("unify", budget=str(8 * MIB))
    got = c("import", handle=handle)
    assert got["rc"] == Status.OK
    assert p("stats")["used"] == 6 * MIB
    assert c("stats")["used"] == 0  # the import is the producer's, in no other ledger
    assert c("alloc", size=7 * MIB)["rc"] == Status.OK
    # the default pool's other users count against the budget with the exportable pool's
    p("foreign", bytes=MIB)
    assert p("alloc", size=2 * MIB)["rc"] == Status.BUDGET
    assert p("alloc", size=MIB - 4096)["rc"] == Status.OK
