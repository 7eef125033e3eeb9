"""A seeded fault-injection soak through the public manager API, against real tiers.

A file tier and a private Valkey server (both with ``auth_key``) sit under one manager. Several
requests per step look up, load and store chained prefixes while a "hostile neighbour" injects,
at seeded steps, the faults kvtier must survive: a FIFO, a symlink or a directory planted at a
block path; frames written by a second writer with another or no auth key; flipped bytes and
truncated block files; deleted blocks; a SIGSTOP'ed Valkey; a removed namespace directory. On a
thread of its own, the same neighbour keeps re-pointing the symlink the file tier was opened
through (``links/kvcache``) to a tree of its own holding foreign frames, and renames the
namespace directory aside (and back), sometimes planting a replacement full of foreign frames.

Every loaded block is compared with the payload derived from its key: 0 wrong blocks; no store
lands in the neighbour's tree. Every request finishes within a bounded number of steps (no
livelock, no hang), and after shutdown the lookup managers track 0 keys and no kvtier thread is
left.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest

from kvtier import codec
from kvtier.backends import Backend, open_backend
from kvtier.factory import open_manager
from kvtier.keys import BlockKey, Namespace, RequestContext, chain_keys
from kvtier.tiering.manager import StoreMode, TieringManager

SEED = int(os.environ.get("KVTIER_SOAK_SEED", "20261201"))  # rerun a failure by its seed
BLOCK = 4096
BLOCK_TOKENS = 16
SLOTS = 24
DOCUMENTS = 40
BLOCKS_PER_DOCUMENT = 6
STEPS = 1500
REQUESTS_PER_STEP = 3
MAX_STEPS_PER_REQUEST = 300  # a request still unanswered after this is a livelock
STEP_PACE_S = 0.01  # real time per step, so timeouts (probe, load, socket) can expire
FAULT_RATE = 0.06  # chance per step that the neighbour strikes
OWNER_KEY = "owner-" + "k" * 26
OTHER_KEY = "intruder-" + "x" * 23
FAST = {"socket_timeout_s": 0.3, "connect_timeout_s": 0.3}
SWAP_PAUSE_S = (0.01, 0.05)  # between two directory swaps
SWAP_HOLD_S = (0.002, 0.02)  # how long a swap stays in place before it is undone


def payload_of(key: BlockKey) -> bytes:
    """The one right payload of ``key`` (so every loaded block can be checked)."""
    seed = hashlib.blake2b(key, digest_size=64).digest()
    return (seed * (BLOCK // len(seed)))[:BLOCK]


@dataclass(slots=True)
class Request:
    ctx: RequestContext
    keys: list[BlockKey]
    started_step: int


@dataclass(slots=True)
class Tally:
    loaded: int = 0
    wrong: int = 0
    stored: int = 0
    requests: int = 0
    max_steps: int = 0
    faults: dict[str, int] = field(default_factory=dict)


class Neighbour:
    """Injects faults into the tiers the manager uses, from the test's (scheduler) thread."""

    def __init__(self, rng: random.Random, manager: TieringManager, valkey: Any,
                 intruders: list[Backend], known: list[BlockKey]) -> None:
        self._rng = rng
        self._manager = manager
        self._valkey = valkey
        self._intruders = intruders
        self._known = known
        self._file: Any = manager.tiers[0].backend
        self._paused_until: int | None = None
        self._step_now = 0
        self._namespace_removed = False
        # Held by the directory swapper while a swap is in place: a fault that plants at a block
        # path would otherwise re-create the namespace directory under its name.
        self.fs_lock = threading.Lock()
        self.tally: dict[str, int] = {}
        self._faults: list[Callable[[BlockKey], bool]] = [
            self._fifo, self._symlink, self._directory, self._foreign_frame,
            self._flip_file, self._truncate_file, self._delete_file, self._flip_redis,
            self._delete_redis, self._pause_valkey,
        ]

    def step(self, step: int) -> None:
        self._step_now = step
        if self._paused_until is not None and step >= self._paused_until:
            self._valkey.resume()
            self._paused_until = None
        if step == STEPS * 3 // 4 and not self._namespace_removed:
            with self.fs_lock:
                shutil.rmtree(self._file.root / self._manager.namespace.digest_hex,
                              ignore_errors=True)
                self._namespace_removed = True
            self.tally["namespace_removed"] = 1
        if not self._known or self._rng.random() >= FAULT_RATE:
            return
        fault = self._rng.choice(self._faults)
        key = self._rng.choice(self._known)
        if not self.fs_lock.acquire(blocking=False):
            return  # a directory swap is in place
        try:
            struck = fault(key)
        finally:
            self.fs_lock.release()
        if struck:
            self.tally[fault.__name__.lstrip("_")] = self.tally.get(
                fault.__name__.lstrip("_"), 0) + 1

    def resume(self) -> None:
        if self._paused_until is not None:
            self._valkey.resume()
            self._paused_until = None

    @property
    def namespace_removed(self) -> bool:
        return self._namespace_removed

    @property
    def file_tier(self) -> Any:
        return self._file

    # -- file tier faults ------------------------------------------------------------------

    def _replace_path(self, key: BlockKey) -> Path | None:
        if self._namespace_removed:
            return None
        path: Path = self._file.path_for(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        return path

    def _fifo(self, key: BlockKey) -> bool:
        path = self._replace_path(key)
        if path is None:
            return False
        os.mkfifo(path)
        return True

    def _symlink(self, key: BlockKey) -> bool:
        other: Path = self._file.path_for(self._rng.choice(self._known))
        path = self._replace_path(key)
        if path is None or other == path:
            return False
        path.symlink_to(other)  # another block's (valid) frame, reached through a link
        return True

    def _directory(self, key: BlockKey) -> bool:
        path = self._replace_path(key)
        if path is None:
            return False
        path.mkdir()
        return True

    def _block_file(self, key: BlockKey) -> Path | None:
        path: Path = self._file.path_for(key)
        if self._namespace_removed or path.is_symlink() or not path.is_file():
            return None
        return path

    def _flip_file(self, key: BlockKey) -> bool:
        path = self._block_file(key)
        if path is None:
            return False
        raw = bytearray(path.read_bytes())
        if not raw:
            return False
        raw[self._rng.randrange(len(raw))] ^= 0x5A
        path.write_bytes(raw)
        return True

    def _truncate_file(self, key: BlockKey) -> bool:
        path = self._block_file(key)
        if path is None:
            return False
        os.truncate(path, self._rng.randrange(max(1, path.stat().st_size)))
        return True

    def _delete_file(self, key: BlockKey) -> bool:
        path = self._block_file(key)
        if path is None:
            return False
        path.unlink()
        return True

    # -- faults on both tiers ------------------------------------------------------------------

    def _foreign_frame(self, key: BlockKey) -> bool:
        """A writer without the owner's key deletes the block and writes its own bytes."""
        intruder = self._rng.choice(self._intruders)
        if intruder is self._intruders[0] and self._namespace_removed:
            return False
        if intruder is not self._intruders[0] and self._paused_until is not None:
            return False  # the Valkey is stopped: the intruder would only time out
        wrong = payload_of(self._rng.choice(self._known) + b"!")
        intruder.delete([key])
        return intruder.put_many([key], [wrong]) == [True]

    # -- Valkey faults ----------------------------------------------------------------------

    def _redis_name(self, key: BlockKey) -> bytes:
        return b"kvtier:" + self._manager.namespace.digest_hex.encode() + b":" + \
            key.hex().encode()

    def _redis(self, action: Callable[[Any, bytes], object], key: BlockKey) -> bool:
        if self._paused_until is not None:
            return False
        client = self._valkey.client()
        try:
            return bool(action(client, self._redis_name(key)))
        finally:
            client.close()

    def _flip_redis(self, key: BlockKey) -> bool:
        offset = self._rng.randrange(BLOCK)
        return self._redis(lambda client, name: client.exists(name) and client.setrange(
            name, offset, b"\xa5"), key)

    def _delete_redis(self, key: BlockKey) -> bool:
        return self._redis(lambda client, name: client.delete(name), key)

    def _pause_valkey(self, _key: BlockKey) -> bool:
        if self._paused_until is not None:
            return False
        self._valkey.pause()
        self._paused_until = self._step_now + self._rng.randint(5, 40)
        return True


class DirectorySwapper(threading.Thread):
    """The neighbour's second hand: swaps the root symlink and the namespace directory while
    the manager runs (its own thread, paced by ``stop``; every swap undone before the next)."""

    def __init__(self, seed: int, neighbour: Neighbour, link: Path, tier: Path, evil: Path,
                 namespace: Namespace, known: list[BlockKey]) -> None:
        super().__init__(name="soak-directory-swapper", daemon=True)
        self._rng = random.Random(seed)
        self._neighbour = neighbour
        self._link, self._tier, self._evil = link, tier, evil
        self._namespace = namespace
        self._known = known
        self._evil_tier = open_backend(f"file://{evil}", namespace)  # no key, like a stranger
        self.planted: set[str] = set()  # block file names the neighbour wrote into its tree
        self.stop = threading.Event()
        self.tally: dict[str, int] = {}
        self.failure: BaseException | None = None
        self._turn = 0

    def run(self) -> None:
        try:
            while not self.stop.wait(self._rng.uniform(*SWAP_PAUSE_S)):
                with self._neighbour.fs_lock:
                    swap = self._rng.choice([self._repoint_link, self._rename_namespace,
                                             self._replace_namespace])
                    if swap():
                        self.tally[swap.__name__.lstrip("_")] = \
                            self.tally.get(swap.__name__.lstrip("_"), 0) + 1
        except BaseException as exc:  # reported by the test, not lost on this thread
            self.failure = exc
        finally:
            self._evil_tier.close()

    def _hold(self) -> None:
        self.stop.wait(self._rng.uniform(*SWAP_HOLD_S))

    def _foreign(self, count: int) -> list[tuple[BlockKey, bytes]]:
        known = list(self._known)
        keys = [self._rng.choice(known) for _ in range(count)] if known else []
        return [(key, payload_of(key + b"?")) for key in keys]

    def _point_link(self, target: Path) -> None:
        fresh = self._link.with_name(f"kvcache.{self._turn}")
        self._turn += 1
        fresh.symlink_to(target)
        os.replace(fresh, self._link)

    def _repoint_link(self) -> bool:
        """``links/kvcache`` -> the neighbour's tree of foreign frames, then back."""
        for key, wrong in self._foreign(3):
            if self._evil_tier.put_many([key], [wrong]) == [True]:
                self.planted.add(f"{key.hex()}.kvb")
        self._point_link(self._evil)
        self._hold()
        self._point_link(self._tier)
        return True

    def _rename_namespace(self) -> bool:
        """The namespace directory renamed aside, then back."""
        if self._neighbour.namespace_removed:
            return False
        directory = self._tier / self._namespace.digest_hex
        aside = self._tier / f"aside-{self._turn}"
        self._turn += 1
        directory.rename(aside)
        self._hold()
        aside.rename(directory)
        return True

    def _replace_namespace(self) -> bool:
        """Renamed aside and replaced by a directory of unkeyed foreign frames, then restored."""
        if self._neighbour.namespace_removed:
            return False
        directory = self._tier / self._namespace.digest_hex
        aside, replaced = self._tier / f"aside-{self._turn}", self._tier / f"gone-{self._turn}"
        self._turn += 1
        directory.rename(aside)
        directory.mkdir(mode=0o700)
        file_tier: Any = self._neighbour.file_tier
        for key, wrong in self._foreign(3):
            path = directory / file_tier.path_for(key).relative_to(
                file_tier.root / self._namespace.digest_hex)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(bytes(codec.encode(self._namespace.digest, key, wrong)))
        self._hold()
        directory.rename(replaced)
        aside.rename(directory)
        # A batch that began before the restore may still be writing there: best effort.
        shutil.rmtree(replaced, ignore_errors=True)
        return True


def _start(manager: TieringManager, request: Request, tally: Tally) -> bool:
    """One scheduler pass over a request; True once it is done (loaded and stored)."""
    hits = manager.lookup_prefix(request.keys, request.ctx)
    if hits is None:
        return False
    if hits:
        plan = manager.prepare_load(request.keys[:hits], request.ctx)
        try:
            for key, slot in zip(plan.keys, plan.slots, strict=True):
                tally.loaded += 1
                tally.wrong += bytes(manager.primary_view(slot)) != payload_of(key)
        finally:
            manager.complete_load(request.keys[:hits], request.ctx)
    rest = request.keys[hits:]
    if rest:
        store = manager.prepare_store(rest, request.ctx, StoreMode.PREFIX)
        if store is not None and store.keys:
            for key, slot in zip(store.keys, store.slots, strict=True):
                manager.primary_view(slot)[:] = payload_of(key)
            manager.complete_store(store.keys, request.ctx)
            tally.stored += len(store.keys)
    return True


def _kvtier_threads() -> list[str]:
    return [thread.name for thread in threading.enumerate()
            if thread.name.startswith("kvtier") and thread.is_alive()]


@pytest.mark.timeout(240)
def test_fault_soak_serves_no_wrong_block_and_leaves_nothing_behind(
        tmp_path: Path, valkey_factory: Callable[..., Any]) -> None:
    rng = random.Random(SEED)
    valkey = valkey_factory()
    model = f"soak-{uuid4().hex}"
    namespace = Namespace(model=model)
    tier_dir, evil_dir, link = tmp_path / "tier", tmp_path / "evil", tmp_path / "links" / "kvcache"
    tier_dir.mkdir(mode=0o700)
    link.parent.mkdir(mode=0o700)
    link.symlink_to(tier_dir)
    file_url = f"file://{link}"  # opened through the link the neighbour re-points
    tiers = [
        {"url": file_url, "auth_key": OWNER_KEY, "load_timeout_s": 1.0,
         "lookup": {"probe_timeout_s": 1.0}},
        {"url": valkey.url, "auth_key": OWNER_KEY, "load_timeout_s": 1.0,
         "lookup": {"probe_timeout_s": 1.0}, **FAST},
    ]
    # The unkeyed intruder opens before the keyed manager: once a tier's manifest says keyed, an
    # unkeyed open is refused (a stranger who ignores that writes the same frames).
    intruders = [open_backend(file_url, namespace, auth_key=OTHER_KEY),
                 open_backend(valkey.url, namespace, **FAST),
                 open_backend(valkey.url, namespace, auth_key=OTHER_KEY, **FAST)]
    manager = open_manager({"block_bytes": BLOCK, "primary_bytes": BLOCK * SLOTS,
                            "namespace": {"model": model}, "secondary_tiers": tiers})
    # (intruders[0] is the file tier's: the neighbour relies on that order)
    documents = [chain_keys([rng.randrange(32000) for _ in range(BLOCK_TOKENS *
                                                                 BLOCKS_PER_DOCUMENT)],
                            BLOCK_TOKENS, namespace) for _ in range(DOCUMENTS)]
    known: list[BlockKey] = []
    neighbour = Neighbour(rng, manager, valkey, intruders, known)
    swapper = DirectorySwapper(rng.randrange(1 << 30), neighbour, link, tier_dir, evil_dir,
                               namespace, known)
    swapper.start()
    tally = Tally()
    active: list[Request] = []
    started = time.monotonic()
    try:
        for step in range(STEPS + MAX_STEPS_PER_REQUEST):
            draining = step >= STEPS
            if draining and not active:
                break
            if draining:
                swapper.stop.set()
            if not draining:
                neighbour.step(step)
                while len(active) < REQUESTS_PER_STEP:
                    document = rng.choice(documents)
                    keys = list(document[:rng.randint(1, BLOCKS_PER_DOCUMENT)])
                    active.append(Request(RequestContext(f"r{tally.requests}"), keys, step))
                    tally.requests += 1
            else:
                neighbour.resume()
            for request in list(active):
                if _start(manager, request, tally):
                    known.extend(key for key in request.keys if key not in known)
                    manager.on_request_finished(request.ctx)
                    active.remove(request)
                    tally.max_steps = max(tally.max_steps, step - request.started_step)
                else:
                    assert step - request.started_step < MAX_STEPS_PER_REQUEST, (
                        f"request {request.ctx.req_id} unanswered after "
                        f"{MAX_STEPS_PER_REQUEST} steps")
            manager.on_schedule_end()
            time.sleep(STEP_PACE_S)
        assert not active, f"{len(active)} request(s) never finished"
        swapper.stop.set()
        swapper.join(30)
        assert not swapper.is_alive() and swapper.failure is None, swapper.failure
        neighbour.resume()
        manager.on_schedule_end()
        assert manager.wait_idle(30)
        manager.on_schedule_end()
        stats = manager.get_stats()
        assert stats["tracked_keys"] == 0
        assert all(tier["tracked_keys"] == 0 for tier in stats["tiers"].values())
        assert stats["pins"] == 0
        assert stats["manager"]["invariant_violations"] == 0
        rejected = [tier.backend.stats() for tier in manager.tiers]
    finally:
        swapper.stop.set()
        swapper.join(30)
        neighbour.resume()
        shutdown_started = time.monotonic()
        manager.shutdown(20)
        shutdown_s = time.monotonic() - shutdown_started
        for intruder in intruders:
            intruder.close()
    elapsed = time.monotonic() - started
    faults = dict(sorted({**neighbour.tally, **swapper.tally}.items()))
    leaked = sorted(path.name for path in evil_dir.rglob("*.kvb")
                    if path.name not in swapper.planted)
    print(f"soak: {tally.requests} requests, {tally.loaded} blocks loaded, "
          f"{tally.stored} stored, {tally.wrong} wrong, max {tally.max_steps} steps per "
          f"request, faults {faults}, {elapsed:.1f} s, shutdown {shutdown_s:.2f} s")
    assert tally.wrong == 0
    assert leaked == [], f"{len(leaked)} stores landed in the neighbour's tree"
    assert min(swapper.tally.get(name, 0) for name in (
        "repoint_link", "rename_namespace", "replace_namespace")) > 0
    assert rejected[0]["namespace_dir_swaps"] > 0  # the file tier saw swaps, and moved on
    assert tally.loaded > 1000 and tally.stored > 200  # the soak did real work
    assert sum(faults.values()) >= 20 and len(faults) >= 8  # ... under most kinds of fault
    assert shutdown_s < 20
    # the tiers saw the bad objects, refused them, and removed them
    assert all(counts["corrupt_objects"] + counts["auth_failures"] > 0 for counts in rejected)
    for thread in threading.enumerate():
        if thread.name.startswith("kvtier"):
            thread.join(5)
    assert _kvtier_threads() == []
