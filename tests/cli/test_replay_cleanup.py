"""What a replay cleans up and the TTL it adds: exact revisions, exact numbers."""

from __future__ import annotations

import signal
import urllib.parse
from pathlib import Path

import pytest

from kvtier.backends import open_backend
from kvtier.cli.common import REPLAY_MODEL
from kvtier.cli.replay import _replay_namespaces, _with_ttl, replay_revisions
from kvtier.keys import Namespace, chain_keys


def _store(url: str, revision: str) -> Namespace:
    namespace = Namespace(model=REPLAY_MODEL, revision=revision)
    backend = open_backend(url, namespace)
    keys = chain_keys(list(range(32)), 16, namespace)
    assert backend.put_many(keys, [bytes(64)] * len(keys)) == [True, True]
    backend.close()
    return namespace


def test_cleanup_of_tag_foo_leaves_run_foo_bar_alone(tmp_path: Path) -> None:
    """Before: the revision was matched by prefix, so tag 'foo' also took 'foo-bar-kvtier'."""
    url = f"file://{tmp_path}"
    mine = _store(url, "foo-kvtier")
    other = _store(url, "foo-bar-kvtier")
    found = _replay_namespaces(url, "foo")
    assert [item.digest for item in found] == [mine.digest_hex]
    assert other.digest_hex not in {item.digest for item in found}
    assert "foo-bar-kvtier" not in replay_revisions("foo")


def test_ttl_is_written_without_an_exponent() -> None:
    """Before: 1209600 became 'ttl_s=1.2096e+06', read back as '1.2096e 06' and rejected."""
    url = _with_ttl("redis://127.0.0.1:6379/0", 1_209_600)
    assert urllib.parse.parse_qs(urllib.parse.urlsplit(url).query) == {"ttl_s": ["1209600"]}
    fractional = _with_ttl("redis://127.0.0.1:6379/0?socket_timeout_s=2", 0.25)
    assert urllib.parse.parse_qs(urllib.parse.urlsplit(fractional).query)["ttl_s"] == ["0.25"]
    assert _with_ttl("file:///tmp/x", 60) == "file:///tmp/x"


def test_absurd_replay_numbers_are_refused_by_name() -> None:
    """Before: --step-ms 1e308 raised OverflowError, --speed 1e-300 slept forever."""
    import subprocess
    import sys

    for flag, value in (("--step-ms", "1e308"), ("--speed", "1e-300"), ("--ttl-s", "1e308")):
        done = subprocess.run([sys.executable, "-m", "kvtier.cli", "replay", flag, value],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert f"argument {flag}: expected a finite number" in done.stderr
        assert "Traceback" not in done.stderr


# ---- signals during the end-of-run cleanup ---------------------------------------------------
# The moment is pinned with the cleanup test hook (kvtier.cli.signals.cleanup_starts): the run
# blocks at the start of its cleanup until the test has opened and closed a FIFO.


def _tier_url(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if kind == "file":
        return f"file://{tmp_path / 'tier'}"
    server = request.getfixturevalue("redis_server")
    return f"redis://127.0.0.1:{server.port}/0"


def _stored_blocks(url: str, tag: str) -> int:
    return sum(item.blocks for item in _replay_namespaces(url, tag))


class _HeldReplay:
    """A real ``kvtier replay`` subprocess held at the start of its cleanup."""

    def __init__(self, tmp_path: Path, url: str, tag: str) -> None:
        import json
        import os
        import subprocess
        import sys
        import threading

        from kvtier.cli.signals import CLEANUP_HOOK_ENV

        trace = tmp_path / "trace.jsonl"
        trace.write_text("".join(
            json.dumps({"timestamp": i, "input_length": 512 * 6, "output_length": 8,
                        "hash_ids": list(range(6 * i, 6 * i + 6))}) + "\n" for i in range(20)))
        self.fifo = tmp_path / "cleanup.fifo"
        os.mkfifo(self.fifo)
        self.out = (tmp_path / "stdout.txt").open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli", "replay", str(trace), "--tier", url,
             "--namespace-tag", tag, "--step-ms", "0", "--block-bytes", "4KiB",
             "--no-progress"],
            stdout=self.out, stderr=subprocess.PIPE, text=True,
            env={**os.environ, CLEANUP_HOOK_ENV: str(self.fifo)})
        # Should the run die before its cleanup, open the read end so that our open returns.
        threading.Thread(target=self._unblock_when_dead, daemon=True).start()
        self.writer = self.fifo.open("wb")  # returns once the cleanup has started
        assert self.process.poll() is None, self.process.communicate(timeout=30)[1]
        self.err: list[str] = []

    def _unblock_when_dead(self) -> None:
        import contextlib
        import os

        self.process.wait()
        with contextlib.suppress(OSError):
            os.close(os.open(self.fifo, os.O_RDONLY | os.O_NONBLOCK))

    def signal_and_wait_for(self, signum: int, text: str) -> None:
        """Send ``signum`` and read stderr until a line holds ``text`` (or the run ends)."""
        self.process.send_signal(signum)
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.err.append(line)
            if text in line:
                return

    def finish(self) -> tuple[int, str]:
        self.writer.close()
        assert self.process.stderr is not None
        try:
            # Through the same buffered reader as the lines before (communicate() would read
            # the pipe past what that reader already holds).
            rest = self.process.stderr.read()
            self.process.wait(timeout=60)
        finally:
            self.process.kill()
            self.out.close()
        return self.process.returncode, "".join(self.err) + rest


@pytest.mark.parametrize("kind", ["file", "redis"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_cleanup_lets_it_finish(tmp_path: Path, kind: str, signum: int,
                                                request: pytest.FixtureRequest) -> None:
    """Before: the signal interrupted the removal, and the run said "cleaned up" (exit 143)
    with the blocks still stored."""
    url = _tier_url(kind, tmp_path, request)
    tag = f"held-{kind}-{signum}"
    held = _HeldReplay(tmp_path, url, tag)
    assert _stored_blocks(url, tag) > 0
    held.signal_and_wait_for(signum, "finishing the cleanup")
    code, err = held.finish()
    assert code == 128 + signum, err
    assert _stored_blocks(url, tag) == 0, err
    assert "cleaned up" in err and "Traceback" not in err


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_a_second_signal_stops_the_cleanup_and_says_what_is_left(
        tmp_path: Path, kind: str, request: pytest.FixtureRequest) -> None:
    """Before: the first signal already stopped the removal and the run said "cleaned up".
    Now the second one stops it, and the run names the exact count left and the command that
    removes it (which works when pasted)."""
    import shlex
    import subprocess
    import sys

    url = _tier_url(kind, tmp_path, request)
    tag = f"aborted-{kind}"
    held = _HeldReplay(tmp_path, url, tag)
    stored = _stored_blocks(url, tag)
    held.signal_and_wait_for(signal.SIGTERM, "finishing the cleanup")
    held.signal_and_wait_for(signal.SIGTERM, "left")
    code, err = held.finish()
    assert code == 128 + signal.SIGTERM, err
    assert _stored_blocks(url, tag) == stored
    assert f"{stored:,} blocks" in err and "cleaned up" not in err, err
    assert "remove them with:" in err, err
    commands = [line.strip() for line in err.splitlines() if line.startswith("  kvtier purge ")]
    assert commands, err
    for command in commands:
        # No terminal here to answer purge's question: --yes answers it.
        argv = [*shlex.split(command), "--yes"]
        done = subprocess.run([sys.executable, "-m", "kvtier.cli", *argv[1:]],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    assert _stored_blocks(url, tag) == 0
