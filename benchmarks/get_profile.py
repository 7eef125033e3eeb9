"""Where a verified ``get`` spends its time, per block, against what any reader must do.

    .venv/bin/python benchmarks/get_profile.py                       # file (page cache), memory
    .venv/bin/python benchmarks/get_profile.py --sizes 64KiB,1MiB --rounds 21

The throughput benchmark (``backend_throughput.py``) compares kvtier's ``get`` with a raw read
that verifies nothing. This one splits the difference into its parts, each measured in the same
run, interleaved round by round (median of ``--rounds``), over the same blocks:

- file: ``raw`` = ``open`` + ``preadv`` (header and payload, like the backend) + ``close``;
  ``+fstat`` adds the ``fstat`` the backend needs to refuse non-regular files and to name the
  object it read; ``+xxh3`` adds one xxh3 pass over the payload (the checksum every verified
  read must compute); ``kvtier`` is ``FileBackend.get_many``. ``kvtier - (+xxh3)`` is kvtier's
  own Python per block; ``(+xxh3) - raw`` is the price of verifying at all.
- memory: ``copy`` = a numpy copy out of each block's own private copy (as a store must keep
  one); ``kvtier`` = ``MemoryBackend.get_many`` (a frame this instance encoded: header
  checked, checksum skipped, one copy).

Everything runs on the main thread; the module owns no shared state.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import xxhash
from rich.console import Console
from rich.table import Table

from kvtier.backends import open_backend
from kvtier.keys import Namespace
from kvtier.settings import parse_size

HEADER_BYTES = 512


def _median_us(action: Callable[[], None], blocks: int, samples: list[float]) -> None:
    started = time.perf_counter()
    action()
    samples.append((time.perf_counter() - started) / blocks * 1e6)


def _file_rows(directory: Path, size: int, blocks: int, rounds: int) -> list[tuple[str, float]]:
    backend = open_backend(directory.as_uri(), Namespace(model=f"get-profile-{size}"))
    try:
        keys = [os.urandom(16) for _ in range(blocks)]
        payload = np.random.default_rng(size).bytes(size)
        backend.put_many(keys, [payload] * blocks)
        paths = [backend.path_for(key) for key in keys]  # type: ignore[attr-defined]
        outs = [memoryview(bytearray(size)) for _ in range(blocks)]
        header = bytearray(HEADER_BYTES)

        def raw(stat: bool = False, digest: bool = False) -> None:
            for path, out in zip(paths, outs, strict=True):
                fd = os.open(path, os.O_RDONLY)
                if stat:
                    os.fstat(fd)
                os.preadv(fd, [header, out], 0)
                os.close(fd)
                if digest:
                    xxhash.xxh3_64_intdigest(out)

        def kvtier() -> None:
            if not all(backend.get_many(keys, outs)):
                raise RuntimeError("a block failed to load")

        variants: list[tuple[str, Callable[[], None]]] = [
            ("raw", raw), ("+fstat", lambda: raw(stat=True)),
            ("+xxh3", lambda: raw(stat=True, digest=True)), ("kvtier", kvtier)]
        return _interleaved(variants, blocks, rounds)
    finally:
        backend.close()


def _memory_rows(size: int, blocks: int, rounds: int) -> list[tuple[str, float]]:
    backend = open_backend("memory://", Namespace(model=f"get-profile-{size}"))
    try:
        keys = [os.urandom(16) for _ in range(blocks)]
        source = np.frombuffer(np.random.default_rng(size).bytes(size), dtype=np.uint8)
        backend.put_many(keys, [source.data] * blocks)
        stored = [source.copy() for _ in range(blocks)]  # distinct copies, like the frames
        arrays = [np.empty(size, dtype=np.uint8) for _ in range(blocks)]
        outs = [array.data for array in arrays]

        def copy() -> None:
            for array, private in zip(arrays, stored, strict=True):
                np.copyto(array, private)

        def kvtier() -> None:
            if not all(backend.get_many(keys, outs)):
                raise RuntimeError("a block failed to load")

        return _interleaved([("copy", copy), ("kvtier", kvtier)], blocks, rounds)
    finally:
        backend.close()


def _interleaved(variants: Sequence[tuple[str, Callable[[], None]]], blocks: int,
                 rounds: int) -> list[tuple[str, float]]:
    samples: dict[str, list[float]] = {name: [] for name, _ in variants}
    for index in range(rounds + 1):
        order = variants if index % 2 else list(reversed(variants))
        for name, action in order:
            if index:  # round 0 warms the page cache and the allocator
                _median_us(action, blocks, samples[name])
            else:
                action()
    return [(name, statistics.median(samples[name])) for name, _ in variants]


def _table(title: str, rows: dict[str, list[tuple[str, float]]]) -> Table:
    names = [name for name, _ in next(iter(rows.values()))]
    table = Table(title=title)
    table.add_column("block")
    for name in names:
        table.add_column(f"{name} µs", justify="right")
    table.add_column("kvtier / first", justify="right")
    for size, values in rows.items():
        first = values[0][1]
        ours = values[-1][1]
        table.add_row(size, *(f"{value:.1f}" for _, value in values), f"{first / ours:.2f}")
    return table


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64KiB,256KiB,1MiB")
    parser.add_argument("--total", default="64MiB", help="bytes per variant per round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm") if Path(
        "/dev/shm").is_dir() else None, help="file tier directory (default /dev/shm: the "
        "page cache, so the numbers are CPU, not disk)")
    args = parser.parse_args(argv)
    try:
        sizes = [parse_size(part.strip(), "--sizes", minimum=1)
                 for part in args.sizes.split(",") if part.strip()]
        total = parse_size(args.total, "--total", minimum=1)
    except ValueError as exc:
        parser.error(str(exc))
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    file_rows: dict[str, list[tuple[str, float]]] = {}
    memory_rows: dict[str, list[tuple[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-get-profile-", dir=args.dir) as scratch:
        for size in sizes:
            blocks = max(8, total // size)
            label = f"{size >> 10} KiB" if size < 1 << 20 else f"{size >> 20} MiB"
            file_rows[label] = _file_rows(Path(scratch, str(size)), size, blocks, args.rounds)
            memory_rows[label] = _memory_rows(size, blocks, args.rounds)
    console = Console(width=100)
    console.print(_table("file get, per block (page cache)", file_rows))
    console.print(_table("memory get, per block", memory_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
