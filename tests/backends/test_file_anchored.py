"""The file tier anchored at directory descriptors: symlink swaps, renamed and replaced
namespace directories, StrictModes checks of the root's path, the one-level layout and blocks of
the old two-level one.

The tests run as root, so "another user" is uid 65534 (nobody): its directories are made with
``os.chown``, and the neighbour that re-points a symlink is a real second process running as
that uid (``subprocess.run(user=...)``) in a world-readable scratch directory under /tmp (the
pytest tmp_path is private to root).
"""

from __future__ import annotations

import gc
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvtier
from backends.test_contract import keys_for, payload_for, sentinel_buffer
from kvtier import codec
from kvtier.backends import OpenMode, open_backend
from kvtier.backends.file import FileBackend
from kvtier.keys import Namespace
from kvtier.settings import ConfigError

NOBODY = 65534
AUTH_KEY = "anchored-auth-key-0123456789abcdef"
# The neighbour runs the system interpreter: the venv's lives under /root (mode 0700).
NEIGHBOUR_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


def _namespace() -> Namespace:
    return Namespace(model=f"anchored-{os.urandom(4).hex()}")


def _files(root: Path) -> list[Path]:
    return sorted(path for path in root.rglob("*") if path.is_file() and not path.is_symlink())


@pytest.fixture
def world_dir() -> Iterator[Path]:
    """A scratch directory under /tmp that uid nobody can traverse (0755, owned by root)."""
    base = Path(tempfile.mkdtemp(prefix="kvtier-anchored-", dir="/tmp"))
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _as_nobody(script: str, *args: str) -> None:
    """Run ``script`` in a second process as uid/gid nobody; fail the test if it fails."""
    result = subprocess.run([NEIGHBOUR_PYTHON, "-c", textwrap.dedent(script), *args],
                            user=NOBODY, group=NOBODY, extra_groups=[], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------- symlink swap


def test_a_root_symlink_re_pointed_after_open_redirects_no_byte(world_dir: Path) -> None:
    """A neighbour plants ``shared/kvcache -> <the victim's directory>`` in a sticky directory;
    the victim opens the tier through the link; the neighbour re-points it to a tree of its own
    holding a valid frame (correct checksum, no key) for one of the victim's keys. The victim is
    never served that frame, and its stores never land in the neighbour's tree."""
    shared, victim = world_dir / "shared", world_dir / "victim"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    victim.mkdir(mode=0o700)
    link = shared / "kvcache"
    _as_nobody("import os, sys; os.symlink(sys.argv[1], sys.argv[2])", str(victim), str(link))
    assert os.lstat(link).st_uid == NOBODY

    namespace = _namespace()
    backend = open_backend(f"file://{link}", namespace)
    own, planted, later = keys_for(3, "swap")
    assert backend.put_many([own], [payload_for(own, 64)]) == [True]
    relative = backend.path_for(planted).relative_to(backend.root)
    evil_frame = bytes(codec.encode(namespace.digest, planted, b"EVILEVIL"))
    _as_nobody("""
        import os, sys
        shared, relative, frame = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
        path = os.path.join(shared, "evil", relative)
        os.makedirs(os.path.dirname(path), mode=0o755)
        with open(path, "wb") as out:
            out.write(frame)
        os.symlink(os.path.join(shared, "evil"), os.path.join(shared, "kvcache.new"))
        os.rename(os.path.join(shared, "kvcache.new"), os.path.join(shared, "kvcache"))
        """, str(shared), str(relative), evil_frame.hex())
    assert os.readlink(link) == str(shared / "evil")

    out = sentinel_buffer(8)
    assert backend.get_many([planted], [memoryview(out)]) == [False]
    assert backend.exists([planted]) == [False]
    own_out = sentinel_buffer(64)
    assert backend.get_many([own], [memoryview(own_out)]) == [True]
    assert bytes(own_out) == payload_for(own, 64)
    assert backend.put_many([later], [payload_for(later, 64)]) == [True]
    evil_files = [path.name for path in _files(shared / "evil")]
    assert evil_files == [f"{planted.hex()}.kvb"], "a store landed in the neighbour's tree"
    assert any(path.name == f"{later.hex()}.kvb" for path in _files(victim))
    backend.close()

    with pytest.raises(ConfigError, match=f"owned by uid {NOBODY}"):
        open_backend(f"file://{link}", namespace)  # reopened now, the link leads to theirs


# --------------------------------------------------------------------------- shared roots


def test_a_group_writable_root_needs_shared_dir_and_then_auth_key(tmp_path: Path) -> None:
    root = tmp_path / "team"
    root.mkdir()
    os.chmod(root, 0o770)
    url = f"file://{root}"
    with pytest.raises(ConfigError, match=r"group-writable \(mode 770\) without the sticky "
                                          r"bit.*shared_dir=true with auth_key"):
        open_backend(url, _namespace())
    with pytest.raises(ConfigError, match="shared_dir=true requires auth_key"):
        open_backend(f"{url}?shared_dir=true", _namespace())
    backend = open_backend(f"{url}?shared_dir=true", _namespace(), auth_key=AUTH_KEY)
    [key] = keys_for(1, "team")
    assert backend.put_many([key], [b"t" * 100]) == [True]
    out = sentinel_buffer(100)
    assert backend.get_many([key], [memoryview(out)]) == [True] and bytes(out) == b"t" * 100
    backend.close()


def test_a_group_writable_or_sticky_namespace_directory_is_refused(tmp_path: Path) -> None:
    """Sticky protects a root's entries, not a namespace directory: anyone could still create
    the fan-out directories blocks are written to."""
    for mode in (0o770, 0o1777):
        namespace = _namespace()
        planted = tmp_path / namespace.digest_hex
        planted.mkdir()
        os.chmod(planted, mode)
        with pytest.raises(ConfigError, match=f"namespace directory .*writable \\(mode {mode:o}"):
            open_backend(f"file://{tmp_path}", namespace)


# --------------------------------------------------------------------------- StrictModes


@pytest.mark.parametrize(("mode", "owner", "problem"), [
    (0o777, 0, r"world-writable \(mode 777\) without the sticky bit"),
    (0o775, 0, r"group-writable \(mode 775\) without the sticky bit"),
    (0o755, NOBODY, f"owned by uid {NOBODY}"),
], ids=["world-writable", "group-writable", "foreign-owner"])
def test_a_parent_others_can_rename_the_root_in_is_refused(
    tmp_path: Path, mode: int, owner: int, problem: str
) -> None:
    parent = tmp_path / "parent"
    parent.mkdir()
    os.chmod(parent, mode)
    os.chown(parent, owner, owner)
    with pytest.raises(ConfigError, match=f"the directory '{parent}' on its path is {problem}"):
        FileBackend(parent / "tier", _namespace())
    assert not (parent / "tier").exists(), "nothing is created below a refused directory"


def test_a_sticky_parent_owned_by_root_is_accepted(tmp_path: Path) -> None:
    parent = tmp_path / "like-tmp"
    parent.mkdir()
    os.chmod(parent, 0o1777)
    backend = FileBackend(parent / "tier", _namespace())
    assert backend.put_many(keys_for(1, "sticky"), [b"s"]) == [True]
    backend.close()


# --------------------------------------------------------------------------- namespace swaps


def _plant_frame(directory: Path, backend: FileBackend, key: bytes, payload: bytes) -> None:
    """A valid frame (right checksum, no key) of ``key`` where ``backend`` would look for it
    if ``directory`` were its namespace directory."""
    namespace = backend.namespace
    path = directory / backend.path_for(key).relative_to(backend.root / namespace.digest_hex)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(codec.encode(namespace.digest, key, payload)))


def test_a_namespace_directory_renamed_aside_and_replaced_is_never_served(
    tmp_path: Path,
) -> None:
    namespace = _namespace()
    backend = FileBackend(tmp_path / "tier", namespace)
    own, planted, later = keys_for(3, "ns-swap")
    assert backend.put_many([own], [payload_for(own, 64)]) == [True]
    directory = tmp_path / "tier" / namespace.digest_hex
    aside = tmp_path / "tier" / "aside"
    directory.rename(aside)
    directory.mkdir(mode=0o755)
    _plant_frame(directory, backend, planted, b"EVILEVIL")
    _plant_frame(directory, backend, own, b"EVIL" * 16)
    for path in (directory, *directory.rglob("*")):
        os.chown(path, NOBODY, NOBODY)

    assert backend.get_many([planted, own], [memoryview(sentinel_buffer(8)),
                                             memoryview(sentinel_buffer(64))]) == [False, False]
    assert backend.exists([planted, own]) == [False, False]
    assert backend.put_many([later], [payload_for(later, 64)]) == [False]
    stats = backend.stats()
    assert stats["namespace_dir_swaps"] == 1 and stats["hits"] == 0 and stats["errors"] >= 1
    planted_names = sorted(path.name for path in _files(directory))
    assert planted_names == sorted([f"{planted.hex()}.kvb", f"{own.hex()}.kvb"])
    assert not any(path.name == f"{later.hex()}.kvb" for path in _files(aside))
    backend.close()


def test_a_replacement_that_passes_the_checks_is_used_and_nothing_is_re_created(
    tmp_path: Path,
) -> None:
    """Renamed aside and replaced by a directory of our own: the tier moves to it (counted);
    the renamed one is never read again. Removed: reads miss, stores fail, nothing re-created."""
    namespace = _namespace()
    backend = FileBackend(tmp_path / "tier", namespace)
    first, second = keys_for(2, "ns-reopen")
    assert backend.put_many([first], [b"1" * 10]) == [True]
    directory = tmp_path / "tier" / namespace.digest_hex
    directory.rename(tmp_path / "tier" / "aside")
    directory.mkdir(mode=0o700)
    assert backend.exists([first]) == [False]  # it is in the directory renamed aside
    assert backend.put_many([second], [b"2" * 10]) == [True]
    assert (directory / second.hex()[:2] / f"{second.hex()}.kvb").is_file()
    assert backend.stats()["namespace_dir_swaps"] == 1
    shutil.rmtree(directory)
    assert backend.exists([second]) == [False]
    assert backend.put_many([first], [b"1" * 10]) == [False]
    assert not directory.exists()
    assert backend.stats()["namespace_dir_swaps"] == 2
    backend.close()


def test_a_held_namespace_directory_made_group_writable_is_refused_until_fixed(
    tmp_path: Path,
) -> None:
    namespace = _namespace()
    backend = FileBackend(tmp_path, namespace)
    first, second = keys_for(2, "chmod")
    assert backend.put_many([first], [b"x" * 10]) == [True]
    directory = tmp_path / namespace.digest_hex
    os.chmod(directory, 0o770)
    assert backend.put_many([second], [b"y" * 10]) == [False]
    assert backend.get_many([first], [memoryview(bytearray(10))]) == [False]
    assert backend.stats()["errors"] == 2
    os.chmod(directory, 0o700)
    assert backend.put_many([second], [b"y" * 10]) == [True]
    assert backend.get_many([first], [memoryview(bytearray(10))]) == [True]
    backend.close()


# --------------------------------------------------------------------------- layout


def test_one_fan_out_level_and_at_most_256_directories(tmp_path: Path) -> None:
    namespace = _namespace()
    backend = FileBackend(tmp_path, namespace)
    keys = keys_for(2000, "fan")
    assert backend.put_many(keys, [b"f"] * len(keys)) == [True] * len(keys)
    directory = tmp_path / namespace.digest_hex
    for key in keys[:5]:
        assert backend.path_for(key) == directory / key.hex()[:2] / f"{key.hex()}.kvb"
    subdirs = [path for path in directory.rglob("*") if path.is_dir()]
    assert len(subdirs) <= 256
    assert all(path.parent == directory for path in subdirs)
    backend.close()


def test_a_removed_fan_out_directory_is_re_created_by_the_next_store(tmp_path: Path) -> None:
    namespace = _namespace()
    backend = FileBackend(tmp_path, namespace)
    other = FileBackend(tmp_path, namespace)
    first, second, third = (bytes([0xAB]) + key[1:] for key in keys_for(3, "fan-gone"))
    assert backend.put_many([first], [b"1"]) == [True]  # its fan-out descriptor is cached now
    shutil.rmtree(tmp_path / namespace.digest_hex / "ab")
    assert backend.put_many([second], [b"2"]) == [True]
    assert other.put_many([third], [b"3"]) == [True]
    assert backend.exists([first, second, third]) == [False, True, True]
    backend.close()
    other.close()


def _old_path(directory: Path, key: bytes) -> Path:
    """Where the two-level layout kept a block (keys up to 124 bytes)."""
    key_hex = key.hex()
    return directory / key_hex[:2] / key_hex[2:4] / f"{key_hex}.kvb"


def _plant_old_layout(tmp_path: Path, namespace: Namespace) -> tuple[list[bytes], Path]:
    keys = keys_for(3, "old-layout")
    FileBackend(tmp_path, namespace).close()
    directory = tmp_path / namespace.digest_hex
    for key in keys:
        path = _old_path(directory, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(codec.encode(namespace.digest, key, payload_for(key, 100))))
    # A 200-byte key: the old layout split it over chunk directories below both fan-out levels.
    long_key = bytes(range(200))
    long_hex = long_key.hex()
    long_path = directory / long_hex[:2] / long_hex[2:4] / long_hex[:200] / f"{long_hex[200:]}.kvb"
    long_path.parent.mkdir(parents=True)
    long_path.write_bytes(bytes(codec.encode(namespace.digest, long_key,
                                             payload_for(long_key, 100))))
    (_old_path(directory, keys[0]).parent / ".tmp-999999999-1").write_bytes(b"partial")
    return [*keys, long_key], directory


def test_blocks_of_the_two_level_layout_are_moved_and_served_after_a_restart(
    tmp_path: Path,
) -> None:
    namespace = _namespace()
    keys, directory = _plant_old_layout(tmp_path, namespace)
    duplicate = keys[1]  # also present in the current layout: the old copy goes
    current = directory / duplicate.hex()[:2] / f"{duplicate.hex()}.kvb"
    current.write_bytes(_old_path(directory, duplicate).read_bytes())
    (item,) = kvtier.usage(f"file://{tmp_path}")
    assert item.blocks == 5  # four old-layout blocks and the duplicate

    backend = FileBackend(tmp_path, namespace, max_bytes=1 << 20)
    stats = backend.stats()
    assert (stats["old_layout_blocks_moved"], stats["blocks"]) == (3, 4)
    assert stats["stray_temp_files_removed"] == 1
    outs = [sentinel_buffer(100) for _ in keys]
    assert backend.get_many(keys, [memoryview(out) for out in outs]) == [True] * 4
    assert [bytes(out) for out in outs] == [payload_for(key, 100) for key in keys]
    assert all(backend.path_for(key).is_file() for key in keys)
    leftovers = [path for path in directory.rglob("*") if len(path.relative_to(directory).parts) > 1
                 and len(path.relative_to(directory).parts[1]) == 2]
    assert leftovers == [], "the two-level directories were not removed once empty"
    backend.close()


def test_usage_and_purge_count_and_remove_blocks_of_the_two_level_layout(tmp_path: Path) -> None:
    namespace = _namespace()
    keys, directory = _plant_old_layout(tmp_path, namespace)
    url = f"file://{tmp_path}"
    (item,) = kvtier.usage(url)
    assert (item.blocks, item.digest) == (len(keys), namespace.digest_hex)
    result = kvtier.purge(url, digest=namespace.digest_hex)
    assert result.objects_deleted == len(keys) + 1  # and the stray temp file
    assert not directory.exists()


# --------------------------------------------------------------------------- descriptors


def _fds_under(directory: Path) -> int:
    """Descriptors of this process open on ``directory`` or below (other tests' threads may
    open and close sockets meanwhile: only these are counted)."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed while we listed
        count += target == str(directory) or target.startswith(f"{directory}/")
    return count


def test_close_and_garbage_collection_release_every_descriptor(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path, _namespace())
    keys = keys_for(64, "fds")
    assert backend.put_many(keys, [b"d"] * 64) == [True] * 64
    assert backend.get_many(keys, [memoryview(bytearray(1)) for _ in keys]) == [True] * 64
    assert _fds_under(tmp_path) > 2  # root, namespace and cached fan-out directories
    backend.close()
    assert _fds_under(tmp_path) == 0
    forgotten = FileBackend(tmp_path, _namespace())
    assert forgotten.put_many(keys, [b"d"] * 64) == [True] * 64
    assert _fds_under(tmp_path) > 2
    del forgotten
    gc.collect()
    assert _fds_under(tmp_path) == 0


def test_symlinked_fan_out_directory_is_never_followed(tmp_path: Path) -> None:
    namespace = _namespace()
    backend = FileBackend(tmp_path / "tier", namespace)
    [key] = keys_for(1, "fan-link")
    elsewhere = tmp_path / "elsewhere"
    _plant_frame(elsewhere, backend, key, b"LINKED")
    fan = tmp_path / "tier" / namespace.digest_hex / key.hex()[:2]
    fan.symlink_to(elsewhere / key.hex()[:2])
    assert backend.exists([key]) == [False]
    assert backend.get_many([key], [memoryview(sentinel_buffer(6))]) == [False]
    assert backend.put_many([key], [b"mine"]) == [False]  # refused: counted, never followed
    assert stat.S_ISLNK(os.lstat(fan).st_mode)
    assert [path.name for path in _files(elsewhere)] == [f"{key.hex()}.kvb"]
    backend.close()


def test_a_read_only_open_moves_and_removes_nothing(tmp_path: Path) -> None:
    """``OpenMode.READ_ONLY`` (``kvtier inspect``) goes through the same anchored directories
    but never writes: old-layout blocks and stray temp files stay where they are."""
    namespace = _namespace()
    keys, directory = _plant_old_layout(tmp_path, namespace)
    before = sorted(str(path) for path in _files(directory))
    backend = open_backend(f"file://{tmp_path}", namespace, mode=OpenMode.READ_ONLY)
    assert backend.stats()["old_layout_blocks_moved"] == 0
    assert backend.exists(keys[:1]) == [False]  # read in the current layout only
    backend.close()
    assert sorted(str(path) for path in _files(directory)) == before
    missing = open_backend(f"file://{tmp_path}", _namespace(), mode=OpenMode.READ_ONLY)
    assert missing.exists(keys[:1]) == [False]
    missing.close()
    assert [path.name for path in tmp_path.iterdir()] == [namespace.digest_hex]
