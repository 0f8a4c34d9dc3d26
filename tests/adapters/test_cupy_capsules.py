# SPDX-License-Identifier: Apache-2.0
"""CuPy's device and stream through CuPy's C functions (``__pyx_capi__``), on the stand-in.

bridge._core.CupyAllocator takes CuPy's ``get_device_id`` and ``get_current_stream``
as capsules named by their C signatures, as Cython exports them, and calls them
directly instead of the Python callables; a capsule of another signature is never
called. The C functions are stood in for with ctypes callbacks of the same
signatures, so these tests see which path ran and what the stream function was
asked for.
"""

from __future__ import annotations

import ctypes
import gc
import weakref

import pytest
from ledger_util import DEV, MIB, TAG_CUPY, stats

from bridge._runtime import core

DEVICE_SIGNATURE = b"int (int __pyx_skip_dispatch)"
STREAM_SIGNATURE = (
    b"PyObject *(int __pyx_skip_dispatch, struct "
    b"__pyx_opt_args_4cupy_4cuda_6stream_get_current_stream *__pyx_optional_args)"
)
DEFAULT = 0


class Stream:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class Opt(ctypes.Structure):  # Cython's struct of a cpdef function's optional arguments
    _fields_ = [("n", ctypes.c_int), ("device_id", ctypes.c_int)]


DEVICE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)
STREAM_FN = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_int, ctypes.POINTER(Opt))
_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class CupyStandIn:
    """CuPy's two functions, as C functions in capsules, and as the Python callables."""

    def __init__(self, device: int = DEV, stream: int = DEFAULT) -> None:
        self.device, self.stream = device, stream
        self.c_calls: list[tuple] = []
        self.py_calls: list[str] = []
        self.streams: list[weakref.ref] = []  # every Stream the C function handed out
        self.keep: list = []  # the callbacks and names live as long as the capsules

        def device_c(skip_dispatch: int) -> int:
            self.c_calls.append(("device", skip_dispatch))
            return self.device

        def stream_c(skip_dispatch: int, opt) -> Stream:
            self.c_calls.append(("stream", skip_dispatch, opt[0].n, opt[0].device_id))
            out = Stream(self.stream)
            self.streams.append(weakref.ref(out))
            return out

        self.device_fn, self.stream_fn = DEVICE_FN(device_c), STREAM_FN(stream_c)

    def capsule(self, fn, name: bytes):
        self.keep.append(name)
        return _new_capsule(ctypes.cast(fn, ctypes.c_void_p), name, None)

    def allocator(self, device_name: bytes = DEVICE_SIGNATURE,
                  stream_name: bytes = STREAM_SIGNATURE, capsules: bool = True):  # fmt: skip
        def get_device() -> int:
            self.py_calls.append("device")
            return self.device

        def get_stream() -> Stream:
            self.py_calls.append("stream")
            return Stream(self.stream)

        def on_failure(size, device, stream, rc):
            raise MemoryError(rc)

        extra = {}
        if capsules:
            extra = {
                "device_capsule": self.capsule(self.device_fn, device_name),
                "stream_capsule": self.capsule(self.stream_fn, stream_name),
            }
        return core.CupyAllocator(
            get_device,
            get_stream,
            lambda ptr, size, owner, dev: (ptr, size, owner, dev),  # UnownedMemory
            lambda mem, offset: mem,  # MemoryPointer
            on_failure,
            TAG_CUPY,
            **extra,
        )


def test_the_capsules_replace_both_python_calls(cache):
    cupy = CupyStandIn()
    alloc = cupy.allocator()
    assert alloc.direct_lookups is True
    mem = alloc(2 * MIB)
    ptr, size, block, dev = mem
    assert size == 2 * MIB and dev == DEV and ptr != 0
    assert core.lookup(ptr)[:4] == (0, 2 * MIB, DEV, TAG_CUPY)
    # one C call each; the stream asked for on the device just read (one optional argument)
    assert cupy.c_calls == [("device", 1), ("stream", 1, 1, DEV)]
    assert cupy.py_calls == []
    assert stats()["tags"][TAG_CUPY]["current"] == 2 * MIB
    del mem, block
    assert stats()["tags"][TAG_CUPY]["current"] == 0
    again = alloc(2 * MIB)  # the block cached on CuPy's stream: the same address
    assert again[0] == ptr
    assert len(cupy.c_calls) == 4 and cupy.py_calls == []
    del again


def test_the_block_keeps_the_stream_the_c_function_gave_until_its_free(cache):
    cupy = CupyStandIn(stream=0xC2000)
    alloc = cupy.allocator()
    mem = alloc(MIB)
    block = mem[2]
    assert isinstance(block, core.Block)
    assert block.ptr == mem[0] and block.size == MIB and block.device == DEV
    gc.collect()
    assert cupy.streams[0]() is not None  # held by the block (its free is ordered on it)
    del mem, block
    gc.collect()
    assert cupy.streams[0]() is None  # given back with the free: no reference leaked
    assert stats()["tags"][TAG_CUPY]["current"] == 0


@pytest.mark.parametrize("which", ["device", "stream", "both"])
def test_a_capsule_of_another_signature_is_never_called(cache, which):
    cupy = CupyStandIn()
    other = b"int (void)"
    names = {
        "device": (other, STREAM_SIGNATURE),
        "stream": (DEVICE_SIGNATURE, other),
        "both": (other, other),
    }[which]
    alloc = cupy.allocator(*names)
    assert alloc.direct_lookups is False
    mem = alloc(MIB)
    assert cupy.c_calls == []  # neither: the device and its stream come one way
    assert cupy.py_calls == ["device", "stream"]
    del mem


def test_without_capsules_the_python_callables_run(cache):
    cupy = CupyStandIn()
    alloc = cupy.allocator(capsules=False)
    assert alloc.direct_lookups is False
    mem = alloc(MIB)
    assert cupy.py_calls == ["device", "stream"] and cupy.c_calls == []
    del mem


def test_none_and_non_capsules_fall_back(cache):
    cupy = CupyStandIn()
    for dcap, scap in ((None, None), (1, 2), ("get_device_id", None)):
        alloc = core.CupyAllocator(
            lambda: DEV, lambda: Stream(DEFAULT), lambda *a: a, lambda m, o: m,
            lambda *a: None, TAG_CUPY, device_capsule=dcap, stream_capsule=scap,
        )  # fmt: skip
        assert alloc.direct_lookups is False
        mem = alloc(MIB)
        assert mem[1] == MIB
        del mem
    assert cupy.c_calls == []
