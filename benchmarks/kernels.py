#!/usr/bin/env python
"""Time ONE eviction step as the SGLang server runs it: `step.evict(rt, batch)` of
patches/step.py (imported as vase_sglang_patches; the benchmark stops if it cannot be, rather
than time a copy), on a fake KV pool. The step gathers the candidates' K/V and the
window queries, scores and selects (select_tokens), compacts the pool, rewrites the
req_to_token rows, frees the dropped slots and updates the lengths. Its input is a stand-in
batch (objects with the fields of SGLang's Req / ScheduleBatch that the step reads and writes,
and an allocator that counts freed slots); every timed step starts from a fresh batch of
requests due for eviction, and a step that does not free exactly B * R slots is an error.

Shapes default to Qwen3-4B: 36 layers, 32 query / 8 KV heads, head_dim 128, bf16 KV. For a
budget T and window R a request holds T + R private tokens when it is evicted: n = T candidates,
K = T - R kept per (layer, KV head). The pool has B * (T + R) + 1 slots per layer (slot 0 is
SGLang's padding slot), each request owning random distinct slots.

Times are medians (and ranges) over --repeats steps after --warmup steps, each between two
torch.cuda.synchronize on CUDA. Each step compacts the pool in place, so later steps run on
shuffled (equally random) data, with identical shapes and costs.

Bandwidth (GB/s) = bytes the step must move / total time, where the bytes are: the candidate K
and V of all layers (policies that read K/V), the window queries (attention policies), and the
K/V moved by the compaction, read + write. It is a lower bound of the traffic (the gather also
writes a copy and the torch scoring path re-reads it in fp32).

Backends: on CUDA both VASE_KERNELS=torch and VASE_KERNELS=triton by default (the variable is
read per op call, so it is switched between runs); on CPU only torch (Triton on CPU exists only
through TRITON_INTERPRET=1, whose times are meaningless; --backends triton is accepted on CPU
only with that variable set, for exercising the code path).

Memory: a configuration whose estimated peak working set (pool + gathered K/V + scoring
temporaries of the chosen backend, see estimate_bytes) exceeds --mem-cap-gib is skipped and
reported as skipped with the estimate. On CUDA an out-of-memory error is reported as `oom`.
Note the torch scoring path of the attention policies materialises [B, L, H_kv, G*W, n] fp32
logits twice (G = H_q / H_kv), four times the gathered K/V: that, not the pool, is what
excludes most CPU configurations.

--check runs, before the benchmark, on the smallest configuration: every Triton op (window
attention, value range, CUR leverage) against its torch reference on the same candidates,
whatever the selected policies; then per policy, VASE_KERNELS=torch against triton from
identical pools: scores within the kernel tolerance (rtol 1e-4, atol 1e-6 in the interpreter;
rtol 1e-3 on a GPU, whose dots run on tensor cores: vase_sglang.serving.gpu_check), forced
slots equal, kept indices equal (a difference is accepted only where it is a near-tie flip
fully explained by that score tolerance, and is counted), the real step's req_to_token rows
equal and compacted pools bit-equal, and each backend's compaction of the torch selection
bit-equal to the torch step's pool. On CPU it sets TRITON_INTERPRET=1 itself (interpreted
kernels: slow, so --check-layers defaults to 2 there); it does not change the torch timings.

Outputs: a table on stdout, a JSON file (--out, default results/kernels.json) with machine info
and the exact command line, and a PNG plot next to it (same name, .png): total step time against
requests, one line per (budget, backend), one panel per policy.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import resource
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402  (does not import triton: TRITON_INTERPRET can still be set below)

GIB = 2**30


def _score_tolerance(device) -> dict:
    """rtol 1e-4 in Triton's interpreter (fp32 dots, as tests/test_kernels.py), 1e-3 on a GPU,
    whose dots run on tensor cores (docs/gpu.md). Imported late: vase_sglang imports triton,
    which must see TRITON_INTERPRET first."""
    from vase_sglang.serving.gpu_check import score_tolerance

    return score_tolerance(device)

MODELS = {
    # name: (layers, q heads, kv heads, head_dim)
    "qwen3-4b": (36, 32, 8, 128),
    "qwen3-8b": (36, 32, 8, 128),
    "llama3-8b": (32, 32, 8, 128),
    # the real models served here (docs/real_model.md)
    "qwen2.5-0.5b": (24, 14, 2, 64),
    "smollm2-135m": (30, 9, 3, 64),
}
DEFAULT_BUDGETS = (1024, 2048, 4096)
DEFAULT_REQUESTS = (1, 4, 16, 64)
QUICK_BUDGETS = (256, 512)
QUICK_REQUESTS = (1, 2)


def _csv_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _window(text: str) -> str:
    """R as a number of tokens ("64") or a fraction of the budget ("T/4", the serving
    default's ratio)."""
    text = text.strip()
    try:
        if text.upper().startswith("T/"):
            if int(text[2:]) >= 1:
                return text.upper()
        elif int(text) >= 1:
            return text
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected a positive integer or T/k, got {text!r}")


def window_for(spec: str, budget: int) -> int:
    """The window R of budget T under --window spec ("64" or "T/4"; at least 1 token)."""
    if spec.startswith("T/"):
        return max(1, budget // int(spec[2:]))
    return int(spec)


def _csv(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="benchmarks/kernels.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("configurations")
    g.add_argument("--policies", type=_csv, default=["vase-attnv"],
                   help="comma-separated policies, or 'all' for every registered one "
                        "(default: vase-attnv; e.g. vase-attnv,vase-dkv,snapkv,random,streaming)")
    g.add_argument("--budgets", type=_csv_ints, default=None,
                   help=f"budgets T (default {','.join(map(str, DEFAULT_BUDGETS))}; "
                        f"--quick: {','.join(map(str, QUICK_BUDGETS))})")
    g.add_argument("--requests", type=_csv_ints, default=None,
                   help=f"requests B evicted together (default "
                        f"{','.join(map(str, DEFAULT_REQUESTS))}; --quick: "
                        f"{','.join(map(str, QUICK_REQUESTS))})")
    g.add_argument("--window", type=_window, default="64",
                   help="window R: tokens, or T/k for a fraction of each budget (default 64; "
                        "the accuracy study's settings are T/4)")
    g.add_argument("--sinks", type=int, default=4, help="sink tokens (default 4)")
    g.add_argument("--model", choices=sorted(MODELS), default="qwen3-4b",
                   help="shape preset: layers, heads, head_dim (default qwen3-4b: 36 layers, "
                        "32 q / 8 KV heads, head_dim 128)")
    g.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    g.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="KV pool and query ring dtype (default bfloat16)")
    g.add_argument("--quick", action="store_true",
                   help="smoke test: budgets 256,512, requests 1,2, 1 warmup + 2 repeats "
                        "(< 1 min on CPU)")

    g = p.add_argument_group("execution")
    g.add_argument("--device", default=None,
                   help="cuda or cpu (default: cuda if torch.cuda.is_available() else cpu)")
    g.add_argument("--backends", type=_csv, default=None,
                   help="VASE_KERNELS values to time, comma-separated (default: torch,triton on "
                        "CUDA, torch on CPU)")
    g.add_argument("--warmup", type=int, default=None,
                   help="untimed steps per run (default 3 on CUDA, 1 on CPU or with --quick)")
    g.add_argument("--repeats", type=int, default=None,
                   help="timed steps per run, the median is reported (default 10 on CUDA, 3 on "
                        "CPU; --quick: 2)")
    g.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: faster than 2 for the small ops here)")
    g.add_argument("--mem-cap-gib", type=float, default=None,
                   help="skip configurations whose estimated peak working set exceeds this "
                        "(default 6 on CPU; on CUDA 90%% of the free device memory)")
    g.add_argument("--seed", type=int, default=0, help="seed of the fake pool and of the policy")

    g = p.add_argument_group("correctness")
    g.add_argument("--check", action="store_true",
                   help="first assert that the triton step equals the torch reference on the "
                        "smallest configuration (see above); exit status 1 on a mismatch")
    g.add_argument("--check-only", action="store_true", help="--check, then no benchmark")
    g.add_argument("--check-layers", type=int, default=None,
                   help="layers of the --check configuration (default: all on CUDA, 2 on CPU "
                        "where the kernels run in the Triton interpreter)")

    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=ROOT / "results" / "kernels.json",
                   help="JSON output (default results/kernels.json); the plot goes next to it "
                        "with the suffix .png")
    g.add_argument("--no-plot", action="store_true", help="skip the PNG")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    args = p.parse_args(argv)
    if args.check_only:
        args.check = True
    if args.sinks < 0:
        p.error("--sinks must be >= 0")
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be >= 1")
    if args.check_layers is not None and args.check_layers < 1:
        p.error("--check-layers must be >= 1")
    if args.threads < 1:
        p.error("--threads must be >= 1")
    for name in ("warmup", "repeats"):
        value = getattr(args, name)
        if value is not None and value < (1 if name == "repeats" else 0):
            p.error(f"--{name} must be >= {1 if name == 'repeats' else 0}")
    return args


# --------------------------------------------------------------------------- shapes and bytes


@dataclass(frozen=True)
class Shape:
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    elt: int  # bytes per K/V/query element

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads


def step_bytes(shape: Shape, policy_cls, b: int, t: int, r: int) -> dict[str, int]:
    """Bytes the step must move (see the module docstring)."""
    n, k = t, t - r
    kv = 2 * b * shape.layers * shape.kv_heads * n * shape.head_dim * shape.elt
    q = b * shape.layers * shape.q_heads * r * shape.head_dim * shape.elt
    moved = 2 * 2 * b * shape.layers * shape.kv_heads * k * shape.head_dim * shape.elt
    return {
        "kv_read": kv if policy_cls.reads_kv else 0,
        "queries_read": q if policy_cls.needs_queries else 0,
        "compaction_read_write": moved,
    }


def pool_bytes(shape: Shape, b: int, t: int, r: int, needs_queries: bool) -> int:
    slots = b * (t + r) + 1
    pool = 2 * shape.layers * slots * shape.kv_heads * shape.head_dim * shape.elt
    ring = shape.layers * b * r * shape.q_heads * shape.head_dim * shape.elt if needs_queries else 0
    return pool + ring


def estimate_bytes(shape: Shape, policy_name: str, policy_cls, cfg, b: int, t: int, r: int,
                   backend: str, needs_ring: bool) -> int:
    """Estimated peak memory of one run: pool (+ query ring) plus the step's live tensors at its
    largest point. Counts what the torch code paths allocate (fp32 copies, logits, ...)."""
    L, H, Hq, D, e = shape.layers, shape.kv_heads, shape.q_heads, shape.head_dim, shape.elt
    n, k = t, t - r
    E = b * L * H * n  # (request, layer, head, candidate) elements
    base = pool_bytes(shape, b, t, r, needs_ring)
    live = 0
    if policy_cls.reads_kv:
        live += 2 * E * D * e  # gathered K and V (the stack copies of the last one in flight)
        gather_peak = live + E * D * e
    else:
        gather_peak = 0
    if policy_cls.needs_queries:
        live += b * L * Hq * r * D * e
    # select: fp32 score, masked copy, bool mask, topk/sort values and int64 indices,
    # counter-based RNG int64 temporaries (Gumbel / projection)
    sel = E * (4 + 4 + 1 + 8 + 8) + (E * 8 * 4 if policy_cls.samples else 0)
    torch_path = backend == "torch"
    attn = 0
    if policy_cls.needs_queries:
        if torch_path:  # q.float(), keys.float(), logits and the softmax output (fp32)
            attn = b * L * Hq * r * D * 4 + E * D * 4 + 2 * E * shape.group * r * 4
        else:  # lse per query row + output
            attn = b * L * H * shape.group * r * 4 + E * 4
    extra = attn
    # what the built-in classes' torch references allocate besides (by class, so a subclass
    # registered under another name is estimated as its parent)
    from vase_sglang.policies import (CurDKVPolicy, EvictLargeValuesPolicy, RKVPolicy,
                                      VaseAttnVPolicy)

    if issubclass(policy_cls, RKVPolicy):  # normalised fp32 keys (+ temp), n x n cosines
        extra = max(extra, E * 4 + 2 * E * D * 4 + E * n * 4)
    if issubclass(policy_cls, (VaseAttnVPolicy, EvictLargeValuesPolicy)):  # values.float()
        extra = max(extra, E * 4 + (E * D * 4 if torch_path else 0) + 2 * E * 4)
    if issubclass(policy_cls, CurDKVPolicy):
        rank = cfg.projection_rank
        extra = max(extra, (2 * E * D * 4 + 4 * E * rank * 4) if torch_path else E * 4)
    # torch compaction: one layer's gathered rows + indices at a time
    compact = b * H * k * (D * e + 16) if torch_path else 0
    return base + max(gather_peak, live + max(sel + extra, compact))


# --------------------------------------------------------------------------- fake server state


def load_runtime_module(name: str = "runtime"):
    """patches/<name>.py of THIS tree (runtime: the EvictionRuntime; step: the eviction step),
    imported as the server imports it (vase_sglang_patches). No fallback: a benchmark of a
    copy of the step would not measure what the server runs."""
    try:
        module = importlib.import_module(f"vase_sglang_patches.{name}")
    except Exception as exc:
        raise SystemExit(f"error: cannot import vase_sglang_patches.{name} ({exc!r}): install "
                         f"the project (pip install -e .) or link patches/ as "
                         f"vase_sglang_patches") from exc
    want = (ROOT / "patches" / f"{name}.py").resolve()
    if Path(module.__file__).resolve() != want:
        raise SystemExit(f"error: vase_sglang_patches.{name} is {module.__file__}, not {want}: "
                         f"the benchmark would time another tree's step")
    return module


# Stand-ins for the SGLang objects step.evict reads and writes (Req, Req.kv,
# ScheduleBatch, the token allocator): the benchmark's input, not the thing measured.


class _Kv:
    def __init__(self, row: int, length: int):
        self.req_pool_idx = row
        self.kv_allocated_len = self.kv_committed_len = length
        self.cache_protected_len = 0  # no radix-tree prefix: the private cache is the whole row


class _SamplingParams:
    def __init__(self, seed: int):
        self.custom_params = None  # the server's settings
        self.sampling_seed = seed  # keys the random draws


class _Req:
    def __init__(self, i: int, row: int, length: int, seed: int):
        self.rid = f"bench-{i}"
        self.kv = _Kv(row, length)
        self.sampling_params = _SamplingParams(seed)
        self.decode_batch_idx = 1  # past its first decode step
        self.skip_radix_cache_insert = False


class _Batch:
    def __init__(self, reqs, device):
        self.reqs = reqs
        lens = [r.kv.kv_allocated_len for r in reqs]
        self.seq_lens_cpu = torch.tensor(lens, dtype=torch.int64)
        self.seq_lens = self.seq_lens_cpu.to(device)
        self.orig_seq_lens = None
        self.seq_lens_sum = sum(lens)
        self.batch_is_full = True


class _Allocator:
    """Counts the slots the step frees (SGLang's allocator concatenates them to its free list,
    a cost this stand-in leaves out)."""

    def __init__(self):
        self.freed = 0

    def free(self, slots: torch.Tensor) -> None:
        self.freed += int(slots.numel())


class FakeServer:
    """A KV pool holding B evictable requests of T + R private tokens each, and the real
    EvictionRuntime of patches/runtime.py on it, evicted by patches/step.py."""

    def __init__(self, shape: Shape, b: int, t: int, r: int, dtype, device, seed: int,
                 with_ring: bool, runtime_module):
        self.shape, self.b, self.t, self.r = shape, b, t, r
        self.device = torch.device(device)
        self.module = runtime_module
        self.step = load_runtime_module("step")
        gen = torch.Generator(device=self.device).manual_seed(seed)
        num_slots = b * (t + r) + 1
        buf_shape = (num_slots, shape.kv_heads, shape.head_dim)
        self.k_buffers = [torch.randn(buf_shape, generator=gen, device=self.device, dtype=dtype)
                          for _ in range(shape.layers)]
        self.v_buffers = [torch.randn(buf_shape, generator=gen, device=self.device, dtype=dtype)
                          for _ in range(shape.layers)]
        cpu_gen = torch.Generator().manual_seed(seed + 1)
        slots = torch.randperm(num_slots - 1, generator=cpu_gen)[: b * (t + r)] + 1
        # req_pool_idx of each request: a row of req_to_token and of the query ring
        self.rows = torch.randperm(b, generator=cpu_gen).tolist()
        self.req_to_token = slots.view(b, t + r).to(torch.int32).to(self.device)
        self.initial_rows = self.req_to_token.clone()
        self.request_keys = (torch.randint(0, 2**31 - 1, (b,), generator=cpu_gen)).tolist()
        self.queries = None
        if with_ring:
            self.queries = torch.randn((shape.layers, b, r, shape.q_heads, shape.head_dim),
                                       generator=gen, device=self.device, dtype=dtype)
        self._runtimes = {}

    def runtime(self, cfg):
        """The server's EvictionRuntime for these settings (built once per cfg)."""
        if cfg not in self._runtimes:
            self._runtimes[cfg] = self.module.EvictionRuntime(
                cfg=cfg, k_buffers=self.k_buffers, v_buffers=self.v_buffers,
                req_to_token=self.req_to_token, allocator=_Allocator(),
                num_q_heads=self.shape.q_heads, head_dim=self.shape.head_dim, start_layer=0,
                queries=self.queries)
        return self._runtimes[cfg]

    def fresh_batch(self) -> _Batch:
        """Every request back at T + R private tokens, due for eviction. The pool keeps what
        the last step compacted into it (equally random data, same shapes and costs)."""
        self.req_to_token.copy_(self.initial_rows)
        n = self.t + self.r
        return _Batch([_Req(i, row, n, key) for i, (row, key)
                       in enumerate(zip(self.rows, self.request_keys))], self.device)

    def clone_pool(self):
        return [t.clone() for t in self.k_buffers], [t.clone() for t in self.v_buffers]

    def set_pool(self, k_buffers, v_buffers):
        """Copy the given buffers into the pool (the same tensors stay referenced)."""
        for dst, src in zip(self.k_buffers + self.v_buffers, list(k_buffers) + list(v_buffers)):
            dst.copy_(src)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_step(server: FakeServer, cfg, backend: str) -> float:
    """One real eviction step, step.evict(rt, batch), on a fresh batch; its seconds.
    Fails unless it evicted every request down to its budget."""
    os.environ["VASE_KERNELS"] = backend
    rt = server.runtime(cfg)
    batch = server.fresh_batch()
    saved, server.module.RUNTIME = server.module.RUNTIME, rt  # request_config reads it
    try:
        _sync(server.device)
        t0 = time.perf_counter()
        freed = server.step.evict(rt, batch)
        _sync(server.device)
        seconds = time.perf_counter() - t0
    finally:
        server.module.RUNTIME = saved
    expected = server.b * (server.t - cfg.keep)
    lens = [r.kv.kv_allocated_len for r in batch.reqs]
    if freed != expected or lens != [cfg.budget] * server.b:
        raise RuntimeError(f"{cfg.policy}: the step freed {freed} slots (expected {expected}) "
                           f"and left lengths {sorted(set(lens))} (expected {cfg.budget})")
    return seconds


def time_config(server, cfg, backend, warmup, repeats):
    for _ in range(warmup):
        run_step(server, cfg, backend)
    samples = {"total": [run_step(server, cfg, backend) for _ in range(repeats)]}
    median = {key: statistics.median(v) for key, v in samples.items()}
    return median, samples


# --------------------------------------------------------------------------- --check


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _pools_equal(a_k, a_v, b_k, b_v) -> bool:
    return all(torch.equal(_bits(x), _bits(y)) for x, y in zip(a_k + a_v, b_k + b_v))


def _gather(server: FakeServer, reads_kv: bool = True):
    """Candidate K/V [B, L, H_kv, n, D] and window queries [B, L, H_q, W, D] of a fresh batch,
    gathered here for the backend comparison (the step gathers its own)."""
    rows = torch.tensor(server.rows, device=server.device)
    slots = server.initial_rows[rows, : server.t].long()
    if reads_kv:
        keys = torch.stack([buf[slots] for buf in server.k_buffers], dim=1).transpose(2, 3)
        values = torch.stack([buf[slots] for buf in server.v_buffers], dim=1).transpose(2, 3)
    else:  # random / streaming read no K/V: shapes only
        shape = (server.b, server.shape.layers, server.shape.kv_heads, server.t,
                 server.shape.head_dim)
        keys = values = torch.zeros((), device=server.device).expand(shape)
    queries = None if server.queries is None else server.queries[:, rows].permute(1, 0, 3, 2, 4)
    return slots, keys, values, queries


CHECKED_OPS = ("window_attention", "value_range", "cur_leverage")


def check_kernels(server: FakeServer, rank: int = 16) -> dict:
    """Every Triton op against its torch reference on the benchmark's candidates, whatever the
    selected policies use: window attention, value range, CUR leverage (compaction is compared
    within the steps). Returns the largest absolute difference per op."""
    from vase_sglang import ops

    _, keys, values, queries = _gather(server)
    gen = torch.Generator(device=server.device).manual_seed(7)
    projection = torch.randn((server.shape.head_dim, rank), generator=gen, device=server.device)
    calls = {  # keys: CHECKED_OPS
        "window_attention": lambda: ops.window_attention(queries, keys),
        "value_range": lambda: ops.value_range(values),
        "cur_leverage": lambda: ops.cur_leverage(keys, values, projection),
    }
    diffs = {}
    for name, call in calls.items():
        out = {}
        for backend in ("torch", "triton"):
            os.environ["VASE_KERNELS"] = backend
            out[backend] = call().float()
        torch.testing.assert_close(out["triton"], out["torch"], **_score_tolerance(server.device),
                                   msg=lambda m, name=name: f"{name}: triton differs: {m}")
        diffs[name] = float((out["triton"] - out["torch"]).abs().max())
    return diffs


def check_step(server: FakeServer, cfg) -> dict:
    """Torch vs triton on the same pool: scores, forced slots, kept indices, and the real
    eviction step's compacted pool and req_to_token rows."""
    from vase_sglang import select_tokens
    from vase_sglang.ops import compact_kv_
    from vase_sglang.policies import POLICIES, Draws

    policy_cls = POLICIES[cfg.policy]
    pol = policy_cls(cfg)
    device = server.device
    orig_k, orig_v = server.clone_pool()
    result = {"policy": cfg.policy, "budget": server.t, "requests": server.b,
              "layers": server.shape.layers}

    # Scores, forced slots and kept indices of both backends on the same candidates.
    slots, keys, values, queries = _gather(server, policy_cls.reads_kv)
    if not policy_cls.needs_queries:
        queries = None
    request = torch.tensor(server.request_keys, device=device)  # = the step's request keys
    layers = torch.arange(server.shape.layers, device=device)
    rounds = torch.zeros(server.b, device=device, dtype=torch.int64)
    draws = Draws.make(cfg.seed, keys.shape[:-3], device, request[:, None], layers[None, :],
                       rounds[:, None])
    final, score, forced, keep = {}, {}, {}, {}
    for backend in ("torch", "triton"):
        os.environ["VASE_KERNELS"] = backend
        s = pol.score(keys, values, queries, draws).float()
        f = pol.forced(keys, values, cfg.sinks)
        # The transform of Policy.select: Gumbel-top-k for sampling policies, forced -> inf.
        p = s.clamp_min(1e-30).log() + draws.gumbel(s.shape[-2:]) if pol.samples else s
        score[backend], forced[backend] = s, f
        final[backend] = p.masked_fill(f, float("inf"))
        keep[backend] = select_tokens(cfg, keys, values, queries, request=request[:, None],
                                      layer=layers[None, :], round=rounds[:, None],
                                      sinks=cfg.sinks, check=False)
    torch.testing.assert_close(score["triton"], score["torch"], **_score_tolerance(device),
                               msg=lambda m: f"{cfg.policy}: triton scores differ: {m}")
    assert torch.equal(forced["triton"], forced["torch"]), f"{cfg.policy}: forced slots differ"
    result["max_abs_score_diff"] = float((score["triton"] - score["torch"]).abs().max())
    del keys, values, queries

    flips = 0
    keep_ref, keep_tri = keep["torch"], keep["triton"]
    if not torch.equal(keep_tri, keep_ref):
        n = server.t
        kept = {}
        for name, k in (("torch", keep_ref), ("triton", keep_tri)):
            mask = torch.zeros(*k.shape[:-1], n, dtype=torch.bool, device=device)
            kept[name] = mask.scatter_(-1, k, True)
        diff = kept["torch"] ^ kept["triton"]
        # A difference is a near-tie flip iff every differing candidate's (final) score is
        # within the two backends' score disagreement of the selection boundary.
        p_ref, p_tri = final["torch"], final["triton"]
        boundary = p_ref.topk(cfg.keep, dim=-1).values[..., -1:]
        finite = torch.isfinite(p_ref) & torch.isfinite(p_tri)
        spread = torch.where(finite, (p_ref - p_tri).abs(), 0).amax(dim=-1, keepdim=True)
        near = (p_ref - boundary).abs() <= 2 * spread + 1e-12
        bad = diff & ~near
        assert not bad.any(), (
            f"{cfg.policy}: {int(bad.sum())} kept indices differ beyond near-tie flips "
            f"(first at {bad.nonzero()[0].tolist()})")
        flips = int(diff.sum()) // 2
    result["kept_indices_equal"] = flips == 0
    result["near_tie_flips"] = flips

    # The real step (step.evict) from identical pools with each backend.
    after = {}
    for backend in ("torch", "triton"):
        server.set_pool(orig_k, orig_v)
        run_step(server, cfg, backend)
        after[backend] = (*server.clone_pool(), server.req_to_token.clone())
    ref_k, ref_v, ref_rows = after["torch"]
    tri_k, tri_v, tri_rows = after["triton"]
    assert torch.equal(tri_rows, ref_rows), f"{cfg.policy}: req_to_token rows differ"
    if flips == 0:
        assert _pools_equal(tri_k, tri_v, ref_k, ref_v), f"{cfg.policy}: compacted pools differ"
    # The step is select + compact: each backend's compaction of the torch selection equals
    # the torch step's pool, bit for bit.
    for backend in ("torch", "triton"):
        server.set_pool(orig_k, orig_v)
        os.environ["VASE_KERNELS"] = backend
        compact_kv_(server.k_buffers, server.v_buffers, slots, keep_ref,
                    ascending=policy_cls.ascending)
        assert _pools_equal(server.k_buffers, server.v_buffers, ref_k, ref_v), (
            f"{cfg.policy}: {backend} compaction of the torch selection differs from the step")
    result["compacted_pool_bit_equal"] = True
    server.set_pool(orig_k, orig_v)
    return result


# --------------------------------------------------------------------------- output


def machine_info(device: torch.device, threads: int) -> dict:
    info = {
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    if device.type == "cuda":
        prop = torch.cuda.get_device_properties(device)
        info["device_name"] = prop.name
        info["device_memory_gib"] = round(prop.total_memory / GIB, 1)
        info["cuda"] = torch.version.cuda
    else:
        name = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        info["device_name"] = name
    return info


def _num(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def format_table(rows: list[dict]) -> str:
    head = ["policy", "backend", "B", "T", "step ms", "min ms", "max ms", "GB/s", "est GiB",
            "status"]
    lines = []
    for r in rows:
        ok = r["status"] == "ok"

        def ms(key):
            return f"{r['ms'][key]:.2f}" if ok else "-"

        lines.append([
            r["policy"], r["backend"], str(r["requests"]), str(r["budget"]),
            ms("total"), f"{min(r['samples_ms']['total']):.2f}" if ok else "-",
            f"{max(r['samples_ms']['total']):.2f}" if ok else "-",
            _num(r["gb_per_s"]) if ok else "-",
            f"{r['est_bytes'] / GIB:.2f}",
            "ok" if ok else f"{r['status']}: {r['reason']}",
        ])
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h)
              for i, h in enumerate(head)]
    right = {2, 3, 4, 5, 6, 7, 8}

    def fmt(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, lines)])


def plot(rows: list[dict], path: Path, title: str) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(r["policy"] for r in rows))
    ncols = min(3, len(policies))
    nrows = -(-len(policies) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4.2 * nrows), squeeze=False)
    for ax in axes.flat[len(policies):]:
        ax.set_visible(False)
    budgets = sorted({r["budget"] for r in rows})
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    colors = plt.get_cmap("viridis")
    styles = ["-", "--", ":", "-."]
    for ax, policy in zip(axes.flat, policies):
        drawn = False
        for bi, budget in enumerate(budgets):
            for ki, backend in enumerate(backends):
                pts = sorted((r["requests"], r["ms"]["total"]) for r in rows
                             if r["policy"] == policy and r["budget"] == budget
                             and r["backend"] == backend and r["status"] == "ok")
                if not pts:
                    continue
                drawn = True
                ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[ki % len(styles)],
                        marker="os^D"[ki % 4], color=colors(bi / max(1, len(budgets) - 1) * 0.85),
                        label=f"T={budget} {backend}")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["requests"] for r in rows})
        ax.set_xticks(ticks, [str(x) for x in ticks])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("requests evicted together (B)")
        ax.set_ylabel("eviction step time (ms)")
        ax.set_title(policy)
        ax.grid(True, which="both", alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no configuration ran", ha="center", transform=ax.transAxes)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- runs


@dataclass
class Context:
    device: torch.device
    shape: Shape
    dtype: torch.dtype
    window: str  # --window: tokens or T/k (window_for)
    seed: int
    policies: list
    backends: list
    budgets: list
    requests: list
    warmup: int
    repeats: int
    cap: int  # bytes
    cfgs: dict  # (policy, budget) -> EvictionConfig
    runtime_module: object  # patches/runtime.py
    needs_ring: bool

    def server(self, shape: Shape, b: int, t: int, with_ring: bool | None = None) -> FakeServer:
        return FakeServer(shape, b, t, window_for(self.window, t), self.dtype, self.device, self.seed,
                          self.needs_ring if with_ring is None else with_ring,
                          self.runtime_module)


def run_checks(ctx: Context, layers: int) -> tuple[dict, list[dict]]:
    """--check: triton vs torch on the smallest configuration: every op, then the step of
    every selected policy."""
    shape = Shape(layers, ctx.shape.q_heads, ctx.shape.kv_heads, ctx.shape.head_dim,
                  ctx.shape.elt)
    b, t = min(ctx.requests), min(ctx.budgets)
    print(f"check: triton vs torch, B={b} T={t} layers={layers} on {ctx.device}"
          + (" (Triton interpreter)" if ctx.device.type != "cuda" else ""), file=sys.stderr)
    checks = []
    server = ctx.server(shape, b, t, with_ring=True)  # the window-attention op needs queries
    try:
        kernels = {"ok": True, "max_abs_diff": check_kernels(server)}
    except AssertionError as exc:
        kernels = {"ok": False, "error": str(exc)}
    print("check kernels (" + ", ".join(CHECKED_OPS) + "): "
          + ("ok" if kernels["ok"] else "FAILED: " + kernels["error"]), flush=True)
    for policy in ctx.policies:
        start = time.perf_counter()
        try:
            res = check_step(server, ctx.cfgs[policy, t])
            res["ok"] = True
        except AssertionError as exc:
            res = {"policy": policy, "budget": t, "requests": b, "layers": layers,
                   "ok": False, "error": str(exc)}
        res["seconds"] = round(time.perf_counter() - start, 2)
        checks.append(res)
        flips = res.get("near_tie_flips")
        print(f"check {policy}: " + ("ok" if res["ok"] else "FAILED: " + res["error"])
              + (f" ({flips} near-tie flips)" if flips else ""), flush=True)
    return kernels, checks


def run_benchmark(ctx: Context, progress: bool) -> list[dict]:
    from vase_sglang.policies import POLICIES

    rows = []
    bar = None
    if progress:
        from tqdm import tqdm

        total = len(ctx.budgets) * len(ctx.requests) * len(ctx.policies) * len(ctx.backends)
        bar = tqdm(total=total, desc="configs", unit="run", file=sys.stderr)
    cuda = ctx.device.type == "cuda"
    for t in ctx.budgets:
        window = window_for(ctx.window, t)
        for b in ctx.requests:
            plan = [(policy, backend, estimate_bytes(ctx.shape, policy, POLICIES[policy],
                                                     ctx.cfgs[policy, t], b, t, window, backend,
                                                     ctx.needs_ring))
                    for policy in ctx.policies for backend in ctx.backends]
            server = None
            if any(est <= ctx.cap for _, _, est in plan):
                try:
                    server = ctx.server(ctx.shape, b, t)
                except torch.OutOfMemoryError:
                    server = None
            for policy, backend, est in plan:
                cls = POLICIES[policy]
                row = {"policy": policy, "backend": backend, "requests": b, "budget": t,
                       "window": window, "candidates": t, "kept": t - window,
                       "est_bytes": est, "bytes": step_bytes(ctx.shape, cls, b, t, window)}
                row["bytes"]["total"] = sum(row["bytes"].values())
                if est > ctx.cap:
                    row.update(status="skipped", reason=(
                        f"est. {est / GIB:.1f} GiB > cap {ctx.cap / GIB:.1f} GiB"))
                elif server is None:
                    row.update(status="oom", reason="building the pool ran out of memory")
                else:
                    try:
                        if cuda:
                            torch.cuda.reset_peak_memory_stats(ctx.device)
                        median, samples = time_config(server, ctx.cfgs[policy, t], backend,
                                                      ctx.warmup, ctx.repeats)
                        row.update(
                            status="ok", reason="",
                            step="vase_sglang_patches.step.evict",
                            ms={k: v * 1e3 for k, v in median.items()},
                            samples_ms={k: [x * 1e3 for x in v] for k, v in samples.items()},
                            gb_per_s=row["bytes"]["total"] / median["total"] / 1e9,
                        )
                        if cuda:
                            row["peak_bytes"] = torch.cuda.max_memory_allocated(ctx.device)
                    except torch.OutOfMemoryError as exc:
                        row.update(status="oom", reason=str(exc).splitlines()[0][:120])
                    if row["status"] == "oom":  # the step's tensors are released by now
                        gc.collect()
                        torch.cuda.empty_cache()
                rows.append(row)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix_str(f"T={t} B={b} {policy} {backend} {row['status']}")
            del server
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    if bar is not None:
        bar.close()
    order = {name: i for i, name in enumerate(ctx.policies + ctx.backends)}
    rows.sort(key=lambda r: (order[r["policy"]], order[r["backend"]], r["budget"], r["requests"]))
    return rows


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    saved = {k: os.environ.get(k) for k in ("VASE_KERNELS", "TRITON_INTERPRET")}
    try:
        return _main(argv)
    finally:  # the runs switch VASE_KERNELS; leave the caller's environment as it was
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    on_cpu = device.type != "cuda"
    if args.check and on_cpu:
        # Triton kernels on CPU only exist in the interpreter; this must precede the first
        # @triton.jit definition (vase_sglang.ops imports) and leaves the torch path untouched.
        os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(args.threads)

    from vase_sglang import EvictionConfig
    from vase_sglang.policies import POLICIES

    policies = list(POLICIES) if args.policies == ["all"] else args.policies
    for name in policies:
        if name not in POLICIES:
            print(f"error: unknown policy {name!r}; choose from {', '.join(POLICIES)} or all",
                  file=sys.stderr)
            return 2
    backends = args.backends or (["torch"] if on_cpu else ["torch", "triton"])
    for name in backends:
        if name not in ("torch", "triton"):
            print(f"error: unknown backend {name!r} (torch or triton)", file=sys.stderr)
            return 2
        if name == "triton" and on_cpu:
            if os.environ.get("TRITON_INTERPRET") != "1":
                print("error: --backends triton on CPU needs TRITON_INTERPRET=1 (and its times "
                      "are meaningless)", file=sys.stderr)
                return 2
            print("warning: triton on CPU runs in the interpreter: its times are meaningless",
                  file=sys.stderr)
    budgets = args.budgets or list(QUICK_BUDGETS if args.quick else DEFAULT_BUDGETS)
    requests = args.requests or list(QUICK_REQUESTS if args.quick else DEFAULT_REQUESTS)
    warmup = args.warmup if args.warmup is not None else (1 if (on_cpu or args.quick) else 3)
    repeats = args.repeats if args.repeats is not None else (
        2 if args.quick else (3 if on_cpu else 10))
    layers, q_heads, kv_heads, head_dim = MODELS[args.model]
    layers = args.layers or layers
    dtype = getattr(torch, args.dtype)
    shape = Shape(layers, q_heads, kv_heads, head_dim, torch.empty((), dtype=dtype).element_size())
    if args.mem_cap_gib is not None:
        cap = int(args.mem_cap_gib * GIB)
    elif on_cpu:
        cap = 6 * GIB
    else:
        cap = int(0.9 * torch.cuda.mem_get_info(device)[0])

    cfgs = {}
    for policy in policies:
        for budget in budgets:
            try:
                cfgs[policy, budget] = EvictionConfig(policy=policy, budget=budget,
                                                      window=window_for(args.window, budget),
                                                      sinks=args.sinks,
                                                      seed=args.seed)
            except ValueError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
    runtime_module = load_runtime_module()
    info = machine_info(device, torch.get_num_threads())
    command = shlex.join([sys.executable, *sys.argv] if argv is None
                         else [sys.executable, sys.argv[0], *argv])
    report = {
        "command": command,
        "cwd": os.getcwd(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": info,
        "settings": {
            "model": args.model, "layers": layers, "q_heads": q_heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "dtype": args.dtype, "window": args.window,
            "sinks": args.sinks, "policies": policies, "budgets": budgets, "requests": requests,
            "backends": backends, "warmup": warmup, "repeats": repeats,
            "mem_cap_gib": round(cap / GIB, 2), "seed": args.seed,
            "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        },
        "check_kernels": None,
        "check": None,
        "rows": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    png = args.out.with_suffix(".png")
    ctx = Context(device=device, shape=shape, dtype=dtype, window=args.window, seed=args.seed,
                  policies=policies, backends=backends, budgets=budgets, requests=requests,
                  warmup=warmup, repeats=repeats, cap=cap, cfgs=cfgs, runtime_module=runtime_module,
                  needs_ring=any(POLICIES[p].needs_queries for p in policies))
    status = 0
    if args.check:
        check_layers = args.check_layers or (2 if on_cpu else layers)
        report["check_kernels"], report["check"] = run_checks(ctx, check_layers)
        status = 0 if report["check_kernels"]["ok"] and all(c["ok"] for c in report["check"]) else 1
    if not args.check_only:
        report["rows"] = run_benchmark(ctx, progress=not args.no_progress)

    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    report["max_rss_gib"] = round(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 2)
    if report["rows"]:
        print(f"\n{info['device_name']} | torch {info['torch']} | {info['torch_threads']} "
              f"thread(s) | {args.model}: {layers} layers, {q_heads}/{kv_heads} heads, "
              f"D={head_dim}, {args.dtype} | R={args.window} | median of {repeats}")
        print(format_table(report["rows"]))
        if not args.no_plot:
            title = (f"one eviction step, {args.model} ({layers} layers), {info['device_name']}, "
                     f"{info['torch_threads']} thread(s)")
            plot(report["rows"], png, title)
            report["plot"] = str(png)
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"\nwrote {args.out}" + (f" and {png}" if report.get("plot") else ""))
    return status


if __name__ == "__main__":
    sys.exit(main())
