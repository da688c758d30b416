"""The elastic load benchmark (benchmarks/elastic_load.py): its Poisson arrivals and summaries,
and one small end-to-end run on real servers with a tiny model (the real-model run is a
measurement, docs/elastic.md; it is not part of the suite)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import elastic_load as el  # noqa: E402

pytest.importorskip("reasoning_gym")


def test_arrivals_are_seeded_poisson_and_the_same_for_every_arm():
    a = el.arrival_times(4000, 0.5, seed=0)
    assert a == el.arrival_times(4000, 0.5, seed=0)  # every arm gets these times
    assert a != el.arrival_times(4000, 0.5, seed=1)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    mean = sum(gaps) / len(gaps)
    assert abs(mean - 2.0) < 0.15  # mean gap 1/rate (4000 draws: sd of the mean ~0.03)
    # exponential gaps: the share above the mean is e^-1, not ~1/2 as for uniform gaps
    assert abs(sum(g > mean for g in gaps) / len(gaps) - math.exp(-1)) < 0.03
    assert el.arrival_times(3, math.inf, seed=0) == [0.0, 0.0, 0.0]


def test_percentile_and_effective_budget():
    assert el.percentile([], 50) is None
    assert el.percentile([3, 1, 2], 50) == 2
    assert el.percentile(list(range(1, 101)), 99) == 99
    assert el.percentile(list(range(1, 101)), 100) == 100
    assert el.effective_budget({"kv_min_budget": 90, "n_tokens": 300}) == 90
    assert el.effective_budget({"kv_min_budget": None, "n_tokens": 300}) == 300  # never cut


def test_by_cause_reads_labelled_counters():
    text = ('# HELP vase:evictions_by_cause_total x\n'
            'vase:evictions_by_cause_total{cause="scheduled",model_name="m"} 5.0\n'
            'vase:evictions_by_cause_total{cause="decode_pressure",model_name="m"} 2.0\n')
    assert el.by_cause(text) == {"scheduled": 5.0, "decode_pressure": 2.0,
                                 "admission_pressure": 0.0}


def test_paired_comparison():
    a = {p: {"correct": c, "pred": str(c), "output_ids": [c]} for p, c in
         zip("abcd", [True, True, False, False])}
    b = {p: {"correct": c, "pred": str(c), "output_ids": [c]} for p, c in
         zip("abcd", [True, False, False, True])}
    v = el.paired(a, b, boot_iters=200)
    assert v["n_paired"] == 4 and v["acc_diff"] == 0
    assert (v["only_this_right"], v["only_other_right"]) == (1, 1)
    assert v["same_answer"] == 0.5 and v["identical_output"] == 0.5
    assert el.paired(a, {}, boot_iters=10) is None


def _run(model, out, arms, rates):
    return el.main(["run", "--model-path", model, "--out", str(out), "--task", "chain_sum",
                    "--n", "3", "--rates", rates, "--arms", arms, "--max-new-tokens", "40",
                    "--budget", "16", "--window", "8", "--max-total-tokens", "1024",
                    "--threads", "1", "--boot-iters", "200"])


def test_end_to_end_with_resume(tiny_model_fp32, tmp_path):
    """Full, fixed and elastic on real servers at one rate: a pool that never fills leaves
    elastic token-identical to the full cache with no eviction, fixed evicts on schedule; a
    second invocation adds an arm without redoing the finished runs."""
    out = tmp_path / "load"
    assert _run(tiny_model_fp32, out, "full,elastic", "inf") == 0
    first = json.loads((out / "summary.json").read_text())
    full_run = next(r for r in first["runs"] if r["arm"] == "full")

    assert _run(tiny_model_fp32, out, "full,elastic,fixed", "inf") == 0
    assert (out / "server_full.log").read_text().count("\n=== ") == 1  # full not restarted
    summary = json.loads((out / "summary.json").read_text())
    runs = {r["arm"]: r for r in summary["runs"]}
    assert set(runs) == {"full", "fixed", "elastic"}
    assert runs["full"]["finished"] == full_run["finished"]
    for r in runs.values():
        assert r["n"] == 3 and r["output_tokens"] > 0 and r["output_tok_s"] > 0
        assert r["peak_running"] >= 1 and r["retractions"] == 0
        assert r["ttft_p50"] is not None and r["itl_p50"] is not None
    assert runs["elastic"]["vs_full"]["identical_output"] == 1.0
    assert runs["elastic"]["evictions_by_cause"] == dict.fromkeys(el.CAUSES, 0.0)
    assert runs["elastic"]["cut_share"] == 0.0
    assert runs["fixed"]["evictions_by_cause"]["scheduled"] > 0
    assert runs["fixed"]["cut_share"] > 0
    assert runs["fixed"]["mean_effective_budget"] < runs["full"]["mean_effective_budget"]
    rows = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    reqs = [r for r in rows if r["kind"] == "request"]
    assert len({r["key"] for r in reqs}) == 9
    for r in reqs:  # every streamed request carries its whole output, one gap per later token
        assert len(r["output_ids"]) == r["n_tokens"] and r["first_chunk_tokens"] >= 1
        assert len(r["itl"]) == r["n_tokens"] - r["first_chunk_tokens"]
    assert (out / "elastic_load.png").stat().st_size > 0
    assert "| inf | elastic |" in (out / "summary.md").read_text()

    # teacher-forced KL at fixed budgets with the runs' window, through the accuracy harness
    assert el.main(["tf", "--model-path", tiny_model_fp32, "--out", str(out), "--task",
                    "chain_sum", "--max-new-tokens", "40", "--budget", "16", "--window", "8",
                    "--tf-budgets", "16,24", "--tf-n", "1", "--threads", "1",
                    "--boot-iters", "200"]) == 0
    tf = json.loads((out / "summary.json").read_text())["teacher_forced"]
    assert sorted(tf) == ["16", "24"]
    for t in tf.values():
        assert t["window"] == 8 and t["n"] == 1 and t["tokens_measured"] > 0
        assert t["kl"] >= 0 and 0 <= t["top1_agree"] <= 1
    assert len(json.loads((out / "summary.json").read_text())["runs"]) == 3  # runs kept


def test_rates_option():
    a = el.parse_args(["run", "--model-path", "m", "--rates", "0.02:8,0.04,inf", "--n", "16"])
    assert a.rates == [0.02, 0.04, math.inf] and a.rate_n == {0.02: 8}
    for bad in ("0", "0.5:x", "-1", "1:0"):
        with pytest.raises(SystemExit):
            el.parse_args(["run", "--model-path", "m", "--rates", bad])
    with pytest.raises(SystemExit):  # trimkv needs gates
        el.parse_args(["run", "--model-path", "m", "--arms", "elastic-trimkv"])
