# SPDX-License-Identifier: Apache-2.0
"""``python -m bridge``: the command line of :mod:`bridge.tools.cli` (the ``bridge`` script)."""

from __future__ import annotations

import sys

from bridge.tools.cli import COLUMNS, format_table, main, snapshot

__all__ = ["main", "format_table", "snapshot", "COLUMNS"]

if __name__ == "__main__":
    sys.exit(main(prog="python -m bridge"))
