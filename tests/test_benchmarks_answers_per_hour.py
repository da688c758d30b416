"""The answers-per-hour benchmark (benchmarks/answers_per_hour.py): its arms, schedules,
multi-turn prompts and summary statistics on hand-made records, and one small end-to-end run on
real servers with the tiny model (stock and one evicting arm, one round, one server start each,
a resume in the middle of a run and one that starts nothing). The tiny model's answers are
garbage: the run checks the mechanics, not accuracy. The real-model run is a measurement
(docs/answers_per_hour.md), not part of the suite."""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import answers_per_hour as aph  # noqa: E402

pytest.importorskip("reasoning_gym")

BASE = ["run", "--model-path", "M"]


# ----------------------------------------------------------------------------- arms, schedules


def test_arms_are_named_with_their_defaults_and_checked(tmp_path):
    a = aph.parse_args(BASE + ["--arms", "stock", "vase-attnv", "vase-attnv:budget=64:mode=elastic",
                               "--multi-turn", "4"])
    assert a.arms == ["stock", "vase-attnv:budget=128:window=32",
                      "vase-attnv:budget=64:window=16:mode=elastic"]
    assert a.multi_turn_arm == "vase-attnv:budget=128:window=32"  # the first evicting arm
    stock, t128, elastic = a.arm_list
    assert stock.flags(5, None) == [] and not stock.evicts
    assert elastic.flags(5, None) == ["--kv-evict-policy", "vase-attnv", "--kv-evict-budget", "64",
                                      "--kv-evict-window", "16", "--kv-evict-seed", "5",
                                      "--kv-evict-mode", "elastic"]
    assert [aph.arm_workloads(x, a) for x in a.arm_list] == [
        ["all", "poisson", "multiturn"], ["all", "poisson", "multiturn"], ["all", "poisson"]]
    # the order rotates by one arm per round
    assert [aph.rotated(a.arms, r)[0] for r in range(4)] == [a.arms[0], a.arms[1], a.arms[2],
                                                             a.arms[0]]
    gates = tmp_path / "g.safetensors"
    gates.write_bytes(b"x")
    ga = aph.parse_args(BASE + ["--arms", "stock", "trimkv:budget=64:budget-scope=global",
                                "--gates", str(gates)])
    g = ga.arm_list[1]
    assert ga.gates_sha256 == hashlib.sha256(b"x").hexdigest()  # config.json names the gates
    assert g.name == "trimkv:budget=64:window=16:budget-scope=global"
    assert g.flags(0, str(gates))[-4:] == ["--kv-evict-budget-scope", "global",
                                           "--kv-evict-retention-gates", str(gates.resolve())]
    # a trimkv run's records name their gates: other gates are not resumed into them
    rows = {"p0": {"kind": "request", "gates_sha256": "aaa"}}
    aph.check_gates(rows, g, "aaa", tmp_path)
    with pytest.raises(SystemExit, match="other retention gates"):
        aph.check_gates(rows, g, "bbb", tmp_path)
    aph.check_gates(rows, elastic, None, tmp_path)  # an arm without gates: not checked
    for bad in (["--arms", "vase-attnv"],  # no stock
                ["--arms", "stock", "trimkv:budget=64"],  # no gates
                ["--arms", "stock", "nosuch:budget=64"],
                ["--arms", "stock", "vase-attnv", "vase-attnv:budget=128"],  # the same arm twice
                ["--arms", "stock", "vase-attnv:budget"],
                ["--workloads", "all,burst"],
                ["--multi-turn", "2", "--multi-turn-arm", "snapkv:budget=64"]):  # not in --arms
        with pytest.raises(SystemExit):
            aph.parse_args(BASE + bad)


def test_poisson_schedule_is_seeded_and_resumes_with_its_gaps():
    s = aph.schedule("poisson", 2000, 0.5, seed=3)
    assert s == aph.schedule("poisson", 2000, 0.5, seed=3)  # every arm of a round: these times
    assert s != aph.schedule("poisson", 2000, 0.5, seed=4)  # the next round: others
    assert s[0] == 0 and all(x < y for x, y in zip(s, s[1:]))
    assert abs(s[-1] / 1999 - 2.0) < 0.15  # mean gap 1 / rate
    assert aph.schedule("all", 3, 0.5, seed=3) == [0.0] * 3
    assert aph.schedule("multiturn", 2, 0.5, seed=3) == [0.0] * 2
    # a resumed run sends what is missing on the run's own schedule, the first at once
    t = aph.schedule("poisson", 6, 0.5, seed=3)
    assert aph.segment_times("poisson", 6, [2, 4, 5], 0.5, seed=3) == [
        0.0, t[4] - t[2], t[5] - t[2]]
    assert aph.segment_times("all", 6, [2, 4], 0.5, seed=3) == [0.0, 0.0]


def test_resume_binds_the_arrival_settings_only_to_poisson_records(tmp_path):
    """A folder holding only `all` records takes another --rate (the Poisson run it has not
    made yet); once Poisson records exist, their rate and arrival seed bind the folder."""
    a = aph.parse_args(BASE + ["--out", str(tmp_path), "--rate", "0.03"])
    a.cpu = "a processor"
    (tmp_path / "records").mkdir()
    (tmp_path / "config.json").write_text(json.dumps(aph.config(a)))
    (tmp_path / "records" / "stock__all__r0.jsonl").write_text("{}\n")
    faster = aph.parse_args(BASE + ["--out", str(tmp_path), "--rate", "0.05", "--arrival-seed", "4"])
    faster.cpu = a.cpu
    aph.check_resume(tmp_path, faster)
    later = aph.parse_args(BASE + ["--out", str(tmp_path), "--max-new-tokens", "30"])
    later.cpu = a.cpu
    with pytest.raises(SystemExit, match="max_new_tokens"):  # the other settings still bind
        aph.check_resume(tmp_path, later)
    (tmp_path / "records" / "stock__poisson__r0.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit, match="rate.*arrival_seed"):
        aph.check_resume(tmp_path, faster)
    aph.check_resume(tmp_path, a)


# ----------------------------------------------------------------------------- multi-turn prompts


def test_multi_turn_prompt_extends_turn_one(tokenizer):
    from benchmarks import accuracy as acc

    prob = {"pid": "p", "question": "Tom has 3 apples and buys 4. How many?", "answer": "7"}
    answer = "3 + 4 = 7.\nFinal answer: 7"
    msgs = aph.conversation(prob, answer)
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    assert msgs[0]["content"] == acc.PROMPT.format(q=prob["question"])
    assert msgs[2]["content"].startswith("Now double your answer.")
    first = acc.prompt_ids(tokenizer, prob)
    second = aph.follow_up_ids(tokenizer, prob, answer)
    # turn 1's prompt is turn 2's prefix (what the radix cache can give back), then the answer
    assert second[:len(first)] == first
    text = tokenizer.decode(second[len(first):])
    assert text.startswith(answer) and aph.FOLLOW_UP in text
    assert text.endswith("<|im_start|>assistant\n")
    assert [aph.doubled(x) for x in ("7", "2.5", "1/3", "-4", None, "x")] == [
        "14", "5", "2/3", "-8", None, None]
    assert acc.is_right("Final answer: 14".split(": ")[1], aph.doubled(prob["answer"]))


# ----------------------------------------------------------------------------- summary


def row(pid, correct, tokens, segment=0, finished_at=10.0, ttft=1.0, itl=(0.1,), latency=5.0,
        retractions=0):
    return {"kind": "request", "pid": pid, "correct": correct, "n_tokens": tokens,
            "segment": segment, "finished_at": finished_at, "ttft": ttft, "itl": list(itl),
            "latency": latency, "num_retractions": retractions, "finish": "stop"}


def segment(seg, steps=10, peak=3, mean=2.0, evict_s=None, retractions=0):
    return {"kind": "segment", "segment": seg, "decode_steps": steps, "peak_running": peak,
            "mean_running": mean, "retractions": retractions, "eviction_seconds": evict_s,
            "eviction_steps": None if evict_s is None else 5, "machine": {"cpu": "test cpu"},
            "evictions_by_cause": None}


def run_of(correct, tokens, wall, evict_s=None, **kw):
    rows = {f"p{i}": row(f"p{i}", c, t, finished_at=wall if i == 0 else wall / 2, **kw)
            for i, (c, t) in enumerate(zip(correct, tokens))}
    return {"rows": rows, "segments": [segment(0, evict_s=evict_s)]}


PIDS = [f"p{i}" for i in range(6)]


def test_summary_answers_per_hour_paired_ratio_tokens_and_mcnemar():
    arm = "vase-attnv:budget=64:window=16"
    stock_c, arm_c = [0, 0, 0, 0, 0, 1], [1, 1, 1, 1, 1, 1]
    runs = {}
    for rnd, (ws, wa) in enumerate([(3600.0, 1800.0), (3600.0, 3600.0)]):
        runs[("all", "stock", rnd)] = run_of(stock_c, [10, 20, 30, 40, 50, 60], ws)
        runs[("all", arm, rnd)] = run_of(arm_c, [12, 22, 32, 42, 52, 62], wa, evict_s=18.0)
    runs[("poisson", "stock", 0)] = run_of(stock_c[:3], [1, 2, 3], 100.0)  # 3 of 6: unfinished
    s = aph.summarize(runs, {"all": PIDS, "poisson": PIDS}, boot_iters=2000)
    assert s["unfinished"] == [{"workload": "poisson", "arm": "stock", "round": 0,
                                "answered": 3, "of": 6}]
    stock, ev = s["workloads"]["all"]["stock"], s["workloads"]["all"][arm]
    # all correct answers over all wall time: 2 in 2 h; 12 in 1.5 h
    assert stock["answers_per_hour"] == pytest.approx(1.0)
    assert ev["answers_per_hour"] == pytest.approx(8.0)
    assert ev["answers_per_hour_by_round"] == pytest.approx([12.0, 6.0])
    assert stock["correct_by_round"] == [1, 1] and ev["correct_by_round"] == [6, 6]
    lo, hi = ev["answers_per_hour_ci95"]
    assert lo < 8.0 < hi
    v = ev["vs_stock"]
    assert v["answers_per_hour_ratio"] == pytest.approx(8.0)
    assert v["answers_per_hour_ratio_by_round"]["per_pair"] == pytest.approx([12.0, 6.0])
    assert v["answers_per_hour_ratio_ci95"][0] <= 8.0 <= v["answers_per_hour_ratio_ci95"][1]
    # resamples that drew none of stock's one correct problem have no ratio
    assert v["resamples_without_stock_answers"] > 0
    # every problem 2 tokens longer than stock's: the paired difference has no spread
    assert v["tokens_per_answer_diff"] == pytest.approx(2.0)
    assert v["tokens_per_answer_diff_ci95"] == pytest.approx([2.0, 2.0])
    assert v["tokens_per_answer_ratio"] == pytest.approx(37 / 35)
    assert ev["tokens_per_answer_mean"] == pytest.approx(37.0)
    assert ev["tokens_per_answer_p90"] == 62 and stock["tokens_per_answer_p90"] == 60
    # five problems only the arm answers, none only stock: exact McNemar 2 / 2^5
    assert (v["only_arm_right"], v["only_stock_right"]) == (5, 0)
    assert v["mcnemar_p"] == pytest.approx(0.0625) and v["mcnemar_round"] == 0
    assert v["mcnemar_p_by_round"] == pytest.approx([0.0625, 0.0625])
    # eviction share: 18 s of eviction in a 1800 s and a 3600 s round
    assert ev["eviction_share_by_round"] == pytest.approx([0.01, 0.005])
    assert stock["eviction_share_by_round"] == [None, None]
    assert ev["finished_by_length_by_round"] == [0.0, 0.0]
    assert ev["peak_running"] == 3 and ev["processors"] == ["test cpu"]
    md = aph.markdown(s)
    assert "| stock | 2 |" in md and "8.00×" in md and "unfinished: poisson, stock" in md


def test_run_sizes_keep_the_conversations_a_later_command_did_not_ask_for():
    """A command that adds Poisson arms without --multi-turn writes multi_turn 0 to config.json:
    the 40 conversations recorded before are still whole runs (their first segment's n), not
    runs of 0 problems left out as unfinished."""
    cfg = {"problems": 60, "multi_turn": 0}
    runs = {("multiturn", "stock", 0): {"rows": {}, "segments": [{"segment": 0, "n": 40}]},
            ("all", "stock", 0): {"rows": {}, "segments": [{"segment": 0, "n": 60},
                                                            {"segment": 1, "n": 7}]},
            ("poisson", "stock", 0): {"rows": {}, "segments": [{"segment": 1, "n": 80}]}}
    assert aph.run_sizes(cfg, runs) == {"all": 60, "poisson": 60, "multiturn": 40}
    assert aph.run_sizes({"problems": 80, "multi_turn": 50}, runs) == {  # a larger run asked for
        "all": 80, "poisson": 80, "multiturn": 50}


def test_paired_interval_has_no_spread_for_identical_arms():
    """Both arms drawn on the same problems and rounds: equal records give a ratio of exactly
    1 in every resample, where unpaired resamples would spread."""
    correct = [[1, 0, 1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0, 1, 0]]
    walls = [1000.0, 1400.0]
    r = aph.answers_per_hour_ci(correct, walls, correct, walls, iters=2000)
    assert r["ratio"] == pytest.approx(1.0) and r["ratio_ci95"] == pytest.approx([1.0, 1.0])
    assert r["answers_per_hour"] == pytest.approx(3600 * 8 / 2400)
    lo, hi = r["ci95"]
    assert lo < r["answers_per_hour"] < hi
    assert aph.answers_per_hour_ci([[1, 1]], [3600.0], iters=100)["ci95"] == [2.0, 2.0]


def test_run_figures_percentiles_and_resumed_segments():
    """Nearest-rank p50 / p90; a run cut and resumed: wall time is each segment's time to its
    last answer, running requests are weighted by decode steps, and a segment cut before its
    server figures were written is said."""
    rows = {f"p{i}": row(f"p{i}", i % 2 == 0, 10 * (i + 1), segment=0 if i < 7 else 1,
                         finished_at=20.0 if i < 7 else 5.0, ttft=float(i + 1),
                         itl=[0.01 * (i + 1)], latency=float(i + 1), retractions=i == 3)
            for i in range(10)}
    f = aph.run_figures(rows, [segment(1, steps=30, mean=4.0, peak=5, evict_s=0.5,
                                       retractions=1)])
    assert f["wall_s"] == 25.0 and f["segments"] == 2
    assert f["correct"] == 5 and f["answers_per_hour"] == pytest.approx(3600 * 5 / 25)
    assert f["ttft_s"] == {"p50": 5.0, "p90": 9.0}
    assert f["latency_s"] == {"p50": 5.0, "p90": 9.0}
    assert f["itl_s"]["p90"] == pytest.approx(0.09)
    assert f["tokens_per_answer_mean"] == 55 and f["tokens_per_answer_p90"] == 90
    assert f["tokens_per_correct_answer"] == pytest.approx(550 / 5)
    assert f["retractions"] == 1 and f["retractions_logged"] == 1
    assert f["server_figures_complete"] is False  # segment 0 has no segment row
    assert (f["peak_running"], f["mean_running"]) == (5, 4.0)
    assert f["eviction_share"] == pytest.approx(0.5 / 25)
    both = aph.run_figures(rows, [segment(0, steps=10, mean=2.0), segment(1, steps=30, mean=4.0)])
    assert both["mean_running"] == pytest.approx(3.5) and both["server_figures_complete"]


# ----------------------------------------------------------------------------- end to end


def _run(model, out, arms, extra=()):
    return aph.main(["run", "--model-path", model, "--out", str(out), "--task", "chain_sum",
                     "--problems", "3", "--workloads", "all,poisson", "--rate", "20",
                     "--multi-turn", "2", "--max-new-tokens", "40", "--max-total-tokens", "2048",
                     "--threads", "1", "--boot-iters", "200", "--arms", *arms, *extra])


def test_end_to_end_two_arms_and_resume(tiny_model_fp32, tmp_path):
    """stock, then the evicting arm after a restart that finds one of its problems already
    recorded (it runs the other two, and the stock server is not started again), then the
    same command once more: nothing runs, the records do not change."""
    out = tmp_path / "aph"
    arm = "vase-attnv:budget=16:window=8"
    assert _run(tiny_model_fp32, out, ["stock"]) == 0
    records = out / "records"
    assert sorted(p.name for p in records.iterdir()) == [
        "stock__all__r0.jsonl", "stock__multiturn__r0.jsonl", "stock__poisson__r0.jsonl"]
    # the evicting arm's run as a restart finds it: its first problem answered, in a segment
    # cut before its server figures were written (the answer is stock's, marked as such)
    first = json.loads((records / "stock__all__r0.jsonl").read_text().splitlines()[0])
    first.update(arm=arm, text="recorded before the restart")
    slug = "vase_attnv_budget_16_window_8"
    (records / f"{slug}__all__r0.jsonl").write_text(json.dumps(first) + "\n")

    assert _run(tiny_model_fp32, out, ["stock", arm]) == 0
    assert (out / "server-stock-r0.log").read_text().count("\n=== ") == 1  # not restarted
    rows = [json.loads(x) for x in (records / f"{slug}__all__r0.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["request", "request", "request", "segment"]
    assert rows[0]["text"] == "recorded before the restart"  # kept, not asked again
    assert {r["pid"] for r in rows[1:3]} == {r["pid"] for r in rows[:3]} - {first["pid"]}
    assert rows[3]["segment"] == 1 and rows[3]["n"] == 2
    assert rows[3]["eviction_steps"] > 0 and rows[3]["eviction_seconds"] > 0

    summary = json.loads((out / "summary.json").read_text())
    assert not summary["unfinished"]
    for w in ("all", "poisson"):
        table = summary["workloads"][w]
        assert list(table) == ["stock", arm]
        for s in table.values():
            assert s["rounds"] == [0] and s["n"] == 3
            assert s["wall_s_by_round"][0] > 0 and s["answers_per_hour"] >= 0
            assert s["tokens_per_answer_mean"] > 0 and s["tokens_per_answer_p90"] <= 40
            assert s["ttft_s"]["p50"] > 0 and s["itl_s"]["p90"] > 0
            assert s["latency_s"]["p50"] >= s["ttft_s"]["p50"]
            assert s["peak_running"] >= 1 and s["mean_running_by_round"][0] > 0
            assert s["retractions_by_round"] == s["retractions_logged_by_round"] == [0]
        v = table[arm]["vs_stock"]
        assert v["rounds"] == [0] and 0 <= v["mcnemar_p"] <= 1
        assert v["tokens_per_answer_diff_ci95"][0] <= v["tokens_per_answer_diff"]
        assert table[arm]["eviction_share_by_round"][0] > 0
        assert table["stock"]["eviction_share_by_round"] == [None]
    resumed = summary["workloads"]["all"][arm]
    assert resumed["segments_by_round"] == [2] and not resumed["server_figures_complete"]
    assert summary["workloads"]["poisson"][arm]["server_figures_complete"]

    # multi-turn: turn 2 re-sends turn 1's conversation; stock's radix cache gives back turn
    # 1's prompt and answer, the evicting arm's at most the prompt (its compacted answer never
    # enters the tree) and it prefills the rest again
    mt = summary["workloads"]["multiturn"]
    assert list(mt) == ["stock", arm]
    conv = [json.loads(x) for x in (records / f"{slug}__multiturn__r0.jsonl").read_text()
            .splitlines() if '"conversation"' in x]
    assert len(conv) == 2
    for c in conv:
        t1, t2 = c["turn1"], c["turn2"]
        assert t2["prompt_tokens"] > t1["prompt_tokens"] + t1["n_tokens"] - 2
        assert t2["cached_tokens"] <= t1["prompt_tokens"]
        assert c["gold2"] == aph.doubled(c["gold"])
    assert mt[arm]["turn2_cached_tokens_mean"] < mt["stock"]["turn2_cached_tokens_mean"]
    assert mt["stock"]["turn2_cached_tokens_mean"] > mt["stock"]["turn1_tokens_mean"] / 2
    assert mt[arm]["turn2_prefilled_tokens_mean"] > mt["stock"]["turn2_prefilled_tokens_mean"]
    assert mt[arm]["turn2_ttft_s"]["p50"] > 0 and "turn2_mcnemar_p" in mt[arm]["vs_stock"]
    assert (out / "answers_per_hour.png").stat().st_size > 0
    assert f"| {arm} | 1 |" in (out / "summary.md").read_text()

    # the same command again: everything is recorded, no server starts, nothing is appended
    before = {p.name: p.read_bytes() for p in records.iterdir()}
    assert _run(tiny_model_fp32, out, ["stock", arm]) == 0
    assert {p.name: p.read_bytes() for p in records.iterdir()} == before
    assert (out / "server-stock-r0.log").read_text().count("\n=== ") == 1
    with pytest.raises(SystemExit, match="max_new_tokens"):  # other settings: refused
        _run(tiny_model_fp32, out, ["stock", arm], ["--max-new-tokens", "30"])
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "cpu": "another processor"}))
    with pytest.raises(SystemExit, match="cpu"):  # rounds paired across two batch curves: refused
        _run(tiny_model_fp32, out, ["stock", arm])
    assert math.isfinite(json.loads((out / "summary.json").read_text())["workloads"]["all"]
                         ["stock"]["answers_per_hour"])
