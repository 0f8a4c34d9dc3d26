# SPDX-License-Identifier: Apache-2.0
"""How to install each framework for one CUDA major: the words unify(), doctor and the
demo give (pyproject.toml's extras are the same sets; tests/project/test_packaging.py checks them).

PyPI's torch is a CUDA 13 build; a CUDA 12 torch comes from PyTorch's own index.
"""

from __future__ import annotations

__all__ = ["TORCH_CUDA12_INDEX", "TORCH_CUDA12", "PACKAGES", "install_command", "install_hint"]

TORCH_CUDA12_INDEX = "https://download.pytorch.org/whl/cu129"
TORCH_CUDA12 = f"pip install torch --index-url {TORCH_CUDA12_INDEX}"

# framework -> CUDA major -> what to pip install
PACKAGES: dict[str, dict[int, str]] = {
    "cupy": {13: "cupy-cuda13x", 12: "cupy-cuda12x"},
    "torch": {13: "torch", 12: f"torch --index-url {TORCH_CUDA12_INDEX}"},
    "jax": {13: "'jax[cuda13]'", 12: "'jax[cuda12]'"},
    "numba": {13: "'numba-cuda[cu13]'", 12: "'numba-cuda[cu12]'"},
    "rmm": {13: "rmm-cu13", 12: "rmm-cu12"},
}


def install_command(names: list[str], major: int) -> str:
    """The pip command(s) that install these frameworks for one CUDA major.

    >>> install_command(["cupy", "torch"], 12)
    'pip install cupy-cuda12x and pip install torch --index-url https://download.pytorch.org/whl/cu129'
    """
    plain = [PACKAGES[n][major] for n in names if "--" not in PACKAGES[n][major]]
    indexed = [PACKAGES[n][major] for n in names if "--" in PACKAGES[n][major]]
    cmds = [f"pip install {' '.join(plain)}"] if plain else []
    cmds += [f"pip install {p}" for p in indexed]
    return " and ".join(cmds)


def install_hint(names: list[str]) -> str:
    """How to install these frameworks for either CUDA major, one major per environment.

    >>> install_hint(["cupy"])
    'for CUDA 13: pip install cupy-cuda13x; for CUDA 12: pip install cupy-cuda12x'
    """
    return "; ".join(f"for CUDA {m}: {install_command(names, m)}" for m in (13, 12))
