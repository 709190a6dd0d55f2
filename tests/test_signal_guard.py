"""The one mechanism by which every command stops on a signal (dit_lightning.signals), with real
signals sent to this process: the first stops at a safe point inside a block (at once outside),
the second at once, exit 128 + signal, one line saying what is kept; nothing without a guard."""

from __future__ import annotations

import pickle
import signal
import threading

import pytest

from dit_lightning.signals import NOTHING_PARTIAL, SignalExit, SignalGuard, active, on_stop, safe_points, stop_point


def kill(signum: int = signal.SIGTERM) -> None:
    # To the main thread itself: with os.kill a thread left by an earlier test (torch, a loader) could
    # receive it, and the main thread would notice a bytecode or two later (flaky in a full run). A
    # signal a thread sends itself is delivered before pthread_kill returns; Python runs the handler
    # at its next check, which the loop's backward jumps make happen here.
    signal.pthread_kill(threading.main_thread().ident or 0, signum)
    for _ in range(100):
        pass


def test_outside_a_block_the_first_signal_stops_at_once_and_the_handlers_come_back(capsys):
    before, outer = signal.getsignal(signal.SIGTERM), active()
    with pytest.raises(SignalExit) as stop, SignalGuard("dit-lightning tool") as guard:
        assert active() is guard
        kill()
        raise AssertionError("not reached")
    assert stop.value.code == 143 and not stop.value.at_once
    assert signal.getsignal(signal.SIGTERM) is before and active() is outer
    assert capsys.readouterr().out == f"dit-lightning tool: stopped by SIGTERM: {NOTHING_PARTIAL}.\n"


def test_in_a_block_the_first_signal_waits_for_the_next_safe_point(capfd):
    done = []
    with pytest.raises(SignalExit) as stop, SignalGuard("dit-lightning sample"):
        with safe_points(), on_stop(lambda: f"{len(done)} of 5 written; run the same command again"):
            for i in range(5):
                stop_point()
                if i == 1:
                    kill(signal.SIGINT)
                done.append(i)  # the step in progress finishes
    assert done == [0, 1] and stop.value.code == 130
    out, err = capfd.readouterr()
    assert "dit-lightning sample: SIGINT (Ctrl-C) received: stopping at the next safe point" in err
    assert out == "dit-lightning sample: stopped by SIGINT (Ctrl-C): 2 of 5 written; run the same command again.\n"


def test_the_end_of_a_block_is_a_safe_point_and_the_second_signal_stops_at_once(capsys):
    with pytest.raises(SignalExit) as stop, SignalGuard("x"), safe_points():
        kill()
    assert stop.value.code == 143 and not stop.value.at_once
    with pytest.raises(SignalExit) as stop, SignalGuard("x"), safe_points():
        kill()
        kill()
        raise AssertionError("not reached")
    assert stop.value.code == 143 and stop.value.at_once
    assert "stopped at once by a second SIGTERM" in capsys.readouterr().out


def test_a_deferring_guard_only_records_the_first_signal():
    with SignalGuard("fit", defer=True) as guard, safe_points():
        kill()
        stop_point()  # its owner decides where to stop
        assert guard.signum == signal.SIGTERM
        with pytest.raises(SignalExit) as stop:
            kill()
    assert stop.value.at_once and stop.value.code == 143


def test_without_a_guard_nothing_changes():
    # Python's own SIGINT handler, whatever this process inherited: a job a shell starts in the
    # background (`make test &`, a CI runner) ignores SIGINT, and Python keeps it ignored.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with safe_points(), on_stop(lambda: "unused"):
            stop_point()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with pytest.raises(KeyboardInterrupt):
            kill(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_a_signal_exit_crosses_processes_whole():
    stop = pickle.loads(pickle.dumps(SignalExit(15, detail="kept", at_once=True)))
    assert (stop.code, stop.signum, stop.detail, stop.at_once) == (143, 15, "kept", True)


def test_a_stage_that_fails_gives_its_handlers_back():
    """FaultTolerance installs a guard per stage; Lightning skips teardown hooks after an error, so
    on_exception must remove it (a stale guard took the signals of whatever ran next)."""
    from unittest import mock

    from dit_lightning.callbacks.fault_tolerance import FaultTolerance

    before, outer = signal.getsignal(signal.SIGTERM), active()
    trainer = mock.Mock(global_rank=0)
    trainer.strategy.launcher.procs = []
    callback = FaultTolerance()
    with mock.patch.object(FaultTolerance, "_handled_signals", return_value=[signal.SIGTERM]):
        callback._install_guard(trainer, "test")
    assert active() is not outer
    callback.on_exception(trainer, mock.Mock(), RuntimeError("the stage failed"))
    assert active() is outer and signal.getsignal(signal.SIGTERM) is before
