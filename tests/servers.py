"""Start and stop real SGLang servers (python -m sglang.launch_server) for end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from vase_sglang.serving.ports import BIND_FAILURE, free_port

CPU_FLAGS = [
    "--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
    "--sleep-on-idle", "--host", "127.0.0.1",
]
STRICT_ENV = {
    # SGLang's own memory checks: conservation every busy step, page ownership
    # (use-after-free, double free), and the idle leak check (strict by default).
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
    "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1",
}

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


def trimkv_gates(config, seed=7):
    """Deterministic retention gates whose β spread widely (gate weights 0.5, bias 2), so
    retention, not age alone, decides what trimkv keeps."""
    from vase_sglang import gates

    return gates.RetentionGates.for_model(config, gate_hidden=8, bias_init=2.0, init_std=0.5,
                                          seed=seed)


# The tests' prompts are about 10 tokens: their evicting servers size the query ring for 8 (the
# default assumes 256-token prompts and would cap the small test pools at a few running
# requests, below what admission admits there).
TEST_PROMPT_LEN = ["--kv-evict-expected-prompt-len", "8"]


def launch_command(model: str, port: int, max_total_tokens: int, args) -> list[str]:
    args = list(args)
    if "--kv-evict-policy" in args and TEST_PROMPT_LEN[0] not in args:
        args += TEST_PROMPT_LEN
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model, *CPU_FLAGS,
            "--port", str(port), "--max-total-tokens", str(max_total_tokens), *args]


def server_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("VASE_KV_EVICT_") and k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.update(STRICT_ENV)
    env.update(extra or {})
    return env


class Server:
    def __init__(self, model: str, args=(), env: dict | None = None, max_total_tokens: int = 4096,
                 timeout: float = 600.0):
        for attempt in range(3):  # a new port if the HTTP port was taken meanwhile
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.log = tempfile.NamedTemporaryFile("w+", prefix="sglang-", suffix=".log",
                                                   delete=False)
            cmd = launch_command(model, self.port, max_total_tokens, args)
            self.proc = subprocess.Popen(cmd, env=server_env(env), stdout=self.log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
            if self._wait_ready(timeout):
                return
        raise RuntimeError(f"server could not bind a port in 3 attempts:\n{self.output()[-4000:]}")

    def _wait_ready(self, timeout: float) -> bool:
        """True once ready; False if the HTTP port was taken (the server is stopped)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            out = self.output()
            if BIND_FAILURE in out:
                self.stop()
                return False
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{out[-4000:]}")
            # Ready once SGLang's own warmup request is done, so that it never shares a batch
            # with (and perturbs the numerics of) the first test request.
            if "The server is fired up and ready to roll" in out:
                return True
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.output()[-4000:]}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def get(self, path: str, timeout: float = 30):
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def post(self, path: str, payload: dict, timeout: float = 300):
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
        return json.loads(body) if body.strip() else None

    def post_status(self, path: str, payload: dict, timeout: float = 120) -> tuple[int, dict]:
        """POST that also returns error answers: (HTTP status, JSON body)."""
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")

    def generate(self, text=None, *, input_ids=None, max_new_tokens=64, **kwargs) -> dict:
        sampling = {"max_new_tokens": max_new_tokens, "temperature": 0}
        sampling.update(kwargs.pop("sampling_params", {}))
        payload = {"sampling_params": sampling, **kwargs}
        if input_ids is not None:
            payload["input_ids"] = input_ids
        else:
            payload["text"] = text
        return self.post("/generate", payload)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_idle_checked(self, seconds: float = 1.0) -> None:
        """Let the scheduler go idle (where SGLang runs its strict leak check) and make sure it
        survived: a leak raises inside the scheduler and takes the server down. The check runs
        in the first loop iteration without work and again at every wake-up of the idle
        sleeper (a 1 s poll, --sleep-on-idle), so one second covers it."""
        time.sleep(seconds)
        assert self.alive(), self.output()[-4000:]
        self.generate("ping", max_new_tokens=2)
        assert "memory leak" not in self.output(), self.output()[-4000:]

    def stop(self) -> None:
        """Kill the whole process group at once. Nothing is checked at shutdown (the leak check
        runs when the scheduler goes idle, see wait_idle_checked), and a SIGTERM took ~5 s per
        server only to leave the scheduler processes behind for this SIGKILL anyway."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def run_launch_server_expect_failure(model: str, args, env=None, timeout: float = 120) -> tuple[int, str]:
    """Launch a server that must refuse to start; returns (exit code, combined output)."""
    cmd = launch_command(model, free_port(), 4096, args)
    try:
        proc = subprocess.run(cmd, env=server_env(env), capture_output=True, text=True,
                              timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"server did not exit: {err.stdout}\n{err.stderr}") from None
    return proc.returncode, proc.stdout + proc.stderr
