"""Value-range profile of a model: how skewed are Range(v) = max(v) - min(v) over head_dim?

VaSE's N_v reservation keeps the tokens with the largest value ranges, per layer and KV head.
How much that matters depends on the model: if a few tokens have ranges far above the rest,
evicting them hurts and reserving them helps; if ranges are flat, the reservation is close to
a few extra random slots. This tool measures it with plain transformers on your own model:

    python benchmarks/value_profile.py --model qwen2.5-0.5b --prompts 4 --gen-tokens 200
    python benchmarks/value_profile.py --model /path/to/hf_model --texts outputs.jsonl

Sequences: gsm_symbolic questions (reasoning-gym, fixed seed) through the chat template, each
continued greedily by the model for --gen-tokens tokens (its own generated text), or texts you
give (--texts: jsonl with "prompt" and optional "output", e.g. what a served run produced,
teacher-forced here). For every layer, token and KV head it reads the value vectors from the
KV cache (past_key_values: exactly what the server caches, before any eviction) and reports,
pooled over tokens and KV heads: median, p99, max, max/median, where the largest sit (position
of the max; share of the top 1 % in the first --sinks tokens, which VaSE keeps anyway), and
max/median again without the sink tokens. Writes JSON + PNG to --out and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

SINKS = 4


def load(model: str, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vase_sglang.serving.models import MODELS, fetch

    path = str(fetch(model)) if model in MODELS else model
    tok = AutoTokenizer.from_pretrained(path)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    return path, tok, m


def _known() -> dict:
    from vase_sglang.serving.models import MODELS

    return MODELS


def gsm_prompts(tok, n: int, seed: int) -> list[list[int]]:
    import reasoning_gym as rg

    from vase_sglang.serving.answers import ANSWER_INSTRUCTION

    out = []
    for entry in rg.create_dataset("gsm_symbolic", size=n, seed=seed):
        msg = [{"role": "user", "content": entry["question"] + "\n" + ANSWER_INSTRUCTION}]
        out.append(_chat_ids(tok, msg))
    return out


def _chat_ids(tok, messages, add_generation_prompt=True) -> list[int]:
    if not tok.chat_template:
        return tok("\n".join(m["content"] for m in messages))["input_ids"]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tok(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def value_ranges(model, ids: list[int]) -> list[torch.Tensor]:
    """Range(v) per layer for one sequence: a list of [H_kv, n] float32 tensors, read from the
    KV cache of one forward pass over `ids`."""
    out = model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    ranges = []
    for layer in cache.layers:
        v = layer.values[0].float()  # [H_kv, n, D]
        ranges.append(v.amax(-1) - v.amin(-1))
    return ranges


def summarize(per_seq: list[list[torch.Tensor]], sinks: int = SINKS, top_share: float = 0.01) -> list[dict]:
    """Per-layer statistics pooled over sequences, tokens and KV heads."""
    layers = []
    for li in range(len(per_seq[0])):
        vals, pos, heads, seq = [], [], [], []
        for si, ranges in enumerate(per_seq):
            r = ranges[li]  # [H, n]
            h, n = r.shape
            vals.append(r.reshape(-1))
            pos.append(torch.arange(n).repeat(h))
            heads.append(torch.arange(h).repeat_interleave(n))
            seq.append(torch.full((h * n,), si))
        v, p, hd, sq = (torch.cat(x) for x in (vals, pos, heads, seq))
        median = v.median().item()
        p99 = torch.quantile(v, 0.99).item()
        imax = int(v.argmax())
        k = max(1, int(round(top_share * v.numel())))
        top = v.topk(k).indices
        rest = v[p >= sinks]
        layers.append({
            "layer": li,
            "median": median,
            "p99": p99,
            "max": v.max().item(),
            "max_over_median": v.max().item() / median,
            "p99_over_median": p99 / median,
            "argmax": {"position": int(p[imax]), "kv_head": int(hd[imax]), "sequence": int(sq[imax])},
            "top1pct_share_in_sinks": (p[top] < sinks).float().mean().item(),
            "max_over_median_no_sinks": rest.max().item() / rest.median().item(),
            "tokens": sum(r[li].shape[1] for r in per_seq),
            "kv_heads": int(per_seq[0][li].shape[0]),
        })
    return layers


def print_table(layers: list[dict], sinks: int = SINKS) -> None:
    print(f"{'layer':>5} {'median':>8} {'p99':>8} {'max':>8} {'max/med':>8} {'p99/med':>8} "
          f"{'argmax pos':>10} {'top1% in sinks':>14} {'max/med w/o sinks':>17}")
    for r in layers:
        print(f"{r['layer']:>5} {r['median']:>8.3f} {r['p99']:>8.3f} {r['max']:>8.3f} "
              f"{r['max_over_median']:>8.2f} {r['p99_over_median']:>8.2f} "
              f"{r['argmax']['position']:>10} {r['top1pct_share_in_sinks']:>14.0%} "
              f"{r['max_over_median_no_sinks']:>17.2f}")
    worst = max(layers, key=lambda r: r["max_over_median"])
    print(f"max/median: {min(r['max_over_median'] for r in layers):.2f} .. "
          f"{worst['max_over_median']:.2f} (layer {worst['layer']}); without the first {sinks} "
          f"tokens: up to {max(r['max_over_median_no_sinks'] for r in layers):.2f}")


def plot(layers: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["layer"] for r in layers]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key, style in (("median", "-o"), ("p99", "-s"), ("max", "-^")):
        a.plot(x, [r[key] for r in layers], style, label=key, ms=3)
    a.set_yscale("log")
    a.set_xlabel("layer")
    a.set_ylabel("Range(v) = max(v) - min(v)")
    a.legend()
    a.set_title("value range per layer (tokens x KV heads)")
    b.plot(x, [r["max_over_median"] for r in layers], "-o", ms=3, label="max / median")
    b.plot(x, [r["max_over_median_no_sinks"] for r in layers], "-s", ms=3,
           label="max / median, sinks excluded")
    b.plot(x, [r["p99_over_median"] for r in layers], "-^", ms=3, label="p99 / median")
    b.set_xlabel("layer")
    b.set_title("skew")
    b.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b",
                    help="HF model folder, or a name known to vase_sglang.serving.models (fetched)")
    ap.add_argument("--prompts", type=int, default=4, help="gsm_symbolic questions")
    ap.add_argument("--seed", type=int, default=123)
    ap.add_argument("--gen-tokens", type=int, default=200,
                    help="greedy tokens generated after each prompt (0: prompts only)")
    ap.add_argument("--texts", default=None, help="jsonl of {prompt, output} to profile instead")
    ap.add_argument("--sinks", type=int, default=SINKS)
    ap.add_argument("--dtype", default="float32", help="float32 is fastest on CPU")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="default: results/value_profile/<model>")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    path, tok, model = load(args.model, args.dtype)
    if args.texts:
        seqs = []
        for line in Path(args.texts).read_text().splitlines():
            if line.strip():
                item = json.loads(line)
                msgs = [{"role": "user", "content": item["prompt"]}]
                ids = _chat_ids(tok, msgs)
                seqs.append(ids + tok(item.get("output", ""), add_special_tokens=False)["input_ids"])
        source = f"texts from {args.texts}"
    else:
        seqs = gsm_prompts(tok, args.prompts, args.seed)
        if args.gen_tokens:
            for i, ids in enumerate(seqs):
                with torch.no_grad():
                    out = model.generate(torch.tensor([ids]), max_new_tokens=args.gen_tokens,
                                         do_sample=False, pad_token_id=tok.pad_token_id)
                seqs[i] = out[0].tolist()
                print(f"[value_profile] sequence {i + 1}/{len(seqs)}: {len(ids)} prompt + "
                      f"{len(seqs[i]) - len(ids)} generated tokens", file=sys.stderr, flush=True)
        source = (f"{args.prompts} gsm_symbolic prompts (seed {args.seed}) + "
                  f"{args.gen_tokens} greedy tokens each")
    per_seq = [value_ranges(model, ids) for ids in seqs]
    layers = summarize(per_seq, args.sinks)
    result = {
        "model": path, "dtype": args.dtype, "source": source, "sinks": args.sinks,
        "sequences": len(seqs), "tokens": sum(len(s) for s in seqs), "layers": layers,
        "max_over_median_range": [min(r["max_over_median"] for r in layers),
                                  max(r["max_over_median"] for r in layers)],
        "seconds": round(time.time() - t0, 1),
    }
    label = args.model if args.model in _known() else os.path.basename(path.rstrip("/"))
    out = Path(args.out or f"results/value_profile/{label}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "value_profile.json").write_text(json.dumps(result, indent=1))
    plot(layers, out / "value_profile.png", f"{label}: {source}")
    print_table(layers, args.sinks)
    print(f"{len(seqs)} sequences, {result['tokens']} tokens; wrote {out}/value_profile.json, "
          f"value_profile.png ({result['seconds']} s)")
    return result


if __name__ == "__main__":
    main()
