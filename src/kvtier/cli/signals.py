"""Signals during a ``kvtier`` command: SIGTERM, SIGHUP and SIGINT raise :class:`Terminated`.

The exception is raised once, in the main thread, so every ``finally`` (manager shutdown,
scratch removal) runs; a second signal during that cleanup is counted and ignored (a late Ctrl-C
never interrupts a shutdown half-way). The command then exits ``128 + signal number`` (130 for
Ctrl-C, 143 for SIGTERM, 129 for SIGHUP).

Thread ownership: :class:`SignalGuard` owns the previous handlers and the "already interrupted"
flag; it is entered and left on the command's main thread, where the handlers also run (between
bytecodes). Entered from another thread it does nothing: the embedder owns signals.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

_HANDLED = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class Terminated(BaseException):  # like KeyboardInterrupt: a way out, not an error
    """A termination signal arrived; raised once in the main thread."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class SignalGuard:
    """Turn SIGTERM/SIGHUP/SIGINT into one :class:`Terminated`; later ones are ignored."""

    __slots__ = ("_interrupted", "_previous", "ignored")

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._interrupted = False
        self.ignored = 0

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self._interrupted:  # cleanup is running: let it finish
            self.ignored += 1
            return
        self._interrupted = True
        raise Terminated(signum)

    def __enter__(self) -> SignalGuard:
        if threading.current_thread() is not threading.main_thread():
            return self  # only the main thread may set handlers; the embedder owns signals
        for signum in _HANDLED:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self._interrupted = True  # from here on, the process is on its way out
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
