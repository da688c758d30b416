"""vase_sglang/serving/sglang_decode_export.py and the module it generates,
vase_sglang/serving/sglang_decode_attention.py (SGLang's Triton decode attention without SGLang,
for the GPU check's sglang_decode section; docs/gpu.md).

The committed module must equal a fresh export from the installed SGLang (so an SGLang upgrade
that changes the kernels fails here until the export is rerun), import without SGLang, and give
bit for bit what SGLang's own decode_attention_fwd gives in Triton's interpreter: GQA (the
grouped stage 1) and MHA (the normal stage 1), fp32 and fp16, a logit cap, per-request split
counts that leave splits empty.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton / vase_sglang are imported

import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from vase_sglang.serving import sglang_decode_export as E  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_the_committed_export_equals_a_fresh_one():
    text = E.export()
    assert E.GENERATED.read_text() == text, (
        "vase_sglang/serving/sglang_decode_attention.py is stale: rerun "
        "`python -m vase_sglang.serving.sglang_decode_export`")
    assert E.main(["--check"]) == 0
    assert len(text.encode()) < 100_000  # small enough to commit
    for name in ("_fwd_grouped_kernel_stage1", "_fwd_kernel_stage1", "_fwd_kernel_stage2",
                 "decode_attention_fwd_grouped", "decode_attention_fwd_normal"):
        assert f"\ndef {name}(" in text
    assert "Licensed under the Apache License" in text.splitlines()[1]


def test_a_new_sglang_dependency_fails_the_export(tmp_path):
    """A reached function that starts using another name imported from SGLang is refused (it
    would be undefined on the GPU image), naming it."""
    folder = tmp_path / "sglang"
    for part in (E.SOURCE, E.SCORE_MOD):
        (folder.joinpath(*part)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(E.sglang_folder().joinpath(*part), folder.joinpath(*part))
    assert E.export(folder) == E.export()
    src = folder.joinpath(*E.SOURCE)
    text = src.read_text()
    text = text.replace("from sglang.srt.environ import envs\n",
                        "from sglang.srt.environ import envs\nfrom sglang.srt.utils import cdiv\n")
    text = text.replace("    _decode_att_m_fwd(\n", "    cdiv(1, 1)\n    _decode_att_m_fwd(\n", 1)
    src.write_text(text)
    with pytest.raises(RuntimeError, match="cdiv"):
        E.export(folder)


def test_the_export_imports_without_sglang(tmp_path):
    blocked = tmp_path / "sglang"
    blocked.mkdir()
    (blocked / "__init__.py").write_text("raise ImportError('no SGLang on the GPU image')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    code = ("import sys, vase_sglang.serving.sglang_decode_attention as m; "
            "assert callable(m.decode_attention_fwd); "
            "assert not [k for k in sys.modules if k.split('.')[0] == 'sglang']")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _run(module, q, k, v, indptr, indices, splits, cap):
    b, h_q, d = q.shape
    m = int(splits.max())
    o = torch.full((b, h_q, v.shape[-1]), float("nan"), dtype=q.dtype)
    # NaN where a split stores nothing, so both sides must leave the same entries untouched
    logits = torch.full((b, h_q, m, v.shape[-1]), float("nan"))
    lse = torch.full((b, h_q, m), float("nan"))
    module.decode_attention_fwd(q, k, v, o, indptr, indices, logits, lse, splits, m, d ** -0.5,
                                1.0, 1.0, logit_cap=cap)
    return o, logits, lse


@pytest.mark.parametrize("h_q,h_kv,d,lens,splits,dtype,cap", [
    (8, 2, 64, [40, 100, 7], [4, 2, 8], torch.float32, 0.0),  # GQA: grouped stage 1
    (4, 4, 32, [40, 70], [3, 2], torch.float32, 30.0),  # MHA: normal stage 1; logit cap
    (8, 2, 64, [33, 70], [3, 1], torch.float16, 0.0),
])
def test_the_export_equals_sglangs_decode_attention(h_q, h_kv, d, lens, splits, dtype, cap):
    from sglang.kernels.ops.attention import decode_attention as sglang_decode

    from vase_sglang.serving import sglang_decode_attention as exported

    g = torch.Generator().manual_seed(len(lens) + d)
    slots = sum(lens) + 8
    k = torch.randn(slots, h_kv, d, generator=g).to(dtype)
    v = torch.randn(slots, h_kv, d, generator=g).to(dtype)
    q = torch.randn(len(lens), h_q, d, generator=g).to(dtype)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(lens).cumsum(0)
    indices = (1 + torch.randperm(slots - 1, generator=g)[: sum(lens)]).int()
    splits = torch.tensor(splits, dtype=torch.int32)
    ours = _run(exported, q, k, v, indptr, indices, splits, cap)
    theirs = _run(sglang_decode, q, k, v, indptr, indices, splits, cap)
    assert torch.isfinite(ours[0]).all()
    for a, b in zip(ours, theirs):
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
