# SPDX-License-Identifier: Apache-2.0
"""Probe: throwing c10::OutOfMemoryError from a CUDAPluggableAllocator's alloc function.

The platform notes record that this segfaulted in 3 of 3 tries with torch 2.11 (cause not
found then).  This builds such an allocator with torch's load_inline, installs it, asks for
more than it grants, and prints what Python saw.  Run it in a process of its own:

    python benchmarks/probes/pluggable_oom_throw.py [throw|runtime_error]

Exit status 0 and a line `caught <type>: <message>` when torch raised; a crash otherwise.
"""

import faulthandler
import sys

import torch
from torch.utils.cpp_extension import load_inline

faulthandler.enable()
kind = sys.argv[1] if len(sys.argv) > 1 else "throw"
src = r"""
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <stdexcept>
extern "C" {
void* probe_alloc(size_t size, int device, cudaStream_t stream) {
    if (size > (1ull << 30)) {
#ifdef PROBE_RUNTIME_ERROR
        throw std::runtime_error("CUDA out of memory. probe");
#else
        TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. probe");
#endif
    }
    void* p = nullptr;
    cudaMallocAsync(&p, size, stream);
    return p;
}
void probe_free(void* p, size_t, int, cudaStream_t stream) { cudaFreeAsync(p, stream); }
}
"""
flags = ["-DPROBE_RUNTIME_ERROR"] if kind == "runtime_error" else []
mod = load_inline(
    name=f"probe_oom_{kind}",
    cpp_sources=[src],
    extra_cflags=flags,
    with_cuda=True,
    is_python_module=False,
    verbose=False,
)
alloc = torch.cuda.memory.CUDAPluggableAllocator(mod, "probe_alloc", "probe_free")
torch.cuda.memory.change_current_allocator(alloc)
x = torch.ones(10, device="cuda")
try:
    torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    print("no error")
except Exception as e:  # noqa: BLE001 - the probe reports whatever came
    print(f"caught {type(e).__module__}.{type(e).__name__}: {str(e).splitlines()[0]}")
print("after:", float(x.sum()))
