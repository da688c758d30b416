"""benchmarks/batch_step_profile.py: the products it times are the model's own, and a small run
writes its figures (fast: the tiny model's shapes)."""

import json
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # benchmarks/ is not installed

from benchmarks import batch_step_profile as bp  # noqa: E402


def weight_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def test_shapes_are_the_models_weights_fused_as_sglang_fuses_them(tiny_model):
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    weights = weight_shapes(tiny_model)
    layer, head = bp.linear_shapes(config)

    def w(name):  # (out, in) of layer 0's projection
        return weights[f"model.layers.0.{name}.weight"]

    q, k, v = w("self_attn.q_proj"), w("self_attn.k_proj"), w("self_attn.v_proj")
    gate, up, down, o = w("mlp.gate_proj"), w("mlp.up_proj"), w("mlp.down_proj"), w("self_attn.o_proj")
    assert layer == [("qkv", q[1], q[0] + k[0] + v[0]), ("o", o[1], o[0]),
                     ("gate_up", gate[1], gate[0] + up[0]), ("down", down[1], down[0])]
    lm = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    assert head == (lm[1], lm[0])


def test_a_small_run_writes_one_row_per_batch_size(tiny_model, tmp_path):
    assert bp.main(["--model", tiny_model, "--batch-sizes", "1", "3", "--repeats", "3",
                    "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "batch_step_profile.json").read_text())
    assert (tmp_path / "batch_step_profile.png").stat().st_size > 0
    assert [r["batch"] for r in result["rows"]] == [1, 3]
    for r in result["rows"]:
        assert 0 < r["min_ms"] <= r["step_ms"] <= r["max_ms"] and r["repeats"] == 3
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / (r["step_ms"] / 1000))
    assert result["machine"]["server_threads"] == 1 and result["dtype"] == "float32"


def test_bad_arguments_are_refused():
    for argv in (["--threads", "0"], ["--batch-sizes", "0"], ["--layers", "-1"]):
        with pytest.raises(SystemExit):
            bp.parse_args(argv)


def test_an_earlier_profile_is_drawn_beside_and_a_wrong_one_refused_first(tiny_model, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    assert bp.main(["--model", tiny_model, "--batch-sizes", "1", "2", "--repeats", "1",
                    "--out", str(first)]) == 0
    earlier = first / "batch_step_profile.json"
    assert bp.main(["--model", tiny_model, "--batch-sizes", "1", "2", "--repeats", "1",
                    "--out", str(second), "--compare", str(earlier)]) == 0
    result = json.loads((second / "batch_step_profile.json").read_text())
    assert result["compared"] == [str(earlier)]
    assert bp.profile_label(result).endswith(result["date_utc"][:10])
    assert (second / "batch_step_profile.png").stat().st_size > 0
    (tmp_path / "bad.json").write_text('{"rows": []}')
    with pytest.raises(SystemExit, match="not a batch_step_profile.json"):
        bp.main(["--model", "/nonexistent", "--compare", str(tmp_path / "bad.json"),
                 "--out", str(tmp_path / "never")])
    assert not (tmp_path / "never").exists()
