"""Bad eviction settings stop `python -m sglang.launch_server` at startup with a message naming
the flag (or environment variable) at fault."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from servers import run_launch_server_expect_failure

POLICY = ["--kv-evict-policy", "vase-attnv"]
CASES = [
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
]


@pytest.fixture(scope="module")
def failures(tiny_model):
    # Each refused launch costs SGLang's import time; run them two at a time.
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda c: run_launch_server_expect_failure(tiny_model, c[0], c[1]), CASES))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[" ".join(c[0]) or str(c[1]) for c in CASES])
def test_bad_setting_stops_the_server_naming_the_flag(failures, index):
    code, output = failures[index]
    expected = CASES[index][2]
    assert code != 0
    assert expected in output, output[-3000:]
    assert "fired up and ready" not in output
