"""Ratios between two arms of repeated benchmark runs, each run paired with its repeat's twin.

A benchmark that repeats its arms gives every run a repeat index, and one index's runs of two
arms were made close together: one round of `concurrency_scaling.py --order round`, or one
`length_scaling.py` invocation (each adds the next index, on whichever machine runs it). Their
ratio leaves out what differs between runs made hours or machines apart (the 2-core VMs here are
an AMD EPYC or an Intel Xeon, with opposite small-batch step curves); crossing every run of one
arm with every run of the other would put that difference into the ratio's range. Which runs
may be paired is the benchmark's rule (`pairable`): runs made in rounds, runs on one processor.
"""

from __future__ import annotations

import statistics
from typing import Callable

Pairable = Callable[[dict, dict], bool]


def cpu(run: dict) -> str | None:
    """The processor a run recorded (None for runs from before records named it)."""
    return (run.get("machine") or {}).get("cpu")


def same_processor(a: dict, b: dict) -> bool:
    """Both runs on one processor, or one of them did not record it (not known to differ)."""
    return None in (cpu(a), cpu(b)) or cpu(a) == cpu(b)


def both_in_rounds(a: dict, b: dict) -> bool:
    """Both runs made with --order round: one round runs every arm once, minutes apart."""
    return a.get("order") == "round" and b.get("order") == "round"


def pairs(a: list[dict], b: list[dict], pairable: Pairable) -> list[tuple[dict, dict]]:
    """(run of a, run of b) with one repeat index, in repeat order, where pairable allows it."""
    by_repeat = {r["repeat"]: r for r in b if "repeat" in r}
    return [(r, by_repeat[r["repeat"]]) for r in sorted(a, key=lambda r: r.get("repeat", -1))
            if r.get("repeat") in by_repeat and pairable(r, by_repeat[r["repeat"]])]


def paired_ratio(a: list[dict], b: list[dict], value: Callable[[dict], float],
                 pairable: Pairable) -> dict | None:
    """value(run of a) / value(run of b) over the pairs: median and range of the per-pair ratios,
    each pair's ratio (`per_pair`) and its repeat index (`repeats`); None when no pair."""
    found = pairs(a, b, pairable)
    if not found:
        return None
    ratios = [value(r) / value(ref) for r, ref in found]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "n": len(ratios), "per_pair": ratios, "repeats": [r["repeat"] for r, _ in found]}
