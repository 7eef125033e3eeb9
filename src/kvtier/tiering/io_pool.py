"""Deadlines: the load-deadline setting, the shutdown bound, and the I/O thread pool that makes
them enforceable (its threads never keep the interpreter alive).

Thread ownership:

- :class:`IoThreadPool`: ``submit`` and ``shutdown`` are called by the owner of the pool (a
  tier's scheduler thread); the task queue (a ``queue.SimpleQueue``) is the only state shared
  with the worker threads, which take tasks from it until they get the stop sentinel. The
  thread list and the lifecycle flag are owned by the owner thread.

Why not ``concurrent.futures.ThreadPoolExecutor``: its threads are joined at interpreter exit,
so one backend call stuck forever (a FIFO opened for reading, a SIGSTOPped server with no socket
timeout) makes the whole process hang on exit. These threads are daemons: a stuck call is
abandoned, never waited for past the documented bound.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from kvtier.errors import ClosedError

DEFAULT_LOAD_TIMEOUT_S = 30.0
SHUTDOWN_EXTRA_PER_TIER_S = 2.5
"""Past ``shutdown(timeout)``, each tier may take this long to stop its probe worker (2 s at
most) and close its backend; ``TieringManager.shutdown(timeout)`` returns within
``timeout + tiers * SHUTDOWN_EXTRA_PER_TIER_S`` seconds."""



PoolClosedError = ClosedError  # the one closed error; this name is kept for callers


_STOP = None


class IoThreadPool:
    """``max_workers`` daemon threads running submitted callables in FIFO order.

    The threads start with the pool, not on demand: ``Thread.start`` waits until the new
    thread runs, which took 6-10 ms on the scheduler thread in a fresh vLLM engine's first load
    (three starts while the lock was contended; ``benchmarks/engine_load.py --trace``). A task
    must not raise (the tier's task catches everything); if one does, the thread logs nothing
    and carries on.
    """

    __slots__ = ("_open", "_tasks", "_threads")

    def __init__(self, max_workers: int, name_prefix: str) -> None:
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers must be an int >= 1, got {max_workers!r}")
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, daemon=True,
                                          name=f"{name_prefix}_{index}")
                         for index in range(max_workers)]
        self._open = True
        for thread in self._threads:
            thread.start()

    def submit(self, task: Callable[[], None]) -> None:
        if not self._open:
            raise PoolClosedError("the I/O thread pool is shut down")
        self._tasks.put(task)

    def _work(self) -> None:
        while True:
            task = self._tasks.get()
            if task is _STOP:
                return
            try:
                task()
            except Exception:  # a task owns its error handling; the thread survives
                continue

    def shutdown(self, timeout: float) -> bool:
        """Stop accepting tasks, drop the waiting ones, and wait up to ``timeout`` s for the
        threads to finish their current task. True when every thread exited; a thread stuck
        in a call is left behind (it is a daemon: it never holds up interpreter exit)."""
        self._open = False
        while True:  # waiting tasks are dropped: their jobs are failed or abandoned by the owner
            try:
                self._tasks.get_nowait()
            except queue.Empty:
                break
        for _ in self._threads:
            self._tasks.put(_STOP)
        deadline = time.monotonic() + max(0.0, timeout)
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    @property
    def alive_threads(self) -> int:
        return sum(thread.is_alive() for thread in self._threads)
