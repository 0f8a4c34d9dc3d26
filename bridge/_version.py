# SPDX-License-Identifier: Apache-2.0
"""The version of bridge: stated here only (pyproject.toml reads it from this file), and the
name of the distribution that installs it (pyproject.toml's project.name: PyPI's "bridge" is
another project, so ``pip install`` names this one, while the package imports as bridge)."""

__version__ = "0.1.0"
DISTRIBUTION = "gpumem-bridge"
