"""Retraction order with eviction: uncompacted requests are retracted before compacted ones,
SGLang's own order holds within each group, and priority blocks still come first."""

from types import SimpleNamespace

from vase_sglang_patches import state
from vase_sglang_patches.scheduler import uncompacted_last


def _req(rounds, priority=None):
    req = SimpleNamespace(priority=priority)
    if rounds:
        state.state(req).rounds = rounds
    return req


def test_uncompacted_are_retracted_first_and_order_is_stable():
    reqs = [_req(0), _req(2), _req(0), _req(1), _req(0)]
    order = [4, 3, 2, 1, 0]  # SGLang's keep-order: index 0 is retracted first
    out = uncompacted_last(order, reqs, by_priority=False)
    assert out == [3, 1, 4, 2, 0]
    assert sorted(out) == list(range(5))


def test_priority_blocks_outrank_compaction():
    reqs = [_req(1, priority=0), _req(0, priority=5), _req(0, priority=0), _req(3, priority=5)]
    order = [1, 3, 0, 2]  # SGLang keeps priority 5 before priority 0
    out = uncompacted_last(order, reqs, by_priority=True)
    assert out == [3, 1, 0, 2]


def test_retracted_request_counts_as_uncompacted_again():
    req = _req(3)
    assert state.compacted(req)
    state.reset_request(req)
    assert not state.compacted(req)
