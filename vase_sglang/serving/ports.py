"""A TCP port for a server we launch (tests, benchmarks, the demo).

A port the OS hands out for `bind(("", 0))` comes from its ephemeral range, from which it also
hands out ports to every outgoing connection and every other `bind(0)`. Between picking the
port and SGLang binding it (after the model is loaded, tens of seconds later) another socket
took ours once (most likely one of the ephemeral ports torch.distributed/gloo bind in the
server's own processes; not traced): uvicorn failed with "[Errno 98] address already in use"
and the launcher hung. So the port is drawn below the ephemeral range, where nothing is
assigned without asking for it by number."""

from __future__ import annotations

import random
import socket

# uvicorn's message when the HTTP port is taken; launchers watch for it to fail fast
BIND_FAILURE = "error while attempting to bind"

_handed_out: set[int] = set()
_rng = random.Random()  # not the global RNG: tests seed that one


def ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port that is free now, below the ephemeral range, not handed out before by this
    process; an ephemeral one only if none is found there."""
    lo, _ = ephemeral_range()
    first = max(1024, lo - 12000)
    for _ in range(100):
        port = _rng.randrange(first, lo)
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
