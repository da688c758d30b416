"""Hooks on sglang.srt.mem_cache.kv_cache_configurator: reserve the query ring's memory before
the KV pool is sized from the free memory (else the ring could push a full pool out of memory,
the failure R-KV's port hit with its query buffer), and keep the ring a modest share of memory.

The ring holds the last `window` post-RoPE queries of every request row: per row
layers x window x q_heads x head_dim elements, often as much as the request's whole KV budget
(GQA models have several query heads per KV head). SGLang sizes its request table at 2048-4096
rows when --max-running-requests is unset, which for a 0.5B model with window 64 would be
5+ GB. So without an explicit --max-running-requests the ring gets at most RING_SHARE of the
free memory, and SGLang's max_running_requests is capped to the rows that fit.
"""

from __future__ import annotations

import logging

from vase_sglang.policies import POLICIES

logger = logging.getLogger("vase_sglang.eviction")

TARGET_PROFILE = (
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes"
)
TARGET_MAX_NUM_REQS = (
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.resolve_max_num_reqs"
)
# SGLang sizes its request table at most this many rows when --max-running-requests is unset.
DEFAULT_MAX_ROWS = 4096
RING_SHARE = 0.15  # of the memory left for the KV pool, when --max-running-requests is unset

_row_cap: int | None = None  # max running requests the reserved ring can serve (this process)


def query_ring_dtype(kv_cache_dtype, model_dtype):
    """The query ring's dtype, for both its reservation and its allocation: the KV cache's
    (queries are scored against keys stored at that precision), or the model's where the KV
    cache is not a 16/32-bit float (then eviction is refused at startup anyway)."""
    import torch

    if kv_cache_dtype in (torch.float16, torch.bfloat16, torch.float32):
        return kv_cache_dtype
    return model_dtype


def ring_bytes(num_layers: int, rows: int, window: int, num_q_heads: int, head_dim: int,
               element_size: int) -> int:
    return num_layers * rows * window * num_q_heads * head_dim * element_size


def ring_rows(available: int, per_row: int, requested: int | None) -> tuple[int, int | None]:
    """(rows to reserve, cap on max_running_requests or None). One extra row: SGLang's request
    table has max_running_requests + 1 rows."""
    if requested:
        return requested + 1, None
    fit = int(available * RING_SHARE) // max(1, per_row)
    cap = max(1, min(DEFAULT_MAX_ROWS, fit - 1))
    return cap + 1, (cap if cap < DEFAULT_MAX_ROWS else None)


def around_profile(original, self, *args, **kwargs):
    global _row_cap
    available = original(self, *args, **kwargs)
    from sglang.srt.runtime_context import get_schedule

    from .model_runner import _attention_layers
    from .settings import config_from_env

    cfg = config_from_env()
    if cfg is None or not cfg.evicts or not POLICIES[cfg.policy].needs_queries or self.is_draft_worker:
        return available
    layers = _attention_layers(self.model)
    if not layers:
        return available
    requested = get_schedule().max_running_requests
    if requested:
        requested = max(1, requested // max(1, self.attn_dp_size))
    dtype = query_ring_dtype(self.kv_cache_dtype, self.model_dtype)
    per_row = ring_bytes(len(layers), 1, cfg.window, layers[0].tp_q_head_num,
                         layers[0].qk_head_dim, dtype.itemsize)
    rows, _row_cap = ring_rows(available, per_row, requested)
    reserve = rows * per_row
    logger.info(
        "VaSE query ring: reserving %.1f MiB (%d bytes of %s) for %d request rows%s",
        reserve / 2**20, reserve, dtype, rows,
        "" if requested else
        (f" ({RING_SHARE:.0%} of free memory: max running requests capped to {_row_cap}; "
         "set --max-running-requests to choose)" if _row_cap else ""),
    )
    return available - reserve


def around_max_num_reqs(original, self, *args, **kwargs):
    n = original(self, *args, **kwargs)
    if _row_cap is not None and not self.is_draft_worker and n > _row_cap:
        return _row_cap
    return n


HOOKS = [
    (TARGET_PROFILE, "AROUND", around_profile),
    (TARGET_MAX_NUM_REQS, "AROUND", around_max_num_reqs),
]
