# SPDX-License-Identifier: Apache-2.0
"""Framework adapters: one module per framework, each importing its framework lazily.

``bridge.unify`` imports ``bridge.adapters.<name>`` and calls ``install(devices)``.
"""
