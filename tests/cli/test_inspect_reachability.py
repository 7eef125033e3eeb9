"""`kvtier inspect` without --key reads the medium once, so a dead one exits 1.

Before: its table is this process's own counters, so a dead Redis or S3 endpoint printed zeros
and exited 0. The dead endpoints are real: loopback ports with nothing listening (the S3 client
gets static test credentials, so it never looks for instance credentials off this machine).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:{port}/0?socket_timeout_s=2&connect_timeout_s=1",
    "s3://bucket/prefix?endpoint_url=http://127.0.0.1:{port}&timeout_s=2&region=us-east-1",
])
def test_inspect_of_a_dead_medium_exits_1(url: str) -> None:
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "kvtier-test", "AWS_SECRET_ACCESS_KEY": "x" * 16,
           "AWS_EC2_METADATA_DISABLED": "true"}
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "inspect", url.format(port=_closed_port()),
         "--namespace", "model=m"], capture_output=True, text=True, timeout=90, env=env)
    # The S3 client's native runtime used to abort the process at exit (SIGABRT, about 1 run in
    # 7; in gdb an obstore tokio worker is inside asyncio's call_soon_threadsafe when
    # Py_FinalizeEx starts, and re-taking the GIL then calls pthread_exit through Rust frames);
    # the command now exits without finalization once obstore was used (cli.run_command).
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "FAILED: could not read" in done.stderr


def test_inspect_of_a_live_medium_exits_0() -> None:
    done = subprocess.run([sys.executable, "-m", "kvtier.cli", "inspect", "memory://",
                           "--namespace", "model=m"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
