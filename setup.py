# SPDX-License-Identifier: Apache-2.0
"""Build of bridge's compiled core: one C library (plus the C++ torch entry
points) that loads the CUDA driver at run time, so no CUDA toolkit is needed."""
import os

from setuptools import Extension, setup

flags = ["-O2", "-Wall", "-Wextra", "-fvisibility=default"]
# -Bsymbolic-functions: the core's calls into its own functions bind inside the
# library (no PLT stub on the hot path); every symbol stays exported for dlsym.
link = ["-ldl", "-lpthread", "-Wl,-Bsymbolic-functions"]
if os.environ.get("BRIDGE_WERROR"):
    flags.append("-Werror")
if os.environ.get("BRIDGE_SANITIZE"):  # e.g. "address" for a sanitizer build
    flags += [f"-fsanitize={os.environ['BRIDGE_SANITIZE']}", "-g", "-fno-omit-frame-pointer"]
elif not os.environ.get("BRIDGE_DEBUG"):  # what people install: no debug information
    flags.append("-g0")
    link.append("-s")

native = "bridge/_native"
# the C core (no Python), then its CPython bindings (python/), then what adapters add to the
# module: their C and C++ live beside them (bridge/adapters is adapters/; frameworks.h lists them)
CORE = ("driver.c", "counts.c", "records.c", "cache.c", "carve.c", "streams.c", "ledger.c", "graph.c",
        "wait.c", "device.c", "alloc.c",
        "share.c", "pinned.c", "views.c", "managed.c", "ipc.c")
BINDINGS = ("pymod.c", "pybind.c", "pypinned.c", "dlpack.c", "pyviews.c", "pycallback.c",
            "pyshare.c", "pyblock.c", "pymanaged.c")
ADAPTERS = ("_torch_abi.cpp", "_cupy_alloc.c")
core = Extension(
    "bridge._core",
    sources=[f"{native}/{name}" for name in CORE]
    + [f"{native}/python/{name}" for name in BINDINGS]
    + [f"bridge/adapters/{name}" for name in ADAPTERS],
    include_dirs=[native, f"{native}/python"],
    extra_compile_args=flags,
    extra_link_args=link,
    language="c++",
)

setup(ext_modules=[core])
