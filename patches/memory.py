"""Hook on sglang.srt.mem_cache.kv_cache_configurator: reserve the query ring's memory before
the KV pool is sized from the free memory (else the ring could push a full pool out of memory,
the failure R-KV's port hit with its query buffer)."""

from __future__ import annotations

import logging

from vase_sglang.policies import POLICIES

logger = logging.getLogger("vase_sglang.eviction")

TARGET_PROFILE = (
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes"
)
# SGLang sizes its request table at most this many rows when --max-running-requests is unset.
DEFAULT_MAX_ROWS = 4096


def ring_bytes(num_layers: int, rows: int, window: int, num_q_heads: int, head_dim: int,
               element_size: int) -> int:
    return num_layers * rows * window * num_q_heads * head_dim * element_size


def around_profile(original, self, *args, **kwargs):
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
    rows = (max(1, requested // max(1, self.attn_dp_size)) if requested else DEFAULT_MAX_ROWS) + 1
    reserve = ring_bytes(len(layers), rows, cfg.window, layers[0].tp_q_head_num,
                         layers[0].qk_head_dim, self.model_dtype.itemsize)
    logger.info("VaSE query ring: reserving %.1f MiB for %d request rows%s", reserve / 2**20, rows,
                "" if requested else " (set --max-running-requests to reserve less)")
    return available - reserve


HOOKS = [(TARGET_PROFILE, "AROUND", around_profile)]
