"""A plain transformers decode loop with the same eviction semantics as the SGLang plugin.

It is the yardstick of engine faithfulness (served logprobs vs this loop) and the engine of
teacher-forced fidelity measurements. Semantics mirrored from the plugin:
  - the prompt is the protected prefix (the radix tree owns it) unless protect_prompt=False;
    with KV pages of `page_size` tokens the tree owns whole pages only, so the prompt's partial
    last page is private (a candidate like the generated tokens);
  - before decoding a token (not right after the prefill), if the private cache holds
    n + window tokens with n >= budget, the policy keeps budget - window of the n oldest
    private tokens per (layer, KV head);
  - the window queries are the post-RoPE queries of the last `window` processed positions;
  - RoPE positions stay the true positions; draws are keyed by (seed, request key, layer, round)
    and the global KV head (this loop holds every head: offset 0);
  - window-attention scores use the model's own logit scaling and soft-cap (`attention_params`);
  - an 8-bit float KV cache (`kv_dtype=torch.float8_e4m3fn` or `float8_e5m2`, as
    --kv-cache-dtype fp8_e4m3 / fp8_e5m2 with scale 1): every K/V is rounded to that dtype as
    it is cached (SGLang casts it to the pool's dtype when it stores it), and attention and
    scores read the rounded values (torch_native casts them back to the query's dtype);
  - trimkv (`gates=`): log β of every token from the gates when it is processed (attention
    input of each layer), kept per (layer, KV head) with the token's true position and compacted
    with K/V; age = position of the next token - the token's position.

Supports the Llama-style families whose attention calls a module-level
`apply_rotary_pos_emb(q, k, cos, sin)` (Qwen2, Qwen3, Llama): the queries are recorded there.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager

import torch

from ..config import EvictionConfig
from ..policies import POLICIES, AttentionParams, Retention, select_tokens
from ..rows import owned_prompt


def attention_params(model) -> AttentionParams:
    """The logit scaling and tanh soft-cap of a transformers model's attention modules (their
    `scaling` and, for Gemma-2-like models, `attn_logit_softcapping`), equal in every layer."""
    found = {
        (float(m.scaling), float(getattr(m, "attn_logit_softcapping", None) or 0.0), m.head_dim)
        for m in model.modules()
        if hasattr(m, "scaling") and hasattr(m, "layer_idx") and hasattr(m, "head_dim")
    }
    if len(found) != 1:
        raise ValueError(f"model: expected one (scaling, softcap, head_dim) in all attention "
                         f"layers, found {sorted(found) or 'no attention layer'}")
    scaling, softcap, head_dim = found.pop()
    return AttentionParams.of_layer(scaling, softcap, head_dim)


def round_cache_writes(cache, dtype: torch.dtype) -> None:
    """Make `cache` (a transformers Cache) store every new K/V rounded to `dtype` and hand
    attention the rounded values, in the model's dtype: a KV cache kept in `dtype`."""
    update = cache.update

    def rounded(key_states, value_states, *args, **kwargs):
        return update(key_states.to(dtype).to(key_states.dtype),
                      value_states.to(dtype).to(value_states.dtype), *args, **kwargs)

    cache.update = rounded


class ReferenceDecoder:
    def __init__(self, model, cfg: EvictionConfig, *, protect_prompt: bool = True,
                 page_size: int = 1, gates=None, kv_dtype: torch.dtype | None = None):
        """gates: retention gates for trimkv (a RetentionGates or a gates file path);
        kv_dtype: the dtype K/V are cached in (None: the model's)."""
        self.kv_dtype = kv_dtype
        self.model = model.eval()
        self.gates = self._gates_for(model, cfg, gates)
        self.cfg = cfg
        self.protect_prompt = protect_prompt
        self.page_size = page_size
        self._queries: list[torch.Tensor] = []
        self.attention = attention_params(model)
        arch = type(model).__module__
        self._modeling = importlib.import_module(arch)
        if not hasattr(self._modeling, "apply_rotary_pos_emb"):
            raise ValueError(f"model: {arch} has no apply_rotary_pos_emb to record queries from")

    @staticmethod
    def _gates_for(model, cfg, gates):
        if gates is None:
            if cfg.evicts and POLICIES[cfg.policy].needs_retention:
                raise ValueError(f"gates: policy {cfg.policy!r} needs retention gates (a file from "
                                 f"`python -m vase_sglang.retention train`)")
            return None
        from .. import gates as retention_gates

        if not isinstance(gates, retention_gates.RetentionGates):
            gates = retention_gates.load_gates(gates, model.config)
        return gates

    @contextmanager
    def _record_retention(self):
        """log β [B, T, H] per layer of each forward (trimkv); per-layer caches [H, n] of log β
        and true positions, aligned with the KV cache."""
        self._log_beta = self._positions = None
        if self.gates is None:
            yield
            return
        from ..gates import recording_log_beta

        self._new_log_beta: dict = {}
        with torch.no_grad(), recording_log_beta(self.model, self.gates, self._new_log_beta):
            yield

    def _push_retention(self, pos):
        if self.gates is None:
            return
        layers = self.gates.layers
        new_lb = [self._new_log_beta[i][0].transpose(0, 1) for i in range(layers)]  # [H, T]
        new_pos = [pos[0].expand_as(lb) for lb in new_lb]
        if self._log_beta is None:
            self._log_beta, self._positions = new_lb, new_pos
            return
        self._log_beta = [torch.cat([a, b], 1) for a, b in zip(self._log_beta, new_lb)]
        self._positions = [torch.cat([a, b], 1) for a, b in zip(self._positions, new_pos)]

    def _retention_of(self, prefix, n):
        if self.gates is None:
            return None
        log_beta = torch.stack([lb[:, prefix: prefix + n] for lb in self._log_beta])  # [L, H, n]
        pos = torch.stack([p[:, prefix: prefix + n] for p in self._positions])
        now = max(int(p.max()) for p in self._positions) + 1  # the next token's position
        return Retention(log_beta, now - pos)

    def _compact_retention(self, keep, prefix, n):
        if self.gates is None:
            return
        for name in ("_log_beta", "_positions"):
            rows = getattr(self, name)
            setattr(self, name, [
                torch.cat([r[:, :prefix], torch.gather(r[:, prefix: prefix + n], 1, keep[layer]),
                           r[:, prefix + n:]], 1)
                for layer, r in enumerate(rows)])

    @classmethod
    def from_pretrained(cls, path, cfg, dtype=torch.float32, **kwargs):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        return cls(model, cfg, **kwargs)

    @contextmanager
    def _record_queries(self):
        original = self._modeling.apply_rotary_pos_emb

        def recording(q, k, cos, sin, *args, **kwargs):
            q_embed, k_embed = original(q, k, cos, sin, *args, **kwargs)
            self._queries.append(q_embed.detach())  # [B, H_q, T, D], one call per layer
            return q_embed, k_embed

        self._modeling.apply_rotary_pos_emb = recording
        try:
            yield
        finally:
            self._modeling.apply_rotary_pos_emb = original

    @torch.no_grad()
    def run(self, prompt_ids, *, max_new_tokens: int = 0, forced_ids=None, request_key: int = 0,
            observe=None):
        """Greedy decode (or teacher-forced on `forced_ids`). Returns dict with `tokens`,
        `logprobs` (of each emitted/forced token), `evicted` (per layer/head) and `rounds`.
        observe(step, logp): called with each step's full-vocabulary log-probabilities."""
        from transformers import DynamicCache

        cfg = self.cfg
        steps = len(forced_ids) if forced_ids is not None else max_new_tokens
        cache = DynamicCache()
        if self.kv_dtype is not None:
            round_cache_writes(cache, self.kv_dtype)
        window_q: list[list[torch.Tensor]] = []  # per layer: recent [H_q, D] queries
        tokens, logprobs = [], []
        prefix = owned_prompt(len(prompt_ids), self.page_size, self.protect_prompt)
        offset = rounds = 0
        with self._record_queries(), self._record_retention():
            ids = torch.tensor([list(prompt_ids)])
            pos = torch.arange(len(prompt_ids))[None]
            for step in range(steps):
                self._queries.clear()
                phys = cache.get_seq_length()
                out = self.model(input_ids=ids, position_ids=pos, past_key_values=cache,
                                 cache_position=torch.arange(phys, phys + ids.shape[1]),
                                 use_cache=True)
                self._push_queries(window_q)
                self._push_retention(pos)
                logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
                if observe is not None:
                    observe(step, logp)
                token = int(forced_ids[step]) if forced_ids is not None else int(logp.argmax())
                tokens.append(token)
                logprobs.append(float(logp[token]))
                if step == steps - 1:
                    break
                private = cache.get_seq_length() - prefix
                # As the server: never before the first decode step (step 0 is the prefill).
                # Elastic mode: only the ceiling cuts here (no memory pressure in a reference).
                if (cfg.evicts and step >= 1 and cfg.trigger_len is not None
                        and private >= cfg.trigger_len):
                    dropped = self._evict(cache, window_q, prefix, private - cfg.window,
                                          request_key, rounds)
                    offset += dropped
                    rounds += 1
                true_pos = cache.get_seq_length() + offset
                ids, pos = torch.tensor([[token]]), torch.tensor([[true_pos]])
        return {"tokens": tokens, "logprobs": logprobs, "evicted": offset, "rounds": rounds}

    def _push_queries(self, window_q):
        if not window_q:
            window_q.extend([] for _ in self._queries)
        for layer, q in enumerate(self._queries):
            window_q[layer].extend(q[0].transpose(0, 1))  # T x [H_q, D]
            del window_q[layer][: -self.cfg.window]

    def _evict(self, cache, window_q, prefix, n, request_key, rounds) -> int:
        cfg = self.cfg.replace(budget=self.cfg.scheduled_budget)  # elastic: the ceiling
        layers = cache.layers
        keys = torch.stack([lay.keys[0, :, prefix: prefix + n] for lay in layers])  # [L, H, n, D]
        values = torch.stack([lay.values[0, :, prefix: prefix + n] for lay in layers])
        queries = torch.stack([torch.stack(q, dim=1) for q in window_q])  # [L, H_q, W, D]
        keep = select_tokens(
            cfg, keys, values, queries, request=request_key,
            layer=torch.arange(len(layers)), round=rounds,
            sinks=max(0, cfg.sinks - prefix), attention=self.attention,
            retention=self._retention_of(prefix, n),
        )  # [L, H, K]
        self._compact_retention(keep, prefix, n)
        for layer, lay in enumerate(layers):
            for name in ("keys", "values"):
                full = getattr(lay, name)
                cand = full[:, :, prefix: prefix + n]
                kept = torch.gather(cand, 2, keep[layer][None, :, :, None].expand(1, -1, -1, full.shape[-1]))
                setattr(lay, name, torch.cat([full[:, :, :prefix], kept, full[:, :, prefix + n:]], dim=2))
        return n - keep.shape[-1]
