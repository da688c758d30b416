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
        --problems 60 --max-total-tokens 2048 --rounds 3 --rate 0.05 --multi-turn 40 \\
        --arms stock vase-attnv:budget=128 vase-attnv:budget=64 ...
    python benchmarks/answers_per_hour.py report --out results/answers_per_hour

docs/answers_per_hour.md: the real model's command, its expected duration, what it measures.
The summary's code (statistics, tables, plot): benchmarks/answers_per_hour_report.py.
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
from benchmarks import concurrency_scaling as cs  # noqa: E402
from benchmarks import elastic_load as el  # noqa: E402
from benchmarks._server import BenchServer, sigterm_exits  # noqa: E402
from benchmarks.accuracy_harness import refuse_other_settings  # noqa: E402
# the summary's names, which the tests use as answers_per_hour.NAME
from benchmarks.answers_per_hour_report import (  # noqa: E402, F401
    STOCK, WORKLOADS, answered, answers_per_hour, answers_per_hour_ci, load_runs, markdown,
    percentiles, plot, report, run_figures, run_sizes, summarize, turn_figures, turn_versus_stock,
    versus_stock)

DEFAULT_ARMS = (STOCK, "vase-attnv:budget=128", "vase-attnv:budget=64",
                "vase-attnv:budget=64:mode=elastic")
# the accuracy harness' length limit, so answers stop where its accuracy figures stopped them
ACCURACY_MAX_NEW_TOKENS = acc.parse_args(["run", "--model-path", "-"]).max_new_tokens
FOLLOW_UP = "Now double your answer.\n" + acc._answers.ANSWER_INSTRUCTION
# what a record means beyond its arm, round and workload: a resume must not mix other settings
# (and the processor: a CPU's decode step follows its batch curve, notes/2026-12-05-two-processors.md)
RUN_IDENTITY = ("model_path", "task", "seed", "max_new_tokens", "max_total_tokens",
                "max_running", "dtype", "threads", "server_args", "cpu")
# ... and what only the poisson workload's records depend on: a folder without them takes any
ARRIVAL_IDENTITY = ("rate", "arrival_seed")


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
                 records: acc.Records, gates_sha: str | None = None):
        super().__init__(server, arm.name, a.rate if workload == "poisson" else math.inf,
                         probs, prompts, a, records)
        self.evicts = arm.evicts
        self.workload, self.round, self.segment, self.times = workload, rnd, segment, times
        self.gates_sha = gates_sha

    def schedule(self) -> list[float]:
        return self.times

    def request_row(self, i: int, res: dict, arrival: float) -> dict:
        row = super().request_row(i, res, arrival)
        del row["output_ids"]  # the text is kept; the ids would double the records' size
        row.update(key=row["pid"], workload=self.workload, round=self.round,
                   segment=self.segment, cached_tokens=res["meta"].get("cached_tokens"),
                   num_retractions=res["meta"]["num_retractions"], gates_sha256=self.gates_sha)
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
                             "segment", "gates_sha256")}

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
                "gates_sha256": self.gates_sha,
                "turn1": first, "turn2": second, "correct": second["correct"],
                # what elastic_load's run row reads: the conversation as one request
                "n_tokens": first["n_tokens"] + second["n_tokens"],
                "prompt_tokens": first["prompt_tokens"], "ttft": first["ttft"],
                "itl": first["itl"] + second["itl"], "latency": time.perf_counter() - t0}


# ----------------------------------------------------------------------------- records


def record_path(out: Path, arm: Arm, workload: str, rnd: int) -> Path:
    return out / "records" / f"{arm.slug}__{workload}__r{rnd}.jsonl"


def check_resume(out: Path, a) -> None:
    """Refuse to add records to a folder whose records were made with other settings."""
    path = out / "config.json"
    if not path.exists() or not any((out / "records").glob("*.jsonl")):
        return
    poisson = any((out / "records").glob("*__poisson__*.jsonl"))
    refuse_other_settings(out, json.loads(path.read_text()), config(a),
                          RUN_IDENTITY + (ARRIVAL_IDENTITY if poisson else ()))


def config(a) -> dict:
    return json.loads(json.dumps({k: v for k, v in vars(a).items() if k not in ("cmd", "arm_list")},
                                 default=str))


def check_gates(rows: dict, arm: Arm, gates_sha: str | None, path: Path) -> None:
    """A trimkv run's records (every row) hold the gates' hash: records of other gates are not
    resumed."""
    if not arm.needs_gates:
        return
    other = {r.get("gates_sha256") for r in rows.values()} - {gates_sha}
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
              [prompts[i] for i in todo], times, a, records, gates_sha=gates_sha, **extra)
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

    tok = AutoTokenizer.from_pretrained(a.model_path)
    probs = load_problems(a)
    prompts = [acc.prompt_ids(tok, p) for p in probs]
    gates_sha = a.gates_sha256
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
    r.add_argument("--rate", type=float, default=0.05,
                   help="poisson arrivals, requests/s (default: above what the README's model "
                        "answers a second with the full cache on a 2048-token pool with 2 "
                        "threads, 0.036 measured, within what it answers at T = 64: "
                        "docs/answers_per_hour.md)")
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
    from vase_sglang.gates import gates_sha256

    a.gates_sha256 = gates_sha256(a.gates) if a.gates else None  # hashed once, in config.json
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
