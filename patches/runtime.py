"""The per-process eviction runtime: one `EvictionRuntime` in each scheduler process, built when
the model runner has its KV pool (model_runner.after_post_pool). It holds what the eviction step
(step.py) works on: the KV pool's buffers, the request table, the allocator, the query ring that
the attention hook writes (vase_sglang/capture.py), trimkv's side buffers, and the step's
workspace; plus the counters the metrics report."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vase_sglang import EvictionConfig, capture
from vase_sglang.chunk import KVShapes, Workspace
from vase_sglang.plan import allocate_workspace
from vase_sglang.policies import AttentionParams

from . import metrics, request_control
from .settings import RequestLimits
from .timing import StepTimer

@dataclass
class EvictionStats:
    evictions: int = 0  # request-rounds
    tokens_evicted: int = 0
    slots_freed: int = 0
    seconds: float = 0.0  # host wall time of the steps (what the scheduler waited for)
    device_seconds: float = 0.0  # device time of the finished steps (StepTimer)
    failures: int = 0  # requests finished because a step failed on them (commit.fail, commit.agree)


@dataclass
class EvictionRuntime:
    cfg: EvictionConfig
    k_buffers: list
    v_buffers: list
    req_to_token: torch.Tensor
    allocator: object
    num_q_heads: int
    head_dim: int
    start_layer: int
    queries: torch.Tensor | None  # ring [layers, rows, window, H_q, D] of post-RoPE queries
    workspace: Workspace | None = None  # gathers of a step; None: sized for this server now
    stats: EvictionStats = field(default_factory=EvictionStats)
    attention: AttentionParams = AttentionParams()  # the model's logit scaling and soft-cap
    kv_head_offset: int = 0  # global index of this rank's first KV head (tensor parallel)
    # Ring row of each token of the current extend batch (SCRATCH_ROW where not kept); a
    # persistent buffer because recorded prefill graphs read it (vase_sglang.capture).
    token_rows: torch.Tensor | None = None
    page_size: int = 1  # the allocator's; the step keeps the paged row layout (vase_sglang/rows.py)
    retention: RetentionBuffers | None = None  # with --kv-evict-retention-gates: trimkv served
    limits: RequestLimits | None = None  # what requests may choose (default: from cfg)
    # The longest private cache the server admits (the model's context length): the
    # workspace holds one unit of it, streamed over candidates. None: the largest budget.
    max_candidates: int | None = None
    # The query ring's dtype (memory.query_ring_dtype), also where there is no ring, so that
    # the step's shapes equal those its workspace was planned with. None: the ring's, or K's.
    query_dtype: torch.dtype | None = None
    # request-table row -> shared_scope.CellView of each request holding cells (a shared
    # budget scope): what decode attention reads for it
    cell_views: dict = field(default_factory=dict)
    # The attention-TP group's CPU (gloo) group where it has several ranks: they hold the same
    # batch, and agree on the requests a step failed (commit.agree). None: one rank.
    tp_cpu_group: object = None

    def __post_init__(self):
        k = self.k_buffers[0]
        ring = self.queries
        q_dtype = ring.dtype if ring is not None else (self.query_dtype or k.dtype)
        self.shapes = KVShapes(
            kv_heads=k.shape[1], q_heads=self.num_q_heads, head_dim=self.head_dim,
            kv_dtype=k.dtype, q_dtype=q_dtype,
            ring_window=ring.shape[2] if ring is not None else self.cfg.window,
        )
        self.device_type = k.device.type  # the device the step's memory is planned for
        # Global layer ids key the draws; built once (a device arange, no host copy).
        self.layer_ids = torch.arange(self.start_layer, self.start_layer + self.num_layers,
                                      device=k.device)
        if self.limits is None:
            self.limits = RequestLimits.defaults(self.cfg)
        if self.workspace is None:  # what memory.around_profile reserved for it
            self.workspace = allocate_workspace(self.cfg, self.shapes, k.device,
                                                max_budget=self.limits.max_budget,
                                                max_candidates=self.max_candidates)
        if self.device_type == "cuda":
            # The compaction kernel's pointer tables: one host copy now, none per step.
            from vase_sglang.ops.compact import pointer_table

            pointer_table(self.k_buffers, k.device), pointer_table(self.v_buffers, k.device)
            if self.retention is not None:
                pointer_table(self.retention.log_beta, k.device)
                pointer_table(self.retention.position, k.device)
        # logged once: (policy, n) by step.plan_group, (stage, error type) by commit.fail
        self.warned: set[tuple[str, object]] = set()
        self.ring_held = 0  # pool slots the running requests' query rings hold
        self.timer = StepTimer(k.device)

    def request_settings(self, custom_params) -> EvictionConfig | None:
        """A request's effective settings on this scheduler (its page size, gates, limits)."""
        return request_control.effective_config(custom_params, self.cfg, self.page_size,
                                                self.retention is not None, self.limits)

    @property
    def num_layers(self) -> int:
        return len(self.k_buffers)

    # -- the query ring's slots (vase_sglang/pool_ring.py) --------------------------------

    @property
    def ring_slots(self) -> int:
        """Pool slots the query ring of one request takes (0: this server records none)."""
        table = getattr(self.queries, "table", None)
        return 0 if table is None else table.shape[1]

    @property
    def ring_storage(self):
        """The ring's own slot list beside a --max-total-tokens pool; None: in the pool
        (who holds which slots: ring.py)."""
        return getattr(self.queries, "storage", None)

    def capture_queries(self, layer_id: int, q: torch.Tensor, forward_batch) -> None:
        """Write the post-RoPE queries of the last `window` positions of each request into the
        ring at position % window. Runs inside CUDA graphs: see vase_sglang.capture."""
        ring = self.queries[layer_id - self.start_layer]
        q = q.reshape(q.shape[0], self.num_q_heads, self.head_dim)
        mode = forward_batch.forward_mode
        if mode.is_decode():
            capture.capture_decode_queries(ring, q, forward_batch.req_pool_indices,
                                           forward_batch.positions, self.cfg.window)
        elif mode.is_extend() and forward_batch.extend_seq_lens is not None:
            capture.capture_extend_queries(ring, q, self.token_rows, forward_batch.positions,
                                           self.cfg.window)

    def record_retention(self, layer_id: int, hidden_states: torch.Tensor, positions: torch.Tensor,
                         forward_batch) -> None:
        """trimkv's gate for the tokens of this forward, at their creation (every layer, prefill
        and decode): log β and true position into the side buffers. Runs inside CUDA graphs."""
        r = self.retention
        layer = layer_id - self.start_layer  # side buffers: pool layers; gates: global layers
        capture.record_retention(r.log_beta[layer], r.position[layer], hidden_states,
                                 r.w1[layer_id], r.b1[layer_id], r.w2[layer_id], r.b2[layer_id],
                                 forward_batch.out_cache_loc, positions)

    def prepare_capture(self, forward_batch) -> None:
        """Once per ForwardBatch, before its forward (recorded or replayed): the ring row of
        each extend token, which the recorded extend capture reads from `token_rows`."""
        if self.queries is None or not forward_batch.forward_mode.is_extend():
            return
        if forward_batch.extend_seq_lens is None:
            return
        capture.extend_token_rows(
            self.token_rows, forward_batch.req_pool_indices, forward_batch.extend_seq_lens,
            forward_batch.seq_lens, forward_batch.positions, self.cfg.window,
        )

    def report_device_times(self) -> None:
        """Device time of the steps that have finished on the device (read without waiting);
        on CPU the ops run synchronously and it equals the host time."""
        done = self.timer.finished()
        self.stats.device_seconds += sum(done)
        if metrics.METRICS is not None:
            for seconds in done:
                metrics.METRICS.record_device(seconds)


@dataclass
class RetentionBuffers:
    """trimkv's state in a server (docs/retention.md): the gates of this rank's KV heads on the
    device (w1 [L, r, hidden], b1 [L, r], w2 [L, H, r], b2 [L, H], float32) and per pool layer
    the side buffers log_beta and position [slots, H, 1] float32, indexed like the KV pool.
    Position is float32 (exact below 2^24 tokens) so that one compaction call moves both."""

    w1: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor
    log_beta: list
    position: list

    @classmethod
    def allocate(cls, gates, slots: int, layers: int, kv_heads: int, head_offset: int,
                 device) -> "RetentionBuffers":
        heads = slice(head_offset, head_offset + kv_heads)

        def on_device(t):
            return t.detach().float().contiguous().to(device)

        return cls(
            w1=on_device(gates.w1), b1=on_device(gates.b1),
            w2=on_device(gates.w2[:, heads]), b2=on_device(gates.b2[:, heads]),
            log_beta=[torch.zeros(slots, kv_heads, 1, device=device) for _ in range(layers)],
            position=[torch.zeros(slots, kv_heads, 1, device=device) for _ in range(layers)],
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.log_beta, *self.position))


RUNTIME: EvictionRuntime | None = None
