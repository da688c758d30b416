"""The plugin's work inside a model forward is legal under CUDA-graph capture, and unchanged.

SGLang 0.5.23 records decode and (on CUDA, by default) prefill in CUDA graphs
(docs/cuda_graphs.md), so the query capture runs inside graphs and the token-row build and the
position offset run once per forward on the stream. The CPU stand-in for a capture check:
run each op on fake CUDA tensors (FakeTensorMode without a ShapeEnv, static shapes; no data,
no GPU needed). There, an op whose output shape depends on tensor values (nonzero, boolean
masks, repeat_interleave with tensor repeats) raises DynamicOutputShapeException, a host read
of a device value (.item(), .tolist(), `if tensor`) raises DataDependentOutputException, and a
dispatch hook flags every op that moves data between host and device. Each hazard is shown to
be caught (negative controls, run every time), and the old extend capture fails the check.

torch.compile(fullgraph=True) is not used: torch 2.14 compiles the old extend body as one
graph (it represents data-dependent sizes with unbacked symbols), so it cannot fail here.
Whether the offset staging is pinned (not pageable) needs a CUDA device: graph_capture_check.
"""

from __future__ import annotations

import enum
import json
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.utils._python_dispatch import TorchDispatchMode

from vase_sglang import EvictionConfig, capture
from vase_sglang.capture import SCRATCH_ROW

torch.set_num_threads(1)


# --------------------------------------------------------------------- the check


class _TransferLog(TorchDispatchMode):
    """Records ops whose tensor arguments or results span host and device."""

    def __init__(self):
        super().__init__()
        self.transfers = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [a for a in _flatten(list(args) + list(kwargs.values()) + [out])
                   if isinstance(a, torch.Tensor)]
        if len({t.device.type for t in tensors}) > 1:
            self.transfers.append(f"host-device transfer: {func}")
        return out


def _flatten(items):
    for item in items:
        if isinstance(item, (list, tuple)):
            yield from _flatten(item)
        else:
            yield item


def capture_hazards(fn, *args) -> list[str]:
    """Run fn on fake CUDA copies of the tensor args (same shapes and dtypes); return what
    would make it illegal or wrong under CUDA-graph capture."""
    mode = FakeTensorMode()  # no ShapeEnv: every shape must be static
    with mode:
        fakes = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cuda")
                 if isinstance(a, torch.Tensor) else a for a in args]
    log = _TransferLog()
    try:
        with mode, log:
            fn(*fakes)
    except DynamicOutputShapeException as err:
        return [f"data-dependent shape: {err.func}"]
    except DataDependentOutputException as err:
        return [f"host read of a device value: {err.func}"]
    return log.transfers


# ------------------------------------------------------ the code before this change


def old_capture_extend(ring, q, req_pool_indices, extend_seq_lens, seq_lens, positions, window):
    """Negative control: the extend branch of EvictionRuntime.capture_queries before the
    capture moved to vase_sglang/capture.py (commit 385648f), verbatim but for the arguments."""
    lens = extend_seq_lens
    rows = torch.repeat_interleave(req_pool_indices, lens)
    ends = torch.repeat_interleave(seq_lens, lens)
    n = rows.shape[0]
    pos = positions[:n]
    mask = pos >= ends - window
    ring[rows[mask], pos[mask] % window] = q[:n][mask].to(ring.dtype)


def old_capture_decode(ring, q, req_pool_indices, positions, window):
    """The decode branch before this change, verbatim but for the arguments."""
    n = req_pool_indices.shape[0]
    ring[req_pool_indices, positions[:n] % window] = q[:n].to(ring.dtype)


# ------------------------------------------------------------------ test batches

ROWS, WINDOW, HEADS, DIM, LAYERS = 12, 8, 4, 16, 3


def extend_batch(gen, requests: int, window: int = WINDOW):
    """Distinct request rows (never the scratch row), extend lengths from 1 to 3 * window (so
    some are shorter than the window), cached prefixes; positions and seq_lens as
    ForwardBatch.init_new builds them."""
    rows = torch.randperm(ROWS - 1, generator=gen)[:requests] + 1
    lens = torch.randint(1, 3 * window, (requests,), generator=gen)
    prefix = torch.randint(0, 2 * window, (requests,), generator=gen)
    positions = torch.cat([p + torch.arange(n) for p, n in zip(prefix.tolist(), lens.tolist())])
    return SimpleNamespace(rows=rows, lens=lens.to(torch.int32), seq_lens=prefix + lens,
                           positions=positions, tokens=int(lens.sum()))


def expected_extend(ring, q, batch, window=WINDOW):
    """Plain loop: each request's tokens at positions >= seq_len - window land at
    ring[row, position % window]; nothing else changes."""
    expected = ring.clone()
    token = 0
    for row, n, end in zip(batch.rows.tolist(), batch.lens.tolist(), batch.seq_lens.tolist()):
        for i in range(token, token + n):
            pos = int(batch.positions[i])
            if pos >= end - window:
                expected[row, pos % window] = q[i]
        token += n
    return expected


def expected_decode(ring, q, rows, positions, window=WINDOW):
    expected = ring.clone()
    for i, (row, pos) in enumerate(zip(rows.tolist(), positions.tolist())):
        expected[row, pos % window] = q[i]
    return expected


def real_rows(ring):
    return ring[..., SCRATCH_ROW + 1:, :, :, :] if ring.dim() == 5 else ring[SCRATCH_ROW + 1:]


# ------------------------------------------------------------ capture safety


def test_negative_control_old_extend_capture_is_not_capturable():
    gen = torch.Generator().manual_seed(0)
    b = extend_batch(gen, 4)
    ring = torch.zeros(ROWS, WINDOW, HEADS, DIM)
    q = torch.randn(b.tokens, HEADS, DIM, generator=gen)
    hazards = capture_hazards(old_capture_extend, ring, q, b.rows, b.lens, b.seq_lens,
                              b.positions, WINDOW)
    assert hazards == ["data-dependent shape: aten.repeat_interleave.Tensor"]


@pytest.mark.parametrize("body,hazard", [
    (lambda x, lens: torch.repeat_interleave(x, lens), "data-dependent shape"),
    (lambda x, lens: x[x > 2], "data-dependent shape"),
    (lambda x, lens: x.nonzero(), "data-dependent shape"),
    (lambda x, lens: torch.zeros(int(lens.sum()), device=x.device), "host read"),
    (lambda x, lens: x[: lens.tolist()[0]], "host read"),
    (lambda x, lens: x * 2 if bool((x > 0).any()) else x, "host read"),
    (lambda x, lens: x + torch.tensor([1, 2, 3]).to(x.device, non_blocking=True), "transfer"),
    (lambda x, lens: x.cpu(), "transfer"),
])
def test_negative_controls_each_hazard_is_caught(body, hazard):
    hazards = capture_hazards(body, torch.arange(3), torch.tensor([1, 2, 0]))
    assert hazards and all(hazard in h for h in hazards), hazards


def test_decode_capture_is_capturable():
    bucket = 8  # padded decode batch: padding rows are row 0, position 0
    args = (torch.zeros(ROWS, WINDOW, HEADS, DIM, dtype=torch.bfloat16),
            torch.randn(bucket, HEADS, DIM), torch.zeros(bucket, dtype=torch.int64),
            torch.zeros(bucket, dtype=torch.int64), WINDOW)
    assert capture_hazards(capture.capture_decode_queries, *args) == []


def test_extend_capture_and_token_rows_are_capturable():
    gen = torch.Generator().manual_seed(1)
    b = extend_batch(gen, 5)
    bucket = b.tokens + 13  # a prefill-graph bucket larger than the batch: padding tokens
    token_rows = torch.zeros(bucket + 64, dtype=torch.int64)
    assert capture_hazards(capture.extend_token_rows, token_rows, b.rows, b.lens, b.seq_lens,
                           b.positions, WINDOW) == []
    assert capture_hazards(capture.capture_extend_queries,
                           torch.zeros(ROWS, WINDOW, HEADS, DIM), torch.randn(bucket, HEADS, DIM),
                           token_rows, torch.zeros(bucket, dtype=torch.int64), WINDOW) == []


def test_offset_op_is_capturable():
    assert capture_hazards(capture.offset_positions, torch.zeros(8, dtype=torch.int64),
                           torch.zeros(5, dtype=torch.int64)) == []


# ------------------------------------------------- results identical to before


class Mode(enum.Enum):
    """The two ForwardMode predicates capture_queries asks."""
    EXTEND = "extend"
    DECODE = "decode"

    def is_extend(self):
        return self is Mode.EXTEND

    def is_decode(self):
        return self is Mode.DECODE


def make_runtime(capacity=512, queries=None, token_rows=None):
    from vase_sglang_patches.runtime import EvictionRuntime

    cfg = EvictionConfig(policy="vase-attnv", budget=32, window=WINDOW)
    # Small real KV buffers: the runtime sizes its step workspace from them at construction.
    kv = [torch.zeros(8, 1, DIM) for _ in range(LAYERS)]
    rt = EvictionRuntime(
        cfg=cfg, k_buffers=kv, v_buffers=kv, req_to_token=None,
        allocator=None, num_q_heads=HEADS, head_dim=DIM, start_layer=0,
        queries=torch.randn(LAYERS, ROWS, WINDOW, HEADS, DIM) if queries is None else queries,
    )
    rt.token_rows = (torch.full((capacity,), SCRATCH_ROW, dtype=torch.int64)
                     if token_rows is None else token_rows)
    return rt


@pytest.mark.parametrize("mode", [Mode.DECODE, Mode.EXTEND])
def test_runtime_capture_queries_is_capturable(mode):
    """The entry point serving calls inside the recorded forward (RadixAttention.forward hook):
    EvictionRuntime.capture_queries, on a prefill-graph bucket with padding tokens."""
    gen = torch.Generator().manual_seed(6)
    b = extend_batch(gen, 4)
    bucket = b.tokens + 9 if mode is Mode.EXTEND else 8

    rt = make_runtime()  # built outside the check: only the forward-path call is under it

    def forward_layer(queries, token_rows, q, rows, lens, seq_lens, positions):
        rt.queries, rt.token_rows = queries, token_rows
        fb = SimpleNamespace(forward_mode=mode, req_pool_indices=rows, extend_seq_lens=lens,
                             seq_lens=seq_lens, positions=positions)
        rt.capture_queries(1, q, fb)

    rows = b.rows if mode is Mode.EXTEND else torch.zeros(bucket, dtype=torch.int64)
    hazards = capture_hazards(
        forward_layer, torch.zeros(LAYERS, ROWS, WINDOW, HEADS, DIM),
        torch.zeros(bucket + 32, dtype=torch.int64), torch.randn(bucket, HEADS * DIM), rows,
        b.lens, b.seq_lens, torch.zeros(bucket, dtype=torch.int64))
    assert hazards == []


def test_extend_capture_matches_old_and_loop_on_random_batches():
    """One runtime through batches of varying size (a stale tail of the token-row buffer would
    show), each run unpadded (eager) and padded to a larger bucket (graph replay, padding at
    position 0 with garbage queries)."""
    gen = torch.Generator().manual_seed(2)
    rt = make_runtime()
    for trial in range(12):
        b = extend_batch(gen, int(torch.randint(1, 7, (1,), generator=gen)))
        fb = SimpleNamespace(forward_mode=Mode.EXTEND, req_pool_indices=b.rows,
                             extend_seq_lens=b.lens, seq_lens=b.seq_lens, positions=b.positions)
        rt.prepare_capture(fb)
        pad = int(torch.randint(0, 20, (1,), generator=gen))
        padded_positions = torch.cat([b.positions, torch.zeros(pad, dtype=torch.int64)])
        for layer in range(LAYERS):
            q = torch.randn(b.tokens + pad, HEADS * DIM, generator=gen)
            q3 = q.view(-1, HEADS, DIM)
            before = rt.queries[layer].clone()
            old = before.clone()
            old_capture_extend(old, q3[: b.tokens], b.rows, b.lens, b.seq_lens, b.positions,
                               WINDOW)
            expected = expected_extend(before, q3, b)
            assert torch.equal(real_rows(old), real_rows(expected))  # the loop is the old rule
            if trial % 2:  # eager forward: exactly the batch's tokens
                rt.capture_queries(layer, q[: b.tokens], fb)
            else:  # replayed graph bucket: the forward batch's positions are the padded buffer
                rt.capture_queries(layer, q, SimpleNamespace(**{**vars(fb),
                                                                "positions": padded_positions}))
            assert torch.equal(real_rows(rt.queries[layer]), real_rows(expected)), (trial, layer)


def test_decode_capture_matches_old_and_loop_on_random_batches():
    gen = torch.Generator().manual_seed(3)
    rt = make_runtime()
    for _ in range(10):
        bs = int(torch.randint(1, ROWS - 1, (1,), generator=gen))
        pad = int(torch.randint(0, 4, (1,), generator=gen))
        rows = torch.cat([torch.randperm(ROWS - 1, generator=gen)[:bs] + 1,
                          torch.zeros(pad, dtype=torch.int64)])  # graph padding rows: row 0
        positions = torch.cat([torch.randint(0, 500, (bs,), generator=gen),
                               torch.zeros(pad, dtype=torch.int64)])
        fb = SimpleNamespace(forward_mode=Mode.DECODE, req_pool_indices=rows, positions=positions)
        for layer in range(LAYERS):
            q = torch.randn(bs + pad, HEADS * DIM, generator=gen)
            before = rt.queries[layer].clone()
            old = before.clone()
            old_capture_decode(old, q.view(-1, HEADS, DIM), rows, positions, WINDOW)
            expected = expected_decode(before, q.view(-1, HEADS, DIM)[:bs], rows[:bs],
                                       positions[:bs])
            rt.capture_queries(layer, q, fb)
            assert torch.equal(real_rows(rt.queries[layer]), real_rows(expected))
            assert torch.equal(real_rows(old), real_rows(expected))


def test_token_rows_send_unkept_and_padding_tokens_to_scratch():
    gen = torch.Generator().manual_seed(4)
    b = extend_batch(gen, 6)
    out = torch.full((b.tokens + 40,), -1, dtype=torch.int64)
    capture.extend_token_rows(out, b.rows, b.lens, b.seq_lens, b.positions, WINDOW)
    expected, token = [], 0
    for row, n, end in zip(b.rows.tolist(), b.lens.tolist(), b.seq_lens.tolist()):
        expected += [row if int(b.positions[i]) >= end - WINDOW else SCRATCH_ROW
                     for i in range(token, token + n)]
        token += n
    assert out.tolist() == expected + [SCRATCH_ROW] * 40
    with pytest.raises(RuntimeError, match="exceeds the token-row buffer"):
        capture.extend_token_rows(out[: b.tokens - 1], b.rows, b.lens, b.seq_lens, b.positions,
                                  WINDOW)


# ------------------------------------------------------ the ForwardBatch hook


def test_forward_batch_hook_offsets_decode_positions_and_builds_extend_rows(monkeypatch):
    from vase_sglang_patches import model_runner, runtime, state

    rt = make_runtime()
    monkeypatch.setattr(runtime, "RUNTIME", rt)
    reqs = [SimpleNamespace(), SimpleNamespace(), SimpleNamespace()]
    state.state(reqs[0]).pos_offset = 40
    state.state(reqs[2]).pos_offset = 7
    positions = torch.tensor([10, 11, 12, 0], dtype=torch.int64)  # one padding entry
    ret = SimpleNamespace(forward_mode=Mode.DECODE, positions=positions)
    out = model_runner.after_forward_batch_init(ret, None, SimpleNamespace(reqs=reqs), None)
    assert out.positions.tolist() == [50, 11, 19, 0]

    gen = torch.Generator().manual_seed(5)
    b = extend_batch(gen, 3)
    ret = SimpleNamespace(forward_mode=Mode.EXTEND, req_pool_indices=b.rows,
                          extend_seq_lens=b.lens, seq_lens=b.seq_lens, positions=b.positions)
    model_runner.after_forward_batch_init(ret, None, SimpleNamespace(reqs=reqs[:3]), None)
    assert ret.positions is b.positions  # extend positions are not offset
    kept = rt.token_rows[: b.tokens]
    assert (kept != SCRATCH_ROW).sum() == sum(min(int(n), WINDOW) for n in b.lens)
    assert (rt.token_rows[b.tokens:] == SCRATCH_ROW).all()


# ------------------------------------------------------- the GPU check's harness


def test_graph_capture_check_harness_runs_on_cpu():
    result = capture.graph_capture_check("cpu")
    assert json.loads(json.dumps(result)) == result
    assert result["ok"] and not result["cuda_graphs"], result
    assert set(result["checks"]) == {"decode", "extend", "extend_token_rows", "offset"}


def test_graph_capture_check_harness_detects_a_wrong_capture(monkeypatch):
    """Negative control for the harness: an extend capture that ignores the scratch row
    (writes every token to its request) must be reported, not pass."""

    def ignores_scratch(ring, q, token_rows, positions, window):
        rows = torch.where(token_rows[: q.shape[0]] == SCRATCH_ROW, 1, token_rows[: q.shape[0]])
        ring[rows, positions[: q.shape[0]] % window] = q

    monkeypatch.setattr(capture, "capture_extend_queries", ignores_scratch)
    result = capture.graph_capture_check("cpu")
    assert not result["ok"] and not result["checks"]["extend"]["ok"]
    assert result["checks"]["decode"]["ok"]


# ------------------------------------------------------- trimkv's retention gate


def _gate_args(gen, bucket, slots=64, hidden=24, rank=8, layers=LAYERS, kv_heads=2):
    return (torch.zeros(layers, slots, kv_heads, 1), torch.zeros(layers, slots, kv_heads, 1),
            torch.randn(layers, rank, hidden, generator=gen), torch.randn(layers, rank, generator=gen),
            torch.randn(layers, kv_heads, rank, generator=gen), torch.randn(layers, kv_heads, generator=gen),
            torch.randn(bucket, hidden, generator=gen))


def _gate_forward(module_layer, mode):
    """The serving entry point inside the recorded forward: the pre-hook on self_attn
    (patches/model_runner._retention_pre_hook) with this runtime's buffers and gates."""
    from vase_sglang_patches import model_runner, runtime

    def forward_layer(log_beta, position, w1, b1, w2, b2, x, out_cache_loc, positions):
        rt = runtime.RUNTIME
        rt.retention = runtime.RetentionBuffers(w1, b1, w2, b2, list(log_beta), list(position))
        module = SimpleNamespace(attn=SimpleNamespace(layer_id=module_layer))
        fb = SimpleNamespace(forward_mode=mode, out_cache_loc=out_cache_loc)
        model_runner._retention_pre_hook(
            module, (), {"positions": positions, "hidden_states": x, "forward_batch": fb})

    return forward_layer


@pytest.mark.parametrize("mode", [Mode.DECODE, Mode.EXTEND])
def test_retention_gate_hook_is_capturable(monkeypatch, mode):
    """trimkv's gate (log β and position into the side buffers) on a graph bucket with
    padding tokens (out_cache_loc 0, position 0): static shapes, no host read, no transfer."""
    from vase_sglang_patches import runtime

    monkeypatch.setattr(runtime, "RUNTIME", make_runtime())
    gen = torch.Generator().manual_seed(9)
    bucket = 8 if mode is Mode.DECODE else 37
    args = _gate_args(gen, bucket)
    loc = torch.zeros(bucket, dtype=torch.int64)
    hazards = capture_hazards(_gate_forward(1, mode), *args, loc, torch.zeros(bucket, dtype=torch.int64))
    assert hazards == []


def test_retention_gate_hook_writes_the_gates_log_beta_and_position(monkeypatch):
    """Real tokens: the slot of each token holds RetentionGates.log_beta of its input and its
    true position, for this layer only; padding tokens go to slot 0 only."""
    from vase_sglang import gates as R
    from vase_sglang_patches import runtime

    monkeypatch.setattr(runtime, "RUNTIME", make_runtime())
    gen = torch.Generator().manual_seed(10)
    real, bucket, layer = 5, 9, 2
    log_beta, position, w1, b1, w2, b2, x = _gate_args(gen, bucket)
    loc = torch.zeros(bucket, dtype=torch.int64)
    loc[:real] = torch.tensor([7, 3, 40, 12, 63])
    positions = torch.zeros(bucket, dtype=torch.int64)
    positions[:real] = torch.tensor([100, 5, 2**20 + 3, 64, 9])
    _gate_forward(layer, Mode.EXTEND)(log_beta, position, w1, b1, w2, b2, x, loc, positions)

    gates = R.RetentionGates(LAYERS, x.shape[1], w2.shape[1], gate_hidden=w1.shape[1])
    with torch.no_grad():
        for name, t in zip(R.TENSORS, (w1, b1, w2, b2)):
            getattr(gates, name).copy_(t)
    expected = gates.log_beta(layer, x[:real])  # [real, H]
    for i, slot in enumerate(loc[:real].tolist()):
        torch.testing.assert_close(log_beta[layer, slot, :, 0], expected[i], rtol=0, atol=1e-6)
        assert position[layer, slot, :, 0].tolist() == [float(positions[i])] * 2
    touched = set(loc.tolist())
    untouched = [s for s in range(log_beta.shape[1]) if s not in touched]
    assert not log_beta[layer, untouched].any() and not position[layer, untouched].any()
    others = [i for i in range(LAYERS) if i != layer]
    assert not log_beta[others].any() and not position[others].any()


# ------------------------------------------ the query ring held in the pool's slots


def _pool_ring(k, v, table):
    from vase_sglang.pool_ring import PoolRing

    return PoolRing([k], [v], table, WINDOW, HEADS, DIM, k.dtype)


def _pool_buffers(slots=64):
    from vase_sglang.pool_ring import slots_per_request

    per_request = slots_per_request(WINDOW, HEADS, DIM, torch.float32, 1, 4)
    return (torch.zeros(slots, 1, DIM), torch.zeros(slots, 1, DIM),
            torch.zeros(ROWS, per_request, dtype=torch.int64))


def test_pool_ring_capture_is_capturable():
    """Issue 51: the ring in the pool's slots is written by the same recorded capture ops
    (decode and extend) and read by the step's gather, all static-shaped and sync-free."""
    k, v, table = _pool_buffers()
    bucket = 8

    def decode(k, v, table, q, rows, positions):
        capture.capture_decode_queries(_pool_ring(k, v, table)[0], q, rows, positions, WINDOW)

    def extend(k, v, table, q, token_rows, positions):
        capture.capture_extend_queries(_pool_ring(k, v, table)[0], q, token_rows, positions,
                                       WINDOW)

    def gather(k, v, table, rows, entries, out):
        from vase_sglang.pool_ring import gather_queries

        gather_queries(_pool_ring(k, v, table)[0], (rows, entries), out)

    positions = torch.zeros(bucket, dtype=torch.int64)
    rows = torch.zeros(bucket, dtype=torch.int64)
    assert capture_hazards(decode, k, v, table, torch.randn(bucket, HEADS, DIM), rows,
                           positions) == []
    assert capture_hazards(extend, k, v, table, torch.randn(bucket + 5, HEADS, DIM),
                           torch.zeros(bucket + 9, dtype=torch.int64),
                           torch.zeros(bucket + 5, dtype=torch.int64)) == []
    assert capture_hazards(gather, k, v, table, torch.zeros(3, 1, dtype=torch.int64),
                           torch.zeros(3, WINDOW, dtype=torch.int64),
                           torch.zeros(3, WINDOW, HEADS, DIM)) == []


def test_pool_ring_holds_what_a_ring_tensor_holds():
    """Written by the decode and extend captures, then gathered as the step does, the ring in
    pool slots gives exactly the ring tensor's queries; rows without slots (row 0, requests
    whose policy reads no queries) write only the padding slot, and no other slot changes."""
    gen = torch.Generator().manual_seed(5)
    slots = 1 + (ROWS - 1) * _pool_buffers()[2].shape[1] + 7
    k, v, table = _pool_buffers(slots)
    k.normal_(generator=gen), v.normal_(generator=gen)
    owned = torch.randperm(slots - 1, generator=gen)[: (ROWS - 2) * table.shape[1]] + 1
    table[2:] = owned.view(ROWS - 2, table.shape[1])  # row 1: a request without a ring
    before_k, before_v = k.clone(), v.clone()
    ring = _pool_ring(k, v, table)[0]
    plain = torch.zeros(ROWS, WINDOW, HEADS, DIM)
    for step in range(3 * WINDOW):
        rows = torch.randperm(ROWS, generator=gen)  # distinct rows, as in a batch
        q = torch.randn(ROWS, HEADS, DIM, generator=gen)
        positions = torch.full((ROWS,), step)
        capture.capture_decode_queries(ring, q, rows, positions, WINDOW)
        capture.capture_decode_queries(plain, q, rows, positions, WINDOW)
    index = (torch.arange(2, ROWS)[:, None], torch.arange(WINDOW).roll(3).expand(ROWS - 2, -1))
    out = torch.empty(ROWS - 2, WINDOW, HEADS, DIM)
    from vase_sglang.pool_ring import gather_queries

    gather_queries(ring, index, out)
    assert torch.equal(out, plain[index])
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[owned] = False
    untouched[0] = False
    assert torch.equal(k[untouched], before_k[untouched])
    assert torch.equal(v[untouched], before_v[untouched])
