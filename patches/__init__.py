"""SGLang hooks of vase-sglang (this folder imports as `vase_sglang_patches`).

SGLang calls `register()` (entry point group `sglang.srt.plugins`) at the start of every one of
its processes. Each module here hooks one SGLang subsystem and lists its exact targets
(`planned_hooks` plans them; tests/test_docs.py checks this table and docs/hooks.md, which says
why each is hooked, against it):

| module | target (sglang 0.5.23) | what for |
|---|---|---|
| server_args | `ServerArgs.add_cli_args`, `.from_cli_args`, `.resolve_once` | flags, validation |
| memory | `KVCacheConfigurator._profile_available_bytes` | workspace reserved first |
| model_runner | `ModelRunner._init_post_memory_pool_components` | the eviction runtime |
| | `RadixAttention.forward` | query capture |
| | `ForwardBatch.init_new` | RoPE positions, extend rows |
| scheduler | `Scheduler.init_overlap` | overlap needs a forward stream |
| | `Scheduler._create_generation_req` | per-request settings |
| | `Scheduler.get_new_batch_prefill` | admission pressure |
| | `Scheduler.update_running_batch` | the eviction step |
| | `ScheduleBatch._get_decode_retraction_order` | uncompacted retracted first |
| | `Req.reset_for_retract` | retraction resets the state |
| | `release_kv_cache` | compacted slots stay out of the tree |
| | `ScheduleBatch.prepare_for_extend` | query ring slots (ring.py) |
| | `SchedulerInvariantChecker._get_total_uncached_sizes` | ring slots counted |
| | `Req._compute_max_prefix_len`, `UnifiedRadixCache.checkpoint` | outputs stay private |
| footprint | `PrefillAdder.add_one_req`, `.add_chunked_req`, `._check_prefill_budget` | charges |
| | `PrefillAdder._update_prefill_budget`, `._get_running_request_total_token_offset` | |
| output | `SchedulerOutputStreamer.build_additional_customized_info` | meta_info count |
| | `TokenizerManager.update_request_meta_info` | |
| request_control | `SamplingParams.verify` | kv_evict values, HTTP 400 |
| | `TokenizerManager._validate_one_request` | out-of-vocabulary ids |
| | `GenerateReqInput._handle_parallel_sampling` | bounded n |
| metrics | `Scheduler.init_metrics_collector` | vase:* metrics |
| shared_scope | `TorchNativeAttnBackend.forward_decode` | attention over cells |
| | `TorchNativeAttnBackend._run_sdpa_forward_decode` | SDPA skips requests holding cells |
| | `TritonAttnBackend.init_forward_metadata` | triton: plain tokens only for them |
| | `TritonAttnBackend.forward_decode` | triton: cells merged by log-sum-exp |
| rotary_cpu | `RotaryEmbedding.__init__` | CPU serving without vllm |
| distributed_cpu | `GroupCoordinator.__init__` | CPU tensor parallel (gloo) |

The other modules hook nothing: settings (the flags' values), runtime (the per-process state),
state (a request's), ring (its query ring), grouping / step / commit (the eviction step),
supported (the flag allowlist), timing.
"""

from __future__ import annotations

import logging
import pkgutil

from . import (distributed_cpu, footprint, memory, metrics, model_runner, output, request_control,
               rotary_cpu, scheduler, server_args, settings, shared_scope)
from .settings import configure

logger = logging.getLogger("vase_sglang")
SUPPORTED_SGLANG = "0.5.23"


def planned_hooks(cfg) -> list[tuple[str, str, object]]:
    """The hooks this process needs: flags and meta_info everywhere, the eviction machinery
    only where eviction is configured."""
    # request_control everywhere: a server without eviction must still answer a request that
    # asks for it with HTTP 400.
    hooks = list(server_args.HOOKS) + list(output.FRONTEND_HOOKS) + list(request_control.HOOKS)
    if rotary_cpu.needed():
        hooks += rotary_cpu.HOOKS
    if distributed_cpu.needed():
        hooks += distributed_cpu.HOOKS
    if cfg is not None and cfg.evicts:
        hooks += (memory.HOOKS + model_runner.HOOKS + scheduler.HOOKS + footprint.HOOKS
                  + output.SCHEDULER_HOOKS + metrics.HOOKS + shared_scope.HOOKS)
    return hooks


def check_targets(hooks, shapes=()) -> None:
    """Every target must exist in the installed SGLang, and the code shapes some hooks rely on
    (footprint.SHAPES) must hold. SGLang's HookRegistry only logs a failed patch, which would
    leave eviction silently half-installed, so stop the process."""
    missing = footprint.check_shapes(shapes) if shapes else []
    for target in [t for t, _kind, _fn in hooks]:
        try:
            pkgutil.resolve_name(target)
        except (ImportError, AttributeError) as err:
            missing.append(f"{target} ({type(err).__name__}: {err})")
    if missing:
        import sglang

        raise SystemExit(
            f"vase-sglang: hook targets missing in sglang {sglang.__version__} "
            f"(supported: {SUPPORTED_SGLANG}):\n  " + "\n  ".join(missing)
        )


def register() -> None:
    """Entry point of the `sglang.srt.plugins` group."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    # load_plugins() logs and swallows exceptions, which would leave eviction silently half
    # installed: a bad setting, and any failure here, must stop the process instead.
    try:
        cfg = settings.current().config
    except ValueError as err:
        raise SystemExit(f"vase-sglang: {err}") from None
    hooks = planned_hooks(cfg)
    check_targets(hooks, footprint.SHAPES if cfg is not None and cfg.evicts else ())
    try:
        for target, kind, fn in hooks:
            HookRegistry.register(target, fn, HookType[kind])
    except Exception as err:
        raise SystemExit(f"vase-sglang: registering the hook on {target} failed: "
                         f"{type(err).__name__}: {err}") from err


__all__ = ["register", "configure", "planned_hooks", "check_targets"]
