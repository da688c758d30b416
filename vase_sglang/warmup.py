"""Warm-up: compile every Triton kernel an eviction step launches before the server serves.

A Triton kernel compiles (JIT) at its first launch, and again at the first launch of every new
*specialisation*. Nothing launches the ops before the first eviction, so on a GPU that first
eviction, inside the scheduler's step, would stall every running request for the compile
(seconds), and again whenever a later step hit a new specialisation. `warm_up` runs the real
chunk stage (`workspace.evict_chunk`: gather, select, compact) on scratch tensors of the
server's dtypes and head counts, for every policy the server may run, at startup.

What makes a specialisation (Triton 3.8): a kernel's constexprs (tile sizes, SOFTCAP, HALF,
WORD, UPCAST / PRECISION), the dtypes of its tensors, and, for every other argument not marked
`do_not_specialize`, whether an integer is 1, a multiple of 16 or neither (and i32 or i64), and
whether a pointer is 16-byte aligned. The kernels mark what changes during a server's life and
does not matter to their code: the candidate count n (and the value-range rows it sets), a
per-request window (query rows), the kept count and the strides of `keep` (per-request
budgets; the paged copy's expanded shift index), the compaction's slot stride (n + window) and
the alignment of its pointer tables and slots (a chunk of layers starts at an offset of the
tables; the paged copy passes a column slice of the slots). The batch strides of the gathered
keys, values and queries (n H D, W H_q D) stay specialised, since their divisibility lets the
loads vectorise: they are multiples of 16 whatever n and W when H D and H_q D are (every
head dim in use), and otherwise take two classes, which the scratch covers (n a multiple of 16
and not; for query policies two windows, an even and an odd one). Everything else is fixed for
the server's life by the model (head dim, heads, their strides), the KV and query dtypes, the
model's soft-cap, and the settings no request changes (pool_kernel, projection_rank). So each
kernel compiles once per server; `warm_up` runs every allowed policy at two candidate counts on
two chunk layouts (2 requests x 2 layers from layer 0, 1 x 1 from layer 1), query policies
at two windows, plus the paged copy of the newest window where pages hold several tokens.
`probe` runs the chunks a server produces later (other candidate counts, per-request budgets,
windows and policies, other chunk layouts): tests/test_warmup.py checks under Triton's real
compiler for sm_80, and vase_sglang.gpu_check on a GPU, that they compile nothing after warm_up.

    python -m vase_sglang.warmup --json OUT [--device cuda] [--quick]

runs warm_up then probe on Qwen3-4B's attention shapes (--quick: tiny ones) and writes both
results: gpu_check's "warm_up" section, in fresh processes so that nothing is compiled yet.

Not covered: integers past 2^31 (a request of more than ~2M tokens at 1024 values per token
makes the gathered keys' batch stride an int64: one more compilation), and a custom policy's
own Triton kernels, if it has any (its select() is run, and a failure is recorded, not raised).

On the torch backend (CPU) nothing compiles: the server's own policy runs once on tiny scratch
shapes, so the call stays cheap.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

import torch

from . import ops
from .config import EvictionConfig
from .policies import POLICIES, AttentionParams
from .chunk import KVShapes, Workspace, aligned_size, evict_chunk, gather_layout, tensor_bytes

KERNEL_MODULES = ("compact", "cur_leverage", "value_range", "window_attention")
SCRATCH_LAYERS = 3  # chunks of 2 layers from layer 0 and of 1 layer from layer 1
# (requests, layers, first layer) of the chunks run per candidate count
LAYOUTS = ((2, 2, 0), (1, 1, 1))


def allowed_policies(cfg: EvictionConfig, retention: bool = False) -> list[str]:
    """The policies a server started with `cfg` may run: its own, and those a request may ask
    for (patches/request_control.effective_config): every registered policy if the server's
    scores with queries (it records them), else only those that do not; trimkv (and any
    policy scoring from retention gates) only with the gates loaded. The server's first."""
    if not cfg.evicts:
        return []
    queries = POLICIES[cfg.policy].needs_queries
    names = [cfg.policy] + [p for p in POLICIES if p != cfg.policy]
    return [p for p in names if (queries or not POLICIES[p].needs_queries)
            and (retention or not POLICIES[p].needs_retention)]


def scratch_config(cfg: EvictionConfig, policy: str, window: int | None = None) -> EvictionConfig:
    """A small config of `policy` for the scratch chunks: the server's settings that select
    kernels (pool_kernel, projection_rank, temperature, ...) with a budget and window small
    enough for a cheap chunk (values the kernels do not specialise on). Value slots where the
    policy reserves them, also where its default is none (trimkv's hybrid), so that the
    value-range kernel runs."""
    window = min(cfg.window, 8) if window is None else window
    budget = -(-(window + max(32, 2 * cfg.sinks + 8)) // 16) * 16  # a multiple of 16
    scratch = cfg.replace(policy=policy, budget=budget, window=window, value_slots=None,
                          budget_scope="head")
    if POLICIES[policy].reserves_value_slots and not scratch.n_value_slots:
        scratch = scratch.replace(value_slots=max(1, (budget - window - cfg.sinks) // 4))
    return scratch


def compiled_kernels() -> dict[str, int]:
    """Kernel name -> compiled specialisations in this process's Triton caches (every device).
    Empty under TRITON_INTERPRET=1 (interpreted kernels do not compile) or without Triton."""
    try:
        import triton
    except ImportError:
        return {}
    counts, seen = {}, set()
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"vase_sglang.ops.{name}")
        for obj in vars(module).values():
            if isinstance(obj, triton.runtime.jit.JITFunction) and id(obj) not in seen:
                seen.add(id(obj))
                # device_caches: device -> (kernel_cache, key cache, target, backend, binder)
                total = sum(len(c[0]) for c in list(obj.device_caches.values()))
                if total:
                    counts[obj.__name__] = total
    return counts


def new_compilations(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


class Scratch:
    """A small KV pool, query ring, side buffers and workspace shaped like the server's, on
    `device`: `step` runs one chunk stage on requests of n candidates each."""

    def __init__(self, shapes: KVShapes, device, *, num_layers: int = SCRATCH_LAYERS,
                 max_requests: int = 2, max_candidates: int, max_window: int, seed: int = 0):
        self.shapes, self.device = shapes, torch.device(device)
        self.num_layers = num_layers
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        per_request = max_candidates + max_window
        self.num_slots = 1 + max_requests * per_request  # slot 0: SGLang's padding slot
        kv = (self.num_slots, shapes.kv_heads, shapes.head_dim)
        self.k_buffers = [self._randn(kv, shapes.kv_dtype) for _ in range(num_layers)]
        self.v_buffers = [self._randn(kv, shapes.kv_dtype) for _ in range(num_layers)]
        side = (self.num_slots, shapes.kv_heads, 1)
        self.side = ([-self._randn(side, torch.float32).abs() for _ in range(num_layers)],
                     [torch.zeros(side, device=self.device) for _ in range(num_layers)])
        self.ring = self._randn((num_layers, max_requests + 1, max_window, shapes.q_heads,
                                 shapes.head_dim), shapes.q_dtype)
        self.layer_ids = torch.arange(num_layers, device=self.device)
        self.max_requests, self.max_window = max_requests, max_window

    def _randn(self, shape, dtype):
        return torch.randn(shape, generator=self.gen, device=self.device).to(dtype)

    def row_slots(self, b: int, n: int, window: int) -> torch.Tensor:
        """[b, n + window] distinct pool slots per request, in token order (int64, fresh, as
        the runtime gathers them from req_to_token)."""
        order = torch.randperm(self.num_slots - 1, generator=self.gen, device=self.device) + 1
        return order[: b * (n + window)].view(b, n + window).clone()

    def workspace(self, cfg: EvictionConfig, b: int, l: int, n: int) -> Workspace:
        size = sum(aligned_size(tensor_bytes(s, t)) for s, t in gather_layout(cfg, self.shapes, b, l, n))
        return Workspace(torch.empty(size, dtype=torch.uint8, device=self.device), 0)

    def step(self, cfg: EvictionConfig, *, n: int, b: int = 1, l: int = 1, first_layer: int = 0,
             attention: AttentionParams = AttentionParams(), head_offset: int = 0,
             page_size: int = 1) -> torch.Tensor:
        """One chunk stage (evict_chunk) of b requests with n candidates over layers
        first_layer .. first_layer + l - 1, then, where pages are larger than one token and
        the kept count or n is not a multiple of them, the paged copy of the newest window
        (patches/step.py _evict_requests). Returns keep."""
        policy = POLICIES[cfg.policy]
        window = cfg.window
        rows = self.row_slots(b, n, window)
        slots = rows[:, :n]
        dev = self.device
        request = torch.arange(b, device=dev) + 7
        rounds = torch.zeros(b, dtype=torch.int64, device=dev)
        ring_index = None
        if policy.needs_queries:
            ring_index = (torch.arange(b, device=dev)[:, None],
                          torch.arange(window, device=dev).expand(b, window))
        side = now = None
        if policy.needs_retention:
            side = self.side
            now = torch.full((b,), n + window, device=dev)
        keep = evict_chunk(cfg, self.k_buffers, self.v_buffers, self.ring,
                           self.workspace(cfg, b, l, n), first_layer=first_layer, num_layers=l,
                           layer_ids=self.layer_ids, slots=slots, ring_index=ring_index,
                           request=request, rounds=rounds, sinks=cfg.sinks, side=side, now=now,
                           attention=attention, head_offset=head_offset)
        k = keep.shape[-1]
        if page_size > 1 and k != n and (n % page_size or k % page_size):
            shift = ((n - k) + torch.arange(window, device=dev)).expand(
                b, self.num_layers, self.shapes.kv_heads, window)
            ops.compact_kv_(self.k_buffers, self.v_buffers, rows[:, k:], shift)
            if side is not None:
                ops.compact_kv_(side[0], side[1], rows[:, k:], shift)
        return keep


def warm_up(cfg: EvictionConfig, shapes: KVShapes, device, *,
            attention: AttentionParams = AttentionParams(), head_offset: int = 0,
            retention: bool = False, page_size: int = 1) -> dict:
    """Compile (by running them) the Triton kernels of every eviction step a server with these
    settings can run: each policy of allowed_policies(cfg, retention) on scratch tensors of
    `shapes` on `device` (never the server's pool), at two candidate counts on two chunk
    layouts (query policies at two windows), plus the paged copy for page_size > 1.
    `attention` and `head_offset` as the server's runtime passes them (the soft-cap is a
    specialisation). Returns, for a log line:
    backend, policies run, steps, the kernels compiled (name -> count; empty on torch or in
    the interpreter), errors (policy -> message: a policy that failed on scratch data is
    recorded, the others still run), seconds, and `summary`."""
    start = time.perf_counter()
    device = torch.device(device)
    backend = ops.kernel_backend(device)
    result = {"backend": backend, "device": str(device), "policies": [], "steps": 0,
              "compiled": {}, "errors": {}}
    policies = allowed_policies(cfg, retention)
    if backend == "torch":
        policies = policies[:1]  # nothing compiles: one cheap run keeps the path exercised
    before = compiled_kernels()
    configs = {}
    for policy in policies:
        configs[policy] = [scratch_config(cfg, policy)]
        window = configs[policy][0].window
        if POLICIES[policy].needs_queries and window > 1 and backend == "triton":
            configs[policy].append(scratch_config(cfg, policy, window - 1))  # odd and even W
    if configs:
        largest = max(c.budget for cs in configs.values() for c in cs) + 1
        scratch = Scratch(shapes, device, max_candidates=largest,
                          max_window=max(c.window for cs in configs.values() for c in cs))
    for policy, scfgs in configs.items():
        try:
            for scfg in scfgs:
                counts = (scfg.budget, scfg.budget + 1)  # n: a multiple of 16, and not
                for n in counts if backend == "triton" else counts[:1]:
                    for b, l, first in LAYOUTS if backend == "triton" else LAYOUTS[:1]:
                        scratch.step(scfg, n=n, b=b, l=l, first_layer=first, attention=attention,
                                     head_offset=head_offset, page_size=page_size)
                        result["steps"] += 1
            result["policies"].append(policy)
        except Exception as exc:  # noqa: BLE001  (a custom policy on scratch data: report it)
            result["errors"][policy] = f"{type(exc).__name__}: {exc}"
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result["compiled"] = new_compilations(before, compiled_kernels())
    result["seconds"] = round(time.perf_counter() - start, 3)
    compiled = sum(result["compiled"].values())
    result["summary"] = (
        f"eviction warm-up ({backend} on {device.type}): {len(result['policies'])} policies, "
        f"{result['steps']} chunk steps, {compiled} kernel compilations in "
        f"{result['seconds']:.2f} s" + (f"; failed: {', '.join(result['errors'])}"
                                         if result["errors"] else ""))
    return result


def probe(cfg: EvictionConfig, shapes: KVShapes, device, *,
          attention: AttentionParams = AttentionParams(), head_offset: int = 0,
          retention: bool = False, page_size: int = 1) -> dict:
    """Chunk steps a server with these settings runs after start-up, at shapes warm_up never
    ran: every allowed policy at the server's budget and window with n = budget (the steady
    state), budget + 1, budget + 16 and 2 budget + 17 (early evictions, a long prompt's first)
    on chunk layouts of 2 x 2 layers, 3 x 1 from layer 1, 1 x 3, 1 x 1 from layer 2; then
    per-request budgets and windows (window 1 included) for a query, a CUR and a retention
    policy where allowed (the first registered of each kind: `_probe_kinds`). Returns steps,
    the compilations they caused and seconds."""
    start = time.perf_counter()
    before = compiled_kernels()
    layouts = ((2, 2, 0), (3, 1, 1), (1, 3, 0), (1, 1, 2))
    counts = (cfg.budget, cfg.budget + 1, cfg.budget + 16, 2 * cfg.budget + 17)
    requests = [(cfg.budget // 2 + 1, max(1, cfg.window // 2 + 1)), (cfg.budget + 16, cfg.window),
                (cfg.budget, 1)]
    scratch = Scratch(shapes, device, num_layers=3, max_requests=3,
                      max_candidates=max(counts[-1], cfg.budget + 19), max_window=cfg.window)
    policies = allowed_policies(cfg, retention)
    steps = 0
    for policy in policies:
        pcfg = cfg.replace(policy=policy, value_slots=None, budget_scope="head")
        for n, (b, l, first) in zip(counts, layouts):
            scratch.step(pcfg, n=n, b=b, l=l, first_layer=first, attention=attention,
                         head_offset=head_offset, page_size=page_size)
            steps += 1
    kinds = _probe_kinds(policies)
    for budget, window in requests:
        for policy in kinds:
            if budget > window:
                rcfg = cfg.replace(policy=policy, budget=budget, window=window, value_slots=None,
                                   budget_scope="head")
                scratch.step(rcfg, n=budget + 3, b=2, l=1, first_layer=1, attention=attention,
                             head_offset=head_offset, page_size=page_size)
                steps += 1
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return {"steps": steps, "compiled": new_compilations(before, compiled_kernels()),
            "seconds": round(time.perf_counter() - start, 3)}


def _probe_kinds(allowed: list[str]) -> list[str]:
    """Of the allowed policies, in registration order, the first that scores with queries
    (vase-attnv), the first that reads K/V without queries or gates (vase-dkv: CUR) and the
    first that scores from retention gates (trimkv): each kind's kernels at other shapes."""
    kinds = (lambda p: p.needs_queries,
             lambda p: p.reads_kv and not p.needs_queries and not p.needs_retention,
             lambda p: p.needs_retention)
    found = []
    for kind in kinds:
        name = next((n for n in POLICIES if n in allowed and kind(POLICIES[n])), None)
        if name is not None:
            found.append(name)
    return found


# Qwen3-4B's attention (36 layers of which the scratch takes 3; 8 KV / 32 query heads, head dim
# 128, bf16) at budget 2048, window 64 (benchmarks/kernels.py's T), vase-attnv with trimkv's
# gates and 16-token pages: every kernel and path. --quick: tiny shapes (the CPU self-test).
_SHAPES = {"qwen3-4b": KVShapes(8, 32, 128, torch.bfloat16, torch.bfloat16, 64),
           "tiny": KVShapes(2, 4, 32, torch.bfloat16, torch.bfloat16, 16)}
_CONFIGS = {"qwen3-4b": EvictionConfig(policy="vase-attnv", budget=2048, window=64),
            "tiny": EvictionConfig(policy="vase-attnv", budget=48, window=16)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vase_sglang.warmup",
                                description="warm_up, then probe: the steps after it compile nothing")
    p.add_argument("--json", required=True, help="where to write the result")
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny shapes")
    args = p.parse_args(argv)
    key = "tiny" if args.quick else "qwen3-4b"
    shapes, cfg = _SHAPES[key], _CONFIGS[key]
    server = dict(retention=True, page_size=16)
    start = time.perf_counter()
    result = {"shapes": {k: str(v) for k, v in vars(shapes).items()}, "config": vars(cfg),
              "server": server}
    result["warm_up"] = warm_up(cfg, shapes, args.device, **server)
    result["probe"] = probe(cfg, shapes, args.device, **server)
    result["seconds"] = round(time.perf_counter() - start, 3)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(result["warm_up"]["summary"] + f"; then {result['probe']['steps']} steps compiled "
          f"{sum(result['probe']['compiled'].values())} kernels", flush=True)
    return 0 if not result["warm_up"]["errors"] and not result["probe"]["compiled"] else 1


if __name__ == "__main__":
    sys.exit(main())
