"""vase_sglang/cells.py: unequal heads packed into equal slots. A request simulated through
many evictions at each scope: its cells always hold exactly what a cache that never moves a
token and masks the dropped ones would show (same kept sets, same K/V, same attention output),
in K older slots; the packing is capture-safe."""

from __future__ import annotations

import pytest
import torch

from tests.test_capture_safety import capture_hazards
from vase_sglang.cells import CellMap, Moves, apply_moves, attend, pack

L, H, G, D, K, R, P = 3, 2, 2, 8, 6, 3, 5


def select(scores: torch.Tensor, alive: torch.Tensor, scope: str) -> torch.Tensor:
    """alive [L, H, n] candidates; keep K per head / H·K per layer / L·H·K in all."""
    s = scores.masked_fill(~alive, float("-inf"))
    if scope == "head":
        idx = s.topk(K, dim=-1).indices
        return torch.zeros_like(alive).scatter_(-1, idx, True) & alive
    if scope == "layer":
        flat = s.reshape(L, -1)
        idx = flat.topk(H * K, dim=-1).indices
        return torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, idx, True).view(L, H, -1) & alive
    idx = s.flatten().topk(L * H * K).indices
    return torch.zeros(s.numel(), dtype=torch.bool).index_fill_(0, idx, True).view_as(alive) & alive


def simulate(scope: str, rounds: int = 12, seed: int = 0):
    """Yield, after each eviction, (cells, cell_k, cell_v, alive, keys, values, plain
    positions, now): the packed state and the masked truth."""
    gen = torch.Generator().manual_seed(seed)
    total = P + K + 2 * R + rounds * R
    keys = torch.randn(L, H, total, D, generator=gen)
    values = torch.randn(L, H, total, D, generator=gen)
    scores = torch.rand(L, H, total, generator=gen)  # a fixed worth per (layer, head, token)
    alive = torch.zeros(L, H, total, dtype=torch.bool)
    now = P + K + 2 * R  # the request's first eviction: private = T + R = K + 2R
    alive[..., :now] = True
    older = torch.arange(P, P + K)
    cells = CellMap.plain(older, L, H, "global" if scope == "head" else scope)
    cell_k = keys[:, :, older].permute(0, 2, 1, 3).clone()  # [L, K, H, D]
    cell_v = values[:, :, older].permute(0, 2, 1, 3).clone()
    for _ in range(rounds):
        leaving = torch.arange(now - 2 * R, now - R)
        cand = alive.clone()
        cand[..., :P] = False
        cand[..., now - R:] = False
        kept = select(scores, cand, scope)
        alive[..., P:now - R] = kept[..., P:now - R]
        # the same selection on the cells: a cell stays iff its owner keeps its position
        owner_l, owner_h = cells.owner // H, cells.owner % H
        keep_cells = alive[owner_l, owner_h, cells.position]
        keep_leaving = alive[:, :, leaving].permute(0, 2, 1)  # [L, R, H]
        cells, moves = pack(cells, leaving, keep_cells, keep_leaving)
        cell_k = apply_moves(cell_k, keys[:, :, leaving].permute(0, 2, 1, 3), moves)
        cell_v = apply_moves(cell_v, values[:, :, leaving].permute(0, 2, 1, 3), moves)
        now += R
        alive[..., now - R:now] = True
        plain = torch.cat([torch.arange(P), torch.arange(now - 2 * R, now)])
        yield cells, cell_k, cell_v, alive, keys, values, plain, now


@pytest.mark.parametrize("scope", ["head", "layer", "global"])
def test_cells_hold_what_the_mask_shows(scope):
    unequal = False
    for cells, cell_k, cell_v, alive, keys, values, plain, now in simulate(scope):
        assert cells.owner.shape == (L, K, H)  # K slots, whatever the scope
        counts = cells.counts()
        assert int(counts.sum()) == L * H * K
        unequal |= bool((counts != K).any())
        if scope == "layer":
            assert (cells.owner // H == torch.arange(L)[:, None, None]).all()
            assert (counts.sum(-1) == H * K).all()
        if scope == "head":
            assert (counts == K).all()
        owner_l, owner_h = cells.owner // H, cells.owner % H
        # every cell holds its owner's token at its position, K and V
        assert torch.equal(cell_k, keys[owner_l, owner_h, cells.position])
        assert torch.equal(cell_v, values[owner_l, owner_h, cells.position])
        for layer in range(L):
            for h in range(H):
                mine = cells.position[cells.owner == layer * H + h]
                older = alive[layer, h, P:now - 2 * R].nonzero().flatten() + P
                assert sorted(mine.tolist()) == older.tolist()
        # attention over plain tokens + own cells == masked attention over the whole cache
        query = torch.randn(H * G, D, generator=torch.Generator().manual_seed(now))
        for layer in range(L):
            got = attend(query, keys[layer][:, plain], values[layer][:, plain], cell_k, cell_v,
                         cells, layer, scaling=D ** -0.5)
            for h in range(H):
                k = keys[layer, h, :now][alive[layer, h, :now]]
                v = values[layer, h, :now][alive[layer, h, :now]]
                q = query[h * G:(h + 1) * G]
                want = torch.softmax(q @ k.T * D ** -0.5, -1) @ v
                torch.testing.assert_close(got[h * G:(h + 1) * G], want, rtol=1e-5, atol=1e-5)
    assert unequal == (scope != "head")


def test_segments_list_each_heads_cells_in_position_order():
    cells = list(simulate("global", rounds=5))[-1][0]
    order, offsets = cells.segments()
    assert offsets[-1] == L * K * H and torch.equal(offsets[1:] - offsets[:-1],
                                                    cells.counts().flatten())
    for lh in range(L * H):
        seg = order[offsets[lh]:offsets[lh + 1]]
        assert (cells.owner.flatten()[seg] == lh).all()
        pos = cells.position.flatten()[seg]
        assert torch.equal(pos, pos.sort().values)


def test_pack_refuses_a_selection_that_misses_the_budget():
    older = torch.arange(P, P + K)
    cells = CellMap.plain(older, L, H, "layer")
    leaving = torch.arange(P + K, P + K + R)
    keep_cells = torch.ones(L, K, H, dtype=torch.bool)
    keep_cells[0, 0, 0] = False  # one hole in layer 0 ...
    keep_leaving = torch.zeros(L, R, H, dtype=torch.bool)
    keep_leaving[1, 0, 0] = True  # ... filled from layer 1: fine globally, not per layer
    with pytest.raises(ValueError, match="layer scope"):
        pack(cells, leaving, keep_cells, keep_leaving)
    glob = CellMap.plain(older, L, H, "global")
    new, moves = pack(glob, leaving, keep_cells, keep_leaving)
    assert int(new.owner[0, 0, 0]) == 1 * H + 0 and int(new.position[0, 0, 0]) == P + K
    assert int(moves.valid.sum()) == 1 and int(moves.dst[1, 0, 0]) == 0
    keep_leaving[1, 0, 0] = False
    with pytest.raises(ValueError, match="global scope"):
        pack(glob, leaving, keep_cells, keep_leaving)
    with pytest.raises(ValueError, match="scope"):
        CellMap.plain(older, L, H, "head")


@pytest.mark.parametrize("scope", ["layer", "global"])
def test_pack_is_capturable(scope):
    """Without its count check, the packing and the K/V copy are static-shaped device ops."""
    older = torch.arange(P, P + K)
    cells = CellMap.plain(older, L, H, scope)

    def body(owner, position, leaving, keep_cells, keep_leaving, storage, leaving_kv):
        new, moves = pack(CellMap(owner, position, scope), leaving, keep_cells, keep_leaving,
                          check=False)
        apply_moves(storage, leaving_kv, moves)
        new.segments()

    args = (cells.owner, cells.position, torch.arange(R), torch.ones(L, K, H, dtype=torch.bool),
            torch.zeros(L, R, H, dtype=torch.bool), torch.zeros(L, K, H, D),
            torch.zeros(L, R, H, D))
    assert capture_hazards(body, *args) == []
    # negative control: the check reads a device value on the host
    assert capture_hazards(lambda *a: pack(CellMap(a[0], a[1], scope), *a[2:5]), *args)
    assert isinstance(Moves(torch.zeros(1), torch.zeros(1)), Moves)


# -- the served selection: select_shared equals the reference's keep_mask ---------------------

def _reference_keep_mask():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.global_budget import keep_mask

    return keep_mask


@pytest.mark.parametrize("scope", ["layer", "global"])
@pytest.mark.parametrize("floor", [0, 2])
def test_select_shared_keeps_what_the_reference_keeps_wherever_the_tokens_sit(scope, floor):
    """The reference ranks [L, H, n] by position; the server holds the same candidates in
    cells of any (layer, column, head) of the scope. Scores with many exact ties (the
    order of ties is where a different layout would differ), sinks at +inf, missing
    candidates at -inf: the same tokens are kept, whatever cell they sit in."""
    from vase_sglang.cells import select_shared

    keep_mask = _reference_keep_mask()
    n, keep = K + R, K
    for seed in range(6):
        gen = torch.Generator().manual_seed(seed)
        ref = (torch.randint(0, 4, (L, H, n), generator=gen).float() * -0.5)  # ties
        ref[..., :1] = float("inf")  # a sink
        if seed % 2:
            ref[0, 1, 2:4] = float("-inf")  # missing candidates
        want = keep_mask(ref, keep, scope, floor)
        # the same candidates laid out as the server holds them: [L, M = n, H] cells, each
        # layer's (or all) candidates shuffled over the scope's cells
        owner = (torch.arange(L)[:, None, None] * H + torch.arange(H)[None, None, :]).expand(L, n, H)
        pos = torch.arange(n)[None, :, None].expand(L, n, H)
        flat_score = ref.permute(0, 2, 1).reshape(L, -1)
        flat_owner, flat_pos = owner.reshape(L, -1), pos.reshape(L, -1)
        if scope == "global":
            flat_score, flat_owner, flat_pos = (t.reshape(1, -1) for t in (flat_score, flat_owner, flat_pos))
        perm = torch.stack([torch.randperm(flat_score.shape[1], generator=gen)
                            for _ in range(flat_score.shape[0])])
        s = flat_score.gather(1, perm).reshape(L, n, H)
        o = flat_owner.gather(1, perm).reshape(L, n, H)
        p = flat_pos.gather(1, perm).reshape(L, n, H)
        got = select_shared(s, o, p, keep, scope, floor)
        got_ref = torch.zeros(L, H, n, dtype=torch.bool)
        l_of, h_of = o // H, o % H
        got_ref[l_of[got], h_of[got], p[got]] = True
        assert torch.equal(got_ref, want), (seed, got_ref.sum(-1), want.sum(-1))
        candidates = int((ref != float("-inf")).sum())
        assert int(got.sum()) == min(L * H * keep, candidates) or scope == "layer"


def test_select_shared_check_can_fail():
    """The tie order is the positions': told the opposite order (positions negated), the same
    tied scores keep other tokens than the reference, and the comparison above sees it."""
    from vase_sglang.cells import select_shared

    keep_mask = _reference_keep_mask()
    ref = torch.zeros(1, 2, 4)  # all tied
    want = keep_mask(ref, 1, "global")  # owner 0's two oldest
    owner = torch.tensor([0, 1]).view(1, 1, 2).expand(1, 4, 2)
    pos = torch.arange(4).view(1, 4, 1).expand(1, 4, 2)
    score = ref.permute(0, 2, 1)
    assert torch.equal(select_shared(score, owner, pos, 1, "global").permute(0, 2, 1), want)
    assert not torch.equal(select_shared(score, owner, -pos, 1, "global").permute(0, 2, 1), want)


def test_segments_skip_empty_cells():
    """Holes (NO_OWNER, left by an unchecked packing) belong to no head's segment."""
    owner = torch.tensor([[[-1, 0], [1, -1]]])  # L = 1, K = 2, H = 2
    cells = CellMap(owner, torch.tensor([[[0, 5], [6, 0]]]), "layer")
    order, offsets = cells.segments()
    assert offsets.tolist() == [2, 3, 4]
    assert order[2:3].tolist() == [1] and order[3:4].tolist() == [2]


def select_keep(scores: torch.Tensor, alive: torch.Tensor, scope: str, keep: int) -> torch.Tensor:
    """select() with `keep` older tokens per (layer, head) on average."""
    s = scores.masked_fill(~alive, float("-inf"))
    if scope == "layer":
        flat = s.reshape(L, -1)
        idx = flat.topk(H * keep, dim=-1).indices
        return (torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, idx, True)
                .view(L, H, -1) & alive)
    idx = s.flatten().topk(L * H * keep).indices
    return torch.zeros(s.numel(), dtype=torch.bool).index_fill_(0, idx, True).view_as(alive) & alive


@pytest.mark.parametrize("scope", ["layer", "global"])
def test_elastic_cuts_to_any_level_keep_the_cells_equal_to_the_mask(scope):
    """Elastic cuts (issue 59): each eviction has its own level, K' older slots, above or
    below the cells the request holds; the cache grows between cuts. The candidates are the
    cells held and the plain slots after them; the first K' slots hold the cells after the
    cut, and cells beyond them leave with the plain slots (pack's CellMap `leaving`). After
    every cut the cells hold exactly the masked truth's tokens (K and V at their owner's
    position) and attention over them equals the masked attention."""
    gen = torch.Generator().manual_seed(3)
    levels = [6, 3, 9, 9, 2, 12, 5, 1, 7]  # K' per cut: up, down, equal, down past the plain
    growth = [5, 2, 7, 4, 3, 9, 1, 6, 2]  # plain tokens generated before each cut (>= R - 1)
    total = P + 40 + sum(growth) + R
    keys = torch.randn(L, H, total, D, generator=gen)
    values = torch.randn(L, H, total, D, generator=gen)
    scores = torch.rand(L, H, total, generator=gen)
    now = P + 8 + R  # 8 private tokens, then the newest R, before the first cut
    alive = torch.zeros(L, H, total, dtype=torch.bool)
    alive[..., :now] = True
    held = 0  # slots that hold cells (0: none yet, the plain layout)
    slot_pos = torch.arange(P, now)  # each private slot's plain position (cells: the map's)
    cells = None
    store_k = keys[:, :, P:now].permute(0, 2, 1, 3).clone()  # [L, slots, H, D]
    store_v = values[:, :, P:now].permute(0, 2, 1, 3).clone()
    moved_down = moved_up = False
    for level, grown in zip(levels, growth):
        n = store_k.shape[1] - R
        k_new = min(level, n)
        plain = CellMap.plain(slot_pos, L, H, scope)
        owner, position = plain.owner.clone(), plain.position.clone()
        if cells is not None:
            owner[:, :held], position[:, :held] = cells.owner, cells.position
        cand = alive.clone()
        cand[..., :P] = False
        cand[..., now - R:] = False
        kept = select_keep(scores, cand, scope, k_new)
        alive[..., P:now - R] = kept[..., P:now - R]
        keep_all = alive[owner // H, owner % H, position]  # [L, slots, H]
        new, moves = pack(CellMap(owner[:, :k_new], position[:, :k_new], scope),
                          CellMap(owner[:, k_new:n], position[:, k_new:n], scope),
                          keep_all[:, :k_new], keep_all[:, k_new:n])
        moved_down |= k_new < held
        moved_up |= k_new > held > 0
        cell_k = apply_moves(store_k[:, :k_new], store_k[:, k_new:n], moves)
        cell_v = apply_moves(store_v[:, :k_new], store_v[:, k_new:n], moves)
        cells, held = new, k_new
        # the cut frees slots k_new .. n; the newest R stay; then the cache grows
        fresh = torch.arange(now, now + grown)
        slot_pos = torch.cat([slot_pos[:k_new], slot_pos[n:], fresh])
        store_k = torch.cat([cell_k, store_k[:, n:], keys[:, :, fresh].permute(0, 2, 1, 3)], 1)
        store_v = torch.cat([cell_v, store_v[:, n:], values[:, :, fresh].permute(0, 2, 1, 3)], 1)
        now += grown
        alive[..., now - grown:now] = True
        assert int(cells.counts().sum()) == L * H * k_new
        owner_l, owner_h = cells.owner // H, cells.owner % H
        torch.testing.assert_close(cell_k, keys[owner_l, owner_h, cells.position], rtol=0, atol=0)
        torch.testing.assert_close(cell_v, values[owner_l, owner_h, cells.position], rtol=0, atol=0)
        plain_pos = torch.cat([torch.arange(P), slot_pos[k_new:]])
        query = torch.randn(H * G, D, generator=torch.Generator().manual_seed(now))
        for layer in range(L):
            got = attend(query, keys[layer][:, plain_pos], values[layer][:, plain_pos], cell_k,
                         cell_v, cells, layer, scaling=D ** -0.5)
            for h in range(H):
                k = keys[layer, h, :now][alive[layer, h, :now]]
                v = values[layer, h, :now][alive[layer, h, :now]]
                want = torch.softmax(query[h * G:(h + 1) * G] @ k.T * D ** -0.5, -1) @ v
                torch.testing.assert_close(got[h * G:(h + 1) * G], want, rtol=1e-5, atol=1e-5)
    assert moved_down and moved_up  # both directions were exercised
