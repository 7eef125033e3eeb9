"""The local-disk backend: one framed file per block (layout in :mod:`.layout`).

Publishing. A block is written to ``.tmp-<pid>-<n>`` in its own directory (optionally fsync'd),
then published without ever overwriting: ``renameat2(RENAME_NOREPLACE)`` where the C library and
filesystem have it, else ``os.link`` + unlink, else (no hard links) a check then ``os.replace``,
where a racing writer of the same key may replace the file with its identical frame. Readers
never see a partial block; two racing writers of one key both answer True.

Sharing. Several processes may share one directory: ``exists`` / ``get_many`` / ``put_many``
consult the filesystem; the capacity index (:mod:`.capacity`) only drives ``max_bytes`` and LRU
eviction over the blocks this process knows. On open the directory is scanned and temp files of
dead processes are removed.

Hygiene. The root and namespace directory must be owned by this user (or root) and not
world-writable without the sticky bit, unless ``shared_dir`` (then use ``auth_key``); they are
created only at open and never re-created if deleted. Block files are opened ``O_NONBLOCK |
O_NOFOLLOW`` and only regular files are read: anything else at a block path is moved aside,
removed and counted corrupt. A buffered read lands in the caller's buffer (``preadv`` of header
and payload, one verification pass); ``o_direct`` reads go through a page-aligned per-thread
buffer.

State and owners (any caller thread): ``_capacity`` (its own lock); ``_direct_io``, written once
under ``_lock`` when O_DIRECT turns out unsupported, read without it (a stale read costs one more
EINVAL fallback); ``_scratch``, per thread.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import logging
import os
import stat
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtier import codec
from kvtier.backends import redact_url, split_url_options
from kvtier.backends.base import (
    COMMON_SETTINGS,
    CORRUPT_FETCH,
    FAILED_FETCH,
    MISSING_FETCH,
    Backend,
    Fetched,
    OpenMode,
    Outcome,
    StoredFrame,
    load_auth_key,
)
from kvtier.backends.file.capacity import CapacityIndex
from kvtier.backends.file.layout import (
    _ALIGN,
    _DIR_MODE,
    _FILE_MODE,
    _MAX_NAME_HEX,
    _MISSING_ERRNOS,
    _NO_LINK_ERRNOS,
    _NOT_REGULAR_ERRNOS,
    _O_CLOEXEC,
    _O_DIRECT,
    _READ_FLAGS,
    _SUFFIX,
    _TEMP_COUNTER,
    _TEMP_PREFIX,
    MANIFEST_NAME,
    _claimed_length,
    _key_location,
    _pid_alive,
    _round_up,
    _Scratch,
    _write_all,
)
from kvtier.keys import MAX_KEY_BYTES, BlockKey, Namespace, check_key
from kvtier.settings import ConfigError, Kind, Setting, SettingsTable

_log = logging.getLogger(__name__)

SETTINGS = SettingsTable("file backend", (
    Setting("max_bytes", Kind.SIZE, 0,
            help="bound on the bytes this process keeps under the directory, LRU eviction "
                 "(0 = unlimited)"),
    Setting("fsync", Kind.BOOL, False, help="fsync every block and its directory on store"),
    Setting("o_direct", Kind.BOOL, False,
            help="O_DIRECT reads and writes (bypass the page cache; falls back if refused)"),
    Setting("shared_dir", Kind.BOOL, False,
            help="accept a root or namespace directory owned by another user or world-writable "
                 "without the sticky bit (use with auth_key)"),
    *COMMON_SETTINGS,
))
class DirectIO(enum.Enum):
    OFF = "off"  # not requested
    ACTIVE = "active"  # requested and working
    UNSUPPORTED = "unsupported"  # requested, the filesystem refused it: buffered I/O instead


class _LinkMode(enum.Enum):
    """How a temp file is published without overwriting, best first."""

    RENAME_NOREPLACE = "rename_noreplace"  # renameat2(RENAME_NOREPLACE): one atomic syscall
    HARD_LINK = "hard_link"  # link + unlink: atomic, two syscalls
    CHECK_THEN_REPLACE = "check_then_replace"  # racy fallback for filesystems without links


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def _load_renameat2() -> Any:
    """glibc's ``renameat2`` (2.28+), or None where the C library lacks it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                         ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_renameat2 = _load_renameat2()


def _rename_noreplace(temp: str, final: str) -> None:
    """Atomically rename ``temp`` to ``final``; FileExistsError if ``final`` exists."""
    if _renameat2(_AT_FDCWD, os.fsencode(temp), _AT_FDCWD, os.fsencode(final),
                  _RENAME_NOREPLACE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), final)


class FileBackend(Backend):
    """A thread-safe block store on a local directory (see module docstring)."""

    EXTRA_COUNTERS = ("evictions", "stray_temp_files_removed", "o_direct_fallbacks",
                      "put_rejected")

    def __init__(
        self,
        root: str | os.PathLike[str],
        namespace: Namespace,
        *,
        max_bytes: int | str = 0,
        fsync: bool | str = False,
        o_direct: bool | str = False,
        shared_dir: bool | str = False,
        auth_key: bytes | None = None,
        mode: OpenMode = OpenMode.READ_WRITE,
    ) -> None:
        root_path = Path(root)
        if not root_path.is_absolute():
            raise ValueError(f"file backend root must be an absolute path, got {str(root)!r}")
        if root_path == Path(root_path.anchor):
            raise ValueError(f"file backend root {str(root)!r} is the file system's root; expected "
                             "a directory of its own, e.g. file:///var/cache/kvtier")
        digest_hex = namespace.digest_hex if isinstance(namespace, Namespace) else ""
        self._dir = root_path / digest_hex
        self._dir_str = str(self._dir)
        self._root = root_path
        super().__init__(namespace, name=f"file backend at {self._dir_str}", logger=_log,
                         auth_key=auth_key)
        self._max_bytes: int = SETTINGS["max_bytes"].parse(max_bytes)
        self._fsync: bool = SETTINGS["fsync"].parse(fsync)
        wants_direct: bool = SETTINGS["o_direct"].parse(o_direct)
        self._shared_dir: bool = SETTINGS["shared_dir"].parse(shared_dir)
        if wants_direct and not _O_DIRECT:
            _log.warning("file backend: O_DIRECT is not available on this OS; using buffered I/O")
        self._direct_io = DirectIO.ACTIVE if wants_direct and _O_DIRECT else DirectIO.OFF
        self._link_mode = (
            _LinkMode.HARD_LINK if _renameat2 is None else _LinkMode.RENAME_NOREPLACE
        )
        self._lock = threading.Lock()  # guards _direct_io's one transition
        self._capacity = CapacityIndex(self._max_bytes)
        # Process-wide: two instances on one directory must never pick the same temp name.
        self._temp_counter = _TEMP_COUNTER
        self._pid = os.getpid()
        self._uid = os.geteuid()
        self._scratch = _Scratch()
        self._read_only = mode is OpenMode.READ_ONLY
        try:
            for path, what in ((self._root, "root"), (self._dir, "namespace directory")):
                if not self._read_only:
                    self._make_root(path)
                elif not os.path.lexists(path):  # READ_ONLY creates nothing: a namespace never
                    break                        # written is empty (kind.py: a missing root)
                self._check_private(path, what)
            else:
                self._scan()  # READ_ONLY: no temp-file removal, no eviction
        except OSError as exc:
            raise ValueError(
                f"file backend root {str(root)!r} cannot be used: {exc.strerror or exc}"
            ) from exc

    # ------------------------------------------------------------------ identity

    @property
    def url(self) -> str:
        return "file://" + urllib.parse.quote(str(self._root))

    @property
    def root(self) -> Path:
        return self._root

    @property
    def direct_io(self) -> DirectIO:
        return self._direct_io

    def path_for(self, key: BlockKey) -> Path:
        """The file that holds ``key``'s block (whether or not it exists)."""
        parts, name = _key_location(check_key(key).hex())
        return self._dir.joinpath(*parts, name)

    def _m_extra_stats(self) -> dict[str, int]:
        gauges = self._capacity.gauges()
        gauges["o_direct_active"] = int(self._direct_io is DirectIO.ACTIVE)
        return gauges

    def _m_write_manifest(self, document: bytes) -> None:
        """Write ``<root>/<digest>/namespace.json`` unless it is there (atomic: temp + rename)."""
        final = os.path.join(self._dir_str, MANIFEST_NAME)
        if os.path.lexists(final):
            return
        temp = os.path.join(self._dir_str, f"{_TEMP_PREFIX}{self._pid}-{next(_TEMP_COUNTER)}")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, _FILE_MODE)
        try:
            _write_all(fd, [document])
        finally:
            os.close(fd)
        os.replace(temp, final)  # identical content if another writer won: harmless

    # ------------------------------------------------------------------ directory hygiene

    def _check_private(self, path: Path, what: str) -> None:
        """Refuse a directory others could plant blocks in, unless ``shared_dir`` is set."""
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) and what != "root":
            raise ConfigError(f"file backend {what} {str(path)!r} is not a directory")
        if what == "root":
            info = os.stat(path)  # the root itself may be a symlink to the real directory
            if not stat.S_ISDIR(info.st_mode):
                raise ConfigError(f"file backend root {str(path)!r} is not a directory")
        if self._shared_dir:
            return
        mode = stat.S_IMODE(info.st_mode)
        if info.st_uid not in (self._uid, 0):
            raise ConfigError(
                f"file backend {what} {str(path)!r} is owned by uid {info.st_uid}, not by this "
                f"user (uid {self._uid}); another user could plant blocks there. Use a directory "
                "of your own, or set shared_dir=true (with auth_key) if it is shared on purpose"
            )
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            raise ConfigError(
                f"file backend {what} {str(path)!r} is world-writable (mode {mode:o}) without "
                "the sticky bit; anyone could plant or swap blocks there. chmod o-w it, or set "
                "shared_dir=true (with auth_key) if it is shared on purpose"
            )

    def _make_root(self, path: Path) -> None:
        """Create the root or namespace directory at open (0700); never called later."""
        try:
            os.makedirs(path, _DIR_MODE)
        except FileExistsError:
            return
        os.chmod(path, _DIR_MODE)  # the umask may have removed bits we need

    def _make_dirs(self, directory: str) -> None:
        """Create the missing fan-out directories of ``directory`` below the namespace directory.

        The namespace directory itself is never re-created: if it was deleted under a running
        backend, this raises FileNotFoundError and the write fails (counted), as it should.
        """
        if directory == self._dir_str:
            raise FileNotFoundError(errno.ENOENT, "the tier's namespace directory is gone",
                                    directory)
        if not directory.startswith(self._dir_str + os.sep):
            raise FileNotFoundError(errno.ENOENT, "outside the namespace directory", directory)
        try:
            os.mkdir(directory, _DIR_MODE)
        except FileExistsError:
            return
        except FileNotFoundError:
            self._make_dirs(os.path.dirname(directory))
            try:
                os.mkdir(directory, _DIR_MODE)
            except FileExistsError:
                return
        os.chmod(directory, _DIR_MODE)

    # ------------------------------------------------------------------ existence

    def _m_exists(self, keys: list[BlockKey]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for key in keys:
            try:
                info = os.lstat(self._path_str(key))
            except OSError as exc:
                outcomes.append(Outcome.MISSING if exc.errno in _MISSING_ERRNOS
                                else self._fail("exists", key, exc))
            else:
                # A FIFO, symlink or directory is not a block (a read removes it).
                outcomes.append(Outcome.OK if stat.S_ISREG(info.st_mode) else Outcome.MISSING)
        return outcomes

    # ------------------------------------------------------------------ writes

    def _m_store(self, frames: list[StoredFrame]) -> list[Outcome]:
        return [self._put_one(frame) for frame in frames]

    def _put_one(self, frame: StoredFrame) -> Outcome:
        key, header, view = frame.key, frame.header, frame.payload
        direct = self._direct_io is DirectIO.ACTIVE
        file_size = _round_up(frame.nbytes) if direct else frame.nbytes
        final = self._path_str(key)
        directory = os.path.dirname(final)
        try:
            info = os.lstat(final)
        except OSError:
            pass  # absent (or unreadable: the write below reports the real error)
        else:
            if stat.S_ISREG(info.st_mode):
                self._evict_files(self._capacity.adopt(key, info.st_size))  # its size on disk
                return Outcome.PRESENT
            # Not a block: set it aside so the key can be stored.
            self._stats.add("corrupt_objects")
            self._drop_bad(key, final, None, "not a regular file")
        reserved = file_size
        fits, victims = self._capacity.reserve(reserved)
        self._evict_files(victims)
        if not fits:
            self._stats.add("put_rejected")
            return Outcome.FAILED
        temp = f"{directory}/{_TEMP_PREFIX}{self._pid}-{next(self._temp_counter)}"
        try:
            try:
                written = self._write_temp(temp, header, view, direct)
            except FileNotFoundError:
                self._make_dirs(directory)
                written = self._write_temp(temp, header, view, direct)
            published = self._publish(temp, final, directory)
        except OSError as exc:
            self._capacity.release(reserved, key=None)
            if os.path.lexists(temp):
                self._unlink_quietly(temp, key)
            return self._fail("put", key, exc)
        self._capacity.release(reserved, key=key, stored=written)
        return Outcome.OK if published else Outcome.PRESENT

    def _write_temp(self, temp: str, header: bytes, view: memoryview, direct: bool) -> int:
        """Write the frame to ``temp``; returns the file size. Raises OSError."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC
        if direct:
            try:
                fd = os.open(temp, flags | _O_DIRECT, _FILE_MODE)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._disable_direct_io(exc)
                return self._write_temp(temp, header, view, direct=False)
        else:
            fd = os.open(temp, flags, _FILE_MODE)
        try:
            if direct:
                frame_len = len(header) + view.nbytes
                size = _round_up(frame_len)
                buffer = self._scratch.get(size)
                buffer[: len(header)] = header
                buffer[len(header) : frame_len] = view
                buffer[frame_len:size] = bytes(size - frame_len)
                try:
                    _write_all(fd, [buffer[:size]])
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    # Some filesystems accept O_DIRECT at open and refuse it at write.
                    os.close(fd)
                    fd = -1
                    os.unlink(temp)
                    self._disable_direct_io(exc)
                    return self._write_temp(temp, header, view, direct=False)
            else:
                size = len(header) + view.nbytes
                _write_all(fd, [header, view])
            if self._fsync:
                os.fsync(fd)
        finally:
            if fd >= 0:
                os.close(fd)
        return size

    def _publish(self, temp: str, final: str, directory: str) -> bool:
        """Make ``temp`` visible as ``final`` unless it exists; True if ours was published."""
        published = True
        if self._link_mode is _LinkMode.RENAME_NOREPLACE:
            try:
                _rename_noreplace(temp, final)
            except FileExistsError:
                published = False
                os.unlink(temp)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                _log.info("file backend: no RENAME_NOREPLACE on %s (%s); using hard links",
                          directory, exc)
                self._link_mode = _LinkMode.HARD_LINK
                return self._publish(temp, final, directory)
        elif self._link_mode is _LinkMode.HARD_LINK:
            try:
                os.link(temp, final)
            except FileExistsError:
                published = False
            except OSError as exc:
                if exc.errno not in _NO_LINK_ERRNOS:
                    raise
                _log.info("file backend: no hard links on %s (%s); using replace", directory, exc)
                self._link_mode = _LinkMode.CHECK_THEN_REPLACE
                return self._publish(temp, final, directory)
            os.unlink(temp)
        elif os.path.lexists(final):
            published = False
            os.unlink(temp)
        else:
            os.replace(temp, final)
        if self._fsync and published:
            dir_fd = os.open(directory, os.O_RDONLY | _O_CLOEXEC)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        return published

    # ------------------------------------------------------------------ reads

    def _m_fetch(self, keys: list[BlockKey], outs: list[memoryview]) -> Iterator[Fetched]:
        for key, out in zip(keys, outs, strict=True):
            yield self._fetch_one(key, out)

    def _fetch_one(self, key: BlockKey, out: memoryview) -> Fetched:
        path = self._path_str(key)
        direct = self._direct_io is DirectIO.ACTIVE
        try:
            fd = os.open(path, _READ_FLAGS | (_O_DIRECT if direct else 0))
        except OSError as exc:
            if exc.errno in _MISSING_ERRNOS:
                return MISSING_FETCH
            if exc.errno in _NOT_REGULAR_ERRNOS:
                return CORRUPT_FETCH  # a symlink or socket at the block path
            if direct and exc.errno == errno.EINVAL:
                self._disable_direct_io(exc)
                return self._fetch_one(key, out)
            self._fail("get", key, exc)
            return FAILED_FETCH
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):  # a FIFO, directory or device: never read
                return Fetched(Outcome.CORRUPT, token=info.st_ino)
            if direct:
                fetched = self._read_direct(fd, info, out)
            else:
                fetched = self._read_in_place(fd, info, out)
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                self._disable_direct_io(exc)
                os.close(fd)
                fd = -1
                return self._fetch_one(key, out)
            self._fail("get", key, exc)
            return FAILED_FETCH
        finally:
            if fd >= 0:
                os.close(fd)
        if self._capacity.bounded and fetched.outcome is Outcome.OK:
            self._evict_files(self._capacity.adopt(key, info.st_size))
        return fetched

    def _read_in_place(self, fd: int, info: os.stat_result, out: memoryview) -> Fetched:
        """Header into a small buffer, payload straight into ``out``: no scratch, no copy."""
        expected = codec.HEADER_BYTES + out.nbytes
        size = info.st_size
        if size != expected and size != _round_up(expected):
            return self._read_whole(fd, info)
        header = bytearray(codec.HEADER_BYTES)
        if os.preadv(fd, [header, out], 0) != expected:  # the file shrank under us
            return self._read_whole(fd, os.fstat(fd))
        if size != expected and _claimed_length(header) != out.nbytes:
            return self._read_whole(fd, info)  # a padded frame of another size, same pages
        return Fetched(Outcome.OK, header=header, payload_bytes=out.nbytes, token=info.st_ino)

    def _read_direct(self, fd: int, info: os.stat_result, out: memoryview) -> Fetched:
        """O_DIRECT: the whole padded frame into the page-aligned per-thread buffer."""
        expected = codec.HEADER_BYTES + out.nbytes
        padded = _round_up(expected)
        if info.st_size not in (expected, padded):
            return self._read_whole(fd, info)
        buffer = self._scratch.get(padded)
        size = os.preadv(fd, [buffer[:padded]], 0)
        if size < expected or _claimed_length(buffer[: codec.HEADER_BYTES]) != out.nbytes:
            return self._read_whole(fd, os.fstat(fd))
        return Fetched(Outcome.OK, frame=buffer[:expected], token=info.st_ino)

    def _read_whole(self, fd: int, info: os.stat_result) -> Fetched:
        """The rare path: a file whose size is not the caller's frame size.

        It may be a valid block of another size (the caller's mistake: kept) or a damaged one.
        The header's length field alone cannot be trusted, so a file whose size matches its
        header is read whole and verified by the template; any other size is corrupt.
        """
        head = self._scratch.get(_ALIGN)[: _ALIGN]
        count = os.preadv(fd, [head], 0)
        try:
            length = codec.payload_length(head[:count])
        except codec.FrameError:
            return Fetched(Outcome.CORRUPT, token=info.st_ino)
        frame_len = codec.HEADER_BYTES + length
        if info.st_size not in (frame_len, _round_up(frame_len)):
            return Fetched(Outcome.CORRUPT, token=info.st_ino)
        buffer = self._scratch.get(_round_up(max(frame_len, 1)))
        if os.preadv(fd, [buffer[: _round_up(max(frame_len, 1))]], 0) < frame_len:
            return Fetched(Outcome.CORRUPT, token=info.st_ino)
        return Fetched(Outcome.OK, frame=buffer[:frame_len], token=info.st_ino)

    def _m_remove_bad(self, bad: list[tuple[BlockKey, Fetched]]) -> None:
        for key, item in bad:
            token = item.token if isinstance(item.token, int) else None
            self._drop_bad(key, self._path_str(key), token, "corrupt or unauthenticated")

    def _drop_bad(self, key: BlockKey, path: str, inode: int | None, why: str) -> None:
        """Remove the bad object we saw at ``path`` (inode ``inode``; None: any non-regular file).

        Between our read and now, another reader may have removed it and a writer published the
        good block under the same name. "stat, then unlink if same inode" would still delete that
        block if it lands between the two calls; instead the name is first renamed aside
        (atomic), then what was moved is checked, and put back if it is a block we did not read.
        """
        directory = os.path.dirname(path)
        aside = os.path.join(directory, f"{_TEMP_PREFIX}{self._pid}-{next(self._temp_counter)}")
        try:
            os.rename(path, aside)
        except OSError as error:
            if error.errno not in _MISSING_ERRNOS:  # else someone else already removed it
                self._fail("remove bad block", key, error)
                return
        else:
            try:
                moved = os.lstat(aside)
                ours = moved.st_ino == inode if inode is not None else not stat.S_ISREG(
                    moved.st_mode)
                if not ours:  # a good block published meanwhile: give it its name back
                    self._publish(aside, path, directory)
                    return
                if stat.S_ISDIR(moved.st_mode):
                    os.rmdir(aside)  # a non-empty planted directory stays aside, out of the way
                else:
                    os.unlink(aside)
            except OSError as error:
                self._fail("remove bad block", key, error)
        self._error_log.warning("file backend: removed %s block %s", why, path)
        self._capacity.forget((key,))

    def _m_delete(self, keys: list[BlockKey]) -> None:
        self._capacity.forget(keys)
        for key in keys:
            self._unlink_quietly(self._path_str(key), key)

    # ------------------------------------------------------------------ capacity index

    def _scan(self) -> None:
        """Rebuild the index from the directory; remove temp files of dead processes."""
        found: list[tuple[int, BlockKey, int]] = []
        removed = 0
        for directory, _subdirs, files in os.walk(self._dir_str):
            relative = os.path.relpath(directory, self._dir_str)
            parts = () if relative == "." else tuple(relative.split(os.sep))
            for name in files:
                path = os.path.join(directory, name)
                if name.startswith(_TEMP_PREFIX):
                    if not self._read_only and self._is_stray_temp(name):
                        self._unlink_quietly(path, None)
                        removed += 1
                    continue
                key = self._key_from_location(parts, name)
                if key is None:
                    continue
                try:
                    info = os.lstat(path)
                except OSError:
                    continue
                if stat.S_ISREG(info.st_mode):
                    found.append((info.st_mtime_ns, key, info.st_size))
        found.sort(key=lambda entry: entry[0])
        victims = self._capacity.load((key, size) for _mtime, key, size in found)
        if removed:
            self._stats.add("stray_temp_files_removed", removed)
            _log.info("file backend: removed %d stray temp files under %s", removed, self._dir)
        if not self._read_only:
            self._evict_files(victims)

    def _evict_files(self, victims: list[BlockKey]) -> None:
        for victim in victims:
            self._unlink_quietly(self._path_str(victim), victim)
        if victims:
            self._stats.add("evictions", len(victims))

    def _is_stray_temp(self, name: str) -> bool:
        pid_text = name[len(_TEMP_PREFIX) :].partition("-")[0]
        if not pid_text.isdigit():
            return True
        pid = int(pid_text)
        # Our own pid: a sibling instance in this process may be writing it right now.
        return pid != self._pid and not _pid_alive(pid)

    @staticmethod
    def _key_from_location(parts: tuple[str, ...], name: str) -> BlockKey | None:
        if not name.endswith(_SUFFIX) or len(parts) < 2:
            return None
        key_hex = "".join(parts[2:]) + name[: -len(_SUFFIX)]
        try:
            key = bytes.fromhex(key_hex)
        except ValueError:
            return None
        if not 1 <= len(key) <= MAX_KEY_BYTES or key.hex() != key_hex:
            return None
        if _key_location(key_hex) != (parts, name):
            return None
        return key

    # ------------------------------------------------------------------ helpers

    def _path_str(self, key: BlockKey) -> str:
        key_hex = key.hex()
        if 4 <= len(key_hex) <= _MAX_NAME_HEX:  # the common case, without tuple building
            return f"{self._dir_str}/{key_hex[0:2]}/{key_hex[2:4]}/{key_hex}{_SUFFIX}"
        parts, name = _key_location(key_hex)
        return os.path.join(self._dir_str, *parts, name)

    def _disable_direct_io(self, exc: OSError) -> None:
        with self._lock:
            if self._direct_io is not DirectIO.ACTIVE:
                return
            self._direct_io = DirectIO.UNSUPPORTED
        self._stats.add("o_direct_fallbacks")
        _log.warning(
            "file backend: O_DIRECT refused on %s (%s); falling back to buffered I/O",
            self._dir,
            exc,
        )

    def _unlink_quietly(self, path: str, key: BlockKey | None) -> None:
        try:
            os.unlink(path)
        except OSError as exc:
            if exc.errno not in _MISSING_ERRNOS:
                self._fail("unlink", key if key is not None else path, exc)


def from_url(url: str, namespace: Namespace, options: dict[str, Any],
             mode: OpenMode = OpenMode.READ_WRITE) -> FileBackend:
    """Build a :class:`FileBackend` from ``file:///abs/path``.

    Options (keyword or query string): see :data:`SETTINGS` (``max_bytes``, ``fsync``,
    ``o_direct``, ``shared_dir``, ``auth_key``, ``auth_key_file``).
    """
    parts, merged = split_url_options(url, options)
    shown = redact_url(url)
    if parts.scheme != "file":
        raise ValueError(f"file backend URL must start with file://, got {shown!r}")
    if parts.netloc:
        raise ValueError(
            f"file backend URL {shown!r} has a host part; expected file:///absolute/path "
            "(three slashes)"
        )
    path = urllib.parse.unquote(parts.path)
    if not path.startswith("/"):
        raise ValueError(
            f"file backend URL {shown!r} needs an absolute path; expected file:///absolute/path"
        )
    if parts.fragment:
        raise ValueError(f"file backend URL {shown!r} has a fragment; expected none")
    if "\x00" in path:
        raise ValueError(f"file backend URL {shown!r} contains a NUL byte in its path")
    parsed = SETTINGS.parse(merged, "file")
    return FileBackend(
        path,
        namespace,
        max_bytes=parsed["max_bytes"],
        fsync=parsed["fsync"],
        o_direct=parsed["o_direct"],
        shared_dir=parsed["shared_dir"],
        auth_key=load_auth_key(parsed, "file"),
        mode=mode,
    )

