"""What keeps a ``kvtier`` command run honest and tidy: signals, scratch directories, secrets,
and the verdict on tiers that failed.

Thread ownership: everything here runs on the command's main thread (signal handlers run there
too, between bytecodes). :class:`SignalGuard` owns the previous handlers and the "already
interrupted" flag; :class:`ScratchDir` owns its directory; :class:`Scrubber` is immutable once
built and safe to call from any thread (it runs inside the logging record factory).

- **Signals.** SIGTERM, SIGHUP and SIGINT raise :class:`Terminated` once, in the main thread, so
  every ``finally`` (manager shutdown, scratch removal) runs; a second signal during that
  cleanup is counted and ignored (a late Ctrl-C never interrupts a shutdown half-way). The
  command then exits ``128 + signal number`` (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP).
- **Scratch.** The default file tier lives in ``kvtier-run-<pid>-<random>`` under the scratch
  parent, with an ``owner`` file naming the pid and its start time. A later run removes such
  directories whose owner is gone (pid dead, or reused by another process), so a ``kill -9``
  costs disk space only until the next run.
- **Secrets.** Passwords and credential-like query values of the given URLs (and credential
  environment variables) are replaced by ``***`` in every message and log record.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

SCRATCH_PREFIX = "kvtier-run-"
_OWNER_FILE = "owner"
_HANDLED = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
_SECRET_WORDS = ("password", "secret", "token", "key_id", "auth", "credential")
_USERINFO_RE = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:/@\s]*):[^@/\s]*@")


# ---- signals ------------------------------------------------------------------------------

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


# ---- scratch directories ----------------------------------------------------------------

def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def _owner_alive(directory: Path) -> bool:
    try:
        pid_text, _, started = (directory / _OWNER_FILE).read_text().strip().partition(" ")
        pid = int(pid_text)
    except (OSError, ValueError):
        return False  # no readable owner: a directory we never finished creating, or foreign
    current = _start_time(pid)
    return current is not None and current == started


def remove_stale_scratch(parent: str | os.PathLike[str]) -> list[Path]:
    """Remove ``kvtier-run-*`` directories under ``parent`` that this user owns and whose owner
    process is gone; returns what was removed. Never raises."""
    removed: list[Path] = []
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        if not entry.name.startswith(SCRATCH_PREFIX):
            continue
        try:
            info = entry.lstat()
        except OSError:
            continue
        if not entry.is_dir() or entry.is_symlink() or info.st_uid != uid:
            continue
        if _owner_alive(entry):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        if not entry.exists():
            removed.append(entry)
    return removed


class ScratchDir:
    """A private run directory under ``parent`` that records its owner and is removed at exit."""

    __slots__ = ("path",)

    def __init__(self, parent: str | os.PathLike[str]) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=parent))
        (self.path / _OWNER_FILE).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> ScratchDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def check_scratch_parent(parent: str) -> str | None:
    """Why ``parent`` cannot hold scratch directories, or None when it can."""
    path = Path(parent)
    if not path.exists():
        return f"{parent!r} does not exist"
    if not path.is_dir():
        return f"{parent!r} is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{parent!r} is not writable by this user"
    return None


# ---- secrets ------------------------------------------------------------------------------

def _is_secret_name(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in _SECRET_WORDS)


def secrets_in_url(url: str) -> list[str]:
    """The password and the credential-like query values in ``url``."""
    found: list[str] = []
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.password:
            found.append(urllib.parse.unquote(parts.password))
            found.append(parts.password)
        for name, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=False):
            if _is_secret_name(name):
                found.append(value)
    except ValueError:
        pass
    return found


@dataclass(frozen=True, slots=True)
class Scrubber:
    """Replaces every known secret (and any ``scheme://user:password@``) in text by ``***``."""

    secrets: tuple[str, ...] = ()

    @classmethod
    def for_run(cls, urls: Iterable[str], environ: Mapping[str, str] | None = None) -> Scrubber:
        env = os.environ if environ is None else environ
        found = [secret for url in urls for secret in secrets_in_url(url)]
        found += [value for name, value in env.items()
                  if _is_secret_name(name) and name.upper() == name]
        # Longest first, so a secret that contains another is replaced whole; very short values
        # would blank out ordinary words and are not credentials worth the name.
        unique = sorted({secret for secret in found if len(secret) >= 4}, key=len, reverse=True)
        return cls(tuple(unique))

    def __call__(self, text: str) -> str:
        text = _USERINFO_RE.sub(r"\g<scheme>\g<user>:***@", text)
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text

    @contextlib.contextmanager
    def in_logs(self) -> Iterator[None]:
        """Scrub every log record created while active (whatever handler prints it)."""
        previous = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = previous(*args, **kwargs)
            with contextlib.suppress(Exception):  # a bad format string stays logging's problem
                record.msg = self(record.getMessage())
                record.args = ()
            return record

        logging.setLogRecordFactory(factory)
        try:
            yield
        finally:
            logging.setLogRecordFactory(previous)


# ---- verdict on tiers ---------------------------------------------------------------------

FAILED_FRACTION = 0.5
"""A tier whose operations failed for more than this fraction of the run failed the run."""


@dataclass(frozen=True, slots=True)
class TierHealth:
    """One secondary tier's operations over a run, summed over instances."""

    name: str
    attempts: int
    failures: int

    @property
    def failed(self) -> bool:
        return self.attempts > 0 and self.failures > FAILED_FRACTION * self.attempts

    def summary(self) -> str:
        share = self.failures / self.attempts if self.attempts else 0.0
        return (f"tier {self.name!r} failed {self.failures:,} of {self.attempts:,} operations "
                f"({share:.0%}: probes, loads and stores that errored, timed out, were cut off "
                f"by the circuit breaker or were shed)")


def tier_health(manager_stats: Iterable[Mapping[str, Any]]) -> list[TierHealth]:
    """Health of every secondary tier from the managers' ``get_stats()``."""
    totals: dict[str, list[int]] = {}
    for stats in manager_stats:
        for name, tier in stats.get("tiers", {}).items():
            attempts = (tier.get("probes_submitted", 0) + tier.get("breaker_short_circuits", 0)
                        + tier.get("load_keys", 0)
                        + tier.get("store_keys", 0) + tier.get("store_keys_shed", 0))
            failures = (tier.get("probe_errors", 0) + tier.get("probe_timeouts", 0)
                        + tier.get("breaker_short_circuits", 0)
                        + tier.get("load_keys_failed", 0) + tier.get("store_keys_failed", 0)
                        + tier.get("store_keys_shed", 0))
            total = totals.setdefault(name, [0, 0])
            total[0] += attempts
            total[1] += failures
    return [TierHealth(name, attempts, failures) for name, (attempts, failures) in totals.items()]
