"""Every scheduler-side call of TieringManager is owner-checked before any state changes.

Before: prepare_store / complete_store / prepare_load from a second thread corrupted the
tables ("OrderedDict mutated during iteration", pins left behind), and shutdown() from a
foreign thread closed the manager and only then raised.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

import kvtier
from kvtier.keys import RequestContext, chain_keys
from kvtier.lookup.manager import OwnerThreadError
from kvtier.tiering.manager import KeyStatus, TieringManager


def _manager() -> TieringManager:
    return kvtier.open_manager({"block_bytes": 4096, "primary_bytes": 16 * 4096,
                                "namespace": {"model": "owner-test"}, "secondary_tiers": []})


def _from_other_thread(call: Callable[[], Any]) -> BaseException | None:
    caught: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            caught.append(exc)

    thread = threading.Thread(target=run, name="intruder")
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive()
    return caught[0] if caught else None


def test_a_second_thread_is_refused_and_changes_nothing() -> None:
    manager = _manager()
    ctx = RequestContext("r1")
    keys = chain_keys(list(range(64)), 16, manager.namespace)
    plan = manager.prepare_store(keys[:2], ctx)  # binds the owner: this thread
    assert plan is not None
    before = manager.pool.occupancy()
    for name, call in [
        ("prepare_store", lambda: manager.prepare_store(keys[2:], RequestContext("r2"))),
        ("complete_store", lambda: manager.complete_store(keys[:2], ctx)),
        ("prepare_load", lambda: manager.prepare_load(keys[:1], ctx)),
        ("lookup", lambda: manager.lookup(keys[0], ctx)),
        ("shutdown", lambda: manager.shutdown()),
    ]:
        error = _from_other_thread(call)
        assert isinstance(error, OwnerThreadError), name
        assert f"{name}()" in str(error) and "nothing was changed" in str(error)
        assert manager.pool.occupancy() == before, name
    manager.complete_store(keys[:2], ctx)  # the owner goes on as if nothing happened
    assert manager.lookup(keys[0], ctx) is KeyStatus.HIT
    manager.on_request_finished(ctx)
    manager.shutdown()
    with pytest.raises(kvtier.errors.ClosedError):
        manager.lookup(keys[0], ctx)
