"""``kvtier.usage`` / ``kvtier.purge`` (kvtier.ops.inventory) and the ``usage`` / ``purge`` /
``inspect --digest`` commands, against real media: files, a real Valkey, a real 3-node Valkey
Cluster and a real SeaweedFS S3 server."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest

import kvtier
from kvtier import cli, codec
from kvtier.backends import Backend, OpenMode, open_backend
from kvtier.keys import Namespace
from kvtier.ops.inventory import MediumError, NamespaceUsage, UsageError, manifest_document

KINDS = ("file", "redis", "redis_cluster", "s3")
PAYLOAD = 3000
FRAME = codec.HEADER_BYTES + PAYLOAD


@dataclass
class Medium:
    kind: str
    url: str
    server: Any


@pytest.fixture(params=KINDS)
def medium(request: pytest.FixtureRequest, tmp_path: Path) -> Medium:
    kind: str = request.param
    if kind == "file":
        return Medium(kind, f"file://{tmp_path / 'tier'}", None)
    if kind == "redis":
        server = request.getfixturevalue("redis_server")
        return Medium(kind, server.url, server)
    if kind == "redis_cluster":
        server = request.getfixturevalue("redis_cluster")
        return Medium(kind, server.url, server)
    server = request.getfixturevalue("s3_server")
    return Medium(kind, server.url(f"usage-{uuid4().hex[:10]}"), server)


def _namespace(**fields: Any) -> Namespace:
    return Namespace(model=fields.pop("model", f"model-{uuid4().hex[:8]}"), **fields)


def _store(url: str, namespace: Namespace, blocks: int) -> list[bytes]:
    keys = [uuid4().bytes for _ in range(blocks)]
    backend = open_backend(url, namespace)
    try:
        assert backend.put_many(keys, [bytes([i % 256]) * PAYLOAD for i in range(blocks)]) == \
            [True] * blocks
    finally:
        backend.close()
    return keys


def _mine(found: list[NamespaceUsage], *namespaces: Namespace) -> dict[str, NamespaceUsage]:
    digests = {namespace.digest_hex for namespace in namespaces}
    return {item.digest: item for item in found if item.digest in digests}


@pytest.fixture
def two_namespaces(medium: Medium) -> Iterator[tuple[Namespace, Namespace, list[bytes]]]:
    first = _namespace(revision="r1", kv_layout="L" * 200, block_size=16)
    second = _namespace(tenant="t2")
    keys = _store(medium.url, first, 5)
    _store(medium.url, second, 2)
    yield first, second, keys
    for namespace in (first, second):  # whatever the test left
        kvtier.purge(medium.url, fields={"model": namespace.model})


def test_usage_counts_blocks_and_bytes_per_namespace_from_the_medium(
    medium: Medium, two_namespaces: tuple[Namespace, Namespace, list[bytes]]
) -> None:
    first, second, _keys = two_namespaces
    found = _mine(kvtier.usage(medium.url), first, second)
    assert set(found) == {first.digest_hex, second.digest_hex}
    one, two = found[first.digest_hex], found[second.digest_hex]
    assert (one.blocks, one.bytes) == (5, 5 * FRAME)  # the manifest is not a block
    assert (two.blocks, two.bytes) == (2, 2 * FRAME)
    assert one.model == first.model and one.fields is not None
    assert Namespace.from_mapping(one.fields) == first
    assert two.fields is not None and two.fields["tenant"] == "t2"
    for item in (one, two):
        assert item.oldest is not None and item.newest is not None
        assert item.oldest <= item.newest


def _du(directory: Path) -> int:
    """Bytes allocated under ``directory``, itself included (what ``du -s -B1`` prints)."""
    import os

    total = os.lstat(directory).st_blocks * 512
    for parent, subdirs, files in os.walk(directory):
        total += sum(os.lstat(os.path.join(parent, name)).st_blocks * 512
                     for name in (*subdirs, *files))
    return total


def test_usage_counts_bytes_on_disk_where_the_medium_can_tell(
    medium: Medium, two_namespaces: tuple[Namespace, Namespace, list[bytes]]
) -> None:
    """Before: usage gave frame bytes only while du read far more (a directory per block)."""
    first, second, _keys = two_namespaces
    found = _mine(kvtier.usage(medium.url), first, second)
    for namespace in (first, second):
        item = found[namespace.digest_hex]
        if medium.kind != "file":  # Redis and S3 do not say what they allocate
            assert item.disk_bytes is None and item.to_json()["disk_bytes"] is None
            continue
        assert item.disk_bytes is not None and item.disk_bytes >= item.bytes
        assert item.disk_bytes == _du(Path(medium.url.removeprefix("file://"))
                                      / namespace.digest_hex)


def test_the_manifest_is_never_served_or_indexed_as_a_block(
    medium: Medium, two_namespaces: tuple[Namespace, Namespace, list[bytes]]
) -> None:
    first, _second, keys = two_namespaces
    backend = open_backend(medium.url, first)
    try:
        assert backend.exists(keys) == [True] * 5
        if medium.kind == "file":  # the reopen scan indexes blocks only
            assert backend.stats()["blocks"] == 5
    finally:
        backend.close()


def test_purge_dry_run_removes_nothing(
    medium: Medium, two_namespaces: tuple[Namespace, Namespace, list[bytes]]
) -> None:
    first, _second, keys = two_namespaces
    result = kvtier.purge(medium.url, digest=first.digest_hex[:10], dry_run=True)
    assert result.dry_run and result.objects_deleted == 0
    assert [item.digest for item in result.namespaces] == [first.digest_hex]
    assert (result.blocks, result.bytes) == (5, 5 * FRAME)
    assert _mine(kvtier.usage(medium.url), first)[first.digest_hex].blocks == 5
    backend = open_backend(medium.url, first, mode=OpenMode.INSPECT)
    try:
        assert backend.exists(keys) == [True] * 5
    finally:
        backend.close()


def test_purge_by_digest_removes_that_namespace_only(
    medium: Medium, two_namespaces: tuple[Namespace, Namespace, list[bytes]]
) -> None:
    first, second, keys = two_namespaces
    result = kvtier.purge(medium.url, digest=first.digest_hex)
    assert result.objects_deleted == 5 + 1  # the blocks and the manifest
    left = _mine(kvtier.usage(medium.url), first, second)
    assert set(left) == {second.digest_hex}
    assert left[second.digest_hex].blocks == 2
    backend = open_backend(medium.url, first, mode=OpenMode.INSPECT)
    try:
        assert backend.exists(keys) == [False] * 5
    finally:
        backend.close()


def test_purge_by_fields_matches_every_field(
    medium: Medium, two_namespaces: tuple[Namespace, Namespace, list[bytes]]
) -> None:
    first, second, _keys = two_namespaces
    assert kvtier.purge(medium.url, fields={"model": first.model, "revision": "nope"}).blocks == 0
    result = kvtier.purge(medium.url, fields={"model": first.model, "block_size": "16"})
    assert [item.digest for item in result.namespaces] == [first.digest_hex]
    assert set(_mine(kvtier.usage(medium.url), first, second)) == {second.digest_hex}


def test_memory_usage_is_trivially_empty() -> None:
    assert kvtier.usage("memory://") == []
    assert kvtier.purge("memory://", fields={"model": "x"}).namespaces == []


def test_a_manifest_that_does_not_hash_to_its_digest_is_ignored(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    namespace = _namespace()
    _store(url, namespace, 1)
    forged = manifest_document(Namespace(model="someone-else"))
    (tmp_path / namespace.digest_hex / "namespace.json").write_bytes(forged)
    (item,) = kvtier.usage(url)
    assert item.fields is None and item.model == "?" and item.blocks == 1
    with pytest.raises(UsageError, match="no namespace"):
        kvtier.purge(url, digest="abcdef1234")
    assert kvtier.purge(url, fields={"model": "someone-else"}).namespaces == []  # not by fields
    assert kvtier.purge(url, digest=namespace.digest_hex).objects_deleted == 2


def test_bad_selectors_and_urls_are_named(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    with pytest.raises(UsageError, match="digest 'xyz'"):
        kvtier.purge(url, digest="xyz")
    with pytest.raises(UsageError, match="none given"):
        kvtier.purge(url)
    with pytest.raises(UsageError, match=r"unknown namespace field\(s\) \['colour'\]"):
        kvtier.purge(url, fields={"colour": "red"})
    with pytest.raises(UsageError, match="unknown backend URL scheme"):
        kvtier.usage("ftp://host/x")
    # A root that is not there is a medium with no tier (exit 1), not a bad argument.
    with pytest.raises(MediumError, match=r"no kvtier tier at file://.*/missing.* does not exist"):
        kvtier.usage(f"file://{tmp_path}/missing")
    assert not (tmp_path / "missing").exists()


def test_an_unreachable_server_is_a_medium_error() -> None:
    with pytest.raises(MediumError, match=r"could not list redis://127\.0\.0\.1:1/0"):
        kvtier.usage("redis://127.0.0.1:1/0?connect_timeout_s=0.5")


def test_an_ambiguous_digest_prefix_lists_the_candidates(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    for digest in ("abcdef" + "0" * 26, "abcdef" + "1" * 26):
        (tmp_path / digest).mkdir()
    with pytest.raises(UsageError, match=r"ambiguous: abcdef0+, abcdef1+"):
        kvtier.purge(url, digest="abcdef")


def test_inspect_opens_without_writing_a_manifest(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    backend: Backend = open_backend(url, _namespace(), mode=OpenMode.INSPECT)
    backend.close()
    assert kvtier.usage(url) == []  # not even a namespace directory
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- the commands


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_usage_command_shows_digest_model_blocks_and_bytes(
    medium: Medium, two_namespaces: tuple[Namespace, Namespace, list[bytes]],
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    first, second, _keys = two_namespaces
    monkeypatch.setenv("COLUMNS", "200")  # one line per namespace
    code, out, _err = _cli(["usage", medium.url], capsys)
    assert code == 0
    row = next(line for line in out.splitlines() if first.digest_hex[:12] in line)
    assert first.model in row and "revision=r1" in row and "LLLL" not in out
    assert "│      5 │ 14.0 KiB │" in row or "5 │" in row
    code, out, _err = _cli(["usage", medium.url, "--json"], capsys)
    assert code == 0
    mine = {item["digest"]: item for item in json.loads(out)}
    assert mine[second.digest_hex]["blocks"] == 2
    assert mine[second.digest_hex]["bytes"] == 2 * FRAME
    assert mine[second.digest_hex]["model"] == second.model


def test_purge_command_dry_run_then_digest(
    medium: Medium, two_namespaces: tuple[Namespace, Namespace, list[bytes]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    first, second, _keys = two_namespaces
    code, out, _err = _cli(["purge", medium.url, "--digest", first.digest_hex[:8], "--dry-run"],
                           capsys)
    assert code == 0 and "would remove 5 blocks" in out
    assert len(_mine(kvtier.usage(medium.url), first, second)) == 2
    code, out, _err = _cli(["purge", medium.url, "--digest", first.digest_hex[:8], "--yes"],
                           capsys)
    assert code == 0 and "removed 5 blocks" in out
    assert set(_mine(kvtier.usage(medium.url), first, second)) == {second.digest_hex}


def test_purge_without_yes_refuses_when_nobody_can_confirm(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    namespace = _namespace()
    _store(url, namespace, 2)
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "purge", url, "--namespace",
         f"model={namespace.model}"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 2
    assert "refusing to remove 2 blocks" in result.stderr and "--yes" in result.stderr
    assert kvtier.usage(url)[0].blocks == 2


def test_inspect_by_digest_uses_the_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"file://{tmp_path}"
    namespace = _namespace(kv_layout="a long layout nobody types " * 4)
    keys = _store(url, namespace, 3)
    code, out, _err = _cli(["inspect", url, "--digest", namespace.digest_hex[:8], "--key",
                            keys[0].hex(), "--key", "00" * 16], capsys)
    assert code == 0
    assert f"namespace {namespace.digest_hex}" in out
    assert "stored: 3 blocks" in out
    assert f"key {keys[0].hex()}: present" in out and f"key {'00' * 16}: absent" in out
    code, _out, err = _cli(["inspect", url, "--digest", "ffffff"], capsys)
    assert code == 2 and "no namespace with digest 'ffffff'" in err


# --------------------------------------------------------------------------- replay cleans up

REPLAY = ["replay", "builtin:conversation", "--max-requests", "30", "--step-ms", "0",
          "--block-bytes", "1KiB", "--cpu-blocks", "8", "--gpu-blocks", "0", "--no-progress"]


def _replay_namespaces(url: str, tag: str) -> list[NamespaceUsage]:
    return [item for item in kvtier.usage(url)
            if item.fields is not None and str(item.fields["revision"]).startswith(f"{tag}-")]


def test_a_replay_leaves_nothing_behind(
    medium: Medium, capsys: pytest.CaptureFixture[str]
) -> None:
    tag = uuid4().hex[:12]
    code, out, err = _cli([*REPLAY, "--tier", medium.url, "--namespace-tag", tag], capsys)
    assert code == 0, err
    assert "removed the " in out and " blocks (" in out
    removed = int(out.split("removed the ", 1)[1].split(" ", 1)[0].replace(",", ""))
    assert removed > 0  # it did store blocks there (the CPU pool of 8 cannot hold them)
    assert _replay_namespaces(medium.url, tag) == []


def test_keep_keeps_the_blocks_and_redis_gives_them_a_ttl(
    redis_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    tag = uuid4().hex[:12]
    code, out, err = _cli([*REPLAY, "--tier", redis_server.url, "--namespace-tag", tag, "--keep",
                           "--ttl-s", "120"], capsys)
    assert code == 0, err
    assert "kept " in out and "expire after their ttl_s" in out
    (item,) = _replay_namespaces(redis_server.url, tag)
    assert item.blocks > 0
    client = redis_server.client()
    try:
        names = list(client.scan_iter(match=f"kvtier:{item.digest}:*".encode()))
        assert len(names) == item.blocks + 1  # and the manifest
        ttls = [client.pttl(name) for name in names]
        assert all(0 < ttl <= 120_000 for ttl in ttls), ttls
    finally:
        client.close()
    assert kvtier.purge(redis_server.url, digest=item.digest).objects_deleted == item.blocks + 1


def test_foreign_and_poisoned_redis_keys_never_break_usage_or_purge(redis_server: Any) -> None:
    """A neighbour with write access to the Redis tier plants, under kvtier's prefix: a string
    that is not a block, a manifest that is a hash (WRONGTYPE), one nested 100k deep and one
    whose block_size is 10**26. Before, each made usage/purge exit 1 (or counted and deleted the
    foreign key); now the listing goes on, the poisoned namespaces show no fields, and purge
    deletes only blocks and manifests."""
    namespace = _namespace()
    keys = _store(redis_server.url, namespace, 3)
    client = redis_server.client()
    digest = namespace.digest_hex
    notes = f"kvtier:{digest}:user-notes".encode()
    client.set(notes, b"my notes")
    poisoned = {f"{i:02x}" * (len(digest) // 2): value for i, value in enumerate([
        None,  # a hash, below
        b"[" * 100_000,
        json.dumps({"namespace": {"model": "m", "block_size": 10**26}}).encode(),
    ], start=1)}
    for other, value in poisoned.items():
        name = f"kvtier:{other}:namespace"
        if value is None:
            client.hset(name, "model", "m")
        else:
            client.set(name, value)
        client.set(f"kvtier:{other}:{'ab' * 16}", b"x" * 10)
    try:
        found = {item.digest: item for item in kvtier.usage(redis_server.url)}
        assert found[digest].blocks == len(keys)  # the notes are not a block
        for other in poisoned:
            assert found[other].fields is None and found[other].blocks == 1
        result = kvtier.purge(redis_server.url, digest=digest)
        assert result.objects_deleted == len(keys) + 1
        assert client.get(notes) == b"my notes"
    finally:
        client.delete(notes)
        for other in poisoned:
            client.delete(f"kvtier:{other}:namespace", f"kvtier:{other}:{'ab' * 16}")
