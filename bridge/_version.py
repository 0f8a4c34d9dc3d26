# SPDX-License-Identifier: Apache-2.0
"""The version of bridge: stated here only (pyproject.toml reads it from this file)."""

__version__ = "0.1.0"
