"""Elastic budgets under load (issue 21): what the full cache, fixed VaSE and elastic VaSE give
when real problems arrive at increasing rates on one fixed KV pool.

Each arm gets its own server (same pool, `--max-total-tokens`); for each rate the same problems
(reasoning-gym gsm_symbolic, the accuracy harness' prompts and answer extraction) arrive as a
Poisson process (seeded: every arm sees the same arrival times at a rate), greedy, streamed:

  full            stock SGLang
  fixed           vase-attnv, T = --budget, R = --window (the paper: cut back to T every R tokens)
  elastic         vase-attnv with --kv-evict-mode elastic: T is a floor, cut only under pressure
  elastic-trimkv  trimkv, elastic (with --retention-gates)

Measured per (arm, rate) on the same run: output tokens/s (output tokens / time from the first
arrival to the last answer), TTFT and inter-token latency percentiles (client side: the stream's
chunks), peak and mean running requests (server decode log, --decode-log-interval 1),
retractions (log, checked against SGLang's counter), eviction steps by cause (`vase:` metrics),
accuracy with a Wilson interval, paired per problem against full and against fixed at the same
rate (difference with a paired bootstrap interval, exact McNemar p, same answer, identical
output), and the effective budget: per request the smallest budget its cache ran at
(`meta_info.kv_min_budget`; a request never cut ran at its whole private cache, its generated
tokens), and what it held at the end (generated tokens - tokens evicted per layer and head).
The radix cache is flushed before each run, so no run reuses another's prefills.

The `tf` command adds the accuracy harness' teacher-forced KL(full || vase-attnv) with the same
window at fixed budgets (--tf-budgets): what a request held at a budget throughout costs. An
elastic request cut to L holds at least L and grows again after a cut, so the KL at its
effective budget bounds its loss from above.

Resumable: every request appends a row to records.jsonl as it completes, every finished run a
run row; a rerun skips finished runs and redoes a run cut short (its load figures need the whole
run). `report` rebuilds summary.{json,md} and elastic_load.png from the records.

    python benchmarks/elastic_load.py run --model-path M --out results/elastic_load \\
        --rates 0.02:8,0.06,inf --n 16 --max-total-tokens 3072
    python benchmarks/elastic_load.py tf --model-path M --out results/elastic_load --tf-n 20
    python benchmarks/elastic_load.py report --out results/elastic_load
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import accuracy as acc  # noqa: E402
from benchmarks import accuracy_stats as st  # noqa: E402
from benchmarks import concurrency_scaling as cs  # noqa: E402
from benchmarks._server import BenchServer, sigterm_exits  # noqa: E402

ARMS = ("full", "fixed", "elastic", "elastic-trimkv")
ARM_POLICY = {"fixed": "vase-attnv", "elastic": "vase-attnv", "elastic-trimkv": "trimkv"}
TF_POLICY = "vase-attnv"  # the policy of the teacher-forced KL curve (run_tf)
CAUSES = ("scheduled", "decode_pressure", "admission_pressure")
BY_CAUSE = "vase:evictions_by_cause_total"


def arm_flags(arm: str, a) -> list[str]:
    """launch_server flags of an arm (the rest of the server is the same for every arm)."""
    if arm == "full":
        return []
    from vase_sglang.policies import needs_gates

    policy = ARM_POLICY[arm]
    flags = ["--kv-evict-policy", policy, "--kv-evict-budget", str(a.budget),
             "--kv-evict-window", str(a.window), "--kv-evict-seed", str(a.seed),
             "--kv-evict-mode", "fixed" if arm == "fixed" else "elastic"]
    if needs_gates(policy):
        flags += ["--kv-evict-retention-gates", str(Path(a.retention_gates).resolve())]
    return flags


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the run's start at which each of n requests arrives: a Poisson process
    (exponential gaps, mean 1/rate), seeded by (seed, rate) so every arm gets the same times;
    rate inf = all at once. The first request arrives at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"{seed}:{rate_label(rate)}")
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def effective_budget(row: dict) -> int:
    """The smallest budget a request's cache ran at: the level it was cut to, or (never cut)
    its whole private cache, the generated tokens."""
    return row["kv_min_budget"] if row.get("kv_min_budget") is not None else row["n_tokens"]


# ----------------------------------------------------------------------------- one request


def stream_generate(url: str, payload: dict, timeout: float) -> dict:
    """POST /generate with stream on; the chunks' arrival times give TTFT and the gaps between
    tokens. SGLang streams cumulative `text`, `output_ids` and `meta_info`."""
    import requests

    t0 = time.perf_counter()
    times, counts, ids, last = [], [], [], None
    with requests.post(url + "/generate", json={**payload, "stream": True}, stream=True,
                       timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line or not line.startswith(b"data:"):
                continue
            body = line[5:].strip()
            if body == b"[DONE]":
                break
            chunk = json.loads(body)
            if "error" in chunk:
                raise RuntimeError(f"server error: {chunk['error']}")
            now = time.perf_counter() - t0
            n = chunk["meta_info"]["completion_tokens"]
            if counts and n == counts[-1]:
                last = chunk
                continue
            new = chunk.get("output_ids") or []
            # SGLang 0.5.23 streams the cumulative ids; an incremental stream extends them
            ids = list(new) if len(new) == n else ids + list(new)
            times.append(now)
            counts.append(n)
            last = chunk
    if last is None or not counts:
        raise RuntimeError("the stream ended without a token")
    meta = last["meta_info"]
    if len(ids) != meta["completion_tokens"]:
        raise RuntimeError(f"streamed {len(ids)} output ids for {meta['completion_tokens']} "
                           "completion tokens: SGLang's stream format changed")
    # inter-token latency: each chunk's gap spread over the tokens it brought
    itl = [(times[i] - times[i - 1]) / (counts[i] - counts[i - 1]) for i in range(1, len(times))
           for _ in range(counts[i] - counts[i - 1])]
    return {"text": last["text"], "output_ids": ids, "meta": meta, "ttft": times[0],
            "first_chunk_tokens": counts[0],  # a busy server can stream its first two at once
            "itl": itl, "latency": time.perf_counter() - t0}


# ----------------------------------------------------------------------------- one run


class LoadRun:
    """One (arm, rate) run on a running server: the arrivals, then the server's figures."""

    def __init__(self, server: BenchServer, arm: str, rate: float, probs: list[dict],
                 prompts: list[list[int]], a, records: acc.Records):
        self.server, self.arm, self.rate, self.a = server, arm, rate, a
        self.probs, self.prompts, self.records = probs, prompts, records
        self.evicts = arm != "full"

    def request_row(self, i: int, res: dict, arrival: float) -> dict:
        prob, meta = self.probs[i], res["meta"]
        pred = acc.extract_answer(res["text"])
        fin = meta.get("finish_reason") or {}
        row = {"key": request_key(self.arm, self.rate, prob["pid"]), "kind": "request",
               "arm": self.arm, "rate": rate_label(self.rate), "pid": prob["pid"],
               "gold": prob["answer"], "pred": pred, "correct": acc.is_right(pred, prob["answer"]),
               "text": res["text"], "output_ids": res["output_ids"],
               "n_tokens": meta["completion_tokens"], "prompt_tokens": meta["prompt_tokens"],
               "finish": fin.get("type") if isinstance(fin, dict) else str(fin),
               "arrival": round(arrival, 3), "ttft": res["ttft"], "latency": res["latency"],
               "itl": [round(x, 5) for x in res["itl"]],
               "first_chunk_tokens": res["first_chunk_tokens"],
               "kv_evicted": acc._evicted_total(meta.get("kv_evicted_tokens")) if self.evicts else 0,
               "kv_min_budget": meta.get("kv_min_budget") if self.evicts else None}
        return row

    def schedule(self) -> list[float]:
        """Seconds after the run's start at which each problem's request is sent."""
        return arrival_times(len(self.probs), self.rate, self.a.arrival_seed)

    def request(self, i: int, arrival: float) -> dict:
        """Serve problem i (greedy, streamed): its record row, without its finish time."""
        payload = {"input_ids": self.prompts[i],
                   "sampling_params": {"max_new_tokens": self.a.max_new_tokens, "temperature": 0.0}}
        res = stream_generate(self.server.url, payload, timeout=self.a.request_timeout)
        return self.request_row(i, res, arrival)

    def run(self) -> dict:
        server = self.server
        server.flush_cache()  # no run reuses another run's prefills
        times = self.schedule()
        before_text = server.get_text("/metrics")
        log_start = server.log_path.stat().st_size
        rows: list[dict | None] = [None] * len(self.probs)
        errors: list[BaseException] = []
        done = threading.Event()
        t0 = time.perf_counter()

        def one(i: int) -> None:
            delay = t0 + times[i] - time.perf_counter()
            if delay > 0 and done.wait(delay):
                return  # the run was stopped
            try:
                row = self.request(i, times[i])
            except BaseException as err:  # noqa: BLE001 - reported below with the server log
                errors.append(err)
                return
            row["finished_at"] = round(time.perf_counter() - t0, 3)
            rows[i] = row
            self.records.add(row)

        from tqdm import tqdm

        pool = ThreadPoolExecutor(len(self.probs))
        futs = [pool.submit(one, i) for i in range(len(self.probs))]
        bar = tqdm(total=len(futs), desc=f"{self.arm} @ {rate_label(self.rate)}/s",
                   dynamic_ncols=True, file=sys.stderr)
        try:
            for fut in futs:
                fut.result()
                bar.update(1)
        finally:
            done.set()
            bar.close()
            pool.shutdown(wait=False, cancel_futures=True)
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed; first: {errors[0]!r}; server "
                               f"log {server.log_path}")
        after_text = server.get_text("/metrics")
        with open(server.log_path, errors="replace") as f:
            f.seek(log_start)
            log = f.read()
        return self.run_row(rows, before_text, after_text, log)

    def run_row(self, rows: list[dict], before_text: str, after_text: str, log: str) -> dict:
        before, after = cs.metric_sums(before_text), cs.metric_sums(after_text)
        wall = max(r["finished_at"] for r in rows)
        decode = cs.decode_stats(log)
        causes = None
        if self.evicts:
            b, e = by_cause(before_text), by_cause(after_text)
            causes = {c: e[c] - b.get(c, 0.0) for c in e}
        # an elastic arm without pressure runs no eviction step: 0 s, not a missing figure
        evict_s = (after.get(cs.EVICT_SUM, 0.0) - before.get(cs.EVICT_SUM, 0.0)
                   if self.evicts else None)
        out_tokens = sum(r["n_tokens"] for r in rows)
        ttft = [r["ttft"] for r in rows]
        itl = [x for r in rows for x in r["itl"]]
        return {"key": run_key(self.arm, self.rate), "kind": "run", "arm": self.arm,
                "rate": rate_label(self.rate), "n": len(rows), "wall_s": wall,
                "output_tokens": out_tokens, "output_tok_s": out_tokens / wall,
                "ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90),
                "ttft_p99": percentile(ttft, 99), "itl_p50": percentile(itl, 50),
                "itl_p90": percentile(itl, 90), "itl_p99": percentile(itl, 99),
                "peak_running": decode["peak_running"], "mean_running": decode["mean_running"],
                "peak_kv_tokens": decode["peak_kv_tokens"], "decode_steps": decode["decode_steps"],
                "retractions": cs.retracted_requests(log, before, after),
                "eviction_seconds": evict_s, "evictions_by_cause": causes,
                "mean_prompt_tokens": st.mean(r["prompt_tokens"] for r in rows),
                "finished": time.strftime("%Y-%m-%d %H:%M:%S")}


def by_cause(metrics_text: str) -> dict[str, float]:
    """vase:evictions_by_cause_total per cause label (0 for a cause not exported yet)."""
    out = dict.fromkeys(CAUSES, 0.0)
    for line in metrics_text.splitlines():
        if line.startswith(BY_CAUSE + "{"):
            label = line.split('cause="', 1)[1].split('"', 1)[0]
            out[label] = out.get(label, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def request_key(arm: str, rate: float, pid: str) -> str:
    return f"{arm}|{rate_label(rate)}|{pid}"


def run_key(arm: str, rate: float) -> str:
    return f"run:{arm}|{rate_label(rate)}"


# ----------------------------------------------------------------------------- running


def load_prompts(a) -> tuple[list[dict], list[list[int]]]:
    """The accuracy harness' problems and prompts (chat template, answer instruction)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model_path)
    probs = acc.load_problems(a.task, max([a.n, *a.rate_n.values()]), a.seed)
    return probs, [acc.prompt_ids(tok, p) for p in probs]


def run(a) -> dict:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    records = acc.Records(out / "records.jsonl")
    cfg = {**vars(a), "rates": [rate_label(r) for r in a.rates],
           "rate_n": {rate_label(r): n for r, n in a.rate_n.items()}}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    with open(out / "runs.jsonl", "a") as f:
        f.write(json.dumps({"started": time.strftime("%Y-%m-%d %H:%M:%S"), **cfg}) + "\n")
    probs, prompts = load_prompts(a)
    for arm in a.arms:
        todo = [r for r in a.rates if run_key(arm, r) not in records.rows]
        if not todo:
            continue
        flags = (arm_flags(arm, a) + ["--random-seed", str(a.seed), "--dtype", a.dtype,
                                      "--enable-metrics", "--decode-log-interval", "1"]
                 + a.server_args.split())
        print(f"{arm}: starting a server ({' '.join(flags)})", file=sys.stderr)
        server = BenchServer(a.model_path, flags, log_path=out / f"server_{arm}.log",
                             max_total_tokens=a.max_total_tokens, max_running=a.max_running,
                             threads=a.threads, teacher_forcing=False)
        try:
            for rate in todo:
                n = a.rate_n.get(rate, a.n)
                row = LoadRun(server, arm, rate, probs[:n], prompts[:n], a, records).run()
                records.add(row)
                print(f"{arm} @ {rate_label(rate)}/s: {row['output_tok_s']:.1f} tok/s, "
                      f"{row['mean_running']:.1f} running (peak {row['peak_running']}), "
                      f"{row['retractions']} retractions", file=sys.stderr)
        finally:
            server.stop()
        report(out, a.boot_iters)  # after every arm: partial results are usable
    return report(out, a.boot_iters)


def run_tf(a) -> dict:
    """Teacher-forced KL(full || vase-attnv) at --tf-budgets with the load runs' window, on the
    first --tf-n problems, through the accuracy harness (its own server, records in OUT/tf)."""
    budgets = sorted(set(a.tf_budgets))
    argv = ["run", "--model-path", a.model_path, "--out", str(Path(a.out) / "tf"),
            "--task", a.task, "--seed", str(a.seed), "--budget", str(a.budget),
            "--window", str(a.window), "--max-new-tokens", str(a.max_new_tokens),
            "--dtype", a.dtype, "--threads", str(a.threads), "--concurrency", str(a.tf_concurrency),
            "--curve", ",".join(map(str, budgets)), "--curve-policies", TF_POLICY,
            "--sweep", str(a.budget), "--stages", "", "--tf-n", str(a.tf_n),
            "--server-args", a.server_args]
    ha = acc.parse_args(argv)
    h = acc.Harness(ha)
    try:
        arms = [acc.Arm(TF_POLICY, b, a.window, kind="tf") for b in budgets]
        h.teacher_forced("tf", arms, acc.load_problems(a.task, a.tf_n, a.seed))
    finally:
        h.close()
    return report(Path(a.out), a.boot_iters)


# ----------------------------------------------------------------------------- report


def paired(rows_a: dict, rows_b: dict, boot_iters: int) -> dict | None:
    """Arm a against arm b on the problems both answered: accuracy difference (a - b) with a
    paired bootstrap interval, exact McNemar p, same extracted answer, identical output."""
    common = sorted(set(rows_a) & set(rows_b))
    if not common:
        return None
    r = st.paired_accuracy([float(rows_a[p]["correct"]) for p in common],
                           [float(rows_b[p]["correct"]) for p in common], boot_iters)
    return {"n_paired": r["n_paired"], "acc_diff": r["acc_diff"],
            "acc_diff_boot95": r["acc_diff_boot95"], "only_this_right": r["only_a_right"],
            "only_other_right": r["only_b_right"], "mcnemar_p": r["mcnemar_p"],
            "same_answer": st.mean(rows_a[p]["pred"] == rows_b[p]["pred"] for p in common),
            "identical_output": st.mean(rows_a[p]["output_ids"] == rows_b[p]["output_ids"]
                                        for p in common)}


def tf_summary(out: Path, boot_iters: int) -> dict:
    """KL at each teacher-forced budget, from the tf records (empty without them)."""
    tf_out = out / "tf"
    if not (tf_out / "records.jsonl").exists():
        return {}
    summary = acc.report(tf_out, boot_iters)["teacher_forced"]
    rows = {}
    for s in summary.values():
        if s.get("policy") != TF_POLICY or "kl_after_first_eviction" not in s:
            continue
        rows[str(s["budget"])] = {
            "budget": s["budget"], "window": s["window"], "n": s["n_paired"],
            "kl": s["kl_after_first_eviction"], "kl_boot95": s["kl_boot95_after_first_eviction"],
            "top1_agree": s["top1_agree_after_first_eviction"],
            "tokens_measured": s["tokens_after_first_eviction"]}
    return rows


def summarize(records: dict, boot_iters: int = 10000) -> dict:
    runs = {k: r for k, r in records.items() if r.get("kind") == "run"}
    reqs: dict[tuple, dict] = {}
    for r in records.values():
        if r.get("kind") == "request":
            reqs.setdefault((r["arm"], r["rate"]), {})[r["pid"]] = r
    table = []
    for run in sorted(runs.values(), key=lambda r: (_rate_value(r["rate"]), ARMS.index(r["arm"]))):
        rows = reqs.get((run["arm"], run["rate"]), {})
        n, k = len(rows), sum(r["correct"] for r in rows.values())
        eff = [effective_budget(r) for r in rows.values()]
        s = {k2: v for k2, v in run.items() if k2 not in ("key", "kind")}
        s.update({"correct": k, "accuracy": k / n if n else None, "wilson95": list(st.wilson(k, n)),
                  "mean_tokens": st.mean(r["n_tokens"] for r in rows.values()),
                  "mean_effective_budget": st.mean(eff),
                  # what the cache held at the end: an elastic cache grows again after a cut
                  "mean_final_cache": st.mean(r["n_tokens"] - r["kv_evicted"]
                                              for r in rows.values()),
                  "cut_share": st.mean(r["kv_min_budget"] is not None for r in rows.values())})
        for other in ("full", "fixed"):
            if other != run["arm"] and (other, run["rate"]) in reqs:
                s[f"vs_{other}"] = paired(rows, reqs[(other, run["rate"])], boot_iters)
        table.append(s)
    return {"runs": table}


def _rate_value(label: str) -> float:
    return math.inf if label == "inf" else float(label)


def _fmt(x, spec=".1f") -> str:
    return "–" if x is None else format(x, spec)


def markdown(summary: dict) -> str:
    lines = ["| rate (req/s) | arm | output tok/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | "
             "running mean / peak | retractions | evictions: scheduled / decode / admission | "
             "effective budget: mean smallest / mean at the end (cut %) | accuracy [95% Wilson] | "
             "vs full: Δ [95%], McNemar p | "
             "vs fixed: Δ [95%], McNemar p |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary["runs"]:
        c = s.get("evictions_by_cause") or {}
        ev = " / ".join(_fmt(c.get(x), ".0f") for x in CAUSES) if c else "–"
        acc_s = f"{s['correct']}/{s['n']} [{s['wilson95'][0]:.2f}, {s['wilson95'][1]:.2f}]"

        def vs(name):
            v = s.get(f"vs_{name}")
            if not v:
                return "–"
            lo, hi = v["acc_diff_boot95"]
            extra = (f", {v['same_answer']:.0%} same answer, {v['identical_output']:.0%} "
                     "identical output" if name == "full" else "")
            return f"{v['acc_diff']:+.2f} [{lo:+.2f}, {hi:+.2f}], p={v['mcnemar_p']:.2f}{extra}"

        lines.append(
            f"| {s['rate']} | {s['arm']} | {s['output_tok_s']:.1f} | "
            f"{_fmt(s['ttft_p50'], '.2f')} / {_fmt(s['ttft_p99'], '.2f')} | "
            f"{_fmt(s['itl_p50'] * 1e3 if s['itl_p50'] is not None else None, '.0f')} / "
            f"{_fmt(s['itl_p99'] * 1e3 if s['itl_p99'] is not None else None, '.0f')} | "
            f"{s['mean_running']:.1f} / {s['peak_running']} | {s['retractions']} | {ev} | "
            f"{s['mean_effective_budget']:.0f} / {s['mean_final_cache']:.0f} "
            f"({s['cut_share']:.0%}) | {acc_s} | {vs('full')} | "
            f"{vs('fixed')} |")
    tf = summary.get("teacher_forced") or {}
    if tf:
        lines += ["", "| budget T (window R) | problems | tokens measured | KL(full ‖ vase-attnv) "
                      "[95%] | top-1 agreement |", "|---|---|---|---|---|"]
        for t in sorted(tf.values(), key=lambda t: t["budget"]):
            lines.append(f"| {t['budget']} ({t['window']}) | {t['n']} | {t['tokens_measured']} | "
                         f"{t['kl']:.3f} [{t['kl_boot95'][0]:.3f}, {t['kl_boot95'][1]:.3f}] | "
                         f"{t['top1_agree']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, out: Path) -> Path | None:
    runs = summary["runs"]
    if not runs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r["rate"] for r in runs}, key=_rate_value)
    x = {r: i for i, r in enumerate(rates)}
    panels = [("output_tok_s", "output tokens/s"), ("mean_running", "mean running requests"),
              ("ttft_p50", "TTFT p50 (s)"), ("accuracy", "accuracy (95% Wilson)"),
              ("mean_effective_budget", "mean smallest budget (tokens)"),
              ("mean_final_cache", "mean private cache at the end (tokens)")]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (field, title) in zip(axes.flat, panels):
        for j, arm in enumerate(a for a in ARMS if any(r["arm"] == a for r in runs)):
            pts = sorted((x[r["rate"]], r) for r in runs if r["arm"] == arm)
            xs = [p + (j - 1) * 0.06 for p, _ in pts]
            ys = [r[field] for _, r in pts]
            if field == "accuracy":
                err = [[y - r["wilson95"][0] for y, (_, r) in zip(ys, pts)],
                       [r["wilson95"][1] - y for y, (_, r) in zip(ys, pts)]]
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=arm)
            else:
                ax.plot(xs, ys, marker="o", label=arm)
        ax.set_xticks(range(len(rates)), [f"{r}/s" for r in rates])
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("Elastic vs fixed vs full cache under Poisson load (x: arrival rate)")
    fig.tight_layout()
    path = out / "elastic_load.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(out: Path, boot_iters: int = 10000) -> dict:
    records = acc.Records(out / "records.jsonl").rows if (out / "records.jsonl").exists() else {}
    summary = summarize(records, boot_iters)
    summary["teacher_forced"] = tf_summary(out, boot_iters)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(markdown(summary))
    plot(summary, out)
    return summary


# ----------------------------------------------------------------------------- CLI


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument("--model-path", required=True)
        p.add_argument("--out", default="results/elastic_load")
        p.add_argument("--task", default="gsm_symbolic", choices=["gsm_symbolic", "chain_sum"])
        p.add_argument("--seed", type=int, default=123, help="problem seed, eviction seed")
        p.add_argument("--n", type=int, default=40, help="problems per run")
        p.add_argument("--budget", type=int, default=64, help="T: fixed budget, elastic floor")
        p.add_argument("--window", type=int, default=16, help="R")
        p.add_argument("--max-new-tokens", type=int, default=512)
        p.add_argument("--dtype", default="float32",
                       help="server --dtype (this CPU has no native bf16: fp32 is faster)")
        p.add_argument("--threads", type=int, default=2, help="server OpenMP threads")
        p.add_argument("--server-args", default="", help="extra launch_server arguments")
        p.add_argument("--boot-iters", type=int, default=10000)

    r = sub.add_parser("run", help="the load runs")
    common(r)
    r.add_argument("--rates", default="0.02:8,0.06,inf",
                   help="arrival rates (requests/s, 'inf' = all at once), comma list; RATE:N "
                        "serves that rate's run the first N problems instead of --n (a run at a "
                        "low rate lasts about N / RATE seconds)")
    r.add_argument("--arms", default="full,fixed,elastic",
                   help=f"comma list of {', '.join(ARMS)} (elastic-trimkv needs --retention-gates)")
    r.add_argument("--max-total-tokens", type=int, default=3072,
                   help="the KV pool of every arm: small enough that the highest rate fills it")
    r.add_argument("--max-running", type=int, default=64)
    r.add_argument("--arrival-seed", type=int, default=0)
    r.add_argument("--request-timeout", type=float, default=3600)
    r.add_argument("--retention-gates", default=None, metavar="PATH")

    t = sub.add_parser("tf", help="teacher-forced KL at fixed budgets (the accuracy harness)")
    common(t)
    t.add_argument("--tf-budgets", default="64,96,128,192,256")
    t.add_argument("--tf-n", type=int, default=20)
    t.add_argument("--tf-concurrency", type=int, default=64)

    rp = sub.add_parser("report")
    rp.add_argument("--out", default="results/elastic_load")
    rp.add_argument("--boot-iters", type=int, default=10000)

    a = ap.parse_args(argv)
    if a.cmd == "run":
        spec, a.rates, a.rate_n = a.rates, [], {}
        for item in (x for x in spec.split(",") if x):
            rate_s, _, n_s = item.partition(":")
            try:
                rate = math.inf if rate_s == "inf" else float(rate_s)
                if n_s:
                    a.rate_n[rate] = int(n_s)
            except ValueError:
                ap.error(f"--rates: {item!r} is not RATE or RATE:N")
            if rate <= 0 or a.rate_n.get(rate, 1) <= 0:
                ap.error(f"--rates: {item!r}: rates and N must be > 0")
            a.rates.append(rate)
        a.arms = [x for x in a.arms.split(",") if x]
        bad = set(a.arms) - set(ARMS)
        if bad:
            ap.error(f"--arms: unknown {sorted(bad)}; choose from {', '.join(ARMS)}")
        if "elastic-trimkv" in a.arms and not a.retention_gates:
            ap.error("--arms elastic-trimkv needs --retention-gates")
        if a.retention_gates and not Path(a.retention_gates).is_file():
            ap.error(f"--retention-gates: no such file: {a.retention_gates}")
    if a.cmd == "tf":
        a.tf_budgets = [int(x) for x in a.tf_budgets.split(",") if x]
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    with sigterm_exits():  # a kill stops the servers
        if a.cmd == "report":
            summary = report(Path(a.out), a.boot_iters)
        elif a.cmd == "tf":
            summary = run_tf(a)
        else:
            summary = run(a)
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
