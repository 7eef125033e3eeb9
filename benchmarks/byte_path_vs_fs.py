"""kvtier's file tier against vLLM's own ``fs`` tier on the byte path alone, outside the engine.

Run with the vLLM venv (``scripts/setup-vllm-venv.sh``)::

    PYTHONPATH=src .venv-vllm/bin/python benchmarks/byte_path_vs_fs.py [--blocks 16,64]
        [--block-bytes 256KiB] [--modes buffered,direct] [--rounds 60] [--dir /var/tmp]
        [--json FILE]

The same blocks (``--block-bytes`` each, the cpu preset's chunk by default), written once by
each tier into its own directory under ``--dir`` (a real disk for O_DIRECT; tmpfs refuses it),
are read back into one page-aligned region, as a load lands in the CPU tier's slots:

- ``fs``: vLLM's ``batch_load_block``, one call on a pool thread, as its tier runs it;
- ``kvtier``: ``FileBackend.get_many`` in 1, 2 or 4 parts on pool threads (a tier with several
  I/O threads splits a load), every block's frame and checksum verified (``fs`` verifies
  nothing).

Every round times each side once, in turn (interleaved); the table shows medians over the
rounds and kvtier's best split against ``fs``. The engine-load benchmark
(``benchmarks/engine_load.py``) is where the same loads are measured inside the engine; this
one says whether a difference there comes from the bytes or from the engine's steps around them.

Owns no shared state: the main thread drives, a private pool of four threads reads.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from engine_load import BenchArgumentError, parse_modes  # the sibling benchmark's --modes
from kvtier.backends.file import FileBackend
from kvtier.keys import BlockKey, Namespace
from kvtier.settings import ConfigError, parse_size

SPLITS = (1, 2, 4)


def _fs_io() -> tuple[Callable[..., None], Callable[..., None]]:
    try:
        from vllm.v1.kv_offload.tiering.fs.io import batch_load_block, batch_store_block
    except ImportError as exc:
        raise SystemExit("byte_path_vs_fs needs vLLM's fs tier (run it with .venv-vllm: "
                         f"bash scripts/setup-vllm-venv.sh .venv-vllm): {exc}") from exc
    return batch_load_block, batch_store_block


class Sides:
    """The two tiers over the same blocks, written once, read into one region."""

    def __init__(self, root: Path, blocks: int, block_bytes: int, direct: bool,
                 pool: ThreadPoolExecutor) -> None:
        self.load_fs, store_fs = _fs_io()
        self.direct = direct
        self.block_bytes = block_bytes
        self.pool = pool
        self.region = mmap.mmap(-1, block_bytes * blocks)  # page-aligned, as the pool's slots
        view = memoryview(self.region)
        self.offsets = [index * block_bytes for index in range(blocks)]
        for offset in self.offsets:
            view[offset:offset + block_bytes] = os.urandom(block_bytes)
        self.keys: list[BlockKey] = [os.urandom(16) for _ in range(blocks)]
        (root / "fs").mkdir(parents=True)
        self.paths = [str(root / "fs" / f"{key.hex()}.bin") for key in self.keys]
        store_fs(self.paths, view, self.offsets, block_bytes, direct)
        self.backend = FileBackend(str(root / "kvtier"), Namespace(model="byte-path"),
                                   o_direct=direct)
        self.outs = [view[offset:offset + block_bytes] for offset in self.offsets]
        if self.backend.put_many(self.keys, self.outs) != [True] * blocks:
            raise RuntimeError("kvtier's file tier refused a block of the benchmark")
        self.view = view

    def read_fs(self) -> None:
        self.pool.submit(self.load_fs, self.paths, self.view, self.offsets, self.block_bytes,
                         self.direct).result()

    def read_kvtier(self, parts: int) -> None:
        size = -(-len(self.keys) // parts)
        futures = [self.pool.submit(self.backend.get_many, self.keys[i:i + size],
                                    self.outs[i:i + size])
                   for i in range(0, len(self.keys), size)]
        for future in futures:
            if not all(future.result()):
                raise RuntimeError("kvtier's file tier failed to read a block it stored")

    def close(self) -> None:
        self.backend.close()
        self.outs.clear()
        self.view.release()
        self.region.close()


def measure(sides: Sides, rounds: int) -> dict[str, float]:
    """Median milliseconds per read of every side, the sides taken in turn each round."""
    runs: dict[str, Callable[[], None]] = {"fs": sides.read_fs}
    for parts in SPLITS:
        runs[f"kvtier_{parts}"] = lambda parts=parts: sides.read_kvtier(parts)
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()  # warm: the page cache (buffered) and the code paths, not timed
    for _ in range(rounds):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            samples[name].append((time.perf_counter() - started) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def run(blocks: Sequence[int], block_bytes: int, modes: Sequence[str], rounds: int,
        directory: Path) -> list[dict[str, Any]]:
    rows = []
    with ThreadPoolExecutor(max_workers=max(SPLITS)) as pool:
        for mode in modes:
            for count in blocks:
                with tempfile.TemporaryDirectory(dir=directory) as scratch:
                    sides = Sides(Path(scratch), count, block_bytes, mode == "direct", pool)
                    try:
                        medians = measure(sides, rounds)
                    finally:
                        sides.close()
                best = min(medians[f"kvtier_{parts}"] for parts in SPLITS)
                rows.append({"mode": mode, "blocks": count, "block_bytes": block_bytes,
                             "fs_ms": medians["fs"],
                             **{f"kvtier_{parts}_parts_ms": medians[f"kvtier_{parts}"]
                                for parts in SPLITS},
                             "best_kvtier_over_fs": best / medians["fs"]})
    return rows


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, "
                                         f"got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=_positive_ints, default=[16, 64],
                        help="blocks per load (default 16,64)")
    parser.add_argument("--block-bytes", default="256KiB",
                        help="bytes per block, a multiple of 4096 (default 256KiB)")
    parser.add_argument("--modes", default="buffered,direct",
                        help="buffered, direct (O_DIRECT) or both (default)")
    parser.add_argument("--rounds", type=int, default=60, help="interleaved rounds (median)")
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"),
                        help="where the tiers' files go: a real disk for O_DIRECT")
    parser.add_argument("--json", type=Path, help="write the rows as JSON to this file")
    args = parser.parse_args(argv)
    try:
        args.block_bytes = parse_size(args.block_bytes, "--block-bytes", minimum=4096)
        args.modes = parse_modes(args.modes)
    except (ConfigError, BenchArgumentError) as exc:
        parser.error(str(exc))
    if args.block_bytes % 4096:
        parser.error(f"--block-bytes must be a multiple of 4096 (O_DIRECT), got "
                     f"{args.block_bytes}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if not args.dir.is_dir():
        parser.error(f"--dir {args.dir}: not a directory")
    rows = run(args.blocks, args.block_bytes, args.modes, args.rounds, args.dir)
    print(f"median ms per load of {args.block_bytes // 1024} KiB blocks over {args.rounds} "
          f"interleaved rounds, files under {args.dir}")
    print(f"{'mode':9s} {'blocks':>6s} {'fs':>8s} " +
          " ".join(f"{f'kvtier/{parts}':>9s}" for parts in SPLITS) + "  best/fs")
    for row in rows:
        print(f"{row['mode']:9s} {row['blocks']:6d} {row['fs_ms']:8.2f} " +
              " ".join(f"{row[f'kvtier_{parts}_parts_ms']:9.2f}" for parts in SPLITS) +
              f"  {row['best_kvtier_over_fs']:7.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {**vars(args), "dir": str(args.dir),
                                                  "json": str(args.json)},
                                         "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
