# SPDX-License-Identifier: Apache-2.0
"""A CPU-only jaxlib: no cuda folder inside."""
