"""The settings of one secondary tier: :class:`TierSettings` (a typed record) and its tables.

This module owns no mutable state: the record is frozen and the tables are frozen, safe to
share between threads.

:class:`TierSettings` is the one declaration of a tier's I/O settings (name, type, default,
bounds, env name, help: see :func:`kvtier.settings.setting_field`); :data:`TIER_IO_SETTINGS` is
derived from it, and :data:`TIER_SETTINGS` (the config's ``secondary_tiers[*]`` entries) adds the
backend URL and the tier name. :class:`LookupConfig` holds the tier's lookup-manager
settings (:data:`~kvtier.lookup.manager.LOOKUP_SETTINGS`). A
:class:`~kvtier.tiering.tier.SecondaryTier` takes one record.

:class:`PrefetchSettings` (the config's ``prefetch`` section, :data:`PREFETCH_SETTINGS`) is the
manager's session-aware prefetch (:mod:`kvtier.tiering.prefetch`): its share of the pool and of
each tier's I/O threads.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvtier.lookup.manager import LOOKUP_SETTINGS
from kvtier.settings import (
    MAX_TIMEOUT_S,
    Kind,
    Setting,
    SettingsTable,
    check_record,
    mapping_of,
    parse_record,
    record_table,
    setting_field,
)
from kvtier.tiering.io_pool import DEFAULT_LOAD_TIMEOUT_S

__all__ = ["PREFETCH_SETTINGS", "TIER_IO_SETTINGS", "TIER_SETTINGS", "LookupConfig",
           "PrefetchMode", "PrefetchSettings", "TierSettings"]


MAX_IO_THREADS = 256
"""More threads than this per tier only contend; a million would exhaust the process."""
MIN_LOAD_TIMEOUT_S = 0.001
"""Below a millisecond every load would time out: a typo, not a deadline."""
MAX_PREFILL_TOKENS_PER_S = 1e9
"""No engine prefills a billion tokens a second: a bigger rate is a typo (it declines nothing)."""


@dataclass(slots=True, frozen=True)
class TierSettings:
    """A secondary tier's I/O settings; every value is checked when the record is built."""

    io_threads: int = setting_field(Kind.INT, 4, "threads moving this tier's bytes", minimum=1,
                                    maximum=MAX_IO_THREADS, env="KVTIER_IO_THREADS")
    store_threads: int | None = setting_field(
        Kind.INT, None,
        "of the io_threads, how many may run stores at once (the others stay free for "
        "loads); unset: the backend's choice, 1 for a buffered file tier without fsync (its "
        "stores are CPU-bound copies into the page cache that side by side only wait for the "
        "interpreter lock), all of them for the others",
        minimum=1, maximum=MAX_IO_THREADS, nullable=True, env="KVTIER_STORE_THREADS")
    max_pending_store_bytes: int = setting_field(
        Kind.SIZE, 256 * 1024**2,
        "backpressure: store payload in flight at most this; more waits its turn (see "
        "store_stall_s)", minimum=0,
        env="KVTIER_MAX_PENDING_STORE_BYTES")
    max_pending_store_jobs: int = setting_field(
        Kind.INT, 1024, "backpressure: store jobs in flight at most this; more wait their turn",
        minimum=1, env="KVTIER_MAX_PENDING_STORE_JOBS")
    load_timeout_s: float = setting_field(
        Kind.FLOAT, DEFAULT_LOAD_TIMEOUT_S,
        "a load job not finished this long after it was submitted fails for its keys (they "
        "are marked missing and the request recomputes them); its slots stay out of use "
        "until the stuck backend call returns, so it never writes a slot that holds another "
        "block (under vLLM, which reuses chunks at once, the job is reported then)",
        minimum=MIN_LOAD_TIMEOUT_S, maximum=MAX_TIMEOUT_S, unit="seconds",
        env="KVTIER_LOAD_TIMEOUT_S")
    prefill_tokens_per_s: float | None = setting_field(
        Kind.FLOAT, None,
        "the engine's prefill rate: a hit whose load from this tier (at its measured rate) "
        "would take longer than recomputing it at this rate is answered absent and counted "
        "(kvtier_loads_declined_total); unset: never declined",
        minimum=0.0, strict_min=True, maximum=MAX_PREFILL_TOKENS_PER_S, unit="tokens/s",
        nullable=True, env="KVTIER_PREFILL_TOKENS_PER_S")

    store_stall_s: float = setting_field(
        Kind.FLOAT, 5.0,
        "back-pressure: when more stores wait for this tier than half the CPU pool, the "
        "scheduler waits for its store jobs as long as one finishes at least this often; a "
        "tier that finishes none for this long is stalled and the excess is shed (counted)",
        minimum=MIN_LOAD_TIMEOUT_S, maximum=MAX_TIMEOUT_S, unit="seconds",
        env="KVTIER_STORE_STALL_S")

    def __post_init__(self) -> None:
        check_record(self, TIER_IO_SETTINGS, "tier")

    @classmethod
    def parse(cls, values: Mapping[str, Any], path: str = "") -> TierSettings:
        """The record of ``values`` (objects or strings); unknown names are rejected."""
        return parse_record(cls, TIER_IO_SETTINGS, values, path)


TIER_IO_SETTINGS = record_table("secondary tier I/O", TierSettings)

TIER_SETTINGS = SettingsTable("secondary tier", [
    Setting("url", Kind.STR, None, "backend URL: memory://, file:///abs/dir, redis://host:port/db,"
            " redis+cluster://host:port, s3://bucket/prefix", required=True),
    Setting("name", Kind.STR, None,
            "tier name (metrics, stats); default: the scheme, made unique", nullable=True),
    *TIER_IO_SETTINGS,
])


@dataclass(frozen=True, slots=True)
class LookupConfig:
    """Per-tier settings of the tier's AsyncLookupManager (:data:`LOOKUP_SETTINGS`); a setting
    that is not set takes the lookup manager's default."""

    values: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __getattr__(self, name: str) -> Any:
        if name in LOOKUP_SETTINGS:
            return self.values.get(name)
        raise AttributeError(name)

    def as_kwargs(self) -> dict[str, Any]:
        """The settings that are set, as keyword arguments for AsyncLookupManager."""
        return {name: value for name, value in self.values.items() if value is not None}

    @classmethod
    def from_dict(cls, values: object, path: str) -> LookupConfig:
        if values is None:
            return cls()
        parsed = LOOKUP_SETTINGS.parse(mapping_of(values, path), path, fill_defaults=False)
        return cls(MappingProxyType(parsed))


class PrefetchMode(enum.Enum):
    """Whether the manager prefetches finished chains back into the pool between turns."""

    OFF = "off"
    ON = "on"


MAX_PREFETCH_POOL_FRACTION = 0.9
"""Prefetch may never hold the whole pool: demand always keeps a tenth."""


@dataclass(slots=True, frozen=True)
class PrefetchSettings:
    """The manager's session-aware prefetch; every value is checked when the record is built."""

    mode: str = setting_field(
        Kind.CHOICE, PrefetchMode.OFF.value,
        "on: when a request finishes, its chain (session: RequestContext.session_id, else "
        "the chain's first key) is promoted back into the pool while the session pauses, "
        "within the budgets below; demand loads and stores always go first",
        choices=tuple(mode.value for mode in PrefetchMode), env="KVTIER_PREFETCH")
    pool_fraction: float = setting_field(
        Kind.FLOAT, 0.5, "share of the primary pool that prefetched blocks not used yet and "
        "prefetches in flight may hold", minimum=0.0, maximum=MAX_PREFETCH_POOL_FRACTION,
        env="KVTIER_PREFETCH_POOL_FRACTION")
    io_fraction: float = setting_field(
        Kind.FLOAT, 0.5, "share of each tier's I/O threads prefetch loads may occupy (at least "
        "one load job of up to 64 blocks in flight per tier)", minimum=0.0, maximum=1.0,
        env="KVTIER_PREFETCH_IO_FRACTION")
    max_chains: int = setting_field(
        Kind.INT, 256, "finished chains remembered; the oldest is forgotten first", minimum=1,
        maximum=1 << 20, env="KVTIER_PREFETCH_MAX_CHAINS")
    chain_ttl_s: float = setting_field(
        Kind.FLOAT, 600.0, "a paused chain whose session sends nothing for this long is "
        "forgotten (its prefetched blocks not used count as wasted)", minimum=0.001,
        maximum=MAX_TIMEOUT_S, unit="seconds", env="KVTIER_PREFETCH_CHAIN_TTL_S")

    def __post_init__(self) -> None:
        check_record(self, PREFETCH_SETTINGS, "prefetch")

    @property
    def enabled(self) -> bool:
        return (self.mode == PrefetchMode.ON.value and self.pool_fraction > 0
                and self.io_fraction > 0)

    @classmethod
    def parse(cls, values: Mapping[str, Any], path: str = "prefetch") -> PrefetchSettings:
        """The record of ``values`` (objects or strings); unknown names are rejected."""
        return parse_record(cls, PREFETCH_SETTINGS, values, path)


PREFETCH_SETTINGS = record_table("prefetch", PrefetchSettings)
