"""Per-token KV-cache quantization error vs value range, and value-aware mixed precision.

VaSE's third claim: large-range value states (Range(v) = max(v) - min(v) over head_dim) are the
main source of reconstruction error in per-token KV-cache quantization, so mixed precision that
keeps them in high precision helps. Two commands test it with plain transformers (no server):

    python benchmarks/kv_quant.py error --model qwen2.5-0.5b --prompts 4 --gen-tokens 200
    python benchmarks/kv_quant.py kl    --model qwen2.5-0.5b --n 16 --max-new 256

`error` (the finding): sequences as benchmarks/value_profile.py builds them (gsm_symbolic
prompts through the chat template, each continued greedily for --gen-tokens), K (post-RoPE) and
V read from the KV cache, fake-quantized per scheme:
  fp8     (x / 1.0).to(float8_e4m3fn): SGLang's --kv-cache-dtype fp8_e4m3 without checkpoint
          scales (torch's cast saturates at +-448); relative error per element
  fp8cal  the same with a per-layer scale amax/448 (K and V separately, amax over all the
          measured sequences)
  int8 / int4  per-token asymmetric: per token and KV head over head_dim, scale =
          (max - min) / (2^b - 1), zero point min (scale and zero stored in fp16)
Per scheme it reports the per-token error (squared error summed over head_dim) against Range(v)
(Spearman per (sequence, layer, KV head), binned means of error / group mean against
Range(v) / group median), the share of the error carried by the top fraction of tokens by
Range(v) per (sequence, layer, KV head) next to that fraction, and the attention-output error
||A V^ - A V||^2 with the model's own attention weights (eager, output_attentions): the share of
it removed by keeping the top-range tokens exact, vs the same number of random tokens (seeded),
vs the tokens with the most attention mass (an oracle reference). JSON + PNG.

`kl` (value-aware precision, by measurement): the accuracy harness' gsm_symbolic problems
(benchmarks/accuracy.py load_problems / prompt_ids), the full-precision model's greedy answer,
teacher-forced under each arm; KL(full || arm) over the full vocabulary per answer token and
top-1 agreement, bootstrap 95% intervals over problems. K/V are fake-quantized inside attention
(a transformers AttentionInterface function wrapping sdpa). Prompt queries attend to exact K/V
(SGLang's prefill attends to the fresh k/v of the new tokens), answer queries attend to the
quantized cache (decode reads the cache), as teacher forcing of a decode. Arms: bf16, fp8,
fp8cal, int8, int4, int4g32 (two groups of 32 per head), and mixed arms `mix-range:F` /
`mix-random:F`: a token's K and V are kept in bf16 iff its priority is among the
ceil(F * (t + 1)) largest of tokens 0..t of its (layer, KV head) (a causal running rule; t is the
token's position), the rest int4; priority Range(v) for mix-range, a seeded uniform random number
for mix-random (the same rule with a range-blind priority). An arm "K/V" sets the two sides
apart, e.g. "bf16/mix-range:0.0625" (K in bf16, V mixed) or "int8/int4".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import accuracy_stats as st  # noqa: E402
from benchmarks import value_profile as vp  # noqa: E402

FP8_MAX = 448.0
ERROR_SCHEMES = ("fp8", "fp8cal", "int8", "int4")
FRACTIONS = (1 / 16, 1 / 4)
KL_ARMS = ("bf16", "fp8", "fp8cal", "int8", "int4", "int4g32",
           "mix-range:0.0625", "mix-random:0.0625", "mix-range:0.25", "mix-random:0.25")
META_BYTES = 4  # fp16 scale + fp16 zero point per token, KV head and tensor (K or V)


# ----------------------------------------------------------------------------- quantizers


def fake_fp8(x: torch.Tensor, scale=1.0) -> torch.Tensor:
    """What an fp8_e4m3 KV cache stores and reads back: (x / scale) cast to float8_e4m3fn
    (torch saturates at +-448), times scale."""
    return (x / scale).to(torch.float8_e4m3fn).to(x.dtype) * scale


def fake_int(x: torch.Tensor, bits: int, group: int | None = None) -> torch.Tensor:
    """Per-token asymmetric integer quantization over the last dim (or groups of `group`
    elements of it): scale = (max - min) / (2^b - 1), zero point min, q = round((x - min) /
    scale) in [0, 2^b - 1]. A group with max == min is stored exactly."""
    shape = x.shape
    if group:
        x = x.reshape(*shape[:-1], shape[-1] // group, group)
    mn = x.amin(-1, keepdim=True)
    mx = x.amax(-1, keepdim=True)
    scale = (mx - mn) / (2 ** bits - 1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round((x - mn) / safe), 0, 2 ** bits - 1)
    out = torch.where(scale > 0, q * safe + mn, x)
    return out.reshape(shape)


def fake_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def quantize(x: torch.Tensor, scheme: str, scale=None) -> torch.Tensor:
    if scheme == "none":
        return x
    if scheme == "bf16":
        return fake_bf16(x)
    if scheme == "fp8":
        return fake_fp8(x, 1.0)
    if scheme == "fp8cal":
        return fake_fp8(x, scale)
    if scheme == "int8":
        return fake_int(x, 8)
    if scheme == "int4":
        return fake_int(x, 4)
    if scheme == "int4g32":
        return fake_int(x, 4, group=32)
    raise ValueError(f"unknown scheme {scheme!r}")


def scheme_bytes(scheme: str, head_dim: int) -> float:
    """Bytes one token costs per layer and KV head, K and V together."""
    per = {"none": 4 * head_dim, "bf16": 2 * head_dim, "fp8": head_dim, "fp8cal": head_dim,
           "int8": head_dim + META_BYTES, "int4": head_dim / 2 + META_BYTES,
           "int4g32": head_dim / 2 + META_BYTES * head_dim / 32}
    return 2 * per[scheme]


def arm_sides(arm: str) -> tuple[str, str]:
    """An arm's K and V specs: "int4" (both sides), or "K/V" such as "bf16/mix-range:0.0625"."""
    k, _, v = arm.partition("/")
    return k, (v or k)


def is_mixed(arm: str) -> bool:
    return any(side.startswith("mix-") for side in arm_sides(arm))


def arm_bytes(arm: str, head_dim: int, protected_fraction: float | None = None) -> float:
    """Bytes per token per layer and KV head (K + V) of a KL arm; a mixed side's from the share
    of tokens it actually kept in bf16 (the 1-bit precision flag per token is not counted)."""
    total = 0.0
    for side in arm_sides(arm):
        if side.startswith("mix-"):
            f = protected_fraction if protected_fraction is not None else float(side.split(":")[1])
            total += (f * scheme_bytes("bf16", head_dim) + (1 - f) * scheme_bytes("int4", head_dim)) / 2
        else:
            total += scheme_bytes(side, head_dim) / 2
    return total


def running_top(priority: torch.Tensor, f: float) -> torch.Tensor:
    """Causal selection over the last dim: token t is selected iff its priority is among the
    ceil(f * (t + 1)) largest of tokens 0..t (ties broken toward the earlier token)."""
    n = priority.shape[-1]
    t = torch.arange(n)
    earlier = t[None, :] < t[:, None]  # [t, j]: j < t
    greater = priority[..., None, :] > priority[..., :, None]  # [.., t, j]: p_j > p_t
    ties = (priority[..., None, :] == priority[..., :, None]) & earlier
    rank = 1 + ((greater & (t[None, :] <= t[:, None])) | ties).sum(-1)
    quota = torch.ceil(f * (t + 1).to(torch.float64)).to(torch.long)
    return rank <= quota


def value_range(v: torch.Tensor) -> torch.Tensor:
    return v.amax(-1) - v.amin(-1)


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = (ra.norm() * rb.norm()).item()
    return float((ra @ rb).item() / den) if den > 0 else float("nan")


def topk_mask(score: torch.Tensor, k: int) -> torch.Tensor:
    """[..., n] bool mask of the k largest entries of the last dim."""
    m = torch.zeros_like(score, dtype=torch.bool)
    if k > 0:
        m.scatter_(-1, score.topk(k, dim=-1).indices, True)
    return m


def random_mask(shape, k: int, gen: torch.Generator) -> torch.Tensor:
    return topk_mask(torch.rand(shape, generator=gen), k)


def error_shares(err: torch.Tensor, score: torch.Tensor, frac: float) -> torch.Tensor:
    """err, score: [G, n]; per group, the share of sum(err) carried by the ceil(frac * n)
    tokens with the largest score."""
    k = math.ceil(frac * err.shape[-1])
    m = topk_mask(score, k)
    return (err * m).sum(-1) / err.sum(-1)


# ----------------------------------------------------------------------------- sequences


def load_model(model: str, dtype: str, attn: str):
    path, tok, m = vp.load(model, dtype)
    m.set_attn_implementation(attn)
    return path, tok, m


def label_of(model: str, path: str) -> str:
    return model if model in vp._known() else os.path.basename(path.rstrip("/"))


@torch.no_grad()
def greedy(model, tok, ids: list[int], max_new: int) -> list[int]:
    """The model's greedy continuation (stops at EOS or after max_new tokens)."""
    if max_new <= 0:
        return list(ids)
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                         pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    return out[0].tolist()


class GreedyCache:
    """Greedy continuations memoised in a json file (optional): the error and kl commands
    share the answers of the same prompts, which are the expensive part on a CPU."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self.data = json.loads(self.path.read_text()) if self.path and self.path.exists() else {}

    def get(self, key: str, prompt: list[int], make) -> list[int]:
        got = self.data.get(key)
        if got is not None and got[:len(prompt)] == prompt:
            return got
        got = make()
        if self.path:
            self.data[key] = got
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.data))
        return got


# ----------------------------------------------------------------------------- error command


@torch.no_grad()
def kv_of(model, ids: list[int], attentions: bool = False):
    """K, V per layer ([H_kv, n, D] float32, from past_key_values) and, with `attentions`,
    the attention weights per layer ([H_q, n, n], needs the eager implementation)."""
    out = model(torch.tensor([ids]), use_cache=True, output_attentions=attentions)
    ks = [layer.keys[0].float() for layer in out.past_key_values.layers]
    vs = [layer.values[0].float() for layer in out.past_key_values.layers]
    att = [a[0].float() for a in out.attentions] if attentions else None
    return ks, vs, att


def fp8_scales(kvs: list) -> dict:
    """Per-layer calibrated fp8 scales amax / 448 for K and V over all sequences."""
    layers = len(kvs[0][0])
    out = {"k": [], "v": []}
    for li in range(layers):
        out["k"].append(max(ks[li].abs().max().item() for ks, _ in kvs) / FP8_MAX)
        out["v"].append(max(vs[li].abs().max().item() for _, vs in kvs) / FP8_MAX)
    return out


def token_error(x: torch.Tensor, scheme: str, scale=None) -> torch.Tensor:
    """Squared reconstruction error summed over head_dim: [..., n]."""
    return ((quantize(x, scheme, scale) - x) ** 2).sum(-1)


def attention_output_error(att: torch.Tensor, dv: torch.Tensor, exact: torch.Tensor | None = None) -> float:
    """||A (V^ - V)||^2 summed over query heads, positions and head_dim. att [H_q, n, n],
    dv = V^ - V [H_kv, n, D], exact: [H_kv, n] tokens kept exact (their dv zeroed)."""
    if exact is not None:
        dv = dv * (~exact)[..., None]
    groups = att.shape[0] // dv.shape[0]
    dvq = dv.repeat_interleave(groups, dim=0)
    return float(((att @ dvq) ** 2).sum().item())


def analyse_sequence(ks, vs, att, scales, schemes, fractions, gen: torch.Generator) -> dict:
    """Per-layer numbers of one sequence: per scheme, per-token errors of K and V, their
    shares over the top fractions, and the attention-output errors."""
    layers = []
    for li, (k, v) in enumerate(zip(ks, vs)):
        h, n, _ = v.shape
        rv, rk = value_range(v), value_range(k)
        att_mass = None
        if att is not None:
            g = att[li].shape[0] // h
            att_mass = att[li].sum(1).reshape(h, g, n).sum(1)  # attention each token receives
        row = {"range_v": rv, "range_k": rk, "schemes": {}}
        exact_sets = {}
        for frac in fractions:
            kk = math.ceil(frac * n)
            exact_sets[frac] = {
                "top_range": topk_mask(rv, kk),
                "random": random_mask((h, n), kk, gen),
                **({"top_attention": topk_mask(att_mass, kk)} if att_mass is not None else {}),
            }
        for s in schemes:
            ev = token_error(v, s, scales["v"][li] if s == "fp8cal" else None)
            ek = token_error(k, s, scales["k"][li] if s == "fp8cal" else None)
            srow = {"err_v": ev, "err_k": ek}
            if att is not None:
                dv = quantize(v, s, scales["v"][li] if s == "fp8cal" else None) - v
                total = attention_output_error(att[li], dv)
                srow["att_err"] = total
                srow["att_err_kept"] = {
                    frac: {name: attention_output_error(att[li], dv, m) for name, m in sets.items()}
                    for frac, sets in exact_sets.items()}
            row["schemes"][s] = srow
        layers.append(row)
    return layers


def summarize_errors(per_seq: list, schemes, fractions) -> dict:
    layers = len(per_seq[0])
    out = {}
    for s in schemes:
        res = {"spearman_v": [], "spearman_k": [], "share_v": {}, "share_k_by_range_v": {},
               "share_k_by_range_k": {}, "share_v_oracle": {}, "att_removed": {}, "per_layer": []}
        groups_ev, groups_rv, groups_ek, groups_rk = [], [], [], []
        for li in range(layers):
            # sequences differ in length: one group per (sequence, KV head)
            gev = [g for seq in per_seq for g in seq[li]["schemes"][s]["err_v"]]
            grv = [g for seq in per_seq for g in seq[li]["range_v"]]
            gek = [g for seq in per_seq for g in seq[li]["schemes"][s]["err_k"]]
            grk = [g for seq in per_seq for g in seq[li]["range_k"]]
            groups_ev += gev
            groups_rv += grv
            groups_ek += gek
            groups_rk += grk
            lrow = {"layer": li,
                    "spearman_v": st.mean(_spearman(e, r) for e, r in zip(gev, grv)),
                    "share_v": {}, "att_removed": {}}
            for frac in fractions:
                lrow["share_v"][f"{frac:g}"] = st.mean(
                    error_shares(e[None], r[None], frac).item() for e, r in zip(gev, grv))
            if "att_err" in per_seq[0][li]["schemes"][s]:
                tot = sum(seq[li]["schemes"][s]["att_err"] for seq in per_seq)
                for frac in fractions:
                    kept = {name: sum(seq[li]["schemes"][s]["att_err_kept"][frac][name] for seq in per_seq)
                            for name in per_seq[0][li]["schemes"][s]["att_err_kept"][frac]}
                    lrow["att_removed"][f"{frac:g}"] = {name: (1 - v / tot) if tot > 0 else float("nan")
                                                        for name, v in kept.items()}
            res["per_layer"].append(lrow)
        res["spearman_v"] = _stats([_spearman(e, r) for e, r in zip(groups_ev, groups_rv)])
        res["spearman_k_vs_range_k"] = _stats([_spearman(e, r) for e, r in zip(groups_ek, groups_rk)])
        res["spearman_k_vs_range_v"] = _stats([_spearman(e, r) for e, r in zip(groups_ek, groups_rv)])
        del res["spearman_k"]
        for frac in fractions:
            key = f"{frac:g}"
            res["share_v"][key] = _stats([error_shares(e[None], r[None], frac).item()
                                          for e, r in zip(groups_ev, groups_rv)])
            res["share_v_oracle"][key] = _stats([error_shares(e[None], e[None], frac).item()
                                                 for e in groups_ev])
            res["share_k_by_range_v"][key] = _stats([error_shares(e[None], r[None], frac).item()
                                                     for e, r in zip(groups_ek, groups_rv)])
            res["share_k_by_range_k"][key] = _stats([error_shares(e[None], r[None], frac).item()
                                                     for e, r in zip(groups_ek, groups_rk)])
            if res["per_layer"][0]["att_removed"]:
                names = res["per_layer"][0]["att_removed"][key]
                res["att_removed"][key] = {name: _stats([lr["att_removed"][key][name] for lr in res["per_layer"]])
                                           for name in names}
        res["binned_v"] = _binned(groups_ev, groups_rv)
        res["binned_k"] = _binned(groups_ek, groups_rk)
        res["groups"] = len(groups_ev)
        out[s] = res
    return out


def _stats(xs: list[float]) -> dict:
    t = torch.tensor([x for x in xs if not math.isnan(x)], dtype=torch.float64)
    if len(t) == 0:
        return {"mean": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"mean": t.mean().item(), "median": t.median().item(), "min": t.min().item(),
            "max": t.max().item(), "n": len(t)}


BINS = (0, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, float("inf"))


def _normalised(errs, ranges):
    x = torch.cat([r / r.median() for r in ranges])
    y = torch.cat([e / e.mean() if e.mean() > 0 else e for e in errs])
    return x, y


def _binned(errs, ranges) -> list[dict]:
    """Mean of error / group mean over bins of range / group median (group = one sequence,
    layer and KV head)."""
    x, y = _normalised(errs, ranges)
    rows = []
    for lo, hi in zip(BINS[:-1], BINS[1:]):
        m = (x >= lo) & (x < hi)
        if m.any():
            rows.append({"range_over_median": [lo, hi], "tokens": int(m.sum()),
                         "mean_err_over_mean": y[m].mean().item()})
    return rows


def plot_errors(per_seq, schemes, path: Path, title: str, seed: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gen = torch.Generator().manual_seed(seed)
    fig, axes = plt.subplots(2, len(schemes), figsize=(3.6 * len(schemes), 7), squeeze=False)
    layers = len(per_seq[0])
    for ci, s in enumerate(schemes):
        for ri, (ekey, rkey, name) in enumerate((("err_v", "range_v", "V"), ("err_k", "range_k", "K"))):
            errs = [g for seq in per_seq for li in range(layers) for g in seq[li]["schemes"][s][ekey]]
            ranges = [g for seq in per_seq for li in range(layers) for g in seq[li][rkey]]
            x, y = _normalised(errs, ranges)
            ok = y > 0
            x, y = x[ok], y[ok]
            idx = torch.randperm(len(x), generator=gen)[:20000]
            ax = axes[ri][ci]
            ax.scatter(x[idx], y[idx], s=1, alpha=0.15, rasterized=True)
            edges = torch.logspace(math.log10(max(x.min().item(), 1e-3)), math.log10(x.max().item()), 16)
            cx, cy = [], []
            for lo, hi in zip(edges[:-1], edges[1:]):
                m = (x >= lo) & (x < hi)
                if m.sum() >= 20:
                    cx.append(math.sqrt(lo * hi))
                    cy.append(y[m].mean().item())
            ax.plot(cx, cy, "r-o", ms=3, label="binned mean")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(f"{s}: {name}", fontsize=9)
            ax.set_xlabel(f"Range({name.lower()}) / median of its (seq, layer, head)", fontsize=8)
            if ci == 0:
                ax.set_ylabel("token error / mean of its group", fontsize=8)
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def cmd_error(a) -> dict:
    t0 = time.time()
    path, tok, model = load_model(a.model, a.dtype, "eager")
    label = label_of(a.model, path)
    seqs = vp.gsm_prompts(tok, a.prompts, a.seed)
    cache = GreedyCache(a.greedy_cache)
    for i, ids in enumerate(seqs):
        # the accuracy harness' problem id of the same question (same seed, same prompt ids)
        seqs[i] = cache.get(f"{label}|{a.gen_tokens}|gsm_symbolic-{a.seed}-{i}", ids,
                            lambda: greedy(model, tok, ids, a.gen_tokens))
        print(f"[kv_quant] sequence {i + 1}/{len(seqs)}: {len(ids)} prompt + {len(seqs[i]) - len(ids)} "
              f"generated tokens ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    kvs = [kv_of(model, ids)[:2] for ids in seqs]
    scales = fp8_scales(kvs)
    amax = {"k": max(ks[li].abs().max().item() for ks, _ in kvs for li in range(len(ks))),
            "v": max(vs[li].abs().max().item() for _, vs in kvs for li in range(len(vs)))}
    del kvs
    gen = torch.Generator().manual_seed(a.seed)
    per_seq = []
    for ids in seqs:
        ks, vs, att = kv_of(model, ids, attentions=True)
        per_seq.append(analyse_sequence(ks, vs, att, scales, ERROR_SCHEMES, FRACTIONS, gen))
        del att
    summary = summarize_errors(per_seq, ERROR_SCHEMES, FRACTIONS)
    cfg = model.config
    result = {
        "model": path, "label": label, "dtype": a.dtype,
        "source": f"{a.prompts} gsm_symbolic prompts (seed {a.seed}) + up to {a.gen_tokens} greedy tokens each",
        "sequence_lengths": [len(s) for s in seqs],
        "layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads,
        "head_dim": vs[0].shape[-1], "fractions": list(FRACTIONS),
        "abs_max": amax, "fp8cal_scales": scales, "schemes": summary,
        "seconds": round(time.time() - t0, 1),
        "command": "python benchmarks/kv_quant.py " + " ".join(sys.argv[1:]) if a.record_argv else None,
    }
    out = Path(a.out or f"docs/results/kv_quant/{label}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "error.json").write_text(json.dumps(result, indent=1))
    plot_errors(per_seq, ERROR_SCHEMES, out / "error_vs_range.png",
                f"{label}: per-token quantization error vs range; {result['source']}", a.seed)
    print_errors(result)
    print(f"wrote {out}/error.json, error_vs_range.png ({result['seconds']} s)")
    return result


def print_errors(result: dict) -> None:
    fr = [f"{f:g}" for f in result["fractions"]]
    print(f"{'scheme':>7} {'rho(errV,Rv)':>12} " + " ".join(
        f"{'V share top ' + f:>16} {'K share top ' + f:>16} {'attO removed rng/rand/att ' + f:>32}" for f in fr))
    for s, r in result["schemes"].items():
        cells = []
        for f in fr:
            att = r["att_removed"].get(f, {})
            cells.append(f"{r['share_v'][f]['mean']:>16.3f} {r['share_k_by_range_v'][f]['mean']:>16.3f} "
                         + f"{att.get('top_range', {}).get('mean', float('nan')):>10.3f}/"
                         f"{att.get('random', {}).get('mean', float('nan')):.3f}/"
                         f"{att.get('top_attention', {}).get('mean', float('nan')):.3f}".rjust(32))
        print(f"{s:>7} {r['spearman_v']['mean']:>12.3f} " + " ".join(cells))


# ----------------------------------------------------------------------------- KL command


class QuantState:
    """What the registered attention function does: the active arm, the prompt length (queries
    before it attend to exact K/V), fp8cal scales, and the selections it made per layer."""

    def __init__(self):
        self.arm = "none"
        self.prompt_len = 0
        self.scales = None
        self.seed = 0
        self.selected: dict[int, torch.Tensor] = {}

    def selection(self, li: int, spec: str, value: torch.Tensor) -> torch.Tensor:
        """[H, n] tokens a mixed spec keeps in bf16 (the causal running rule, see the module
        docstring); the same for K and V of one arm."""
        kind, f = spec.split(":")
        v = value[0].float()  # [H, n, D]
        if kind == "mix-range":
            priority = value_range(v)
        elif kind == "mix-random":
            gen = torch.Generator().manual_seed(self.seed * 1000 + li)
            priority = torch.rand(v.shape[:2], generator=gen)
        else:
            raise ValueError(f"unknown mixed spec {spec!r}")
        keep = running_top(priority, float(f))
        self.selected[li] = keep
        return keep

    def quantize_kv(self, li: int, key: torch.Tensor, value: torch.Tensor):
        out = []
        for x, spec, name in zip((key, value), arm_sides(self.arm), "kv"):
            if spec.startswith("mix-"):
                m = self.selection(li, spec, value)[None, :, :, None]
                out.append(torch.where(m, fake_bf16(x), fake_int(x, 4)))
            else:
                scale = self.scales[name][li] if spec == "fp8cal" else None
                out.append(quantize(x, spec, scale))
        return tuple(out)


STATE = QuantState()
ATTN_NAME = "vase_kvq"


def kvq_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    base = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if STATE.arm == "none":
        return base(module, query, key, value, attention_mask, **kwargs)
    kq, vq = STATE.quantize_kv(module.layer_idx, key, value)
    out_q, _ = base(module, query, kq, vq, attention_mask, **kwargs)
    p = STATE.prompt_len
    if p > 0:
        out_e, _ = base(module, query, key, value, attention_mask, **kwargs)
        out_q = torch.cat([out_e[:, :p], out_q[:, p:]], dim=1)  # [B, n, H, D]
    return out_q, None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_NAME, kvq_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)


@torch.no_grad()
def logits_of(model, ids: list[int], start: int = 1) -> torch.Tensor:
    """Logits at positions start-1 .. n-1 (the LM head only runs there)."""
    out = model(torch.tensor([ids]), use_cache=False, logits_to_keep=len(ids) - start + 1)
    return out.logits[0].float()


def compare(full: torch.Tensor, arm: torch.Tensor) -> dict:
    """KL(full || arm) over the full vocabulary and top-1 agreement, summed over the rows of
    logits_of(.., start) but the last: the predictions of tokens start .. n-1."""
    lp = torch.log_softmax(full[:-1].double(), -1)
    lq = torch.log_softmax(arm[:-1].double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0)
    agree = (lp.argmax(-1) == lq.argmax(-1)).double()
    return {"kl_sum": kl.sum().item(), "top1_sum": agree.sum().item(), "tokens": len(kl),
            "kl_max": kl.max().item()}


@torch.no_grad()
def calibrate(model, seqs: list[list[int]]) -> dict:
    kvs = [kv_of(model, ids)[:2] for ids in seqs]
    return fp8_scales(kvs)


def cmd_kl(a) -> dict:
    from benchmarks.accuracy import load_problems, prompt_ids

    t0 = time.time()
    register()
    path, tok, model = load_model(a.model, a.dtype, "sdpa")
    label = label_of(a.model, path)
    out = Path(a.out or f"docs/results/kv_quant/{label}")
    out.mkdir(parents=True, exist_ok=True)
    problems = load_problems("gsm_symbolic", a.n, a.seed)
    calib_problems = load_problems("gsm_symbolic", a.calib, a.seed + 1)
    scales = calibrate(model, [prompt_ids(tok, p) for p in calib_problems])
    arms = a.arms.split(",")
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    head_dim = getattr(model.config, "head_dim", None) or head_dim
    cache = GreedyCache(a.greedy_cache)
    rows = []
    model.set_attn_implementation(ATTN_NAME)
    STATE.scales = scales
    for pi, prob in enumerate(problems):
        t1 = time.time()
        pids = prompt_ids(tok, prob)
        STATE.arm, STATE.prompt_len = "none", 0
        ids = cache.get(f"{label}|{a.max_new}|{prob['pid']}", pids,
                        lambda: greedy(model, tok, pids, a.max_new))
        t_gen = time.time() - t1
        STATE.arm, STATE.prompt_len = "none", len(pids)
        full = logits_of(model, ids, len(pids))
        row = {"pid": prob["pid"], "prompt_tokens": len(pids), "answer_tokens": len(ids) - len(pids),
               "answer_correct": None, "arms": {}}
        from benchmarks.accuracy import extract_answer, is_right

        row["answer_correct"] = is_right(extract_answer(tok.decode(ids[len(pids):], skip_special_tokens=True)),
                                         prob["answer"])
        for arm in arms:
            STATE.arm, STATE.seed, STATE.selected = arm, a.seed * 100003 + pi, {}
            got = compare(full, logits_of(model, ids, len(pids)))
            if is_mixed(arm):
                sel = torch.stack([STATE.selected[li].float() for li in sorted(STATE.selected)])
                got["protected_fraction"] = sel.mean().item()
                got["protected_fraction_answer"] = sel[..., len(pids):].mean().item()
            row["arms"][arm] = got
        STATE.arm = "none"
        rows.append(row)
        print(f"[kv_quant] problem {pi + 1}/{len(problems)}: {len(pids)} + {row['answer_tokens']} tokens, "
              f"greedy {t_gen:.0f} s, arms {time.time() - t1 - t_gen:.0f} s; " + ", ".join(
                  f"{arm} {r['kl_sum'] / max(1, r['tokens']):.4f}" for arm, r in row["arms"].items()),
              file=sys.stderr, flush=True)
    result = {"model": path, "label": label, "dtype": a.dtype, "problems": len(rows),
              "source": f"gsm_symbolic n={a.n} seed={a.seed}, greedy answers up to {a.max_new} tokens "
                        f"teacher-forced; fp8cal scales from the prompts of {a.calib} problems (seed {a.seed + 1})",
              "head_dim": head_dim, "fp8cal_scales": scales,
              "arms": summarize_kl(rows, arms, head_dim, a.boot_iters, a.seed), "rows": rows,
              "command": "python benchmarks/kv_quant.py " + " ".join(sys.argv[1:]) if a.record_argv else None,
              "seconds": round(time.time() - t0, 1)}
    name = f"kl_{a.tag}.json" if a.tag else "kl.json"
    (out / name).write_text(json.dumps(result, indent=1))
    print_kl(result)
    print(f"wrote {out}/{name} ({result['seconds']} s)")
    return result


def summarize_kl(rows: list[dict], arms: list[str], head_dim: int, iters: int, seed: int) -> dict:
    counts = [r["arms"][arms[0]]["tokens"] for r in rows] if arms else []
    out = {}
    for arm in arms:
        kls = [r["arms"][arm]["kl_sum"] for r in rows]
        t1 = [r["arms"][arm]["top1_sum"] for r in rows]
        m, lo, hi = st.cluster_bootstrap(kls, counts, iters, seed)
        tm, tlo, thi = st.cluster_bootstrap(t1, counts, iters, seed)
        frac = None
        if is_mixed(arm):
            frac = sum(r["arms"][arm]["protected_fraction"] * (r["prompt_tokens"] + r["answer_tokens"])
                       for r in rows) / sum(r["prompt_tokens"] + r["answer_tokens"] for r in rows)
        out[arm] = {"kl": [m, lo, hi], "top1": [tm, tlo, thi], "tokens": sum(counts),
                    "protected_fraction": frac, "bytes_per_token": arm_bytes(arm, head_dim, frac)}
    for arm in (a for a in arms if "mix-range:" in a):
        f = arm.split("mix-range:")[1].split("/")[0]
        refs = {"kl_minus_random": arm.replace("mix-range", "mix-random"), "kl_minus_int4": "int4",
                "kl_minus_int4g32": "int4g32", "kl_minus_uniform": arm.replace(f"mix-range:{f}", "int4")}
        for key, ref in refs.items():
            if ref in arms and ref != arm and not (key == "kl_minus_uniform" and ref == "int4"):
                d = st.paired_cluster_bootstrap([r["arms"][arm]["kl_sum"] for r in rows],
                                                [r["arms"][ref]["kl_sum"] for r in rows], counts, iters, seed)
                out[arm][key] = list(d) + [ref]
    return out


def print_kl(result: dict) -> None:
    print(f"{'arm':>18} {'B/token/head':>12} {'KL(full||arm) [95% CI]':>30} {'top-1 agree':>24}")
    for arm, r in result["arms"].items():
        kl, t = r["kl"], r["top1"]
        print(f"{arm:>18} {r['bytes_per_token']:>12.1f} {kl[0]:>10.5f} [{kl[1]:.5f}, {kl[2]:.5f}] "
              f"{t[0]:>10.4f} [{t[1]:.4f}, {t[2]:.4f}]")
        for key in ("kl_minus_random", "kl_minus_int4", "kl_minus_int4g32", "kl_minus_uniform"):
            if key in r:
                d = r[key]
                print(f"{'':>18} KL - KL({d[4]}): {d[0]:+.5f} [{d[1]:+.5f}, {d[2]:+.5f}] p={d[3]:.3f}")


# ----------------------------------------------------------------------------- CLI


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("error", "kl"):
        p = sub.add_parser(name)
        p.add_argument("--model", default="qwen2.5-0.5b",
                       help="HF model folder, or a name known to vase_sglang.serving.models")
        p.add_argument("--seed", type=int, default=123)
        p.add_argument("--dtype", default="float32")
        p.add_argument("--threads", type=int, default=1)
        p.add_argument("--out", default=None, help="default: docs/results/kv_quant/<model>")
        p.add_argument("--greedy-cache", default=None,
                       help="json file memoising the greedy answers (e.g. results/kv_quant/greedy.json)")
        if name == "error":
            p.add_argument("--prompts", type=int, default=4)
            p.add_argument("--gen-tokens", type=int, default=200)
        else:
            p.add_argument("--n", type=int, default=16, help="gsm_symbolic problems")
            p.add_argument("--max-new", type=int, default=256, help="greedy answer cap")
            p.add_argument("--calib", type=int, default=4, help="problems whose prompts calibrate fp8cal")
            p.add_argument("--arms", default=",".join(KL_ARMS))
            p.add_argument("--boot-iters", type=int, default=10000)
            p.add_argument("--tag", default="", help="write kl_TAG.json instead of kl.json")
    a = ap.parse_args(argv)
    a.record_argv = argv is None
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    return cmd_error(a) if a.cmd == "error" else cmd_kl(a)


if __name__ == "__main__":
    main()
