"""SIGTERM and SIGINT as `Stopped` where the process is, or right after a deferred block (`runtime/stop_signals.py`)."""

from __future__ import annotations

import os
import signal

import pytest

from probdiff_callback.runtime.stop_signals import EXIT_ON_SIGNAL, Stopped, StopSignals


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_a_stop_signal_acts_at_once_or_right_after_a_rows_writing(signum, code):
    before = signal.getsignal(signum)
    with StopSignals() as signals:
        with pytest.raises(Stopped) as stopped:
            os.kill(os.getpid(), signum)  # the handler runs before the next statement
        assert stopped.value.signum == signum and EXIT_ON_SIGNAL[signum] == code
        signals.received = None
        written = []
        with pytest.raises(Stopped):
            with signals.deferred():
                os.kill(os.getpid(), signum)
                written.append("row and done mark")
        assert written == ["row and done mark"]
    assert signal.getsignal(signum) == before
