"""Files a user names are read only if they are regular files, at once, whole or refused.

Each case hung forever (a FIFO), was accepted (a foreign owner) or was cut silently (over 64 KiB)
before. The FIFOs are real ones (os.mkfifo) with no writer; a hang fails the test's timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.backends import open_backend
from kvtier.config import ConfigError, KvtierConfig
from kvtier.keys import Namespace


def test_a_fifo_as_auth_key_file_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "key"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ConfigError, match="not a regular file"):
        open_backend(f"memory://?auth_key_file={fifo}", Namespace(model="m"))


def test_a_fifo_as_yaml_config_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "kvtier.yaml"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ConfigError, match=r"config file .* not a regular file"):
        KvtierConfig.from_yaml(fifo)


def test_a_fifo_as_json_report_fails_the_replay_before_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo, 0o600)
    done = subprocess.run([sys.executable, "-m", "kvtier.cli", "replay", "--max-requests", "20",
                           "--json", str(fifo)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "not a regular file" in done.stderr or "No such device" in done.stderr, done.stderr


def test_key_files_over_64_kib_are_refused_not_cut(tmp_path: Path) -> None:
    """Before: two files differing after byte 65,536 gave the same key."""
    key = tmp_path / "key"
    key.write_bytes(b"k" * (1 << 16) + b"tail")
    key.chmod(0o600)
    with pytest.raises(ConfigError, match="at most 65,536"):
        open_backend(f"memory://?auth_key_file={key}", Namespace(model="m"))


def test_line_endings_end_keys_and_never_become_key_bytes(tmp_path: Path) -> None:
    """Before: the file held one key with one line ending removed, so 'key\\n\\n' was the key
    'key\\n'. Now a key file holds one key per line (blank lines ignored): '\\n', '\\r\\n',
    none, or a trailing blank line all give the same one key."""
    from kvtier.backends.base import load_auth_key
    from kvtier.codec import KeyRing

    secret = b"0123456789abcdef0123456789abcdef"
    key = tmp_path / "key"
    for content in (secret + b"\n\n", secret + b"\r\n", secret, b"\n" + secret + b"\n \n"):
        key.write_bytes(content)
        key.chmod(0o600)
        ring = load_auth_key({"auth_key_file": str(key)}, "t")
        assert ring is not None and ring.key_ids == KeyRing([secret]).key_ids, content


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_key_file_owned_by_another_uid_is_refused(tmp_path: Path) -> None:
    from kvtier.backends.base import load_auth_key

    key = tmp_path / "key"
    key.write_bytes(b"0123456789abcdef0123456789abcdef")
    key.chmod(0o600)
    os.chown(key, 12345, 12345)
    with pytest.raises(ConfigError, match="owned by uid 12345"):
        load_auth_key({"auth_key_file": str(key)}, "t")
