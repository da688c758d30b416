"""benchmarks/kv_quant.py: the quantizers against independent formulas, the error shares and
attention-output errors against brute-force recomputations, the causal mixed-precision rule,
bytes per token, and both commands on the tiny model (KL exactly 0 without quantization)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "kv_quant.py"


@pytest.fixture(scope="module")
def kq():
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("kv_quant", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_int_quantizer_error_bound_and_levels(kq):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, 64, generator=g) * torch.rand(3, 50, 1, generator=g) * 10
    for bits in (4, 8):
        y = kq.fake_int(x, bits)
        mn, mx = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        step = (mx - mn) / (2 ** bits - 1)
        # every element within half a step of the original, per token
        assert ((y - x).abs() <= step / 2 + 1e-5 * mx.abs().clamp_min(1)).all()
        # values lie on the grid min + q * step, q in 0 .. 2^b - 1, and the extremes are exact
        q = (y - mn) / step
        assert (q.round() - q).abs().max() < 1e-3
        assert q.min() > -1e-3 and q.max() < 2 ** bits - 1 + 1e-3
        torch.testing.assert_close(y.amax(-1), x.amax(-1))
        torch.testing.assert_close(y.amin(-1), x.amin(-1))
        assert max(len(torch.unique(row)) for row in y.reshape(-1, 64)) <= 2 ** bits
    # a constant token is kept exactly; groups of 32 are quantized independently
    c = torch.full((1, 1, 64), 3.25)
    assert torch.equal(kq.fake_int(c, 4), c)
    two = torch.cat([torch.rand(1, 1, 32, generator=g), 100 + torch.rand(1, 1, 32, generator=g)], -1)
    grouped = kq.fake_int(two, 4, group=32)
    for half in (slice(0, 32), slice(32, 64)):
        torch.testing.assert_close(grouped[..., half], kq.fake_int(two[..., half], 4))


def test_fp8_is_torch_cast(kq):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 40, 64, generator=g) * 30
    x[0, 0, 0] = 1000.0  # beyond 448: torch's cast saturates, as SGLang's store does
    assert torch.equal(kq.fake_fp8(x), x.to(torch.float8_e4m3fn).to(torch.float32))
    s = 1000.0 / 448
    assert torch.equal(kq.fake_fp8(x, s), (x / s).to(torch.float8_e4m3fn).to(torch.float32) * s)
    assert kq.fake_fp8(x)[0, 0, 0] == 448.0
    # relative error of e4m3 (3 mantissa bits) within 2^-4 for normal numbers below the max
    normal = (x.abs() > 2 ** -6) & (x.abs() <= 448)
    rel = ((kq.fake_fp8(x) - x).abs() / x.abs())[normal]
    assert rel.max() <= 2 ** -4 + 1e-6
    assert torch.equal(kq.quantize(x, "bf16"), x.to(torch.bfloat16).float())
    assert torch.equal(kq.quantize(x, "none"), x)


def test_bytes_per_token(kq):
    d = 64
    assert kq.scheme_bytes("bf16", d) == 256
    assert kq.scheme_bytes("fp8", d) == kq.scheme_bytes("fp8cal", d) == 128
    assert kq.scheme_bytes("int8", d) == 2 * (64 + 4)
    assert kq.scheme_bytes("int4", d) == 2 * (32 + 4)
    assert kq.scheme_bytes("int4g32", d) == 2 * (32 + 2 * 4)
    assert kq.arm_bytes("mix-range:0.0625", d) == 0.0625 * 256 + 0.9375 * 72
    assert kq.arm_bytes("mix-random:0.25", d, protected_fraction=0.3) == 0.3 * 256 + 0.7 * 72
    assert kq.arm_bytes("int4", d) == 72
    # "K/V" arms: each side half of its scheme's figure
    assert kq.arm_sides("bf16/mix-range:0.0625") == ("bf16", "mix-range:0.0625")
    assert kq.arm_sides("int4") == ("int4", "int4")
    assert kq.arm_bytes("bf16/int4", d) == 128 + 36
    assert kq.arm_bytes("int4/bf16", d) == 36 + 128
    assert kq.arm_bytes("bf16/int4g32", d) == 128 + 40
    assert abs(kq.arm_bytes("bf16/mix-range:0.0625", d, protected_fraction=0.1) - (128 + 0.1 * 128 + 0.9 * 36)) < 1e-9


def test_running_top_is_causal_quota(kq):
    g = torch.Generator().manual_seed(2)
    p = torch.rand(3, 70, generator=g)
    p[0, 10] = p[0, 3]  # a tie: the earlier token ranks first
    for f in (1 / 16, 1 / 4):
        got = kq.running_top(p, f)
        for h in range(3):
            for t in range(70):
                prefix = p[h, : t + 1].tolist()
                rank = 1 + sum(1 for j in range(t) if prefix[j] > prefix[t] or prefix[j] == prefix[t])
                assert bool(got[h, t]) == (rank <= math.ceil(f * (t + 1))), (f, h, t)
        # token 0 always kept; a selection only looks back (prefix-stable)
        assert got[:, 0].all()
        assert torch.equal(kq.running_top(p[:, :40], f), got[:, :40])


def test_error_shares_brute_force(kq):
    g = torch.Generator().manual_seed(3)
    err = torch.rand(4, 37, generator=g)
    score = torch.rand(4, 37, generator=g)
    for frac in (1 / 16, 1 / 4):
        got = kq.error_shares(err, score, frac)
        k = math.ceil(frac * 37)
        for i in range(4):
            order = sorted(range(37), key=lambda j: -score[i, j].item())[:k]
            want = sum(err[i, j].item() for j in order) / err[i].sum().item()
            assert abs(got[i].item() - want) < 1e-6


def test_attention_output_error_brute_force(kq):
    g = torch.Generator().manual_seed(4)
    hq, hkv, n, d = 4, 2, 9, 8
    att = torch.softmax(torch.randn(hq, n, n, generator=g), -1)
    dv = torch.randn(hkv, n, d, generator=g)
    exact = torch.zeros(hkv, n, dtype=torch.bool)
    exact[0, 2] = exact[1, 5] = True
    want = want_kept = 0.0
    for h in range(hq):
        kv = h // (hq // hkv)
        for i in range(n):
            o = sum(att[h, i, j] * dv[kv, j] for j in range(n))
            o_kept = sum(att[h, i, j] * dv[kv, j] for j in range(n) if not exact[kv, j])
            want += (o ** 2).sum().item()
            want_kept += (o_kept ** 2).sum().item()
    assert abs(kq.attention_output_error(att, dv) - want) < 1e-4 * want
    assert abs(kq.attention_output_error(att, dv, exact) - want_kept) < 1e-4 * want_kept


def test_error_command_on_tiny_model(kq, tiny_model_fp32, tmp_path):
    from transformers import AutoModelForCausalLM

    res = kq.main(["error", "--model", tiny_model_fp32, "--prompts", "2", "--gen-tokens", "4",
                   "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "error.json").read_text())
    assert (tmp_path / "error_vs_range.png").stat().st_size > 10_000
    assert set(saved["schemes"]) == {"fp8", "fp8cal", "int8", "int4"}
    # recompute the V error shares of int4 from the cache, independently of analyse_sequence
    model = AutoModelForCausalLM.from_pretrained(tiny_model_fp32, dtype=torch.float32).eval()
    import importlib

    vp = importlib.import_module("benchmarks.value_profile")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_fp32)
    seqs = [model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False,
                           pad_token_id=tok.pad_token_id)[0].tolist()
            for ids in vp.gsm_prompts(tok, 2, 123)]
    assert saved["sequence_lengths"] == [len(s) for s in seqs]
    shares = {1 / 16: [], 1 / 4: []}
    for ids in seqs:
        with torch.no_grad():
            cache = model(torch.tensor([ids]), use_cache=True).past_key_values
        for layer in cache.layers:
            for v in layer.values[0]:  # [n, D] per KV head
                v = v.float()
                n = v.shape[0]
                err = []
                for tokv in v:
                    lo, hi = tokv.min().item(), tokv.max().item()
                    step = (hi - lo) / 15
                    deq = [lo + round((x - lo) / step) * step for x in tokv.tolist()]
                    err.append(sum((a - b) ** 2 for a, b in zip(deq, tokv.tolist())))
                rng = (v.max(-1).values - v.min(-1).values).tolist()
                order = sorted(range(n), key=lambda j: -rng[j])
                for frac in shares:
                    k = math.ceil(frac * n)
                    shares[frac].append(sum(err[j] for j in order[:k]) / sum(err))
    for frac, vals in shares.items():
        got = saved["schemes"]["int4"]["share_v"][f"{frac:g}"]
        assert got["n"] == len(vals)
        assert abs(got["mean"] - sum(vals) / len(vals)) < 1e-4
    for s in saved["schemes"].values():
        for key in ("0.0625", "0.25"):
            removed = s["att_removed"][key]
            assert set(removed) == {"top_range", "random", "top_attention"}
            assert all(0 <= r["mean"] <= 1 for r in removed.values())
    assert res["layers"] == 2


def test_kl_command_on_tiny_model(kq, tiny_model_fp32, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.accuracy import load_problems, prompt_ids

    arms = "none,int4,fp8,mix-range:0.25,mix-random:0.25"
    res = kq.main(["kl", "--model", tiny_model_fp32, "--n", "2", "--max-new", "6", "--calib", "1",
                   "--arms", arms, "--boot-iters", "200", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "kl.json").read_text())
    a = saved["arms"]
    assert a["none"]["kl"] == [0.0, 0.0, 0.0] and a["none"]["top1"][0] == 1.0
    assert all(r["arms"]["none"]["kl_sum"] == 0.0 for r in saved["rows"])
    assert a["int4"]["kl"][0] > 0 and a["fp8"]["kl"][0] > 0
    assert a["none"]["tokens"] == sum(r["answer_tokens"] for r in saved["rows"]) > 0
    # bytes of a mixed arm: from the share of (layer, head, token) it kept in bf16
    d = saved["head_dim"]
    assert d == 32  # the tiny model: bf16 K+V = 4 d bytes, int4 = 2 (d/2 + 4)
    for arm in ("mix-range:0.25", "mix-random:0.25"):
        f = a[arm]["protected_fraction"]
        assert 0.2 < f < 0.4
        assert abs(a[arm]["bytes_per_token"] - (f * 4 * d + (1 - f) * 2 * (d / 2 + 4))) < 1e-9
    assert a["int4"]["bytes_per_token"] == 2 * (d / 2 + 4) == 40
    assert a["fp8"]["bytes_per_token"] == 2 * d and a["none"]["bytes_per_token"] == 8 * d
    # the registered attention with quantization off reproduces the stock model's logits exactly
    tok = AutoTokenizer.from_pretrained(tiny_model_fp32)
    ids = prompt_ids(tok, load_problems("gsm_symbolic", 1, 123)[0])
    stock = AutoModelForCausalLM.from_pretrained(tiny_model_fp32, dtype=torch.float32).eval()
    with torch.no_grad():
        want = stock(torch.tensor([ids])).logits[0]
    mine = AutoModelForCausalLM.from_pretrained(tiny_model_fp32, dtype=torch.float32).eval()
    kq.register()
    mine.set_attn_implementation(kq.ATTN_NAME)
    kq.STATE.arm, kq.STATE.prompt_len = "none", 0
    assert torch.equal(kq.logits_of(mine, ids), want)
    # int4 everywhere (no exact prompt part) changes them; the prompt split keeps the prompt rows
    kq.STATE.arm, kq.STATE.prompt_len = "int4", len(ids) - 3
    split = kq.logits_of(mine, ids)
    assert torch.equal(split[: len(ids) - 3], want[: len(ids) - 3])
    assert not torch.equal(split[-3:], want[-3:])
    kq.STATE.arm = "none"
    assert res["problems"] == 2
