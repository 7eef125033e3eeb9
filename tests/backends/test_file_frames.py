"""The file tier's frame format 4 (payload, then a trailer) on real files: older frames, O_DIRECT
reads and writes without a bounce copy, damaged trailers, a file rewritten while it is read, and
a good get that makes no ``fstat`` of a block file."""

from __future__ import annotations

import mmap
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvtier.backends.file.backend as file_backend_module
from backends.conftest import fresh_namespace
from backends.test_contract import keys_for, payload_for, sentinel_buffer
from kvtier import codec
from kvtier.backends.file import DirectIO, FileBackend

SIZE = 16384
TRAILER = codec.FrameLayout.TRAILER


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _aligned(size: int) -> memoryview:
    """Page-aligned memory, as an engine's pool slot is (mmap is always page-aligned)."""
    return memoryview(mmap.mmap(-1, size))


@pytest.fixture
def direct_root() -> Iterator[Path]:
    """A directory on a real disk (/var/tmp; tmpfs refuses O_DIRECT)."""
    with tempfile.TemporaryDirectory(prefix="kvtier-direct-", dir="/var/tmp") as root:
        yield Path(root)


def _direct_backend(root: Path) -> FileBackend:
    backend = FileBackend(root, fresh_namespace(), o_direct=True)
    if backend.direct_io is not DirectIO.ACTIVE:
        pytest.skip("this OS has no O_DIRECT")
    return backend


def _require_direct(backend: FileBackend) -> None:
    if backend.direct_io is not DirectIO.ACTIVE:
        pytest.skip(f"the filesystem under {backend.root} refuses O_DIRECT")


def test_files_are_written_in_format_4_payload_first(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path, fresh_namespace())
    [key] = keys_for(1, "fmt4")
    payload = payload_for(key, SIZE)
    assert backend.put_many([key], [payload]) == [True]
    stored = backend.path_for(key).read_bytes()
    assert len(stored) == SIZE + codec.HEADER_BYTES
    assert stored[:SIZE] == payload  # the payload at offset 0: a direct read lands in place
    assert codec.frame_info(stored).version == codec.TRAILER_VERSION == 4
    assert stored == bytes(codec.encode(backend.namespace.digest, key, payload, TRAILER))


@pytest.mark.parametrize("padded", [False, True], ids=["buffered", "o_direct_padded"])
def test_a_format_3_file_still_reads_and_the_next_store_rewrites_it(
    tmp_path: Path, padded: bool
) -> None:
    """Files of kvtier before format 4 (header first; O_DIRECT ones padded to whole pages)."""
    backend = FileBackend(tmp_path, fresh_namespace())
    [key] = keys_for(1, f"fmt3-{padded}")
    payload = payload_for(key, 5000)
    old = bytes(codec.encode(backend.namespace.digest, key, payload))  # format 3
    assert codec.frame_info(old).version == 3
    if padded:
        old += bytes(-len(old) % 4096)
    path = backend.path_for(key)
    _write(path, old)
    out = sentinel_buffer(5000)
    assert backend.get_many([key], [memoryview(out)]) == [True]
    assert bytes(out) == payload
    stats = backend.stats()
    assert (stats["old_format"], stats["corrupt_objects"], stats["hits"]) == (1, 0, 1)
    assert backend.put_many([key], [payload]) == [True]  # replaces it
    assert codec.frame_info(path.read_bytes()).version == 4
    out = sentinel_buffer(5000)
    assert backend.get_many([key], [memoryview(out)]) == [True]
    assert bytes(out) == payload and backend.stats()["old_format"] == 1


def test_a_frame_older_than_format_2_is_refused_as_written_by_an_older_kvtier(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = FileBackend(tmp_path, fresh_namespace())
    [key] = keys_for(1, "fmt1")
    frame = bytearray(codec.encode(backend.namespace.digest, key, bytes(100)))
    frame[4] = 1
    _write(backend.path_for(key), bytes(frame))
    assert backend.get_many([key], [memoryview(bytearray(100))]) == [False]
    assert backend.stats()["corrupt_objects"] == 1
    assert "written by an older kvtier" in caplog.text
    assert backend.put_many([key], [bytes(100)]) == [True]  # and replaced
    assert codec.frame_info(backend.path_for(key).read_bytes()).version == 4


def _damage(stored: bytes, how: str) -> bytes:
    trailer = len(stored) - codec.HEADER_BYTES
    damaged = bytearray(stored)
    if how == "truncated_by_one":
        return stored[:-1]
    if how == "truncated_into_trailer":
        return stored[: trailer + 100]
    if how == "no_trailer":
        return stored[:trailer]
    if how == "trailing_junk":
        return stored + b"junk"
    if how == "trailer_magic":
        damaged[trailer] ^= 0x01
    elif how == "trailer_check":
        damaged[-1] ^= 0x01
    elif how == "trailer_length":
        damaged[trailer + 8] ^= 0x01
    elif how == "trailer_reserved":
        damaged[trailer + 300] ^= 0x01
    return bytes(damaged)


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "o_direct"])
@pytest.mark.parametrize("how", ["truncated_by_one", "truncated_into_trailer", "no_trailer",
                                 "trailing_junk", "trailer_magic", "trailer_check",
                                 "trailer_length", "trailer_reserved"])
def test_a_truncated_or_garbled_trailer_is_never_served_and_is_removed(
    direct_root: Path, o_direct: bool, how: str
) -> None:
    backend = FileBackend(direct_root, fresh_namespace(), o_direct=o_direct)
    if o_direct:
        _require_direct(backend)
    keys = keys_for(2, f"trailer-{how}")
    payloads = [payload_for(key, SIZE) for key in keys]
    assert backend.put_many(keys, payloads) == [True, True]
    path = backend.path_for(keys[0])
    path.write_bytes(_damage(path.read_bytes(), how))
    outs = [_aligned(SIZE), _aligned(SIZE)]
    assert backend.get_many(keys, outs) == [False, True]
    assert bytes(outs[1]) == payloads[1]
    stats = backend.stats()
    assert stats["corrupt_objects"] + stats["size_mismatches"] == 1
    assert not path.exists()
    assert backend.put_many(keys[:1], payloads[:1]) == [True]
    assert backend.get_many(keys[:1], outs[:1]) == [True] and bytes(outs[0]) == payloads[0]


def test_o_direct_reads_land_in_an_aligned_destination_without_a_bounce_buffer(
    direct_root: Path,
) -> None:
    backend = _direct_backend(direct_root)
    keys = keys_for(3, "direct-aligned")
    payloads = [_aligned(SIZE) for _ in keys]
    for key, payload in zip(keys, payloads, strict=True):
        payload[:] = payload_for(key, SIZE)
    assert backend.put_many(keys, payloads) == [True] * 3  # written from where they are
    _require_direct(backend)
    for key in keys:
        assert backend.path_for(key).stat().st_size == SIZE + codec.HEADER_BYTES
    outs = [_aligned(SIZE) for _ in keys]
    assert backend.get_many(keys, outs) == [True] * 3
    assert [bytes(out) for out in outs] == [bytes(payload) for payload in payloads]
    _require_direct(backend)
    # Neither the write nor the read went through the per-thread bounce buffer.
    assert backend._scratch.buffer is None
    assert backend.stats()["o_direct_fallbacks"] == 0
    # An unaligned destination still reads (through the aligned buffer, one copy).
    unaligned = memoryview(bytearray(SIZE + 1))[1:]
    assert backend.get_many(keys[:1], [unaligned]) == [True]
    assert bytes(unaligned) == bytes(payloads[0])


class _NeighbourRewrite:
    """Rewrites the block file in place (same inode, a real write through its own descriptor)
    right before the backend's read of it: a real neighbour cannot be paused between the
    backend's open and its read, so this wrapper around ``os.preadv`` pins that moment."""

    def __init__(self, path: Path, data: bytes) -> None:
        self.path, self.data, self.done = path, data, False
        self.real = os.preadv

    def __call__(self, fd: int, buffers: Any, offset: int) -> int:
        if not self.done and os.fstat(fd).st_ino == self.path.stat().st_ino:
            self.done = True
            with self.path.open("r+b") as neighbour:
                neighbour.write(self.data)
                neighbour.truncate()
        return self.real(fd, buffers, offset)


@pytest.mark.parametrize("rewrite", ["garbage", "another_keys_frame", "shorter"])
def test_a_neighbour_rewriting_the_file_between_open_and_read_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rewrite: str
) -> None:
    # The Python read path: only there can a test stop between the open and the read. The
    # native batch reader has the same window and hands the same bytes to the same template
    # (test_file_reads.py: a bad frame in a batch fails alone and is removed by its inode).
    backend = FileBackend(tmp_path, fresh_namespace(), native_io=False)
    key, other = keys_for(2, f"neighbour-{rewrite}")
    payload = payload_for(key, SIZE)
    assert backend.put_many([key], [payload]) == [True]
    path = backend.path_for(key)
    data = {"garbage": payload_for(other, SIZE + codec.HEADER_BYTES),
            "another_keys_frame": bytes(codec.encode(backend.namespace.digest, other,
                                                     payload_for(other, SIZE), TRAILER)),
            "shorter": path.read_bytes()[:SIZE]}[rewrite]
    neighbour = _NeighbourRewrite(path, data)
    monkeypatch.setattr(file_backend_module.os, "preadv", neighbour)
    out = sentinel_buffer(SIZE)
    assert backend.get_many([key], [memoryview(out)]) == [False]
    assert neighbour.done
    assert backend.stats()["corrupt_objects"] == 1
    assert not path.exists()  # the rewritten file is the one that was read: removed


def test_a_good_get_makes_no_fstat_of_a_block_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trust rules hold without it (the hostile tests: FIFOs, sockets, directories and
    symlinks at block paths are refused by ``open`` or by the read); a bad block still has its
    inode taken before it is removed (the rename-aside race test)."""
    backend = FileBackend(tmp_path, fresh_namespace())
    keys = keys_for(8, "no-fstat")
    payloads = [payload_for(key, SIZE) for key in keys]
    assert backend.put_many(keys, payloads) == [True] * 8
    regular: list[int] = []
    real_fstat = os.fstat

    def counting_fstat(fd: int) -> os.stat_result:
        info = real_fstat(fd)
        if stat.S_ISREG(info.st_mode):
            regular.append(fd)
        return info

    monkeypatch.setattr(os, "fstat", counting_fstat)
    outs = [sentinel_buffer(SIZE) for _ in keys]
    assert backend.get_many(keys, [memoryview(out) for out in outs]) == [True] * 8
    assert [bytes(out) for out in outs] == payloads
    assert regular == []
