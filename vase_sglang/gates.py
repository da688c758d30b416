"""Learned retention gates (the TRIM-KV family): the gate, its file format, and loading a
file for a model, checked against it. What the server needs (patches/settings.py,
patches/model_runner.py) and the transformers reference (serving/hf_reference.py); the
training is vase_sglang.training.retention (`python -m vase_sglang.retention train`).

TRIM-KV ("Cache What Lasts", arXiv 2512.03324; code github.com/ngocbh/trimkv) gives each token,
when it is created, a retention β in (0, 1) per (layer, KV head). At time t the token's
retention is β^(t - i): eviction keeps the largest, i.e. the largest log β · (t - i) (policy
`trimkv` in policies.py).

The gate (what we chose, and why)
  log β = logsigmoid(W2 · silu(W1 · x + b1) + b2), one small MLP per layer, x the layer's
  attention input (the hidden state after input_layernorm, from which K and V are projected),
  W1 [r, hidden], W2 [H_kv, r], b2 [H_kv] initialised to `bias_init`.
  This is the reference's default gate ("rg" in modeling_trimkv_qwen3.py: Linear(hidden, 512,
  bias) -> act -> Linear(512, H_kv, no bias) + a per-head bias, logsigmoid output). Reasons:
  - the hidden state is position-free (unlike post-RoPE keys, the input of the reference's
    rg2/rg3 variants), so a token's β does not depend on where it sits;
  - it exists at token creation in every engine, prefill and decode alike, and the gate is a
    fixed-shape matmul chain: capture-safe in a CUDA graph (docs/retention.md);
  - log β (not β) is stored and used: logsigmoid does not saturate to exactly 0 where sigmoid
    rounds to 1, and the eviction score is then one multiply.
  r defaults to 32 instead of the reference's 512: our models are 10-100x smaller (hidden 576
  and 896 instead of 2048-5120) and training runs on CPU; the file stays small (Qwen2.5-0.5B:
  24 x (896 x 32 + 32 + 2 x 32 + 2) floats = 2.8 MB in float32). `--gate-hidden` changes it.
  The bias starts high (default 6: β = 0.9975, a horizon 1/(1 - β) of about 400 tokens, longer
  than our sequences), so the gated model starts as the full-cache model, as the reference's
  bias init (10-18) does for its 16K-32K contexts; lower than theirs so that Adam moves it
  within a CPU-sized number of steps.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = [
    "FORMAT", "FORMAT_VERSION", "TENSORS", "GatesError", "model_signature", "signature_hash",
    "config_hash", "RetentionGates", "expected_shapes", "save_gates", "canonical_safetensors",
    "canonicalize_gates_file", "gates_sha256", "read_metadata",
    "load_gates", "attention_modules", "recording_log_beta",
]

FORMAT = "vase-retention-gates"
FORMAT_VERSION = "1"
TENSORS = ("w1", "b1", "w2", "b2")


class GatesError(ValueError):
    """A gates file that cannot be used with this model; the message says why."""


# ------------------------------------------------------------------------ model identity


def _config_of(model_config):
    """A transformers config from a config, a model, a dict or a model folder."""
    if hasattr(model_config, "config") and not isinstance(model_config, dict):
        model_config = model_config.config
    if isinstance(model_config, (str, os.PathLike)):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_config)
    if isinstance(model_config, dict):
        return _DictConfig(model_config)
    return model_config


class _DictConfig:
    def __init__(self, d):
        self.__dict__.update(d)


def model_signature(model_config) -> dict:
    """The facts the gates depend on: architecture and every shape they touch. Only structural
    fields, so that the hash is the same in transformers and in SGLang's copy of the config."""
    c = _config_of(model_config)
    heads = int(c.num_attention_heads)
    return {
        "architecture": ",".join(getattr(c, "architectures", None) or ["?"]),
        "model_type": str(getattr(c, "model_type", "?")),
        "hidden_size": int(c.hidden_size),
        "num_hidden_layers": int(c.num_hidden_layers),
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(c, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(c, "head_dim", None) or c.hidden_size // heads),
        "intermediate_size": int(getattr(c, "intermediate_size", 0) or 0),
        "vocab_size": int(c.vocab_size),
    }


def signature_hash(sig: dict) -> str:
    return hashlib.sha256(json.dumps(sig, sort_keys=True).encode()).hexdigest()[:16]


def config_hash(model_config) -> str:
    return signature_hash(model_signature(model_config))


# ------------------------------------------------------------------------ the gates


class RetentionGates(torch.nn.Module):
    """The gates of every layer, stacked: w1 [L, r, hidden], b1 [L, r], w2 [L, H_kv, r],
    b2 [L, H_kv]. `log_beta(layer, x)`: x [..., hidden] -> log β [..., H_kv] in float32."""

    def __init__(self, layers: int, hidden_size: int, kv_heads: int, gate_hidden: int = 32,
                 bias_init: float = 6.0, seed: int = 0, init_std: float = 0.02):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.w1 = torch.nn.Parameter(torch.randn(layers, gate_hidden, hidden_size, generator=gen) * init_std)
        self.b1 = torch.nn.Parameter(torch.zeros(layers, gate_hidden))
        self.w2 = torch.nn.Parameter(torch.randn(layers, kv_heads, gate_hidden, generator=gen) * init_std)
        self.b2 = torch.nn.Parameter(torch.full((layers, kv_heads), float(bias_init)))

    @property
    def layers(self) -> int:
        return self.w1.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.w2.shape[1]

    @property
    def hidden_size(self) -> int:
        return self.w1.shape[2]

    @property
    def gate_hidden(self) -> int:
        return self.w1.shape[1]

    def log_beta(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        h = F.silu(F.linear(x, self.w1[layer], self.b1[layer]))
        return F.logsigmoid(F.linear(h, self.w2[layer], self.b2[layer]))

    forward = log_beta

    @classmethod
    def for_model(cls, model_config, **kwargs) -> "RetentionGates":
        sig = model_signature(model_config)
        return cls(sig["num_hidden_layers"], sig["hidden_size"], sig["num_key_value_heads"], **kwargs)


def expected_shapes(sig: dict, gate_hidden: int) -> dict[str, tuple[int, ...]]:
    layers, hidden, heads = sig["num_hidden_layers"], sig["hidden_size"], sig["num_key_value_heads"]
    return {"w1": (layers, gate_hidden, hidden), "b1": (layers, gate_hidden),
            "w2": (layers, heads, gate_hidden), "b2": (layers, heads)}


def save_gates(path, gates: RetentionGates, model_config, **info) -> Path:
    """Write `gates` for the model of `model_config` (safetensors; metadata names the model).
    `info`: extra string metadata (training settings)."""
    from safetensors.torch import save

    sig = model_signature(model_config)
    if (gates.layers, gates.hidden_size, gates.kv_heads) != (
            sig["num_hidden_layers"], sig["hidden_size"], sig["num_key_value_heads"]):
        raise GatesError(f"retention gates: shapes (layers {gates.layers}, hidden "
                         f"{gates.hidden_size}, kv heads {gates.kv_heads}) do not fit the model "
                         f"{_describe(sig)}")
    meta = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "config_hash": signature_hash(sig),
        "architecture": sig["architecture"], "model_type": sig["model_type"],
        "layers": str(sig["num_hidden_layers"]), "kv_heads": str(sig["num_key_value_heads"]),
        "hidden_size": str(sig["hidden_size"]), "gate_hidden": str(gates.gate_hidden),
        "signature": json.dumps(sig, sort_keys=True),
        "gate": "log_beta = logsigmoid(w2 @ silu(w1 @ x + b1) + b2); x = attention input "
                "(after input_layernorm)",
    }
    meta.update({k: str(v) for k, v in info.items()})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: getattr(gates, name).detach().float().contiguous() for name in TENSORS}
    _write_atomic(path, canonical_safetensors(save(tensors, metadata=meta)))
    return path


def canonical_safetensors(raw: bytes) -> bytes:
    """The same safetensors file with its header's keys sorted. safetensors writes the header
    from a hash map whose order changes with every process, so the same gates saved twice
    differed in their bytes, and in the SHA-256 benchmarks record as the gates' identity. The
    tensors' data offsets are relative to the end of the header: they do not change."""
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the 8-byte alignment safetensors itself pads to
    return len(text).to_bytes(8, "little") + text + raw[8 + n:]


def canonicalize_gates_file(path) -> bool:
    """Rewrite a gates file written before its bytes were canonical (same tensors, same
    metadata); True when it was rewritten."""
    path = Path(path)
    raw = path.read_bytes()
    canon = canonical_safetensors(raw)
    if canon == raw:
        return False
    _write_atomic(path, canon)
    return True


def gates_sha256(path) -> str:
    """A gates file's SHA-256: the gates' name in benchmark records (canonical bytes make it
    the same for the same tensors and metadata)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)  # a reader (a server starting) never sees half a file


def _describe(sig: dict) -> str:
    return (f"{sig['architecture']} ({sig['num_hidden_layers']} layers, "
            f"{sig['num_key_value_heads']} KV heads, hidden {sig['hidden_size']})")


def read_metadata(path) -> dict:
    from safetensors import safe_open

    path = Path(path)
    if not path.exists():
        raise GatesError(f"retention gates: {path}: no such file (train them with "
                         f"`python -m vase_sglang.retention train --model ...`)")
    if not path.is_file():
        raise GatesError(f"retention gates: {path} is not a file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            meta["_tensors"] = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as err:  # safetensors raises its own error types for a corrupt header
        raise GatesError(f"retention gates: {path} is not a readable safetensors file: "
                         f"{err}") from None
    if meta.get("format") != FORMAT:
        raise GatesError(f"retention gates: {path} is not a {FORMAT} file (metadata format "
                         f"{meta.get('format')!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise GatesError(f"retention gates: {path} has format version "
                         f"{meta.get('format_version')!r}; this version reads {FORMAT_VERSION!r}")
    return meta


def load_gates(path, model_config) -> RetentionGates:
    """The gates in `path`, checked against the model (a transformers config, model, dict or
    model folder). Raises GatesError naming the file and the mismatch: missing or unreadable
    file, gates of another model, or tensors of the wrong shapes."""
    from safetensors.torch import load_file

    meta = read_metadata(path)
    sig = model_signature(model_config)
    if meta.get("config_hash") != signature_hash(sig):
        try:
            theirs = _describe(json.loads(meta.get("signature", "")))
        except (ValueError, KeyError, TypeError):
            theirs = meta.get("architecture", "?")
        raise GatesError(
            f"retention gates: {path} were trained for another model: {theirs}, config hash "
            f"{meta.get('config_hash')}; this model is {_describe(sig)}, config hash "
            f"{signature_hash(sig)}. Train gates for this model.")
    try:
        gate_hidden = int(meta["gate_hidden"])
    except (KeyError, ValueError):
        raise GatesError(f"retention gates: {path}: metadata has no valid gate_hidden") from None
    want = expected_shapes(sig, gate_hidden)
    have = meta["_tensors"]
    for name, shape in want.items():
        if name not in have:
            raise GatesError(f"retention gates: {path}: tensor {name!r} is missing "
                             f"(has {sorted(have)})")
        if tuple(have[name]) != shape:
            raise GatesError(f"retention gates: {path}: tensor {name!r} has shape "
                             f"{tuple(have[name])}, expected {shape} for {_describe(sig)} "
                             f"with gate_hidden {gate_hidden}")
    tensors = load_file(str(path))
    gates = RetentionGates(sig["num_hidden_layers"], sig["hidden_size"],
                           sig["num_key_value_heads"], gate_hidden)
    with torch.no_grad():
        for name in TENSORS:
            t = tensors[name]
            if not t.is_floating_point() or not torch.isfinite(t).all():
                raise GatesError(f"retention gates: {path}: tensor {name!r} is not finite "
                                 f"floating point")
            getattr(gates, name).copy_(t)
    gates.requires_grad_(False)
    return gates


def attention_modules(model) -> list[torch.nn.Module]:
    """The self-attention module of every layer, by layer index (Llama-style families)."""
    found = {m.layer_idx: m for m in model.modules()
             if hasattr(m, "layer_idx") and hasattr(m, "k_proj") and hasattr(m, "v_proj")}
    layers = model.config.num_hidden_layers
    if sorted(found) != list(range(layers)):
        raise ValueError(f"model: expected attention modules for layers 0..{layers - 1}, found "
                         f"{sorted(found)}")
    return [found[i] for i in range(layers)]


@contextlib.contextmanager
def recording_log_beta(model, gates: RetentionGates, sink: dict):
    """While active, every forward of the model stores sink[layer] = log β [B, T, H_kv] of the
    tokens it processes, computed from the attention input (hooks removed on exit)."""

    def hook_for(layer):
        def hook(module, args, kwargs):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            sink[layer] = gates.log_beta(layer, x)
        return hook

    handles = [m.register_forward_pre_hook(hook_for(i), with_kwargs=True)
               for i, m in enumerate(attention_modules(model))]
    try:
        yield sink
    finally:
        for h in handles:
            h.remove()
