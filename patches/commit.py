"""The fail-safe step's last stage (step.py): commit a chunk's requests, or roll them back and
finish them, and make every tensor-parallel rank finish the same ones.

  commit     after a chunk's pages are freed: KV lengths, position offsets, rounds (state.py),
             then the batch's seq_lens once per step (update_batch_lengths)
  roll back  an exception inside a chunk: its rows are put back as they were (restore_rows,
             before the free, which is the rewrite's last act) and its requests are finished
             with an error naming the stage (fail): their K/V may be half compacted
  agree      under tensor parallelism each rank evicts its own KV heads, so an exception on one
             rank (an allocation failure on one GPU, a custom policy raising on some heads)
             fails requests on that rank only; a request finished on one rank and kept on
             another would make the ranks' next batches differ (a hang or a crash in the
             collectives). So a step that evicted ends with one small all-reduce over the
             attention-TP group's CPU group: each request's failed stage (0: none), and every
             rank finishes the requests any rank failed (docs/reliability.md).

A failed request is never evicted again and its slots never reach the radix tree
(state.mark_failed); SGLang's own release frees them once.
"""

from __future__ import annotations

import logging

import torch

from .state import failed, mark_failed, record_eviction, state

logger = logging.getLogger("vase_sglang.eviction")

# Where a step can fail, as named in a failed request's finish reason (and by fault injection
# in tests/fault_policy.py). A shared budget scope (shared_scope.evict_one) fails at select
# (scoring and the scope's selection), pack or compact (the K/V copies into cells).
PLAN, STAGE, SELECT, PACK, COMPACT, REWRITE = "plan", "stage", "select", "pack", "compact", "rewrite"
STAGES = (PLAN, STAGE, SELECT, PACK, COMPACT, REWRITE)


class StepFailure(Exception):
    """An exception inside the step, with the stage it came from."""

    def __init__(self, stage: str, cause: BaseException):
        super().__init__(f"{stage}: {type(cause).__name__}: {cause}")
        self.stage, self.cause = stage, cause


def commit(rt, cfg, n, k, members, reqs, new_lens) -> None:
    """The chunk's requests after their pages are freed: lengths and state (the batch's lengths
    in update_batch_lengths, once per step)."""
    dropped = n - k
    rt.stats.tokens_evicted += dropped * len(reqs)
    rt.stats.evictions += len(reqs)
    for i, req in zip(members, reqs):
        req.kv.kv_allocated_len -= dropped
        req.kv.kv_committed_len -= dropped
        record_eviction(req, dropped, cfg.budget)
        new_lens[i] = req.kv.kv_allocated_len


def restore_rows(rt, rows, cols, row_slots) -> None:
    """Put the chunk's rows back as they were before its rewrite, so that finishing its
    requests frees each slot once."""
    rt.req_to_token[rows[:, None], cols] = row_slots.to(rt.req_to_token.dtype)


def fail(rt, reqs, stage: str, err: BaseException) -> None:
    """Finish `reqs` with an error naming the stage that failed (their next step finishes
    them, as an abort does; eviction never runs on them again and their slots never reach
    the radix tree: state.mark_failed). The traceback is logged once per (stage, error type);
    the server keeps serving."""
    if isinstance(err, StepFailure):
        stage, err = err.stage, err.cause
    rt.stats.failures += len(reqs)
    first = (stage, type(err).__name__) not in rt.warned
    rt.warned.add((stage, type(err).__name__))
    logger.error("KV eviction failed at stage %r for %d request(s) (%s): %s: %s; they are "
                 "finished with an error, the others keep running",
                 stage, len(reqs), ", ".join(str(r.rid) for r in reqs), type(err).__name__, err,
                 exc_info=err if first else None)
    for req in reqs:
        state(req).failed_stage = stage
        mark_failed(req, f"KV eviction failed at stage {stage!r} ({type(err).__name__}: {err}); "
                         "the request was stopped, other requests are unaffected")


def agree(rt, batch, failed_before) -> None:
    """Under tensor parallelism, after a step that evicted: every rank finishes the requests
    that any rank's step failed (one all-reduce of a small int32 tensor, one entry per request
    of the batch, over the attention-TP group's CPU group; the ranks hold the same batch and
    run the step on the same steps, decided from the same host state). `failed_before`: the
    requests that had failed before this step."""
    group = rt.tp_cpu_group
    if group is None:
        return
    codes = torch.zeros(len(batch.reqs), dtype=torch.int32)
    for i, req in enumerate(batch.reqs):
        if failed(req) and req not in failed_before:
            codes[i] = STAGES.index(state(req).failed_stage or PLAN) + 1
    torch.distributed.all_reduce(codes, op=torch.distributed.ReduceOp.MAX, group=group)
    elsewhere = [(req, STAGES[int(code) - 1]) for req, code in zip(batch.reqs, codes.tolist())
                 if code and not failed(req)]
    if not elsewhere:
        return
    rt.stats.failures += len(elsewhere)
    logger.error("KV eviction failed on another tensor-parallel rank for %d request(s) (%s); "
                 "they are finished here too", len(elsewhere),
                 ", ".join(str(r.rid) for r, _ in elsewhere))
    for req, stage in elsewhere:
        state(req).failed_stage = stage
        mark_failed(req, f"KV eviction failed at stage {stage!r} on another tensor-parallel rank "
                         "(its log has the error); the request was stopped, other requests "
                         "are unaffected")


def update_batch_lengths(batch, new_lens: dict[int, int]) -> None:
    """The batch's lengths after the step: new tensors, never in place (under the overlap
    scheduler the previous forward may still hold references to the old ones)."""
    idx = list(new_lens)
    lens = list(new_lens.values())
    seq_lens_cpu = batch.seq_lens_cpu.clone()
    seq_lens_cpu[idx] = torch.tensor(lens, dtype=seq_lens_cpu.dtype)
    delta = batch.seq_lens_cpu - seq_lens_cpu
    batch.seq_lens_cpu = seq_lens_cpu
    batch.seq_lens = batch.seq_lens - to_device(delta, batch.seq_lens)
    if getattr(batch, "orig_seq_lens", None) is not None:
        batch.orig_seq_lens = batch.orig_seq_lens - to_device(delta, batch.orig_seq_lens)
    batch.seq_lens_sum = None


def pinned(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def to_device(host: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A host tensor on `like`'s device and dtype without blocking the CPU (pinned staging)."""
    host = host.to(like.dtype)
    if pinned(like.device):
        host = host.pin_memory()
    return host.to(like.device, non_blocking=True)
