"""The lookup manager's probe worker: one daemon thread that calls ``batch_lookup``.

Owner threads: the worker thread owns only its local variables and its rate-limited error logs.
``busy_since`` (the clock reading when the batch in progress started, None while idle) is
written only by the worker and read by the scheduler thread, which uses it to tell a slow queue
(back-pressure: probes wait their turn) from a stuck backend call (a fault: they time out).
The scheduler thread puts :class:`ProbeBatch` items on ``_requests`` (via :meth:`submit`) and
reads :class:`ProbeResult` items from ``results``; both are ``queue.SimpleQueue``, one producer
and one consumer each. ``_posted`` (results posted so far) is guarded by ``_posted_cond``: the
worker bumps it after each result and :meth:`wait_posted` blocks on it — that is what
``wait_for_probes`` (the engine's GIL-releasing wait) and the tiering manager's idle wait use;
``lookup`` and ``flush`` never take that lock.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from kvtier.backends.stats import RateLimitedLog
from kvtier.keys import BlockKey, RequestContext

__all__ = ["ProbeBatch", "ProbeResult", "ProbeWorker", "as_verdict", "rate_limited_logs"]

_log = logging.getLogger("kvtier.lookup.manager")  # one logger name for the whole manager

LOG_INTERVAL_S: Final = 10.0

Entry = tuple[BlockKey, int, RequestContext]  # key, generation, the request that asked first
BatchLookup = Callable[[list[BlockKey], RequestContext], Sequence[bool]]
LookupScope = Callable[[RequestContext], Hashable]


@dataclass(slots=True)
class ProbeBatch:
    batch_id: int
    entries: list[Entry]


@dataclass(slots=True)
class ProbeResult:
    """One batch's answers as parallel lists (no tuple per key for the scheduler to free):
    ``verdicts[i]`` answers ``keys[i]`` of generation ``generations[i]``; None = a fault."""

    batch_id: int
    keys: list[BlockKey]
    generations: list[int]
    verdicts: list[bool | None]
    call_outcomes: list[bool]  # one per backend call, True = succeeded
    error_keys: int
    answered_at: float


def rate_limited_logs(clock: Callable[[], float], *kinds: str) -> dict[str, RateLimitedLog]:
    """One :class:`RateLimitedLog` per kind of message, for one thread."""
    return {kind: RateLimitedLog(_log, LOG_INTERVAL_S, clock) for kind in kinds}


def as_verdict(item: object) -> bool | None:
    """A trusted verdict, or None when ``item`` is not bool, numpy.bool_ or the int 0/1."""
    if item is True or item is False:
        return bool(item)
    if isinstance(item, np.bool_):
        return bool(item)
    if isinstance(item, (int, np.integer)) and not isinstance(item, bool) and item in (0, 1):
        return bool(item)
    return None


class ProbeWorker:
    """Unions each batch's keys per lookup scope and calls ``batch_lookup`` in chunks of at most
    ``max_batch_keys``; every batch gets exactly one result, whatever the backend does.
    ``lookup_scope`` None: every request shares one scope (the manager's default), so the
    worker does not call it per key."""

    __slots__ = ("_batch_lookup", "_clock", "_lookup_scope", "_max_batch_keys", "_posted",
                 "_posted_cond", "_requests", "_stop", "_tier", "busy_since", "results",
                 "thread")

    def __init__(self, tier_name: str, batch_lookup: BatchLookup,
                 lookup_scope: LookupScope | None, max_batch_keys: int,
                 clock: Callable[[], float]) -> None:
        self._tier = tier_name
        self._batch_lookup = batch_lookup
        self._lookup_scope = lookup_scope
        self._max_batch_keys = max_batch_keys
        self._clock = clock
        self._requests: queue.SimpleQueue[ProbeBatch | None] = queue.SimpleQueue()
        self.results: queue.SimpleQueue[ProbeResult] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._posted_cond = threading.Condition()
        self._posted = 0
        self.busy_since: float | None = None
        self.thread = threading.Thread(target=self._run, name=f"kvtier-lookup-{tier_name}",
                                       daemon=True)
        self.thread.start()

    def submit(self, batch: ProbeBatch) -> None:
        self._requests.put(batch)

    def wait_posted(self, count: int, timeout: float) -> bool:
        """Block at most ``timeout`` s until ``count`` results were posted in all."""
        with self._posted_cond:
            return self._posted_cond.wait_for(lambda: self._posted >= count, timeout)

    def is_progressing(self, now: float, timeout_s: float) -> bool:
        """Alive and not inside a backend call older than ``timeout_s``: batches past their
        deadline are waiting their turn (or for the interpreter lock), not lost."""
        busy_since = self.busy_since
        if busy_since is not None:
            return now - busy_since < timeout_s
        return self.thread.is_alive()

    def stop(self, timeout: float | None) -> bool:
        """Stop after the call in progress (waiting up to ``timeout`` s); True when it stopped."""
        self._stop.set()
        self._requests.put(None)
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def _run(self) -> None:
        logs = rate_limited_logs(self._clock, "worker", "error", "length", "type")
        while True:
            batch = self._requests.get()
            if batch is None or self._stop.is_set():
                return
            self.busy_since = self._safe_now()
            try:
                result = self._probe(batch, logs)
            except BaseException as exc:  # the worker survives everything, even odd scopes
                logs["worker"].warning("tier %s: probe worker error %r; answering False",
                                       self._tier, exc)
                entries = batch.entries
                result = ProbeResult(
                    batch.batch_id, [entry[0] for entry in entries],
                    [entry[1] for entry in entries], [None] * len(entries),
                    [False], len(entries), self._safe_now())
            self.results.put(result)
            self.busy_since = None
            with self._posted_cond:
                self._posted += 1
                self._posted_cond.notify_all()

    def _safe_now(self) -> float:
        try:
            return float(self._clock())
        except Exception:
            return -math.inf

    def _probe(self, batch: ProbeBatch, logs: dict[str, RateLimitedLog]) -> ProbeResult:
        answered_keys: list[BlockKey] = []
        answered_generations: list[int] = []
        answers: list[bool | None] = []
        outcomes: list[bool] = []
        error_keys = 0
        chunk_size = self._max_batch_keys
        for req_context, keys, generations in self._groups(batch.entries):
            for start in range(0, len(keys), chunk_size):
                chunk = keys[start : start + chunk_size]
                answered_keys += chunk
                answered_generations += generations[start : start + chunk_size]
                verdicts = self._call_backend(chunk, req_context, logs)
                if verdicts is None:
                    outcomes.append(False)
                    error_keys += len(chunk)
                    answers += [None] * len(chunk)
                else:
                    outcomes.append(True)
                    answers += verdicts
        return ProbeResult(batch.batch_id, answered_keys, answered_generations, answers,
                           outcomes, error_keys, self._clock())

    def _groups(self, entries: list[Entry]
                ) -> Iterable[tuple[RequestContext, list[BlockKey], list[int]]]:
        """(context of the scope's first request, keys, generations) per lookup scope."""
        if self._lookup_scope is None:  # one scope: no per-key scope call
            return [(entries[0][2], [entry[0] for entry in entries],
                     [entry[1] for entry in entries])] if entries else []
        groups: dict[Hashable, tuple[RequestContext, list[BlockKey], list[int]]] = {}
        for key, generation, req_context in entries:
            scope = self._lookup_scope(req_context)
            group = groups.get(scope)
            if group is None:
                groups[scope] = (req_context, [key], [generation])
            else:
                group[1].append(key)
                group[2].append(generation)
        return groups.values()

    def _call_backend(self, keys: list[BlockKey], req_context: RequestContext,
                      logs: dict[str, RateLimitedLog]) -> list[bool] | None:
        """The validated verdicts, or None when the call or its result is faulty."""
        tier = self._tier
        try:
            raw = self._batch_lookup(keys, req_context)
            # One more than expected is enough to detect a result that is too long.
            items: list[object] = list(itertools.islice(raw, len(keys) + 1))
        except Exception as exc:
            logs["error"].warning("tier %s: batch_lookup of %d keys failed: %r",
                                  tier, len(keys), exc)
            return None
        if len(items) != len(keys):
            logs["length"].warning("tier %s: batch_lookup returned %s items for %d keys", tier,
                                   f"{len(items)}" if len(items) <= len(keys) else "too many",
                                   len(keys))
            return None
        for item in items:  # the common answer: only bools, nothing to convert
            if item is not True and item is not False:
                break
        else:
            return items  # type: ignore[return-value]  # every item is a bool (tested above)
        verdicts: list[bool] = []
        for index, item in enumerate(items):
            verdict = as_verdict(item)
            if verdict is None:
                logs["type"].warning("tier %s: batch_lookup result[%d] is %s %r, expected a bool",
                                     tier, index, type(item).__name__, item)
                return None
            verdicts.append(verdict)
        return verdicts
