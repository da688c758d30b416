"""benchmarks/frontier.py: the join of accuracy records and concurrency runs (no server: both
inputs are written here in the formats the two benchmarks write)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed

from benchmarks import accuracy_stats as st  # noqa: E402
from benchmarks import frontier  # noqa: E402

WORKLOAD = {"model_path": "/m", "max_total_tokens": 2048, "input_len": 64, "output_len": 512,
            "num_prompts": 16, "dtype": "float32", "seed": 1}


def _gen(policy, budget, correct, n=100, value_slots=None, gates=None):
    name = "full:greedy" if policy == "full" else (
        f"{policy}@{budget}/w{budget // 4}" + (f"/nv{value_slots}" if value_slots is not None
                                              else "") + (f"/g{gates}" if gates else "")
        + ":greedy")
    return name, {"policy": policy, "budget": budget, "window": budget // 4,
                  "value_slots": value_slots, "decoding": "greedy", "kind": "gen",
                  "gates": gates or "",
                  "n": n, "correct": correct, "accuracy": correct / n,
                  "wilson95": list(st.wilson(correct, n))}


def _summary(*entries):
    return {"generation": dict(entries)}


def _run(arm, budget, tps, running, concurrency=16, **workload):
    settings = WORKLOAD | {"budget": budget, "window": budget // 4} | workload
    return {"settings": settings, "row": {
        "arm": arm, "concurrency": concurrency, "page_size": 1, "output_throughput": tps,
        "mean_running": running, "peak_running": int(running) + 1, "bound": 7.9}}


def _write_runs(folder: Path, runs):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    return folder


def test_points_take_their_own_runs_else_the_budget_proxy_and_the_smallest_t_is_chosen(tmp_path):
    summary = _summary(_gen("full", 0, 21), _gen("vase-attnv", 32, 5), _gen("vase-attnv", 64, 13),
                       _gen("vase-attnv", 128, 20), _gen("snapkv", 128, 30),
                       _gen("snapkv", 32, 9), _gen("vase-attnv", 64, 12, value_slots=0),
                       _gen("streaming", 128, 25))
    a = _write_runs(tmp_path / "a", [
        _run("full@N", 128, 7.0, 2.7), _run("full@N", 128, 7.2, 2.7),
        _run("vase-attnv@N", 128, 15.3, 5.3), _run("snapkv@N", 128, 14.0, 5.3),
        _run("ceiling", 128, 32.0, 16), _run("vase-attnv@N fp8_e4m3", 128, 1.0, 1)])
    b = _write_runs(tmp_path / "b", [_run("vase-attnv@N", 32, 30.0, 16),
                                     _run("vase-attnv@N", 64, 25.0, 13)])
    runs, workload = frontier.throughput_runs([a, b])
    res = frontier.build(summary, runs, workload, ["vase-attnv", "snapkv"], None, "vase-attnv")
    pts = {(p["policy"], p["budget"]): p for p in res["points"]}
    # the ablation (value_slots=0) and unlisted policies are not points
    assert set(pts) == {("vase-attnv", 32), ("vase-attnv", 64), ("vase-attnv", 128),
                        ("snapkv", 32), ("snapkv", 128)}
    assert pts[("snapkv", 128)]["throughput"] == 14.0  # its own run at that budget
    assert pts[("snapkv", 128)]["throughput_measured_with"] == "snapkv"
    assert pts[("snapkv", 32)]["throughput"] == 30.0  # the budget's vase-attnv run
    assert pts[("snapkv", 32)]["throughput_measured_with"] == "vase-attnv"
    assert res["references"]["full"]["throughput"] == pytest.approx(7.1)
    assert res["references"]["full"]["throughput_range"] == [7.0, 7.2]
    assert res["references"]["ceiling"]["accuracy"] == 0.21
    # full 21/100: Wilson [0.14, 0.30]; 13/100 lies below it, 20/100 inside, 30/100 above
    assert res["smallest_budget_within_full_interval"] == {"vase-attnv": 128, "snapkv": None}
    md = frontier.table(res)
    assert "| vase-attnv | 32 / 8 | 5/100 = 0.05" in md and "fp8" not in md


def test_a_budget_without_runs_is_a_point_without_throughput(tmp_path):
    summary = _summary(_gen("full", 0, 21), _gen("vase-dkv", 192, 20))
    runs, workload = frontier.throughput_runs([_write_runs(tmp_path / "a", [
        _run("full@N", 128, 7.0, 2.7)])])
    res = frontier.build(summary, runs, workload, ["vase-dkv"], None, "vase-attnv")
    assert res["points"][0].get("throughput") is None
    assert "not measured" in frontier.table(res)


def test_another_workload_is_refused(tmp_path):
    a = _write_runs(tmp_path / "a", [_run("full@N", 128, 7.0, 2.7)])
    b = _write_runs(tmp_path / "b", [_run("vase-attnv@N", 32, 30.0, 16, max_total_tokens=4096)])
    with pytest.raises(SystemExit, match="another workload"):
        frontier.throughput_runs([a, b])
    c = _write_runs(tmp_path / "c", [_run("vase-attnv@N", 32, 30.0, 8, concurrency=8)])
    with pytest.raises(SystemExit, match="another workload"):
        frontier.throughput_runs([a, c])


def test_trimkv_points_of_one_gates_file(tmp_path):
    summary = _summary(_gen("full", 0, 21), _gen("trimkv", 64, 25, gates="aaaa1111"),
                       _gen("trimkv", 64, 22, gates="bbbb2222"),
                       _gen("trimkv", 64, 24, value_slots=16, gates="aaaa1111"))
    old, new = _run("trimkv@N", 64, 9.0, 13), _run("trimkv@N", 64, 26.0, 13)
    old["row"]["gates_sha256"], new["row"]["gates_sha256"] = "bbbb2222ff", "aaaa1111ff"
    folder = _write_runs(tmp_path / "a", [_run("vase-attnv@N", 64, 25.0, 13), old, new])
    runs, workload = frontier.throughput_runs([folder])
    assert len(runs[("trimkv@N", 64, 16)]) == 2
    runs, workload = frontier.throughput_runs([folder], "aaaa1111")
    assert [r["output_throughput"] for r in runs[("trimkv@N", 64, 16)]] == [26.0]
    with pytest.raises(SystemExit, match="several gates"):
        frontier.build(summary, runs, workload, ["trimkv"], None, "vase-attnv")
    res = frontier.build(summary, runs, workload, ["trimkv"], "aaaa1111", "vase-attnv")
    assert [(p["gates"], p["correct"]) for p in res["points"]] == [("aaaa1111", 25)]


def test_cli_writes_json_table_and_png(tmp_path):
    acc = tmp_path / "acc"
    acc.mkdir()
    (acc / "summary.json").write_text(json.dumps(_summary(
        _gen("full", 0, 21), _gen("vase-attnv", 32, 8), _gen("vase-attnv", 128, 19))))
    conc = _write_runs(tmp_path / "conc", [
        _run("full@N", 128, 7.0, 2.7), _run("vase-attnv@N", 128, 15.3, 5.3),
        _run("vase-attnv@N", 32, 30.0, 16), _run("ceiling", 128, 32.0, 16)])
    out = tmp_path / "out"
    assert frontier.main(["--accuracy", str(acc), "--concurrency", str(conc),
                          "--out", str(out)]) == 0
    res = json.loads((out / "frontier.json").read_text())
    assert res["smallest_budget_within_full_interval"] == {"vase-attnv": 128}
    assert (out / "frontier.png").stat().st_size > 10_000
    assert (out / "frontier.md").read_text().startswith("| policy |")


def _round_run(arm, budget, tps, repeat, cpu="AMD EPYC"):
    rec = _run(arm, budget, tps, 5.0)
    rec["row"] |= {"order": "round", "repeat": repeat, "machine": {"cpu": cpu, "cpu_count": 2}}
    return rec


def test_throughput_against_the_full_cache_paired_round_by_round_across_folders(tmp_path):
    summary = _summary(_gen("full", 0, 21), _gen("vase-attnv", 32, 8), _gen("vase-attnv", 128, 19))
    # one folder per budget, as the rounds are run: round i of each is paired with full's round i
    a = _write_runs(tmp_path / "T128", [_round_run("full@N", 128, 10.0, 0),
                                        _round_run("vase-attnv@N", 128, 20.0, 0),
                                        _round_run("full@N", 128, 5.0, 1),
                                        _round_run("vase-attnv@N", 128, 15.0, 1)])
    b = _write_runs(tmp_path / "T32", [_round_run("vase-attnv@N", 32, 40.0, 1),
                                       _round_run("vase-attnv@N", 32, 30.0, 0)])
    runs, workload = frontier.throughput_runs([a, b])
    assert workload["cpu"] == "AMD EPYC"
    res = frontier.build(summary, runs, workload, ["vase-attnv"], None, "vase-attnv")
    pts = {p["budget"]: p for p in res["points"]}
    # paired: 20/10, 15/5 and 30/10, 40/5; the ratio of medians is 17.5/7.5 and 35/7.5
    assert pts[128]["vs_full_paired"] == pytest.approx([2.0, 3.0])
    assert pts[32]["vs_full_paired"] == pytest.approx([3.0, 8.0])
    assert pts[128]["vs_full"] == pytest.approx(17.5 / 7.5)
    assert res["references"]["full"]["vs_full_paired"] == pytest.approx([1.0, 1.0])
    md = frontier.table(res)
    assert "4.67× (3.00, 8.00 by round)" in md


def test_runs_arm_by_arm_have_no_paired_ratio():
    full = [{"output_throughput": 10.0, "repeat": 0, "order": "arm"}]
    rows = [{"output_throughput": 20.0, "repeat": 0, "order": "round"}]
    assert frontier.paired_ratios(rows, full) == []
    assert frontier.versus_full(rows, full) == {"vs_full": 2.0, "vs_full_paired": []}


def test_runs_of_different_processors_are_refused(tmp_path):
    a = _write_runs(tmp_path / "a", [_round_run("full@N", 128, 10.0, 0, cpu="AMD EPYC")])
    b = _write_runs(tmp_path / "b", [_round_run("vase-attnv@N", 32, 30.0, 0,
                                                cpu="Intel(R) Xeon(R) Processor")])
    with pytest.raises(SystemExit, match="different processors"):
        frontier.throughput_runs([a, b])
    # records made before the machine facts were kept are one unknown processor, not a match
    old = _write_runs(tmp_path / "old", [_run("vase-attnv@N", 64, 25.0, 13)])
    with pytest.raises(SystemExit, match="not recorded"):
        frontier.throughput_runs([a, old])


def test_a_later_accuracy_folder_replaces_its_arms_and_is_named(tmp_path):
    # the first folder's vase-attnv T = 64 is an older draw, served again in the second folder
    first, second = tmp_path / "acc", tmp_path / "acc_again"
    for folder, entries in ((first, [_gen("full", 0, 21), _gen("vase-attnv", 64, 13),
                                     _gen("vase-attnv", 128, 22)]),
                            (second, [_gen("full", 0, 21), _gen("vase-attnv", 64, 20)])):
        folder.mkdir()
        (folder / "summary.json").write_text(json.dumps(_summary(*entries)))
    conc = _write_runs(tmp_path / "conc", [_run("full@N", 128, 7.0, 2.7),
                                           _run("vase-attnv@N", 64, 20.0, 8.0),
                                           _run("vase-attnv@N", 128, 15.3, 5.3)])
    out = tmp_path / "out"
    assert frontier.main(["--accuracy", str(first), str(second), "--concurrency", str(conc),
                          "--out", str(out)]) == 0
    res = json.loads((out / "frontier.json").read_text())
    by_t = {p["budget"]: p for p in res["points"]}
    assert (by_t[64]["correct"], by_t[64]["accuracy_from"]) == (20, str(second))
    assert (by_t[128]["correct"], by_t[128]["accuracy_from"]) == (22, str(first))
    assert res["smallest_budget_within_full_interval"] == {"vase-attnv": 64}
    assert f"vase-attnv T = 64 from {second}" in (out / "frontier.md").read_text()


def test_accuracy_folders_of_different_full_caches_are_refused():
    with pytest.raises(SystemExit, match="not one workload"):
        frontier.merge_accuracy([("a", _summary(_gen("full", 0, 21))),
                                 ("b", _summary(_gen("full", 0, 19), _gen("vase-attnv", 64, 20)))])


def _acc_folder(folder: Path, entries, eviction_seed=None, seed=123):
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps(_summary(*entries)))
    (folder / "config.json").write_text(json.dumps({"seed": seed, "eviction_seed": eviction_seed}))
    return folder


def test_other_eviction_seeds_are_draws_averaged_and_the_same_seed_replaced(tmp_path):
    # first: an old draw at the default seed (123), replaced by `again`; then seeds 1 and 2
    first = _acc_folder(tmp_path / "acc", [_gen("full", 0, 21), _gen("vase-attnv", 64, 13),
                                           _gen("vase-attnv", 32, 6)])
    again = _acc_folder(tmp_path / "again", [_gen("full", 0, 21), _gen("vase-attnv", 64, 20)])
    s1 = _acc_folder(tmp_path / "s1", [_gen("full", 0, 21), _gen("vase-attnv", 64, 19),
                                       _gen("vase-attnv", 32, 9)], eviction_seed=1)
    s2 = _acc_folder(tmp_path / "s2", [_gen("full", 0, 21), _gen("vase-attnv", 64, 17)],
                     eviction_seed=2)
    conc = _write_runs(tmp_path / "conc", [_run("full@N", 128, 7.0, 2.7),
                                           _run("vase-attnv@N", 32, 20.0, 8.0),
                                           _run("vase-attnv@N", 64, 20.0, 8.0)])
    out = tmp_path / "out"
    assert frontier.main(["--accuracy", *map(str, (first, again, s1, s2)), "--concurrency",
                          str(conc), "--out", str(out)]) == 0
    res = json.loads((out / "frontier.json").read_text())
    by_t = {p["budget"]: p for p in res["points"]}
    assert by_t[64]["correct"] == pytest.approx(56 / 3)  # 20, 19, 17: the 13 was replaced
    assert [(d["eviction_seed"], d["correct"], d["from"]) for d in by_t[64]["draws"]] == [
        (123, 20, str(again)), (1, 19, str(s1)), (2, 17, str(s2))]
    assert by_t[64]["wilson95"] == pytest.approx(list(st.wilson(56 / 3, 100)))
    assert by_t[32]["correct"] == 7.5 and len(by_t[32]["draws"]) == 2
    # 7.5 lies outside the full cache's interval [0.14, 0.30], 18.7 inside
    assert res["smallest_budget_within_full_interval"] == {"vase-attnv": 64}
    md = (out / "frontier.md").read_text()
    assert "18.7/100 = 0.19" in md and "mean of 3 draws: 20, 19, 17" in md


def test_draws_over_different_numbers_of_problems_are_refused():
    with pytest.raises(SystemExit, match="different numbers of problems"):
        frontier.merge_accuracy([
            ("a", _summary(_gen("full", 0, 21), _gen("vase-attnv", 64, 20)), 123),
            ("b", _summary(_gen("full", 0, 21), _gen("vase-attnv", 64, 9, n=50)), 1)])
