"""The file tier's directories, held open by descriptor and checked like OpenSSH's StrictModes.

The configured root is resolved once (its symlinks are followed then, and never again); every
component of the resolved path is then opened from ``/`` with ``O_DIRECTORY | O_NOFOLLOW``
relative to its parent's descriptor, and checked (:class:`DirRule`). The root's descriptor and
the namespace directory's are kept: every later open, create, rename, unlink, stat and scan
happens relative to them, so re-pointing a symlink on the root's path or renaming a directory
after open redirects nothing. On every use the held namespace directory is re-verified
(``fstat``: owner and mode; ``fstatat`` of its name under the root: still the same inode), in
Python or, for the native batch calls, inside the call (:meth:`TierDirs.acquire_guarded`). One
that is no longer at its name (renamed aside, replaced, removed) is dropped and counted, and what
stands at the name now is used only if it passes the same checks; nothing is ever re-created.

Fan-out directories (``<k0k1>``, at most 256 per namespace) are opened ``O_NOFOLLOW`` relative
to the namespace descriptor and cached per :class:`View`: ``benchmarks/backend_throughput.py``
shows an open per key costs more than a small-block read (docs/tiers.md). A view lives while the
namespace directory's mtime and ctime stand still (creating, renaming or removing a fan-out
directory changes them) and for at most ``_FAN_TTL_S``; then a new view with a fresh cache
replaces it. At open the backend holds every fan-out directory there is (:meth:`View.hold_fans`),
so the descriptor table grows then, not under the first requests. Cached descriptors are bounded
process-wide (:class:`_FanBudget`): past the budget a fan-out directory is opened for the one
call and closed.

State and owners (any caller thread of the backend):

- ``TierDirs._view``: the view in use, replaced under ``TierDirs._lock``; ``View.users``, under
  the same lock. A replaced view is retired: its descriptors are closed by whichever thread drops
  its last use (or at once if none), so no call ever uses a descriptor number after its close.
- ``View.fans``: filled by any thread with ``dict.setdefault`` (atomic; the loser of a race
  closes its own descriptor); never emptied while the view is in use. ``View.fan_table``, the
  same descriptors by the fan-out directory's number (the first byte of its keys) for the native
  store: each slot written once, by the thread that cached its descriptor, after caching it (a
  reader that still sees -1 takes the careful path).
- ``_FAN_BUDGET``: a process-wide count of cached descriptors, under its own lock.
"""

from __future__ import annotations

import array
import contextlib
import enum
import errno
import os
import resource
import stat
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvtier.backends.file.layout import (
    _DIR_MODE,
    _MAX_DEPTH,
    _MAX_NAME_HEX,
    _O_CLOEXEC,
    _O_NOFOLLOW,
)
from kvtier.settings import ConfigError

__all__ = ["DIR_FLAGS", "DirRule", "DirectoryRefusedError", "Guard", "GuardRefused",
           "NamespaceGoneError", "Sharing", "TierDirs", "View", "anchor", "walk"]

DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_NOFOLLOW | _O_CLOEXEC
_FAN_TTL_S = 1.0

class GuardRefused(Exception):
    """A native batch call's namespace check (its :data:`Guard`) did not hold, and the call did
    nothing: its caller releases the view and takes the careful path (internal)."""


Guard = tuple[int, int, bytes, int, int, int, int, int, int]
"""What a native batch call checks before it starts (``_batchio.c``'s ``DirGuard``): the held
namespace descriptor, the root's, the namespace's name, and the device, inode, mode, owner,
mtime and ctime (ns) :meth:`TierDirs.acquire` last found."""
_NOT_A_DIRECTORY_ERRNOS = {errno.ELOOP, errno.ENOTDIR}
_FIX = ("Use a directory of your own that nobody else can write (chmod go-w), or set "
        "shared_dir=true with auth_key if it is shared on purpose")


class NamespaceGoneError(FileNotFoundError):
    """Nothing stands at the namespace directory's name any more (removed or renamed away)."""


class DirectoryRefusedError(PermissionError):
    """What stands at a held directory's name now fails the checks it passed at open."""


class Sharing(enum.Enum):
    PRIVATE = "private"  # owned by root or us, nobody else can write it (the default)
    SHARED = "shared"  # shared_dir=true: any owner, any mode (frames must carry auth_key tags)


class Role(enum.Enum):
    ANCESTOR = "directory"  # a component of the root's path above the root
    ROOT = "root"
    NAMESPACE = "namespace directory"


@dataclass(frozen=True, slots=True)
class DirRule:
    """Which directories the tier trusts (StrictModes): owned by root or by this user, and not
    writable by group or others, except a sticky root or ancestor (like /tmp: nobody can rename
    or remove another's entries there). A namespace directory is never writable by others, sticky
    or not: anyone could create the fan-out directories blocks are written to."""

    uid: int
    sharing: Sharing

    def problem(self, info: os.stat_result, role: Role) -> str | None:
        """Why a directory with ``info`` cannot be trusted in ``role``, or None."""
        if not stat.S_ISDIR(info.st_mode):
            return "is not a directory"
        if self.sharing is Sharing.SHARED:
            return None
        harm = ("could rename or replace the directories below it" if role is Role.ANCESTOR
                else "could plant or swap blocks there")
        if info.st_uid not in (0, self.uid):
            return (f"is owned by uid {info.st_uid}, not by this user (uid {self.uid}) or root; "
                    f"that user {harm}")
        mode = stat.S_IMODE(info.st_mode)
        sticky = bool(mode & stat.S_ISVTX) and role is not Role.NAMESPACE
        unless = " without the sticky bit" if role is not Role.NAMESPACE else ""
        if mode & stat.S_IWOTH and not sticky:
            return f"is world-writable (mode {mode:o}){unless}; anyone {harm}"
        if mode & stat.S_IWGRP and not sticky:
            return (f"is group-writable (mode {mode:o}){unless}; any member of group "
                    f"{info.st_gid} {harm}")
        return None

    def check(self, info: os.stat_result, path: str, role: Role, root: str) -> None:
        problem = self.problem(info, role)
        if problem is None:
            return
        if role is Role.ANCESTOR:
            raise ConfigError(f"file backend root {root!r} cannot be used: the directory "
                              f"{path!r} on its path {problem}. {_FIX}")
        raise ConfigError(f"file backend {role.value} {path!r} {problem}. {_FIX}")


def _open_dir(name: str, parent: int, *, create: bool) -> tuple[int, bool]:
    """``name`` under ``parent``, opened O_NOFOLLOW (created 0700 if ``create``): (fd, created)."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent), False
    except FileNotFoundError:
        if not create:
            raise
    created = True
    try:
        os.mkdir(name, _DIR_MODE, dir_fd=parent)
    except FileExistsError:
        created = False
    fd = os.open(name, DIR_FLAGS, dir_fd=parent)
    if created:
        with contextlib.suppress(OSError):
            os.fchmod(fd, _DIR_MODE)  # the umask may have removed bits we need
    return fd, created


def anchor(path: str, rule: DirRule, *, create: bool) -> tuple[int, str]:
    """Open the directory ``path`` (creating missing components if ``create``), checking every
    component from ``/``: (its descriptor, its resolved path). Raises ConfigError for a component
    that fails ``rule``, OSError for the rest (missing, not a directory, swapped meanwhile)."""
    resolved = os.path.realpath(path)
    fd = os.open("/", DIR_FLAGS)
    try:
        rule.check(os.fstat(fd), "/", Role.ANCESTOR, resolved)
        names = [name for name in resolved.split("/") if name]
        for depth, name in enumerate(names):
            current = "/" + "/".join(names[: depth + 1])
            try:
                child, _created = _open_dir(name, fd, create=create)
            except OSError as exc:
                if exc.errno in _NOT_A_DIRECTORY_ERRNOS:
                    raise ConfigError(f"file backend root {resolved!r} cannot be used: "
                                      f"{current!r} is not a directory (or was replaced by a "
                                      "symlink while opening)") from None
                raise
            os.close(fd)
            fd = child
            role = Role.ROOT if depth == len(names) - 1 else Role.ANCESTOR
            rule.check(os.fstat(fd), current, role, resolved)
    except BaseException:
        os.close(fd)
        raise
    return fd, resolved


class _FanBudget:
    """Fan-out descriptors cached by every file tier of this process: a quarter of the soft
    ``RLIMIT_NOFILE`` (the other three quarters stay the engine's)."""

    __slots__ = ("_limit", "_lock", "_used")

    def __init__(self) -> None:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        self._limit = (soft // 4) if soft != resource.RLIM_INFINITY else 1 << 16
        self._lock = threading.Lock()
        self._used = 0

    def take(self) -> bool:
        with self._lock:
            if self._used >= self._limit:
                return False
            self._used += 1
            return True

    def give(self, count: int) -> None:
        with self._lock:
            self._used -= count


_FAN_BUDGET = _FanBudget()
_NO_FANS = [-1] * 256  # a View's fan_table before any fan-out directory is cached
_FAN_NUMBERS = {f"{number:02x}": number for number in range(256)}  # a fan-out name's slot


class View:
    """One held namespace descriptor and its fan-out cache (see module docstring)."""

    __slots__ = ("dev", "expires", "fan_table", "fans", "fd", "ino", "retired", "stale", "stamp",
                 "trusted", "users")

    def __init__(self, fd: int, info: os.stat_result) -> None:
        self.fd = fd
        self.dev, self.ino = info.st_dev, info.st_ino
        self.stamp = (info.st_mtime_ns, info.st_ctime_ns)
        self.trusted = (info.st_mode, info.st_uid)  # the owner and mode last checked
        self.expires = time.monotonic() + _FAN_TTL_S
        self.fans: dict[str, int] = {}
        self.fan_table = array.array("i", _NO_FANS)
        self.users = 0
        self.retired = False
        self.stale = False  # a cached fan-out directory was found removed: replace this view

    def key_dir(self, parts: tuple[str, ...], *, create: bool, fresh: bool = False
                ) -> tuple[int, bool]:
        """The descriptor of the directory a key's file sits in, and whether the caller must
        close it (True except for a cached fan-out directory; always with ``fresh``, which
        reopens the name instead of trusting the cache). FileNotFoundError if it is absent and
        not ``create``; ELOOP / ENOTDIR if something else than a directory stands there."""
        fan = None if fresh else self.fans.get(parts[0])
        owned = False
        if fan is None:
            fan, _created = _open_dir(parts[0], self.fd, create=create)
            if not fresh and _FAN_BUDGET.take():
                cached = self.fans.setdefault(parts[0], fan)
                if cached != fan:  # another thread cached it first
                    os.close(fan)
                    _FAN_BUDGET.give(1)
                    fan = cached
                elif (number := _FAN_NUMBERS.get(parts[0])) is not None:
                    self.fan_table[number] = fan
            else:
                owned = True
        if len(parts) == 1:
            return fan, owned
        fd = fan
        try:
            for name in parts[1:]:  # a long key's chunk directories: rare, never cached
                child, _created = _open_dir(name, fd, create=create)
                if owned or fd != fan:
                    os.close(fd)
                fd = child
        except BaseException:
            if owned or fd != fan:
                os.close(fd)
            raise
        return fd, True

    def block_fan(self, key_hex: str, *, create: bool) -> int:
        """The cached fan-out directory the block of ``key_hex`` sits in, opened into the cache
        (created first if ``create``) where it is not there yet; -1 for the caller's careful
        path: a long key (its name is split into directories below the fan-out one), or a
        directory that cannot be cached (absent, not a directory, an error, the descriptor
        budget spent), which that path handles and reports."""
        if len(key_hex) > _MAX_NAME_HEX:
            return -1
        cached = self.fans.get(key_hex[:2], -1)
        if cached >= 0:
            return cached
        try:
            fd, owned = self.key_dir((key_hex[:2],), create=create)
        except OSError:
            return -1
        if owned:
            os.close(fd)
            return -1
        return fd

    def cached_fans(self, key_hexes: list[str]) -> list[int] | None:
        """:meth:`block_fan` of every key where each one is short and its fan-out directory
        cached, in one pass at C speed (the common store); None where any one is not."""
        if max(map(len, key_hexes)) > _MAX_NAME_HEX:
            return None
        fans = self.fans
        fds = [fans.get(key_hex[:2], -1) for key_hex in key_hexes]
        return None if -1 in fds else fds

    def hold_fans(self) -> None:
        """Open every fan-out directory there is into the cache (as far as the descriptor budget
        allows). Called at open: a threaded process pays for each new descriptor number above
        its table's size (the table is copied as it doubles, ~20 us a descriptor measured here),
        so it is paid once there, not by the first requests' probes; later views reuse the
        numbers."""
        listing = os.open(".", DIR_FLAGS, dir_fd=self.fd)  # our own: scandir moves its offset
        try:
            with os.scandir(listing) as entries:
                names = [entry.name for entry in entries if len(entry.name) == 2
                         and entry.is_dir(follow_symlinks=False)]
        finally:
            os.close(listing)
        for name in names:
            self.block_fan(name, create=False)  # a fan's name is its keys' first two hex digits

    def close(self) -> None:
        fans = list(self.fans.values())
        self.fans = {}
        self.fan_table = array.array("i", _NO_FANS)
        for fd in fans:
            with contextlib.suppress(OSError):
                os.close(fd)
        _FAN_BUDGET.give(len(fans))
        with contextlib.suppress(OSError):
            os.close(self.fd)


class _Held:
    """The descriptors of one :class:`TierDirs` (apart from it, so that a garbage-collected
    backend that was never closed still closes them: ``weakref.finalize``)."""

    __slots__ = ("closed", "root_fd", "view")

    def __init__(self, root_fd: int, view: View | None) -> None:
        self.root_fd = root_fd
        self.view = view
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.view is not None and self.view.users == 0:
            self.view.close()
        self.view = None
        with contextlib.suppress(OSError):
            os.close(self.root_fd)


class TierDirs:
    """The root and namespace directory of one file tier, held by descriptor."""

    def __init__(self, root: str, namespace_name: str, rule: DirRule, *,
                 on_swap: Callable[[], None], create: bool = True) -> None:
        """``create``: make the root and namespace directory where missing; without it, a
        missing namespace directory reads as empty (``NamespaceGoneError`` on use)."""
        self._rule = rule
        self._name = namespace_name
        self._name_bytes = os.fsencode(namespace_name)
        self._on_swap = on_swap
        self._lock = threading.Lock()
        root_fd, self.root_path = anchor(root, rule, create=create)
        self.namespace_path = os.path.join(self.root_path, namespace_name)
        view: View | None = None
        try:
            try:
                fd, _created = _open_dir(namespace_name, root_fd, create=create)
            except FileNotFoundError:
                fd = -1  # not created (create=False): looked up again on every use
            except OSError as exc:
                if exc.errno in _NOT_A_DIRECTORY_ERRNOS:
                    raise ConfigError(f"file backend namespace directory "
                                      f"{self.namespace_path!r} is not a directory") from None
                raise
            if fd >= 0:
                info = os.fstat(fd)
                try:
                    rule.check(info, self.namespace_path, Role.NAMESPACE, self.root_path)
                except ConfigError:
                    os.close(fd)
                    raise
                view = View(fd, info)
        except BaseException:
            os.close(root_fd)
            raise
        self._held = _Held(root_fd, view)
        self._finalizer = weakref.finalize(self, self._held.close)

    def acquire(self) -> View:
        """The namespace directory, re-verified (see module docstring), for one batch call;
        hand it back with :meth:`release`.

        Raises NamespaceGoneError when nothing stands at its name, DirectoryRefusedError when
        what stands there fails the checks, OSError for an I/O error."""
        with self._lock:
            view = self._current()
            view.users += 1
            return view

    def acquire_guarded(self) -> tuple[View, Guard] | None:
        """The view in use, counted as :meth:`acquire` counts it, with its checks left to the
        native call that uses it: the :data:`Guard` to pass (the same ``fstat`` and ``fstatat``
        made inside that call, so that a batch gives the interpreter lock up once, not three
        times). A call whose guard does not hold does nothing; its caller then releases the
        view and takes :meth:`acquire`, which looks again and handles what changed. None where
        the view is due for replacement (or none is held): the caller takes :meth:`acquire`."""
        with self._lock:
            held = self._held
            view = held.view
            if held.closed or view is None or view.stale or time.monotonic() > view.expires:
                return None
            view.users += 1
            return view, (view.fd, held.root_fd, self._name_bytes, view.ino, view.dev,
                          *view.trusted, *view.stamp)

    @contextlib.contextmanager
    def guarded(self) -> Iterator[tuple[View, Guard] | None]:
        """:meth:`acquire_guarded` and :meth:`release` around a native call (the hot paths);
        None inside where the caller must take the careful path."""
        guarded = self.acquire_guarded()
        try:
            yield guarded
        finally:
            if guarded is not None:
                self.release(guarded[0])

    def release(self, view: View) -> None:
        with self._lock:
            view.users -= 1
            if view.retired and view.users == 0:
                view.close()

    @contextlib.contextmanager
    def use(self) -> Iterator[View]:
        """:meth:`acquire` and :meth:`release` around a block (the paths off the hot one)."""
        view = self.acquire()
        try:
            yield view
        finally:
            self.release(view)

    def close(self) -> None:
        with self._lock:
            if self._held.view is not None:
                self._held.view.retired = True
            self._finalizer()

    def _current(self) -> View:
        """The view to use now (under ``_lock``)."""
        held = self._held
        if held.closed:
            raise OSError(errno.EBADF, "the file tier is closed")
        view = held.view
        if view is not None:
            info = os.fstat(view.fd)
            try:
                named = os.stat(self._name, dir_fd=held.root_fd, follow_symlinks=False)
            except FileNotFoundError:
                named = None
            if named is not None and named.st_ino == view.ino and named.st_dev == view.dev:
                if (info.st_mode, info.st_uid) != view.trusted:
                    self._refuse_if_bad(info)
                    view.trusted = (info.st_mode, info.st_uid)
                if view.stale or (info.st_mtime_ns, info.st_ctime_ns) != view.stamp or \
                        time.monotonic() > view.expires:
                    view = self._install(View(os.dup(view.fd), info))
                return view
            self._retire_current()
            self._on_swap()
        try:
            fd = os.open(self._name, DIR_FLAGS, dir_fd=held.root_fd)
        except FileNotFoundError:
            raise NamespaceGoneError(errno.ENOENT, "the tier's namespace directory is gone",
                                     self.namespace_path) from None
        except OSError as exc:
            if exc.errno in _NOT_A_DIRECTORY_ERRNOS:
                raise DirectoryRefusedError(errno.EPERM, "not a directory (a symlink?)",
                                            self.namespace_path) from None
            raise
        info = os.fstat(fd)
        try:
            self._refuse_if_bad(info)
        except DirectoryRefusedError:
            os.close(fd)
            raise
        return self._install(View(fd, info))

    def _refuse_if_bad(self, info: os.stat_result) -> None:
        problem = self._rule.problem(info, Role.NAMESPACE)
        if problem is not None:
            raise DirectoryRefusedError(errno.EPERM, f"refused: it {problem}",
                                        self.namespace_path)

    def _install(self, view: View) -> View:
        self._retire_current()
        self._held.view = view
        return view

    def _retire_current(self) -> None:
        old, self._held.view = self._held.view, None
        if old is not None:
            old.retired = True
            if old.users == 0:
                old.close()


def walk(top: int) -> Iterator[tuple[tuple[str, ...], int, list[str], list[str]]]:
    """Every directory below ``top`` (``top`` included), bottom-up: (its components below
    ``top``, its descriptor, its non-directory entry names, its subdirectory names).
    Subdirectories are opened ``O_NOFOLLOW`` relative to their parent (a symlink is never
    followed, one swapped in meanwhile is skipped) and not entered past ``_MAX_DEPTH``."""
    yield from _walk(os.open(".", DIR_FLAGS, dir_fd=top), ())


def _walk(fd: int, parts: tuple[str, ...]
          ) -> Iterator[tuple[tuple[str, ...], int, list[str], list[str]]]:
    """``walk`` from ``fd`` (a descriptor of our own, closed here: scandir moves its offset)."""
    try:
        files: list[str] = []
        subdirs: list[str] = []
        with os.scandir(fd) as entries:
            for entry in entries:
                try:
                    is_dir = entry.is_dir(follow_symlinks=False)
                except OSError:
                    continue  # removed while we listed
                (subdirs if is_dir else files).append(entry.name)
        if len(parts) < _MAX_DEPTH:
            for name in subdirs:
                try:
                    child = os.open(name, DIR_FLAGS, dir_fd=fd)
                except OSError:
                    continue  # removed, or no longer a directory
                yield from _walk(child, (*parts, name))
        yield parts, fd, files, subdirs
    finally:
        os.close(fd)
