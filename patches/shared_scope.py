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
  around_forward_decode  torch_native's decode attention: SGLang's SDPA loop skips the
  around_sdpa_decode     requests holding cells, which are attended per KV head over their
                         prompt, newest tokens and the cells they own (any layer's buffer).
  after_triton_metadata  the triton backend's decode: SGLang's kernel reads a request holding
  around_triton_forward_decode  cells over its plain tokens only, and the cell kernel's part
                         is merged in through the log-sum-exp.

Memory: the cell map (owner and position, int64 [L, K, H] each) is host-side request state,
beside the row; a step holds one request's candidates' scores [L, n, H] and its leaving
tokens' K/V [L, n - K, H, D] at a time, outside the step workspace (at Qwen2.5-0.5B's shapes,
T = 64 and R = 16: 0.2 MiB; an elastic cut's n is the grown cache: about 0.2 MiB per 16
candidates in fp32). Served on CPU (torch_native, and triton under Triton's interpreter), with
pages, elastic mode, fp8 K/V on torch_native (supported.shared_scope_refusal); the hooks read
device values on the host, which is why CUDA (graphs) stays refused.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch

from vase_sglang.cells import CellMap, pack, select_shared
from vase_sglang.ops.cell_attention import cell_attention, merge_attention, split_lse
from vase_sglang.policies import POLICIES, Retention

from . import runtime
from .commit import COMPACT, PACK, SELECT, StepFailure
from .state import STATE, pos_offset, state

TARGET_DECODE = ("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend."
                 "forward_decode")
TARGET_SDPA_DECODE = ("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend."
                      "_run_sdpa_forward_decode")
TARGET_TRITON_METADATA = ("sglang.srt.layers.attention.triton_backend.TritonAttnBackend."
                          "init_forward_metadata")
TARGET_TRITON_DECODE = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.forward_decode"


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
    offset_table: torch.Tensor  # the same offsets, int64 [L · H + 1], for the cell kernel

    def owned(self, layer: int, head: int, kv_heads: int) -> torch.Tensor:
        i = layer * kv_heads + head
        return self.order[self.offsets[i]: self.offsets[i + 1]]

    def plain(self, row_slots: torch.Tensor) -> torch.Tensor:
        """The row's plain slots (prompt and newest tokens): without its K older columns,
        whose cells hold tokens of any (layer, head)."""
        return torch.cat([row_slots[:self.prefix], row_slots[self.prefix + self.keep:]])


def cell_hits(forward_batch) -> tuple[list[int], list[tuple[int, CellView]]]:
    """The batch's request-table rows and, for each request holding cells, (its index in the
    batch, its CellView); ([], []) when no request of this process holds cells."""
    rt = runtime.RUNTIME
    if rt is None or not rt.cell_views:
        return [], []
    rows = forward_batch.req_pool_indices.tolist()
    return rows, [(i, rt.cell_views[row]) for i, row in enumerate(rows) if row in rt.cell_views]


def evict_one(rt, cfg, n: int, sinks: int, req) -> tuple[torch.Tensor, CellView]:
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
        keep, candidates = _select(rt, cfg, n, sinks, req, row_slots)
    except Exception as err:
        raise StepFailure(SELECT, err) from err
    try:
        # the first K slots hold the cells after the cut; the rest leave (plain slots, and
        # cells too where an elastic cut goes below the cells the request holds)
        cells = CellMap(candidates.owner[:, :K], candidates.position[:, :K], cfg.budget_scope)
        going = CellMap(candidates.owner[:, K:], candidates.position[:, K:], cfg.budget_scope)
        packed, moves = pack(cells, going, keep[:, :K], keep[:, K:], check=device.type == "cpu")
    except Exception as err:
        raise StepFailure(PACK, err) from err
    try:
        move_kept(rt, moves, older, leaving, K, H)
    except Exception as err:
        raise StepFailure(COMPACT, err) from err
    st.cells = packed
    order, offsets = packed.segments()
    return row_slots, CellView(prefix, K, older, order, offsets.tolist(), offsets)


def _select(rt, cfg, n: int, sinks: int, req, row_slots) -> tuple[torch.Tensor, CellMap]:
    """Score every candidate of the scope (the n oldest private slots: the cells the request
    holds, then plain slots) with the policy and keep the scope's total, L · H · K with K =
    cfg.keep (cells.select_shared); returns the kept mask and the candidates' map [L, n, H].
    K may differ from the cells held (an elastic cut: a level of its own). The shared-scope
    contract (Policy.shares_budget_refusal, docs/add_policy.md): the policy scores from
    retention, as score_streamed(candidates, None, None) with `candidates` of shape
    [L, n, H] and its `retention` the log β and age of every candidate [L, n, H]; no K/V,
    queries or draws."""
    K, L, H = cfg.keep, rt.num_layers, rt.shapes.kv_heads
    prefix = req.kv.cache_protected_len
    r = rt.retention
    # every candidate's log β and true position [L, n, H] (a cell's own, moved with it)
    log_beta = torch.stack([lb[row_slots[:n], :, 0] for lb in r.log_beta])
    position = torch.stack([p[row_slots[:n], :, 0] for p in r.position]).long()
    # slots past the cells held are plain: each (layer, head) cell holds its own token
    owner = CellMap.plain(position[0, :, 0], L, H, cfg.budget_scope).owner
    held = state(req).cells
    if held is not None:
        owner[:, :held.slots] = held.owner
    now = req.kv.kv_allocated_len + pos_offset(req)  # the true length: the next position
    policy = POLICIES[cfg.policy](cfg, attention=rt.attention,
                                  retention=Retention(log_beta, (now - position).float()))
    score = policy.score_streamed(log_beta, None, None).float().clone()
    if score.shape != log_beta.shape:
        raise ValueError(f"policy {cfg.policy!r}: scored a shared scope as {tuple(score.shape)}, "
                         f"not [layers, candidates, KV heads] {tuple(log_beta.shape)}")
    score = score.masked_fill(position < prefix + sinks, float("inf"))  # sinks: always kept
    keep = select_shared(score, owner, position, K, cfg.budget_scope, cfg.floor)
    return keep, CellMap(owner, position, cfg.budget_scope)


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


# The batch rows (forward order) whose decode attention SGLang's SDPA loop leaves to
# around_forward_decode, set for the duration of one forward_decode call.
_CELL_ROWS: contextvars.ContextVar = contextvars.ContextVar("vase_cell_rows", default=None)


def around_forward_decode(original, backend, q, k, v, layer, forward_batch, *args, **kwargs):
    """AROUND TorchNativeAttnBackend.forward_decode: SGLang's decode (it writes the new token's
    K/V) attends every request but those holding cells (around_sdpa_decode skips them); each
    of those is attended here per KV head over its prompt, its newest tokens and the cells it
    owns (the older slots' columns of its row hold other heads' tokens at this layer)."""
    rows, hits = cell_hits(forward_batch)
    if not hits or layer.is_cross_attention:
        return original(backend, q, k, v, layer, forward_batch, *args, **kwargs)
    rt = runtime.RUNTIME
    token = _CELL_ROWS.set(frozenset(i for i, _ in hits))
    try:
        out = original(backend, q, k, v, layer, forward_batch, *args, **kwargs)
    finally:
        _CELL_ROWS.reset(token)
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
            gathered[i] = (view.plain(row_slots),
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


def around_sdpa_decode(original, backend, query, output, k_cache, v_cache, req_to_token,
                       req_pool_indices, seq_lens, *args, **kwargs):
    """AROUND TorchNativeAttnBackend._run_sdpa_forward_decode (its per-request SDPA loop): in a
    forward_decode whose batch has requests holding cells (_CELL_ROWS), only the other
    requests are attended; the skipped ones' output rows are left to around_forward_decode
    (no pass is computed and thrown away)."""
    skip = _CELL_ROWS.get()
    encoder_lens = args[0] if args else kwargs.get("encoder_lens")
    if not skip or encoder_lens is not None:
        return original(backend, query, output, k_cache, v_cache, req_to_token,
                        req_pool_indices, seq_lens, *args, **kwargs)
    rest = [i for i in range(seq_lens.shape[0]) if i not in skip]
    if rest:
        idx = torch.tensor(rest, device=query.device)
        part = output[idx]  # query / output: [tokens, heads, dim], one token per request
        original(backend, query[idx], part, k_cache, v_cache, req_to_token,
                 req_pool_indices[idx], seq_lens[idx], *args, **kwargs)
        output[idx] = part
    return output


def after_triton_metadata(ret, backend, forward_batch, *args, **kwargs):
    """AFTER TritonAttnBackend.init_forward_metadata: at decode, a request holding cells is
    read by SGLang's kernel over its plain tokens only (prompt and newest slots): its K older
    columns, which hold cells of any (layer, head), leave its kv_indices, and its split count
    follows its shorter length. Other requests' indices are SGLang's, unchanged."""
    if not forward_batch.forward_mode.is_decode():
        return ret
    rows, hits = cell_hits(forward_batch)
    if not hits:
        return ret
    views = dict(hits)
    md = backend.forward_metadata
    lens = forward_batch.seq_lens.tolist()
    pieces, plain_lens = [], []
    for i, (row, n) in enumerate(zip(rows, lens)):
        slots = backend.req_to_token[row, :n]
        if i in views:
            slots = views[i].plain(slots)
        pieces.append(slots.to(md.kv_indices.dtype))
        plain_lens.append(slots.numel())
    plain = torch.tensor(plain_lens, dtype=forward_batch.seq_lens.dtype,
                         device=forward_batch.seq_lens.device)
    indptr = torch.zeros(len(rows) + 1, dtype=md.kv_indptr.dtype, device=md.kv_indptr.device)
    indptr[1:] = plain.cumsum(0)
    # new tensors: kv_indptr is a view of the backend's persistent buffer
    md.kv_indptr, md.kv_indices = indptr, torch.cat(pieces)
    num_kv_splits = torch.empty_like(md.num_kv_splits)
    backend.get_num_kv_splits(num_kv_splits, plain, md.uneven_batch)
    md.num_kv_splits = num_kv_splits
    return ret


def around_triton_forward_decode(original, backend, q, k, v, layer, forward_batch, *args,
                                 **kwargs):
    """AROUND TritonAttnBackend.forward_decode: SGLang's decode (over each request's plain
    tokens, after_triton_metadata) writes the new token's K/V and the attention over the
    plain part; a request holding cells then gets the attention over the cells each KV head
    owns (ops.cell_attention, in any layer's buffer) merged in through the log-sum-exp, the
    plain part's taken from the kernel's per-split log-sum-exps (split_lse)."""
    out = original(backend, q, k, v, layer, forward_batch, *args, **kwargs)
    _, hits = cell_hits(forward_batch)
    if not hits or layer.is_cross_attention:
        return out
    rt = runtime.RUNTIME
    md = backend.forward_metadata
    q_heads = layer.tp_q_head_num
    queries = q.reshape(-1, q_heads, layer.qk_head_dim)
    outputs = out.view(-1, q_heads, layer.v_head_dim)
    plain_lse = split_lse(md.attn_lse, md.kv_indptr, md.num_kv_splits)
    here = layer.layer_id - rt.start_layer
    softcap = float(layer.logit_cap or 0.0)
    for i, view in hits:
        cell_out, cell_lse = cell_attention(
            queries[i:i + 1], rt.k_buffers, rt.v_buffers, view.older[None], view.order[None],
            view.offset_table[None], here, layer.scaling, softcap)
        merged, _ = merge_attention(outputs[i:i + 1], plain_lse[i:i + 1], cell_out, cell_lse)
        outputs[i] = merged[0].to(outputs.dtype)
    return out


HOOKS = [(TARGET_DECODE, "AROUND", around_forward_decode),
         (TARGET_SDPA_DECODE, "AROUND", around_sdpa_decode),
         (TARGET_TRITON_METADATA, "AFTER", after_triton_metadata),
         (TARGET_TRITON_DECODE, "AROUND", around_triton_forward_decode)]
