"""benchmarks/paired_runs.py: the pairing rule shared by the throughput benchmarks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import paired_runs as pr  # noqa: E402


def _run(tput: float, repeat: int, order: str = "round", cpu: str | None = "AMD EPYC") -> dict:
    return {"output_throughput": tput, "repeat": repeat, "order": order,
            **({"machine": {"cpu": cpu}} if cpu else {})}


def _tput(r: dict) -> float:
    return r["output_throughput"]


def test_each_run_is_divided_by_its_repeats_twin_only():
    # crossing every run with every run would give [20/30, 60/10] = [0.67, 6]
    a = [_run(60.0, 2), _run(20.0, 0), _run(33.0, 1)]
    b = [_run(10.0, 0), _run(11.0, 1), _run(30.0, 2)]
    p = pr.paired_ratio(a, b, _tput, pr.both_in_rounds)
    assert p["repeats"] == [0, 1, 2] and p["per_pair"] == pytest.approx([2.0, 3.0, 2.0])
    assert (p["min"], p["median"], p["max"], p["n"]) == pytest.approx((2.0, 2.0, 3.0, 3))


def test_the_rule_decides_which_twins_are_pairs():
    a = [_run(20.0, 0), _run(30.0, 1, order="arm"), _run(40.0, 2, cpu="Intel Xeon"),
         _run(50.0, 3, cpu=None), _run(60.0, 4)]
    b = [_run(10.0, 0), _run(10.0, 1), _run(10.0, 2), _run(10.0, 3)]  # no repeat 4
    assert pr.paired_ratio(a, b, _tput, pr.both_in_rounds)["repeats"] == [0, 2, 3]
    # a processor not recorded is not known to differ
    assert pr.paired_ratio(a, b, _tput, pr.same_processor)["repeats"] == [0, 1, 3]
    assert pr.paired_ratio(a[1:2], b, _tput, pr.both_in_rounds) is None
