"""Unequal heads in equal slots: a request's older tokens as *cells* (issue 52).

SGLang's KV pool gives a slot to every layer and KV head at once, so a budget shared by heads
(one total per layer, or one for the whole model) frees no slot while any head keeps a token
in it. Yet every scope keeps the same total, K = T - R older tokens per head on average: L·H·K
cells, exactly what K slots hold. Cells make that total the memory:

- a *cell* is one (layer, slot, KV head) of the pool's K/V storage (D elements in K, D in V);
- a request keeps its K older slots in its `req_to_token` row, as today, so SGLang's
  allocator, its memory checks and the radix tree see nothing new; what changes is who owns
  each cell of those slots: `owner[l, j, h]` = the (layer, KV head) whose token the cell of
  layer l, older slot j, head h holds, and `position[l, j, h]` its true position (RoPE is
  already in the cached key, so a token can sit in any cell). Scope "layer": a cell holds a
  token of its own layer (any head); scope "global": of any layer (a reader takes each layer's
  buffer by its base pointer, as ops/cell_attention.py does, or gathers layer by layer);
- attention of (layer l, KV head h) reads the prompt and the newest tokens as usual and, for
  the older part, the cells `owner == (l, h)`: from 0 to H·K of them (layer) or L·H·K
  (global) instead of K;
- an eviction of a request at T + R (its K older slots, then 2R newest slots in the plain
  layout) keeps L·H·K of its candidates (the cells and the oldest R plain slots, the
  *leaving* slots; the newest R stay): per layer (layer scope) or in total (global). Then it
  *packs*: each kept token of a leaving slot moves into a cell whose token was dropped (a
  hole). Kept leaving tokens and holes are equal in number, per layer or in total, so the R
  leaving slots go back to the allocator, as with per-head budgets.

So an unequal budget costs no slot over an equal one: it costs an owner and a position per
cell (int32 [L, K, H] each per request) and a packed attention read. This module is the
engine-free core: the cell map, the packing as static-shaped tensor ops (no host reads: it can
run in a CUDA graph), the owner-sorted segments a kernel iterates, and the reference attention
over packed cells, checked against a cache in which nothing moves and a mask hides the dropped
tokens (tests/test_cells.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCOPES = ("layer", "global")
NO_OWNER = -1  # an empty cell (a hole between the drop and the move)


def _check_scope(scope: str) -> None:
    if scope not in SCOPES:
        raise ValueError(f"scope: one of {SCOPES}, got {scope!r}")


@dataclass(frozen=True)
class CellMap:
    """Who owns the cells of a request's K older slots.

    owner: [L, K, H] int64, the flat owner l' · H + h' of the token in the cell (layer l,
        older slot j, KV head h); with scope "layer", owner // H == l.
    position: [L, K, H] int64, that token's true position.
    """

    owner: torch.Tensor
    position: torch.Tensor
    scope: str

    def __post_init__(self):
        _check_scope(self.scope)
        if self.owner.shape != self.position.shape or self.owner.dim() != 3:
            raise ValueError(f"owner {tuple(self.owner.shape)} and position "
                             f"{tuple(self.position.shape)}: expected one [L, K, H] shape")

    @classmethod
    def plain(cls, positions: torch.Tensor, layers: int, kv_heads: int, scope: str) -> "CellMap":
        """K slots in the plain layout: older slot j holds the token at positions[j] for
        every (layer, head), as after a per-head eviction or before any."""
        k = positions.shape[-1]
        owner = (torch.arange(layers, device=positions.device)[:, None, None] * kv_heads
                 + torch.arange(kv_heads, device=positions.device)[None, None, :])
        return cls(owner.expand(layers, k, kv_heads).clone(),
                   positions.view(1, k, 1).expand(layers, k, kv_heads).clone(), scope)

    @property
    def layers(self) -> int:
        return self.owner.shape[0]

    @property
    def slots(self) -> int:
        return self.owner.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.owner.shape[2]

    def counts(self) -> torch.Tensor:
        """[L, H]: the cells each (layer, KV head) owns."""
        L, H = self.layers, self.kv_heads
        owner = self.owner.flatten()
        counts = torch.zeros(L * H, dtype=torch.int64, device=owner.device)
        # scatter_add, not bincount: a static output shape (bincount's is data-dependent)
        return counts.scatter_add_(0, owner.clamp_min(0), (owner >= 0).long()).view(L, H)

    def segments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cells sorted by owner, then position: order [L·K·H] (flat cell indices
        (l · K + j) · H + h) and offsets [L·H + 1], so (l, h) owns order[offsets[lH+h] :
        offsets[lH+h+1]]. Static shapes: what a decode kernel iterates per (request, l, h)."""
        key = self.owner.flatten() * (self.position.max() + 1) + self.position.flatten()
        order = key.argsort(stable=True)
        offsets = torch.zeros(self.layers * self.kv_heads + 1, dtype=torch.int64,
                              device=self.owner.device)
        # empty cells (NO_OWNER, holes of an unchecked packing) sort first: skip them
        offsets[1:] = self.counts().flatten().cumsum(0)
        return order, offsets + (self.owner < 0).sum()


@dataclass(frozen=True)
class Moves:
    """K/V copies of one packing, static-shaped: L · R · H entries, one per (layer, leaving
    slot r, head) of the leaving tokens in row-major order; `valid` marks the kept ones.
    A valid entry copies the cell (layer, leaving slot r, head) into the cell `dst` (flat
    (l · K + j) · H + h over the older slots). Invalid entries point dst at 0 and must be
    masked (or sent to a scratch cell) by the caller."""

    dst: torch.Tensor  # [L, R, H] int64
    valid: torch.Tensor  # [L, R, H] bool


def pack(cells: CellMap, leaving: "torch.Tensor | CellMap", keep_cells: torch.Tensor,
         keep_leaving: torch.Tensor, check: bool = True) -> tuple[CellMap, Moves]:
    """One eviction's packing.

    Args:
        cells: the map of the K slots that hold cells after the eviction, before it.
        leaving: [R] int64, the true positions of the R leaving plain slots; or the map
            [L, R, H] of leaving slots that hold cells too (an elastic cut below the cells a
            request holds: its older slots beyond the new K leave).
        keep_cells: [L, K, H] bool, whether each cell's token stays.
        keep_leaving: [L, R, H] bool, whether the token of (layer, leaving slot, head) stays.
        check: verify that the counts match (a host read; False inside a CUDA graph).

    Returns:
        The map after it and the moves that realise it. Holes (cells whose token goes) are
        filled in (layer, slot, head) order by the kept leaving tokens in (layer, slot, head)
        order, within their layer for scope "layer", across layers for "global": the result is
        a function of the selection only.

    Raises:
        ValueError: the kept counts do not fill the holes exactly (per layer for "layer", in
            total for "global"): the selection did not keep the scope's budget (check=True).
    """
    L, K, H = cells.owner.shape
    if isinstance(leaving, CellMap):
        R, src_owner, src_position = leaving.slots, leaving.owner, leaving.position
    else:
        R = leaving.shape[0]
        src_owner = (torch.arange(L, device=leaving.device)[:, None, None] * H
                     + torch.arange(H, device=leaving.device)[None, None, :]).expand(L, R, H)
        src_position = leaving.view(1, R, 1).expand(L, R, H)
    if keep_cells.shape != (L, K, H) or keep_leaving.shape != (L, R, H):
        raise ValueError(f"keep_cells {tuple(keep_cells.shape)} / keep_leaving "
                         f"{tuple(keep_leaving.shape)}: expected {(L, K, H)} / {(L, R, H)}")
    holes = ~keep_cells
    if cells.scope == "layer":
        hole_rank = holes.view(L, -1).cumsum(-1) - 1  # rank of a hole within its layer
        mover_rank = keep_leaving.reshape(L, -1).cumsum(-1) - 1
        short = holes.view(L, -1).sum(-1) != keep_leaving.reshape(L, -1).sum(-1)
        base = torch.arange(L, device=holes.device)[:, None] * (K * H)
        hole_key = (hole_rank + base).flatten()
        mover_key = (mover_rank + base).flatten()
    else:
        hole_key = holes.flatten().cumsum(0) - 1
        mover_key = keep_leaving.flatten().cumsum(0) - 1
        short = holes.sum() != keep_leaving.sum()
    if check and bool(short.any()):
        raise ValueError(f"{cells.scope} scope: the kept leaving tokens "
                         f"({keep_leaving.reshape(L, -1).sum(-1).tolist()} per layer) do not "
                         f"fill the holes ({holes.view(L, -1).sum(-1).tolist()} per layer)")
    # the cell of each hole rank (ranks of non-holes point past the end and are dropped)
    cell_of_rank = torch.zeros(L * K * H + 1, dtype=torch.int64, device=holes.device)
    flat_holes = holes.flatten()
    cell_of_rank.scatter_(0, torch.where(flat_holes, hole_key, L * K * H),
                          torch.arange(L * K * H, device=holes.device))
    valid = keep_leaving
    dst = torch.where(valid.flatten(), cell_of_rank[mover_key.clamp_min(0)], 0).view(L, R, H)
    owner = cells.owner.flatten().masked_fill(flat_holes, NO_OWNER)
    position = cells.position.flatten().masked_fill(flat_holes, -1)
    # invalid entries write to a scratch element past the end
    scratch = torch.where(valid.flatten(), dst.flatten(), L * K * H)
    owner = torch.cat([owner, owner.new_zeros(1)]).scatter(0, scratch, src_owner.flatten())
    position = torch.cat([position, position.new_zeros(1)]).scatter(0, scratch,
                                                                    src_position.flatten())
    return (CellMap(owner[:-1].view(L, K, H), position[:-1].view(L, K, H), cells.scope),
            Moves(dst, valid))


def select_shared(score: torch.Tensor, owner: torch.Tensor, position: torch.Tensor,
                  keep: int, scope: str, floor: int = 0) -> torch.Tensor:
    """Which candidates a shared budget keeps: the selection of the reference's layer and
    global rows (benchmarks/global_budget.keep_mask), on candidates held in any cell.

    Args:
        score: [L, M, H] float, each candidate's score (higher = keep; +inf: kept whatever,
            e.g. sinks; -inf: not a candidate). Candidate (l, m, h) sits in the cell of layer
            l, column m, KV head h: the K older slots' cells, then the leaving slots'.
        owner: [L, M, H] int64, the flat owner l' · H + h' of each candidate's token (with
            scope "layer", l' == l).
        position: [L, M, H] int64, each candidate's true position (distinct per owner).
        keep: K, older tokens per (layer, KV head) on average: a layer keeps H · K (scope
            "layer"), the request L · H · K (scope "global").
        scope: "layer" or "global".
        floor: each owner first keeps its `floor` best (at most K).

    Returns:
        [L, M, H] bool, the kept candidates.

    Ties go as in the reference, which ranks a [L, H, n] tensor of positions flattened: by
    owner, then position (the older first), within each scope. Static shapes, no host read.
    """
    _check_scope(scope)
    L, M, H = score.shape
    groups = L if scope == "layer" else 1
    # the reference's order: by owner, then position (two stable sorts)
    flat_owner, flat_pos = owner.reshape(groups, -1), position.reshape(groups, -1)
    by_pos = flat_pos.argsort(dim=-1, stable=True)
    order = by_pos.gather(-1, flat_owner.gather(-1, by_pos).argsort(dim=-1, stable=True))
    s = score.reshape(groups, -1).float().gather(-1, order)
    o = flat_owner.gather(-1, order)
    valid = s != float("-inf")
    f = min(floor, keep)
    if f > 0:
        # each owner's f best (descending score, ties to the older): rank within its owner
        desc = s.sort(dim=-1, descending=True, stable=True).indices
        within = desc.gather(-1, o.gather(-1, desc).argsort(dim=-1, stable=True))
        owners = o.gather(-1, within)
        counts = torch.zeros(groups, L * H, dtype=torch.int64, device=s.device)
        counts.scatter_add_(-1, owners, torch.ones_like(owners))
        start = counts.cumsum(-1) - counts
        rank = torch.arange(within.shape[-1], device=s.device) - start.gather(-1, owners)
        forced = torch.zeros_like(valid).scatter_(-1, within, rank < f) & valid
        s = s.masked_fill(forced, float("inf"))
    total = (L * H * keep) // groups
    chosen = s.sort(dim=-1, descending=True, stable=True).indices[..., :total]
    kept = torch.zeros_like(valid).scatter_(-1, chosen, True) & valid
    return torch.zeros_like(kept).scatter_(-1, order, kept).view(L, M, H)


def apply_moves(storage: torch.Tensor, leaving: torch.Tensor, moves: Moves) -> torch.Tensor:
    """Copy the kept leaving tokens into their cells: storage [L, K, H, D] (the older slots'
    K or V, cell-indexed), leaving [L, R, H, D] (the leaving slots'). Returns the new
    storage (the reference of what the serving step does in place on the pool)."""
    L, K, H, D = storage.shape
    flat = torch.cat([storage.reshape(L * K * H, D), storage.new_zeros(1, D)])
    idx = torch.where(moves.valid, moves.dst, L * K * H).flatten()
    flat = flat.index_copy(0, idx, leaving.reshape(-1, D))
    return flat[:-1].view(L, K, H, D)


def attend(query: torch.Tensor, plain_k: torch.Tensor, plain_v: torch.Tensor,
           cell_k: torch.Tensor, cell_v: torch.Tensor, cells: CellMap, layer: int,
           scaling: float) -> torch.Tensor:
    """Reference decode attention of one request at one layer over plain tokens and cells.

    Args:
        query: [H_q, D] the new token's query; query head q reads KV head q // (H_q / H).
        plain_k, plain_v: [H, n, D] the plain tokens (prompt and newest slots), every head.
        cell_k, cell_v: [L, K, H, D] the older slots' cells of every layer.
        cells: who owns them; (layer, h) reads the cells it owns.
        scaling: logit = q · k * scaling.

    Returns:
        [H_q, D] the attention output.
    """
    H = plain_k.shape[0]
    group = query.shape[0] // H
    out = torch.empty_like(query, dtype=torch.float32)
    owner = cells.owner
    for h in range(H):
        mine = owner == layer * H + h  # [L, K, H]
        k = torch.cat([plain_k[h], cell_k[mine]]).float()
        v = torch.cat([plain_v[h], cell_v[mine]]).float()
        q = query[h * group:(h + 1) * group].float()
        probs = torch.softmax(q @ k.T * scaling, dim=-1)
        out[h * group:(h + 1) * group] = probs @ v
    return out
