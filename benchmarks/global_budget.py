"""Global vs per-head budgets, measured on the transformers reference (issues 15 and 52).

    python benchmarks/global_budget.py --model-path M --gates G.safetensors \\
        --records results/accuracy --n 40 --budget 64 --window 16 --out results/global_budget \\
        [--policies trimkv,vase-attnv --scopes head,layer,global]

TRIM-KV's global follow-up ("Make Each Token Count", arXiv 2605.09649) lets the tokens of all
layers and KV heads compete for one budget. SGLang's pool cannot free memory that way (one slot
spans every layer and head; docs/retention.md), so before any redesign we measure what it would
buy, here, where unequal heads are cheap: every token stays in the transformers KV cache and a
per-(layer, KV head) mask hides the evicted ones from attention.

Rows of one batch share the forced tokens (the full cache's greedy output from the accuracy
harness' records) and differ only in what they hide. Per policy, three scopes of one budget:
  full                 nothing: the teacher-forced full cache, the KL reference
  <policy> per-head    the policy as served: at each eviction every (layer, KV head) keeps
                       K = T - R of its candidates (the newest R are not candidates)
  <policy> layer       each layer keeps H · K, its KV heads competing (equal per-layer totals)
  <policy> global      L · H · K over all (layer, head) together
  (", floor f": each head first keeps its f best; trimkv only, f = 0 when not named)
trimkv ranks by log β · age (deterministic top-k). vase-attnv per-head is the served policy
(`select_tokens` on each head's candidates: Range(v) slots, then sampling ∝ window attention
with softmax over the candidates). Its layer and global rows make the scores comparable across
heads as AdaKV does: the window queries' softmax runs over every key they see (prompt,
candidates, window), so a head that attends elsewhere offers less mass; each head keeps its
N_v value slots (and sinks), and the rest of the scope's budget is one Gumbel-top-k draw
(sampling without replacement ∝ score) over the scope's candidates together.
Evictions happen at the served schedule (the private cache reaches T + R, then every R tokens),
so every row holds the same number of tokens at every step: the same memory. Between two
evictions the R new tokens are processed in one forward (causal within it), which is exactly
what R single-token steps compute. Each per-head row equals `ReferenceDecoder` with the same
policy (gates, request key; tests/test_global_budget.py), so the comparison is the served
policy against its global twins. The draws of problem i are keyed as request i.

Metrics per token after the first eviction, against the full row: KL(full || row) (exact, whole
vocabulary), NLL excess of the forced token, top-1 agreement; 95% bootstrap intervals over
problems and the paired difference global − per-head (benchmarks/accuracy_stats.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import accuracy_stats as st  # noqa: E402
from vase_sglang import ops  # noqa: E402
from vase_sglang.config import EvictionConfig  # noqa: E402
from vase_sglang.policies import (  # noqa: E402
    POLICIES, Draws, Retention, VaseAttnVPolicy, needs_gates, select_tokens, top_indices)
from vase_sglang.rows import owned_prompt  # noqa: E402
from vase_sglang.serving.hf_reference import attention_params, round_cache_writes  # noqa: E402

MASKED_ATTENTION = "vase_masked_heads"


class _Masks:
    """What the masked attention reads: alive[layer] bool [B, H_kv, capacity] (None: plain
    causal), and where it leaves the last `window` queries of each layer's latest forward."""

    alive: list[torch.Tensor] | None = None
    queries: dict | None = None  # layer -> [B, H_q, window, D], post-RoPE
    window: int = 0


_MASKS = _Masks()


def masked_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Causal attention over the whole cache in which a hidden key of a (row, KV head) gets no
    weight. Physical cache index = true position: nothing is ever removed from the cache."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if _MASKS.queries is not None and q_len >= _MASKS.window:
        _MASKS.queries[module.layer_idx] = query[:, :, q_len - _MASKS.window:].detach()
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


def schedule(steps: int, budget: int, window: int, private: int = 0) -> list[list[int]]:
    """The teacher-forced steps grouped into forwards: [[0], [1, ..], ..]; an eviction runs
    before each group but the first two. Mirrors ReferenceDecoder.run (page size 1): step 0 is
    the prefill, step s >= 1 feeds forced[s - 1]; after step s >= 1, if the private cache holds
    budget + window tokens, it is cut to budget. `private`: the private tokens after the
    prefill (0: the radix tree owns the prompt; the prompt's length without the radix cache)."""
    groups, current = [[0]], []
    for step in range(1, steps):
        current.append(step)
        private += 1
        if step < steps - 1 and private >= budget + window:
            groups.append(current)
            current, private = [], budget
    if current:
        groups.append(current)
    return groups


SCOPES = {"head": "per-head", "layer": "layer", "global": "global"}


def keep_mask(scores: torch.Tensor, keep: int, mode: str, floor: int = 0) -> torch.Tensor:
    """scores [L, H, n] (-inf: not a candidate, +inf: kept whatever) -> bool [L, H, n], the kept
    candidates. per-head: the `keep` largest of each (layer, head). layer: the H·keep largest of
    each layer's heads together. global: the L·H·keep largest of all. In the last two, each head
    first keeps its `floor` largest (floor >= keep gives per-head)."""
    if mode == "layer":
        return torch.cat([keep_mask(scores[i:i + 1], keep, "global", floor)
                          for i in range(scores.shape[0])])
    cand = torch.isfinite(scores) | (scores == float("inf"))
    L, H, n = scores.shape
    if mode == "per-head":
        idx = top_indices(scores, keep)
        kept = torch.zeros_like(cand).scatter_(-1, idx, True)
        return kept & cand
    if mode != "global":
        raise ValueError(f"mode: per-head, layer or global, got {mode!r}")
    f = min(floor, keep)
    forced = torch.zeros_like(cand)
    if f > 0:
        forced.scatter_(-1, top_indices(scores, f), True)
        forced &= cand
    bonus = scores.masked_fill(forced, float("inf"))
    total = min(L * H * keep, int(cand.sum()))
    flat = top_indices(bonus.flatten(), total)
    kept = torch.zeros(L * H * n, dtype=torch.bool, device=scores.device)
    kept[flat] = True
    return kept.view(L, H, n) & cand


@dataclass(frozen=True)
class Row:
    """One batch row: a policy (or "full") at a budget scope."""

    policy: str
    scope: str = "per-head"  # per-head, layer or global
    floor: int = 0
    # tensor parallel: the KV heads split into `ranks` equal shares, each competing within its
    # own share of a layer or global budget (what a tp = ranks server selects)
    ranks: int = 1

    @property
    def name(self) -> str:
        if self.policy == "full":
            return "full"
        return (f"{self.policy} {self.scope}" + (f", floor {self.floor}" if self.floor else "")
                + (f", {self.ranks} ranks" if self.ranks > 1 else ""))

    @classmethod
    def of(cls, mode) -> "Row":
        """A Row, or the trimkv-only form (scope, floor) of the first version."""
        if isinstance(mode, Row):
            return mode
        scope, floor = mode
        return cls("full") if scope == "full" else cls("trimkv", scope, floor)


class MaskedBudgetRun:
    """Teacher-forced eviction on the transformers reference, one batch row per (policy, scope).
    `gates` are needed for trimkv rows only."""

    def __init__(self, model, gates=None, *, budget: int, window: int, sinks: int = 4,
                 seed: int = 0, protect_prompt: bool = True, kv_dtype: torch.dtype | None = None,
                 page_size: int = 1):
        """protect_prompt=False: the prompt is private and evicted too (a server with
        --disable-radix-cache); page_size: the radix tree owns the prompt's whole pages only
        (its partial last page is private, as served); kv_dtype: the dtype K/V are cached in
        (an fp8 cache with scale 1, as ReferenceDecoder's), None: the model's."""
        self.protect_prompt, self.kv_dtype, self.page_size = protect_prompt, kv_dtype, page_size
        self.model = model.eval()
        self.gates = None
        if gates is not None:
            from vase_sglang.gates import RetentionGates, load_gates

            self.gates = gates if isinstance(gates, RetentionGates) else load_gates(gates, model.config)
        self.budget, self.window, self.sinks, self.seed = budget, window, sinks, seed
        cfg = model.config
        self.layers = cfg.num_hidden_layers
        self.kv_heads = cfg.num_key_value_heads
        self.attention = attention_params(model)
        install(model)

    def config(self, policy: str) -> EvictionConfig:
        return EvictionConfig(policy=policy, budget=self.budget, window=self.window,
                              sinks=self.sinks, seed=self.seed)

    @torch.no_grad()
    def run(self, prompt_ids: list[int], forced_ids: list[int], modes, request_key: int = 0):
        """modes: a Row per batch row (or (scope, floor) for trimkv). Returns per row the
        log-softmax of each step's next-token distribution [steps, V] (float32) and, per
        eviction, the kept older tokens per (layer, head) of each row (None for full)."""
        from contextlib import nullcontext

        from transformers import DynamicCache

        from vase_sglang.gates import recording_log_beta

        rows = [Row.of(m) for m in modes]
        if any(needs_gates(r.policy) for r in rows) and self.gates is None:
            raise ValueError(f"rows of {[r.policy for r in rows if needs_gates(r.policy)]} "
                             "score from retention gates: pass gates")
        P, steps = len(prompt_ids), len(forced_ids)
        B, L, H = len(rows), self.layers, self.kv_heads
        cap = P + steps
        alive = [torch.zeros(B, H, cap, dtype=torch.bool) for _ in range(L)]
        log_beta = [torch.zeros(B, H, cap) for _ in range(L)] if self.gates is not None else None
        sink: dict = {}
        cache = DynamicCache()
        if self.kv_dtype is not None:
            round_cache_writes(cache, self.kv_dtype)
        out = torch.empty(B, steps, self.model.config.vocab_size)
        counts = []
        _MASKS.alive, _MASKS.queries, _MASKS.window = alive, {}, self.window
        retention = (recording_log_beta(self.model, self.gates, sink) if self.gates is not None
                     else nullcontext())
        rounds = 0
        try:
            with retention:
                for gi, group in enumerate(schedule(steps, self.budget, self.window,
                                                          P - self._protected(P))):
                    if gi >= 2:
                        state = _State(cache, alive, log_beta, _MASKS.queries, P,
                                       P + group[0] - 1, request_key, rounds)
                        counts.append(self._evict(state, rows))
                        rounds += 1
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
                    if log_beta is not None:
                        for layer in range(L):
                            log_beta[layer][:, :, pos] = sink[layer].transpose(1, 2)
                    out_rows = logits[:, -1:] if group == [0] else logits
                    out[:, group[0]: group[0] + out_rows.shape[1]] = torch.log_softmax(
                        out_rows.float(), -1)
        finally:
            _MASKS.alive, _MASKS.queries = None, None
        return out, counts

    def _evict(self, state: "_State", rows: list[Row]):
        """Cut every non-full row back to the budget before the token at position `now`."""
        L, H = self.layers, self.kv_heads
        keep = self.budget - self.window
        P, now = state.P, state.now
        # candidates: private, older than the window; a protected prompt holds the sinks
        lo = self._protected(P)
        hi = now - self.window
        sinks = max(0, self.sinks - lo)
        kept_counts = []
        for b, row in enumerate(rows):
            if row.policy == "full":
                kept_counts.append(None)
                continue
            cand = torch.stack([state.alive[layer][b, :, lo:hi] for layer in range(L)])  # [L, H, n]
            if needs_gates(row.policy):
                # the policy's own score of log β and age (trimkv: log β · age), for every
                # (layer, head) at once
                log_beta = torch.stack([state.log_beta[layer][b, :, lo:hi] for layer in range(L)])
                age = (now - torch.arange(lo, hi)).float()
                policy = POLICIES[row.policy](self.config(row.policy),
                                              retention=Retention(log_beta, age))
                scores = policy.score_streamed(log_beta, None, None).float().clone()
                scores[..., :sinks] = float("inf")  # sinks: always kept, counted in K
                scores = scores.masked_fill(~cand, float("-inf"))
                share = H // row.ranks  # each rank's KV heads compete among themselves
                kept = torch.cat([keep_mask(scores[:, r * share:(r + 1) * share], keep,
                                            row.scope, row.floor)
                                  for r in range(row.ranks)], dim=1)
            elif row.ranks > 1:
                raise ValueError(f"{row.name}: ranks are built for retention rows (trimkv)")
            elif row.scope == "per-head":
                kept = self._served_per_head(state, b, row.policy, cand, lo, sinks)
            else:
                kept = self._pooled(state, b, row, cand, lo, sinks, keep)
            before = sum(int(a[b, :, lo:now].sum()) for a in state.alive)
            for layer in range(L):
                state.alive[layer][b, :, lo:hi] = kept[layer]
            after = sum(int(a[b, :, lo:now].sum()) for a in state.alive)
            # the same memory in every row: L · H · budget private tokens after the cut
            if after != L * H * self.budget:
                raise AssertionError(f"{row.name}: {after} private tokens kept (from {before}), "
                                     f"expected {L * H * self.budget}")
            kept_counts.append(kept.sum(-1))
        return kept_counts

    def _protected(self, P: int) -> int:
        """The prompt tokens the radix tree owns: its whole pages (none without it)."""
        return owned_prompt(P, self.page_size, self.protect_prompt)

    def _compact(self, cand: torch.Tensor):
        """Each (layer, head)'s candidates in position order, padded: positions [L, H, m]
        (offsets from lo; pads point at 0) and valid [L, H, m]."""
        n_of = cand.sum(-1)
        m = int(n_of.max())
        order = torch.sort((~cand).to(torch.int8), dim=-1, stable=True).indices[..., :m]
        valid = torch.arange(m)[None, None, :] < n_of[..., None]
        return order.masked_fill(~valid, 0), valid

    def _gather(self, state, b, positions, lo, name):
        """[L, H, m, D] keys or values of row b at candidate offsets `positions`."""
        rows = []
        for layer, lay in enumerate(state.cache.layers):
            full = getattr(lay, name)[b]  # [H, cached, D]
            idx = (positions[layer] + lo)[..., None].expand(-1, -1, full.shape[-1])
            rows.append(torch.gather(full, 1, idx))
        return torch.stack(rows)

    def _served_per_head(self, state, b, policy, cand, lo, sinks):
        """The served policy on each head's own candidates (equal counts per head)."""
        positions, valid = self._compact(cand)
        if not bool(valid.all()):
            raise AssertionError(f"{policy} per-head: heads hold unequal candidate counts")
        keys = self._gather(state, b, positions, lo, "keys")
        values = self._gather(state, b, positions, lo, "values")
        queries = torch.stack([state.queries[layer][b] for layer in range(self.layers)])
        keep = select_tokens(self.config(policy), keys, values, queries,
                             request=state.request_key, layer=torch.arange(self.layers),
                             round=state.rounds, sinks=sinks, attention=self.attention)
        kept = torch.zeros_like(cand)
        kept.scatter_(-1, positions.gather(-1, keep), True)
        return kept

    def _pooled(self, state, b, row, cand, lo, sinks, keep):
        """vase-attnv over a layer's or all heads: AdaKV-normalised window attention, each
        head's sinks and value slots forced, one Gumbel-top-k draw over the scope."""
        if POLICIES.get(row.policy) is not VaseAttnVPolicy:  # its score, rebuilt for a scope
            raise ValueError(f"{row.name}: pooled scopes are built for retention policies "
                             "(trimkv) and vase-attnv")
        cfg = self.config(row.policy)
        positions, valid = self._compact(cand)
        L, H, m = positions.shape
        score = torch.zeros(L, H, m)
        for layer in range(L):
            score[layer] = self._normalised_scores(state, b, layer, cfg, lo)[
                torch.arange(H)[:, None], positions[layer]]
        score = score.masked_fill(~valid, 0.0)
        if cfg.pool_kernel > 1:  # SnapKV's smoothing, along each head's own candidates
            score = F.avg_pool1d(score.reshape(-1, 1, m), cfg.pool_kernel, stride=1,
                                 padding=cfg.pool_kernel // 2).reshape(L, H, m)
        values = self._gather(state, b, positions, lo, "values")
        # the served rule for sinks and value slots (Policy.forced), pads never taking a slot
        forced = VaseAttnVPolicy(cfg)._forced_mask(
            valid.shape, valid.device, sinks,
            lambda: ops.value_range(values).masked_fill(~valid, float("-inf"))) & valid
        draws = Draws.make(cfg.seed, (L,), "cpu", request=state.request_key,
                           layer=torch.arange(L), round=state.rounds)
        rank = score.clamp_min(1e-30).log() + draws.gumbel((H, m))
        rank = rank.masked_fill(forced, float("inf")).masked_fill(~valid, float("-inf"))
        chosen = keep_mask(rank, keep, row.scope, 0)
        # pads point at offset 0 unchosen: add, so they cannot overwrite a chosen candidate 0
        hits = torch.zeros(cand.shape, dtype=torch.int32).scatter_add_(-1, positions,
                                                                      chosen.to(torch.int32))
        return hits > 0

    def _normalised_scores(self, state, b, layer, cfg, lo):
        """[H, now]: the mean over the window's queries (and each KV head's query group) of
        the attention each alive key gets, softmax over every key the query sees (AdaKV)."""
        now = state.now
        keys = state.cache.layers[layer].keys[b, :, :now].float()  # [H, now, D]
        q = state.queries[layer][b].float()  # [H_q, W, D]
        h_q, w, d = q.shape
        H = keys.shape[0]
        q = q.reshape(H, h_q // H * w, d)
        qk = torch.matmul(q, keys.transpose(-1, -2))  # [H, G·W, now]
        scaling = self.attention.scaling if self.attention.scaling is not None else d ** -0.5
        logits = qk * scaling
        if self.attention.softcap:
            logits = self.attention.softcap * torch.tanh(logits / self.attention.softcap)
        logits = logits / cfg.temperature
        qpos = torch.arange(now - w, now).repeat(h_q // H)  # query row r of group g: window r
        allowed = torch.arange(now)[None, :] <= qpos[:, None]  # [G·W, now], causal
        allowed = allowed[None] & state.alive[layer][b, :, None, :now]
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        return probs.mean(dim=1)  # [H, now]


MaskedRetentionRun = MaskedBudgetRun  # the first version's name (trimkv rows only)


@dataclass
class _State:
    """One eviction of one batch: the cache, the masks and who it is for."""

    cache: object
    alive: list
    log_beta: list | None
    queries: dict
    P: int
    now: int
    request_key: int
    rounds: int


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


def _policy_of(name: str) -> str:
    return name.split(" ")[0]


def _per_problem_sums(per_problem: list[dict], name: str, start: int) -> list[dict]:
    out = []
    for r in per_problem:
        x = r["modes"][name]
        out.append({"kl": sum(x["kl"][start:]),
                    "nll_excess": sum(x["nll"][start:]) - sum(x["nll_full"][start:]),
                    "top1_agree": sum(x["top1_agree"][start:]),
                    "count": len(x["kl"][start:])})
    return out


def gain_share(head: list[dict], layer: list[dict], glob: list[dict], iters: int,
               seed: int = 0) -> dict:
    """How much of the global scope's KL gain over per-head the layer scope keeps:
    (KL_head − KL_layer) / (KL_head − KL_global), pooled over tokens, with a percentile
    bootstrap over problems (the decision rule of issue 52: ≥ 0.8 → a within-layer layout).
    Defined only where the global scope gains (KL_global < KL_head): where sharing the budget
    hurts, a ratio of two losses says nothing, so `share` is None and `global_gain` (≤ 0) says
    why."""
    import numpy as np

    kl = {k: np.array([p["kl"] for p in v], dtype=float)
          for k, v in (("head", head), ("layer", layer), ("global", glob))}
    counts = np.array([p["count"] for p in head], dtype=float)

    def share(idx):
        c = counts[idx].sum()
        h, la, g = (kl[k][idx].sum() / c for k in ("head", "layer", "global"))
        return (h - la) / (h - g) if h != g else float("nan")

    everything = np.arange(len(counts))
    c = counts.sum()
    global_gain = float((kl["head"].sum() - kl["global"].sum()) / c)
    if global_gain <= 0:
        return {"share": None, "boot95": [None, None], "global_gain": global_gain}
    point = share(everything)
    idx = np.random.default_rng(seed).integers(0, len(counts), size=(iters, len(counts)))
    boots = np.array([share(i) for i in idx])
    boots = boots[np.isfinite(boots)]
    lo, hi = (np.percentile(boots, [2.5, 97.5]).tolist() if len(boots) else [float("nan")] * 2)
    return {"share": float(point), "boot95": [lo, hi], "global_gain": global_gain}


def summarize(per_problem: list[dict], modes: list[str], start: int, boot_iters: int) -> dict:
    """Pooled means over the tokens after the first eviction, bootstrap over problems; each
    row paired with its policy's per-head row; the layer scope's share of the global gain."""
    summary = {"modes": {}, "pairs": {}, "gain_share": {}}
    sums = {}
    for m in modes:
        per = _per_problem_sums(per_problem, m, start)
        sums[m] = per
        counts = [p["count"] for p in per]
        s = {"n": len(per), "tokens": sum(counts)}
        for metric in ("kl", "nll_excess", "top1_agree"):
            v, lo, hi = st.cluster_bootstrap([p[metric] for p in per], counts, boot_iters)
            s[metric] = v
            s[metric + "_boot95"] = [lo, hi]
        summary["modes"][m] = s
    for m in modes:
        base = f"{_policy_of(m)} per-head"
        if m == base or base not in sums:
            continue
        counts = [p["count"] for p in sums[m]]
        row = {}
        for metric in ("kl", "nll_excess", "top1_agree"):
            d, lo, hi, p = st.paired_cluster_bootstrap(
                [x[metric] for x in sums[m]], [x[metric] for x in sums[base]], counts,
                boot_iters)
            row[metric] = {"diff": d, "boot95": [lo, hi], "p": p,
                           "significant": bool(lo > 0 or hi < 0)}
        summary["pairs"][f"{m} - {base}"] = row
    for policy in dict.fromkeys(_policy_of(m) for m in modes):
        names = [f"{policy} {s}" for s in ("per-head", "layer", "global")]
        if all(n in sums for n in names):
            summary["gain_share"][policy] = gain_share(*(sums[n] for n in names),
                                                       iters=min(boot_iters, 2000))
    return summary


def markdown(summary: dict, cfg: dict) -> str:
    lines = [f"Budget T = {cfg['budget']}, window R = {cfg['window']}, {cfg['n']} problems, "
             f"gates {cfg['gates']} (sha256 {cfg.get('gates_sha256') or '–'}).", "",
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
    if summary.get("gain_share"):
        lines += ["", "| policy | layer scope's share of the global KL gain [95%] |", "|---|---|"]
        for policy, g in summary["gain_share"].items():
            if g["share"] is None:
                lines.append(f"| {policy} | none: the global scope raises KL by "
                             f"{-g['global_gain']:.4f}, nothing to keep a share of |")
            else:
                lines.append(f"| {policy} | {g['share']:.2f} [{g['boot95'][0]:.2f}, "
                             f"{g['boot95'][1]:.2f}] |")
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
    fig.suptitle("one budget per (layer, KV head), per layer, or global: same memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--gates", default=None,
                    help="retention gates file of this model (needed for trimkv rows)")
    ap.add_argument("--policies", default="trimkv",
                    help="comma-separated: trimkv, vase-attnv (default: trimkv)")
    ap.add_argument("--scopes", default="head,layer,global",
                    help="comma-separated budget scopes per policy: head, layer, global")
    ap.add_argument("--records", required=True,
                    help="accuracy harness output folder (records.jsonl or records.jsonl.gz)")
    ap.add_argument("--out", default="results/global_budget")
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--task", default="gsm_symbolic")
    ap.add_argument("--seed", type=int, default=123)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--floors", default=None,
                    help="trimkv's global rows: per-head floors, the candidates each head keeps "
                         "before the global ranking (default: 0 and K/4, K = budget - window)")
    ap.add_argument("--ranks", type=int, default=1,
                    help="also trimkv's global row as tensor parallelism over this many ranks "
                         "serves it (each rank's KV heads share its part of the budget)")
    ap.add_argument("--eviction-seed", type=int, default=0,
                    help="vase-attnv's draws: seed; problem i is request i")
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
    policies = [x for x in a.policies.split(",") if x]
    scopes = [x for x in a.scopes.split(",") if x]
    bad = [x for x in policies if not (needs_gates(x) or POLICIES.get(x) is VaseAttnVPolicy)] + [
        x for x in scopes if x not in SCOPES]
    if bad or not policies or not scopes:
        ap.error(f"--policies trimkv,vase-attnv and --scopes head,layer,global; got {bad}")
    gated = [x for x in policies if needs_gates(x)]
    if gated and not a.gates:
        ap.error(f"--gates: {', '.join(gated)} rows need a gates file")
    gates = a.gates if gated else None
    runner = MaskedBudgetRun(model, gates, budget=a.budget, window=a.window,
                             seed=a.eviction_seed)
    keep = a.budget - a.window
    floors = ([0, keep // 4] if a.floors is None else
              [int(x) for x in a.floors.split(",") if x])
    modes = [Row("full")]
    for policy in policies:
        for scope in scopes:
            if scope == "global" and needs_gates(policy):  # a floor per head: retention rows
                modes += [Row(policy, "global", f) for f in floors]
                if a.ranks > 1:
                    modes.append(Row(policy, "global", 0, a.ranks))
            else:
                modes.append(Row(policy, SCOPES[scope]))
    names = [m.name for m in modes]
    if gates:
        import hashlib

        a.gates_sha256 = hashlib.sha256(Path(gates).read_bytes()).hexdigest()
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
            logp, counts = runner.run(prob["prompt"], prob["forced"], modes,
                                      request_key=problems.index(prob))
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
