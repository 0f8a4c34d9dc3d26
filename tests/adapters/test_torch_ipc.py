# SPDX-License-Identifier: Apache-2.0
"""torch's shareIpcHandle and getIpcDevPtr on the bridge's C++ allocator, on the stand-in.

Needs torch with its C++ headers, a compiler and ninja (skipped otherwise, as
in CI).  torch cannot start CUDA without a GPU, so the two calls are reached
through the module's test entry points, which call them as
``storage._share_cuda_()`` and ``_new_shared_cuda`` do (torch's current
allocator); the producer and the consumer are separate processes, each with
its own stand-in.  A CUDA tensor through ``torch.multiprocessing`` is
tests/gpu/test_gpu_ipc.py's.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys

import pytest
from torch_util import cuda_torch

cuda_torch()

SETUP = r"""
import ctypes, json, sys
import torch
from bridge import _runtime
from bridge._runtime import core
from bridge.adapters import torch_build
_runtime.ensure_device(0)
missing = torch_build.missing_tools()
if missing:
    print("RESULT " + json.dumps({"skip": missing}), flush=True); raise SystemExit
mod = torch_build.load()
assert mod is not None, torch_build.reason
mod.install(core.__file__)
def say(**kw):
    print("RESULT " + json.dumps(kw), flush=True)
"""

PRODUCER = (
    SETUP
    + r"""
IPC = sys.argv[1] == "1"
if IPC:
    assert core.ipc_enable(0) == 0
p = mod._alloc_on(4096, 0, 0)
if IPC:  # (the stand-in's default pool has no bytes behind its addresses)
    ctypes.memmove(p, bytes(range(256)) * 16, 4096)
try:
    h, off = mod._share_ipc_handle(p)
    say(handle=h.hex(), offset=off, ptr=p)
except RuntimeError as e:
    say(error=str(e).splitlines()[0])
for line in sys.stdin:
    op = json.loads(line)["op"]
    if op == "free":
        mod._free(p); say()
    elif op == "alloc":
        say(ptr=mod._alloc_on(4096, 0, 0))
    elif op == "holds":
        say(holds=core.ipc_counts()[0])
    elif op == "head":
        say(hex=ctypes.string_at(p, 4).hex())
"""
)

CONSUMER = (
    SETUP
    + r"""
q = mod._open_ipc_handle(bytes.fromhex(sys.argv[1]))
data = ctypes.string_at(q, 4096)
ctypes.memmove(q, b"\xde\xad\xbe\xef", 4)
imported = core.ipc_counts()[1]
mod._close_ipc_handle(q)
say(ok=data == bytes(range(256)) * 16, imported=imported, after=core.ipc_counts()[1])
"""
)


class Producer:
    def __init__(self, ipc: bool) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PRODUCER, "1" if ipc else "0"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.first = self.read()

    def read(self) -> dict:
        assert self.proc.stdout is not None
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], 300)
            assert ready, "the producer did not answer"
            line = self.proc.stdout.readline()
            assert line, self.proc.stderr.read() if self.proc.stderr else "ended"
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT ") :])

    def __call__(self, op: str) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op}) + "\n")
        return self.read()

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(60)


def consume(handle: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", CONSUMER, handle], capture_output=True, text=True, timeout=300
    )
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.fixture
def producer(standin):
    made: list[Producer] = []

    def make(ipc: bool) -> Producer:
        p = Producer(ipc)
        made.append(p)
        if "skip" in p.first:
            pytest.skip(f"the torch module cannot be built here: {p.first['skip']}")
        return p

    yield make
    for p in made:
        p.close()


def test_another_process_reads_the_bytes_through_torchs_handle(producer):
    p = producer(True)
    assert p.first["offset"] == 0 and len(bytes.fromhex(p.first["handle"])) == 152
    got = consume(p.first["handle"])
    assert got == {"ok": True, "imported": 1, "after": 0}
    assert p("head")["hex"] == "deadbeef"  # the consumer wrote the producer's block
    assert p("holds")["holds"] == 0  # let go when torch's reference went


def test_a_block_of_the_default_pool_is_a_clear_error(producer):
    p = producer(False)
    msg = p.first["error"]
    assert msg.startswith("bridge: this CUDA tensor cannot be sent to another process")
    assert "unify(ipc=True)" in msg and "tensor.cpu()" in msg


def test_a_handle_of_a_block_its_producer_freed_is_refused_with_what_to_do(producer):
    p = producer(True)
    p("free")  # torch's deleter: nobody held the block, so it went back
    got = subprocess.run(
        [sys.executable, "-c", CONSUMER, p.first["handle"]],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode != 0
    assert "bridge: a CUDA tensor from another process cannot be opened here" in got.stderr
    assert "keep the sender's tensor alive until it is received" in got.stderr
