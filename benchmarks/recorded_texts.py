"""Long reasoning text the served model did not write, for teacher-forced replay.

CHAMP (`pip install champ-dataset==1.0.0`, MIT; Mao et al. 2024, "CHAMP: A Competition-level
Dataset for Fine-Grained Analyses of LLMs' Mathematical Reasoning Capabilities") ships, for each
of its 270 competition problems, the conversations of four models (GPT-3.5, GPT-4, GPT-4 Turbo,
PaLM 2 Medium) under 18 prompt settings (0-shot, 5-shot, partial solutions, concept hints, ...).
`champ_texts` picks, per problem, one model's longest complete solution (the first model turn of
a conversation; turns the recording marks as cut at its length limit are skipped) that has at
least `min_tokens` tokens under the served model's tokenizer, and returns it with the
conversation before it (system, user, few-shot turns) as the prompt: the text is replayed in
the context it was written in. Selection is deterministic: problems in a fixed order, shuffled
by `seed`.

GPT-4 Turbo's are the longest complete ones (with Qwen2.5's tokenizer: 150 of the 270 problems
have one of at least 1,024 tokens, 60 of 1,536, 37 of 2,048).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CHAMP_MODELS = ("GPT-4 Turbo", "GPT-4", "GPT-3.5", "PaLM 2 Medium")
ROLES = {"System": "system", "User": "user", "Imputation": "assistant"}


def champ_file() -> Path:
    """The dataset file of the installed champ-dataset package."""
    try:
        import champ_dataset
    except ImportError:
        raise SystemExit("--task champ needs the CHAMP dataset: pip install champ-dataset==1.0.0 "
                         "(or pass --champ-file v0.json)") from None
    path = Path(champ_dataset.__file__).parent / "dataset_files" / "v0.json"
    if not path.is_file():
        raise SystemExit(f"champ-dataset is installed but has no {path}")
    return path


def _chat(messages: list[dict]) -> list[dict]:
    """CHAMP roles -> chat-template roles (a model's own turns become assistant turns)."""
    out = []
    for m in messages:
        role = ROLES.get(m["role"], "assistant" if m["role"].startswith("Model.") else None)
        if role is None:
            raise ValueError(f"unknown CHAMP role {m['role']!r}")
        out.append({"role": role, "content": m["text"]})
    return out


def champ_texts(tok, n: int, seed: int, min_tokens: int, model: str = "GPT-4 Turbo",
                path: str | Path | None = None) -> list[dict]:
    """n problems, each with one recorded solution of `model` of >= min_tokens tokens: dicts
    with pid, question, answer, messages (the prompt conversation), text (the solution),
    text_tokens and setting (CHAMP's prompt setting). Fewer than n available is an error."""
    if model not in CHAMP_MODELS:
        raise SystemExit(f"--champ-model: one of {', '.join(CHAMP_MODELS)}")
    data = json.loads(Path(path or champ_file()).read_text())
    chosen = []
    for ident in sorted(data["problems"]):
        prob = data["problems"][ident]
        best = None
        for key in sorted(prob.get("conversations", {})):
            who, _, setting = key.partition("|")
            if who != model:
                continue
            msgs = prob["conversations"][key]["messages"]
            turn = next((i for i, m in enumerate(msgs) if m["role"].startswith("Model.")), None)
            if turn is None or not msgs[turn]["text"] or msgs[turn].get("error") is not None:
                continue
            n_tok = len(tok(msgs[turn]["text"], add_special_tokens=False)["input_ids"])
            if n_tok >= min_tokens and (best is None or n_tok > best["text_tokens"]):
                best = {"pid": f"champ-{ident}", "question": prob["_text"],
                        "answer": prob.get("_answer", ""), "messages": _chat(msgs[:turn]),
                        "text": msgs[turn]["text"], "text_tokens": n_tok, "setting": setting}
        if best is not None:
            chosen.append(best)
    random.Random(seed).shuffle(chosen)
    if len(chosen) < n:
        raise SystemExit(f"CHAMP has {len(chosen)} {model} solutions of at least {min_tokens} "
                         f"tokens, {n} asked: lower --max-new-tokens or --tf-n")
    return chosen[:n]
