"""Served budget scopes against the masked reference, token by token, on the real model.

    python benchmarks/served_vs_masked.py --served results/accuracy_scopes \\
        --masked docs/results/global_budget/trimkv_scopes --out docs/results/global_budget/served

The accuracy harness' teacher-forced arms (benchmarks/accuracy.py `--stages tf`, a real SGLang
server replaying the full cache's greedy output during decode) record the NLL of each forced
token; benchmarks/global_budget.py records the same for its masked rows (transformers, every
token kept, a per-(layer, head) mask hiding the evicted ones) on the same forced tokens. Where
both ran the same policy, budget, window, gates and scope, each token's NLL should agree up to
the two engines' arithmetic (fp32 on both sides): this compares them per scope and writes the
largest and median |Δ NLL|, and the same for the per-head scope as the yardstick (the
tolerance the per-head policies meet today).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import accuracy as acc  # noqa: E402

# the served arm's scope -> the masked row's scope (global_budget.Row.name, floor 0)
ROW_SCOPES = {"head": "per-head", "layer": "layer", "global": "global"}


def compare(served_rows: list[dict], masked_rows: list[dict], budget: int, window: int,
            gates: str, policy: str = "trimkv") -> dict:
    """Per scope: tokens compared, max / median |Δ NLL|, problems, over the (problem, scope)
    pairs both sides recorded with the same gates (`gates`: the file's SHA-256; served arms
    name its first 8 hex digits) and no value slots."""
    masked = {r["pid"]: r["modes"] for r in masked_rows}
    out = {}
    for r in served_rows:
        f = r.get("arm_fields") or {}
        if (f.get("kind") != "tf" or f.get("policy") != policy or f.get("budget") != budget
                or f.get("window") != window or r["pid"] not in masked
                or f.get("value_slots") is not None or not gates.startswith(f.get("gates") or "-")):
            continue
        scope = f.get("scope", "head")
        row = masked[r["pid"]].get(f"{policy} {ROW_SCOPES[scope]}")
        if row is None:
            continue
        diffs = [abs(a - b) for a, b in zip(r["nll"], row["nll"], strict=True)]
        s = out.setdefault(scope, {"problems": 0, "diffs": []})
        s["problems"] += 1
        s["diffs"] += diffs
    return {scope: {"problems": s["problems"], "tokens": len(s["diffs"]),
                    "max_abs_diff": max(s["diffs"]), "median_abs_diff": statistics.median(s["diffs"]),
                    "share_above_1e-3": sum(d > 1e-3 for d in s["diffs"]) / len(s["diffs"])}
            for scope, s in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--served", required=True, help="accuracy harness --out with trimkv tf arms")
    ap.add_argument("--masked", required=True, help="global_budget.py --out (records.jsonl)")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    served = acc.load_rows(Path(a.served))
    masked = [json.loads(x) for x in (Path(a.masked) / "records.jsonl").read_text().splitlines()]
    gates = json.loads((Path(a.masked) / "summary.json").read_text())["config"]["gates_sha256"]
    result = compare(served, masked, a.budget, a.window, gates)
    if not result:
        raise SystemExit("no (problem, scope) recorded on both sides")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "served_vs_masked.json").write_text(json.dumps(
        {"config": {**vars(a), "gates_sha256": gates}, "scopes": result}, indent=1))
    lines = ["| scope | problems | tokens | max abs diff NLL | median | share > 1e-3 |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {s} | {v['problems']} | {v['tokens']} | {v['max_abs_diff']:.2e} | "
              f"{v['median_abs_diff']:.1e} | {v['share_above_1e-3']:.3f} |"
              for s, v in sorted(result.items())]
    (out / "served_vs_masked.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
