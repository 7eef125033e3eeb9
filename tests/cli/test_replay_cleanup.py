"""What a replay cleans up and the TTL it adds: exact revisions, exact numbers."""

from __future__ import annotations

import urllib.parse
from pathlib import Path

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
