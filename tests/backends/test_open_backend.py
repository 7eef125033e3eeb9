"""open_backend URL dispatch and the shared option parsers: every bad input names itself."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from backends.conftest import fresh_namespace
from kvtier.backends import (
    Backend,
    RateLimitedLog,
    open_backend,
    parse_bool_option,
    parse_float_option,
    parse_int_option,
    parse_size_option,
    redact_url,
    split_url_options,
)
from kvtier.backends.file import FileBackend
from kvtier.backends.memory import MemoryBackend


def test_dispatch_by_scheme(tmp_path: Path) -> None:
    namespace = fresh_namespace()
    memory = open_backend("memory://", namespace)
    assert isinstance(memory, MemoryBackend)
    assert isinstance(memory, Backend)
    file = open_backend(f"FILE://{tmp_path}", namespace, max_bytes="1MiB", fsync="yes")
    assert isinstance(file, FileBackend)
    assert isinstance(file, Backend)
    assert file.namespace == namespace
    assert file.url == f"file://{tmp_path}"
    assert file.stats()["max_bytes"] == 1 << 20


def test_file_url_options_from_query_string(tmp_path: Path) -> None:
    backend = open_backend(f"file://{tmp_path}?max_bytes=4G&o_direct=1", fresh_namespace())
    stats = backend.stats()
    assert stats["max_bytes"] == 4 << 30
    assert stats["o_direct_active"] == 1


@pytest.mark.parametrize(
    ("url", "options", "error", "message"),
    [
        ("", {}, ValueError, "has no scheme"),
        ("/just/a/path", {}, ValueError, "has no scheme"),
        ("ftp://host/x", {}, ValueError, "unknown backend URL scheme 'ftp://'"),
        ("file://relative/path", {}, ValueError, "host part 'relative'"),
        ("file://localhost/tmp/x", {}, ValueError, "host part 'localhost'"),
        ("file:relative", {}, ValueError, "has no scheme"),
        ("file:///tmp/x?max_bytes=lots", {}, ValueError, "max_bytes='lots'"),
        ("file:///tmp/x?max_bytes=-5", {}, ValueError, "max_bytes='-5'"),
        ("file:///tmp/x?fsync=maybe", {}, ValueError, "fsync='maybe'"),
        ("file:///tmp/x", {"o_direct": 2}, ValueError, "o_direct=2"),
        ("file:///tmp/x?capacity=1", {}, ValueError, r"unknown option\(s\) \['capacity'\]"),
        ("file:///tmp/x", {"ttl_s": 5}, ValueError, r"unknown option\(s\) \['ttl_s'\]"),
        ("file:///tmp/x?fsync=1", {"fsync": True}, ValueError, "both in the URL"),
        ("file:///tmp/x?fsync=1&fsync=0", {}, ValueError, "appears twice"),
        ("file:///tmp/x#frag", {}, ValueError, "fragment"),
    ],
)
def test_bad_urls_and_options_name_the_bad_part(
    url: str, options: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        open_backend(url, fresh_namespace(), **options)


def test_wrong_argument_types() -> None:
    with pytest.raises(TypeError, match="url must be a str"):
        open_backend(b"memory://", fresh_namespace())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="namespace must be a Namespace"):
        open_backend("memory://", "model")  # type: ignore[arg-type]


def test_option_parsers() -> None:
    assert [parse_bool_option("b", v) for v in (True, "yes", "ON", "1", False, "no", "0")] == [
        True,
        True,
        True,
        True,
        False,
        False,
        False,
    ]
    assert parse_size_option("s", 10) == 10
    assert parse_size_option("s", "4096") == 4096
    assert parse_size_option("s", "512MiB") == 512 << 20
    assert parse_size_option("s", "4G") == 4 << 30
    assert parse_size_option("s", "1.5GiB") == 1536 << 20
    with pytest.raises(ValueError, match=r"option s=.2kb.: .2kb. is ambiguous .* write 2KiB"):
        parse_size_option("s", "2kb")
    assert parse_int_option("n", "-3") == -3
    assert parse_float_option("f", "0.25") == 0.25
    for bad_call in (
        lambda: parse_bool_option("flag", "maybe"),
        lambda: parse_size_option("size", True),
        lambda: parse_size_option("size", "1.5"),
        lambda: parse_size_option("size", 5, minimum=10),
        lambda: parse_int_option("count", "1.0"),
        lambda: parse_int_option("count", 0, minimum=1),
        lambda: parse_int_option("count", 9, maximum=8),
        lambda: parse_float_option("ttl", "nan"),
        lambda: parse_float_option("ttl", -1, minimum=0),
    ):
        with pytest.raises(ValueError, match=r"option (flag|size|count|ttl)="):
            bad_call()


def test_split_url_options_merges_query_and_keywords() -> None:
    parts, merged = split_url_options("redis://h:1/0?ttl_s=5", {"password": "x"})
    assert (parts.hostname, parts.port, merged) == ("h", 1, {"ttl_s": "5", "password": "x"})


def test_redact_url_hides_secrets() -> None:
    assert redact_url("redis://user:hunter2@host:6379/0") == "redis://user:***@host:6379/0"
    assert redact_url("redis://:hunter2@host") == "redis://:***@host"
    assert redact_url("s3://b/p?aws_secret_access_key=zz&region=x") == (
        "s3://b/p?aws_secret_access_key=***&region=x"
    )
    with pytest.raises(ValueError, match="ftp") as caught:
        open_backend("ftp://u:hunter2@h", fresh_namespace())
    assert "hunter2" not in str(caught.value)


def test_rate_limited_log_counts_what_it_suppresses(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    log = RateLimitedLog(logging.getLogger("kvtier.test"), interval_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvtier.test"):
        assert log.warning("down: %s", "a") is True
        assert log.warning("down: %s", "b") is False
        assert log.warning("down: %s", "c") is False
        now[0] += 10
        assert log.warning("down: %s", "d") is True
    assert [record.getMessage() for record in caplog.records] == [
        "down: a",
        "down: d (2 similar messages suppressed)",
    ]
