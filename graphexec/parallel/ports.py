"""Loopback ports for the processes graphexec starts (tensor-parallel rendezvous, data-parallel
replicas, the benchmarks' servers).  Standard library only: a front or a benchmark client that
imports it loads no torch."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port the OS just handed out (it may be taken again before it is bound; rare)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
