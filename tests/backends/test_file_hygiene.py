"""File tier hygiene with real FIFOs, symlinks, sockets, directories, modes and owners.

The tests run as root, so "a directory owned by another user" is made with ``os.chown`` to uid
65534 (nobody). Every read that could hang (a FIFO at a block path) runs on a daemon thread with
a wall-clock limit, so a hang fails the test instead of blocking the run.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from backends.test_contract import keys_for, payload_for, sentinel_buffer
from kvtier import codec
from kvtier.backends import open_backend
from kvtier.backends.file import FileBackend
from kvtier.keys import Namespace
from kvtier.settings import ConfigError

NOBODY = 65534
AUTH_KEY = "hygiene-auth-key-0123456789abcdef"
WALL_CLOCK_S = 10.0


def _within_deadline(call: Callable[[], object]) -> object:
    """Run ``call`` on a daemon thread; fail the test if it does not return in time."""
    box: list[object] = []
    thread = threading.Thread(target=lambda: box.append(call()), daemon=True)
    thread.start()
    thread.join(WALL_CLOCK_S)
    assert not thread.is_alive(), f"the call did not return within {WALL_CLOCK_S}s (a hang)"
    return box[0]


def _fresh(tmp_path: Path, *, native: bool = True) -> tuple[FileBackend, Namespace]:
    namespace = Namespace(model=f"hygiene-{os.urandom(4).hex()}")
    backend = FileBackend(tmp_path / "tier", namespace, native_io=native)
    assert backend.stats()["native_io_active"] == int(native)  # the path under test is taken
    return backend, namespace


# The reads and stores below run on both paths: the native batch calls and Python's.
READ_PATHS = pytest.mark.parametrize("native", [True, False], ids=["native", "python"])


def _assert_read_path(backend: FileBackend, native: bool) -> None:
    assert (backend.stats()["native_reads"] > 0) is native


# --------------------------------------------------------------------------- directories


def test_world_writable_root_without_sticky_bit_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "open"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(ConfigError, match=r"world-writable \(mode 777\) without the sticky bit"):
        open_backend(f"file://{root}", Namespace(model="m"))
    os.chmod(root, 0o1777)  # like /tmp: others cannot remove or rename our entries
    open_backend(f"file://{root}", Namespace(model="m")).close()
    os.chmod(root, 0o777)
    open_backend(f"file://{root}?shared_dir=true", Namespace(model="m"),
                 auth_key=AUTH_KEY).close()


def test_namespace_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    namespace = Namespace(model="planted")
    planted = tmp_path / namespace.digest_hex
    planted.mkdir(mode=0o755)
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=f"owned by uid {NOBODY}") as caught:
        open_backend(f"file://{tmp_path}", namespace)
    assert "shared_dir=true" in str(caught.value)
    backend = open_backend(f"file://{tmp_path}", namespace, shared_dir=True, auth_key=AUTH_KEY)
    backend.close()


def test_world_writable_namespace_directory_is_refused(tmp_path: Path) -> None:
    namespace = Namespace(model="planted-open")
    planted = tmp_path / namespace.digest_hex
    planted.mkdir()
    os.chmod(planted, 0o777)
    with pytest.raises(ConfigError, match=r"namespace directory .* world-writable"):
        open_backend(f"file://{tmp_path}", namespace)


def test_root_of_another_user_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "theirs"
    root.mkdir()
    os.chown(root, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=f"root .* owned by uid {NOBODY}"):
        open_backend(f"file://{root}", Namespace(model="m"))


def test_a_root_deleted_under_a_running_backend_is_never_recreated(tmp_path: Path) -> None:
    backend, _namespace = _fresh(tmp_path)
    keys = keys_for(2, "deleted-root")
    assert backend.put_many(keys[:1], [b"a" * 100]) == [True]
    shutil.rmtree(tmp_path / "tier")
    before = backend.stats()["errors"]
    assert backend.put_many(keys[1:], [b"b" * 100]) == [False]  # fails, counted
    assert backend.stats()["errors"] == before + 1
    assert not (tmp_path / "tier").exists(), "the backend re-created a deleted root"
    assert backend.exists(keys) == [False, False]
    assert backend.get_many(keys[:1], [memoryview(bytearray(100))]) == [False]
    assert not (tmp_path / "tier").exists()


# --------------------------------------------------------------------------- block paths


def _plant_fifo(path: Path) -> None:
    os.mkfifo(path)


def _plant_symlink(path: Path) -> None:
    # The target is a valid-looking file elsewhere; a symlink is never followed.
    target = path.parent / "elsewhere"
    target.write_bytes(b"x" * 500)
    path.symlink_to(target)


def _plant_dangling_symlink(path: Path) -> None:
    path.symlink_to("/nonexistent/target")


def _plant_directory(path: Path) -> None:
    path.mkdir()


def _plant_full_directory(path: Path) -> None:
    path.mkdir()
    (path / "inside").write_bytes(b"x")


def _plant_socket(path: Path) -> None:
    # AF_UNIX paths are short (108 bytes): bind next to the tier root, then move it in place.
    short = path.parents[3] / f"s{os.getpid()}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(short))
    server.close()  # the socket file stays; nobody listens
    os.rename(short, path)


PLANTS: dict[str, Callable[[Path], None]] = {
    "fifo": _plant_fifo,
    "symlink": _plant_symlink,
    "dangling_symlink": _plant_dangling_symlink,
    "directory": _plant_directory,
    "non_empty_directory": _plant_full_directory,
    "socket": _plant_socket,
}


def _plant(backend: FileBackend, key: bytes, kind: str) -> Path:
    path = backend.path_for(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    PLANTS[kind](path)
    return path


@READ_PATHS
@pytest.mark.parametrize("kind", sorted(PLANTS))
def test_a_non_regular_file_at_a_block_path_is_never_read_and_is_removed(
    tmp_path: Path, kind: str, native: bool
) -> None:
    backend, _namespace = _fresh(tmp_path, native=native)
    [key] = keys_for(1, f"plant-{kind}")
    path = _plant(backend, key, kind)
    out = sentinel_buffer(500)
    assert _within_deadline(lambda: backend.get_many([key], [memoryview(out)])) == [False]
    _assert_read_path(backend, native)
    assert backend.stats()["corrupt_objects"] == 1
    assert backend.stats()["hits"] == 0
    assert not os.path.lexists(path), f"the planted {kind} still blocks the key"
    _plant(backend, key, kind)  # again, for the probes: they never answer present for it
    assert backend.exists([key]) == [False]
    assert backend.probe([key]) == [False]
    payload = payload_for(key, 500)
    assert backend.put_many([key], [payload]) == [True]
    assert backend.get_many([key], [memoryview(out)]) == [True] and bytes(out) == payload
    assert stat.S_ISREG(os.lstat(path).st_mode)


@READ_PATHS
@pytest.mark.parametrize("kind", sorted(PLANTS))
def test_a_store_replaces_a_non_regular_file_instead_of_answering_already_present(
    tmp_path: Path, kind: str, native: bool
) -> None:
    backend, _namespace = _fresh(tmp_path, native=native)
    [key] = keys_for(1, f"plant-put-{kind}")
    path = _plant(backend, key, kind)
    payload = payload_for(key, 300)
    assert _within_deadline(lambda: backend.put_many([key], [payload])) == [True]
    assert backend.stats()["puts_existing"] == 0
    assert stat.S_ISREG(os.lstat(path).st_mode)
    out = bytearray(300)
    assert backend.get_many([key], [memoryview(out)]) == [True] and bytes(out) == payload


@READ_PATHS
def test_a_fifo_with_a_writer_attached_still_cannot_hang_a_load(tmp_path: Path,
                                                                native: bool) -> None:
    """Even with a writer holding the FIFO open (so a blocking read would wait for data
    forever), the load returns at once: the block file is opened O_NONBLOCK and its read
    refused (ESPIPE: no positioned read on a pipe)."""
    backend, _namespace = _fresh(tmp_path, native=native)
    [key] = keys_for(1, "fifo-writer")
    path = _plant(backend, key, "fifo")
    reader_fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    writer_fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(writer_fd, b"data a blocking read would take")
        result = _within_deadline(lambda: backend.get_many([key], [memoryview(bytearray(64))]))
        assert result == [False]
        _assert_read_path(backend, native)
    finally:
        os.close(writer_fd)
        os.close(reader_fd)
    assert not os.path.lexists(path)


@READ_PATHS
def test_a_symlink_to_a_valid_frame_is_not_served(tmp_path: Path, native: bool) -> None:
    """A link to a perfectly valid frame of this very key (say, in a directory the attacker
    controls) is still refused: blocks are only ever read from regular files in our tree."""
    backend, namespace = _fresh(tmp_path, native=native)
    [key] = keys_for(1, "valid-link")
    payload = payload_for(key, 256)
    target = tmp_path / "attacker-frame"
    target.write_bytes(bytes(codec.encode(namespace.digest, key, payload)))
    path = backend.path_for(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)
    assert backend.get_many([key], [memoryview(bytearray(256))]) == [False]
    _assert_read_path(backend, native)
    assert backend.exists([key]) == [False]
    assert target.exists(), "only the link is removed, never what it points to"
    assert not os.path.lexists(path)
