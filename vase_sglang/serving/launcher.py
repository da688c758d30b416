"""Start one real SGLang server (`python -m sglang.launch_server`), wait until it serves, stop it.

The one launcher of the tests (tests/servers.py: `Server`), the benchmarks
(benchmarks/_server.py: `BenchServer`) and the demo (scripts/demo.py). What differs between
them is an option of `Launcher`:

  strict           SGLang's own memory checks in the server's environment (STRICT_ENV; the tests)
  log_path         append the server's output to this file, a header line per start (the
                   benchmarks); by default each start writes a new temporary file (the tests);
  echo             keep the output in memory and copy it to this process' stdout (the demo)
  teacher_forcing  accept the custom logit processor the teacher-forced benchmarks send, with the
                   overlap scheduler off (the processor must see the step it is forcing)
  max_total_tokens, max_running
                   --max-total-tokens, --max-running-requests (None: SGLang's default)
  device_flags     flags that choose the device; default the CPU flags when there is no CUDA
  scrub_env        drop VASE_KV_EVICT_* and TRITON_INTERPRET from the inherited environment, so
                   that only the flags configure eviction (the tests, the benchmarks)
  threads          OMP_NUM_THREADS of the server (None: leave the environment's)
  stop_grace       seconds between SIGTERM and SIGKILL of the process group at stop (0: SIGKILL
                   at once; nothing is checked at shutdown)

A start whose HTTP port was taken meanwhile (vase_sglang/serving/ports.py) is stopped at once and
tried again on a new port, 3 times in all. Ready means SGLang's own warm-up request is done
(READY in the output), so that it never shares a batch with (and perturbs the numerics of) the
first real request.

Imports neither SGLang, nor the tests, nor the benchmarks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from .ports import BIND_FAILURE, free_port

READY = "The server is fired up and ready to roll"
CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"]
STRICT_ENV = {
    # SGLang's own memory checks: conservation every busy step, page ownership
    # (use-after-free, double free), and the idle leak check (strict by default).
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
    "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1",
}
# the teacher-forced mode sends a logit processor; the overlap scheduler is off so that the
# processor sees req.output_ids of the step it is forcing
TEACHER_FORCING_FLAGS = ["--enable-custom-logit-processor", "--disable-overlap-schedule"]


def on_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def launch_command(model, port: int, *, args=(), host: str | None = "127.0.0.1",
                   max_total_tokens: int | None = None, max_running: int | None = None,
                   teacher_forcing: bool = False, device_flags=()) -> list[str]:
    """The command line; `args` (e.g. the --kv-evict-* flags) come last, so they win."""
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
            *([] if host is None else ["--host", host]), "--port", str(port),
            *([] if max_total_tokens is None else ["--max-total-tokens", str(max_total_tokens)]),
            *([] if max_running is None else ["--max-running-requests", str(max_running)]),
            *(TEACHER_FORCING_FLAGS if teacher_forcing else []),
            *device_flags, *map(str, args)]


def server_env(extra: dict | None = None, *, strict: bool = False, threads: int | None = 1,
               scrub: bool = True, pythonpath=()) -> dict:
    """This process' environment for a server: scrubbed of the eviction settings (`scrub`),
    one OpenMP thread per process by default (small models on CPU are far slower with OpenMP
    sync overhead), SGLang's memory checks if `strict`, `pythonpath` put first (a class a
    request sends by reference must be importable in the scheduler), then `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not (scrub and (k.startswith("VASE_KV_EVICT_") or k == "TRITON_INTERPRET"))}
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    if strict:
        env.update(STRICT_ENV)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(
            [*map(str, pythonpath), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(extra or {})
    return env


def stop_process_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM (the process stops its own children) and up to `grace` seconds, then SIGKILL
    whatever is left of its process group (it was started with start_new_session)."""
    if grace > 0 and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class Launcher:
    """One server; the options are in the module docstring. `args` are extra launch_server
    arguments. Attributes: port, url, cmd, proc, log_path (None with echo)."""

    # Class-level defaults: what __init__ sets, also read by a launcher built around an
    # existing process (tests/test_ports.py).
    log_path: Path | None = None
    stop_grace = 0.0
    post_timeout = 300.0
    _log = None
    _start = 0
    _owns_log = False
    _memory: list | None = None
    _reader: threading.Thread | None = None

    def __init__(self, model, args=(), *, env: dict | None = None, strict: bool = False,
                 scrub_env: bool = True, threads: int | None = 1, pythonpath=(), cwd=None,
                 log_path=None, echo: bool = False, max_total_tokens: int | None = None,
                 max_running: int | None = None, teacher_forcing: bool = False,
                 device_flags=None, host: str | None = "127.0.0.1", timeout: float = 600.0,
                 stop_grace: float | None = None, attempts: int = 3):
        if stop_grace is not None:
            self.stop_grace = stop_grace
        if device_flags is None:
            device_flags = [] if on_cuda() else CPU_FLAGS
        full_env = server_env(env, strict=strict, threads=threads, scrub=scrub_env,
                              pythonpath=pythonpath)
        if log_path is not None:
            self.log_path = Path(log_path)
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log, self._owns_log = open(self.log_path, "a"), True
        for _ in range(attempts):  # a new port if the HTTP port was taken meanwhile
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.cmd = launch_command(model, self.port, args=args, host=host,
                                      max_total_tokens=max_total_tokens, max_running=max_running,
                                      teacher_forcing=teacher_forcing, device_flags=device_flags)
            self.proc = self._popen(echo, full_env, cwd)
            try:
                ready = self._wait_ready(timeout)
            except BaseException:  # also Ctrl-C: its own session would outlive this process
                stop_process_group(self.proc, grace=min(self.stop_grace, 5.0))
                raise
            if ready:
                return
        raise RuntimeError(f"server could not bind a port in {attempts} attempts"
                           f"{self._where()}{self._tail(self.output())}")

    def _popen(self, echo: bool, env: dict, cwd) -> subprocess.Popen:
        popen = dict(env=env, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)
        if echo:
            print("$", " ".join(self.cmd), flush=True)
            self._memory = []
            proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, text=True,
                                    errors="replace", **popen)
            self._reader = threading.Thread(target=_copy_lines, daemon=True,
                                            args=(proc.stdout, self._memory))
            self._reader.start()
            return proc
        if self._owns_log:
            self._log.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(self.cmd)}\n")
            self._log.flush()
            self._start = self.log_path.stat().st_size
        else:
            self.log = tempfile.NamedTemporaryFile("w+", prefix="sglang-", suffix=".log",
                                                   delete=False)
        return subprocess.Popen(self.cmd, stdout=self._log, **popen)

    @property
    def log(self):
        """The open file the server writes its output to (None with echo)."""
        return self._log

    @log.setter
    def log(self, file) -> None:
        self._log, self.log_path, self._start = file, Path(file.name), 0

    def _where(self) -> str:
        return f"; log {self.log_path}" if self.log_path is not None else ""

    def _tail(self, out: str) -> str:
        return "" if self._memory is not None else ":\n" + out[-4000:]  # echo: printed already

    def _wait_ready(self, timeout: float) -> bool:
        """True once ready; False if the HTTP port was taken (the server is stopped)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            out = self.output()
            if BIND_FAILURE in out:
                stop_process_group(self.proc, grace=min(self.stop_grace, 5.0))
                return False
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}{self._where()}"
                                   f"{self._tail(out)}")
            if READY in out:
                return True
            time.sleep(0.5)
        tail = self._tail(self.output())
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s{self._where()}{tail}")

    def output(self) -> str:
        """What the server wrote since this start."""
        if self._memory is not None:
            return "".join(self._memory)
        self._log.flush()
        with open(self.log_path) as f:
            f.seek(self._start)
            return f.read()

    # ----------------------------------------------------------------------------- HTTP

    def get(self, path: str, timeout: float = 30):
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def get_text(self, path: str, timeout: float = 60) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return r.read().decode()

    def post(self, path: str, payload: dict, timeout: float | None = None):
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout or self.post_timeout) as r:
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

    def generate(self, text=None, *, input_ids=None, max_new_tokens=64, timeout=None,
                 **kwargs) -> dict:
        """POST /generate, greedy unless `sampling_params` say otherwise; other keyword
        arguments go into the request as they are."""
        sampling = {"max_new_tokens": max_new_tokens, "temperature": 0}
        sampling.update(kwargs.pop("sampling_params", {}))
        payload = {"sampling_params": sampling, **kwargs}
        if input_ids is not None:
            payload["input_ids"] = input_ids
        else:
            payload["text"] = text
        return self.post("/generate", payload, timeout=timeout)

    def flush_cache(self) -> None:
        """Drop the radix cache (its answer is plain text, not JSON)."""
        req = urllib.request.Request(self.url + "/flush_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()

    # ----------------------------------------------------------------------------- stop

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        stop_process_group(self.proc, grace=self.stop_grace)
        if self._reader is not None:
            self._reader.join(timeout=5)
        if self._owns_log:
            self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _copy_lines(stream, memory: list) -> None:
    for line in stream:
        memory.append(line)
        sys.stdout.write(line)
        sys.stdout.flush()
