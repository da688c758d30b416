"""Serve a model with VaSE eviction (python -m sglang.launch_server), send one request,
print the answer and how many tokens were evicted, then stop the server.

Default model: the tiny local Qwen3 built by vase_sglang.tiny_model (random weights: the
text is gibberish, the eviction is real). Pass --model-path for a real model; any other
launch_server option is passed through."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from vase_sglang.tiny_model import build_tiny_qwen3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--prompt", default="Hello world! The capital of France is")
    parser.add_argument("--max-new-tokens", type=int, default=400)
    args, passthrough = parser.parse_known_args()
    model = args.model_path or str(build_tiny_qwen3())
    if not any(a.startswith("--kv-evict-policy") for a in passthrough):
        passthrough += ["--kv-evict-policy", "vase-attnv", "--kv-evict-budget", "128",
                        "--kv-evict-window", "32"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model,
           "--host", "127.0.0.1", "--port", str(port)]
    if "--device" not in passthrough and not _has_cuda():
        cmd += ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
                "--sleep-on-idle"]
    if "--max-total-tokens" not in passthrough:
        cmd += ["--max-total-tokens", "8192"]
    cmd += passthrough
    print("$", " ".join(cmd), flush=True)
    server = subprocess.Popen(cmd, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 300
        while True:
            if server.poll() is not None:
                sys.exit(f"server exited with code {server.returncode}")
            try:
                urllib.request.urlopen(url + "/model_info", timeout=5).read()
                break
            except OSError:
                if time.time() > deadline:
                    sys.exit("server did not come up within 300 s")
                time.sleep(1)
        payload = {"text": args.prompt, "sampling_params": {
            "max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}}
        req = urllib.request.Request(url + "/generate", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        out = json.loads(urllib.request.urlopen(req, timeout=600).read())
        meta = out["meta_info"]
        print("\n=== request ===\n" + args.prompt)
        print("=== answer ===\n" + out["text"][:2000])
        print(f"=== {meta['completion_tokens']} tokens generated, "
              f"{meta.get('kv_evicted_tokens', 0)} evicted per (layer, KV head), "
              f"{meta['e2e_latency']:.2f} s ===")
    finally:
        server.send_signal(signal.SIGTERM)  # the launcher shuts its children down itself
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
