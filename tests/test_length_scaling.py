"""benchmarks/length_scaling.py: the per-length report from recorded runs (written here in the
format concurrency_scaling.py records, under the settings it would use), the plan and the
refusals. No server: the runs themselves are concurrency_scaling.py's, tested there."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks/ is not installed

from benchmarks import concurrency_scaling as cs  # noqa: E402
from benchmarks import length_scaling as ls  # noqa: E402

BASE = ["--model-path", "/m", "--lengths", "512", "2048", "4096", "--budget", "128",
        "--window", "32", "--policies", "vase-dkv", "vase-attnv", "--max-total-tokens", "8448"]


def _args(out):
    """length_scaling.py's settings for BASE (what main() passes to its helpers)."""
    return argparse.Namespace(model_path="/m", max_total_tokens=8448, input_len=64, num_prompts=4,
                            concurrency=4, repeats=1, policies=["vase-dkv", "vase-attnv"],
                            budget=128, window=32, dtype=None, seed=1, out=str(out),
                            quiet_client=True, lengths=[512, 2048, 4096])


def _record(args, length, arm, tps, running, step_s, repeat=0, **settings_change):
    """One run as concurrency_scaling.py appends it to --out/L<length>/runs.jsonl: `tps` tokens
    a second from `running` requests at once, a decode step every `step_s` seconds."""
    steps = 1000
    sub = cs.parse_args(ls.concurrency_args(args, length))
    settings = cs.run_settings(sub) | settings_change
    row = {"arm": arm, "pool": args.max_total_tokens, "page_size": 1,
           "concurrency": args.concurrency, "repeat": repeat, "gates_sha256": None,
           "started_utc": "2026-12-04T08:00:00Z", "load_1min_at_start": 1.0,
           "output_throughput": tps, "peak_running": round(running), "mean_running": running,
           "bound": 40.0, "prompt_tokens_mean": 97.0, "median_ttft_ms": 100.0,
           "duration": steps * step_s, "decode_steps": steps,
           "total_output_tokens": tps * steps * step_s,
           "median_itl_ms": 1000 * step_s, "p99_itl_ms": 1500 * step_s, "peak_kv_tokens": 1000,
           "retracted_requests": 0,
           "eviction_time_share": None if arm == "full@N" else 0.005}
    folder = Path(sub.out)
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / cs.RECORDS).open("a") as f:
        f.write(json.dumps({"settings": settings, "row": row}) + "\n")


def test_report_splits_each_ratio_into_running_requests_and_step_speed(tmp_path):
    args = _args(tmp_path)
    for length, full, dkv, attnv in [(512, (10.0, 4.0, 0.4), (9.0, 4.0, 0.444),
                                      (9.5, 4.0, 0.42)),
                                     (4096, (4.0, 1.6, 0.4), (10.0, 4.0, 0.4),
                                      (11.0, 4.0, 0.36))]:
        _record(args, length, "full@N", *full)
        _record(args, length, "vase-dkv@N", *dkv)
        _record(args, length, "vase-attnv@N", *attnv)
    # a run of another budget in the same folder is not this command's: left aside
    _record(args, 4096, "vase-dkv@N", 99.0, 4.0, 0.01, repeat=1, budget=64)
    argv = BASE + ["--out", str(tmp_path), "--report-only"]
    assert ls.main(argv) == 0
    result = json.loads((tmp_path / "length_scaling.json").read_text())
    assert result["lengths_missing"] == [2048]
    by_len = {e["output_len"]: e for e in result["table"]}
    assert sorted(by_len) == [512, 4096]
    long = by_len[4096]["vs_full"]
    assert long["vase-dkv"]["throughput"]["median"] == pytest.approx(2.5)
    assert long["vase-dkv"]["mean_running"]["median"] == pytest.approx(2.5)
    assert long["vase-dkv"]["step_speed"]["median"] == pytest.approx(1.0)
    assert long["vase-attnv"]["throughput"]["median"] == pytest.approx(2.75)
    assert long["vase-attnv"]["step_speed"]["median"] == pytest.approx(0.4 / 0.36)
    assert by_len[4096]["arms"]["vase-dkv@N"]["runs"] == 1  # the budget-64 run left aside
    assert by_len[512]["vs_full"]["vase-dkv"]["throughput"]["median"] == pytest.approx(0.9)
    md = (tmp_path / "length_scaling.md").read_text()
    assert ("| 4096 | vase-dkv@N | 10.0 | 2.50× | 4 / 4.0 | 2.50× | 400 | 1.00× | 400 | 0 | "
            "0.50 % |") in md
    assert "| 4096 | full@N | 4.0 | 1 |" in md
    assert (tmp_path / "length_scaling.png").stat().st_size > 0


def test_ratios_pair_the_runs_of_one_repeat_not_every_run_with_every_run(tmp_path):
    """Repeats made on two machines (one twice as fast): each repeat's ratio is 1.2 or 1.1, so
    the ratio's range is [1.1, 1.2]; crossing all runs would give [0.6, 2.2], the machines'
    difference, not eviction's. A pair recorded on two processors is not a pair."""
    args = _args(tmp_path)
    _record(args, 4096, "full@N", 10.0, 2.0, 0.2, repeat=0)
    _record(args, 4096, "vase-dkv@N", 12.0, 8.0, 8 / 12.0, repeat=0)
    _record(args, 4096, "full@N", 20.0, 2.0, 0.1, repeat=1)
    _record(args, 4096, "vase-dkv@N", 22.0, 8.0, 8 / 22.0, repeat=1)
    _record(args, 4096, "full@N", 30.0, 2.0, 0.1, repeat=2)
    _record(args, 4096, "vase-dkv@N", 90.0, 8.0, 0.1, repeat=2)
    rows = ls.length_rows(argparse.Namespace(**{**vars(args), "lengths": [4096]}))[4096]
    for r in rows:  # repeat 2's arms on two processors
        if r["repeat"] == 2:
            r["machine"] = {"cpu": "AMD EPYC" if r["arm"] == "full@N" else "Intel Xeon"}
    (entry,) = ls.summarize({4096: rows}, ["vase-dkv", "vase-attnv"])
    tput = entry["vs_full"]["vase-dkv"]["throughput"]
    assert tput["per_pair"] == pytest.approx([1.2, 1.1])
    assert (tput["min"], tput["median"], tput["max"]) == pytest.approx((1.1, 1.15, 1.2))
    # tok/s = running / step time: 1.2 = 4 (running) x 0.3 (step speed), 1.1 = 4 x 0.275
    assert entry["vs_full"]["vase-dkv"]["mean_running"]["per_pair"] == pytest.approx([4.0, 4.0])
    assert entry["vs_full"]["vase-dkv"]["step_speed"]["per_pair"] == pytest.approx([0.3, 0.275])
    assert "vase-attnv" not in entry["vs_full"]  # never ran: no ratio
    assert [(r["repeat"], r["throughput_vs_full"]["vase-dkv"]) for r in entry["runs"]] == \
        [(0, pytest.approx(1.2)), (1, pytest.approx(1.1)), (2, None)]
    md = ls.markdown([entry])
    assert "| 4096 | vase-dkv@N | 22.0 [12.0–90.0] | 1.15× [1.10–1.20] |" in md
    assert "| 4096 | 1 | 2026-12-04T08:00:00Z | not recorded | 20.0 | 1.10× | – |" in md
    assert "| 4096 | 2 | 2026-12-04T08:00:00Z | AMD EPYC | 30.0 | – | – |" in md


def test_report_without_any_recorded_run_fails(tmp_path):
    assert ls.main(BASE + ["--out", str(tmp_path), "--report-only"]) == 1


def test_default_pool_holds_two_full_cache_requests_of_the_longest_length():
    assert ls.default_pool([512, 4096, 1024], 64) == 2 * (4096 + 128)


def test_plan_counts_waves_of_the_requests_that_fit(capsys):
    args = _args("/tmp/unused")
    args.step_seconds, args.prompt_estimate = 0.5, 96.0
    rows = {(r["output_len"], r["arm"]): r for r in ls.plan(args)}
    # 8448 // (96 + 4096) = 2 full-cache requests at once: two waves of 4096 steps
    assert rows[4096, "full@N"]["at_once"] == 2
    assert rows[4096, "full@N"]["decode_steps"] == 2 * 4096
    # 8448 // (96 + 2048) = 3: still two waves
    assert rows[2048, "full@N"]["decode_steps"] == 2 * 2048
    # an evicting request holds P + T + R: all four at once
    assert rows[4096, "vase-dkv@N"]["at_once"] == 4
    assert rows[4096, "vase-dkv@N"]["seconds"] == pytest.approx(4096 * 0.5)
    assert ls.main(BASE + ["--plan", "--step-seconds", "0.5"]) == 0
    assert "decode steps" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["--lengths", "128", "512"], "must exceed T + R = 160"),
    (["--budget", "32", "--window", "32"], "must be larger than --window"),
    (["--policies", "trimkv"], "trimkv needs gates"),
])
def test_settings_that_cannot_measure_eviction_are_refused(extra, message):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "length_scaling.py"),
                           *BASE, "--plan", *extra], capture_output=True, text=True)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_each_length_runs_the_full_cache_and_the_policies_at_one_pool(tmp_path):
    args = _args(tmp_path)
    sub = cs.parse_args(ls.concurrency_args(args, 2048))
    assert sub.output_len == 2048 and sub.max_total_tokens == 8448
    assert sub.arms == ["full", "vase"] and sub.policies == ["vase-dkv", "vase-attnv"]
    assert Path(sub.out) == tmp_path / "L2048"
    assert (sub.budget, sub.window, sub.concurrency, sub.num_prompts) == (128, 32, [4], 4)
