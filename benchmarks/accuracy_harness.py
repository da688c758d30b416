"""The accuracy harness' serving side (benchmarks/accuracy.py): the arms (policy, budget, window,
value slots, decoding, greedy or teacher-forced) and the stages that choose them, the resumable
records, the Harness that starts servers and runs each stage's requests, and the throughput
measurement.

Serving: if the plugin has per-request control (patches/request_control.py), ONE server started
with a query-scoring policy serves every arm at once (each request carries
`custom_params.kv_evict`), so the batch mixes arms; otherwise one server per eviction setting.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import accuracy_stats as st
from benchmarks._server import REPO, BenchServer
from benchmarks.accuracy_tasks import extract_answer, is_right, load_problems, prompt_ids
from vase_sglang.policies import needs_gates, policy_names

# The arms' policies, from the registry (vase_sglang.policies.POLICIES): the full cache and every
# registered policy that needs no retention gates; those that do (trimkv) run with
# --retention-gates only (RETENTION_POLICIES, retention_arms).
POLICIES = ["full", *policy_names(retention=False)]
RETENTION_POLICIES = [p for p in policy_names() if needs_gates(p)]
QUERY_POLICY = "vase-attnv"  # a server started with it records queries for every policy
SAMPLING = {"temperature": 0.6, "top_p": 0.95}  # the paper's sampling
TF_K = 20


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
    scope: str = "head"  # budget_scope: head, layer or global (docs/global_budget.md)

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
        scope = "" if self.scope == "head" else f"/{self.scope}"
        return f"{self.policy}@{self.budget}/w{self.window}{nv}{gates}{scope}"

    @property
    def name(self) -> str:
        return f"{self.setting}:{self.decoding}" + (":tf" if self.kind == "tf" else "")

    @property
    def label(self) -> str:
        return (self.policy + (f" nv={self.value_slots}" if self.value_slots is not None else "")
                + ("" if self.scope == "head" else f" {self.scope}"))

    def kv_evict(self):
        if not self.evicts:
            return False
        d = {"policy": self.policy, "budget": self.budget, "window": self.window}
        if self.value_slots is not None:
            d["value_slots"] = self.value_slots
        if self.scope != "head":
            d["budget_scope"] = self.scope
        return d

    def flags(self) -> list[str]:
        if not self.evicts:
            return []
        f = ["--kv-evict-policy", self.policy, "--kv-evict-budget", str(self.budget),
             "--kv-evict-window", str(self.window)]
        if self.value_slots is not None:
            f += ["--kv-evict-value-slots", str(self.value_slots)]
        if self.scope != "head":
            f += ["--kv-evict-budget-scope", self.scope]
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
    policy (TRIM-KV), at each --scopes budget scope its scores allow (Policy.shares_budget),
    and, with `hybrid` where it reserves value slots, the VaSE hybrid (the N_v = T/4 largest
    value ranges forced first, as vase-attnv's default) at this budget; none without gates."""
    from vase_sglang.policies import POLICIES as REGISTRY

    if not a.gates_id:
        return []
    arms = []
    for p in RETENTION_POLICIES:
        if not keep(p):
            continue
        arms.append(Arm(p, budget, window, gates=a.gates_id))
        if REGISTRY[p].shares_budget:
            arms += [Arm(p, budget, window, gates=a.gates_id, scope=s)
                     for s in getattr(a, "scopes", ("head",)) if s != "head"]
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
        return [Arm(x.policy, x.budget, x.window, x.value_slots, kind="tf", gates=x.gates,
                    scope=x.scope) for x in main + ablation + learned]
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


# ----------------------------------------------------------------------------- resume


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
    refuse_other_settings(out, old, {**vars(a), "eviction_seed": eviction_seed(a)}, RUN_IDENTITY)


def refuse_other_settings(out: Path, old: dict, now: dict, identity) -> None:
    """Stop where a setting of `identity` recorded in `old` (a folder's config) differs now."""
    differ = {k: (old.get(k), now.get(k)) for k in identity
              if k in old and old.get(k) != now.get(k)}
    if differ:
        raise SystemExit(f"{out} holds records of a run with other settings "
                         + ", ".join(f"{k}: {o!r} there, {n!r} now" for k, (o, n) in differ.items())
                         + "; use another --out (or the same settings to resume)")


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
