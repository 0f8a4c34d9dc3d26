# SPDX-License-Identifier: Apache-2.0
"""``bridge.cli.main([...])``: the command line inside a program (an alias of bridge.tools.cli)."""

from bridge.tools.cli import COLUMNS, format_table, main, snapshot

__all__ = ["COLUMNS", "format_table", "main", "snapshot"]
