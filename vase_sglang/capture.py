"""Everything the plugin runs inside a model forward: the query capture and the RoPE offset.

SGLang 0.5.23 on CUDA records decode in a full CUDA graph and prefill in a breakable one by
default (docs/cuda_graphs.md). Work recorded in a graph is replayed later on new values in the
same buffers, so every op here is static-shaped, never reads a device value on the host (no
`.item()`, no boolean-mask indexing, no `repeat_interleave` with device lengths) and never
copies between host and device. Plain functions on tensors, free of SGLang, so a GPU check
without SGLang can capture them (`graph_capture_check`).

Decode: one query per request, written at (req_pool_indices, position % window). Both tensors
are static buffers that decode replay refills (padding rows: request row 0, position 0).

Extend: the breakable prefill graph records the transformer body, RadixAttention.forward and
therefore our hook included, with a dummy ForwardBatch whose per-request tensors
(req_pool_indices, seq_lens, extend_seq_lens, ...) are views of length capture-bs (one request
for most buckets) into static buffers; replay refills them up to the live batch size, so
recorded kernels that read those views see only the first capture-bs requests. Only the token
axis is safe in the graph: `positions` and the query tensor are bucket-sized and refilled
(padding tokens at position 0). So the one per-request fact the capture needs, the ring row of
each token, is computed outside the graph when the ForwardBatch is built (`extend_token_rows`,
run from the ForwardBatch.init_new hook on the forward stream, before replay), into a
persistent buffer that the recorded `capture_extend_queries` reads. It is computed on device
from the batch's device tensors (a searchsorted over cumulative extend lengths): no host read,
no transfer. Building it on the host from `extend_seq_lens_cpu` would cost an H2D copy of one
int per token per prefill, and that list is unset on SGLang's gpu_only path; the device build
needs neither.

Tokens outside their request's last `window`, and padding tokens, are written to ring row
`SCRATCH_ROW` = 0 instead of being filtered out (a filter would have a data-dependent shape).
Row 0 is SGLang's own padding row of the request table (ReqToTokenPool never hands it to a
request; decode graphs already point padding rows at it), so the ring, which has one row per
request-table row, needs no extra row. Real rows end up exactly as with the old filtered write:
the kept tokens of a request have distinct positions modulo window, and requests have distinct
rows. Cost: the extend capture writes every token's query (to row 0 when not kept), one extra
copy of q per layer per prefill.

The RoPE offset (true position minus KV length, per request) lives on the host (a Req
attribute); `stage_host_ints` moves it through pinned memory with a non-blocking copy, the
idiom ForwardBatch.init_new uses for extend_seq_lens, and `offset_positions` adds it on device.
Decode replay copies ForwardBatch.positions into its static buffer, so the offset reaches the
graph.
"""

from __future__ import annotations

import torch

SCRATCH_ROW = 0  # SGLang's padding row of the request table, never a request's row


# ------------------------------------------------------------- recorded in CUDA graphs


def capture_decode_queries(ring: torch.Tensor, q: torch.Tensor, req_pool_indices: torch.Tensor,
                           positions: torch.Tensor, window: int) -> None:
    """ring [rows, window, H, D] of one layer; q [bs(+), H, D]; one query per request."""
    n = req_pool_indices.shape[0]
    ring[req_pool_indices, positions[:n] % window] = q[:n].to(ring.dtype)


def capture_extend_queries(ring: torch.Tensor, q: torch.Tensor, token_rows: torch.Tensor,
                           positions: torch.Tensor, window: int) -> None:
    """ring [rows, window, H, D] of one layer; q [T, H, D] (T = tokens, or the graph bucket);
    token_rows from `extend_token_rows` (>= T entries)."""
    t = q.shape[0]
    ring[token_rows[:t], positions[:t] % window] = q.to(ring.dtype)


def record_retention(log_beta: torch.Tensor, position: torch.Tensor, x: torch.Tensor,
                     w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
                     out_cache_loc: torch.Tensor, positions: torch.Tensor) -> None:
    """trimkv's gate at token creation, for one layer: log β = logsigmoid(w2 · silu(w1 · x +
    b1) + b2) of every token x [T, hidden] (T = tokens, or the graph bucket), written with the
    token's true position into the side buffers log_beta, position [slots, H, 1] (float32) at
    the slots its K/V go to (out_cache_loc; padding tokens write to slot 0, SGLang's padding
    slot, as the K/V write does). w2 [H, r], b2 [H]: this rank's KV heads."""
    t = x.shape[0]
    h = torch.nn.functional.silu(torch.nn.functional.linear(x.float(), w1, b1))
    lb = torch.nn.functional.logsigmoid(torch.nn.functional.linear(h, w2, b2))  # [T, H]
    loc = out_cache_loc[:t]
    log_beta[loc] = lb[:, :, None]
    position[loc] = positions[:t].to(position.dtype)[:, None, None].expand(t, lb.shape[1], 1)


# ------------------------------------------------- run once per forward, outside graphs


def extend_token_rows(out: torch.Tensor, req_pool_indices: torch.Tensor,
                      extend_seq_lens: torch.Tensor, seq_lens: torch.Tensor,
                      positions: torch.Tensor, window: int) -> None:
    """Fill `out` (persistent [capacity] int64) with the ring row of each token of an extend
    batch: its request's row when the token is among the request's last `window` positions
    (position >= seq_len - window), else SCRATCH_ROW; entries past the batch's tokens too."""
    n = positions.shape[0]  # a shape: host-known, no sync
    if n > out.shape[0]:
        raise RuntimeError(f"extend batch of {n} tokens exceeds the token-row buffer ({out.shape[0]})")
    token = torch.arange(n, device=positions.device)
    ends = torch.cumsum(extend_seq_lens.to(torch.int64), 0)  # exclusive end of each request
    req = torch.searchsorted(ends, token, right=True)  # first request whose end is > token
    real = req < req_pool_indices.shape[0]
    req = req.clamp(max=req_pool_indices.shape[0] - 1)
    keep = real & (positions.to(torch.int64) >= seq_lens[req].to(torch.int64) - window)
    rows = torch.where(keep, req_pool_indices[req].to(out.dtype), SCRATCH_ROW)
    out[:n].copy_(rows)
    out[n:].fill_(SCRATCH_ROW)  # graph buckets read past n: padding goes to the scratch row


def pinned_host_ints(values: list[int], dtype: torch.dtype, device) -> torch.Tensor:
    """Host tensor of `values`, page-locked when it is bound for a CUDA device."""
    return torch.tensor(values, dtype=dtype, pin_memory=torch.device(device).type == "cuda")


def stage_host_ints(values: list[int], dtype: torch.dtype, device) -> torch.Tensor:
    """`values` on `device` without blocking the host: from pinned memory, non_blocking, on the
    current stream. PyTorch's caching host allocator keeps the pinned block until the copy has
    run, so a later call cannot overwrite it early."""
    return pinned_host_ints(values, dtype, device).to(device, non_blocking=True)


def offset_positions(positions: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Decode positions (one per request, then any padding) plus each request's offset."""
    n = offsets.shape[0]
    return torch.cat([positions[:n] + offsets.to(positions.dtype), positions[n:]])


# ---------------------------------------------------------------- GPU capture check


def graph_capture_check(device="cuda", seed: int = 0) -> dict:
    """Record the forward-path ops in torch.cuda.CUDAGraph under
    torch.cuda.set_sync_debug_mode("error"), replay them on new input values written into the
    same buffers, and compare with eager runs and a plain loop. The ops that run outside graphs
    in serving (the token-row build, the offset staging) run eagerly under the same sync mode,
    and are also recorded once to show they would be legal inside one. On a non-CUDA device
    the same sequence runs eagerly in place of record/replay (a harness check only).
    Returns a JSON-able dict; "ok" is true when every part matched."""
    device = torch.device(device)
    use_graphs = device.type == "cuda"
    gen = torch.Generator().manual_seed(seed)
    out = {"device": str(device), "cuda_graphs": use_graphs, "torch": torch.__version__,
           "checks": {}}
    if use_graphs:
        out["device_name"] = torch.cuda.get_device_name(device)
    for name, check in (("decode", _check_decode), ("extend", _check_extend),
                        ("extend_token_rows", _check_token_rows), ("offset", _check_offset)):
        try:
            out["checks"][name] = check(device, use_graphs, gen)
        except Exception as err:  # report every part, not just the first failure
            out["checks"][name] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    out["ok"] = all(c.get("ok", False) for c in out["checks"].values())
    return out


_ROWS, _WINDOW, _HEADS, _DIM = 9, 4, 2, 8  # ring of one layer, rows 1.. are requests


class _SyncErrors:
    """torch.cuda.set_sync_debug_mode("error") for the block (no-op off CUDA)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self):
        if self.enabled:
            self.previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        if self.enabled:
            torch.cuda.set_sync_debug_mode(self.previous)
        return False


def _record(body, device, use_graphs):
    """A callable that replays `body` on whatever its buffers hold: a CUDA graph recorded with
    sync errors on (after a warm-up on a side stream, as torch.cuda.graph requires), or the
    body itself off CUDA. The graph object is returned too, to keep it alive."""
    if not use_graphs:
        return body, None
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with _SyncErrors(True):
            body()

    def replay():
        with _SyncErrors(True):
            graph.replay()

    return replay, graph


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen)


def _expected_ring(ring, q, rows, positions, window):
    """Plain loop: token i of row r != SCRATCH_ROW lands at ring[r, positions[i] % window]."""
    expected = ring.clone()
    for i, (row, pos) in enumerate(zip(rows.tolist(), positions.tolist())):
        if row != SCRATCH_ROW:
            expected[row, pos % window] = q[i].to(ring.dtype)
    return expected


def _real_rows_equal(a, b) -> bool:
    return bool(torch.equal(a[SCRATCH_ROW + 1:].cpu(), b[SCRATCH_ROW + 1:].cpu()))


def _check_decode(device, use_graphs, gen) -> dict:
    bucket = 6
    ring = torch.zeros(_ROWS, _WINDOW, _HEADS, _DIM, device=device)
    q = torch.zeros(bucket, _HEADS, _DIM, device=device)
    rows = torch.zeros(bucket, dtype=torch.int64, device=device)
    positions = torch.zeros(bucket, dtype=torch.int64, device=device)
    replay, _graph = _record(
        lambda: capture_decode_queries(ring, q, rows, positions, _WINDOW), device, use_graphs)
    results = []
    for real in (bucket, 3, 1):  # full bucket, then padded batches (padding: row 0, pos 0)
        perm = torch.randperm(_ROWS - 1, generator=gen)[:real] + 1
        new_rows = torch.zeros(bucket, dtype=torch.int64)
        new_rows[:real] = perm
        new_pos = torch.zeros(bucket, dtype=torch.int64)
        new_pos[:real] = torch.randint(0, 100, (real,), generator=gen)
        new_q = _randn(gen, bucket, _HEADS, _DIM)
        before = ring.clone()
        rows.copy_(new_rows.to(device))
        positions.copy_(new_pos.to(device))
        q.copy_(new_q.to(device))
        replay()
        eager = before.clone()
        capture_decode_queries(eager, q, rows, positions, _WINDOW)
        expected = _expected_ring(before.cpu(), new_q, new_rows, new_pos, _WINDOW)
        results.append(_real_rows_equal(ring, eager) and _real_rows_equal(ring, expected))
    return {"ok": all(results), "replays": len(results), "bucket": bucket}


def _extend_batch(gen, requests: int, tokens: int, window: int):
    """A random extend batch: distinct rows, extend lengths (some < window) and cached
    prefixes; positions and seq_lens as ForwardBatch.init_new builds them."""
    rows = torch.randperm(_ROWS - 1, generator=gen)[:requests] + 1
    cuts = torch.sort(torch.randperm(tokens - 1, generator=gen)[:requests - 1] + 1).values
    bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([tokens])])
    lens = bounds[1:] - bounds[:-1]
    prefix = torch.randint(0, 2 * window, (requests,), generator=gen)
    positions = torch.cat([p + torch.arange(n) for p, n in zip(prefix.tolist(), lens.tolist())])
    return rows, lens, prefix + lens, positions


def _check_extend(device, use_graphs, gen) -> dict:
    """Serving's split: the token rows are built eagerly per batch, the capture is recorded
    once for a token bucket and replayed on batches of fewer tokens (padding at position 0)."""
    bucket, capacity = 24, 32
    ring = torch.zeros(_ROWS, _WINDOW, _HEADS, _DIM, device=device)
    q = torch.zeros(bucket, _HEADS, _DIM, device=device)
    positions = torch.zeros(bucket, dtype=torch.int64, device=device)
    token_rows = torch.zeros(capacity, dtype=torch.int64, device=device)
    replay, _graph = _record(
        lambda: capture_extend_queries(ring, q, token_rows, positions, _WINDOW), device, use_graphs)
    results = []
    for requests, tokens in ((3, bucket), (4, 17), (2, 5), (1, 2)):
        rows, lens, seq_lens, pos = _extend_batch(gen, requests, tokens, _WINDOW)
        new_q = _randn(gen, bucket, _HEADS, _DIM)
        before = ring.clone()
        padded_pos = torch.zeros(bucket, dtype=torch.int64)
        padded_pos[:tokens] = pos
        batch = [t.to(device) for t in (rows, lens.to(torch.int32), seq_lens, pos)]
        with _SyncErrors(use_graphs):  # the eager part of serving, from device tensors
            extend_token_rows(token_rows, *batch, _WINDOW)
        positions.copy_(padded_pos.to(device))
        q.copy_(new_q.to(device))
        replay()
        eager = before.clone()
        capture_extend_queries(eager, q, token_rows, positions, _WINDOW)
        kept = torch.zeros(bucket, dtype=torch.int64)
        start = 0
        for row, n, end in zip(rows.tolist(), lens.tolist(), seq_lens.tolist()):
            for i in range(start, start + n):
                kept[i] = row if int(pos[i]) >= end - _WINDOW else SCRATCH_ROW
            start += n
        expected = _expected_ring(before.cpu(), new_q, kept, padded_pos, _WINDOW)
        results.append(_real_rows_equal(ring, eager) and _real_rows_equal(ring, expected))
    return {"ok": all(results), "replays": len(results), "bucket": bucket}


def _check_token_rows(device, use_graphs, gen) -> dict:
    """The token-row build recorded for a fixed (requests, tokens) shape and replayed on new
    lengths, rows and positions: legal inside a graph too, not only sync-free."""
    requests, tokens, capacity = 3, 20, 32
    req_rows = torch.zeros(requests, dtype=torch.int64, device=device)
    lens = torch.zeros(requests, dtype=torch.int32, device=device)
    seq_lens = torch.zeros(requests, dtype=torch.int64, device=device)
    positions = torch.zeros(tokens, dtype=torch.int64, device=device)
    out = torch.zeros(capacity, dtype=torch.int64, device=device)
    replay, _graph = _record(
        lambda: extend_token_rows(out, req_rows, lens, seq_lens, positions, _WINDOW),
        device, use_graphs)
    results = []
    for _ in range(3):
        rows, new_lens, new_seq, pos = _extend_batch(gen, requests, tokens, _WINDOW)
        req_rows.copy_(rows.to(device))
        lens.copy_(new_lens.to(torch.int32).to(device))
        seq_lens.copy_(new_seq.to(device))
        positions.copy_(pos.to(device))
        replay()
        eager = torch.full_like(out, -1)
        extend_token_rows(eager, req_rows, lens, seq_lens, positions, _WINDOW)
        results.append(bool(torch.equal(out, eager)))
    return {"ok": all(results), "replays": len(results)}


def _check_offset(device, use_graphs, gen) -> dict:
    bs, bucket = 3, 4
    positions = torch.zeros(bucket, dtype=torch.int64, device=device)
    offsets = torch.zeros(bs, dtype=torch.int64, device=device)
    result = torch.zeros(bucket, dtype=torch.int64, device=device)
    replay, _graph = _record(lambda: result.copy_(offset_positions(positions, offsets)),
                             device, use_graphs)
    results = []
    for _ in range(3):
        host_offsets = torch.randint(0, 1000, (bs,), generator=gen).tolist()
        new_pos = torch.randint(0, 1000, (bucket,), generator=gen)
        with _SyncErrors(use_graphs):  # serving stages the offsets eagerly, per decode step
            staged = stage_host_ints(host_offsets, torch.int64, device)
        offsets.copy_(staged)
        positions.copy_(new_pos.to(device))
        replay()
        expected = new_pos.clone()
        expected[:bs] += torch.tensor(host_offsets)
        results.append(bool(torch.equal(result.cpu(), expected)))
    pinned = pinned_host_ints([1, 2], torch.int64, device).is_pinned() if use_graphs else None
    return {"ok": all(results) and pinned is not False, "replays": len(results),
            "staging_pinned": pinned}
