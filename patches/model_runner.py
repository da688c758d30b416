"""Hooks on sglang.srt.model_executor: build the eviction runtime once the KV pool exists,
capture decode queries in every attention layer, and decouple RoPE positions from KV length."""

from __future__ import annotations

import logging

import torch

from vase_sglang import capture
from vase_sglang.capture import SCRATCH_ROW
from vase_sglang.ops import FP8_KV_DTYPES
from vase_sglang.policies import POLICIES, AttentionParams

from . import output, runtime, settings, state
from .memory import attention_layers as _attention_layers
from .memory import query_ring_dtype

logger = logging.getLogger("vase_sglang.eviction")

TARGET_POST_POOL = (
    "sglang.srt.model_executor.model_runner.ModelRunner._init_post_memory_pool_components"
)
TARGET_ATTENTION = "sglang.srt.layers.radix_attention.RadixAttention.forward"
TARGET_FORWARD_BATCH = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
# Not a class patch: a torch forward pre-hook on each instance that owns a RadixAttention
# (installed by after_post_pool with --kv-evict-retention-gates), e.g.
TARGET_RETENTION_GATE = "sglang.srt.models.qwen3.Qwen3Attention.forward (and Qwen2's, Llama's)"


def check_attention_layers(layers, pool_head_num: int, pool_head_dim: int,
                           pool_v_head_dim: int) -> AttentionParams:
    """Refuse at startup what the eviction step cannot score or compact correctly, and return
    the model's attention logit parameters (the same in every layer)."""
    if not layers:
        raise ValueError("--model-path: no RadixAttention layer found; the model is not supported")
    for layer in layers:
        if getattr(layer, "sliding_window_size", -1) not in (-1, None, 0):
            raise ValueError(
                "--model-path: sliding-window attention layers read slot order; "
                "KV eviction does not support them"
            )
        if layer.v_head_dim != layer.qk_head_dim or pool_v_head_dim != pool_head_dim:
            raise ValueError(
                f"--model-path: value head dim {layer.v_head_dim} differs from the key head dim "
                f"{layer.qk_head_dim} (layer {layer.layer_id}); KV eviction needs equal K and V "
                f"head dims"
            )
        if layer.tp_k_head_num != pool_head_num or layer.qk_head_dim != pool_head_dim:
            raise ValueError("--model-path: attention heads differ from the KV pool layout")
        if getattr(layer, "logit_cap", 0) and getattr(layer, "logit_capping_method", "tanh") != "tanh":
            raise ValueError(
                f"--model-path: logit capping method {layer.logit_capping_method!r} is not "
                f"supported by KV eviction (only tanh soft-capping)"
            )
        if getattr(layer, "xai_temperature_len", -1) > 0:
            raise ValueError(
                "--model-path: position-dependent attention temperature (xai_temperature_len) "
                "is not supported by KV eviction"
            )
    found = {(float(layer.scaling), float(layer.logit_cap or 0.0)) for layer in layers}
    if len(found) != 1:
        raise ValueError(
            f"--model-path: attention layers differ in (scaling, logit cap): {sorted(found)}; "
            f"KV eviction supports one value for all layers"
        )
    scaling, softcap = found.pop()
    return AttentionParams.of_layer(scaling, softcap, layers[0].qk_head_dim)


def kv_head_offset(total_kv_heads: int, local_kv_heads: int, attn_tp_rank: int,
                   attn_tp_size: int) -> tuple[int, int]:
    """(global index of this rank's first KV head, ranks sharing each head). SGLang shards KV
    heads over the attention-TP group (QKVParallelLinear, KV pool head_num); with more ranks
    than heads each head is replicated on attn_tp_size / heads consecutive ranks (shard
    kv_tp_rank // replicas)."""
    replicas = max(1, attn_tp_size // total_kv_heads)
    offset = (attn_tp_rank // replicas) * local_kv_heads
    if offset + local_kv_heads > total_kv_heads:
        raise ValueError(
            f"--tp-size: rank {attn_tp_rank} of {attn_tp_size} would hold KV heads "
            f"[{offset}, {offset + local_kv_heads}) of {total_kv_heads}"
        )
    return offset, replicas


def _rank_kv_heads(model_runner, pool, cfg) -> int:
    """This rank's KV head offset; refuses replicated KV heads for window-attention policies
    (each replica sees only its share of the GQA group's queries, so replicas would score
    differently and a tp > KV-heads server would not draw what tp=1 draws)."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    total = model_runner.model_config.get_total_num_kv_heads()
    offset, replicas = kv_head_offset(total, pool.head_num, parallel.attn_tp_rank,
                                      parallel.attn_tp_size)
    if replicas > 1 and POLICIES[cfg.policy].needs_queries:
        raise ValueError(
            f"--tp-size: {parallel.attn_tp_size} attention-TP ranks replicate the model's "
            f"{total} KV heads; --kv-evict-policy {cfg.policy} scores each head from its whole "
            f"query group, which a replica does not hold. Use at most {total} TP ranks or a "
            f"policy that reads no queries"
        )
    return offset


def after_post_pool(result, model_runner):
    """AFTER ModelRunner._init_post_memory_pool_components: runs after the KV pool is built and
    before attention backends and CUDA graphs, so the query ring exists before capture."""
    server = settings.current()
    cfg = server.config
    if cfg is None or not cfg.evicts or getattr(model_runner, "is_draft_worker", False):
        return
    pool = model_runner.token_to_kv_pool
    layers = _attention_layers(model_runner.model)
    check_pool(pool, layers)
    attention = check_attention_layers(layers, pool.head_num, pool.head_dim,
                                       getattr(pool, "v_head_dim", pool.head_dim))
    head_offset = _rank_kv_heads(model_runner, pool, cfg)
    num_q_heads, head_dim = layers[0].tp_q_head_num, layers[0].qk_head_dim
    queries = token_rows = None
    if POLICIES[cfg.policy].needs_queries:
        queries, token_rows = _query_buffers(model_runner, pool, cfg, num_q_heads, head_dim)
    retention = _retention_buffers(model_runner, pool, head_offset, server.gates_path)
    runtime.RUNTIME = runtime.EvictionRuntime(
        cfg=cfg,
        # The step sees K/V in their dtype (8-bit floats: views of SGLang's byte storage).
        k_buffers=_as_kv_dtype(pool.k_buffer, pool.dtype),
        v_buffers=_as_kv_dtype(pool.v_buffer, pool.dtype),
        req_to_token=model_runner.req_to_token_pool.req_to_token,
        allocator=model_runner.token_to_kv_pool_allocator,
        num_q_heads=num_q_heads,
        head_dim=head_dim,
        start_layer=getattr(pool, "start_layer", 0) or 0,
        queries=queries,
        token_rows=token_rows,
        attention=attention,
        kv_head_offset=head_offset,
        page_size=model_runner.token_to_kv_pool_allocator.page_size,
        retention=retention,
        limits=server.limits,
        max_candidates=model_runner.model_config.context_len,
        query_dtype=query_ring_dtype(pool.dtype, model_runner.dtype),
        tp_cpu_group=_tp_cpu_group(),
    )
    if retention is not None:
        _install_retention_gate(model_runner.model, layers)
        logger.info("VaSE retention gates %s loaded: side buffers %.1f MiB = %d bytes (log β and "
                    "position, float32 [%d slots, %d KV heads] x %d layers x 2), gates %.1f MiB",
                    server.gates_path, retention.nbytes() / 2**20, retention.nbytes(),
                    retention.log_beta[0].shape[0], pool.head_num, len(pool.k_buffer),
                    sum(t.numel() * 4 for t in (retention.w1, retention.b1, retention.w2,
                                                retention.b2)) / 2**20)
    _warm_up(runtime.RUNTIME)
    _prime_plans(runtime.RUNTIME)
    output.enable_in_scheduler()
    _log_enabled(runtime.RUNTIME)


def _tp_cpu_group():
    """The CPU group of the ranks that run this scheduler's batch (attention TP), or None."""
    from sglang.srt.distributed.parallel_state import get_attn_tp_group

    group = get_attn_tp_group()
    return group.cpu_group if group.world_size > 1 else None


def check_pool(pool, layers=()) -> None:
    """Refuse at startup a KV pool the step cannot read or move: it reads K/V as the attention
    backends do and moves them as stored, which needs plain 16/32-bit floats, or 8-bit floats
    stored as their bytes with no scales beside them (fp8_e4m3 / fp8_e5m2 of SGLang's plain
    MHA pool) and no per-layer scale: torch_native reads the stored values as they are, while
    the CUDA backends multiply them by the layer's k_scale / v_scale, so the scores match
    both only at scale 1 (no quantization param file or checkpoint KV scales)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    if type(pool) is not MHATokenToKVPool:
        raise ValueError(
            f"--model-path: KV eviction needs a plain MHA KV pool, this model uses "
            f"{type(pool).__name__} (MLA, hybrid SWA/Mamba and quantised pools are not supported)"
        )
    store = getattr(pool, "store_dtype", pool.dtype)
    plain = pool.dtype in (torch.float16, torch.bfloat16, torch.float32) and store == pool.dtype
    fp8 = (pool.dtype in FP8_KV_DTYPES and store == torch.uint8
           and not getattr(pool, "is_quantized_kv_cache", False))
    if not (plain or fp8):
        raise ValueError(
            f"--kv-cache-dtype: KV eviction reads and moves K/V as float16, bfloat16, float32, "
            f"or fp8_e4m3 / fp8_e5m2 stored as bytes without scale buffers; this KV cache is "
            f"{pool.dtype} stored as {store}"
            + (f" with {type(pool.quant_method).__name__}" if getattr(
                pool, "is_quantized_kv_cache", False) else "")
        )
    if fp8:
        for layer in layers:
            for name in ("k_scale_float", "v_scale_float"):
                scale = getattr(layer, name, None)
                if scale is not None and float(scale) != 1.0:
                    raise ValueError(
                        f"--kv-cache-dtype {_KV_DTYPE_FLAG[pool.dtype]}: layer {layer.layer_id} "
                        f"has {name[0]}_scale {float(scale)}; KV eviction scores 8-bit K/V only "
                        f"at scale 1 (no --quantization-param-path, no KV scales in the "
                        f"checkpoint)"
                    )
        if pool.k_buffer[0].device.type == "cuda":
            check_fp8_kernels(pool.dtype, torch.cuda.get_device_capability(pool.k_buffer[0].device))


def _as_kv_dtype(buffers, dtype):
    """The pool's per-layer buffers as `dtype` (views of the same memory where SGLang stores
    8-bit floats as uint8; the buffers themselves otherwise)."""
    return buffers if all(b.dtype == dtype for b in buffers) else [b.view(dtype) for b in buffers]


_KV_DTYPE_FLAG = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


def check_fp8_kernels(kv_dtype, capability: tuple[int, int]) -> None:
    """Triton has e4m3 (fp8e4nv) only from sm_89 on; e5m2 from sm_80 (vase_sglang.ops.aot
    compiles both: tests/test_triton_compile.py). The torch kernels (VASE_KERNELS=torch) read
    both anywhere."""
    from vase_sglang import ops

    if (kv_dtype == torch.float8_e4m3fn and tuple(capability) < (8, 9)
            and ops.kernel_backend("cuda") == "triton"):
        raise ValueError(
            f"--kv-cache-dtype fp8_e4m3: the eviction kernels read e4m3 only on sm_89 or newer "
            f"(Triton), this GPU is sm_{capability[0]}{capability[1]}; use fp8_e5m2, or "
            f"VASE_KERNELS=torch (slower scoring)"
        )


def _query_buffers(model_runner, pool, cfg, num_q_heads: int, head_dim: int):
    """The query ring, held in the KV pool's own slots (vase_sglang/pool_ring.py: a table of
    each request row's ring slots, filled when a request is admitted), and the extend
    capture's ring row per token."""
    from vase_sglang.pool_ring import PoolRing, RingSlots, slots_per_request

    req_pool = model_runner.req_to_token_pool
    if SCRATCH_ROW in req_pool.free_slots:
        raise ValueError(
            f"--model-path: request table {type(req_pool).__name__} hands out row "
            f"{SCRATCH_ROW}, which the query capture uses as its scratch row"
        )
    from sglang.srt.runtime_context import get_schedule

    from .memory import kv_shapes, ring_storage_slots

    window = cfg.window
    rows = req_pool.req_to_token.shape[0]
    device = pool.k_buffer[0].device
    dtype = query_ring_dtype(pool.dtype, model_runner.dtype)
    k_buffers = _as_kv_dtype(pool.k_buffer, pool.dtype)
    v_buffers = _as_kv_dtype(pool.v_buffer, pool.dtype)
    page_size = model_runner.token_to_kv_pool_allocator.page_size
    shapes = kv_shapes(_attention_layers(model_runner.model), pool.dtype, window,
                       model_runner.dtype)
    own = ring_storage_slots(settings.current(), shapes, get_schedule().max_total_tokens,
                             page_size)
    storage = None
    if own:  # beside a --max-total-tokens pool (memory.ring_storage_slots)
        k_buffers = [torch.zeros((own + 1, *k.shape[1:]), dtype=k.dtype, device=device)
                     for k in k_buffers]
        v_buffers = [torch.zeros_like(k) for k in k_buffers]
        storage, page_size = RingSlots(own, device), 1
    per_request = slots_per_request(window, num_q_heads, head_dim, dtype, pool.head_num,
                                    k_buffers[0].element_size(), page_size)
    table = torch.zeros((rows, per_request), dtype=torch.int64, device=device)
    queries = PoolRing(k_buffers, v_buffers, table, window, num_q_heads, head_dim, dtype)
    queries.storage = storage  # None: the slots come from the KV pool's allocator
    # One entry per token of any extend forward: real tokens each hold a pool slot,
    # padded prefill-graph buckets are at most the largest captured bucket.
    token_rows = torch.full((max(pool.size, _largest_prefill_bucket()) + 1,), SCRATCH_ROW,
                            dtype=torch.int64, device=device)
    return queries, token_rows


def _log_enabled(rt) -> None:
    queries, token_rows, workspace = rt.queries, rt.token_rows, rt.workspace
    rows_mb = 0 if token_rows is None else token_rows.numel() * token_rows.element_size() / 2**20
    if rt.ring_storage is not None:
        ring = (f"query ring beside the pool: {rt.ring_slots} slots a request of "
                f"{rt.ring_storage.size} in its own storage")
    else:
        ring = f"query ring: {rt.ring_slots} pool slots per request"
    table = "" if queries is None else f"; slot table {list(queries.table.shape)}"
    logger.info(
        "VaSE eviction on: %s (%s whose policy reads queries, %s%s; token rows %.1f MiB; step "
        "workspace %.1f MiB = %.1f MiB buffer + %.1f MiB for temporaries; KV heads from %d; "
        "%s)",
        rt.cfg, ring, None if queries is None else queries.dtype, table, rows_mb,
        workspace.size / 2**20, workspace.buffer_bytes / 2**20, workspace.headroom / 2**20,
        rt.kv_head_offset, rt.attention,
    )


def _warm_up(rt) -> None:
    """Compile every kernel the eviction step can launch now, on scratch tensors, rather than
    inside the first eviction with every running request waiting (vase_sglang/warmup.py)."""
    from vase_sglang.warmup import warm_up

    done = warm_up(rt.cfg, rt.shapes, rt.k_buffers[0].device, attention=rt.attention,
                   head_offset=rt.kv_head_offset, retention=rt.retention is not None,
                   page_size=rt.page_size)
    (logger.warning if done["errors"] else logger.info)("VaSE %s", done["summary"])


def _prime_plans(rt) -> None:
    """Trace the step costs of every cut an elastic server can make now (step.prime_plans),
    rather than in the scheduler's step at the first cut to each new level."""
    import time

    from . import step

    start = time.perf_counter()
    count = step.prime_plans(rt)
    if count:
        logger.info("VaSE planned %d elastic cut sizes in %.2f s", count,
                    time.perf_counter() - start)


def _retention_buffers(model_runner, pool, head_offset: int, path: str | None):
    """With --kv-evict-retention-gates: the gates (checked against the served model) and the
    side buffers, one row per pool slot (reserved in the memory plan: memory.around_profile)."""
    if not path:
        return None
    gates = settings.load_server_gates(path, model_runner.model_config.hf_config)
    start = getattr(pool, "start_layer", 0) or 0
    if start + len(pool.k_buffer) > gates.layers:
        raise ValueError(f"--kv-evict-retention-gates: {gates.layers} layers of gates, the pool "
                         f"holds layers {start}..{start + len(pool.k_buffer) - 1}")
    return runtime.RetentionBuffers.allocate(
        gates, slots=pool.k_buffer[0].shape[0], layers=len(pool.k_buffer),
        kv_heads=pool.head_num, head_offset=head_offset, device=pool.k_buffer[0].device)


def _install_retention_gate(model, layers) -> None:
    """A forward pre-hook on the module that owns each RadixAttention (Qwen2/Qwen3/Llama
    `self_attn`, called as self_attn(positions=, hidden_states=, forward_batch=)): its
    hidden_states are the attention input the gates were trained on (after input_layernorm)."""
    owners = [m for m in model.modules() if getattr(m, "attn", None) in layers]
    if len(owners) != len(layers):
        raise ValueError(f"--kv-evict-retention-gates: found the attention module of "
                         f"{len(owners)} of {len(layers)} layers; the gate needs each layer's "
                         f"attention input")
    for module in owners:
        module.register_forward_pre_hook(_retention_pre_hook, with_kwargs=True)


def _retention_pre_hook(module, args, kwargs):
    """Forward pre-hook on <model>.layers[i].self_attn (see _install_retention_gate)."""
    rt = runtime.RUNTIME
    if rt is None or rt.retention is None:
        return None
    try:
        x, positions, fb = kwargs["hidden_states"], kwargs["positions"], kwargs["forward_batch"]
    except KeyError:
        raise RuntimeError(f"{type(module).__name__}.forward was not called with keyword "
                           f"arguments positions=, hidden_states=, forward_batch=; the "
                           f"retention gate cannot find its input") from None
    if x.shape[0]:
        rt.record_retention(module.attn.layer_id, x, positions, fb)
    return None


def _largest_prefill_bucket() -> int:
    """Largest token bucket of SGLang's prefill CUDA graphs (0 when it has none)."""
    try:
        from sglang.srt.runtime_context import get_exec

        prefill = get_exec().graph.cuda_graph_config.prefill
    except (ImportError, AttributeError, ValueError):
        return 0
    if prefill is None or prefill.backend == "disabled" or not prefill.bs:
        return 0
    return max(prefill.bs)


def around_attention(original, self, q, k, v, forward_batch, *args, **kwargs):
    """AROUND RadixAttention.forward: record post-RoPE queries for window-attention scores.
    Inside CUDA graphs on CUDA (decode, and prefill: the breakable graph runs only the
    attention kernel eagerly), so the capture is static-shaped and sync-free."""
    rt = runtime.RUNTIME
    if rt is not None and rt.queries is not None and q is not None:
        rt.capture_queries(self.layer_id, q, forward_batch)
    return original(self, q, k, v, forward_batch, *args, **kwargs)


def after_forward_batch_init(ret, cls, batch, *args, **kwargs):
    """AFTER ForwardBatch.init_new: runs on the forward stream before the forward, its graph
    replay included (decode replay copies `positions` into its static buffer).
    Extend: the ring row of each token, read by the recorded extend capture.
    Decode: positions are seq_lens - 1, which after an eviction is the KV length, not the
    token's true position; add the per-request offset (host ints, staged through pinned
    memory so the host never waits on the forward in flight)."""
    rt = runtime.RUNTIME
    if rt is None or ret.positions is None:
        return ret
    rt.prepare_capture(ret)
    if not ret.forward_mode.is_decode():
        return ret
    offsets = [state.pos_offset(req) for req in batch.reqs]
    if any(offsets):
        staged = capture.stage_host_ints(offsets, ret.positions.dtype, ret.positions.device)
        ret.positions = capture.offset_positions(ret.positions, staged)
    return ret


HOOKS = [
    (TARGET_POST_POOL, "AFTER", after_post_pool),
    (TARGET_ATTENTION, "AROUND", around_attention),
    (TARGET_FORWARD_BATCH, "AFTER", after_forward_batch_init),
]
