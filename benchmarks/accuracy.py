"""Accuracy and fidelity of the eviction policies on a real model, served by the real server.

    python benchmarks/accuracy.py run --model-path DIR --out results/accuracy [--n 100 ...]
    python benchmarks/accuracy.py throughput --model-path DIR --concurrency 16,32,64
    python benchmarks/accuracy.py report --out results/accuracy      # JSON + PNG from the records
    python benchmarks/accuracy.py export-gsm8k --n 200 --out gsm_symbolic.jsonl

Problems come from reasoning-gym (offline, fixed seed): `gsm_symbolic` (GSM8K templates with
new numbers) or `chain_sum`. `--task champ` replays, teacher-forced (stages tf and curve),
long solutions other models wrote to CHAMP's competition problems instead of the full cache's
own output (benchmarks/recorded_texts.py). The export writes GSM8K-format jsonl ({"question", "answer":
cot + "\\n#### N"}) for `python -m sglang.test.few_shot_gsm8k --data-path FILE`.

Stages of `run` (--stages, default greedy,tf,curve; each appends to records.jsonl and is
skipped on resume):
  greedy  every policy at the main budget (+ vase-attnv with value_slots=0), greedy, --n problems
  tf      teacher-forced: the full-cache greedy output replayed under each policy's evicting
          cache (forcing happens in decode, where eviction happens); per-token NLL, KL against
          full (on the full cache's top-k ids + the rest, a lower bound of the exact KL) and
          top-1 agreement, --tf-n problems; bootstrap intervals over problems, and paired
          differences of vase-attnv against every other arm at the same budget
  curve   teacher-forced budget curve: --curve-policies at the --curve budgets (window =
          budget/4), --curve-n problems; budget_curve.png (KL and top-1 vs compression)
  sweep   greedy at the other --sweep budgets (window = budget/4) for every evicting policy
          and plain trimkv (with --retention-gates), --sweep-n problems: the accuracy side of
          the budget frontier (benchmarks/frontier.py)
  sample  every policy at the main budget with temperature 0.6, top-p 0.95, --sample-n

Serving: if the plugin has per-request control (patches/request_control.py), ONE server started
with a query-scoring policy serves every arm at once (each request carries
`custom_params.kv_evict`), so the batch mixes arms; otherwise one server per eviction setting.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import accuracy_stats as st  # noqa: E402
from benchmarks._server import REPO, BenchServer  # noqa: E402
from vase_sglang.policies import needs_gates, policy_names  # noqa: E402

# The arms' policies, from the registry (vase_sglang.policies.POLICIES): the full cache and every
# registered policy that needs no retention gates; those that do (trimkv) run with
# --retention-gates only (RETENTION_POLICIES, retention_arms).
POLICIES = ["full", *policy_names(retention=False)]
RETENTION_POLICIES = [p for p in policy_names() if needs_gates(p)]
QUERY_POLICY = "vase-attnv"  # a server started with it records queries for every policy
SAMPLING = {"temperature": 0.6, "top_p": 0.95}  # the paper's sampling
TF_K = 20


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


# The shared extractor and instruction of the frontend programs (examples/) and this harness.
# No private fallback: a second extractor would silently score answers differently.
from vase_sglang.serving import answers as _answers  # noqa: E402

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


# ----------------------------------------------------------------------------- arms


@dataclass(frozen=True)
class Arm:
    policy: str
    budget: int = 0
    window: int = 0
    value_slots: int | None = None
    decoding: str = "greedy"  # or "sample"
    kind: str = "gen"  # or "tf" (teacher-forced replay of the full greedy output)
    gates: str = ""  # trimkv: short hash of the retention gates file (records of other gates differ)

    @property
    def evicts(self) -> bool:
        return self.policy != "full"

    @property
    def setting(self) -> str:
        """The eviction setting, without decoding/kind: what a per-arm server is started with."""
        if not self.evicts:
            return "full"
        nv = "" if self.value_slots is None else f"/nv{self.value_slots}"
        gates = f"/g{self.gates}" if self.gates else ""
        return f"{self.policy}@{self.budget}/w{self.window}{nv}{gates}"

    @property
    def name(self) -> str:
        return f"{self.setting}:{self.decoding}" + (":tf" if self.kind == "tf" else "")

    @property
    def label(self) -> str:
        return self.policy + (f" nv={self.value_slots}" if self.value_slots is not None else "")

    def kv_evict(self):
        if not self.evicts:
            return False
        d = {"policy": self.policy, "budget": self.budget, "window": self.window}
        if self.value_slots is not None:
            d["value_slots"] = self.value_slots
        return d

    def flags(self) -> list[str]:
        if not self.evicts:
            return []
        f = ["--kv-evict-policy", self.policy, "--kv-evict-budget", str(self.budget),
             "--kv-evict-window", str(self.window)]
        if self.value_slots is not None:
            f += ["--kv-evict-value-slots", str(self.value_slots)]
        return f


def window_for(budget: int) -> int:
    return max(4, budget // 4)


def request_limit_flags(a) -> list[str]:
    """The per-request limits of the one server that serves every stage's arms: its largest
    budget, smallest window, a grid every budget, window and value_slots is on, and room for
    every arm's distinct settings."""
    arms = [x for stage in ("greedy", "tf", "sweep", "curve", "sample")
            for x in stage_arms(stage, a) if x.evicts]
    values = [x.budget for x in arms] + [x.window for x in arms] + [
        x.value_slots for x in arms if x.value_slots is not None]
    return ["--kv-evict-max-budget", str(max([a.budget] + [x.budget for x in arms])),
            "--kv-evict-min-window", str(min(x.window for x in arms)),
            "--kv-evict-grid", str(math.gcd(*values)),
            # every arm's settings at once (the default bound is 16 in recent use)
            "--kv-evict-max-settings", str(max(16, len({x.setting for x in arms})))]


def gates_id(path) -> str:
    """Short content hash of a retention gates file: names the trimkv arms it serves."""
    from vase_sglang.gates import gates_sha256

    return gates_sha256(path)[:8]


def retention_arms(a, budget: int, window: int, keep=lambda policy: True,
                   hybrid: bool = True) -> list[Arm]:
    """With --retention-gates, per policy that scores from them (trimkv) and `keep`s: the plain
    policy (TRIM-KV) and, with `hybrid` where it reserves value slots, the VaSE hybrid (the
    N_v = T/4 largest value ranges forced first, as vase-attnv's default) at this budget;
    none without gates."""
    from vase_sglang.policies import POLICIES as REGISTRY

    if not a.gates_id:
        return []
    arms = []
    for p in RETENTION_POLICIES:
        if not keep(p):
            continue
        arms.append(Arm(p, budget, window, gates=a.gates_id))
        if hybrid and REGISTRY[p].reserves_value_slots:
            arms.append(Arm(p, budget, window, value_slots=budget // 4, gates=a.gates_id))
    return arms


def stage_arms(stage: str, a) -> list[Arm]:
    """The arms of a stage; with --policies only theirs (and the full cache, every stage's
    reference; the value_slots=0 ablation goes with vase-attnv, the learned arms with trimkv)."""
    kept = getattr(a, "policies", None)

    def keep(policy):
        return not kept or policy == "full" or policy in kept

    main = [Arm("full")] + [Arm(p, a.budget, a.window) for p in POLICIES[1:] if keep(p)]
    ablations = not getattr(a, "no_ablations", False)
    ablation = ([Arm("vase-attnv", a.budget, a.window, value_slots=0)]
                if keep("vase-attnv") and ablations else [])
    # plain trimkv, and without --no-ablations its hybrid
    learned = retention_arms(a, a.budget, a.window, keep, hybrid=ablations)
    if stage == "greedy":
        return main + ablation + learned
    if stage == "tf":
        return [Arm(x.policy, x.budget, x.window, x.value_slots, kind="tf", gates=x.gates)
                for x in main + ablation + learned]
    if stage == "sweep":
        arms = []
        for b in a.sweep:
            if b == a.budget:
                continue
            w = window_for(b)
            arms += [Arm(p, b, w) for p in POLICIES[1:] if keep(p)]
            # plain TRIM-KV with the gates; no ablations here: greedy answers on 100 problems
            # do not separate them (docs/accuracy.md), the teacher-forced stages do
            arms += retention_arms(a, b, w, keep, hybrid=False)
        return arms
    if stage == "sample":
        return [Arm(x.policy, x.budget, x.window, x.value_slots, decoding="sample")
                for x in main]
    if stage == "curve":  # teacher-forced budget curve; the main budget's arms are tf's own
        arms = []
        for b in a.curve:
            w = a.window if b == a.budget else window_for(b)
            for p in a.curve_policies:
                arms.append(Arm(p, b, w, kind="tf", gates=a.gates_id if needs_gates(p) else ""))
        return arms
    raise ValueError(f"--stages: unknown stage {stage!r}; use greedy, tf, curve, sweep, sample")


# ----------------------------------------------------------------------------- records


class Records:
    """Append-only jsonl of per-request results keyed by arm + problem: the resume state."""

    def __init__(self, path: Path):
        self.path = path
        self.lock = threading.Lock()
        self.rows: dict[str, dict] = {}
        if path.exists():
            with open(path) as f:
                for line in f:
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:  # a line cut by a kill: redo that request
                        continue
                    self.rows[row["key"]] = row
            if path.stat().st_size and not path.read_bytes().endswith(b"\n"):
                with open(path, "a") as f:  # end the cut line so the next row starts afresh
                    f.write("\n")

    def add(self, row: dict) -> None:
        with self.lock:
            self.rows[row["key"]] = row
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def get(self, arm: Arm, pid: str):
        return self.rows.get(key(arm, pid))

    def forget(self, arm: Arm, pid: str) -> None:
        """Run this request again: its row is dropped here; the file keeps it until the new
        row, appended later, replaces it on the next load."""
        with self.lock:
            self.rows.pop(key(arm, pid), None)


def key(arm: Arm, pid: str) -> str:
    return f"{arm.name}|{pid}"


# ----------------------------------------------------------------------------- running


def per_request_available() -> bool:
    return (REPO / "patches" / "request_control.py").exists()


class Harness:
    def __init__(self, a):
        self.a = a
        self.out = Path(a.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.records = Records(self.out / "records.jsonl")
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(a.model_path)
        self.mode = a.mode if a.mode != "auto" else (
            "per-request" if per_request_available() else "per-arm")
        self.tf_dir = self.out / "tf_tmp"
        self.tf_dir.mkdir(exist_ok=True)
        self._prompt_cache: dict[str, list[int]] = {}

    # prompts ---------------------------------------------------------------
    def prompt_ids(self, prob: dict) -> list[int]:
        if prob["pid"] not in self._prompt_cache:
            self._prompt_cache[prob["pid"]] = prompt_ids(self.tok, prob)
        return self._prompt_cache[prob["pid"]]

    # servers ---------------------------------------------------------------
    def server_flags(self, arms: list[Arm]) -> list[str]:
        if self.mode == "per-request":
            # one server for every stage: its window bounds the per-request windows
            window = max([window_for(b) for b in self.a.sweep + self.a.curve] + [self.a.window])
            # the server's own budget must exceed that window (a budget includes its window);
            # a small --budget (short answers) takes the largest budget of the stages instead
            budget = (self.a.budget if self.a.budget > window
                      else max(self.a.sweep + self.a.curve + [self.a.budget]))
            return (["--kv-evict-policy", QUERY_POLICY, "--kv-evict-budget", str(budget),
                     "--kv-evict-window", str(window), "--kv-evict-seed", str(eviction_seed(self.a))]
                    + request_limit_flags(self.a) + self.gates_flags())
        (setting,) = {x.setting for x in arms}
        if not arms[0].evicts:
            return []
        return (arms[0].flags() + ["--kv-evict-seed", str(eviction_seed(self.a))]
                + (self.gates_flags() if needs_gates(arms[0].policy) else []))

    def gates_flags(self) -> list[str]:
        # the gate runs for every token of every request; the other arms' outputs do not change
        g = self.a.retention_gates
        return ["--kv-evict-retention-gates", str(Path(g).resolve())] if g else []

    def start_server(self, arms: list[Arm]) -> BenchServer:
        flags = (self.server_flags(arms) + ["--random-seed", str(self.a.seed),
                                            "--dtype", self.a.dtype] + self.a.server_args.split())
        return BenchServer(self.a.model_path, flags, log_path=self.out / "server.log",
                           max_total_tokens=self.a.max_total_tokens,
                           max_running=self.a.concurrency, threads=self.a.threads)

    _server: BenchServer | None = None
    _server_key: tuple | None = None

    def server_for(self, arms: list[Arm]) -> BenchServer:
        """The running server if it was started with the same flags (startup of the 0.5B
        model takes minutes on a busy CPU), else a new one."""
        flags = tuple(self.server_flags(arms))
        if self._server is not None and (self._server_key != flags or not self._server.alive()):
            self.close()
        if self._server is None:
            self._server, self._server_key = self.start_server(arms), flags
        return self._server

    def adopt_server(self, other: "Harness") -> None:
        """Take over another harness's running server (a resume without a restart)."""
        self._server, self._server_key = other._server, other._server_key
        other._server = other._server_key = None

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = self._server_key = None

    # payloads --------------------------------------------------------------
    def payload(self, arm: Arm, prob: dict, tf: dict | None = None) -> dict:
        sp = {"max_new_tokens": self.a.max_new_tokens}
        if arm.decoding == "greedy":
            sp["temperature"] = 0.0
        else:
            # same seed for every arm of a problem (common random numbers); SGLang honours
            # per-request seeds only with --enable-deterministic-inference
            sp.update(SAMPLING, sampling_seed=self.a.seed * 100003 + int(prob["pid"].rsplit("-", 1)[1]))
        custom = {}
        if self.mode == "per-request":
            custom["kv_evict"] = arm.kv_evict()
        payload = {"input_ids": self.prompt_ids(prob), "sampling_params": sp}
        if tf is not None:
            from benchmarks.teacher_force import TeacherForceProcessor

            sp["max_new_tokens"] = len(tf["forced"])
            sp["ignore_eos"] = True
            custom.update(tf_forced=tf["forced"], tf_out=tf["path"], tf_k=TF_K)
            if tf.get("ref") is not None:
                custom["tf_ref"] = tf["ref"]
            payload["custom_logit_processor"] = TeacherForceProcessor.to_str()
        if custom:
            sp["custom_params"] = custom
        return payload

    # result rows -----------------------------------------------------------
    def gen_row(self, arm: Arm, prob: dict, res: dict, secs: float) -> dict:
        meta = res.get("meta_info", {})
        ids = res.get("output_ids") or []
        text = res.get("text", "")
        pred = extract_answer(text)
        fin = meta.get("finish_reason") or {}
        evicted = meta.get("kv_evicted_tokens")
        return {"key": key(arm, prob["pid"]), "arm": arm.name, "arm_fields": asdict(arm),
                "pid": prob["pid"], "question": prob["question"], "gold": prob["answer"],
                "text": text, "output_ids": ids, "n_tokens": meta.get("completion_tokens", len(ids)),
                "finish": fin.get("type") if isinstance(fin, dict) else str(fin),
                "pred": pred, "correct": is_right(pred, prob["answer"]),
                "kv_evicted": _evicted_total(evicted), "secs": round(secs, 2)}

    def tf_row(self, arm: Arm, prob: dict, res: dict, path: Path, forced: list[int],
               ref_lp_full: list[list[float]] | None, secs: float) -> dict:
        steps: dict[int, dict] = {}
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    steps[r["t"]] = r  # a retracted request re-runs a step: keep the last
        path.unlink(missing_ok=True)
        out_ids = res.get("output_ids") or []
        if out_ids != forced or sorted(steps) != list(range(len(forced))):
            raise RuntimeError(f"teacher forcing failed for {arm.name} {prob['pid']}: "
                               f"{len(steps)} steps recorded, output equal to forced: "
                               f"{out_ids == forced} (is --disable-overlap-schedule on?)")
        recs = [steps[t] for t in range(len(forced))]
        row = {"key": key(arm, prob["pid"]), "arm": arm.name, "arm_fields": asdict(arm),
               "pid": prob["pid"], "n_tokens": len(forced),
               "nll": [-r["lp"] for r in recs],
               "top1_agree": [int(r["top1"] == forced[t]) for t, r in enumerate(recs)],
               "kv_evicted": _evicted_total(res.get("meta_info", {}).get("kv_evicted_tokens")),
               "secs": round(secs, 2)}
        if ref_lp_full is None:  # the full cache: keep its top-k as the reference
            row["ref_ids"] = [r["top_ids"] for r in recs]
            row["ref_lp"] = [r["top_lp"] for r in recs]
        else:
            row["kl"] = [st.coarse_kl(ref_lp_full[t], recs[t]["ref_lp"]) for t in range(len(recs))]
        return row

    # the request loop ------------------------------------------------------
    def run_jobs(self, jobs: list, desc: str) -> None:
        """jobs: (arm, prob, tf-spec or None). Groups them by server (one group in per-request
        mode), runs each group at --concurrency, appends each result as it completes."""
        from tqdm import tqdm

        jobs = [j for j in jobs if self.records.get(j[0], j[1]["pid"]) is None]
        if not jobs:
            return
        groups: dict[str, list] = defaultdict(list)
        for j in jobs:
            groups["all" if self.mode == "per-request" else j[0].setting].append(j)
        bar = tqdm(total=len(jobs), desc=desc, dynamic_ncols=True, file=sys.stderr)
        for group in groups.values():
            server = self.server_for([j[0] for j in group])
            errors = []

            def one(job):
                arm, prob, tf = job
                spec = None
                if tf is not None:
                    path = self.tf_dir / f"{re.sub(r'[^A-Za-z0-9]+', '_', arm.name)}__{prob['pid']}.jsonl"
                    path.unlink(missing_ok=True)
                    spec = dict(tf, path=str(path))
                t0 = time.time()
                res = server.post("/generate", self.payload(arm, prob, spec))
                secs = time.time() - t0
                if tf is None:
                    row = self.gen_row(arm, prob, res, secs)
                else:
                    row = self.tf_row(arm, prob, res, Path(spec["path"]), tf["forced"],
                                      tf.get("ref_lp"), secs)
                self.records.add(row)

            pool = ThreadPoolExecutor(self.a.concurrency)
            try:
                futs = [pool.submit(one, j) for j in group]
                for fut in as_completed(futs):
                    try:
                        fut.result()
                    except Exception as err:  # keep going; report at the end of the group
                        errors.append(err)
                    bar.update(1)
            finally:
                # on a kill, do not wait for the requests in flight: stopping the server
                # (Harness.close) ends them, and a rerun redoes them
                pool.shutdown(wait=False, cancel_futures=True)
            if errors:
                bar.close()
                raise RuntimeError(f"{len(errors)} requests failed; first: {errors[0]!r}; "
                                   f"server log {server.log_path}")
        bar.close()

    # stages ----------------------------------------------------------------
    def problems(self, n: int) -> list[dict]:
        if self.a.task == "champ":  # recorded texts at least as long as the replay
            from benchmarks.recorded_texts import champ_texts

            return champ_texts(self.tok, n, self.a.seed, self.a.max_new_tokens,
                               self.a.champ_model, self.a.champ_file)
        return load_problems(self.a.task, n, self.a.seed)

    def interleave(self, arms: list[Arm], probs: list[dict]) -> list:
        # problem-major order: if the run is stopped, every arm has about the same problems
        return [(arm, p, None) for p in probs for arm in arms]

    def stage(self, name: str, n: int | None = None) -> None:
        """Run one stage on its first n problems (default: the stage's --*-n option)."""
        a = self.a
        n = n if n is not None else {"greedy": a.n, "tf": a.tf_n, "curve": a.curve_n,
                                     "sweep": a.sweep_n, "sample": a.sample_n}.get(name, 0)
        if name == "greedy":
            self.run_jobs(self.interleave(stage_arms("greedy", a), self.problems(n)), "greedy")
        elif name == "sweep":
            probs = self.problems(n)
            self.run_jobs(self.interleave([Arm("full")], probs), "sweep (full)")
            self.run_jobs(self.interleave(stage_arms("sweep", a), probs), "sweep")
        elif name == "sample":
            self.run_jobs(self.interleave(stage_arms("sample", a), self.problems(n)),
                          "sample")
        elif name in ("tf", "curve"):
            self.teacher_forced(name, stage_arms(name, a), self.problems(n))
        else:
            raise ValueError(f"--stages: unknown stage {name!r}")

    def forced_ids(self, prob: dict) -> list[int]:
        """A recorded text's first --max-new-tokens tokens (the tokenizer's, no special ones)."""
        ids = self.tok(prob["text"], add_special_tokens=False)["input_ids"]
        return ids[: self.a.max_new_tokens]

    def teacher_forced(self, name: str, arms: list[Arm], probs: list[dict]) -> None:
        """Replay the full cache's greedy output (or the problem's recorded text, --task
        champ) under the full cache (the reference top-k) and then under each evicting arm."""
        full, full_tf = Arm("full"), Arm("full", kind="tf")
        generated = [p for p in probs if "text" not in p]
        self.run_jobs(self.interleave([full], generated), f"{name} (full greedy)")
        forced = {p["pid"]: self.forced_ids(p) for p in probs if "text" in p}
        forced |= {p["pid"]: self.records.get(full, p["pid"])["output_ids"] for p in generated}
        # records unpacked from the committed compact copy have no top-k reference (dropped to
        # keep it small): replay the full cache again for those problems, so new arms can run
        stale = [p for p in probs if (row := self.records.get(full_tf, p["pid"])) is not None
                 and "ref_ids" not in row]
        if stale:
            print(f"{name}: {len(stale)} full-cache replays lack their top-k reference (a "
                  "compact copy's records): replaying them again", file=sys.stderr)
            for p in stale:
                self.records.forget(full_tf, p["pid"])
        self.run_jobs([(full_tf, p, {"forced": forced[p["pid"]]}) for p in probs],
                      f"{name} (full replay)")
        jobs = []
        for p in probs:
            ref = self.records.get(full_tf, p["pid"])
            flat = [i for ids in ref["ref_ids"] for i in ids]
            for arm in arms:
                if arm.evicts:
                    jobs.append((arm, p, {"forced": forced[p["pid"]], "ref": flat,
                                          "ref_lp": ref["ref_lp"]}))
        self.run_jobs(jobs, f"{name} (policies)")


def _evicted_total(v):
    """meta_info kv_evicted_tokens -> one number (per layer and head, so take the max).
    The plugin reports it on every response (0 where nothing was evicted); a response without
    it did not come from a VaSE server, and counting it as 0 would fake a measurement."""
    if v is None:
        raise RuntimeError("response has no meta_info.kv_evicted_tokens: the server does not "
                           "run the vase_sglang plugin")
    if isinstance(v, (int, float)):
        return v
    flat = []

    def walk(x):
        if isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)
        elif isinstance(x, (int, float)):
            flat.append(x)

    walk(v)
    if not flat:
        raise RuntimeError(f"meta_info.kv_evicted_tokens holds no number: {v!r}")
    return max(flat)


def _recorded_evictions(recs: dict) -> list:
    """kv_evicted of each record; a record without it is an error, not 0."""
    missing = [pid for pid, r in recs.items() if r.get("kv_evicted") is None]
    if missing:
        raise RuntimeError(f"records without kv_evicted (not from a VaSE server?): {missing[:5]}")
    return [r["kv_evicted"] for r in recs.values()]


# ----------------------------------------------------------------------------- report


COMPACT = "records.jsonl.gz"


def compact_row(row: dict) -> dict:
    """What the report reads, small enough to commit: the full cache's top-k reference of the
    teacher-forced rows (needed only while the policies are replayed) is dropped, and per-token
    floats are rounded to 5 decimals."""
    out = {k: v for k, v in row.items() if k not in ("ref_ids", "ref_lp")}
    for k in ("nll", "kl"):
        if k in out:
            out[k] = [round(x, 5) for x in out[k]]
    return out


def write_compact(out: Path, rows: list[dict]) -> Path:
    import gzip

    path = out / COMPACT
    with gzip.open(path, "wt") as f:
        for row in sorted(rows, key=lambda r: r["key"]):
            f.write(json.dumps(compact_row(row)) + "\n")
    return path


def load_rows(out: Path) -> list[dict]:
    """The run's records; where only the compact copy exists (a committed result), that."""
    if (out / "records.jsonl").exists():
        return list(Records(out / "records.jsonl").rows.values())
    if (out / COMPACT).exists():
        import gzip

        with gzip.open(out / COMPACT, "rt") as f:
            return [json.loads(line) for line in f if line.strip()]
    raise FileNotFoundError(f"no records.jsonl or {COMPACT} in {out}")


def paired_answers(a: dict, b: dict, pids: list, boot_iters: int) -> dict:
    """Two arms' records on the same problems, paired: accuracy difference a − b with its
    bootstrap interval, the discordant problems and McNemar's p, the share of equal answers,
    and (with `output_ids`) where each pair of outputs first differs (None: identical)."""
    a_ok = [float(a[p]["correct"]) for p in pids]
    b_ok = [float(b[p]["correct"]) for p in pids]
    only_a = sum(int(x > y) for x, y in zip(a_ok, b_ok))
    only_b = sum(int(y > x) for x, y in zip(a_ok, b_ok))
    d, lo, hi = st.paired_bootstrap(a_ok, b_ok, iters=boot_iters)
    return {"n_paired": len(pids), "acc_diff": d, "acc_diff_boot95": [lo, hi],
            "only_a_right": only_a, "only_b_right": only_b,
            "mcnemar_p": st.mcnemar_exact(only_a, only_b),
            "same_answer": st.mean(a[p]["pred"] == b[p]["pred"] for p in pids),
            "divergences": [st.first_divergence(a[p]["output_ids"], b[p]["output_ids"])
                            for p in pids]}


def summarize(rows: list[dict], boot_iters: int = 10000) -> dict:
    by_arm: dict[str, dict[str, dict]] = defaultdict(dict)
    fields: dict[str, dict] = {}
    for r in rows:
        by_arm[r["arm"]][r["pid"]] = r
        fields[r["arm"]] = r["arm_fields"]
    summary = {"generation": {}, "teacher_forced": {}}
    full_name = {"greedy": Arm("full").name,
                 "sample": Arm("full", decoding="sample").name}
    for name, recs in sorted(by_arm.items()):
        f = fields[name]
        arm = Arm(**f)
        if arm.kind == "tf":
            continue
        n = len(recs)
        k = sum(r["correct"] for r in recs.values())
        lo, hi = st.wilson(k, n)
        s = {**f, "setting": arm.setting, "n": n, "correct": k, "accuracy": k / n if n else None,
             "wilson95": [lo, hi],
             "mean_tokens": st.mean(r["n_tokens"] for r in recs.values()),
             "loop_rate": st.mean(r["finish"] == "length" for r in recs.values()),
             "mean_kv_evicted": st.mean(_recorded_evictions(recs))}
        full = by_arm.get(full_name[arm.decoding], {})
        common = sorted(set(recs) & set(full))
        if arm.evicts and common:
            pair = paired_answers(recs, full, common, boot_iters)
            divs = pair.pop("divergences")
            pair["only_policy_right"] = pair.pop("only_a_right")
            pair["only_full_right"] = pair.pop("only_b_right")
            s["vs_full"] = pair
            if arm.decoding == "greedy":
                pos = [x for x in divs if x is not None]
                s["vs_full"].update({
                    "identical": st.mean(x is None for x in divs),
                    "first_divergence_median": sorted(pos)[len(pos) // 2] if pos else None,
                    "first_divergence_mean": st.mean(pos) if pos else None,
                    # eviction starts once the private cache holds budget + window tokens: an
                    # earlier divergence is batch numerics, not the policy
                    "diverged_before_first_eviction": st.mean(
                        x is not None and x < arm.budget + arm.window for x in divs)})
        summary["generation"][name] = s
    tf_full = by_arm.get(Arm("full", kind="tf").name, {})
    sums: dict[str, dict] = {}  # per tf arm: per-problem metric sums over the measured tokens
    for name, recs in sorted(by_arm.items()):
        arm = Arm(**fields[name])
        if arm.kind != "tf":
            continue
        start = arm.budget + arm.window if arm.evicts else 0
        nll_all = [x for r in recs.values() for x in r["nll"]]
        after = [x for r in recs.values() for x in r["nll"][start:]]
        agree = [x for r in recs.values() for x in r["top1_agree"][start:]]
        s = {**fields[name], "setting": arm.setting, "n": len(recs), "tokens": len(nll_all),
             "tokens_after_first_eviction": len(after),
             "nll_mean": st.mean(nll_all), "nll_after_first_eviction": st.mean(after),
             "top1_agree_after_first_eviction": st.mean(agree)}
        if arm.evicts:
            common = sorted(set(recs) & set(tf_full))
            sums[name] = per = tf_sums(recs, tf_full, common, start)
            s["n_paired"] = len(common)
            counts = [per[p]["count"] for p in common]
            for metric in TF_METRICS:
                m, lo, hi = st.cluster_bootstrap([per[p][metric] for p in common], counts,
                                                 boot_iters)
                s[f"{metric}_after_first_eviction"] = m
                s[f"{metric}_boot95_after_first_eviction"] = [lo, hi]
            kl = [x for r in recs.values() for x in r["kl"][start:]]
            s["kl_p90_after_first_eviction"] = sorted(kl)[int(0.9 * len(kl))] if kl else None
            s["kl_note"] = f"KL(full || policy) on the full cache's top-{TF_K} ids + the rest: a lower bound"
            s["compression"] = generated_compression(
                [len(recs[p]["nll"]) for p in common], arm.budget, arm.window)
        summary["teacher_forced"][name] = s
    summary["teacher_forced_pairs"] = tf_pairs(fields, sums, boot_iters)
    return summary


# per-token teacher-forced metrics, summarised over the tokens after the first eviction
TF_METRICS = ("kl", "nll_excess", "top1_agree")
# (reference arm, what it is compared with): VaSE-AttnV against each other policy at the same
# budget, and against itself without its value slots; trimkv against its VaSE hybrid
PAIR_REFERENCE = "vase-attnv"


def tf_sums(recs: dict, tf_full: dict, pids: list, start: int) -> dict:
    """Per problem: sums of KL, NLL excess over the full cache's replay (same tokens) and top-1
    agreement over the tokens after the first eviction, and their count."""
    out = {}
    for p in pids:
        r, f = recs[p], tf_full[p]
        out[p] = {"kl": sum(r["kl"][start:]),
                  "nll_excess": sum(r["nll"][start:]) - sum(f["nll"][start:]),
                  "top1_agree": sum(r["top1_agree"][start:]), "count": len(r["nll"][start:])}
    return out


def generated_compression(lengths: list[int], budget: int, window: int) -> float:
    """How many times smaller the generated tokens' cache is than under the full cache, averaged
    over the measured tokens (positions t >= T + R, where the cache holds T + (t - T) mod R of
    the t generated tokens; the prompt, never evicted, is left out)."""
    num = den = 0.0
    for n in lengths:
        for t in range(budget + window, n):
            num += t / (budget + (t - budget) % window)
            den += 1
    return num / den if den else float("nan")


def tf_pairs(fields: dict, sums: dict, boot_iters: int) -> dict:
    """Paired differences (reference − other) of the teacher-forced metrics on the problems both
    arms replayed, with a bootstrap CI over problems and p-value; significant when the 95% CI
    excludes 0."""
    pairs = {}
    # records of two gates files (say in-distribution and general gates) make two trimkv arms
    # of one label: name each by its gates, or one pair would overwrite the other
    several_gates = len({fields[n].get("gates") for n in sums} - {None, ""}) > 1

    def label(x: Arm) -> str:
        return x.label + (f" g{x.gates}" if several_gates and x.gates else "")

    for ref_name, ref in sums.items():
        a = Arm(**fields[ref_name])
        if a.value_slots is not None or not (a.policy == PAIR_REFERENCE
                                             or needs_gates(a.policy)):
            continue
        for name, other in sums.items():
            b = Arm(**fields[name])
            if name == ref_name or (b.budget, b.window) != (a.budget, a.window):
                continue
            # trimkv is the reference against its own hybrid (same gates) and, where two gates
            # files ran, against the other gates with the same value slots (once per pair:
            # the gates whose hash sorts first are the reference)
            if needs_gates(a.policy) and not (
                    b.policy == a.policy and (b.gates == a.gates or (
                        b.value_slots == a.value_slots and b.gates > a.gates))):
                continue
            pids = sorted(set(ref) & set(other))
            counts = [ref[p]["count"] for p in pids]
            assert counts == [other[p]["count"] for p in pids]  # same forced tokens
            row = {"reference": label(a), "other": label(b), "budget": a.budget,
                   "window": a.window, "n_paired": len(pids)}
            for metric in TF_METRICS:
                d, lo, hi, p = st.paired_cluster_bootstrap(
                    [ref[q][metric] for q in pids], [other[q][metric] for q in pids], counts,
                    boot_iters)
                row[metric] = {"diff": d, "boot95": [lo, hi], "p": p,
                               "significant": bool(lo > 0 or hi < 0)}
            pairs[f"{label(a)} vs {label(b)} @T={a.budget}"] = row
    return pairs


def plot(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gen = [s for s in summary["generation"].values() if s["decoding"] == "greedy"]
    full = next((s for s in gen if s["policy"] == "full"), None)
    lines = defaultdict(list)
    for s in gen:
        if s["policy"] != "full":
            lines[Arm(**{k: s[k] for k in ("policy", "value_slots")}).label].append(s)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for lab, ss in sorted(lines.items()):
        ss.sort(key=lambda s: s["budget"])
        xs = [s["budget"] for s in ss]
        axes[0].errorbar(xs, [s["accuracy"] for s in ss], marker="o", capsize=3, label=lab,
                         yerr=[[s["accuracy"] - s["wilson95"][0] for s in ss],
                               [s["wilson95"][1] - s["accuracy"] for s in ss]], alpha=0.8)
        axes[1].plot(xs, [s.get("vs_full", {}).get("same_answer") for s in ss], marker="o",
                     label=lab)
    if full:
        for ax, y in ((axes[0], full["accuracy"]), (axes[1], 1.0)):
            ax.axhline(y, color="k", ls="--", label="full cache")
        axes[0].axhspan(*full["wilson95"], color="k", alpha=0.08)
    axes[0].set(xlabel="budget T (tokens per layer and KV head)", ylabel="accuracy (greedy)",
                title="accuracy vs budget (95% Wilson CI)")
    axes[1].set(xlabel="budget T", ylabel="share with the same answer as full",
                title="answer agreement with the full cache")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=110)
    plt.close(fig)

    all_tf = [s for s in summary["teacher_forced"].values() if s["policy"] != "full"]
    main_budget = _main_budget(out, all_tf)
    tf = [s for s in all_tf if s["budget"] == main_budget]
    # --task champ replays texts other models wrote, not the full cache's own output
    cfg = out / "config.json"
    recorded = cfg.exists() and json.loads(cfg.read_text()).get("task") == "champ"
    replayed = "recorded solutions" if recorded else "the full-cache greedy output"
    panels = ((f"KL(full||policy), top-{TF_K}+rest", "kl"),
              ("NLL excess over full (nats/token)", "nll_excess"),
              ("top-1 agreement with the replayed text" if recorded
               else "top-1 agreement with full output", "top1_agree"))
    if tf:
        tf.sort(key=lambda s: s.get("kl_after_first_eviction") or 0)
        # two gates files make two trimkv bars: name each by its gates (as tf_pairs does)
        several_gates = len({s.get("gates") for s in tf} - {None, ""}) > 1
        labels = [Arm(**{k: s[k] for k in ("policy", "value_slots")}).label
                  + (f" g{s['gates']}" if several_gates and s.get("gates") else "") for s in tf]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
        for ax, (title, metric) in zip(axes, panels):
            vals, err = _with_ci(tf, metric)
            ax.barh(labels, vals, xerr=err, capsize=3)
            ax.set_title(title + " [95% bootstrap CI]", fontsize=9)
        fig.suptitle(f"teacher-forced replay of {replayed} at T={main_budget} "
                     f"(tokens after the first eviction, n={tf[0]['n']} problems)", fontsize=10)
        fig.tight_layout()
        fig.savefig(out / "fidelity.png", dpi=110)
        plt.close(fig)
    curves = defaultdict(list)
    for s in all_tf:
        curves[Arm(**{k: s[k] for k in ("policy", "value_slots")}).label].append(s)
    curves = {lab: sorted(ss, key=lambda s: s["budget"]) for lab, ss in curves.items()
              if len({s["budget"] for s in ss}) >= 2}
    if curves:
        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        for lab, ss in sorted(curves.items()):
            xs = [s["compression"] for s in ss]
            for ax, (title, metric) in zip(axes, (panels[0], panels[2])):
                vals, err = _with_ci(ss, metric)
                ax.errorbar(xs, vals, yerr=err, marker="o", capsize=3, label=lab, alpha=0.85)
        for ax, (title, _) in zip(axes, (panels[0], panels[2])):
            ax.set_xscale("log", base=2)
            ax.set(xlabel="compression of the generated tokens' cache (x, mean over measured "
                          "tokens)", title=title + " [95% bootstrap CI]")
            ax.legend(fontsize=8)
        for s in next(iter(curves.values())):  # budget labels on the first panel
            axes[0].annotate(f"T={s['budget']}", (s["compression"], s["kl_after_first_eviction"]),
                             fontsize=7, textcoords="offset points", xytext=(4, 4))
        fig.suptitle(f"budget curve (teacher-forced, R = T/4, n={min(s['n'] for ss in curves.values() for s in ss)} problems)",
                     fontsize=10)
        fig.tight_layout()
        fig.savefig(out / "budget_curve.png", dpi=110)
        plt.close(fig)


def _main_budget(out: Path, tf_summaries: list[dict]) -> int | None:
    cfg = out / "config.json"
    if cfg.exists():
        return json.loads(cfg.read_text())["budget"]
    budgets = [s["budget"] for s in tf_summaries]
    return max(set(budgets), key=budgets.count) if budgets else None


def _with_ci(summaries: list[dict], metric: str):
    """Values and asymmetric error bars of a teacher-forced metric."""
    key, ci = f"{metric}_after_first_eviction", f"{metric}_boot95_after_first_eviction"
    vals = [s.get(key) for s in summaries]
    lo = [v - s[ci][0] if ci in s else 0 for v, s in zip(vals, summaries)]
    hi = [s[ci][1] - v if ci in s else 0 for v, s in zip(vals, summaries)]
    return vals, [lo, hi]


def markdown(summary: dict) -> str:
    lines = ["| arm | n | accuracy [95% CI] | Δ vs full [boot 95%] | McNemar p | same answer | "
             "1st divergence (median) | loops | mean tokens |", "|---" * 9 + "|"]
    for name, s in summary["generation"].items():
        v = s.get("vs_full", {})
        fmt = lambda x, p=2: "–" if x is None else f"{x:.{p}f}"  # noqa: E731
        ci = f"{fmt(s['accuracy'])} [{fmt(s['wilson95'][0])}, {fmt(s['wilson95'][1])}]"
        d = ("–" if not v else f"{v['acc_diff']:+.2f} [{v['acc_diff_boot95'][0]:+.2f}, "
             f"{v['acc_diff_boot95'][1]:+.2f}]")
        lines.append(f"| {name} | {s['n']} | {ci} | {d} | {fmt(v.get('mcnemar_p'), 3)} | "
                     f"{fmt(v.get('same_answer'))} | {v.get('first_divergence_median', '–')} | "
                     f"{fmt(s['loop_rate'])} | {s['mean_tokens']:.0f} |")
    if summary["teacher_forced"]:
        lines += ["", "| teacher-forced arm | n | compression | NLL after 1st eviction | "
                  "NLL excess [boot 95%] | KL, lower bound [boot 95%] | top-1 agreement [boot 95%] |",
                  "|---" * 7 + "|"]
        for name, s in summary["teacher_forced"].items():
            cells = []
            for metric, p in (("nll_excess", "+.3f"), ("kl", ".4f"), ("top1_agree", ".3f")):
                v = s.get(f"{metric}_after_first_eviction")
                ci = s.get(f"{metric}_boot95_after_first_eviction")
                cells.append("–" if v is None
                             else f"{v:{p}}" + (f" [{ci[0]:{p}}, {ci[1]:{p}}]" if ci else ""))
            comp = f"{s['compression']:.1f}×" if "compression" in s else "–"
            lines.append(f"| {name} | {s['n']} | {comp} | {s['nll_after_first_eviction']:.3f} | "
                         + " | ".join(cells) + " |")
    if summary.get("teacher_forced_pairs"):
        lines += ["", "| paired difference (teacher-forced) | n | ΔKL [boot 95%] | p | "
                  "ΔNLL excess [boot 95%] | p | Δtop-1 [boot 95%] | p |", "|---" * 8 + "|"]
        for name, row in summary["teacher_forced_pairs"].items():
            cells = []
            for metric in TF_METRICS:
                m = row[metric]
                star = " *" if m["significant"] else ""
                cells.append(f"{m['diff']:+.4f} [{m['boot95'][0]:+.4f}, {m['boot95'][1]:+.4f}]"
                             f"{star} | {m['p']:.3f}")
            lines.append(f"| {name} | {row['n_paired']} | " + " | ".join(cells) + " |")
        lines.append("\n\\* the 95% interval excludes 0")
    return "\n".join(lines) + "\n"


def report(out: Path, boot_iters: int = 10000) -> dict:
    rows = load_rows(out)
    if (out / "records.jsonl").exists():
        write_compact(out, rows)
    summary = summarize(rows, boot_iters)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(markdown(summary))
    plot(summary, out)
    return summary


def compare(a_rows: list[dict], b_rows: list[dict], boot_iters: int = 10000) -> dict:
    """Each generation arm that both runs served (same arm name: policy, budget, window,
    decoding), paired per problem: run A against run B. For two runs that differ only in what the
    arm names do not say, e.g. the server's --kv-cache-dtype. Problems are matched by id and must
    have the same question in both runs (same task and seed)."""
    def by_arm(rows):
        out: dict[str, dict[str, dict]] = defaultdict(dict)
        for r in rows:
            if r["arm_fields"].get("kind", "gen") != "tf":
                out[r["arm"]][r["pid"]] = r
        return out

    a_arms, b_arms = by_arm(a_rows), by_arm(b_rows)
    result = {}
    for name in sorted(set(a_arms) & set(b_arms)):
        ra, rb = a_arms[name], b_arms[name]
        common = sorted(set(ra) & set(rb))
        if not common:
            continue
        differ = [p for p in common if ra[p].get("question") != rb[p].get("question")]
        if differ:
            raise ValueError(f"{name}: the runs hold different problems under the same ids "
                             f"(another task or seed?): {differ[:3]}")
        pair = paired_answers(ra, rb, common, boot_iters)
        divs = pair.pop("divergences")
        pos = sorted(x for x in divs if x is not None)
        ka, kb, n = (sum(bool(ra[p]["correct"]) for p in common),
                     sum(bool(rb[p]["correct"]) for p in common), len(common))
        result[name] = {
            **pair, "a_correct": ka, "b_correct": kb,
            "a_accuracy": ka / n, "a_wilson95": list(st.wilson(ka, n)),
            "b_accuracy": kb / n, "b_wilson95": list(st.wilson(kb, n)),
            "identical": st.mean(x is None for x in divs),
            "first_divergence_median": pos[len(pos) // 2] if pos else None,
            "a_mean_tokens": st.mean(ra[p]["n_tokens"] for p in common),
            "b_mean_tokens": st.mean(rb[p]["n_tokens"] for p in common)}
    return result


def compare_markdown(result: dict, a_label: str, b_label: str) -> str:
    lines = [f"| arm | n | {a_label} [95% CI] | {b_label} [95% CI] | Δ ({a_label} − {b_label}) "
             f"[boot 95%] | only {a_label} right | only {b_label} right | McNemar p | "
             "same answer | identical output | 1st divergence (median) |", "|---" * 11 + "|"]
    for name, c in result.items():
        lines.append(
            f"| {name} | {c['n_paired']} | {c['a_accuracy']:.2f} [{c['a_wilson95'][0]:.2f}, "
            f"{c['a_wilson95'][1]:.2f}] | {c['b_accuracy']:.2f} [{c['b_wilson95'][0]:.2f}, "
            f"{c['b_wilson95'][1]:.2f}] | {c['acc_diff']:+.2f} [{c['acc_diff_boot95'][0]:+.2f}, "
            f"{c['acc_diff_boot95'][1]:+.2f}] | {c['only_a_right']} | {c['only_b_right']} | "
            f"{c['mcnemar_p']:.3f} | {c['same_answer']:.2f} | {c['identical']:.2f} | "
            f"{c['first_divergence_median'] if c['first_divergence_median'] is not None else '–'} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- throughput


def throughput(a) -> dict:
    """Generated tokens/s at each concurrency: c requests of exactly --tokens new tokens
    (ignore_eos), half full cache and half vase-attnv at the main budget when the server takes
    per-request settings."""
    h = Harness(a)
    probs = load_problems(a.task, max(a.concurrency_list), a.seed)
    arm_e = Arm(QUERY_POLICY, a.budget, a.window)
    result = {"mode": h.mode, "tokens": a.tokens, "runs": []}
    with h.start_server([arm_e]) as server:
        for c in a.concurrency_list:
            arms = [Arm("full"), arm_e] if h.mode == "per-request" else [arm_e]
            payloads = []
            for i in range(c):
                p = h.payload(arms[i % len(arms)], probs[i])
                p["sampling_params"].update(max_new_tokens=a.tokens, ignore_eos=True)
                payloads.append(p)
            t0 = time.time()
            with ThreadPoolExecutor(c) as pool:
                res = list(pool.map(lambda p: server.post("/generate", p), payloads))
            wall = time.time() - t0
            toks = sum(r["meta_info"]["completion_tokens"] for r in res)
            run = {"concurrency": c, "wall_s": round(wall, 1), "tokens": toks,
                   "tok_per_s": round(toks / wall, 1)}
            print(json.dumps(run), flush=True)
            result["runs"].append(run)
            (Path(a.out) / "throughput.json").write_text(json.dumps(result, indent=1))
    return result


# ----------------------------------------------------------------------------- CLI


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument("--model-path", required=True)
        p.add_argument("--out", default="results/accuracy")
        p.add_argument("--task", default="gsm_symbolic",
                       choices=["gsm_symbolic", "chain_sum", "champ"],
                       help="reasoning-gym problems, or champ: long solutions other models wrote "
                            "to CHAMP's competition problems (benchmarks/recorded_texts.py), "
                            "replayed teacher-forced (stages tf and curve only), their first "
                            "--max-new-tokens tokens")
        p.add_argument("--champ-model", default="GPT-4 Turbo",
                       help="--task champ: whose recorded solutions (GPT-4 Turbo, GPT-4, "
                            "GPT-3.5, PaLM 2 Medium)")
        p.add_argument("--champ-file", default=None,
                       help="--task champ: the dataset file (default: the installed "
                            "champ-dataset's v0.json)")
        p.add_argument("--seed", type=int, default=123,
                       help="problem seed (reasoning-gym), and the eviction seed unless "
                            "--eviction-seed is given")
        p.add_argument("--eviction-seed", type=int, default=None,
                       help="seed of the stochastic policies' draws (--kv-evict-seed; default "
                            "--seed): the same problems under other draws, to measure how much "
                            "one set of draws moves the results (use another --out)")
        p.add_argument("--budget", type=int, default=64, help="main budget T (~4x compression of ~280 tokens)")
        p.add_argument("--window", type=int, default=16, help="window R at the main budget")
        p.add_argument("--max-new-tokens", type=int, default=512)
        p.add_argument("--max-total-tokens", type=int, default=65536, help="server KV pool size")
        p.add_argument("--mode", default="auto", choices=["auto", "per-request", "per-arm"])
        p.add_argument("--dtype", default="float32",
                       help="server --dtype: CPUs without native bf16 run bf16 weights far slower")
        p.add_argument("--server-args", default="", help="extra launch_server arguments, one string")
        p.add_argument("--threads", type=int, default=2,
                       help="OMP threads of the server: on 2 cores, 2 threads made 70 tok/s at 64 "
                            "requests, 1 thread 45 (two 1-thread servers: 69)")
        p.add_argument("--sweep", default="32,64,128,192", help="budgets of the sweep stage")
        p.add_argument("--curve", default="32,48,64,96,128,192",
                       help="budgets of the teacher-forced budget curve (window = budget/4)")
        p.add_argument("--curve-policies", default="vase-attnv,snapkv,random",
                       help="policies of the curve stage (trimkv needs --retention-gates)")
        p.add_argument("--policies", default="",
                       help="comma list: only these policies' arms in the greedy, tf, sweep and "
                            "sample stages (the full cache always runs; default: every policy), "
                            "e.g. vase-attnv with --server-args '--kv-cache-dtype fp8_e4m3'")
        p.add_argument("--retention-gates", default=None, metavar="PATH",
                       help="retention gates (python -m vase_sglang.retention train): the server "
                            "loads them, and greedy and tf gain the arms trimkv and the hybrid "
                            "trimkv with value_slots = budget/4")

    r = sub.add_parser("run")
    common(r)
    r.add_argument("--stages", default="greedy,tf,curve",
                   help="comma list of stages in order, each optionally STAGE:N (its first N "
                        "problems), e.g. greedy:30,tf:30,greedy:100 to get fidelity early")
    r.add_argument("--n", type=int, default=100, help="problems of the greedy stage")
    r.add_argument("--tf-n", type=int, default=40)
    r.add_argument("--curve-n", type=int, default=40)
    r.add_argument("--sweep-n", type=int, default=50)
    r.add_argument("--sample-n", type=int, default=100)
    r.add_argument("--concurrency", type=int, default=64)
    r.add_argument("--boot-iters", type=int, default=10000)
    r.add_argument("--no-ablations", action="store_true",
                   help="greedy and tf stages without the ablations (vase-attnv with "
                        "value_slots=0, the trimkv + value slots hybrid)")

    t = sub.add_parser("throughput")
    common(t)
    t.add_argument("--concurrency", dest="concurrency_list", default="16,32,64")
    t.add_argument("--tokens", type=int, default=128)

    rp = sub.add_parser("report")
    rp.add_argument("--out", default="results/accuracy")
    rp.add_argument("--boot-iters", type=int, default=10000)

    cp = sub.add_parser("compare", help="pair the generation arms two runs share, per problem "
                        "(e.g. the same arms on an fp8 KV cache against the model dtype)")
    cp.add_argument("a", help="run A's --out folder (records.jsonl or records.jsonl.gz)")
    cp.add_argument("b", help="run B's --out folder")
    cp.add_argument("--labels", default="A,B", help="names of A and B in the table, e.g. fp8,bf16")
    cp.add_argument("--out", default=None,
                    help="folder for compare.json and compare.md (default: A's folder)")
    cp.add_argument("--boot-iters", type=int, default=10000)

    ex = sub.add_parser("export-gsm8k")
    ex.add_argument("--task", default="gsm_symbolic")
    ex.add_argument("--n", type=int, default=200)
    ex.add_argument("--seed", type=int, default=123)
    ex.add_argument("--out", required=True)

    a = ap.parse_args(argv)
    if hasattr(a, "sweep"):
        a.sweep = [int(x) for x in a.sweep.split(",") if x]
        a.curve = [int(x) for x in a.curve.split(",") if x]
        a.curve_policies = [x for x in a.curve_policies.split(",") if x]
        a.policies = [x for x in a.policies.split(",") if x]
        known = POLICIES + RETENTION_POLICIES
        unknown = set(a.policies) - set(known)
        if unknown:
            ap.error(f"--policies: unknown {sorted(unknown)}; choose from {known}")
        unknown = set(a.curve_policies) - set(known[1:])
        if unknown:
            ap.error(f"--curve-policies: unknown {sorted(unknown)}; choose from {known[1:]}")
        gated = [p for p in a.curve_policies if needs_gates(p)]
        if gated and not a.retention_gates:
            ap.error(f"--curve-policies: {gated[0]} needs --retention-gates")
        if a.retention_gates and not Path(a.retention_gates).is_file():
            ap.error(f"--retention-gates: no such file: {a.retention_gates}")
        a.gates_id = gates_id(a.retention_gates) if a.retention_gates else ""  # hashed once
    if getattr(a, "task", None) == "champ":
        if a.cmd == "throughput":
            ap.error("--task champ has no problems to answer: use gsm_symbolic or chain_sum")
        if a.cmd == "run":
            other = [x for x in a.stages.split(",")
                     if x and x.partition(":")[0] not in ("tf", "curve")]
            if other:
                ap.error(f"--task champ replays recorded texts: stages tf and curve only, not "
                         f"{', '.join(other)}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    # a plain `kill` of a background run must still stop its server (finally blocks run)
    old = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return _main(a)
    finally:
        signal.signal(signal.SIGTERM, old)


def eviction_seed(a) -> int:
    return a.seed if getattr(a, "eviction_seed", None) is None else a.eviction_seed


# what a record means beyond its arm name: a resumed run must not mix records made otherwise
RUN_IDENTITY = ("task", "seed", "eviction_seed", "dtype", "server_args", "max_new_tokens",
                "champ_model", "champ_file")


def check_resume(out: Path, a) -> None:
    """Refuse to add records to a folder whose earlier run served otherwise (another seed,
    eviction seed, task, dtype, server flags or length limit): its records would be resumed
    as if they were this run's."""
    cfg_path = out / "config.json"
    if not (out / "records.jsonl").exists() or not cfg_path.exists():
        return
    old = json.loads(cfg_path.read_text())
    old["eviction_seed"] = eviction_seed(argparse.Namespace(**old))  # absent before the option
    now = {**vars(a), "eviction_seed": eviction_seed(a)}
    differ = {k: (old.get(k), now.get(k)) for k in RUN_IDENTITY
              if k in old and old.get(k) != now.get(k)}
    if differ:
        raise SystemExit(f"{out} holds records of a run with other settings "
                         + ", ".join(f"{k}: {o!r} there, {n!r} now" for k, (o, n) in differ.items())
                         + "; use another --out (or the same settings to resume)")


def run_stages(h: Harness) -> dict:
    """The `run` command on a Harness (whose server, if started, stays up: call h.close())."""
    a, out = h.a, h.out
    check_resume(out, a)
    sizes = [int(x.partition(":")[2]) for x in a.stages.split(",") if x.partition(":")[2]]
    if a.task != "champ":  # recorded texts, not problems with a GSM8K answer
        export_gsm8k(load_problems(a.task, max([a.n, a.tf_n, a.curve_n, a.sweep_n, a.sample_n,
                                                *sizes]), a.seed),
                     out / f"{a.task}.gsm8k.jsonl")
    cfg = {**vars(a), "serving": h.mode}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    with open(out / "runs.jsonl", "a") as f:  # config.json is the latest run; this is every run
        f.write(json.dumps({"started": time.strftime("%Y-%m-%d %H:%M:%S"), **cfg}) + "\n")
    print(f"mode: {h.mode}; records: {out / 'records.jsonl'}; server log: {out / 'server.log'}",
          file=sys.stderr)
    summary = {}
    for item in [s for s in a.stages.split(",") if s]:
        stage, _, n = item.partition(":")
        h.stage(stage, int(n) if n else None)
        summary = report(out, a.boot_iters)  # after every stage: partial results are usable
        print(f"stage {stage} done: {out / 'summary.md'}", file=sys.stderr)
    return summary


def _main(a) -> int:
    if a.cmd == "export-gsm8k":
        export_gsm8k(load_problems(a.task, a.n, a.seed), a.out)
        print(a.out)
        return 0
    if a.cmd == "report":
        print(markdown(report(Path(a.out), a.boot_iters)))
        return 0
    if a.cmd == "compare":
        labels = a.labels.split(",")
        if len(labels) != 2:
            raise SystemExit("--labels: two names, e.g. fp8,bf16")
        result = compare(load_rows(Path(a.a)), load_rows(Path(a.b)), a.boot_iters)
        if not result:
            raise SystemExit(f"no generation arm with problems in both {a.a} and {a.b}")
        out = Path(a.out or a.a)
        out.mkdir(parents=True, exist_ok=True)
        md = compare_markdown(result, *labels)
        (out / "compare.json").write_text(json.dumps(
            {"a": str(a.a), "b": str(a.b), "labels": labels, "arms": result}, indent=1))
        (out / "compare.md").write_text(md)
        print(md)
        return 0
    if a.cmd == "throughput":
        a.concurrency_list = [int(x) for x in a.concurrency_list.split(",")]
        a.concurrency = max(a.concurrency_list)
        throughput(a)
        return 0
    h = Harness(a)
    try:
        summary = run_stages(h)
    finally:
        h.close()
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
