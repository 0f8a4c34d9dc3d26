# SPDX-License-Identifier: Apache-2.0
"""The core's thread-local state (bridge/_native/tls.h), stand-in driver.

Its hot path reads three thread-local pointers in the initial-exec model, so
the whole TLS block of bridge._core goes to the static TLS area that glibc
keeps small for libraries loaded late: the block must stay within glibc's
allowance for one library.  The tables the pointers name live on the heap and
go with their thread: a thread that ends leaves its cached block and its
counts to the threads after it.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import sysconfig
import textwrap
import threading

import pytest

import bridge._core
from bridge._runtime import core

MIB = 1 << 20
TORCH = 2
PT_TLS = 7
GLIBC_OTHER_IE_TLS = 144  # glibc's elf/dl-tls.c: its budget for one such library


def tls_block_bytes(path: str) -> int:
    """p_memsz of the PT_TLS program header of an ELF64 little-endian file; 0 when none."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not an ELF64 LE file"
    phoff = struct.unpack_from("<Q", data, 0x20)[0]
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for i in range(phnum):
        off = phoff + i * phentsize
        if struct.unpack_from("<I", data, off)[0] == PT_TLS:
            return struct.unpack_from("<Q", data, off + 0x28)[0]
    return 0


@pytest.mark.skipif(sys.platform != "linux", reason="an ELF shared object")
def test_the_cores_tls_block_fits_glibcs_allowance_for_one_library():
    size = tls_block_bytes(bridge._core.__file__)
    # the three pointers of tls.h are in it; a per-thread table would not fit
    assert 24 <= size <= GLIBC_OTHER_IE_TLS, (
        f"bridge._core's TLS block is {size} bytes: keep per-thread tables on the heap (tls.h)"
    )


@pytest.fixture
def cached(standin):
    core.set_cache(0, 64 * MIB)
    core.set_cache_tiers(0, MIB, 64 * MIB)
    yield standin
    core.set_cache(0, 0)


def stats():
    return core.stats(0)[1]


def run(fn):
    out = {}

    def body():
        out["value"] = fn()

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out["value"]


def test_threads_that_end_leave_their_block_and_counts_to_the_next(cached):
    before = stats()["tags"][TORCH]

    def loop():
        ptrs = set()
        for _ in range(5):  # parked in the thread's slot and taken back
            rc, p = core.alloc(0, 2 * MIB, 0, TORCH)
            assert rc == 0
            ptrs.add(p)
            core.free(p)
        return ptrs

    seen = [run(loop) for _ in range(40)]
    # one block for all of them: each thread's slot and memo went with it,
    # and the next took the block the last one left cached
    assert all(s == seen[0] for s in seen) and len(seen[0]) == 1
    after = stats()["tags"][TORCH]
    assert after["current"] == before["current"] and after["count"] == before["count"]
    assert after["num_allocs"] - before["num_allocs"] == 200
    assert after["num_frees"] - before["num_frees"] == 200
    assert stats()["cached"] == 2 * MIB


def test_a_block_freed_by_another_thread_takes_the_tables_way(cached):
    rc, p = core.alloc(0, 3 * MIB, 0, TORCH)  # this thread's memo names it
    assert rc == 0
    run(lambda: core.free(p))  # the other thread has no memo of it
    assert stats()["tags"][TORCH]["current"] == 0
    assert stats()["cached"] == 3 * MIB
    rc, q = core.alloc(0, 3 * MIB, 0, TORCH)
    assert rc == 0 and q == p
    core.free(q)
    core.free(q)  # a double free is counted, nothing else changes
    assert stats()["num_bad_frees"] >= 1 and stats()["tags"][TORCH]["current"] == 0


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's static TLS")
def test_no_room_for_the_cores_tls_says_what_to_do(tmp_path):
    """Issue: with glibc's static TLS room taken by libraries loaded first, `import bridge`
    said "bridge's compiled core (bridge._core) is missing: reinstall ...", which does
    not help; it now says to import bridge first or to raise glibc's room."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    sizes = (1024, 512, 256, 128, 64, 32)  # the room left at the end: under 32 bytes
    for n in sizes:
        src = tmp_path / f"tls{n}.c"
        src.write_text(
            f'__attribute__((tls_model("initial-exec"))) __thread char tls_{n}[{n}];\n'
            f"char *tls_{n}_addr(void) {{ return tls_{n}; }}\n"
        )
        lib = tmp_path / f"libtls{n}.so"
        subprocess.run(cc.split() + ["-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    code = textwrap.dedent(
        f"""
        import ctypes, pathlib, shutil
        d = pathlib.Path({str(tmp_path)!r})
        for n in {sizes!r}:  # copies of each size (a copy is another library) till none fits
            for i in range(64):
                copy = d / f"libtls{{n}}-{{i}}.so"
                shutil.copy(d / f"libtls{{n}}.so", copy)
                try:
                    ctypes.CDLL(str(copy))
                except OSError:
                    break
        try:
            import bridge
        except ImportError as e:
            print(e)
        else:
            print("imported")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "cannot allocate memory in static TLS block" in r.stdout, r.stdout
    assert "Import bridge before the other libraries" in r.stdout, r.stdout
    assert "GLIBC_TUNABLES=glibc.rtld.optional_static_tls=4096" in r.stdout, r.stdout
    assert "reinstall" not in r.stdout, r.stdout
