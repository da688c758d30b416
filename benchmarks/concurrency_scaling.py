"""Concurrency scaling: do the slots eviction frees become more concurrent requests?

For each arm the script starts `python -m sglang.launch_server` itself, runs SGLang's own
benchmark client (`python -m sglang.benchmark.serving --dataset-name random-ids`, ignore_eos,
so every request decodes exactly --output-len tokens) at each --concurrency, and reads the
server's decode log (`--decode-log-interval 1`) and /metrics. Arms:

  full@N      stock SGLang, pool of N = --max-total-tokens slots
  <policy>@N  VaSE with that policy, same pool, --kv-evict-budget / --kv-evict-window
  ceiling     stock SGLang with a pool big enough for every request at once

Each arm runs --repeats client runs (default 3) per concurrency on its server, back to back;
with --order round the arms take turns instead (round r runs every arm's r-th run, a server
started per run), so a machine that drifts over the hours is drift every arm shares, and the
summary adds each round's ratio to the full cache (paired runs).
Recorded per run: peak and mean (over decode steps) running requests, output tokens/s, TTFT
and inter-token latency percentiles, peak KV usage (slots), retracted requests (the log's
`#retracted_reqs`, checked against `sglang:num_retracted_requests_total`), the prompt lengths
the server saw (the client's random-ids prompts are text the server tokenizes again, longer than
--input-len; read from the client's per-request output and checked against the server's prompt
histogram), the bound N / (P + T + R) with that P (with --page-size ps > 1, in whole pages:
N / (P rounded down to pages, which the radix tree holds, + T + R rounded up to pages, the
private cycle's top, prompt tail included)), and the eviction time share (the server's
`vase:eviction_seconds` / the run's wall time). Reported: median and range over the runs; a
ratio between arms is bold only where their ranges do not overlap, a target (running / bound
>= 0.95, eviction time <= 3 %) only where every run meets it; where the clients send fewer
requests at once than the bound admits, running is held to the client count instead
(running / clients), since memory is then not the limit. A figure that cannot be measured
(no decode line, no eviction step in /metrics, counts that disagree) stops the benchmark.
Writes JSON, a Markdown table and a PNG.

KV dtypes (--kv-dtypes auto fp8_e4m3): the arms of --kv-dtype-arms run again with
--kv-cache-dtype fp8_e4m3, named "... fp8_e4m3", at the same pool *bytes*: the pool in tokens is
N times the bytes per element of the served K/V (--dtype) over those of the cached dtype (fp32 to
fp8: 4 N; bf16 to fp8 on a GPU: 2 N); the summary compares them with the default-dtype arms.

Every run's record is appended to runs.jsonl in --out as soon as it completes; a later call with
the same settings reuses those records and only runs what is missing (--fresh discards them), so
a run cut short loses at most the run in progress. Records made on another processor are not
reused: on a CPU the step time follows the processor's batch curve (batch_step_profile.py).
The server runs on OMP_NUM_THREADS threads (unset: one), the client beside it.

    python benchmarks/concurrency_scaling.py            # tiny local model, CPU: ~10 minutes
    python benchmarks/concurrency_scaling.py --model-path DIR --concurrency 8 16 32 ...
    python benchmarks/concurrency_scaling.py --arms vase --page-size 1 16   # pages vs tokens
    python benchmarks/concurrency_scaling.py --kv-dtypes auto fp8_e4m3      # 8-bit KV, same bytes
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import paired_runs  # noqa: E402
from benchmarks._server import BenchServer, on_cuda  # noqa: E402

class MissingMeasurement(RuntimeError):
    """A figure the benchmark must report but could not measure: it stops instead of printing
    a default (0 running requests, 0 % eviction time) that would read as a result."""


# SGLang 0.5.23's scheduler logs, per decode step with --decode-log-interval 1
# (SchedulerMetricsReporter.report_decode_stats):
#   "Decode batch[ [iter]], #running-req: R, #token: T, token usage: U, ..."
DECODE_LINE = re.compile(r"Decode batch(?: \[\d+\])?, #running-req: (\d+), #token: (\d+),")
# and per retraction (Scheduler.update_running_batch), one line for a whole group of requests:
#   "KV cache pool is full. Retract requests. #retracted_reqs: K, #new_tokens_gained: G, ..."
RETRACT_LINE = re.compile(r"(?:Retract requests\.|Testing retraction\.) #retracted_reqs: (\d+)")
RETRACT_MENTION = re.compile(r"Retract requests\.|Testing retraction\.")

RETRACTED_METRIC = "sglang:num_retracted_requests_total"
PROMPT_SUM, PROMPT_COUNT = "sglang:prompt_tokens_histogram_sum", "sglang:prompt_tokens_histogram_count"
EVICT_SUM, EVICT_COUNT = "vase:eviction_seconds_sum", "vase:eviction_seconds_count"
METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? (\S+)(?: \d+)?$")


# the same line's "gen throughput (token/s): X": with --decode-log-interval 1, the tokens of one
# step over the time since the last logged step, so running / X is that step's time
GEN_THROUGHPUT = re.compile(r"gen throughput \(token/s\): ([0-9.]+)")
DP_TAG = re.compile(r" DP(\d+)")  # data-parallel workers prefix their lines "[time DPk]"


def decode_stats(log_text: str) -> dict:
    """Running requests and KV tokens over the decode steps logged in `log_text`. Under data
    parallel each worker logs its own steps: the totals after each line add every worker's
    latest figures."""
    latest: dict[str, tuple[int, int]] = {}
    totals = []
    step_s: dict[int, list[float]] = {}  # a worker's step time by its running requests
    for line in log_text.splitlines():
        m = DECODE_LINE.search(line)
        if not m:
            continue
        tag = DP_TAG.search(line[: m.start()])
        latest[tag.group(1) if tag else ""] = (int(m.group(1)), int(m.group(2)))
        gen = GEN_THROUGHPUT.search(line, m.end())
        if gen and float(gen.group(1)) > 0:
            step_s.setdefault(int(m.group(1)), []).append(int(m.group(1)) / float(gen.group(1)))
        totals.append((sum(r for r, _ in latest.values()), sum(t for _, t in latest.values())))
    if not totals:
        raise MissingMeasurement("no 'Decode batch' line in the server log: cannot tell how "
                                 "many requests ran (is --decode-log-interval 1 set?)")
    running = [r for r, _ in totals]
    return {
        "peak_running": max(running),
        "mean_running": sum(running) / len(running),  # mean over decode steps
        "peak_kv_tokens": max(t for _, t in totals),
        "decode_steps": len(totals),
        "workers": len(latest),
        # median decode step (ms) by batch size: what the machine charged for a batch of k
        # during this run (a step that also waited for a prefill counts as longer; the median
        # keeps the common case)
        "step_ms_by_running": {str(k): round(1000 * statistics.median(v), 1)
                               for k, v in sorted(step_s.items())},
    }


def retracted_requests_logged(log_text: str) -> int:
    """Requests retracted (one log line can retract several, a request can be retracted more
    than once: each time counts)."""
    counts = [int(k) for k in RETRACT_LINE.findall(log_text)]
    if len(counts) != len(RETRACT_MENTION.findall(log_text)):
        raise MissingMeasurement("a retraction line without '#retracted_reqs: K' in the server "
                                 "log: SGLang's log format changed")
    return sum(counts)


def metric_sums(metrics_text: str) -> dict[str, float]:
    """Prometheus text -> value per metric name, summed over label sets."""
    values: dict[str, float] = {}
    for line in metrics_text.splitlines():
        m = METRIC_LINE.match(line)
        if m:
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(2))
    return values


def eviction_seconds(before: dict, after: dict, evicting: bool) -> float | None:
    """Seconds the server spent in eviction steps between two /metrics scrapes. None for an
    arm without eviction; an evicting arm that exported no eviction step is an error."""
    steps = after.get(EVICT_COUNT, 0.0) - before.get(EVICT_COUNT, 0.0)
    if not evicting:
        if steps:
            raise MissingMeasurement(f"an arm without eviction ran {steps:.0f} eviction steps")
        return None
    if EVICT_SUM not in after or steps <= 0:
        raise MissingMeasurement(f"no eviction step in /metrics ({EVICT_COUNT} delta {steps:.0f}): "
                                 "the arm did not evict, or --enable-metrics is off")
    return after[EVICT_SUM] - before.get(EVICT_SUM, 0.0)


def retracted_requests(log_text: str, before: dict, after: dict) -> int:
    """Retracted requests from the log, checked against SGLang's counter where it is exported
    (prometheus_client only exports a labelled counter once it was incremented)."""
    logged = retracted_requests_logged(log_text)
    if RETRACTED_METRIC in after:
        counted = after[RETRACTED_METRIC] - before.get(RETRACTED_METRIC, 0.0)
        if counted != logged:
            raise MissingMeasurement(f"{RETRACTED_METRIC} counts {counted:.0f} retracted "
                                     f"requests, the log {logged}")
    elif logged:
        raise MissingMeasurement(f"the log retracted {logged} requests but {RETRACTED_METRIC} "
                                 "is not exported")
    return logged


def server_prompt_lengths(client_result: dict, before: dict, after: dict) -> list[int]:
    """Prompt tokens of each request as the server counted them. The client sends random-ids
    prompts as text, which the server tokenizes again (longer than --input-len); its output
    JSON (--output-details) holds the server's meta_info.prompt_tokens per request, checked
    here against the server's own prompt-length histogram."""
    lens = client_result.get("input_lens")
    if not lens or len(lens) != client_result.get("completed"):
        raise MissingMeasurement("the client's output has no input_lens for every completed "
                                 "request (--output-details)")
    count = after.get(PROMPT_COUNT, 0.0) - before.get(PROMPT_COUNT, 0.0)
    total = after.get(PROMPT_SUM, 0.0) - before.get(PROMPT_SUM, 0.0)
    if count != len(lens) or total != sum(lens):
        raise MissingMeasurement(f"the server's prompt histogram ({count:.0f} requests, "
                                 f"{total:.0f} tokens) disagrees with the client's input_lens "
                                 f"({len(lens)} requests, {sum(lens)} tokens)")
    return [int(x) for x in lens]


def concurrency_bound(pool: int, prompt_lens: list[int], budget: int, window: int,
                      page_size: int = 1, ring: int = 0) -> float:
    """N / (P + T + R + ring) with P the mean prompt length the server saw: how many requests
    fit at once when each holds its prompt plus a full budget and window, and, where its
    policy scores with queries, its query ring's `ring` pool slots (vase_sglang/pool_ring.py;
    whole pages). With pages, a request holds its prompt's whole pages (tree-owned) and at
    most T + R private tokens, the prompt's partial page included, in whole pages."""
    private = -(-(budget + window) // page_size) * page_size
    held = [p // page_size * page_size + private + ring for p in prompt_lens]
    return pool / (sum(held) / len(held))


RING_LINE = re.compile(r"VaSE eviction on: .*?query ring: (\d+) pool slots per request")


def ring_slots(log: str) -> int:
    """The pool slots a request's query ring takes on this server (its startup log), 0 for
    stock SGLang or a policy that reads no queries."""
    m = RING_LINE.search(log)
    return int(m.group(1)) if m else 0


def run_client(server: BenchServer, args, concurrency: int, out_file: Path, tokenizer: str) -> dict:
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang",
           "--base-url", server.url, "--tokenizer", tokenizer, "--model", tokenizer,
           "--dataset-name", "random-ids", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--random-range-ratio", "1.0",
           "--num-prompts", str(args.num_prompts), "--max-concurrency", str(concurrency),
           "--request-rate", "inf", "--seed", str(args.seed), "--output-file", str(out_file),
           # per-request prompt lengths; no warmup request, so the server's counters see
           # exactly the measured requests
           "--output-details", "--warmup-requests", "0"]
    if args.quiet_client:
        cmd.append("--disable-tqdm")
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, env=env, stdout=None if not args.quiet_client else subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0 or not out_file.exists():
        raise RuntimeError(f"benchmark client failed ({proc.returncode}): {proc.stdout or ''}")
    result = json.loads(out_file.read_text().strip().splitlines()[-1])
    if result.get("completed") != args.num_prompts:
        raise MissingMeasurement(f"{result.get('completed')} of {args.num_prompts} requests "
                                 f"completed: {[e for e in result.get('errors', []) if e][:3]}")
    return result


CLIENT_KEYS = ["duration", "completed", "total_output_tokens", "output_throughput",
               "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "mean_tpot_ms",
               "max_concurrent_requests"]


def measure_run(server: BenchServer, args, c: int, evicting: bool, page_size: int = 1,
                pool: int | None = None, budget: int | None = None,
                window: int | None = None) -> dict:
    """One client run against a running server: the client's figures plus what the server
    logged and exported during it."""
    server.flush_cache()  # same prompts every run: no prefix hits from the last one
    start_log = len(server.output())
    before = metric_sums(server.get_text("/metrics"))
    with tempfile.TemporaryDirectory() as tmp:
        result = run_client(server, args, c, Path(tmp) / "out.jsonl", args.model_path)
    text = server.output()[start_log:]
    after = metric_sums(server.get_text("/metrics"))
    prompts = server_prompt_lengths(result, before, after)
    evict_s = eviction_seconds(before, after, evicting)
    return {
        **{k: result.get(k) for k in CLIENT_KEYS}, **decode_stats(text),
        "prompt_tokens_mean": sum(prompts) / len(prompts),
        "prompt_tokens_min": min(prompts), "prompt_tokens_max": max(prompts),
        "bound": concurrency_bound(pool or args.max_total_tokens, prompts,
                                   budget or args.budget, window or args.window, page_size,
                                   ring_slots(server.output())),
        "retracted_requests": retracted_requests(text, before, after),
        "eviction_seconds": evict_s,
        "eviction_time_share": None if evict_s is None else evict_s / result["duration"],
    }


def run_arm(name: str, server_args: list[str], pool: int, args, out_dir: Path,
            page_size: int = 1, done: dict | None = None,
            record=None, repeats: list[int] | None = None) -> list[dict]:
    """--repeats client runs per concurrency on one server of this arm. `done` holds the
    records of earlier calls by (arm, concurrency, repeat): those runs are not repeated (and
    the server is not started when none is missing); `record(row)` is called after each run.
    `repeats`: which repeat indices to run (default all of --repeats; one with --order round)."""
    # A trimkv arm's record holds the hash of the gates it served: records made with other
    # gates are run again (--gates is otherwise a selection option, see SELECTION).
    from vase_sglang.gates import gates_sha256

    gates = (gates_sha256(server_args[server_args.index("--kv-evict-retention-gates") + 1])
             if "--kv-evict-retention-gates" in server_args else None)
    done = {k: row for k, row in (done or {}).items() if row.get("gates_sha256") == gates}
    reps = range(args.repeats) if repeats is None else repeats
    wanted = [(c, rep) for c in args.concurrency for rep in reps]
    if all((name, c, rep) in done for c, rep in wanted):
        print(f"  {name}: all {len(wanted)} runs reused from {RECORDS}", flush=True)
        return [done[name, c, rep] for c, rep in wanted]
    log = out_dir / f"server-{name.replace('@', '_at_').replace(' ', '_')}.log"
    if page_size != 1:
        server_args = [*server_args, "--page-size", str(page_size)]
    if args.dtype != "auto":
        server_args = [*server_args, "--dtype", args.dtype]
    if repeats is None or min(repeats) == 0:
        log.unlink(missing_ok=True)  # a later round's server appends to the first one's log
    threads = int(os.environ.get("OMP_NUM_THREADS") or 1)  # the server's, as BenchServer sets it
    server = BenchServer(args.model_path,
                         ["--decode-log-interval", "1", "--enable-metrics", *server_args],
                         log_path=log, max_total_tokens=pool, max_running=None,
                         teacher_forcing=False,
                         threads=threads)
    evicting = "--kv-evict-policy" in server_args
    # --max-total-tokens is per data-parallel worker; rows report the pool of all of them
    workers = int(server_args[server_args.index("--dp-size") + 1]) if "--dp-size" in server_args else 1
    rows = []
    try:
        for c, rep in wanted:
            if (name, c, rep) in done:
                rows.append(done[name, c, rep])
                continue
            # when, and how busy the machine was: a table must say its machine state
            started = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "load_1min_at_start": round(os.getloadavg()[0], 2),
                       "order": args.order, "machine": machine_facts(threads)}
            row = {"arm": name, "pool": pool * workers, "page_size": page_size,
                   "concurrency": c, "repeat": rep, "gates_sha256": gates, **started,
                   **measure_run(server, args, c, evicting, page_size, pool * workers,
                                 flag_value(server_args, "--kv-evict-budget", args.budget),
                                 flag_value(server_args, "--kv-evict-window", args.window))}
            rows.append(row)
            if record is not None:
                record(row)
            share = row["eviction_time_share"]
            print(f"  {name} c={c} run {rep + 1}/{args.repeats}: "
                  f"{row['output_throughput']:.0f} tok/s, running peak {row['peak_running']} "
                  f"mean {row['mean_running']:.1f}, bound {row['bound']:.1f}, eviction "
                  + ("-" if share is None else f"{100 * share:.2f} %"), flush=True)
    finally:
        server.stop()
    return rows


def machine_facts(threads: int) -> dict:
    """What decides a decode step's time on a CPU besides the batch: the processor the virtual
    machine landed on (its model and vector extensions pick the BLAS kernels), the server's
    threads, and the torch build."""
    import platform

    import torch

    model, flags = platform.processor(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = [f for f in value.split() if f.startswith(("avx", "amx", "fma"))]
                break
    except OSError:
        pass
    return {"cpu": model, "cpu_count": os.cpu_count(), "vector_flags": sorted(flags),
            "server_threads": threads, "torch": torch.__version__}


# ----------------------------------------------------------------------------- statistics

STAT_KEYS = ["output_throughput", "peak_running", "mean_running", "bound", "prompt_tokens_mean",
             "median_ttft_ms", "median_itl_ms", "p99_itl_ms", "peak_kv_tokens",
             "retracted_requests", "eviction_time_share"]


def spread(values: list[float]) -> dict:
    """Median and range of repeated runs."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def aggregate(rows: list[dict]) -> list[dict]:
    """One entry per (arm, concurrency): median and range of every figure over the repeats."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["arm"], r["concurrency"]), []).append(r)
    out = []
    for (arm, c), runs in groups.items():
        entry = {"arm": arm, "pool": runs[0]["pool"], "concurrency": c, "runs": len(runs)}
        for k in STAT_KEYS:
            vals = [r[k] for r in runs]
            entry[k] = None if any(v is None for v in vals) else spread(vals)
        out.append(entry)
    return out


def ratio(a: list[float], b: list[float]) -> dict:
    """a / b from repeated runs of both: ratio of the medians, the range it can take within the
    runs' ranges, and whether the difference is clear: the two ranges do not overlap."""
    return {"median": statistics.median(a) / statistics.median(b),
            "min": min(a) / max(b), "max": max(a) / min(b),
            "separated": min(a) > max(b) or max(a) < min(b)}


def against(values: list[float], target: float, higher_is_better: bool) -> dict:
    """A figure against a fixed target: met only if every run meets it."""
    s = spread(values)
    s["meets_target"] = s["min"] >= target if higher_is_better else s["max"] <= target
    s["target"] = target
    return s


# Bytes per cached K/V element: the pool at another KV dtype holds the same bytes as N slots of
# the served dtype (equal_bytes_pool).
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp8_e4m3": 1,
                 "fp8_e5m2": 1}
KV_DTYPES = ("auto", "bfloat16", "fp8_e4m3", "fp8_e5m2")


def served_element_bytes(model_path: str, dtype: str) -> int:
    """Bytes per K/V element of the model served with --dtype (auto: its config's dtype)."""
    if dtype == "auto":
        config = json.loads((Path(model_path) / "config.json").read_text())
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    if dtype not in ELEMENT_BYTES:
        raise ValueError(f"cannot size a pool for dtype {dtype!r}")
    return ELEMENT_BYTES[dtype]


def equal_bytes_pool(n: int, served_bytes: int, kv_dtype: str) -> int:
    """Slots of --kv-cache-dtype kv_dtype in the bytes of n slots of the served dtype."""
    if kv_dtype == "auto":
        return n
    return n * served_bytes // ELEMENT_BYTES[kv_dtype]


def kv_suffix(kv_dtype: str) -> str:
    return "" if kv_dtype == "auto" else f" {kv_dtype}"


# Every completed run is appended here (one JSON object per line: the run's settings and row).
RECORDS = "runs.jsonl"
# Options that choose which runs to make, not what a run measures: records made under other
# values of these are still valid. --gates only reaches the trimkv arms, whose records carry
# the gates' hash (run_arm reuses them only with the same gates).
SELECTION = ("out", "quiet_client", "fresh", "repeats", "order", "concurrency", "arms", "policies",
             "page_size", "kv_dtypes", "kv_dtype_arms", "gates")


def run_settings(args) -> dict:
    """The settings a run's record must match to be reused (JSON-normalised)."""
    return json.loads(json.dumps({k: v for k, v in vars(args).items() if k not in SELECTION},
                                 default=str, sort_keys=True))


def load_records(path: Path, settings: dict, cpu: str | None = None) -> tuple[dict, int]:
    """Earlier runs made with these settings, by (arm, concurrency, repeat), and the number of
    records left aside (other settings, or a line cut short by a crash). With `cpu` (this
    machine's processor) runs recorded on another processor are left aside too: a CPU's step
    time follows its batch curve, so they must not be resumed into, or paired with, this
    machine's runs (records made before the machine facts were kept cannot tell, and count)."""
    done, other = {}, 0
    if not path.exists():
        return done, other
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
            row = rec["row"]
            key = (row["arm"], row["concurrency"], row["repeat"])
        except (json.JSONDecodeError, KeyError, TypeError):
            other += 1
            continue
        # options counted as selection since the record was written do not void it
        recorded = {k: v for k, v in (rec.get("settings") or {}).items() if k not in SELECTION}
        recorded_cpu = (row.get("machine") or {}).get("cpu")
        if recorded == settings and (cpu is None or recorded_cpu in (None, cpu)):
            done[key] = row
        else:
            other += 1
    return done, other


def page_suffix(page_size: int) -> str:
    """Arm names at page size 1 are as before; other page sizes are named apart."""
    return "" if page_size == 1 else f" p{page_size}"


def summarize(rows: list[dict], policies: list[str], page_sizes=(1,), kv_dtypes=("auto",)) -> dict:
    """The issue's criteria, per policy and page size, at the highest concurrency run; arms at
    another KV dtype also against the default dtype's arms (same pool bytes)."""
    c = max(r["concurrency"] for r in rows)
    runs: dict[str, list[dict]] = {}
    for r in rows:
        if r["concurrency"] == c:
            runs.setdefault(r["arm"], []).append(r)

    def col(arm, key):
        return [r[key] for r in runs[arm]]

    out = {"concurrency": c}
    for p, page, kv in ((p, page, kv) for page in page_sizes for kv in kv_dtypes
                        for p in policies):
        sfx = page_suffix(page) + kv_suffix(kv)
        arm = f"{p}@N{sfx}"
        if arm not in runs:
            continue
        v = runs[arm]
        # Against what limits the arm: the memory bound, or the clients where they send
        # fewer requests at once than the bound admits (then memory is not what is tested).
        limits = [min(r["bound"], r["concurrency"]) for r in v]
        limit = "bound" if all(x == r["bound"] for x, r in zip(limits, v)) else "clients"
        s = {
            f"peak_running_over_{limit}": against(
                [r["peak_running"] / x for r, x in zip(v, limits)], 0.95, True),
            f"mean_running_over_{limit}": against(
                [r["mean_running"] / x for r, x in zip(v, limits)], 0.95, True),
            "eviction_time_share": against(col(arm, "eviction_time_share"), 0.03, False),
            "retracted_requests": spread(col(arm, "retracted_requests")),
        }
        for ref in (f"full@N{sfx}", f"ceiling{sfx}"):
            if ref in runs:
                base = ref.split('@')[0].split(' ')[0]
                s[f"throughput_over_{base}"] = ratio(
                    col(arm, "output_throughput"), col(ref, "output_throughput"))
                s[f"mean_running_over_{base}"] = ratio(
                    col(arm, "mean_running"), col(ref, "mean_running"))
                # round by round: only runs made with --order round are paired
                paired = paired_runs.paired_ratio(v, runs[ref], lambda r: r["output_throughput"],
                                                  paired_runs.both_in_rounds)
                if paired is not None:
                    s[f"throughput_over_{base}_paired"] = paired
        out[p + sfx] = s
    for page in page_sizes:
        base = page_suffix(page)
        for kv in kv_dtypes:
            if kv == "auto":
                continue
            for p in ("full", *policies):
                arm = f"{p}@N{base}{kv_suffix(kv)}"
                if arm not in runs:
                    continue
                vs = {}
                for ref in dict.fromkeys((f"full@N{base}", f"{p}@N{base}")):
                    if ref in runs:
                        vs[ref] = {"throughput": ratio(col(arm, "output_throughput"),
                                                       col(ref, "output_throughput")),
                                   "mean_running": ratio(col(arm, "mean_running"),
                                                         col(ref, "mean_running"))}
                out.setdefault(p + base + kv_suffix(kv), {})["vs_default_kv"] = vs
    return out


def plot(agg: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if len({e["concurrency"] for e in agg}) == 1:  # one concurrency: one bar per arm
        names = list(dict.fromkeys(e["arm"] for e in agg))
        for ax, key in ((ax1, "output_throughput"), (ax2, "mean_running")):
            med = [e[key]["median"] for e in agg]
            err = [[m - e[key]["min"] for m, e in zip(med, agg)],
                   [e[key]["max"] - m for m, e in zip(med, agg)]]
            ax.bar(range(len(names)), med, yerr=err, capsize=3,
                   color=[f"C{i}" for i in range(len(names))])
            ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
        c = agg[0]["concurrency"]
        ax1.set(ylabel="output tokens/s", title=f"throughput at {c} clients (median, range)")
        ax2.set(ylabel="mean running requests",
                title=f"concurrency at {c} clients (median, range)")
        for ax in (ax1, ax2):
            ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        return
    for arm in dict.fromkeys(e["arm"] for e in agg):
        sel = [e for e in agg if e["arm"] == arm]
        xs = [e["concurrency"] for e in sel]
        for ax, key in ((ax1, "output_throughput"), (ax2, "mean_running")):
            med = [e[key]["median"] for e in sel]
            err = [[m - e[key]["min"] for m, e in zip(med, sel)],
                   [e[key]["max"] - m for m, e in zip(med, sel)]]
            ax.errorbar(xs, med, yerr=err, fmt="o-", capsize=3, label=arm)
    ax1.set(xlabel="client concurrency", ylabel="output tokens/s", title="throughput (median, range)")
    ax2.set(xlabel="client concurrency", ylabel="mean running requests",
            title="concurrency (median, range)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _fmt(s: dict | None, digits: int = 1, scale: float = 1.0) -> str:
    """median [min-max] of repeated runs."""
    if s is None:
        return "–"
    f = f"{{:.{digits}f}}"
    if s["n"] == 1:
        return f.format(scale * s["median"])
    return (f.format(scale * s["median"]) + " [" + f.format(scale * s["min"]) + "–"
            + f.format(scale * s["max"]) + "]")


def markdown_table(agg: list[dict]) -> str:
    """Per arm and concurrency: median [min–max] over the repeats."""
    lines = ["| arm | pool | conc | runs | output tok/s | peak running | mean running | "
             "bound N/(P+T+R) | P (server) | TTFT p50 ms | ITL p50 / p99 ms | retracted | "
             "eviction time |", "|" + "---|" * 13]
    for e in agg:
        lines.append(
            f"| {e['arm']} | {e['pool']} | {e['concurrency']} | {e['runs']} | "
            f"{_fmt(e['output_throughput'], 0)} | {_fmt(e['peak_running'], 0)} | "
            f"{_fmt(e['mean_running'])} | {_fmt(e['bound'])} | {_fmt(e['prompt_tokens_mean'])} | "
            f"{_fmt(e['median_ttft_ms'], 0)} | {_fmt(e['median_itl_ms'])} / "
            f"{_fmt(e['p99_itl_ms'])} | {_fmt(e['retracted_requests'], 0)} | "
            f"{_fmt(e['eviction_time_share'], 2, 100)}{'' if e['eviction_time_share'] is None else ' %'} |")
    return "\n".join(lines)


def markdown_summary(summary: dict) -> str:
    """The criteria in words. A ratio is bold only where the runs' ranges do not overlap, a
    target figure only where every run meets it."""
    def ratio_text(r):
        text = f"{r['median']:.2f} × [{r['min']:.2f}–{r['max']:.2f}]"
        return f"**{text}**" if r["separated"] else text + " (ranges overlap)"

    def target_text(t, pct=False):
        k = 100 if pct else 1
        unit = " %" if pct else " ×"
        text = f"{k * t['median']:.2f}{unit} [{k * t['min']:.2f}–{k * t['max']:.2f}]"
        return f"**{text}**" if t["meets_target"] else text + " (not in every run)"

    lines = [f"at {summary['concurrency']} concurrent clients:"]
    for p, s in summary.items():
        if not isinstance(s, dict):
            continue
        limit = next((k for k in ("bound", "clients") if f"peak_running_over_{k}" in s), None)
        if limit is None:  # a stock arm at another KV dtype
            lines.append(f"- {p}:")
        else:
            lines.append(
                f"- {p}: peak running / {limit} {target_text(s[f'peak_running_over_{limit}'])}, "
                f"mean running / {limit} {target_text(s[f'mean_running_over_{limit}'])} "
                f"(target ≥ 0.95), eviction time {target_text(s['eviction_time_share'], True)} "
                f"(target ≤ 3 %), retracted requests {s['retracted_requests']['max']:.0f} at most")
        for ref in ("full", "ceiling"):
            if f"throughput_over_{ref}" in s:
                lines.append(f"  - vs {ref}: output tok/s {ratio_text(s[f'throughput_over_{ref}'])}, "
                             f"mean running {ratio_text(s[f'mean_running_over_{ref}'])}")
            paired = s.get(f"throughput_over_{ref}_paired")
            if paired:
                rounds = ", ".join(f"{x:.2f}" for x in paired["per_pair"])
                lines.append(f"  - vs {ref}, round by round (paired runs): output tok/s "
                             f"{paired['median']:.2f} × [{paired['min']:.2f}–{paired['max']:.2f}] "
                             f"({rounds})")
        for ref, r in s.get("vs_default_kv", {}).items():
            lines.append(f"  - vs {ref} (same pool bytes): output tok/s "
                         f"{ratio_text(r['throughput'])}, mean running "
                         f"{ratio_text(r['mean_running'])}")
    return "\n".join(lines)


def policy_spec(spec: str, args) -> tuple[str, int, int, list[str]]:
    """A --policies entry: POLICY or POLICY:FLAG=VALUE:... with FLAG a --kv-evict-* suffix
    (budget, window, budget-scope, ...), e.g. trimkv:budget=64:budget-scope=global. Returns
    the policy, its budget and window (default --budget / --window) and the other flags."""
    policy, *options = spec.split(":")
    budget, window, more = args.budget, args.window, []
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"--policies {spec!r}: expected POLICY:FLAG=VALUE, got {option!r}")
        if key == "budget":
            budget = int(value)
        elif key == "window":
            window = int(value)
        else:
            more += [f"--kv-evict-{key}", value]
    return policy, budget, window, more


def flag_value(server_args: list[str], flag: str, default: int) -> int:
    return int(server_args[server_args.index(flag) + 1]) if flag in server_args else default


def build_arms(args, served_bytes: int) -> list[tuple[str, list[str], int, int]]:
    """(name, server flags, pool per worker, page size) of every arm, in run order."""
    n = args.max_total_tokens
    # the server's prompts are longer than --input-len (re-tokenized text): 2x slack
    ceiling_pool = int(args.num_prompts * (2 * args.input_len + args.output_len) * 1.05) + 1024
    # only trimkv (a policy scoring from retention gates) reads the gates: the other arms run
    # (and are recorded) without them
    gates = ["--kv-evict-retention-gates", str(args.gates)] if args.gates else []
    extra = getattr(args, "kv_args", [])  # --kv-args, for the eviction arms

    def gates_for(policy):
        from vase_sglang.policies import needs_gates

        return gates if needs_gates(policy) else []
    def evict_flags(spec):
        policy, budget, window, more = policy_spec(spec, args)
        return ["--kv-evict-policy", policy, "--kv-evict-budget", str(budget),
                "--kv-evict-window", str(window), *more, *extra, *gates_for(policy)]
    arms = []
    for page in args.page_size:
        for kv in args.kv_dtypes:
            sfx = page_suffix(page) + kv_suffix(kv)
            selected = args.arms if kv == "auto" else [
                a for a in args.arms if a in args.kv_dtype_arms]
            kv_args = [] if kv == "auto" else ["--kv-cache-dtype", kv]
            pool = equal_bytes_pool(n, served_bytes, kv)
            if "full" in selected:
                arms.append((f"full@N{sfx}", kv_args, pool, page))
            if "vase" in selected:
                for p in args.policies:
                    arms.append((f"{p}@N{sfx}", [*kv_args, *evict_flags(p)], pool, page))
            if "vase-dp2" in selected:
                for p in args.policies:
                    # the pool flag is per worker: half each
                    arms.append((f"{p}@N-dp2{sfx}", [*kv_args, "--dp-size", "2",
                                                      *evict_flags(p)], pool // 2, page))
            if "ceiling" in selected:
                arms.append((f"ceiling{sfx}", kv_args, ceiling_pool, page))
    return arms


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked, with the defaults resolved (dtype, model path): also how
    benchmarks/length_scaling.py finds the records of its per-length runs."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="model directory (default: the tiny local test model)")
    ap.add_argument("--max-total-tokens", type=int, default=4096, help="N, the pool of the @N arms")
    ap.add_argument("--input-len", type=int, default=64,
                    help="the client's --random-input-len (the server sees longer prompts: the "
                         "bound uses the lengths it reports)")
    ap.add_argument("--output-len", type=int, default=1024, help="L, output tokens (ignore_eos)")
    ap.add_argument("--num-prompts", type=int, default=24, help="M, requests per run")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[24])
    ap.add_argument("--repeats", type=int, default=3,
                    help="client runs per arm and concurrency (median and range reported)")
    ap.add_argument("--order", choices=["arm", "round"], default="arm",
                    help="arm: each arm's runs back to back on one server; round: the arms take "
                    "turns, one run each per round (a server per run), so slow drift of the "
                    "machine falls on every arm alike and runs pair up by round")
    ap.add_argument("--policies", nargs="+", default=["vase-attnv"],
                    help="eviction arms: POLICY, or POLICY:FLAG=VALUE:... with --kv-evict-* "
                    "suffixes, e.g. trimkv:budget=128 trimkv:budget=64:budget-scope=global "
                    "(arms at equal quality, different settings)")
    ap.add_argument("--budget", type=int, default=192)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--arms", nargs="+", default=["full", "vase", "ceiling"],
                    choices=["full", "vase", "vase-dp2", "ceiling"],
                    help="vase-dp2: the policy on two data-parallel workers (--dp-size 2), each "
                    "with half the pool, so the total is N as in the other @N arms")
    ap.add_argument("--page-size", type=int, nargs="+", default=[1],
                    help="KV page sizes: every arm runs at each (arms at page size ps > 1 are "
                    "named '... pPS'; their bound counts whole pages)")
    ap.add_argument("--kv-dtypes", nargs="+", default=["auto"], choices=KV_DTYPES,
                    help="KV cache dtypes (--kv-cache-dtype): the arms of --kv-dtype-arms run at "
                    "each, at the same pool bytes as N slots of the served dtype (default: auto)")
    ap.add_argument("--kv-dtype-arms", nargs="+", default=["full", "vase"],
                    choices=["full", "vase", "vase-dp2"],
                    help="arms that run at the other --kv-dtypes (default: full vase)")
    ap.add_argument("--dtype", default=None,
                    choices=["auto", "float32", "bfloat16", "float16"],
                    help="the model's --dtype (default: float32 on CPU, which has no native "
                    "bf16 here; auto on CUDA)")
    ap.add_argument("--gates", help="retention gates file for the trimkv arms "
                    "(--kv-evict-retention-gates; needed by --policies trimkv: "
                    "python -m vase_sglang.retention train); the other arms' records stay "
                    "valid when it is added or changed")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kv-args", action="append", default=[], metavar="FLAG=VALUE",
                    help="one more --kv-evict-* flag for the eviction arms, repeatable, e.g. "
                    "--kv-args=--kv-evict-ring=pool (servers start with a scrubbed environment: "
                    "VASE_KV_EVICT_* variables do not reach them)")
    ap.add_argument("--out", default=str(REPO / "results" / "concurrency"))
    ap.add_argument("--quiet-client", action="store_true", help="hide the client's progress bar")
    ap.add_argument("--fresh", action="store_true",
                    help=f"discard the records of earlier runs in --out ({RECORDS}) instead of "
                    "reusing those made with the same settings")
    args = ap.parse_args(argv)
    from vase_sglang.policies import needs_gates

    try:
        specs = [policy_spec(p, args) for p in args.policies]
    except ValueError as err:
        ap.error(str(err))
    gated = [p for p, *_ in specs if needs_gates(p)]
    if gated and not args.gates:
        ap.error(f"--policies {gated[0]} needs --gates FILE (retention gates trained for the "
                 "model)")
    if args.dtype is None:
        args.dtype = "auto" if on_cuda() else "float32"
    if args.model_path is None:
        from vase_sglang.serving.tiny_model import build_tiny_qwen3

        args.model_path = str(build_tiny_qwen3())
    for name in ("max_total_tokens", "input_len", "output_len", "num_prompts", "budget", "window",
                 "repeats"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if any(c <= 0 for c in args.concurrency):
        ap.error("--concurrency values must be positive")
    if any(p <= 0 for p in args.page_size):
        ap.error("--page-size values must be positive")
    evicting_arms = {"vase", "vase-dp2"} & set(args.arms)
    if evicting_arms and args.window < max(args.page_size):
        ap.error(f"--window {args.window} must be >= every --page-size (the server refuses a "
                 "window below one page)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    arms = build_arms(args, served_element_bytes(args.model_path, args.dtype))

    records = out_dir / RECORDS
    if args.fresh:
        records.unlink(missing_ok=True)
    settings = run_settings(args)
    cpu = machine_facts(1)["cpu"]
    done, other = load_records(records, settings, cpu)
    if done:
        print(f"reusing {len(done)} runs recorded in {records} with these settings "
              "(--fresh to discard them)", flush=True)
    if other:
        print(f"leaving aside {other} records in {records} made with other settings or on "
              f"another processor than this {cpu!r}", flush=True)

    def record(row):
        with records.open("a") as f:
            f.write(json.dumps({"settings": settings, "row": row}) + "\n")

    from tqdm import tqdm

    rows = []
    started = time.time()
    if args.order == "arm":
        for name, server_args, pool, page in tqdm(arms, desc="arms", unit="arm", file=sys.stdout):
            print(f"\n== {name} (pool {pool}, page size {page})", flush=True)
            rows += run_arm(name, server_args, pool, args, out_dir, page, done, record)
    else:
        turns = [(rep, arm) for rep in range(args.repeats) for arm in arms]
        for rep, (name, server_args, pool, page) in tqdm(turns, desc="runs", unit="run",
                                                          file=sys.stdout):
            print(f"\n== round {rep + 1}/{args.repeats}: {name} (pool {pool}, page size {page})",
                  flush=True)
            rows += run_arm(name, server_args, pool, args, out_dir, page, done, record, [rep])
    agg = aggregate(rows)
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "settings": {k: v for k, v in vars(args).items() if k not in ("quiet_client",)},
        "device": "cuda" if on_cuda() else f"cpu ({os.cpu_count()} cores)",
        "wall_seconds": time.time() - started,
        "rows": rows,
        "aggregate": agg,
        "summary": summarize(rows, args.policies, args.page_size, args.kv_dtypes),
    }
    (out_dir / "concurrency_scaling.json").write_text(json.dumps(result, indent=2))
    plot(agg, out_dir / "concurrency_scaling.png")
    processors = sorted({(r.get("machine") or {}).get("cpu") or "not recorded" for r in rows})
    table = (markdown_table(agg) + "\n\n" + markdown_summary(result["summary"])
             + f"\n\nprocessor: {', '.join(processors)}")
    (out_dir / "concurrency_scaling.md").write_text(table + "\n")
    print()
    print(table)
    print(f"wrote {out_dir / 'concurrency_scaling.json'}, .md and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
