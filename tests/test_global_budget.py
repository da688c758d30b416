"""benchmarks/global_budget.py: the masked-cache emulation of per-head, per-layer and global
budgets. Its per-head rows must be the served policies (= ReferenceDecoder with the same gates
and draws), its layer and global rows must hold the same memory and differ, and a floor of K
must give per-head."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed

from benchmarks import global_budget as gb  # noqa: E402
from tests.servers import trimkv_gates  # noqa: E402
from vase_sglang.config import EvictionConfig  # noqa: E402
from vase_sglang.serving.hf_reference import ReferenceDecoder  # noqa: E402

BUDGET, WINDOW = 16, 4


@pytest.fixture(scope="module")
def case(tiny_model_fp32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_fp32, dtype=torch.float32)
    gates = trimkv_gates(model.config)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, vocab, (11,), generator=gen).tolist()
    forced = torch.randint(0, vocab, (70,), generator=gen).tolist()
    run = gb.MaskedRetentionRun(model, gates, budget=BUDGET, window=WINDOW)
    keep = BUDGET - WINDOW
    modes = [("full", 0), ("per-head", 0), ("global", 0), ("global", keep),
             gb.Row("trimkv", "layer"), gb.Row("vase-attnv", "per-head"),
             gb.Row("vase-attnv", "layer"), gb.Row("vase-attnv", "global")]
    logp, counts = run.run(prompt, forced, modes)
    picked = logp.gather(2, torch.tensor(forced)[None, :, None].expand(len(modes), -1, 1))[..., 0]
    return {"path": tiny_model_fp32, "gates": gates, "prompt": prompt, "forced": forced,
            "picked": picked, "counts": counts, "logp": logp}


def _reference(case, policy, request_key=0):
    cfg = EvictionConfig(policy=policy, budget=BUDGET, window=WINDOW)
    dec = ReferenceDecoder.from_pretrained(case["path"], cfg,
                                           gates=case["gates"] if policy == "trimkv" else None)
    out = dec.run(case["prompt"], forced_ids=case["forced"], request_key=request_key)
    return torch.tensor(out["logprobs"])


def test_schedule_is_the_served_one():
    # prefill; the private cache reaches T + R = 20 after step 20; then every R = 4 steps;
    # no eviction after the last step
    groups = gb.schedule(30, BUDGET, WINDOW)
    assert groups[0] == [0] and groups[1] == list(range(1, 21))
    assert [g[0] for g in groups[2:]] == [21, 25, 29]
    assert sum(groups, []) == list(range(30))
    assert gb.schedule(21, BUDGET, WINDOW) == [[0], list(range(1, 21))]


def test_per_head_row_is_the_reference_trimkv(case):
    ref = _reference(case, "trimkv")
    assert (case["picked"][1] - ref).abs().max() < 1e-4
    # ...and the full row is the full cache
    full = _reference(case, "full")
    assert (case["picked"][0] - full).abs().max() < 1e-4
    # negative control: eviction changed the distribution after the first eviction
    assert (ref - full)[BUDGET + WINDOW:].abs().max() > 1e-3


def test_per_head_row_is_the_reference_vase_attnv(case):
    """The served vase-attnv (Range(v) slots, sampling ∝ window attention), same draws."""
    ref = _reference(case, "vase-attnv")
    assert (case["picked"][5] - ref).abs().max() < 1e-4
    assert (ref - case["picked"][0])[BUDGET + WINDOW:].abs().max() > 1e-3
    # the draws matter: another request key draws other tokens
    other = _reference(case, "vase-attnv", request_key=1)
    assert (other - ref)[BUDGET + WINDOW:].abs().max() > 1e-4


def test_layer_and_global_scopes_same_memory(case):
    """Layer rows keep H·K per layer, unequally over its heads; global rows keep L·H·K; the
    pooled vase-attnv rows keep each head's value slots."""
    keep = BUDGET - WINDOW
    n_value = EvictionConfig(policy="vase-attnv", budget=BUDGET, window=WINDOW).n_value_slots
    assert n_value > 0
    unequal = {4: False, 6: False, 7: False}
    for per_eviction in case["counts"]:
        for b in (4, 6):  # layer scopes
            c = per_eviction[b]
            assert (c.sum(-1) == c.shape[1] * keep).all()
            unequal[b] |= bool((c != keep).any())
        c = per_eviction[7]
        assert int(c.sum()) == c.numel() * keep
        unequal[7] |= bool((c != keep).any())
        assert (per_eviction[6] >= n_value).all() and (c >= n_value).all()
        assert (per_eviction[5] == keep).all()
    assert all(unequal.values())
    for b in (4, 6, 7):
        assert (case["picked"][b] - case["picked"][1 if b == 4 else 5]).abs().max() > 1e-3


def test_keep_mask_layer_scope():
    scores = torch.tensor([[[5.0, 4.0, 3.0], [1.0, 0.5, 0.2]],
                           [[0.1, 0.2, 0.3], [9.0, 8.0, float("-inf")]]])  # [2, 2, 3]
    assert gb.keep_mask(scores, 1, "layer").tolist() == [
        [[True, True, False], [False, False, False]],
        [[False, False, False], [True, True, False]]]
    # +inf is kept whatever (forced), within the layer's total
    forced = scores.clone()
    forced[0, 1, 2] = float("inf")
    assert gb.keep_mask(forced, 1, "layer")[0].tolist() == [[True, False, False],
                                                            [False, False, True]]
    with pytest.raises(ValueError, match="mode"):
        gb.keep_mask(scores, 1, "cluster")


def test_global_budget_same_memory_different_heads(case):
    keep = BUDGET - WINDOW
    assert len(case["counts"]) >= 10
    for per_eviction in case["counts"]:
        per_head, glob, floored = per_eviction[1:4]
        assert (per_head == keep).all()
        # the same total (also asserted inside every eviction), spread unequally
        assert int(glob.sum()) == int(per_head.sum())
        assert (floored == keep).all()
    assert any(int(c[2].max()) > keep for c in case["counts"])
    # a floor of K is per-head; no floor changes what the model sees
    assert (case["logp"][3] - case["logp"][1]).abs().max() < 1e-5
    assert (case["picked"][2] - case["picked"][1]).abs().max() > 1e-3


def test_keep_mask_global_floor_and_candidates():
    scores = torch.tensor([[[5.0, 4.0, 3.0, float("-inf")], [1.0, 0.5, 0.2, 0.1]]])  # [1, 2, 4]
    assert gb.keep_mask(scores, 2, "per-head").tolist() == [[[True, True, False, False],
                                                              [True, True, False, False]]]
    assert gb.keep_mask(scores, 2, "global").tolist() == [[[True, True, True, False],
                                                           [True, False, False, False]]]
    assert gb.keep_mask(scores, 2, "global", floor=2).tolist() == gb.keep_mask(
        scores, 2, "per-head").tolist()


def test_cli_on_harness_records(tiny_model_fp32, trimkv_gates_file, tmp_path):
    """From an accuracy run's records (its full-cache greedy outputs) to summary.json, the
    markdown table and the PNG; a rerun resumes from records.jsonl."""
    import json

    from benchmarks import accuracy as acc

    pytest.importorskip("reasoning_gym")
    records = tmp_path / "acc"
    records.mkdir()
    gen = torch.Generator().manual_seed(5)
    with open(records / "records.jsonl", "w") as f:
        for prob in acc.load_problems("gsm_symbolic", 2, 123):
            ids = torch.randint(0, 1000, (40,), generator=gen).tolist()
            f.write(json.dumps({"key": acc.key(acc.Arm("full"), prob["pid"]), "arm": "full:greedy",
                                "pid": prob["pid"], "output_ids": ids}) + "\n")
    out = tmp_path / "gb"
    args = ["--model-path", tiny_model_fp32, "--gates", str(trimkv_gates_file), "--records",
            str(records), "--out", str(out), "--n", "2", "--budget", str(BUDGET), "--window",
            str(WINDOW), "--threads", "1", "--boot-iters", "100"]
    assert gb.main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["modes"]) == ["trimkv per-head", "trimkv layer", "trimkv global",
                                      "trimkv global, floor 3"]
    for s in summary["modes"].values():
        assert s["n"] == 2 and s["tokens"] == 2 * (40 - BUDGET - WINDOW)
        assert s["kl_boot95"][0] <= s["kl"] <= s["kl_boot95"][1] and s["kl"] > 0
    assert summary["head_spread"]["trimkv per-head"] == {"min": 12.0, "median": 12.0,
                                                         "max": 12.0}
    assert set(summary["pairs"]) == {f"trimkv {m} - trimkv per-head"
                                     for m in ("layer", "global", "global, floor 3")}
    assert set(summary["gain_share"]) == {"trimkv"}
    assert len(summary["config"]["gates_sha256"]) == 64
    assert (out / "global_budget.png").read_bytes()[:4] == b"\x89PNG"
    assert "| trimkv per-head |" in (out / "summary.md").read_text()
    before = (out / "records.jsonl").read_text()
    assert gb.main(args) == 0  # resumed: nothing recomputed
    assert (out / "records.jsonl").read_text() == before


def test_gain_share_is_the_layer_scopes_part_of_a_global_gain_and_none_without_one():
    """Pooled over tokens: KL per token 0.10 per head, 0.06 layer, 0.05 global → the layer
    scope keeps 0.8 of the gain; where the global scope raises KL (vase-attnv's shared scopes
    on the real model) there is no gain to share, and a ratio of two losses must not read as
    one (it did: 0.99)."""
    counts = [10, 30, 20]

    def rows(per_token):
        return [{"kl": per_token * c, "count": c} for c in counts]

    g = gb.gain_share(rows(0.10), rows(0.06), rows(0.05), iters=50)
    assert g["share"] == pytest.approx(0.8) and g["global_gain"] == pytest.approx(0.05)
    assert g["boot95"][0] == pytest.approx(0.8) and g["boot95"][1] == pytest.approx(0.8)
    worse = gb.gain_share(rows(0.09), rows(0.19), rows(0.19), iters=50)
    assert worse["share"] is None and worse["global_gain"] == pytest.approx(-0.10)
    md = gb.markdown({"modes": {}, "pairs": {}, "gain_share": {"vase-attnv": worse}},
                     {"budget": 64, "window": 16, "n": 3, "gates": None})
    assert "| vase-attnv | none: the global scope raises KL by 0.1000" in md


def test_served_vs_masked_pairs_scopes_and_ignores_other_arms():
    from benchmarks.served_vs_masked import compare

    def served(pid, scope, nll, budget=64, gates="abcd1234"):
        return {"pid": pid, "nll": nll, "arm_fields": {"kind": "tf", "policy": "trimkv",
                                                      "budget": budget, "window": 16,
                                                      "scope": scope, "gates": gates}}

    masked = [{"pid": "p0", "modes": {"trimkv per-head": {"nll": [1.0, 2.0]},
                                      "trimkv global": {"nll": [1.0, 2.5]}}}]
    rows = [served("p0", "head", [1.0, 2.0]), served("p0", "global", [1.0, 2.0]),
            served("p0", "global", [9.0, 9.0], budget=128), served("p1", "global", [0.0]),
            served("p0", "head", [5.0, 5.0], gates="ffff0000")]  # other gates: not compared
    out = compare(rows, masked, 64, 16, "abcd1234" + "0" * 56)
    assert out["head"]["max_abs_diff"] == 0.0 and out["head"]["tokens"] == 2
    assert out["global"]["max_abs_diff"] == 0.5 and out["global"]["problems"] == 1
    assert out["global"]["share_above_1e-3"] == 0.5
