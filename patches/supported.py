"""The settings an evicting server supports: an allowlist over every SGLang 0.5.23 ServerArgs
field, checked at startup (server_args.after_resolve_once). docs/supported.md is generated
from this table (`python -m vase_sglang_patches.supported`; a test checks it is current).

Every field is in one of three classes:

  ANY          known-neutral for eviction: any value (ports, logging, tokenizer, weight
               loading, sizes). Listed in NEUTRAL below.
  values       an explicit set of supported values, checked on the value SGLang resolves
               (so a default launch that SGLang resolves to an unsupported value is refused
               too) or on the user's input. Listed in ALLOWED below.
  default      every other field: only SGLang's declared default is supported; any other
               input is refused naming the flag, because it is not tested with eviction.

"Input" is the value given on the command line or to sgl.Engine (ServerArgs keeps it as the
field's value); "resolved" is what SGLang's resolution decided (`resolution_result`), which
is what the running server uses.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Allowed:
    values: tuple | None  # None: any value (listed here for its note)
    why: str  # said when a value outside `values` is refused
    resolved: bool = True  # check SGLang's resolved value (else the user's input)


# Known-neutral: nothing here reaches the KV pool, the request rows, the positions or the
# decode loop, so eviction behaves the same for any value. Grouped by SGLang's namespace.
NEUTRAL = {
    # model: which weights and how they are loaded (weights only; the KV path is checked
    # on the model itself in model_runner.after_post_pool)
    "model_path", "load_format", "model_loader_extra_config", "trust_remote_code",
    "context_length", "revision", "dtype", "quantization", "startup_weight_load_mode",
    "weight_loader_disable_mmap", "weight_loader_prefetch_checkpoints",
    "weight_loader_prefetch_num_threads", "weight_loader_drop_cache_after_load",
    "engine_info_bootstrap_port", "download_dir", "model_checksum", "delete_ckpt_after_loading",
    "decrypted_config_file",
    # serving: HTTP front end, tokenizer, chat templates, parsers, streaming of outputs
    "tokenizer_path", "tokenizer_mode", "tokenizer_backend", "tokenizer_worker_num",
    "detokenizer_worker_num", "skip_tokenizer_init", "host", "port", "fastapi_root_path",
    "skip_server_warmup", "enable_http2", "http2_max_concurrent_streams",
    "http2_initial_connection_window_size", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs",
    "ssl_keyfile_password", "enable_ssl_refresh", "api_key", "admin_api_key",
    "served_model_name", "weight_version", "chat_template", "trust_request_chat_template",
    "hf_chat_template_name", "completion_template", "file_storage_path", "enable_cache_report",
    "return_input_ids", "return_output_ids", "reasoning_parser", "default_chat_template_kwargs",
    "tool_call_parser", "sampling_defaults", "preferred_sampling_params", "allow_auto_truncate",
    "stream_interval", "batch_notify_size", "stream_response_default_include_usage",
    "incremental_streaming_output", "constrained_json_whitespace_pattern",
    "constrained_json_disable_any_whitespace", "constrained_json_max_whitespace_cnt",
    "enable_dynamic_batch_tokenizer", "dynamic_batch_tokenizer_batch_size",
    "dynamic_batch_tokenizer_batch_timeout", "enable_tokenizer_batch_encode",
    "disable_tokenizer_batch_decode", "enable_http_worker_reuseport",
    # exec.features: output-side features (logits processing, sampling-time watermarks)
    "enable_fp32_lm_head", "enable_tf32_matmul", "enable_custom_logit_processor",
    "sampling_mask_max_tokens", "disable_outlines_disk_cache", "enable_watermark",
    "watermark_config", "watermark_key", "watermark_key_b", "watermark_context_window",
    "watermark_mixing_probability", "watermark_max_probability", "watermark_default_enabled",
    "watermark_enforce_all",
    # schedule: sizes and admission order (admission hooks work on any of them)
    "mem_fraction_static", "max_running_requests", "max_queued_requests", "max_total_tokens",
    "chunked_prefill_size", "max_prefill_tokens", "prefill_max_requests", "schedule_policy",
    "schedule_conservativeness", "scheduler_recv_interval",
    # memory: which unlocked tree leaves the radix cache frees first
    "radix_eviction_policy", "radix_eviction_policy_config", "_radix_eviction_policy_explicitly_set",
    # parallel: rendezvous settings (multi-GPU layouts themselves are in ALLOWED)
    "nccl_port", "dist_timeout", "load_balance_method", "enable_p2p_check",
    # device: process placement and housekeeping
    "base_gpu_id", "gpu_id_step", "random_seed", "watchdog_timeout", "soft_watchdog_timeout",
    "sleep_on_idle", "custom_sigquit_handler", "numa_node", "gc_threshold",
    # observability: logs, metrics, traces, tensor dumps (kv_canary and kv_events are not
    # neutral: they watch KV contents and blocks that compaction rewrites)
    "log_level", "log_level_http", "log_requests", "log_requests_level", "log_requests_format",
    "log_requests_target", "uvicorn_access_log_exclude_prefixes", "crash_dump_folder",
    "show_time_cost", "enable_metrics", "smg_http_sidecar_port", "enable_mfu_metrics",
    "enable_metrics_for_all_schedulers", "load_snapshot_publish_interval",
    "tokenizer_metrics_custom_labels_header", "tokenizer_metrics_allowed_custom_labels",
    "extra_metric_labels", "bucket_time_to_first_token", "bucket_inter_token_latency",
    "bucket_e2e_request_latency", "prompt_tokens_buckets", "generation_tokens_buckets",
    "gc_warning_threshold_secs", "decode_log_interval", "enable_request_time_stats_logging",
    "load_publish_endpoint", "enable_forward_pass_metrics", "forward_pass_metrics_worker_id",
    "forward_pass_metrics_ipc_name", "enable_trace", "trace_modules", "otlp_traces_endpoint",
    "export_metrics_to_file", "export_metrics_to_file_dir", "stat_loggers",
    "debug_tensor_dump_output_folder", "debug_tensor_dump_layers", "otlp_service_name",
    # exec.kernel: sampling, grammar and GEMM kernels (not attention), kernel tuning knobs
    "sampling_backend", "grammar_backend", "fp8_gemm_runner_backend", "fp4_gemm_runner_backend",
    "bf16_gemm_backend", "disable_flashinfer_autotune", "flashinfer_autotune_skip_ops",
    "triton_attention_reduce_in_fp32", "triton_attention_num_kv_splits",
    "triton_attention_split_tile_size",
    # exec.graph: which batch sizes are captured, and graph debugging (the backends are in
    # ALLOWED)
    "cuda_graph_max_bs_decode", "cuda_graph_max_bs_prefill", "cuda_graph_bs_decode",
    "cuda_graph_bs_prefill", "cuda_graph_prefill_max_context", "cuda_graph_max_seq_len_prefill",
    "disable_cuda_graph_padding", "enable_profile_cuda_graph", "enable_cudagraph_gc",
    "debug_cuda_graph",
}

BOTH = (False, True)
# Attention backends whose MHA path builds each step's metadata from req_to_token and
# seq_lens (what compaction rewrites), reading a row's pages at its page-start entries
# (req_to_token[row, ::page_size] // page_size) with no slot order of their own:
# torch_native (CPU, tested in CI at page sizes 1 and 16); on CUDA, read in SGLang 0.5.23 but
# not run here: fa3 (the Hopper default; flashattention_backend.py page_table, strided by the
# page size), flashinfer and triton (create_flashinfer_kv_indices_triton over req_to_token /
# seq_lens), trtllm_mha (the Blackwell default, page size 16/32/64;
# kernels/ops/attention/trtllm_mha_page_table.py reads the slot at each page boundary).
# Not: aiter, flashmla/MLA backends, fa4.
ATTENTION_BACKENDS = (None, "torch_native", "fa3", "flashinfer", "triton", "trtllm_mha")

ALLOWED = {
    "device": Allowed(("cpu", "cuda"), "tested on CPU; the CUDA path is read, not run here"),
    "attention_backend": Allowed(ATTENTION_BACKENDS[1:], "only attention backends that read "
                                 "each step's pages from req_to_token and seq_lens are "
                                 "supported"),
    "decode_attention_backend": Allowed(ATTENTION_BACKENDS, "see --attention-backend"),
    "prefill_attention_backend": Allowed(ATTENTION_BACKENDS, "see --attention-backend"),
    # Any page size: the step keeps the paged row layout and frees whole pages
    # (vase_sglang/rows.py); tested at 1 and 16; --kv-evict-window must be >= it.
    "page_size": Allowed(None, "tested at 1 and 16 (tests/test_paged.py); "
                         "--kv-evict-window must be at least one page"),
    # fp8: SGLang's plain pool stores them as bytes with no scale buffers (the step moves the
    # bytes and scores the float8 values: model_runner.check_pool); served on CPU with
    # torch_native (tests/test_server_fp8.py). fp4 / mxfp8 carry per-token scale buffers.
    "kv_cache_dtype": Allowed(("auto", "bf16", "bfloat16", "float16", "float32", "fp8_e4m3",
                               "fp8_e5m2"),
                              "scores need floating-point K/V: 16/32-bit, or fp8 stored "
                              "without scale buffers at scale 1 (served on CPU; on CUDA "
                              "allowed on reading, e4m3 from sm_89: docs/fp8_kv.md)"),
    "disable_radix_cache": Allowed(BOTH, ""),  # both tested
    "disable_overlap_schedule": Allowed(BOTH, ""),  # both tested
    "retraction_policy": Allowed(("length", "priority"), ""),  # retraction order hook
    "disable_cuda_graph": Allowed(BOTH, ""),  # eager is the reference path
    "disable_decode_cuda_graph": Allowed(BOTH, ""),
    "disable_prefill_cuda_graph": Allowed(BOTH, ""),
    # The new spelling of --disable-cuda-graph; other backends than SGLang's own choice are
    # not tested.
    "cuda_graph_backend_decode": Allowed((None, "disabled"), "only the default or disabled",
                                         resolved=False),
    "cuda_graph_backend_prefill": Allowed((None, "disabled"), "only the default or disabled",
                                          resolved=False),
    # Parallel layouts tested at 2 on CPU (tests/test_parallel.py, on main since the tp
    # branch): data parallel runs independent schedulers, each with its own runtime; tensor
    # parallel ranks each evict their own KV heads, with no collective, so a larger size
    # takes the same code path.
    "dp_size": Allowed(None, "tested at 2 (tests/test_parallel.py)"),
    "tp_size": Allowed(None, "tested at 2 (tests/test_parallel.py)"),
    # Refused with a reason (the former denylist, and what issue 10 found unhandled).
    "pp_size": Allowed((1,), "pipeline parallelism is not tested with eviction"),
    "dcp_size": Allowed((1,), "decode context parallelism splits a request's KV across ranks "
                        "by position; compaction moves tokens between positions"),
    "enable_streaming_session": Allowed((False,), "a streaming session hands the compacted "
                                        "row to the next turn without its position offset"),
    "speculative_algorithm": Allowed((None, "", "NONE"), "speculative decoding writes several "
                                     "KV slots per step; eviction does not track drafts"),
    "enable_dp_attention": Allowed((False,), "DP attention turns decode rows into extends",
                                   resolved=False),
    "attn_dp_size": Allowed((1,), "DP attention turns decode rows into extends"),
    "enable_mixed_chunk": Allowed((False,), "mixed chunks turn decode rows into extends"),
    "disaggregation_mode": Allowed(("null",), "PD disaggregation moves KV by true length"),
    "enable_hierarchical_cache": Allowed((False,), "HiCache is not tested with eviction"),
    "enable_unified_memory": Allowed((False,), "unified memory relocates slots itself"),
}

NOT_TESTED = "not tested with eviction"


# The decode attention backends the attention over cells is wired into (shared_scope.py).
SHARED_SCOPE_BACKENDS = ("torch_native", "triton")


def decode_attention_backend(server_args) -> str | None:
    """The attention backend SGLang resolved for decode: --decode-attention-backend where set,
    else --attention-backend."""
    from sglang.srt.arg_groups.overrides import resolution_result

    return (resolution_result(server_args, "decode_attention_backend")
            or resolution_result(server_args, "attention_backend"))


def shared_scope_refusal(server_args) -> str | None:
    """Why a launch cannot serve --kv-evict-budget-scope layer/global (docs/global_budget.md),
    None where it can: the cells are read by a CPU attention hook (torch_native or triton), in
    16/32-bit K/V (fp8 on torch_native: the cells hold the bytes as they are, scale 1), with
    pages of any size (cells are slots of the K older ones; leaving pages are freed whole).
    Tensor parallel ranks each rank their own KV heads within their part of the budget,
    data-parallel workers their own requests, and without the radix cache the prompt is a
    candidate too (tests/test_parallel.py, tests/test_server_shared_scope.py)."""
    device = getattr(server_args, "device", None)
    if device not in (None, "cpu"):
        return (f"--device {device}: shared budget scopes are served on CPU only (torch_native "
                "or triton); on CUDA the attention over cells is not wired into SGLang's CUDA "
                "graphs yet")
    backend = decode_attention_backend(server_args)
    if backend not in SHARED_SCOPE_BACKENDS:
        return (f"the {backend} attention backend: shared budget scopes are served by the "
                f"{' and '.join(SHARED_SCOPE_BACKENDS)} backends only (the attention over a "
                f"request's cells is not wired into {backend})")
    dtype = str(getattr(server_args, "kv_cache_dtype", "auto"))
    if dtype.startswith("fp8") and backend != "torch_native":
        # SGLang's triton decode rounds the softmax weights to fp8 before P·V: nothing to
        # check the cells' part against (tests/test_server_triton_variants.py)
        return (f"--kv-cache-dtype {dtype}: shared budget scopes keep fp8 K/V on the "
                f"torch_native backend only (not tested on {backend})")
    return None


@functools.lru_cache(maxsize=1)
def _field_defaults() -> dict:
    import msgspec

    from sglang.srt.server_args import ServerArgs

    defaults = {}
    for f in msgspec.structs.fields(ServerArgs):
        if f.default is not msgspec.NODEFAULT:
            defaults[f.name] = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            defaults[f.name] = f.default_factory()
        else:
            defaults[f.name] = REQUIRED  # model_path
    return defaults


REQUIRED = object()  # a field without a default


def unsupported(server_args) -> list[tuple[str, object, str]]:
    """(field, value, why) for every setting outside the allowlist, in field order."""
    from sglang.srt.arg_groups.overrides import resolution_result

    found = []
    for name, default in _field_defaults().items():
        if name in NEUTRAL:
            continue
        rule = ALLOWED.get(name)
        if rule is None:
            value = getattr(server_args, name, default)
            if value != default:
                found.append((name, value, NOT_TESTED))
            continue
        value = (resolution_result(server_args, name) if rule.resolved
                 else getattr(server_args, name, None))
        if rule.values is not None and value not in rule.values:
            found.append((name, value, rule.why))
    return found


def user_set(server_args, name: str) -> bool:
    """Whether the launch gave this field a value other than SGLang's declared default (else
    an unsupported value is SGLang's own resolution, e.g. a backend's page size)."""
    return getattr(server_args, name, None) != _field_defaults()[name]


def flag(name: str) -> str:
    return "--" + name.lstrip("_").replace("_", "-")


def table_markdown() -> str:
    """docs/supported.md."""
    defaults = _field_defaults()
    lines = [
        "# Settings supported with KV eviction",
        "",
        "Generated from `patches/supported.py` (`python -m vase_sglang_patches.supported > "
        "docs/supported.md`); `tests/test_bad_inputs.py` checks that it is current.",
        "",
        "A server started with `--kv-evict-policy` refuses to start with any other setting, "
        "naming the flag. Three classes:",
        "",
        "- **values**: only the listed values (checked on the value SGLang resolves, unless "
        "marked *input*);",
        "- **any**: known-neutral for eviction (front end, logging, tokenizer, weight "
        "loading, sizes);",
        "- **default**: every other SGLang 0.5.23 flag: only SGLang's own default; any other "
        "value is refused as not tested with eviction.",
        "",
        "Models are checked too: mrope models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) are refused at "
        "startup, and so are models whose attention is not plain MHA over one KV pool. Per "
        "request, `beam_width > 1` is answered with HTTP 400 unless the request turns eviction "
        "off (`\"custom_params\": {\"kv_evict\": false}`).",
        "",
        "## Explicit values",
        "",
        "| flag | supported | why |",
        "| --- | --- | --- |",
    ]
    for name, rule in ALLOWED.items():
        values = "any" if rule.values is None else ", ".join(
            "default" if v is None else f"`{v!s}`" if v != "" else '`""`' for v in rule.values)
        kind = "" if rule.resolved else " (input)"
        lines.append(f"| `{flag(name)}` | {values}{kind} | {rule.why or 'tested in CI'} |")
    public = [n for n in defaults if not n.startswith("_")]  # bookkeeping fields have no flag
    lines += ["", "## Any value", ""]
    lines.append(", ".join(f"`{flag(n)}`" for n in public if n in NEUTRAL))
    lines += ["", "## Default only", ""]
    lines.append(", ".join(f"`{flag(n)}`" for n in public
                           if n not in NEUTRAL and n not in ALLOWED))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table_markdown(), end="")
