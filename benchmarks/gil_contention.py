"""What a scheduler thread that never sleeps does to the tier's I/O threads, and what helps.

A file tier (``/dev/shm``, so the medium is not the limit) stores, probes and loads 16 KiB
blocks from its I/O threads while the main thread either sleeps (an idle scheduler: the
baseline, measured in the same run) or runs pure-Python work without a pause (the engine's
scheduler, or the replay as fast as possible). Every configuration runs ``--rounds`` times,
interleaved; medians. The variables:

- ``native``: the file tier's batch calls in its C extension (``native_io=true``, the default:
  the interpreter lock released once per batch) or made from Python (``native_io=false``: given
  up and taken back at every system call);
- the interpreter's switch interval (``sys.setswitchinterval``, ``--intervals``): how long a
  thread that comes back from a system call waits for the interpreter lock before the running
  thread is asked to drop it. kvtier does not change it (it is process-wide); instead the
  TieringManager's end-of-step wait gives the tiers' threads as much time as the scheduler
  thread took (see docs/concepts.md, "Threads and the GIL"), which the 50-session replay
  measures.

Run::

    .venv/bin/python benchmarks/gil_contention.py [--blocks 2000] [--rounds 3] [--intervals 0.005]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from kvtier.backends.file.backend import FileBackend
from kvtier.keys import Namespace

BLOCK = 16 * 1024
THREADS = 4
CHUNK = 64


def spin_scheduler(stop: threading.Event) -> None:
    """A scheduler that never sleeps: pure-Python work holding the interpreter lock (also
    ``namespace_check.py``'s)."""
    table: dict[int, int] = {}
    while not stop.is_set():
        for index in range(1000):
            table[index] = table.get(index, 0) + 1


def _one_run(root: str, blocks: int, busy: bool, native: bool) -> tuple[float, float, float]:
    """(puts, probes, loads per second) with the main thread idle or busy."""
    namespace = Namespace.from_mapping({"model": f"gil-{uuid.uuid4().hex[:8]}"})
    backend = FileBackend(root, namespace, native_io=native)
    keys = [uuid.uuid4().bytes for _ in range(blocks)]
    payload = bytes(BLOCK)
    chunks = [keys[i : i + CHUNK] for i in range(0, blocks, CHUNK)]
    outs = {id(chunk): [memoryview(bytearray(BLOCK)) for _ in chunk] for chunk in chunks}
    stop = threading.Event()
    spinner = threading.Thread(target=spin_scheduler, args=(stop,)) if busy else None
    try:
        with ThreadPoolExecutor(THREADS) as pool:
            if spinner is not None:
                spinner.start()
            started = time.perf_counter()
            list(pool.map(lambda chunk: backend.put_many(chunk, [payload] * len(chunk)),
                          chunks))
            put_s = time.perf_counter() - started
            started = time.perf_counter()
            list(pool.map(backend.exists, chunks))
            probe_s = time.perf_counter() - started
            started = time.perf_counter()
            loaded = list(pool.map(lambda chunk: backend.get_many(chunk, outs[id(chunk)]),
                                   chunks))
            get_s = time.perf_counter() - started
    finally:
        stop.set()
        if spinner is not None:
            spinner.join()
        backend.close()
    if not all(all(answers) for answers in loaded):
        raise RuntimeError("a stored block did not load")
    return blocks / put_s, blocks / probe_s, blocks / get_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--intervals", default="0.005,0.0005,0.0001",
                        help="switch intervals in seconds (0.005 is CPython's default)")
    args = parser.parse_args()
    intervals = [float(v) for v in args.intervals.split(",")]
    original = sys.getswitchinterval()
    Key = tuple[float, bool, bool]  # (switch interval, busy, native)
    results: dict[Key, list[tuple[float, float, float]]] = {}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as root:
        for round_index in range(args.rounds):
            for interval in intervals:
                sys.setswitchinterval(interval)
                order = (True, False) if round_index % 2 else (False, True)
                for native in order:
                    for busy in (False, True):
                        results.setdefault((interval, busy, native), []).append(
                            _one_run(root, args.blocks, busy, native))
    sys.setswitchinterval(original)
    print(f"file tier in /dev/shm, {THREADS} I/O threads, {args.blocks} blocks of 16 KiB, "
          f"medians of {args.rounds} rounds; 'vs idle': the same calls with the scheduler idle")
    print(f"{'switch ms':>9} {'calls':>7} {'scheduler':>9} {'puts/s':>8} {'vs idle':>7} "
          f"{'probes/s':>9} {'vs idle':>7} {'loads/s':>8} {'vs idle':>7}")
    for interval in intervals:
        for native in (True, False):
            idle = [statistics.median(r[i] for r in results[(interval, False, native)])
                    for i in range(3)]
            for busy in (False, True):
                rates = [statistics.median(r[i] for r in results[(interval, busy, native)])
                         for i in range(3)]
                cells = "".join(f" {rate:>8.0f} {rate / base:>7.2f}"
                                for rate, base in zip(rates, idle, strict=True))
                print(f"{interval * 1e3:>9.2f} {'native' if native else 'python':>7} "
                      f"{'busy' if busy else 'idle':>9}{cells}")


if __name__ == "__main__":
    main()
