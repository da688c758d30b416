"""Concurrency scaling: do the slots eviction frees become more concurrent requests?

For each arm the script starts `python -m sglang.launch_server` itself, runs SGLang's own
benchmark client (`python -m sglang.benchmark.serving --dataset-name random-ids`, ignore_eos,
so every request decodes exactly --output-len tokens) at each --concurrency, and reads the
server's decode log (`--decode-log-interval 1`) and /metrics. Arms:

  full@N      stock SGLang, pool of N = --max-total-tokens slots
  <policy>@N  VaSE with that policy, same pool, --kv-evict-budget / --kv-evict-window
  ceiling     stock SGLang with a pool big enough for every request at once

Recorded per arm and concurrency: peak and mean running requests, output tokens/s, TTFT and
inter-token latency percentiles, peak KV usage (slots), retractions, and the eviction time share
(the server's eviction step seconds / benchmark wall time). Writes JSON and a PNG; prints a table.

    python benchmarks/concurrency_scaling.py            # tiny local model, CPU: ~10 minutes
    python benchmarks/concurrency_scaling.py --model-path DIR --concurrency 8 16 32 ...
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._server import BenchServer, on_cuda  # noqa: E402

DECODE_LINE = re.compile(r"Decode batch.*?#running-req: (\d+), #token: (\d+)")


def eviction_seconds(metrics_text: str) -> float:
    """Sum of the server's eviction-step histogram (0 when eviction is off)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("vase:eviction_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def decode_stats(log_text: str) -> dict:
    rows = [(int(a), int(b)) for a, b in DECODE_LINE.findall(log_text)]
    if not rows:
        return {"peak_running": 0, "mean_running": 0.0, "peak_kv_tokens": 0, "decode_steps": 0}
    running = [r for r, _ in rows]
    return {
        "peak_running": max(running),
        "mean_running": sum(running) / len(running),  # mean over decode steps
        "peak_kv_tokens": max(t for _, t in rows),
        "decode_steps": len(rows),
    }


def run_client(server: BenchServer, args, concurrency: int, out_file: Path, tokenizer: str) -> dict:
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang",
           "--base-url", server.url, "--tokenizer", tokenizer, "--model", tokenizer,
           "--dataset-name", "random-ids", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--random-range-ratio", "1.0",
           "--num-prompts", str(args.num_prompts), "--max-concurrency", str(concurrency),
           "--request-rate", "inf", "--seed", str(args.seed), "--output-file", str(out_file)]
    if args.quiet_client:
        cmd.append("--disable-tqdm")
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, env=env, stdout=None if not args.quiet_client else subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0 or not out_file.exists():
        raise RuntimeError(f"benchmark client failed ({proc.returncode}): {proc.stdout or ''}")
    return json.loads(out_file.read_text().strip().splitlines()[-1])


CLIENT_KEYS = ["duration", "completed", "total_output_tokens", "output_throughput",
               "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "mean_tpot_ms",
               "max_concurrent_requests"]


def run_arm(name: str, server_args: list[str], pool: int, args, out_dir: Path) -> list[dict]:
    log = out_dir / f"server-{name.replace('@', '_at_')}.log"
    log.unlink(missing_ok=True)
    server = BenchServer(args.model_path,
                         ["--decode-log-interval", "1", "--enable-metrics", *server_args],
                         log_path=log, max_total_tokens=pool, max_running=None,
                         teacher_forcing=False,
                         threads=int(os.environ.get("OMP_NUM_THREADS", "1")))
    rows = []
    try:
        for c in args.concurrency:
            server.flush_cache()  # same prompts every run: no prefix hits from the last one
            start_log = len(server.output())
            seconds_before = eviction_seconds(server.get_text("/metrics"))
            with tempfile.TemporaryDirectory() as tmp:
                result = run_client(server, args, c, Path(tmp) / "out.jsonl", args.model_path)
            text = server.output()[start_log:]
            evict_s = eviction_seconds(server.get_text("/metrics")) - seconds_before
            row = {"arm": name, "pool": pool, "concurrency": c,
                   **{k: result.get(k) for k in CLIENT_KEYS}, **decode_stats(text),
                   "retractions": len(re.findall(r"Retract requests", text)),
                   "eviction_seconds": evict_s,
                   "eviction_time_share": evict_s / result["duration"] if result["duration"] else 0.0}
            rows.append(row)
            print(f"  {name} c={c}: {row['output_throughput']:.0f} tok/s, peak running "
                  f"{row['peak_running']}, eviction share {100 * row['eviction_time_share']:.2f} %",
                  flush=True)
    finally:
        server.stop()
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for arm in dict.fromkeys(r["arm"] for r in rows):
        sel = [r for r in rows if r["arm"] == arm]
        xs = [r["concurrency"] for r in sel]
        ax1.plot(xs, [r["output_throughput"] for r in sel], "o-", label=arm)
        ax2.plot(xs, [r["peak_running"] for r in sel], "o-", label=arm)
    ax1.set(xlabel="client concurrency", ylabel="output tokens/s", title="throughput")
    ax2.set(xlabel="client concurrency", ylabel="peak running requests", title="concurrency")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(rows: list[dict], bound: float) -> None:
    head = (f"{'arm':<16}{'pool':>7}{'conc':>6}{'tok/s':>9}{'peak run':>10}{'mean run':>10}"
            f"{'peak KV':>9}{'TTFT p50':>10}{'ITL p50':>9}{'ITL p99':>9}{'retract':>9}{'evict %':>9}")
    print(head)
    for r in rows:
        print(f"{r['arm']:<16}{r['pool']:>7}{r['concurrency']:>6}{r['output_throughput']:>9.0f}"
              f"{r['peak_running']:>10}{r['mean_running']:>10.1f}{r['peak_kv_tokens']:>9}"
              f"{r['median_ttft_ms']:>10.0f}{r['median_itl_ms']:>9.1f}{r['p99_itl_ms']:>9.1f}"
              f"{r['retractions']:>9}{100 * r['eviction_time_share']:>9.2f}")
    print(f"bound N / (P + budget + window) = {bound:.2f} requests")


def summarize(rows: list[dict], policies: list[str], bound: float) -> dict:
    """The issue's criteria, per policy, at the highest concurrency run."""
    c = max(r["concurrency"] for r in rows)
    at = {r["arm"]: r for r in rows if r["concurrency"] == c}
    out = {"concurrency": c, "bound": bound}
    for p in policies:
        v, full, ceil = at.get(f"{p}@N"), at.get("full@N"), at.get("ceiling")
        if v is None:
            continue
        out[p] = {
            "peak_running_over_bound": v["peak_running"] / bound,
            "throughput_over_full": (v["output_throughput"] / full["output_throughput"]) if full else None,
            "throughput_over_ceiling": (v["output_throughput"] / ceil["output_throughput"]) if ceil else None,
            "eviction_time_share": v["eviction_time_share"],
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="model directory (default: the tiny local test model)")
    ap.add_argument("--max-total-tokens", type=int, default=4096, help="N, the pool of the @N arms")
    ap.add_argument("--input-len", type=int, default=64, help="P, prompt tokens")
    ap.add_argument("--output-len", type=int, default=1024, help="L, output tokens (ignore_eos)")
    ap.add_argument("--num-prompts", type=int, default=24, help="M, requests per run")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[24])
    ap.add_argument("--policies", nargs="+", default=["vase-attnv"])
    ap.add_argument("--budget", type=int, default=192)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--arms", nargs="+", default=["full", "vase", "ceiling"],
                    choices=["full", "vase", "ceiling"])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "results" / "concurrency"))
    ap.add_argument("--quiet-client", action="store_true", help="hide the client's progress bar")
    args = ap.parse_args(argv)
    if args.model_path is None:
        from vase_sglang.tiny_model import build_tiny_qwen3

        args.model_path = str(build_tiny_qwen3())
    for name in ("max_total_tokens", "input_len", "output_len", "num_prompts", "budget", "window"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if any(c <= 0 for c in args.concurrency):
        ap.error("--concurrency values must be positive")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    n = args.max_total_tokens
    ceiling_pool = int(args.num_prompts * (args.input_len + args.output_len) * 1.05) + 1024
    arms = []
    if "full" in args.arms:
        arms.append(("full@N", [], n))
    if "vase" in args.arms:
        for p in args.policies:
            arms.append((f"{p}@N", ["--kv-evict-policy", p, "--kv-evict-budget", str(args.budget),
                                    "--kv-evict-window", str(args.window)], n))
    if "ceiling" in args.arms:
        arms.append(("ceiling", [], ceiling_pool))

    from tqdm import tqdm

    rows = []
    started = time.time()
    for name, server_args, pool in tqdm(arms, desc="arms", unit="arm", file=sys.stdout):
        print(f"\n== {name} (pool {pool})", flush=True)
        rows += run_arm(name, server_args, pool, args, out_dir)
    bound = n / (args.input_len + args.budget + args.window)
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "settings": {k: v for k, v in vars(args).items() if k not in ("quiet_client",)},
        "device": "cuda" if on_cuda() else f"cpu ({os.cpu_count()} cores)",
        "wall_seconds": time.time() - started,
        "rows": rows,
        "summary": summarize(rows, args.policies, bound),
    }
    (out_dir / "concurrency_scaling.json").write_text(json.dumps(result, indent=2))
    plot(rows, out_dir / "concurrency_scaling.png")
    print()
    print_table(rows, bound)
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {out_dir / 'concurrency_scaling.json'} and {out_dir / 'concurrency_scaling.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
