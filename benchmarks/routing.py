"""Cache-aware routing over VaSE workers: does SGLang's gateway keep its prefix hits when every
worker evicts?

Two SGLang workers (`python -m sglang.launch_server`, eviction on, radix cache on) sit behind
the Shepherd Model Gateway (`smg launch`, PyPI package `smg`). Requests share one of K system
prompts and end with their own question, so a router that sends each system prompt to the
same worker finds it in that worker's radix cache; eviction only ever touches the private,
generated tokens, so those hits survive. For each routing policy (cache_aware, round_robin),
fresh workers and a fresh gateway are started and the same request list is sent through the
gateway at a fixed concurrency. Recorded per policy: prefix hit rate (sum of `cached_tokens` /
sum of prompt tokens, from each response's meta_info), output tokens/s, tokens evicted
(`kv_evicted_tokens`), requests per worker and peak running requests per worker (each
worker's decode log). Writes JSON, a PNG and a markdown table.

    python benchmarks/routing.py                       # tiny local model, CPU, a few minutes
    python benchmarks/routing.py --model-path DIR --requests 64 --concurrency 16

All traffic stays on 127.0.0.1; every loop is bounded by --requests.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._server import BenchServer, stop_process_group  # noqa: E402
from vase_sglang.serving.ports import free_port  # noqa: E402
from benchmarks.concurrency_scaling import decode_stats  # noqa: E402

WORDS = ("cache radix token eviction memory budget window value range sample attention "
         "head layer prompt decode prefix router worker gateway slot page").split()


def gateway_binary() -> str:
    """The `smg` console script of this environment (installed by scripts/bootstrap.sh)."""
    here = Path(sys.executable).parent / "smg"
    found = str(here) if here.exists() else shutil.which("smg")
    if not found:
        raise SystemExit("routing.py: the gateway `smg` is not installed (pip install smg==1.13.0; "
                         "scripts/bootstrap.sh installs it)")
    return found


class Gateway:
    """`smg launch` over existing worker URLs, on loopback."""

    def __init__(self, worker_urls, policy: str, log_path: Path, timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "a")
        cmd = [gateway_binary(), "launch", "--host", "127.0.0.1", "--port", str(self.port),
               "--policy", policy, "--worker-urls", *worker_urls, "--log-level", "warn",
               # its metrics listener binds 0.0.0.0:29000 by default: loopback, a free port
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        self.log.write(f"\n=== {' '.join(cmd)}\n")
        self.log.flush()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}; log {log_path}")
            # The gateway answers before it has registered its workers (requests then get
            # 404 "no worker serves model"): wait until every worker is listed and healthy.
            try:
                with urllib.request.urlopen(self.url + "/workers", timeout=5) as r:
                    listed = json.loads(r.read()).get("workers", [])
                if len(listed) == len(worker_urls) and all(w.get("is_healthy", True) for w in listed):
                    return
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"smg not healthy after {timeout}s; log {log_path}")

    def post(self, path: str, payload: dict, timeout: float = 3600):
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def stop(self):
        stop_process_group(self.proc, grace=15)
        self.log.close()


def make_requests(num_system: int, num_requests: int, system_words: int, seed: int):
    """(system prompt index, text) pairs: K long shared system prompts, each request with its
    own short question; the order is shuffled (seeded) so prompts interleave."""
    rng = random.Random(seed)
    systems = [f"System prompt {k}: " + " ".join(rng.choice(WORDS) for _ in range(system_words))
               for k in range(num_system)]
    reqs = [(i % num_system, f"{systems[i % num_system]}\nQuestion {i}: "
             + " ".join(rng.choice(WORDS) for _ in range(8))) for i in range(num_requests)]
    rng.shuffle(reqs)
    return reqs


def run_arm(args, policy: str, requests, out_dir: Path) -> dict:
    evict = ["--kv-evict-policy", args.policy, "--kv-evict-budget", str(args.budget),
             "--kv-evict-window", str(args.window), "--decode-log-interval", "1"]
    workers = []
    try:
        for w in range(2):
            workers.append(BenchServer(args.model_path, evict, log_path=out_dir / f"{policy}-worker{w}.log",
                                       max_total_tokens=args.max_total_tokens, max_running=None,
                                       teacher_forcing=False, threads=args.threads))
        gateway = Gateway([w.url for w in workers], policy, out_dir / f"{policy}-gateway.log")
        try:
            sampling = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}

            def send(item):
                _, text = item
                return gateway.post("/generate", {"text": text, "sampling_params": sampling})

            start = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                results = list(pool.map(send, requests))
            wall = time.perf_counter() - start
        finally:
            gateway.stop()
        logs = [w.output() for w in workers]
    finally:
        for w in workers:
            w.stop()
    metas = [r["meta_info"] for r in results]
    missing = [i for i, m in enumerate(metas)
               if "cached_tokens" not in m or "kv_evicted_tokens" not in m]
    if missing:
        raise RuntimeError(f"{policy}: responses {missing[:5]} lack cached_tokens or "
                           "kv_evicted_tokens; are the workers running vase-sglang?")
    per_worker = []
    for log in logs:
        # the concurrency benchmark's parser: it stops if a worker logged no decode step
        per_worker.append({"peak_running": decode_stats(log)["peak_running"],
                           "requests": _served_requests(log)})
    prompt_tokens = sum(m["prompt_tokens"] for m in metas)
    cached = sum(m["cached_tokens"] for m in metas)
    output_tokens = sum(m["completion_tokens"] for m in metas)
    return {
        "routing": policy,
        "requests": len(results),
        "wall_s": round(wall, 2),
        "output_tok_per_s": round(output_tokens / wall, 2),
        "prefix_hit_rate": round(cached / prompt_tokens, 4),
        "cached_tokens": cached,
        "prompt_tokens": prompt_tokens,
        "evicted_tokens": sum(m["kv_evicted_tokens"] for m in metas),
        "workers": per_worker,
    }


def _served_requests(log: str) -> int:
    """Requests the gateway sent a worker: its access log's POST /generate lines after the
    warmup (prefill log lines would also count the generations behind the gateway's health
    checks)."""
    served = log.split("The server is fired up and ready to roll", 1)[-1]
    return len(re.findall(r'"POST /generate HTTP/1.1" 200', served))


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    names = [r["routing"] for r in rows]
    for ax, key, label in zip(axes, ("prefix_hit_rate", "output_tok_per_s", "evicted_tokens"),
                              ("prefix hit rate", "output tokens/s", "tokens evicted")):
        ax.bar(names, [r[key] for r in rows], color=["tab:blue", "tab:gray"][: len(rows)])
        ax.set_title(label)
    fig.suptitle("2 VaSE workers behind smg: cache-aware vs round-robin routing")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(rows) -> str:
    lines = ["| routing | prefix hit rate | output tok/s | tokens evicted | requests per worker "
             "| peak running per worker |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['routing']} | {r['prefix_hit_rate']:.1%} | {r['output_tok_per_s']:.1f} | "
                     f"{r['evicted_tokens']} | {' / '.join(str(w['requests']) for w in r['workers'])} | "
                     f"{' / '.join(str(w['peak_running']) for w in r['workers'])} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="default: a tiny random Qwen3 built locally")
    p.add_argument("--policy", default="vase-attnv")
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--routing", nargs="+", default=["cache_aware", "round_robin"])
    p.add_argument("--system-prompts", type=int, default=4, help="K shared system prompts")
    p.add_argument("--system-words", type=int, default=150)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-total-tokens", type=int, default=8192)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/routing")
    args = p.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    gateway_binary()  # fail before starting any server
    if args.model_path is None:
        from vase_sglang.serving.tiny_model import build_tiny_qwen3

        args.model_path = str(build_tiny_qwen3(out_dir / "tiny-qwen3"))
    requests = make_requests(args.system_prompts, args.requests, args.system_words, args.seed)
    rows = []
    for policy in args.routing:
        print(f"[routing] {policy}: 2 workers + gateway, {len(requests)} requests ...", flush=True)
        rows.append(run_arm(args, policy, requests, out_dir))
        print(f"[routing] {policy}: hit rate {rows[-1]['prefix_hit_rate']:.1%}, "
              f"{rows[-1]['output_tok_per_s']:.1f} tok/s", flush=True)
    result = {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "arms": rows}
    (out_dir / "routing.json").write_text(json.dumps(result, indent=2))
    (out_dir / "routing.md").write_text(table(rows) + "\n")
    plot(rows, out_dir / "routing.png")
    print(table(rows))
    return result


if __name__ == "__main__":
    main()
