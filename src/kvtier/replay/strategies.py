"""Lookup strategies compared by ``kvtier replay --compare``.

- ``kvtier``: the tier's lookup manager as configured (one backend call per step for all
  requests, in-flight probes shared, verdict cache).
- ``per-request``: how vLLM batches: one backend call per request per step (``lookup_scope`` is
  the request id), no verdict cache (``verdict_ttl_s = 0``). In-flight probes are still shared.
- ``no-reuse``: per-request calls, no verdict cache, and no probe is ever shared: each request
  probes every key itself (its states are keyed by request and key).

The two baselines are :class:`~kvtier.lookup.AsyncLookupManager` subclasses that
``open_manager(lookup_factory=...)`` puts into each secondary tier. Each lookup manager is owned
by its manager's scheduler thread (its probe worker calls ``backend.exists``), exactly like the
tier's own.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.keys import BlockKey, RequestContext
from kvtier.lookup.manager import AsyncLookupManager

if TYPE_CHECKING:
    from kvtier.backends.base import Backend
    from kvtier.tiering.tier import LookupFactory


class Strategy(enum.Enum):
    KVTIER = "kvtier"
    PER_REQUEST = "per-request"
    NO_REUSE = "no-reuse"

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    Strategy.KVTIER: "kvtier as configured: one call per step, shared probes, verdict cache",
    Strategy.PER_REQUEST: "one call per request per step, no verdict cache (vLLM-style)",
    Strategy.NO_REUSE: "per-request calls, no verdict cache, no in-flight reuse",
}


class _PerRequestLookup(AsyncLookupManager):
    """One ``backend.exists`` call per request per step; in-flight probes still shared."""

    def __init__(self, tier_name: str, backend: Backend, options: Mapping[str, Any]) -> None:
        self._backend = backend
        super().__init__(tier_name, **{**options, "verdict_ttl_s": 0.0})

    def lookup_scope(self, req_context: RequestContext) -> Hashable:
        return req_context.req_id

    def batch_lookup(self, keys: list[BlockKey], req_context: RequestContext) -> Sequence[bool]:
        return self._backend.exists(keys)


class _NoReuseLookup(_PerRequestLookup):
    """Never shares a probe: a key's state is private to the request that asked.

    The request id is prepended to the key inside this lookup manager only; the backend is asked
    about the real key. ``mark_miss`` / ``note_*`` from the manager use real keys and so do not
    reach these private states, which is the point of the baseline (nothing is shared).
    """

    def lookup(self, key: BlockKey, req_context: RequestContext) -> bool | None:
        return super().lookup(_private_key(req_context.req_id, key), req_context)

    def batch_lookup(self, keys: list[BlockKey], req_context: RequestContext) -> Sequence[bool]:
        cut = len(_private_key(req_context.req_id, b""))
        return self._backend.exists([key[cut:] for key in keys])


def _private_key(req_id: str, key: BlockKey) -> BlockKey:
    return req_id.encode("utf-8") + b"\0" + key


_LOOKUP_CLASSES: dict[Strategy, type[_PerRequestLookup]] = {
    Strategy.PER_REQUEST: _PerRequestLookup,
    Strategy.NO_REUSE: _NoReuseLookup,
}


def manager_config_for(
    strategy: Strategy,
    *,
    block_bytes: int,
    primary_bytes: int,
    eviction_policy: str,
    write_policy: str,
    tier_urls: Sequence[str],
    namespace: Mapping[str, Any],
    prefetch: str = "off",
) -> dict[str, Any]:
    """The ``open_manager`` config of one replay instance (``prefetch``: "on" or "off")."""
    tiers: list[dict[str, Any]] = []
    for url in tier_urls:
        tier: dict[str, Any] = {"url": url}
        if strategy is not Strategy.KVTIER:
            tier["lookup"] = {"verdict_ttl_s": 0.0}
        tiers.append(tier)
    return {
        "block_bytes": block_bytes,
        "primary_bytes": primary_bytes,
        "eviction_policy": eviction_policy,
        "write_policy": write_policy,
        "secondary_tiers": tiers,
        "namespace": dict(namespace),
        "prefetch": {"mode": prefetch},
    }


def lookup_factory_for(strategy: Strategy) -> LookupFactory | None:
    """The ``open_manager(lookup_factory=...)`` of a strategy; None keeps the tier's own."""
    lookup_class = _LOOKUP_CLASSES.get(strategy)
    if lookup_class is None:
        return None

    def factory(name: str, backend: Backend, options: Mapping[str, Any]) -> AsyncLookupManager:
        return lookup_class(name, backend, options)

    return factory
