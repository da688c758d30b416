"""Global vs per-head retention budgets, measured on the transformers reference (issue 15).

    python benchmarks/global_budget.py --model-path M --gates G.safetensors \\
        --records results/accuracy --n 40 --budget 64 --window 16 --out results/global_budget

TRIM-KV's global follow-up ("Make Each Token Count", arXiv 2605.09649) lets the tokens of all
layers and KV heads compete for one budget. SGLang's pool cannot free memory that way (one slot
spans every layer and head; docs/retention.md), so before any redesign we measure what it would
buy, here, where unequal heads are cheap: every token stays in the transformers KV cache and a
per-(layer, KV head) mask hides the evicted ones from attention.

Rows of one batch share the forced tokens (the full cache's greedy output from the accuracy
harness' records) and differ only in what they hide:
  full        nothing: the teacher-forced full cache, the KL reference
  per-head    trimkv as served: at each eviction every (layer, KV head) keeps its K = T - R
              largest log β · age among its candidates (the newest R are not candidates)
  global@f    the same total, L · H · K, chosen as the largest scores over all (layer, head)
              together, each head keeping at least f of its own (f = 0: no floor)
Evictions happen at the served schedule (the private cache reaches T + R, then every R tokens),
so every row holds the same number of tokens at every step: the same memory. Between two
evictions the R new tokens are processed in one forward (causal within it), which is exactly
what R single-token steps compute. `per-head` equals `ReferenceDecoder` with the same gates
(tests/test_global_budget.py), so the comparison is the served policy against its global twin.

Metrics per token after the first eviction, against the full row: KL(full || row) (exact, whole
vocabulary), NLL excess of the forced token, top-1 agreement; 95% bootstrap intervals over
problems and the paired difference global − per-head (benchmarks/accuracy_stats.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import accuracy_stats as st  # noqa: E402

MASKED_ATTENTION = "vase_masked_heads"


class _Masks:
    """What the masked attention reads: alive[layer] bool [B, H_kv, capacity] (None: plain causal)."""

    alive: list[torch.Tensor] | None = None


_MASKS = _Masks()


def masked_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Causal attention over the whole cache in which a hidden key of a (row, KV head) gets no
    weight. Physical cache index = true position: nothing is ever removed from the cache."""
    q_len, kv_len = query.shape[2], key.shape[2]
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1).float()
    v = value.repeat_interleave(groups, dim=1).float()
    logits = torch.matmul(query.float(), k.transpose(2, 3)) * scaling
    cap = getattr(module, "attn_logit_softcapping", None)
    if cap:
        logits = cap * torch.tanh(logits / cap)
    qpos = torch.arange(kv_len - q_len, kv_len, device=query.device)
    allowed = (torch.arange(kv_len, device=query.device)[None, :] <= qpos[:, None])[None, None]
    if _MASKS.alive is not None:
        alive = _MASKS.alive[module.layer_idx][:, :, :kv_len]  # [B, H_kv, kv]
        allowed = allowed & alive.repeat_interleave(groups, dim=1)[:, :, None, :]
    logits = logits.masked_fill(~allowed, float("-inf"))
    out = torch.matmul(torch.softmax(logits, dim=-1), v).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def install(model) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(MASKED_ATTENTION, masked_attention)
    model.set_attn_implementation(MASKED_ATTENTION)


def schedule(steps: int, budget: int, window: int) -> list[list[int]]:
    """The teacher-forced steps grouped into forwards: [[0], [1, ..], ..]; an eviction runs
    before each group but the first two. Mirrors ReferenceDecoder.run (page size 1, prompt
    protected): step 0 is the prefill, step s >= 1 feeds forced[s - 1]; after step s >= 1, if
    the private cache holds budget + window tokens, it is cut to budget."""
    groups, private, current = [[0]], 0, []
    for step in range(1, steps):
        current.append(step)
        private += 1
        if step < steps - 1 and private >= budget + window:
            groups.append(current)
            current, private = [], budget
    if current:
        groups.append(current)
    return groups


def keep_mask(scores: torch.Tensor, keep: int, mode: str, floor: int = 0) -> torch.Tensor:
    """scores [L, H, n] (-inf: not a candidate) -> bool [L, H, n], the kept candidates.
    per-head: the `keep` largest of each (layer, head). global: the L·H·keep largest of all,
    after each head's `floor` largest (floor >= keep gives per-head)."""
    cand = torch.isfinite(scores)
    L, H, n = scores.shape
    if mode == "per-head":
        idx = scores.topk(keep, dim=-1).indices
        kept = torch.zeros_like(cand).scatter_(-1, idx, True)
        return kept & cand
    f = min(floor, keep)
    forced = torch.zeros_like(cand)
    if f > 0:
        forced.scatter_(-1, scores.topk(f, dim=-1).indices, True)
        forced &= cand
    bonus = scores.masked_fill(forced, float("inf"))
    total = min(L * H * keep, int(cand.sum()))
    flat = bonus.flatten().topk(total).indices
    kept = torch.zeros(L * H * n, dtype=torch.bool, device=scores.device)
    kept[flat] = True
    return kept.view(L, H, n) & cand


class MaskedRetentionRun:
    """Teacher-forced trimkv on the transformers reference, one batch row per eviction mode."""

    def __init__(self, model, gates, *, budget: int, window: int, sinks: int = 4):
        from vase_sglang.gates import RetentionGates, load_gates

        if not isinstance(gates, RetentionGates):
            gates = load_gates(gates, model.config)
        self.model, self.gates = model.eval(), gates
        self.budget, self.window, self.sinks = budget, window, sinks
        install(model)

    @torch.no_grad()
    def run(self, prompt_ids: list[int], forced_ids: list[int], modes: list[tuple[str, int]]):
        """modes: (name, floor) per row, name in full, per-head, global. Returns per row the
        log-softmax of each step's next-token distribution [steps, V] (float32) and, per
        eviction, the kept counts per (layer, head)."""
        from transformers import DynamicCache

        from vase_sglang.gates import recording_log_beta

        P, steps = len(prompt_ids), len(forced_ids)
        B, L, H = len(modes), self.gates.layers, self.gates.kv_heads
        cap = P + steps
        keep = self.budget - self.window
        sinks = max(0, self.sinks - P)  # the protected prompt holds the sinks (as served)
        alive = [torch.zeros(B, H, cap, dtype=torch.bool) for _ in range(L)]
        log_beta = [torch.zeros(B, H, cap) for _ in range(L)]
        sink: dict = {}
        cache = DynamicCache()
        out = torch.empty(B, steps, self.model.config.vocab_size)
        counts = []
        _MASKS.alive = alive
        try:
            with recording_log_beta(self.model, self.gates, sink):
                for gi, group in enumerate(schedule(steps, self.budget, self.window)):
                    if gi >= 2:
                        counts.append(self._evict(alive, log_beta, modes, P, P + group[0] - 1,
                                                  keep, sinks))
                    ids = list(prompt_ids) if group == [0] else [forced_ids[s - 1] for s in group]
                    start = 0 if group == [0] else P + group[0] - 1
                    pos = torch.arange(start, start + len(ids))
                    for layer in range(L):
                        alive[layer][:, :, pos] = True
                    logits = self.model(input_ids=torch.tensor([ids]).expand(B, -1),
                                        position_ids=pos[None].expand(B, -1),
                                        past_key_values=cache, cache_position=pos,
                                        use_cache=True,
                                        logits_to_keep=1 if group == [0] else 0).logits
                    for layer in range(L):
                        log_beta[layer][:, :, pos] = sink[layer].transpose(1, 2)
                    rows = logits[:, -1:] if group == [0] else logits
                    out[:, group[0]: group[0] + rows.shape[1]] = torch.log_softmax(rows.float(), -1)
        finally:
            _MASKS.alive = None
        return out, counts

    def _evict(self, alive, log_beta, modes, P, now, keep, sinks):
        """Cut every non-full row back to the budget before the token at position `now`."""
        L = len(alive)
        lo, hi = P, now - self.window  # candidates: private, older than the window
        age = (now - torch.arange(lo, hi)).float()
        kept_counts = []
        for b, (mode, floor) in enumerate(modes):
            if mode == "full":
                kept_counts.append(None)
                continue
            cand = torch.stack([alive[layer][b, :, lo:hi] for layer in range(L)])  # [L, H, n]
            scores = torch.stack([log_beta[layer][b, :, lo:hi] for layer in range(L)]) * age
            scores[..., :sinks] = float("inf")  # sinks: always kept, counted in K
            scores = scores.masked_fill(~cand, float("-inf"))
            kept = keep_mask(scores, keep, mode, floor)
            before = sum(int(a[b, :, P:now].sum()) for a in alive)
            for layer in range(L):
                alive[layer][b, :, lo:hi] = kept[layer]
            after = sum(int(a[b, :, P:now].sum()) for a in alive)
            # the same memory in every mode: L · H · budget private tokens after the cut
            if after != L * cand.shape[1] * self.budget:
                raise AssertionError(f"{mode}: {after} private tokens kept (from {before}), "
                                     f"expected {L * cand.shape[1] * self.budget}")
            kept_counts.append(kept.sum(-1))
        return kept_counts


# ----------------------------------------------------------------------------- measurement


def token_metrics(full: torch.Tensor, row: torch.Tensor, forced: list[int]) -> dict:
    """Per step: KL(full || row) on the whole vocabulary, NLL of the forced token (row and
    full), top-1 agreement with the forced token."""
    ids = torch.tensor(forced)
    kl = (full.exp() * (full - row)).sum(-1).clamp_min(0)
    return {"kl": kl.tolist(),
            "nll": (-row.gather(1, ids[:, None])[:, 0]).tolist(),
            "nll_full": (-full.gather(1, ids[:, None])[:, 0]).tolist(),
            "top1_agree": (row.argmax(-1) == ids).int().tolist()}


def load_forced(records: Path, n: int, task: str, seed: int, tok) -> list[dict]:
    """The accuracy harness' first n problems with their full-cache greedy output."""
    from benchmarks import accuracy as acc

    rows = {r["pid"]: r for r in acc.load_rows(records) if r["arm"] == acc.Arm("full").name}
    out = []
    for prob in acc.load_problems(task, n, seed):
        if prob["pid"] not in rows:
            raise SystemExit(f"--records: no full-cache greedy output of {prob['pid']} in {records}")
        msgs = [{"role": "user", "content": acc.PROMPT.format(q=prob["question"])}]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        out.append({"pid": prob["pid"], "prompt": tok(text, add_special_tokens=False)["input_ids"],
                    "forced": rows[prob["pid"]]["output_ids"]})
    return out


def summarize(per_problem: list[dict], modes: list[str], start: int, boot_iters: int) -> dict:
    """Pooled means over the tokens after the first eviction, bootstrap over problems."""
    summary = {"modes": {}, "pairs": {}}
    sums = {}
    for m in modes:
        per = []
        for r in per_problem:
            x = r["modes"][m]
            per.append({"kl": sum(x["kl"][start:]),
                        "nll_excess": sum(x["nll"][start:]) - sum(x["nll_full"][start:]),
                        "top1_agree": sum(x["top1_agree"][start:]),
                        "count": len(x["kl"][start:])})
        sums[m] = per
        counts = [p["count"] for p in per]
        s = {"n": len(per), "tokens": sum(counts)}
        for metric in ("kl", "nll_excess", "top1_agree"):
            v, lo, hi = st.cluster_bootstrap([p[metric] for p in per], counts, boot_iters)
            s[metric] = v
            s[metric + "_boot95"] = [lo, hi]
        summary["modes"][m] = s
    for m in modes:
        if m == "per-head":
            continue
        counts = [p["count"] for p in sums[m]]
        row = {}
        for metric in ("kl", "nll_excess", "top1_agree"):
            d, lo, hi, p = st.paired_cluster_bootstrap(
                [x[metric] for x in sums[m]], [x[metric] for x in sums["per-head"]], counts,
                boot_iters)
            row[metric] = {"diff": d, "boot95": [lo, hi], "p": p,
                           "significant": bool(lo > 0 or hi < 0)}
        summary["pairs"][f"{m} - per-head"] = row
    return summary


def markdown(summary: dict, cfg: dict) -> str:
    lines = [f"Budget T = {cfg['budget']}, window R = {cfg['window']}, {cfg['n']} problems, "
             f"gates {cfg['gates']}.", "",
             "| budget | tokens | KL(full‖·) [95%] | NLL excess [95%] | top-1 agreement [95%] | "
             "per-head kept: min / median / max |", "|---" * 6 + "|"]
    for m, s in summary["modes"].items():
        cells = [f"{s[k]:.4f} [{s[k + '_boot95'][0]:.4f}, {s[k + '_boot95'][1]:.4f}]"
                 for k in ("kl", "nll_excess", "top1_agree")]
        spread = summary.get("head_spread", {}).get(m)
        sp = "–" if spread is None else f"{spread['min']:.0f} / {spread['median']:.0f} / {spread['max']:.0f}"
        lines.append(f"| {m} | {s['tokens']} | " + " | ".join(cells) + f" | {sp} |")
    lines += ["", "| paired difference | ΔKL [95%] | p | ΔNLL excess [95%] | p | Δtop-1 [95%] | p |",
              "|---" * 7 + "|"]
    for name, row in summary["pairs"].items():
        cells = [f"{row[k]['diff']:+.4f} [{row[k]['boot95'][0]:+.4f}, {row[k]['boot95'][1]:+.4f}]"
                 f"{' *' if row[k]['significant'] else ''} | {row[k]['p']:.3f}"
                 for k in ("kl", "nll_excess", "top1_agree")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("\n\\* the 95% interval excludes 0")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(summary["modes"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, title in ((axes[0], "kl", "KL(full || budget), after the first eviction"),
                              (axes[1], "top1_agree", "top-1 agreement with the forced token")):
        vals = [summary["modes"][m][metric] for m in modes]
        err = [[v - summary["modes"][m][metric + "_boot95"][0] for v, m in zip(vals, modes)],
               [summary["modes"][m][metric + "_boot95"][1] - v for v, m in zip(vals, modes)]]
        ax.bar(modes, vals, yerr=err, capsize=4, color="#4c72b0")
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle("trimkv: one budget per (layer, KV head) vs one global budget, same memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--gates", required=True, help="retention gates file of this model")
    ap.add_argument("--records", required=True,
                    help="accuracy harness output folder (records.jsonl or records.jsonl.gz)")
    ap.add_argument("--out", default="results/global_budget")
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--task", default="gsm_symbolic")
    ap.add_argument("--seed", type=int, default=123)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--floors", default=None,
                    help="global rows: per-head floors, the candidates each head keeps before "
                         "the global ranking (default: 0 and K/4, K = budget - window)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--boot-iters", type=int, default=10000)
    a = ap.parse_args(argv)

    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(a.model_path)
    model = AutoModelForCausalLM.from_pretrained(a.model_path, dtype=torch.float32)
    runner = MaskedRetentionRun(model, a.gates, budget=a.budget, window=a.window)
    keep = a.budget - a.window
    floors = ([0, keep // 4] if a.floors is None else
              [int(x) for x in a.floors.split(",") if x])
    modes = [("full", 0), ("per-head", 0)] + [("global", f) for f in floors]
    names = ["full", "per-head"] + [f"global, floor {f}" for f in floors]
    problems = load_forced(Path(a.records), a.n, a.task, a.seed, tok)
    records = out / "records.jsonl"
    done = {}
    if records.exists():
        for line in records.read_text().splitlines():
            r = json.loads(line)
            done[r["pid"]] = r
    t0 = time.time()
    with open(records, "a") as f:
        for prob in tqdm(problems, desc="global vs per-head", unit="problem"):
            if prob["pid"] in done:
                continue
            logp, counts = runner.run(prob["prompt"], prob["forced"], modes)
            row = {"pid": prob["pid"], "tokens": len(prob["forced"]), "modes": {}, "spread": {}}
            for b, name in enumerate(names[1:], start=1):
                row["modes"][name] = {k: [round(x, 6) for x in v] for k, v in
                                      token_metrics(logp[0], logp[b], prob["forced"]).items()}
                per_head = [c[b] for c in counts]
                if per_head:
                    allc = torch.stack(per_head).float()
                    row["spread"][name] = {"min": float(allc.min()), "max": float(allc.max()),
                                           "median": float(allc.median())}
            f.write(json.dumps(row) + "\n")
            f.flush()
            done[prob["pid"]] = row
    rows = [done[p["pid"]] for p in problems]
    summary = summarize(rows, names[1:], a.budget + a.window, a.boot_iters)
    summary["head_spread"] = {
        m: {k: st.mean(r["spread"][m][k] for r in rows if m in r["spread"])
            for k in ("min", "median", "max")} for m in names[1:]}
    cfg = {k: v for k, v in vars(a).items()}
    cfg["wall_s"] = round(time.time() - t0, 1)
    summary["config"] = cfg
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(markdown(summary, cfg))
    plot(summary, out / "global_budget.png")
    print(markdown(summary, cfg))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
