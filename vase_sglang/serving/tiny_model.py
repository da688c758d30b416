"""A tiny random Qwen3 (GQA, 2 layers) with its own byte-level BPE tokenizer, built locally in
seconds: the default model of tests and demos on machines that cannot reach a model hub.

    python -m vase_sglang.serving.tiny_model [OUT_DIR]      # prints the model directory

Deterministic: the same arguments give byte-identical weights and tokenizer.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny tokenizer for testing SGLang on CPU.",
    "user assistant system: What is the capital of France? Paris is the capital.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "KV cache eviction policy radix tree prefix sharing memory pool token",
] * 50
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def default_dir() -> Path:
    base = os.environ.get("VASE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "vase-sglang")
    return Path(base) / "tiny-qwen3"


def build_tiny_qwen3(
    out: str | os.PathLike | None = None,
    *,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    hidden: int = 128,
    vocab: int = 1024,
    dtype: str = "bfloat16",
    seed: int = 0,
    init_std: float | None = None,
    attention_multiplier: float | None = None,
) -> Path:
    """Build (or reuse) the model directory and return its path. With `attention_multiplier`
    the model is a Granite instead (Qwen3's layout without q/k norms) whose attention logits
    are q . k * attention_multiplier rather than / sqrt(head_dim)."""
    out = Path(out) if out is not None else default_dir()
    spec = dict(layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim, hidden=hidden,
                vocab=vocab, dtype=dtype, seed=seed, init_std=init_std)
    if attention_multiplier is not None:
        spec["attention_multiplier"] = attention_multiplier
    stamp = out / "vase_tiny_model.json"
    if stamp.exists() and json.loads(stamp.read_text()) == spec:
        return out

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import (
        GraniteConfig,
        GraniteForCausalLM,
        PreTrainedTokenizerFast,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=min(1000, vocab - 24), special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                     pad_token="<|endoftext|>", unk_token=None,
                                     model_max_length=32768)
    hf_tok.chat_template = CHAT_TEMPLATE
    # Plain filler tokens so that every id the model can sample decodes to text.
    hf_tok.add_tokens([f"<x{i}>" for i in range(vocab - len(hf_tok))])
    hf_tok.save_pretrained(out)

    config_cls, model_cls, extra = Qwen3Config, Qwen3ForCausalLM, {"head_dim": head_dim}
    if attention_multiplier is not None:
        if hidden != heads * head_dim:
            raise ValueError("Granite: head_dim is hidden / heads")
        config_cls, model_cls = GraniteConfig, GraniteForCausalLM
        extra = {"attention_multiplier": attention_multiplier}
    cfg = config_cls(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=32768, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, torch_dtype=dtype, **extra,
        bos_token_id=hf_tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=hf_tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=hf_tok.convert_tokens_to_ids("<|endoftext|>"),
        **({"initializer_range": init_std} if init_std is not None else {}),
    )
    torch.manual_seed(seed)
    model = model_cls(cfg).to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(spec))
    return out


if __name__ == "__main__":
    print(build_tiny_qwen3(sys.argv[1] if len(sys.argv) > 1 else None))
