"""Server ports (vase_sglang/serving/ports.py) and the launchers' answer to a taken port: the port is
drawn below the OS's ephemeral range (where the server's own torch.distributed/gloo sockets
once took it), and a launcher whose HTTP port was taken stops that server at once and reports
it (the launchers then start again on a new port) instead of waiting for its timeout."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed

from benchmarks._server import BenchServer  # noqa: E402
from servers import Server  # noqa: E402
from vase_sglang.serving import ports  # noqa: E402

BIND_ERROR = ("ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 1): "
              "address already in use\n")


def test_ports_are_free_distinct_and_below_the_ephemeral_range():
    lo, hi = ports.ephemeral_range()
    got = [ports.free_port() for _ in range(50)]
    assert len(set(got)) == 50
    assert all(1024 <= p < lo for p in got), (lo, got)
    # a port in use is never handed out
    with socket.socket() as s:
        s.bind(("127.0.0.1", got[0]))  # free right after the pick
        s.listen()
        ports._handed_out.discard(got[0])
        assert all(ports.free_port() != got[0] for _ in range(200))


def _fake_launch(cls, log_text: str):
    """A launcher object around a real process that never becomes ready, with `log_text` in its
    log (what a server writes when uvicorn cannot bind)."""
    obj = cls.__new__(cls)
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    log.write(log_text)
    log.flush()
    if cls is Server:
        obj.log = log
    else:
        obj.log_path, obj._log, obj._start = Path(log.name), log, 0
    obj.proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    return obj


def test_a_taken_port_stops_the_launch_at_once():
    for cls in (Server, BenchServer):
        obj = _fake_launch(cls, "Uvicorn starting\n" + BIND_ERROR)
        t0 = time.time()
        assert obj._wait_ready(timeout=60) is False
        assert time.time() - t0 < 5
        assert obj.proc.poll() is not None  # stopped, not left running
    # negative control: without the message the same launch waits for its timeout
    obj = _fake_launch(Server, "Uvicorn starting\n")
    t0 = time.time()
    try:
        obj._wait_ready(timeout=2)
        raise AssertionError("expected a timeout")
    except RuntimeError as err:
        assert "not ready after 2" in str(err)
    assert time.time() - t0 >= 2
