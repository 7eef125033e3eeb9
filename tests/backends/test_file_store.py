"""The file tier's batch store (``kvtier.backends.file.store``): one native call per batch
(``write_frames``) where the extension is built, else the same system calls from Python. The
capped store, crash safety and the hostile cases are in ``test_file.py`` and
``test_file_hygiene.py``; the contract suite runs on both paths (``file``, ``file-python``)."""

from __future__ import annotations

import array
import mmap
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import xxhash

from backends.conftest import fresh_namespace
from backends.test_contract import keys_for, payload_for, sentinel_buffer
from backends.test_file import all_files, temp_files
from kvtier import codec
from kvtier.backends.file import DirectIO, FileBackend, dirs
from kvtier.backends.file.layout import _ALIGN
from kvtier.backends.file.native import require_batchio
from kvtier.backends.file.store import StoreStage
from kvtier.codec.record import _CHECK_OFFSET, _KEY_OFFSET
from kvtier.keys import Namespace

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


# -- the sealed store: trailers sealed in the native call (store_sealed) ---------------------


@pytest.fixture(autouse=True)
def _fans_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """A namespace view (and its fan-out cache) lives for an hour here, not a second, so that a
    slow machine cannot renew it between a test's warm-up and its batch (a renewed view takes
    the careful path until its fan-out directories are cached again, which would change the
    counts these tests assert, not the bytes)."""
    monkeypatch.setattr(dirs, "_FAN_TTL_S", 3600.0)


def _warm(backend: FileBackend) -> None:
    """Blocks in every fan-out directory: the first batch creates them (which renews the
    namespace view), the second caches them in the new view, so that the next batch is the
    sealed store's whole."""
    for tag in (b"warm", b"hold"):
        warm = [bytes([first]) + tag * 4 for first in range(256)]
        assert backend.put_many(warm, [b"w"] * 256) == [True] * 256


def _frame_of(namespace: Namespace, key: bytes, payload: bytes) -> bytes:
    """The frame Python's codec writes for ``payload`` (the sealed store's twin)."""
    encoder = codec.FrameCodec(namespace.digest, layout=codec.FrameLayout.TRAILER)
    return payload + encoder.encode_trailer(key, memoryview(payload))


@pytest.mark.parametrize("size", [0, 3, 16, 17, 128, 129, 240, 241, 1024, 4096, 16384,
                                  65536 + 7, 1 << 20])
def test_the_native_checksum_is_the_xxhash_librarys(size: int) -> None:
    """Each of xxh3's length classes (0, 1-3, 4-8, 9-16, 17-128, 129-240, longer; whole and
    partial stripes and blocks), as the trailer hashes it: the payload, then the record."""
    native = require_batchio()
    payload = payload_for(b"xxh3", size)
    record = payload_for(b"record", 304)
    hasher = xxhash.xxh3_64(payload)
    hasher.update(record)
    assert native.xxh3_pair(payload, record) == hasher.intdigest()
    assert native.XXH3_KERNEL in ("avx2", "baseline")
    assert native.SKIPPED == StoreStage.SKIPPED


@pytest.mark.parametrize("key_len", [1, 16, 32, 124])
def test_a_sealed_store_writes_the_exact_frame_the_codec_encodes(tmp_path: Path,
                                                                   key_len: int) -> None:
    namespace = fresh_namespace()
    backend = FileBackend(tmp_path, namespace)
    _warm(backend)
    before = backend.stats()["sealed_stores"]
    keys = [key[:1] + key * 8 for key in keys_for(12, f"sealed-{key_len}")]
    keys = [key[:key_len] for key in keys]
    payloads = [payload_for(key, 5000) for key in keys]
    assert backend.put_many(keys, payloads) == [True] * 12
    assert backend.stats()["sealed_stores"] - before == 12
    for key, payload in zip(keys, payloads, strict=True):
        assert backend.path_for(key).read_bytes() == _frame_of(namespace, key, payload)
    outs = [sentinel_buffer(5000) for _ in keys]
    assert backend.get_many(keys, [memoryview(out) for out in outs]) == [True] * 12
    assert [bytes(out) for out in outs] == payloads
    assert temp_files(tmp_path) == []


def test_blocks_of_another_shape_in_a_sealed_batch_are_stored_the_careful_way(
        tmp_path: Path) -> None:
    """The template fits the first block's key and payload lengths; the native call skips the
    others (and blocks under a fan-out directory not cached yet), which the backend then stores
    through write_frames. Every block is the exact frame either way."""
    namespace = fresh_namespace()
    backend = FileBackend(tmp_path, namespace)
    _warm(backend)
    before = backend.stats()["sealed_stores"]
    keys = keys_for(9, "sealed-mixed")
    keys[4] = keys[4] * 2  # 32 bytes, not 16
    sizes = [4096] * 9
    sizes[2] = sizes[7] = 4097
    payloads = [payload_for(key, size) for key, size in zip(keys, sizes, strict=True)]
    assert backend.put_many(keys, payloads) == [True] * 9
    assert backend.stats()["sealed_stores"] - before == 6
    for key, payload in zip(keys, payloads, strict=True):
        assert backend.path_for(key).read_bytes() == _frame_of(namespace, key, payload)
    assert temp_files(tmp_path) == [] and backend.stats()["errors"] == 0


def test_the_first_batch_caches_the_fan_out_directories_the_next_ones_seal(
        tmp_path: Path) -> None:
    backend = FileBackend(tmp_path, fresh_namespace())
    keys = keys_for(40, "sealed-first")
    payloads = [payload_for(key, 1000) for key in keys]
    assert backend.put_many(keys[:20], payloads[:20]) == [True] * 20
    assert backend.stats()["sealed_stores"] == 0  # a new tier: no fan-out directory cached yet
    assert backend.put_many(keys, payloads) == [True] * 40  # the first 20 are there already
    assert backend.stats()["puts_existing"] == 20
    assert backend.stats()["blocks"] == 40 and temp_files(tmp_path) == []


def test_a_sealed_store_over_a_stored_block_keeps_it_and_answers_present(
        tmp_path: Path) -> None:
    """RENAME_NOREPLACE finds the name taken: the temp file is removed and the block that holds
    the name is kept (never overwritten), counted in ``puts_existing``."""
    namespace = fresh_namespace()
    backend = FileBackend(tmp_path, namespace)
    _warm(backend)
    key, other = keys_for(2, "sealed-present")
    first = payload_for(key, 3000)
    assert backend.put_many([key], [first]) == [True]
    before = backend.stats()["puts_existing"]
    assert backend.put_many([key, other], [payload_for(key, 3000, b"again"),
                                           payload_for(other, 3000)]) == [True, True]
    assert backend.stats()["puts_existing"] - before == 1
    assert backend.path_for(key).read_bytes() == _frame_of(namespace, key, first)
    assert temp_files(tmp_path) == []


def test_a_sealed_store_over_a_planted_directory_sets_it_aside_and_stores(tmp_path: Path) -> None:
    """A neighbour's directory at the block's name is no block: it is moved aside and removed,
    and the block stored."""
    namespace = fresh_namespace()
    backend = FileBackend(tmp_path, namespace)
    _warm(backend)
    key = keys_for(1, "sealed-planted")[0]
    backend.path_for(key).mkdir()
    payload = payload_for(key, 2000)
    assert backend.put_many([key], [payload]) == [True]
    assert backend.path_for(key).read_bytes() == _frame_of(namespace, key, payload)
    assert temp_files(tmp_path) == []


_FSIZE_CHILD = """
import os, resource, signal, sys
from pathlib import Path
from kvtier.backends.file import FileBackend, dirs
from kvtier.keys import Namespace
dirs._FAN_TTL_S = 3600.0  # as the parent test's fixture: the view is not renewed mid-test
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
root, model = sys.argv[1], sys.argv[2]
backend = FileBackend(root, Namespace(model=model))
for tag in (b"warm", b"hold"):
    warm = [bytes([first]) + tag * 4 for first in range(256)]
    assert backend.put_many(warm, [b"w"] * 256) == [True] * 256
resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
big = [bytes([7, n]) * 8 for n in range(4)]
small = [bytes([9, n]) * 8 for n in range(4)]
print(backend.put_many(big, [b"b" * 16384] * 4), backend.put_many(small, [b"s" * 1000] * 4),
      backend.stats()["errors"], backend.stats()["sealed_stores"])
"""


def test_a_write_the_kernel_refuses_fails_that_block_and_leaves_no_temp_file(
        tmp_path: Path) -> None:
    """A real write failure: in a child process whose file size limit (RLIMIT_FSIZE, 8 KiB) a
    16 KiB block exceeds, the sealed write stops short (EFBIG); the temp file is removed, the
    careful path fails the same way, and the block answers False (counted). Blocks under the
    limit in the next batch are stored."""
    model = f"test-fsize-{os.getpid()}"
    child = subprocess.run([sys.executable, "-c", _FSIZE_CHILD, str(tmp_path), model],
                           capture_output=True, text=True, timeout=60, check=False)
    assert child.returncode == 0, child.stderr
    assert child.stdout.startswith("[False, False, False, False] [True, True, True, True] ")
    errors, sealed = map(int, child.stdout.split()[-2:])
    assert errors == 4 and sealed == 4  # the small ones (the warm-up's went the careful way)
    assert temp_files(tmp_path) == []
    reader = FileBackend(tmp_path, Namespace(model=model))
    assert reader.exists([bytes([7, n]) * 8 for n in range(4)]) == [False] * 4
    assert reader.exists([bytes([9, n]) * 8 for n in range(4)]) == [True] * 4


def test_a_keyed_tier_signs_every_frame_in_python_never_the_sealed_store(tmp_path: Path) -> None:
    namespace = fresh_namespace()
    backend = FileBackend(tmp_path, namespace, auth_key=b"k" * 32)
    _warm(backend)
    keys = keys_for(8, "sealed-keyed")
    assert backend.put_many(keys, [payload_for(key, 4096) for key in keys]) == [True] * 8
    assert backend.stats()["sealed_stores"] == 0
    assert backend.stats()["native_stores"] == 2 * 256 + 8


def test_the_fan_table_holds_each_cached_fan_out_directory_by_number(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path, fresh_namespace())
    _warm(backend)
    reopened = FileBackend(tmp_path, backend.namespace)  # holds every fan-out directory at open
    view = reopened._dirs.acquire()
    try:
        assert sorted(view.fans) == [f"{number:02x}" for number in range(256)]
        assert list(view.fan_table) == [view.fans[f"{number:02x}"] for number in range(256)]
    finally:
        reopened._dirs.release(view)


def test_a_sealed_store_of_the_wrong_shape_is_refused_before_anything_is_written(
        tmp_path: Path) -> None:
    native = require_batchio()
    table = array.array("i", [-1] * 256)
    results = array.array("q", bytes(16))
    args = (table, [b"k" * 16], [b"p"], [0], bytes(320), 16, 1, 32, 304, b".tmp-", b".kvb",
            results, os.O_WRONLY, 0o600)
    with pytest.raises(ValueError, match="fan table of 1020 bytes; expected 256 int32"):
        native.store_sealed(array.array("i", [-1] * 255), *args[1:])
    with pytest.raises(ValueError, match="check at 316; expected key and check inside"):
        native.store_sealed(*args[:8], 316, *args[9:])
    with pytest.raises(ValueError, match="1 keys, 1 payloads and 2 temp numbers"):
        native.store_sealed(*args[:3], [0, 1], *args[4:])
    with pytest.raises(ValueError, match="names of 300 hex digits"):
        native.store_sealed(table, [b"k" * 150], *args[2:5], 150, *args[6:])
    assert list(tmp_path.iterdir()) == []


def test_a_sealed_store_whose_guard_no_longer_holds_writes_nothing(tmp_path: Path) -> None:
    """The namespace check made inside the native store (its guard) finds the directory is not
    as last checked: no temp file, no block, every slot skipped, and the call says so."""
    backend = FileBackend(tmp_path, fresh_namespace())
    _warm(backend)
    native = require_batchio()
    keys = keys_for(8, "sealed-guard")
    payloads = [payload_for(key, 1000) for key in keys]
    template = backend._codec.seal_template(len(keys[0]), 1000)
    assert template is not None
    guarded = backend._dirs.acquire_guarded()
    assert guarded is not None
    view, guard = guarded
    files = sorted(all_files(tmp_path))
    try:
        results = array.array("q", bytes(16 * 8))
        stale = (*guard[:7], guard[7] - 1, guard[8])  # the directory changed since (mtime)
        assert native.store_sealed(view.fan_table, keys, payloads, list(range(8)), template,
                                   len(keys[0]), 1000, _KEY_OFFSET, _CHECK_OFFSET, b".tmp-g-",
                                   b".kvb", results, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                   0o600, stale) is False
        assert list(results) == [StoreStage.SKIPPED, 0] * 8
        assert sorted(all_files(tmp_path)) == files
        assert native.store_sealed(view.fan_table, keys, payloads, list(range(8)), template,
                                   len(keys[0]), 1000, _KEY_OFFSET, _CHECK_OFFSET, b".tmp-g-",
                                   b".kvb", results, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                   0o600, guard) is True
        assert list(results) == [StoreStage.STORED, 0] * 8
    finally:
        backend._dirs.release(view)
    assert backend.exists(keys) == [True] * 8


@pytest.mark.parametrize(("max_bytes", "checked_calls"), [(0, 0), (1 << 30, 1)],
                         ids=["unbounded", "capped"])
def test_a_warm_sealed_store_checks_its_namespace_inside_the_native_call(
        tmp_path: Path, max_bytes: int, checked_calls: int) -> None:
    """``TierDirs.acquire`` (the check from Python) wrapped to count its calls, a spy, not a
    fault: a warm unkeyed store takes the guarded path; a capped tier (which evicts before it
    writes) takes the checked one."""
    backend = FileBackend(tmp_path, fresh_namespace(), max_bytes=max_bytes)
    _warm(backend)
    calls: list[int] = []
    checked = backend._dirs.acquire

    def counted() -> dirs.View:
        calls.append(1)
        return checked()

    backend._dirs.acquire = counted  # type: ignore[method-assign]
    keys = keys_for(16, "sealed-path")
    sealed = backend.stats()["sealed_stores"]
    assert backend.put_many(keys, [payload_for(key, 1000) for key in keys]) == [True] * 16
    assert backend.stats()["sealed_stores"] == sealed + 16
    assert len(calls) == checked_calls


def test_an_o_direct_sealed_store_writes_the_codecs_exact_frame_from_the_slot() -> None:
    """O_DIRECT and unkeyed: pool slots (whole pages at aligned addresses) are sealed and
    written in the native call, each trailer from a zeroed page of its own and the file cut to
    the frame, byte for byte what the codec encodes; a payload of whole pages at an unaligned
    address in the same batch is skipped there and stored the careful way. All read back, with
    O_DIRECT and buffered."""
    with tempfile.TemporaryDirectory(prefix="kvtier-direct-", dir="/var/tmp") as root:
        namespace = fresh_namespace()
        direct = FileBackend(root, namespace, o_direct=True)
        if direct.direct_io is not DirectIO.ACTIVE:
            pytest.fail(f"O_DIRECT is not available under {root}: the test needs a real disk")
        _warm(direct)
        size = 2 * mmap.PAGESIZE
        keys = keys_for(5, "direct-sealed")
        slots = [memoryview(mmap.mmap(-1, size)) for _ in range(4)]
        for key, slot in zip(keys[:4], slots, strict=True):
            slot[:] = payload_for(key, size)
        shifted = memoryview(bytearray(size + 1))[1:]  # whole pages, unaligned address
        shifted[:] = payload_for(keys[4], size)
        sealed = direct.stats()["sealed_stores"]
        assert direct.put_many(keys, [*slots, shifted]) == [True] * 5
        assert direct.stats()["sealed_stores"] == sealed + 4
        assert temp_files(Path(root)) == []
        for key, payload in zip(keys, [*slots, shifted], strict=True):
            assert direct.path_for(key).read_bytes() == _frame_of(namespace, key, bytes(payload))
        for reader in (direct, FileBackend(root, namespace)):
            outs = [memoryview(mmap.mmap(-1, size)) for _ in keys]
            assert reader.get_many(keys, outs) == [True] * 5
            assert [bytes(out) for out in outs] == [bytes(p) for p in (*slots, shifted)]


def test_the_native_direct_unit_is_the_layouts() -> None:
    assert require_batchio().DIRECT_ALIGN == _ALIGN
