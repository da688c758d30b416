"""The accuracy harness' tasks and answers (benchmarks/accuracy.py): the problems (reasoning-gym,
offline, fixed seed), their GSM8K export, the prompt, and the answer extraction and check that
every arm is scored with (vase_sglang.serving.answers, shared with the frontend programs)."""

from __future__ import annotations

import json
from pathlib import Path

# The shared extractor and instruction of the frontend programs (examples/) and this harness.
# No private fallback: a second extractor would silently score answers differently.
from vase_sglang.serving import answers as _answers

# ----------------------------------------------------------------------------- problems


def load_problems(task: str, n: int, seed: int) -> list[dict]:
    try:
        import reasoning_gym as rg
    except ImportError:
        raise SystemExit("benchmarks/accuracy.py needs reasoning-gym: pip install reasoning-gym")
    ds = rg.create_dataset(task, size=n, seed=seed)
    out = []
    for i in range(n):
        item = ds[i]
        out.append({"pid": f"{task}-{seed}-{i}", "question": item["question"],
                    "answer": str(item["answer"]),
                    "cot": item["metadata"].get("answer_cot", "")})
    return out


def gsm8k_answer(cot: str, answer: str) -> str:
    """A GSM8K answer field: the chain of thought, then exactly one final `#### N` line.
    reasoning-gym's gsm_symbolic chains already end with that line (chain_sum has none), so a
    trailing `#### ...` line of the chain is dropped before the canonical one is appended; one
    that disagrees with the problem's answer is an error, not something to paper over."""
    lines = cot.strip().splitlines()
    if lines and lines[-1].lstrip().startswith("####"):
        stated = lines.pop().lstrip()[4:].strip()
        # the same number written differently ("51.0" for 51) is not a disagreement
        if not _answers.answers_equal(stated.replace(",", ""), answer.replace(",", "")):
            raise ValueError(f"chain of thought ends with '#### {stated}', answer is {answer!r}")
    body = "\n".join(lines).strip()
    return (body + "\n" if body else "") + "#### " + answer


def export_gsm8k(problems: list[dict], path: str | Path) -> None:
    """GSM8K jsonl: sglang.test.few_shot_gsm8k reads the number after '####'."""
    with open(path, "w") as f:
        for p in problems:
            f.write(json.dumps({"question": p["question"],
                                "answer": gsm8k_answer(p["cot"], p["answer"])}) + "\n")


# ----------------------------------------------------------------------------- answers


PROMPT = "{q}\n" + _answers.ANSWER_INSTRUCTION


def prompt_ids(tok, prob: dict) -> list[int]:
    """A problem's prompt tokens: the question and the answer instruction through the model's
    chat template; a recorded text's own conversation (`messages`) where it has one."""
    msgs = prob.get("messages") or [{"role": "user", "content": PROMPT.format(q=prob["question"])}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def extract_answer(text: str) -> str | None:
    """The model's final answer, normalised ("72", "2.5", "1/3"); None if it gave none."""
    return _answers.extract_answer(text)


def is_right(pred: str | None, gold: str) -> bool:
    return _answers.answers_equal(pred, gold)
