"""Hooks on sglang.srt.model_executor: build the eviction runtime once the KV pool exists,
capture decode queries in every attention layer, and decouple RoPE positions from KV length."""

from __future__ import annotations

import logging

import torch

from vase_sglang.policies import POLICIES

from . import output, runtime

logger = logging.getLogger("vase_sglang.eviction")

TARGET_POST_POOL = (
    "sglang.srt.model_executor.model_runner.ModelRunner._init_post_memory_pool_components"
)
TARGET_ATTENTION = "sglang.srt.layers.radix_attention.RadixAttention.forward"
TARGET_FORWARD_BATCH = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"


def _attention_layers(model):
    from sglang.srt.layers.radix_attention import RadixAttention

    return [m for m in model.modules() if isinstance(m, RadixAttention)]


def after_post_pool(result, model_runner):
    """AFTER ModelRunner._init_post_memory_pool_components: runs after the KV pool is built and
    before attention backends and CUDA graphs, so the query ring exists before capture."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from .settings import config_from_env

    cfg = config_from_env()
    if cfg is None or not cfg.evicts or getattr(model_runner, "is_draft_worker", False):
        return
    pool = model_runner.token_to_kv_pool
    if type(pool) is not MHATokenToKVPool:
        raise ValueError(
            f"--model-path: KV eviction needs a plain MHA KV pool, this model uses "
            f"{type(pool).__name__} (MLA, hybrid SWA/Mamba and quantised pools are not supported)"
        )
    layers = _attention_layers(model_runner.model)
    if not layers:
        raise ValueError("--model-path: no RadixAttention layer found; the model is not supported")
    for layer in layers:
        if getattr(layer, "sliding_window_size", -1) not in (-1, None, 0):
            raise ValueError(
                "--model-path: sliding-window attention layers read slot order; "
                "KV eviction does not support them"
            )
        if layer.tp_k_head_num != pool.head_num or layer.qk_head_dim != pool.head_dim:
            raise ValueError("--model-path: attention heads differ from the KV pool layout")
    num_q_heads, head_dim = layers[0].tp_q_head_num, layers[0].qk_head_dim
    queries = None
    if POLICIES[cfg.policy].needs_queries:
        rows = model_runner.req_to_token_pool.req_to_token.shape[0]
        queries = torch.zeros(
            (len(pool.k_buffer), rows, cfg.window, num_q_heads, head_dim),
            dtype=pool.dtype if pool.dtype.is_floating_point else torch.bfloat16,
            device=pool.k_buffer[0].device,
        )
    runtime.RUNTIME = runtime.EvictionRuntime(
        cfg=cfg,
        k_buffers=pool.k_buffer,
        v_buffers=pool.v_buffer,
        req_to_token=model_runner.req_to_token_pool.req_to_token,
        allocator=model_runner.token_to_kv_pool_allocator,
        num_q_heads=num_q_heads,
        head_dim=head_dim,
        start_layer=getattr(pool, "start_layer", 0) or 0,
        queries=queries,
    )
    output.enable_in_scheduler()
    ring_mb = 0 if queries is None else queries.numel() * queries.element_size() / 2**20
    workspace = runtime.RUNTIME.workspace
    logger.info(
        "VaSE eviction on: %s (query ring %.1f MiB, step workspace %.1f MiB = %.1f MiB buffer "
        "+ %.1f MiB for temporaries)", cfg, ring_mb, workspace.size / 2**20,
        workspace.buffer_bytes / 2**20, workspace.headroom / 2**20,
    )


def around_attention(original, self, q, k, v, forward_batch, *args, **kwargs):
    """AROUND RadixAttention.forward: record post-RoPE queries for window-attention scores."""
    rt = runtime.RUNTIME
    if rt is not None and rt.queries is not None and q is not None:
        rt.capture_queries(self.layer_id, q, forward_batch)
    return original(self, q, k, v, forward_batch, *args, **kwargs)


def after_forward_batch_init(ret, cls, batch, *args, **kwargs):
    """AFTER ForwardBatch.init_new: decode positions are seq_lens - 1, which after an eviction
    is the KV length, not the token's true position. Add the per-request offset (a host-side
    int, so there is no device read)."""
    if runtime.RUNTIME is None or not ret.forward_mode.is_decode() or ret.positions is None:
        return ret
    offsets = [getattr(req, runtime.OFFSET, 0) for req in batch.reqs]
    if any(offsets):
        n = len(offsets)
        add = torch.tensor(offsets, dtype=ret.positions.dtype).to(ret.positions.device, non_blocking=True)
        ret.positions = torch.cat([ret.positions[:n] + add, ret.positions[n:]])
    return ret


HOOKS = [
    (TARGET_POST_POOL, "AFTER", after_post_pool),
    (TARGET_ATTENTION, "AROUND", around_attention),
    (TARGET_FORWARD_BATCH, "AFTER", after_forward_batch_init),
]
