# SPDX-License-Identifier: Apache-2.0
"""A stand-in ``rmm`` for the RMM adapter's tests on the stand-in driver (no RMM, no GPU).

Its ``CallbackMemoryResource`` calls the two callables as RMM's C++ callback
resource does (``allocate(nbytes, Stream)``, ``deallocate(ptr, nbytes, Stream)``;
a ``MemoryError`` from ``allocate`` becomes RMM's ``MemoryError``).
"""

from __future__ import annotations

import sys
import types


class Stream:
    """rmm.pylibrmm.stream.Stream: the CUDA stream protocol."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


class CallbackMemoryResource:
    def __init__(self, allocate_func, deallocate_func) -> None:
        self.allocate_func, self.deallocate_func = allocate_func, deallocate_func

    def allocate(self, nbytes: int, stream: Stream) -> int:
        try:
            return self.allocate_func(nbytes, stream)
        except MemoryError as exc:  # rmm::out_of_memory, back as MemoryError
            raise MemoryError(str(exc)) from None

    def deallocate(self, ptr: int, nbytes: int, stream: Stream) -> None:
        self.deallocate_func(ptr, nbytes, stream)


def install_fake_rmm(monkeypatch) -> dict[int, object]:
    """Put a stand-in rmm with per-device resources in sys.modules; forget the adapter and
    the bridge made so far, so that the next unify imports the adapter on it. Returns the
    per-device resources, as rmm.mr.set_per_device_resource sets them."""
    per_device: dict[int, object] = {}
    mr = types.ModuleType("rmm.mr")
    mr.CallbackMemoryResource = CallbackMemoryResource
    mr.get_per_device_resource = lambda d: per_device.get(d)
    mr.set_per_device_resource = per_device.__setitem__
    rmm = types.ModuleType("rmm")
    rmm.mr = mr
    monkeypatch.setitem(sys.modules, "rmm", rmm)
    monkeypatch.setitem(sys.modules, "rmm.mr", mr)
    monkeypatch.delitem(sys.modules, "bridge.adapters.rmm", raising=False)
    monkeypatch.setattr(sys.modules["bridge.unify"], "_bridge", None)
    return per_device


def forget_fake_rmm() -> None:
    """After a test: the adapter imported on the stand-in rmm goes; tag rmm as it was."""
    from bridge._runtime import core

    sys.modules.pop("bridge.adapters.rmm", None)
    core.set_tag_holds_streams(core.TAG_RMM, False)
