"""Shared budget scopes served (issue 52): heads keep unequal counts in the same slots.

With `budget_scope` "layer" or "global" (vase_sglang/config.py) the older tokens of a request
are *cells* (vase_sglang/cells.py): its row keeps `prefix | K older slots | newest`, as under a
per-head budget, so SGLang's allocator, memory checks and radix tree see nothing new, but a
cell (layer l, older slot j, KV head h) may hold the token of any (layer, KV head) of the
scope. Two pieces live here:

  evict_one              the eviction of one request: score every candidate (its cells and
                         the leaving slots) with the policy, keep the scope's total
                         (cells.select_shared, the reference's ranking), pack the kept
                         leaving tokens into the dropped cells (cells.pack), copy their K/V
                         and trimkv side values there, then rewrite the row and free the
                         leaving slots as a per-head step does (step._apply).
  around_forward_decode  torch_native's decode attention: a request holding cells is
                         recomputed per KV head over its prompt, its newest tokens and the
                         cells it owns (read from any layer's buffer).

Memory: the cell map (owner and position, int64 [L, K, H] each) is host-side request state,
beside the row; a step holds one request's candidates' scores [L, n, H] and its leaving
tokens' K/V [L, n - K, H, D] at a time, outside the step workspace (at Qwen2.5-0.5B's shapes,
T = 64 and R = 16: 0.2 MiB). Served on CPU (torch_native), pages of 1, one rank, 16/32-bit
K/V (supported.shared_scope_refusal); nothing here reads a device value on CUDA because it
never runs there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vase_sglang.cells import CellMap, pack, select_shared
from vase_sglang.policies import POLICIES, Retention

from . import runtime
from .commit import COMPACT, PACK, SELECT, StepFailure
from .state import STATE, pos_offset, state

TARGET_DECODE = ("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend."
                 "forward_decode")


@dataclass(frozen=True)
class CellView:
    """What decode attention needs of a request holding cells: its prefix length, K, the
    pool slots of its K older slots, and its cells sorted by owner (CellMap.segments: flat
    cell indices (l · K + j) · H + h, and per owner l · H + h its range as host ints)."""

    prefix: int
    keep: int
    older: torch.Tensor  # [K] int64
    order: torch.Tensor  # [L · K · H] int64
    offsets: list  # L · H + 1 host ints

    def owned(self, layer: int, head: int, kv_heads: int) -> torch.Tensor:
        i = layer * kv_heads + head
        return self.order[self.offsets[i]: self.offsets[i + 1]]


def evict_one(rt, cfg, n: int, sinks: int, req) -> tuple[torch.Tensor, torch.Tensor]:
    """Select and pack one request's candidates under cfg.budget_scope; returns its row's
    slots before the rewrite ([n + R]) and the new cell map's view, the K/V and side values
    already moved (the caller rewrites the row and frees the leaving slots: step._apply).
    Raises commit.StepFailure naming the stage: select (scoring and the scope's selection),
    pack (a selection that does not fill the holes: cells.pack's check) or compact (the
    copies into cells); nothing has moved before the copies."""
    K, H = cfg.keep, rt.shapes.kv_heads
    row, prefix = req.kv.req_pool_idx, req.kv.cache_protected_len
    device = rt.req_to_token.device
    row_slots = rt.req_to_token[row, prefix + torch.arange(n + cfg.window, device=device)].long()
    older, leaving = row_slots[:K], row_slots[K:n]
    st = state(req)
    try:
        keep, position, cells = _select(rt, cfg, n, sinks, req, row_slots)
    except Exception as err:
        raise StepFailure(SELECT, err) from err
    try:
        packed, moves = pack(cells, position[0, K:, 0], keep[:, :K], keep[:, K:],
                             check=device.type == "cpu")
    except Exception as err:
        raise StepFailure(PACK, err) from err
    try:
        move_kept(rt, moves, older, leaving, K, H)
    except Exception as err:
        raise StepFailure(COMPACT, err) from err
    st.cells = packed
    order, offsets = packed.segments()
    return row_slots, CellView(prefix, K, older, order, offsets.tolist())


def _select(rt, cfg, n: int, sinks: int, req, row_slots):
    """Score every candidate of the scope (its K cells, then the leaving slots) with the
    policy and keep the scope's total (cells.select_shared). The shared-scope contract
    (Policy.shares_budget_refusal, docs/add_policy.md): the policy scores from retention, as
    score_streamed(candidates, None, None) with `candidates` of shape [L, n, H] and its
    `retention` the log β and age of every candidate [L, n, H]; no K/V, queries or draws."""
    K, L, H = cfg.keep, rt.num_layers, rt.shapes.kv_heads
    prefix = req.kv.cache_protected_len
    r = rt.retention
    # every candidate's log β and true position: [L, n, H], the K cells then the leaving slots
    log_beta = torch.stack([lb[row_slots[:n], :, 0] for lb in r.log_beta])
    position = torch.stack([p[row_slots[:n], :, 0] for p in r.position]).long()
    st = state(req)
    plain = CellMap.plain(position[0, :K, 0], L, H, cfg.budget_scope)
    cells = st.cells if st.cells is not None else plain
    owner = torch.cat([cells.owner, plain.owner[:, :1].expand(L, n - K, H)], dim=1)
    now = req.kv.kv_allocated_len + pos_offset(req)  # the true length: the next position
    policy = POLICIES[cfg.policy](cfg, attention=rt.attention,
                                  retention=Retention(log_beta, (now - position).float()))
    score = policy.score_streamed(log_beta, None, None).float().clone()
    if score.shape != log_beta.shape:
        raise ValueError(f"policy {cfg.policy!r}: scored a shared scope as {tuple(score.shape)}, "
                         f"not [layers, candidates, KV heads] {tuple(log_beta.shape)}")
    score = score.masked_fill(position < prefix + sinks, float("inf"))  # sinks: always kept
    keep = select_shared(score, owner, position, K, cfg.budget_scope)
    return keep, position, CellMap(cells.owner, position[:, :K], cfg.budget_scope)


def move_kept(rt, moves, older, leaving, K: int, H: int) -> None:
    """The kept leaving tokens into their cells: K, V, log β, position, one destination layer
    at a time (sources and destinations are disjoint slots)."""
    r = rt.retention
    dst_layer, dst_slot = moves.dst // (K * H), older[(moves.dst // H) % K]
    dst_head = moves.dst % H
    for buffers in (rt.k_buffers, rt.v_buffers, r.log_beta, r.position):
        moved = torch.stack([b[leaving] for b in buffers])  # [L, n - K, H, ...]
        for layer in range(len(buffers)):
            sel = moves.valid & (dst_layer == layer)
            buffers[layer][dst_slot[sel], dst_head[sel]] = moved[sel]


def forget(req) -> None:
    """The request gives its row back (finish, abort, retraction): its cells go with it."""
    rt = runtime.RUNTIME
    st = getattr(req, STATE, None)
    if rt is not None and st is not None and st.cells is not None:
        rt.cell_views.pop(req.kv.req_pool_idx, None)
        st.cells = None


def around_forward_decode(original, backend, q, k, v, layer, forward_batch, *args, **kwargs):
    """AROUND TorchNativeAttnBackend.forward_decode: SGLang's decode attention for every
    request (it also writes the new token's K/V), then, for each request holding cells, its
    output recomputed per KV head over its prompt, its newest tokens and the cells it owns
    (the older slots' columns of its row hold other heads' tokens at this layer)."""
    out = original(backend, q, k, v, layer, forward_batch, *args, **kwargs)
    rt = runtime.RUNTIME
    if rt is None or not rt.cell_views or layer.is_cross_attention:
        return out
    rows = forward_batch.req_pool_indices.tolist()
    hits = [(i, rt.cell_views[row]) for i, row in enumerate(rows) if row in rt.cell_views]
    if not hits:
        return out
    lens = forward_batch.seq_lens.tolist()
    H = rt.shapes.kv_heads
    here = layer.layer_id - rt.start_layer
    q_heads, dim = layer.tp_q_head_num, layer.qk_head_dim
    group = q_heads // H
    queries = q.reshape(-1, q_heads, dim)
    outputs = out.view(-1, q_heads, layer.v_head_dim)
    k_cache = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_cache = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
    # Neither the row nor the cells change within a forward (the new token's slot is already
    # in the row): each request's plain slots and its cells of every layer are gathered once
    # per forward, at its first layer.
    gathered = forward_batch.__dict__.setdefault("_vase_cells", {})
    for i, view in hits:
        if i not in gathered:
            row_slots = backend.req_to_token_pool.req_to_token[rows[i], :lens[i]].long()
            gathered[i] = (torch.cat([row_slots[:view.prefix], row_slots[view.prefix + view.keep:]]),
                           torch.stack([b[view.older] for b in rt.k_buffers]).flatten(0, 2),
                           torch.stack([b[view.older] for b in rt.v_buffers]).flatten(0, 2))
        plain, cell_k, cell_v = gathered[i]
        plain_k, plain_v = k_cache[plain], v_cache[plain]  # [n, H, D]
        for h in range(H):
            owned = view.owned(here, h, H)
            keys = torch.cat([plain_k[:, h], cell_k[owned]])
            values = torch.cat([plain_v[:, h], cell_v[owned]])
            query = queries[i, h * group:(h + 1) * group]  # [G, D]
            if keys.dtype != query.dtype:  # as SGLang's decode does
                keys, values = keys.to(query.dtype), values.to(query.dtype)
            outputs[i, h * group:(h + 1) * group] = torch.nn.functional.scaled_dot_product_attention(
                query[:, None], keys.expand(group, -1, -1), values.expand(group, -1, -1),
                scale=layer.scaling)[:, 0]
    return out


HOOKS = [(TARGET_DECODE, "AROUND", around_forward_decode)]
