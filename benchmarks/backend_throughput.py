"""Backend throughput against the machine's own limit, measured in the same run.

    .venv/bin/python benchmarks/backend_throughput.py                      # memory, file, redis
    .venv/bin/python benchmarks/backend_throughput.py --backends s3 --total 24MiB
    .venv/bin/python benchmarks/backend_throughput.py --backends file --sizes 1MiB --total 256MiB
    .venv/bin/python benchmarks/backend_throughput.py --backends file+direct --direct-dir /var/tmp
    .venv/bin/python benchmarks/backend_throughput.py --backends memory+auth,file+auth

    .venv/bin/python benchmarks/backend_throughput.py --backends file --json rows.json
    .venv/bin/python benchmarks/backend_throughput.py --backends file --dir /dev/shm --clock cpu

For every backend and block size: put and get GB/s; for every batch size: ``exists`` keys/s.
Each number sits next to a baseline measured in the same run, interleaved round by round
(median of ``--rounds``), because these machines are noisy. Every transfer also has a
**floor**: the raw operation plus the verification pass kvtier must do on it, measured as its
own side in the same rounds: one xxh3_64 pass over each block (keyed BLAKE3 for ``+auth``), on
put (the frame's check) and on get (its verification); a memory get of a frame the instance
encoded itself verifies nothing (private memory), so its floor is the raw copy. ``--json FILE``
writes every transfer row as ``{backend, op, block_bytes, gbps, raw_gbps, floor_gbps}`` (plus
the paired ratios) and every ``exists`` row as ``{backend, op, batch, keys_per_s,
raw_keys_per_s}``. ``--clock cpu`` times this process's CPU time instead of elapsed time: on a
machine whose other jobs preempt the run it still measures the work each side does (GB/s of CPU
time), where the medium is moved by the CPU (memory, page cache, tmpfs); it is not for disks.

- memory: a numpy copy of the same bytes (memory bandwidth); ``exists``: dict membership.
- file:   raw ``open/write/close/rename`` (put: a temp file renamed into place, as any store
          that never shows a partial block must) and ``open/readv/close`` (get) of the same
          bytes, one file per block; ``exists``: ``os.stat``.
- file+capped: the file backend under ``max_bytes`` (1 TiB: the capacity index's bookkeeping,
          no eviction) against the same raw baseline as ``file``.
- file+python: the file backend with ``native_io=false`` (its system calls made from Python,
          as on an install without the compiled batch calls) against the same raw baseline.
- file+direct: the file backend with ``o_direct=true`` on ``--direct-dir`` (a real disk, not
          tmpfs; default /var/tmp) against raw O_DIRECT write+rename / read of the same
          page-aligned buffers (every side's buffers are page-aligned, as pool slots are) in the
          same directory: the disk, not the page cache.
- memory+auth, file+auth: the same with ``auth_key`` set (keyed BLAKE3 over every frame)
          against the same raw baseline, and in a second row against the same backend without
          ``auth_key`` (``kvtier, no auth_key``), in the same rounds: the price of
          authenticated frames.
- redis:  raw redis-py pipelined SET / GET of the same bytes, same batch size; ``exists``: a raw
          pipelined EXISTS per key. The benchmark starts its own private valkey server.
- s3:     raw obstore PUT (``If-None-Match: *``, as the backend) / GET (into the caller's buffer)
          / HEAD of the same bytes, the same batch size and the same concurrency
          (``--s3-concurrency``, a semaphore as in the backend) on one asyncio loop. The
          benchmark starts its own SeaweedFS (``weed mini``, loopback, private directory).

Targets (issue 22): file put >= 90% of raw; file get >= 90% of its floor and >= 80% of raw at
256 KiB and above; memory get >= 90% of its floor; redis ``exists`` >= 80% of raw (issue 3); an
authenticated file get >= 60% of an unauthenticated one (issue 19). Redis and S3 transfers have
no target beyond "as before or better" (their baselines share the network stack).
This module owns no shared state; everything runs on the main thread (the S3 baseline's event
loop runs on it too, inside ``run_until_complete``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib
import json
import mmap
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import xxhash
from rich.console import Console
from rich.table import Table

from kvtier.backends import Backend, open_backend
from kvtier.keys import Namespace
from kvtier.settings import parse_size

_TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"


@dataclass(frozen=True, slots=True)
class Target:
    against: str  # "raw" or "floor"
    ratio: float
    min_block: int


TARGETS: dict[tuple[str, str], tuple[Target, ...]] = {
    ("file", "put"): (Target("raw", 0.90, 16 << 10),),
    ("file", "get"): (Target("floor", 0.90, 256 << 10), Target("raw", 0.80, 256 << 10)),
    ("file+direct", "get"): (Target("floor", 0.90, 256 << 10),),
    ("memory", "get"): (Target("floor", 0.90, 64 << 10),),
}
AUTH_TARGETS = {("file+auth", "get"): 0.60}
"""Authenticated against unauthenticated kvtier, same medium, same run (issue 19)."""
EXISTS_TARGETS = {"redis": 0.80}
AUTH_KEY = "benchmark-auth-key-0123456789abcdef"
_ALIGN = 4096


@dataclass(slots=True)
class Row:
    backend: str
    operation: str
    shape: str
    unit: str
    value: float
    baseline_name: str
    baseline: float
    target: float | None

    ratio: float  # median over rounds of the paired (same-round) ratio: robust to drift
    block_bytes: int | None = None
    floor: float | None = None  # GB/s of the raw operation + kvtier's verification pass
    floor_ratio: float | None = None
    floor_name: str = ""
    targets: tuple[Target, ...] = ()

    def misses(self) -> list[str]:
        """The targets this row misses, in words (empty: every one met)."""
        missed = []
        for target in self.targets:
            ratio = self.floor_ratio if target.against == "floor" else self.ratio
            if ratio is not None and ratio < target.ratio:
                missed.append(f"{target.ratio:.0%} of {target.against}")
        return missed

    def as_json(self) -> dict[str, Any]:
        if self.block_bytes is None:
            return {"backend": self.backend, "op": self.operation,
                    "batch": int(self.shape.split()[-1]), "keys_per_s": self.value,
                    "raw_keys_per_s": self.baseline, "ratio": self.ratio}
        return {"backend": self.backend, "op": self.operation, "block_bytes": self.block_bytes,
                "gbps": self.value, "raw_gbps": self.baseline, "floor_gbps": self.floor,
                "ratio_raw": self.ratio, "ratio_floor": self.floor_ratio,
                "raw": self.baseline_name, "floor": self.floor_name}


def verify_pass(kind: str) -> tuple[str, Callable[[memoryview], None]]:
    """The pass kvtier makes over each block of ``kind`` (xxh3, or keyed BLAKE3 with auth)."""
    if kind.endswith("+auth"):
        mac_key = blake3.blake3(AUTH_KEY.encode(), derive_key_context="bench floor").digest()

        def keyed(view: memoryview) -> None:
            blake3.blake3(view, key=mac_key).digest(16)

        return "+ keyed BLAKE3", keyed
    return "+ xxh3", lambda view: xxhash.xxh3_64(view).intdigest()


def _keys(count: int, tag: str) -> list[bytes]:
    """Fresh 16-byte content-hash-like keys (they spread over the file fan-out like real ones)."""
    salt = uuid.uuid4().bytes + tag.encode()
    return [
        hashlib.blake2b(salt + i.to_bytes(8, "little"), digest_size=16).digest()
        for i in range(count)
    ]


_CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter  # set once by main() from --clock, before anything is timed


def _timed(action: Callable[[], None]) -> float:
    start = _clock()
    action()
    return _clock() - start


def _batches(items: Sequence[Any], batch: int) -> Iterator[Sequence[Any]]:
    for index in range(0, len(items), batch):
        yield items[index : index + batch]


# --------------------------------------------------------------------------- baselines


class MemoryBaseline:
    """What any in-memory store must do: keep a private copy, copy it out again."""

    name = "copy in/out"
    exists_name = "dict lookup"
    verifies_get = False  # kvtier's own frames in private memory: header checked, no hash

    def __init__(self) -> None:
        self._table: dict[bytes, np.ndarray[Any, Any]] = {}
        self.check: Callable[[memoryview], None] | None = None  # the floor's pass, per block

    def put(self, keys: Sequence[bytes], payload: np.ndarray[Any, Any], batch: int) -> None:
        check, view = self.check, payload.data
        for key in keys:
            if check is not None:
                check(view)
            self._table[key] = payload.copy()

    def get(self, keys: Sequence[bytes], out: np.ndarray[Any, Any], batch: int) -> None:
        for key in keys:
            np.copyto(out, self._table[key])

    def exists(self, keys: Sequence[bytes]) -> None:
        table = self._table
        _ = [key in table for key in keys]

    def cleanup(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._table.pop(key, None)


class FileBaseline:
    """Raw per-block files in the same one-level fan-out layout as the file backend."""

    name = "raw write/read"
    exists_name = "os.stat"
    verifies_get = True

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.check: Callable[[memoryview], None] | None = None  # the floor's pass, per block

    def _path(self, key: bytes) -> str:
        name = key.hex()
        return os.path.join(self._dir, name[0:2], name)

    direct = False

    def put(self, keys: Sequence[bytes], payload: np.ndarray[Any, Any], batch: int) -> None:
        view = self._write_view(payload)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.direct else 0)
        check = self.check
        for key in keys:
            if check is not None:
                check(view)
            path = self._path(key)
            temp = path + ".tmp"
            try:
                fd = os.open(temp, flags, 0o600)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd = os.open(temp, flags, 0o600)
            os.write(fd, view)
            os.close(fd)
            os.rename(temp, path)

    def get(self, keys: Sequence[bytes], out: np.ndarray[Any, Any], batch: int) -> None:
        view, copy_out = self._read_view(out)
        flags = os.O_RDONLY | (os.O_DIRECT if self.direct else 0)
        check = self.check
        for key in keys:
            fd = os.open(self._path(key), flags)
            os.readv(fd, [view])
            os.close(fd)
            copy_out()
            if check is not None:
                check(view)

    def _write_view(self, payload: np.ndarray[Any, Any]) -> memoryview:
        return payload.data

    def _read_view(self, out: np.ndarray[Any, Any]) -> tuple[memoryview, Callable[[], None]]:
        return out.data, lambda: None

    def exists(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            with suppress(FileNotFoundError):
                os.stat(self._path(key))

    def cleanup(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            os.unlink(self._path(key))


class DirectFileBaseline(FileBaseline):
    """Raw O_DIRECT files: page-aligned buffers rounded up to whole pages (as O_DIRECT needs)."""

    name = "raw O_DIRECT write/read"
    direct = True

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self._buffers: dict[int, mmap.mmap] = {}

    def _aligned(self, size: int) -> memoryview:
        rounded = max(_ALIGN, (size + _ALIGN - 1) // _ALIGN * _ALIGN)
        if rounded not in self._buffers:
            self._buffers[rounded] = mmap.mmap(-1, rounded)
        return memoryview(self._buffers[rounded])

    @staticmethod
    def _in_place(array: np.ndarray[Any, Any]) -> bool:
        """Whether O_DIRECT can move ``array`` where it is (whole pages, page-aligned)."""
        return array.nbytes % _ALIGN == 0 and array.ctypes.data % _ALIGN == 0

    def _write_view(self, payload: np.ndarray[Any, Any]) -> memoryview:
        if self._in_place(payload):
            return payload.data
        view = self._aligned(payload.nbytes)
        view[: payload.nbytes] = payload.data.cast("B")
        return view

    def _read_view(self, out: np.ndarray[Any, Any]) -> tuple[memoryview, Callable[[], None]]:
        if self._in_place(out):
            return out.data, lambda: None
        view = self._aligned(out.nbytes)
        target = out.data.cast("B")

        def copy_out() -> None:  # any O_DIRECT reader of unaligned buffers pays this copy
            target[:] = view[: out.nbytes]

        return view, copy_out


class RedisBaseline:
    """Raw redis-py pipelines; a GET reply (a ``bytes``) is copied into the caller's buffer, as
    any redis-py user must to get the block where the engine wants it."""

    name = "redis-py SET/GET"
    exists_name = "pipelined EXISTS"
    verifies_get = True

    def __init__(self, client: Any) -> None:
        self._client = client
        self.check: Callable[[memoryview], None] | None = None  # the floor's pass, per block

    def put(self, keys: Sequence[bytes], payload: np.ndarray[Any, Any], batch: int) -> None:
        value = payload.data
        for chunk in _batches(keys, batch):
            pipe = self._client.pipeline(transaction=False)
            for key in chunk:
                if self.check is not None:
                    self.check(value)
                pipe.set(b"raw:" + key, value)
            pipe.execute()

    def get(self, keys: Sequence[bytes], out: np.ndarray[Any, Any], batch: int) -> None:
        for chunk in _batches(keys, batch):
            pipe = self._client.pipeline(transaction=False)
            for key in chunk:
                pipe.get(b"raw:" + key)
            view = out.data.cast("B")
            check = self.check
            for reply in pipe.execute():  # into the caller's buffer, as the backend must
                view[:] = reply
                if check is not None:
                    check(view)

    def exists(self, keys: Sequence[bytes]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(b"raw:" + key)
        pipe.execute()

    def cleanup(self, keys: Sequence[bytes]) -> None:
        for chunk in _batches(keys, 1000):
            self._client.delete(*[b"raw:" + key for key in chunk])


class S3Baseline:
    """Raw obstore requests: what any S3 client must do for the same bytes and concurrency."""

    name = "obstore PUT/GET"
    exists_name = "obstore HEAD"
    verifies_get = True

    def __init__(self, store: Any, concurrency: int) -> None:
        self._store = store
        self._concurrency = concurrency
        self._loop = asyncio.new_event_loop()
        self.check: Callable[[memoryview], None] | None = None  # the floor's pass, per block

    def _gather(self, names: Sequence[str], request: Callable[[str], Any]) -> None:
        async def run() -> None:
            slots = asyncio.Semaphore(self._concurrency)

            async def one(name: str) -> None:
                async with slots:
                    with suppress(FileNotFoundError):
                        await request(name)

            await asyncio.gather(*(one(name) for name in names))

        self._loop.run_until_complete(run())

    def put(self, keys: Sequence[bytes], payload: np.ndarray[Any, Any], batch: int) -> None:
        import obstore

        data = payload.tobytes()

        def request(name: str) -> Any:
            if self.check is not None:
                self.check(memoryview(data))
            return obstore.put_async(self._store, name, data, mode="create", use_multipart=False)

        for chunk in _batches(keys, batch):
            self._gather([f"raw/{key.hex()}" for key in chunk], request)

    def get(self, keys: Sequence[bytes], out: np.ndarray[Any, Any], batch: int) -> None:
        import obstore

        view = out.data.cast("B")

        async def request(name: str) -> None:
            result = await obstore.get_async(self._store, name)
            view[:] = memoryview(await result.bytes_async())
            if self.check is not None:
                self.check(view)

        for chunk in _batches(keys, batch):
            self._gather([f"raw/{key.hex()}" for key in chunk], request)

    def exists(self, keys: Sequence[bytes]) -> None:
        import obstore

        self._gather(
            [f"raw/{key.hex()}" for key in keys],
            lambda name: obstore.head_async(self._store, name),
        )

    def cleanup(self, keys: Sequence[bytes]) -> None:
        import obstore

        names = [f"raw/{key.hex()}" for key in keys]

        async def delete(chunk: list[str]) -> None:
            await obstore.delete_async(self._store, chunk)

        for chunk in _batches(names, 1000):
            self._loop.run_until_complete(delete(list(chunk)))

    def close(self) -> None:
        self._loop.close()


# --------------------------------------------------------------------------- harness


@dataclass(slots=True)
class Subject:
    kind: str
    backend: Backend
    baseline: Any
    unkeyed: Backend | None = None  # +auth kinds: the same medium without auth_key


def _bench_transfer(subject: Subject, size: int, total: int, rounds: int, batch: int) -> list[Row]:
    count = max(16, total // size)
    # Page-aligned buffers, as an engine's pool slots are (O_DIRECT moves them in place).
    payload = _page_aligned(size)
    payload[:] = np.frombuffer(os.urandom(size), dtype=np.uint8)
    out = _page_aligned(size)
    payload_view = payload.data
    out_views = [out.data] * batch
    sides = ["baseline", "floor", "backend"] + (["unkeyed"] if subject.unkeyed is not None
                                                else [])
    put_times: dict[str, list[float]] = {side: [] for side in sides}
    get_times: dict[str, list[float]] = {side: [] for side in sides}
    backends = {"backend": subject.backend}
    if subject.unkeyed is not None:
        backends["unkeyed"] = subject.unkeyed
    floor_name, check = verify_pass(subject.kind)
    baseline = subject.baseline

    def puts(backend: Backend, keys: list[bytes]) -> Callable[[], None]:
        def run() -> None:
            for chunk in _batches(keys, batch):
                answers = backend.put_many(chunk, [payload_view] * len(chunk))
                if not all(answers):
                    raise RuntimeError(f"{subject.kind}: put_many failed: {answers}")
        return run

    def gets(backend: Backend, keys: list[bytes]) -> Callable[[], None]:
        def run() -> None:
            for chunk in _batches(keys, batch):
                answers = backend.get_many(chunk, out_views[: len(chunk)])
                if not all(answers):
                    raise RuntimeError(f"{subject.kind}: get_many missed: {answers}")
        return run

    def raw(keys: list[bytes], with_check: bool) -> tuple[Callable[[], None], Callable[[], None]]:
        def put() -> None:
            baseline.check = check if with_check else None
            try:
                baseline.put(keys, payload, batch)
            finally:
                baseline.check = None

        def get() -> None:
            baseline.check = check if with_check and baseline.verifies_get else None
            try:
                baseline.get(keys, out, batch)
            finally:
                baseline.check = None

        return put, get

    for _round in range(rounds):
        keys = {side: _keys(count, side) for side in sides}
        actions = []
        for side in sides:
            if side in ("baseline", "floor"):
                actions.append((side, *raw(keys[side], with_check=side == "floor")))
            else:
                actions.append((side, puts(backends[side], keys[side]),
                                gets(backends[side], keys[side])))
        # Rotate who goes first, and flush dirty pages between phases, so that no side pays
        # for another's writeback.
        shift = _round % len(actions)
        actions = actions[shift:] + actions[:shift]
        for side, put, _get in actions:
            os.sync()
            put_times[side].append(_timed(put))
        os.sync()
        for side, _put, get in actions:
            get_times[side].append(_timed(get))
            if not np.array_equal(out, payload):
                raise RuntimeError(f"{subject.kind} ({side}): read back different bytes")
            out[:] = 0
        baseline.cleanup(keys["baseline"])
        baseline.cleanup(keys["floor"])
        for side, backend in backends.items():
            for chunk in _batches(keys[side], 1000):
                backend.delete(chunk)
    volume = count * size / 1e9
    rows = []
    for operation, times in (("put", put_times), ("get", get_times)):
        row = _row(subject.kind, operation, size, volume, times["backend"], baseline.name,
                   times["baseline"], None)
        row.block_bytes = size
        row.floor = volume / statistics.median(times["floor"])
        row.floor_ratio = _paired(times["floor"], times["backend"])
        row.floor_name = (f"{baseline.name} {floor_name}"
                          if operation == "put" or baseline.verifies_get
                          else f"{baseline.name} (nothing to verify)")
        row.targets = tuple(target for target in TARGETS.get((subject.kind, operation), ())
                            if size >= target.min_block)
        rows.append(row)
        if subject.unkeyed is not None:
            rows.append(_row(subject.kind, operation, size, volume, times["backend"],
                             "kvtier, no auth_key", times["unkeyed"],
                             AUTH_TARGETS.get((subject.kind, operation))))
            rows[-1].block_bytes = size
    return rows


def _page_aligned(size: int) -> np.ndarray[Any, Any]:
    """A writable byte array of ``size`` in its own mmap (page-aligned)."""
    return np.frombuffer(mmap.mmap(-1, max(size, 1)), dtype=np.uint8)[:size]


def _paired(base: list[float], ours: list[float]) -> float:
    return statistics.median(b / o for b, o in zip(base, ours, strict=True))


def _row(kind: str, operation: str, size: int, volume: float, ours: list[float],
         baseline_name: str, base: list[float], target: float | None) -> Row:
    return Row(kind, operation, _human(size), "GB/s", volume / statistics.median(ours),
               baseline_name, volume / statistics.median(base), target, _paired(base, ours))


def _bench_exists(subject: Subject, batch: int, total_keys: int, rounds: int) -> Row:
    keys = _keys(max(batch, 256), "exists")
    payload = np.zeros(64, dtype=np.uint8)
    subject.backend.put_many(keys, [payload.data] * len(keys))
    subject.baseline.put(keys, payload, 256)
    calls = max(1, total_keys // batch)
    chunks = [keys[(i * batch) % len(keys) :][:batch] for i in range(calls)]
    chunks = [chunk if len(chunk) == batch else keys[:batch] for chunk in chunks]
    backend_times, baseline_times = [], []
    for _round in range(rounds):

        def run_baseline() -> None:
            for chunk in chunks:
                subject.baseline.exists(chunk)

        def run_backend() -> None:
            for chunk in chunks:
                subject.backend.exists(chunk)

        if _round % 2:
            backend_times.append(_timed(run_backend))
            baseline_times.append(_timed(run_baseline))
        else:
            baseline_times.append(_timed(run_baseline))
            backend_times.append(_timed(run_backend))
    subject.backend.delete(keys)
    subject.baseline.cleanup(keys)
    done = calls * batch
    return Row(
        subject.kind,
        "exists",
        f"batch {batch}",
        "keys/s",
        done / statistics.median(backend_times),
        subject.baseline.exists_name,
        done / statistics.median(baseline_times),
        EXISTS_TARGETS.get(subject.kind),
        statistics.median(
            base / ours for base, ours in zip(baseline_times, backend_times, strict=True)
        ),
    )


def _batch_sizes(parser: argparse.ArgumentParser, text: str) -> list[int]:
    """``--exists-batches``: comma-separated whole numbers >= 1, or a usage error naming it."""
    batches = [item.strip() for item in text.split(",")]
    if not all(item.isdigit() and int(item) >= 1 for item in batches):
        parser.error(f"--exists-batches {text!r}: expected comma-separated whole numbers >= 1, "
                     "e.g. 1,16,256")
    return [int(item) for item in batches]


def _human(size: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


@contextmanager
def _subjects(
    kinds: Sequence[str], workdir: Path, s3_concurrency: int = 32, direct_root: str = "/var/tmp"
) -> Iterator[list[Subject]]:
    namespace = Namespace(model=f"bench-{uuid.uuid4().hex}")
    subjects: list[Subject] = []
    cleanup_dirs: list[Path] = []
    server: Any = None
    client: Any = None
    seaweed: Any = None
    s3_baseline: S3Baseline | None = None
    try:
        for kind in kinds:
            auth = {"auth_key": AUTH_KEY} if kind.endswith("+auth") else {}
            if kind in ("memory", "memory+auth"):
                subjects.append(
                    Subject(kind, open_backend("memory://", namespace, **auth), MemoryBaseline(),
                            open_backend("memory://", namespace) if auth else None)
                )
            elif kind in ("file", "file+auth", "file+capped", "file+python"):
                cap = {"max_bytes": "1TiB"} if kind == "file+capped" else {}
                python = {"native_io": False} if kind == "file+python" else {}
                backend = open_backend(f"file://{workdir / kind}", namespace, **auth, **cap,
                                       **python)
                unkeyed = (open_backend(f"file://{workdir / 'unkeyed'}", namespace)
                           if auth else None)
                subjects.append(Subject(kind, backend, FileBaseline(workdir / f"raw-{kind}"),
                                        unkeyed))
            elif kind == "file+direct":
                direct_dir = Path(tempfile.mkdtemp(prefix="kvtier-bench-direct-", dir=direct_root))
                cleanup_dirs.append(direct_dir)
                backend = open_backend(f"file://{direct_dir / 'tier'}", namespace, o_direct=True)
                subjects.append(Subject(kind, backend, DirectFileBaseline(direct_dir / "raw")))
            elif kind == "redis":
                # The test suite's private-server helper: loopback, free port, no persistence.
                sys.path.insert(0, str(_TESTS_DIR))
                valkey = importlib.import_module("servers.valkey")
                server = valkey.ValkeyServer()
                server.start()
                client = server.client()
                subjects.append(
                    Subject(kind, open_backend(server.url, namespace), RedisBaseline(client))
                )
            elif kind == "s3":
                from obstore.store import S3Store

                # The test suite's private-server helper: weed mini on loopback, free ports.
                sys.path.insert(0, str(_TESTS_DIR))
                seaweed_module = importlib.import_module("servers.seaweed")
                (workdir / "seaweed").mkdir()
                seaweed = seaweed_module.SeaweedServer(
                    root=workdir / "seaweed",
                    bucket="bench",
                    access_key="AK" + secrets.token_hex(8),
                    secret_key=secrets.token_hex(16),
                )
                seaweed.start()
                os.environ.update(
                    AWS_ACCESS_KEY_ID=seaweed.access_key,
                    AWS_SECRET_ACCESS_KEY=seaweed.secret_key,
                    AWS_REGION=seaweed.region,
                )
                store = S3Store(
                    seaweed.bucket,
                    endpoint=seaweed.endpoint_url,
                    region=seaweed.region,
                    virtual_hosted_style_request=False,
                    client_options={"allow_http": True, "timeout": timedelta(seconds=30)},
                )
                s3_baseline = S3Baseline(store, s3_concurrency)
                backend = open_backend(
                    seaweed.url("bench"),
                    namespace,
                    max_concurrency=s3_concurrency,
                    timeout_s=30,
                )
                subjects.append(Subject(kind, backend, s3_baseline))
            else:
                raise SystemExit(f"unknown backend {kind!r}; expected memory, file, redis, s3, "
                                 "memory+auth, file+auth, file+capped, file+python or "
                                 "file+direct")
        yield subjects
    finally:
        for subject in subjects:
            subject.backend.close()
            if subject.unkeyed is not None:
                subject.unkeyed.close()
        if client is not None:
            client.close()
        if server is not None:
            server.close()
        if s3_baseline is not None:
            s3_baseline.close()
        if seaweed is not None:
            seaweed.stop()
            seaweed.remove_socket_files()
        for directory in cleanup_dirs:
            shutil.rmtree(directory, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="memory,file,redis", help="comma-separated kinds")
    parser.add_argument("--sizes", default="64KiB,256KiB,1MiB", help="block sizes")
    parser.add_argument("--total", default="64MiB", help="bytes moved per size, op and round")
    parser.add_argument("--batch", type=int, default=16, help="blocks per put_many/get_many")
    parser.add_argument("--exists-batches", default="1,16,256")
    parser.add_argument("--exists-keys", type=int, default=20000, help="keys probed per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median)")
    parser.add_argument("--dir", default=None, help="scratch directory for the file backend")
    parser.add_argument("--direct-dir", default="/var/tmp",
                        help="real-disk directory for file+direct (not tmpfs)")
    parser.add_argument(
        "--s3-concurrency", type=int, default=32, help="requests in flight (backend and raw)"
    )
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="also write every row to FILE as JSON")
    parser.add_argument("--clock", choices=sorted(_CLOCKS), default="wall",
                        help="wall: elapsed time; cpu: this process's CPU time (user + system), "
                             "for a busy machine where other jobs preempt the run; only for "
                             "media the CPU moves (memory, page cache, tmpfs), not a disk")
    args = parser.parse_args(argv)
    global _clock
    _clock = _CLOCKS[args.clock]

    kinds = [kind.strip() for kind in args.backends.split(",") if kind.strip()]
    sizes = [parse_size(size.strip(), "--sizes") for size in args.sizes.split(",")]
    total = parse_size(args.total, "--total")
    exists_batches = _batch_sizes(parser, args.exists_batches)
    for option, directory in (("--dir", args.dir), ("--direct-dir", args.direct_dir)):
        if directory is not None and not os.path.isdir(directory):
            parser.error(f"{option} {directory!r}: no such directory (expected an existing "
                         "directory to hold the benchmark's scratch files)")
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=args.dir))
    console = Console(width=150)
    rows: list[Row] = []
    started = time.perf_counter()
    try:
        with _subjects(kinds, workdir, args.s3_concurrency, args.direct_dir) as subjects:
            for subject in subjects:
                for size in sizes:
                    console.log(f"{subject.kind}: put/get {_human(size)}")
                    rows.extend(_bench_transfer(subject, size, total, args.rounds, args.batch))
                for batch in exists_batches:
                    console.log(f"{subject.kind}: exists batch {batch}")
                    rows.append(_bench_exists(subject, batch, args.exists_keys, args.rounds))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    table = Table(title=f"kvtier backend throughput ({time.perf_counter() - started:.0f} s)")
    for column in ("backend", "op", "block / batch", "kvtier", "baseline", "raw", "ratio",
                   "floor", "of floor", "target"):
        table.add_column(column, justify="right" if column in ("kvtier", "raw", "ratio", "floor",
                                                             "of floor") else "left")
    for row in rows:
        verdict = ""
        if row.target is not None:
            ok = row.ratio >= row.target
            verdict = f"{'[green]ok' if ok else '[red]MISS'} (>= {row.target:.0%})"
        elif row.targets:
            missed = row.misses()
            wanted = ", ".join(f"{t.ratio:.0%} {t.against}" for t in row.targets)
            verdict = f"[red]MISS ({', '.join(missed)})" if missed else f"[green]ok ({wanted})"
        fmt = "{:,.0f}" if row.unit == "keys/s" else "{:.2f}"
        table.add_row(
            row.backend,
            row.operation,
            row.shape,
            f"{fmt.format(row.value)} {row.unit}",
            row.baseline_name,
            f"{fmt.format(row.baseline)} {row.unit}",
            f"{row.ratio:.0%}",
            "" if row.floor is None else f"{row.floor:.2f} {row.unit}",
            "" if row.floor_ratio is None else f"{row.floor_ratio:.0%}",
            verdict,
        )
    if args.json:
        document = [row.as_json() for row in rows if row.baseline_name != "kvtier, no auth_key"]
        for row in rows:  # +auth kinds: the unkeyed kvtier of the same rounds, on its row
            if row.baseline_name == "kvtier, no auth_key":
                for entry in document:
                    if (entry["backend"], entry["op"], entry.get("block_bytes")) == (
                            row.backend, row.operation, row.block_bytes):
                        entry["unkeyed_gbps"] = row.baseline
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
