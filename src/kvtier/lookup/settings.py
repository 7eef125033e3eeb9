"""The lookup manager's settings table (:data:`LOOKUP_SETTINGS`); it holds no state.

The constructor of :class:`~kvtier.lookup.manager.AsyncLookupManager`, the config loader and the
docs all read this one table, so a setting's default, bounds, unit and help live here only.
"""

from __future__ import annotations

from typing import Final

from kvtier.settings import Kind, Setting, SettingsTable

__all__ = ["LOOKUP_SETTINGS"]

_MAX_SECONDS: Final = 3600.0


def _seconds(name: str, default: float, help_text: str, *, strict_min: bool) -> Setting:
    return Setting(name, Kind.FLOAT, default, help_text, minimum=0.0, maximum=_MAX_SECONDS,
                   strict_min=strict_min, unit="seconds", env=f"KVTIER_LOOKUP_{name.upper()}")


def _count(name: str, default: int, help_text: str) -> Setting:
    return Setting(name, Kind.INT, default, help_text, minimum=1, unit="count",
                   env=f"KVTIER_LOOKUP_{name.upper()}")


LOOKUP_SETTINGS: Final = SettingsTable("lookup", (
    _seconds("probe_timeout_s", 5.0, "a probe in flight longer than this answers False (the "
             "block is recomputed) at the next flush or lookup", strict_min=True),
    _seconds("verdict_ttl_s", 2.0, "how long a backend or note_* verdict is served from the cache "
             "after its last request finished, counted from when it was answered; 0 disables",
             strict_min=False),
    _seconds("stored_verdict_ttl_s", 300.0, "how long the True verdict of our own store "
             "(note_stored) is served from the cache, counted from the store: a returning prompt "
             "needs no probe; never less than verdict_ttl_s, off with it, capped by the "
             "backend's own block lifetime (Redis ttl_s); a block the backend lost meanwhile "
             "fails its load and is recomputed", strict_min=False),
    _count("max_cached_verdicts", 65536, "bound of the verdict cache and, separately, of the "
           "quarantine (the least recently released entries go first)"),
    _seconds("quarantine_s", 30.0, "after mark_miss (a failed load) the key answers False without "
             "probing for this long", strict_min=False),
    _count("max_batch_keys", 1024, "the most keys in one batch_lookup call"),
    _count("breaker_threshold", 5, "consecutive failed or timed-out backend calls that open the "
           "circuit breaker"),
    _seconds("breaker_cooldown_s", 10.0, "how long an open breaker answers False before one trial "
             "batch decides", strict_min=True),
))
"""The lookup manager's settings: the constructor, the config loader and the docs use this table."""
