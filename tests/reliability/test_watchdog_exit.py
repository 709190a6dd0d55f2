"""The lost-rank watchdog leaves no thread inside a store call when the interpreter exits (issue 25: a
2-process FSDP2 fit of the GPU check's dry run aborted at exit with "terminate called without an
active exception", exit -6). A daemon thread that is inside a c10d store call (C++, GIL released)
when Python finalises is ended by ``pthread_exit`` as it takes the GIL back; the unwinding crosses a
``noexcept`` destructor and the C++ runtime aborts. The watchdog is joined at teardown and at exit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import timedelta

import torch.distributed as dist

from dit_lightning.callbacks.fault_tolerance import PeerWatchdog
from tests.helpers.cli import ROOT

# Watchdogs beating as fast as they can, so that one is always inside a store call, and a process
# that exits without stopping them (an exception, sys.exit): before the fix it aborted every time.
EXIT_WITH_WATCHDOGS_RUNNING = textwrap.dedent(
    """
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from dit_lightning.callbacks.fault_tolerance import PeerWatchdog

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    dogs = [PeerWatchdog(store, 0, 1, interval=1e-6) for _ in range(4)]
    for dog in dogs:
        dog.start()
    time.sleep(0.2)
    assert all(dog.is_alive() for dog in dogs) and sum(dog._beats for dog in dogs) > 0
    """
)


def test_watchdogs_alive_at_interpreter_exit_do_not_abort_it():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_WITH_WATCHDOGS_RUNNING], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "terminate called" not in proc.stderr, (proc.returncode, proc.stderr[-2000:])


def test_close_stops_and_joins_the_watchdog():
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    dog = PeerWatchdog(store, 0, 1, interval=1e-4)
    dog.start()
    dog.close()
    assert not dog.is_alive()
