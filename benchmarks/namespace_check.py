"""The file tier's namespace check made inside the native batch call, against the same check
made from Python before the call, beside a scheduler thread that never sleeps.

Before every batch the file tier re-checks its held namespace directory (``fstat`` of the held
descriptor, ``fstatat`` of its name under the root: docs/tiers.md). From Python that is two
system calls, each of which gives the interpreter lock up and must win it back from the
scheduler thread; inside the native call (``TierDirs.acquire_guarded``, the default) it costs
no lock hand-off at all. Both arms run the same file tier (``/dev/shm``, so the medium is not
the limit), the same 16 KiB blocks in batches of 64 from 4 I/O threads, stores then probes then
loads, with the main thread spinning in pure Python (the engine's scheduler) or idle
(``--idle``). The ``python`` arm makes ``acquire_guarded`` answer None, which is what the tier
does whenever its view is due for renewal: the checks then run in Python, as they all did
before. Arms interleaved, medians; the ratio is native / python.

Run::

    .venv/bin/python benchmarks/namespace_check.py [--rounds 21] [--blocks 2048] [--idle]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gil_contention import spin_scheduler  # a sibling script: benchmarks/ is on sys.path
from kvtier.backends.file import dirs
from kvtier.backends.file.backend import FileBackend
from kvtier.keys import Namespace

BLOCK = 16 * 1024
CHUNK = 64
THREADS = 4
OPS = ("put", "probe", "load")
ARMS = ("native", "python")


def _python_check(_self: dirs.TierDirs) -> None:
    return None  # no guarded view: every batch takes acquire(), the check from Python


def _one_round(root: str, blocks: int, arm: str, busy: bool) -> dict[str, float]:
    """Blocks per second of each operation, one fresh namespace."""
    guarded = dirs.TierDirs.acquire_guarded
    backend = FileBackend(root, Namespace.from_mapping({"model": f"ns-{uuid.uuid4().hex[:8]}"}))
    keys = [uuid.uuid4().bytes for _ in range(blocks)]
    chunks = [keys[i : i + CHUNK] for i in range(0, blocks, CHUNK)]
    outs = [[memoryview(bytearray(BLOCK)) for _ in chunk] for chunk in chunks]
    payload = bytes(BLOCK)
    backend.put_many([bytes([n]) + b"warm" for n in range(256)], [payload] * 256)
    backend.exists([bytes([n]) + b"warm" for n in range(256)])  # fan-outs cached, view renewed
    calls: dict[str, Callable[[int], list[bool]]] = {
        "put": lambda i: backend.put_many(chunks[i], [payload] * len(chunks[i])),
        "probe": lambda i: backend.exists(chunks[i]),
        "load": lambda i: backend.get_many(chunks[i], outs[i]),
    }
    rates: dict[str, float] = {}
    stop = threading.Event()
    spinner = threading.Thread(target=spin_scheduler, args=(stop,), daemon=True)
    if arm == "python":
        dirs.TierDirs.acquire_guarded = _python_check  # type: ignore[method-assign,assignment]
    try:
        with ThreadPoolExecutor(THREADS) as pool:
            if busy:
                spinner.start()
            for op in OPS:
                started = time.perf_counter()
                answers = list(pool.map(calls[op], range(len(chunks))))
                rates[op] = blocks / (time.perf_counter() - started)
                if not all(all(answer) for answer in answers):
                    raise RuntimeError(f"a block did not answer True to {op}")
    finally:
        dirs.TierDirs.acquire_guarded = guarded  # type: ignore[method-assign]
        stop.set()
        if busy:
            spinner.join()
        backend.close()
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=21, help="interleaved rounds (median)")
    parser.add_argument("--blocks", type=int, default=2048, help="blocks per operation")
    parser.add_argument("--idle", action="store_true", help="no spinning scheduler thread")
    parser.add_argument("--json", type=Path, help="write the results as JSON to this file")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.blocks < CHUNK:
        parser.error(f"--rounds {args.rounds} / --blocks {args.blocks}: expected at least 1 "
                     f"round and {CHUNK} blocks")
    samples: dict[str, dict[str, list[float]]] = {arm: {op: [] for op in OPS} for arm in ARMS}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as root:
        for round_index in range(args.rounds):
            for arm in ARMS if round_index % 2 else reversed(ARMS):
                for op, rate in _one_round(root, args.blocks, arm, not args.idle).items():
                    samples[arm][op].append(rate)
    medians = {arm: {op: statistics.median(v) for op, v in ops.items()}
               for arm, ops in samples.items()}
    scheduler = "idle" if args.idle else "spinning"
    print(f"file tier in /dev/shm, {THREADS} I/O threads, {args.blocks} blocks of 16 KiB in "
          f"batches of {CHUNK}, scheduler thread {scheduler}, medians of {args.rounds} rounds")
    print(f"{'op':>6} {'native /s':>11} {'python /s':>11} {'native/python':>14}")
    for op in OPS:
        native, python = medians["native"][op], medians["python"][op]
        print(f"{op:>6} {native:>11,.0f} {python:>11,.0f} {native / python:>14.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"scheduler": scheduler, "rounds": args.rounds,
                                         "blocks": args.blocks, "medians": medians,
                                         "samples": samples}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
