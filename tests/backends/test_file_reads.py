"""The file tier's batch reads (``kvtier.backends.file.reads``): the native reader that opens
and reads a batch with the interpreter lock released once, and the Python path it falls back
to. The hostile cases (FIFOs, sockets, symlinks, directories at block paths) run on both paths
in ``test_file_hygiene.py``; the whole contract suite runs on both (``file`` and
``file-python`` in ``conftest.py``)."""

from __future__ import annotations

import array
import mmap
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from backends.conftest import fresh_namespace
from backends.test_contract import keys_for, payload_for, sentinel_buffer
from kvtier import codec
from kvtier.backends import open_backend
from kvtier.backends.file import DirectIO, FileBackend
from kvtier.backends.file import dirs as file_dirs
from kvtier.backends.file.dirs import View
from kvtier.backends.file.native import NativeIO, native_io_for, require_batchio
from kvtier.backends.file.reads import BATCH_KEYS, _batch_names
from kvtier.codec.record import _CHECK_OFFSET, _KEY_OFFSET


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _warmed(backend: FileBackend, keys: list[bytes], sizes: list[int]) -> None:
    """Read every key once (the fan-out directories held, the first read's costs paid)."""
    backend.get_many(keys, [memoryview(bytearray(size)) for size in sizes])


def test_the_batch_reader_is_built_in_this_install() -> None:
    assert native_io_for(True) is NativeIO.ACTIVE, (
        "kvtier.backends.file._batchio was not built: install kvtier with a C compiler "
        "(pip install -e . builds it); without it the file tier reads through Python")
    assert native_io_for(False) is NativeIO.OFF


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_get_of_several_native_calls_reads_each_block_exactly_and_leaks_no_descriptor(
    tmp_path: Path, native: bool
) -> None:
    backend = FileBackend(tmp_path, fresh_namespace(), native_io=native)
    count = 2 * BATCH_KEYS + 9
    keys = keys_for(count, "batches")
    sizes = [(i * 977) % 9000 + 1 for i in range(count)]
    payloads = [payload_for(key, size) for key, size in zip(keys, sizes, strict=True)]
    stored = [i for i in range(count) if i % 17 != 5]  # some keys missing in every batch
    assert backend.put_many([keys[i] for i in stored], [payloads[i] for i in stored]) == \
        [True] * len(stored)
    _warmed(backend, keys, sizes)
    before = backend.stats()["native_reads"]
    outs = [sentinel_buffer(size) for size in sizes]
    fds = _open_fds()
    answers = backend.get_many(keys, [memoryview(out) for out in outs])
    assert _open_fds() == fds
    assert answers == [i in stored for i in range(count)]
    for i in stored:
        assert bytes(outs[i]) == payloads[i], f"block {i} read wrong"
    fans = {keys[i].hex()[:2] for i in stored}  # a key whose fan-out directory exists
    batched = sum(key.hex()[:2] in fans for key in keys)
    assert backend.stats()["native_reads"] - before == (batched if native else 0)
    assert backend.stats()["misses"] >= count - len(stored)


def test_a_bad_frame_in_a_batch_fails_alone_and_is_removed(tmp_path: Path) -> None:
    """Its inode is taken from the descriptor the batch read it through: the file that was
    read is the one removed, and its neighbours in the batch are served."""
    backend = FileBackend(tmp_path, fresh_namespace())
    keys = keys_for(12, "bad-in-batch")
    payloads = [payload_for(key, 3000) for key in keys]
    assert backend.put_many(keys, payloads) == [True] * 12
    _warmed(backend, keys, [3000] * 12)
    victim = backend.path_for(keys[6])
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF  # a payload byte: the checksum no longer matches
    victim.write_bytes(bytes(data))
    outs = [sentinel_buffer(3000) for _ in keys]
    answers = backend.get_many(keys, [memoryview(out) for out in outs])
    assert answers == [i != 6 for i in range(12)]
    assert [bytes(outs[i]) for i in range(12) if i != 6] == \
        [payloads[i] for i in range(12) if i != 6]
    assert not victim.exists()
    assert backend.stats()["corrupt_objects"] == 1


def test_descriptors_of_a_batch_are_closed_when_its_reader_stops_early(tmp_path: Path) -> None:
    """The medium's generator is closed after two items (as when the caller fails between
    items): the batch's descriptors are closed, not left to the garbage collector. A keyed
    tier, whose blocks are judged in Python with their descriptors open (an unkeyed exact
    block's descriptor is closed inside the native call)."""
    backend = FileBackend(tmp_path, fresh_namespace(), auth_key=b"k" * 32)
    keys = keys_for(20, "early-stop")
    assert backend.put_many(keys, [payload_for(key, 500) for key in keys]) == [True] * 20
    _warmed(backend, keys, [500] * 20)
    fds = _open_fds()
    items = backend._m_fetch(keys, [memoryview(bytearray(500)) for _ in keys])
    next(items)
    next(items)
    assert _open_fds() >= fds + 18  # the batch is open while its items are judged
    items.close()
    assert _open_fds() == fds


@pytest.fixture
def direct_root() -> Iterator[Path]:
    """A directory on a real disk (/var/tmp; tmpfs refuses O_DIRECT)."""
    with tempfile.TemporaryDirectory(prefix="kvtier-direct-", dir="/var/tmp") as root:
        yield Path(root)


def test_an_o_direct_batch_reads_aligned_destinations_natively_and_others_the_careful_way(
    direct_root: Path,
) -> None:
    backend = FileBackend(direct_root, fresh_namespace(), o_direct=True)
    if backend.direct_io is not DirectIO.ACTIVE:
        pytest.fail(f"O_DIRECT is not available under {direct_root}: the test needs a real disk")
    keys = keys_for(8, "direct-mix")
    size = 2 * mmap.PAGESIZE
    payloads = [payload_for(key, size) for key in keys]
    assert backend.put_many(keys, payloads) == [True] * 8
    _warmed(backend, keys, [size] * 8)
    # Even slots: whole aligned pages (an engine's pool slot); odd ones: one byte off.
    outs = [memoryview(mmap.mmap(-1, size)) if i % 2 == 0
            else memoryview(bytearray(size + 1))[1:] for i in range(8)]
    before = backend.stats()["native_reads"]
    assert backend.get_many(keys, outs) == [True] * 8
    assert [bytes(out) for out in outs] == payloads
    assert backend.stats()["native_reads"] - before == 4
    assert backend.direct_io is DirectIO.ACTIVE


def test_native_io_is_a_setting_and_its_state_a_gauge(tmp_path: Path) -> None:
    off = open_backend(f"file://{tmp_path}?native_io=false", fresh_namespace())
    on = open_backend(f"file://{tmp_path}", fresh_namespace())
    try:
        assert off.stats()["native_io_active"] == 0
        assert on.stats()["native_io_active"] == 1
    finally:
        off.close()
        on.close()


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_exists_answers_alike_on_both_paths_for_every_kind_of_name(tmp_path: Path,
                                                                    native: bool) -> None:
    """Stored, absent (in a fan-out directory that exists and in one that does not), a
    directory at a block path, and a key too long for one file name (nested directories:
    the native call skips it and that key alone is looked at from Python)."""
    backend = FileBackend(tmp_path, fresh_namespace(), native_io=native)
    stored, absent, planted = keys_for(3, "exists-kinds")
    sibling = stored[:1] + absent[1:]  # absent, in a fan-out directory that exists
    long_key = bytes(range(200))
    assert backend.put_many([stored, long_key], [b"s" * 10, b"l" * 10]) == [True, True]
    path = backend.path_for(planted)
    path.mkdir(parents=True)
    keys = [stored, absent, sibling, planted]
    assert backend.exists(keys) == [True, False, False, False]
    assert backend.exists([*keys, long_key]) == [True, False, False, False, True]
    assert backend.stats()["errors"] == 0


def test_a_backend_opened_on_a_filled_tier_holds_its_fan_out_directories_from_the_start(
    tmp_path: Path,
) -> None:
    """The first probe of a fresh process opens no directory: in a threaded process every
    descriptor number above the table's size costs a copy of the table as it grows (~20 us a
    descriptor), which the first request's probe would otherwise pay for each directory."""
    namespace = fresh_namespace()
    writer = FileBackend(tmp_path, namespace)
    keys = keys_for(40, "held-fans")
    assert writer.put_many(keys, [b"x" * 100] * 40) == [True] * 40
    writer.close()
    fresh = FileBackend(tmp_path, namespace)
    fds = _open_fds()
    assert fresh.exists(keys) == [True] * 40
    assert _open_fds() == fds, "the probe opened directories the open should have held"
    outs = [sentinel_buffer(100) for _ in keys]
    assert fresh.get_many(keys, [memoryview(out) for out in outs]) == [True] * 40
    assert all(bytes(out) == b"x" * 100 for out in outs)


# -- the seal check in the native read (read_frames with a seal) -----------------------------


def _stored(tmp_path: Path, count: int, tag: str, size: int = 3000,
            **options: object) -> tuple[FileBackend, list[bytes], list[bytes]]:
    backend = FileBackend(tmp_path, fresh_namespace(), **options)  # type: ignore[arg-type]
    keys = keys_for(count, tag)
    payloads = [payload_for(key, size) for key in keys]
    assert backend.put_many(keys, payloads) == [True] * count
    return backend, keys, payloads


def test_an_exact_frame_is_verified_in_the_native_read(tmp_path: Path) -> None:
    backend, keys, payloads = _stored(tmp_path, 40, "sealed-read")
    outs = [sentinel_buffer(3000) for _ in keys]
    assert backend.get_many(keys, [memoryview(out) for out in outs]) == [True] * 40
    assert [bytes(out) for out in outs] == payloads
    assert backend.stats()["sealed_reads"] == 40
    assert backend.stats()["hits"] == 40 and backend.stats()["corrupt_objects"] == 0


@pytest.mark.parametrize("where", ["payload", "checksum", "key echo", "namespace", "length"])
def test_a_neighbours_edit_anywhere_in_a_frame_is_never_verified_natively_nor_served(
        tmp_path: Path, where: str) -> None:
    """One byte changed by a writer with access to the tier: the native check refuses the
    frame, the template's judge finds what is wrong, the block answers False and its file is
    removed; the rest of the batch is served."""
    backend, keys, payloads = _stored(tmp_path, 6, f"sealed-edit-{where}")
    offset = {"payload": 1234, "checksum": 3000 + 304, "key echo": 3000 + 32 + 3,
              "namespace": 3000 + 20, "length": 3000 + 8}[where]
    victim = backend.path_for(keys[2])
    data = bytearray(victim.read_bytes())
    data[offset] ^= 0x01
    victim.write_bytes(bytes(data))
    outs = [sentinel_buffer(3000) for _ in keys]
    assert backend.get_many(keys, [memoryview(out) for out in outs]) == [i != 2 for i in range(6)]
    assert [bytes(outs[i]) for i in range(6) if i != 2] == [payloads[i] for i in range(6) if i != 2]
    assert backend.stats()["sealed_reads"] == 5
    assert not victim.exists()


def test_a_block_file_moved_to_another_keys_name_is_not_served_for_it(tmp_path: Path) -> None:
    """A valid frame of key A renamed to key B's path: every byte is a good frame, but of
    another key; the native check compares the key echo with B and refuses it."""
    backend, keys, _payloads = _stored(tmp_path, 2, "sealed-moved")
    os.replace(backend.path_for(keys[0]), backend.path_for(keys[1]))
    out = sentinel_buffer(3000)
    assert backend.get_many([keys[1]], [memoryview(out)]) == [False]
    assert backend.stats()["sealed_reads"] == 0 and backend.stats()["corrupt_objects"] == 1


@pytest.mark.parametrize("change", ["appended", "truncated"])
def test_a_frame_of_another_size_is_judged_by_the_template(tmp_path: Path, change: str) -> None:
    backend, keys, _payloads = _stored(tmp_path, 1, f"sealed-size-{change}")
    path = backend.path_for(keys[0])
    data = path.read_bytes()
    path.write_bytes(data + b"x" * 10 if change == "appended" else data[:-10])
    assert backend.get_many(keys, [memoryview(sentinel_buffer(3000))]) == [False]
    assert backend.stats()["sealed_reads"] == 0


def test_a_keyed_tier_verifies_every_tag_in_python(tmp_path: Path) -> None:
    backend, keys, payloads = _stored(tmp_path, 8, "sealed-keyed", auth_key=b"k" * 32)
    outs = [sentinel_buffer(3000) for _ in keys]
    assert backend.get_many(keys, [memoryview(out) for out in outs]) == [True] * 8
    assert [bytes(out) for out in outs] == payloads
    assert backend.stats()["sealed_reads"] == 0


def test_a_capped_tier_indexes_blocks_verified_natively(tmp_path: Path) -> None:
    """A block found by a read (stored by another process) joins the capacity index at its
    size on disk, whichever path verified it."""
    namespace = fresh_namespace()
    reader = FileBackend(tmp_path, namespace, max_bytes=1 << 30)  # opened on an empty tier
    writer = FileBackend(tmp_path, namespace)
    keys = keys_for(10, "sealed-capped")
    assert writer.put_many(keys, [payload_for(key, 3000) for key in keys]) == [True] * 10
    assert reader.stats()["blocks"] == 0
    assert reader.get_many(keys, [memoryview(sentinel_buffer(3000)) for _ in keys]) == [True] * 10
    assert reader.stats()["sealed_reads"] == 10
    assert reader.stats()["blocks"] == 10
    assert reader.stats()["used_bytes"] == 10 * (3000 + 320)


def test_a_seal_of_the_wrong_shape_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    native = require_batchio()
    results = array.array("q", bytes(16))
    pages = mmap.mmap(-1, mmap.PAGESIZE)
    out = bytearray(10)
    template = bytes(320)
    with pytest.raises(ValueError, match="1 seal keys and 0 verdict bytes for 1 blocks"):
        native.read_frames([-1], [b""], [out], pages, mmap.PAGESIZE, results, os.O_RDONLY,
                           ([b"k" * 16], template, 16, 10, 32, 304, bytearray(0)))
    with pytest.raises(ValueError, match="a record of 320 bytes with a key of 300 bytes"):
        native.read_frames([-1], [b""], [out], pages, mmap.PAGESIZE, results, os.O_RDONLY,
                           ([b"k" * 16], template, 300, 10, 32, 304, bytearray(1)))
    with pytest.raises(TypeError, match="seal key 0 is str; expected bytes"):
        native.read_frames([-1], [b""], [out], pages, mmap.PAGESIZE, results, os.O_RDONLY,
                           (["k"], template, 16, 10, 32, 304, bytearray(1)))


# -- the namespace check inside the native call (a guard) -------------------------------------


@pytest.fixture
def long_lived_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """Views that do not expire within a test (a slow machine could pass the 1 s between a
    warm-up and the call under test, and the careful path would then answer instead)."""
    monkeypatch.setattr(file_dirs, "_FAN_TTL_S", 3600.0)


def _guarded_call(backend: FileBackend, keys: list[bytes], *, swap: Path | None = None,
                  edit: int | None = None) -> tuple[int, bool, array.array, bytearray]:
    """One read_frames and one stat_names of ``keys`` under the guard ``acquire_guarded``
    gives; before the calls, with ``swap``, the namespace directory is renamed there and a
    directory holding a valid frame of each key put in its place; with ``edit``, field ``edit``
    of the guard is changed by one."""
    native = require_batchio()
    _warmed(backend, keys, [3000] * len(keys))  # a view checked since the stores' new fan-outs
    guarded = backend._dirs.acquire_guarded()
    assert guarded is not None
    view, guard = guarded
    try:
        dir_fds, names = _batch_names(view, keys)
        if swap is not None:
            directory = Path(backend._dirs.namespace_path)
            paths = [backend.path_for(key).relative_to(directory) for key in keys]
            directory.rename(swap)
            for key, path in zip(keys, paths, strict=True):
                (directory / path).parent.mkdir(parents=True, exist_ok=True)
                (directory / path).write_bytes(
                    bytes(codec.encode(backend.namespace.digest, key, b"E" * 3000)))
            directory.chmod(0o777)  # what the careful path then finds fails its checks
        if edit is not None:
            fields = list(guard)
            fields[edit] = fields[edit] + b"x" if edit == 2 else fields[edit] + 1
            guard = tuple(fields)  # type: ignore[assignment]
        results = array.array("q", bytes(16 * len(keys)))
        outs = [sentinel_buffer(3000) for _ in keys]
        pages = mmap.mmap(-1, len(keys) * mmap.PAGESIZE)
        left = native.read_frames(dir_fds, names, [memoryview(out) for out in outs], pages,
                                  mmap.PAGESIZE, results, os.O_RDONLY, None, guard)
        looked = native.stat_names(dir_fds, names, array.array("q", bytes(8 * len(keys))), guard)
        native.close_fds(results, len(keys))
        return left, looked, results, outs[0]
    finally:
        backend._dirs.release(view)


def test_a_guard_that_holds_reads_the_batch(tmp_path: Path, long_lived_views: None) -> None:
    backend, keys, payloads = _stored(tmp_path, 3, "guard-holds")
    left, looked, _results, first = _guarded_call(backend, keys)
    assert (left, looked) == (3, True)  # no seal given: every descriptor is the caller's
    assert bytes(first) == payloads[0]


def test_a_namespace_directory_swapped_after_the_guard_was_taken_is_never_read(
        tmp_path: Path, long_lived_views: None) -> None:
    """The race the guard closes: the namespace directory renamed aside and replaced (by a
    world-writable directory of valid frames) between the view's last check and the batch. The
    call opens nothing and looks at nothing; the backend's next call finds the swap (counted)
    and refuses what stands there now."""
    backend, keys, _payloads = _stored(tmp_path, 3, "guard-swap")
    left, looked, results, first = _guarded_call(backend, keys, swap=tmp_path / "aside")
    native = require_batchio()
    assert (left, looked) == (native.GUARD_REFUSED, False)
    assert list(results) == [native.NOT_TAKEN, 0] * 3
    assert bytes(first) == bytes(sentinel_buffer(3000))
    hits = backend.stats()["hits"]  # the warm-up's
    assert backend.get_many(keys, [memoryview(sentinel_buffer(3000)) for _ in keys]) == \
        [False] * 3
    assert backend.stats()["namespace_dir_swaps"] == 1 and backend.stats()["hits"] == hits


@pytest.mark.parametrize("field", range(9), ids=["view_fd", "root_fd", "name", "ino", "dev",
                                                 "mode", "uid", "mtime_ns", "ctime_ns"])
def test_a_guard_refuses_when_any_one_of_its_fields_differs(
        tmp_path: Path, long_lived_views: None, field: int) -> None:
    backend, keys, _payloads = _stored(tmp_path, 2, f"guard-field-{field}")
    left, looked, _results, _first = _guarded_call(backend, keys, edit=field)
    assert (left, looked) == (require_batchio().GUARD_REFUSED, False)


def test_a_warm_batch_makes_its_namespace_check_inside_the_native_call(
        tmp_path: Path, long_lived_views: None) -> None:
    """``TierDirs.acquire`` (the check from Python) is wrapped to count its calls, a spy, not a
    fault: a warm get and exists take the guarded path; a view due for replacement (expired)
    takes the careful one, which installs a fresh view."""
    backend, keys, payloads = _stored(tmp_path, 5, "guard-path")
    _warmed(backend, keys, [3000] * 5)
    dirs = backend._dirs
    calls: list[int] = []
    checked = dirs.acquire

    def counted() -> View:
        calls.append(1)
        return checked()

    dirs.acquire = counted  # type: ignore[method-assign]
    outs = [sentinel_buffer(3000) for _ in keys]
    assert backend.get_many(keys, [memoryview(out) for out in outs]) == [True] * 5
    assert backend.exists(keys) == [True] * 5
    assert [bytes(out) for out in outs] == payloads and calls == []
    assert dirs._held.view is not None
    dirs._held.view.expires = 0.0
    assert backend.exists(keys) == [True] * 5
    assert calls == [1]


def test_an_exact_blocks_descriptor_is_closed_in_the_native_call(tmp_path: Path) -> None:
    backend, keys, _payloads = _stored(tmp_path, 4, "guard-close")
    native = require_batchio()
    view = backend._dirs.acquire()
    try:
        dir_fds, names = _batch_names(view, keys)
        template = backend._codec.seal_template(len(keys[0]), 3000)
        assert template is not None
        verified = bytearray(4)
        results = array.array("q", bytes(64))
        pages = mmap.mmap(-1, 4 * mmap.PAGESIZE)
        outs = [memoryview(sentinel_buffer(3000)) for _ in keys]
        outs[3] = memoryview(sentinel_buffer(2999))  # read whole, but not the template's size
        fds = _open_fds()
        left = native.read_frames(dir_fds, names, outs, pages, mmap.PAGESIZE, results,
                                  os.O_RDONLY, (keys, template, len(keys[0]), 3000, _KEY_OFFSET,
                                                _CHECK_OFFSET, verified))
        assert (left, bytes(verified)) == (1, b"\x01\x01\x01\x00")
        assert [results[2 * i] for i in range(3)] == [native.NOT_TAKEN] * 3
        assert _open_fds() == fds + 1
        native.close_fds(results, 4)
        assert _open_fds() == fds
    finally:
        backend._dirs.release(view)


def test_a_guard_of_the_wrong_shape_is_refused_with_what_was_expected() -> None:
    native = require_batchio()
    results = array.array("q", bytes(16))
    with pytest.raises(ValueError, match=r"guard of 2 items; expected 9 \(view_fd, root_fd"):
        native.stat_names([-1], [b""], results, (1, 2))
    with pytest.raises(TypeError, match=r"guard is list; expected None or a tuple"):
        native.read_frames([-1], [b""], [bytearray(1)], mmap.mmap(-1, mmap.PAGESIZE),
                           mmap.PAGESIZE, results, os.O_RDONLY, None, [1])
