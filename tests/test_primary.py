"""The primary pool: one arena of slots, pins, eviction, shared backings."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from uuid import uuid4

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policies import ARCPolicy
from kvtier.primary import (
    ArenaError,
    ArenaMapping,
    PoolClosedError,
    PoolError,
    PrimaryBacking,
    PrimaryPool,
    SlotState,
    available_memory_bytes,
)
from kvtier.settings import ConfigError


def k(i: int) -> bytes:
    return i.to_bytes(4, "big")


def fill(pool: PrimaryPool, key: bytes) -> int:
    reservation = pool.reserve(key)
    assert reservation is not None
    return pool.commit(key)


def test_geometry_and_views_share_one_contiguous_arena() -> None:
    with PrimaryPool(64, 4) as pool:
        assert pool.num_slots == 4
        assert pool.arena.nbytes == 256
        view = pool.view(2)
        view[:] = b"\x07" * 64
        assert bytes(pool.arena[128:192]) == b"\x07" * 64
        assert pool.as_array()[2].tobytes() == b"\x07" * 64
        assert pool.as_array().base is not None  # a view, not a copy
        with pytest.raises(ValueError, match=r"slot must be an int in \[0, 4\), got 4"):
            pool.view(4)


def test_bad_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match="block_bytes must be an int >= 1, got 0"):
        PrimaryPool(0, 4)
    with pytest.raises(ValueError, match="num_slots"):
        PrimaryPool(64, 0)
    with pytest.raises(ValueError, match="unknown primary backing 'gpu'"):
        PrimaryPool(64, 1, backing="gpu")
    with pytest.raises(ValueError, match="absolute file path"):
        PrimaryPool(64, 1, backing="mmap_file", path="relative.bin")


def test_free_slots_first_then_lru_eviction_reports_the_victim() -> None:
    with PrimaryPool(8, 2) as pool:
        fill(pool, k(1))
        fill(pool, k(2))
        pool.touch(k(1))
        reservation = pool.reserve(k(3))
        assert reservation is not None
        assert reservation.evicted == k(2)
        assert pool.state_of(k(2)) is SlotState.FREE
        assert pool.state_of(k(3)) is SlotState.FILLING
        assert not pool.is_resident(k(3))
        assert pool.evictions == 1


def test_a_victim_chooser_goes_before_the_policy_and_a_stale_pick_falls_back() -> None:
    with PrimaryPool(8, 3) as pool:
        for i in (1, 2, 3):
            fill(pool, k(i))
        picks = [k(3), k(9), None]  # the newest; then one not resident; then no opinion
        asked: list[bool] = []

        def choose(skip: Callable[[bytes], bool]) -> bytes | None:
            asked.append(skip(k(1)))
            return picks.pop(0)

        pool.victim_chooser = choose
        first = pool.reserve(k(4))
        assert first is not None and first.evicted == k(3)  # not the LRU victim k(1)
        pool.commit(k(4))
        second = pool.reserve(k(5))  # k(9) is stale: refused, counted, LRU decides
        assert second is not None and second.evicted == k(1)
        assert pool.chooser_refused == 1
        pool.commit(k(5))
        pool.pin(k(2))
        third = pool.reserve(k(6))  # no pick: the policy, which skips the pinned k(2)
        assert third is not None and third.evicted == k(4)
        assert asked == [False, False, False]
        pool.commit(k(6))
        pool.victim_chooser = lambda skip: k(2)  # pinned: never evicted, whoever picks it
        fourth = pool.reserve(k(7))
        assert fourth is not None and fourth.evicted == k(5)
        assert pool.is_resident(k(2)) and pool.chooser_refused == 2


def test_pinned_and_filling_slots_are_never_evicted_and_a_full_pool_is_not_an_error() -> None:
    with PrimaryPool(8, 3) as pool:
        fill(pool, k(1))
        fill(pool, k(2))
        assert pool.reserve(k(3)) is not None  # filling
        pool.pin(k(1))
        pool.pin(k(2))
        assert pool.reserve(k(4)) is None
        pool.unpin(k(2))
        reservation = pool.reserve(k(4))
        assert reservation is not None and reservation.evicted == k(2)
        assert pool.is_resident(k(1))


def test_pins_nest_and_contract_errors_are_named() -> None:
    with PrimaryPool(8, 2) as pool:
        fill(pool, k(1))
        pool.pin(k(1))
        pool.pin(k(1))
        assert pool.pin_count(k(1)) == 2
        pool.unpin(k(1))
        pool.unpin(k(1))
        with pytest.raises(PoolError, match="not pinned"):
            pool.unpin(k(1))
        with pytest.raises(PoolError, match="not resident"):
            pool.pin(k(9))
        with pytest.raises(PoolError, match="already has slot"):
            pool.reserve(k(1))
        with pytest.raises(PoolError, match="not filling"):
            pool.commit(k(1))
        with pytest.raises(PoolError, match="not filling"):
            pool.abort(k(1))


def test_reserve_many_is_all_or_nothing_and_respects_protect() -> None:
    with PrimaryPool(8, 3) as pool:
        for i in range(3):
            fill(pool, k(i))
        pool.pin(k(0))
        assert pool.reserve_many([k(10), k(11), k(12)]) is None
        assert pool.occupancy().resident == 3
        assert pool.reserve_many([k(10), k(11)], protect={k(1)}) is None
        reservations = pool.reserve_many([k(10), k(11)])
        assert reservations is not None
        assert {r.evicted for r in reservations} == {k(1), k(2)}
        with pytest.raises(PoolError, match="duplicate"):
            pool.reserve_many([k(20), k(20)])


def test_abort_and_discard_free_the_slot() -> None:
    with PrimaryPool(8, 2) as pool:
        assert pool.reserve(k(1)) is not None
        pool.abort(k(1))
        assert pool.free_slots == 2
        fill(pool, k(2))
        pool.pin(k(2))
        assert not pool.discard(k(2))
        pool.unpin(k(2))
        assert pool.discard(k(2))
        assert pool.free_slots == 2 and len(pool.policy) == 0


def test_closed_pool_refuses_work() -> None:
    pool = PrimaryPool(8, 1)
    pool.close()
    pool.close()
    with pytest.raises(PoolClosedError):
        _ = pool.arena
    with pytest.raises(PoolClosedError):
        pool.reserve(k(1))
    with pytest.raises(PoolClosedError):
        pool.as_array()
    with pytest.raises(PoolClosedError):
        pool.view(0)


def test_arc_policy_by_name() -> None:
    with PrimaryPool(8, 2, "arc") as pool:
        assert isinstance(pool.policy, ARCPolicy)


def test_shared_memory_backing_is_visible_to_another_process() -> None:
    name = f"kvtier-test-{uuid4().hex[:12]}"
    with PrimaryPool(16, 4, backing=PrimaryBacking.SHARED_MEMORY, path=name) as pool:
        assert pool.path == name
        pool.view(1)[:] = bytes(range(16))
        script = (
            "import sys; from kvtier.primary import ArenaMapping\n"
            "with ArenaMapping('shared_memory', sys.argv[1], 16, 4) as arena:\n"
            "    sys.stdout.write(bytes(arena.view(1)).hex())\n"
            "    arena.view(2)[:] = b'\\x05' * 16\n"
        )
        done = subprocess.run([sys.executable, "-c", script, name], check=True,
                              capture_output=True, text=True, timeout=60)
        assert done.stdout == bytes(range(16)).hex()
        assert "leaked" not in done.stderr
        assert bytes(pool.view(2)) == b"\x05" * 16
        assert Path(f"/dev/shm/{name}").exists()  # the worker's exit did not unlink it
    assert not Path(f"/dev/shm/{name}").exists()


def test_mmap_file_backing_writes_through_to_the_file(tmp_path: Path) -> None:
    path = tmp_path / "arena.bin"
    with PrimaryPool(16, 2, backing="mmap_file", path=str(path)) as pool:
        pool.view(1)[:] = b"\x09" * 16
        assert path.stat().st_size == 32
        assert path.read_bytes()[16:] == b"\x09" * 16
        with ArenaMapping("mmap_file", str(path), 16, 2) as arena:
            assert bytes(arena.view(1)) == b"\x09" * 16
            arena.as_array()[0, :] = 3
        assert bytes(pool.view(0)) == b"\x03" * 16
        with pytest.raises(ValueError, match="expected at least 64"):
            ArenaMapping("mmap_file", str(path), 16, 4)
    assert not path.exists()  # the pool removes the arena it created
    with pytest.raises(ValueError, match="heap arena is private"):
        ArenaMapping("heap", "x", 16, 2)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["reserve", "commit", "abort", "pin", "unpin",
                                           "touch", "discard"]),
                          st.integers(0, 12)), max_size=200),
       st.sampled_from(["lru", "arc"]))
def test_pool_invariants_under_random_operations(ops: list[tuple[str, int]], policy: str) -> None:
    with PrimaryPool(4, 5, policy) as pool:
        pins: dict[bytes, int] = {}
        for op, value in ops:
            key = k(value)
            state = pool.state_of(key)
            if op == "reserve" and state is SlotState.FREE:
                reservation = pool.reserve(key)
                if reservation is not None and reservation.evicted is not None:
                    assert reservation.evicted not in pins
            elif op == "commit" and state is SlotState.FILLING:
                pool.commit(key)
            elif op == "abort" and state is SlotState.FILLING:
                pool.abort(key)
            elif op == "pin" and state is SlotState.RESIDENT:
                pool.pin(key)
                pins[key] = pins.get(key, 0) + 1
            elif op == "unpin" and pins.get(key):
                pool.unpin(key)
                pins[key] -= 1
                if not pins[key]:
                    del pins[key]
            elif op == "touch":
                pool.touch(key)
            elif op == "discard":
                removed = pool.discard(key)
                assert removed == (state is SlotState.RESIDENT and key not in pins)
            assert pool.free_slots + pool.occupancy().filling + pool.occupancy().resident == 5
            assert len(pool.policy) == pool.occupancy().resident
            assert all(pool.is_resident(p) for p in pins)
            slots = [pool.slot_of(key) for key in map(k, range(13))]
            used = [slot for slot in slots if slot is not None]
            assert len(used) == len(set(used))
        assert np.asarray(pool.as_array()).shape == (5, 4)


# ---- arena ownership (issue 10) -------------------------------------------------------------

_HOLD_ARENA = (
    "import sys\n"
    "from kvtier.primary import PrimaryPool\n"
    "pool = PrimaryPool(16, 4, backing=sys.argv[1], path=sys.argv[2])\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()\n"
    "if sys.argv[3] == 'close':\n"
    "    pool.close()\n"
    "# otherwise: exit with the pool open; the interpreter-exit finalizer removes the arena\n"
)


def _start_holder(backing: str, path: str, mode: str = "close") -> subprocess.Popen[str]:
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_ARENA, backing, path, mode],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "ready"
    return holder


def _stop_holder(holder: subprocess.Popen[str]) -> None:
    assert holder.stdin is not None
    holder.stdin.write("\n")
    holder.stdin.close()
    assert holder.wait(timeout=30) == 0


@pytest.mark.parametrize("backing", ["mmap_file", "shared_memory"])
def test_a_second_manager_is_refused_the_arena_another_process_holds(
        tmp_path: Path, backing: str) -> None:
    name = f"kvtier-test-{uuid4().hex[:12]}"
    path = str(tmp_path / "arena.bin") if backing == "mmap_file" else name
    on_disk = Path(path if backing == "mmap_file" else f"/dev/shm/{name}")
    holder = _start_holder(backing, path)
    try:
        with pytest.raises(ArenaError, match="another running kvtier manager") as refused:
            PrimaryPool(16, 4, backing=backing, path=path)
        assert isinstance(refused.value, ConfigError)
        assert on_disk.stat().st_size == 64  # the holder's arena is untouched
    finally:
        _stop_holder(holder)
    assert not on_disk.exists()  # the holder removed what it created
    with PrimaryPool(16, 4, backing=backing, path=path) as pool:  # free again: ours now
        assert pool.path == path
    assert not on_disk.exists()


def test_an_existing_file_is_refused_and_never_truncated(tmp_path: Path) -> None:
    path = tmp_path / "precious.bin"
    path.write_bytes(b"x" * 1_500_000)
    with pytest.raises(ArenaError, match="already exists and is not this manager's arena"):
        PrimaryPool(16, 2048, backing="mmap_file", path=str(path))
    assert path.stat().st_size == 1_500_000
    link = tmp_path / "link.bin"
    link.symlink_to(tmp_path / "target.bin")  # a dangling symlink is not followed either
    with pytest.raises(ArenaError, match="already exists"):
        PrimaryPool(16, 2, backing="mmap_file", path=str(link))
    assert not (tmp_path / "target.bin").exists()


def test_an_existing_shared_memory_segment_is_refused() -> None:
    from multiprocessing import shared_memory

    name = f"kvtier-test-{uuid4().hex[:12]}"
    foreign = shared_memory.SharedMemory(name=name, create=True, size=4096)
    try:
        with pytest.raises(ArenaError, match="already exists and is not this manager's arena"):
            PrimaryPool(16, 4, backing="shared_memory", path=name)
        assert foreign.size >= 4096 and Path(f"/dev/shm/{name}").exists()
    finally:
        foreign.close()
        foreign.unlink()


@pytest.mark.parametrize("backing", ["mmap_file", "shared_memory"])
def test_a_process_that_exits_without_closing_removes_its_arena(
        tmp_path: Path, backing: str) -> None:
    name = f"kvtier-test-{uuid4().hex[:12]}"
    path = str(tmp_path / "arena.bin") if backing == "mmap_file" else name
    holder = _start_holder(backing, path, mode="leave-open")
    _stop_holder(holder)
    assert not Path(path if backing == "mmap_file" else f"/dev/shm/{name}").exists()


@pytest.mark.parametrize(("backing", "path", "message"), [
    ("mmap_file", "/nonexistent-dir/arena.bin", "cannot create the arena file"),
    ("mmap_file", "/proc/arena.bin", "cannot create the arena file"),
    ("shared_memory", "bad/name", "cannot create a shared-memory segment"),
])
def test_arena_creation_failures_are_config_errors_naming_the_path(
        backing: str, path: str, message: str) -> None:
    with pytest.raises(ArenaError, match=message) as refused:
        PrimaryPool(16, 4, backing=backing, path=path)
    assert repr(path) in str(refused.value)


def test_a_directory_at_the_arena_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ArenaError, match="already exists"):
        PrimaryPool(16, 4, backing="mmap_file", path=str(tmp_path))
    assert tmp_path.is_dir()


@pytest.mark.parametrize("backing", ["heap", "shared_memory"])
def test_an_arena_larger_than_available_memory_is_refused_up_front(backing: str) -> None:
    available = available_memory_bytes(backing)
    assert available is not None and available > 0
    # Twice what is available: other processes move MemAvailable between the two reads.
    with pytest.raises(ArenaError, match="does not fit") as refused:
        PrimaryPool(1024**2, 2 * (available // 1024**2) + 1, backing=backing)
    reported = re.search(r": ([\d,]+) bytes; lower", str(refused.value))
    assert reported is not None, str(refused.value)
    assert abs(int(reported.group(1).replace(",", "")) - available) < available // 10
    with pytest.raises(ArenaError, match="does not fit"):
        PrimaryPool(1024**5, 16_000)  # 1 PiB blocks: no MemoryError, a clear error


def test_open_manager_reports_a_taken_arena_as_a_config_error(tmp_path: Path) -> None:
    from kvtier.factory import open_manager

    path = str(tmp_path / "arena.bin")
    config = {"block_bytes": 16, "primary_bytes": 64, "namespace": {"model": "m"},
              "primary_backing": "mmap_file", "primary_path": path, "metrics_registry": "disabled"}
    with open_manager(config), pytest.raises(ConfigError, match="another running kvtier"):
        open_manager(config)
    assert not Path(path).exists()


def test_heap_slots_are_page_aligned_for_direct_io() -> None:
    """An O_DIRECT file tier reads into and writes from a slot in place only if it is whole
    pages at a page-aligned address (else through a bounce buffer)."""
    pool = PrimaryPool(16384, 4)
    try:
        arena = np.frombuffer(pool._arena, dtype=np.uint8)  # type: ignore[arg-type]
        assert arena.ctypes.data % 4096 == 0
    finally:
        pool.close()
