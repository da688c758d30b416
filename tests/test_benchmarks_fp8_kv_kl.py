"""benchmarks/fp8_kv_kl.py on the tiny model: teacher-forced KL of eviction on an 8-bit KV
cache, on the transformers reference (which equals the server: tests/test_server_fp8.py)."""

import gzip
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import fp8_kv_kl  # noqa: E402

torch.set_num_threads(1)


def _records(path: Path, model: str) -> Path:
    """An accuracy-study records file with two problems' full-cache greedy answers."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rows = []
    for i, question in enumerate(["What is 12 plus 30?", "How many legs have 3 cats?"]):
        answer = tok(" The answer is 42, since twelve and thirty make forty-two. " * 3,
                     add_special_tokens=False)["input_ids"][:60]
        rows.append({"arm": "full:greedy", "pid": f"gsm_symbolic-1-{i}", "question": question,
                     "output_ids": answer})
    with gzip.open(path, "wt") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def test_replays_pair_every_arm_and_resume(tiny_model_fp32, tmp_path):
    records = _records(tmp_path / "records.jsonl.gz", tiny_model_fp32)
    out = tmp_path / "out"
    argv = ["--model", tiny_model_fp32, "--records", str(records), "--problems", "2",
            "--budget", "16", "--window", "4", "--out", str(out)]
    assert fp8_kv_kl.main(argv) == 0
    rows = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    names = [a for a in map(fp8_kv_kl.arm_name, fp8_kv_kl.arms(16, 4, ["vase-attnv"]))]
    assert sorted(r["arm"] for r in rows) == sorted(names * 2)
    by = {(r["arm"], r["pid"]): r for r in rows}
    for pid in ("gsm_symbolic-1-0", "gsm_symbolic-1-1"):
        ref = by[("full:model", pid)]
        assert len(ref["ref_ids"]) == len(ref["kl"]) == 60 and set(ref["kl"]) == {0.0}
        # 8-bit rounding alone moves the distribution; e5m2 (2 mantissa bits) more than e4m3
        e4, e5 = (sum(by[(f"full:{kv}", pid)]["kl"]) for kv in ("fp8_e4m3", "fp8_e5m2"))
        assert 0 < e4 < e5
        vase = [by[(f"vase-attnv@16/w4:{kv}", pid)] for kv in ("model", "fp8_e4m3")]
        assert all(r["evicted"] > 0 and r["rounds"] >= 3 for r in vase)
        assert sum(vase[0]["kl"]) > 0 and vase[0]["kl"] != vase[1]["kl"]
    summary = json.loads((out / "summary.json").read_text())
    assert "full:model" not in summary["arms"]  # the reference is not an arm
    assert set(summary["pairs"]) == {f"vase-attnv@16/w4:{kv} - vase-attnv@16/w4:model"
                                     for kv in ("fp8_e4m3", "fp8_e5m2")}
    assert (out / "fp8_kv_kl.png").stat().st_size > 0
    # A rerun finds every replay recorded and runs none.
    assert fp8_kv_kl.main(argv) == 0
    assert len((out / "records.jsonl").read_text().splitlines()) == len(rows)


def test_kl_against_the_reference_top_k_is_the_coarse_kl():
    """The per-step KL is accuracy_stats.coarse_kl on the reference's top-k ids: zero for the
    same distribution, positive for another one."""
    from benchmarks import accuracy_stats as st

    logp = torch.log_softmax(torch.randn(50, generator=torch.Generator().manual_seed(0)), -1)
    lp, ids = logp.topk(fp8_kv_kl.TOP_K)
    assert abs(st.coarse_kl(lp.tolist(), logp[ids].tolist())) < 1e-9
    other = torch.log_softmax(logp * 1.5, -1)
    assert st.coarse_kl(lp.tolist(), other[ids].tolist()) > 1e-3
