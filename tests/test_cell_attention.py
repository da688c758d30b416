"""vase_sglang/ops/cell_attention.py: decode attention over a request's packed cells (issue 52).

The Triton kernel runs under the CPU interpreter (as in tests/test_kernels.py: its dots are
upcast to fp32 there, so it must match the fp32 torch reference to fp32 rounding) on seeded
cases: several batch sizes, KV heads, GQA groups, head dims and K/V dtypes, heads owning no
cell, a head owning every one of the L·K·H cells (its segment split over several programs),
requests with fewer older slots than the batch's K_max (their padding slots hold NaN, so a stray
read shows), padding requests that own nothing, and cells packed by `cells.pack` through real
evictions. The reference, merged with the plain tokens' attention, equals `cells.attend`; the
merge is exact when either side is empty; the wrapper is capture-safe (static grid and shapes,
no host reads) with its launches stubbed out.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton / vase_sglang are imported

import pytest  # noqa: E402
import torch  # noqa: E402
from torch._subclasses.fake_tensor import (  # noqa: E402
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from tests.test_capture_safety import _TransferLog  # noqa: E402
from tests.test_cells import simulate  # noqa: E402
from vase_sglang import cells as C  # noqa: E402
from vase_sglang.ops import cell_attention as CA  # noqa: E402
from vase_sglang.ops import compact  # noqa: E402
from vase_sglang.ops.cell_attention import (  # noqa: E402
    cell_attention,
    cell_attention_reference,
    cell_attention_triton,
    merge_attention,
    split_lse,
)

torch.set_num_threads(1)
TOL = dict(rtol=1e-5, atol=2e-5)
NEG_INF = float("-inf")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _segments(owner, position):
    """Per request: CellMap.segments of owner / position [B, L, K, H]."""
    pairs = [C.CellMap(o, p, "global").segments() for o, p in zip(owner, position)]
    return torch.stack([o for o, _ in pairs]), torch.stack([f for _, f in pairs])


def _case(b, layers, h, group, k, d, dtype, seed):
    """A pool (one [S, H, D] K and V tensor per layer, slot 0 a NaN scratch slot), queries,
    each request's K older slots, and a random ownership of its L·K·H cells (unequal counts)."""
    g = _gen(seed)
    slots = b * k + 4
    q_dtype = torch.bfloat16 if dtype in compact.FP8_KV_DTYPES else dtype

    def buffer():
        t = torch.randn(slots, h, d, generator=g)
        t[0] = float("nan")  # never read: no request's older slot is 0
        return t.to(dtype)

    k_bufs = [buffer() for _ in range(layers)]
    v_bufs = [buffer() for _ in range(layers)]
    q = torch.randn(b, h * group, d, generator=g).to(q_dtype)
    older = (1 + torch.randperm(slots - 1, generator=g)[:b * k]).view(b, k)
    owner = torch.randint(0, layers * h, (b, layers, k, h), generator=g)
    position = torch.stack([torch.randperm(layers * k * h, generator=g).view(layers, k, h)
                            for _ in range(b)])
    return q, k_bufs, v_bufs, older, owner, position


def _check(q, k_bufs, v_bufs, older, order, offsets, layer, scaling=0.125, softcap=0.0,
           **options):
    out, lse = cell_attention_triton(q, k_bufs, v_bufs, older, order, offsets, layer, scaling,
                                     softcap, **options)
    ref_out, ref_lse = cell_attention_reference(q, k_bufs, v_bufs, older, order, offsets, layer,
                                                scaling, softcap)
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    assert torch.isfinite(out).all() and torch.isfinite(ref_out).all()
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)  # -inf where the other is (empty heads)
    return out, lse


def _empty_heads(offsets, layer, h):
    """[B, H] whether (layer, head) owns no cell."""
    seg = offsets[:, layer * h:(layer + 1) * h + 1]
    return seg[:, 1:] == seg[:, :-1]


# ------------------------------------------------------------- kernel against reference


@pytest.mark.parametrize("b,layers,h,group,k,d,dtype,splits", [
    (2, 3, 2, 4, 5, 64, torch.bfloat16, 16),
    (1, 2, 4, 1, 7, 128, torch.float16, 3),
    (3, 2, 1, 8, 9, 64, torch.float32, 1),
    (2, 4, 2, 2, 6, 128, torch.bfloat16, 2),
    (2, 2, 2, 3, 5, 64, torch.float8_e5m2, 4),  # fp8 K/V, bf16 queries; a group of 3
])
def test_kernel_matches_reference(b, layers, h, group, k, d, dtype, splits):
    q, k_bufs, v_bufs, older, owner, position = _case(b, layers, h, group, k, d, dtype, seed=k)
    # request 0, layer 0, head 0 owns nothing (its cells go to the next owner)
    owner[0] = torch.where(owner[0] == 0, 1, owner[0])
    order, offsets = _segments(owner, position)
    counts = offsets.diff(dim=-1)
    assert counts.max() > k and counts.min() == 0  # unequal heads, an empty one
    for layer in {0, layers - 1}:
        out, lse = _check(q, k_bufs, v_bufs, older, order, offsets, layer, num_splits=splits)
        empty = _empty_heads(offsets, layer, h).repeat_interleave(group, dim=1)
        assert torch.equal(torch.isinf(lse), empty) and (lse[empty] == NEG_INF).all()
        assert (out[empty] == 0).all()


@pytest.mark.parametrize("splits", [1, 4, 5])
def test_a_head_owning_every_cell(splits):
    """(layer 1, head 1) owns all L·K·H = 144 cells: 5 blocks of 32, split over the programs
    (4 splits: chunks of 64, 64, 16 and an empty one); every other head of every layer owns
    none."""
    b, layers, h, group, k, d = 2, 3, 2, 2, 24, 64
    q, k_bufs, v_bufs, older, _, position = _case(b, layers, h, group, k, d, torch.bfloat16, 1)
    owner = torch.full((b, layers, k, h), 1 * h + 1)
    order, offsets = _segments(owner, position)
    out, lse = _check(q, k_bufs, v_bufs, older, order, offsets, 1, num_splits=splits)
    assert torch.isfinite(lse[:, group:]).all()
    assert (lse[:, :group] == NEG_INF).all() and (out[:, :group] == 0).all()
    out0, lse0 = _check(q, k_bufs, v_bufs, older, order, offsets, 0, num_splits=splits)
    assert (lse0 == NEG_INF).all() and (out0 == 0).all()


@pytest.mark.parametrize("softcap", [0.0, 2.0, 30.0])
def test_scaling_and_softcap(softcap):
    b, layers, h, group, k, d = 2, 2, 2, 4, 6, 64
    q, k_bufs, v_bufs, older, owner, position = _case(b, layers, h, group, k, d,
                                                      torch.float32, 7)
    q = q * 4  # large logits, so that a cap of 2 bends them
    order, offsets = _segments(owner, position)
    out, lse = _check(q, k_bufs, v_bufs, older, order, offsets, 1, scaling=0.3,
                      softcap=softcap, num_splits=2)
    plain_out, plain_lse = cell_attention_reference(q, k_bufs, v_bufs, older, order, offsets, 1,
                                                    0.3)
    if softcap == 2.0:  # the cap changes the result; and it is the model's tanh cap
        assert not torch.allclose(out, plain_out, atol=1e-2)
        # every capped logit lies in (-cap, cap): lse < cap + log(cells owned)
        counts = offsets.diff(dim=-1)[:, h:2 * h].repeat_interleave(group, dim=1)
        some = counts > 0
        assert (lse[some] < softcap + counts[some].log()).all()
        assert not (plain_lse[some] < softcap + counts[some].log()).all()


def test_padded_requests_and_padded_older_slots():
    """A batch padded as a captured graph pads it (int32 slots): request 1 has 3 older slots
    of the batch's K_max = 7 (its other 4 are the NaN scratch slot 0, and its cell indices are
    laid out over K_max), request 2 is a padding request (every slot 0, every offset 0)."""
    layers, h, group, k_max, d = 2, 2, 2, 7, 64
    q, k_bufs, v_bufs, older, owner, position = _case(3, layers, h, group, k_max, d,
                                                      torch.bfloat16, 11)
    order, offsets = _segments(owner, position)
    k_short = 3
    short = C.CellMap(owner[1, :, :k_short], position[1, :, :k_short], "global")
    s_order, s_offsets = short.segments()
    cell = s_order  # (l·k_short + j)·H + h  ->  (l·K_max + j)·H + h
    l_, j_, h_ = cell // (k_short * h), (cell // h) % k_short, cell % h
    order[1] = torch.cat([(l_ * k_max + j_) * h + h_,
                          torch.arange(layers * (k_max - k_short) * h)])  # tail: owned by none
    offsets[1] = s_offsets
    older[1, k_short:] = 0
    older[2] = 0
    order[2] = torch.arange(layers * k_max * h)
    offsets[2] = 0
    older = older.int()  # as SGLang's req_to_token holds slots
    for layer in range(layers):
        out, lse = _check(q, k_bufs, v_bufs, older, order, offsets, layer, num_splits=3)
        assert (lse[2] == NEG_INF).all() and (out[2] == 0).all()
        assert torch.isfinite(lse[1]).any()


# ------------------------------------------------- cells packed by real evictions, and merge


def _plain_part(q, plain_k, plain_v, scaling):
    """Softmax attention of one request over its plain tokens: out [H_q, D], lse [H_q]."""
    group = q.shape[0] // plain_k.shape[0]
    logits = torch.einsum("qd,qnd->qn", q.float(),
                          plain_k.float().repeat_interleave(group, 0)) * scaling
    lse = torch.logsumexp(logits, -1)
    out = torch.einsum("qn,qnd->qd", torch.softmax(logits, -1),
                       plain_v.float().repeat_interleave(group, 0))
    return out, lse


@pytest.mark.parametrize("scope", ["layer", "global"])
def test_packed_cells_merged_with_the_plain_part_equal_cells_attend(scope):
    """Requests whose cells were packed through real evictions (tests/test_cells.simulate,
    cells.pack): their cells are placed at each request's older slots in a per-layer pool;
    the kernel equals the reference, and the reference merged with the plain tokens'
    attention equals cells.attend (the masked-cache-checked reference attention)."""
    from tests.test_cells import G, H, K, L

    states = list(simulate(scope, rounds=8, seed=3))
    picked = [states[3], states[7]]  # two requests, unequal owners (checked below)
    d = picked[0][1].shape[-1]
    g = _gen(5)
    b = len(picked) + 1  # and a padding request
    slots = b * K + 2
    k_bufs = [torch.full((slots, H, d), float("nan")) for _ in range(L)]
    v_bufs = [torch.full((slots, H, d), float("nan")) for _ in range(L)]
    older = torch.zeros(b, K, dtype=torch.int64)
    order = torch.zeros(b, L * K * H, dtype=torch.int64)
    offsets = torch.zeros(b, L * H + 1, dtype=torch.int64)
    q = torch.randn(b, H * G, d, generator=g)
    for r, (cells, cell_k, cell_v, *_rest) in enumerate(picked):
        assert (cells.counts() != K).any()
        older[r] = 1 + r * K + torch.randperm(K, generator=g)
        for layer in range(L):
            k_bufs[layer][older[r]] = cell_k[layer]
            v_bufs[layer][older[r]] = cell_v[layer]
        order[r], offsets[r] = cells.segments()
    scaling = d ** -0.5
    for layer in range(L):
        out, lse = _check(q, k_bufs, v_bufs, older, order, offsets, layer, scaling=scaling,
                          num_splits=2)
        assert (lse[-1] == NEG_INF).all() and (out[-1] == 0).all()
        for r, (cells, cell_k, cell_v, alive, keys, values, plain, now) in enumerate(picked):
            plain_k, plain_v = keys[layer][:, plain], values[layer][:, plain]
            want = C.attend(q[r], plain_k, plain_v, cell_k, cell_v, cells, layer, scaling)
            p_out, p_lse = _plain_part(q[r], plain_k, plain_v, scaling)
            merged, merged_lse = merge_attention(p_out, p_lse, out[r], lse[r])
            torch.testing.assert_close(merged, want, **TOL)
            assert not torch.allclose(p_out, want, **TOL)  # the cells matter
            # the merged lse is the whole row's: plain tokens and owned cells together
            mine = cells.owner == layer * H + torch.arange(H).repeat_interleave(G)[:, None,
                                                                                   None, None]
            full_k = [torch.cat([plain_k[hq // G], cell_k[mine[hq]]]) for hq in range(H * G)]
            full_lse = torch.stack([torch.logsumexp(q[r, hq] @ full_k[hq].T * scaling, 0)
                                    for hq in range(H * G)])
            torch.testing.assert_close(merged_lse, full_lse, **TOL)


def test_merge_attention_is_exact_with_an_empty_side_and_equals_one_softmax():
    g = _gen(9)
    out = torch.randn(3, 4, 16, generator=g)
    lse = torch.randn(3, 4, generator=g) * 5
    empty_lse = torch.full((3, 4), NEG_INF)
    for garbage in (torch.zeros(3, 4, 16), torch.full((3, 4, 16), float("nan"))):
        got, got_lse = merge_attention(out, lse, garbage, empty_lse)
        assert torch.equal(got, out) and torch.equal(got_lse, lse)
        got, got_lse = merge_attention(garbage, empty_lse, out, lse)
        assert torch.equal(got, out) and torch.equal(got_lse, lse)
        got, got_lse = merge_attention(garbage, empty_lse, garbage.clone(), empty_lse)
        assert (got == 0).all() and (got_lse == NEG_INF).all()
    # two disjoint key sets merged = one softmax over their union
    q = torch.randn(5, 8, generator=g)
    keys, values = torch.randn(5, 30, 8, generator=g), torch.randn(5, 30, 8, generator=g)
    logits = torch.einsum("qd,qnd->qn", q, keys)

    def part(sl):
        return torch.einsum("qn,qnd->qd", torch.softmax(logits[:, sl], -1), values[:, sl]), \
            torch.logsumexp(logits[:, sl], -1)

    merged, merged_lse = merge_attention(*part(slice(0, 11)), *part(slice(11, 30)))
    whole, whole_lse = part(slice(0, 30))
    torch.testing.assert_close(merged, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged_lse, whole_lse, rtol=1e-6, atol=1e-6)
    # a plain average is not a merge (the check can fail)
    assert not torch.allclose((part(slice(0, 11))[0] + part(slice(11, 30))[0]) / 2, whole,
                              atol=1e-3)


# ------------------------------------------------------------------ dispatch and errors


def test_cell_attention_dispatches_by_backend(monkeypatch):
    q, k_bufs, v_bufs, older, owner, position = _case(1, 2, 2, 2, 4, 64, torch.float32, 13)
    order, offsets = _segments(owner, position)
    args = (q, k_bufs, v_bufs, older, order, offsets, 1, 0.125)
    called = []
    for name in ("cell_attention_triton", "cell_attention_reference"):
        fn = getattr(CA, name)
        monkeypatch.setattr(CA, name, lambda *a, _fn=fn, _name=name: called.append(_name)
                            or _fn(*a))
    for backend in ("triton", "torch"):
        monkeypatch.setenv("VASE_KERNELS", backend)
        cell_attention(*args)
    assert called == ["cell_attention_triton", "cell_attention_reference"]


@pytest.mark.parametrize("change", ["layer", "heads", "order", "offsets", "scaling", "splits",
                                    "dtype", "stride"])
def test_bad_arguments_are_refused(change):
    q, k_bufs, v_bufs, older, owner, position = _case(1, 2, 2, 2, 4, 64, torch.float32, 13)
    order, offsets = _segments(owner, position)
    args = dict(q=q, k_buffers=k_bufs, v_buffers=v_bufs, older_slots=older, order=order,
                offsets=offsets, layer=0, scaling=0.125)
    options = {}
    if change == "layer":
        args["layer"] = 2
    elif change == "heads":
        args["q"] = q[:, :3]
    elif change == "order":
        args["order"] = order[:, 1:]
    elif change == "offsets":
        args["offsets"] = offsets[:, 1:]
    elif change == "scaling":
        args["scaling"] = 0.0
    elif change == "splits":
        options["num_splits"] = 0
    elif change == "dtype":
        args["v_buffers"] = [v.half() for v in v_bufs]
    else:  # [S, H, D] views whose head dim is not contiguous
        args["k_buffers"] = [torch.randn(10, 64, 2).transpose(1, 2) for _ in k_bufs]
        args["v_buffers"] = [torch.randn(10, 64, 2).transpose(1, 2) for _ in v_bufs]
    with pytest.raises(ValueError):
        cell_attention_triton(**args, **options)
    if change not in ("splits", "dtype", "stride"):  # kernel-only constraints
        with pytest.raises(ValueError):
            cell_attention_reference(**args)


# ------------------------------------------------------------------------ capture safety


class _Launches:
    """Stands in for a @triton.jit kernel on fake tensors: records each launch's grid."""

    def __init__(self):
        self.grids = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            assert all(type(n) is int for n in grid), grid  # a static grid: host ints
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            assert tensors and all(t.device.type == "cuda" for t in tensors)
            self.grids.append(tuple(grid))
        return launch


def _hazards_after_warmup(fn, *args):
    """tests/test_capture_safety.capture_hazards with one warm-up call first, as the server
    warms up before it captures: the pointer tables are built (a host-to-device copy) once per
    pool, then found in the cache."""
    mode = FakeTensorMode()
    with mode:
        fakes = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cuda")
                 if isinstance(a, torch.Tensor) else
                 [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
                  for t in a] if isinstance(a, list) else a for a in args]
    try:
        with mode:
            fn(*fakes)
        log = _TransferLog()
        with mode, log:
            fn(*fakes)
    except DynamicOutputShapeException as err:
        return [f"data-dependent shape: {err.func}"]
    except DataDependentOutputException as err:
        return [f"host read of a device value: {err.func}"]
    return log.transfers


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
def test_cell_attention_is_capturable(monkeypatch):
    """On fake CUDA tensors (static shapes, no data) the wrapper allocates, builds its launch
    and launches (stubbed) with no host read, no data-dependent shape and no host-device copy
    once its pointer tables exist; the grid is (B, H, splits) whatever the cells' owners.
    The reference is capture-safe too. Negative control: a grid sized by the largest head's
    cell count (a host read) is caught."""
    monkeypatch.setattr(compact, "_TABLES", {})  # keep the fake tables out of the real cache
    attn, combine = _Launches(), _Launches()
    monkeypatch.setattr(CA, "_cell_attention_kernel", attn)
    monkeypatch.setattr(CA, "_cell_combine_kernel", combine)
    b, layers, h, group, k, d = 3, 4, 2, 4, 40, 128
    q, k_bufs, v_bufs, older, owner, position = _case(b, layers, h, group, k, d,
                                                      torch.bfloat16, 17)
    order, offsets = _segments(owner, position)
    args = (q, k_bufs, v_bufs, older, order, offsets)

    def body(*a):
        return cell_attention_triton(*a, 2, 0.125, 0.0, num_splits=8)

    assert _hazards_after_warmup(body, *args) == []
    assert attn.grids == [(b, h, 8)] * 2 and combine.grids == [(b * h * group,)] * 2
    assert _hazards_after_warmup(lambda *a: cell_attention_reference(*a, 2, 0.125), *args) == []

    def sized_by_data(*a):
        return cell_attention_triton(*a, 2, 0.125, num_splits=int(a[5].diff(dim=-1).max()))

    assert _hazards_after_warmup(sized_by_data, *args)


# ------------------------------------------- split_lse: SGLang's per-split log-sum-exps


def _splits_holding_keys(length, k, min_block=32):
    """Brute force, as SGLang's stage 1 loops: the splits s < S whose [start, end) is not empty."""
    per = -(-(-(-length // k)) // min_block) * min_block
    return [s for s in range(8) if min(per * s + per, length) > per * s]


def test_split_lse_takes_exactly_the_splits_that_hold_keys():
    """Requests of 0..300 keys and 1..8 splits: the total is the log-sum-exp of the splits that
    hold keys (by the kernel's own loop bounds); the others hold NaN (never written) and are
    left out; a request of no key gives -inf. kv_indptr and num_kv_splits may be longer than
    the batch (a captured graph's buffers)."""
    g = _gen(3)
    lengths = [0, 1, 31, 32, 33, 64, 65, 100, 255, 256, 257, 300, 7, 40]
    ks = [1, 8, 4, 1, 2, 8, 3, 5, 8, 8, 7, 2, 8, 3]
    b, h_q = len(lengths), 3
    lse = torch.randn(b, h_q, 8, generator=g) * 5
    expected = torch.full((b, h_q), NEG_INF)
    for i, (n, k) in enumerate(zip(lengths, ks)):
        holds = _splits_holding_keys(n, k)
        assert all(s < k for s in holds) and (holds or n == 0)
        empty = [s for s in range(8) if s not in holds]
        lse[i][:, empty] = float("nan")
        if holds:
            expected[i] = torch.logsumexp(lse[i][:, holds].double(), -1).float()
    indptr = torch.tensor([0] + lengths + [0]).cumsum(0).int()  # one padding entry more
    splits = torch.tensor(ks + [8], dtype=torch.int32)
    total = split_lse(lse, indptr, splits)
    assert total.dtype == torch.float32 and total.shape == (b, h_q)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=1e-6)
    assert (total[0] == NEG_INF).all()
    assert torch.isnan(torch.logsumexp(lse, -1)).any()  # all splits: NaN (what it avoids)


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
def test_split_lse_is_capturable():
    """No host read, no data-dependent shape, no copy: it runs on the backend's metadata inside
    a captured decode step."""
    args = (torch.zeros(4, 8, 8), torch.zeros(5, dtype=torch.int32),
            torch.ones(4, dtype=torch.int32))
    assert _hazards_after_warmup(split_lse, *args) == []
