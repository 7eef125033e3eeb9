"""The ``Backend`` protocol and the helpers every backend shares.

State owned here lives inside helper objects that each backend instance creates for itself:

- :class:`BackendStats` counters: written by any thread calling into the backend, guarded by the
  object's own lock.
- :class:`RateLimitedLog` timestamps: any thread, guarded by the object's own lock.
- :class:`Lifecycle` state: any thread; ``close()`` flips it once, under its lock.

Backends are synchronous and thread-safe. A batch call never raises for an I/O error (the
affected keys answer False, the error is counted and logged); it raises ``TypeError`` /
``ValueError`` only for bad arguments, and :class:`BackendClosedError` after ``close()``.
"""

from __future__ import annotations

import enum
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from kvtier.codec import Buffer, as_byte_view, check_key
from kvtier.keys import BlockKey, Namespace

__all__ = [
    "Backend",
    "BackendClosedError",
    "BackendStats",
    "BackendUnavailableError",
    "Buffer",
    "ExistenceChecks",
    "Lifecycle",
    "RateLimitedLog",
    "check_get_args",
    "check_keys",
    "check_put_args",
    "parse_bool_option",
    "parse_float_option",
    "parse_int_option",
    "parse_size_option",
    "reject_unknown_options",
]


class BackendClosedError(RuntimeError):
    """A backend method was called after ``close()``."""


class BackendUnavailableError(RuntimeError):
    """:meth:`Backend.probe` could not answer for every key (I/O error, lost connection).

    ``exists`` turns such keys into False; ``probe`` raises instead, so that a lookup manager can
    tell "absent" from "unknown": unknown answers are never cached and feed its circuit breaker.
    """


@runtime_checkable
class Backend(Protocol):
    """A synchronous, thread-safe block store bound to one :class:`Namespace`."""

    @property
    def namespace(self) -> Namespace: ...

    @property
    def url(self) -> str:
        """The backend's URL with credentials redacted."""
        ...

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """True where the block is stored; False where absent or where the check failed."""
        ...

    def probe(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Like :meth:`exists`, but raises :class:`BackendUnavailableError` if any check failed."""
        ...

    def put_many(self, keys: Sequence[BlockKey], payloads: Sequence[Buffer]) -> list[bool]:
        """True where stored or already present (never overwritten); False where it failed."""
        ...

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[memoryview]) -> list[bool]:
        """True where ``out`` now holds the block; ``out`` untouched where False."""
        ...

    def delete(self, keys: Sequence[BlockKey]) -> None: ...

    def close(self) -> None: ...

    def stats(self) -> dict[str, int]: ...


class ExistenceChecks:
    """``exists`` and ``probe`` for a backend that implements ``_exists``.

    ``_exists(keys)`` returns one answer per key (False where the check failed) and the number
    of checks that failed; the failures are already counted and logged by the backend.
    """

    __slots__ = ()

    @property
    def url(self) -> str:
        raise NotImplementedError

    def _exists(self, keys: Sequence[BlockKey]) -> tuple[list[bool], int]:
        raise NotImplementedError

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        return self._exists(keys)[0]

    def probe(self, keys: Sequence[BlockKey]) -> list[bool]:
        answers, failed = self._exists(keys)
        if failed:
            raise BackendUnavailableError(
                f"{self.url}: {failed} of {len(answers)} existence check(s) failed"
            )
        return answers


# --------------------------------------------------------------------------- lifecycle


class LifecycleState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class Lifecycle:
    """Open/closed state of one backend instance."""

    __slots__ = ("_lock", "_name", "_state")

    def __init__(self, name: str) -> None:
        self._name = name
        self._state = LifecycleState.OPEN
        self._lock = threading.Lock()

    @property
    def state(self) -> LifecycleState:
        return self._state

    def check_open(self) -> None:
        if self._state is LifecycleState.CLOSED:
            raise BackendClosedError(f"{self._name} is closed")

    def close(self) -> bool:
        """Mark closed; True only for the call that actually closed it."""
        with self._lock:
            if self._state is LifecycleState.CLOSED:
                return False
            self._state = LifecycleState.CLOSED
            return True


# --------------------------------------------------------------------------- counters


STANDARD_COUNTERS = (
    "corrupt_objects",
    "errors",
    "bytes_read",
    "bytes_written",
    "round_trips",
    "puts",
    "gets",
    "hits",
    "misses",
    "exists_calls",
    "deletes",
)


class BackendStats:
    """Thread-safe integer counters; ``snapshot()`` always has every standard counter."""

    __slots__ = ("_counters", "_lock")

    def __init__(self, extra: Sequence[str] = ()) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, int] = dict.fromkeys((*STANDARD_COUNTERS, *extra), 0)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + amount

    def add_many(self, amounts: Mapping[str, int]) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._counters[name] = self._counters.get(name, 0) + amount

    def set(self, name: str, value: int) -> None:
        with self._lock:
            self._counters[name] = value

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)


class RateLimitedLog:
    """Logs at most one warning per ``interval_s``; the ones in between are counted, not lost.

    A dead server can fail every call many times per second; one line per interval, carrying the
    number of suppressed messages, keeps the log readable.
    """

    __slots__ = ("_clock", "_interval_s", "_last", "_lock", "_logger", "_suppressed")

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None
        self._suppressed = 0

    def warning(self, message: str, *args: object) -> bool:
        """Log unless one was logged less than ``interval_s`` ago; True if it was logged."""
        now = self._clock()
        with self._lock:
            if self._last is not None and now - self._last < self._interval_s:
                self._suppressed += 1
                return False
            suppressed, self._suppressed, self._last = self._suppressed, 0, now
        if suppressed:
            message = f"{message} (%d similar messages suppressed)"
            args = (*args, suppressed)
        self._logger.warning(message, *args)
        return True


# --------------------------------------------------------------------------- argument checks


def check_keys(keys: Sequence[BlockKey], argument: str = "keys") -> list[BlockKey]:
    """``keys`` as a list, raising naming the first key that is not 1..255 bytes."""
    if isinstance(keys, (bytes, bytearray, memoryview, str)) or not isinstance(keys, Sequence):
        raise TypeError(
            f"{argument} must be a sequence of BlockKey (bytes), got {type(keys).__name__}"
        )
    return [check_key(key, f"{argument}[{index}]") for index, key in enumerate(keys)]


def check_put_args(
    keys: Sequence[BlockKey], payloads: Sequence[Buffer]
) -> tuple[list[BlockKey], list[memoryview]]:
    """Validated keys and flat byte views of the payloads (no copy)."""
    key_list = check_keys(keys)
    if isinstance(payloads, (bytes, bytearray, memoryview, str)) or not isinstance(
        payloads, Sequence
    ):
        raise TypeError(f"payloads must be a sequence of buffers, got {type(payloads).__name__}")
    if len(payloads) != len(key_list):
        raise ValueError(
            f"len(payloads) must equal len(keys): got {len(payloads)} payloads "
            f"for {len(key_list)} keys"
        )
    views = [as_byte_view(payload, f"payloads[{index}]") for index, payload in enumerate(payloads)]
    return key_list, views


def check_get_args(
    keys: Sequence[BlockKey], outs: Sequence[memoryview]
) -> tuple[list[BlockKey], list[memoryview]]:
    """Validated keys and flat, writable byte views of the output buffers."""
    key_list = check_keys(keys)
    if isinstance(outs, (bytes, bytearray, memoryview, str)) or not isinstance(outs, Sequence):
        raise TypeError(f"outs must be a sequence of memoryview, got {type(outs).__name__}")
    if len(outs) != len(key_list):
        raise ValueError(
            f"len(outs) must equal len(keys): got {len(outs)} outs for {len(key_list)} keys"
        )
    views: list[memoryview] = []
    for index, out in enumerate(outs):
        if not isinstance(out, memoryview):
            raise TypeError(f"outs[{index}] must be a memoryview, got {type(out).__name__}")
        view = as_byte_view(out, f"outs[{index}]")
        if view.readonly:
            raise TypeError(f"outs[{index}] must be a writable memoryview")
        views.append(view)
    return key_list, views


# --------------------------------------------------------------------------- option parsing

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_bool_option(name: str, value: object) -> bool:
    """A bool from a bool or one of 1/0, true/false, yes/no, on/off (case-insensitive)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
    raise ValueError(f"option {name}={value!r}: expected a boolean (true/false, 1/0, yes/no)")


def parse_size_option(name: str, value: object, *, minimum: int = 0) -> int:
    """Bytes from an int or a binary size (``"512MiB"``, ``"4G"``, ``"4096"``): the one size rule
    of kvtier (:func:`kvtier.settings.parse_size`; ``"1.5GB"`` is ambiguous and rejected)."""
    from kvtier.settings import parse_size  # a ConfigError is a ValueError

    return parse_size(value, f"option {name}={value!r}", minimum=minimum)


def parse_int_option(
    name: str, value: object, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """An int from an int or a decimal string, with optional bounds."""
    result: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        result = value
    elif isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        result = int(value)
    if result is None:
        raise ValueError(f"option {name}={value!r}: expected an integer")
    if minimum is not None and result < minimum:
        raise ValueError(f"option {name}={value!r}: must be >= {minimum}")
    if maximum is not None and result > maximum:
        raise ValueError(f"option {name}={value!r}: must be <= {maximum}")
    return result


def parse_float_option(name: str, value: object, *, minimum: float | None = None) -> float:
    """A finite float from a number or a decimal string, with an optional lower bound."""
    result: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        result = float(value)
    elif isinstance(value, str):
        try:
            result = float(value)
        except ValueError:
            result = None
    if result is None or result != result or result in (float("inf"), float("-inf")):
        raise ValueError(f"option {name}={value!r}: expected a finite number")
    if minimum is not None and result < minimum:
        raise ValueError(f"option {name}={value!r}: must be >= {minimum}")
    return result


def reject_unknown_options(scheme: str, options: Mapping[str, Any], allowed: Sequence[str]) -> None:
    """Raise ``ValueError`` naming every option the backend does not know."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} for {scheme}:// backends; "
            f"expected some of {sorted(allowed)}"
        )

