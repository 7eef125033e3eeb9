"""Errors a replay raises; each message says what broke and where. No state."""

from __future__ import annotations

from kvtier.errors import KvtierError


class ReplayError(KvtierError, RuntimeError):
    """The replay could not go on."""


class ReplayIntegrityError(ReplayError):
    """A loaded block's bytes differ from the bytes stored under its key."""


class ReplayStuckError(ReplayError):
    """A request waited on lookups longer than ``max_wait_s``."""
