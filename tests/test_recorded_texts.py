"""Teacher-forced replay of text the served model did not write (--task champ): which recorded
solution is chosen, in which conversation, and the accuracy harness replaying it through the
real server (tiny model, a CHAMP-format file written here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed

from benchmarks import accuracy as acc  # noqa: E402
from benchmarks.recorded_texts import champ_texts  # noqa: E402


def _words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i % 7}" for i in range(n))


def _conv(model: str, text: str | None, error=None, shots: int = 0) -> dict:
    msgs = [{"role": "System", "text": "You are an expert on mathematics.", "error": None}]
    for i in range(shots):  # few-shot turns recorded as Imputation
        msgs += [{"role": "User", "text": f"example {i}", "error": None},
                 {"role": "Imputation", "text": f"solution {i}", "error": None}]
    msgs += [{"role": "User", "text": "Solve the following problem.", "error": None},
             {"role": f"Model.{model}", "text": text, "error": error},
             {"role": "User", "text": "Now, summarize the answer above.", "error": None},
             {"role": f"Model.{model}", "text": _words(400, "s"), "error": None}]
    return {"messages": msgs}


def _champ_file(tmp_path: Path) -> Path:
    problems = {
        # the longest complete GPT-4 Turbo turn wins; the longer one cut at its limit is skipped
        "P_A_1": {"0-Shot": _conv("GPT-4 Turbo", _words(60, "a")),
                  "5-Shot": _conv("GPT-4 Turbo", _words(90, "b"), shots=2),
                  "1/3 Soln": _conv("GPT-4 Turbo", _words(300, "c"), error="LENGTH_CURRENT")},
        "P_A_2": {"0-Shot": _conv("GPT-4 Turbo", _words(10, "d"))},  # too short
        "P_A_3": {"0-Shot": _conv("GPT-4", _words(200, "e"))},  # another model's
        "P_A_4": {"0-Shot": _conv("GPT-4 Turbo", _words(70, "f"))},
    }
    data = {"problems": {
        k: {"identifier": k, "_text": f"problem {k}", "_answer": "1",
            "conversations": {f"{m}|{s}": c for s, c in convs.items()
                              for m in ["GPT-4" if k == "P_A_3" else "GPT-4 Turbo"]}}
        for k, convs in problems.items()}, "concepts": {}, "hints": {}}
    path = tmp_path / "v0.json"
    path.write_text(json.dumps(data))
    return path


def test_the_longest_complete_solution_is_replayed_in_its_own_conversation(tmp_path, tokenizer):
    path = _champ_file(tmp_path)
    texts = champ_texts(tokenizer, 2, seed=1, min_tokens=40, path=path)
    by_pid = {t["pid"]: t for t in texts}
    assert set(by_pid) == {"champ-P_A_1", "champ-P_A_4"}
    a = by_pid["champ-P_A_1"]
    assert a["setting"] == "5-Shot" and a["text"].startswith("b0 b1")
    assert a["text_tokens"] == len(tokenizer(a["text"], add_special_tokens=False)["input_ids"])
    # the prompt is the conversation before the solution, few-shot turns as assistant turns
    assert [m["role"] for m in a["messages"]] == ["system", "user", "assistant", "user",
                                                  "assistant", "user"]
    assert a["messages"][-1]["content"] == "Solve the following problem."
    # another seed, the same set in another order; more than there are is refused
    assert {t["pid"] for t in champ_texts(tokenizer, 2, seed=2, min_tokens=40, path=path)} == \
        set(by_pid)
    with pytest.raises(SystemExit, match="2 GPT-4 Turbo solutions of at least 40 tokens, 3"):
        champ_texts(tokenizer, 3, seed=1, min_tokens=40, path=path)
    assert [t["pid"] for t in champ_texts(tokenizer, 1, 1, 40, "GPT-4", path)] == ["champ-P_A_3"]


def test_champ_runs_only_the_teacher_forced_stages(tmp_path):
    base = ["run", "--model-path", "M", "--out", str(tmp_path), "--task", "champ"]
    assert acc.parse_args(base + ["--stages", "tf:4,curve"]).task == "champ"
    for stages in ("greedy", "tf,sweep"):
        with pytest.raises(SystemExit):
            acc.parse_args(base + ["--stages", stages])
    with pytest.raises(SystemExit):
        acc.parse_args(["throughput", "--model-path", "M", "--task", "champ"])


def test_no_ablations_keeps_the_plain_arms(tmp_path):
    base = ["run", "--model-path", "M", "--out", str(tmp_path), "--policies", "vase-attnv,snapkv"]
    assert [x.setting for x in acc.stage_arms("tf", acc.parse_args(base + ["--no-ablations"]))] \
        == ["full", "vase-attnv@64/w16", "snapkv@64/w16"]
    assert "vase-attnv@64/w16/nv0" in [x.setting for x in acc.stage_arms(
        "tf", acc.parse_args(base))]


def test_recorded_texts_are_replayed_through_the_server(tiny_model_fp32, tokenizer, tmp_path):
    path = _champ_file(tmp_path)
    out = tmp_path / "acc"
    forced_len = 48
    a = acc.parse_args(["run", "--model-path", tiny_model_fp32, "--out", str(out),
                        "--task", "champ", "--champ-file", str(path), "--stages", "tf",
                        "--tf-n", "2", "--max-new-tokens", str(forced_len), "--budget", "16",
                        "--window", "4", "--policies", "vase-attnv", "--no-ablations",
                        "--max-total-tokens", "4096", "--concurrency", "4", "--threads", "1",
                        "--boot-iters", "100"])
    h = acc.Harness(a)
    try:
        summary = acc.run_stages(h)
    finally:
        h.close()
    rows = acc.Records(out / "records.jsonl").rows
    texts = {t["pid"]: t for t in champ_texts(tokenizer, 2, 123, forced_len, path=path)}
    # no greedy generation: the replayed tokens are the recorded text's first forced_len
    assert {r["arm"] for r in rows.values()} == {"full:greedy:tf", "vase-attnv@16/w4:greedy:tf"}
    for pid, t in texts.items():
        full, pol = rows[f"full:greedy:tf|{pid}"], rows[f"vase-attnv@16/w4:greedy:tf|{pid}"]
        assert full["n_tokens"] == pol["n_tokens"] == forced_len
        assert len(pol["kl"]) == forced_len and pol["kv_evicted"] > 0
        forced = tokenizer(t["text"], add_special_tokens=False)["input_ids"][:forced_len]
        # the full cache's top-1 at a step is compared with the recorded token there
        agree = sum(int(ids[0] == tok) for ids, tok in zip(full["ref_ids"], forced))
        assert sum(full["top1_agree"]) == agree
    # the prompt is the recorded conversation through the chat template
    p = next(iter(texts.values()))
    assert h.prompt_ids(p) == acc.prompt_ids(tokenizer, p)
    assert "Solve the following problem." in tokenizer.decode(acc.prompt_ids(tokenizer, p))
    assert summary and not (out / "champ.gsm8k.jsonl").exists()
