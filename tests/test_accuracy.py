"""Smoke of the accuracy/fidelity harness (benchmarks/accuracy.py) on a real server with a tiny
fp32 model: every stage (greedy, teacher-forced, sweep, sampling), the resume path, the GSM8K
export and the JSON/PNG report. The real-model run is a documented benchmark, not a test."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed

from benchmarks import accuracy as acc  # noqa: E402
from benchmarks import accuracy_stats as st  # noqa: E402

pytest.importorskip("reasoning_gym")

BUDGET, WINDOW, MAX_NEW = 16, 4, 40
ARGS = ["--budget", str(BUDGET), "--window", str(WINDOW), "--max-new-tokens", str(MAX_NEW),
        "--sweep", "12,16", "--curve", "8,12,16", "--curve-policies", "vase-attnv,snapkv",
        "--max-total-tokens", "8192", "--concurrency", "16", "--threads", "1",
        "--boot-iters", "200"]


def test_stats_known_values():
    # Wilson 95% interval of 7/24 (R's prop.test without continuity correction: 0.149-0.492)
    lo, hi = st.wilson(7, 24)
    assert abs(lo - 0.1490) < 1e-3 and abs(hi - 0.4915) < 1e-3
    # exact McNemar: 1 vs 7 discordant pairs -> 2 * P(X <= 1), X ~ Bin(8, 1/2) = 18/256
    assert math.isclose(st.mcnemar_exact(1, 7), 18 / 256)
    assert st.mcnemar_exact(0, 0) == 1.0
    assert st.first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert st.first_divergence([1, 2], [1, 2]) is None
    assert st.first_divergence([1, 2], [1, 2, 3]) == 2
    d, lo, hi = st.paired_bootstrap([1, 1, 1, 0], [0, 0, 1, 0], iters=500)
    assert d == 0.5 and lo <= d <= hi


def test_cluster_bootstrap_pools_tokens_and_resamples_problems():
    # pooled mean over tokens (not the mean of per-problem means): (1 + 9) / (1 + 3)
    m, lo, hi = st.cluster_bootstrap([1.0, 9.0], [1, 3], iters=2000)
    assert m == 2.5 and 1.0 <= lo <= m <= hi <= 3.0
    # identical problems: every resample has the same pooled mean
    assert st.cluster_bootstrap([2.0] * 5, [4] * 5, iters=200) == (0.5, 0.5, 0.5)
    # a difference every problem shows is significant; one that flips sign is not
    d, lo, hi, p = st.paired_cluster_bootstrap([3.0] * 20, [1.0] * 20, [2] * 20, iters=2000)
    assert (d, lo, hi, p) == (1.0, 1.0, 1.0, 0.0)
    d, lo, hi, p = st.paired_cluster_bootstrap([1.0, 0.0] * 10, [0.0, 1.0] * 10, [1] * 20,
                                               iters=2000)
    assert d == 0.0 and lo < 0 < hi and p > 0.5


def test_coarse_kl_is_exact_on_the_whole_vocabulary_and_a_lower_bound_on_top_k():
    import torch

    torch.manual_seed(0)
    p = torch.log_softmax(torch.randn(50), -1)
    q = torch.log_softmax(torch.randn(50), -1)
    exact = float((p.exp() * (p - q)).sum())
    ids = p.argsort(descending=True)
    assert math.isclose(st.coarse_kl(p[ids].tolist(), q[ids].tolist()), exact, rel_tol=1e-5)
    assert st.coarse_kl(p[ids[:5]].tolist(), q[ids[:5]].tolist()) <= exact + 1e-9


def test_answer_extraction_and_export(tmp_path):
    assert acc.extract_answer("so 3 + 4 = 7.\nFinal answer: 7") == "7"
    assert acc.is_right(acc.extract_answer(r"The total is \boxed{\frac{3}{2}}"), "1.5")
    probs = acc.load_problems("gsm_symbolic", 3, 123)
    assert probs == acc.load_problems("gsm_symbolic", 3, 123)  # fixed seed
    acc.export_gsm8k(probs, tmp_path / "g.jsonl")
    rows = [json.loads(x) for x in (tmp_path / "g.jsonl").read_text().splitlines()]
    # sglang.test.few_shot_gsm8k reads the number after "####"
    assert [r["answer"].rsplit("#### ", 1)[1] for r in rows] == [p["answer"] for p in probs]


def test_harness_end_to_end_with_resume(tiny_model_fp32, trimkv_gates_file, tmp_path):
    out = tmp_path / "acc"
    a = acc.parse_args(["run", "--model-path", tiny_model_fp32, "--out", str(out), "--n", "2",
                        "--tf-n", "2", "--curve-n", "1", "--sweep-n", "1", "--sample-n", "1",
                        "--stages", "greedy,tf,curve,sweep,sample",
                        "--retention-gates", str(trimkv_gates_file), *ARGS])
    h = acc.Harness(a)
    try:
        acc.run_stages(h)
        _check_and_resume(h, a, out)
        _resume_from_compact_copy(h, a, out, tmp_path / "from_compact")
    finally:
        h.close()
    # the CLI rebuilds the report from the records alone
    assert acc.main(["report", "--out", str(out), "--boot-iters", "100"]) == 0
    assert (out / "summary.md").read_text().count(":greedy") >= 9
    # ...and from the compact copy alone (what is committed): the same summary up to rounding
    committed = tmp_path / "committed"
    committed.mkdir()
    for name in (acc.COMPACT, "config.json"):
        (committed / name).write_bytes((out / name).read_bytes())
    assert acc.main(["report", "--out", str(committed), "--boot-iters", "100"]) == 0
    _assert_close(json.loads((committed / "summary.json").read_text()),
                  json.loads((out / "summary.json").read_text()))


def _resume_from_compact_copy(h, a, out, folder):
    """A run resumed from the committed compact copy (its full-cache replays lack the top-k
    reference) can add a teacher-forced arm: the full replays are run again, not a KeyError."""
    import argparse
    import gzip

    with gzip.open(out / acc.COMPACT, "rt") as f:
        rows = [json.loads(x) for x in f if x.strip()]
    target = "snapkv@16/w4:greedy:tf"
    before = {r["pid"]: r for r in rows if r["arm"] == target}
    assert before and all("ref_ids" not in r for r in rows)
    folder.mkdir()
    (folder / "config.json").write_bytes((out / "config.json").read_bytes())
    (folder / "records.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows if r["arm"] != target))
    h2 = acc.Harness(argparse.Namespace(**{**vars(a), "out": str(folder), "stages": "tf"}))
    h2.adopt_server(h)
    try:
        acc.run_stages(h2)
    finally:
        h2.close()
    again = acc.Records(folder / "records.jsonl").rows
    assert all("ref_ids" in r for r in again.values() if r["arm"] == "full:greedy:tf")
    for pid, old in before.items():
        new = again[f"{target}|{pid}"]
        assert new["n_tokens"] == old["n_tokens"]
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        assert math.isclose(mean(new["kl"]), mean(old["kl"]), abs_tol=1e-3), pid


def _assert_close(a, b, path="summary"):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert math.isclose(a, b, abs_tol=1e-4) or (math.isnan(a) and math.isnan(b)), path
    else:
        assert a == b, path


def _check_and_resume(h, a, out):
    records = out / "records.jsonl"
    rows = [json.loads(x) for x in records.read_text().splitlines()]
    arms = {r["arm"] for r in rows}
    # greedy: the 9 registered policies without gates (curdkv included since the arms come
    # from the registry) + the value_slots=0 ablation + trimkv and its hybrid (the gates);
    # tf: the same 12; curve: budgets 8 and 12 for 2 policies (16 is tf's); sweep: budget 12
    # for the 8 evicting policies + plain trimkv (no ablation); sampling: 9 policies
    assert len([x for x in arms if x.endswith(":greedy")]) == 12 + 9
    assert len([x for x in arms if x.endswith(":tf")]) == 12 + 4
    assert len([x for x in arms if x.endswith(":sample")]) == 9
    assert len(rows) == 12 * 2 + 12 * 2 + 4 * 1 + 9 * 1 + 9 * 1
    gid = acc.gates_id(a.retention_gates)
    assert {f"trimkv@16/w4/g{gid}:greedy", f"trimkv@16/w4/nv4/g{gid}:greedy:tf"} <= arms
    assert f"trimkv@12/w4/g{gid}:greedy" in arms and "vase-attnv@12/w4/nv0:greedy" not in arms

    full = {r["pid"]: r for r in rows if r["arm"] == "full:greedy"}
    long_evicting = 0
    for r in rows:
        if r["arm"].endswith(":greedy") and r["arm"] != "full:greedy":
            # the per-request setting reached the scheduler: long outputs were evicted...
            if r["n_tokens"] > BUDGET + WINDOW + 1 and r["arm"].startswith(("vase", "snap", "rkv", "trimkv")) \
                    and "@16/" in r["arm"]:
                assert r["kv_evicted"] > 0, r["arm"]
                long_evicting += 1
            # ...and nothing differs from the full cache before the first eviction
            div = st.first_divergence(r["output_ids"], full[r["pid"]]["output_ids"])
            budget = r["arm_fields"]["budget"]
            assert div is None or div >= budget + r["arm_fields"]["window"], (r["arm"], div)
    # the check above ran (the problems' outputs are long enough to evict), and the full
    # cache, served by the same evicting server, reports exactly 0
    assert long_evicting > 0
    assert all(r["kv_evicted"] == 0 for r in full.values()), [r["kv_evicted"] for r in full.values()]

    # teacher forcing: replaying the full cache's own greedy output under the full cache picks
    # every forced token as top-1 (an off-by-one in the forcing would break this), and every
    # policy agrees with it until its first eviction
    tf = [r for r in rows if r["arm"].endswith(":tf")]
    for r in tf:
        start = r["arm_fields"]["budget"] + r["arm_fields"]["window"]
        head = r["top1_agree"] if r["arm"] == "full:greedy:tf" else r["top1_agree"][:start]
        assert all(head), r["arm"]
        assert r["n_tokens"] == len(full[r["pid"]]["output_ids"])
        if r["arm"] != "full:greedy:tf":
            assert max(r["kl"][:start]) < 1e-4, r["arm"]

    summary = json.loads((out / "summary.json").read_text())
    g = summary["generation"]["vase-attnv@16/w4:greedy"]
    assert g["n"] == 2 and "mcnemar_p" in g["vs_full"] and "same_answer" in g["vs_full"]
    tfs = summary["teacher_forced"]
    vase, snap = tfs["vase-attnv@16/w4:greedy:tf"], tfs["snapkv@16/w4:greedy:tf"]
    for s in (vase, snap):
        lo, hi = s["kl_boot95_after_first_eviction"]
        assert lo <= s["kl_after_first_eviction"] <= hi
    # the paired difference is taken on the same forced tokens of the same problems, so its
    # point estimate is the difference of the two pooled means
    pair = summary["teacher_forced_pairs"]["vase-attnv vs snapkv @T=16"]
    assert pair["n_paired"] == 2
    for metric in ("kl", "nll_excess", "top1_agree"):
        want = vase[f"{metric}_after_first_eviction"] - snap[f"{metric}_after_first_eviction"]
        got = pair[metric]["diff"]
        assert math.isclose(got, want, abs_tol=1e-9), metric
    assert "vase-attnv vs vase-attnv nv=0 @T=16" in summary["teacher_forced_pairs"]
    assert {"vase-attnv vs trimkv @T=16", "vase-attnv vs trimkv nv=4 @T=16",
            "trimkv vs trimkv nv=4 @T=16"} <= set(summary["teacher_forced_pairs"])
    assert not [x for x in summary["teacher_forced_pairs"] if x.startswith("trimkv vs snapkv")]
    assert "vase-attnv vs snapkv @T=8" in summary["teacher_forced_pairs"]
    # the curve: a smaller budget compresses the generated tokens' cache more
    comp = [tfs[f"vase-attnv@{b}/w4:greedy:tf"]["compression"] for b in (8, 12, 16)]
    assert comp[0] > comp[1] > comp[2] > 1, comp
    for png in ("accuracy.png", "fidelity.png", "budget_curve.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert (out / "gsm_symbolic.gsm8k.jsonl").exists()

    # resume: a run killed mid-write leaves a cut last line and misses some rows; a new harness
    # (on the same server, to save a startup) redoes exactly those and keeps the rest
    lines = records.read_text().splitlines()
    dropped = {json.loads(x)["key"] for x in lines[-3:]}
    records.write_text("\n".join(lines[:-3]) + "\n" + lines[-3][:20])
    h2 = acc.Harness(a)
    h2.adopt_server(h)
    try:
        acc.run_stages(h2)
    finally:
        h2.close()
    again = {}
    for x in records.read_text().splitlines():
        try:
            r = json.loads(x)
        except json.JSONDecodeError:
            continue
        again[r["key"]] = r
    assert len(again) == len(rows) and dropped <= set(again)
    kept = {json.loads(x)["key"]: x for x in lines[:-3]}
    assert all(json.dumps(again[k]) == v for k, v in kept.items())
