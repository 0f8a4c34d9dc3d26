# SPDX-License-Identifier: Apache-2.0
"""torch.cuda of a wheel that cannot use a GPU here: never initialized, never available.

A CUDA build (BRIDGE_TEST_FAKE_TORCH_CUDA) on a driver older than its CUDA warns, as the
real one does, with BRIDGE_TEST_FAKE_TORCH_CUDA_WARNING's text when it is asked."""

import os
import warnings


def is_initialized() -> bool:
    return False


def is_available() -> bool:
    said = os.environ.get("BRIDGE_TEST_FAKE_TORCH_CUDA_WARNING")
    if said:
        warnings.warn(said, UserWarning, stacklevel=2)
    return False
