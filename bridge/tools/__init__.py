# SPDX-License-Identifier: Apache-2.0
"""The tools for people: the command line (``bridge doctor | stats | demo | build-torch |
build-rmm``).

They use the library; the library never imports them (``bridge.cli``, the
documented way to run the command line inside a program, is a thin alias of
``bridge.tools.cli``).
"""
