"""``put_many``'s hooks of :class:`~kvtier.backends.file.backend.FileBackend` (a mixin, as
:mod:`.reads` is for loads): the sealed store, the batch store and the careful one-block path
with everything a failed or refused store leaves to judge.

State and owners: none of its own; the attributes below are the backend's (see its module
docstring).
"""

from __future__ import annotations

import errno
import itertools
import os
import stat
from collections.abc import Callable

from kvtier.backends.base import Outcome, StoredFrame, encode_frames
from kvtier.backends.file.capacity import CapacityIndex
from kvtier.backends.file.dirs import Guard, GuardRefused, TierDirs, View
from kvtier.backends.file.frameio import write_temp
from kvtier.backends.file.layout import (
    _MAX_NAME_HEX,
    _TEMP_PREFIX_BYTES,
    DirectIO,
    _Scratch,
    is_aligned,
    locate,
)
from kvtier.backends.file.native import NativeIO, require_batchio
from kvtier.backends.file.publish import Publisher
from kvtier.backends.file.store import (
    StoreStage,
    Unpublished,
    put_native,
    put_plain,
    put_sealed,
)
from kvtier.backends.stats import BackendStats
from kvtier.codec import FrameCodec
from kvtier.keys import BlockKey

__all__ = ["FileWrites"]


class FileWrites:
    """``_m_store`` and ``_m_store_blocks`` of the file backend (a mixin: the attributes and
    methods annotated below are the backend's)."""

    _capacity: CapacityIndex
    _codec: FrameCodec
    _dirs: TierDirs
    _direct_io: DirectIO
    _fsync: bool
    _native_io: NativeIO
    _pid: int
    _publisher: Publisher
    _scratch: _Scratch
    _stats: BackendStats
    _temp_counter: itertools.count[int]
    # The backend's and the template's (annotations only: a stub here would shadow them).
    _batch: Callable[..., list[Outcome]]  # (operation, keys, run, gone)
    _evict_files: Callable[..., None]  # (view, victims, *, count=True)
    _fail: Callable[[str, object, BaseException], Outcome]
    _drop_bad: Callable[..., None]  # (key, dir_fd, name, inode, reason)
    _disable_direct_io: Callable[[OSError], None]
    _unlink_quietly: Callable[[int, str | bytes, BlockKey | None], None]

    def _m_store(self, frames: list[StoredFrame]) -> list[Outcome]:
        def run(view: View) -> list[Outcome]:
            stored: list[tuple[BlockKey, int]] = []
            try:
                direct = self._direct_io is DirectIO.ACTIVE
                native = self._native_io is NativeIO.ACTIVE
                if (not self._fsync and self._publisher.refuses_existing
                        and (native or not direct)):
                    return self._put_batch(view, frames, stored)
                return [self._put_one(view, frame, stored) for frame in frames]
            finally:
                self._capacity.commit(stored)  # one lock per batch, not per block

        return self._batch("put", [frame.key for frame in frames], run, Outcome.FAILED)

    def _m_store_blocks(self, keys: list[BlockKey], payloads: list[memoryview]) -> list[Outcome]:
        """The batch through :func:`.store.put_sealed` where it applies (:meth:`_seal_template`),
        else encoded and stored frame by frame (:meth:`_m_store`)."""
        template = self._seal_template(keys, payloads)
        if template is None:
            return self._m_store(encode_frames(self._codec, keys, payloads))
        if not self._capacity.bounded and \
                (guarded := self._put_guarded(keys, payloads, template)) is not None:
            return guarded

        def run(view: View) -> list[Outcome]:
            stored: list[tuple[BlockKey, int]] = []
            try:
                return self._put_sealed(view, keys, payloads, template, stored)
            finally:
                self._capacity.commit(stored)  # one lock per batch, not per block

        return self._batch("put", keys, run, Outcome.FAILED)

    def _put_guarded(self, keys: list[BlockKey], payloads: list[memoryview],
                     template: bytes) -> list[Outcome] | None:
        """:meth:`_put_sealed` with the namespace directory checked inside the native call
        (:meth:`.TierDirs.acquire_guarded`); None where that cannot answer (the view is due for
        replacement, or the check did not hold: nothing was written). Unbounded tiers only: a
        bounded one evicts before it writes, and evicts under a checked view."""
        with self._dirs.guarded() as guarded:
            if guarded is None:
                return None
            view, guard = guarded
            stored: list[tuple[BlockKey, int]] = []
            try:
                return self._put_sealed(view, keys, payloads, template, stored, guard)
            except GuardRefused:
                return None
            finally:
                self._capacity.commit(stored)

    def _seal_template(self, keys: list[BlockKey], payloads: list[memoryview]) -> bytes | None:
        """The trailer template of a batch the native call seals itself: native I/O (buffered,
        or O_DIRECT from a first payload of whole aligned pages, an engine's pool slot), no
        fsync, a no-replace publish, no MAC, a first key short enough for one file name. None
        for every other store."""
        if (self._native_io is not NativeIO.ACTIVE or self._fsync
                or not self._publisher.refuses_existing or 2 * len(keys[0]) > _MAX_NAME_HEX
                or (self._direct_io is DirectIO.ACTIVE and not is_aligned(payloads[0]))):
            return None
        return self._codec.seal_template(len(keys[0]), payloads[0].nbytes)

    def _put_sealed(self, view: View, keys: list[BlockKey], payloads: list[memoryview],
                    template: bytes, stored: list[tuple[BlockKey, int]],
                    guard: Guard | None = None) -> list[Outcome]:
        """:func:`.store.put_sealed` over the batch (under ``max_bytes`` reserved first, as
        :meth:`_put_batch` does); what it did not publish goes the careful ways
        (:meth:`_store_unpublished`). Raises :class:`.GuardRefused`, having written nothing,
        where ``guard`` did not hold."""
        capacity = self._capacity
        held = 0
        if capacity.bounded:
            held = sum(map(len, payloads)) + len(template) * len(keys)
            fits, victims = capacity.reserve(held)
            self._evict_files(view, victims)
            if not fits:
                return [self._put_one(view, frame, stored)
                        for frame in encode_frames(self._codec, keys, payloads)]
        published: list[tuple[BlockKey, int]] = []
        prefix = b"%s%d-" % (_TEMP_PREFIX_BYTES, self._pid)
        try:
            unpublished = put_sealed(view, keys, payloads, published, template=template,
                                     temp_prefix=prefix, counter=self._temp_counter,
                                     native=require_batchio(), guard=guard,
                                     direct=self._direct_io is DirectIO.ACTIVE)
        finally:
            stored.extend(published)  # their reservation ends in commit()
            self._stats.add_many({"native_stores": len(published),
                                  "sealed_stores": len(published)})
            if held and (unreached := held - sum(size for _key, size in published)):
                capacity.release(unreached, key=None)  # the paths below reserve their own
        if unpublished is None:
            raise GuardRefused
        outcomes = [Outcome.OK] * len(keys)
        if unpublished:
            self._store_unpublished(view, keys, payloads, unpublished, outcomes, stored)
        return outcomes

    def _store_unpublished(self, view: View, keys: list[BlockKey], payloads: list[memoryview],
                           unpublished: list[Unpublished], outcomes: list[Outcome],
                           stored: list[tuple[BlockKey, int]]) -> None:
        """The blocks :func:`.store.put_sealed` did not publish, each frame encoded here: a
        standing temp file is removed and the block judged as :func:`.store.put_native`'s rare
        path judges it (a taken name: what holds it); skipped blocks and failed opens go
        through :meth:`_put_batch` together."""
        retry: list[int] = []
        for index, stage, code, temp in unpublished:
            if stage in (StoreStage.SKIPPED, StoreStage.OPEN_FAILED):
                retry.append(index)
                continue
            key, payload = keys[index], payloads[index]
            frame = StoredFrame(key, self._codec.encode_record(key, payload), payload)
            taken = stage is StoreStage.RENAME_FAILED and code == errno.EEXIST
            outcomes[index] = self._put_rare(view, view.fan_table[key[0]], temp, frame, stored,
                                             name_taken=taken)
        if retry:
            frames = encode_frames(self._codec, [keys[i] for i in retry],
                                   [payloads[i] for i in retry])
            for index, outcome in zip(retry, self._put_batch(view, frames, stored), strict=True):
                outcomes[index] = outcome

    def _put_batch(self, view: View, frames: list[StoredFrame],
                   stored: list[tuple[BlockKey, int]]) -> list[Outcome]:
        """:func:`.store.put_native` (or, without the extension, :func:`.store.put_plain`,
        buffered only) over the batch. Under ``max_bytes`` the batch is reserved
        first (one lock, victims evicted); a frame handed to a slow path gives its share back
        (that path reserves its own); a batch that does not fit goes block by block."""
        capacity = self._capacity
        held = 0  # bytes of the batch reservation not given back (published ones included)
        if capacity.bounded:
            held = sum(frame.nbytes for frame in frames)
            fits, victims = capacity.reserve(held)
            self._evict_files(view, victims)
            if not fits:
                return [self._put_one(view, frame, stored) for frame in frames]

        def give_back(frame: StoredFrame) -> None:
            nonlocal held
            if held:
                held -= frame.nbytes
                capacity.release(frame.nbytes, key=None)

        def slow(frame: StoredFrame) -> Outcome:
            give_back(frame)
            return self._put_one(view, frame, stored)

        def rare(fan: int, temp: bytes, frame: StoredFrame, taken: bool) -> Outcome:
            give_back(frame)
            return self._put_rare(view, fan, temp, frame, stored, name_taken=taken)

        published: list[tuple[BlockKey, int]] = []
        prefix = b"%s%d-" % (_TEMP_PREFIX_BYTES, self._pid)
        try:
            if self._native_io is NativeIO.ACTIVE:
                outcomes = put_native(view, frames, published, temp_prefix=prefix,
                                      counter=self._temp_counter, slow=slow, rare=rare,
                                      native=require_batchio(),
                                      direct=self._direct_io is DirectIO.ACTIVE)
                self._stats.add("native_stores", len(published))
                return outcomes
            return put_plain(view, frames, published, temp_prefix=prefix,
                             counter=self._temp_counter, slow=slow, rare=rare)
        finally:
            stored.extend(published)  # their reservation ends in commit()
            if held and (unreached := held - sum(size for _key, size in published)):
                capacity.release(unreached, key=None)  # after an error only

    def _put_rare(self, view: View, fan: int, temp: bytes, frame: StoredFrame,
                  stored: list[tuple[BlockKey, int]], *, name_taken: bool) -> Outcome:
        """:func:`.store.put_plain`'s temp file ``temp`` under ``fan`` was not published (its write
        or rename failed; ``name_taken``: a file holds the block's name): the temp file
        removed, the name's holder judged, else :meth:`_put_one` tries and reports."""
        self._unlink_quietly(fan, temp, frame.key)
        found = self._existing(view, fan, locate(frame.key)[1], frame.key) if name_taken \
            else None
        return found if found is not None else self._put_one(view, frame, stored)

    def _put_one(self, view: View, frame: StoredFrame,
                 stored: list[tuple[BlockKey, int]]) -> Outcome:
        parts, name = locate(frame.key)
        try:
            for fresh in (False, True):
                dir_fd, owned = view.key_dir(parts, create=True, fresh=fresh)
                try:
                    outcome = self._put_in(view, dir_fd, name, frame, stored)
                finally:
                    if owned:
                        os.close(dir_fd)
                if outcome is not None:
                    return outcome
                view.stale = True  # its directory was removed under us: reopen it by name
            raise FileNotFoundError(errno.ENOENT, "the block's directory keeps vanishing", name)
        except OSError as exc:
            return self._fail("put", frame.key, exc)

    def _put_in(self, view: View, dir_fd: int, name: str, frame: StoredFrame,
                stored: list[tuple[BlockKey, int]]) -> Outcome | None:
        """Store ``frame`` as ``name`` under ``dir_fd``; None if that directory was removed.
        What exists at ``name`` is looked at first only with fsync or no no-replace rename.
        A published block is appended to ``stored`` (its reservation and index entry are
        committed with its batch's)."""
        key = frame.key
        reserved = frame.nbytes  # the file's size, O_DIRECT or not (the padding is cut off)
        capacity = self._capacity
        if self._fsync or not self._publisher.refuses_existing:
            found = self._existing(view, dir_fd, name, key)
            if found is not None:
                return found
        for _attempt in range(2):  # a second time after setting a planted non-block aside
            if capacity.bounded:
                fits, victims = capacity.reserve(reserved)
                self._evict_files(view, victims)
                if not fits:
                    self._stats.add("put_rejected")
                    return Outcome.FAILED
            temp = b"%s%d-%d" % (_TEMP_PREFIX_BYTES, self._pid, next(self._temp_counter))
            try:
                write_temp(dir_fd, temp, frame.header, frame.payload,
                           direct=self._direct_io is DirectIO.ACTIVE, fsync=self._fsync,
                           scratch=self._scratch, on_direct_refused=self._disable_direct_io)
                published = self._publisher.publish(dir_fd, temp, dir_fd, name)
            except OSError as exc:
                capacity.release(reserved, key=None)
                try:
                    os.stat(temp, dir_fd=dir_fd, follow_symlinks=False)
                except OSError:
                    if isinstance(exc, FileNotFoundError):
                        return None  # no temp file: its directory is gone
                else:
                    self._unlink_quietly(dir_fd, temp, key)
                return self._fail("put", key, exc)
            if published:
                stored.append((key, reserved))
                return Outcome.OK
            capacity.release(reserved, key=None)
            found = self._existing(view, dir_fd, name, key)
            if found is not None:
                return found
        return Outcome.PRESENT  # set aside twice and re-planted: leave it to the next put

    def _existing(self, view: View, dir_fd: int, name: str, key: BlockKey) -> Outcome | None:
        """PRESENT if a regular file holds ``name``; None if nothing does (or a non-block did
        and was set aside; an unreadable one: the write reports the real error)."""
        try:
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return None
        if stat.S_ISREG(info.st_mode):
            self._evict_files(view, self._capacity.adopt(key, info.st_size))  # size on disk
            return Outcome.PRESENT
        self._stats.add("corrupt_objects")
        self._drop_bad(key, dir_fd, name, None, "not a regular file")
        return None
