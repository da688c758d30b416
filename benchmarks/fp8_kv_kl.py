"""What an 8-bit KV cache costs on top of eviction: teacher-forced KL(full || arm) with K/V
cached in fp8 (--kv-cache-dtype fp8_e4m3 / fp8_e5m2), with and without eviction.

The arms run on the transformers reference (vase_sglang.serving.hf_reference.ReferenceDecoder),
which equals the server with the same cache format to ~1e-7 in logprob when no rounding flips
(tests/test_server_fp8.py). This way every arm replays the same tokens with the same random
draws (one request key per problem), so the arms pair exactly.

The replayed tokens are the full cache's greedy answers from the accuracy study
(docs/results/accuracy/records.jsonl.gz, arm `full:greedy`). The reference distribution is the
full cache in the model's dtype replayed here first (its top-20 per step, recorded), and KL is
the accuracy harness' coarse KL: the top-20 plus the rest (benchmarks/accuracy_stats.coarse_kl).

    python benchmarks/fp8_kv_kl.py --problems 12 --budget 64 --window 16

Records are appended per (arm, problem) to --out/records.jsonl, and a rerun skips what is
done. The summary (JSON + PNG + a markdown table) goes to --out.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import accuracy_stats as st  # noqa: E402

DTYPES = {"model": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def arms(budget: int, window: int, policies: list[str], kv=("fp8_e4m3", "fp8_e5m2")) -> list[dict]:
    """The full cache in the model's dtype first (the reference), then the full cache in each
    8-bit format, then each policy in the model's dtype and in each format."""
    dtypes = ["model", *kv]
    out = [{"policy": "full", "kv": d} for d in dtypes]
    for p in policies:
        out += [{"policy": p, "budget": budget, "window": window, "kv": d} for d in dtypes]
    return out


def arm_name(a: dict) -> str:
    setting = "full" if a["policy"] == "full" else f"{a['policy']}@{a['budget']}/w{a['window']}"
    return f"{setting}:{a['kv']}"


def load_replays(records: Path, n: int) -> list[dict]:
    """The first n problems and the full cache's greedy answer to each (the forced tokens)."""
    greedy = {}
    with gzip.open(records, "rt") as f:
        for line in f:
            r = json.loads(line)
            if r["arm"] == "full:greedy":
                greedy[r["pid"]] = r
    pids = sorted(greedy, key=lambda p: int(p.rsplit("-", 1)[1]))[:n]
    return [{"pid": p, "question": greedy[p]["question"], "forced": greedy[p]["output_ids"]}
            for p in pids]


TOP_K = 20


def replay(model, tok, arm: dict, prob: dict, request_key: int, ref: dict | None) -> dict:
    """One teacher-forced replay. ref: the reference replay's row (None: this is the
    reference, whose top-TOP_K ids and logprobs per step are recorded)."""
    from benchmarks.accuracy import prompt_ids
    from vase_sglang import EvictionConfig
    from vase_sglang.serving.hf_reference import ReferenceDecoder

    if arm["policy"] == "full":
        cfg = EvictionConfig(policy="full")
    else:
        cfg = EvictionConfig(policy=arm["policy"], budget=arm["budget"], window=arm["window"],
                             seed=0)
    kl, top1, top_ids, top_lp = [], [], [], []

    def observe(step, logp):
        if ref is None:
            lp, ids = logp.topk(TOP_K)
            top_ids.append(ids.tolist())
            top_lp.append([round(x, 6) for x in lp.tolist()])
            kl.append(0.0)
        else:
            ids = torch.tensor(ref["ref_ids"][step])
            kl.append(st.coarse_kl(ref["ref_lp"][step], logp[ids].tolist()))
        top1.append(int(int(logp.argmax()) == prob["forced"][step]))

    start = time.time()
    res = ReferenceDecoder(model, cfg, kv_dtype=DTYPES[arm["kv"]]).run(
        prompt_ids(tok, prob), forced_ids=prob["forced"], request_key=request_key,
        observe=observe)
    row = {"arm": arm_name(arm), "arm_fields": arm, "pid": prob["pid"], "kl": kl,
           "top1_agree": top1, "evicted": res["evicted"], "rounds": res["rounds"],
           "secs": round(time.time() - start, 1)}
    if ref is None:
        row.update(ref_ids=top_ids, ref_lp=top_lp)
    return row


def summarize(rows: list[dict], boot_iters: int = 10000) -> dict:
    """Per arm: mean KL per token over the tokens at or after T + R (where eviction acts; all
    tokens for the full cache in 8 bits), with a cluster bootstrap over problems; and each
    eviction arm in fp8 paired against the same arm in the model's dtype."""
    by_arm: dict[str, dict] = {}
    for r in rows:
        by_arm.setdefault(r["arm"], {})[r["pid"]] = r
    out = {"arms": {}, "pairs": {}}
    for name, recs in sorted(by_arm.items()):
        fields = next(iter(recs.values()))["arm_fields"]
        if fields["policy"] == "full" and fields["kv"] == "model":
            continue  # the reference itself
        start = fields.get("budget", 0) + fields.get("window", 0)
        pids = sorted(recs)
        sums = [sum(recs[p]["kl"][start:]) for p in pids]
        counts = [len(recs[p]["kl"][start:]) for p in pids]
        mean, lo, hi = st.cluster_bootstrap(sums, counts, boot_iters)
        agree = sum(sum(recs[p]["top1_agree"][start:]) for p in pids) / max(1, sum(counts))
        out["arms"][name] = {"fields": fields, "problems": len(pids), "tokens": sum(counts),
                             "kl": mean, "kl_boot95": [lo, hi], "top1_agree": agree,
                             "secs": sum(recs[p]["secs"] for p in pids)}
    for name, a in out["arms"].items():
        f = a["fields"]
        if f["policy"] == "full" or f["kv"] == "model":
            continue
        base = f"{f['policy']}@{f['budget']}/w{f['window']}:model"
        if base not in by_arm:
            continue
        start = f["budget"] + f["window"]
        pids = sorted(set(by_arm[name]) & set(by_arm[base]))
        d, lo, hi, p = st.paired_cluster_bootstrap(
            [sum(by_arm[name][q]["kl"][start:]) for q in pids],
            [sum(by_arm[base][q]["kl"][start:]) for q in pids],
            [len(by_arm[name][q]["kl"][start:]) for q in pids], boot_iters)
        out["pairs"][f"{name} - {base}"] = {"diff": d, "boot95": [lo, hi], "p": p,
                                            "problems": len(pids)}
    return out


def markdown(summary: dict) -> str:
    lines = ["| arm | KV cache | problems | tokens | KL(full ‖ arm) per token [95% CI] | "
             "top-1 agreement |", "|---|---|---|---|---|---|"]
    for name, a in summary["arms"].items():
        f = a["fields"]
        setting = "full" if f["policy"] == "full" else f"{f['policy']} T={f['budget']} R={f['window']}"
        lines.append(f"| {setting} | {f['kv']} | {a['problems']} | {a['tokens']} | "
                     f"{a['kl']:.4f} [{a['kl_boot95'][0]:.4f}, {a['kl_boot95'][1]:.4f}] | "
                     f"{a['top1_agree']:.3f} |")
    if summary["pairs"]:
        lines += ["", "| fp8 arm − same arm in the model's dtype | KL difference [95% CI] | p |",
                  "|---|---|---|"]
        for name, p in summary["pairs"].items():
            lines.append(f"| {name} | {p['diff']:+.4f} [{p['boot95'][0]:+.4f}, "
                         f"{p['boot95'][1]:+.4f}] | {p['p']:.3g} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["arms"])
    kl = [summary["arms"][n]["kl"] for n in names]
    err = [[k - summary["arms"][n]["kl_boot95"][0] for n, k in zip(names, kl)],
           [summary["arms"][n]["kl_boot95"][1] - k for n, k in zip(names, kl)]]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.5))
    ax.barh(range(len(names)), kl, xerr=err, color="tab:blue")
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("KL(full ‖ arm) per token, top-20 + rest (95% CI over problems)")
    ax.set_title("Eviction on an 8-bit KV cache, teacher-forced")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--records", type=Path,
                   default=ROOT / "docs/results/accuracy/records.jsonl.gz",
                   help="the accuracy study's records (full:greedy and full:greedy:tf)")
    p.add_argument("--problems", type=int, default=12)
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--policies", default="vase-attnv", help="comma-separated")
    p.add_argument("--kv", default="fp8_e4m3,fp8_e5m2", help="8-bit formats, comma-separated")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "docs/results/fp8_kv")
    p.add_argument("--report-only", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    a.out.mkdir(parents=True, exist_ok=True)
    rec_path = a.out / "records.jsonl"
    done = {}
    if rec_path.exists():
        for line in rec_path.read_text().splitlines():
            r = json.loads(line)
            done[(r["arm"], r["pid"])] = r
    if not a.report_only:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from vase_sglang.serving.models import MODELS, fetch

        path = str(fetch(a.model)) if a.model in MODELS else a.model
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        probs = load_replays(a.records, a.problems)
        todo = [(arm, prob) for prob in probs
                for arm in arms(a.budget, a.window, a.policies.split(","), a.kv.split(","))
                if (arm_name(arm), prob["pid"]) not in done]
        print(f"{len(todo)} replays to run ({len(done)} recorded)", flush=True)
        from tqdm import tqdm

        reference = arm_name(arms(a.budget, a.window, [])[0])
        for arm, prob in tqdm(todo, desc="replays"):  # each problem's reference comes first
            key = random.Random(prob["pid"]).getrandbits(31)  # one draw stream per problem
            ref = None if arm_name(arm) == reference else done[(reference, prob["pid"])]
            row = replay(model, tok, arm, prob, key, ref)
            done[(row["arm"], row["pid"])] = row
            with open(rec_path, "a") as f:
                f.write(json.dumps(row) + "\n")
    summary = summarize(list(done.values()))
    summary["command"] = "python benchmarks/fp8_kv_kl.py " + " ".join(sys.argv[1:] if argv is None else argv)
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    (a.out / "summary.md").write_text(markdown(summary))
    plot(summary, a.out / "fp8_kv_kl.png")
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
