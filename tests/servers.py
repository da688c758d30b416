"""Start and stop real SGLang servers (python -m sglang.launch_server) for end-to-end tests:
vase_sglang.serving.launcher with the tests' settings (CPU, SGLang's strict memory checks, the
output in a temporary file per server)."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

from vase_sglang.serving import launcher
from vase_sglang.serving.launcher import STRICT_ENV  # noqa: F401  (tests/test_stress.py names it)
from vase_sglang.serving.ports import free_port

CPU_FLAGS = [*launcher.CPU_FLAGS, "--sleep-on-idle", "--host", "127.0.0.1"]

# The settings of the evicting server that test modules share (conftest.py: snapkv_server);
# per-request settings (custom_params.kv_evict) give the other policies and budgets: snapkv
# records the window queries, so every policy can be asked for.
SNAPKV = {"policy": "snapkv", "budget": 32, "window": 8, "seed": 5}
# ...and of the shared server with the radix cache off (test_admission's settings).
RADIX_OFF_POOL, RADIX_OFF = 1024, {"policy": "vase-attnv", "budget": 64, "window": 16}
# ...and of the shared vase-attnv server (differs from SNAPKV in every field).
VASE_ATTNV = {"policy": "vase-attnv", "budget": 24, "window": 4, "sinks": 2, "seed": 9}
# ...and of the shared paged server (tests/test_paged.py, tests/test_server_trimkv.py): pages of
# 16, budget and window page multiples, trimkv's gates loaded (trimkv_gates, seed 7).
PAGE = 16
PAGED = {"policy": "snapkv", "budget": 48, "window": 16, "seed": 5}


def snapkv_flags(gates_file) -> list[str]:
    """The flags of the shared snapkv server (conftest.py), but its device: fp32, a decode log
    line every step, Prometheus metrics, query rings in the pool (as on a server started
    without --max-total-tokens), trimkv's gates, SNAPKV."""
    flags = ["--dtype", "float32", "--decode-log-interval", "1", "--enable-metrics",
             "--kv-evict-ring", "pool", "--kv-evict-retention-gates", str(gates_file)]
    for key, value in SNAPKV.items():
        flags += ["--kv-evict-" + key, str(value)]
    return flags


def trimkv_gates(config, seed=7):
    """Deterministic retention gates whose β spread widely (gate weights 0.5, bias 2), so
    retention, not age alone, decides what trimkv keeps."""
    from vase_sglang import gates

    return gates.RetentionGates.for_model(config, gate_hidden=8, bias_init=2.0, init_std=0.5,
                                          seed=seed)


def masked_logprobs(model_path, prompt_ids, forced, rows, gates=None, **run_kwargs):
    """The transformers reference's masked trimkv rows (benchmarks/global_budget.MaskedBudgetRun:
    heads may keep unequal counts) teacher-forced on `forced`: per row, the logprob of each
    forced token. rows: a scope ("global", "layer", "per-head") or a dict of Row fields
    (scope, floor, ranks) each. A fresh fp32 copy of the model (the run installs its own
    attention); gates: trimkv_gates (the shared servers') unless given; run_kwargs:
    MaskedBudgetRun's (budget, window, ...)."""
    import sys
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.global_budget import MaskedBudgetRun, Row

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    run = MaskedBudgetRun(model, trimkv_gates(model.config) if gates is None else gates,
                          **run_kwargs)
    rows = [Row("trimkv", r) if isinstance(r, str) else Row("trimkv", **r) for r in rows]
    logprobs, _counts = run.run(prompt_ids, forced, rows)
    return [[float(logprobs[b, t, tok]) for t, tok in enumerate(forced)] for b in range(len(rows))]


def serve_request(server, prompt_ids, n, seed=77, kv_evict=None):
    """One request of n tokens past EOS, seeded: (output ids, their logprobs, meta_info)."""
    sampling = {"ignore_eos": True, "sampling_seed": seed}
    if kv_evict is not None:
        sampling["custom_params"] = {"kv_evict": kv_evict}
    out = server.generate(input_ids=prompt_ids, max_new_tokens=n, return_logprob=True,
                          sampling_params=sampling)
    return (out["output_ids"], [x[0] for x in out["meta_info"]["output_token_logprobs"]],
            out["meta_info"])


def stream_and_abort(server, payload, after, timeout=120) -> int:
    """POST `payload` (a /generate body with "stream": true and its "rid") and read the stream
    until more than `after` tokens came back, then ask /abort_request for that rid. Returns the
    last completion_tokens seen."""
    req = urllib.request.Request(server.url + "/generate", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    seen = 0
    with urllib.request.urlopen(req, timeout=timeout) as stream:
        for line in stream:
            if line.startswith(b"data:") and b"[DONE]" not in line:
                seen = json.loads(line[5:])["meta_info"]["completion_tokens"]
                if seen > after:
                    server.post("/abort_request", {"rid": payload["rid"]})
                    break
    return seen


def reference(model, policy, prompt_ids, forced, *, budget, window, seed=5, request_key=77,
              **decoder_kwargs):
    """The transformers reference teacher-forced on `forced` with the servers' draws (config
    seed, request key): ReferenceDecoder(...).run(...); decoder_kwargs as ReferenceDecoder's
    (page_size, kv_dtype, protect_prompt, ...)."""
    from vase_sglang import EvictionConfig
    from vase_sglang.serving.hf_reference import ReferenceDecoder

    cfg = EvictionConfig(policy=policy, budget=budget, window=window, seed=seed)
    return ReferenceDecoder(model, cfg, **decoder_kwargs).run(
        prompt_ids, forced_ids=forced, request_key=request_key)


def max_logprob_diff(a, b, tol=None):
    """The largest |a - b| of two equally long logprob lists, printed (with the first token
    above tol, if given) so a failing comparison shows where it diverged."""
    assert len(a) == len(b), (len(a), len(b))
    diffs = [abs(x - y) for x, y in zip(a, b)]
    worst = max(diffs)
    where = ""
    if tol is not None:
        first = next((i for i, d in enumerate(diffs) if d > tol), None)
        where = f", first above {tol} at token {first}"
    print(f"max logprob diff {worst:.3g}{where}")
    return worst


# The shared servers serve dozens of test modules' per-request settings within a minute; the
# bound on distinct settings (default 16, tests/test_fail_safe.py) is raised for them.
TEST_MAX_SETTINGS = ["--kv-evict-max-settings", "1024"]


def _test_args(args) -> list[str]:
    args = list(args)
    if "--kv-evict-policy" in args and TEST_MAX_SETTINGS[0] not in args:
        args += TEST_MAX_SETTINGS
    return args


def launch_command(model: str, port: int, max_total_tokens: int, args) -> list[str]:
    # CPU_FLAGS is read at each call: benchmarks/overlap.py replaces it on a GPU
    return launcher.launch_command(model, port, args=_test_args(args), host=None,
                                   max_total_tokens=max_total_tokens, device_flags=CPU_FLAGS)


def server_env(extra: dict | None = None) -> dict:
    return launcher.server_env(extra, strict=True, threads=1)


class Server(launcher.Launcher):
    """A server with the tests' settings; stop() kills its process group at once (nothing is
    checked at shutdown: the leak check runs when the scheduler goes idle, see
    wait_idle_checked; a SIGTERM took ~5 s per server only to leave the scheduler processes
    behind for the SIGKILL anyway)."""

    stop_grace = 0.0
    post_timeout = 300

    def __init__(self, model: str, args=(), env: dict | None = None, max_total_tokens: int = 4096,
                 timeout: float = 600.0):
        super().__init__(model, _test_args(args), env=env, strict=True, threads=1, host=None,
                         max_total_tokens=max_total_tokens, device_flags=CPU_FLAGS,
                         timeout=timeout)

    def wait_idle_checked(self, seconds: float = 1.0) -> None:
        """Let the scheduler go idle (where SGLang runs its strict leak check) and make sure it
        survived: a leak raises inside the scheduler and takes the server down. The check runs
        in the first loop iteration without work and again at every wake-up of the idle
        sleeper (a 1 s poll, --sleep-on-idle), so one second covers it."""
        time.sleep(seconds)
        assert self.alive(), self.output()[-4000:]
        self.generate("ping", max_new_tokens=2)
        assert "memory leak" not in self.output(), self.output()[-4000:]

    def used_tokens(self, settle: float = 10.0) -> int:
        """Pool slots held by requests (SGLang's `num_used_tokens`, summed over workers) once
        the server is idle. Polled until it reads 0 or `settle` seconds pass: with overlap
        scheduling the last batch's result (and the finished request's delayed slot) is
        processed an iteration after its response goes out, so a reading taken right after a
        response can still see that request's page. A leak stays above 0 and is returned."""
        deadline = time.monotonic() + settle
        while True:
            used = sum(int(x["num_used_tokens"]) for x in self.get("/v1/loads")["loads"])
            if used == 0 or time.monotonic() > deadline:
                return used
            time.sleep(0.2)


def run_launch_server_expect_failure(model: str, args, env=None, timeout: float = 120) -> tuple[int, str]:
    """Launch a server that must refuse to start; returns (exit code, combined output)."""
    cmd = launch_command(model, free_port(), 4096, args)
    try:
        proc = subprocess.run(cmd, env=server_env(env), capture_output=True, text=True,
                              timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"server did not exit: {err.stdout}\n{err.stderr}") from None
    return proc.returncode, proc.stdout + proc.stderr
