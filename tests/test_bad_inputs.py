"""The bad-input matrix (docs/reliability.md): each bad setting is refused with the message the
user sees.

- Bad server configurations stop `python -m sglang.launch_server` at startup with a message
  naming the flag (or environment variable) at fault.
- Bad per-request values (`custom_params.kv_evict`) are answered with HTTP 400 naming
  `kv_evict.<field>`, and the server keeps serving.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from servers import Server, run_launch_server_expect_failure
from vase_sglang import EvictionConfig
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
    (["--kv-evict-budget", "128"], {}, "--kv-evict-budget: set --kv-evict-policy too"),
    (POLICY + ["--page-size", "16"], {}, "--page-size=16 is not supported"),
    (POLICY + ["--enable-mixed-chunk"], {}, "--enable-mixed-chunk=True is not supported"),
    (POLICY + ["--kv-cache-dtype", "fp8_e4m3"], {}, "--kv-cache-dtype=fp8_e4m3 is not supported"),
    ([], {"VASE_KV_EVICT_POLICY": "vase-attnv", "VASE_KV_EVICT_BUDGET": "lots"},
     "VASE_KV_EVICT_BUDGET: expected an integer"),
    (POLICY, {"VASE_KV_EVICT_PLUGINS": "no_such_policy_module"},
     "VASE_KV_EVICT_PLUGINS: cannot import 'no_such_policy_module'"),
]


@pytest.fixture(scope="module")
def failures(tiny_model):
    # Each refused launch costs SGLang's import time; run them two at a time.
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(
            lambda c: run_launch_server_expect_failure(tiny_model, c[0], c[1]), LAUNCH_CASES))


@pytest.mark.parametrize("index", range(len(LAUNCH_CASES)),
                         ids=[" ".join(c[0]) or str(c[1]) for c in LAUNCH_CASES])
def test_bad_setting_stops_the_server_naming_the_flag(failures, index):
    code, output = failures[index]
    expected = LAUNCH_CASES[index][2]
    assert code != 0
    assert expected in output, output[-3000:]
    assert "fired up and ready" not in output


# Server: snapkv, budget 32, window 8. (kv_evict value, message in the HTTP 400 body)
REQUEST_CASES = [
    ({"budget": 8}, "kv_evict.budget: must be larger than window (8) since the budget includes "
                    "the window, got 8"),
    ({"policy": "nope"}, "kv_evict.policy: unknown policy 'nope'; choose one of full, vase-attnv"),
    ({"window": 16}, "kv_evict.window: must be <= the server's --kv-evict-window (8) for policy "
                     "'snapkv'"),
    ({"budgte": 64}, "kv_evict.budgte: unknown setting; use policy, budget, window, value_slots, "
                     "sinks, seed"),
    ({"budget": "64"}, "kv_evict.budget: must be an integer, got '64'"),
    ({"value_slots": 4}, "kv_evict.value_slots: only the vase-attnv policy reserves value slots"),
    ({"policy": "vase-attnv", "value_slots": 30},
     "kv_evict.value_slots: value_slots (30) + sinks (4) must fit in budget - window (24)"),
    ({"sinks": -1}, "kv_evict.sinks: must be >= 0, got -1"),
    ("off", "kv_evict: expected false, true or an object with keys policy, budget, window, "
            "value_slots, sinks, seed; got 'off'"),
]
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(tiny_model):
    args = ["--kv-evict-policy", "snapkv", "--kv-evict-budget", "32", "--kv-evict-window", "8"]
    with Server(tiny_model, args, timeout=600) as s:
        yield s


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
    # Without query scoring the request's window is free.
    assert effective_config({"kv_evict": {"window": 16, "budget": 64}}, streaming).window == 16
    with pytest.raises(ValueError, match=r"^kv_evict: this server was started without "
                                         r"--kv-evict-policy"):
        effective_config({"kv_evict": {"budget": 64}}, None)
    assert effective_config({"kv_evict": False}, None) is None
