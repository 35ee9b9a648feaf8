"""`rlplex run` turns SIGINT, SIGTERM and SIGHUP into a graceful stop of the job (checkpoints,
report, exit code 128 + N). The whole path is run with SIGTERM on a real job by
tests/mainjob/test_main_job_faults.py; here, each signal reaches the same handler."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from rlplex.mainjob.driver import _StopSignals
from timing import wait_for


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_every_stop_signal_asks_for_a_graceful_stop_and_the_handlers_are_restored(signum: int) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed from the main thread only")
    before = signal.getsignal(signum)
    with _StopSignals() as signals:
        os.kill(os.getpid(), signum)
        wait_for(lambda: signals.received == signum, 5, f"{signal.Signals(signum).name} to be received")
        other = signal.SIGTERM if signum != signal.SIGTERM else signal.SIGHUP
        os.kill(os.getpid(), other)  # Python runs the handler before the next line
        assert signals.received == signum  # the first signal is the one reported
    assert signal.getsignal(signum) == before


def test_a_second_ctrl_c_interrupts_at_once() -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed from the main thread only")
    with _StopSignals() as signals, pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        wait_for(lambda: signals.received == signal.SIGINT, 5, "the first Ctrl-C")
        os.kill(os.getpid(), signal.SIGINT)
        wait_for(lambda: False, 5, "the second Ctrl-C to interrupt")
