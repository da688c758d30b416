"""Elastic budgets (issue 21), without a server: the settings, and who loses what under memory
pressure (vase_sglang/elastic.py's water-filling, checked against brute force; the step's
pressure groups on SGLang's real Req)."""

from __future__ import annotations

import itertools
import random

import pytest

from vase_sglang import EvictionConfig
from vase_sglang.elastic import Holding, freed_by_cut, level_grid, over_floor, water_fill
from vase_sglang.rows import freed_slots
from vase_sglang_patches import grouping
from vase_sglang_patches.request_control import effective_config


def test_mode_and_ceiling_settings():
    cfg = EvictionConfig(budget=64, window=16, mode="elastic")
    assert cfg.elastic and cfg.trigger_len is None and cfg.scheduled_budget is None
    capped = cfg.replace(ceiling=256)
    assert capped.trigger_len == 272 and capped.scheduled_budget == 256
    fixed = EvictionConfig(budget=64, window=16, ceiling=256)  # the ceiling is elastic's only
    assert not fixed.elastic and fixed.trigger_len == 80
    with pytest.raises(ValueError, match="^mode: must be one of fixed, elastic"):
        EvictionConfig(mode="lazy")
    with pytest.raises(ValueError, match=r"^ceiling: must be >= budget \(64\)"):
        EvictionConfig(budget=64, window=16, mode="elastic", ceiling=32)


def test_mode_per_request():
    server = EvictionConfig(policy="vase-attnv", budget=64, window=16)
    assert effective_config({"kv_evict": {"mode": "elastic"}}, server).elastic
    assert not effective_config({"kv_evict": {"mode": "fixed"}},
                                server.replace(mode="elastic")).elastic
    with pytest.raises(ValueError, match=r"^kv_evict\.mode: must be one of fixed, elastic"):
        effective_config({"kv_evict": {"mode": "lazy"}}, server)
    capped = server.replace(mode="elastic", ceiling=128)
    with pytest.raises(ValueError, match=r"^kv_evict\.budget: must be <= the server's "
                                         r"--kv-evict-ceiling \(128\)"):
        effective_config({"kv_evict": {"budget": 192}}, capped)


def _brute_force_level(holdings, members, need, page_size):
    """The highest grid level at which cutting `members` frees >= need."""
    top = max(holdings[i].private for i in members)
    for level in sorted(level_grid(top, page_size), reverse=True):
        if sum(freed_by_cut(holdings[i], level, page_size) for i in members) >= need:
            return level
    return None


def test_level_grid():
    assert level_grid(100) == [0, 1, 2, 3, 4, 5, 6, 8, 9, 11, 13, 16, 19, 22, 26, 32, 38, 45, 53,
                               64, 76, 90]
    assert level_grid(100, 16) == [0, 16, 32, 48, 64, 80, 96]
    assert len(level_grid(32768)) < 70  # few distinct levels over a server's life


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_water_filling_against_brute_force(page_size):
    rng = random.Random(page_size)  # the holdings and needs tried
    window = max(4, page_size)
    for _ in range(400):
        holdings = []
        for _ in range(rng.randint(1, 6)):
            floor = rng.choice([window + 4, 2 * window, 3 * window + 1])
            holdings.append(Holding(private=floor + rng.randint(-2, 12 * window), floor=floor,
                                    window=window, rank=rng.choice([0, 0, 1, 2])))
        holdings = [h._replace(private=max(h.private, h.window + 1)) for h in holdings]
        need = rng.randint(1, sum(max(1, over_floor(h)) for h in holdings) + 8)
        levels = water_fill(holdings, need, page_size)
        freed = {i: freed_by_cut(holdings[i], lvl, page_size) for i, lvl in levels.items()}
        reclaimable = sum(freed_by_cut(h, 0, page_size) for h in holdings)
        # Frees what is needed where the floors allow, else everything above them.
        assert sum(freed.values()) >= min(need, reclaimable)
        for i, lvl in levels.items():
            h = holdings[i]
            assert h.floor <= lvl < h.private and freed[i] > 0  # no cut that frees nothing
        # Lower ranks first: a rank loses tokens only if every lower one is at its floors.
        ranks = sorted({h.rank for h in holdings})
        cut_ranks = {holdings[i].rank for i in levels}
        if cut_ranks:
            top_rank = max(cut_ranks)
            for i, h in enumerate(holdings):
                if h.rank < top_rank:
                    assert freed_by_cut(h, levels.get(i, h.private), page_size) == \
                        freed_by_cut(h, 0, page_size), (i, levels)
                if h.rank > top_rank:
                    assert i not in levels
            # Within the covering rank: one common level, the highest that frees enough.
            members = [i for i, h in enumerate(holdings) if h.rank == top_rank]
            still = need - sum(freed_by_cut(holdings[i], 0, page_size)
                               for i, h in enumerate(holdings) if h.rank < top_rank)
            level = _brute_force_level(holdings, members, still, page_size)
            expect = level if level is not None else 0
            for i in members:
                want = max(expect, holdings[i].floor)
                if freed_by_cut(holdings[i], want, page_size) > 0:
                    assert levels[i] == want, (i, levels, expect)
                else:
                    assert i not in levels
        assert ranks  # at least one holding


def test_water_filling_cuts_the_largest_first_and_evenly():
    holdings = [Holding(1000, 64, 16), Holding(400, 64, 16), Holding(100, 64, 16)]
    levels = water_fill(holdings, 700)
    # 362 (the next grid level) would free 638 + 38 < 700; 304 frees 696 + 96: the 100-token
    # cache is untouched.
    assert levels == {0: 304, 1: 304}
    assert freed_by_cut(holdings[0], 304) + freed_by_cut(holdings[1], 304) == 792
    assert water_fill(holdings, 10**6) == {0: 64, 1: 64, 2: 64}  # all to their floors
    assert water_fill(holdings, 0) == {}


def _req(rid, private, kv_evict, priority=None):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid, "", [1, 2, 3, 4], SamplingParams(max_new_tokens=4096,
                                                    custom_params={"kv_evict": kv_evict}),
              priority=priority)
    req.kv.req_pool_idx = 0
    req.kv.kv_allocated_len = req.kv.kv_committed_len = private
    req.decode_batch_idx = 1
    return req


def test_pressure_groups_cut_fixed_requests_to_budget_and_water_fill_elastic_ones():
    from test_hardening import _batch, serving

    server = EvictionConfig(policy="streaming", budget=32, window=8)
    with serving(server):
        reqs = [_req("fixed", 36, {}), _req("a", 300, {"mode": "elastic"}),
                _req("b", 120, {"mode": "elastic"}), _req("low", 200, {"mode": "elastic"}, 0),
                _req("floor", 33, {"mode": "elastic"})]
        for r in reqs[:3] + reqs[4:]:
            r.priority = 5
        batch = _batch(reqs)
        rank = {id(r): r.priority for r in reqs}
        groups, level = grouping.pressure_groups(None_rt(), batch, (), need=300,
                                             rank_of=lambda r: rank[id(r)])
        cut = {batch.reqs[i].rid: (cfg.budget, n) for (cfg, n, _), members in groups.items()
               for i in members}
        # fixed over budget: back to it (frees 4); low priority first: all 168 above its floor;
        # then the rest (300 - 4 - 168 = 128) from the largest elastic cache, down to the grid
        # level 152 (181, the next, frees only 119).
        assert cut["fixed"] == (32, 28)
        assert cut["low"] == (32, 192)
        assert cut["a"] == (152, 292) and "b" not in cut and "floor" not in cut
        assert level == 32
        assert freed_slots(292, 144, 8, 1) == 148
        # Scheduled evictions leave elastic caches alone (no ceiling) ...
        assert {batch.reqs[i].rid for members in grouping.due_groups(None_rt(), batch).values()
                for i in members} == set()
        # ... and stop them at the ceiling with one.
        ceiling = _req("ceil", 300, {"mode": "elastic"})
        with serving(server.replace(ceiling=200)):
            due = grouping.due_groups(None_rt(), _batch([ceiling]))
        assert [(cfg.budget, n) for cfg, n, _ in due] == [(200, 292)]


def None_rt():
    """The step's grouping reads only the page size and the ring's slots (none: these
    requests' policies record no queries) of the runtime."""
    from types import SimpleNamespace

    return SimpleNamespace(page_size=1, ring_slots=0)


def test_a_cut_that_frees_no_page_is_not_made():
    # 40 private tokens, floor 34, pages of 16: cutting to 34 keeps 3 pages, as now.
    h = Holding(40, 34, 16)
    assert freed_by_cut(h, 0, 16) == 0 and water_fill([h], 16, 16) == {}
    assert list(itertools.islice(water_fill([Holding(80, 34, 16)], 16, 16).items(), 1)) == [(0, 64)]
