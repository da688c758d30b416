"""Test-only fault injection, loaded into servers through VASE_KV_EVICT_PLUGINS=fault_policy.

Registers `test-fault-<stage>` for each stage of the eviction step (patches/step.py: plan,
stage, select, compact, rewrite): a policy that selects as snapkv does, and whose group raises
a RuntimeError at that stage, inside the real step of a real server. Requests ask for one
per request (custom_params.kv_evict.policy); every other request is untouched by this module.
The hooks wrap the step's own functions in the scheduler process, at the point each stage
runs: plan_group, _stage, the policy's selection, the in-place compaction, and the page free
after the row rewrite (the row already moved: the rollback's hardest case).

`test-fault-select-rank1` fails at select on tensor-parallel rank 1 only (a fault one rank
sees, as an allocation failure on one GPU would be).

`test-fault-shared-<stage>` (select, pack, compact) score as trimkv does and are served under a
shared budget scope (patches/shared_scope.evict_one, one request at a time): select is the
policy's own scoring raising (a user's policy), pack and compact wrap cells.pack and the K/V
copies into cells (shared_scope.move_kept)."""

import contextvars
import functools

from vase_sglang import ops, register_policy
from vase_sglang import chunk as chunk_module
from vase_sglang.policies import POLICIES, TrimKVPolicy

STAGES = ("plan", "stage", "select", "compact", "rewrite")
SHARED_STAGES = ("select", "pack", "compact")
PREFIX = "test-fault-"
SHARED = PREFIX + "shared-"
RANK1 = "-rank1"
_group = contextvars.ContextVar("fault_policy_group", default=None)  # the policy in the step


class InjectedFault(RuntimeError):
    pass


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _fail_if(stage, policy, prefix=PREFIX):
    if policy == prefix + stage or (policy == prefix + stage + RANK1 and _rank() == 1):
        raise InjectedFault(f"injected fault at stage {stage!r}"
                            + (f" on rank {_rank()}" if policy.endswith(RANK1) else ""))


for _stage in STAGES:
    register_policy(PREFIX + _stage, POLICIES["snapkv"])
register_policy(PREFIX + "select" + RANK1, POLICIES["snapkv"])


class FaultyScore(TrimKVPolicy):
    """trimkv whose scoring raises in a shared-scope step (not in the plans' traces on meta
    tensors at startup): a user's shared-scope policy failing in its own code."""

    def score_streamed(self, candidates, queries, draws):
        _fail_if("select", _group.get(), SHARED)  # the policy of the step's evict_one
        return super().score_streamed(candidates, queries, draws)


register_policy(SHARED + "select", FaultyScore)
for _stage in SHARED_STAGES[1:]:
    register_policy(SHARED + _stage, TrimKVPolicy)


def _with_group_policy(evict):
    """`evict(rt, cfg, ...)` run with _group holding cfg.policy, the policy of the step's
    group, for the stage hooks below to read."""
    @functools.wraps(evict)
    def wrapped(rt, cfg, *args, **kwargs):
        token = _group.set(cfg.policy)
        try:
            return evict(rt, cfg, *args, **kwargs)
        finally:
            _group.reset(token)

    return wrapped


def _install():
    try:
        from vase_sglang_patches import step
    except ImportError:  # not an SGLang process
        return
    if getattr(step, "_fault_policy_installed", False):
        return
    step._fault_policy_installed = True

    plan_group = step.plan_group

    @functools.wraps(plan_group)
    def plan(rt, cfg, n, num_requests):
        _fail_if("plan", cfg.policy)
        return plan_group(rt, cfg, n, num_requests)

    stage = step._stage

    @functools.wraps(stage)
    def staged(rt, reqs, cfg):
        _fail_if("stage", cfg.policy)
        return stage(rt, reqs, cfg)

    in_group = _with_group_policy(step._evict_requests)

    select_tokens = chunk_module.select_tokens

    @functools.wraps(select_tokens)
    def select(cfg, *args, **kwargs):
        _fail_if("select", _group.get())  # not in plan_group's traces on meta tensors
        return select_tokens(cfg, *args, **kwargs)

    compact_kv_ = ops.compact_kv_

    @functools.wraps(compact_kv_)
    def compact(*args, **kwargs):
        _fail_if("compact", _group.get())
        return compact_kv_(*args, **kwargs)

    free = step._free

    @functools.wraps(free)
    def freeing(rt, slots):
        _fail_if("rewrite", _group.get())
        return free(rt, slots)

    step.plan_group, step._stage, step._evict_requests, step._free = plan, staged, in_group, freeing
    chunk_module.select_tokens = select
    ops.compact_kv_ = compact
    _install_shared()


def _install_shared():
    from vase_sglang_patches import shared_scope

    pack, move_kept = shared_scope.pack, shared_scope.move_kept
    one = _with_group_policy(shared_scope.evict_one)

    @functools.wraps(pack)
    def packing(*args, **kwargs):
        _fail_if("pack", _group.get(), SHARED)
        return pack(*args, **kwargs)

    @functools.wraps(move_kept)
    def moving(*args, **kwargs):
        _fail_if("compact", _group.get(), SHARED)
        return move_kept(*args, **kwargs)

    shared_scope.evict_one, shared_scope.pack, shared_scope.move_kept = one, packing, moving


_install()
