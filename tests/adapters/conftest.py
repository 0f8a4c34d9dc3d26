# SPDX-License-Identifier: Apache-2.0
"""Fixtures the adapters' tests share."""

from __future__ import annotations

import pytest
from ledger_util import DEV, MIB

from bridge._runtime import core


@pytest.fixture
def cache(led):
    """``led`` with the core's cache on (64 MiB) on the test device, off before led's check."""
    core.set_cache(DEV, 64 * MIB)
    yield led
    core.set_cache(DEV, 0)  # cached bytes count as used: back to the pool first
