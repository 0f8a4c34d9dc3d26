# SPDX-License-Identifier: Apache-2.0
"""A process for the tests of blocks shared between processes (tests/core/test_ipc.py).

On the stand-in: it reads one JSON command per line on stdin and answers one
JSON line on stdout.  ``unify`` (ipc, budget, devices), ``alloc`` (size) -> ptr,
``write`` (ptr, hex), ``read`` (ptr, n) -> hex, ``export`` (ptr) -> handle hex,
``import`` (handle) -> ptr or the error, ``release`` (ptr), ``free`` (ptr),
``stats``, ``counts``, ``foreign`` (bytes other users of the default pool hold),
``grants`` (device) -> the peers' access to its pools, ``fds`` -> the
descriptors open here, in a forked child and in a program that ``os.system``
runs.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import tempfile

import bridge
from bridge._errors import BridgeError, Status
from bridge._runtime import core

DEV = 0
standin = ctypes.CDLL(os.environ["BRIDGE_CUDA_LIBRARY"])
standin.standin_add_foreign.argtypes = [ctypes.c_int, ctypes.c_int64]
standin.standin_imported_count.restype = ctypes.c_uint64
standin.standin_access_grants.restype = ctypes.c_uint64
standin.standin_xpool_access_grants.restype = ctypes.c_uint64


def run(cmd: dict) -> dict:
    op = cmd["op"]
    if op == "unify":
        kw = {"budget": cmd.get("budget")} if cmd.get("budget") else {}
        if "ipc" in cmd:
            kw["ipc"] = cmd["ipc"]
        bridge.unify(cupy=False, torch=False, device=cmd.get("devices", DEV), **kw)
        return {"ipc": core.ipc_enabled(DEV)}
    if op == "alloc":
        rc, ptr = core.alloc(DEV, cmd["size"], 0, cmd.get("tag", 0))
        return {"rc": rc, "ptr": ptr}
    if op == "free":
        core.free(cmd["ptr"])
        return {}
    if op == "write":
        data = bytes.fromhex(cmd["hex"])
        ctypes.memmove(cmd["ptr"], data, len(data))
        return {}
    if op == "read":
        return {"hex": ctypes.string_at(cmd["ptr"], cmd["n"]).hex()}
    if op == "export":
        rc, handle, offset = core.ipc_export(cmd["ptr"])
        if rc != Status.OK:
            return {"rc": rc, "error": core.ipc_error()}
        return {"rc": rc, "handle": handle.hex(), "offset": offset}
    if op == "import":
        rc, ptr = core.ipc_import(bytes.fromhex(cmd["handle"]), DEV)
        return {"rc": rc, "ptr": ptr, "error": core.ipc_error() if rc else ""}
    if op == "release":
        core.ipc_release(cmd["ptr"])
        return {"imported": standin.standin_imported_count()}
    if op == "stats":
        s = bridge.stats(DEV)
        carve_held = core.stats(DEV)[1]["carve_held"]
        return {"used": s.used, "reserved": s.reserved, "limit": s.limit, "carve_held": carve_held}
    if op == "counts":
        holds, imported, refused = core.ipc_counts()
        return {"holds": holds, "imported": imported, "refused": refused}
    if op == "foreign":
        standin.standin_add_foreign(DEV, cmd["bytes"])
        return {}
    if op == "grants":  # peers' access granted to device d's default and exportable pools
        d = cmd["device"]
        return {
            "default": standin.standin_access_grants(d),
            "exportable": standin.standin_xpool_access_grants(d),
        }
    if op == "fds":
        return {"here": _fds(), "forked": _forked_fds(), "program": _program_fds()}
    raise ValueError(op)


def _fds() -> list[str]:
    """This process's open descriptors as "number target" (the target tells a
    descriptor from another that took its number, such as the listing's own)."""
    out = []
    for f in os.listdir("/proc/self/fd"):
        try:
            out.append(f"{f} {os.readlink(f'/proc/self/fd/{f}')}")
        except OSError:  # the listing's own, closed by now
            pass
    return sorted(out)


def _forked_fds() -> list[str]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.write(w, json.dumps(_fds()).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        got = json.loads(f.read())
    os.waitpid(pid, 0)
    return got


def _program_fds() -> list[str]:
    with tempfile.NamedTemporaryFile("r") as out:
        # what a program started from here holds: "number target" per line
        os.system(f"find /proc/self/fd -mindepth 1 -printf '%f %l\\n' > {out.name}")
        return sorted(line for line in out.read().splitlines() if line)


def main() -> None:
    print(json.dumps({"pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            out = run(cmd)
        except (BridgeError, ValueError) as e:
            out = {"exception": type(e).__name__, "message": str(e)}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
