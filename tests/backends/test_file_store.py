"""The file tier's batch store (``kvtier.backends.file.store``): one native call per batch
(``write_frames``) where the extension is built, else the same system calls from Python. The
capped store, crash safety and the hostile cases are in ``test_file.py`` and
``test_file_hygiene.py``; the contract suite runs on both paths (``file``, ``file-python``)."""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path

import pytest

from backends.conftest import fresh_namespace
from backends.test_contract import keys_for, payload_for, sentinel_buffer
from backends.test_file import all_files, temp_files
from kvtier import codec
from kvtier.backends.file import DirectIO, FileBackend

BOTH_PATHS = pytest.mark.parametrize("native", [True, False], ids=["native", "python"])


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@BOTH_PATHS
def test_a_batch_is_stored_as_exact_frames_with_no_temp_file_left(tmp_path: Path,
                                                                    native: bool) -> None:
    backend = FileBackend(tmp_path, fresh_namespace(), native_io=native)
    keys = keys_for(150, "store-batch")
    sizes = [(i * 1237) % 20000 for i in range(150)]
    payloads = [payload_for(key, size) for key, size in zip(keys, sizes, strict=True)]
    fds = _open_fds()
    assert backend.put_many(keys, payloads) == [True] * 150
    assert _open_fds() <= fds + 256  # only fan-out directories held, no block file left open
    assert temp_files(tmp_path) == []
    for key, size in zip(keys, sizes, strict=True):
        assert backend.path_for(key).stat().st_size == size + codec.HEADER_BYTES
    outs = [sentinel_buffer(size) for size in sizes]
    assert backend.get_many(keys, [memoryview(out) for out in outs]) == [True] * 150
    assert [bytes(out) for out in outs] == payloads
    assert backend.stats()["puts"] == 150 and backend.stats()["errors"] == 0


@BOTH_PATHS
def test_a_key_stored_twice_in_one_batch_and_again_later_is_one_block(tmp_path: Path,
                                                                       native: bool) -> None:
    """The second copy finds the name taken (RENAME_NOREPLACE: never an overwrite), removes
    its temp file and answers present, counted in ``puts_existing``."""
    backend = FileBackend(tmp_path, fresh_namespace(), native_io=native)
    key, other = keys_for(2, "store-twice")
    payload = payload_for(key, 5000)
    assert backend.put_many([key, other, key], [payload, b"o" * 10, payload]) == [True] * 3
    assert backend.put_many([key], [payload]) == [True]
    assert backend.stats()["puts_existing"] == 2
    assert temp_files(tmp_path) == []
    assert sum(path.name.endswith(".kvb") for path in all_files(tmp_path)) == 2
    out = sentinel_buffer(5000)
    assert backend.get_many([key], [memoryview(out)]) == [True] and bytes(out) == payload


@BOTH_PATHS
def test_a_batch_under_cached_fan_out_directories_indexes_each_block_at_its_file_size(
        tmp_path: Path, native: bool) -> None:
    """The second batch finds every fan-out directory cached (the native path's whole-batch
    build, no pass per frame); the capacity index then holds each block at its size on disk,
    and a block already stored in that batch still answers present, not stored twice."""
    backend = FileBackend(tmp_path, fresh_namespace(), native_io=native)
    warm = [bytes([first]) + b"w" * 15 for first in range(256)]  # one key per fan-out directory
    assert backend.put_many(warm, [b"x"] * 256) == [True] * 256
    keys = keys_for(64, "store-cached")
    sizes = [100 + 97 * i for i in range(64)]
    payloads = [payload_for(key, size) for key, size in zip(keys, sizes, strict=True)]
    assert backend.put_many(keys, payloads) == [True] * 64
    assert backend.put_many([keys[3], *keys[:2]], [payloads[3], *payloads[:2]]) == [True] * 3
    on_disk = sum(path.stat().st_size for path in all_files(tmp_path) if path.suffix == ".kvb")
    assert backend.stats()["used_bytes"] == on_disk
    assert backend.stats()["used_bytes"] == sum(sizes) + 256 * (1 + codec.HEADER_BYTES) \
        + 64 * codec.HEADER_BYTES
    assert backend.stats()["blocks"] == 256 + 64 and backend.stats()["puts_existing"] == 3


def test_a_frame_the_native_call_cannot_take_goes_the_careful_way_in_the_same_batch(
    tmp_path: Path,
) -> None:
    """A key too long for one file name (nested directories) beside ordinary ones."""
    backend = FileBackend(tmp_path, fresh_namespace())
    keys = [*keys_for(3, "store-mixed"), bytes(range(200))]
    payloads = [payload_for(key, 700) for key in keys]
    assert backend.put_many(keys, payloads) == [True] * 4
    outs = [sentinel_buffer(700) for _ in keys]
    assert backend.get_many(keys, [memoryview(out) for out in outs]) == [True] * 4
    assert [bytes(out) for out in outs] == payloads
    assert temp_files(tmp_path) == []


def test_o_direct_stores_of_aligned_payloads_go_natively_and_are_exact_frames() -> None:
    """A pool slot (whole pages at a page-aligned address) is written from where it is with its
    trailer from a page of its own and the file cut to the frame's size, in the native call; an
    unaligned payload in the same batch takes the careful path (one copy into an aligned
    buffer). Both read back with O_DIRECT and buffered."""
    with tempfile.TemporaryDirectory(prefix="kvtier-direct-", dir="/var/tmp") as root:
        namespace = fresh_namespace()
        direct = FileBackend(root, namespace, o_direct=True)
        if direct.direct_io is not DirectIO.ACTIVE:
            pytest.fail(f"O_DIRECT is not available under {root}: the test needs a real disk")
        keys = keys_for(6, "direct-store")
        size = 2 * mmap.PAGESIZE
        slots = [memoryview(mmap.mmap(-1, size)) for _ in range(4)]
        for key, slot in zip(keys[:4], slots, strict=True):
            slot[:] = payload_for(key, size)
        unaligned = [payload_for(key, 5000) for key in keys[4:]]
        assert direct.put_many(keys, [*slots, *unaligned]) == [True] * 6
        assert direct.stats()["native_stores"] == 4
        assert temp_files(Path(root)) == []
        for key in keys[:4]:
            assert direct.path_for(key).stat().st_size == size + codec.HEADER_BYTES
        buffered = FileBackend(root, namespace)
        for reader in (direct, buffered):
            outs = [memoryview(mmap.mmap(-1, size)) for _ in range(4)]
            outs += [memoryview(bytearray(5000)) for _ in range(2)]
            assert reader.get_many(keys, outs) == [True] * 6
            assert [bytes(out) for out in outs] == [bytes(slot) for slot in slots] + unaligned
