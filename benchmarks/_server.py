"""The benchmark harnesses' server: vase_sglang.serving.launcher without SGLang's strict memory
checks (they cost time on every busy step), its output appended to a log kept next to the
results, run from the repository (the teacher-forcing processor class is unpickled, by
reference, in the scheduler)."""

from __future__ import annotations

from pathlib import Path

from vase_sglang.serving.launcher import CPU_FLAGS, Launcher, on_cuda, stop_process_group  # noqa: F401

REPO = Path(__file__).resolve().parent.parent


class BenchServer(Launcher):
    """`args` are extra launch_server arguments (e.g. the --kv-evict-* flags)."""

    stop_grace = 30.0
    post_timeout = 3600

    def __init__(self, model: str, args=(), *, log_path: str | Path, max_total_tokens: int = 65536,
                 max_running: int | None = 64, env: dict | None = None, timeout: float = 600.0,
                 threads: int = 1, teacher_forcing: bool = True):
        super().__init__(model, args, env=env, threads=threads, pythonpath=[REPO], cwd=str(REPO),
                         log_path=log_path, max_total_tokens=max_total_tokens,
                         max_running=max_running, teacher_forcing=teacher_forcing,
                         timeout=timeout)
