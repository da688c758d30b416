"""A small launcher for the benchmark harnesses: one real SGLang server (python -m
sglang.launch_server) per context manager, with its log kept next to the results.

Kept apart from tests/servers.py on purpose: benchmarks run without SGLang's strict memory checks
(they cost time on every busy step) and must be importable without the tests package.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from vase_sglang.serving.ports import BIND_FAILURE, free_port

REPO = Path(__file__).resolve().parent.parent

CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"]


def stop_process_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM (the process stops its own children), then SIGKILL whatever is left of its
    process group (it was started with start_new_session)."""
    if proc.poll() is None:
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


def on_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


class BenchServer:
    """`args` are extra launch_server arguments (e.g. the --kv-evict-* flags)."""

    def __init__(self, model: str, args=(), *, log_path: str | Path, max_total_tokens: int = 65536,
                 max_running: int | None = 64, env: dict | None = None, timeout: float = 600.0,
                 threads: int = 1, teacher_forcing: bool = True):
        full_env = {k: v for k, v in os.environ.items()
                    if not k.startswith("VASE_KV_EVICT_") and k != "TRITON_INTERPRET"}
        # one thread per process: small models on CPU are far slower with OpenMP sync overhead
        full_env.update(OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
        # the teacher-forcing processor class is unpickled (by reference) in the scheduler
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
        full_env.update(env or {})
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "a")
        for attempt in range(3):  # a new port if the HTTP port was taken meanwhile
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
                   "--host", "127.0.0.1", "--port", str(self.port),
                   "--max-total-tokens", str(max_total_tokens),
                   *([] if max_running is None else ["--max-running-requests", str(max_running)]),
                   # the teacher-forced mode sends a logit processor; the overlap scheduler is
                   # off so that the processor sees req.output_ids of the step it is forcing
                   *(["--enable-custom-logit-processor", "--disable-overlap-schedule"]
                     if teacher_forcing else []),
                   *([] if on_cuda() else CPU_FLAGS), *map(str, args)]
            self.cmd = cmd
            self._log.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(cmd)}\n")
            self._log.flush()
            self._start = self.log_path.stat().st_size
            self.proc = subprocess.Popen(cmd, env=full_env, stdout=self._log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         cwd=str(REPO))
            if self._wait_ready(timeout):
                return
        raise RuntimeError(f"server could not bind a port in 3 attempts; log {self.log_path}")

    def _wait_ready(self, timeout: float) -> bool:
        """True once ready; False if the HTTP port was taken (the server is stopped)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            out = self.output()
            if BIND_FAILURE in out:
                stop_process_group(self.proc, grace=5)
                return False
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log {self.log_path}:\n"
                                   f"{out[-3000:]}")
            # ready once SGLang's own warmup request is done
            if "The server is fired up and ready to roll" in out:
                return True
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s; log {self.log_path}")

    def output(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            f.seek(self._start)
            return f.read()

    def post(self, path: str, payload: dict, timeout: float = 3600):
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
        return json.loads(body) if body.strip() else None

    def flush_cache(self) -> None:
        """Drop the radix cache (its answer is plain text, not JSON)."""
        req = urllib.request.Request(self.url + "/flush_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()

    def get_text(self, path: str, timeout: float = 60) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return r.read().decode()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        stop_process_group(self.proc, grace=30)
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
