"""Every byte an eviction step may use, and how a step is cut to stay inside it.

A step over B requests and L layers is split into chunks of b requests x l layers (the chunk
stage: vase_sglang/chunk.py). Its extra memory is bounded by the workspace: `buffer` (a
preallocated byte buffer holding the gathers) plus `headroom` (reserved, left free, for the
temporaries torch ops allocate themselves: fp32 scores, sort indices, random-number arithmetic)
and what each request of a chunk holds around the stage (its row's columns and slots, staged
ids). The temporaries are measured, not guessed: the real chunk stage runs on meta tensors under
`PeakMemory`, which follows every storage an op creates until it is freed (nothing is
allocated), on the backend the step will use (Triton on CUDA, the torch references elsewhere;
`ops.planning_for`).

This module owns every byte count of a step: the workspace a server reserves
(`workspace_bytes`), the plan of one group (`plan_step`: the plain stage where one unit fits,
else the unit's candidates streamed in chunks), and the side buffers' and query ring's bytes.
A step never allocates outside the workspace.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import ops
from .chunk import KVShapes, Workspace, aligned_size, tensor_bytes, evict_chunk, gather_layout
from .config import EvictionConfig
from .policies import POLICIES
from .pool_ring import PoolRing, slots_per_request

DEFAULT_UNITS = 64  # (request, layer) units per chunk the default workspace is sized for


# Ops whose device implementation allocates scratch inside the kernel call, which the
# dispatcher never sees (CUDA's segmented sort: double buffers of keys and values plus CUB
# temp storage). Counted as this many times their outputs, live during the op only.
_INTERNAL_SCRATCH = {"aten::sort": 2.0, "aten::topk": 2.0}


class PeakMemory(TorchDispatchMode):
    """Peak bytes of the storages created while active (views and in-place/out= writes into
    existing storages count nothing), plus an allowance for kernel-internal scratch. Works on
    meta tensors, so a plan costs no memory."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}  # storage address (StorageImpl*) -> bytes
        self.known: set[int] = set()  # storages that existed before
        self.current = 0
        self.peak = 0

    def _freed(self, key: int) -> None:
        self.current -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.live:
                self.known.add(t.untyped_storage()._cdata)
        out = func(*args, **(kwargs or {}))
        scratch = _INTERNAL_SCRATCH.get(func._schema.name)
        if scratch:
            made = sum(t.untyped_storage().nbytes() for t in tree_flatten(out)[0]
                       if isinstance(t, torch.Tensor))
            self.peak = max(self.peak, self.current + int(scratch * made))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self.live or key in self.known:
                continue
            self.live[key] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._freed, key)
        return out


@dataclass(frozen=True)
class ChunkCost:
    """Bytes of one chunk of b requests x l layers: `gather_per_unit` in the buffer per
    (request, layer) unit, and for the temporaries b * per_request + b * l * per_unit.

    per_unit is the traced peak of a whole 1 x 1 chunk (or a 2 x 2 chunk's per unit, if
    larger): every tensor of the stage is shaped [b or 1, l or 1, ...] and the op sequence does
    not depend on b and l (the per-layer loops free what each iteration allocates), so b * l
    times it bounds any chunk's peak; tests/test_step_memory.py checks it on a grid."""

    gather_per_unit: int
    per_unit: int
    per_request: int = 0

    def buffer(self, b: int, l: int) -> int:
        return b * l * aligned_size(self.gather_per_unit)

    def temporaries(self, b: int, l: int) -> int:
        return b * self.per_request + b * l * self.per_unit


def trace_chunk(cfg: EvictionConfig, shapes: KVShapes, n: int, b: int, l: int, sinks: int,
                device: str, chunk: int | None = None) -> tuple[int, int]:
    """(buffer bytes, peak bytes of the temporaries) of one real chunk stage, on meta tensors
    planned as `device` (nothing is allocated); chunk: the streamed stage, candidate chunks
    of that many tokens."""
    meta = torch.device("meta")
    slots_in_pool = b * (n + 1)
    k_buffers = [torch.empty(slots_in_pool, shapes.kv_heads, shapes.head_dim, dtype=shapes.kv_dtype,
                             device=meta) for _ in range(l)]
    v_buffers = [torch.empty_like(k) for k in k_buffers]
    ring = None
    if POLICIES[cfg.policy].needs_queries:  # as served: held in the pool's slots
        per_request = slots_per_request(shapes.ring_window, shapes.q_heads, shapes.head_dim,
                                        shapes.q_dtype, shapes.kv_heads,
                                        shapes.kv_dtype.itemsize)
        table = torch.empty(b + 1, per_request, dtype=torch.int64, device=meta)
        ring = PoolRing(k_buffers, v_buffers, table, shapes.ring_window, shapes.q_heads,
                        shapes.head_dim, shapes.q_dtype)
    layout = gather_layout(cfg, shapes, b, l, n, chunk)
    buffer_bytes = sum(aligned_size(tensor_bytes(s, t)) for s, t in layout)
    workspace = Workspace(torch.empty(buffer_bytes, dtype=torch.uint8, device=meta), 0)
    slots = torch.empty(b, n, dtype=torch.int64, device=meta)
    ring_index = (torch.empty(b, 1, dtype=torch.int64, device=meta),
                  torch.empty(b, cfg.window, dtype=torch.int64, device=meta))
    ids = torch.empty(b, dtype=torch.int64, device=meta)
    layer_ids = torch.empty(l, dtype=torch.int64, device=meta)
    side = None
    if POLICIES[cfg.policy].needs_retention:
        side = tuple([torch.empty(slots_in_pool, shapes.kv_heads, 1, device=meta) for _ in range(l)]
                     for _ in range(2))
    with ops.planning_for(device), PeakMemory() as peak:
        keep = evict_chunk(cfg, k_buffers, v_buffers, ring, workspace, first_layer=0, num_layers=l,
                           layer_ids=layer_ids, slots=slots, ring_index=ring_index, request=ids,
                           rounds=ids, sinks=sinks, side=side, now=ids, candidate_chunk=chunk,
                           seed=ids[:, None])  # per-request seeds, as the engine passes them
        del keep
    return buffer_bytes, peak.peak


def chunk_cost(cfg: EvictionConfig, shapes: KVShapes, n: int, device: str,
               chunk: int | None = None, exact: bool = False) -> ChunkCost:
    """The cost of a chunk with n candidates, traced at the smallest of {cfg.budget, powers
    of two} >= n (costs grow with n), so a server traces a handful of sizes in its life.
    chunk: of the streamed stage with candidate chunks of that many tokens (costs grow with
    it too; the plan uses powers of two, `candidate_chunks`).

    Only what changes a chunk's memory is in the trace's key (cost_key), and a cut below the
    bucket (an elastic level, or pressure) is traced at its budget rounded up to a power of
    two: costs never fall as the budget grows (measured on Qwen3-4B shapes: flat, then higher
    as the kept count nears n), so the levels a server cuts to share a few traces. `exact`:
    at the budget itself (where the rounded cost does not fit, a plan tries this one)."""
    key, bucket, chunk = cost_key(cfg, n, chunk, exact)
    return _chunk_cost(key, shapes, bucket, key.sinks, device, chunk)


def cost_key(cfg: EvictionConfig, n: int, chunk: int | None = None, exact: bool = False):
    """(settings, candidate bucket, candidate chunk) a chunk's cost is traced at: the seed
    (what is drawn), the workspace size (how a step is chunked), the mode and ceiling (when
    a step runs) and the sinks (which entries a mask sets) are left out; the value slots are
    pinned to the count they resolve to; below the bucket, the budget (and the value slots)
    are rounded up to a power of two (at most the bucket)."""
    if n <= cfg.budget:
        bucket = budget = cfg.budget
    else:
        bucket = _power_of_two(n)
        budget = cfg.budget if exact else min(_power_of_two(cfg.budget), bucket)
    if chunk is not None and chunk >= bucket:
        chunk = None  # one chunk holds every candidate: the plain stage
    value_slots = None
    if POLICIES[cfg.policy].reserves_value_slots:
        value_slots = cfg.n_value_slots
        if budget != cfg.budget and cfg.value_slots is None:  # the default, at that budget
            value_slots = cfg.replace(budget=budget, sinks=0).n_value_slots
        elif budget != cfg.budget and value_slots:  # rounded up with the budget
            value_slots = min(_power_of_two(value_slots), budget - cfg.window)
    key = cfg.replace(seed=0, workspace_mb=None, mode="fixed", ceiling=None, sinks=0,
                      value_slots=value_slots, budget=budget)
    return key, bucket, chunk


def cut_samples(budget: int, max_candidates: int) -> list[tuple[int, int]]:
    """(level, n): one cut per cost_key a server of this budget can reach when it cuts
    requests of up to `max_candidates` private tokens to levels >= budget (elastic mode),
    n candidates > level. Tracing these at startup leaves no trace for the first cuts."""
    samples = []
    top = _power_of_two(max(max_candidates, budget + 1))
    bucket = _power_of_two(budget + 1)  # n > level >= budget
    while bucket <= top:
        level_bucket = _power_of_two(budget)
        while level_bucket <= bucket:
            level = max(budget, level_bucket // 2 + 1)
            n = min(bucket, max_candidates)  # same bucket, within what the server admits
            if level < n:
                samples.append((level, n))
            level_bucket *= 2
        bucket *= 2
    return samples


def _power_of_two(x: int) -> int:
    return 1 << (x - 1).bit_length()


# Sized to hold every trace of the settings a server accepts at once (RequestLimits.
# max_settings, each with its elastic levels' buckets), so that none is traced twice.
@functools.lru_cache(maxsize=2048)
def _chunk_cost(cfg, shapes, n, sinks, device, chunk=None) -> ChunkCost:
    # A 1 x 1 chunk alone can take other paths (matmul folds size-1 batch dims into one mm),
    # so a 2 x 2 chunk's peak per unit is traced too and the larger of the two is kept.
    # (torch's CPU matmul also changes path with the batch size: 8 units are traced too).
    gather, one = trace_chunk(cfg, shapes, n, 1, 1, sinks, device, chunk)
    if chunk is not None:  # the streamed stage runs one (request, layer) unit at a time
        return ChunkCost(gather, one)
    _, four = trace_chunk(cfg, shapes, n, 2, 2, sinks, device, chunk)
    _, eight = trace_chunk(cfg, shapes, n, 4, 2, sinks, device, chunk)
    return ChunkCost(gather, max(one, -(-four // 4), -(-eight // 8)))


def plan_chunks(cost: ChunkCost, num_requests: int, num_layers: int, buffer_bytes: int,
                headroom: int) -> tuple[int, int] | None:
    """(requests, layers) per chunk: all requests of a layer at once where they fit (the step
    streams over layers), more layers per chunk when room is left. None: not even one
    (request, layer) unit fits. Pure arithmetic."""

    def fits(b, l):
        return cost.buffer(b, l) <= buffer_bytes and cost.temporaries(b, l) <= headroom

    if not fits(1, 1):
        return None
    b = _largest(lambda x: fits(x, 1), num_requests)
    return b, _largest(lambda x: fits(b, x), num_layers)


def _largest(ok, limit: int) -> int:
    """Largest x in [1, limit] with ok(x), for ok monotone and ok(1) true (bisection)."""
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


class StepPlan(NamedTuple):
    """How a group's step streams: `requests` x `layers` (request, layer) units per chunk and,
    on the streamed path (one unit per chunk), its candidates `chunk` tokens at a time (None:
    all at once)."""

    requests: int
    layers: int
    chunk: int | None


MIN_CANDIDATE_CHUNK = 16  # the smallest candidate chunk a plan tries
STREAM_CHUNK = 1024  # candidate chunk of the streamed unit a workspace is sized to hold


def candidate_chunks(n: int) -> list[int]:
    """The candidate chunks a plan tries for n candidates: powers of two from
    MIN_CANDIDATE_CHUNK up to below n, ascending."""
    sizes, c = [], MIN_CANDIDATE_CHUNK
    while c < n:
        sizes.append(c)
        c *= 2
    return sizes


def plan_step(cost_of, n: int, num_requests: int, num_layers: int, buffer_bytes: int,
              headroom: int, streams: bool = True) -> StepPlan | None:
    """The plan of a step over n candidates: the plain stage (plan_chunks) where one unit of
    it fits, else (policies that stream) the streamed stage, one (request, layer) unit at a
    time, with the largest candidate chunk at which it fits. cost_of(chunk) -> ChunkCost
    (None: the plain stage), monotone in the chunk. None: nothing fits (the caller must not
    run the step). Pure arithmetic on the costs."""
    plan = plan_chunks(cost_of(None), num_requests, num_layers, buffer_bytes, headroom)
    if plan is not None:
        return StepPlan(*plan, None)
    sizes = candidate_chunks(n) if streams else []

    def fits(i):  # i: 1-based index into sizes
        cost = cost_of(sizes[i - 1])
        return cost.buffer(1, 1) <= buffer_bytes and cost.temporaries(1, 1) <= headroom

    if not sizes or not fits(1):
        return None
    return StepPlan(1, 1, sizes[_largest(fits, len(sizes)) - 1])


def size_workspace(cost: ChunkCost, requested_bytes: int | None, units: int = DEFAULT_UNITS,
                   also=()) -> tuple[int, int, int]:
    """(buffer bytes, headroom bytes, units per chunk) of a workspace for steps of this cost.
    Default: `units` (request, layer) units as a chunk of that many requests of one layer.
    With a size requested, the most units that fit it (0: not even one). also: (buffer,
    temporaries) bytes of single units it must hold as well (a unit at the largest
    per-request budget, a streamed unit of the longest private cache); with a size requested
    that cannot hold them, 0 units."""
    need_buffer = max([b for b, _ in also], default=0)
    need_temps = max([t for _, t in also], default=0)

    def size(u):
        return max(cost.buffer(u, 1), need_buffer), max(cost.temporaries(u, 1), need_temps)

    if requested_bytes is None:
        buffer, temps = size(units)
    else:
        per_unit = aligned_size(cost.gather_per_unit) + cost.per_request + cost.per_unit
        limit = max(0, requested_bytes // max(1, per_unit))
        if limit < 1 or sum(size(1)) > requested_bytes:
            return 0, requested_bytes, 0
        buffer = size(_largest(lambda u: sum(size(u)) <= requested_bytes, limit))[0]
        temps = requested_bytes - buffer

    def holds(u):
        return cost.buffer(u, 1) <= buffer and cost.temporaries(u, 1) <= temps

    most = max(units, buffer // max(1, aligned_size(cost.gather_per_unit)) + 1)
    return buffer, temps, _largest(holds, most) if holds(1) else 0


def side_bytes_per_token(layers: int, kv_heads: int) -> int:
    """Bytes of the trimkv side buffers per pool slot: log β and position, float32, per
    (layer, KV head)."""
    return layers * kv_heads * 2 * 4


def ring_bytes(num_layers: int, rows: int, window: int, num_q_heads: int, head_dim: int,
               element_size: int) -> int:
    return num_layers * rows * window * num_q_heads * head_dim * element_size


def group_bytes(num_requests: int) -> int:
    """Device memory a group holds across all its chunks: the staged ids [6, B] int64."""
    return 4096 + num_requests * 6 * 8


def request_bytes(n: int, window: int) -> int:
    """Device temporaries per request of a chunk outside the chunk stage: its row's columns
    and slots (int32 gather, then int64), the ring entries, the rewritten window and the
    freed slots (an upper bound; tests/test_step_memory.py checks the whole step)."""
    return (n + window) * (8 + 4 + 8) + window * 8 * 4 + window * (8 + 4) + n * 8


def step_cost(cfg, shapes, n, device_type, chunk: int | None = None,
              exact: bool = False) -> ChunkCost:
    """The chunk stage's measured cost plus what each request of a chunk holds around it;
    chunk: of the streamed stage, candidate chunks of that many tokens; exact: chunk_cost's."""
    cost = chunk_cost(cfg, shapes, n, device_type, chunk, exact)
    return dataclasses.replace(cost, per_request=cost.per_request + request_bytes(n, cfg.window))


class WorkspaceSize(NamedTuple):
    """A workspace's size and what it was sized to hold: `units` (request, layer) units of
    the server's own step per chunk, one unit at `max_budget` candidates at once, and private
    caches up to `max_candidates` tokens (streamed where a unit does not fit at once;
    `streams` False: the server's policy cannot stream, longer caches are not evicted)."""

    buffer: int
    headroom: int
    units: int
    max_budget: int
    max_candidates: int
    streams: bool

    def describe(self) -> str:
        longest = f"private caches up to {self.max_candidates} tokens"
        if self.max_candidates > self.max_budget:
            longest += (f", streamed in chunks of {STREAM_CHUNK} or more candidates where a "
                        f"unit does not fit at once" if self.streams else
                        " at once where they fit (the policy cannot stream over candidates: "
                        "requests that do not fit are not evicted)")
        return (f"{self.units} requests x 1 layer per chunk at the server's budget, one "
                f"(request, layer) at budget {self.max_budget}, {longest}")


def streamed_policies(cfg: EvictionConfig) -> list[str]:
    """The policies a request may choose on a server of `cfg` whose steps can stream: every
    registered one that streams (Policy.streams), those scoring with queries only where the
    server records them (request_control)."""
    queries = POLICIES[cfg.policy].needs_queries
    return [name for name, policy in POLICIES.items()
            if policy.streams() and (queries or not policy.needs_queries)]


def workspace_bytes(cfg: EvictionConfig, shapes: KVShapes, device_type: str,
                    max_requests: int = 4096, *, max_budget: int | None = None,
                    max_candidates: int | None = None) -> WorkspaceSize:
    """(buffer bytes, headroom bytes, requests per chunk, ...) of this server's eviction
    workspace. It holds, whichever is largest: DEFAULT_UNITS requests of one layer per chunk
    of its own step (n = budget candidates, every sink) or what --kv-evict-workspace-mb
    holds; one (request, layer) unit at `max_budget` candidates (default the budget: the
    largest per-request budget) at once; and, for every policy a request may choose that
    streams, one unit of `max_candidates` candidates (the longest private cache the server
    admits, e.g. the model's context length; default max_budget) streamed STREAM_CHUNK
    candidates at a time. `max_requests` bounds the group (its staged ids). Raises
    ValueError naming the flag if a requested size cannot hold them."""
    # when a step runs does not change its memory; a shared budget scope's steps run outside
    # the workspace (patches/shared_scope.py): it holds per-head steps, this policy's and
    # those of the policies requests may ask for
    cfg = cfg.replace(mode="fixed", ceiling=None, budget_scope="head")
    max_budget = cfg.budget if max_budget is None else max(max_budget, cfg.budget)
    max_candidates = max_budget if max_candidates is None else max(max_candidates, max_budget)
    cost = step_cost(cfg, shapes, cfg.budget, device_type)
    also = []
    if max_budget > cfg.budget and cfg.workspace_mb is None:
        # Sized here, a unit at the largest per-request budget runs at once; in a workspace
        # of a size the user set, it streams over candidates where it does not fit.
        big = step_cost(cfg.replace(budget=max_budget), shapes, max_budget, device_type)
        also.append((big.buffer(1, 1), big.temporaries(1, 1)))
    if max_candidates > cfg.budget:
        for name in streamed_policies(cfg):
            other = _request_like(cfg, name, max_budget)
            long = step_cost(other, shapes, max_candidates, device_type, STREAM_CHUNK)
            also.append((long.buffer(1, 1), long.temporaries(1, 1)))
    group = group_bytes(max_requests)
    requested = None if cfg.workspace_mb is None else cfg.workspace_mb * 2**20 - group
    buffer, temps, units = size_workspace(cost, requested, also=also)
    if units < 1:
        need = (max([cost.buffer(1, 1), *(b for b, _ in also)]) + group
                + max([cost.temporaries(1, 1), *(t for _, t in also)]))
        also = (f", one at budget {max_budget}" if max_budget > cfg.budget else "") + (
            f", a private cache of {max_candidates} tokens streamed"
            if max_candidates > cfg.budget else "")
        raise ValueError(
            f"--kv-evict-workspace-mb: {cfg.workspace_mb} MiB cannot hold one (request, layer) "
            f"unit of an eviction step ({need / 2**20:.1f} MiB for {cfg.policy} at budget "
            f"{cfg.budget}{also}); set at least {math.ceil(need / 2**20)}")
    return WorkspaceSize(buffer, temps + group, units, max_budget, max_candidates,
                         POLICIES[cfg.policy].streams())


def _request_like(cfg: EvictionConfig, policy: str, budget: int) -> EvictionConfig:
    """The server's settings with a request's policy and budget (request_control gives a
    request that changes either the default value slots), reading what such a request may
    read: trimkv with value slots (its VaSE hybrid) reads V too."""
    if policy != cfg.policy or budget != cfg.budget:
        cfg = cfg.replace(policy=policy, budget=budget, value_slots=None)
    if POLICIES[policy].needs_retention and not cfg.n_value_slots:
        cfg = cfg.replace(value_slots=1)
    return cfg


def allocate_workspace(cfg, shapes, device, max_requests: int = 4096, *,
                       max_budget: int | None = None,
                       max_candidates: int | None = None) -> Workspace:
    """The workspace workspace_bytes sizes (pass the same max_budget / max_candidates as the
    memory plan that reserved it: memory.around_profile)."""
    size = workspace_bytes(cfg, shapes, torch.device(device).type, max_requests,
                           max_budget=max_budget, max_candidates=max_candidates)
    return Workspace(torch.empty(size.buffer, dtype=torch.uint8, device=device), size.headroom)

