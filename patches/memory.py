"""Hooks on sglang.srt.mem_cache.kv_cache_configurator: reserve the eviction step's workspace
(and trimkv's side buffers, and the extend capture's token rows) before the KV pool is sized
from the free memory, else either could push a full pool out of memory, the failure R-KV's port
hit with its query buffer.

The workspace (vase_sglang/plan.py, docs/memory.md) bounds one eviction step: a buffer for
the gathered K/V and window queries plus headroom for the score temporaries; its size is logged
and set by --kv-evict-workspace-mb.

The query ring reserves nothing here: a request that scores with queries holds its last
`window` queries in a few ordinary pool slots, allocated with its prefill and charged at its
admission (vase_sglang/pool_ring.py, scheduler.after_prepare_for_extend, footprint.ring_charge),
so the ring's memory follows the requests that use it and never caps how many run.
"""

from __future__ import annotations

import logging

import torch

from vase_sglang.policies import POLICIES

logger = logging.getLogger("vase_sglang.eviction")

TARGET_PROFILE = (
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes"
)


def attention_layers(model):
    """The model's RadixAttention layers (the KV pool's layers, in order)."""
    from sglang.srt.layers.radix_attention import RadixAttention

    return [m for m in model.modules() if isinstance(m, RadixAttention)]


def query_ring_dtype(kv_cache_dtype, model_dtype):
    """The query ring's dtype, for its cost and its allocation: the KV cache's (queries are
    scored against keys stored at that precision), or the model's where the KV cache is not a
    16/32-bit float (fp8: the ring keeps the model's precision, in twice the pool slots)."""
    import torch

    if kv_cache_dtype in (torch.float16, torch.bfloat16, torch.float32):
        return kv_cache_dtype
    return model_dtype


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
    less the step workspace, trimkv's side buffers and the extend capture's token rows (in
    that order)."""
    available = original(self, *args, **kwargs)
    from .settings import current

    server = current()
    cfg = server.config
    if cfg is None or not cfg.evicts or self.is_draft_worker:
        return available
    layers = attention_layers(self.model)
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
        from sglang.srt.runtime_context import get_schedule

        ring = ring_storage_slots(server, shapes, get_schedule().max_total_tokens,
                                  get_schedule().page_size or 1)
        if ring:
            reserve = (ring + 1) * kv_per_token
            logger.info("VaSE query ring beside the --max-total-tokens pool: reserving %.1f MiB "
                        "(%d slots: a ring for every request the pool can run at the server's "
                        "budget; a request finding none free waits for one)",
                        reserve / 2**20, ring)
            available -= reserve
        available -= _reserve_ring_table(shapes, cfg.window, ring,
                                         get_schedule().page_size or 1,
                                         get_schedule().max_running_requests)
    return available


def ring_table_rows(max_running_requests: int | None) -> int:
    """The most rows SGLang's request table can have, known before the pool is sized: its
    max_num_reqs (KVCacheConfigurator.resolve_max_num_reqs: the user's
    --max-running-requests, else at most 4096) plus its padding row."""
    return (max_running_requests or 4096) + 1


def _reserve_ring_table(shapes, window: int, storage: int, page_size: int,
                        max_running_requests: int | None) -> int:
    """The query ring's slot table, int64 [request rows, slots per request]
    (model_runner._query_buffers), and the free list of its storage beside the pool (int64,
    one per slot), reserved like the other buffers beside the pool."""
    from vase_sglang.pool_ring import slots_per_request

    per_request = slots_per_request(window, shapes.q_heads, shapes.head_dim, shapes.q_dtype,
                                    shapes.kv_heads, shapes.kv_dtype.itemsize,
                                    1 if storage else page_size)
    rows = ring_table_rows(max_running_requests)
    reserve = (rows * per_request + storage) * 8
    logger.info("VaSE query-ring slot table: reserving %.1f MiB (at most %d request rows x %d "
                "slots, int64%s)", reserve / 2**20, rows, per_request,
                f"; the storage's free list, {storage} slots" if storage else "")
    return reserve


def ring_storage_slots(server, shapes, max_total_tokens: int | None, page_size: int) -> int:
    """Slots of the query ring's own storage beside the pool (0: the rings are held in the
    pool). With --max-total-tokens N (and --kv-evict-ring auto or beside) the pool is N tokens
    of K/V and the rings come from the memory beside it: enough for every request the pool
    can run that can be evicted (one holding at least its admission charge,
    footprint.charge_len), with a quarter to spare. Without it the pool takes all the memory,
    and the rings share it with K/V."""
    from vase_sglang.pool_ring import slots_per_request

    from .footprint import charge_len

    cfg = server.config
    if not POLICIES[cfg.policy].needs_queries or server.ring == "pool":
        return 0
    if not max_total_tokens:
        if server.ring == "beside":
            raise ValueError("--kv-evict-ring beside: needs --max-total-tokens (the pool the "
                             "rings are held beside); use pool or auto")
        return 0
    per_request = slots_per_request(cfg.window, shapes.q_heads, shapes.head_dim,
                                     shapes.q_dtype, shapes.kv_heads, shapes.kv_dtype.itemsize)
    requests = -(-max_total_tokens * 5 // (4 * charge_len(cfg, page_size))) + 1
    return requests * per_request


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


HOOKS = [
    (TARGET_PROFILE, "AROUND", around_profile),
]
