# SPDX-License-Identifier: Apache-2.0
"""A CUDA plugin's module name and nothing else (see ../../README.md)."""
