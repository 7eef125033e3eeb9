"""Thread-free stand-ins for the tiering tables' unit tests: a pool with resident blocks and a
fake secondary tier that records what it is asked to transfer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.primary import PrimaryPool
from kvtier.tiering.events import Counters, EventLog
from kvtier.tiering.tier import JobKind, TierJob

BLOCK = 16


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def make_pool(num_slots: int = 4) -> PrimaryPool:
    return PrimaryPool(BLOCK, num_slots)


def resident(pool: PrimaryPool, key: bytes, fill: int = 0) -> int:
    reservation = pool.reserve(key)
    if reservation is None:
        raise RuntimeError("no slot in the test pool")
    pool.view(reservation.slot)[:] = bytes([fill]) * BLOCK
    return pool.commit(key)


def tables() -> tuple[Counters, EventLog]:
    counters = Counters()
    return counters, EventLog(100, counters)


def finished(job_id: int, kind: JobKind, keys: Sequence[bytes], results: Sequence[bool],
             *, abandoned: bool = False) -> TierJob:
    return TierJob(job_id, kind, tuple(keys), (), 0, results=tuple(results),
                       abandoned=abandoned)


@dataclass
class FakeTier:
    """Records submissions; ``accept`` is the backpressure answer, ``shed`` makes
    ``submit_store`` return None."""

    name: str = "fake"
    accept: bool = True
    shed: bool = False
    loads: list[tuple[list[bytes], list[memoryview]]] = field(default_factory=list)
    stores: list[tuple[list[bytes], list[Any]]] = field(default_factory=list)
    shed_counts: list[int] = field(default_factory=list)
    released: list[TierJob] = field(default_factory=list)
    done: list[TierJob] = field(default_factory=list)  # handed out by get_finished_jobs
    next_id: int = 0

    def submit_load(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> TierJob:
        self.loads.append((list(keys), list(outs)))
        return self._job(JobKind.LOAD, keys)

    def can_accept_store(self, nbytes: int) -> bool:
        return self.accept

    def submit_store(self, keys: Sequence[bytes], payloads: Sequence[Any]) -> TierJob | None:
        if self.shed:
            return None
        self.stores.append((list(keys), list(payloads)))
        return self._job(JobKind.STORE, keys)

    def count_shed(self, keys: int) -> None:
        self.shed_counts.append(keys)

    def get_finished_jobs(self, wait: bool = False,
                          timeout: float | None = None) -> list[TierJob]:
        done, self.done = self.done, []
        return done

    def take_released_loads(self, wait_s: float = 0.0) -> list[TierJob]:
        released, self.released = self.released, []
        return released

    def _job(self, kind: JobKind, keys: Sequence[bytes]) -> TierJob:
        self.next_id += 1
        return TierJob(self.next_id, kind, tuple(keys), (), 0)
