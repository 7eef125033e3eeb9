"""``open_manager``: build the whole tiering stack (pool, backends, tiers, metrics) from a config.

It sits on the config floor: it loads a config, then builds the layers below from it.

Owns no state: it builds a :class:`~kvtier.tiering.manager.TieringManager`, which owns it all.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import prometheus_client

from kvtier.config import KvtierConfig, load_config
from kvtier.ops.metrics import KvtierMetrics, MetricsRegistry
from kvtier.primary import PrimaryPool
from kvtier.settings import ConfigError
from kvtier.tiering.manager import TieringManager
from kvtier.tiering.tier import LookupFactory, SecondaryTier

__all__ = ["open_manager"]


def open_manager(
    config: KvtierConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    lookup_factory: LookupFactory | None = None,
    **overrides: Any,
) -> TieringManager:
    """Build the whole stack (pool, backends, tiers, metrics) from a config.

    ``config`` is a :class:`KvtierConfig`, a dict, a YAML file path, or None for the ``KVTIER_*``
    environment; ``overrides`` replace top-level keys. ``clock`` drives every tier's lookup
    manager, quarantines and load deadlines (tests inject one); ``lookup_factory`` replaces
    each tier's lookup manager (see :class:`~kvtier.tiering.tier.SecondaryTier`). Raises
    :class:`ConfigError` naming the bad key path, including for a backend URL or option the
    backend rejects.
    """
    cfg = load_config(config, **overrides)
    metrics: KvtierMetrics | None
    if cfg.metrics_registry is MetricsRegistry.DISABLED:
        metrics = None
    elif cfg.metrics_registry is MetricsRegistry.GLOBAL:
        try:
            metrics = KvtierMetrics(prometheus_client.REGISTRY)
        except ValueError as exc:
            raise ConfigError(
                f"metrics_registry: 'global' failed ({exc}); another manager in this process "
                f"already registered kvtier metrics — use 'private'"
            ) from None
    else:
        metrics = KvtierMetrics()
    from kvtier.backends import open_backend  # lazy: backends import redis/boto3 on demand

    tiers: list[SecondaryTier] = []
    pool: PrimaryPool | None = None
    try:
        for index, tier_cfg in enumerate(cfg.secondary_tiers):
            try:
                backend = open_backend(tier_cfg.url, cfg.namespace, **dict(tier_cfg.options))
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"secondary_tiers[{index}]: {exc}") from None
            try:
                tiers.append(SecondaryTier(
                    tier_cfg.name, backend, tier_cfg.settings, lookup=tier_cfg.lookup,
                    metrics=metrics, clock=clock, lookup_factory=lookup_factory,
                ))
            except (ValueError, TypeError) as exc:
                backend.close()
                raise ConfigError(f"secondary_tiers[{index}]: {exc}") from None
        pool = PrimaryPool(cfg.block_bytes, cfg.num_slots, cfg.eviction_policy,
                           backing=cfg.primary_backing, path=cfg.primary_path)
        return TieringManager(
            pool, tiers, namespace=cfg.namespace, write_policy=cfg.write_policy,
            metrics=metrics, clock=clock, max_events=cfg.max_events,
            owns_global_metrics=cfg.metrics_registry is MetricsRegistry.GLOBAL,
            prefetch=cfg.prefetch,
        )
    except BaseException:
        for tier in tiers:
            tier.shutdown(5.0)
        if pool is not None:
            pool.close()
        if metrics is not None and cfg.metrics_registry is MetricsRegistry.GLOBAL:
            metrics.unregister()
        raise
