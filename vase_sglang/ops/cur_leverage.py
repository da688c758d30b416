"""CUR leverage score (CurDKV / VaSE-DKV): ||k_i G||^2 * ||v_i G||^2, normalised over tokens.

G [..., D, r] is a Gaussian projection shared by the KV heads of one (request, layer).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch-only install: the reference works, the kernel is not defined
    triton = None


def cur_leverage_reference(
    keys: torch.Tensor, values: torch.Tensor, projection: torch.Tensor
) -> torch.Tensor:
    """keys, values [..., H, n, D], projection [..., D, r] -> [..., H, n] float32, sums to 1 over n."""
    g = projection.float().unsqueeze(-3)  # broadcast over heads
    k2 = torch.matmul(keys.float(), g).square().sum(dim=-1)
    v2 = torch.matmul(values.float(), g).square().sum(dim=-1)
    score = k2 * v2
    return score / score.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


if triton is not None:
    from .window_attention import _mma, dot_mode

    # Fuses both projections (K G and V G), their squared row norms and the product into one
    # pass over K and V per block of tokens; the two [n, r] projections never reach memory. The
    # projections run on tensor cores (as window attention's q . k; see _mma there), over the
    # head dim in chunks of BLOCK_D:
    #   bf16 / fp16 K and V (SPLIT)  go to the MMA in their own dtype; G (fp32, as the policies
    #       draw it) is split in the kernel into G_hi = G rounded to K's dtype and G_lo = the
    #       remainder rounded likewise, and K G = K G_hi + K G_lo (two MMAs, fp32
    #       accumulation). K's values are exact in that dtype and |G - G_hi - G_lo| <= 2^-16 |G|
    #       for bf16 (2^-22 for fp16), so K G is the fp32 product to about 2^-16 relative: far
    #       inside the tolerance, where G rounded once to bf16 (2^-9) would not be. (fp16 keys:
    #       G must fit fp16's range, |G| < 65504; the policies' N(0, 1/r) entries do.)
    #   fp32 (or K and V of different dtypes)  fp32 operands with tf32x3, as window attention.
    # Not specialised on the candidate count (vase_sglang/warmup.py); the batch strides of K
    # and V (n H D) are, as window attention's: vectorised loads.
    @triton.jit(do_not_specialize=["n", "sp_b"])
    def _cur_leverage_kernel(
        keys, values, proj, out, h, n, d, r,
        sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, sp_b, sp_d, sp_r,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
        SPLIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    ):
        b = (tl.program_id(0) // h).to(tl.int64)
        head = (tl.program_id(0) % h).to(tl.int64)
        tok = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rr = tl.arange(0, BLOCK_R)
        row = tok[:, None].to(tl.int64)
        k_rows = keys + b * sk_b + head * sk_h + row * sk_n
        v_rows = values + b * sv_b + head * sv_h + row * sv_n
        g_cols = proj + b * sp_b + rr[None, :] * sp_r
        tok_ok = tok[:, None] < n
        kg = tl.zeros([BLOCK_N, BLOCK_R], tl.float32)
        vg = tl.zeros([BLOCK_N, BLOCK_R], tl.float32)
        for d0 in range(0, d, BLOCK_D):
            dd = d0 + tl.arange(0, BLOCK_D)
            g = tl.load(g_cols + dd[:, None] * sp_d, mask=(dd[:, None] < d) & (rr[None, :] < r),
                        other=0.0).to(tl.float32)
            mask = tok_ok & (dd[None, :] < d)
            kt = tl.load(k_rows + dd[None, :] * sk_d, mask=mask, other=0.0)
            vt = tl.load(v_rows + dd[None, :] * sv_d, mask=mask, other=0.0)
            if SPLIT:
                g_hi = g.to(kt.dtype)
                g_lo = (g - g_hi.to(tl.float32)).to(kt.dtype)
                kg = _mma(kt, g_hi, kg, UPCAST, PRECISION)
                kg = _mma(kt, g_lo, kg, UPCAST, PRECISION)
                vg = _mma(vt, g_hi, vg, UPCAST, PRECISION)
                vg = _mma(vt, g_lo, vg, UPCAST, PRECISION)
            else:
                kg = _mma(kt, g, kg, True, PRECISION)
                vg = _mma(vt, g, vg, True, PRECISION)
        score = tl.sum(kg * kg, axis=1) * tl.sum(vg * vg, axis=1)
        tl.store(out + (b * h + head) * n + tok, score, mask=tok < n)


# Tile sizes by the width of the MMA operands (2 bytes: bf16 / fp16 K and V, else 4); chosen so
# that the kernel does not spill at D 64 / 128 / 256 on sm_80 / 90 / 100 (vase_sglang.ops.aot
# --strict; docs/gpu.md). maxnreg (PTX .maxnreg): without it ptxas picks a register target of
# its own (128 or 168 for 128 threads) and spilled a few values in the fp32 kernel on sm_100;
# with it, it takes the registers it needs (<= 168 here).
TILES = {
    2: dict(BLOCK_N=64, BLOCK_D=64, num_warps=4, num_stages=3),
    4: dict(BLOCK_N=64, BLOCK_D=16, num_warps=4, num_stages=2, maxnreg=255),
}


def cur_leverage_triton(
    keys: torch.Tensor, values: torch.Tensor, projection: torch.Tensor
) -> torch.Tensor:
    """Same contract as cur_leverage_reference (projection broadcasts over keys' leading dims)."""
    *batch, h, n, d = keys.shape
    rank = projection.shape[-1]
    k = keys.reshape(-1, h, n, d)
    v = values.reshape(-1, h, n, d)
    g = projection.expand(*batch, d, rank).reshape(-1, d, rank)
    score = torch.empty(k.shape[0], h, n, dtype=torch.float32, device=keys.device)
    if score.numel() > 0 and keys.device.type != "meta":  # meta: memory planning, no launch
        split = k.dtype == v.dtype and k.dtype in (torch.bfloat16, torch.float16)
        upcast, precision = dot_mode(k.dtype, v.dtype)
        tile = dict(TILES[2 if split else 4])
        tile["BLOCK_D"] = min(tile["BLOCK_D"], max(16, triton.next_power_of_2(d)))
        _cur_leverage_kernel[(k.shape[0] * h, triton.cdiv(n, tile["BLOCK_N"]))](
            k, v, g, score, h, n, d, rank, *k.stride(), *v.stride(), *g.stride(),
            BLOCK_R=max(16, triton.next_power_of_2(rank)), SPLIT=split, UPCAST=upcast,
            PRECISION=precision, **tile,
        )
    score = score.reshape(*batch, h, n)
    return score / score.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
