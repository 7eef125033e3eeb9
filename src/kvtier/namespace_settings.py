"""The settings of a :class:`~kvtier.keys.Namespace` (the config's ``namespace`` section).

This module owns no mutable state: the table is frozen, safe to share between threads. It sits
beside :mod:`kvtier.keys` in the basics layer so that the config loader and the vLLM tier (which
takes ``model``, ``revision`` and ``tenant``) share one declaration.
"""

from __future__ import annotations

from kvtier.settings import Kind, Setting, SettingsTable

__all__ = ["NAMESPACE_SETTINGS"]

NAMESPACE_SETTINGS = SettingsTable("namespace", [
    Setting("model", Kind.STR, "", "model name (required in a config; under vLLM: vLLM's)",
            env="KVTIER_NAMESPACE_MODEL"),
    Setting("revision", Kind.STR, "", "model revision", env="KVTIER_NAMESPACE_REVISION"),
    Setting("dtype", Kind.STR, "", "KV cache dtype", env="KVTIER_NAMESPACE_DTYPE"),
    Setting("kv_layout", Kind.STR, "", "KV cache layout", env="KVTIER_NAMESPACE_KV_LAYOUT"),
    Setting("block_size", Kind.INT, 0, "tokens per block (0: unknown)", minimum=0,
            unit="tokens", env="KVTIER_NAMESPACE_BLOCK_SIZE"),
    Setting("world_size", Kind.INT, 1, "ranks sharing the model", minimum=1,
            env="KVTIER_NAMESPACE_WORLD_SIZE"),
    Setting("rank", Kind.INT, 0, "this process's rank (< world_size)", minimum=0,
            env="KVTIER_NAMESPACE_RANK"),
    Setting("tenant", Kind.STR, "", "tenant: tenants never read each other's blocks",
            env="KVTIER_NAMESPACE_TENANT"),
])
