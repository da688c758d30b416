"""SnapKV-style window-attention score of each candidate key, per KV head.

score[kv, i] = mean_{q in group(kv)} avgpool_i( mean_w softmax_i(logit(q_w, k_i) / tau) )
logit(q, k) = q . k * scaling, then cap * tanh(logit / cap) where the model soft-caps (cap > 0)

`scaling` and `cap` are the layer's own (SGLang's RadixAttention.scaling / logit_cap: e.g. Granite's
attention_multiplier, Gemma-2's query_pre_attn_scalar**-0.5 and 50.0 cap), applied as SGLang's
attention backends do (triton: qk *= sm_scale; qk = cap * tanh(qk / cap)); tau is VaSE's
temperature on top of the model's logits. scaling=None means 1/sqrt(D).

The softmax runs over the candidates only (the newest `window` tokens are not candidates), as in
the official VaSE engine. Pooling is avg_pool1d(kernel, stride 1, padding kernel//2) with zero
padding counted (torch's default), and q head h belongs to KV head h // (H_q / H_kv) (repeat_kv).
Mean over the window, pooling and group mean are all linear, so their order does not matter.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # torch-only install: the reference works, the kernels are not defined
    triton = None


def _check_logit_params(scaling, softcap) -> None:
    if scaling is not None and not (math.isfinite(scaling) and scaling > 0):
        raise ValueError(f"scaling: must be a finite number > 0 or None, got {scaling!r}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap: must be a finite number >= 0 (0 = off), got {softcap!r}")


def window_attention_reference(
    queries: torch.Tensor, keys: torch.Tensor, *, temperature: float = 1.0, pool_kernel: int = 5,
    scaling: float | None = None, softcap: float = 0.0,
) -> torch.Tensor:
    """queries [..., H_q, W, D], keys [..., H_kv, n, D] -> [..., H_kv, n] float32."""
    *batch, h_q, w, d = queries.shape
    h_kv, n = keys.shape[-3], keys.shape[-2]
    _check_logit_params(scaling, softcap)
    group = h_q // h_kv
    q = queries.float().reshape(*batch, h_kv, group * w, d)
    qk = torch.matmul(q, keys.float().transpose(-1, -2))
    if softcap:
        scale = 1.0 / math.sqrt(d) if scaling is None else scaling
        logits = softcap * torch.tanh(qk * scale / softcap) / temperature
    else:  # one division, as before scaling existed: the 1/sqrt(D) scores stay bit-identical
        logits = qk / (math.sqrt(d) * temperature if scaling is None else temperature / scaling)
    probs = torch.softmax(logits, dim=-1).mean(dim=-2)  # mean over group and window: [..., H_kv, n]
    if pool_kernel > 1:
        flat = probs.reshape(-1, 1, n)
        flat = F.avg_pool1d(flat, pool_kernel, stride=1, padding=pool_kernel // 2)
        probs = flat.reshape(*batch, h_kv, n)
    return probs


if triton is not None:

    # The logits' q . k runs on tensor cores (tl.dot: mma / wgmma) with fp32 accumulation,
    # over the head dimension in chunks of BLOCK_D, so no [rows, D] fp32 tile is ever held
    # whole (the fp32 "ieee" dot of the first version did, and spilled thousands of registers):
    #   bf16 / fp16 (the KV cache's dtype; the query ring has the same)  the operands go to the
    #       MMA in their own dtype. A product of two 8- or 11-bit mantissas is exact in fp32,
    #       so the logits differ from the fp32 reference only in the order and rounding of the
    #       fp32 sums, as the first version's did;
    #   fp32 (or two different dtypes)  the operands, in fp32, use input_precision="tf32x3":
    #       each is split into a tf32 high part and a tf32 remainder and three tf32 MMAs are
    #       summed (remainder x remainder dropped), about 21 of fp32's 24 mantissa bits: errors
    #       of the order of fp32 rounding, not plain tf32's 2^-11 (docs/gpu.md says why neither
    #       plain tf32 nor a bf16 downcast).
    # Under TRITON_INTERPRET=1 (the CPU tests) the wrapper sets UPCAST and "ieee": Triton's
    # interpreter cannot multiply bf16 blocks (it stores bf16 as uint16 and multiplies the bit
    # patterns; triton-lang/triton#11584), and ignores input_precision. Upcast first, it
    # computes the exact products the MMA computes, summed in fp32: the CPU suite checks the
    # kernels' indexing, tiling and masking, not the tensor cores' rounding.

    @triton.jit
    def _mma(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """acc + a @ b, fp32 accumulation (see above)."""
        # One dot, its operands cast or not: Triton compiles the statements after an `if`
        # that returns, so a second `return tl.dot(a, b)` would be built for fp8 K too.
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        return tl.dot(a, b, acc, input_precision=PRECISION)

    @triton.jit
    def _qk(q, k, b, kv, r, pos, rows, w, group, n, d, sq_b, sq_h, sq_w, sq_d, sk_b, sk_h, sk_n,
            sk_d, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """q . k, fp32 [BLOCK_M rows r, BLOCK_N keys pos] of KV head kv, summed over the head
        dim in chunks of BLOCK_D. Row r is window query r % w of q head kv * group + r // w
        (the GQA group is contiguous, as in repeat_kv); rows >= `rows` and keys outside
        [0, n) read as zeros."""
        head = (kv * group + r // w).to(tl.int64)
        q_rows = q + b.to(tl.int64) * sq_b + head[:, None] * sq_h + (r % w)[:, None] * sq_w
        k_rows = (k + b.to(tl.int64) * sk_b + kv.to(tl.int64) * sk_h
                  + pos[:, None].to(tl.int64) * sk_n)
        q_ok = r[:, None] < rows
        k_ok = (pos[:, None] >= 0) & (pos[:, None] < n)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for d0 in range(0, d, BLOCK_D):
            dd = d0 + tl.arange(0, BLOCK_D)
            d_ok = dd[None, :] < d
            qt = tl.load(q_rows + dd[None, :] * sq_d, mask=q_ok & d_ok, other=0.0)
            kt = tl.load(k_rows + dd[None, :] * sk_d, mask=k_ok & d_ok, other=0.0)
            acc = _mma(qt, tl.trans(kt), acc, UPCAST, PRECISION)
        return acc

    @triton.jit
    def _tanh(x):
        # tanh as a scaled sigmoid, exactly as SGLang's triton attention kernels soft-cap (fp32).
        return 2 * tl.sigmoid(2 * x) - 1

    @triton.jit
    def _logits_log2(s, qk_scale, softcap, scale_log2, SOFTCAP: tl.constexpr):
        """The model's attention logits of a [rows, keys] tile of q . k, divided by the
        temperature and in base 2 (scale_log2 = log2(e) / tau with a soft-cap, log2(e) *
        scaling / tau without)."""
        if SOFTCAP:
            s = softcap * _tanh(s * qk_scale / softcap)
        return s * scale_log2

    # Pass 1 fuses QK^T with an online softmax over n: it keeps, per window query, a running max
    # and sum instead of materialising the [H_q, W, n] logits; it writes log2-sum-exp2 per row.
    # The candidate count and a per-request window are not specialised on, so one compilation
    # per server serves every step (vase_sglang/warmup.py). The batch strides sq_b = W H_q D
    # and sk_b = n H D still are: their divisibility by 16 lets the loads vectorise (without
    # it ptxas spilled), and it does not change with n or W where H D and H_q D are multiples
    # of 16 (every head dim compiled here).
    @triton.jit(do_not_specialize=["rows", "w", "n"])
    def _window_lse_kernel(
        q, k, lse, rows, w, n, d, group, h_kv, qk_scale, softcap, scale_log2,
        sq_b, sq_h, sq_w, sq_d, sk_b, sk_h, sk_n, sk_d,
        SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0) // h_kv
        kv = tl.program_id(0) % h_kv
        r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        for start in range(0, n, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            s = _qk(q, k, b, kv, r, pos, rows, w, group, n, d, sq_b, sq_h, sq_w, sq_d, sk_b, sk_h,
                    sk_n, sk_d, BLOCK_M, BLOCK_N, BLOCK_D, UPCAST, PRECISION)
            s = _logits_log2(s, qk_scale, softcap, scale_log2, SOFTCAP)
            s = tl.where(pos[None, :] < n, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
            m_i = m_new
        out = lse + (b * h_kv + kv).to(tl.int64) * rows + r
        tl.store(out, m_i + tl.log2(l_i), mask=r < rows)

    # Pass 2 fuses the softmax, the mean over GQA group and window, and the avg-pool: each
    # program recomputes the probabilities of a block of keys plus a halo of HALF keys per side
    # (zero outside [0, n), which is the pool's zero padding), then pools them with a banded
    # [BLOCK_N, BLOCK_N] matrix and writes only the interior, so no [H_q, W, n] tensor exists.
    @triton.jit(do_not_specialize=["rows", "w", "n"])
    def _window_score_kernel(
        q, k, lse, out, rows, w, n, d, group, h_kv, qk_scale, softcap, scale_log2,
        sq_b, sq_h, sq_w, sq_d, sk_b, sk_h, sk_n, sk_d,
        SOFTCAP: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0) // h_kv
        kv = tl.program_id(0) % h_kv
        i = tl.arange(0, BLOCK_N)
        pos = tl.program_id(1) * (BLOCK_N - 2 * HALF) - HALF + i
        in_range = (pos >= 0) & (pos < n)
        row_lse = lse + (b * h_kv + kv).to(tl.int64) * rows
        raw = tl.zeros([BLOCK_N], tl.float32)
        for m0 in range(0, rows, BLOCK_M):
            r = m0 + tl.arange(0, BLOCK_M)
            s = _qk(q, k, b, kv, r, pos, rows, w, group, n, d, sq_b, sq_h, sq_w, sq_d, sk_b, sk_h,
                    sk_n, sk_d, BLOCK_M, BLOCK_N, BLOCK_D, UPCAST, PRECISION)
            s = _logits_log2(s, qk_scale, softcap, scale_log2, SOFTCAP)
            row_ok = r < rows
            l_r = tl.load(row_lse + r, mask=row_ok, other=0.0)
            p = tl.where(row_ok[:, None] & in_range[None, :], tl.exp2(s - l_r[:, None]), 0.0)
            raw += tl.sum(p, axis=0)
        raw = raw / rows
        band = tl.abs(i[:, None] - i[None, :]) <= HALF
        pooled = tl.sum(tl.where(band, raw[None, :], 0.0), axis=1) / (2 * HALF + 1)
        interior = (i >= HALF) & (i < BLOCK_N - HALF) & in_range
        tl.store(out + (b * h_kv + kv).to(tl.int64) * n + pos, pooled, mask=interior)


def interpreted() -> bool:
    """Whether this process's kernels run in Triton's interpreter (TRITON_INTERPRET=1 when
    they were defined): then the dots are computed in fp32 (see the kernels' comment)."""
    return triton is not None and not isinstance(_window_lse_kernel, triton.runtime.jit.JITFunction)


def dot_mode(*dtypes: torch.dtype, interpreter: bool | None = None) -> tuple[bool, str]:
    """(UPCAST, PRECISION) of the kernels' tl.dot for operands of these dtypes: bf16 / fp16
    (all the same) go to the tensor cores as they are; fp32 or mixed are upcast to fp32 and
    use tf32x3; in the interpreter (default: whether this process's kernels are interpreted)
    everything is upcast, "ieee" (which it computes anyway)."""
    if interpreted() if interpreter is None else interpreter:
        return True, "ieee"
    if len(set(dtypes)) == 1 and dtypes[0] in (torch.bfloat16, torch.float16):
        return False, "tf32"  # ignored for 16-bit operands
    return True, "tf32x3"


# Tile sizes: BLOCK_M window-query rows x BLOCK_N keys per dot, over BLOCK_D of the head dim at
# a time, per operand width; chosen so that no kernel spills at D 64 / 128 / 256 on sm_80 / 90 /
# 100 in bf16, fp16 and fp32, soft-capped or not (vase_sglang.ops.aot --strict; docs/gpu.md).
# maxnreg (PTX .maxnreg): without it ptxas picks a register target of its own (128 or 168 for
# 128 threads) and spilled 2-10 instructions in a few of these 108 specialisations; with it,
# it takes the registers it needs (at most 205 here, none spilled).
TILES = {
    2: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=64, num_warps=4, num_stages=3, maxnreg=255),
    4: dict(BLOCK_M=32, BLOCK_N=64, BLOCK_D=16, num_warps=4, num_stages=2, maxnreg=255),
}


def tiles(dtypes, d: int) -> dict:
    """The launch's tile sizes, by the width of the operands the GPU's dot takes: 2 bytes for
    bf16 / fp16 (all the same), else 4 (the interpreter takes the same tiles as the GPU)."""
    t = dict(TILES[2 if len(set(dtypes)) == 1 and dtypes[0].itemsize == 2 else 4])
    t["BLOCK_D"] = min(t["BLOCK_D"], max(16, triton.next_power_of_2(d)))
    return t


def window_attention_triton(
    queries: torch.Tensor, keys: torch.Tensor, *, temperature: float = 1.0, pool_kernel: int = 5,
    scaling: float | None = None, softcap: float = 0.0,
) -> torch.Tensor:
    """Same contract as window_attention_reference (pool_kernel odd, >= 1)."""
    *batch, h_q, w, d = queries.shape
    h_kv, n = keys.shape[-3], keys.shape[-2]
    if h_q % h_kv or pool_kernel < 1 or pool_kernel % 2 == 0:
        raise ValueError(f"need H_q % H_kv == 0, odd pool_kernel: {h_q}, {h_kv}, {pool_kernel}")
    _check_logit_params(scaling, softcap)
    q = queries.reshape(-1, h_q, w, d)
    k = keys.reshape(-1, h_kv, n, d)
    bt, rows = q.shape[0], (h_q // h_kv) * w
    out = torch.empty(bt, h_kv, n, dtype=torch.float32, device=keys.device)
    if out.numel() == 0:
        return out.reshape(*batch, h_kv, n)
    lse = torch.empty(bt, h_kv, rows, dtype=torch.float32, device=keys.device)
    if keys.device.type == "meta":
        return out.reshape(*batch, h_kv, n)  # memory planning: the same allocations, no launch
    half = pool_kernel // 2
    upcast, precision = dot_mode(q.dtype, k.dtype)
    tile = tiles((q.dtype, k.dtype), d)
    tile["BLOCK_N"] = block_n = max(tile["BLOCK_N"], triton.next_power_of_2(4 * half))
    block_m = tile["BLOCK_M"]
    qk_scale = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    if softcap:
        scale_log2 = math.log2(math.e) / temperature
    elif scaling is None:
        scale_log2 = math.log2(math.e) / (math.sqrt(d) * temperature)
    else:
        scale_log2 = math.log2(math.e) * scaling / temperature
    common = (
        rows, w, n, d, h_q // h_kv, h_kv, qk_scale, float(softcap), scale_log2,
        *q.stride(), *k.stride(),
    )
    _window_lse_kernel[(bt * h_kv, triton.cdiv(rows, block_m))](
        q, k, lse, *common, SOFTCAP=bool(softcap), UPCAST=upcast, PRECISION=precision,
        **tile,
    )
    _window_score_kernel[(bt * h_kv, triton.cdiv(n, block_n - 2 * half))](
        q, k, lse, out, *common, SOFTCAP=bool(softcap), HALF=half, UPCAST=upcast,
        PRECISION=precision, **tile,
    )
    return out.reshape(*batch, h_kv, n)
