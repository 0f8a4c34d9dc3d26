# SPDX-License-Identifier: Apache-2.0
"""How to install each framework for one CUDA major: the words unify(), doctor and the
demo give, from the registry's rows (``Framework.install``; pyproject.toml's extras are the
same sets; tests/project/test_packaging.py checks them).

PyPI's torch is a CUDA 13 build; a CUDA 12 torch comes from PyTorch's own index.
"""

from __future__ import annotations

__all__ = ["install_command", "install_hint", "own_index_command"]

from bridge import frameworks


def _from_own_index(spec: str) -> bool:
    return "--" in spec  # it names an index of its own: pip installs it alone


def install_command(names: list[str], major: int) -> str:
    """The pip command(s) that install these frameworks for one CUDA major.

    >>> install_command(["cupy", "torch"], 12)
    'pip install cupy-cuda12x and pip install torch --index-url https://download.pytorch.org/whl/cu129'
    """
    specs = [frameworks.row(n).pip(major) for n in names]
    plain = [s for s in specs if not _from_own_index(s)]
    indexed = [s for s in specs if _from_own_index(s)]
    cmds = [f"pip install {' '.join(plain)}"] if plain else []
    cmds += [f"pip install {s}" for s in indexed]
    return " and ".join(cmds)


def install_hint(names: list[str]) -> str:
    """How to install these frameworks for either CUDA major, one major per environment.

    >>> install_hint(["cupy"])
    'for CUDA 13: pip install cupy-cuda13x; for CUDA 12: pip install cupy-cuda12x'
    """
    return "; ".join(f"for CUDA {m}: {install_command(names, m)}" for m in frameworks.MAJORS)


def own_index_command(major: int) -> str:
    """The pip command for the frameworks whose build for this CUDA major comes from their
    own index, not PyPI: the ones that major's extra (``.[cuda12]``) leaves out.

    >>> own_index_command(12)
    'pip install torch --index-url https://download.pytorch.org/whl/cu129'
    """
    names = [f.name for f in frameworks.REGISTRY if _from_own_index(f.pip(major))]
    return install_command(names, major)
