"""Bounded loads and exits: a load past its deadline fails for its keys (the request
recomputes), a stuck backend call never writes a slot afterwards, ``shutdown()`` returns within
its documented bound, and a process whose backend hangs forever still exits."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvtier.backends import open_backend
from kvtier.config import ConfigError, load_config
from kvtier.factory import open_manager
from kvtier.keys import Namespace, RequestContext, chain_keys
from kvtier.tiering.io_pool import DEFAULT_LOAD_TIMEOUT_S, SHUTDOWN_EXTRA_PER_TIER_S, IoThreadPool
from kvtier.tiering.manager import KeyStatus
from kvtier.tiering.tier import SecondaryTier
from kvtier.tiering.tier_settings import TierSettings

BLOCK = 4096


class _HeldBackend:
    """A memory backend whose ``get_many`` blocks until released: a mock, because no real
    medium can be made to hang and then answer with a *valid* frame at a moment the test picks
    (the FIFO scenario below is the real-part version of the hang)."""

    def __init__(self) -> None:
        self._inner = open_backend("memory://", Namespace(model="held"))
        self.entered = threading.Event()
        self.release = threading.Event()

    def get_many(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[bool]:
        self.entered.set()
        self.release.wait(60)
        return self._inner.get_many(keys, outs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_a_load_past_its_deadline_fails_and_its_buffer_is_released_when_the_call_ends() -> None:
    backend = _HeldBackend()
    key = b"k" * 16
    assert backend.put_many([key], [b"\x07" * BLOCK]) == [True]
    tier = SecondaryTier("held", backend, TierSettings(load_timeout_s=0.05))  # type: ignore[arg-type]
    slot = bytearray(BLOCK)
    job = tier.submit_load([key], [memoryview(slot)])
    assert backend.entered.wait(30)
    started = time.monotonic()
    finished = tier.get_finished_jobs(wait=True, timeout=30)
    assert time.monotonic() - started < 10  # woke at the load deadline, not at the timeout
    assert finished == [job]
    assert job.results == (False,) and job.error is not None and "timed out" in job.error
    assert job.abandoned  # the call still runs: the buffer is not the caller's again yet
    stats = tier.stats()
    assert stats["load_keys_failed"] == 1 and stats["loads_abandoned"] == 1
    assert stats["abandoned_loads"] == 1 and tier.take_released_loads() == []
    backend.release.set()  # the stuck call now ends (it may write the buffer: unspecified)
    tier.shutdown(10)      # joins the I/O thread, which posted the job as released
    assert tier.take_released_loads() == [job]
    assert tier.stats()["abandoned_loads"] == 0
    assert job.results == (False,)  # a late answer never turns a failed load into a hit


def test_an_abandoned_load_keeps_its_primary_slot_out_of_use_until_its_call_ends() -> None:
    """The manager retires the slot of a timed-out load (no key, never handed out), so a late
    write from the stuck call can never land in a slot that holds another block; the slot
    comes back once the call ended. The held backend is an injected fault (see above)."""
    backend = _HeldBackend()
    namespace = Namespace(model="retire")
    m = open_manager({"block_bytes": BLOCK, "primary_bytes": BLOCK * 2, "namespace": {
        "model": "retire"}, "metrics_registry": "disabled",
        "secondary_tiers": [{"url": "memory://", "load_timeout_s": 0.05}]})
    try:
        tier = m.tiers[0]
        tier._backend = backend  # inject the hold
        key = chain_keys(list(range(16)), 16, namespace)[0]
        assert backend.put_many([key], [b"\x07" * BLOCK]) == [True]
        tier.lookup_manager.note_stored([key])
        reader = RequestContext("r")
        assert m.lookup(key, reader) is KeyStatus.HIT_PENDING
        m.on_schedule_end()
        assert backend.entered.wait(30)
        assert not m.wait_idle(0.5)  # the deadline passes: failed, slot retired, call running
        stats = m.get_stats()
        assert stats["manager"]["promotions_failed"] == 1
        assert stats["manager"]["retired_slots"] == 1
        assert m.pool.free_slots == 1 and m.pool.occupancy().retired == 1
        assert m.lookup(key, reader) is KeyStatus.MISS  # quarantined: recompute
        backend.release.set()
        assert m.wait_idle(10)  # waits for the call to end: the slot is back
        assert m.pool.occupancy().retired == 0 and m.pool.free_slots == 2
        assert m.get_stats()["manager"]["retired_slots"] == 0
        m.on_request_finished(reader)
    finally:
        backend.release.set()
        m.shutdown(10)


def test_load_timeout_is_a_tier_setting_with_bounds() -> None:
    base = {"block_bytes": BLOCK, "primary_bytes": BLOCK, "namespace": {"model": "m"}}
    tier = load_config({**base, "secondary_tiers": ["memory://"]}).secondary_tiers[0]
    assert tier.load_timeout_s == DEFAULT_LOAD_TIMEOUT_S
    tier = load_config({**base, "secondary_tiers": [{"url": "memory://",
                                                     "load_timeout_s": "2.5"}]})
    assert tier.secondary_tiers[0].load_timeout_s == 2.5
    assert "load_timeout_s" not in tier.secondary_tiers[0].options  # not a backend option
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.load_timeout_s: expected"):
        load_config({**base, "secondary_tiers": [{"url": "memory://", "load_timeout_s": 0}]})


def test_io_threads_are_daemons_and_shutdown_is_bounded() -> None:
    pool = IoThreadPool(2, "test-io")
    stuck, running = threading.Event(), threading.Event()

    def hang() -> None:
        running.set()
        stuck.wait(60)

    pool.submit(hang)
    assert running.wait(10)  # taken by a thread, not still waiting (shutdown drops those)
    started = time.monotonic()
    assert pool.shutdown(0.2) is False  # the stuck task is abandoned, not waited for
    assert time.monotonic() - started < 5
    assert all(thread.daemon for thread in threading.enumerate()
               if thread.name.startswith("test-io"))
    stuck.set()


_FIFO_SCENARIO = textwrap.dedent("""
    import json, os, sys, time
    from kvtier.keys import Namespace, RequestContext, chain_keys
    from kvtier.factory import open_manager

    root, block = sys.argv[1], 4096
    config = {"block_bytes": block, "primary_bytes": block * 8, "namespace": {"model": "fifo"},
              "metrics_registry": "disabled",
              "secondary_tiers": [{"url": "file://" + root, "load_timeout_s": 0.5}]}
    keys = chain_keys(list(range(48)), 16, Namespace(model="fifo"))
    writer = open_manager(config)
    ctx = RequestContext("w")
    plan = writer.prepare_store(keys, ctx)
    for slot in plan.slots:
        writer.primary_view(slot)[:] = b"\\x01" * block
    writer.complete_store(plan.keys, ctx)
    writer.on_request_finished(ctx)
    writer.on_schedule_end()
    writer.wait_idle(30)
    writer.shutdown(10)

    m = open_manager(config)
    fifo = m.tiers[0].backend.path_for(keys[0])
    os.unlink(fifo)
    os.mkfifo(fifo)                  # opening it for reading blocks forever: nobody writes
    reader = RequestContext("r")
    started = time.monotonic()
    answer = None
    for _ in range(40):              # a bounded number of steps, each at most 0.25 s
        answer = m.lookup_prefix(keys, reader)
        if answer is not None:
            break
        m.on_schedule_end()
        m.wait_idle(0.25)
    answered_s = time.monotonic() - started
    m.on_request_finished(reader)
    stats = m.get_stats()["tiers"][m.tier_names[0]]
    started = time.monotonic()
    m.shutdown(2.0)
    shutdown_s = time.monotonic() - started
    print(json.dumps({"answer": answer, "answered_s": answered_s, "shutdown_s": shutdown_s,
                      "load_keys_failed": stats["load_keys_failed"]}), flush=True)
    # the interpreter must now exit although an I/O thread is stuck in open() on the FIFO
""")


def test_a_hung_load_times_out_and_the_process_still_exits(tmp_path: Path) -> None:
    """A real FIFO at a block path (opening it for reading would block forever): the file tier
    never opens it (it is not a regular file), the key answers absent, the request recomputes,
    and shutdown and interpreter exit stay bounded. The load deadline for a backend call that
    really hangs is pinned by the held-backend test above."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _FIFO_SCENARIO, str(tmp_path / "tier")],
                          capture_output=True, text=True, timeout=60)
    wall_s = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["answer"] == 0           # the key recomputes (it is the first block)
    assert result["answered_s"] < 10       # about the 0.5 s deadline, not forever
    assert result["shutdown_s"] < 2.0 + SHUTDOWN_EXTRA_PER_TIER_S
    assert wall_s < 45                     # and the process exited


def test_tier_rejects_a_bad_load_timeout() -> None:
    backend = open_backend("memory://", Namespace(model="m"))
    with pytest.raises(ValueError, match=r"load_timeout_s: expected a finite number >= 0\.001"):
        TierSettings(load_timeout_s=0)
    with pytest.raises(ValueError, match=r"load_timeout_s: expected a finite number >= 0\.001"):
        SecondaryTier("t", backend, load_timeout_s=0)
    backend.close()
    assert RequestContext("x").req_id == "x"


def test_the_io_threads_start_with_the_pool_not_in_a_submit() -> None:
    """``Thread.start`` waits until the new thread runs: started in ``submit``, a fresh engine's
    first load paid for it on the scheduler thread. So every thread runs from construction on,
    and a submit starts none."""
    pool = IoThreadPool(3, "test-eager")
    try:
        assert pool.alive_threads == 3
        names = {thread.name for thread in threading.enumerate()}
        assert {"test-eager_0", "test-eager_1", "test-eager_2"} <= names
        done = [threading.Event() for _ in range(5)]
        for event in done:
            pool.submit(event.set)
        assert all(event.wait(10) for event in done)
        assert pool.alive_threads == 3
        assert sum(thread.name.startswith("test-eager") for thread in threading.enumerate()) == 3
    finally:
        assert pool.shutdown(5)
