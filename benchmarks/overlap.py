#!/usr/bin/env python
"""Overlap scheduler on vs off with eviction: same outputs, throughput of each.

Starts `python -m sglang.launch_server` twice with the same eviction settings (a deterministic
policy, greedy decoding), once as SGLang defaults (overlap scheduler on) and once with
--disable-overlap-schedule, sends both the same requests (all at once, --concurrency at a time),
and reports:

  - whether every request's output tokens are identical in the two runs (exit code 1 if not);
  - wall time, output tokens / s and requests / s of each run;
  - tokens evicted per (layer, KV head), summed over requests (same in both runs).

Default model: a tiny random fp32 Qwen3 built locally (vase_sglang.serving.tiny_model), CPU flags from
tests/servers.py. Throughput on a shared or 2-core machine is noisy: record what else ran.

    python benchmarks/overlap.py --out overlap.json
    python benchmarks/overlap.py --model-path M --device cuda --budget 1024 --window 64 \
        --requests 256 --max-new-tokens 2048 --out overlap.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # servers.py: start/stop real SGLang servers

import servers  # noqa: E402
from servers import Server  # noqa: E402

MODES = {"overlap": [], "no-overlap": ["--disable-overlap-schedule"]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="default: a tiny fp32 Qwen3 built in a temp folder")
    p.add_argument("--device", default="cpu", help="cpu (tests' CPU flags) or cuda")
    p.add_argument("--policy", default="snapkv", help="a deterministic policy")
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64, help="max prompt tokens (random 8..N)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-total-tokens", type=int, default=8192)
    p.add_argument("--strict", action="store_true",
                   help="SGLang's strict memory checks on (slower; the tests use them)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="overlap.json")
    p.add_argument("server_args", nargs="*", help="extra launch_server arguments (after --)")
    return p.parse_args(argv)


def make_requests(args):
    rng = random.Random(args.seed)
    return [[rng.randrange(30, 900) for _ in range(rng.randrange(8, args.prompt_len + 1))]
            for _ in range(args.requests)]


def server_args(args, mode):
    flags = ["--kv-evict-policy", args.policy, "--kv-evict-budget", str(args.budget),
             "--kv-evict-window", str(args.window),
             *MODES[mode], *args.server_args]
    if args.device == "cpu":
        return ["--dtype", "float32"] + flags
    return flags + ["--device", args.device]


def run_mode(args, model, mode, prompts):
    env = {}
    if not args.strict:
        env = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "0",
               "SGLANG_CHECK_KV_PAGE_INVARIANTS": "0"}
    with Server(model, server_args(args, mode), env=env,
                max_total_tokens=args.max_total_tokens, timeout=600) as server:
        def one(ids):
            return server.post("/generate", {"input_ids": ids, "sampling_params": {
                "max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}})

        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            outs = list(pool.map(one, prompts))
        seconds = time.perf_counter() - start
        server.wait_idle_checked(1)
    tokens = sum(len(o["output_ids"]) for o in outs)
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "requests_per_s": len(prompts) / seconds,
        "kv_evicted_tokens": sum(o["meta_info"].get("kv_evicted_tokens", 0) for o in outs),
        "outputs": [o["output_ids"] for o in outs],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model = args.model_path
    if model is None:
        from vase_sglang.serving.tiny_model import build_tiny_qwen3

        model = str(build_tiny_qwen3(Path(tempfile.mkdtemp()) / "tiny-qwen3-fp32",
                                     dtype="float32", init_std=0.1))
    if args.device != "cpu":  # Server() would add the CPU flags (torch_native, no CUDA graph)
        servers.CPU_FLAGS = ["--host", "127.0.0.1"]
    prompts = make_requests(args)
    runs = {mode: run_mode(args, model, mode, prompts) for mode in MODES}
    a, b = (runs[m]["outputs"] for m in MODES)
    mismatched = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    report = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "config": {k: v for k, v in vars(args).items() if k != "out"} | {"model_path": model},
        "identical_outputs": not mismatched,
        "mismatched_requests": mismatched,
        "modes": {m: {k: v for k, v in r.items() if k != "outputs"} for m, r in runs.items()},
    }
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"{'mode':<12} {'seconds':>8} {'tok/s':>8} {'req/s':>7} {'evicted':>8}")
    for m, r in report["modes"].items():
        print(f"{m:<12} {r['seconds']:8.1f} {r['tokens_per_s']:8.1f} {r['requests_per_s']:7.2f} "
              f"{r['kv_evicted_tokens']:8d}")
    print(f"identical outputs: {not mismatched} ({len(prompts)} requests)"
          + (f", mismatched: {mismatched[:10]}" if mismatched else ""))
    print(f"wrote {args.out}")
    return 0 if not mismatched else 1


if __name__ == "__main__":
    sys.exit(main())
