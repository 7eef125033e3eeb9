"""A tier's transfer jobs: what a load or store is, and the part of one that an I/O thread runs.

Thread ownership: a :class:`TierJob` is created and read by the **scheduler thread**; its
progress fields (``running``, ``parts_left``, ``partial``, ``first_error``, ``busy_s``,
``first_began``, ``settled``, ``abandoned``) are written by the **I/O threads** under the tier's
settle lock, and the thread that finishes the last part fills in ``results``, ``error`` and
``seconds`` before posting the job; after posting no I/O thread touches it again; before posting
the scheduler never reads those fields (see :mod:`kvtier.tiering.tier`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvtier.backends.base import Buffer
from kvtier.keys import BlockKey
from kvtier.tiering.plans import LoadPriority

__all__ = ["JobKind", "Part", "TierJob", "so_far"]


class JobKind(enum.Enum):
    LOAD = "load"
    STORE = "store"


@dataclass(slots=True, eq=False)
class TierJob:
    """One batch transfer between a tier's backend and caller buffers.

    ``results`` has one entry per key (True = that key moved) once the job is finished;
    ``error`` is set when a backend call raised (its keys and the rest of its part are False)
    or the load timed out (the keys of parts that had not finished are False).
    """

    job_id: int
    kind: JobKind
    keys: tuple[BlockKey, ...]
    buffers: tuple[Buffer, ...]
    nbytes: int
    results: tuple[bool, ...] = ()
    error: str | None = None
    seconds: float = 0.0
    suspects: tuple[int, ...] = ()  # store: positions whose load failed recently (read back)
    verified: tuple[int, ...] = ()  # store: suspects whose read-back succeeded
    deadline: float = float("inf")  # the tier's clock() past which a load job fails
    priority: LoadPriority = LoadPriority.DEMAND
    settled: bool = False           # results are final (set once, under the tier's settle lock)
    abandoned: bool = False         # a load failed by its deadline while its I/O still runs
    # Progress of its parts (a load runs as parts on several I/O threads), under the settle
    # lock: parts in a backend call now, parts not finished, per-key answers, first error.
    running: int = 0
    parts_left: int = 1
    partial: list[bool] = field(default_factory=list)
    first_error: str | None = None
    busy_s: float = 0.0
    first_began: float = 0.0  # perf_counter() when its first part began (under the settle lock)
    wall_s: float = 0.0       # first part began -> last part ended: what the load rate measures

    @property
    def succeeded(self) -> list[BlockKey]:
        return [key for key, ok in zip(self.keys, self.results, strict=True) if ok]

    @property
    def failed(self) -> list[BlockKey]:
        return [key for key, ok in zip(self.keys, self.results, strict=True) if not ok]


def so_far(job: TierJob) -> tuple[bool, ...]:
    """Per key of ``job``, whether a part that has finished moved it (under the settle lock).
    A part records its answers only when its backend call has returned, so a key of a part
    still running (a stuck NFS server) or never started answers False, and a key a finished part
    moved is delivered, never thrown away with the stuck ones."""
    return tuple(job.partial)


@dataclass(slots=True)
class Part:
    """Keys ``start:end`` of a job: what one I/O thread runs."""

    job: TierJob
    start: int
    end: int
