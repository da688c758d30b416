"""The eviction step's memory is bounded by its workspace (issue 10, item 2).

The large cases run the real step (patches/runtime.py) on meta tensors under PeakMemory:
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

from vase_sglang.workspace import (KVShapes, PeakMemory, Workspace, chunk_cost, plan_chunks,
                                   trace_chunk)
from vase_sglang_patches import runtime
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
          seed=0, prefix=3, page_size=1):
    """A runtime over a pool holding `requests` requests of n = budget candidates each, and a
    decode batch of them. On meta nothing is allocated."""
    n, window = cfg.budget, cfg.window
    per_req = prefix + n + window
    slots_total = requests * per_req + 1
    gen = torch.Generator().manual_seed(seed)

    def tensor(*shape, dt=dtype):
        if device == "meta":
            return torch.empty(*shape, dtype=dt, device="meta")
        return torch.randn(*shape, generator=gen).to(dt)

    k_buffers = [tensor(slots_total, kv_heads, head_dim) for _ in range(layers)]
    v_buffers = [tensor(slots_total, kv_heads, head_dim) for _ in range(layers)]
    ring = None
    if POLICIES[cfg.policy].needs_queries:
        ring = tensor(layers, requests + 1, window, q_heads, head_dim)
    # Each request's row: a shuffled run of slots, so gathers and compaction cross rows.
    if device == "meta":
        req_to_token = torch.empty(requests + 1, per_req + 8, dtype=torch.int32, device="meta")
    else:
        perm = torch.randperm(slots_total - 1, generator=gen) + 1
        req_to_token = torch.zeros(requests + 1, per_req + 8, dtype=torch.int32)
        req_to_token[:requests, :per_req] = perm[: requests * per_req].view(requests, per_req).int()
    rt = runtime.EvictionRuntime(
        cfg=cfg, k_buffers=k_buffers, v_buffers=v_buffers, req_to_token=req_to_token,
        allocator=_Allocator(), num_q_heads=q_heads, head_dim=head_dim, start_layer=0,
        queries=ring, workspace=workspace, page_size=page_size,
    )
    reqs = [_request(i, n, window, prefix) for i in range(requests)]
    lens = torch.full((requests,), prefix + n + window, dtype=torch.int64)
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
    buffer, headroom, _units = runtime.workspace_bytes(cfg, shapes, device)
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
        freed = rt.evict(batch)
    assert freed == requests * (cfg.budget - cfg.keep)
    assert workspace.overflows == 0  # every gather was a view of the buffer
    assert workspace.buffer_bytes + peak.peak <= workspace.size


def test_default_workspace_figures_for_qwen3_4b():
    """The figures docs/memory.md quotes (Triton path, T = 2048, window 64)."""
    cfg = EvictionConfig(policy="vase-attnv", budget=2048, window=64)
    shapes = KVShapes(8, 32, 128, torch.bfloat16, torch.bfloat16, 64)
    buffer, headroom, units = runtime.workspace_bytes(cfg, shapes, "cuda")
    assert units == 64
    assert 500 * 2**20 < buffer + headroom < 700 * 2**20


def test_too_small_a_workspace_is_refused_naming_the_flag():
    cfg = EvictionConfig(policy="snapkv", budget=2048, window=64, workspace_mb=4)
    shapes = KVShapes(8, 32, 128, torch.bfloat16, torch.bfloat16, 64)
    with pytest.raises(ValueError, match="--kv-evict-workspace-mb: 4 MiB cannot hold one"):
        runtime.workspace_bytes(cfg, shapes, "cuda")
    buffer, headroom, units = runtime.workspace_bytes(cfg.replace(workspace_mb=100), shapes, "cuda")
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
    from vase_sglang.workspace import ChunkCost

    cost = ChunkCost(gather_per_unit=1024, per_unit=512, per_request=256)
    # All 64 requests of a layer fit, and two layers at a time.
    assert plan_chunks(cost, 64, 36, 128 * 1024, 64 * 1024 * 3) == (64, 2)
    # Only 10 units in the buffer: 10 requests of one layer per chunk.
    assert plan_chunks(cost, 64, 36, 10 * 1024, 10**9) == (10, 1)
    # Not one unit: None (the runtime then warns and runs unit by unit).
    assert plan_chunks(cost, 64, 36, 1000, 10**9) is None
    assert plan_chunks(cost, 64, 36, 10**9, 700) is None


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
    request = torch.tensor([runtime.request_key(r, cfg) for r in reqs])
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
    cost = runtime.step_cost(cfg, rt.shapes, cfg.budget, "cpu")
    rt.workspace = Workspace(torch.empty(cost.buffer(2, 1), dtype=torch.uint8),
                             runtime.group_bytes(5) + cost.temporaries(2, 1))
    assert rt._plan(cfg, cfg.budget, 5) == (2, 1)  # 3 request chunks x 3 layer chunks
    rt.evict(batch)
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


@pytest.mark.parametrize("policy,page_size,budget,window", [
    *[(p, 1, 40, 8) for p in BUILT_IN],
    # paged: the newest window moved by pages (48 / 16) or copied (40 / 16)
    ("vase-attnv", 16, 48, 16), ("vase-attnv", 16, 40, 16), ("snapkv", 16, 40, 16)])
def test_step_makes_no_blocking_host_copies_and_reads_nothing_back(policy, page_size, budget,
                                                                  window, monkeypatch):
    """The whole step on meta tensors (a device value cannot be read on meta at all), with
    torch.tensor / as_tensor of host data onto the device forbidden: those are synchronising
    copies from pageable memory (the step stages through pinned buffers instead)."""
    cfg = EvictionConfig(policy=policy, budget=budget, window=window)
    shape = dict(layers=3, kv_heads=2, q_heads=6, head_dim=16, dtype=torch.bfloat16)
    shapes = KVShapes(2, 6, 16, torch.bfloat16, torch.bfloat16, window)
    prefix = 3 if page_size == 1 else 2 * page_size  # the tree owns whole pages
    rt, batch = _step(cfg, **shape, requests=5, device="meta", prefix=prefix,
                      page_size=page_size, workspace=_meta_workspace(cfg, shapes, "cuda"))
    rt.device_type = "cuda"
    monkeypatch.setattr(runtime, "RUNTIME", rt)
    runtime.step_cost(cfg, rt.shapes, cfg.budget, "cuda")  # plan traces are host-only
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
        freed = rt.evict(batch)
    assert freed == 5 * runtime.freed_slots(cfg.budget, cfg.keep, cfg.window, page_size) > 0
