# SPDX-License-Identifier: Apache-2.0
"""The one table of frameworks (bridge.frameworks): what pool, unify and the timeline read."""

from __future__ import annotations

import importlib
import importlib.util

from bridge import frameworks
from bridge._runtime import core


def test_every_framework_has_a_column_and_every_tag_a_name():
    assert set(frameworks.FRAMEWORKS) == set(frameworks.ORDER) | {"other"}
    assert sorted(frameworks.TAG_NAMES) == list(range(core.NTAGS))
    assert set(frameworks.COLORS) == set(frameworks.FRAMEWORKS)


def test_jax_is_set_up_first_and_is_outside_the_ledger():
    assert frameworks.ORDER[0] == "jax"
    (jax,) = [f for f in frameworks.REGISTRY if f.name == "jax"]
    assert jax.tag is None


def test_the_library_reads_the_table():
    # the modules (bridge.pool and bridge.unify are also the functions of those names)
    pool, unify, timeline = (
        importlib.import_module(f"bridge.{m}") for m in ("pool", "unify", "timeline")
    )
    assert pool.FRAMEWORKS is frameworks.FRAMEWORKS and pool.TAG_NAMES is frameworks.TAG_NAMES
    assert unify.ORDER is frameworks.ORDER
    assert timeline.COLORS is frameworks.COLORS


def test_each_row_names_an_adapter_that_exists():
    for f in frameworks.REGISTRY:
        assert importlib.util.find_spec(f.adapter) is not None, f
