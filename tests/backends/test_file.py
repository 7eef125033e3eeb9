"""File backend specifics: restart, crash leftovers, capacity, full and read-only disks, modes."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.conftest import fresh_namespace
from backends.test_contract import keys_for, payload_for, sentinel_buffer
from kvtier import codec
from kvtier.backends import BackendUnavailableError, open_backend
from kvtier.backends.file import DirectIO, FileBackend
from kvtier.keys import Namespace


def all_files(root: Path) -> list[Path]:
    return sorted(path for path in root.rglob("*") if path.is_file())


def temp_files(root: Path) -> list[Path]:
    return [path for path in all_files(root) if path.name.startswith(".tmp-")]


@contextlib.contextmanager
def mounted(args: list[str], target: Path) -> Iterator[bool]:
    """Run ``mount args... target``; yields False (and mounts nothing) if that is not allowed."""
    target.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", *args, str(target)], capture_output=True, check=False)
    if result.returncode != 0:
        yield False
        return
    try:
        yield True
    finally:
        if subprocess.run(["umount", str(target)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(target)], check=False)


def test_restart_sees_blocks_and_rebuilds_the_capacity_index(tmp_path: Path) -> None:
    namespace = fresh_namespace()
    keys = keys_for(5, "restart")
    first = FileBackend(tmp_path, namespace, max_bytes=10 << 20)
    assert first.put_many(keys, [payload_for(key, 1000) for key in keys]) == [True] * 5
    used = first.stats()["used_bytes"]
    assert used == 5 * codec.frame_size(1000)
    first.close()

    second = FileBackend(tmp_path, namespace, max_bytes=10 << 20)
    stats = second.stats()
    assert (stats["blocks"], stats["used_bytes"]) == (5, used)
    outs = [sentinel_buffer(1000) for _ in keys]
    assert second.get_many(keys, [memoryview(out) for out in outs]) == [True] * 5
    assert [bytes(out) for out in outs] == [payload_for(key, 1000) for key in keys]


def test_restart_with_smaller_capacity_evicts_oldest_by_mtime(tmp_path: Path) -> None:
    namespace = fresh_namespace()
    keys = keys_for(5, "mtime")
    first = FileBackend(tmp_path, namespace)
    assert first.put_many(keys, [payload_for(key, 1000) for key in keys]) == [True] * 5
    # Make the on-disk age order differ from the write order: keys[4] oldest, keys[0] newest.
    for age, key in enumerate(reversed(keys)):
        os.utime(first.path_for(key), ns=(10**18 + age * 10**9, 10**18 + age * 10**9))
    first.close()

    second = FileBackend(tmp_path, namespace, max_bytes=3 * codec.frame_size(1000))
    assert second.exists(keys) == [True, True, True, False, False]
    assert second.stats()["evictions"] == 2
    assert second.evicted.take() == [keys[4], keys[3]]  # the scan's evictions, oldest first


def test_capacity_evicts_least_recently_used(tmp_path: Path) -> None:
    frame = codec.frame_size(1000)
    backend = FileBackend(tmp_path, fresh_namespace(), max_bytes=3 * frame)
    k1, k2, k3, k4 = keys_for(4, "lru")
    assert (
        backend.put_many([k1, k2, k3], [payload_for(k, 1000) for k in (k1, k2, k3)]) == [True] * 3
    )
    assert backend.get_many([k1], [memoryview(bytearray(1000))]) == [True]  # k1 is now newest
    assert backend.put_many([k4], [payload_for(k4, 1000)]) == [True]
    assert backend.exists([k1, k2, k3, k4]) == [True, False, True, True]
    stats = backend.stats()
    assert (stats["evictions"], stats["used_bytes"], stats["blocks"]) == (1, 3 * frame, 3)
    assert (backend.evicted.take(), backend.evicted.take()) == ([k2], [])  # taken once
    # A block that can never fit is refused without evicting anything.
    [huge] = keys_for(1, "huge")
    assert backend.put_many([huge], [bytes(3 * frame)]) == [False]
    assert backend.stats()["put_rejected"] == 1
    assert backend.exists([k1, k3, k4]) == [True, True, True]
    backend.delete([k3])  # a delete is the caller's own: not reported back
    assert backend.evicted.take() == []


def test_a_capped_batch_reserves_once_and_gives_back_what_a_slow_path_stores(
    tmp_path: Path,
) -> None:
    """A size-capped tier stores a batch through the one-loop store: a block another writer
    published meanwhile (the loop's rename finds its name taken) gives its share of the batch
    reservation back, so the next batch fits without evicting; a batch over the rest of the cap
    evicts the oldest blocks first, as block-by-block stores would."""
    namespace = fresh_namespace()
    frame = codec.frame_size(1000)
    k1, k2, k3, k4 = keys_for(4, "capped-batch")
    other = FileBackend(tmp_path, namespace)  # a second writer on the same directory
    capped = FileBackend(tmp_path, namespace, max_bytes=5 * frame)
    assert other.put_many([k1], [payload_for(k1, 1000)]) == [True]
    assert capped.put_many([k1, k2, k3], [payload_for(k, 1000) for k in (k1, k2, k3)]) == [True] * 3
    used = capped.stats()["used_bytes"]
    assert used in (2 * frame, 3 * frame)  # k1 is the other writer's: indexed or not
    assert capped.put_many([k4], [payload_for(k4, 1000)]) == [True]
    assert capped.stats()["evictions"] == 0
    assert capped.stats()["used_bytes"] == used + frame
    # Two more blocks than the cap has room for: the oldest go first, whole batch at once.
    more = keys_for(3, "capped-more")
    assert capped.put_many(more, [payload_for(k, 1000) for k in more]) == [True] * 3
    stats = capped.stats()
    assert stats["used_bytes"] <= 5 * frame
    assert stats["evictions"] == (used + 4 * frame - 5 * frame) // frame
    assert capped.exists([*more, k4]) == [True] * 4
    assert capped.exists([k2]) == [False]  # the oldest block this writer stored


def test_crash_mid_put_leaves_no_block_and_the_temp_file_is_removed_on_open(
    tmp_path: Path,
) -> None:
    """A real crash: a child process is SIGKILLed after writing the temp file, before publish.
    The child stores through Python (``native_io=False``): only there can a test stop it between
    the two calls; the native store leaves the same temp file at the same point."""
    namespace = fresh_namespace()
    [key] = keys_for(1, "crash")
    script = textwrap.dedent(
        f"""
        import os, signal
        from kvtier.backends.file import FileBackend, publish, store
        from kvtier.keys import Namespace
        backend = FileBackend({str(tmp_path)!r}, Namespace(model={namespace.model!r}),
                              native_io=False)
        die = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
        os.link = die  # whichever way the backend publishes, it dies first
        publish._rename_noreplace = die
        store._renameat2 = die  # the store loop's inline renameat2
        backend.put_many([{key!r}], [bytes(100000)])
        """
    )
    child = subprocess.run([sys.executable, "-c", script], check=False, timeout=60)
    assert child.returncode == -9
    assert len(temp_files(tmp_path)) == 1

    reopened = FileBackend(tmp_path, namespace)
    assert temp_files(tmp_path) == []
    assert reopened.stats()["stray_temp_files_removed"] == 1
    assert reopened.exists([key]) == [False]


def test_temp_files_of_live_processes_are_kept(tmp_path: Path) -> None:
    namespace = fresh_namespace()
    backend = FileBackend(tmp_path, namespace)
    [key] = keys_for(1, "live")
    directory = backend.path_for(key).parent
    directory.mkdir(parents=True)
    ours = directory / f".tmp-{os.getpid()}-12345"  # a sibling instance in this process
    init = directory / ".tmp-1-7"  # pid 1 is always alive
    for path in (ours, init):
        path.write_bytes(b"partial")
    FileBackend(tmp_path, namespace)
    assert ours.exists() and init.exists()


def test_files_are_0600_and_directories_0700(tmp_path: Path) -> None:
    root = tmp_path / "fresh" / "tier"
    old_umask = os.umask(0)
    try:
        backend = FileBackend(root, fresh_namespace())
        keys = keys_for(3, "modes")
        assert backend.put_many(keys, [b"x" * 10] * 3) == [True] * 3
    finally:
        os.umask(old_umask)
    for path in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))


@pytest.mark.parametrize(
    "key",
    [b"../../../etc/passwd", b"/", b".", b"\x00", b"\xff", bytes(range(255)), b"a" * 125],
    ids=["dotdot", "slash", "dot", "nul", "one-byte", "255-bytes", "125-bytes"],
)
def test_no_key_escapes_the_root_and_every_key_survives_a_restart(
    tmp_path: Path, key: bytes
) -> None:
    namespace = fresh_namespace()
    backend = FileBackend(tmp_path / "tier", namespace)
    namespace_dir = (tmp_path / "tier" / namespace.digest_hex).resolve()
    path = backend.path_for(key).resolve()
    assert path.is_relative_to(namespace_dir)
    payload = payload_for(key, 777)
    assert backend.put_many([key], [payload]) == [True]
    assert all(p.is_relative_to(tmp_path / "tier") for p in all_files(tmp_path))
    backend.close()
    reopened = FileBackend(tmp_path / "tier", namespace)
    assert reopened.stats()["blocks"] == 1
    out = sentinel_buffer(777)
    assert reopened.get_many([key], [memoryview(out)]) == [True]
    assert bytes(out) == payload


def test_foreign_files_are_ignored_and_kept(tmp_path: Path) -> None:
    namespace = fresh_namespace()
    backend = FileBackend(tmp_path, namespace)
    namespace_dir = tmp_path / namespace.digest_hex
    strangers = [namespace_dir / "README", namespace_dir / "zz" / "yy" / "not-hex.kvb"]
    strangers[1].parent.mkdir(parents=True)
    for path in strangers:
        path.write_bytes(b"not ours")
    backend.close()
    reopened = FileBackend(tmp_path, namespace)
    assert reopened.stats()["blocks"] == 0
    assert all(path.exists() for path in strangers)


def test_disk_full_fails_cleanly_and_recovers(tmp_path: Path) -> None:
    """A real full filesystem: a 512 KiB tmpfs. Where mounting is not allowed, ENOSPC is injected
    with a mock ``os.writev`` that writes part of the frame, then fails (documented fallback)."""
    mount_point = tmp_path / "small"
    tmpfs = ["-t", "tmpfs", "-o", "size=512k,mode=0700", "tmpfs"]
    with mounted(tmpfs, mount_point) as real, contextlib.ExitStack() as fault:
        if not real:
            fault.enter_context(_inject_enospc_after(4))
        backend = FileBackend(mount_point, fresh_namespace())
        keys = keys_for(12, "full")
        payloads = [payload_for(key, 65536) for key in keys]
        stored = backend.put_many(keys, payloads)
        assert True in stored and False in stored
        assert backend.stats()["errors"] >= 1
        assert temp_files(mount_point) == []
        assert backend.exists(keys) == stored
        outs = [sentinel_buffer(65536) for _ in keys]
        answers = backend.get_many(keys, [memoryview(out) for out in outs])
        assert answers == stored
        for ok, out, payload in zip(answers, outs, payloads, strict=True):
            assert bytes(out) == (payload if ok else bytes(sentinel_buffer(65536)))
        # Free space; the failed keys can now be stored: the next call recovers.
        fault.close()
        backend.delete([key for key, ok in zip(keys, stored, strict=True) if ok])
        failed = [key for key, ok in zip(keys, stored, strict=True) if not ok][:4]
        retried = backend.put_many(failed, [payload_for(key, 65536) for key in failed])
        assert retried == [True] * len(failed)
        backend.close()


@contextlib.contextmanager
def _inject_enospc_after(successful_writes: int) -> Iterator[None]:
    real_writev = os.writev
    calls = 0

    def writev(fd: int, buffers: Any) -> int:
        nonlocal calls
        calls += 1
        if calls <= successful_writes:
            return real_writev(fd, buffers)
        real_writev(fd, [bytes(100)])
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "writev", writev)
        yield


def test_read_only_directory_serves_reads_and_fails_writes_cleanly(tmp_path: Path) -> None:
    """A real read-only bind mount of a populated tier. Where mounting is not allowed, EROFS is
    injected with a mock ``os.open`` / ``os.unlink`` (documented fallback)."""
    namespace = fresh_namespace()
    source = tmp_path / "rw"
    keys = keys_for(3, "ro")
    payloads = [payload_for(key, 5000) for key in keys]
    writer = FileBackend(source, namespace)
    assert writer.put_many(keys[:2], payloads[:2]) == [True, True]
    writer.close()
    view_point = tmp_path / "ro"
    with mounted(["--bind", str(source)], view_point) as bound, contextlib.ExitStack() as stack:
        if bound:
            remount = ["mount", "-o", "remount,bind,ro", str(view_point)]
            subprocess.run(remount, check=True, capture_output=True)
        else:
            view_point = source
            stack.enter_context(_inject_erofs())
        backend = FileBackend(view_point, namespace)
        assert backend.put_many([keys[2]], [payloads[2]]) == [False]
        assert backend.stats()["errors"] == 1
        assert backend.exists(keys) == [True, True, False]
        outs = [sentinel_buffer(5000) for _ in keys]
        assert backend.get_many(keys, [memoryview(out) for out in outs]) == [True, True, False]
        assert [bytes(out) for out in outs[:2]] == payloads[:2]
        backend.delete(keys[:1])  # cannot delete: counted, logged, never raised
        assert backend.stats()["errors"] == 2
        backend.close()


@contextlib.contextmanager
def _inject_erofs() -> Iterator[None]:
    real_open, creating = os.open, os.O_CREAT

    def fake_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & creating:
            raise OSError(errno.EROFS, "Read-only file system (injected)")
        return real_open(path, flags, *args, **kwargs)

    def fake_unlink(*_args: Any, **_kwargs: Any) -> None:
        raise OSError(errno.EROFS, "Read-only file system (injected)")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "open", fake_open)
        patch.setattr(os, "unlink", fake_unlink)
        yield


def test_o_direct_files_are_exact_frames_and_mix_with_buffered_instances(tmp_path: Path) -> None:
    namespace = fresh_namespace()
    direct = FileBackend(tmp_path, namespace, o_direct=True)
    assert direct.direct_io is DirectIO.ACTIVE
    assert direct.stats()["o_direct_active"] == 1
    keys = keys_for(3, "direct")
    sizes = [0, 5000, 1 << 20]
    payloads = [payload_for(key, size) for key, size in zip(keys, sizes, strict=True)]
    assert direct.put_many(keys, payloads) == [True] * 3
    for key, size in zip(keys, sizes, strict=True):  # written in whole pages, then cut
        assert direct.path_for(key).stat().st_size == size + codec.HEADER_BYTES
    outs = [sentinel_buffer(size) for size in sizes]
    assert direct.get_many(keys, [memoryview(out) for out in outs]) == [True] * 3
    assert [bytes(out) for out in outs] == payloads

    buffered = FileBackend(tmp_path, Namespace(model=namespace.model), o_direct=False)
    assert buffered.namespace == namespace
    outs = [sentinel_buffer(size) for size in sizes]
    assert buffered.get_many(keys, [memoryview(out) for out in outs]) == [True] * 3
    assert [bytes(out) for out in outs] == payloads
    [plain] = keys_for(1, "plain")
    assert buffered.put_many([plain], [b"abc"]) == [True]
    out = sentinel_buffer(3)
    assert direct.get_many([plain], [memoryview(out)]) == [True]
    assert bytes(out) == b"abc"
    assert direct.stats()["corrupt_objects"] == buffered.stats()["corrupt_objects"] == 0


def test_o_direct_refused_falls_back_to_buffered_io(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mocked fault: the filesystems here accept O_DIRECT, so EINVAL is injected into os.open."""
    real_open = os.open

    def refusing_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument (injected)")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    backend = FileBackend(tmp_path, fresh_namespace(), o_direct=True)
    keys = keys_for(2, "fallback")
    assert backend.put_many(keys, [b"a" * 5000, b"b" * 7000]) == [True, True]
    outs = [sentinel_buffer(5000), sentinel_buffer(7000)]
    assert backend.get_many(keys, [memoryview(out) for out in outs]) == [True, True]
    assert (bytes(outs[0]), bytes(outs[1])) == (b"a" * 5000, b"b" * 7000)
    stats = backend.stats()
    assert (stats["o_direct_fallbacks"], stats["o_direct_active"], stats["errors"]) == (1, 0, 0)
    assert backend.direct_io is DirectIO.UNSUPPORTED


def test_file_longer_than_its_padding_is_corrupt(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path, fresh_namespace())
    [key] = keys_for(1, "long")
    assert backend.put_many([key], [b"z" * 1000]) == [True]
    path = backend.path_for(key)
    path.write_bytes(path.read_bytes() + bytes(8192))
    out = sentinel_buffer(1000)
    assert backend.get_many([key], [memoryview(out)]) == [False]  # out: unspecified, unpublished
    assert backend.stats()["corrupt_objects"] == 1
    assert not path.exists()


def test_racing_writers_of_one_key_publish_exactly_one_whole_file(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path, fresh_namespace())
    [key] = keys_for(1, "race")
    payloads = [payload_for(key, 300000, bytes([i])) for i in range(4)]
    barrier = threading.Barrier(len(payloads))
    answers: list[list[bool]] = []

    def writer(payload: bytes) -> None:
        barrier.wait(timeout=30)
        answers.append(backend.put_many([key], [payload]))

    threads = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert answers == [[True]] * 4
    assert [path.name for path in all_files(tmp_path)] == [backend.path_for(key).name]
    out = bytearray(300000)
    assert backend.get_many([key], [memoryview(out)]) == [True]
    assert bytes(out) in payloads


def test_instances_sharing_a_directory_see_each_others_blocks(tmp_path: Path) -> None:
    namespace = fresh_namespace()
    scheduler_side = FileBackend(tmp_path, namespace)
    worker_side = FileBackend(tmp_path, namespace)
    keys = keys_for(2, "shared")
    assert worker_side.put_many(keys, [b"p" * 10, b"q" * 10]) == [True, True]
    assert scheduler_side.exists(keys) == [True, True]
    out = bytearray(10)
    assert scheduler_side.get_many(keys[1:], [memoryview(out)]) == [True]
    assert bytes(out) == b"q" * 10


def test_fsync_option_syncs_file_and_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``os.fsync`` is wrapped by a counting spy that still calls the real fsync."""
    real_fsync, calls = os.fsync, []

    def counting_fsync(fd: int) -> None:
        calls.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    backend = open_backend(f"file://{tmp_path}?fsync=true", fresh_namespace())
    keys = keys_for(2, "fsync")
    assert backend.put_many(keys, [b"1" * 100, b"2" * 100]) == [True, True]
    assert len(calls) == 4  # file + directory, per block
    assert backend.put_many(keys, [b"1" * 100, b"2" * 100]) == [True, True]
    assert len(calls) == 4  # already present: nothing written


def test_relative_root_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="absolute path"):
        FileBackend("relative/dir", fresh_namespace())
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with pytest.raises(ValueError, match="cannot be used"):
        FileBackend(blocker / "sub", Namespace(model="m"))


@pytest.mark.parametrize("o_direct", [False, True])
@pytest.mark.parametrize("out_size", [0, 10, 999, 1001, 5000, 9000])
def test_wrong_size_out_answers_false_in_buffered_and_direct_files(
    tmp_path: Path, o_direct: bool, out_size: int
) -> None:
    """The payload is read straight into ``out`` before the size is known (no ``fstat``), so
    ``out`` is unspecified after False; the block is never served and is removed."""
    backend = FileBackend(tmp_path, fresh_namespace(), o_direct=o_direct)
    [key] = keys_for(1, "wrong-size")
    assert backend.put_many([key], [b"w" * 1000]) == [True]
    out = sentinel_buffer(out_size)
    assert backend.get_many([key], [memoryview(out)]) == [False]
    assert backend.exists([key]) == [False]  # removed: the next store replaces it
    assert (backend.stats()["corrupt_objects"], backend.stats()["size_mismatches"]) == (0, 1)


def test_a_failed_stat_is_unknown_to_probe_and_false_to_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An I/O error (EIO) on the block's ``fstatat`` cannot be produced on demand by a real
    disk, so it is injected with a mock ``os.stat``; a missing file (ENOENT) stays a plain
    "absent". The backend looks through Python (``native_io=false``), where the mock reaches;
    a native look that fails other than ENOENT is looked at again by the same Python path."""
    backend = open_backend(f"file://{tmp_path}?native_io=false", fresh_namespace())
    present, absent = keys_for(2, "probe")
    assert backend.put_many([present], [payload_for(present, 64)]) == [True]
    real_stat = os.stat

    def failing_stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if str(path).endswith(present.hex() + ".kvb"):
            raise OSError(errno.EIO, "injected I/O error", str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", failing_stat)
    assert backend.exists([present, absent]) == [False, False]
    with pytest.raises(BackendUnavailableError, match="1 of 2 existence check"):
        backend.probe([present, absent])
    monkeypatch.setattr(os, "stat", real_stat)
    assert backend.probe([present, absent]) == [True, False]
    backend.close()


def test_publishing_falls_back_to_hard_links_without_rename_noreplace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem that refuses RENAME_NOREPLACE (EINVAL) is simulated with a mock, since the
    test machine's filesystems all support it; the block must still be published once, and an
    existing block still never overwritten."""
    from kvtier.backends.file import publish

    def refusing(_src_dir: int, _temp: str, _dst_dir: int, final: str) -> None:
        raise OSError(errno.EINVAL, "injected: no RENAME_NOREPLACE", final)

    monkeypatch.setattr(publish, "_rename_noreplace", refusing)
    backend = open_backend(f"file://{tmp_path}", fresh_namespace())
    [key] = keys_for(1, "fallback")
    first, second = payload_for(key, 4096, b"first"), payload_for(key, 4096, b"second")
    assert backend.put_many([key], [first]) == [True]
    assert backend.put_many([key], [second]) == [True]
    out = sentinel_buffer(4096)
    assert backend.get_many([key], [memoryview(out)]) == [True]
    assert bytes(out) == first
    assert temp_files(tmp_path) == []
    backend.close()


@pytest.mark.parametrize("o_direct", [False, True])
def test_damaged_length_field_is_corrupt_not_a_wrong_size_read(
    tmp_path: Path, o_direct: bool
) -> None:
    """A flipped bit in the header's payload-length field must not pass for "the caller's out
    has the wrong size" (which keeps the file): the file would then be kept, never counted, and
    answer True to exists but False to every read, forever."""
    backend = FileBackend(tmp_path, fresh_namespace(), o_direct=o_direct)
    [key] = keys_for(1, "length-flip")
    assert backend.put_many([key], [b"q" * 1000]) == [True]
    path = backend.path_for(key)
    damaged = bytearray(path.read_bytes())
    damaged[9] ^= 0x01  # payload length 1000 -> 744: within the same O_DIRECT page
    path.write_bytes(bytes(damaged))
    out = sentinel_buffer(1000)
    assert backend.get_many([key], [memoryview(out)]) == [False]  # out: unspecified, unpublished
    assert backend.stats()["corrupt_objects"] == 1
    assert not path.exists()


def test_good_block_published_while_dropping_a_corrupt_one_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader finds a corrupt file; while it removes it, another reader drops the bad file and
    a writer publishes the good block under the same name. Only the bad file may go. The
    wrappers around ``os.stat`` / ``os.rename`` only pin that interleaving right after the
    reader's first filesystem call on the block's name (no real part can pause between two
    syscalls); the files, renames and unlinks are real."""
    namespace = fresh_namespace()
    reader, writer = FileBackend(tmp_path, namespace), FileBackend(tmp_path, namespace)
    [key] = keys_for(1, "drop-race")
    payload = b"g" * 5000
    path = str(reader.path_for(key))
    name = os.path.basename(path)  # the backend names files relative to held directories
    good = bytes(codec.encode(namespace.digest, key, payload, codec.FrameLayout.TRAILER))
    bad = bytearray(good)
    bad[7] ^= 0x01  # a payload byte (format 4: the payload comes first)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(bytes(bad))
    armed = threading.Event()
    raced = threading.Event()
    real_verify, real_stat, real_rename = codec.FrameCodec.verify_in_place, os.stat, os.rename

    def verify_then_arm(*args: Any) -> None:
        try:
            real_verify(*args)
        except codec.FrameError:
            armed.set()
            raise

    def race() -> None:
        if not raced.is_set():
            raced.set()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # another reader dropped the bad file ...
            assert writer.put_many([key], [payload]) == [True]  # ... and the block came back

    def stat_then_race(target: Any, *args: Any, **kwargs: Any) -> Any:
        result = real_stat(target, *args, **kwargs)
        if armed.is_set() and os.fspath(target) == name:
            race()
        return result

    def rename_then_race(source: Any, *args: Any, **kwargs: Any) -> None:
        real_rename(source, *args, **kwargs)
        if armed.is_set() and os.fspath(source) == name:
            race()

    monkeypatch.setattr(codec.FrameCodec, "verify_in_place", verify_then_arm)
    monkeypatch.setattr(os, "stat", stat_then_race)
    monkeypatch.setattr(os, "rename", rename_then_race)
    out = sentinel_buffer(len(payload))
    assert reader.get_many([key], [memoryview(out)]) == [False]
    monkeypatch.undo()
    assert raced.is_set()
    assert reader.stats()["corrupt_objects"] == 1
    assert Path(path).read_bytes() == good
    assert reader.get_many([key], [memoryview(out)]) == [True] and bytes(out) == payload
    assert temp_files(tmp_path) == []


def test_two_instances_in_one_process_never_share_a_temp_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two instances on one directory (a scheduler and a worker in one process) write into the
    same fan-out directory at once: their temp names must differ, or the second O_EXCL open
    fails and a good put answers False. The ``os.fsync`` wrapper only holds the first write
    open (with its temp file on disk) while the second one runs."""
    namespace = fresh_namespace()
    first = FileBackend(tmp_path, namespace, fsync=True)
    second = FileBackend(tmp_path, namespace)
    key_a, key_b = b"\xab\xcd" + b"a" * 14, b"\xab\xcd" + b"b" * 14  # one fan-out directory
    holding, release = threading.Event(), threading.Event()
    real_fsync = os.fsync
    results: list[list[bool]] = []

    def held_fsync(fd: int) -> None:
        if threading.current_thread().name == "first-writer" and not holding.is_set():
            holding.set()
            if not release.wait(30):
                raise TimeoutError("the test never released the first writer")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", held_fsync)
    writer = threading.Thread(
        target=lambda: results.append(first.put_many([key_a], [b"1" * 100])), name="first-writer"
    )
    writer.start()
    try:
        assert holding.wait(30)
        assert temp_files(tmp_path) != []  # the first write is in flight
        assert second.put_many([key_b], [b"2" * 100]) == [True]
    finally:
        release.set()
        writer.join(30)
    assert results == [[True]]
    assert second.stats()["errors"] == 0
    assert first.exists([key_a, key_b]) == [True, True]


def test_put_of_an_existing_block_indexes_its_size_on_disk(tmp_path: Path) -> None:
    """A block another instance already wrote (unpadded, buffered I/O) is indexed by a put with
    its real file size, not the padded size this O_DIRECT instance would have written."""
    namespace = fresh_namespace()
    direct = FileBackend(tmp_path, namespace, o_direct=True, max_bytes=1 << 20)
    buffered = FileBackend(tmp_path, namespace)
    [key] = keys_for(1, "adopt-size")
    assert buffered.put_many([key], [b"s" * 1000]) == [True]
    assert direct.stats()["used_bytes"] == 0  # opened before the block existed
    assert direct.put_many([key], [b"s" * 1000]) == [True]
    assert direct.stats()["used_bytes"] == codec.HEADER_BYTES + 1000
