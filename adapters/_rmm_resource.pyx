# SPDX-License-Identifier: Apache-2.0
# cython: language_level=3, embedsignature=False
# distutils: language = c++
"""The bridge's RMM resource in C++: an ``rmm.mr.DeviceMemoryResource`` over the core.

Compiled on the first ``bridge.unify(rmm=True)`` against the installed RMM
(``rmm_build``). ``BridgeResource`` holds an ``rmm::mr::callback_memory_resource``
whose two callbacks are C functions of this module: allocate calls the core's
``bridge_alloc`` on the stream RMM passes, deallocate ``bridge_free_on_stream``
on the stream RMM frees on, both found by name in the loaded ``bridge._core``
(``load_core``). No GIL and no Python object per call: RMM's ``DeviceBuffer``
reaches the core through C++ alone, as it reaches ``cudaMallocAsync`` on its own
``CudaAsyncMemoryResource``.

The same semantics as ``bridge._core.StreamAllocator`` and ``stream_free``
(the Python callback resource that stands in where this module cannot be
built): a refused allocation takes the GIL and calls ``on_failure(size,
device, stream, status)``, which sets up a device first used now and returns
an address, or raises (the bridge's ``OutOfMemoryError``, a ``MemoryError``);
the exception becomes ``rmm::out_of_memory`` (a ``MemoryError``) or a
``std::runtime_error`` (a ``RuntimeError``) in C++, as RMM's own callback
resource turns it, and that into the same exception at the Python surface.
"""

from cython.operator cimport dereference as deref
from libc.stdint cimport uintptr_t
from libcpp.memory cimport unique_ptr

from rmm.librmm.cuda_stream_ref cimport stream_ref
from rmm.librmm.memory_resource cimport (
    CppExcept,
    allocate_callback_t,
    callback_memory_resource,
    deallocate_callback_t,
    make_device_async_resource_ref,
    throw_cpp_except,
    translate_python_except_to_cpp,
)
from rmm.pylibrmm.memory_resource._memory_resource cimport DeviceMemoryResource


cdef extern from "<dlfcn.h>" nogil:
    void *dlopen(const char *path, int flags)
    void *dlsym(void *handle, const char *name)
    char *dlerror()
    int RTLD_NOW
    int RTLD_NOLOAD


# the core's entry points (bridge/_native/bridge.h)
ctypedef int (*alloc_fn)(int device, size_t size, void *stream, int tag,
                         void **out) noexcept nogil
ctypedef void (*free_on_stream_fn)(void *ptr, void *stream) noexcept nogil

cdef alloc_fn core_alloc = NULL
cdef free_on_stream_fn core_free_on_stream = NULL
cdef int BRIDGE_OK = 0


def load_core(str path):
    """Find the core's functions in the loaded ``bridge._core`` at ``path``.

    Raises ``RuntimeError`` when that library is not loaded in this process or
    lacks one of them (a core older than this module's source).
    """
    global core_alloc, core_free_on_stream
    cdef bytes raw = path.encode()
    cdef void *lib = dlopen(raw, RTLD_NOW | RTLD_NOLOAD)
    if lib == NULL:
        err = dlerror()
        raise RuntimeError(
            f"the core {path} is not loaded in this process "
            f"({err.decode() if err != NULL else 'dlopen failed'}): import bridge first"
        )
    cdef void *a = dlsym(lib, b"bridge_alloc")
    cdef void *f = dlsym(lib, b"bridge_free_on_stream")
    if a == NULL or f == NULL:
        raise RuntimeError(
            f"the core {path} has no bridge_alloc or bridge_free_on_stream: rebuild bridge "
            "(pip install -e .) so that the core and this module match"
        )
    core_alloc = <alloc_fn>a
    core_free_on_stream = <free_on_stream_fn>f


def loaded():
    """Whether ``load_core`` found the core's functions."""
    return core_alloc != NULL and core_free_on_stream != NULL


cdef struct Context:
    int device
    int tag
    void *owner  # the BridgeResource that holds this context (borrowed)


cdef void *_refused(Context *ctx, size_t nbytes, void *stream, int rc) noexcept nogil:
    # The rare path, as StreamAllocator's: the GIL, then on_failure, which
    # returns an address or raises; its exception is thrown in C++ without
    # the GIL (rmm's own translation: MemoryError -> rmm::out_of_memory).
    cdef CppExcept err
    with gil:
        try:
            return <void *><uintptr_t>(<BridgeResource>ctx.owner).on_failure(
                nbytes, ctx.device, <uintptr_t>stream, rc
            )
        except BaseException as e:
            err = translate_python_except_to_cpp(e)
    throw_cpp_except(err)
    return NULL


cdef void *_allocate(size_t nbytes, stream_ref stream, void *arg) noexcept nogil:
    cdef Context *ctx = <Context *>arg
    cdef void *ptr = NULL
    cdef void *s = <void *>stream.get()
    cdef int rc = core_alloc(ctx.device, nbytes, s, ctx.tag, &ptr)
    if rc == BRIDGE_OK:
        return ptr
    return _refused(ctx, nbytes, s, rc)


cdef void _deallocate(void *ptr, size_t nbytes, stream_ref stream, void *arg) noexcept nogil:
    # After the work queued on RMM's stream, which RMM keeps alive through the
    # free: the core issues it there (tag rmm holds its streams). Never fails.
    core_free_on_stream(ptr, <void *>stream.get())


cdef class BridgeResource(DeviceMemoryResource):
    """RMM's resource of one device on the shared pool, counted under one tag.

    Parameters
    ----------
    device : int
        The device it allocates on.
    tag : int
        The framework tag its bytes count under (``bridge._core.TAG_RMM``).
    on_failure : callable
        ``(size, device, stream, status) -> address`` or raise: called with
        the GIL when the core refuses an allocation.
    """

    cdef unique_ptr[callback_memory_resource] c_obj
    cdef Context ctx
    cdef readonly object on_failure

    def __cinit__(self, int device, int tag, object on_failure):
        if not loaded():
            raise RuntimeError("load_core(bridge._core.__file__) first")
        if not callable(on_failure):
            raise TypeError("on_failure must be callable")
        self.ctx.device = device
        self.ctx.tag = tag
        self.ctx.owner = <void *>self
        self.on_failure = on_failure
        self.c_obj.reset(
            new callback_memory_resource(
                <allocate_callback_t>_allocate,
                <deallocate_callback_t>_deallocate,
                <void *>&self.ctx,
                <void *>&self.ctx,
            )
        )
        self.c_ref = make_device_async_resource_ref(deref(self.c_obj))

    @property
    def device(self):
        """The device it allocates on."""
        return self.ctx.device

    @property
    def tag(self):
        """The framework tag it counts under."""
        return self.ctx.tag

    def __repr__(self):
        return f"<bridge RMM resource (C++) device {self.ctx.device}, tag {self.ctx.tag}>"
