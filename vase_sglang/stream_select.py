"""Scores streamed over chunks of candidates: what a policy needs from n candidates whose K/V
(and score temporaries) do not fit in memory at once.

One (request, layer) unit of an eviction step holds all n candidates of a request: K/V gathers
[n, H, D] and, on the torch path, a [H_q, W, n] softmax. For a long private cache (the first
eviction of a long prompt with the radix cache off, a per-request budget above the server's)
that is more than the step's workspace. The streamed path reads the candidates in chunks of c
tokens and keeps only per-candidate results, full-length [..., H, n] float32 arrays (O(n H)
bytes, about D / 2 times smaller than the K/V), from which `Policy.select_streamed` makes the
same selection as `Policy.select`.

Each policy's streamed score is `Policy.score_streamed` (vase_sglang/policies.py), built from
the parts here:
  value range, CUR leverage   local per candidate (CUR: normalised over n at the end);
  window attention            softmax over ALL candidates per query row: pass 1 accumulates a
                              running max and sum (log-sum-exp) per (q head, window row), pass 2
                              turns each chunk into probabilities with the final lse and
                              averages them over the GQA group and the window; the avg-pool runs
                              on the full [H_kv, n] array at the end;
  rkv's redundancy            pass 1 sums the unit keys over n, pass 2 takes each chunk's
                              cosines to that sum; softmax over n at the end.
Results equal the unstreamed ops up to float summation order (the lse and the key sum are
accumulated chunk by chunk); tests/test_stream_select.py states the tolerance.

`Candidates` is what a streamed score reads: `TensorCandidates` slices tensors already in
memory (engine-free use and tests), the engine's gathers from the KV pool into its workspace
(vase_sglang/chunk.py). A chunk's tensors are valid until the next chunk is read.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from . import ops


class Candidates:
    """n candidate tokens [*batch, H, n, D] read in chunks of `chunk` along n.

    `chunks(keys=..., values=...)` yields (start, stop, keys, values) with keys / values
    [*batch, H, stop - start, D] (None where not asked for), one chunk at a time: every call
    reads the candidates again (a multi-pass score calls it once per pass)."""

    shape: tuple  # (*batch, H, n): the shape of a per-candidate score
    head_dim: int
    device: torch.device
    chunk: int

    @property
    def n(self) -> int:
        return self.shape[-1]

    def spans(self) -> Iterator[tuple[int, int]]:
        for start in range(0, self.n, self.chunk):
            yield start, min(self.n, start + self.chunk)

    def chunks(self, keys: bool = False, values: bool = False):
        raise NotImplementedError


class TensorCandidates(Candidates):
    """Candidates already in memory: keys, values [*batch, H, n, D]; chunks are views."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, chunk: int):
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk: must be an integer >= 1, got {chunk!r}")
        self.keys, self.values, self.chunk = keys, values, chunk
        self.shape = tuple(keys.shape[:-1])
        self.head_dim = keys.shape[-1]
        self.device = keys.device

    def chunks(self, keys: bool = False, values: bool = False):
        for start, stop in self.spans():
            yield (start, stop, self.keys[..., start:stop, :] if keys else None,
                   self.values[..., start:stop, :] if values else None)


def value_range_streamed(candidates: Candidates) -> torch.Tensor:
    """Range(v) = max_d v - min_d v [*batch, H, n] float32 (ops.value_range, chunk by chunk:
    local per candidate, so the same values)."""
    out = torch.empty(candidates.shape, dtype=torch.float32, device=candidates.device)
    for start, stop, _, v in candidates.chunks(values=True):
        out[..., start:stop] = ops.value_range(v)
    return out


def cur_leverage_streamed(candidates: Candidates, projection: torch.Tensor) -> torch.Tensor:
    """||k G||^2 ||v G||^2 normalised over n, as ops.cur_leverage_reference: the raw product per
    chunk (local), the normalisation on the full-length array at the end."""
    g = projection.float().unsqueeze(-3)  # [*batch, 1, D, r]: broadcast over heads
    raw = torch.empty(candidates.shape, dtype=torch.float32, device=candidates.device)
    for start, stop, k, v in candidates.chunks(keys=True, values=True):
        k2 = torch.matmul(k.float(), g).square().sum(dim=-1)
        v2 = torch.matmul(v.float(), g).square().sum(dim=-1)
        raw[..., start:stop] = k2 * v2
        del k2, v2
    return raw / raw.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


def _window_logits(q: torch.Tensor, k: torch.Tensor, *, temperature, scaling, softcap):
    """Logits [*batch, H_kv, G W, c] of a chunk of keys, divided by the temperature: the
    arithmetic of ops.window_attention_reference."""
    d = k.shape[-1]
    qk = torch.matmul(q, k.float().transpose(-1, -2))
    if softcap:
        scale = 1.0 / math.sqrt(d) if scaling is None else scaling
        return softcap * torch.tanh(qk * scale / softcap) / temperature
    return qk / (math.sqrt(d) * temperature if scaling is None else temperature / scaling)


def window_attention_streamed(queries: torch.Tensor, candidates: Candidates, *,
                              temperature: float = 1.0, pool_kernel: int = 5,
                              scaling: float | None = None, softcap: float = 0.0) -> torch.Tensor:
    """ops.window_attention over candidate chunks: queries [*batch, H_q, W, D] ->
    [*batch, H_kv, n] float32. Two passes over the keys: the log-sum-exp of each query row's
    logits over all n candidates, then each chunk's probabilities exp(logit - lse), averaged
    over the GQA group and the window; the avg-pool runs on the full-length result."""
    *batch, h_q, w, d = queries.shape
    h_kv, n = candidates.shape[-2], candidates.shape[-1]
    group = h_q // h_kv
    logit = dict(temperature=temperature, scaling=scaling, softcap=softcap)
    q = queries.float().reshape(*batch, h_kv, group * w, d)
    top = sum_exp = None  # running max and sum of exp(logit - max) per row [*batch, H_kv, G W, 1]
    for _, _, k, _ in candidates.chunks(keys=True):
        x = _window_logits(q, k, **logit)
        chunk_top = x.amax(dim=-1, keepdim=True)
        if top is None:
            top = chunk_top
            sum_exp = (x - top).exp_().sum(dim=-1, keepdim=True)
        else:
            new_top = torch.maximum(top, chunk_top)
            sum_exp = (sum_exp * (top - new_top).exp_()
                       + (x - new_top).exp_().sum(dim=-1, keepdim=True))
            top = new_top
            del new_top
        del x, chunk_top
    lse = top + sum_exp.log_()
    del top, sum_exp
    probs = torch.empty(candidates.shape, dtype=torch.float32, device=candidates.device)
    for start, stop, k, _ in candidates.chunks(keys=True):
        x = _window_logits(q, k, **logit)
        probs[..., start:stop] = x.sub_(lse).exp_().mean(dim=-2)  # mean over group and window
        del x
    if pool_kernel > 1:
        flat = F.avg_pool1d(probs.reshape(-1, 1, n), pool_kernel, stride=1,
                            padding=pool_kernel // 2)
        probs = flat.reshape(*batch, h_kv, n)
    return probs


def mean_cosine_streamed(candidates: Candidates) -> torch.Tensor:
    """mean_cosine_to_others over candidate chunks [*batch, H, n] float32: pass 1 sums
    the unit keys over all n, pass 2 takes each chunk's cosines to that sum."""
    total = None  # [*batch, H, 1, D]
    for _, _, k, _ in candidates.chunks(keys=True):
        part = unit_keys(k).sum(dim=-2, keepdim=True)
        total = part if total is None else total.add_(part)
        del part
    out = torch.empty(candidates.shape, dtype=torch.float32, device=candidates.device)
    for start, stop, k, _ in candidates.chunks(keys=True):
        out[..., start:stop] = cosine_to_others(unit_keys(k), total, candidates.n)
    return out


def mean_cosine_to_others(keys: torch.Tensor) -> torch.Tensor:
    """[..., n, D] -> [..., n] float32: sum over j != i of cos(k_i, k_j), divided by n (the
    mean over a row of the cosine matrix with its diagonal zeroed, as R-KV computes it).

    Without the n x n matrix: with unit rows u (normalize gives 0 for a zero key, whose
    cosines are then 0), sum_{j != i} u_i.u_j = u_i . sum_j u_j - u_i.u_i, in O(n D) memory."""
    unit = unit_keys(keys)
    total = unit.sum(dim=-2, keepdim=True)  # [..., 1, D]
    return cosine_to_others(unit, total, keys.shape[-2])


def unit_keys(keys: torch.Tensor) -> torch.Tensor:
    """[..., n, D] float32 keys scaled to unit norm (a zero key stays zero)."""
    return torch.nn.functional.normalize(keys.float(), dim=-1)


def cosine_to_others(unit: torch.Tensor, total: torch.Tensor, n: int) -> torch.Tensor:
    """mean_cosine_to_others of the unit keys `unit` [..., c, D] (some or all of the n
    candidates), given total [..., 1, D], the sum of all n unit keys."""
    with_self = torch.matmul(unit, total.transpose(-1, -2)).squeeze(-1)
    return (with_self - (unit * unit).sum(dim=-1)) / n
