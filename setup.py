# SPDX-License-Identifier: Apache-2.0
"""Build of bridge's compiled core: one C library (plus the C++ torch entry
points) that loads the CUDA driver at run time, so no CUDA toolkit is needed;
and the long description, README.md with links that hold on the package index."""
from __future__ import annotations

import os
import re

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

#: The public repository (``https://host/owner/name``), from which the project URLs and the
#: long description's links are made; None while the project has no public repository: the
#: metadata then names no URLs, and README's links to files of the tree become plain text.
REPOSITORY: str | None = None
#: the branch that README's links point into
BRANCH = "main"

# a Markdown link to a file of the tree: [text](path) or [text](path#anchor)
_RELATIVE_LINK = re.compile(r"\[([^\]]+)\]\((?![a-z][a-z0-9+.-]*:|#)([^)\s#]+)(#[^)\s]*)?\)")


def project_urls(repository: str | None = REPOSITORY) -> dict[str, str]:
    """The metadata's project URLs, each a page of the repository (none without one)."""
    if repository is None:
        return {}
    blob = f"{repository}/blob/{BRANCH}"
    return {
        "Homepage": repository,
        "Documentation": f"{blob}/docs/user-guide.md",
        "Source": repository,
        "Issues": f"{repository}/issues",
        "Changelog": f"{blob}/CHANGELOG.md",
    }


def long_description(readme: str, repository: str | None = REPOSITORY) -> str:
    """README.md for the package index, where a relative link leads nowhere: each link to a
    file of the tree points into the repository, or without one becomes its text and the
    file's path ("user guide in `docs/user-guide.md`": the sdist holds the files README
    links to)."""

    def absolute(m: re.Match[str]) -> str:
        text, path, anchor = m.group(1), m.group(2), m.group(3) or ""
        if repository is not None:
            kind = "tree" if path.endswith("/") else "blob"
            return f"[{text}]({repository}/{kind}/{BRANCH}/{path}{anchor})"
        return f"`{path}`" if text.strip("`") == path else f"{text} in `{path}`"

    return _RELATIVE_LINK.sub(absolute, readme)


if __name__ == "__main__":  # as setuptools runs it (tests load the functions above alone)
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    setup(
        ext_modules=[core],
        long_description=long_description(readme),
        long_description_content_type="text/markdown",
        project_urls=project_urls(),
    )
