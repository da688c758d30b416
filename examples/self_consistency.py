"""Self-consistency on a (VaSE) SGLang server: k sampled solutions forked from one prompt
(temperature 0.6, top-p 0.95), majority vote over their extracted answers.

    python examples/self_consistency.py --url http://127.0.0.1:30000 -k 5 \
        --question "A farmer has 12 cows and buys 3 times as many sheep. How many animals?"

The k branches share the prompt's KV through the radix cache (cached_tokens per branch) and each
evicts its own generated tokens under the server's --kv-evict-budget (kv_evicted_tokens).
"""

from __future__ import annotations

import argparse
import json

from reasoning import connect, run_self_consistency


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--question", required=True)
    p.add_argument("-k", type=int, default=5, help="number of sampled branches")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--chat-template", default=None, help="sglang.lang template name (default: guessed)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens (random test models)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    backend = connect(args.url, args.chat_template)
    out = run_self_consistency(backend, args.question, k=args.k, max_tokens=args.max_tokens,
                               temperature=args.temperature, top_p=args.top_p,
                               ignore_eos=args.ignore_eos)
    if args.json:
        print(json.dumps(out))
        return
    for i, b in enumerate(out["branches"]):
        print(f"--- branch {i}: answer {b['answer']} ({b['completion_tokens']} tokens, "
              f"{b['cached_tokens']} prompt tokens from the radix cache, "
              f"{b['kv_evicted_tokens']} evicted) ---")
        print(b["text"].strip()[-300:])
    print(f"\n=== vote: {out['answer']}  {out['votes']} ===")


if __name__ == "__main__":
    main()
