# SPDX-License-Identifier: Apache-2.0
"""torch.version of a CPU-only wheel: no CUDA (a ROCm build's HIP when a test asks for one; a
CUDA build's version when a test asks for a CUDA torch whose CUDA this machine cannot run)."""

import os

__version__ = os.environ.get("BRIDGE_TEST_FAKE_TORCH_VERSION", "2.13.0+cpu")
cuda = os.environ.get("BRIDGE_TEST_FAKE_TORCH_CUDA") or None
hip = os.environ.get("BRIDGE_TEST_FAKE_TORCH_HIP") or None
