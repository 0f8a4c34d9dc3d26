# SPDX-License-Identifier: Apache-2.0
"""A stand-in for PyTorch's CPU-only wheel in tests (see ../../README.md)."""

from torch import cuda, version

__version__ = version.__version__
__all__ = ["cuda", "version"]
