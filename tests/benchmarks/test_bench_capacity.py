# SPDX-License-Identifier: Apache-2.0
"""benchmarks/bench_capacity.py on the CPU: the batch search, the summary, the
plan and bad arguments (the measurement itself needs a GPU)."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_capacity as bc  # noqa: E402


@pytest.mark.parametrize("largest_fitting", [0, 1, 7, 8, 9, 100, 1000, 4096, 5000])
def test_the_search_finds_the_largest_batch_that_fits(largest_fitting):
    asked = []

    def fits(n):
        asked.append(n)
        return n <= largest_fitting

    assert bc.largest(fits, start=8, limit=4096) == min(largest_fitting, 4096)
    assert len(asked) == len(set(asked))  # no batch tried twice
    assert len(asked) <= 2 * 13  # doubling then bisection: logarithmic


def test_the_summary_takes_the_best_native_split():
    s = bc.summarize({"0.3": 100, "0.5": 140, "0.7": 0}, 300)
    assert s == {"native_best_split": "0.5", "native_batch": 140, "bridge_batch": 300,
                 "ratio": 300 / 140}  # fmt: skip
    assert bc.summarize({"0.5": 0}, 10)["ratio"] is None  # nothing fit natively


def test_the_plan_has_every_split_and_the_bridge(capsys):
    assert bc.main(["--dry-run", "--budget", "1GiB", "--splits", "0.25,0.75"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert "--child native --split 0.25" in lines[0] and "--split 0.75" in lines[1]
    assert "--child bridge" in lines[2] and "--budget 1073741824" in lines[2]


@pytest.mark.parametrize("argv", [["--splits", "0,0.5"], ["--splits", "a"], ["--steps", "0"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit) as e:
        bc.main(["--dry-run", *argv])
    assert e.value.code == 2
