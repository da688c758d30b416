"""Correct answers per hour at the same KV memory, with natural stopping (issue 60).

The question a user asks before turning eviction on: on this machine and this KV pool, how many
correct answers an hour, and how long does each user wait? Fixed-length benchmarks (ignore_eos)
cannot show an eviction that makes answers longer; here every request stops on its own (EOS, or
the accuracy harness' max_new_tokens), greedy.

Every arm gets its own server with the same pool (--max-total-tokens) and answers the accuracy
harness' problems (reasoning-gym gsm_symbolic, its prompts and answer checking), streamed:

  workloads  all        every problem submitted at once
             poisson    the same problems arriving as a Poisson process at --rate requests/s
                        (seeded by --arrival-seed + the round: every arm of a round gets the
                        same arrival times, each round other ones)
             multiturn  (--multi-turn N) N two-turn conversations, all started at once: turn 2
                        sends turn 1's conversation back with "Now double your answer." and is
                        checked against twice the gold answer; stock and --multi-turn-arm only
  arms       stock (no plugin flags) and POLICY:FLAG=VALUE:... with FLAG a --kv-evict-* suffix,
             e.g. vase-attnv:budget=64:mode=elastic, trimkv:budget=64:budget-scope=global
             (budget default --budget, window default budget / 4; trimkv needs --gates, whose
             SHA-256 every trimkv record carries)
  rounds     --rounds paired rounds: each round runs every arm once, one server per arm, the
             arms' order rotated by one every round (round r starts with arm r), so a machine
             that drifts does so under every arm alike and every round pairs each arm with stock

Per (workload, arm) over the finished rounds (summary.json, summary.md, answers_per_hour.png):
correct answers, correct answers per hour (with a bootstrap interval resampling problems and
rounds; relative to stock, paired: the same problems and rounds for both arms, and round by
round), wall time, output tokens per answer (mean, p90, and against stock's for the same
problem: the paired mean difference with a bootstrap interval), TTFT / inter-token / end-to-end
latency p50 and p90 (client side, the stream's chunks), peak and mean running requests (server
decode log), retractions (meta_info.num_retractions, and the log's count), the eviction step's
share of wall time (vase:eviction_seconds), exact McNemar against stock (the first round both
finished, and each round's p). Multi-turn: turn 1 and turn 2 accuracy, turn 2 consistent with
turn 1 (twice its answer), the prompt tokens the server found cached in turn 2
(meta_info.cached_tokens) against what turn 1 left (its prompt and answer), what turn 2
prefilled again, turn-2 TTFT.

Records: one JSONL per (arm, round, workload) in OUT/records/, a row appended as each request
(conversation) finishes and one per segment (a run, or what a restart ran of it) with the
server's figures. The same command again resumes: finished problems are skipped, a cut run is
completed by a new segment (its wall time is the sum of its segments' times to their last answer,
so the work in flight when it was cut is not counted; the summary names such runs), a finished
run starts no server. A folder's records refuse other settings (model, pool, lengths, rate,
seeds, ...: config.json). `report` rebuilds the summary from the records at any time.

    python benchmarks/answers_per_hour.py run --model-path M --out results/answers_per_hour \\
        --problems 60 --max-total-tokens 2048 --rounds 3 --rate 0.03 --multi-turn 40 \\
        --arms stock vase-attnv:budget=128 vase-attnv:budget=64 ...
    python benchmarks/answers_per_hour.py report --out results/answers_per_hour

docs/answers_per_hour.md: the real model's command, its expected duration, what it measures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import accuracy as acc  # noqa: E402
from benchmarks import accuracy_stats as st  # noqa: E402
from benchmarks import concurrency_scaling as cs  # noqa: E402
from benchmarks import elastic_load as el  # noqa: E402
from benchmarks import paired_runs  # noqa: E402
from benchmarks._server import BenchServer, sigterm_exits  # noqa: E402
from benchmarks.accuracy_harness import refuse_other_settings  # noqa: E402

STOCK = "stock"
WORKLOADS = ("all", "poisson", "multiturn")
DEFAULT_ARMS = (STOCK, "vase-attnv:budget=128", "vase-attnv:budget=64",
                "vase-attnv:budget=64:mode=elastic")
# the accuracy harness' length limit, so answers stop where its accuracy figures stopped them
ACCURACY_MAX_NEW_TOKENS = acc.parse_args(["run", "--model-path", "-"]).max_new_tokens
FOLLOW_UP = "Now double your answer.\n" + acc._answers.ANSWER_INSTRUCTION
# what a record means beyond its arm, round and workload: a resume must not mix other settings
# (and the processor: a CPU's decode step follows its batch curve, notes/2026-12-05-two-processors.md)
RUN_IDENTITY = ("model_path", "task", "seed", "max_new_tokens", "max_total_tokens",
                "max_running", "dtype", "threads", "server_args", "rate", "arrival_seed", "cpu")


# ----------------------------------------------------------------------------- arms


@dataclass(frozen=True)
class Arm:
    """stock SGLang, or one eviction setting: what a server of the arm is started with."""

    policy: str | None = None
    budget: int = 0
    window: int = 0
    more: tuple[str, ...] = ()  # further --kv-evict-* flags, as "flag=value"

    @property
    def evicts(self) -> bool:
        return self.policy is not None

    @property
    def name(self) -> str:
        """The arm's spec with its defaults filled in: how records and tables name it."""
        if not self.evicts:
            return STOCK
        return ":".join([self.policy, f"budget={self.budget}", f"window={self.window}",
                         *self.more])

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9]+", "_", self.name).strip("_")

    @property
    def needs_gates(self) -> bool:
        from vase_sglang.policies import needs_gates

        return self.evicts and needs_gates(self.policy)

    def flags(self, seed: int, gates: str | None) -> list[str]:
        if not self.evicts:
            return []
        flags = ["--kv-evict-policy", self.policy, "--kv-evict-budget", str(self.budget),
                 "--kv-evict-window", str(self.window), "--kv-evict-seed", str(seed)]
        for item in self.more:
            key, _, value = item.partition("=")
            flags += [f"--kv-evict-{key}", value]
        if self.needs_gates:
            flags += ["--kv-evict-retention-gates", str(Path(gates).resolve())]
        return flags


def parse_arm(spec: str, budget: int) -> Arm:
    """`stock`, or POLICY[:FLAG=VALUE...] as concurrency_scaling's --policies (budget default
    `budget`, window default budget / 4, as the accuracy harness' sweep)."""
    if spec == STOCK:
        return Arm()
    from vase_sglang.policies import policy_names

    policy, b, w, more = cs.policy_spec(spec, argparse.Namespace(budget=budget, window=None))
    if policy not in policy_names():
        raise ValueError(f"{spec!r}: unknown policy {policy!r}; choose from "
                         f"{', '.join(policy_names())}")
    flags = [f"{more[i][len('--kv-evict-'):]}={more[i + 1]}" for i in range(0, len(more), 2)]
    return Arm(policy, b, acc.window_for(b) if w is None else w, tuple(flags))


def rotated(arms: list, rnd: int) -> list:
    """The arms' order in round `rnd`: rotated by one per round."""
    k = rnd % len(arms)
    return arms[k:] + arms[:k]


def arm_workloads(arm: Arm, a) -> list[str]:
    """The workloads an arm runs: --workloads, and multiturn for stock and --multi-turn-arm."""
    extra = ["multiturn"] if a.multi_turn and arm.name in (STOCK, a.multi_turn_arm) else []
    return list(a.workloads) + extra


def schedule(workload: str, n: int, rate: float, seed: int) -> list[float]:
    """Send times (s after a run's start) of n problems: a seeded Poisson process at `rate`
    for the poisson workload, all at once for the others."""
    return el.arrival_times(n, rate if workload == "poisson" else math.inf, seed)


def segment_times(workload: str, n: int, todo: list[int], rate: float, seed: int) -> list[float]:
    """Send times of the problems `todo` (indices into the run's n, ascending) when a run is
    resumed: the run's schedule for them, shifted so that the first is sent at once."""
    times = schedule(workload, n, rate, seed)
    return [times[i] - times[todo[0]] for i in todo]


# ----------------------------------------------------------------------------- multi-turn


def conversation(prob: dict, answer_text: str) -> list[dict]:
    """Turn 2's messages: turn 1's question (the accuracy harness' prompt), the model's answer as
    it was detokenized, and the follow-up."""
    return [{"role": "user", "content": acc.PROMPT.format(q=prob["question"])},
            {"role": "assistant", "content": answer_text},
            {"role": "user", "content": FOLLOW_UP}]


def follow_up_ids(tok, prob: dict, answer_text: str) -> list[int]:
    """Turn 2's prompt tokens through the chat template, as a chat client would send them."""
    return acc.prompt_ids(tok, {"messages": conversation(prob, answer_text)})


def doubled(answer: str | None) -> str | None:
    """Twice a normalised answer ("21" -> "42", "2.5" -> "5", "1/3" -> "2/3"); None for none."""
    value = None if answer is None else acc._answers.parse_number(str(answer))
    return None if value is None else acc._answers.format_number(2 * value)


# ----------------------------------------------------------------------------- one run


class AnswerRun(el.LoadRun):
    """One segment of an (arm, round, workload) run on a running server: elastic_load's
    arrivals, streaming and server figures, with this benchmark's record rows."""

    def __init__(self, server: BenchServer, arm: Arm, workload: str, rnd: int, segment: int,
                 probs: list[dict], prompts: list[list[int]], times: list[float], a,
                 records: acc.Records):
        super().__init__(server, arm.name, a.rate if workload == "poisson" else math.inf,
                         probs, prompts, a, records)
        self.evicts = arm.evicts
        self.workload, self.round, self.segment, self.times = workload, rnd, segment, times

    def schedule(self) -> list[float]:
        return self.times

    def request_row(self, i: int, res: dict, arrival: float) -> dict:
        row = super().request_row(i, res, arrival)
        del row["output_ids"]  # the text is kept; the ids would double the records' size
        row.update(key=row["pid"], workload=self.workload, round=self.round,
                   segment=self.segment, cached_tokens=res["meta"].get("cached_tokens"),
                   num_retractions=res["meta"]["num_retractions"])
        return row

    def run_row(self, rows: list[dict], before_text: str, after_text: str, log: str) -> dict:
        row = super().run_row(rows, before_text, after_text, log)
        before, after = cs.metric_sums(before_text), cs.metric_sums(after_text)
        row.update(key=f"segment:{self.segment}", kind="segment", workload=self.workload,
                   round=self.round, segment=self.segment,
                   eviction_steps=(after.get(cs.EVICT_COUNT, 0.0) - before.get(cs.EVICT_COUNT, 0.0)
                                   if self.evicts else None))
        return row


class ConversationRun(AnswerRun):
    """Two turns per problem: turn 2 (the follow-up, sent when turn 1 is answered) re-sends
    turn 1's conversation, so the radix cache can give back what turn 1 left in it."""

    def __init__(self, *args, tok, **kwargs):
        super().__init__(*args, **kwargs)
        self.tok = tok

    def turn(self, i: int, ids: list[int], arrival: float) -> dict:
        payload = {"input_ids": ids, "sampling_params": {
            "max_new_tokens": self.a.max_new_tokens, "temperature": 0.0}}
        res = el.stream_generate(self.server.url, payload, timeout=self.a.request_timeout)
        row = self.request_row(i, res, arrival)
        return {k: v for k, v in row.items()
                if k not in ("key", "kind", "arm", "rate", "pid", "gold", "workload", "round",
                             "segment")}

    def request(self, i: int, arrival: float) -> dict:
        prob = self.probs[i]
        t0 = time.perf_counter()
        first = self.turn(i, self.prompts[i], arrival)
        sent = time.perf_counter() - t0
        second = self.turn(i, follow_up_ids(self.tok, prob, first["text"]), arrival + sent)
        gold2 = doubled(prob["answer"])
        second["correct"] = acc.is_right(second["pred"], gold2)
        second["consistent"] = (first["pred"] is not None
                                and acc.is_right(second["pred"], doubled(first["pred"])))
        return {"key": prob["pid"], "kind": "conversation", "arm": self.arm,
                "workload": self.workload, "round": self.round, "segment": self.segment,
                "pid": prob["pid"], "gold": prob["answer"], "gold2": gold2,
                "turn1": first, "turn2": second, "correct": second["correct"],
                # what elastic_load's run row reads: the conversation as one request
                "n_tokens": first["n_tokens"] + second["n_tokens"],
                "prompt_tokens": first["prompt_tokens"], "ttft": first["ttft"],
                "itl": first["itl"] + second["itl"], "latency": time.perf_counter() - t0}


# ----------------------------------------------------------------------------- records


def record_path(out: Path, arm: Arm, workload: str, rnd: int) -> Path:
    return out / "records" / f"{arm.slug}__{workload}__r{rnd}.jsonl"


def answered(rows: dict) -> dict[str, dict]:
    """A record file's finished problems (request or conversation rows) by problem id."""
    return {r["pid"]: r for r in rows.values() if r.get("kind") in ("request", "conversation")}


def check_resume(out: Path, a) -> None:
    """Refuse to add records to a folder whose records were made with other settings."""
    path = out / "config.json"
    if not path.exists() or not any((out / "records").glob("*.jsonl")):
        return
    refuse_other_settings(out, json.loads(path.read_text()), config(a), RUN_IDENTITY)


def config(a) -> dict:
    return json.loads(json.dumps({k: v for k, v in vars(a).items() if k not in ("cmd", "arm_list")},
                                 default=str))


def check_gates(rows: dict, arm: Arm, gates_sha: str | None, path: Path) -> None:
    """A trimkv run's records hold the gates' hash: records of other gates are not resumed."""
    if not arm.needs_gates:
        return
    other = {r.get("gates_sha256") for r in rows.values() if r.get("kind") == "segment"} - {gates_sha}
    if other:
        raise SystemExit(f"{path} was recorded with other retention gates ({sorted(other)}); "
                         f"--gates hashes to {gates_sha}: use another --out or those gates")


# ----------------------------------------------------------------------------- running


def load_problems(a) -> list[dict]:
    return acc.load_problems(a.task, max(a.problems, a.multi_turn), a.seed)


def run_workload(server: BenchServer, arm: Arm, workload: str, rnd: int, a, probs: list[dict],
                 prompts: list[list[int]], tok, gates_sha: str | None) -> None:
    """Run what is missing of one (arm, round, workload) run as a new segment."""
    n = a.multi_turn if workload == "multiturn" else a.problems
    path = record_path(Path(a.out), arm, workload, rnd)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = acc.Records(path)
    check_gates(records.rows, arm, gates_sha, path)
    done = answered(records.rows)
    todo = [i for i in range(n) if probs[i]["pid"] not in done]
    if not todo:
        return
    segment = 1 + max((r.get("segment", -1) for r in records.rows.values()), default=-1)
    times = segment_times(workload, n, todo, a.rate, a.arrival_seed + rnd)
    started = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "load_1min_at_start": round(os.getloadavg()[0], 2),
               "machine": cs.machine_facts(a.threads), "gates_sha256": gates_sha}
    cls, extra = (ConversationRun, {"tok": tok}) if workload == "multiturn" else (AnswerRun, {})
    print(f"round {rnd}: {arm.name}, {workload}: {len(todo)} of {n} problems"
          + (f" (segment {segment}, {len(done)} recorded)" if done else ""), file=sys.stderr)
    run = cls(server, arm, workload, rnd, segment, [probs[i] for i in todo],
              [prompts[i] for i in todo], times, a, records, **extra)
    row = run.run()
    records.add({**row, **started})
    print(f"  {len(todo)} answered in {row['wall_s']:.0f} s, {row['mean_running']:.1f} running "
          f"(peak {row['peak_running']}), {row['retractions']} retractions", file=sys.stderr)


def run(a) -> dict:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    a.cpu = cs.machine_facts(a.threads)["cpu"]
    check_resume(out, a)
    (out / "config.json").write_text(json.dumps(config(a), indent=1))
    with open(out / "runs.jsonl", "a") as f:
        f.write(json.dumps({"started": time.strftime("%Y-%m-%d %H:%M:%S"), **config(a)}) + "\n")
    from transformers import AutoTokenizer

    from vase_sglang.gates import gates_sha256

    tok = AutoTokenizer.from_pretrained(a.model_path)
    probs = load_problems(a)
    prompts = [acc.prompt_ids(tok, p) for p in probs]
    gates_sha = gates_sha256(a.gates) if a.gates else None
    for rnd in range(a.rounds):
        for arm in rotated(a.arm_list, rnd):
            todo = []
            for w in arm_workloads(arm, a):
                n = a.multi_turn if w == "multiturn" else a.problems
                done = answered(acc.Records(record_path(out, arm, w, rnd)).rows)
                if any(p["pid"] not in done for p in probs[:n]):
                    todo.append(w)
            if not todo:
                continue
            flags = (arm.flags(a.seed, a.gates)
                     + ["--random-seed", str(a.seed), "--dtype", a.dtype, "--enable-metrics",
                        "--decode-log-interval", "1"] + a.server_args.split())
            print(f"round {rnd}: {arm.name}: starting a server ({' '.join(flags)})",
                  file=sys.stderr)
            server = BenchServer(a.model_path, flags, log_path=out / f"server-{arm.slug}-r{rnd}.log",
                                 max_total_tokens=a.max_total_tokens, max_running=a.max_running,
                                 threads=a.threads, teacher_forcing=False)
            try:
                for w in todo:
                    run_workload(server, arm, w, rnd, a, probs, prompts, tok,
                                 gates_sha if arm.needs_gates else None)
            finally:
                server.stop()
            report(out, a.boot_iters)  # after every arm: partial results are usable
    return report(out, a.boot_iters)


# ----------------------------------------------------------------------------- statistics


def percentiles(xs: list[float]) -> dict:
    return {"p50": el.percentile(xs, 50), "p90": el.percentile(xs, 90)}


def answers_per_hour(correct: int | float, wall_s: float) -> float:
    return 3600.0 * correct / wall_s


def answers_per_hour_ci(correct, wall, ref_correct=None, ref_wall=None, iters: int = 10000,
                        seed: int = 0, level: float = 0.95) -> dict:
    """Correct answers per hour of rounds x problems (`correct`: one row of 0/1 per round, the
    same problems in each; `wall`: each round's seconds): the pooled figure, all correct answers
    over all wall time, and a percentile bootstrap interval resampling problems and rounds. With
    a reference (stock's rows and walls on the same problems and rounds) the ratio of the two,
    each resample drawing the same problems and rounds for both: paired. Resamples where the
    reference has no correct answer are left out of the ratio's interval (`undefined`)."""
    import numpy as np

    c = np.asarray(correct, dtype=float)
    w = np.asarray(wall, dtype=float)
    rounds, n = c.shape
    rng = np.random.default_rng(seed)
    rr = rng.integers(0, rounds, size=(iters, rounds))
    pp = rng.integers(0, n, size=(iters, n))

    def resampled(x, walls):
        picked = np.take_along_axis(x[rr], pp[:, None, :], axis=2)  # iters x rounds x problems
        return picked.sum(axis=(1, 2)), walls[rr].sum(axis=1)

    def interval(values):
        values = np.sort(values)
        if not len(values):
            return [None, None]
        k = len(values)
        return [float(values[int((1 - level) / 2 * k)]),
                float(values[min(k - 1, int((1 + level) / 2 * k))])]

    num, den = resampled(c, w)
    own = 3600.0 * num / den
    out = {"answers_per_hour": answers_per_hour(c.sum(), w.sum()), "ci95": interval(own)}
    if ref_correct is None:
        return out
    rc, rw = np.asarray(ref_correct, dtype=float), np.asarray(ref_wall, dtype=float)
    rnum, rden = resampled(rc, rw)
    ref = 3600.0 * rnum / rden
    ok = ref > 0
    ref_point = answers_per_hour(rc.sum(), rw.sum())
    out.update(ratio=out["answers_per_hour"] / ref_point if ref_point > 0 else None,
               ratio_ci95=interval(own[ok] / ref[ok]), undefined=int((~ok).sum()))
    return out


def run_figures(rows: dict[str, dict], segments: list[dict]) -> dict:
    """One (arm, round, workload) run's figures from its records (rows: the problems counted)."""
    rows_l = list(rows.values())
    ids = sorted({r["segment"] for r in rows_l})
    # each segment's time to its last answer (a cut segment's unfinished work is not counted)
    wall = sum(max(r["finished_at"] for r in rows_l if r["segment"] == s) for s in ids)
    segs = [s for s in segments if s["segment"] in ids]
    correct = sum(bool(r["correct"]) for r in rows_l)
    tokens = [r["n_tokens"] for r in rows_l]
    steps = sum(s["decode_steps"] for s in segs)
    evict = [s["eviction_seconds"] for s in segs if s.get("eviction_seconds") is not None]
    turns = ([r["turn1"] for r in rows_l] + [r["turn2"] for r in rows_l]
             if rows_l and "turn1" in rows_l[0] else rows_l)
    causes = {}
    for s in segs:
        for k, v in (s.get("evictions_by_cause") or {}).items():
            causes[k] = causes.get(k, 0.0) + v
    return {
        "n": len(rows_l), "correct": correct, "wall_s": wall,
        "answers_per_hour": answers_per_hour(correct, wall) if wall > 0 else None,
        "tokens_per_answer_mean": st.mean(tokens), "tokens_per_answer_p90": el.percentile(tokens, 90),
        "tokens_per_correct_answer": sum(tokens) / correct if correct else None,
        "finished_by_length": st.mean(r.get("finish") == "length" for r in turns),
        "ttft_s": percentiles([r["ttft"] for r in turns]),
        "itl_s": percentiles([x for r in turns for x in r["itl"]]),
        "latency_s": percentiles([r["latency"] for r in turns]),
        "peak_running": max((s["peak_running"] for s in segs), default=None),
        "mean_running": (sum(s["mean_running"] * s["decode_steps"] for s in segs) / steps
                         if steps else None),
        "retractions": sum(r["num_retractions"] for r in turns),
        "retractions_logged": sum(s["retractions"] for s in segs) if segs else None,
        "eviction_seconds": sum(evict) if evict else None,
        "eviction_share": sum(evict) / wall if evict and wall > 0 else None,
        "eviction_steps": (sum(s["eviction_steps"] for s in segs)
                           if segs and segs[0].get("eviction_steps") is not None else None),
        "evictions_by_cause": causes or None,
        "segments": len(ids),
        # a segment cut before its server figures were recorded: running, retractions logged
        # and eviction time cover only the other segments
        "server_figures_complete": len(segs) == len(ids),
        "processors": sorted({(s.get("machine") or {}).get("cpu") or "not recorded"
                              for s in segs}),
    }


def turn_figures(rows: dict[str, dict]) -> dict:
    """A multi-turn run's per-turn figures: accuracy of each turn, turn 2 consistent with turn
    1, and what the server had cached for turn 2 against what turn 1 left."""
    rows_l = list(rows.values())
    t1, t2 = [r["turn1"] for r in rows_l], [r["turn2"] for r in rows_l]
    left = [a["prompt_tokens"] + a["n_tokens"] for a in t1]  # turn 1's conversation
    cached = [b["cached_tokens"] for b in t2]
    return {
        "conversations": len(rows_l),
        "turn1_correct": sum(bool(a["correct"]) for a in t1),
        "turn2_correct": sum(bool(b["correct"]) for b in t2),
        "turn2_consistent": sum(bool(b["consistent"]) for b in t2),
        "turn1_tokens_mean": st.mean(left),
        "turn2_prompt_tokens_mean": st.mean(b["prompt_tokens"] for b in t2),
        "turn2_cached_tokens_mean": st.mean(cached),
        "turn2_cached_share_of_turn1": sum(cached) / sum(left) if left else None,
        "turn2_prefilled_tokens_mean": st.mean(b["prompt_tokens"] - b["cached_tokens"] for b in t2),
        "turn2_ttft_s": percentiles([b["ttft"] for b in t2]),
    }


def versus_stock(arm_runs: dict[int, dict], stock_runs: dict[int, dict], pids: list[str],
                 boot_iters: int) -> dict | None:
    """An arm against stock on the rounds both finished and the same problems: answers per hour
    (pooled ratio, paired bootstrap interval, round by round), output tokens per problem
    (paired), McNemar (first common round; each round's p)."""
    rounds = sorted(set(arm_runs) & set(stock_runs))
    if not rounds:
        return None

    def correct_rows(runs):
        return [[float(bool(runs[r]["rows"][p]["correct"])) for p in pids] for r in rounds]

    ci = answers_per_hour_ci(correct_rows(arm_runs), [arm_runs[r]["figures"]["wall_s"] for r in rounds],
                             correct_rows(stock_runs),
                             [stock_runs[r]["figures"]["wall_s"] for r in rounds], boot_iters)
    per_round = None
    if all(stock_runs[r]["figures"]["answers_per_hour"] for r in rounds):
        per_round = paired_runs.paired_ratio(
            [{"repeat": r, **arm_runs[r]["figures"]} for r in rounds],
            [{"repeat": r, **stock_runs[r]["figures"]} for r in rounds],
            lambda run: run["answers_per_hour"], lambda x, y: True)
    # tokens per problem, averaged over the common rounds, paired per problem
    tok_a = [st.mean(arm_runs[r]["rows"][p]["n_tokens"] for r in rounds) for p in pids]
    tok_s = [st.mean(stock_runs[r]["rows"][p]["n_tokens"] for r in rounds) for p in pids]
    diff, lo, hi = st.paired_bootstrap(tok_a, tok_s, iters=boot_iters)
    mcnemar = [st.paired_accuracy(*(
        [float(bool(runs[r]["rows"][p]["correct"])) for p in pids]
        for runs in (arm_runs, stock_runs)), iters=boot_iters) for r in rounds]
    first = mcnemar[0]
    return {"rounds": rounds, "answers_per_hour_ratio": ci["ratio"],
            "answers_per_hour_ratio_ci95": ci["ratio_ci95"],
            "resamples_without_stock_answers": ci["undefined"],
            "answers_per_hour_ratio_by_round": per_round,
            "tokens_per_answer_diff": diff, "tokens_per_answer_diff_ci95": [lo, hi],
            "tokens_per_answer_ratio": st.mean(tok_a) / st.mean(tok_s) if st.mean(tok_s) else None,
            "acc_diff": first["acc_diff"], "acc_diff_ci95": first["acc_diff_boot95"],
            "only_arm_right": first["only_a_right"], "only_stock_right": first["only_b_right"],
            "mcnemar_p": first["mcnemar_p"], "mcnemar_round": rounds[0],
            "mcnemar_p_by_round": [m["mcnemar_p"] for m in mcnemar]}


def turn_versus_stock(arm_runs: dict, stock_runs: dict, pids: list[str], boot_iters: int) -> dict | None:
    """Turn 2 against stock's on the first round both finished: accuracy (McNemar), cached and
    re-prefilled tokens per conversation (paired)."""
    rounds = sorted(set(arm_runs) & set(stock_runs))
    if not rounds:
        return None
    a, s = arm_runs[rounds[0]]["rows"], stock_runs[rounds[0]]["rows"]
    acc2 = st.paired_accuracy([float(bool(a[p]["turn2"]["correct"])) for p in pids],
                              [float(bool(s[p]["turn2"]["correct"])) for p in pids], boot_iters)
    cached = st.paired_bootstrap([a[p]["turn2"]["cached_tokens"] for p in pids],
                                 [s[p]["turn2"]["cached_tokens"] for p in pids], iters=boot_iters)
    return {"round": rounds[0], "turn2_acc_diff": acc2["acc_diff"],
            "turn2_acc_diff_ci95": acc2["acc_diff_boot95"], "turn2_mcnemar_p": acc2["mcnemar_p"],
            "turn2_cached_tokens_diff": cached[0], "turn2_cached_tokens_diff_ci95": list(cached[1:])}


def load_runs(out: Path) -> dict[tuple[str, str, int], dict]:
    """Every record file: (workload, arm, round) -> its finished problems and segments."""
    runs = {}
    for path in sorted((out / "records").glob("*.jsonl")):
        rows = acc.Records(path).rows
        segs = [r for r in rows.values() if r.get("kind") == "segment"]
        done = answered(rows)
        if not done and not segs:
            continue
        first = next(iter(done.values()), None) or segs[0]
        runs[(first["workload"], first["arm"], first["round"])] = {"rows": done, "segments": segs}
    return runs


def summarize(runs: dict, pids: dict[str, list[str]], arm_order: list[str] | None = None,
              boot_iters: int = 10000) -> dict:
    """Per workload and arm, over its finished rounds (every problem of `pids[workload]`
    answered): the figures above, and against stock. Runs not finished are listed apart."""
    summary: dict = {"workloads": {}, "unfinished": []}
    finished: dict[str, dict[str, dict[int, dict]]] = {}
    for (w, arm, rnd), run_ in runs.items():
        want = pids.get(w, [])
        if want and all(p in run_["rows"] for p in want):
            rows = {p: run_["rows"][p] for p in want}
            entry = {"rows": rows, "figures": run_figures(rows, run_["segments"])}
            if w == "multiturn":
                entry["figures"].update(turn_figures(rows))
            finished.setdefault(w, {}).setdefault(arm, {})[rnd] = entry
        else:
            summary["unfinished"].append({"workload": w, "arm": arm, "round": rnd,
                                          "answered": sum(p in run_["rows"] for p in want),
                                          "of": len(want)})
    order = {name: i for i, name in enumerate(arm_order or [])}
    for w in (x for x in WORKLOADS if x in finished):
        table = {}
        arms = sorted(finished[w], key=lambda x: (x != STOCK, order.get(x, len(order)), x))
        for arm in arms:
            by_round = finished[w][arm]
            rounds = sorted(by_round)
            figs = [by_round[r]["figures"] for r in rounds]
            rows = [row for r in rounds for row in by_round[r]["rows"].values()]
            turns = ([x for row in rows for x in (row["turn1"], row["turn2"])]
                     if w == "multiturn" else rows)
            tokens = [row["n_tokens"] for row in rows]
            ci = answers_per_hour_ci([[float(bool(by_round[r]["rows"][p]["correct"]))
                                       for p in pids[w]] for r in rounds],
                                     [f["wall_s"] for f in figs], iters=boot_iters)
            s = {"rounds": rounds, "n": len(pids[w]),
                 "correct_by_round": [f["correct"] for f in figs],
                 "answers_per_hour": ci["answers_per_hour"], "answers_per_hour_ci95": ci["ci95"],
                 "answers_per_hour_by_round": [f["answers_per_hour"] for f in figs],
                 "wall_s_by_round": [f["wall_s"] for f in figs],
                 "tokens_per_answer_mean": st.mean(tokens),
                 "tokens_per_answer_p90": el.percentile(tokens, 90),
                 "tokens_per_correct_answer": (sum(tokens) / sum(f["correct"] for f in figs)
                                               if any(f["correct"] for f in figs) else None),
                 "ttft_s": percentiles([x["ttft"] for x in turns]),
                 "itl_s": percentiles([y for x in turns for y in x["itl"]]),
                 "latency_s": percentiles([x["latency"] for x in turns]),
                 "peak_running": max((f["peak_running"] for f in figs
                                      if f["peak_running"] is not None), default=None),
                 "mean_running_by_round": [f["mean_running"] for f in figs],
                 "finished_by_length_by_round": [f["finished_by_length"] for f in figs],
                 "retractions_by_round": [f["retractions"] for f in figs],
                 "retractions_logged_by_round": [f["retractions_logged"] for f in figs],
                 "eviction_share_by_round": [f["eviction_share"] for f in figs],
                 "segments_by_round": [f["segments"] for f in figs],
                 "server_figures_complete": all(f["server_figures_complete"] for f in figs),
                 "processors": sorted({p for f in figs for p in f["processors"]}),
                 "by_round": figs}
            if w == "multiturn":
                for k in ("turn1_correct", "turn2_correct", "turn2_consistent"):
                    s[f"{k}_by_round"] = [f[k] for f in figs]
                for k in ("turn1_tokens_mean", "turn2_prompt_tokens_mean",
                          "turn2_cached_tokens_mean", "turn2_prefilled_tokens_mean",
                          "turn2_cached_share_of_turn1"):
                    s[k] = st.mean(f[k] for f in figs)
                s["turn2_ttft_s"] = percentiles([row["turn2"]["ttft"] for row in rows])
            if arm != STOCK and STOCK in finished[w]:
                s["vs_stock"] = versus_stock(by_round, finished[w][STOCK], pids[w], boot_iters)
                if w == "multiturn":
                    s["vs_stock"].update(turn_versus_stock(by_round, finished[w][STOCK], pids[w],
                                                           boot_iters) or {})
            table[arm] = s
        summary["workloads"][w] = table
    return summary


# ----------------------------------------------------------------------------- report


def _f(x, spec=".1f", scale=1.0) -> str:
    return "–" if x is None else format(scale * x, spec)


def _ci(pair, spec=".1f") -> str:
    return "–" if not pair or pair[0] is None else f"[{pair[0]:{spec}}, {pair[1]:{spec}}]"


def _pcts(p, spec=".1f", scale=1.0) -> str:
    return f"{_f(p['p50'], spec, scale)} / {_f(p['p90'], spec, scale)}"


def markdown(summary: dict) -> str:
    lines = []
    for w, table in summary["workloads"].items():
        lines += [f"### workload: {w}", ""]
        if w == "multiturn":
            lines += ["| arm | rounds | turn 1 / turn 2 correct (of n) | turn 2 consistent | "
                      "turn 1 tokens (prompt + answer) | turn 2 prompt / cached / prefilled again "
                      "| turn 2 TTFT p50 / p90 (s) | turn 2 vs stock: Δ accuracy [95%], McNemar p |",
                      "|---|---|---|---|---|---|---|---|"]
            for arm, s in table.items():
                v = s.get("vs_stock") or {}
                vs = ("–" if "turn2_acc_diff" not in v else
                      f"{v['turn2_acc_diff']:+.2f} {_ci(v['turn2_acc_diff_ci95'], '+.2f')}, "
                      f"p = {v['turn2_mcnemar_p']:.2f}")
                lines.append(
                    f"| {arm} | {len(s['rounds'])} | "
                    f"{','.join(map(str, s['turn1_correct_by_round']))} / "
                    f"{','.join(map(str, s['turn2_correct_by_round']))} (of {s['n']}) | "
                    f"{','.join(map(str, s['turn2_consistent_by_round']))} | "
                    f"{_f(s['turn1_tokens_mean'])} | {_f(s['turn2_prompt_tokens_mean'])} / "
                    f"{_f(s['turn2_cached_tokens_mean'])} / {_f(s['turn2_prefilled_tokens_mean'])} "
                    f"| {_pcts(s['turn2_ttft_s'], '.2f')} | {vs} |")
            lines.append("")
            continue
        lines += ["| arm | rounds | correct (of n) | answers / h [95%] | vs stock [95%] (by round) "
                  "| wall (s) | tokens / answer mean / p90 | Δ tokens vs stock [95%] | "
                  "TTFT p50 / p90 (s) | ITL p50 / p90 (ms) | latency p50 / p90 (s) | "
                  "running peak / mean | retractions | eviction share | McNemar p vs stock |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for arm, s in table.items():
            v = s.get("vs_stock") or {}
            ratio = "–"
            if v.get("answers_per_hour_ratio") is not None:
                by = v.get("answers_per_hour_ratio_by_round")
                rounds = "" if not by else " (" + ", ".join(f"{x:.2f}" for x in by["per_pair"]) + ")"
                ratio = (f"{v['answers_per_hour_ratio']:.2f}× "
                         f"{_ci(v['answers_per_hour_ratio_ci95'], '.2f')}{rounds}")
            dtok = ("–" if not v else f"{v['tokens_per_answer_diff']:+.1f} "
                    f"{_ci(v['tokens_per_answer_diff_ci95'], '+.1f')}")
            share = [x for x in s["eviction_share_by_round"] if x is not None]
            lines.append(
                f"| {arm} | {len(s['rounds'])} | {','.join(map(str, s['correct_by_round']))} "
                f"(of {s['n']}) | {_f(s['answers_per_hour'])} {_ci(s['answers_per_hour_ci95'])} | "
                f"{ratio} | {', '.join(f'{x:.1f}' for x in s['wall_s_by_round'])} | "
                f"{_f(s['tokens_per_answer_mean'])} / {_f(s['tokens_per_answer_p90'], '.0f')} | "
                f"{dtok} | {_pcts(s['ttft_s'], '.2f')} | {_pcts(s['itl_s'], '.0f', 1e3)} | "
                f"{_pcts(s['latency_s'])} | {_f(s['peak_running'], '.0f')} / "
                f"{', '.join(_f(x) for x in s['mean_running_by_round'])} | "
                f"{', '.join(map(str, s['retractions_by_round']))} | "
                f"{', '.join(f'{100 * x:.2f} %' for x in share) or '–'} | "
                f"{_f(v.get('mcnemar_p'), '.2f')} |")
        lines.append("")
    notes = []
    for w, table in summary["workloads"].items():
        for arm, s in table.items():
            if any(k > 1 for k in s["segments_by_round"]):
                notes.append(f"- {w}, {arm}: resumed after a cut (segments by round "
                             f"{s['segments_by_round']}): its wall time leaves out the work in "
                             "flight at the cut")
            if not s["server_figures_complete"]:
                notes.append(f"- {w}, {arm}: a cut segment has no server figures (running "
                             "requests, logged retractions, eviction time cover the others)")
    for u in summary["unfinished"]:
        notes.append(f"- unfinished: {u['workload']}, {u['arm']}, round {u['round']}: "
                     f"{u['answered']} of {u['of']} answered (not in the tables)")
    procs = sorted({p for t in summary["workloads"].values() for s in t.values()
                    for p in s["processors"]})
    notes.append(f"- processor: {', '.join(procs) or 'not recorded'}")
    return "\n".join(lines + notes) + "\n"


def plot(summary: dict, out: Path) -> Path | None:
    single = [w for w in summary["workloads"] if w != "multiturn"]
    if not single:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(single), 3, figsize=(15, 4.2 * len(single)), squeeze=False)
    for row, w in zip(axes, single):
        table = summary["workloads"][w]
        names = list(table)
        xs = range(len(names))
        colors = [f"C{i}" for i in xs]

        def bars(ax, values, cis, title, ylabel):
            ys = [v if v is not None else math.nan for v in values]
            err = [[y - (c[0] if c and c[0] is not None else y) for y, c in zip(ys, cis)],
                   [(c[1] if c and c[1] is not None else y) - y for y, c in zip(ys, cis)]]
            ax.bar(xs, ys, yerr=err, capsize=3, color=colors)
            ax.set_xticks(list(xs), names, rotation=20, ha="right", fontsize=8)
            ax.set(title=f"{w}: {title}", ylabel=ylabel)
            ax.grid(alpha=0.3, axis="y")

        bars(row[0], [table[n]["answers_per_hour"] for n in names],
             [table[n]["answers_per_hour_ci95"] for n in names],
             "correct answers per hour [95%]", "answers / hour")
        vs = [table[n].get("vs_stock") or {} for n in names]
        bars(row[1], [1.0 if n == STOCK else v.get("answers_per_hour_ratio")
                      for n, v in zip(names, vs)],
             [None if n == STOCK else v.get("answers_per_hour_ratio_ci95") for n, v in zip(names, vs)],
             "answers per hour / stock's, paired [95%]", "ratio")
        row[1].axhline(1.0, color="k", lw=0.8)
        bars(row[2], [table[n]["tokens_per_answer_mean"] for n in names], [None] * len(names),
             "output tokens per answer (bar: mean, dot: p90)", "tokens")
        row[2].plot(list(xs), [table[n]["tokens_per_answer_p90"] for n in names], "ko")
    cfg = summary.get("config") or {}
    fig.suptitle(f"{Path(str(cfg.get('model_path', ''))).name}: pool {cfg.get('max_total_tokens')} "
                 f"tokens, {cfg.get('problems')} problems, natural stopping (greedy)")
    path = out / "answers_per_hour.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(out: Path, boot_iters: int = 10000) -> dict:
    cfg = json.loads((out / "config.json").read_text())
    n = {"all": cfg["problems"], "poisson": cfg["problems"], "multiturn": cfg["multi_turn"]}
    probs = acc.load_problems(cfg["task"], max(n.values()), cfg["seed"])
    pids = {w: [p["pid"] for p in probs[:k]] for w, k in n.items()}
    summary = summarize(load_runs(out), pids, cfg.get("arms"), boot_iters)
    summary["config"] = cfg
    plot(summary, out)
    (out / "summary.md").write_text(markdown(summary))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


# ----------------------------------------------------------------------------- CLI


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the paired rounds (resumes from the records in --out)")
    r.add_argument("--model-path", required=True)
    r.add_argument("--out", default="results/answers_per_hour")
    r.add_argument("--task", default="gsm_symbolic", choices=["gsm_symbolic", "chain_sum"])
    r.add_argument("--seed", type=int, default=123,
                   help="problem seed (the accuracy harness'), eviction seed, server seed")
    r.add_argument("--problems", type=int, default=60, help="problems per run (the first N)")
    r.add_argument("--rounds", type=int, default=1, help="paired rounds (more: resume adds them)")
    r.add_argument("--workloads", default="all,poisson",
                   help="comma list of all (every problem at once) and poisson (--rate)")
    r.add_argument("--rate", type=float, default=0.03,
                   help="poisson arrivals, requests/s (default: above what the README's model "
                        "answers a second with the full cache on a 2048-token pool, below what "
                        "it answers with eviction: docs/answers_per_hour.md)")
    r.add_argument("--arrival-seed", type=int, default=0,
                   help="round r's arrivals are seeded with this + r")
    r.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS),
                   help="stock and POLICY:FLAG=VALUE:... (--kv-evict-* suffixes), e.g. "
                        "vase-attnv:budget=64:mode=elastic trimkv:budget=64:budget-scope=global")
    r.add_argument("--budget", type=int, default=128,
                   help="T of an arm that names none (the README's recommendation)")
    r.add_argument("--gates", default=None, metavar="PATH",
                   help="retention gates of the trimkv arms (their SHA-256 is recorded)")
    r.add_argument("--multi-turn", type=int, default=0,
                   help="N two-turn conversations per round for stock and --multi-turn-arm")
    r.add_argument("--multi-turn-arm", default=None,
                   help="the evicting arm of the multi-turn workload (default: the first "
                        "evicting arm of --arms)")
    r.add_argument("--max-new-tokens", type=int, default=ACCURACY_MAX_NEW_TOKENS,
                   help="natural stopping's limit (default: the accuracy harness')")
    r.add_argument("--max-total-tokens", type=int, default=2048, help="the KV pool of every arm")
    r.add_argument("--max-running", type=int, default=64)
    r.add_argument("--dtype", default="float32",
                   help="server --dtype (CPUs without native bf16 run fp32 faster)")
    r.add_argument("--threads", type=int, default=2, help="server OpenMP threads")
    r.add_argument("--server-args", default="", help="extra launch_server arguments, one string")
    r.add_argument("--request-timeout", type=float, default=7200)
    r.add_argument("--boot-iters", type=int, default=10000)
    rp = sub.add_parser("report", help="summary.{json,md} and the PNG from the records")
    rp.add_argument("--out", default="results/answers_per_hour")
    rp.add_argument("--boot-iters", type=int, default=10000)

    a = ap.parse_args(argv)
    if a.cmd != "run":
        return a
    for name in ("problems", "rounds", "max_new_tokens", "max_total_tokens", "budget"):
        if getattr(a, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if a.rate <= 0 or a.multi_turn < 0:
        ap.error("--rate must be positive, --multi-turn not negative")
    a.workloads = [x for x in a.workloads.split(",") if x]
    bad = set(a.workloads) - {"all", "poisson"}
    if bad or not a.workloads:
        ap.error(f"--workloads: all and/or poisson, not {sorted(bad)}")
    try:
        a.arm_list = [parse_arm(spec, a.budget) for spec in a.arms]
    except ValueError as err:
        ap.error(f"--arms: {err}")
    names = [x.name for x in a.arm_list]
    if STOCK not in names:
        ap.error("--arms: stock is the reference of every ratio: name it")
    if len(set(names)) != len(names):
        ap.error(f"--arms: an arm named twice ({names})")
    a.arms = names  # canonical: what records and tables call them
    if any(x.needs_gates for x in a.arm_list):
        if not a.gates:
            ap.error("--arms: trimkv needs --gates FILE")
    if a.gates and not Path(a.gates).is_file():
        ap.error(f"--gates: no such file: {a.gates}")
    if a.multi_turn:
        evicting = [x.name for x in a.arm_list if x.evicts]
        if a.multi_turn_arm is None:  # without an evicting arm, stock's alone
            a.multi_turn_arm = evicting[0] if evicting else None
        else:
            try:
                a.multi_turn_arm = parse_arm(a.multi_turn_arm, a.budget).name
            except ValueError as err:
                ap.error(f"--multi-turn-arm: {err}")
            if a.multi_turn_arm not in evicting:
                ap.error(f"--multi-turn-arm {a.multi_turn_arm} is not an evicting arm of --arms")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    with sigterm_exits():  # a kill stops the servers
        summary = report(Path(a.out), a.boot_iters) if a.cmd == "report" else run(a)
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
