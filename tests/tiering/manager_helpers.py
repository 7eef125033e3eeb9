"""What the TieringManager tests share: keys and their block bytes, a settable clock, and the
engine's store / step / read calls."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.keys import RequestContext
from kvtier.tiering.manager import TieringManager

BLOCK = 256

Factory = Callable[..., TieringManager]


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def data(key: bytes) -> bytes:
    return (key * (BLOCK // len(key) + 1))[:BLOCK]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def store(manager: TieringManager, keys: Sequence[bytes], ctx: RequestContext) -> None:
    plan = manager.prepare_store(keys, ctx)
    assert plan is not None
    for key, slot in zip(plan.keys, plan.slots, strict=True):
        manager.primary_view(slot)[:] = data(key)
    manager.complete_store(plan.keys, ctx)


def step(manager: TieringManager) -> None:
    manager.on_schedule_end()
    assert manager.wait_idle(10)


def read(manager: TieringManager, keys: Sequence[bytes], ctx: RequestContext) -> list[bytes]:
    plan = manager.prepare_load(keys, ctx)
    result = [bytes(manager.primary_view(slot)) for slot in plan.slots]
    manager.complete_load(keys, ctx)
    return result
