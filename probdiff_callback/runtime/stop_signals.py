"""SIGTERM and SIGINT as an exception where the process is (`Stopped`), or, inside `deferred()`, on leaving it: a
command that must stop at once, but never halfway through writing a file that goes with another."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

EXIT_ON_SIGNAL = {signal.SIGTERM: 0, signal.SIGINT: 130}  # a stop asked for; Ctrl-C as shells report it


class Stopped(BaseException):  # noqa: N818 - not an error: a signal asked the command to stop
    """SIGTERM or SIGINT: the command ends where it is (a BaseException: no `except Exception` keeps it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return EXIT_ON_SIGNAL[self.signum]


class StopSignals:
    """SIGTERM and SIGINT raise `Stopped` where the process is; inside `deferred()`, on leaving it."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._deferring = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        for signum in EXIT_ON_SIGNAL:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame) -> None:
        self.received = signum
        if not self._deferring:
            raise Stopped(signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        self.raise_if_received()

    def raise_if_received(self) -> None:
        if self.received is not None:
            raise Stopped(self.received)
