"""Triton kernels against their torch references, run on CPU under the Triton interpreter.

What the interpreter can and cannot show. On a GPU the scoring kernels' dots run on tensor
cores: bf16 / fp16 operands as they are, fp32 through tf32x3, fp32 accumulation (docs/gpu.md).
Triton's interpreter cannot multiply bf16 blocks (it stores bf16 as uint16 and multiplies the bit
patterns: test_the_interpreter_cannot_multiply_bf16_blocks) and ignores input_precision, so
under it the kernels upcast their operands and sum in fp32 (`dot_mode`). Upcasting a bf16 or
fp16 operand is exact, and so is a product of two of them in fp32, so the interpreter computes
the very products the MMA does: the tests below check the kernels' indexing, head-dim tiling,
masking, the split of CUR's projection into two 16-bit halves, and everything after the dot. They
cannot show the MMA's own accumulation order and rounding, nor tf32x3's rounding: those are
modelled in torch (test_tensor_core_arithmetic_*, by rewriting the operands: tf32x3 as a dot of
concatenated high / remainder parts, the projection as its two halves) and measured on a GPU by
vase_sglang.serving.gpu_check, at its GPU tolerance.

Tolerances here: value_range and compaction must be bit-exact (max/min and a copy round nothing);
window-attention and CUR scores use rtol 1e-4, atol 1e-6 (scores are probabilities of order 1/n;
in the interpreter the kernels only reorder fp32 sums and fold the 1/sqrt(D) scale into an
exp2). Selections downstream: select_tokens with VASE_KERNELS=triton and =torch must share at
least gpu_check.KEPT_AGREEMENT of each row's kept tokens, every difference a near tie
(test_selections_*).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton / vase_sglang are imported

import pytest  # noqa: E402
import torch  # noqa: E402

import vase_sglang.ops as ops  # noqa: E402
from vase_sglang import EvictionConfig, gpu_check  # noqa: E402
from vase_sglang.ops.compact import compact_kv_reference_, compact_kv_triton_  # noqa: E402
from vase_sglang.ops.cur_leverage import cur_leverage_reference, cur_leverage_triton  # noqa: E402
from vase_sglang.ops.value_range import value_range_reference, value_range_triton  # noqa: E402
from vase_sglang.ops.window_attention import (  # noqa: E402
    dot_mode,
    interpreted,
    window_attention_reference,
    window_attention_triton,
)

torch.set_num_threads(1)
SCORE_TOL = dict(rtol=1e-4, atol=1e-6)
DTYPES = [torch.float32, torch.bfloat16]
# --kv-cache-dtype fp8_e4m3 / fp8_e5m2: K/V in 8 bits, the window queries in the model's dtype.
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _q_dtype(dtype):
    return torch.bfloat16 if dtype in FP8 else dtype


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


# ---------------------------------------------------------------- value range


@pytest.mark.parametrize("dtype", DTYPES + FP8)
@pytest.mark.parametrize(
    "batch,h,n,d", [((2, 3), 2, 37, 64), ((), 4, 131, 128), ((2,), 1, 5, 100)]
)
def test_value_range_matches_reference(dtype, batch, h, n, d):
    v = _randn(*batch, h, n, d, dtype=dtype, seed=n + d)
    out = value_range_triton(v)
    assert out.dtype == torch.float32 and out.shape == (*batch, h, n)
    torch.testing.assert_close(out, value_range_reference(v), rtol=0, atol=0)


@pytest.mark.parametrize("shift", [-10.0, 10.0])
def test_value_range_one_signed_values_with_padded_head_dim(shift):
    v = _randn(2, 3, 37, 100, seed=1) + shift  # D=100 is padded to 128 inside the kernel
    torch.testing.assert_close(value_range_triton(v), value_range_reference(v), rtol=0, atol=0)


def test_value_range_strided_input():
    v = _randn(3, 2, 40, 128)[:, :, 1:38, ::2]  # non-contiguous along n and D
    torch.testing.assert_close(value_range_triton(v), value_range_reference(v), rtol=0, atol=0)


# ---------------------------------------------------------------- window attention


@pytest.mark.parametrize("dtype", DTYPES + FP8)
@pytest.mark.parametrize("group", [1, 2, 7])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n,batch", [(37, (2, 3)), (131, (2,))])
def test_window_attention_matches_reference(dtype, group, d, n, batch):
    h_kv, w = 2, 8
    q = _randn(*batch, h_kv * group, w, d, dtype=_q_dtype(dtype), seed=1, scale=2.0)
    k = _randn(*batch, h_kv, n, d, dtype=dtype, seed=2, scale=2.0)
    out = window_attention_triton(q, k, temperature=0.7, pool_kernel=5)
    ref = window_attention_reference(q, k, temperature=0.7, pool_kernel=5)
    assert out.dtype == torch.float32 and out.shape == (*batch, h_kv, n)
    torch.testing.assert_close(out, ref, **SCORE_TOL)


@pytest.mark.parametrize("pool_kernel", [1, 3, 7])
@pytest.mark.parametrize("n", [2, 61, 150])  # 2: the pool window is wider than the input
def test_window_attention_pool_kernels(pool_kernel, n):
    q = _randn(1, 4, 5, 64, seed=3, scale=3.0)
    k = _randn(1, 2, n, 64, seed=4, scale=3.0)
    torch.testing.assert_close(
        window_attention_triton(q, k, pool_kernel=pool_kernel),
        window_attention_reference(q, k, pool_kernel=pool_kernel),
        **SCORE_TOL,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_attention_odd_head_dim_and_strided_keys(dtype):
    q = _randn(2, 6, 4, 80, dtype=dtype, seed=5)
    k = _randn(2, 3, 50, 80, dtype=dtype, seed=6)[:, :, 3:40]  # non-contiguous keys
    torch.testing.assert_close(
        window_attention_triton(q, k, temperature=1.3, pool_kernel=5),
        window_attention_reference(q, k, temperature=1.3, pool_kernel=5),
        **SCORE_TOL,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "scaling,softcap",
    [(0.5, 0.0), (0.02, 0.0), (None, 5.0), (0.25, 2.0), (1.0 / 16, 50.0)],  # 50: Gemma-2's cap
)
def test_window_attention_model_scaling_and_softcap(dtype, scaling, softcap):
    # Large logits (scale 4, scaling 0.5) so the tanh cap actually bends them.
    q = _randn(2, 6, 8, 64, dtype=dtype, seed=13, scale=4.0)
    k = _randn(2, 3, 61, 64, dtype=dtype, seed=14, scale=4.0)
    kwargs = dict(temperature=0.8, pool_kernel=5, scaling=scaling, softcap=softcap)
    out = window_attention_triton(q, k, **kwargs)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, window_attention_reference(q, k, **kwargs), **SCORE_TOL)


def test_window_attention_reference_follows_the_models_logits():
    # The score with a model's scaling / cap is the one of 1/sqrt(D) scores on rescaled
    # queries: q * scaling * sqrt(D) (no cap), and a cap changes it (tanh bends large logits).
    q = _randn(1, 4, 6, 32, seed=15, scale=3.0)
    k = _randn(1, 2, 40, 32, seed=16, scale=3.0)
    scaled = window_attention_reference(q, k, scaling=0.3)
    torch.testing.assert_close(scaled, window_attention_reference(q * (0.3 * 32**0.5), k), **SCORE_TOL)
    assert not torch.allclose(scaled, window_attention_reference(q, k), rtol=1e-2, atol=1e-4)
    capped = window_attention_reference(q, k, scaling=0.3, softcap=3.0)
    assert not torch.allclose(capped, scaled, rtol=1e-2, atol=1e-4)
    # With a cap far above every logit, tanh is the identity to within float error.
    torch.testing.assert_close(window_attention_reference(q, k, scaling=0.3, softcap=1e6), scaled,
                               rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kwargs", [dict(scaling=0.0), dict(scaling=float("nan")), dict(softcap=-1.0)])
def test_window_attention_rejects_bad_logit_params(kwargs):
    q, k = torch.zeros(1, 2, 4, 64), torch.zeros(1, 2, 9, 64)
    for fn in (window_attention_reference, window_attention_triton):
        with pytest.raises(ValueError):
            fn(q, k, **kwargs)


def test_window_attention_rejects_even_pool_kernel():
    with pytest.raises(ValueError):
        window_attention_triton(torch.zeros(1, 2, 4, 64), torch.zeros(1, 2, 9, 64), pool_kernel=4)


# ---------------------------------------------------------------- CUR leverage


@pytest.mark.parametrize("dtype", DTYPES + FP8)
@pytest.mark.parametrize(
    "batch,h,n,d,r", [((2, 3), 2, 37, 64, 20), ((2,), 7, 131, 128, 20), ((), 1, 5, 100, 3)]
)
def test_cur_leverage_matches_reference(dtype, batch, h, n, d, r):
    k = _randn(*batch, h, n, d, dtype=dtype, seed=7)
    v = _randn(*batch, h, n, d, dtype=dtype, seed=8)
    g = _randn(*batch, d, r, seed=9)
    out = cur_leverage_triton(k, v, g)
    assert out.dtype == torch.float32 and out.shape == (*batch, h, n)
    torch.testing.assert_close(out, cur_leverage_reference(k, v, g), **SCORE_TOL)


def test_cur_leverage_shared_projection_and_strided_values():
    k = _randn(2, 3, 37, 64, seed=10)
    v = _randn(2, 3, 64, 37, seed=11).transpose(-1, -2)  # non-contiguous values
    g = _randn(64, 20, seed=12)  # one projection broadcast over the leading dims
    torch.testing.assert_close(
        cur_leverage_triton(k, v, g), cur_leverage_reference(k, v, g), **SCORE_TOL
    )


# ---------------------------------------------------------------- compaction


def _pool(num_layers, num_slots, h, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(num_slots, h, d, generator=g).to(dtype) for _ in range(2 * num_layers)]


def _random_keep(b, num_layers, h, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    idx = [torch.randperm(n, generator=g)[:k] for _ in range(b * num_layers * h)]
    return torch.sort(torch.stack(idx)).values.view(b, num_layers, h, k)


def _bits(t):
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _check_compaction(b, num_layers, h, n, d, keep, dtype, slot_dtype, seed=0):
    num_slots = 3 * b * n + 5
    bufs = _pool(num_layers, num_slots, h, d, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    slots = torch.randperm(num_slots, generator=g)[: b * n].view(b, n).to(slot_dtype)
    original = [t.clone() for t in bufs]
    expected = [t.clone() for t in bufs]
    compact_kv_reference_(expected[:num_layers], expected[num_layers:], slots, keep)
    compact_kv_triton_(bufs[:num_layers], bufs[num_layers:], slots, keep)
    for got, want in zip(bufs, expected):
        assert torch.equal(_bits(got), _bits(want))
    # how many layer buffers changed
    return sum(not torch.equal(_bits(a), _bits(o)) for a, o in zip(bufs, original))


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16] + FP8)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("d", [64, 128, 80])
def test_compaction_random_keep(dtype, slot_dtype, d):
    b, num_layers, h, n, k = 3, 4, 2, 131, 70  # 3 requests on disjoint slots
    keep = _random_keep(b, num_layers, h, n, k, seed=d)
    assert _check_compaction(b, num_layers, h, n, d, keep, dtype, slot_dtype) > 0


def test_compaction_identity_keep_is_a_no_op():
    b, num_layers, h, n, k = 2, 3, 4, 37, 37
    keep = torch.arange(k).expand(b, num_layers, h, k).contiguous()
    assert _check_compaction(b, num_layers, h, n, 64, keep, torch.bfloat16, torch.int64) == 0


def test_compaction_keep_last_k():
    b, num_layers, h, n, k = 2, 3, 4, 37, 20
    keep = torch.arange(n - k, n).expand(b, num_layers, h, k).contiguous()
    _check_compaction(b, num_layers, h, n, 128, keep, torch.bfloat16, torch.int32)


def test_compaction_keep_shifted_by_one():
    # keep[j] = j + 1: every source is the destination of the previous j in the same block.
    b, num_layers, h, n, k = 1, 2, 2, 65, 64
    keep = torch.arange(1, n).expand(b, num_layers, h, k).contiguous()
    _check_compaction(b, num_layers, h, n, 64, keep, torch.float32, torch.int64)


@pytest.mark.parametrize("shift", [5, 40, 70])
def test_compaction_moves_the_newest_window_as_paged_eviction_does(shift):
    """Paged eviction copies the newest R tokens of every layer and head forward by `shift`
    candidates (patches/step.py): keep = shift + arange(R), expanded with stride 0, on a
    column slice of the row's slots. shift < R overlaps sources and destinations, across
    the kernel's 32-wide blocks when R > 32."""
    b, num_layers, h, window, d = 2, 3, 2, 48, 64
    row_slots = torch.randperm(3 * b * 200 + 5, generator=torch.Generator().manual_seed(shift))
    row_slots = row_slots[: b * (30 + shift + window)].view(b, -1)
    slots = row_slots[:, 30:]  # the candidates after the K = 30 kept ones: a strided view
    keep = (shift + torch.arange(window)).expand(b, num_layers, h, window)
    bufs = _pool(num_layers, 3 * b * 200 + 5, h, d, torch.bfloat16, seed=shift)
    expected = [t.clone() for t in bufs]
    newest = [t[row_slots[:, -window:]].clone() for t in bufs]  # [b, R, H, D] before the move
    compact_kv_reference_(expected[:num_layers], expected[num_layers:], slots, keep)
    compact_kv_triton_(bufs[:num_layers], bufs[num_layers:], slots, keep)
    for got, want, moved in zip(bufs, expected, newest):
        assert torch.equal(_bits(got), _bits(want))
        assert torch.equal(_bits(got[slots[:, :window]]), _bits(moved))


# ---------------------------------------------------------------- backend dispatch


def test_kernel_backend_choice(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("VASE_KERNELS", raising=False)
    assert ops.kernel_backend(cpu) == "torch"
    monkeypatch.setenv("VASE_KERNELS", "auto")
    assert ops.kernel_backend(cpu) == "torch"
    monkeypatch.setenv("VASE_KERNELS", "triton")
    assert ops.kernel_backend(cpu) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError):
        ops.kernel_backend(cpu)
    monkeypatch.setenv("VASE_KERNELS", "bogus")
    with pytest.raises(ValueError):
        ops.kernel_backend(cpu)


def test_dispatch_runs_triton(monkeypatch):
    monkeypatch.setenv("VASE_KERNELS", "triton")

    def reference_must_not_run(*args, **kwargs):
        raise AssertionError("VASE_KERNELS=triton fell back to the torch reference")

    for name in (
        "value_range_reference",
        "window_attention_reference",
        "cur_leverage_reference",
        "compact_kv_reference_",
    ):
        monkeypatch.setattr(ops, name, reference_must_not_run)

    k = _randn(2, 2, 37, 64, seed=13)
    v = _randn(2, 2, 37, 64, seed=14)
    q = _randn(2, 4, 8, 64, seed=15)
    g = _randn(2, 64, 20, seed=16)
    torch.testing.assert_close(ops.value_range(v), value_range_reference(v), rtol=0, atol=0)
    torch.testing.assert_close(
        ops.window_attention(q, k, temperature=0.5, pool_kernel=3),
        window_attention_reference(q, k, temperature=0.5, pool_kernel=3),
        **SCORE_TOL,
    )
    torch.testing.assert_close(
        ops.cur_leverage(k, v, g), cur_leverage_reference(k, v, g), **SCORE_TOL
    )

    bufs = _pool(2, 60, 2, 64, torch.bfloat16, seed=17)
    expected = [t.clone() for t in bufs]
    slots = torch.randperm(60)[:37].view(1, 37)
    keep = _random_keep(1, 2, 2, 37, 16, seed=18)
    compact_kv_reference_(expected[:2], expected[2:], slots, keep)
    ops.compact_kv_(bufs[:2], bufs[2:], slots, keep)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(bufs, expected))


# ---------------------------------------------------------------- tensor cores vs the interpreter


def test_the_interpreter_cannot_multiply_bf16_blocks():
    """Why the kernels upcast under TRITON_INTERPRET=1 (triton-lang/triton#11584, "not supported
    yet"): a bf16 tl.dot in Triton 3.8's interpreter multiplies the uint16 bit patterns. If this
    starts failing, the interpreter learned bf16 dots: dot_mode could then pass bf16 operands
    as they are, and the CPU suite would run the GPU's operand path."""
    import triton
    import triton.language as tl

    @triton.jit
    def dot16(a, b, out):
        i = tl.arange(0, 16)
        x = tl.load(a + i[:, None] * 16 + i[None, :])
        y = tl.load(b + i[:, None] * 16 + i[None, :])
        tl.store(out + i[:, None] * 16 + i[None, :], tl.dot(x, y))

    a, b = _randn(16, 16, dtype=torch.bfloat16, seed=40), _randn(16, 16, dtype=torch.bfloat16, seed=41)
    out = torch.empty(16, 16)
    dot16[(1,)](a, b, out)
    assert (out - a.float() @ b.float()).abs().max() > 1e3  # bit patterns, not values
    fp16 = torch.empty(16, 16)
    dot16[(1,)](a.half(), b.half(), fp16)  # fp16 is a numpy dtype: multiplied as values
    torch.testing.assert_close(fp16, a.half().float() @ b.half().float(), rtol=1e-5, atol=1e-5)


def test_dot_mode():
    assert interpreted()  # TRITON_INTERPRET=1 before the kernels were defined
    for dtypes in ((torch.bfloat16,) * 2, (torch.float16,) * 2, (torch.float32,) * 2):
        assert dot_mode(*dtypes) == (True, "ieee")
    gpu = dict(interpreter=False)
    assert dot_mode(torch.bfloat16, torch.bfloat16, **gpu) == (False, "tf32")  # tf32: ignored
    assert dot_mode(torch.float16, torch.float16, **gpu) == (False, "tf32")
    assert dot_mode(torch.float32, torch.float32, **gpu) == (True, "tf32x3")
    assert dot_mode(torch.bfloat16, torch.float32, **gpu) == (True, "tf32x3")
    assert dot_mode(torch.bfloat16, torch.float16, **gpu) == (True, "tf32x3")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_window_attention_mixed_and_fp16_operands(dtype):
    # queries in another dtype than keys take the fp32 path; fp16 the 16-bit tiles
    q = _randn(2, 4, 8, 96, dtype=dtype, seed=42, scale=2.0)
    k = _randn(2, 2, 70, 96, dtype=torch.float16, seed=43, scale=2.0)
    torch.testing.assert_close(window_attention_triton(q, k), window_attention_reference(q, k),
                               **SCORE_TOL)


def _tf32(x):
    """Round to tf32 (10 explicit mantissa bits, nearest even), as fp32 values."""
    bits = x.float().view(torch.int32)
    bits = (bits + 0x0FFF + ((bits >> 13) & 1)) & ~0x1FFF
    return bits.view(torch.float32)


def _tf32x3_operands(q, k):
    """q, k with q' . k' = hi_q.hi_k + hi_q.lo_k + lo_q.hi_k: the three tf32 MMAs of tf32x3
    (hi = tf32(x), lo = tf32(x - hi)), as one fp32 dot over 3D."""
    qh, kh = _tf32(q), _tf32(k)
    ql, kl = _tf32(q.float() - qh), _tf32(k.float() - kh)
    return torch.cat([qh, qh, ql], -1), torch.cat([kh, kl, kh], -1)


def _relative(a, b):
    return float(((a - b).abs() / b.abs().clamp_min(1e-30)).max())


def _agreement(a, b, k):
    """Smallest fraction of a row's top-k that two scores share."""
    n = a.shape[-1]
    ka, kb = gpu_check.kept_mask(a.topk(k, -1).indices, n), gpu_check.kept_mask(b.topk(k, -1).indices, n)
    return float(((ka & kb).sum(-1).float() / k).min())


def test_tensor_core_arithmetic_of_fp32_window_attention():
    """The fp32 choice (docs/gpu.md), on CPU by rewriting the operands: tf32x3 stays ~1e-6 of
    the fp32 reference, far inside the GPU tolerance (gpu_check.GPU_SCORE_TOL) and keeping every
    top-k set; plain tf32 and a bf16 downcast use most or all of that tolerance and change kept
    tokens. The GPU tolerance and KEPT_AGREEMENT sit between the two."""
    d, n = 128, 1024
    q = _randn(2, 32, 64, d, seed=44, scale=1.5)
    k = _randn(2, 8, n, d, seed=45, scale=1.5)
    ref = window_attention_reference(q, k)
    scaled = dict(scaling=d**-0.5)  # the operands below are longer than D
    tf32x3 = window_attention_reference(*_tf32x3_operands(q, k), **scaled)
    tf32 = window_attention_reference(_tf32(q), _tf32(k), **scaled)
    bf16 = window_attention_reference(q.bfloat16().float(), k.bfloat16().float(), **scaled)
    keep = n // 2
    assert _relative(tf32x3, ref) < 1e-5
    torch.testing.assert_close(tf32x3, ref, **gpu_check.GPU_SCORE_TOL)
    assert _agreement(tf32x3, ref, keep) == 1.0
    assert _relative(tf32, ref) > 1e-4 and _relative(bf16, ref) > 1e-3
    assert gpu_check.KEPT_AGREEMENT <= _agreement(tf32, ref, keep) < 1.0
    assert _agreement(bf16, ref, keep) < 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tensor_core_arithmetic_of_cur_leverage(dtype):
    """16-bit K and V with the fp32 projection split into two halves of K's dtype (what the
    kernel does before its MMAs): ~1e-5 of the reference at bf16, every top-k set kept; the
    projection rounded once to K's dtype would not be."""
    d, n = 128, 1024
    k = _randn(2, 8, n, d, dtype=dtype, seed=46, scale=1.5)
    v = _randn(2, 8, n, d, dtype=dtype, seed=47)
    g = _randn(2, d, 20, seed=48) / 20**0.5
    ref = cur_leverage_reference(k, v, g)
    hi = g.to(dtype)
    lo = (g - hi.float()).to(dtype)
    split = cur_leverage_reference(k, v, hi.float() + lo.float())  # K G_hi + K G_lo, exact sum
    once = cur_leverage_reference(k, v, hi.float())
    assert _relative(split, ref) < 2e-5
    torch.testing.assert_close(split, ref, **gpu_check.GPU_SCORE_TOL)
    assert _agreement(split, ref, n // 2) == 1.0
    assert _relative(once, ref) > 10 * _relative(split, ref)


# ---------------------------------------------------------------- selections downstream


def _candidates(dtype, seed, b=2, l=2, h=2, group=2, w=8, n=131, d=64):
    keys = _randn(b, l, h, n, d, dtype=dtype, seed=seed, scale=1.5)
    values = _randn(b, l, h, n, d, dtype=dtype, seed=seed + 1)
    queries = _randn(b, l, h * group, w, d, dtype=_q_dtype(dtype), seed=seed + 2, scale=1.5)
    ids = dict(request=torch.arange(b)[:, None], layer=torch.arange(l)[None, :])
    return keys, values, queries, ids


@pytest.mark.parametrize("dtype", DTYPES + FP8)
@pytest.mark.parametrize("policy", ["snapkv", "vase-attnv", "vase-dkv", "curdkv", "rkv"])
def test_selections_agree_with_the_torch_backend(policy, dtype):
    """select_tokens on Triton (interpreted) against torch: at least KEPT_AGREEMENT of every
    row's kept tokens shared, every difference a near tie. Here (fp32 sums on both sides) the
    rows are in fact identical."""
    keys, values, queries, ids = _candidates(dtype, seed=50)
    cfg = EvictionConfig(policy=policy, budget=131 // 2 + 8, window=8, sinks=2, seed=3)
    result = gpu_check.selection_agreement(cfg, keys, values, queries, **ids)
    assert result["ok"], result
    assert result["agreement_min"] == 1.0 and result["unexplained"] == 0, result


def test_selection_agreement_fails_a_wrong_score(monkeypatch):
    """Negative control: a window attention that scores each key with its neighbour's key
    (rolled by one; the pooling keeps neighbours alike) shares only ~80% of the kept tokens, far
    below KEPT_AGREEMENT, and the differences are not near ties."""
    import importlib

    wa_module = importlib.import_module("vase_sglang.ops.window_attention")  # not the function

    def shifted(queries, keys, **kwargs):
        return window_attention_reference(queries, keys.roll(1, dims=-2), **kwargs)

    monkeypatch.setattr(wa_module, "window_attention_triton", shifted)
    keys, values, queries, ids = _candidates(torch.float32, seed=51)
    cfg = EvictionConfig(policy="snapkv", budget=131 // 2 + 8, window=8, sinks=2)
    result = gpu_check.selection_agreement(cfg, keys, values, queries, **ids)
    assert not result["ok"] and result["agreement_min"] < 0.9 and result["unexplained"] > 0, result
