# SPDX-License-Identifier: Apache-2.0
"""torch.cuda of a CPU-only wheel: never initialized, never available."""


def is_initialized() -> bool:
    return False


def is_available() -> bool:
    return False
