"""The bad-input matrix (docs/reliability.md): each bad setting is refused with the message the
user sees.

- Bad server configurations stop `python -m sglang.launch_server` at startup with a message
  naming the flag (or environment variable) at fault. Every case is checked in-process on the
  steps launch_server runs before loading the model, with the plugin's own ServerArgs hooks;
  a few of them also as real launches, so the startup path is covered end to end.
- The supported-settings allowlist (patches/supported.py, docs/supported.md) is checked
  in-process on ServerArgs parsed and resolved as `launch_server` does, for many flags.
- Bad per-request values (`custom_params.kv_evict`) are answered with HTTP 400 naming
  `kv_evict.<field>`, and the server keeps serving.
"""

import json
import os
import pkgutil
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import pytest

from servers import CPU_FLAGS, SNAPKV, run_launch_server_expect_failure
from vase_sglang import EvictionConfig
from vase_sglang_patches import server_args as server_args_hooks
from vase_sglang_patches import settings, supported
from vase_sglang_patches.request_control import effective_config

POLICY = ["--kv-evict-policy", "vase-attnv"]
LAUNCH_CASES = [
    (["--kv-evict-policy", "bogus"], {}, "--kv-evict-policy: unknown policy 'bogus'"),
    (POLICY + ["--kv-evict-budget", "abc"], {}, "--kv-evict-budget: expected an integer"),
    (POLICY + ["--kv-evict-budget", "16", "--kv-evict-window", "64"], {},
     "--kv-evict-budget: must be larger than window"),
    (POLICY + ["--kv-evict-window", "0"], {}, "--kv-evict-window: must be >= 1"),
    (POLICY + ["--kv-evict-value-slots", "-1"], {}, "--kv-evict-value-slots: must be >= 0"),
    (POLICY + ["--kv-evict-budget", "128", "--kv-evict-value-slots", "62"], {},
     "--kv-evict-value-slots: value_slots (62) + sinks (4) must fit"),
    (["--kv-evict-policy", "snapkv", "--kv-evict-value-slots", "8"], {},
     "--kv-evict-value-slots: only the vase-attnv policy"),
    (POLICY + ["--kv-evict-sinks", "-2"], {}, "--kv-evict-sinks: must be >= 0"),
    (POLICY + ["--kv-evict-seed", "x"], {}, "--kv-evict-seed: expected an integer"),
    # Every integer has an explicit range (vase_sglang.config.INT_RANGES): the seed is an int64
    # >= 0 (2^63 overflowed in the step and stopped the scheduler), token counts stop at 2^24.
    (POLICY + ["--kv-evict-seed", str(2**63)], {},
     f"--kv-evict-seed: must be <= {2**63 - 1}, got {2**63}"),
    (POLICY + ["--kv-evict-seed", "-1"], {}, "--kv-evict-seed: must be >= 0, got -1"),
    (POLICY + ["--kv-evict-budget", str(2**40)], {},
     f"--kv-evict-budget: must be <= {2**24}, got {2**40}"),
    (POLICY + ["--kv-evict-max-budget", str(2**63)], {},
     f"--kv-evict-max-budget: must be <= {2**24}, got {2**63}"),
    (POLICY + ["--kv-evict-workspace-mb", str(2**40)], {},
     f"--kv-evict-workspace-mb: must be <= {2**24}, got {2**40}"),
    (POLICY + ["--kv-evict-mode", "elastic", "--kv-evict-ceiling", str(2**70)], {},
     f"--kv-evict-ceiling: must be <= {2**24}, got {2**70}"),
    (["--kv-evict-budget", "128"], {}, "--kv-evict-budget: set --kv-evict-policy too"),
    (["--kv-evict-max-budget", "128"], {}, "--kv-evict-max-budget: set --kv-evict-policy too"),
    (POLICY + ["--kv-evict-max-budget", "512"], {},
     "--kv-evict-max-budget: must be >= --kv-evict-budget (1024), got 512"),
    (POLICY + ["--kv-evict-min-window", "128"], {},
     "--kv-evict-min-window: must be <= --kv-evict-window (64), got 128"),
    (POLICY + ["--kv-evict-grid", "0"], {}, "--kv-evict-grid: must be >= 1, got 0"),
    (POLICY + ["--kv-evict-max-settings", "0"], {}, "--kv-evict-max-settings: must be >= 1, got 0"),
    (POLICY + ["--kv-evict-expected-prompt-len", "-5"], {},
     "--kv-evict-expected-prompt-len: must be >= 0, got -5"),
    (POLICY + ["--page-size", "16", "--kv-evict-window", "8"], {},
     "--kv-evict-window=8 does not fit --page-size=16: must be >= the page size (16)"),
    (POLICY + ["--enable-mixed-chunk"], {}, "--enable-mixed-chunk=True is not supported"),
    (["--kv-evict-policy", "snapkv", "--kv-evict-budget-scope", "global"], {},
     "--kv-evict-budget-scope: 'global' needs a policy whose scores compare across heads"),
    (POLICY + ["--kv-evict-budget-scope", "all"], {},
     "--kv-evict-budget-scope: must be one of head, layer, global, got 'all'"),
    # The allowlist (patches/supported.py): a few real launches; the many flags are checked
    # in-process below.
    (POLICY + ["--enable-streaming-session"], {},
     "--enable-streaming-session=True is not supported with --kv-evict-policy=vase-attnv: a "
     "streaming session hands the compacted row to the next turn without its position offset"),
    (POLICY + ["--dcp-size", "2"], {}, "--dcp-size=2 is not supported"),
    (POLICY + ["--num-continuous-decode-steps", "2"], {},
     "--num-continuous-decode-steps=2 is not supported with --kv-evict-policy=vase-attnv: not "
     "tested with eviction. Drop --num-continuous-decode-steps or turn eviction off."),
    ([], {"VASE_KV_EVICT_POLICY": "vase-attnv", "VASE_KV_EVICT_BUDGET": "lots"},
     "VASE_KV_EVICT_BUDGET: expected an integer"),
    (POLICY, {"VASE_KV_EVICT_PLUGINS": "no_such_policy_module"},
     "VASE_KV_EVICT_PLUGINS: cannot import 'no_such_policy_module'"),
]


# Real launches, one per way a launch is refused: a bad --kv-evict-* flag, a bad variable, a
# policy module that cannot be imported (in the spawned process), an SGLang flag off the allowlist.
REAL_LAUNCHES = [i for i, case in enumerate(LAUNCH_CASES) if case[2].startswith((
    "--kv-evict-budget: must be larger", "VASE_KV_EVICT_", "--enable-streaming-session"))]


@pytest.fixture(scope="module")
def failures(tiny_model):
    # Each refused launch costs SGLang's import time; run them two at a time.
    cases = [LAUNCH_CASES[i] for i in REAL_LAUNCHES]
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(REAL_LAUNCHES, pool.map(
            lambda c: run_launch_server_expect_failure(tiny_model, c[0], c[1]), cases)))


@pytest.mark.parametrize("index", REAL_LAUNCHES,
                         ids=[" ".join(LAUNCH_CASES[i][0]) or str(LAUNCH_CASES[i][1])
                              for i in REAL_LAUNCHES])
def test_bad_setting_stops_the_server_naming_the_flag(failures, index):
    code, output = failures[index]
    expected = LAUNCH_CASES[index][2]
    assert code != 0
    assert expected in output, output[-3000:]
    assert "fired up and ready" not in output


@pytest.fixture
def startup_error(tiny_model, monkeypatch, capsys):
    """What `python -m sglang.launch_server` checks before it loads the model, in its order and
    in this process: load_plugins() runs register(), which reads the environment
    (settings.ServerSettings.from_env); prepare_server_args parses the flags; run_server resolves the
    settings. ServerArgs carries the plugin's own hooks (server_args.HOOKS, wrapped by
    SGLang's HookRegistry wrapper) for the duration of the test. Returns the error message the
    launch would print, or None if it would go on to load the model."""
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn
    from sglang.srt.server_args import prepare_server_args

    for target, kind, hook in server_args_hooks.HOOKS:
        owner_name, name = target.rsplit(".", 1)
        owner = pkgutil.resolve_name(owner_name)
        raw = owner.__dict__[name]
        method = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
        assert not hasattr(method, "__wrapped__"), f"{target} is already hooked in this process"
        wrapped = _wrap_fn(method, hook, HookType[kind])
        monkeypatch.setattr(owner, name, type(raw)(wrapped) if method is not raw else wrapped)

    def check(flags, env) -> str | None:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("VASE_KV_EVICT_")}
        # patch.dict restores the environment whole, whatever the hooks exported into it.
        with mock.patch.dict(os.environ, {**clean, **env}, clear=True):
            try:
                settings.ServerSettings.from_env()  # what register() reads
            except ValueError as err:
                return str(err)
            try:
                args = prepare_server_args(["--model-path", tiny_model, *CPU_FLAGS, *flags])
            except SystemExit:
                return capsys.readouterr().err
            try:
                args.resolve_once()
            except ValueError as err:
                return str(err)
        return None

    return check


@pytest.mark.parametrize("flags,env,expected", LAUNCH_CASES,
                         ids=[" ".join(c[0]) or str(c[1]) for c in LAUNCH_CASES])
def test_bad_setting_is_refused_at_startup_naming_the_flag(startup_error, flags, env, expected):
    message = startup_error(flags, env)
    assert message is not None and expected in message, message


def test_a_shared_budget_scope_is_refused_where_it_is_not_built(startup_error, trimkv_gates_file):
    """Shared budget scopes are served at pages of one token on CPU
    (supported.shared_scope_refusal): other launches stop naming the flag and the reason."""
    trimkv = ["--kv-evict-policy", "trimkv", "--kv-evict-retention-gates", str(trimkv_gates_file),
              "--kv-evict-budget-scope", "global", "--kv-evict-window", "16"]
    assert startup_error(trimkv, {}) is None
    assert startup_error(trimkv + ["--page-size", "16"], {}) is None  # refused before
    # served without the radix cache and under data parallelism (test_server_shared_scope.py,
    # test_parallel.py); refused before
    assert startup_error(trimkv + ["--disable-radix-cache"], {}) is None
    assert startup_error(trimkv + ["--dp-size", "2"], {}) is None
    # fp8 K/V: on torch_native (test_server_fp8.py), not on the triton backend
    assert startup_error(trimkv + ["--kv-cache-dtype", "fp8_e4m3"], {}) is None
    message = startup_error(trimkv + ["--kv-cache-dtype", "fp8_e5m2", "--attention-backend",
                                      "triton"], {})
    assert message is not None and ("--kv-evict-budget-scope=global cannot be served here: "
                                    "--kv-cache-dtype fp8_e5m2: shared budget scopes keep fp8 "
                                    "K/V on the torch_native backend only") in message, message
    assert startup_error(trimkv + ["--kv-evict-mode", "elastic"], {}) is None  # refused before
    # the attention over cells is wired into the torch_native and triton decode backends only
    assert startup_error(trimkv + ["--attention-backend", "triton"], {}) is None
    for flags, backend in ((["--attention-backend", "flashinfer"], "flashinfer"),
                           (["--decode-attention-backend", "fa3"], "fa3")):
        message = startup_error(trimkv + flags, {})
        assert message is not None and (f"cannot be served here: the {backend} attention backend: "
                                        "shared budget scopes are served by the torch_native and "
                                        "triton backends only") in message, message


def test_a_scope_the_launch_cannot_serve_is_refused_per_request(resolved, monkeypatch):
    """A request for a shared scope on a launch that cannot serve it (fp8 K/V on the triton
    backend) is refused naming kv_evict.budget_scope and the launch's reason: the reason
    the scheduler's published arguments give (settings.published_shared_scope_refusal)."""
    from patches import request_control, settings
    from vase_sglang import EvictionConfig

    args = resolved(["--attention-backend", "triton", "--kv-cache-dtype", "fp8_e4m3"])
    reason = supported.shared_scope_refusal(args)
    assert reason is not None and "fp8_e4m3" in reason
    monkeypatch.setattr(request_control, "published_shared_scope_refusal", lambda: reason)
    server = EvictionConfig(policy="trimkv", budget=32, window=8)
    with pytest.raises(ValueError, match="kv_evict.budget_scope: 'global' cannot be served "
                                         "here: --kv-cache-dtype fp8_e4m3"):
        request_control.effective_config({"kv_evict": {"budget_scope": "global"}}, server,
                                         has_gates=True)
    # per head it is served
    assert request_control.effective_config({"kv_evict": {"budget": 24}}, server,
                                            has_gates=True).budget == 24
    assert settings.published_shared_scope_refusal() is None  # nothing published here


SHARING_MODULE = """
from vase_sglang import register_policy
from vase_sglang.policies import SnapKVPolicy, TrimKVPolicy


class {name}({base}):
    shares_budget = True
{body}

register_policy("{policy}", {name})
"""


def test_a_shares_budget_policy_must_score_as_the_shared_scope_step_does(startup_error, tmp_path,
                                                                          monkeypatch,
                                                                          trimkv_gates_file):
    """A user's module whose policy sets shares_budget but scores from K/V and queries (as
    snapkv does): it used to register, pass every check, and fail every request at its first
    shared-scope eviction (the step reads retention gates); now registering it stops the
    launch naming what the shared-scope step needs (Policy.shares_budget_refusal). A policy
    that scores from retention as trimkv does, with its own score_streamed, is accepted and
    may be asked for with a shared scope."""
    import importlib
    import sys

    from vase_sglang import EvictionConfig
    from vase_sglang.policies import POLICIES

    (tmp_path / "user_sharing_snapkv.py").write_text(SHARING_MODULE.format(
        name="SharingSnapKV", base="SnapKVPolicy", body="", policy="user-sharing-snapkv"))
    (tmp_path / "user_sharing_age.py").write_text(SHARING_MODULE.format(
        name="AgeOnly", base="TrimKVPolicy", policy="user-sharing-age", body=(
            "    def score_streamed(self, candidates, queries, draws):\n"
            "        return -self.retention.age.float().expand(candidates.shape)\n")))
    monkeypatch.syspath_prepend(str(tmp_path))
    message = startup_error([], {"VASE_KV_EVICT_POLICY": "snapkv",
                                 "VASE_KV_EVICT_PLUGINS": "user_sharing_snapkv"})
    assert message is not None and (
        "VASE_KV_EVICT_PLUGINS: module 'user_sharing_snapkv': policy: 'user-sharing-snapkv' sets "
        "shares_budget, but a shared budget scope needs needs_retention") in message, message
    assert "no needs_queries" in message and "user-sharing-snapkv" not in POLICIES
    try:
        gated = ["--kv-evict-policy", "user-sharing-age", "--kv-evict-retention-gates",
                 str(trimkv_gates_file), "--kv-evict-budget-scope", "global",
                 "--kv-evict-window", "16"]
        assert startup_error(gated, {"VASE_KV_EVICT_PLUGINS": "user_sharing_age"}) is None
        cfg = EvictionConfig(policy="user-sharing-age", budget=32, window=8,
                             budget_scope="global")
        assert cfg.shared_budget
    finally:
        POLICIES.pop("user-sharing-age", None)
        for module in ("user_sharing_snapkv", "user_sharing_age"):
            sys.modules.pop(module, None)
    importlib.invalidate_caches()


def test_good_settings_pass_the_startup_checks(startup_error):
    """The in-process checks above can pass: a good configuration goes through all of them."""
    assert startup_error(POLICY + ["--kv-evict-budget", "64", "--kv-evict-window", "8"], {}) is None
    assert startup_error([], {"VASE_KV_EVICT_POLICY": "snapkv", "VASE_KV_EVICT_BUDGET": "128"}) is None
    assert startup_error(["--page-size", "16"], {}) is None  # without eviction: stock SGLang


# Server: snapkv, budget 32, window 8. (kv_evict value, message in the HTTP 400 body)
REQUEST_CASES = [
    ({"budget": 8}, "kv_evict.budget: must be larger than window (8) since the budget includes "
                    "the window, got 8"),
    ({"policy": "nope"}, "kv_evict.policy: unknown policy 'nope'; choose one of full, vase-attnv"),
    ({"window": 16}, "kv_evict.window: must be <= the server's --kv-evict-window (8) for policy "
                     "'snapkv'"),
    ({"budgte": 64}, "kv_evict.budgte: unknown setting; use policy, budget, window, value_slots, "
                     "sinks, seed, mode"),
    ({"mode": "lazy"}, "kv_evict.mode: must be one of fixed, elastic, got 'lazy'"),
    ({"budget": "64"}, "kv_evict.budget: must be an integer, got '64'"),
    ({"value_slots": 4}, "kv_evict.value_slots: only the vase-attnv policy reserves value slots"),
    ({"policy": "vase-attnv", "value_slots": 30},
     "kv_evict.value_slots: value_slots (30) + sinks (4) must fit in budget - window (24)"),
    ({"sinks": -1}, "kv_evict.sinks: must be >= 0, got -1"),
    ({"seed": 2**63}, f"kv_evict.seed: must be <= {2**63 - 1}, got {2**63}"),
    ({"seed": -1}, "kv_evict.seed: must be >= 0, got -1"),
    ({"seed": 1.5}, "kv_evict.seed: must be an integer, got 1.5"),
    ({"budget": 2**40}, f"kv_evict.budget: must be <= {2**24}, got {2**40}"),
    # The server's limits (defaults: budget <= 8 of its own, window >= a quarter of its own, a
    # grid of that quarter, sinks <= its own): one request cannot hold an unbounded cache,
    # evict on every step, or split steps into many settings groups.
    ({"budget": 512}, "kv_evict.budget: must be <= 256, this server's limit "
                      "(--kv-evict-max-budget); got 512"),
    ({"window": 1}, "kv_evict.window: must be >= 2, this server's limit "
                    "(--kv-evict-min-window); got 1"),
    ({"budget": 25}, "kv_evict.budget: must be a multiple of 2 (--kv-evict-grid) or the "
                     "server's value 32; got 25"),
    ({"sinks": 6}, "kv_evict.sinks: must be <= 4 (the server's sinks or --kv-evict-grid, the "
                   "larger); got 6"),
    ({"policy": "vase-attnv", "value_slots": 5}, "kv_evict.value_slots: must be a multiple of 2 "
                                                 "(--kv-evict-grid); got 5"),
    ("off", "kv_evict: expected false, true or an object with keys policy, budget, window, "
            "value_slots, sinks, seed, mode, budget_scope, head_floor; got 'off'"),
    ({"head_floor": -1}, "kv_evict.head_floor: must be >= 0, got -1"),
    ({"head_floor": "4"}, "kv_evict.head_floor: must be an integer, got '4'"),
    ({"head_floor": 2**30}, f"kv_evict.head_floor: must be <= {2**24}, got {2**30}"),
]
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(snapkv_server):
    """The shared snapkv server (conftest.py): the messages above name its budget 32, window 8."""
    assert (SNAPKV["policy"], SNAPKV["budget"], SNAPKV["window"]) == ("snapkv", 32, 8)
    return snapkv_server


def _generate(server, kv_evict):
    return server.post_status("/generate", {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 60, "temperature": 0, "ignore_eos": True,
        "custom_params": {"kv_evict": kv_evict}}})


def test_bad_request_values_are_answered_with_400_and_the_server_keeps_serving(server):
    code, good = _generate(server, {"budget": 16})
    assert code == 200 and good["meta_info"]["kv_evicted_tokens"] > 0
    for value, message in REQUEST_CASES:
        code, body = _generate(server, value)
        assert code == 400, (value, body)
        assert body["error"]["message"].startswith(message), (value, body)
    # The OpenAI route gives the same message.
    code, body = server.post_status("/v1/completions", {
        "model": "default", "prompt": PROMPT, "max_tokens": 4,
        "custom_params": {"kv_evict": REQUEST_CASES[0][0]}})
    assert code == 400 and REQUEST_CASES[0][1] in json.dumps(body), body
    # A token id outside the vocabulary would crash SGLang's scheduler; it is a 400 instead.
    code, body = server.post_status("/generate", {"input_ids": [1, 2, 10**6],
                                             "sampling_params": {"max_new_tokens": 4}})
    assert code == 400 and body["error"]["message"].startswith(
        "input_ids: token id 1000000 is outside the vocabulary [0, "), body
    # Still serving, with the same output as before the bad requests.
    code, again = _generate(server, {"budget": 16})
    assert code == 200 and again["output_ids"] == good["output_ids"]
    server.wait_idle_checked(1)


def test_messages_that_need_another_server(tiny_model):
    """Cases whose server differs from the one above, checked on the function SamplingParams
    .verify calls (a stock server's 400 is tested end to end in test_request_control.py)."""
    streaming = EvictionConfig(policy="streaming", budget=32, window=8)
    with pytest.raises(ValueError, match=r"^kv_evict.policy: 'snapkv' scores with attention "
                                         r"queries, which this server does not record"):
        effective_config({"kv_evict": {"policy": "snapkv"}}, streaming)
    # Without query scoring the request's window may exceed the server's (within the limits).
    assert effective_config({"kv_evict": {"window": 16, "budget": 64}}, streaming).window == 16
    with pytest.raises(ValueError, match=r"^kv_evict: this server was started without "
                                         r"--kv-evict-policy"):
        effective_config({"kv_evict": {"budget": 64}}, None)
    assert effective_config({"kv_evict": False}, None) is None


# ---- The supported-settings allowlist, in-process: ServerArgs parsed from the command line
# and resolved by SGLang exactly as launch_server does (prepare_server_args + resolve_once),
# then checked by the function the startup hook calls.

SUPPORTED_FLAGS = [  # each must pass: what the tests, benchmarks and README use
    [], ["--dtype", "float32", "--decode-log-interval", "1"], ["--disable-radix-cache"],
    ["--disable-overlap-schedule", "--enable-custom-logit-processor"], ["--enable-metrics"],
    ["--max-running-requests", "48", "--max-total-tokens", "3072"], ["--schedule-policy", "lpm"],
    ["--random-seed", "3", "--log-level", "debug"], ["--chunked-prefill-size", "64"],
    ["--dp-size", "2"], ["--tp-size", "2"], ["--kv-cache-dtype", "bfloat16"],
    ["--kv-cache-dtype", "fp8_e4m3"], ["--kv-cache-dtype", "fp8_e5m2"],
    ["--retraction-policy", "priority"],
    ["--cuda-graph-backend-decode", "disabled"], ["--attention-backend", "triton"],
    ["--page-size", "16"], ["--page-size", "64"],
]
REFUSED_FLAGS = [  # (flags, the fields named); the first group is refused with a reason
    (["--enable-streaming-session"], ["enable_streaming_session"]),
    (["--dcp-size", "2"], ["dcp_size"]),
    (["--pp-size", "2"], ["pp_size"]),
    (["--enable-mixed-chunk"], ["enable_mixed_chunk"]),
    (["--speculative-algorithm", "NGRAM"], ["speculative_algorithm"]),
    (["--disaggregation-mode", "decode"], ["disaggregation_mode"]),
    (["--enable-hierarchical-cache"], ["enable_hierarchical_cache"]),
    (["--attention-backend", "flashmla"], ["attention_backend"]),
    # ...and flags never tested with eviction: any value but SGLang's default
    (["--enable-torch-compile"], ["enable_torch_compile"]),
    (["--num-continuous-decode-steps", "4"], ["num_continuous_decode_steps"]),
    (["--kv-canary", "log"], ["kv_canary"]),
    (["--enable-priority-scheduling"], ["enable_priority_scheduling"]),
    (["--cpu-offload-gb", "1"], ["cpu_offload_gb"]),
    (["--json-model-override-args", '{"rope_theta": 1}'], ["json_model_override_args"]),
    (["--strip-thinking-cache"], ["strip_thinking_cache"]),
    (["--kv-events-config", '{"publisher": "null"}'], ["kv_events_config"]),
    (["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all"],
     ["enable_lora", "max_lora_rank", "lora_target_modules"]),
]


@pytest.fixture(scope="module")
def resolved(tiny_model):
    from sglang.srt.server_args import prepare_server_args

    def resolve(flags, model=tiny_model, cpu=True):
        args = prepare_server_args(["--model-path", model, *(CPU_FLAGS if cpu else []), *flags])
        args.resolve_once()
        return args

    return resolve


@pytest.mark.parametrize("flags", SUPPORTED_FLAGS, ids=lambda f: " ".join(f) or "cpu-defaults")
def test_supported_settings_pass(resolved, flags):
    assert supported.unsupported(resolved(flags)) == []


def test_a_default_cuda_launch_passes(resolved):
    """`--device cuda` and nothing else: SGLang resolves its own CUDA defaults (on this GPU-less
    host the attention backend resolves to triton; fa3 on Hopper, also in the list), decode
    CUDA graphs on, page size 1."""
    from sglang.srt.arg_groups.overrides import resolution_result

    args = resolved(["--device", "cuda"], cpu=False)
    assert resolution_result(args, "cuda_graph_config").decode.backend == "full"
    assert resolution_result(args, "attention_backend") in supported.ATTENTION_BACKENDS
    assert supported.unsupported(args) == []


@pytest.mark.parametrize("flags,fields", REFUSED_FLAGS, ids=lambda x: " ".join(x))
def test_unsupported_settings_are_refused_naming_the_flag(resolved, flags, fields):
    args = resolved(flags)
    assert [name for name, _value, _why in supported.unsupported(args)] == fields
    cfg = EvictionConfig(policy="snapkv", budget=32, window=8)
    with pytest.raises(ValueError) as err:
        server_args_hooks.check_server_args(args, cfg)
    for name in fields:
        assert f"{supported.flag(name)}=" in str(err.value)
    assert f"{flags[0]}=" in str(err.value) and "Drop " + flags[0] in str(err.value)


def test_kv_cache_dtypes_with_scale_buffers_are_outside_the_allowlist(resolved):
    """Allowed: 16/32-bit floats and fp8_e4m3 / fp8_e5m2 (tests/test_server_fp8.py); refused:
    the dtypes whose pools carry scale buffers. SGLang itself refuses those on CPU before the
    allowlist sees them (they need a GPU), so this checks the rule; on a GPU check_server_args
    names the flag as for any other value outside it."""
    assert supported.unsupported(resolved(["--kv-cache-dtype", "fp8_e4m3"])) == []
    rule = supported.ALLOWED["kv_cache_dtype"]
    assert {"fp8_e4m3", "fp8_e5m2", "auto", "bf16"} <= set(rule.values)
    assert not {"mxfp8", "nvfp4", "fp4_mx_block16"} & set(rule.values)


@pytest.mark.parametrize("page,window,ok", [(16, 16, True), (16, 8, False), (64, 48, False),
                                            (64, 64, True)])
def test_a_window_below_one_page_is_refused_naming_both_flags(resolved, page, window, ok):
    """Each eviction drops `window` tokens and the allocator takes back whole pages: a window
    below one page would mostly free nothing."""
    args = resolved(["--page-size", str(page)])
    cfg = EvictionConfig(policy="snapkv", budget=128, window=window)
    if ok:
        server_args_hooks.check_server_args(args, cfg)
        assert effective_config({"kv_evict": {"window": window}}, cfg, page) == cfg
        return
    with pytest.raises(ValueError, match=f"--kv-evict-window={window} does not fit "
                                         f"--page-size={page}: must be >= the page size"):
        server_args_hooks.check_server_args(args, cfg)
    # Per request (HTTP 400 in the tokenizer manager), against the server's page size.
    ok_cfg = cfg.replace(window=page)
    with pytest.raises(ValueError, match=r"kv_evict\.window: must be >= the page size"):
        effective_config({"kv_evict": {"window": window}}, ok_cfg, page)


def test_the_page_size_sglang_resolves_is_the_one_checked(resolved, monkeypatch):
    """SGLang keeps what its resolution decides apart from the raw flag: on sm_100 the default
    trtllm_mha backend turns page size 1 into 64 (arg_groups.overrides). That backend cannot
    resolve here, so its declaration stands in for it. A window of 16 must be refused at
    startup, and per-request checks (the tokenizer manager reads the page size its process
    published) must use 64 too: the raw flag would let both through and the scheduler would
    reject the settings."""
    from sglang.srt.arg_groups.overrides import declare_resolution

    args = resolved([])
    declare_resolution(args, "trtllm_mha on sm_100 (stand-in)", page_size=64)
    assert args.page_size in (None, 1)  # the raw flag
    cfg = EvictionConfig(policy="snapkv", budget=128, window=16)
    with pytest.raises(ValueError, match=r"--kv-evict-window=16 does not fit --page-size=64 "
                                         r"\(SGLang resolved the page size to 64 for this launch"):
        server_args_hooks.check_server_args(args, cfg)
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.sampling.sampling_params import SamplingParams

    from vase_sglang_patches.request_control import after_verify

    for name, value in [("POLICY", "snapkv"), ("BUDGET", "128"), ("WINDOW", "64"),
                        ("MIN_WINDOW", "16")]:
        monkeypatch.setenv(f"VASE_KV_EVICT_{name}", value)
    server_args_hooks.after_resolve_once(None, args)  # window 64 fits the resolved pages
    params = SamplingParams(max_new_tokens=8, custom_params={"kv_evict": {"window": 32}})
    with use_context(create_context(args, role="tokenizer")):  # what the launch publishes
        assert settings.published_page_size() == 64
        with pytest.raises(ValueError, match=r"kv_evict\.window: must be >= the page size \(64\)"):
            after_verify(None, params)


@pytest.fixture(scope="module")
def tiny_qwen2_vl(tiny_model, tmp_path_factory):
    """A Qwen2-VL config (mrope_section in its rope scaling) with the tiny model's tokenizer;
    SGLang resolves it like the real Qwen2-VL without weights."""
    import shutil
    from pathlib import Path

    from transformers import Qwen2VLConfig

    path = tmp_path_factory.mktemp("models") / "tiny-qwen2-vl"
    Qwen2VLConfig(
        architectures=["Qwen2VLForConditionalGeneration"], hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2},
    ).save_pretrained(path)
    for f in Path(tiny_model).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, path)
    return str(path)


def test_mrope_models_are_refused_naming_the_model(resolved, tiny_qwen2_vl, tiny_model):
    cfg = EvictionConfig(policy="snapkv", budget=32, window=8)
    with pytest.raises(ValueError, match=r"--model-path: Qwen2VLForConditionalGeneration rotates "
                                         r"queries and keys with mrope_positions"):
        server_args_hooks.check_server_args(resolved([], model=tiny_qwen2_vl), cfg)
    server_args_hooks.check_server_args(resolved([], model=tiny_model), cfg)  # plain RoPE


def test_the_table_is_one_allowlist_over_every_field():
    """Every name in the table is a real ServerArgs field (a renamed field in a new SGLang
    would otherwise silently fall to 'default only' or leave a stale entry)."""
    fields = set(supported._field_defaults())
    assert not (supported.NEUTRAL | set(supported.ALLOWED)) - fields
    assert not supported.NEUTRAL & set(supported.ALLOWED)


def test_docs_supported_md_matches_the_table():
    from pathlib import Path

    doc = Path(__file__).resolve().parent.parent / "docs" / "supported.md"
    assert doc.read_text() == supported.table_markdown(), (
        "docs/supported.md is stale: python -m vase_sglang_patches.supported > docs/supported.md")


def test_distinct_settings_in_recent_use_are_bounded():
    """At most max_settings distinct settings besides the server's own in recent use (the seed
    is free): one more is refused naming the flag, until one of them has been idle."""
    from vase_sglang_patches.request_control import RecentSettings, check_distinct
    from vase_sglang_patches.settings import RequestLimits

    now = [0.0]
    recent = RecentSettings(idle_seconds=60, clock=lambda: now[0])
    server = EvictionConfig(policy="snapkv", budget=32, window=8)
    limits = RequestLimits(max_budget=256, min_window=2, grid=2, max_settings=2)
    a, b, c = (server.replace(budget=budget) for budget in (40, 48, 56))
    for cfg in (a, b, a.replace(seed=7), server.replace(seed=3), server, None):
        check_distinct(cfg, server, limits, recent)
    with pytest.raises(ValueError, match=r"^kv_evict: this server serves at most 2 distinct "
                                         r"eviction settings besides its own at a time "
                                         r"\(--kv-evict-max-settings\)"):
        check_distinct(c, server, limits, recent)
    now[0] = 30.0
    check_distinct(b, server, limits, recent)  # b stays in use; a goes idle
    now[0] = 61.0
    check_distinct(c, server, limits, recent)  # in place of a, idle for 61 s
    with pytest.raises(ValueError, match="at most 2 distinct"):
        check_distinct(a, server, limits, recent)


def test_settings_of_queued_or_running_requests_keep_their_place():
    """A setting's place is held while a request that uses it is queued or running in the
    tokenizer manager (its rid_to_state), not only for 60 s after it was last asked for:
    otherwise a client sending a new setting every 61 s while the earlier ones still decode
    would grow every step's groups without bound. Read from the manager's own request states
    (SGLang's GenerateReqInput, as it keeps them)."""
    from types import SimpleNamespace

    from sglang.srt.managers.io_struct import GenerateReqInput

    from vase_sglang_patches.request_control import (RecentSettings, check_distinct,
                                                     live_settings)
    from vase_sglang_patches.settings import RequestLimits, ServerSettings

    now = [0.0]
    recent = RecentSettings(idle_seconds=60, clock=lambda: now[0])
    server = EvictionConfig(policy="snapkv", budget=32, window=8)
    limits = RequestLimits(max_budget=256, min_window=2, grid=2, max_settings=1)
    serving = ServerSettings(config=server, limits=limits)
    manager = SimpleNamespace(rid_to_state={})

    def arrive(rid, budget, seed=0):
        manager.rid_to_state[rid] = SimpleNamespace(obj=GenerateReqInput(
            text="hello", sampling_params={"custom_params": {"kv_evict": {
                "budget": budget, "seed": seed}}}))
        check_distinct(server.replace(budget=budget, seed=seed), server, limits, recent,
                       in_use=lambda: live_settings(manager, serving, limits))

    arrive("long-40", 40)
    arrive("plain", 32)  # the server's own: free
    now[0] = 61.0  # the 40 was asked for 61 s ago, and its request still decodes
    with pytest.raises(ValueError, match=r"at most 1 distinct eviction settings .* each is used "
                                         r"by a queued or running request"):
        arrive("new-48", 48)
    del manager.rid_to_state["new-48"]  # refused: SGLang drops its state
    arrive("long-40-again", 40, seed=9)  # the same setting, another seed: admitted
    del manager.rid_to_state["long-40"], manager.rid_to_state["long-40-again"]
    with pytest.raises(ValueError, match="at most 1 distinct"):
        arrive("new-48", 48)  # finished, but asked for within 60 s (at 61 s)
    del manager.rid_to_state["new-48"]
    now[0] = 122.0
    arrive("new-48", 48)  # finished and idle: its place is free
    assert live_settings(manager, serving, limits) == {server.replace(budget=48),
                                                       server.replace(budget=32)}
