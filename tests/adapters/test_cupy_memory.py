# SPDX-License-Identifier: Apache-2.0
"""CuPy's blocks as BridgeMemory, a BaseMemory made in C, on the stand-in.

bridge._core.CupyAllocator, given CuPy's ``BaseMemory`` (``base_memory``), checks
once that CuPy's BaseMemory and MemoryPointer are laid out as Cython lays them
out, by storing values in C and reading them back through the classes' own
attributes; then it wraps each block in a ``BridgeMemory`` (whose dealloc frees
the block) inside a MemoryPointer made by its type's ``tp_new``. A layout that
does not check out keeps CuPy's ``UnownedMemory`` and says why. CuPy's classes
are stood in for by tests/standin/standin_cupy_memory.c (the right layout, and
two misplaced ones). The GPU half, on CuPy itself: tests/gpu/test_gpu_cupy.py.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import sysconfig
import weakref
from importlib import util

import pytest
from ledger_util import DEV, MIB, TAG_CUPY, stats

from bridge._runtime import core

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "..", "standin", "standin_cupy_memory.c")


def _build():
    out_dir = os.path.join(
        HERE, "..", "standin", "build", f"py{sys.version_info[0]}{sys.version_info[1]}"
    )
    os.makedirs(out_dir, exist_ok=True)
    lib = os.path.join(
        out_dir, "standin_cupy_memory" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")
    )
    if not os.path.exists(lib) or os.path.getmtime(lib) < os.path.getmtime(SOURCE):
        cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
        include = sysconfig.get_paths()["include"]
        cmd = cc.split() + ["-O1", "-g", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
                            f"-I{include}", "-o", lib + ".tmp", SOURCE]  # fmt: skip
        subprocess.run(cmd, check=True)
        os.replace(lib + ".tmp", lib)
    spec = util.spec_from_file_location("standin_cupy_memory", lib)
    module = util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mem_types = _build()


class Stream:
    def __init__(self, ptr: int = 0) -> None:
        self.ptr = ptr


def unowned(ptr, size, owner, dev):
    """CuPy's UnownedMemory, stood in for: the owner is kept, as CuPy keeps it."""
    return ("unowned", ptr, size, owner, dev)


def allocator(base=mem_types.BaseMemory, pointer=mem_types.MemoryPointer, streams=None):
    def get_stream():
        s = Stream(0)
        if streams is not None:
            streams.append(weakref.ref(s))
        return s

    def on_failure(size, device, stream, rc):
        raise MemoryError(rc)

    def make_pointer(mem, offset):  # the Python-level constructor: the UnownedMemory path only
        return ("pointer", mem, offset)

    return core.CupyAllocator(
        lambda: DEV, get_stream, unowned, make_pointer if pointer is None else pointer,
        on_failure, TAG_CUPY, base_memory=base,
    )  # fmt: skip


def test_a_block_is_bridge_memory_in_cupys_memory_pointer(cache):
    alloc = allocator()
    assert alloc.memory_objects == "BridgeMemory" and alloc.memory_problem is None
    p = alloc(3 * MIB)
    assert type(p) is mem_types.MemoryPointer
    mem = p.mem
    assert isinstance(mem, mem_types.BaseMemory) and type(mem).__name__ == "BridgeMemory"
    assert p.ptr == mem.ptr != 0 and mem.size == 3 * MIB
    assert p.device_id == mem.device_id == DEV
    assert core.lookup(p.ptr)[:4] == (0, 3 * MIB, DEV, TAG_CUPY)
    assert stats()["tags"][TAG_CUPY]["current"] == 3 * MIB
    ptr = p.ptr
    del p, mem
    assert stats()["tags"][TAG_CUPY]["current"] == 0  # the pointer's end frees the block
    again = alloc(3 * MIB)  # from the cache, on the same stream: the same address
    assert again.ptr == ptr
    del again


def test_bridge_memory_says_its_address_size_and_device(cache):
    """Its repr names the address in hex on every Python the package supports: 3.10 and
    3.11's PyUnicode_FromFormat know no %zx and printed the format itself."""
    alloc = allocator()
    p = alloc(MIB)
    assert repr(p.mem) == f"<bridge memory 0x{p.ptr:x}, {MIB} bytes, device {DEV}>"
    zero = alloc(0)
    assert repr(zero.mem) == f"<bridge memory 0x0, 0 bytes, device {DEV}>"
    del p, zero


def test_bridge_memory_holds_the_stream_until_its_free(cache):
    streams = []
    alloc = allocator(streams=streams)
    p = alloc(MIB)
    mem = p.mem
    del p  # the memory outlives its pointer, as a view's does
    gc.collect()
    assert streams[0]() is not None  # held: the free may be ordered on it
    assert stats()["tags"][TAG_CUPY]["current"] == MIB
    del mem
    gc.collect()
    assert streams[0]() is None  # given back with the free: no reference leaked
    assert stats()["tags"][TAG_CUPY]["current"] == 0


def test_many_blocks_each_free_once(cache):
    alloc = allocator()
    bad = stats()["num_bad_frees"]
    live = [alloc((i % 7 + 1) * 4096) for i in range(200)]
    assert len({p.ptr for p in live}) == 200
    total = sum(p.mem.size for p in live)
    assert stats()["tags"][TAG_CUPY]["current"] == total
    del live
    assert stats()["tags"][TAG_CUPY]["current"] == 0
    assert stats()["num_bad_frees"] == bad


@pytest.mark.parametrize(
    ("base", "pointer", "words"),
    [
        (mem_types.SwappedMemory, mem_types.MemoryPointer, "BaseMemory's ptr, size and device_id"),
        (mem_types.BaseMemory, mem_types.SwappedPointer, "MemoryPointer's mem"),
        (int, mem_types.MemoryPointer, "not the 40-byte BaseMemory"),
        (object(), mem_types.MemoryPointer, "must be CuPy's classes"),
    ],
)
def test_a_layout_that_does_not_check_out_keeps_unowned_memory(cache, base, pointer, words):
    bad = stats()["num_bad_frees"]
    alloc = allocator(base=base, pointer=pointer)
    assert alloc.memory_objects == "UnownedMemory"
    assert words in alloc.memory_problem
    assert stats()["tags"][TAG_CUPY]["current"] == 0  # the check allocated nothing
    del alloc
    gc.collect()
    assert stats()["num_bad_frees"] == bad  # and freed nothing


def test_the_unowned_path_runs_when_no_base_memory_is_given(cache):
    alloc = allocator(base=None, pointer=None)
    assert (
        alloc.memory_objects == "UnownedMemory" and alloc.memory_problem == "no base_memory given"
    )
    kind, (what, ptr, size, block, dev), offset = alloc(MIB)
    assert (kind, what, size, dev, offset) == ("pointer", "unowned", MIB, DEV, 0)
    assert isinstance(block, core.Block) and block.ptr == ptr
    assert stats()["tags"][TAG_CUPY]["current"] == MIB
    del block
    assert stats()["tags"][TAG_CUPY]["current"] == 0
