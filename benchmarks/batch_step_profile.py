"""A decode step's weight products against the batch size, on this machine.

On a CPU most of a small model's decode step is its matrix products with the weights, and the
BLAS library picks its kernel by the number of rows (the batch): the time is a step function of
the batch, not a line through it. Eviction runs more requests at once on the same memory (a
property of the plugin); how many more tokens per second that buys is requests / step time, so
it depends on this curve, which depends on the processor, the BLAS build and the threads. The
concurrency benchmark's tok/s ratios moved between two days with the same running requests
(docs/admission.md); this tool shows the curve behind them.

For each batch size M it times, from the model's config.json, every layer's products as SGLang's
linear layers compute them (torch.nn.functional.linear: fused QKV, attention output, fused
gate/up, down), each layer with its own weights (so they are read from memory as in serving,
not from cache), and the LM head. Attention, norms, sampling and the scheduler are not in it:
the server's own step time per batch size is in each concurrency-benchmark record
(`step_ms_by_running`). Batch sizes are timed in rounds (every M once per round), so slow drift
of the machine falls on all of them alike. Writes JSON + PNG to --out and prints a table.

    python benchmarks/batch_step_profile.py --model qwen2.5-0.5b    # ~1 minute, 2 GB of fp32
    python benchmarks/batch_step_profile.py --model DIR --threads 2 --batch-sizes 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def linear_shapes(config: dict) -> tuple[list[tuple[str, int, int]], tuple[int, int]]:
    """(name, in, out) of one decoder layer's weight products, as SGLang fuses them, and the
    LM head's (in, out)."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    layer = [("qkv", hidden, (heads + 2 * kv_heads) * head_dim),
             ("o", heads * head_dim, hidden),
             ("gate_up", hidden, 2 * inter),
             ("down", inter, hidden)]
    return layer, (hidden, config["vocab_size"])


def profile(config: dict, batch_sizes: list[int], *, dtype: torch.dtype, repeats: int,
            layers: int | None = None, seed: int = 0, progress=None) -> list[dict]:
    """Median, min and max over `repeats` rounds of one step's products at each batch size."""
    layer_shapes, (head_in, head_out) = linear_shapes(config)
    layers = layers or config["num_hidden_layers"]
    gen = torch.Generator().manual_seed(seed)
    weights = [[torch.randn(o, i, generator=gen).to(dtype) for _, i, o in layer_shapes]
               for _ in range(layers)]
    head = torch.randn(head_out, head_in, generator=gen).to(dtype)
    inputs = {m: {i: torch.randn(m, i, generator=gen).to(dtype) for _, i, _ in layer_shapes}
              for m in batch_sizes}

    def step(m: int) -> float:
        x = inputs[m]
        start = time.perf_counter()
        for layer in weights:
            for (_, i, _), w in zip(layer_shapes, layer):
                torch.nn.functional.linear(x[i], w)
        torch.nn.functional.linear(x[head_in], head)
        return time.perf_counter() - start

    for m in batch_sizes:  # warm up: first-call allocation, kernel selection
        step(m)
    times: dict[int, list[float]] = {m: [] for m in batch_sizes}
    for _ in range(repeats):
        for m in batch_sizes:
            times[m].append(step(m))
            if progress is not None:
                progress.update(1)
    rows = []
    for m in batch_sizes:
        med = statistics.median(times[m])
        rows.append({"batch": m, "step_ms": 1000 * med, "min_ms": 1000 * min(times[m]),
                     "max_ms": 1000 * max(times[m]), "tokens_per_s": m / med,
                     "repeats": repeats})
    return rows


def profile_label(result: dict) -> str:
    """'AMD EPYC, 2026-12-05': which processor and day a profile is of."""
    return f"{result['machine']['cpu']}, {result['date_utc'][:10]}"


def plot(rows: list[dict], title: str, path: Path, label: str = "this run",
         compared: list[dict] | None = None) -> None:
    """Step time and tokens/s against the batch; `compared`: earlier profiles' results
    (batch_step_profile.json), drawn beside this one (another processor, day or dtype)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = [r["batch"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.errorbar(m, [r["step_ms"] for r in rows],
               yerr=[[r["step_ms"] - r["min_ms"] for r in rows],
                     [r["max_ms"] - r["step_ms"] for r in rows]], marker="o", capsize=3,
               label=label, color="C0")
    b.plot(m, [r["tokens_per_s"] for r in rows], marker="o", label=label, color="C0")
    for i, other in enumerate(compared or [], start=1):
        om = [r["batch"] for r in other["rows"]]
        a.plot(om, [r["step_ms"] for r in other["rows"]], marker="s", ls="--", color=f"C{i}",
               label=profile_label(other))
        b.plot(om, [r["tokens_per_s"] for r in other["rows"]], marker="s", ls="--",
               color=f"C{i}", label=profile_label(other))
    a.set(xlabel="batch (running requests)", ylabel="weight products per step (ms)",
          title="step time", ylim=(0, None))
    if compared:
        a.legend(fontsize=8)
    b.plot(m, [x * rows[0]["tokens_per_s"] / m[0] for x in m], ls=":", color="gray",
           label="if the step did not grow with the batch")
    b.set(xlabel="batch (running requests)", ylabel="tokens / s", title="throughput",
          ylim=(0, None))
    b.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b",
                    help="a model name of `python -m vase_sglang.models` or a directory with a "
                    "config.json (only the config is read)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=list(range(1, 9)) + [12, 16])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                    help="the weights' dtype (default float32: what the benchmarks serve on CPU)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: the benchmark servers' OMP_NUM_THREADS)")
    ap.add_argument("--repeats", type=int, default=7, help="rounds over the batch sizes")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the config's)")
    ap.add_argument("--out", default=str(REPO / "results" / "batch_step_profile"))
    ap.add_argument("--compare", nargs="+", default=[], metavar="JSON",
                    help="earlier batch_step_profile.json files to draw beside this run (e.g. "
                    "another processor's)")
    args = ap.parse_args(argv)
    for name in ("threads", "repeats"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name} must be positive")
    if args.layers is not None and args.layers <= 0:
        ap.error("--layers must be positive")
    if any(m <= 0 for m in args.batch_sizes):
        ap.error("--batch-sizes must be positive")
    return args


def config_of(model: str) -> tuple[dict, str]:
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        from vase_sglang.serving.models import MODELS, fetch

        if model not in MODELS:
            raise SystemExit(f"{model}: neither a directory with config.json nor one of "
                             f"{sorted(MODELS)}")
        path = Path(fetch(model))
    return json.loads((path / "config.json").read_text()), str(path)


def main(argv=None) -> int:
    args = parse_args(argv)
    compared = []
    for f in args.compare:  # read before the minutes of timing: a wrong path fails now
        try:
            compared.append(json.loads(Path(f).read_text()))
            profile_label(compared[-1]), compared[-1]["rows"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"--compare {f}: not a batch_step_profile.json ({e!r})") from None
    config, path = config_of(args.model)
    torch.set_num_threads(args.threads)
    from tqdm import tqdm

    from benchmarks.concurrency_scaling import machine_facts

    with tqdm(total=args.repeats * len(args.batch_sizes), desc="steps", unit="step",
              file=sys.stdout) as bar:
        rows = profile(config, args.batch_sizes, dtype=DTYPES[args.dtype], repeats=args.repeats,
                       layers=args.layers, progress=bar)
    machine = machine_facts(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": " ".join(["batch_step_profile.py", *(argv if argv is not None else sys.argv[1:])]),
        "model": path, "dtype": args.dtype, "layers": args.layers or config["num_hidden_layers"],
        "shapes": linear_shapes(config), "machine": machine,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows,
        "compared": args.compare,
    }
    (out / "batch_step_profile.json").write_text(json.dumps(result, indent=2))
    title = (f"{Path(path).name}: {args.dtype}, {args.threads} thread(s), {machine['cpu']}, "
             f"torch {machine['torch']}")
    plot(rows, title, out / "batch_step_profile.png", profile_label(result), compared)
    base = rows[0]
    print(f"\n{title}\n| batch | step (ms) [min–max] | tokens/s | step vs batch {base['batch']} |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['step_ms']:.1f} [{r['min_ms']:.1f}–{r['max_ms']:.1f}] | "
              f"{r['tokens_per_s']:.1f} | {r['step_ms'] / base['step_ms']:.2f}× |")
    print(f"wrote {out / 'batch_step_profile.json'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
