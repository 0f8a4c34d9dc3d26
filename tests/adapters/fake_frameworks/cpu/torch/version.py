# SPDX-License-Identifier: Apache-2.0
"""torch.version of a CPU-only wheel: no CUDA (a ROCm build's HIP when a test asks for one)."""

import os

__version__ = os.environ.get("BRIDGE_TEST_FAKE_TORCH_VERSION", "2.13.0+cpu")
cuda = None
hip = os.environ.get("BRIDGE_TEST_FAKE_TORCH_HIP") or None
