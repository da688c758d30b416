"""benchmarks/value_profile.py on the tiny model: the CLI writes its JSON/PNG/table, and its
per-layer numbers equal Range(v) computed independently from v_proj outputs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "value_profile.py"


def _module():
    spec = importlib.util.spec_from_file_location("value_profile", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ranges_match_v_proj_hooks(tiny_model_fp32):
    from transformers import AutoModelForCausalLM

    vp = _module()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_fp32, dtype=torch.float32).eval()
    cfg = model.config
    seqs = [list(range(5, 45)), list(range(100, 123))]
    # independent path: the value projection's output, reshaped per KV head
    captured = []
    hooks = [layer.self_attn.v_proj.register_forward_hook(lambda m, i, o: captured.append(o))
             for layer in model.model.layers]
    expected = []
    for ids in seqs:
        captured.clear()
        with torch.no_grad():
            model(torch.tensor([ids]))
        per_layer = []
        for o in captured:
            v = o[0].view(len(ids), cfg.num_key_value_heads, -1).transpose(0, 1)  # [H, n, D]
            per_layer.append(v.amax(-1) - v.amin(-1))
        expected.append(per_layer)
    for h in hooks:
        h.remove()
    got = [vp.value_ranges(model, ids) for ids in seqs]
    for g, e in zip(got, expected):
        for gl, el in zip(g, e):
            torch.testing.assert_close(gl, el)
    layers = vp.summarize(got, sinks=4)
    assert len(layers) == cfg.num_hidden_layers
    for li, row in enumerate(layers):
        allv = torch.cat([e[li].reshape(-1) for e in expected])
        assert row["max"] == allv.max().item()
        assert abs(row["median"] - allv.median().item()) < 1e-6
        assert row["median"] <= row["p99"] <= row["max"]
        assert row["tokens"] == sum(len(s) for s in seqs) and row["kv_heads"] == cfg.num_key_value_heads
        # where the max sits, read back from the independent tensors
        am = row["argmax"]
        assert expected[am["sequence"]][li][am["kv_head"], am["position"]].item() == row["max"]


def test_sink_statistics():
    vp = _module()
    # one layer, one head: a huge range at position 1 (a sink) and a moderate one at 10
    r = torch.ones(1, 1, 200)
    r[0, 0, 1] = 50.0
    r[0, 0, 10] = 5.0
    (row,) = vp.summarize([[r[0]]], sinks=4, top_share=0.01)  # top 1 % of 200 = 2 tokens
    assert row["argmax"]["position"] == 1 and row["max_over_median"] == 50.0
    assert row["top1pct_share_in_sinks"] == 0.5
    assert row["max_over_median_no_sinks"] == 5.0


def test_cli_on_tiny_model(tiny_model, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", tiny_model, "--prompts", "2",
                           "--gen-tokens", "6", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "value_profile.json").read_text())
    assert result["sequences"] == 2 and len(result["layers"]) == 2
    assert (tmp_path / "value_profile.png").stat().st_size > 10_000
    assert "max/median" in proc.stdout and "top1% in sinks" in proc.stdout
    lo, hi = result["max_over_median_range"]
    assert 1.0 <= lo <= hi
