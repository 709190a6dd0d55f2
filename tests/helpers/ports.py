"""TCP ports for the tests' multi-process runs (the rendezvous of torchrun, the ``MASTER_PORT`` of
Lightning's launcher), safe when two pytest-xdist workers launch runs at the same time.

A port is taken below the OS's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), where
the OS never hands one out by itself: not to ``bind(("", 0))`` (how Lightning picks a port when
``MASTER_PORT`` is unset) nor to an outgoing connection (the gloo ranks' sockets). Each xdist worker
has a slice of its own, so two workers never pick the same port; within it the start is random
(other pytest sessions on the machine) and a bind checks that nobody holds the port now.
"""

from __future__ import annotations

import os
import random
import socket

FIRST = 20000  # the slices: 20000-20999 (no xdist), 21000-21999 (gw0), ...
SLICE = 1000
_given: set[int] = set()  # a port handed out may be idle until its run binds it: never twice
_random = random.SystemRandom()  # independent of the seeds the tests set (random.seed, seed_everything)


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _worker_index() -> int:
    """0 outside xdist, 1 + N for the worker ``gwN``."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(name[2:]) + 1 if name.startswith("gw") and name[2:].isdigit() else 0


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))  # every address, as the TCPStore server binds
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port nobody listens on, from this worker's slice below the ephemeral range (from the OS
    where that range starts too low for the slices)."""
    slices = (_ephemeral_start() - FIRST) // SLICE
    if slices < 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    start = FIRST + (_worker_index() % slices) * SLICE
    offset = _random.randrange(SLICE)
    for i in range(SLICE):
        port = start + (offset + i) % SLICE
        if port not in _given and _bindable(port):
            _given.add(port)
            return port
    raise RuntimeError(f"no free TCP port in {start}-{start + SLICE - 1}: close what holds them, or rerun")


def with_master_port(env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``MASTER_PORT`` set to a free port, for a process whose Lightning launcher starts
    the other ranks (it keeps a ``MASTER_PORT`` that is set)."""
    return {**env, "MASTER_PORT": str(free_port())}
