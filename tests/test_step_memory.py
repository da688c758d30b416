"""The eviction step's memory is bounded by its workspace (issue 10, item 2).

The large cases run the real step (patches/step.py) on meta tensors under PeakMemory:
nothing is allocated, every storage an op creates is followed until it is freed. The small
case runs the real step on CPU and checks that chunking never changes a selection.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vase_sglang import EvictionConfig, select_tokens
from vase_sglang.ops import compact_kv_reference_, planning_for
from vase_sglang.policies import POLICIES, Retention, RKVPolicy, mean_cosine_to_others
from torch.utils._python_dispatch import TorchDispatchMode

from vase_sglang import rows
from vase_sglang.chunk import KVShapes, PoolCandidates, Workspace, kv_reads
from vase_sglang.plan import (STREAM_CHUNK, PeakMemory, _request_like, chunk_cost, group_bytes,
                              plan_chunks, plan_step, step_cost, streamed_policies, trace_chunk,
                              workspace_bytes)
from vase_sglang_patches import grouping, runtime, state, step
from vase_sglang_patches.memory import kv_shapes

torch.set_num_threads(1)
BUILT_IN = [p for p in POLICIES if p in (
    "vase-attnv", "vase-dkv", "snapkv", "rkv", "curdkv", "random", "streaming",
    "evict-large-values", "trimkv")]
# Qwen3-4B: 36 layers, 8 KV heads, 32 query heads, head dim 128, bf16.
QWEN3_4B = dict(layers=36, kv_heads=8, q_heads=32, head_dim=128, dtype=torch.bfloat16)


class _Allocator:
    def __init__(self):
        self.freed = []

    def free(self, slots):
        self.freed.append(slots)

    def free_page_ids(self, page_ids):  # the paged allocator's exact page free
        self.freed.append(page_ids)


def _request(i, n, window, prefix=3):
    kv = SimpleNamespace(req_pool_idx=i, cache_protected_len=prefix,
                         kv_allocated_len=prefix + n + window, kv_committed_len=prefix + n + window)
    params = SimpleNamespace(sampling_seed=None, custom_params=None)
    tokens = [(31 * i + 7 * j) % 1000 for j in range(prefix + n + window)]  # keys the draws
    return SimpleNamespace(rid=f"r{i}", kv=kv, decode_batch_idx=1, sampling_params=params,
                           skip_radix_cache_insert=False, origin_input_ids=tokens, output_ids=[])


def _step(cfg, *, layers, kv_heads, q_heads, head_dim, dtype, requests, device, workspace=None,
          seed=0, prefix=3, page_size=1, candidates=None, q_dtype=None):
    """A runtime over a pool holding `requests` requests of n = budget candidates each (or
    candidates[i] for request i: a long private cache), and a decode batch of them. On meta
    nothing is allocated. q_dtype: the query ring's (default: the K/V dtype)."""
    window = cfg.window
    ns = [cfg.budget] * requests if candidates is None else list(candidates)
    lengths = [prefix + n + window for n in ns]
    per_req = max(lengths)
    slots_total = sum(lengths) + 1
    gen = torch.Generator().manual_seed(seed)

    def tensor(*shape, dt=dtype):
        if device == "meta":
            return torch.empty(*shape, dtype=dt, device="meta")
        return torch.randn(*shape, generator=gen).to(dt)

    k_buffers = [tensor(slots_total, kv_heads, head_dim) for _ in range(layers)]
    v_buffers = [tensor(slots_total, kv_heads, head_dim) for _ in range(layers)]
    ring = None
    if POLICIES[cfg.policy].needs_queries:
        ring = tensor(layers, requests + 1, window, q_heads, head_dim, dt=q_dtype or dtype)
    # Each request's row: a shuffled run of slots, so gathers and compaction cross rows.
    if device == "meta":
        req_to_token = torch.empty(requests + 1, per_req + 8, dtype=torch.int32, device="meta")
    else:
        perm = torch.randperm(slots_total - 1, generator=gen) + 1
        req_to_token = torch.zeros(requests + 1, per_req + 8, dtype=torch.int32)
        for i, length in enumerate(lengths):
            start = sum(lengths[:i])
            req_to_token[i, :length] = perm[start: start + length].int()
    rt = runtime.EvictionRuntime(
        cfg=cfg, k_buffers=k_buffers, v_buffers=v_buffers, req_to_token=req_to_token,
        allocator=_Allocator(), num_q_heads=q_heads, head_dim=head_dim, start_layer=0,
        queries=ring, workspace=workspace, page_size=page_size, query_dtype=q_dtype,
    )
    reqs = [_request(i, n, window, prefix) for i, n in enumerate(ns)]
    lens = torch.tensor(lengths, dtype=torch.int64)
    batch = SimpleNamespace(reqs=reqs, seq_lens_cpu=lens, seq_lens=lens.to(device),
                            orig_seq_lens=None, seq_lens_sum=None, batch_is_full=True)
    if POLICIES[cfg.policy].needs_retention:  # trimkv: side buffers of log β and position
        side = [[tensor(slots_total, kv_heads, 1, dt=torch.float32) for _ in range(layers)]
                for _ in range(2)]
        if device != "meta":
            side[0] = [torch.nn.functional.logsigmoid(t) for t in side[0]]
        rt.retention = runtime.RetentionBuffers(None, None, None, None, *side)
    return rt, batch


def _meta_workspace(cfg, shapes, device):
    buffer, headroom, *_ = workspace_bytes(cfg, shapes, device)
    return Workspace(torch.empty(buffer, dtype=torch.uint8, device="meta"), headroom)


@pytest.mark.parametrize("policy,requests,device", [
    ("vase-attnv", 64, "cuda"), ("snapkv", 64, "cuda"), ("rkv", 16, "cuda"),
    ("vase-dkv", 64, "cuda"), ("snapkv", 64, "cpu"), ("rkv", 16, "cpu"), ("trimkv", 64, "cuda"),
    ("trimkv", 64, "cpu")])
def test_step_peak_memory_stays_inside_the_reserved_workspace(policy, requests, device, monkeypatch):
    """One eviction step, Qwen3-4B shapes, budget T = 2048: its peak extra memory (traced on
    meta tensors, planned as on `device`) fits the workspace the server reserves."""
    cfg = EvictionConfig(policy=policy, budget=2048, window=64)
    shapes = kv_shapes([SimpleNamespace(tp_k_head_num=8, tp_q_head_num=32, qk_head_dim=128)],
                       torch.bfloat16, cfg.window)
    workspace = _meta_workspace(cfg, shapes, device)
    rt, batch = _step(cfg, **QWEN3_4B, requests=requests, device="meta", workspace=workspace)
    monkeypatch.setattr(runtime, "RUNTIME", rt)
    rt.device_type = device  # meta tensors standing for this device's step
    with planning_for(device), PeakMemory() as peak:
        freed = step.evict(rt, batch)
    assert freed == requests * (cfg.budget - cfg.keep)
    assert workspace.overflows == 0  # every gather was a view of the buffer
    assert workspace.buffer_bytes + peak.peak <= workspace.size


@pytest.mark.parametrize("policy,device", [("vase-attnv", "cuda"), ("vase-dkv", "cuda"),
                                           ("snapkv", "cpu")])
def test_fp8_step_stays_inside_its_smaller_workspace(policy, device, monkeypatch):
    """--kv-cache-dtype fp8_e4m3 at Qwen3-4B shapes, T = 2048: the plan counts one byte per
    gathered K/V element (the query ring stays bf16) and the upcast scores' temporaries, so its
    workspace is smaller than bf16's and the step's traced peak still fits it."""
    cfg = EvictionConfig(policy=policy, budget=2048, window=64)
    layer = [SimpleNamespace(tp_k_head_num=8, tp_q_head_num=32, qk_head_dim=128)]
    shapes = kv_shapes(layer, torch.float8_e4m3fn, cfg.window)
    assert shapes.q_dtype == torch.bfloat16 and shapes.kv_dtype == torch.float8_e4m3fn
    workspace = _meta_workspace(cfg, shapes, device)
    bf16 = _meta_workspace(cfg, kv_shapes(layer, torch.bfloat16, cfg.window), device)
    assert workspace.buffer_bytes < bf16.buffer_bytes
    shape = dict(QWEN3_4B, dtype=torch.float8_e4m3fn)
    rt, batch = _step(cfg, **shape, requests=64, device="meta", workspace=workspace,
                      q_dtype=torch.bfloat16)
    assert rt.shapes == shapes  # as planned, so the step finds its plan's cost (no trace)
    monkeypatch.setattr(runtime, "RUNTIME", rt)
    rt.device_type = device
    with planning_for(device), PeakMemory() as peak:
        freed = step.evict(rt, batch)
    assert freed == 64 * (cfg.budget - cfg.keep)
    assert workspace.overflows == 0
    assert workspace.buffer_bytes + peak.peak <= workspace.size


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("policy", ["vase-attnv", "vase-dkv", "snapkv", "rkv",
                                    "evict-large-values"])
def test_fp8_step_equals_the_step_on_its_values_in_fp32(policy, kv_dtype, monkeypatch):
    """A real chunked step on CPU over an 8-bit cache selects what the same step selects over
    float32 buffers holding the same (dequantized) values, and moves the bytes exactly: the
    scorers read the fp8 values, the gathers and moves their bytes."""
    cfg = EvictionConfig(policy=policy, budget=23, window=4, sinks=3, seed=11)
    shape = dict(layers=3, kv_heads=2, q_heads=6, head_dim=16)
    fp8, batch = _step(cfg, **shape, dtype=kv_dtype, q_dtype=torch.float32, requests=5,
                       device="cpu", seed=7)
    fp32, batch32 = _step(cfg, **shape, dtype=torch.float32, requests=5, device="cpu", seed=7)
    for a, b in zip(fp32.k_buffers + fp32.v_buffers, fp8.k_buffers + fp8.v_buffers):
        a.copy_(b.float())
    assert torch.equal(fp32.req_to_token, fp8.req_to_token)
    if fp8.queries is not None:
        assert torch.equal(fp32.queries, fp8.queries)
    for rt, b in ((fp8, batch), (fp32, batch32)):
        cost = step_cost(cfg, rt.shapes, cfg.budget, "cpu")
        rt.workspace = Workspace(torch.empty(cost.buffer(2, 1), dtype=torch.uint8),
                                 group_bytes(5) + cost.temporaries(2, 1))
        monkeypatch.setattr(runtime, "RUNTIME", rt)
        step.evict(rt, b)
        assert rt.workspace.overflows == 0
    for got, want in zip(fp8.k_buffers + fp8.v_buffers, fp32.k_buffers + fp32.v_buffers):
        assert got.dtype == kv_dtype and torch.equal(got.float(), want)
    assert torch.equal(fp8.req_to_token, fp32.req_to_token)
    assert torch.equal(torch.cat(fp8.allocator.freed), torch.cat(fp32.allocator.freed))


def test_default_workspace_figures_for_qwen3_4b():
    """The figures docs/memory.md quotes (Triton path, T = 2048, window 64)."""
    cfg = EvictionConfig(policy="vase-attnv", budget=2048, window=64)
    shapes = KVShapes(8, 32, 128, torch.bfloat16, torch.bfloat16, 64)
    buffer, headroom, units, *_ = workspace_bytes(cfg, shapes, "cuda")
    assert units == 64
    assert 500 * 2**20 < buffer + headroom < 700 * 2**20


def test_too_small_a_workspace_is_refused_naming_the_flag():
    cfg = EvictionConfig(policy="snapkv", budget=2048, window=64, workspace_mb=4)
    shapes = KVShapes(8, 32, 128, torch.bfloat16, torch.bfloat16, 64)
    with pytest.raises(ValueError, match="--kv-evict-workspace-mb: 4 MiB cannot hold one"):
        workspace_bytes(cfg, shapes, "cuda")
    buffer, headroom, units, *_ = workspace_bytes(cfg.replace(workspace_mb=100), shapes,
                                                          "cuda")
    assert buffer + headroom == 100 * 2**20 and units >= 1


@pytest.mark.parametrize("policy", BUILT_IN)
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_cost_model_bounds_traced_chunks(policy, device):
    """The plan's per-unit model bounds the traced peak of chunks of every shape."""
    cfg = EvictionConfig(policy=policy, budget=96, window=16)
    shapes = KVShapes(2, 6, 32, torch.bfloat16, torch.bfloat16, 16)
    cost = chunk_cost(cfg, shapes, 96, device)
    for b, l in [(3, 5), (8, 1), (1, 8), (5, 2), (2, 3)]:
        buffer, peak = trace_chunk(cfg, shapes, 96, b, l, 4, device)
        assert buffer <= cost.buffer(b, l) and peak <= cost.temporaries(b, l), (b, l)


def test_plan_chunks_streams_layers_and_refuses_what_cannot_fit():
    from vase_sglang.plan import ChunkCost

    cost = ChunkCost(gather_per_unit=1024, per_unit=512, per_request=256)
    # All 64 requests of a layer fit, and two layers at a time.
    assert plan_chunks(cost, 64, 36, 128 * 1024, 64 * 1024 * 3) == (64, 2)
    # Only 10 units in the buffer: 10 requests of one layer per chunk.
    assert plan_chunks(cost, 64, 36, 10 * 1024, 10**9) == (10, 1)
    # Not one unit: None (the runtime then streams the unit's candidates: plan_step).
    assert plan_chunks(cost, 64, 36, 1000, 10**9) is None
    assert plan_chunks(cost, 64, 36, 10**9, 700) is None


def test_plan_step_streams_candidates_only_where_a_unit_does_not_fit():
    """Pure arithmetic: the plain stage where one unit fits; else one unit at a time with the
    largest candidate chunk (a power of two below n) that fits; None where nothing does."""
    from vase_sglang.plan import ChunkCost, StepPlan

    def cost_of(chunk):  # gathers 8 bytes per candidate, temporaries 100 + 2 per candidate
        c = 1000 if chunk is None else chunk
        return ChunkCost(gather_per_unit=8 * c, per_unit=100 + 2 * c + 10)

    assert plan_step(cost_of, 1000, 4, 3, 10**6, 10**6) == StepPlan(4, 3, None)
    assert plan_step(cost_of, 1000, 4, 3, 8 * 1000 - 1, 10**6) == StepPlan(1, 1, 512)
    assert plan_step(cost_of, 1000, 4, 3, 8 * 200, 10**6) == StepPlan(1, 1, 128)
    assert plan_step(cost_of, 1000, 4, 3, 10**6, 100 + 2 * 64 + 10) == StepPlan(1, 1, 64)
    assert plan_step(cost_of, 1000, 4, 3, 8 * 15, 10**6) is None  # below the smallest chunk
    assert plan_step(cost_of, 1000, 4, 3, 10**6, 500, streams=False) is None  # custom policy


QWEN3_SHAPES = KVShapes(8, 32, 128, torch.bfloat16, torch.bfloat16, 64)


@pytest.mark.parametrize("policy,device,workspace_mb,budget,n,layers", [
    ("vase-attnv", "cuda", 48, 2048, 32768, 36), ("vase-attnv", "cuda", 48, 2048, 65536, 2),
    ("snapkv", "cpu", 160, 2048, 32768, 2), ("rkv", "cuda", 64, 2048, 32768, 2),
    ("rkv", "cpu", 160, 2048, 16384, 2), ("vase-dkv", "cpu", 96, 2048, 32768, 2),
    ("trimkv", "cpu", 96, 2048, 32768, 2),
    # default sizes: at T = 2048 one unit of 32K candidates fits at once; at T = 256 it streams
    ("vase-attnv", "cuda", None, 2048, 32768, 2), ("snapkv", "cpu", None, 2048, 32768, 2),
    ("vase-attnv", "cuda", None, 256, 40960, 2)])
def test_long_private_cache_step_stays_inside_the_reserved_workspace(policy, device, workspace_mb,
                                                                    budget, n, layers,
                                                                    monkeypatch):
    """Issue 22 (safety): a long private prompt (the radix cache off: its first eviction has
    n = 8x to 160x the budget candidates) next to a request at the budget, Qwen3-4B shapes,
    bf16, in the workspace the server reserves for a context of n tokens (a size set with
    --kv-evict-workspace-mb, or the default). Where one (request, layer) unit of it does not
    fit at once, its candidates stream in chunks; either way the step's peak, traced on meta
    tensors, stays inside the workspace. Before streaming, that unit ran outside the
    workspace: at 48 MiB (CUDA plan) a 32K prompt peaked at 187 MiB, at 160 MiB (CPU plan) at
    916 MiB. Every streamed unit is alike (one at a time), so most cases run 2 of the 36
    layers, each chunk as a device runs it; the 36-layer case reads META_SPANS chunks per
    pass, as the plan does (meta tensors cost ~1 ms an op)."""
    cfg = EvictionConfig(policy=policy, budget=budget, window=64, workspace_mb=workspace_mb,
                         value_slots=256 if policy == "trimkv" else None)  # trimkv: reads V
    size = workspace_bytes(cfg, QWEN3_SHAPES, device, max_candidates=n)
    workspace = Workspace(torch.empty(size.buffer, dtype=torch.uint8, device="meta"), size.headroom)
    rt, batch = _step(cfg, **dict(QWEN3_4B, layers=layers), requests=2, device="meta",
                      workspace=workspace, candidates=[budget, n])
    monkeypatch.setattr(runtime, "RUNTIME", rt)
    rt.device_type = device
    plan = step.plan_group(rt, cfg, n, 1)  # the plan's costs are traced (and cached) as a server's are
    assert (plan.chunk is None) == (workspace_mb is None and budget == 2048), plan
    if layers < 36:
        monkeypatch.setattr(PoolCandidates, "META_SPANS", None)  # every chunk
    with planning_for(device), PeakMemory() as peak:
        freed = step.evict(rt, batch)
    assert freed == (cfg.budget - cfg.keep) + (n - cfg.keep)
    assert workspace.overflows == 0  # every gather was a view of the buffer
    assert workspace.buffer_bytes + peak.peak <= workspace.size


def test_workspace_holds_a_streamed_unit_of_the_context_and_a_unit_at_max_budget():
    """The sizing: DEFAULT_UNITS units at the budget, one unit at max_budget at once, and (for
    every policy a request may choose that streams) a unit of the context streamed."""
    cfg = EvictionConfig(policy="snapkv", budget=256, window=64)
    small = workspace_bytes(cfg, QWEN3_SHAPES, "cuda")
    assert small.units == 64 and small.max_budget == 256 and small.max_candidates == 256
    size = workspace_bytes(cfg, QWEN3_SHAPES, "cuda", max_budget=8192,
                                   max_candidates=131072)
    assert size.buffer >= small.buffer and size.headroom >= small.headroom
    assert "budget 8192" in size.describe() and "131072 tokens, streamed" in size.describe()
    headroom = size.headroom - group_bytes(1)
    big = cfg.replace(budget=8192)
    cost = step_cost(big, QWEN3_SHAPES, 8192, "cuda")
    assert plan_chunks(cost, 1, 36, size.buffer, headroom) is not None  # at once
    assert set(streamed_policies(cfg)) == set(BUILT_IN)
    for name in streamed_policies(cfg):  # streamed STREAM_CHUNK at a time, or better
        other = _request_like(cfg, name, 8192)
        cost = step_cost(other, QWEN3_SHAPES, 131072, "cuda", STREAM_CHUNK)
        assert cost.buffer(1, 1) <= size.buffer and cost.temporaries(1, 1) <= headroom, name
    long = _request_like(cfg, "snapkv", 8192)
    plan = plan_step(lambda c: step_cost(long, QWEN3_SHAPES, 131072, "cuda", c),
                     131072, 1, 36, size.buffer, headroom)
    assert plan.chunk >= STREAM_CHUNK, plan
    # A server whose policy reads no queries serves no query policy per request.
    assert "snapkv" not in streamed_policies(cfg.replace(policy="random"))
    # A size that cannot hold the streamed unit is refused, naming the flag.
    with pytest.raises(ValueError, match="--kv-evict-workspace-mb: 2 MiB cannot hold one"):
        workspace_bytes(cfg.replace(workspace_mb=2), QWEN3_SHAPES, "cuda",
                                max_candidates=131072)


@pytest.mark.parametrize("policy", BUILT_IN)
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_streamed_cost_model_bounds_traced_chunks(policy, device, monkeypatch):
    """The streamed stage's cost, traced at n's bucket with META_SPANS chunks per pass, bounds
    the stage run chunk by chunk at other n and partial last chunks."""
    cfg = EvictionConfig(policy=policy, budget=96, window=16)
    shapes = KVShapes(2, 6, 32, torch.bfloat16, torch.bfloat16, 16)
    for n, chunk in [(1000, 128), (513, 64), (1024, 256)]:  # partial last chunks, and none
        cost = chunk_cost(cfg, shapes, n, device, chunk)
        monkeypatch.setattr(PoolCandidates, "META_SPANS", None)
        buffer, peak = trace_chunk(cfg, shapes, n, 1, 1, 4, device, chunk)
        monkeypatch.undo()
        assert buffer <= cost.buffer(1, 1) and peak <= cost.temporaries(1, 1), (n, chunk)


def _long_prompt_step(cfg, workspace, seed=11):
    shape = dict(layers=3, kv_heads=2, q_heads=6, head_dim=16, dtype=torch.float32)
    return _step(cfg, **shape, requests=3, device="cpu", seed=seed, candidates=[23, 100, 23],
                 workspace=workspace)


@pytest.mark.parametrize("policy,value_slots", [(p, None) for p in BUILT_IN] + [("trimkv", 5)])
def test_streamed_step_equals_the_step_in_a_big_workspace(policy, value_slots, monkeypatch):
    """A real step on CPU (seeded random K/V, GQA): requests at the budget and one with a long
    private cache (n = 100, 4x the budget), in a workspace where one unit of the long one does
    not fit at once, selects and compacts exactly what the same step does in a workspace that
    holds it (the kept sets could differ only at near ties of attention scores, whose softmax
    sums are accumulated chunk by chunk; none here)."""
    cfg = EvictionConfig(policy=policy, budget=23, window=4, sinks=3, value_slots=value_slots)
    big, batch = _long_prompt_step(cfg, None)
    monkeypatch.setattr(runtime, "RUNTIME", big)
    assert step.plan_group(big, cfg, 100, 1).chunk is None
    step.evict(big, batch)
    shapes = big.shapes
    plain = step_cost(cfg, shapes, cfg.budget, "cpu")
    streamed = step_cost(cfg, shapes, 100, "cpu", 16)
    buffer = max(plain.buffer(1, 1), streamed.buffer(1, 1))
    headroom = group_bytes(2) + max(plain.temporaries(1, 1), streamed.temporaries(1, 1))
    small, batch = _long_prompt_step(cfg, Workspace(torch.empty(buffer, dtype=torch.uint8),
                                                    headroom))
    monkeypatch.setattr(runtime, "RUNTIME", small)
    plan = step.plan_group(small, cfg, 100, 1)
    if any(kv_reads(cfg)):  # random / streaming / plain trimkv read no K/V: at once
        assert plan.chunk is not None and plan.chunk < 100, plan
    step.evict(small, batch)
    assert small.workspace.overflows == 0 and big.workspace.overflows == 0
    side = lambda rt: [] if rt.retention is None else rt.retention.log_beta + rt.retention.position
    for got, want in zip(small.k_buffers + small.v_buffers + side(small),
                         big.k_buffers + big.v_buffers + side(big), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(small.req_to_token, big.req_to_token)
    assert torch.equal(torch.cat(small.allocator.freed), torch.cat(big.allocator.freed))


def test_a_policy_that_cannot_stream_is_skipped_not_run_outside_the_workspace(monkeypatch, caplog):
    """A registered policy overriding select() has no streamed path: where one unit of it does
    not fit, its requests are not evicted this step (logged once), nothing is allocated
    outside the workspace, and the other groups are evicted as usual. A policy that streams
    but cannot fit even streamed is an error, not an allocation: its requests are finished
    with that error (nothing moved), and the step returns to the scheduler."""
    from vase_sglang.policies import Policy, register_policy

    class Reverse(Policy):
        def select(self, keys, values, queries, draws, sinks, check=True):
            n = keys.shape[-2]
            return torch.arange(n - self.cfg.keep, n).expand(*keys.shape[:-2], self.cfg.keep)

    register_policy("test-reverse", Reverse)
    try:
        assert not Reverse.streams() and POLICIES["snapkv"].streams()
        cfg = EvictionConfig(policy="test-reverse", budget=23, window=4, sinks=3)
        rt, batch = _long_prompt_step(cfg, None)
        cost = step_cost(cfg, rt.shapes, cfg.budget, "cpu")
        rt.workspace = Workspace(torch.empty(cost.buffer(1, 1), dtype=torch.uint8),
                                 group_bytes(2) + cost.temporaries(1, 1))
        monkeypatch.setattr(runtime, "RUNTIME", rt)
        before = [b.clone() for b in rt.k_buffers]
        long_req = batch.reqs[1]
        with caplog.at_level("ERROR", logger="vase_sglang.eviction"):
            freed = step.evict(rt, batch)
            step.evict(rt, batch)  # logged once
        assert freed == 2 * (cfg.budget - cfg.keep)  # the two requests at the budget
        assert long_req.kv.kv_allocated_len == 3 + 100 + 4 and state.state(long_req).rounds == 0
        assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
        assert "cannot be streamed" in caplog.records[0].message
        assert rt.workspace.overflows == 0
        assert not all(torch.equal(a, b) for a, b in zip(before, rt.k_buffers))
    finally:
        del POLICIES["test-reverse"]
    cfg = EvictionConfig(policy="snapkv", budget=23, window=4, sinks=3)
    rt, batch = _long_prompt_step(cfg, Workspace(torch.empty(64, dtype=torch.uint8), 10**6))
    monkeypatch.setattr(runtime, "RUNTIME", rt)
    before = [b.clone() for b in rt.k_buffers]
    row = rt.req_to_token.clone()
    assert step.evict(rt, batch) == 0
    due = [r for r in batch.reqs if r.kv.kv_allocated_len > 3 + cfg.budget]
    assert due and all("stage 'plan'" in r.to_finish.message
                       and "even streamed in chunks of 16 candidates" in r.to_finish.message
                       for r in due)
    assert all(state.state(r).rounds == 0 and state.compacted(r) for r in due)
    assert all(torch.equal(a, b) for a, b in zip(before, rt.k_buffers))
    assert torch.equal(row, rt.req_to_token) and rt.stats.failures == len(due)
    assert grouping.due_groups(rt, batch) == {}  # never evicted again: they are being finished


def _unchunked(cfg, rt, batch):
    """Today's step, as it was: every layer of every request gathered at once, one select,
    one compaction of all layers. Returns (K buffers, V buffers, req_to_token, freed)."""
    reqs = batch.reqs
    n, window = cfg.budget, cfg.window
    k_bufs = [b.clone() for b in rt.k_buffers]
    v_bufs = [b.clone() for b in rt.v_buffers]
    table = rt.req_to_token.clone()
    rows = torch.tensor([r.kv.req_pool_idx for r in reqs])
    starts = torch.tensor([r.kv.cache_protected_len for r in reqs])
    row_slots = table[rows[:, None], starts[:, None] + torch.arange(n + window)].long()
    slots, newest = row_slots[:, :n], row_slots[:, n:]
    keys = torch.stack([b[slots] for b in k_bufs], dim=1).transpose(2, 3)
    values = torch.stack([b[slots] for b in v_bufs], dim=1).transpose(2, 3)
    queries = None
    if rt.queries is not None:
        queries = rt.queries[:, rows].permute(1, 0, 3, 2, 4)
    request = torch.tensor([state.request_key(r, cfg) for r in reqs])
    retention = side = None
    if rt.retention is not None:  # trimkv: log β and age from the side buffers, now = length
        side = [b.clone() for b in rt.retention.log_beta], [b.clone() for b in rt.retention.position]
        log_beta, position = (torch.stack([b[slots] for b in bufs], dim=1)[..., 0].transpose(2, 3)
                              for bufs in side)
        now = torch.tensor([r.kv.kv_allocated_len for r in reqs])
        retention = Retention(log_beta, now[:, None, None, None] - position)
    keep = select_tokens(cfg, keys, values, queries, request=request[:, None],
                         layer=torch.arange(len(k_bufs))[None, :], round=torch.zeros(len(reqs), 1,
                                                                                    dtype=torch.int64),
                         sinks=0, check=False, retention=retention)
    compact_kv_reference_(k_bufs, v_bufs, slots, keep)
    if side is not None:
        compact_kv_reference_(side[0], side[1], slots, keep)
        k_bufs, v_bufs = k_bufs + side[0], v_bufs + side[1]
    k = keep.shape[-1]
    table[rows[:, None], starts[:, None] + k + torch.arange(window)] = newest.to(table.dtype)
    return k_bufs, v_bufs, table, slots[:, k:].reshape(-1)


@pytest.mark.parametrize("policy,value_slots", [(p, None) for p in BUILT_IN] + [("trimkv", 5)])
def test_chunked_step_equals_the_unchunked_one(policy, value_slots, monkeypatch):
    """A real step on CPU (seeded random K/V, GQA, odd n) in a workspace that forces chunks of
    2 requests x 1 layer selects and compacts exactly what the all-at-once step does
    (trimkv: the all-at-once step reads K/V, the chunked one reads V only for value slots)."""
    cfg = EvictionConfig(policy=policy, budget=23, window=4, sinks=3, value_slots=value_slots)
    shape = dict(layers=3, kv_heads=2, q_heads=6, head_dim=16, dtype=torch.float32)
    rt, batch = _step(cfg, **shape, requests=5, device="cpu", seed=7)
    monkeypatch.setattr(runtime, "RUNTIME", rt)
    expected = _unchunked(cfg, rt, batch)
    cost = step_cost(cfg, rt.shapes, cfg.budget, "cpu")
    rt.workspace = Workspace(torch.empty(cost.buffer(2, 1), dtype=torch.uint8),
                             group_bytes(5) + cost.temporaries(2, 1))
    assert step.plan_group(rt, cfg, cfg.budget, 5) == (2, 1, None)  # 3 request chunks x 3 layer chunks
    step.evict(rt, batch)
    assert rt.workspace.overflows == 0
    got = rt.k_buffers + rt.v_buffers
    if rt.retention is not None:
        got = rt.k_buffers + rt.retention.log_beta + rt.v_buffers + rt.retention.position
    assert len(got) == len(expected[0] + expected[1])
    for got, want in zip(got, expected[0] + expected[1]):
        assert torch.equal(got, want)
    assert torch.equal(rt.req_to_token, expected[2])
    assert torch.equal(torch.cat(rt.allocator.freed), expected[3])


def test_rkv_redundancy_equals_the_cosine_matrix_formula():
    """mean_{j != i} cos(k_i, k_j) in O(n D) equals R-KV's n x n formula, zero keys included."""
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 3, 4, 37, 16, generator=gen).to(torch.bfloat16)
    keys[0, 1, 2, 5] = 0
    unit = torch.nn.functional.normalize(keys.float(), dim=-1)
    cos = unit @ unit.transpose(-1, -2)
    cos.diagonal(dim1=-2, dim2=-1).zero_()
    torch.testing.assert_close(mean_cosine_to_others(keys), cos.mean(dim=-1), rtol=0, atol=1e-6)
    assert mean_cosine_to_others(keys)[0, 1, 2, 5] == 0
    # And the policy's score is R-KV's definition.
    cfg = EvictionConfig(policy="rkv", budget=30, window=4)
    queries = torch.randn(2, 3, 8, 4, 16, generator=gen)
    policy = RKVPolicy(cfg)
    importance = POLICIES["snapkv"](cfg).score(keys, None, queries, None)
    want = 0.5 * importance - 0.5 * torch.softmax(cos.mean(dim=-1), dim=-1)
    torch.testing.assert_close(policy.score(keys, None, queries, None), want, rtol=0, atol=1e-7)


class _HostReads(TorchDispatchMode):
    """Fails on what would stall the CPU on a GPU: a device value read on the host, or a
    blocking host-to-device copy."""

    READS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::_unique2", "aten::unique_dim",
             "aten::masked_select", "aten::item"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        assert name not in self.READS, f"{name} reads a device value on the host"
        if name in ("aten::_to_copy", "aten::copy_"):
            src = args[1] if name == "aten::copy_" else args[0]
            dst = args[0].device if name == "aten::copy_" else kwargs.get("device", src.device)
            if src.device.type == "cpu" and torch.device(dst).type != "cpu":
                assert kwargs.get("non_blocking", args[2] if len(args) > 2 else False), (
                    f"{name}: blocking host-to-device copy")
        return func(*args, **kwargs)


@pytest.mark.parametrize("policy,page_size,budget,window,streamed", [
    *[(p, 1, 40, 8, False) for p in BUILT_IN],
    # paged: the newest window moved by pages (48 / 16) or copied (40 / 16)
    ("vase-attnv", 16, 48, 16, False), ("vase-attnv", 16, 40, 16, False),
    ("snapkv", 16, 40, 16, False),
    # candidates streamed 16 at a time (a workspace that holds no unit at once)
    *[(p, 1, 40, 8, True) for p in BUILT_IN if p not in ("random", "streaming")]])
def test_step_makes_no_blocking_host_copies_and_reads_nothing_back(policy, page_size, budget,
                                                                  window, streamed, monkeypatch):
    """The whole step on meta tensors (a device value cannot be read on meta at all), with
    torch.tensor / as_tensor of host data onto the device forbidden: those are synchronising
    copies from pageable memory (the step stages through pinned buffers instead)."""
    cfg = EvictionConfig(policy=policy, budget=budget, window=window,
                         value_slots=4 if policy == "trimkv" and streamed else None)
    shape = dict(layers=3, kv_heads=2, q_heads=6, head_dim=16, dtype=torch.bfloat16)
    shapes = KVShapes(2, 6, 16, torch.bfloat16, torch.bfloat16, window)
    prefix = 3 if page_size == 1 else 2 * page_size  # the tree owns whole pages
    workspace = _meta_workspace(cfg, shapes, "cuda")
    if streamed:
        cost = step_cost(cfg, shapes, cfg.budget, "cuda", 16)
        workspace = Workspace(torch.empty(cost.buffer(1, 1), dtype=torch.uint8, device="meta"),
                              group_bytes(5) + cost.temporaries(1, 1))
    rt, batch = _step(cfg, **shape, requests=5, device="meta", prefix=prefix,
                      page_size=page_size, workspace=workspace)
    rt.device_type = "cuda"
    monkeypatch.setattr(runtime, "RUNTIME", rt)
    assert (step.plan_group(rt, cfg, cfg.budget, 5).chunk == 16) == streamed  # plan traces are host-only
    from vase_sglang.ops.compact import pointer_table

    side = () if rt.retention is None else (rt.retention.log_beta, rt.retention.position)
    for buffers in (rt.k_buffers, rt.v_buffers, *side):  # built at startup on CUDA (__post_init__)
        pointer_table(buffers, torch.device("meta"))
    for name in ("tensor", "as_tensor"):
        make = getattr(torch, name)

        def guarded(data, *args, _make=make, _name=name, **kwargs):
            device = kwargs.get("device")
            assert isinstance(data, torch.Tensor) or device is None or \
                torch.device(device).type == "cpu", f"torch.{_name}(host data, device={device})"
            return _make(data, *args, **kwargs)

        monkeypatch.setattr(torch, name, guarded)
    with planning_for("cuda"), _HostReads():
        freed = step.evict(rt, batch)
    assert freed == 5 * rows.freed_slots(cfg.budget, cfg.keep, cfg.window, page_size) > 0
