"""Solve one question step by step on a (VaSE) SGLang server, through the frontend language.

    python -m sglang.launch_server --model-path $(python -m vase_sglang.models fetch) \
        --kv-evict-policy vase-attnv --kv-evict-budget 96 --kv-evict-window 16 --port 30000 \
        [--device cpu --attention-backend torch_native --disable-cuda-graph]
    python examples/solve.py --url http://127.0.0.1:30000 --question "What is 17 + 25?"

Prints the reasoning, the extracted answer and how many tokens were evicted; --json prints one
JSON object instead.
"""

from __future__ import annotations

import argparse
import json

from reasoning import connect, run_solve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--question", required=True)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--chat-template", default=None, help="sglang.lang template name (default: guessed)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens (random test models)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    backend = connect(args.url, args.chat_template)
    out = run_solve(backend, args.question, max_tokens=args.max_tokens, temperature=args.temperature,
                    top_p=args.top_p, ignore_eos=args.ignore_eos)
    if args.json:
        print(json.dumps(out))
        return
    print(out["text"])
    print(f"\n=== answer: {out['answer']} (from {out['answer_source']}); "
          f"{out['completion_tokens']} tokens, {out['kv_evicted_tokens']} evicted per (layer, KV head) ===")


if __name__ == "__main__":
    main()
