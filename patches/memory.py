"""Hooks on sglang.srt.mem_cache.kv_cache_configurator: reserve the eviction step's workspace
and the query ring's memory before the KV pool is sized from the free memory (else either could
push a full pool out of memory, the failure R-KV's port hit with its query buffer), and size
the ring with the pool, not beside it.

The workspace (vase_sglang/plan.py, docs/memory.md) bounds one eviction step: a buffer for
the gathered K/V and window queries plus headroom for the score temporaries; its size is logged
and set by --kv-evict-workspace-mb.

The ring holds the last `window` post-RoPE queries of every request row: per row
layers x window x q_heads x head_dim elements, often as much as the request's whole KV budget
(GQA models have several query heads per KV head). Rows beyond what the pool can run are
memory taken from the pool, so without an explicit --max-running-requests the rows are solved
together with the pool: with A bytes available, a ring row costing r bytes and a request
holding c tokens of b bytes (its prompt, assumed --kv-evict-expected-prompt-len tokens, plus
what admission charges its private cache, footprint.charge_len),
    (cap + 1) r + cap c b <= A   =>   cap = (A - r) // (c b + r)
(SGLang's request table has cap + 1 rows), and SGLang's max_running_requests is capped to it.
Without the prompt, long-prompt traffic would leave most rows idle (Qwen3-4B shapes, T = 1024,
4k-token prompts: ~8 GB of ring the pool can never run).
"""

from __future__ import annotations

import contextvars
import logging

import torch

from vase_sglang.policies import POLICIES

logger = logging.getLogger("vase_sglang.eviction")

TARGET_PROFILE = (
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes"
)
TARGET_MAX_NUM_REQS = (
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.resolve_max_num_reqs"
)
# Calls the two above, in that order: the cap found by the first reaches the second through
# `_RING_CAP`, set for the duration of this call (KVCacheConfigurator has __slots__).
TARGET_RESOLVE_POOL = (
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._resolve_memory_pool_config"
)
# SGLang sizes its request table at most this many rows when --max-running-requests is unset.
DEFAULT_MAX_ROWS = 4096

# The cap on max running requests the reserved ring can serve, found while profiling memory and
# applied when SGLang resolves max running requests, within one around_resolve_pool call.
_RING_CAP: contextvars.ContextVar[list | None] = contextvars.ContextVar("vase_ring_cap",
                                                                       default=None)


def query_ring_dtype(kv_cache_dtype, model_dtype):
    """The query ring's dtype, for both its reservation and its allocation: the KV cache's
    (queries are scored against keys stored at that precision), or the model's where the KV
    cache is not a 16/32-bit float (then eviction is refused at startup anyway)."""
    import torch

    if kv_cache_dtype in (torch.float16, torch.bfloat16, torch.float32):
        return kv_cache_dtype
    return model_dtype


def ring_rows(available: int, per_row: int, requested: int | None, tokens_per_request: int,
              kv_bytes_per_token: int, max_pool_tokens: int | None = None
              ) -> tuple[int, int | None]:
    """(rows to reserve, cap on max_running_requests or None). One extra row: SGLang's request
    table has max_running_requests + 1 rows. Unrequested, the rows are as many as the pool
    left beside them holds requests of `tokens_per_request` tokens (closed form above), and no
    more than a pool capped at --max-total-tokens holds."""
    if requested:
        return requested + 1, None
    per_request = tokens_per_request * kv_bytes_per_token + per_row
    cap = (available - per_row) // max(1, per_request)
    if max_pool_tokens:
        cap = min(cap, max_pool_tokens // max(1, tokens_per_request))
    cap = max(1, min(DEFAULT_MAX_ROWS, cap))
    return cap + 1, (cap if cap < DEFAULT_MAX_ROWS else None)


def ring_tokens_per_request(cfg, page_size: int, prompt_len: int) -> int:
    """Pool tokens a running request holds, as the ring's rows are sized: its prompt (the
    expected length) and what admission charges its private cache."""
    from .footprint import charge_len

    return prompt_len + charge_len(cfg, page_size)


def kv_shapes(layers, kv_dtype: torch.dtype, window: int, model_dtype: torch.dtype | None = None):
    """The KVShapes of an eviction step from the model's attention layers; the ring has the
    dtype after_post_pool allocates it with (query_ring_dtype)."""
    from vase_sglang.chunk import KVShapes

    ring_dtype = query_ring_dtype(kv_dtype, model_dtype or torch.bfloat16)
    return KVShapes(kv_heads=layers[0].tp_k_head_num, q_heads=layers[0].tp_q_head_num,
                    head_dim=layers[0].qk_head_dim, kv_dtype=kv_dtype, q_dtype=ring_dtype,
                    ring_window=window)


def around_profile(original, self, *args, **kwargs):
    """AROUND KVCacheConfigurator._profile_available_bytes: the bytes left for the KV pool,
    less the step workspace, trimkv's side buffers and the query ring (in that order)."""
    available = original(self, *args, **kwargs)
    from .model_runner import _attention_layers
    from .settings import current

    server = current()
    cfg = server.config
    if cfg is None or not cfg.evicts or self.is_draft_worker:
        return available
    layers = _attention_layers(self.model)
    if not layers:
        return available
    shapes = kv_shapes(layers, self.kv_cache_dtype, cfg.window, self.model_dtype)
    available -= _reserve_workspace(self, server, shapes)
    kv_per_token = len(layers) * 2 * shapes.kv_heads * shapes.head_dim * shapes.kv_dtype.itemsize
    if server.gates_path:
        available -= _reserve_side_buffers(available, len(layers), shapes, kv_per_token)
    if POLICIES[cfg.policy].needs_queries:
        # The extend capture keeps one int64 ring row per pool token (EvictionRuntime
        # .token_rows): take its share of the bytes left, as the pool takes the rest.
        available -= available * 8 // (kv_per_token + 8)
        available -= _reserve_ring(self, server, available, len(layers), shapes, kv_per_token)
    return available


def _reserve_workspace(configurator, server, shapes) -> int:
    from vase_sglang.plan import workspace_bytes

    cfg = server.config
    size = workspace_bytes(cfg, shapes, torch.device(configurator.device).type,
                           max_budget=server.limits.max_budget,
                           max_candidates=configurator.model_config.context_len)
    logger.info(
        "VaSE eviction workspace: reserving %.1f MiB (%.1f MiB buffer for gathered K/V and "
        "queries, %.1f MiB for score temporaries; holds %s; budget %d)%s",
        (size.buffer + size.headroom) / 2**20, size.buffer / 2**20, size.headroom / 2**20,
        size.describe(), cfg.budget,
        "" if cfg.workspace_mb else "; set --kv-evict-workspace-mb to choose",
    )
    return size.buffer + size.headroom


def _reserve_side_buffers(available: int, num_layers: int, shapes, kv_per_token: int) -> int:
    """trimkv's side buffers have one row per pool slot (RetentionBuffers): their share of the
    bytes left, as the pool takes the rest."""
    from sglang.srt.runtime_context import get_schedule

    from vase_sglang.plan import side_bytes_per_token

    side = side_bytes_per_token(num_layers, shapes.kv_heads)
    reserve = available * side // (kv_per_token + side)
    capped = get_schedule().max_total_tokens
    if capped:  # the pool will hold at most this many slots (plus a padding page)
        reserve = min(reserve, (capped + (get_schedule().page_size or 1)) * side)
    logger.info(
        "VaSE retention side buffers: reserving %.1f MiB (%d bytes; %d bytes per token slot "
        "beside %d of K/V: log β and position, float32, per layer and KV head)",
        reserve / 2**20, reserve, side, kv_per_token)
    return reserve


def _reserve_ring(configurator, server, available: int, num_layers: int, shapes,
                  kv_per_token: int) -> int:
    """The query ring's rows (module doc); the cap on max running requests they imply goes to
    around_max_num_reqs through _RING_CAP."""
    from sglang.srt.runtime_context import get_schedule

    from vase_sglang.plan import ring_bytes

    from .settings import PROMPT_LEN, flag_name

    cfg = server.config
    requested = get_schedule().max_running_requests
    if requested:
        requested = max(1, requested // max(1, configurator.attn_dp_size))
    dtype = shapes.q_dtype
    per_row = ring_bytes(num_layers, 1, cfg.window, shapes.q_heads, shapes.head_dim,
                         dtype.itemsize)
    prompt = server.expected_prompt_len
    tokens = ring_tokens_per_request(cfg, get_schedule().page_size or 1, prompt)
    rows, row_cap = ring_rows(available, per_row, requested, tokens, kv_per_token,
                              get_schedule().max_total_tokens)
    reserve = rows * per_row
    logger.info(
        "VaSE query ring: reserving %.1f MiB (%d bytes of %s) for %d request rows%s",
        reserve / 2**20, reserve, dtype, rows,
        "" if requested else
        (f" (what the pool beside it holds at {prompt} prompt tokens (assumed: "
         f"{flag_name(PROMPT_LEN)}) + {tokens - prompt} private tokens a request: max running "
         f"requests capped to {row_cap}; set --max-running-requests to choose)"
         if row_cap else ""),
    )
    holder = _RING_CAP.get()
    if holder is not None:
        holder.append(row_cap)
    return reserve


def around_max_num_reqs(original, self, *args, **kwargs):
    n = original(self, *args, **kwargs)
    holder = _RING_CAP.get()
    cap = holder[-1] if holder else None
    if cap is not None and not self.is_draft_worker and n > cap:
        return cap
    return n


def around_resolve_pool(original, self, *args, **kwargs):
    """AROUND KVCacheConfigurator._resolve_memory_pool_config: the scope of one memory plan."""
    token = _RING_CAP.set([])
    try:
        return original(self, *args, **kwargs)
    finally:
        _RING_CAP.reset(token)


HOOKS = [
    (TARGET_RESOLVE_POOL, "AROUND", around_resolve_pool),
    (TARGET_PROFILE, "AROUND", around_profile),
    (TARGET_MAX_NUM_REQS, "AROUND", around_max_num_reqs),
]
