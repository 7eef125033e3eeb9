"""open_backend URL dispatch, the scheme registry and the option tables: every bad input names
itself."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from backends.conftest import fresh_namespace
from kvtier.backends import (
    SCHEMES,
    STANDARD_COUNTERS,
    Backend,
    NoTierError,
    OpenMode,
    RateLimitedLog,
    backend_settings,
    open_backend,
    redact_url,
    register_scheme,
    registered_schemes,
    split_url_options,
)
from kvtier.backends.file import FileBackend
from kvtier.backends.memory import MemoryBackend
from kvtier.keys import Namespace
from kvtier.settings import ConfigError, Kind, Setting, SettingsTable


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
        ("file://relative/path", {}, ValueError, "has a host part"),
        ("file://localhost/tmp/x", {}, ValueError, "has a host part"),
        ("file:relative", {}, ValueError, "has no scheme"),
        ("file:///tmp/x?max_bytes=lots", {}, ConfigError, "file.max_bytes: .*got 'lots'"),
        ("file:///tmp/x?max_bytes=-5", {}, ConfigError, "file.max_bytes: .*got '-5'"),
        ("file:///tmp/x?fsync=maybe", {}, ConfigError, "file.fsync: .*got 'maybe'"),
        ("file:///tmp/x", {"o_direct": 2}, ConfigError, "file.o_direct: .*got 2"),
        ("file:///tmp/x?native_io=fast", {}, ConfigError, "file.native_io: .*got 'fast'"),
        ("file:///tmp/x?capacity=1", {}, ConfigError, r"setting\(s\) \['file.capacity'\]"),
        ("file:///tmp/x", {"ttl_s": 5}, ConfigError, r"setting\(s\) \['file.ttl_s'\]"),
        ("file:///tmp/x", {"auth_key": "short"}, ConfigError, "at least 16"),
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


def test_every_builtin_scheme_declares_its_options_in_a_table() -> None:
    for scheme in SCHEMES:
        table = backend_settings(scheme)
        assert isinstance(table, SettingsTable)
        assert "auth_key" in table and table["auth_key"].kind is Kind.SECRETS
        assert "auth_key_file" in table
    assert backend_settings("redis://")["password"].kind is Kind.SECRET
    assert "shared_dir" in backend_settings("file")
    with pytest.raises(ValueError, match="unknown backend URL scheme 'nope://'"):
        backend_settings("nope")


def test_a_scheme_registered_from_outside_is_opened_and_validated() -> None:
    table = SettingsTable("tape backend", (Setting("max_bytes", Kind.SIZE, 0, help="cap"),))
    opened: list[tuple[str, dict[str, object]]] = []

    def factory(url: str, namespace: Namespace, options: dict[str, object]) -> Backend:
        parsed = table.parse(options, "tape")
        opened.append((url, parsed))
        return MemoryBackend(namespace, max_bytes=parsed["max_bytes"])

    register_scheme("tape+test", factory, table)
    register_scheme("tape+test", factory, table)  # the same factory again: a no-op
    assert "tape+test" in registered_schemes()
    assert backend_settings("tape+test") is table
    backend = open_backend("TAPE+TEST://drive0", fresh_namespace(), max_bytes="1KiB")
    assert opened == [("TAPE+TEST://drive0", {"max_bytes": 1024})]
    key = b"k" * 16
    assert backend.put_many([key], [b"x" * 10]) == [True]
    out = bytearray(10)
    assert backend.get_many([key], [memoryview(out)]) == [True] and out == b"x" * 10
    assert set(STANDARD_COUNTERS) <= set(backend.stats())
    with pytest.raises(ValueError, match="already registered"):
        register_scheme("tape+test", lambda *_args: backend)
    with pytest.raises(ValueError, match="built in"):
        register_scheme("file", factory)
    with pytest.raises(ValueError, match="without '://'"):
        register_scheme("bad://", factory)
    with pytest.raises(TypeError, match="callable"):
        register_scheme("tape2", "not a factory")  # type: ignore[arg-type]

    register_scheme("notabackend", lambda *_args: object())  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="not a kvtier Backend"):
        open_backend("notabackend://x", fresh_namespace())


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


# ---- read-only opens (issue 20: inspect and usage never create anything) -------------------


def _tree(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


def test_a_read_only_open_of_a_missing_file_tier_creates_nothing(tmp_path: Path) -> None:
    root = tmp_path / "typo"
    with pytest.raises(NoTierError, match=r"no kvtier tier at file://.*/typo: .* does not exist"):
        open_backend(root.as_uri(), fresh_namespace(), mode=OpenMode.READ_ONLY)
    assert not root.exists()
    (tmp_path / "a-file").write_text("not a tier")
    with pytest.raises(NoTierError, match="is not a directory"):
        open_backend((tmp_path / "a-file").as_uri(), fresh_namespace(), mode=OpenMode.READ_ONLY)


def test_a_read_only_open_writes_no_namespace_directory_nor_manifest(tmp_path: Path) -> None:
    namespace = fresh_namespace()
    backend = open_backend(tmp_path.as_uri(), namespace, mode=OpenMode.READ_ONLY)
    try:
        assert backend.probe([b"\x01" * 16]) == [False]
        assert backend.stats()["blocks"] == 0
    finally:
        backend.close()
    assert _tree(tmp_path) == []  # not even <root>/<digest>/
    assert OpenMode.INSPECT is OpenMode.READ_ONLY  # the old name still works


def test_a_read_only_open_leaves_stray_temp_files_and_counts_blocks(tmp_path: Path) -> None:
    namespace = fresh_namespace()
    writer = open_backend(tmp_path.as_uri(), namespace)
    assert writer.put_many([b"\x02" * 16], [b"x" * 64]) == [True]
    writer.close()
    stray = tmp_path / namespace.digest_hex / ".tmp-999999999-1"  # a pid that cannot be alive
    stray.write_bytes(b"half a block")
    before = _tree(tmp_path)
    backend = open_backend(tmp_path.as_uri(), namespace, mode=OpenMode.READ_ONLY)
    try:
        assert backend.stats()["blocks"] == 1
        assert backend.probe([b"\x02" * 16]) == [True]
    finally:
        backend.close()
    assert _tree(tmp_path) == before and stray.exists()  # a write-mode open removes it


def test_read_only_opens_write_no_manifest_on_redis(redis_server: Any) -> None:
    namespace = fresh_namespace()
    client = redis_server.client()
    try:
        pattern = f"kvtier:{namespace.digest_hex}*"
        open_backend(redis_server.url, namespace, mode=OpenMode.READ_ONLY).close()
        assert client.keys(pattern) == []
        open_backend(redis_server.url, namespace).close()  # the write mode does write one
        assert client.keys(pattern) == [f"kvtier:{namespace.digest_hex}:namespace".encode()]
    finally:
        client.delete(*client.keys(f"kvtier:{namespace.digest_hex}*"))
        client.close()


def test_read_only_opens_write_no_manifest_on_s3(s3_server: Any) -> None:
    namespace = fresh_namespace()
    prefix = f"readonly-{namespace.digest_hex[:12]}"
    raw = s3_server.raw_client()

    def objects() -> list[str]:
        listed = raw.list_objects_v2(Bucket=s3_server.bucket, Prefix=prefix)
        return [item["Key"] for item in listed.get("Contents", [])]

    open_backend(s3_server.url(prefix), namespace, mode=OpenMode.READ_ONLY).close()
    assert objects() == []
    open_backend(s3_server.url(prefix), namespace).close()
    assert [name.rsplit("/", 1)[-1] for name in objects()] == ["namespace.json"]


def test_a_bare_path_suggests_a_file_url() -> None:
    with pytest.raises(ValueError, match=r"has no scheme; .*did you mean file:///tmp/my%20dir\?"):
        open_backend("/tmp/my dir", fresh_namespace())
