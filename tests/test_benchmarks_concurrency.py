"""benchmarks/concurrency_scaling.py: its parsers and failure paths on text in SGLang 0.5.23's
formats (fast), and the benchmark end to end (slow: three server starts; not in CI).

    pytest -m slow tests/test_benchmarks_concurrency.py
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # benchmarks/ is not installed

from benchmarks import concurrency_scaling as cs  # noqa: E402
from benchmarks.concurrency_scaling import MissingMeasurement  # noqa: E402
from vase_sglang.gates import gates_sha256  # noqa: E402

LABELS = {"model_name": "tiny", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}


def decode_line(running, tokens, it=None, queue=0, gen=123.45):
    """A scheduler line as SchedulerMetricsReporter.report_decode_stats formats it (logger
    prefix "[time] ", iteration only with SGLANG_LOG_FORWARD_ITERS)."""
    iter_msg = f" [{it}]" if it is not None else ""
    return (f"[2026-12-01 08:00:00] Decode batch{iter_msg}, #running-req: {running}, "
            f"#token: {tokens}, token usage: {tokens / 4096:.2f}, cuda graph: False, "
            f"gen throughput (token/s): {gen:.2f}, #queue-req: {queue}")


def retract_line(k):
    """Scheduler.update_running_batch's warning when the pool is full."""
    return (f"[2026-12-01 08:00:01] KV cache pool is full. Retract requests. #retracted_reqs: {k}, "
            f"#new_tokens_gained: {100 * k}, #new_token_ratio: 0.7000 -> 0.8000")


PREFILL = ("[2026-12-01 08:00:00] Prefill batch, #new-seq: 2, #new-token: 130, #cached-token: 0, "
           "token usage: 0.03, #running-req: 9, #queue-req: 0")


def metrics_text(retracted=None, prompts=None, evict_steps=None):
    """/metrics text written by the real prometheus_client, with SGLang's and our metric names
    and labels (a labelled series only appears once it has been touched, as in the server)."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    reg = CollectorRegistry()
    retr = Counter("sglang:num_retracted_requests_total", "Total number of retracted requests.",
                   labelnames=list(LABELS), registry=reg)
    prompt = Histogram("sglang:prompt_tokens_histogram", "Histogram of prompt token length.",
                       labelnames=list(LABELS), buckets=[100, 300, 500], registry=reg)
    evict = Histogram("vase:eviction_seconds", "Wall time of one eviction step.",
                      labelnames=list(LABELS), buckets=[0.001, 0.01, 0.1], registry=reg)
    if retracted is not None:
        retr.labels(**LABELS).inc(retracted)
    for n in prompts or []:
        prompt.labels(**LABELS).observe(n)
    for sec in evict_steps or []:
        evict.labels(**LABELS).observe(sec)
    return generate_latest(reg).decode()


def test_decode_stats_parse_running_requests_and_fail_without_lines():
    log = "\n".join([PREFILL, decode_line(3, 400, gen=30), decode_line(5, 700, it=12, gen=20),
                     PREFILL, decode_line(4, 650, queue=2, gen=16)])
    assert cs.decode_stats(log) == {"peak_running": 5, "mean_running": 4.0,
                                    "peak_kv_tokens": 700, "decode_steps": 3, "workers": 1,
                                    "step_ms_by_running": {"3": 100.0, "4": 250.0, "5": 250.0}}
    with pytest.raises(MissingMeasurement, match="Decode batch"):
        cs.decode_stats(PREFILL)  # used to report 0 running requests


def test_decode_stats_add_data_parallel_workers():
    """Under --dp-size each worker logs its own steps ("[time DPk] Decode batch, ..."): the
    running requests of the server are the sum of every worker's latest figures."""
    def tagged(rank, line):
        return line.replace("] Decode batch", f" DP{rank}] Decode batch", 1)

    log = "\n".join([tagged(0, decode_line(3, 300)), tagged(1, decode_line(2, 200)),
                     tagged(0, decode_line(4, 350)), tagged(1, decode_line(1, 100))])
    stats = cs.decode_stats(log)
    assert stats.pop("step_ms_by_running")  # each worker's own steps (test below)
    assert stats == {"peak_running": 6, "mean_running": (3 + 5 + 6 + 5) / 4,
                     "peak_kv_tokens": 550, "decode_steps": 4, "workers": 2}


def test_step_time_by_batch_size_is_the_median_over_its_steps():
    """With --decode-log-interval 1 a line's gen throughput is one step's tokens over its time:
    running / throughput is the step. A step that waited for a prefill (low throughput) does
    not move the median; a line without a throughput (0.00, nothing measured yet) is left out."""
    log = "\n".join([decode_line(2, 100, gen=10), decode_line(2, 101, gen=10),
                     decode_line(2, 102, gen=1), decode_line(7, 300, gen=14),
                     decode_line(7, 301, gen=0)])
    assert cs.decode_stats(log)["step_ms_by_running"] == {"2": 200.0, "7": 500.0}


def test_retractions_count_requests_not_lines():
    log = "\n".join([decode_line(8, 4000), retract_line(3), decode_line(5, 3000), retract_line(1)])
    assert cs.retracted_requests_logged(log) == 4
    before, after = cs.metric_sums(metrics_text()), cs.metric_sums(metrics_text(retracted=4))
    assert cs.retracted_requests(log, before, after) == 4
    with pytest.raises(MissingMeasurement, match="counts 2"):
        cs.retracted_requests(log, before, cs.metric_sums(metrics_text(retracted=2)))
    with pytest.raises(MissingMeasurement, match="not exported"):
        cs.retracted_requests(log, before, before)
    assert cs.retracted_requests(decode_line(2, 100), before, before) == 0
    with pytest.raises(MissingMeasurement, match="format"):
        cs.retracted_requests_logged("KV cache pool is full. Retract requests. gained 5")


def test_eviction_time_is_measured_or_the_run_fails():
    before = cs.metric_sums(metrics_text(evict_steps=[0.5]))
    after = cs.metric_sums(metrics_text(evict_steps=[0.5, 0.25, 0.125]))
    assert cs.eviction_seconds(before, after, evicting=True) == 0.375
    # stock arms have no eviction time (not 0 %) ...
    nothing = cs.metric_sums(metrics_text())
    assert cs.eviction_seconds(nothing, nothing, evicting=False) is None
    # ... and an evicting arm without a measured step stops the benchmark: a 0 % share would
    # pass the <= 3 % target by default
    with pytest.raises(MissingMeasurement, match="no eviction step"):
        cs.eviction_seconds(nothing, nothing, evicting=True)
    with pytest.raises(MissingMeasurement, match="no eviction step"):
        cs.eviction_seconds(after, after, evicting=True)
    with pytest.raises(MissingMeasurement, match="without eviction"):
        cs.eviction_seconds(before, after, evicting=False)


def test_bound_uses_the_prompt_lengths_the_server_saw():
    lens = [65, 134, 101, 100]  # --input-len 64, as the server tokenized the text prompts
    result = {"completed": 4, "input_lens": lens}
    before, after = cs.metric_sums(metrics_text(prompts=[30])), cs.metric_sums(metrics_text(prompts=[30, *lens]))
    assert cs.server_prompt_lengths(result, before, after) == lens
    assert cs.concurrency_bound(4096, lens, 192, 64) == 4096 / (100 + 192 + 64)
    # Pages of 16: the tree holds whole prompt pages (64, 128, 96, 96), the private cycle's
    # top is T + R = 256 tokens, 16 pages; with T + R = 250 it still takes 16 pages.
    assert cs.concurrency_bound(4096, lens, 192, 64, page_size=16) == 4096 / (96 + 256)
    assert cs.concurrency_bound(4096, lens, 190, 60, page_size=16) == 4096 / (96 + 256)
    with pytest.raises(MissingMeasurement, match="disagrees"):
        cs.server_prompt_lengths({"completed": 4, "input_lens": [64] * 4}, before, after)
    with pytest.raises(MissingMeasurement, match="input_lens"):
        cs.server_prompt_lengths({"completed": 4}, before, after)


def _row(arm, tput, peak, mean, share=None, bound=10.0):
    return {"arm": arm, "pool": 4096, "concurrency": 24, "output_throughput": tput,
            "peak_running": peak, "mean_running": mean, "bound": bound, "prompt_tokens_mean": 100.0,
            "median_ttft_ms": 1.0, "median_itl_ms": 1.0, "p99_itl_ms": 1.0, "peak_kv_tokens": 1,
            "retracted_requests": 0, "eviction_time_share": share}


def test_running_is_held_to_the_clients_when_they_are_fewer_than_the_bound():
    # 4 clients against a bound of 8: 4 running is all the clients allow, not half the memory
    rows = [{**_row("vase-attnv@N", 300, 4, 4.0, 0.01, bound=7.97), "concurrency": 4},
            {**_row("full@N", 150, 3, 2.7, bound=7.97), "concurrency": 4}]
    summary = cs.summarize(rows, ["vase-attnv"])["vase-attnv"]
    assert "peak_running_over_bound" not in summary
    peak = summary["peak_running_over_clients"]
    assert (peak["median"], peak["meets_target"]) == (1.0, True)
    assert "peak running / clients **1.00 × [1.00–1.00]**" in cs.markdown_summary(
        cs.summarize(rows, ["vase-attnv"]))
    # 16 clients against the same bound: the bound is the limit, 7 running is 0.88 of it
    rows = [{**r, "concurrency": 16, "peak_running": 7, "mean_running": 5.3} for r in rows]
    peak = cs.summarize(rows, ["vase-attnv"])["vase-attnv"]["peak_running_over_bound"]
    assert peak["median"] == 7 / 7.97 and not peak["meets_target"]


def test_page_sizes_are_summarized_against_their_own_stock_arm():
    rows = ([_row("full@N", 100, 3, 3.0)] + [_row("vase-attnv@N", 300, 9, 9.0, 0.01)]
            + [_row("full@N p16", 90, 3, 3.0)] + [_row("vase-attnv@N p16", 180, 8, 8.0, 0.02)])
    summary = cs.summarize(rows, ["vase-attnv"], [1, 16])
    assert summary["vase-attnv"]["throughput_over_full"]["median"] == 3.0
    assert summary["vase-attnv p16"]["throughput_over_full"]["median"] == 2.0
    assert summary["vase-attnv p16"]["eviction_time_share"]["median"] == 0.02


def test_a_ratio_is_bold_only_when_the_runs_ranges_do_not_overlap():
    rows = ([_row("full@N", t, 3, 3.0) for t in (100, 110, 120)]
            + [_row("vase-attnv@N", t, p, m, s) for t, p, m, s in
               ((300, 11, 9.0, 0.01), (330, 10, 9.5, 0.02), (310, 12, 10.0, 0.04))]
            + [_row("ceiling", t, 24, 23.0) for t in (280, 350, 320)])
    summary = cs.summarize(rows, ["vase-attnv"])["vase-attnv"]
    full, ceil = summary["throughput_over_full"], summary["throughput_over_ceiling"]
    assert full["separated"] and full["median"] == 310 / 110 and full["min"] == 300 / 120
    assert not ceil["separated"] and ceil["min"] == 300 / 350 and ceil["max"] == 330 / 280
    peak = summary["peak_running_over_bound"]
    assert (peak["median"], peak["min"], peak["meets_target"]) == (1.1, 1.0, True)
    mean = summary["mean_running_over_bound"]
    assert mean["median"] == 0.95 and mean["min"] == 0.9 and not mean["meets_target"]
    assert not summary["eviction_time_share"]["meets_target"]  # one run of three over 3 %
    text = cs.markdown_summary(cs.summarize(rows, ["vase-attnv"]))
    assert "**2.82 × [2.50–3.30]**" in text and "0.97 × [0.86–1.18] (ranges overlap)" in text
    assert "**1.10 × [1.00–1.20]**" in text and "0.95 × [0.90–1.00] (not in every run)" in text
    agg = {e["arm"]: e for e in cs.aggregate(rows)}
    assert agg["vase-attnv@N"]["mean_running"] == {"median": 9.5, "min": 9.0, "max": 10.0, "n": 3}
    assert agg["full@N"]["eviction_time_share"] is None
    assert "| full@N | 4096 | 24 | 3 | 110 [100–120] |" in cs.markdown_table(cs.aggregate(rows))


@pytest.mark.slow
def test_concurrency_scaling_small_run(tiny_model, tmp_path):
    cmd = [sys.executable, str(REPO / "benchmarks" / "concurrency_scaling.py"),
           "--model-path", tiny_model, "--max-total-tokens", "1024", "--input-len", "32",
           "--output-len", "160", "--num-prompts", "8", "--budget", "64", "--window", "16",
           "--concurrency", "8", "--repeats", "2", "--out", str(tmp_path), "--quiet-client"]
    subprocess.run(cmd, check=True, timeout=3000)
    result = json.loads((tmp_path / "concurrency_scaling.json").read_text())
    assert (tmp_path / "concurrency_scaling.png").stat().st_size > 0
    assert (tmp_path / "concurrency_scaling.md").read_text().count("| vase-attnv@N |") == 1
    assert [r["arm"] for r in result["rows"]] == ["full@N"] * 2 + ["vase-attnv@N"] * 2 + ["ceiling"] * 2
    for r in result["rows"]:
        assert r["completed"] == 8 and r["total_output_tokens"] == 8 * 160
        # the server saw longer prompts than the nominal 32, and the bound uses them
        assert r["prompt_tokens_min"] >= 32
        assert r["bound"] == pytest.approx(1024 / (r["prompt_tokens_mean"] + 64 + 16))
        assert r["retracted_requests"] == 0
        if r["arm"] == "full@N":  # stock charges P + 160 per request on the 1024 pool
            assert r["peak_running"] <= 1024 // (r["prompt_tokens_min"] + 160)
            assert r["eviction_seconds"] is None
        if r["arm"] == "vase-attnv@N":
            assert r["peak_running"] == 8 and r["eviction_seconds"] > 0


def test_pools_at_another_kv_dtype_hold_the_same_bytes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert cs.served_element_bytes(str(tmp_path), "auto") == 2
    assert cs.served_element_bytes(str(tmp_path), "float32") == 4
    assert cs.equal_bytes_pool(2048, 4, "fp8_e4m3") == 8192  # fp32 served here, fp8 cached
    assert cs.equal_bytes_pool(2048, 2, "fp8_e5m2") == 4096  # bf16 on a GPU
    assert cs.equal_bytes_pool(2048, 2, "auto") == 2048
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "int8"}))
    with pytest.raises(ValueError, match="int8"):
        cs.served_element_bytes(str(tmp_path), "auto")


def test_kv_dtype_arms_are_compared_with_the_default_dtype_at_the_same_bytes():
    rows = ([_row("full@N", 100, 3, 3.0), _row("vase-attnv@N", 200, 8, 8.0, 0.01),
             _row("full@N fp8_e4m3", 150, 12, 11.0), _row("vase-attnv@N fp8_e4m3", 260, 16, 15.0, 0.02)])
    summary = cs.summarize(rows, ["vase-attnv"], [1], ["auto", "fp8_e4m3"])
    fp8 = summary["vase-attnv fp8_e4m3"]
    assert fp8["throughput_over_full"]["median"] == 260 / 150  # its own dtype's stock arm
    assert fp8["vs_default_kv"]["vase-attnv@N"]["throughput"]["median"] == 260 / 200
    assert fp8["vs_default_kv"]["full@N"]["mean_running"]["median"] == 15.0 / 3.0
    assert list(summary["full fp8_e4m3"]["vs_default_kv"]) == ["full@N"]
    text = cs.markdown_summary(summary)
    assert "- full fp8_e4m3:\n  - vs full@N (same pool bytes): output tok/s **1.50 ×" in text
    assert "vs vase-attnv@N (same pool bytes): output tok/s **1.30 ×" in text


def _args(**kw):
    import argparse

    base = dict(model_path="/m", max_total_tokens=2048, input_len=64, output_len=512,
                num_prompts=16, concurrency=[16], repeats=2, policies=["vase-attnv"],
                budget=128, window=32, arms=["full", "vase"], page_size=[1], seed=1,
                out="/tmp/x", quiet_client=True, kv_dtypes=["auto"], kv_dtype_arms=["full"],
                dtype="float32", fresh=False, gates=None, order="arm")
    base.update(kw)
    return argparse.Namespace(**base)


def test_records_are_reused_only_under_the_same_settings(tmp_path):
    path = tmp_path / cs.RECORDS
    settings = cs.run_settings(_args())
    # choosing other runs (repeats, concurrency, arms, output folder) keeps the records valid
    assert cs.run_settings(_args(repeats=5, concurrency=[8, 16], out="/y", fresh=True)) == settings
    assert cs.run_settings(_args(budget=64)) != settings
    assert cs.run_settings(_args(dtype="bfloat16")) != settings
    row = _row("full@N", 100, 3, 3.0) | {"repeat": 0}
    lines = [json.dumps({"settings": settings, "row": row}),
             json.dumps({"settings": cs.run_settings(_args(budget=64)), "row": row | {"repeat": 1}}),
             '{"settings": {"model_path": "/m", "max_tot']  # cut short by a crash
    path.write_text("\n".join(lines))
    done, other = cs.load_records(path, settings)
    assert list(done) == [("full@N", 24, 0)] and done["full@N", 24, 0] == row and other == 2
    # a record written when --gates was still a setting (gates=None then) stays valid
    path.write_text(json.dumps({"settings": settings | {"gates": None}, "row": row}))
    assert list(cs.load_records(path, settings)[0]) == [("full@N", 24, 0)]


def test_gates_keep_the_other_arms_records_and_renew_trimkvs(tmp_path, monkeypatch):
    # adding trimkv (with its gates) later keeps every record made without them
    assert cs.run_settings(_args(gates="/g.pt", policies=["vase-attnv", "trimkv"])) == \
        cs.run_settings(_args())
    g1, g2 = tmp_path / "g1.pt", tmp_path / "g2.pt"
    g1.write_bytes(b"one")
    g2.write_bytes(b"two")
    started = []

    class Server:
        def __init__(self, *a, **k):
            started.append(a)

        def stop(self):
            pass

    monkeypatch.setattr(cs, "BenchServer", Server)
    monkeypatch.setattr(cs, "measure_run", lambda *a: {"output_throughput": 1.0,
                                                       "peak_running": 1, "mean_running": 1.0,
                                                       "bound": 1.0, "eviction_time_share": None})
    args = _args(concurrency=[16], repeats=1)
    flags = ["--kv-evict-policy", "trimkv", "--kv-evict-retention-gates"]
    rows = cs.run_arm("trimkv@N", [*flags, str(g1)], 2048, args, tmp_path)
    assert rows[0]["gates_sha256"] == gates_sha256(g1) and len(started) == 1
    done = {("trimkv@N", 16, 0): rows[0]}
    cs.run_arm("trimkv@N", [*flags, str(g1)], 2048, args, tmp_path, done=done)
    assert len(started) == 1  # same gates: reused
    cs.run_arm("trimkv@N", [*flags, str(g2)], 2048, args, tmp_path, done=done)
    assert len(started) == 2  # other gates: run again


def test_round_order_takes_turns_and_pairs_the_runs_by_round(tmp_path, monkeypatch):
    """--order round: round r runs every arm's r-th run, a server each, the records say so and
    carry the machine's facts, and the summary adds the ratio of the runs of each round."""
    started = []

    class Server:
        def __init__(self, model, args, **kw):
            started.append("--kv-evict-policy" in args)

        def stop(self):
            pass

    throughputs = iter([10.0, 20.0, 5.0, 15.0])  # in the order the runs are made

    def run(server, args, c, evicting, page_size=1, pool=None, budget=None, window=None):
        figures = dict.fromkeys(cs.STAT_KEYS, 1.0)
        figures["eviction_time_share"] = 0.01 if evicting else None
        return {**figures, "output_throughput": next(throughputs)}

    monkeypatch.setattr(cs, "BenchServer", Server)
    monkeypatch.setattr(cs, "measure_run", run)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cs.main(["--model-path", str(tmp_path), "--dtype", "float32", "--arms", "full", "vase",
             "--concurrency", "16", "--repeats", "2", "--order", "round", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "concurrency_scaling.json").read_text())
    assert [(r["arm"], r["repeat"]) for r in result["rows"]] == [
        ("full@N", 0), ("vase-attnv@N", 0), ("full@N", 1), ("vase-attnv@N", 1)]
    assert started == [False, True, False, True]
    row = result["rows"][0]
    assert row["order"] == "round" and row["machine"]["server_threads"] == 1
    assert row["machine"]["cpu_count"] == os.cpu_count()
    paired = result["summary"]["vase-attnv"]["throughput_over_full_paired"]
    assert paired["per_pair"] == [2.0, 3.0] and paired["repeats"] == [0, 1]
    assert paired["median"] == 2.5
    # the unpaired ratio of medians mixes the rounds: (20 + 15) / 2 over (10 + 5) / 2
    assert result["summary"]["vase-attnv"]["throughput_over_full"]["median"] == pytest.approx(35 / 15)
    assert "round by round (paired runs): output tok/s 2.50 × [2.00–3.00] (2.00, 3.00)" in \
        (tmp_path / "concurrency_scaling.md").read_text()


def test_arm_order_runs_have_no_paired_ratio():
    rows = [{"arm": a, "concurrency": 16, "repeat": r, "order": "arm", "output_throughput": 1.0,
             "peak_running": 1, "mean_running": 1.0, "bound": 1.0, "retracted_requests": 0,
             "eviction_time_share": None if a == "full@N" else 0.01}
            for a in ("full@N", "vase-attnv@N") for r in range(2)]
    summary = cs.summarize(rows, ["vase-attnv"])["vase-attnv"]
    assert "throughput_over_full" in summary and "throughput_over_full_paired" not in summary


def test_an_arm_whose_runs_are_all_recorded_starts_no_server(tmp_path, monkeypatch):
    def no_server(*a, **k):
        raise AssertionError("a server was started for runs already recorded")

    monkeypatch.setattr(cs, "BenchServer", no_server)
    args = _args(concurrency=[16], repeats=2)
    done = {("full@N", 16, r): {"arm": "full@N", "repeat": r} for r in range(2)}
    assert cs.run_arm("full@N", [], 2048, args, tmp_path, done=done) == [done["full@N", 16, 0],
                                                                        done["full@N", 16, 1]]
    with pytest.raises(AssertionError, match="a server was started"):  # one run missing
        cs.run_arm("full@N", [], 2048, args, tmp_path, done={("full@N", 16, 0): {}})


def test_arms_at_another_kv_dtype_get_its_flag_and_the_same_bytes():
    args = _args(arms=["full", "vase", "vase-dp2", "ceiling"], kv_dtypes=["auto", "fp8_e4m3"],
                 kv_dtype_arms=["full", "vase", "vase-dp2"], page_size=[1, 16],
                 policies=["vase-attnv", "trimkv"], gates="/g.pt")
    arms = {name: (flags, pool, page) for name, flags, pool, page in cs.build_arms(args, 4)}
    assert list(arms)[:7] == ["full@N", "vase-attnv@N", "trimkv@N", "vase-attnv@N-dp2",
                              "trimkv@N-dp2", "ceiling", "full@N fp8_e4m3"]
    assert "ceiling fp8_e4m3" not in arms and "ceiling p16" in arms  # not a kv-dtype arm
    flags, pool, page = arms["vase-attnv@N-dp2 p16 fp8_e4m3"]
    assert (pool, page) == (2048 * 4 // 2, 16)  # per worker: half of 4 N fp8 slots
    assert flags[:2] == ["--kv-cache-dtype", "fp8_e4m3"]
    assert "--kv-evict-retention-gates" not in flags  # only trimkv reads the gates
    trim = arms["trimkv@N-dp2 p16 fp8_e4m3"][0]
    assert trim[trim.index("--kv-evict-retention-gates") + 1] == "/g.pt"
    assert arms["full@N"] == ([], 2048, 1) and arms["full@N fp8_e4m3"][1] == 8192
    assert "--kv-evict-retention-gates" not in arms["full@N fp8_e4m3"][0]


def test_policy_specs_give_an_arm_its_own_settings_and_bound():
    """Arms at equal quality with different settings (issue 52: trimkv per head at T = 128
    against its global scope at T = 64): each arm is started with its own flags, and its
    bound counts its own budget."""
    args = _args(arms=["vase"], policies=["trimkv:budget=128",
                                          "trimkv:budget=64:budget-scope=global"], gates="/g.pt")
    arms = {name: flags for name, flags, _pool, _page in cs.build_arms(args, 4)}
    head, glob = arms["trimkv:budget=128@N"], arms["trimkv:budget=64:budget-scope=global@N"]
    assert head[head.index("--kv-evict-budget") + 1] == "128"
    assert "--kv-evict-budget-scope" not in head
    assert glob[glob.index("--kv-evict-budget") + 1] == "64"
    assert glob[glob.index("--kv-evict-budget-scope") + 1] == "global"
    assert glob[glob.index("--kv-evict-retention-gates") + 1] == "/g.pt"
    assert cs.flag_value(glob, "--kv-evict-budget", args.budget) == 64
    assert cs.flag_value([], "--kv-evict-budget", args.budget) == args.budget
    with pytest.raises(ValueError, match="expected POLICY:FLAG=VALUE"):
        cs.policy_spec("trimkv:budget", args)


def test_trimkv_without_gates_is_refused():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "concurrency_scaling.py"),
                           "--policies", "trimkv"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--gates" in proc.stderr, proc.stderr


def test_plots_one_bar_per_arm_at_a_single_concurrency_and_lines_at_several(tmp_path):
    one = cs.aggregate([_row("full@N", 100, 3, 3.0), _row("vase-attnv@N", 300, 9, 9.0, 0.01)])
    cs.plot(one, tmp_path / "one.png")
    several = cs.aggregate([_row("full@N", 100, 3, 3.0),
                            _row("full@N", 120, 3, 3.0) | {"concurrency": 8}])
    cs.plot(several, tmp_path / "several.png")
    assert (tmp_path / "one.png").stat().st_size > 0 and (tmp_path / "several.png").stat().st_size > 0


def test_runs_of_another_processor_are_not_resumed(tmp_path):
    settings = cs.run_settings(_args())
    path = tmp_path / cs.RECORDS
    row = _row("full@N", 100, 3, 3.0)
    lines = [{"settings": settings, "row": row | {"repeat": 0, "machine": {"cpu": "AMD EPYC"}}},
             {"settings": settings, "row": row | {"repeat": 1, "machine": {"cpu": "Intel Xeon"}}},
             {"settings": settings, "row": row | {"repeat": 2}}]  # before machine facts were kept
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    done, other = cs.load_records(path, settings, "AMD EPYC")
    assert sorted(k[2] for k in done) == [0, 2] and other == 1
    done, other = cs.load_records(path, settings, "Intel Xeon")
    assert sorted(k[2] for k in done) == [1, 2] and other == 1
    assert len(cs.load_records(path, settings)[0]) == 3  # no processor given: all
