"""Secret scrubbing for every message and log record of a ``kvtier`` command.

Passwords and credential-like query values of the given URLs (and credential environment
variables) are replaced by ``***``. :class:`Scrubber` is immutable once built and safe to call
from any thread (it runs inside the logging record factory); :class:`ScrubbedStream` wraps
stderr for argparse's own messages. No other state.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

_SECRET_WORDS = ("password", "secret", "token", "key_id", "auth", "credential")
_USERINFO_RE = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:/@\s]*):[^@/\s]*@")


def _is_secret_name(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in _SECRET_WORDS)


def secrets_in_url(url: str) -> list[str]:
    """The password and the credential-like query values in ``url``."""
    found: list[str] = []
    from kvtier.backends import url_password

    password = url_password(url)
    if password:
        found += [password, urllib.parse.unquote(password)]
    try:
        parts = urllib.parse.urlsplit(url)
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


class ScrubbedStream:
    """A text stream that scrubs secrets out of what argparse writes (usage errors)."""

    def __init__(self, stream: Any, scrub: Callable[[str], str]) -> None:
        self._stream = stream
        self._scrub = scrub

    def write(self, text: str) -> int:
        return int(self._stream.write(self._scrub(text)))

    def flush(self) -> None:
        self._stream.flush()


