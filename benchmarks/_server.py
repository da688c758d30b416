"""The benchmark harnesses' server: vase_sglang.serving.launcher without SGLang's strict memory
checks (they cost time on every busy step), its output appended to a log kept next to the
results, run from the repository (the teacher-forcing processor class is unpickled, by
reference, in the scheduler).

Policies of your own (docs/add_policy.md): VASE_KV_EVICT_PLUGINS, set for the benchmark, is
imported here (so the benchmarks' policy lists, drawn from the registry, name them) and passed
to every server it starts (whose environment is otherwise scrubbed of VASE_KV_EVICT_*)."""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
from pathlib import Path

from vase_sglang.serving.launcher import CPU_FLAGS, Launcher, on_cuda, stop_process_group  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
PLUGINS = "VASE_KV_EVICT_PLUGINS"


def import_plugins() -> dict[str, str]:
    """Import the modules named in VASE_KV_EVICT_PLUGINS (comma-separated), as every server
    process does, so the policies they register are in this process's registry; returns the
    variable for the servers' environment ({} where unset)."""
    spec = os.environ.get(PLUGINS, "")
    for name in filter(None, (m.strip() for m in spec.split(","))):
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise SystemExit(f"{PLUGINS}: cannot import {name!r}: {err}") from None
    return {PLUGINS: spec} if spec.strip() else {}


_PLUGIN_ENV = import_plugins()


class BenchServer(Launcher):
    """`args` are extra launch_server arguments (e.g. the --kv-evict-* flags)."""

    stop_grace = 30.0
    post_timeout = 3600

    def __init__(self, model: str, args=(), *, log_path: str | Path, max_total_tokens: int = 65536,
                 max_running: int | None = 64, env: dict | None = None, timeout: float = 600.0,
                 threads: int = 1, teacher_forcing: bool = True):
        env = {**_PLUGIN_ENV, **(env or {})}
        super().__init__(model, args, env=env, threads=threads, pythonpath=[REPO], cwd=str(REPO),
                         log_path=log_path, max_total_tokens=max_total_tokens,
                         max_running=max_running, teacher_forcing=teacher_forcing,
                         timeout=timeout)


@contextlib.contextmanager
def sigterm_exits():
    """Within it a plain `kill` of a benchmark exits through its finally blocks (which stop its
    servers) instead of leaving them running."""
    old = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
