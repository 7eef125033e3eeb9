"""Local-disk backend: one framed file per block under a fan-out directory.

Layout::

    <root>/<namespace digest hex>/<k0k1>/<k2k3>/<key hex>.kvb

where ``k0k1k2k3`` are the first four hex digits of the key. Keys longer than 124 bytes (whose
hex would not fit one file name) are split into nested directories of 200 hex digits each; the
layout stays a pure function of the key, and since every component is hex no key can name a
path outside the root.

Writes go to ``.tmp-<pid>-<n>`` in the block's own directory, optionally fsync'd, then are
published with ``os.link(temp, final)``, which fails if the block already exists: an existing
block is never overwritten, two racing writers of one key both answer True and exactly one
file wins, and a reader never sees a partial block. Where a filesystem has no hard links the
backend checks for the final name and then ``os.replace``s; a racing writer of the same key may
then replace the file with its own (identical-content) frame, which readers still see whole.

Several processes may share one directory (a vLLM scheduler and its workers, for example):
``exists``/``get_many``/``put_many`` consult the filesystem, not a private index. The index
below only drives the ``max_bytes`` capacity and LRU eviction, over the blocks this instance
knows (found by the scan on open, written or read by it); with several writers on one directory
the bound is per process.

State and owners (any caller thread):

- ``_index`` (key -> file size, least recently used first), ``_used_bytes``,
  ``_reserved_bytes``: guarded by ``_lock``.
- ``_direct_io`` (:class:`DirectIO`): written once under ``_lock`` when O_DIRECT turns out not
  to be supported; read without the lock (a stale read only costs one more EINVAL fallback).
- per-thread scratch buffers (``_scratch``): owned by the thread that created them.

On open the directory is scanned: every ``.kvb`` file is indexed (LRU order by mtime) and
temp files left by crashed processes (whose pid is gone) are removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import itertools
import logging
import mmap
import os
import stat
import threading
import urllib.parse
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier import codec
from kvtier.backends import split_url_options
from kvtier.backends.base import (
    BackendStats,
    Buffer,
    ExistenceChecks,
    Lifecycle,
    RateLimitedLog,
    check_get_args,
    check_keys,
    check_put_args,
    parse_bool_option,
    parse_size_option,
    reject_unknown_options,
)
from kvtier.keys import BlockKey, Namespace

_log = logging.getLogger(__name__)

_OPTIONS = ("max_bytes", "fsync", "o_direct")
_SUFFIX = ".kvb"
_TEMP_PREFIX = ".tmp-"
_ALIGN = 4096
_MAX_NAME_HEX = 248  # longest hex in one file name (NAME_MAX is 255 with the suffix)
_CHUNK_HEX = 200
_DIR_MODE = 0o700
_FILE_MODE = 0o600
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NO_LINK_ERRNOS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK}
_MISSING_ERRNOS = {errno.ENOENT, errno.ENOTDIR}
# Temp-file sequence numbers, shared by every instance in this process (next() is atomic).
_TEMP_COUNTER = itertools.count()


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


def _round_up(size: int) -> int:
    return (size + _ALIGN - 1) // _ALIGN * _ALIGN


def _key_location(key_hex: str) -> tuple[tuple[str, ...], str]:
    """(directory components below the namespace directory, file name) of a key."""
    fan = key_hex.ljust(4, "0")
    if len(key_hex) <= _MAX_NAME_HEX:
        return (fan[0:2], fan[2:4]), key_hex + _SUFFIX
    chunks = [key_hex[i : i + _CHUNK_HEX] for i in range(0, len(key_hex), _CHUNK_HEX)]
    return (fan[0:2], fan[2:4], *chunks[:-1]), chunks[-1] + _SUFFIX


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Scratch(threading.local):
    """One page-aligned buffer per thread (aligned for O_DIRECT), grown on demand."""

    def __init__(self) -> None:
        self.buffer: mmap.mmap | None = None
        self.view: memoryview | None = None

    def get(self, size: int) -> memoryview:
        view = self.view
        if view is None or view.nbytes < size:
            if view is not None:
                view.release()
            if self.buffer is not None:
                self.buffer.close()
            capacity = max(_ALIGN, 1 << (size - 1).bit_length())
            self.buffer = mmap.mmap(-1, capacity)
            self.view = view = memoryview(self.buffer)
        return view


class FileBackend(ExistenceChecks):
    """A thread-safe block store on a local directory (see module docstring)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        namespace: Namespace,
        *,
        max_bytes: int = 0,
        fsync: bool = False,
        o_direct: bool = False,
    ) -> None:
        if not isinstance(namespace, Namespace):
            raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
        root_path = Path(root)
        if not root_path.is_absolute():
            raise ValueError(f"file backend root must be an absolute path, got {str(root)!r}")
        self._namespace = namespace
        self._digest = namespace.digest
        self._root = root_path
        self._max_bytes = parse_size_option("max_bytes", max_bytes)
        self._fsync = parse_bool_option("fsync", fsync)
        wants_direct = parse_bool_option("o_direct", o_direct)
        if wants_direct and not _O_DIRECT:
            _log.warning("file backend: O_DIRECT is not available on this OS; using buffered I/O")
        self._direct_io = DirectIO.ACTIVE if wants_direct and _O_DIRECT else DirectIO.OFF
        self._link_mode = (
            _LinkMode.HARD_LINK if _renameat2 is None else _LinkMode.RENAME_NOREPLACE
        )
        self._dir = root_path / namespace.digest_hex
        self._dir_str = str(self._dir)
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockKey, int] = OrderedDict()
        self._used_bytes = 0
        self._reserved_bytes = 0
        # Process-wide: two instances on one directory must never pick the same temp name.
        self._temp_counter = _TEMP_COUNTER
        self._pid = os.getpid()
        self._scratch = _Scratch()
        self._stats = BackendStats(
            extra=("evictions", "stray_temp_files_removed", "o_direct_fallbacks", "put_rejected")
        )
        self._error_log = RateLimitedLog(_log)
        self._lifecycle = Lifecycle(f"file backend at {self._dir_str}")
        try:
            self._make_dirs(self._root)
            self._make_dirs(self._dir)
            self._scan()
        except OSError as exc:
            raise ValueError(
                f"file backend root {str(root)!r} cannot be used: {exc.strerror or exc}"
            ) from exc

    # ------------------------------------------------------------------ public API

    @property
    def namespace(self) -> Namespace:
        return self._namespace

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
        parts, name = _key_location(codec.check_key(key).hex())
        return self._dir.joinpath(*parts, name)

    def _exists(self, keys: Sequence[BlockKey]) -> tuple[list[bool], int]:
        key_list = check_keys(keys)
        self._lifecycle.check_open()
        results: list[bool] = []
        errors = 0
        for key in key_list:
            try:
                os.stat(self._path_str(key))
            except OSError as exc:
                if exc.errno not in _MISSING_ERRNOS:
                    errors += 1
                    self._report("exists", key, exc)
                results.append(False)
            else:
                results.append(True)
        self._stats.add_many({"exists_calls": 1, "errors": errors})
        return results, errors

    def put_many(self, keys: Sequence[BlockKey], payloads: Sequence[Buffer]) -> list[bool]:
        key_list, views = check_put_args(keys, payloads)
        self._lifecycle.check_open()
        results = [self._put_one(key, view) for key, view in zip(key_list, views, strict=True)]
        self._stats.add("puts", len(key_list))
        return results

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[memoryview]) -> list[bool]:
        key_list, views = check_get_args(keys, outs)
        self._lifecycle.check_open()
        get_one = self._get_one
        results = [get_one(key, out) for key, out in zip(key_list, views, strict=True)]
        hits = sum(results)
        read = sum(out.nbytes for out, hit in zip(views, results, strict=True) if hit)
        counts = {"gets": len(key_list), "hits": hits, "misses": len(key_list) - hits}
        self._stats.add_many({**counts, "bytes_read": read})
        return results

    def delete(self, keys: Sequence[BlockKey]) -> None:
        key_list = check_keys(keys)
        self._lifecycle.check_open()
        with self._lock:
            for key in key_list:
                size = self._index.pop(key, None)
                if size is not None:
                    self._used_bytes -= size
        for key in key_list:
            self._unlink_quietly(self._path_str(key), key)
        self._stats.add("deletes", len(key_list))

    def close(self) -> None:
        self._lifecycle.close()

    def stats(self) -> dict[str, int]:
        snapshot = self._stats.snapshot()
        with self._lock:
            snapshot["blocks"] = len(self._index)
            snapshot["used_bytes"] = self._used_bytes
            snapshot["max_bytes"] = self._max_bytes
        snapshot["o_direct_active"] = int(self._direct_io is DirectIO.ACTIVE)
        return snapshot

    # ------------------------------------------------------------------ writes

    def _put_one(self, key: BlockKey, view: memoryview) -> bool:
        frame_len = codec.HEADER_BYTES + view.nbytes
        direct = self._direct_io is DirectIO.ACTIVE
        file_size = _round_up(frame_len) if direct else frame_len
        final = self._path_str(key)
        directory = os.path.dirname(final)
        try:
            existing = os.lstat(final).st_size
        except OSError:
            pass  # absent (or unreadable: the write below reports the real error)
        else:
            self._adopt(key, existing)  # the size on disk, whoever wrote it
            return True
        reserved = file_size
        if not self._reserve(reserved):
            self._stats.add("put_rejected")
            return False
        header = codec.encode_header(self._digest, key, view)
        temp = f"{directory}/{_TEMP_PREFIX}{self._pid}-{next(self._temp_counter)}"
        published = False
        try:
            try:
                written = self._write_temp(temp, header, view, direct)
            except FileNotFoundError:
                self._make_dirs(directory)
                written = self._write_temp(temp, header, view, direct)
            published = self._publish(temp, final, directory)
        except OSError as exc:
            self._release(reserved, key=None)
            if os.path.lexists(temp):
                self._unlink_quietly(temp, key)
            self._stats.add("errors")
            self._report("put", key, exc)
            return False
        self._release(reserved, key=key, stored=written)
        if published:
            self._stats.add("bytes_written", view.nbytes)
        return True

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

    def _get_one(self, key: BlockKey, out: memoryview) -> bool:
        path = self._path_str(key)
        direct = self._direct_io is DirectIO.ACTIVE
        expected = codec.HEADER_BYTES + out.nbytes
        padded = _round_up(expected)
        # Room for one block more than the largest valid file: a file that fills it is too long.
        capacity = padded + _ALIGN
        try:
            fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | (_O_DIRECT if direct else 0))
        except OSError as exc:
            if exc.errno in _MISSING_ERRNOS:
                return False
            if direct and exc.errno == errno.EINVAL:
                self._disable_direct_io(exc)
                return self._get_one(key, out)
            self._stats.add("errors")
            self._report("get", key, exc)
            return False
        try:
            buffer = self._scratch.get(capacity)
            size = os.readv(fd, [buffer[:capacity]])
            if not direct and size not in (expected, padded) and 0 < size < capacity:
                # Local files only read short at end of file; confirm before judging the size.
                size += _read_all(fd, buffer[size:capacity])
            frame = buffer[: expected if size in (expected, padded) else size]
            try:
                codec.decode_checked(frame, self._digest, key, out)
            except codec.OutputSizeMismatch:
                return False  # wrong-size out: keep the object
            except codec.FrameError:
                if self._valid_with_other_size(fd, frame, key, out.nbytes):
                    return False  # wrong-size out: keep the valid object
                raise
        except codec.FrameError as exc:
            self._drop_corrupt(key, path, os.fstat(fd).st_ino, exc)
            return False
        except OSError as exc:
            self._stats.add("errors")
            self._report("get", key, exc)
            return False
        finally:
            os.close(fd)
        if self._max_bytes:
            self._adopt(key, size)
        return True

    def _valid_with_other_size(
        self, fd: int, head: memoryview, key: BlockKey, out_size: int
    ) -> bool:
        """Whether the open file is a whole, valid frame whose payload is not ``out_size`` bytes.

        Only on the (rare) frame-error path of a read: the header's length field alone cannot be
        trusted (a flipped bit there would make a corrupt file look like a wrong-size read
        forever), so the claimed frame is read and verified, checksum included.
        """
        if len(head) < codec.HEADER_BYTES:
            return False
        try:
            length = codec.payload_length(head)
        except codec.FrameError:
            return False
        frame_len = codec.HEADER_BYTES + length
        if length == out_size or os.fstat(fd).st_size not in (frame_len, _round_up(frame_len)):
            return False
        # Page-aligned and page-sized, so that an O_DIRECT descriptor can read into it too.
        with mmap.mmap(-1, _round_up(max(frame_len, 1))) as scratch:
            view = memoryview(scratch)
            try:
                if os.preadv(fd, [view], 0) < frame_len:
                    return False
                codec.verify_frame(view[:frame_len], self._digest, key)
            except codec.FrameError:
                return False
            finally:
                view.release()
        return True

    def _drop_corrupt(self, key: BlockKey, path: str, inode: int, exc: Exception) -> None:
        """Remove the corrupt file we read (inode ``inode``), and only that file.

        Between our read and now, another reader may have removed it and a writer published the
        good block under the same name. "stat, then unlink if same inode" would still delete that
        block if it lands between the two calls; instead the name is first renamed aside
        (atomic), then the file that was moved is checked, and put back if it is not ours.
        """
        self._stats.add("corrupt_objects")
        self._error_log.warning("file backend: dropping corrupt block %s: %s", path, exc)
        directory = os.path.dirname(path)
        aside = os.path.join(directory, f"{_TEMP_PREFIX}{self._pid}-{next(self._temp_counter)}")
        removed = False
        try:
            os.rename(path, aside)
        except OSError as error:
            removed = error.errno in _MISSING_ERRNOS  # someone else already removed it
        else:
            try:
                if os.lstat(aside).st_ino == inode:
                    os.unlink(aside)
                    removed = True
                else:  # a good block published meanwhile: give it its name back
                    self._publish(aside, path, directory)
            except OSError as error:
                self._stats.add("errors")
                self._report("drop corrupt", key, error)
        if removed:
            with self._lock:
                size = self._index.pop(key, None)
                if size is not None:
                    self._used_bytes -= size

    # ------------------------------------------------------------------ capacity index

    def _reserve(self, size: int) -> bool:
        """Reserve ``size`` bytes of capacity, evicting least recently used blocks."""
        if not self._max_bytes:
            return True
        if size > self._max_bytes:
            return False
        victims: list[BlockKey] = []
        with self._lock:
            while self._used_bytes + self._reserved_bytes + size > self._max_bytes:
                if not self._index:  # the rest is reserved by writes in flight
                    break
                victim, victim_size = self._index.popitem(last=False)
                self._used_bytes -= victim_size
                victims.append(victim)
            fits = self._used_bytes + self._reserved_bytes + size <= self._max_bytes
            if fits:
                self._reserved_bytes += size
        self._evict_files(victims)
        return fits

    def _release(self, reserved: int, *, key: BlockKey | None, stored: int = 0) -> None:
        """Return a reservation; with ``key``, record it as stored (``stored`` bytes, newest)."""
        with self._lock:
            if self._max_bytes:
                self._reserved_bytes -= reserved
            if key is not None:
                self._record(key, stored)

    def _record(self, key: BlockKey, size: int) -> None:
        """Mark ``key`` most recently used, indexing it if new. Call with ``_lock`` held."""
        if key in self._index:
            self._index.move_to_end(key)
        else:
            self._index[key] = size
            self._used_bytes += size

    def _adopt(self, key: BlockKey, size: int) -> None:
        """Index a block found on disk (another writer's, or ours) and enforce capacity."""
        with self._lock:
            self._record(key, size)
        if self._max_bytes and self._used_bytes > self._max_bytes:
            self._shrink_to_capacity()

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
                    if self._is_stray_temp(name):
                        self._unlink_quietly(path, None)
                        removed += 1
                    continue
                key = self._key_from_location(parts, name)
                if key is None:
                    continue
                try:
                    info = os.stat(path)
                except OSError:
                    continue
                if stat.S_ISREG(info.st_mode):
                    found.append((info.st_mtime_ns, key, info.st_size))
        found.sort(key=lambda entry: entry[0])
        with self._lock:
            for _mtime, key, size in found:
                self._index[key] = size
                self._used_bytes += size
        if removed:
            self._stats.add("stray_temp_files_removed", removed)
            _log.info("file backend: removed %d stray temp files under %s", removed, self._dir)
        if self._max_bytes and self._used_bytes > self._max_bytes:
            self._shrink_to_capacity()

    def _shrink_to_capacity(self) -> None:
        victims: list[BlockKey] = []
        with self._lock:
            while len(self._index) > 1 and self._used_bytes > self._max_bytes:
                victim, size = self._index.popitem(last=False)
                self._used_bytes -= size
                victims.append(victim)
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
        if not 1 <= len(key) <= codec.MAX_KEY_BYTES or key.hex() != key_hex:
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

    def _make_dirs(self, path: str | Path) -> None:
        """Create ``path`` and its missing parents with mode 0700 (existing ones untouched)."""
        directory = os.fspath(path)
        try:
            os.mkdir(directory, _DIR_MODE)
        except FileExistsError:
            return
        except FileNotFoundError:
            parent = os.path.dirname(directory)
            if parent == directory:
                raise
            self._make_dirs(parent)
            try:
                os.mkdir(directory, _DIR_MODE)
            except FileExistsError:
                return
        os.chmod(directory, _DIR_MODE)  # the umask may have removed bits we need

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
                self._stats.add("errors")
                self._report("unlink", key, exc)

    def _report(self, operation: str, key: BlockKey | None, exc: OSError) -> None:
        self._error_log.warning(
            "file backend %s: %s of block %s failed: %s",
            self._dir,
            operation,
            key.hex() if key is not None else "-",
            exc,
        )


def _write_all(fd: int, buffers: list[memoryview | bytes]) -> None:
    """``writev`` until every byte is written (regular files rarely write short, but may)."""
    remaining = [memoryview(buffer).cast("B") for buffer in buffers]
    while remaining:
        written = os.writev(fd, remaining)
        if written == 0:
            raise OSError(errno.EIO, "write returned 0 bytes")
        while remaining and written >= remaining[0].nbytes:
            written -= remaining[0].nbytes
            remaining.pop(0)
        if remaining and written:
            remaining[0] = remaining[0][written:]


def _read_all(fd: int, buffer: memoryview) -> int:
    """Read until ``buffer`` is full or end of file; returns the bytes read."""
    total = 0
    while total < buffer.nbytes:
        count = os.readv(fd, [buffer[total:]])
        if count == 0:
            break
        total += count
    return total


def from_url(url: str, namespace: Namespace, options: dict[str, Any]) -> FileBackend:
    """Build a :class:`FileBackend` from ``file:///abs/path``.

    Options (keyword or query string): ``max_bytes`` (0 = unlimited), ``fsync``, ``o_direct``.
    """
    parts, merged = split_url_options(url, options)
    if parts.scheme != "file":
        raise ValueError(f"file backend URL must start with file://, got {url!r}")
    if parts.netloc:
        raise ValueError(
            f"file backend URL {url!r} has a host part {parts.netloc!r}; expected "
            f"file:///absolute/path (three slashes)"
        )
    path = urllib.parse.unquote(parts.path)
    if not path.startswith("/"):
        raise ValueError(
            f"file backend URL {url!r} needs an absolute path; expected file:///absolute/path"
        )
    if parts.fragment:
        raise ValueError(f"file backend URL {url!r} has a fragment; expected none")
    if "\x00" in path:
        raise ValueError(f"file backend URL {url!r} contains a NUL byte in its path")
    reject_unknown_options("file", merged, _OPTIONS)
    return FileBackend(  # the constructor parses the options
        path,
        namespace,
        max_bytes=merged.get("max_bytes", 0),
        fsync=merged.get("fsync", False),
        o_direct=merged.get("o_direct", False),
    )


# ------------------------------------------------------------------ usage (kvtier.inventory)

MANIFEST_NAME = "namespace.json"
"""The namespace manifest's file name in ``<root>/<digest>/``; never a block's name (those end
in ``.kvb`` two directories further down)."""


def write_manifest(backend: FileBackend, document: bytes) -> None:
    """Write ``<root>/<digest>/namespace.json`` unless it is there (atomic: temp + rename)."""
    directory = str(backend.root / backend.namespace.digest_hex)
    final = os.path.join(directory, MANIFEST_NAME)
    if os.path.lexists(final):
        return
    temp = os.path.join(directory, f"{_TEMP_PREFIX}{os.getpid()}-{next(_TEMP_COUNTER)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, _FILE_MODE)
    try:
        _write_all(fd, [document])
    finally:
        os.close(fd)
    os.replace(temp, final)  # identical content if another writer won: harmless


def _usage_root(url: str, options: dict[str, Any]) -> Path:
    """The root directory of a file tier URL (validated like :func:`from_url`)."""
    parts, merged = split_url_options(url, options)
    reject_unknown_options("file", merged, _OPTIONS)
    path = urllib.parse.unquote(parts.path)
    if parts.scheme != "file" or parts.netloc or not path.startswith("/"):
        raise ValueError(f"file backend URL {url!r}: expected file:///absolute/path")
    return Path(path)


def _namespace_dirs(root: Path) -> list[Path]:
    from kvtier.inventory import is_digest

    if not root.is_dir():
        raise ValueError(f"file tier root {str(root)!r} is not a directory")
    return sorted(entry for entry in root.iterdir()
                  if is_digest(entry.name) and entry.is_dir() and not entry.is_symlink())


def list_namespaces(url: str, options: dict[str, Any]) -> list[Any]:
    """One :class:`kvtier.inventory.NamespaceUsage` per namespace directory under the root."""
    from kvtier.inventory import NamespaceUsage, parse_manifest

    found = []
    for directory in _namespace_dirs(_usage_root(url, options)):
        manifest = directory / MANIFEST_NAME
        data = manifest.read_bytes() if manifest.is_file() and not manifest.is_symlink() else None
        item = NamespaceUsage(digest=directory.name, fields=parse_manifest(data, directory.name))
        for parent, _subdirs, files in os.walk(directory):
            for name in files:
                if not name.endswith(_SUFFIX):
                    continue
                try:
                    info = os.lstat(os.path.join(parent, name))
                except FileNotFoundError:
                    continue  # removed while we walked
                if stat.S_ISREG(info.st_mode):
                    item.add_block(info.st_size, info.st_mtime)
        found.append(item)
    return found


def delete_namespaces(url: str, options: dict[str, Any], digests: Sequence[str]) -> int:
    """Remove the blocks, temp files and manifest of each namespace, then its directories."""
    root = _usage_root(url, options)
    wanted = set(digests)
    deleted = 0
    for directory in _namespace_dirs(root):
        if directory.name not in wanted:
            continue
        for parent, _subdirs, files in os.walk(directory, topdown=False):
            for name in files:
                if name.endswith(_SUFFIX) or name.startswith(_TEMP_PREFIX) or \
                        name == MANIFEST_NAME:
                    try:
                        os.unlink(os.path.join(parent, name))
                    except FileNotFoundError:
                        continue
                    deleted += 1
            # Not empty: something that is not ours, or a block written meanwhile.
            with contextlib.suppress(OSError):
                os.rmdir(parent)
    return deleted
