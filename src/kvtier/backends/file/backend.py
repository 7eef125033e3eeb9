"""The local-disk backend: one framed file per block (layout in :mod:`.layout`).

Directories. The root is resolved once and every component of its path checked at open; the
root and the namespace directory are then held by descriptor, and every open, create, rename,
unlink and stat happens relative to held directory descriptors (:mod:`.dirs`), so a symlink
re-pointed or a directory renamed after open cannot redirect a byte. The held namespace
directory is re-verified on every batch call; they are created only at open and never
re-created if deleted.

Publishing. A block is written to ``.tmp-<pid>-<n>`` in its own directory (optionally fsync'd),
then published without ever overwriting (:mod:`.publish`). Readers never see a partial block;
two racing writers of one key both answer True.

Sharing. Several processes may share one directory: ``exists`` / ``get_many`` / ``put_many``
consult the filesystem; the capacity index (:mod:`.capacity`) only drives ``max_bytes`` and LRU
eviction over the blocks this process knows. On open the directory is scanned (:mod:`.scan`),
temp files of dead processes are removed and blocks of the old two-level layout moved into the
current one.

Hygiene. The root, its path and the namespace directory must pass :class:`.dirs.DirRule`
(owned by us or root, writable by nobody else unless sticky), unless ``shared_dir`` (which
requires ``auth_key``). Block files are opened ``O_NONBLOCK | O_NOFOLLOW`` and only regular
files are read: anything else at a block path is moved aside, removed and counted corrupt. A
buffered read lands in the caller's buffer (``preadv`` of payload and trailer, one verification
pass); an ``o_direct`` read into memory that is not whole aligned pages goes through a
page-aligned per-thread buffer (:mod:`.frameio`). Batches are read in one native call each where
the extension is built (:mod:`.reads`), and stored the same way (:mod:`.writes`, the
loops in :mod:`.store`; without ``auth_key`` the native call seals each trailer too).

State and owners (any caller thread): ``_capacity`` (its own lock); ``_dirs`` (its own lock,
see :mod:`.dirs`); ``_direct_io``, written once under ``_lock`` when O_DIRECT turns out
unsupported, read without it (a stale read costs one more EINVAL fallback); ``_native_io``,
set once at open; ``_publisher`` (see :mod:`.publish`); ``_scratch``, per thread.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import urllib.parse
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from kvtier import codec
from kvtier.backends import redact_url, split_url_options
from kvtier.backends.base import (
    COMMON_SETTINGS,
    CORRUPT_FETCH,
    FAILED_FETCH,
    MISSING_FETCH,
    AuthKey,
    Backend,
    Fetched,
    OpenMode,
    Outcome,
    load_auth_key,
)
from kvtier.backends.file.capacity import CapacityIndex
from kvtier.backends.file.dirs import DirRule, NamespaceGoneError, Sharing, TierDirs, View
from kvtier.backends.file.frameio import inode_of, read_frame, read_whole
from kvtier.backends.file.layout import (
    _CREATE_FLAGS,
    _FILE_MODE,
    _MISSING_ERRNOS,
    _NOT_READABLE_ERRNOS,
    _NOT_REGULAR_ERRNOS,
    _O_DIRECT,
    _READ_FLAGS,
    _TEMP_COUNTER,
    _TEMP_PREFIX,
    MANIFEST_NAME,
    DirectIO,
    _Scratch,
    _write_all,
    is_trailer,
    locate,
)
from kvtier.backends.file.native import NativeIO, native_io_for
from kvtier.backends.file.publish import Publisher
from kvtier.backends.file.reads import FileReads
from kvtier.backends.file.scan import scan_blocks
from kvtier.backends.file.writes import FileWrites
from kvtier.backends.manifest import read_manifest_file
from kvtier.keys import BlockKey, Namespace, check_key
from kvtier.settings import ConfigError, Kind, Setting, SettingsTable

_log = logging.getLogger(__name__)

SETTINGS = SettingsTable("file backend", (
    Setting("max_bytes", Kind.SIZE, 0,
            help="bound on the bytes this process keeps under the directory, LRU eviction "
                 "(0 = unlimited)"),
    Setting("fsync", Kind.BOOL, False, help="fsync every block and its directory on store"),
    Setting("o_direct", Kind.BOOL, False,
            help="O_DIRECT reads and writes (bypass the page cache; falls back if refused)"),
    Setting("native_io", Kind.BOOL, True,
            help="read, look at and store each batch of blocks in one native call that releases "
                 "the interpreter lock once (where the extension is built; else Python, one "
                 "call per system call)"),
    Setting("shared_dir", Kind.BOOL, False,
            help="accept a root or namespace directory owned by another user or writable by "
                 "group or others (requires auth_key)"),
    *COMMON_SETTINGS,
))



class FileBackend(FileReads, FileWrites, Backend):
    """A thread-safe block store on a local directory (see module docstring)."""

    EXTRA_COUNTERS = ("evictions", "native_reads", "native_stores", "sealed_reads",
                      "sealed_stores", "stray_temp_files_removed", "o_direct_fallbacks",
                      "put_rejected", "namespace_dir_swaps", "old_layout_blocks_moved")
    FRAME_LAYOUT = codec.FrameLayout.TRAILER

    def __init__(
        self,
        root: str | os.PathLike[str],
        namespace: Namespace,
        *,
        max_bytes: int | str = 0,
        fsync: bool | str = False,
        o_direct: bool | str = False,
        native_io: bool | str = True,
        shared_dir: bool | str = False,
        auth_key: AuthKey | None = None,
        mode: OpenMode = OpenMode.READ_WRITE,
    ) -> None:
        root_path = Path(root)
        if not root_path.is_absolute():
            raise ValueError(f"file backend root must be an absolute path, got {str(root)!r}")
        if root_path == Path(root_path.anchor):
            raise ValueError(f"file backend root {str(root)!r} is the file system's root; expected "
                             "a directory of its own, e.g. file:///var/cache/kvtier")
        digest_hex = namespace.digest_hex if isinstance(namespace, Namespace) else ""
        self._configured_root = root_path
        super().__init__(namespace, name=f"file backend at {root_path / digest_hex}", logger=_log,
                         auth_key=auth_key)
        self._max_bytes: int = SETTINGS["max_bytes"].parse(max_bytes)
        self._fsync: bool = SETTINGS["fsync"].parse(fsync)
        wants_direct: bool = SETTINGS["o_direct"].parse(o_direct)
        shared: bool = SETTINGS["shared_dir"].parse(shared_dir)
        if shared and not auth_key:
            raise ConfigError(
                f"file backend root {str(root)!r}: shared_dir=true requires auth_key (or "
                "auth_key_file): in a directory others can write, only a keyed MAC keeps their "
                "frames from being served")
        if wants_direct and not _O_DIRECT:
            _log.warning("file backend: O_DIRECT is not available on this OS; using buffered I/O")
        self._direct_io = DirectIO.ACTIVE if wants_direct and _O_DIRECT else DirectIO.OFF
        self._native_io = native_io_for(SETTINGS["native_io"].parse(native_io))
        # Buffered, no fsync: a store is a CPU-bound copy into the page cache, and a second one
        # beside it only waits for the interpreter lock (benchmarks/beyond_pool.py).
        if self._direct_io is DirectIO.OFF and not self._fsync:
            self.parallel_stores = 1
        self._lock = threading.Lock()  # guards _direct_io's one transition
        self._capacity = CapacityIndex(self._max_bytes)
        # Process-wide: two instances on one directory must never pick the same temp name.
        self._temp_counter = _TEMP_COUNTER
        self._pid = os.getpid()
        self._scratch = _Scratch()
        self._read_only = mode is OpenMode.READ_ONLY
        rule = DirRule(os.geteuid(), Sharing.SHARED if shared else Sharing.PRIVATE)
        try:
            # READ_ONLY creates nothing: a namespace never written is empty (and a missing root
            # is kind.py's NoTierError before this)
            self._dirs = TierDirs(str(root_path), digest_hex, rule, on_swap=self._on_swap,
                                  create=not self._read_only)
            self._publisher = Publisher(fsync=self._fsync, where=self._dirs.root_path)
            self._scan()  # READ_ONLY: no temp-file removal, no move, no eviction
        except OSError as exc:
            raise ValueError(
                f"file backend root {str(root)!r} cannot be used: {exc.strerror or exc}"
            ) from exc

    # ------------------------------------------------------------------ identity

    @property
    def url(self) -> str:
        return "file://" + urllib.parse.quote(str(self._configured_root))

    @property
    def root(self) -> Path:
        """The root as resolved at open: where the blocks are, whatever a symlink on the
        configured path points to now."""
        return Path(self._dirs.root_path)

    @property
    def direct_io(self) -> DirectIO:
        return self._direct_io

    def path_for(self, key: BlockKey) -> Path:
        """The file that holds ``key``'s block (whether or not it exists)."""
        parts, name = locate(check_key(key))
        return Path(self._dirs.namespace_path, *parts, name)

    def _m_extra_stats(self) -> dict[str, int]:
        gauges = self._capacity.gauges()
        gauges["o_direct_active"] = int(self._direct_io is DirectIO.ACTIVE)
        gauges["native_io_active"] = int(self._native_io is NativeIO.ACTIVE)
        return gauges

    def _m_update_manifest(self, decide: Callable[[bytes | None], bytes]) -> None:
        """Replace ``<root>/<digest>/namespace.json`` with ``decide`` of what it holds, unless
        unchanged (atomic: temp + rename; a concurrent writer's is as good)."""
        with self._dirs.use() as view:
            document = decide(stored := read_manifest_file(MANIFEST_NAME, dir_fd=view.fd))
            if document == stored:
                return
            temp = f"{_TEMP_PREFIX}{self._pid}-{next(_TEMP_COUNTER)}"
            fd = os.open(temp, _CREATE_FLAGS, _FILE_MODE, dir_fd=view.fd)
            try:
                _write_all(fd, [document])
            finally:
                os.close(fd)
            os.replace(temp, MANIFEST_NAME, src_dir_fd=view.fd, dst_dir_fd=view.fd)

    def _m_close(self) -> None:
        self._dirs.close()

    def _on_swap(self) -> None:
        """The held namespace directory is no longer at its name (called by ``_dirs``)."""
        self._stats.add("namespace_dir_swaps")
        self._error_log.warning("file backend: the namespace directory %s was renamed, replaced "
                                "or removed while open; it is no longer used",
                                self._dirs.namespace_path)

    def _batch(self, operation: str, keys: list[BlockKey],
               run: Callable[[View], list[Outcome]], gone: Outcome) -> list[Outcome]:
        """``run`` under the re-verified namespace directory; where it is gone every key
        answers ``gone``, where it is refused or unreadable every key fails (counted)."""
        try:
            view = self._dirs.acquire()
        except OSError as exc:
            if isinstance(exc, NamespaceGoneError) and gone is Outcome.MISSING:
                return [Outcome.MISSING] * len(keys)
            return [self._fail(operation, key, exc) for key in keys]
        try:
            return run(view)
        finally:
            self._dirs.release(view)

    # ------------------------------------------------------------------ existence

    def _m_exists(self, keys: list[BlockKey]) -> list[Outcome]:
        if self._native_io is NativeIO.ACTIVE and \
                (answered := self._exists_guarded(keys)) is not None:
            return answered

        def run(view: View) -> list[Outcome]:
            if self._native_io is NativeIO.ACTIVE and \
                    (outcomes := self._exists_native(view, keys)) is not None:
                return outcomes
            return [self._exists_one(view, key) for key in keys]

        return self._batch("exists", keys, run, Outcome.MISSING)

    def _exists_one(self, view: View, key: BlockKey) -> Outcome:
        parts, name = locate(key)
        try:
            dir_fd, owned = view.key_dir(parts, create=False)
        except OSError as exc:
            return Outcome.MISSING if exc.errno in _MISSING_ERRNOS | {errno.ELOOP} \
                else self._fail("exists", key, exc)
        try:
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError as exc:
            return Outcome.MISSING if exc.errno in _MISSING_ERRNOS \
                else self._fail("exists", key, exc)
        finally:
            if owned:
                os.close(dir_fd)
        # A FIFO, symlink or directory is not a block (a read removes it).
        return Outcome.OK if stat.S_ISREG(info.st_mode) else Outcome.MISSING

    # ------------------------------------------------------------------ reads

    def _open_failed(self, key: BlockKey, exc: OSError, *, direct: bool) -> Fetched | None:
        """What a failed open of ``key``'s file means; None: ask :meth:`_fetch_one` again (a
        filesystem refused O_DIRECT)."""
        if exc.errno in _MISSING_ERRNOS:
            return MISSING_FETCH
        if exc.errno in _NOT_REGULAR_ERRNOS:
            return CORRUPT_FETCH  # a symlink or socket at the block path
        if direct and exc.errno == errno.EINVAL:
            self._disable_direct_io(exc)
            return None
        self._fail("get", key, exc)
        return FAILED_FETCH

    def _fetch_one(self, view: View, key: BlockKey, out: memoryview) -> tuple[Fetched, int]:
        """What the file of ``key`` holds, and the descriptor to close once it is judged (-1:
        none). No ``fstat`` on the way of a good block: ``O_NOFOLLOW | O_NONBLOCK`` refuses a
        symlink or socket at open, a FIFO or directory fails the read (ESPIPE, EISDIR), and a
        read of exactly the frame's size into [payload, a page] proves the file's size."""
        parts, name = locate(key)
        direct = self._direct_io is DirectIO.ACTIVE
        # The cached fan-out directory without a call (a lookup per block on the hot path).
        dir_fd = view.fans.get(parts[0], -1) if len(parts) == 1 else -1
        owned = False
        if dir_fd < 0:
            try:
                dir_fd, owned = view.key_dir(parts, create=False)
            except OSError as exc:
                if exc.errno in _MISSING_ERRNOS | {errno.ELOOP}:
                    return MISSING_FETCH, -1
                self._fail("get", key, exc)
                return FAILED_FETCH, -1
        try:
            fd = os.open(name, _READ_FLAGS | (_O_DIRECT if direct else 0), dir_fd=dir_fd)
        except OSError as exc:
            answer = self._open_failed(key, exc, direct=direct)
            return (self._fetch_one(view, key, out) if answer is None else (answer, -1))
        finally:
            if owned:
                os.close(dir_fd)
        try:
            if direct:
                fetched = read_frame(fd, out, direct, self._scratch)
            else:  # _read's buffered case, inline
                page = self._scratch.trailer_page()
                if os.preadv(fd, (out, page), 0) == out.nbytes + codec.HEADER_BYTES and \
                        is_trailer(page):
                    fetched = Fetched(Outcome.OK, header=page[: codec.HEADER_BYTES],
                                      payload_bytes=out.nbytes, token=partial(inode_of, fd))
                else:
                    fetched = read_whole(fd, self._scratch)
        except OSError as exc:
            if exc.errno in _NOT_READABLE_ERRNOS:  # a FIFO or directory: never a block
                os.close(fd)
                return CORRUPT_FETCH, -1
            os.close(fd)
            if direct and exc.errno == errno.EINVAL:
                self._disable_direct_io(exc)
                return self._fetch_one(view, key, out)
            self._fail("get", key, exc)
            return FAILED_FETCH, -1
        if self._capacity.bounded and fetched.outcome is Outcome.OK:
            self._evict_files(view, self._capacity.adopt(key, out.nbytes + codec.HEADER_BYTES))
        return fetched, fd

    def _m_remove_bad(self, bad: list[tuple[BlockKey, Fetched]]) -> None:
        def run(view: View) -> list[Outcome]:
            for key, item in bad:
                token = item.token if isinstance(item.token, int) else None
                parts, name = locate(key)
                try:
                    dir_fd, owned = view.key_dir(parts, create=False)
                except OSError:
                    continue  # its directory is gone, and the bad object with it
                try:
                    self._drop_bad(key, dir_fd, name, token, "corrupt or unauthenticated")
                finally:
                    if owned:
                        os.close(dir_fd)
            return []

        self._batch("remove bad block", [key for key, _item in bad], run, Outcome.MISSING)

    def _drop_bad(self, key: BlockKey, dir_fd: int, name: str, inode: int | None,
                  why: str) -> None:
        """Remove the bad object we saw at ``name`` (inode ``inode``; None: any non-regular
        file).

        Between our read and now, another reader may have removed it and a writer published the
        good block under the same name. "stat, then unlink if same inode" would still delete that
        block if it lands between the two calls; instead the name is first renamed aside
        (atomic), then what was moved is checked, and put back if it is a block we did not read.
        """
        aside = f"{_TEMP_PREFIX}{self._pid}-{next(self._temp_counter)}"
        try:
            os.rename(name, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as error:
            if error.errno not in _MISSING_ERRNOS:  # else someone else already removed it
                self._fail("remove bad block", key, error)
                return
        else:
            try:
                moved = os.stat(aside, dir_fd=dir_fd, follow_symlinks=False)
                ours = moved.st_ino == inode if inode is not None else not stat.S_ISREG(
                    moved.st_mode)
                if not ours:  # a good block published meanwhile: give it its name back
                    self._publisher.publish(dir_fd, aside, dir_fd, name)
                    return
                if stat.S_ISDIR(moved.st_mode):
                    os.rmdir(aside, dir_fd=dir_fd)  # a non-empty planted one stays aside
                else:
                    os.unlink(aside, dir_fd=dir_fd)
            except OSError as error:
                self._fail("remove bad block", key, error)
        self._error_log.warning("file backend: removed %s block %s", why, self.path_for(key))
        self._capacity.forget((key,))

    def _m_delete(self, keys: list[BlockKey]) -> None:
        self._capacity.forget(keys)

        def run(view: View) -> list[Outcome]:
            self._evict_files(view, keys, count=False)
            return []

        self._batch("delete", keys, run, Outcome.MISSING)

    # ------------------------------------------------------------------ capacity index

    def _scan(self) -> None:
        """Rebuild the index from the namespace directory (:func:`.scan.scan_blocks`: temp files
        of dead processes removed, two-level-layout blocks moved) and evict past ``max_bytes``."""
        writing = not self._read_only
        try:
            view = self._dirs.acquire()
        except NamespaceGoneError:
            return  # READ_ONLY, and the namespace was never written: nothing to index
        try:
            scanned = scan_blocks(view, self._pid, writing=writing, publisher=self._publisher,
                                  unlink=self._unlink_quietly, fail=self._fail)
            victims = self._capacity.load(scanned.blocks)
            if writing:
                self._evict_files(view, victims)
            view.hold_fans()
        finally:
            self._dirs.release(view)
        removed, moved = scanned.removed, scanned.moved
        self._stats.add_many({"stray_temp_files_removed": removed,
                              "old_layout_blocks_moved": moved})
        if removed or moved:
            _log.info("file backend: removed %d stray temp files, moved %d blocks of the "
                      "two-level layout under %s", removed, moved, self._dirs.namespace_path)

    def _evict_files(self, view: View, victims: list[BlockKey], *, count: bool = True) -> None:
        for victim in victims:
            parts, name = locate(victim)
            try:
                dir_fd, owned = view.key_dir(parts, create=False)
            except OSError:
                continue  # no directory, no file
            try:
                self._unlink_quietly(dir_fd, name, victim)
            finally:
                if owned:
                    os.close(dir_fd)
        if victims and count:
            self._stats.add("evictions", len(victims))
            self.evicted.note(victims)

    # ------------------------------------------------------------------ helpers

    def _disable_direct_io(self, exc: OSError) -> None:
        with self._lock:
            if self._direct_io is not DirectIO.ACTIVE:
                return
            self._direct_io = DirectIO.UNSUPPORTED
        self._stats.add("o_direct_fallbacks")
        _log.warning(
            "file backend: O_DIRECT refused under %s (%s); falling back to buffered I/O",
            self._dirs.namespace_path,
            exc,
        )

    def _unlink_quietly(self, dir_fd: int, name: str | bytes, key: BlockKey | None) -> None:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno not in _MISSING_ERRNOS:
                self._fail("unlink", key if key is not None else os.fsdecode(name), exc)


def from_url(url: str, namespace: Namespace, options: dict[str, Any],
             mode: OpenMode = OpenMode.READ_WRITE) -> FileBackend:
    """Build a :class:`FileBackend` from ``file:///abs/path``.

    Options (keyword or query string): see :data:`SETTINGS` (``max_bytes``, ``fsync``,
    ``o_direct``, ``native_io``, ``shared_dir``, ``auth_key``, ``auth_key_file``).
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
        native_io=parsed["native_io"],
        shared_dir=parsed["shared_dir"],
        auth_key=load_auth_key(parsed, "file"),
        mode=mode,
    )

