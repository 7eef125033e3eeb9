"""The settings of the vLLM :class:`~kvtier.integrations.vllm.KvtierTier`.

This module owns no mutable state: the table is frozen, safe to share between threads. The
table reuses the declarations it shares with a secondary tier (``url``, ``io_threads``,
``load_timeout_s``, ``prefill_tokens_per_s``) and with the namespace (``model``, ``revision``,
``tenant``), so each of those settings exists once. :func:`kvtier.settings.register_table`
makes it known to the config loader's docs and env checks without the loader importing this
module.
"""

from __future__ import annotations

from kvtier.namespace_settings import NAMESPACE_SETTINGS
from kvtier.settings import Kind, Setting, SettingsTable, register_table
from kvtier.tiering.tier import IO_YIELD_S
from kvtier.tiering.tier_settings import TIER_SETTINGS

__all__ = ["VLLM_TIER_SETTINGS"]

VLLM_TIER_SETTINGS = register_table(SettingsTable("vLLM KvtierTier", [
    TIER_SETTINGS["url"],
    TIER_SETTINGS["io_threads"],
    TIER_SETTINGS["load_timeout_s"],
    TIER_SETTINGS["prefill_tokens_per_s"],
    Setting("max_blocks_per_call", Kind.INT, 32, "keys per backend get/put call", minimum=1,
            env="KVTIER_MAX_BLOCKS_PER_CALL"),
    Setting("locality", Kind.CHOICE, None, "what vLLM is told; default: REMOTE for network "
            "backends, LOCAL for memory:// and file://", choices=("local", "remote"),
            nullable=True, env="KVTIER_LOCALITY"),
    Setting("enable_kv_events", Kind.BOOL, False,
            "emit KV events for stored blocks (needs vLLM's --kv-events-config)",
            env="KVTIER_ENABLE_KV_EVENTS"),
    Setting("prefetch_bytes", Kind.SIZE, 0,
            "staging memory for blocks read ahead when a request finishes, so the next "
            "turn's load is a memory copy (0: off; else at least one block)",
            minimum=0, maximum=1 << 40, unit="bytes", env="KVTIER_PREFETCH_BYTES"),
    Setting("prefetch_ttl_s", Kind.FLOAT, 300.0,
            "a staged block unused this long is dropped (wasted)", minimum=0.0,
            maximum=86400.0, strict_min=True, unit="seconds", env="KVTIER_PREFETCH_TTL_S"),
    Setting("io_yield_ms", Kind.FLOAT, IO_YIELD_S * 1e3,
            "how long the scheduler waits at the end of a step for this tier's in-flight probes "
            "and for a load due within it by the measured load rate (or overdue), handing the "
            "interpreter lock to its I/O threads (0: never)",
            minimum=0.0, maximum=100.0, unit="milliseconds", env="KVTIER_IO_YIELD_MS"),
    NAMESPACE_SETTINGS["model"],
    NAMESPACE_SETTINGS["revision"],
    NAMESPACE_SETTINGS["tenant"],
]))
