"""The GPU check: one call on one CUDA GPU (torch + Triton, no SGLang, no network) that writes one
JSON of everything the CPU suite cannot see.

    python -m vase_sglang.gpu_check --out results/gpu_check.json     (scripts/gpu_check.sh)

Sections, in order (each records its own status; a failing one does not stop the others):

  environment    versions, the device, and a device-to-device copy's bandwidth (the yardstick of
                 the eviction step's bandwidth)
  warm_up        vase_sglang.warmup on Qwen3-4B's attention shapes (every policy, trimkv's side
                 buffers, 16-token pages), twice in fresh processes sharing an empty Triton
                 cache directory: a first start (compiling) and a restart (the on-disk
                 cache); each then runs warmup.probe's steps, which must compile nothing
  kernels        every Triton kernel against its torch reference: at the shapes of
                 benchmarks/kernels.py (Qwen3-4B, T = 2048) with timings, and every dtype x head
                 dim that vase_sglang.ops.aot compiles (bf16/fp16/fp32 x 64/128/256); scores
                 within GPU_SCORE_TOL, and select_tokens on both backends keeping the same
                 tokens (KEPT_AGREEMENT, differences only near ties)
  sglang_decode  SGLang 0.5.23's own Triton decode attention (decode_attention_fwd, exported
                 verbatim into vase_sglang.serving.sglang_decode_attention: SGLang is not
                 installed) over requests' rows as an eviction step leaves them (kept K/V
                 compacted per head, newest moved, freed slots NaN, lengths shrunk), and its
                 output merged through split_lse / merge_attention with cell_attention_triton
                 (the global scope), against fp64 softmax references
                 (vase_sglang.serving.sglang_decode_check)
  graph_capture  CUDA-graph capture and replay of the forward-path hook bodies under
                 torch.cuda.set_sync_debug_mode("error") (vase_sglang.capture.graph_capture_check;
                 "missing" where that module is absent)
  hf_reference   the transformers reference decode loop (vase_sglang.serving.hf_reference) on a tiny
                 Qwen3 with eviction, VASE_KERNELS=triton against VASE_KERNELS=torch: same tokens
  eviction_step  benchmarks/kernels.py --check in a subprocess: the triton step equals the torch
                 step, and the achieved bandwidth of one step against the bytes it must move

Limits: the whole run stays inside --budget-s (default 450 s); a section that would start after
the budget is recorded as skipped, and the benchmark subprocess gets what is left. The JSON is
rewritten after every section, so a run cut short still leaves what it measured.

Never imports SGLang or vase_sglang_patches. Without a CUDA device it writes a JSON saying so and
exits 2. `TRITON_INTERPRET=1 ... --device cpu --quick` runs the same code on CPU with small shapes
and the Triton interpreter: the CPU suite's check of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("environment", "warm_up", "kernels", "sglang_decode", "graph_capture", "step_timer",
            "hf_reference", "eviction_step")
# Scores of the Triton kernels against their fp32 torch references (docs/gpu.md, "Tolerances"):
# on a GPU the dots run on tensor cores (bf16/fp16 operands as they are, fp32 as tf32x3, fp32
# accumulation in the MMA's own order and rounding, unknown until a GPU runs), so rtol 1e-3:
# ~6x the worst-case rounding of a 256-long fp32 dot of unit-scale data (D 2^-24 sum|q_i k_i| /
# sqrt(D) ~ 1.6e-4 of a logit), and 100x+ what the CPU emulation of tf32x3 (1.6e-6) and of the
# CUR projection's split (8e-6) measured. In Triton's interpreter (CPU) the dots are plain fp32
# sums: the old 1e-4, as tests/test_kernels.py.
GPU_SCORE_TOL = dict(rtol=1e-3, atol=1e-6)
SCORE_TOL = dict(rtol=1e-4, atol=1e-6)  # interpreter; tests/test_kernels.py
# Selections: the smallest fraction, over (request, layer, KV head) rows, of kept candidates that
# the triton and torch selections share, at K ~ n / 2 kept. A path using the whole score
# tolerance (plain tf32, emulated: rel. error 7.5e-4) kept >= 0.998; window attention off by
# one key kept 0.80 (tests/test_kernels.py measures both), an unrelated score about K / n.
# Every differing candidate must moreover be a near tie (selection_agreement).
KEPT_AGREEMENT = 0.99
SELECTION_POLICIES = ("snapkv", "vase-attnv", "vase-dkv", "curdkv")
HF_POLICIES = ("vase-attnv", "snapkv", "vase-dkv", "curdkv", "rkv")
STEP_POLICIES = ("vase-attnv", "snapkv", "vase-dkv")  # every kernel; rkv's torch n x n is huge


@dataclass(frozen=True)
class Shapes:
    """One eviction step's candidates: [B, L, H_kv, n, D] K/V, [B, L, H_q, W, D] queries."""

    batch: int
    layers: int
    q_heads: int
    kv_heads: int
    candidates: int
    window: int
    head_dim: int
    rank: int = 20

    @property
    def kept(self) -> int:
        return self.candidates - self.window


# benchmarks/kernels.py's default model (Qwen3-4B) at T = 2048, four requests.
BENCH = Shapes(batch=4, layers=36, q_heads=32, kv_heads=8, candidates=2048, window=64, head_dim=128)
# vase_sglang.ops.aot's shapes, for the dtype x head-dim sweep.
SWEEP = Shapes(batch=2, layers=2, q_heads=32, kv_heads=8, candidates=1003, window=64, head_dim=0)
SWEEP_DTYPES, SWEEP_HEAD_DIMS = ("bfloat16", "float16", "float32"), (64, 128, 256)
QUICK_BENCH = Shapes(batch=2, layers=2, q_heads=4, kv_heads=2, candidates=40, window=8, head_dim=32)
QUICK_SWEEP_DTYPES, QUICK_SWEEP_HEAD_DIMS = ("bfloat16", "float32"), (32,)


# ------------------------------------------------------------------------------- the JSON


class Report:
    """The one JSON file: rewritten whole (via a temporary file) after every section."""

    def __init__(self, path: Path, argv: list[str]):
        self.path = Path(path)
        self.data = {"command": " ".join([sys.executable, "-m", "vase_sglang.gpu_check", *argv]),
                     "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "status": "running",
                     "sections": {}}

    def section(self, name: str, result: dict) -> None:
        self.data["sections"][name] = result
        self.write()

    def finish(self, status: str, **extra) -> None:
        self.data.update(status=status, finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"), **extra)
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        tmp.replace(self.path)


def overall_status(sections: dict) -> str:
    """'failed' if any section failed or raised, else 'ok' (skipped and missing are not
    failures, but stay visible in their sections)."""
    bad = [name for name, s in sections.items() if s.get("status") in ("failed", "error")]
    return "failed" if bad else "ok"


# ----------------------------------------------------------------------------- the sections


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn, device) -> float | None:
    """Median ms of fn on CUDA (triton.testing.do_bench: events, cache flushed); None on CPU."""
    if device.type != "cuda":
        return None
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=5, rep=25, return_mode="median"))


def environment(ctx) -> dict:
    import torch

    info = {"status": "ok", "python": platform.python_version(), "torch": torch.__version__,
            "device": str(ctx.device), "sglang_installed": _installed("sglang"),
            "transformers_installed": _installed("transformers")}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if ctx.device.type == "cuda":
        prop = torch.cuda.get_device_properties(ctx.device)
        info.update(device_name=prop.name, capability=f"{prop.major}.{prop.minor}",
                    multiprocessors=prop.multi_processor_count,
                    memory_gib=round(prop.total_memory / 2**30, 1), cuda=torch.version.cuda)
        n = 2**30  # 1 GiB copied: bytes read + written over the median time
        src = torch.empty(n, dtype=torch.uint8, device=ctx.device)
        dst = torch.empty_like(src)
        ms = _time_ms(lambda: dst.copy_(src), ctx.device)
        info["copy_gb_per_s"] = round(2 * n / (ms / 1e3) / 1e9, 1)
        del src, dst
    return info


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _randn(shape, dtype, device, gen):
    import torch

    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def _compare(name, dtype, shapes, triton_out, ref_out, exact, ms=None, bytes_read=None) -> dict:
    import torch

    row = {"kernel": name, "dtype": str(dtype).replace("torch.", ""), "head_dim": shapes.head_dim,
           "shape": [shapes.batch, shapes.layers, shapes.kv_heads, shapes.candidates]}
    a, b = triton_out.float(), ref_out.float()
    row["max_abs_diff"] = float((a - b).abs().max()) if a.numel() else 0.0
    if not exact:
        row["max_rel_diff"] = (float(((a - b).abs() / b.abs().clamp_min(1e-30)).max())
                               if a.numel() else 0.0)
    try:
        if exact:
            torch.testing.assert_close(triton_out, ref_out, rtol=0, atol=0)
        else:
            torch.testing.assert_close(a, b, **score_tolerance(triton_out.device))
        row["ok"] = True
    except AssertionError as exc:
        row.update(ok=False, error=str(exc).splitlines()[:6])
    if ms is not None:
        row["triton_ms"], row["torch_ms"] = round(ms[0], 4), round(ms[1], 4)
        if bytes_read:
            row["triton_gb_per_s"] = round(bytes_read / (ms[0] / 1e3) / 1e9, 1)
    return row


def score_tolerance(device) -> dict:
    """GPU_SCORE_TOL for scores computed on a CUDA device, SCORE_TOL (interpreter) elsewhere."""
    return GPU_SCORE_TOL if getattr(device, "type", device) == "cuda" else SCORE_TOL


def kept_mask(keep, n: int):
    """Bool [..., n]: which of n candidates the indices keep [..., K] keep."""
    import torch

    return torch.zeros(*keep.shape[:-1], n, dtype=torch.bool, device=keep.device).scatter_(
        -1, keep, True)


def selection_agreement(cfg, keys, values, queries=None, *, attention=None, request=None,
                        layer=None, round=0) -> dict:
    """select_tokens with VASE_KERNELS=torch and =triton on the same candidates: the smallest
    and mean fraction of kept candidates the two share per (batch..., KV head) row, how many
    differ, and how many of those are NOT near ties. A near tie: the candidate's final torch
    score (what top-k ranks: the score, or log score + Gumbel noise for sampling policies) is
    within the score tolerance (score_tolerance of the device, carried into log space for
    samplers) of the row's K-th, its own allowance plus the K-th's: a swap the tolerance
    explains. `ok`: agreement >= KEPT_AGREEMENT and no unexplained difference."""

    from vase_sglang import select_tokens
    from vase_sglang.policies import POLICIES, AttentionParams, Draws

    attention = attention or AttentionParams()
    policy = POLICIES[cfg.policy](cfg, attention)
    n, k = keys.shape[-2], cfg.keep
    tol = score_tolerance(keys.device)
    draws = Draws.make(cfg.seed, keys.shape[:-3], keys.device, request, layer, round)
    saved = os.environ.get("VASE_KERNELS")
    keep = {}
    try:
        for backend in ("torch", "triton"):
            os.environ["VASE_KERNELS"] = backend
            keep[backend] = select_tokens(cfg, keys, values, queries, request=request,
                                          layer=layer, round=round, check=False,
                                          attention=attention)
        # The torch ranking Policy.select builds, and each candidate's allowance in it.
        os.environ["VASE_KERNELS"] = "torch"
        score = policy.score(keys, values, queries, draws).float()
        allowance = tol["atol"] + tol["rtol"] * score.abs()
        final = score
        if policy.samples:
            final = score.clamp_min(1e-30).log() + draws.gumbel(score.shape[-2:])
            allowance = allowance / score.clamp_min(1e-30)  # d log s = ds / s
        final = final.masked_fill(policy.forced(keys, values, cfg.sinks), float("inf"))
    finally:
        _restore_env("VASE_KERNELS", saved)
    a, b = kept_mask(keep["torch"], n), kept_mask(keep["triton"], n)
    shared = (a & b).sum(-1).float() / max(1, k)
    top = final.topk(k, dim=-1)
    boundary = top.values[..., -1:]
    boundary_allowance = allowance.gather(-1, top.indices[..., -1:])
    near = (final - boundary).abs() <= allowance + boundary_allowance
    unexplained = int(((a ^ b) & ~near).sum())
    agreement = float(shared.min()) if shared.numel() else 1.0
    return {"policy": cfg.policy, "kept": k, "candidates": n, "rows": int(shared.numel()),
            "agreement_min": agreement, "agreement_mean": float(shared.mean()) if shared.numel()
            else 1.0, "rows_equal": int((shared == 1).sum()),
            "tokens_differing": int((a ^ b).sum()) // 2, "unexplained": unexplained,
            "ok": agreement >= KEPT_AGREEMENT and unexplained == 0}


def selection_rows(shapes: Shapes, dtype, device, seed: int = 0) -> list[dict]:
    """selection_agreement of each SELECTION_POLICIES policy on random candidates of `shapes`,
    keeping about half of them (budget = n / 2 + window)."""
    import torch

    from vase_sglang.config import EvictionConfig

    s = shapes
    gen = torch.Generator(device=device).manual_seed(seed)
    kv_shape = (s.batch, s.layers, s.kv_heads, s.candidates, s.head_dim)
    keys, values = _randn(kv_shape, dtype, device, gen), _randn(kv_shape, dtype, device, gen)
    queries = _randn((s.layers, s.batch, s.window, s.q_heads, s.head_dim), dtype, device,
                     gen).permute(1, 0, 3, 2, 4)
    request = torch.arange(s.batch, device=device)[:, None]
    layer = torch.arange(s.layers, device=device)[None, :]
    rows = []
    for policy in SELECTION_POLICIES:
        cfg = EvictionConfig(policy=policy, budget=s.candidates // 2 + s.window, window=s.window,
                             sinks=4, seed=seed)
        rows.append(selection_agreement(cfg, keys, values, queries, request=request, layer=layer))
    return rows


def kernel_rows(shapes: Shapes, dtype, device, timed: bool, seed: int = 0) -> list[dict]:
    """Each kernel's triton wrapper against its reference on the same inputs."""
    import torch

    from vase_sglang.ops.cur_leverage import cur_leverage_reference, cur_leverage_triton
    from vase_sglang.ops.value_range import value_range_reference, value_range_triton
    from vase_sglang.ops.window_attention import window_attention_reference, window_attention_triton

    s, elt = shapes, torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator(device=device).manual_seed(seed)
    kv_shape = (s.batch, s.layers, s.kv_heads, s.candidates, s.head_dim)
    keys, values = _randn(kv_shape, dtype, device, gen), _randn(kv_shape, dtype, device, gen)
    # The ring's queries arrive as a permuted view [B, L, H_q, W, D], as the runtime hands them.
    queries = _randn((s.layers, s.batch, s.window, s.q_heads, s.head_dim), dtype, device,
                     gen).permute(1, 0, 3, 2, 4)
    projection = _randn((s.batch, s.layers, s.head_dim, s.rank), torch.float32, device, gen)
    kv_bytes = keys.numel() * elt

    def timed_pair(tri, ref):
        return (_time_ms(tri, device), _time_ms(ref, device)) if timed else None

    rows = [
        _compare("value_range", dtype, s, value_range_triton(values), value_range_reference(values),
                 exact=True, ms=timed_pair(lambda: value_range_triton(values),
                                           lambda: value_range_reference(values)),
                 bytes_read=kv_bytes),
        _compare("window_attention", dtype, s, window_attention_triton(queries, keys),
                 window_attention_reference(queries, keys), exact=False,
                 ms=timed_pair(lambda: window_attention_triton(queries, keys),
                               lambda: window_attention_reference(queries, keys)),
                 bytes_read=kv_bytes + queries.numel() * elt),
        _compare("cur_leverage", dtype, s, cur_leverage_triton(keys, values, projection),
                 cur_leverage_reference(keys, values, projection), exact=False,
                 ms=timed_pair(lambda: cur_leverage_triton(keys, values, projection),
                               lambda: cur_leverage_reference(keys, values, projection)),
                 bytes_read=2 * kv_bytes),
    ]
    if "softcap" in inspect.signature(window_attention_triton).parameters:
        # Soft-capped logits (Gemma-2-like) are their own kernel specialisation (SOFTCAP constexpr).
        capped = dict(softcap=50.0)
        rows.append(_compare("window_attention_softcap", dtype, s,
                             window_attention_triton(queries, keys, **capped),
                             window_attention_reference(queries, keys, **capped), exact=False))
    # free the inputs before the compaction row (not `del`: the lambdas above name them)
    keys = values = queries = None
    rows.append(_compact_row(s, dtype, device, gen, timed))
    return rows


def _compact_row(s: Shapes, dtype, device, gen, timed: bool) -> dict:
    """compact_kv_ on a pool laid out as the server's: B requests of n + R random slots each."""
    import torch

    from vase_sglang.ops.compact import compact_kv_reference_, compact_kv_triton_

    num_slots = s.batch * (s.candidates + s.window) + 1
    pool = [_randn((num_slots, s.kv_heads, s.head_dim), dtype, device, gen)
            for _ in range(2 * s.layers)]
    order = torch.randperm(num_slots - 1, generator=torch.Generator().manual_seed(1)) + 1
    row_slots = order.view(s.batch, -1).to(device)
    slots = row_slots[:, : s.candidates]
    scores = torch.rand((s.batch, s.layers, s.kv_heads, s.candidates), generator=gen,
                        device=device)
    keep = scores.topk(s.kept, dim=-1).indices.sort(dim=-1).values  # ascending, as served
    outs = {}
    for name, fn in (("triton", compact_kv_triton_), ("torch", compact_kv_reference_)):
        bufs = [t.clone() for t in pool]
        fn(bufs[: s.layers], bufs[s.layers:], slots, keep)
        outs[name] = torch.stack(bufs)
    ms = None
    if timed:  # in place on scratch copies: every call moves the same amount
        k_bufs, v_bufs = [t.clone() for t in pool[: s.layers]], [t.clone() for t in pool[s.layers:]]
        ms = (_time_ms(lambda: compact_kv_triton_(k_bufs, v_bufs, slots, keep), device),
              _time_ms(lambda: compact_kv_reference_(k_bufs, v_bufs, slots, keep), device))
    moved = 2 * 2 * s.batch * s.layers * s.kv_heads * s.kept * s.head_dim * pool[0].element_size()
    # Bit-exact: compare raw bits (NaN-free here, but a copy must not even flip a sign of zero).
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[pool[0].element_size()]
    return _compare("compact_kv", dtype, s, outs["triton"].view(bits), outs["torch"].view(bits),
                    exact=True, ms=ms, bytes_read=moved)


def kernels(ctx) -> dict:
    import torch

    bench = QUICK_BENCH if ctx.quick else BENCH
    dtypes = QUICK_SWEEP_DTYPES if ctx.quick else SWEEP_DTYPES
    head_dims = QUICK_SWEEP_HEAD_DIMS if ctx.quick else SWEEP_HEAD_DIMS
    timed = ctx.device.type == "cuda"
    rows = [dict(r, config="benchmark") for r in kernel_rows(bench, torch.bfloat16, ctx.device, timed)]
    sweep = SWEEP if not ctx.quick else QUICK_BENCH
    for dtype in dtypes:
        for d in head_dims:
            shapes = Shapes(**{**sweep.__dict__, "head_dim": d})
            rows += [dict(r, config="sweep") for r in
                     kernel_rows(shapes, getattr(torch, dtype), ctx.device, timed=False)]
    failed = [f"{r['kernel']} {r['dtype']} D={r['head_dim']}" for r in rows if not r["ok"]]
    selections = selection_rows(bench, torch.bfloat16, ctx.device)
    failed += [f"selection {r['policy']}" for r in selections if not r["ok"]]
    return {"status": "failed" if failed else "ok", "failed": failed,
            "tolerance": {"value_range": "exact", "compact_kv": "bit-exact",
                          "scores": score_tolerance(ctx.device),
                          "kept_agreement": KEPT_AGREEMENT},
            "benchmark_shapes": bench.__dict__, "rows": rows, "selections": selections}


def sglang_decode(ctx) -> dict:
    """SGLang's own Triton decode attention (exported without SGLang:
    vase_sglang.serving.sglang_decode_attention) over rows as an eviction step leaves them, and
    its output merged with the cell-attention kernel's under the global scope, against fp64
    references (vase_sglang.serving.sglang_decode_check); cases past the budget are skipped."""
    from .sglang_decode_check import section

    return section(ctx.device, ctx.quick, ctx.remaining)


def warm_up(ctx) -> dict:
    """`python -m vase_sglang.warmup` in two fresh processes (nothing compiled in memory) that
    share a fresh TRITON_CACHE_DIR: "first_start" compiles every kernel, "restart" finds them in
    the on-disk cache, as a server started again on the same machine would. Each then runs
    warmup.probe (other candidate counts, per-request budgets, windows, policies, chunk
    layouts): failed if a probe step compiled anything or a policy failed. On CPU (the
    self-test) the torch backend runs: one cheap step, nothing compiles."""
    cache = tempfile.mkdtemp(prefix="vase-triton-cache-")
    result, failed = {"triton_cache_dir": "fresh (empty) for this section"}, []
    for run in ("first_start", "restart"):
        out = Path(tempfile.mkdtemp()) / "warmup.json"
        cmd = [sys.executable, "-m", "vase_sglang.warmup", "--device", str(ctx.device),
               "--json", str(out)] + (["--quick"] if ctx.quick else [])
        env = _child_env(ctx)
        env["TRITON_CACHE_DIR"] = cache
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=max(10.0, min(240.0, ctx.remaining() - 5)))
        except subprocess.TimeoutExpired:
            result[run] = {"error": "timed out", "command": cmd}
            failed.append(run)
            break
        row = {"returncode": proc.returncode, "process_seconds": round(time.perf_counter() - start, 2),
               "stdout_tail": proc.stdout[-1000:], "stderr_tail": proc.stderr[-2000:]}
        if out.exists():
            data = json.loads(out.read_text())
            wu, probe = data["warm_up"], data["probe"]
            row.update(warm_up_seconds=wu["seconds"], compiled=wu["compiled"], backend=wu["backend"],
                       policies=wu["policies"], steps=wu["steps"], errors=wu["errors"],
                       probe_steps=probe["steps"], probe_compiled=probe["compiled"],
                       probe_seconds=probe["seconds"], shapes=data["shapes"],
                       config=data["config"], server=data["server"])
        if proc.returncode != 0 or not out.exists():
            failed.append(run)
        result[run] = row
    return {"status": "failed" if failed else "ok", "failed": failed, **result}


def graph_capture(ctx) -> dict:
    try:
        from vase_sglang.capture import graph_capture_check
    except ImportError as exc:
        return {"status": "missing", "reason": f"vase_sglang.capture.graph_capture_check: {exc}"}
    if ctx.device.type != "cuda":
        return {"status": "skipped", "reason": "CUDA graphs need a CUDA device"}
    result = dict(graph_capture_check(ctx.device))
    result.setdefault("status", "ok")
    return result


def step_timer(ctx) -> dict:
    """The server's device timing of eviction steps (patches/timing.py: vase:eviction_device_
    seconds): CUDA events around a step, read only once finished. A ~50 ms kernel between
    start and stop: read right away, nothing is reported and the read does not wait (no sync,
    under set_sync_debug_mode("error")); after the device finishes, its time is. On CPU the
    host time of the work is reported at once."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("vase_timing", ROOT / "patches" / "timing.py")
    timing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timing)  # patches/timing.py imports only torch, not SGLang
    timer = timing.StepTimer(ctx.device)
    if ctx.device.type != "cuda":
        timer.start()
        torch.randn(256, 256) @ torch.randn(256, 256)
        timer.stop()
        done = timer.finished()
        return {"status": "ok" if len(done) == 1 and done[0] >= 0 else "failed",
                "device": "cpu", "seconds": done}
    torch.cuda.synchronize(ctx.device)
    cycles = int(1e8)  # ~50 ms at 2 GHz
    timer.start()
    torch.cuda._sleep(cycles)
    timer.stop()
    t0 = time.perf_counter()
    torch.cuda.set_sync_debug_mode("error")
    try:
        early = timer.finished()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    read_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize(ctx.device)
    done = timer.finished()
    ok = early == [] and read_ms < 5 and len(done) == 1 and 0.005 < done[0] < 5
    return {"status": "ok" if ok else "failed", "sleep_cycles": cycles,
            "read_while_running": early, "read_ms": round(read_ms, 3),
            "device_seconds_after": done}


def hf_reference(ctx) -> dict:
    if not _installed("transformers"):
        return {"status": "skipped", "reason": "transformers not installed"}

    from vase_sglang.config import EvictionConfig
    from vase_sglang.serving.hf_reference import ReferenceDecoder
    from vase_sglang.serving.tiny_model import build_tiny_qwen3

    steps = 24 if ctx.quick else 96
    with tempfile.TemporaryDirectory() as tmp:
        # fp32 with larger weights (as tests' tiny_model_fp32): greedy choices have clear margins.
        path = build_tiny_qwen3(Path(tmp) / "tiny-qwen3-fp32", dtype="float32", init_std=0.1)
        decoder_model = _model_on(path, ctx.device)
    prompt = [(7 * i + 3) % 900 + 10 for i in range(20)]
    runs, failed = [], []
    for policy in HF_POLICIES:
        cfg = EvictionConfig(policy=policy, budget=16, window=4, sinks=2, seed=0)
        out = {}
        for backend in ("torch", "triton"):
            os.environ["VASE_KERNELS"] = backend
            out[backend] = ReferenceDecoder(decoder_model, cfg).run(prompt, max_new_tokens=steps,
                                                                    request_key=5)
        a, b = out["triton"], out["torch"]
        same = a["tokens"] == b["tokens"] and a["evicted"] == b["evicted"]
        first = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
        lp = max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])), default=0.0)
        runs.append({"policy": policy, "tokens_equal": same, "first_divergence": first,
                     "max_logprob_diff": lp, "rounds": b["rounds"], "evicted": b["evicted"]})
        if not same or b["rounds"] == 0:
            failed.append(policy)
    return {"status": "failed" if failed else "ok", "failed": failed, "steps": steps,
            "device": str(ctx.device), "model": "tiny Qwen3 fp32 (vase_sglang.tiny_model)",
            "runs": runs}


def _model_on(path, device):
    """The tiny model on `device`; ReferenceDecoder builds its inputs on the CPU, so a pre-hook
    moves every tensor argument of forward to the model's device."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)

    def to_device(module, args, kwargs):
        move = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
        return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}

    model.register_forward_pre_hook(to_device, with_kwargs=True)
    return model


def eviction_step(ctx) -> dict:
    """benchmarks/kernels.py --check, one configuration, both backends, in a subprocess."""
    out = Path(tempfile.mkdtemp()) / "kernels.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "kernels.py"),
           "--policies", ",".join(STEP_POLICIES), "--device", ctx.device.type,
           "--check", "--no-plot", "--no-progress", "--out", str(out)]
    if ctx.quick:
        cmd += ["--quick", "--layers", "2", "--budgets", "48", "--window", "16", "--requests", "2",
                "--backends", "torch" if ctx.device.type != "cuda" else "torch,triton"]
    else:
        cmd += ["--budgets", "2048", "--requests", "16", "--backends", "torch,triton"]
    timeout = max(10.0, ctx.remaining() - 5)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env=_child_env(ctx))
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": f"benchmarks/kernels.py ran past {timeout:.0f} s",
                "command": cmd}
    result = {"command": cmd, "returncode": proc.returncode, "stderr_tail": proc.stderr[-2000:]}
    if not out.exists():
        return {**result, "status": "error", "reason": "benchmarks/kernels.py wrote no JSON"}
    bench = json.loads(out.read_text())
    copy = ctx.copy_gb_per_s
    rows = [{"policy": r["policy"], "backend": r["backend"], "requests": r["requests"],
             "budget": r["budget"], "status": r["status"], "bytes": r["bytes"],
             "ms": r.get("ms"), "gb_per_s": r.get("gb_per_s"),
             "fraction_of_copy_bandwidth": (round(r["gb_per_s"] / copy, 3)
                                            if copy and r.get("gb_per_s") else None)}
            for r in bench.get("rows", [])]
    checks_ok = bool(bench.get("check")) and all(c.get("ok") for c in bench["check"])
    return {**result, "status": "ok" if proc.returncode == 0 and checks_ok else "failed",
            "check": bench.get("check"), "settings": bench.get("settings"), "rows": rows}


def _patches_alias() -> str:
    """A folder holding `vase_sglang_patches` -> this tree's patches/: benchmarks/kernels.py
    times the server's own step (vase_sglang_patches.runtime, which imports no SGLang), and on
    the GPU image the repository is carried, not pip-installed."""
    import atexit
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="vase-patches-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.symlink(ROOT / "patches", os.path.join(folder, "vase_sglang_patches"))
    return folder


def _child_env(ctx) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [_patches_alias(), str(ROOT), env.get("PYTHONPATH")]))
    if ctx.device.type == "cuda":
        env.pop("TRITON_INTERPRET", None)
    return env


# ------------------------------------------------------------------------------------- main


class Context:
    def __init__(self, device, quick: bool, budget_s: float):
        self.device, self.quick = device, quick
        self.deadline = time.monotonic() + budget_s
        self.copy_gb_per_s = None

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


RUNNERS = {"environment": environment, "warm_up": warm_up, "kernels": kernels,
           "sglang_decode": sglang_decode, "graph_capture": graph_capture, "step_timer": step_timer,
           "hf_reference": hf_reference, "eviction_step": eviction_step}


def _csv(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vase_sglang.gpu_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "results" / "gpu_check.json",
                   help="the JSON written (default results/gpu_check.json)")
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu with --quick")
    p.add_argument("--only", type=_csv, default=SECTIONS,
                   help=f"comma-separated sections (default all: {','.join(SECTIONS)})")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="time for the whole run; later sections are skipped past it (default 450)")
    p.add_argument("--quick", action="store_true", help="small shapes (the CPU self-test)")
    args = p.parse_args(argv)
    if bad := [s for s in args.only if s not in SECTIONS]:
        p.error(f"--only: unknown section(s) {', '.join(bad)}; choose from {', '.join(SECTIONS)}")
    if args.device not in ("cuda", "cpu") and not args.device.startswith("cuda:"):
        p.error(f"--device: cuda, cuda:N or cpu, got {args.device!r}")
    # vase_sglang's package import defines the kernels, so TRITON_INTERPRET must be set (or not)
    # before this process started.
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if args.device == "cpu" and not (args.quick and interpreted):
        p.error("--device cpu is the self-test: it needs --quick and TRITON_INTERPRET=1 in the "
                "environment (Triton kernels run on CPU only in the interpreter)")
    if args.device != "cpu" and interpreted:
        p.error("TRITON_INTERPRET=1 is set: on a GPU the kernels must be compiled; unset it")
    if args.budget_s <= 0:
        p.error("--budget-s must be > 0")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    report = Report(args.out, argv)
    import torch

    if args.device != "cpu" and not torch.cuda.is_available():
        message = ("gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing was "
                   "checked. Run it on a GPU machine, or --device cpu --quick for the self-test.")
        print(message, file=sys.stderr)
        report.finish("no-cuda", message=message)
        return 2
    torch.manual_seed(0)
    ctx = Context(torch.device(args.device), args.quick, args.budget_s)
    saved_backend = os.environ.get("VASE_KERNELS")
    for name in SECTIONS:
        if name not in args.only:
            continue
        if ctx.remaining() <= 0:
            report.section(name, {"status": "skipped", "reason": "time budget spent"})
            continue
        start = time.perf_counter()
        try:
            result = RUNNERS[name](ctx)
        except Exception as exc:  # recorded, and the next section still runs
            result = {"status": "error", "error": repr(exc),
                      "traceback": traceback.format_exc().splitlines()[-12:]}
        finally:
            _restore_env("VASE_KERNELS", saved_backend)
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
        result["seconds"] = round(time.perf_counter() - start, 2)
        if name == "environment":
            ctx.copy_gb_per_s = result.get("copy_gb_per_s")
        report.section(name, result)
        print(f"gpu_check {name}: {result['status']} ({result['seconds']} s)", flush=True)
    status = overall_status(report.data["sections"])
    report.finish(status)
    print(f"gpu_check: {status}; wrote {args.out}")
    return 0 if status == "ok" else 1


def _restore_env(key, value):
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


if __name__ == "__main__":
    sys.exit(main())
