"""Free loopback ports for the servers that benchmarks and tests start: one picker for them all."""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port"]

_PORTS_GIVEN: set[int] = set()  # handed out by this process: never twice


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for binds to port 0 (Linux's default 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now, for a server that binds it seconds later, chosen below the kernel's ephemeral
    range. A port the kernel picks is one it may hand to any process's next bind to port 0 as soon as
    it is released: a NIXL decoder's side-channel port, picked so, was taken by the prefiller's own
    sockets while the decoder loaded its model, and every restart of the decoder then failed to bind
    it (a CI run of stop 34 on this host, docs/e2e.md)."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(10000, low) if low > 11000 else 0
        if port in _PORTS_GIVEN:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = sock.getsockname()[1]
        _PORTS_GIVEN.add(port)
        return port
    raise RuntimeError("no free port found below the ephemeral range")
