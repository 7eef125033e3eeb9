"""Signals during a ``kvtier`` command: SIGTERM, SIGHUP and SIGINT raise :class:`Terminated`.

The exception is raised once, in the main thread, so every ``finally`` (manager shutdown,
scratch removal) runs; a second signal during that shutdown is counted and ignored (a late
Ctrl-C never interrupts a shutdown half-way). The command then exits ``128 + signal number``
(130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP).

A cleanup that talks to a tier (removing a replay's blocks from Redis, S3 or a file tier) runs
inside :func:`cleanup_phase`, and there signals work differently, so that it is either finished
or reported, never silently cut short: the first signal is deferred (the cleanup goes on, then
the command stops with that signal's exit code), and any later one raises
:class:`CleanupAborted` in the cleanup, which then reports what it left and how to remove it
(and marks the guard :attr:`SignalGuard.incomplete`, so the command does not say "cleaned up").

Thread ownership: :class:`SignalGuard` owns the previous handlers, the "already interrupted"
flag, the cleanup mode and the deferred signal; it is entered and left on the command's main
thread, where the handlers also run (between bytecodes), and it is the module's ``_active``
guard while entered. Entered from another thread it does nothing: the embedder owns signals
(and :func:`cleanup_phase` is then a no-op).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
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


class CleanupAborted(Terminated):
    """A further signal during a :func:`cleanup_phase`: stop the cleanup, report what is left.
    ``signum`` (and so the exit code) is the first signal's, the one that stopped the command."""


class SignalGuard:
    """Turn SIGTERM/SIGHUP/SIGINT into one :class:`Terminated`; later ones are ignored, except
    inside a :func:`cleanup_phase` (see the module docstring)."""

    __slots__ = ("_cleaning", "_first", "_interrupted", "_previous", "ignored", "incomplete")

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._interrupted = False
        self._cleaning = False
        self._first: int | None = None
        self.ignored = 0
        self.incomplete = False
        """A cleanup was stopped by a signal and left something behind (it said what)."""

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self._cleaning:
            self._in_cleanup(signum)
            return
        if self._interrupted:  # the shutdown is running: let it finish
            self.ignored += 1
            return
        self._interrupted = True
        self._first = signum
        raise Terminated(signum)

    def _in_cleanup(self, signum: int) -> None:
        if self._first is None:
            self._first = signum
            name = signal.Signals(signum).name
            _say(f"kvtier: {name}: finishing the cleanup first (send a signal again to stop "
                 f"it and leave the blocks)")
            return
        self.incomplete = True
        raise CleanupAborted(self._first)

    @contextlib.contextmanager
    def cleaning(self) -> Iterator[None]:
        """The body runs in cleanup mode; a signal deferred in it is raised at the end."""
        self._cleaning = True
        try:
            yield
        finally:
            self._cleaning = False
        if self._first is not None and not self._interrupted:
            self._interrupted = True
            raise Terminated(self._first)

    def __enter__(self) -> SignalGuard:
        global _active
        if threading.current_thread() is not threading.main_thread():
            return self  # only the main thread may set handlers; the embedder owns signals
        for signum in _HANDLED:
            self._previous[signum] = signal.signal(signum, self._handle)
        _active = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _active
        self._interrupted = True  # from here on, the process is on its way out
        self._cleaning = False
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        if _active is self:
            _active = None


_active: SignalGuard | None = None
"""The guard of the running command (main thread only), used by :func:`cleanup_phase`."""


def _say(text: str) -> None:
    # From a signal handler: a raw write, since print() may be in the middle of one already.
    with contextlib.suppress(OSError):
        os.write(2, f"{text}\n".encode())


@contextlib.contextmanager
def cleanup_phase() -> Iterator[None]:
    """Run a bounded cleanup: the first signal is deferred until it ends, a later one raises
    :class:`CleanupAborted` in it. A no-op off the main thread or outside a command."""
    guard = _active
    if guard is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    with guard.cleaning():
        yield


def cleanup_left() -> None:
    """A cleanup left something behind (and said so): the command must not say "cleaned up"."""
    if _active is not None:
        _active.incomplete = True


CLEANUP_HOOK_ENV = "KVTIER_TEST_CLEANUP_FIFO"
"""Test hook: a FIFO path; the cleanup waits there as it starts (see :func:`cleanup_starts`)."""


def cleanup_starts() -> None:
    """Test hook, off unless ``KVTIER_TEST_CLEANUP_FIFO`` names a FIFO: block at the start of a
    cleanup until a writer opens that FIFO (so the test knows the cleanup has started) and
    closes it again (so the test decides when it goes on, e.g. after sending a signal)."""
    path = os.environ.get(CLEANUP_HOOK_ENV)
    if not path:
        return
    with open(path, "rb") as fifo:  # blocks until the test opens it for writing
        fifo.read()  # until the test closes it
