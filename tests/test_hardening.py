"""Issue 22's hardening, on the real scheduler-side code with small CPU tensors and SGLang's own
Req: settings a scheduler cannot apply abort the request, draws are keyed by the request's
content, the overlap scheduler's stream wait happens only on steps that evict, and step device
times are read without waiting."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from vase_sglang import EvictionConfig
from vase_sglang_patches import grouping, runtime, state, step
from vase_sglang_patches import scheduler as scheduler_hooks
from vase_sglang_patches.timing import StepTimer

torch.set_num_threads(1)
LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM = 2, 2, 4, 16


@contextmanager
def serving(cfg, page_size=1, slots=512, rows=8):
    """RUNTIME set to a real EvictionRuntime over a small random CPU pool."""
    gen = torch.Generator().manual_seed(0)
    kv = [torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2 * LAYERS)]
    ring = torch.randn(LAYERS, rows, cfg.window, Q_HEADS, HEAD_DIM, generator=gen)
    rt = runtime.EvictionRuntime(
        cfg=cfg, k_buffers=kv[:LAYERS], v_buffers=kv[LAYERS:],
        req_to_token=torch.zeros(rows, 256, dtype=torch.int32), allocator=None,
        num_q_heads=Q_HEADS, head_dim=HEAD_DIM, start_layer=0, queries=ring,
        page_size=page_size)
    saved, runtime.RUNTIME = runtime.RUNTIME, rt
    try:
        yield rt
    finally:
        runtime.RUNTIME = saved


def _req(rid, input_ids, kv_evict=None, seed=None, output_ids=()):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    custom = None if kv_evict is None else {"kv_evict": kv_evict}
    req = Req(rid, "", list(input_ids), SamplingParams(max_new_tokens=64, custom_params=custom,
                                                      sampling_seed=seed))
    req.output_ids.extend(output_ids)
    return req


def test_settings_the_scheduler_cannot_apply_abort_the_request():
    """The tokenizer manager checks per-request settings against what it knows; a scheduler
    whose pages are larger (or any other mismatch) must abort the request with the reason, not
    serve it with the server's settings as before."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.runtime_context import get_parallel

    server = EvictionConfig(policy="snapkv", budget=128, window=64)
    with serving(server, page_size=64), get_parallel().override(tp_rank=0):
        bad = _req("bad", [1, 2, 3], {"window": 32})
        scheduler_hooks.after_create_req(bad, None, None)
        assert isinstance(bad.to_finish, FINISH_ABORT)
        assert bad.to_finish.status_code == 400
        assert bad.to_finish.message.startswith("kv_evict.window: must be >= the page size (64)")
        assert state.request_config(bad) is None  # never served with other settings
        good = _req("good", [1, 2, 3], {"budget": 96})
        scheduler_hooks.after_create_req(good, None, None)
        assert good.to_finish is None and state.request_config(good).budget == 96
        # A request that reached the scheduler without the intake check (no path does today)
        # is finished at its next step, keeping its KV until SGLang frees it.
        late = _req("late", [1, 2, 3], {"window": 32})
        assert state.request_config(late) is None
        assert isinstance(late.to_finish, FINISH_ABORT) and list(late.origin_input_ids) == [1, 2, 3]


def _key(req, cfg, length):
    """request_key at a true length of `length` tokens (the KV holds all of them)."""
    req.kv.kv_allocated_len = length
    return state.request_key(req, cfg)


def test_draws_are_keyed_by_the_request_content_not_its_rid():
    cfg = EvictionConfig(policy="random", budget=16, window=8)
    prompt = list(range(100, 120))
    out = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    a, b = _req("rid-a", prompt, output_ids=out), _req("rid-b", prompt, output_ids=out)
    with serving(cfg):
        assert _key(a, cfg, 29) == _key(b, cfg, 29)  # random rids, same draws
        # Incremental hashing over rounds equals hashing at once.
        fresh = _req("rid-c", prompt, output_ids=out)
        assert _key(a, cfg, 30) == _key(fresh, cfg, 30) != _key(b, cfg, 29)
        # A token in the window (possibly still in flight) does not change the key; an older
        # one does: n > 1 samples draw alike only while their outputs agree.
        tail = _req("t", prompt, output_ids=out[:-1] + [99])
        assert _key(tail, cfg, 30) == _key(_req("u", prompt, output_ids=out), cfg, 30)
        early = _req("e", prompt, output_ids=[99] + out[1:])
        assert _key(early, cfg, 30) != _key(_req("v", prompt, output_ids=out), cfg, 30)
        # The user's sampling_seed still decides.
        seeded = _req("s", prompt, seed=1234, output_ids=out)
        assert _key(seeded, cfg, 30) == 1234


def _batch(reqs):
    lens = torch.tensor([r.kv.kv_allocated_len for r in reqs])
    return SimpleNamespace(reqs=reqs, seq_lens_cpu=lens, seq_lens=lens.clone(),
                           orig_seq_lens=None, seq_lens_sum=None, batch_is_full=True)


def test_the_overlap_stream_wait_happens_only_on_steps_that_evict(monkeypatch):
    """Ordering the scheduler stream after the forward in flight on every decode step would
    queue each forward behind the previous one; only a step that evicts needs it."""
    cfg = EvictionConfig(policy="streaming", budget=16, window=8)
    waits = []
    monkeypatch.setattr(scheduler_hooks, "wait_for_forward", lambda s: waits.append(s))
    scheduler = SimpleNamespace(enable_overlap=True, forward_stream=object())
    with serving(cfg) as rt:
        reqs = [_req(f"r{i}", [1, 2, 3, 4]) for i in range(2)]
        for i, req in enumerate(reqs):
            req.kv.req_pool_idx, req.kv.cache_protected_len = i, 4
            req.kv.kv_allocated_len = req.kv.kv_committed_len = 4 + cfg.trigger_len - 1
            req.decode_batch_idx = 5
        rt.allocator = SimpleNamespace(free=lambda slots: None)
        batch = _batch(reqs)
        assert scheduler_hooks.evict_due(scheduler, rt, batch, ()) == 0
        assert waits == []  # nothing due: no wait
        for req in reqs:
            req.kv.kv_allocated_len = req.kv.kv_committed_len = 4 + cfg.trigger_len
        rt.req_to_token[:2, :4 + cfg.trigger_len] = torch.arange(
            1, 1 + 2 * (4 + cfg.trigger_len), dtype=torch.int32).view(2, -1)
        assert scheduler_hooks.evict_due(scheduler, rt, _batch(reqs), ()) > 0
        assert waits == [scheduler]


class _FakeEvent:
    """A CUDA event as StepTimer uses it: record(), query() (never blocks), elapsed_time()."""

    clock = 0.0
    done = set()

    def __init__(self):
        self.time = None

    def record(self):
        self.time = _FakeEvent.clock

    def query(self):
        return id(self) in _FakeEvent.done

    def elapsed_time(self, end):
        assert self.query() and end.query(), "elapsed_time on an unfinished event would sync"
        return (end.time - self.time) * 1e3

    def synchronize(self):
        raise AssertionError("StepTimer must never wait on the device")


def test_step_device_time_is_read_when_finished_without_waiting():
    timer = StepTimer("cuda", event_factory=_FakeEvent)
    starts, ends = [], []
    for t0, t1 in ((0.0, 0.25), (1.0, 1.5)):
        _FakeEvent.clock = t0
        timer.start()
        starts.append(timer._start)
        _FakeEvent.clock = t1
        timer.stop()
        ends.append(timer._pending[-1][1])
    assert timer.finished() == []  # both still running on the "device": nothing read, no wait
    _FakeEvent.done |= {id(starts[0]), id(ends[0])}
    assert timer.finished() == [0.25]
    _FakeEvent.done |= {id(starts[1]), id(ends[1])}
    assert timer.finished() == [0.5] and timer.finished() == []
    # On CPU the ops are synchronous: a step's device time is its host time.
    cpu = StepTimer("cpu")
    cpu.start()
    cpu.stop()
    (seconds,) = cpu.finished()
    assert 0 <= seconds < 1


def test_a_seed_tensor_draws_what_each_seed_draws_alone():
    """Per-request seeds go to the selection as a tensor, one per request, so requests that
    differ only in their seed share one batched selection (one settings group)."""
    from vase_sglang import select_tokens

    gen = torch.Generator().manual_seed(3)
    cfg = EvictionConfig(policy="vase-attnv", budget=24, window=8)
    k, v = torch.randn(3, 2, 2, 40, 16, generator=gen), torch.randn(3, 2, 2, 40, 16, generator=gen)
    q = torch.randn(3, 2, 4, 8, 16, generator=gen)
    ids = dict(request=torch.tensor([[5], [6], [7]]), layer=torch.arange(2), round=1)
    seeds = [9, 5, 1234]
    together = select_tokens(cfg, k, v, q, seed=torch.tensor(seeds)[:, None], **ids)
    for i, seed in enumerate(seeds):
        alone = select_tokens(cfg.replace(seed=seed), k[i:i + 1], v[i:i + 1], q[i:i + 1],
                              request=torch.tensor([[5 + i]]), layer=torch.arange(2), round=1)
        assert torch.equal(together[i:i + 1], alone), seed
    assert not torch.equal(together, select_tokens(cfg, k, v, q, **ids))  # seeds matter


def test_requests_differing_only_in_their_seed_share_a_settings_group():
    cfg = EvictionConfig(policy="random", budget=16, window=8)
    with serving(cfg) as rt:
        reqs = [_req(f"r{i}", [1, 2, 3, 4], {"seed": seed}) for i, seed in enumerate((1, 2, 3))]
        reqs.append(_req("r3", [1, 2, 3, 4], {"budget": 24}))
        for i, req in enumerate(reqs):
            req.kv.req_pool_idx, req.kv.cache_protected_len = i, 4
            req.kv.kv_allocated_len = req.kv.kv_committed_len = 4 + 40
            req.decode_batch_idx = 5
        groups = grouping.due_groups(rt, _batch(reqs))
        assert sorted(groups.values()) == [[0, 1, 2], [3]]


def test_pressure_cuts_fixed_requests_only_for_enough_and_never_for_admission():
    """A fixed-mode request is cut early under decode pressure only where that frees half a
    window (a pool that stays short would otherwise run a scoring pass per step for a slot or
    two), and never for a waiting request: admission relief cuts elastic caches only."""
    from test_elastic import _req as elastic_req

    server = EvictionConfig(policy="streaming", budget=32, window=8)
    with serving(server) as rt:
        reqs = [elastic_req("fixed-big", 36, {}), elastic_req("fixed-small", 34, {}),
                elastic_req("elastic", 300, {"mode": "elastic"})]
        batch = _batch(reqs)

        def cut(**kwargs):
            groups, _ = grouping.pressure_groups(rt, batch, (), need=100, **kwargs)
            return {batch.reqs[i].rid for members in groups.values() for i in members}

        assert grouping.min_fixed_cut(server, 1) == 4
        assert cut() == {"fixed-big", "elastic"}  # 34 frees 2 < 4: cut on schedule instead
        assert cut(fixed=False) == {"elastic"}


def test_a_prefix_off_the_page_grid_is_not_evicted(caplog):
    """The row rewrite and the page frees assume the private cache starts on a page; a request
    whose shared prefix does not (not seen with the radix cache on) keeps its whole cache."""
    cfg = EvictionConfig(policy="streaming", budget=32, window=16)
    with serving(cfg, page_size=16) as rt:
        reqs = [_req(f"r{i}", list(range(1, 21))) for i in range(2)]
        for i, (req, prefix) in enumerate(zip(reqs, (16, 20))):
            req.kv.req_pool_idx, req.kv.cache_protected_len = i, prefix
            req.kv.kv_allocated_len = req.kv.kv_committed_len = prefix + 48
            req.decode_batch_idx = 5
        with caplog.at_level("WARNING", logger="vase_sglang.eviction"):
            groups = grouping.due_groups(rt, _batch(reqs))
            grouping.due_groups(rt, _batch(reqs))
        assert list(groups.values()) == [[0]]
        assert sum("does not end on a page of 16" in r.message for r in caplog.records) == 1


def test_overlap_on_cuda_without_a_forward_stream_refuses_to_start(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="no forward_stream"):
        scheduler_hooks.after_init_overlap(None, SimpleNamespace(enable_overlap=True,
                                                                 forward_stream=None))
    scheduler_hooks.after_init_overlap(None, SimpleNamespace(enable_overlap=False,
                                                             forward_stream=None))
    scheduler_hooks.after_init_overlap(None, SimpleNamespace(enable_overlap=True,
                                                             forward_stream=object()))


def test_an_elastic_server_plans_every_cut_at_startup():
    """Elastic cuts go to levels of a grid (vase_sglang/elastic.py) over any number of
    candidates; the step's cost model is keyed so that they share a few traces, which
    step.prime_plans makes at startup: no cut traces in the scheduler's step afterwards, and
    a request's own sinks or seed never trace at all."""
    from vase_sglang import plan
    from vase_sglang.elastic import level_grid

    cfg = EvictionConfig(policy="vase-attnv", budget=24, window=8, mode="elastic")
    with serving(cfg) as rt:
        plan._chunk_cost.cache_clear()
        rt.max_candidates, rt.workspace = 700, None
        rt.__post_init__()  # the startup's own traces (the workspace's sizing)
        assert step.prime_plans(rt) == len(plan.cut_samples(24, 700)) > 0
        traced = plan._chunk_cost.cache_info().misses
        for level in level_grid(700):
            for n in range(max(level, 24) + 1, 700, 37):
                step.plan_group(rt, cfg.replace(budget=max(level, 24), ceiling=None), n, 3)
        for other in (cfg.replace(sinks=0), cfg.replace(seed=12345), cfg.replace(mode="fixed")):
            step.plan_group(rt, other, 24, 2)
        assert plan._chunk_cost.cache_info().misses == traced
