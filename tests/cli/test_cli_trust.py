"""The ``kvtier`` command under faults and hostile input (issue 10), with real parts: real Valkey
(with a password, unreachable, SIGSTOPped), real SeaweedFS S3 with wrong keys, real signals to a
real subprocess, real scratch directories. Every subprocess runs under a wall-clock limit."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli.scratch import SCRATCH_PREFIX, remove_stale_scratch
from kvtier.cli.scrub import Scrubber
from kvtier.config import ConfigError, KvtierConfig, load_config

PASSWORD = "Pa55-w0rd-s3cr3t-9f1c"
FAST = ["--step-ms", "0", "--block-bytes", "4KiB", "--no-progress", "--max-requests", "40"]
WALL_S = 120


def kvtier(*args: str, env: dict[str, str] | None = None,
           timeout: float = WALL_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---- secrets ------------------------------------------------------------------------------

def test_a_redis_password_is_never_shown(valkey_factory: Any, tmp_path: Path) -> None:
    server = valkey_factory("--requirepass", PASSWORD)
    url = f"redis://default:{PASSWORD}@127.0.0.1:{server.port}/0"
    report = tmp_path / "report.json"
    done = kvtier("replay", "--tier", url, "--json", str(report), *FAST)
    assert done.returncode == 0, done.stderr
    assert "***" in done.stdout  # the tier is shown, redacted
    text = report.read_text()
    assert stat.S_IMODE(report.stat().st_mode) == 0o600
    inspect = kvtier("inspect", url, "--key", "00ff")
    assert inspect.returncode == 0, inspect.stderr
    wrong = kvtier("inspect", url.replace(PASSWORD, PASSWORD + "x"))
    assert wrong.returncode != 0
    odd_scheme = kvtier("inspect", f"ftp://u:{PASSWORD}@h/x")
    file_url = kvtier("inspect", f"file://u:{PASSWORD}@host/x")
    bad_tier = kvtier("replay", "--tier", f"nope://u:{PASSWORD}@h", *FAST)
    assert file_url.returncode == 2 and odd_scheme.returncode == 2 and bad_tier.returncode == 2
    for output in (done.stdout, done.stderr, text, inspect.stdout, inspect.stderr, wrong.stdout,
                   wrong.stderr, odd_scheme.stderr, file_url.stderr, bad_tier.stderr):
        assert PASSWORD not in output


def test_reprs_of_configs_and_backends_hide_credentials(valkey_factory: Any) -> None:
    from kvtier.backends import open_backend
    from kvtier.keys import Namespace

    server = valkey_factory("--requirepass", PASSWORD)
    url = f"redis://default:{PASSWORD}@127.0.0.1:{server.port}/0"
    config = load_config({"block_bytes": 64, "primary_bytes": 64, "namespace": {"model": "m"},
                          "secondary_tiers": [url, {"url": "redis://127.0.0.1:1/0",
                                                    "password": PASSWORD}]})
    assert isinstance(config, KvtierConfig)
    backend = open_backend(url, Namespace(model="m"))
    try:
        for text in (repr(config), str(config), repr(config.secondary_tiers),
                     repr(backend), repr(backend.config), backend.url):  # type: ignore[attr-defined]
            assert PASSWORD not in text
    finally:
        backend.close()


def test_the_scrubber_hides_passwords_in_any_text() -> None:
    scrub = Scrubber.for_run([f"redis://u:{PASSWORD}@h:1/0", f"s3://b?token={PASSWORD}x"],
                             environ={})
    assert scrub(f"failed on redis://u:{PASSWORD}@h:1/0: {PASSWORD}x") == \
        "failed on redis://u:***@h:1/0: ***"
    assert scrub("rediss://other:hunter2@host") == "rediss://other:***@host"


# ---- failures said out loud ---------------------------------------------------------------

def test_replay_against_an_unreachable_redis_exits_1_naming_the_tier() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0?connect_timeout_s=0.2&socket_timeout_s=0.2"
    done = kvtier("replay", "--tier", url, *FAST)
    assert done.returncode == 1, done.stderr
    assert "FAILED: tier 'redis' failed" in done.stderr


def test_replay_against_a_stopped_valkey_exits_1(valkey_factory: Any) -> None:
    server = valkey_factory()
    server.pause()  # SIGSTOP: connections are accepted by the kernel, nothing ever answers
    try:
        url = f"{server.url}?connect_timeout_s=0.2&socket_timeout_s=0.2"
        started = time.monotonic()
        done = kvtier("replay", "--tier", url, *FAST)
        assert time.monotonic() - started < WALL_S
    finally:
        server.resume()
    assert done.returncode == 1, done.stderr
    assert "tier 'redis' failed" in done.stderr


def test_replay_with_wrong_s3_keys_exits_non_zero(s3_server: Any) -> None:
    env = {"AWS_ACCESS_KEY_ID": "KVTWRONGKEY0000", "AWS_SECRET_ACCESS_KEY": "wrong-" + PASSWORD}
    done = kvtier("replay", "--tier", s3_server.url(f"wrong-{os.getpid()}"), *FAST, env=env)
    assert done.returncode in (1, 2), done.stderr
    assert "s3" in done.stderr
    assert PASSWORD not in done.stdout + done.stderr


def test_inspect_on_a_dead_redis_says_unknown_and_exits_1() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0?connect_timeout_s=0.2&socket_timeout_s=0.2"
    done = kvtier("inspect", url, "--key", "00ff")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "absent" not in done.stdout
    assert "key 00ff: unknown" in done.stdout


# ---- signals and scratch ------------------------------------------------------------------

def _scratch_dirs(parent: Path) -> list[Path]:
    return sorted(parent.glob(f"{SCRATCH_PREFIX}*"))


def _start_long_replay(parent: Path) -> subprocess.Popen[str]:
    replay = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "replay", "--scratch-dir", str(parent),
         "--step-ms", "5", "--block-bytes", "4KiB", "--no-progress", "--max-requests", "3000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Wait (bounded) until the run is under way: its file tier holds blocks.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and replay.poll() is None:
        tiers = [path for scratch in _scratch_dirs(parent) for path in scratch.rglob("*")
                 if path.is_file() and path.name != "owner"]
        if tiers:
            return replay
        time.sleep(0.05)
    replay.kill()
    raise AssertionError("the replay never started writing its file tier")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_mid_replay_removes_the_scratch_tier(tmp_path: Path, signum: int) -> None:
    replay = _start_long_replay(tmp_path)
    replay.send_signal(signum)
    try:
        _out, err = replay.communicate(timeout=60)
    finally:
        replay.kill()
    assert replay.returncode == 128 + signum, err
    assert "cleaned up" in err and "Traceback" not in err
    assert _scratch_dirs(tmp_path) == []


def test_a_late_ctrl_c_during_cleanup_still_cleans_up(tmp_path: Path) -> None:
    replay = _start_long_replay(tmp_path)
    replay.send_signal(signal.SIGTERM)
    for _ in range(5):  # more signals while it shuts down: ignored, cleanup completes
        replay.send_signal(signal.SIGINT)
    try:
        _out, err = replay.communicate(timeout=60)
    finally:
        replay.kill()
    # Pending signals are delivered lowest number first, so SIGINT may be the one that counts.
    assert replay.returncode in (128 + signal.SIGTERM, 128 + signal.SIGINT), err
    assert err.count("stopped by") == 1 and "Traceback" not in err
    assert _scratch_dirs(tmp_path) == []


def test_stale_scratch_of_dead_runs_is_removed_and_live_runs_kept(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True, timeout=30)
    stale = tmp_path / f"{SCRATCH_PREFIX}{dead.stdout.strip()}-old"
    (stale / "file-tier").mkdir(parents=True)
    (stale / "file-tier" / "block").write_bytes(b"x" * 4096)
    (stale / "owner").write_text(f"{dead.stdout.strip()} 12345\n")
    from kvtier.cli.scratch import ScratchDir

    with ScratchDir(tmp_path) as live:
        unrelated = tmp_path / "not-kvtier"
        unrelated.mkdir()
        done = kvtier("replay", "--scratch-dir", str(tmp_path), *FAST)
        assert done.returncode == 0, done.stderr
        assert not stale.exists()
        assert live.path.exists() and unrelated.exists()
        assert remove_stale_scratch(tmp_path) == []
    assert _scratch_dirs(tmp_path) == []


# ---- clear errors -------------------------------------------------------------------------

@pytest.mark.parametrize(("args", "message"), [
    (["replay", "--block-bytes", "1PiB", "--no-progress"], "does not fit"),
    (["replay", "--cpu-blocks", "99999999999", "--no-progress"], "does not fit"),
    (["bench", "--cpu-blocks", "99999999999"], "does not fit"),
    (["replay", "--scratch-dir", "/nonexistent", "--no-progress"], "'/nonexistent' does not exist"),
    (["inspect", "memory://", "--key", "ab" * 300], "--key must be 1..255 bytes long"),
])
def test_bad_input_is_a_clear_error_not_a_traceback(args: list[str], message: str) -> None:
    done = kvtier(*args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr and "MemoryError" not in done.stderr


def test_a_deeply_nested_trace_line_is_a_clear_error(tmp_path: Path) -> None:
    trace = tmp_path / "deep.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": '
                     + "[" * 100_000 + "]" * 100_000 + "}\n")
    done = kvtier("replay", str(trace), "--no-progress")
    assert done.returncode == 2, done.stderr
    assert "nested too deeply" in done.stderr and "Traceback" not in done.stderr


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvtier.yaml"
    path.write_text(text)
    return path


def test_yaml_duplicate_keys_are_rejected(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "block_bytes: 64\nprimary_bytes: 64\nprimary_bytes: 128\n"
                           "namespace: {model: m}\n")
    with pytest.raises(ConfigError, match="duplicate key 'primary_bytes'"):
        KvtierConfig.from_yaml(path)


def test_yaml_strings_stay_strings(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "block_bytes: 64\nprimary_bytes: 64\n"
                           "namespace: {model: no, revision: on, tenant: off}\n")
    namespace = KvtierConfig.from_yaml(path).namespace
    assert (namespace.model, namespace.revision, namespace.tenant) == ("no", "on", "off")


def test_deep_yaml_and_deep_json_env_are_config_errors(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "block_bytes: 64\nprimary_bytes: 64\nnamespace: "
                 + "[" * 50_000 + "]" * 50_000 + "\n")
    with pytest.raises(ConfigError, match=r"nested too deeply|not valid YAML"):
        KvtierConfig.from_yaml(path)
    env = {"KVTIER_BLOCK_BYTES": "64", "KVTIER_PRIMARY_BYTES": "64",
           "KVTIER_NAMESPACE_MODEL": "m",
           "KVTIER_SECONDARY_TIERS": "[" * 100_000 + "]" * 100_000}
    with pytest.raises(ConfigError, match="nested too deeply"):
        KvtierConfig.from_env(env)


def test_json_report_is_private_even_when_the_file_existed(tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    report.write_text("{}")
    report.chmod(0o644)
    done = kvtier("replay", "--json", str(report), "--scratch-dir", str(tmp_path), *FAST)
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(report.stat().st_mode) == 0o600
    assert json.loads(report.read_text())


def test_the_command_runs_from_a_non_main_thread(tmp_path: Path) -> None:
    """An embedder calling ``cli.main`` from a worker thread keeps its own signal handling."""
    import threading

    from kvtier import cli

    codes: list[int] = []
    worker = threading.Thread(target=lambda: codes.append(cli.main(
        ["replay", "--scratch-dir", str(tmp_path), *FAST])))
    worker.start()
    worker.join(WALL_S)
    assert codes == [0]
    assert _scratch_dirs(tmp_path) == []
