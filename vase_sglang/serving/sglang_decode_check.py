"""The GPU check's `sglang_decode` section: SGLang's own Triton decode attention reading what the
plugin leaves in the KV pool, on the device (and in Triton's interpreter for the CPU self-test).

SGLang is not installed on the GPU image: its kernels come from the exported module
vase_sglang.serving.sglang_decode_attention (SGLang 0.5.23's decode_attention_fwd, grouped and
MHA stage 1 and stage 2, verbatim; vase_sglang.serving.sglang_decode_export). Two checks:

  eviction_row   a pool and requests' rows as an eviction step leaves them: the kept K/V moved
                 per (layer, KV head) into the first K candidate slots (compact_kv_triton_), the
                 newest R moved after them (vase_sglang.rows.rewrite_row: the row rewritten at
                 page size 1, their K/V copied when pages do not line up), the freed slots
                 overwritten with NaN (a read of one shows), plus a request not evicted in the
                 same batch. SGLang's decode_attention_fwd over kv_indptr / kv_indices built from
                 the rewritten rows and the shrunk lengths, every layer, against an fp64 softmax
                 over each head's own kept tokens (prefix + kept + newest, read before the step);
                 and the total log-sum-exp from its per-split ones (split_lse).
  global_merge   the global budget scope: SGLang's decode over each request's plain tokens
                 (prefix + newest; the older slots hold cells of any layer and head), its total
                 log-sum-exp (split_lse over the splits that hold keys; the others hold NaN),
                 merged (merge_attention) with cell_attention_triton over the cells each
                 (layer, head) owns, against an fp64 softmax over plain + owned cells.

Tolerances (`tolerance`): the reference reads the same stored (dtype-rounded) q, K and V, so
what differs is the kernels' arithmetic. In the interpreter every product and sum is fp32:
1e-5. On a GPU (GPU_TOL, per stage-1 kernel and dtype; `emulate` models the arithmetic in torch
and tests/test_gpu_check.py requires its error at these shapes to stay within half of each):
  grouped  q·K on the tensor cores (16-bit products exact in fp32; fp32 K/V in tf32), the
           weights p rounded to the K/V dtype for P·V (`tl.dot(p.to(v.dtype), v)`; tf32 for
           fp32), the output stored in q's dtype: with u = 2^-9 (bf16), 2^-11 (fp16, tf32)
           each rounding is at most u · max|v| and u · |out|, so out within atol 2u · max|v|,
           rtol 2u; log-sum-exp 5e-4 (fp32 sums), 5e-3 with tf32 logits (emulated 6.7e-4);
  normal   (MHA) each product q_i k_i rounded to the dtype before an fp32 sum
           (`tl.sum((q * k).to(tl.float32))`), p and P·V in fp32: logits off by up to
           2^-9 · sum |q_i k_i| · scaling (bf16; 0.04 at D 128): bf16 out 2^-7 · max|v|, rtol
           2^-8, log-sum-exp 2e-2 (emulated 7.5e-3 and 4e-3), fp16 2^-9, 2^-10, 2.5e-3; fp32
           (fp32 products) 1e-4, 1e-5, 1e-4.
A merged output adds lse_atol / 2 · max|v| (a part's log-sum-exp off by d moves its weight by at
most d / 4, between outputs at most 2 max|v| apart).
"""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass

import torch

# SGLang's max_kv_splits: --triton-attention-num-kv-splits, 8 by default (16 on AMD)
MAX_KV_SPLITS = 8
Q_SCALE = 2.0  # queries N(0, 4): logits of std 2 at scaling D^-1/2, attention far from flat
INTERPRETER_TOL = 1e-5


@dataclass(frozen=True)
class RowCase:
    """Requests evicted in one step (one prefix each; n candidates, K kept, R newest), and
    optionally one request of `bystander` tokens that was not; `splits` per request (evicted
    ones first), as SGLang's num_kv_splits, and `max_splits` (its max_kv_splits)."""

    q_heads: int
    kv_heads: int
    head_dim: int
    layers: int
    prefixes: tuple[int, ...]
    candidates: int
    kept: int
    window: int
    bystander: int
    splits: tuple[int, ...]
    page_size: int = 1
    max_splits: int = MAX_KV_SPLITS

    @property
    def kernel(self) -> str:
        return _stage1(self.q_heads, self.kv_heads)


@dataclass(frozen=True)
class MergeCase:
    """Requests under the global scope: each row [prefix | K older slots (cells) | newest R]."""

    q_heads: int
    kv_heads: int
    head_dim: int
    layers: int
    prefixes: tuple[int, ...]
    older: int
    window: int
    splits: tuple[int, ...]
    max_splits: int = MAX_KV_SPLITS

    @property
    def kernel(self) -> str:
        return _stage1(self.q_heads, self.kv_heads)


# Qwen3-4B's attention (32 / 8 heads, D 128) at T = 1024; the quick (interpreter) cases are tiny.
FULL_ROWS = (
    RowCase(32, 8, 128, 2, (0, 48, 128), 1024, 512, 64, 777, (8, 4, 2, 1)),
    RowCase(32, 8, 128, 2, (0, 48, 128), 1024, 500, 64, 777, (8, 4, 2, 1), page_size=16),
    RowCase(8, 8, 128, 2, (0, 48, 128), 1024, 512, 64, 777, (8, 4, 2, 1)),
)
FULL_MERGES = (
    MergeCase(32, 8, 128, 4, (128, 0, 37), 256, 64, (8, 1, 3)),
    MergeCase(8, 8, 128, 4, (128, 0, 37), 256, 64, (8, 1, 3)),
)
FULL_DTYPES = ("bfloat16", "float16", "float32")
QUICK_ROWS = (
    RowCase(4, 2, 32, 2, (0, 8), 40, 20, 8, 30, (4, 2, 1), max_splits=4),
    RowCase(4, 2, 32, 1, (0, 8), 40, 18, 8, 30, (4, 2, 1), page_size=4, max_splits=4),
    RowCase(2, 2, 32, 1, (0, 8), 40, 20, 8, 30, (4, 2, 1), max_splits=4),
)
QUICK_MERGES = (
    MergeCase(4, 2, 32, 2, (5, 0), 6, 4, (4, 1), max_splits=4),
    MergeCase(2, 2, 32, 1, (5, 0), 6, 4, (4, 1), max_splits=4),
)
QUICK_DTYPES = ("float32",)


# (stage-1 kernel, dtype) -> (out atol per max|v|, out rtol, log-sum-exp atol) on a GPU
GPU_TOL = {
    ("grouped", torch.bfloat16): (2.0 ** -8, 2.0 ** -8, 5e-4),
    ("grouped", torch.float16): (2.0 ** -10, 2.0 ** -10, 5e-4),
    ("grouped", torch.float32): (2.0 ** -10, 2.0 ** -10, 5e-3),
    ("normal", torch.bfloat16): (2.0 ** -7, 2.0 ** -8, 2e-2),
    ("normal", torch.float16): (2.0 ** -9, 2.0 ** -10, 2.5e-3),
    ("normal", torch.float32): (1e-4, 1e-5, 1e-4),
}
_WHY = {"grouped": {torch.bfloat16: "p and out rounded to bf16", torch.float16:
                    "p and out rounded to fp16", torch.float32: "tf32 q.K and p.V dots"},
        "normal": {torch.bfloat16: "q_i k_i products rounded to bf16", torch.float16:
                   "q_i k_i products rounded to fp16", torch.float32: "fp32 products and sums"}}


def _stage1(q_heads: int, kv_heads: int) -> str:
    return "normal" if q_heads == kv_heads else "grouped"


def tolerance(dtype, device, kernel: str = "grouped") -> dict:
    """{"out_atol_per_vmax", "out_rtol", "lse_atol", "why"} for SGLang's decode (stage-1
    `kernel` "grouped" or "normal") against the fp64 reference (module doc)."""
    if torch.device(device).type != "cuda":
        return {"out_atol_per_vmax": INTERPRETER_TOL, "out_rtol": INTERPRETER_TOL,
                "lse_atol": INTERPRETER_TOL, "why": "interpreter: fp32 products and sums"}
    out_atol, out_rtol, lse_atol = GPU_TOL[(kernel, dtype)]
    return {"out_atol_per_vmax": out_atol, "out_rtol": out_rtol, "lse_atol": lse_atol,
            "why": _WHY[kernel][dtype]}


def _tf32(x):
    """x rounded to tf32 (10 mantissa bits, to nearest), as Triton's tf32 dots take fp32."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def emulate(kernel: str, q, keys, values, scaling: float):
    """SGLang's decode arithmetic on a GPU, modelled in torch (fp64 otherwise): q [H_q, D],
    keys / values [H, N, D] in the cache dtype -> (out [H_q, D] in q's dtype, lse [H_q]).
    grouped: exact 16-bit products (tf32 operands for fp32), p rounded to the dtype (tf32)
    for P·V; normal: each q_i k_i rounded to the dtype, p in fp32. The splits' fp32 merge and
    the order of fp32 sums are not modelled (~N · 2^-24)."""
    group = q.shape[0] // keys.shape[0]
    k = keys.repeat_interleave(group, 0)
    v = values.repeat_interleave(group, 0)
    fp32 = keys.dtype == torch.float32
    if kernel == "grouped":
        qq, kk = (_tf32(q), _tf32(k)) if fp32 else (q, k)
        logits = torch.einsum("qd,qnd->qn", qq.double(), kk.double()) * scaling
    else:
        logits = (q[:, None, :] * k).double().sum(-1) * scaling  # products in the dtype
    logits = logits.float().double()
    top = logits.max(-1, keepdim=True).values
    p = torch.exp(logits - top)
    if kernel == "grouped":
        rounded = (_tf32(p) if fp32 else p.to(keys.dtype)).double()
        vv = _tf32(v).double() if fp32 else v.double()
    else:
        rounded, vv = p, v.double()
    out = torch.einsum("qn,qnd->qd", rounded, vv) / p.sum(-1, keepdim=True)
    return out.to(q.dtype), (top[..., 0] + p.sum(-1).log())


def _num(x: float):
    return x if math.isfinite(x) else str(x)


def _within(actual, expected, atol: float, rtol: float) -> tuple[bool, float, float]:
    """(every entry finite and |a - e| <= atol + rtol |e|, max |a - e|, max of |a - e| over
    the allowance); NaN counts as out of tolerance."""
    a, e = actual.double(), expected.double()
    both_inf = torch.isinf(a) & torch.isinf(e) & (a == e)  # -inf log-sum-exps of empty parts
    diff = torch.where(both_inf, 0.0, (a - e).abs())
    diff = torch.where(torch.isnan(diff), float("inf"), diff)
    ratio = diff / (atol + rtol * e.abs().nan_to_num(posinf=0.0, neginf=0.0))
    worst = float(diff.max()) if diff.numel() else 0.0
    over = float(ratio.max()) if ratio.numel() else 0.0
    return over <= 1.0, worst, over


def _pages(lengths, page_size: int, gen, device):
    """Rows of whole pages taken in random order from a pool whose page 0 is never handed out
    (SGLang's padding slot 0): (rows [list of int64 slot tensors], number of slots)."""
    counts = [-(-n // page_size) for n in lengths]
    order = torch.randperm(sum(counts), generator=gen, device="cpu") + 1
    rows, at = [], 0
    within = torch.arange(page_size)
    for n, c in zip(lengths, counts):
        pages = order[at: at + c]
        at += c
        rows.append((pages[:, None] * page_size + within).flatten()[:n].to(device))
    return rows, (sum(counts) + 1) * page_size


def _randn(shape, dtype, device, gen):
    return torch.randn(shape, generator=gen, device="cpu").to(device=device, dtype=dtype)


def _attend(q, keys, values, scaling: float):
    """fp64 softmax attention of one request: q [H_q, D], keys / values [H, N, D] (the
    tokens each KV head reads) -> out [H_q, D], lse [H_q]."""
    group = q.shape[0] // keys.shape[0]
    k = keys.double().repeat_interleave(group, 0)
    v = values.double().repeat_interleave(group, 0)
    logits = torch.einsum("qd,qnd->qn", q.double(), k) * scaling
    return torch.einsum("qn,qnd->qd", torch.softmax(logits, -1), v), torch.logsumexp(logits, -1)


def _decode(q, k_buf, v_buf, lengths, rows, splits, page_size: int, max_splits: int):
    """SGLang's decode_attention_fwd over the rows' first `lengths` slots: (o, attn_lse,
    kv_indptr, num_kv_splits). The split buffers start as NaN, so an entry a split did not
    write stays NaN."""
    from .sglang_decode_attention import decode_attention_fwd

    device, b = q.device, q.shape[0]
    indptr = torch.zeros(b + 1, dtype=torch.int32, device=device)
    indptr[1:] = torch.tensor(lengths, device=device).cumsum(0)
    indices = torch.cat([r[:n] for r, n in zip(rows, lengths)]).to(torch.int32)
    num_splits = torch.tensor(splits, dtype=torch.int32, device=device)
    h_q, dv = q.shape[1], v_buf.shape[-1]
    o = torch.full((b, h_q, dv), float("nan"), dtype=q.dtype, device=device)
    logits = torch.full((b, h_q, max_splits, dv), float("nan"), device=device)
    lse = torch.full((b, h_q, max_splits), float("nan"), device=device)
    decode_attention_fwd(q, k_buf, v_buf, o, indptr, indices, logits, lse, num_splits,
                         max_splits, q.shape[-1] ** -0.5, 1.0, 1.0, page_size=page_size)
    return o, lse, indptr, num_splits


def _total_lse(lse, indptr, num_splits, fault):
    from vase_sglang.ops.cell_attention import split_lse

    from .sglang_decode_attention import _MIN_BLOCK_KV

    if fault == "all_splits":  # wrong on purpose: the splits that hold no key included
        return torch.logsumexp(lse, dim=-1)
    return split_lse(lse, indptr, num_splits, _MIN_BLOCK_KV)


def eviction_row(case: RowCase, dtype, device, seed: int = 0, fault: str | None = None) -> dict:
    """The eviction_row check of one case (module doc). `fault` (tests only) breaks it on
    purpose: "uncompacted_length" reads the rows at their length before the step,
    "no_compaction" skips the per-head move of the kept K/V, "all_splits" takes the
    log-sum-exp over every split."""
    from vase_sglang.ops.compact import compact_kv_triton_
    from vase_sglang.rows import rewrite_row

    c, ps = case, case.page_size
    gen = torch.Generator().manual_seed(seed)
    evicted = len(c.prefixes)
    if any(p % ps for p in c.prefixes):
        raise ValueError(f"prefixes {c.prefixes} must be whole pages of {ps}")
    before = [p + c.candidates + c.window for p in c.prefixes] + ([c.bystander] if c.bystander
                                                                  else [])
    rows, num_slots = _pages(before, ps, gen, device)
    shape = (num_slots, c.kv_heads, c.head_dim)
    k_bufs = [_randn(shape, dtype, device, gen) for _ in range(c.layers)]
    v_bufs = [_randn(shape, dtype, device, gen) for _ in range(c.layers)]
    for t in k_bufs + v_bufs:
        t[:ps] = float("nan")  # the padding page: never read
    original_k = [t.clone() for t in k_bufs]
    original_v = [t.clone() for t in v_bufs]
    q = (Q_SCALE * torch.randn((len(before), c.q_heads, c.head_dim), generator=gen)).to(
        device=device, dtype=dtype)
    # the step: each (request, layer, head) keeps its own K of the n candidates (ascending)
    scores = torch.rand((evicted, c.layers, c.kv_heads, c.candidates), generator=gen)
    keep = scores.topk(c.kept, dim=-1).indices.sort(dim=-1).values.to(device)
    candidates = torch.stack([r[p: p + c.candidates] for r, p in zip(rows, c.prefixes)])
    if fault != "no_compaction":
        compact_kv_triton_(k_bufs, v_bufs, candidates, keep)
    rw = rewrite_row(0, c.candidates, c.kept, c.window, ps)
    after_rows = [r.clone() for r in rows]
    freed = []
    j = torch.arange(c.window, device=device)
    if not rw.move_row:  # pages do not line up: the newest R's K/V copied after the kept
        shift = (rw.src - rw.dst + j).expand(evicted, c.layers, c.kv_heads, c.window)
        tails = torch.stack([r[p + rw.dst: p + c.candidates + c.window]
                             for r, p in zip(rows, c.prefixes)])
        compact_kv_triton_(k_bufs, v_bufs, tails, shift)
    for b, p in enumerate(c.prefixes):
        if rw.move_row:
            after_rows[b][p + rw.dst + j] = rows[b][p + rw.src + j]
        freed.append(rows[b][p + rw.free_start: p + rw.free_stop])
    freed = torch.cat(freed)
    for t in k_bufs + v_bufs:
        t[freed] = float("nan")  # given back: another request may write them now
    after = [p + rw.new_length for p in c.prefixes] + before[evicted:]
    read = before if fault == "uncompacted_length" else after

    tol = tolerance(dtype, device, case.kernel)
    worst = {"out": 0.0, "out_over": 0.0, "lse": 0.0, "lse_over": 0.0}
    ok = True
    scaling = c.head_dim ** -0.5
    heads = torch.arange(c.kv_heads, device=device)
    for layer in range(c.layers):
        o, lse, indptr, num_splits = _decode(q, k_bufs[layer], v_bufs[layer], read, after_rows,
                                             c.splits, ps, c.max_splits)
        total = _total_lse(lse, indptr, num_splits, fault)
        for b in range(len(before)):
            if b < evicted:  # prefix + this head's kept candidates + the newest R
                p = c.prefixes[b]
                kept = candidates[b][keep[b, layer]]  # [H, K]
                plain = torch.cat([rows[b][:p], rows[b][p + c.candidates: before[b]]])
                slots = torch.cat([plain.expand(c.kv_heads, -1)[:, :p], kept,
                                   plain.expand(c.kv_heads, -1)[:, p:]], dim=1)
            else:
                slots = rows[b][: before[b]].expand(c.kv_heads, -1)
            keys = original_k[layer][slots, heads[:, None]]  # [H, N, D]
            values = original_v[layer][slots, heads[:, None]]
            ref_out, ref_lse = _attend(q[b], keys, values, scaling)
            vmax = float(values.abs().max())
            good_o, err_o, over_o = _within(o[b], ref_out, tol["out_atol_per_vmax"] * vmax,
                                            tol["out_rtol"])
            good_l, err_l, over_l = _within(total[b], ref_lse, tol["lse_atol"], 0.0)
            ok &= good_o and good_l
            worst["out"], worst["out_over"] = max(worst["out"], err_o), max(worst["out_over"],
                                                                              over_o)
            worst["lse"], worst["lse_over"] = max(worst["lse"], err_l), max(worst["lse_over"],
                                                                              over_l)
    return {"check": "eviction_row", "kernel": case.kernel, "dtype": _name(dtype),
            "q_heads": c.q_heads, "kv_heads": c.kv_heads, "head_dim": c.head_dim,
            "layers": c.layers, "page_size": ps, "row_rewrite": "row" if rw.move_row else
            "kv copy", "lengths_before": before, "lengths_read": read, "splits": list(c.splits),
            "max_splits": c.max_splits, "freed_slots_nan": int(freed.numel()),
            "max_abs_diff_out": _num(worst["out"]),
            "max_abs_diff_lse": _num(worst["lse"]),
            "worst_fraction_of_tolerance": _num(max(worst["out_over"], worst["lse_over"])),
            "fault": fault, "ok": bool(ok)}


def global_merge(case: MergeCase, dtype, device, seed: int = 0, fault: str | None = None) -> dict:
    """The global_merge check of one case (module doc); `fault` "all_splits" (tests only)."""
    from vase_sglang.cells import CellMap
    from vase_sglang.ops.cell_attention import cell_attention_triton, merge_attention

    c = case
    gen = torch.Generator().manual_seed(seed)
    b_count, h, k_old = len(c.prefixes), c.kv_heads, c.older
    lengths = [p + k_old + c.window for p in c.prefixes]
    rows, num_slots = _pages(lengths, 1, gen, device)
    shape = (num_slots, h, c.head_dim)
    k_bufs = [_randn(shape, dtype, device, gen) for _ in range(c.layers)]
    v_bufs = [_randn(shape, dtype, device, gen) for _ in range(c.layers)]
    for t in k_bufs + v_bufs:
        t[0] = float("nan")
    q = (Q_SCALE * torch.randn((b_count, c.q_heads, c.head_dim), generator=gen)).to(
        device=device, dtype=dtype)
    older = torch.stack([r[p: p + k_old] for r, p in zip(rows, c.prefixes)])  # [B, K]
    plain_rows = [torch.cat([r[:p], r[p + k_old:]]) for r, p in zip(rows, c.prefixes)]
    plain_lengths = [p + c.window for p in c.prefixes]
    # who owns each cell: unequal counts; (layer 0, head 0) of request 0 owns none
    cells = c.layers * k_old * h
    owner = torch.randint(0, c.layers * h, (b_count, c.layers, k_old, h), generator=gen)
    owner[0] = torch.where(owner[0] == 0, 1, owner[0])
    position = torch.stack([torch.randperm(cells, generator=gen).view(c.layers, k_old, h)
                            for _ in range(b_count)])
    segs = [CellMap(o, p, "global").segments() for o, p in zip(owner, position)]
    order = torch.stack([s[0] for s in segs]).to(device)
    offsets = torch.stack([s[1] for s in segs]).to(device)

    tol = tolerance(dtype, device, case.kernel)
    worst = {"out": 0.0, "lse": 0.0, "over": 0.0}
    ok, owned = True, []
    scaling = c.head_dim ** -0.5
    all_k, all_v = torch.stack(k_bufs), torch.stack(v_bufs)  # [L, S, H, D], for the reference
    for layer in range(c.layers):
        o, lse, indptr, num_splits = _decode(q, k_bufs[layer], v_bufs[layer], plain_lengths,
                                             plain_rows, c.splits, 1, c.max_splits)
        plain_lse = _total_lse(lse, indptr, num_splits, fault)
        cell_out, cell_lse = cell_attention_triton(q, k_bufs, v_bufs, older, order, offsets,
                                                   layer, scaling)
        out, total = merge_attention(o, plain_lse, cell_out, cell_lse)
        for b in range(b_count):
            slots = plain_rows[b][: plain_lengths[b]]
            ref_out, ref_lse, vmax = [], [], 0.0
            for head in range(h):
                seg = order[b, offsets[b, layer * h + head]: offsets[b, layer * h + head + 1]]
                owned.append(int(seg.numel()))
                src_layer, j, src_head = seg // (k_old * h), (seg // h) % k_old, seg % h
                src_slot = older[b][j]
                keys = torch.cat([k_bufs[layer][slots, head],
                                  all_k[src_layer, src_slot, src_head]])[None]  # [1, N, D]
                values = torch.cat([v_bufs[layer][slots, head],
                                    all_v[src_layer, src_slot, src_head]])[None]
                group = c.q_heads // h
                r_out, r_lse = _attend(q[b, head * group:(head + 1) * group], keys, values,
                                       scaling)
                ref_out.append(r_out)
                ref_lse.append(r_lse)
                vmax = max(vmax, float(values.abs().max()))
            ref_out, ref_lse = torch.cat(ref_out), torch.cat(ref_lse)
            atol = (tol["out_atol_per_vmax"] + tol["lse_atol"] / 2) * vmax
            good_o, err_o, over_o = _within(out[b], ref_out, atol, tol["out_rtol"])
            good_l, err_l, over_l = _within(total[b], ref_lse, tol["lse_atol"], 0.0)
            ok &= good_o and good_l
            worst["out"], worst["lse"] = max(worst["out"], err_o), max(worst["lse"], err_l)
            worst["over"] = max(worst["over"], over_o, over_l)
    return {"check": "global_merge", "kernel": case.kernel, "dtype": _name(dtype),
            "q_heads": c.q_heads, "kv_heads": h, "head_dim": c.head_dim, "layers": c.layers,
            "plain_lengths": plain_lengths, "older_slots": k_old, "splits": list(c.splits),
            "max_splits": c.max_splits,
            "cells_owned_min_max": [min(owned), max(owned)],
            "max_abs_diff_out": _num(worst["out"]), "max_abs_diff_lse": _num(worst["lse"]),
            "worst_fraction_of_tolerance": _num(worst["over"]), "fault": fault, "ok": bool(ok)}


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def section(device, quick: bool, remaining) -> dict:
    """Every case on `device` (the quick ones: the CPU self-test), while `remaining()` (the
    run's seconds left) allows; a case that would start past it is recorded as skipped."""
    from .sglang_decode_attention import __doc__ as exported_doc

    device = torch.device(device)
    dtypes = QUICK_DTYPES if quick else FULL_DTYPES
    plan = [(fn, case, dtype) for dtype in dtypes
            for fn, cases in ((eviction_row, QUICK_ROWS if quick else FULL_ROWS),
                              (global_merge, QUICK_MERGES if quick else FULL_MERGES))
            for case in cases]
    rows, skipped = [], []
    for fn, case, dtype in plan:
        label = f"{fn.__name__} {case.kernel} {dtype}"
        if remaining() <= 5:
            skipped.append(label)
            continue
        start = time.perf_counter()
        try:
            row = fn(case, getattr(torch, dtype), device)
        except Exception as exc:  # recorded as a failed case; the next one still runs
            row = {"check": fn.__name__, "kernel": case.kernel, "dtype": dtype, "ok": False,
                   "error": repr(exc),
                   "traceback": traceback.format_exc().splitlines()[-12:]}
        row["seconds"] = round(time.perf_counter() - start, 2)
        rows.append(row)
    failed = [f"{r['check']} {r['kernel']} {r['dtype']} page {r.get('page_size', 1)}"
              for r in rows if not r["ok"]]
    source = [line for line in exported_doc.splitlines() if "SGLang 0." in line
              or line.startswith("sha256")]
    return {"status": "failed" if failed else "ok", "failed": failed, "skipped": skipped,
            "kernels": "SGLang's decode_attention_fwd, exported (vase_sglang.serving."
                       "sglang_decode_attention): " + "; ".join(s.strip() for s in source),
            "tolerance": {f"{k} {d}": tolerance(getattr(torch, d), device, k)
                          for d in dtypes for k in ("grouped", "normal")},
            "rows": rows}
