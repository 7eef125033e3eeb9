"""The :class:`Backend` template: every rule of the backend contract, once, over per-medium hooks.

A backend medium (memory, file, redis, s3, or one registered from outside) subclasses
:class:`Backend` and implements a handful of small hooks that each return one
:class:`Outcome` per key. The public methods here own everything else:

- argument validation (``TypeError`` / ``ValueError`` before any I/O);
- the lifecycle (any call after ``close()`` raises :class:`BackendClosedError`);
- one counter vocabulary (:data:`STANDARD_COUNTERS`, identical keys in every backend;
  ``bytes_read`` / ``bytes_written`` count payload bytes of successful transfers only);
- frame encoding and verification (:class:`kvtier.codec.FrameCodec`, keyed or not), and the
  conditional removal of every corrupt or unauthenticated object so the owner's next store
  replaces it;
- replacement by the next store: a frame served under an older key of the ring or in an older
  format, and a frame refused as foreign (another key, a newer kvtier: left in place, never
  served), is rewritten by this backend's next store of its key (``put`` never overwrites a
  present block otherwise);
- the tier's manifest at open (:meth:`Backend.open_for_writing`): a writer without a key is
  refused where the manifest says the tier is keyed;
- rate-limited logging of failures.

The load contract: ``get_many`` answers True where ``out`` now holds the verified block. Where it
answers False the contents of ``out`` are unspecified (a medium may read straight into it before
verifying); callers publish a destination only after a True answer.

State and owners:

- :class:`BackendStats` counters: written by any thread calling into the backend, guarded by the
  object's own lock.
- :class:`RateLimitedLog` timestamps: any thread, guarded by the object's own lock.
- :class:`Lifecycle` state: any thread; ``close()`` flips it once, under its lock.
- :class:`ReplaceableKeys` (the keys the next store rewrites): any thread calling
  ``get_many`` / ``put_many``, guarded by the object's own lock.
- :class:`EvictedKeys` (``evicted``: the keys the medium evicted itself, until taken): noted by
  any thread whose store or load evicts, taken by the owning tier's scheduler thread; guarded
  by the object's own lock.
- everything else a medium owns is described in its own module docstring.

Backends are synchronous and thread-safe. A batch call never raises for an I/O error (the
affected keys answer False, the error is counted and logged); it raises ``TypeError`` /
``ValueError`` only for bad arguments, and :class:`BackendClosedError` after ``close()``.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from typing import NamedTuple

from kvtier import codec
from kvtier.backends.args import check_get_args, check_keys, check_put_args
from kvtier.backends.auth import COMMON_SETTINGS, load_auth_key
from kvtier.backends.lifecycle import Lifecycle
from kvtier.backends.manifest import TierAuth, manifest_auth, manifest_document
from kvtier.backends.stats import BackendStats, RateLimitedLog
from kvtier.codec import Buffer, KeyRing, Provenance
from kvtier.errors import KvtierError
from kvtier.keys import BlockKey, Namespace
from kvtier.lru import BoundedLRU
from kvtier.settings import ConfigError
from kvtier.text import first_line

__all__ = [
    "COMMON_SETTINGS",
    "COPIED_FETCH",
    "AuthKey",
    "Backend",
    "BackendUnavailableError",
    "Buffer",
    "EvictedKeys",
    "Fetched",
    "NoTierError",
    "OpenMode",
    "Outcome",
    "ReplaceableKeys",
    "StoredFrame",
    "UnkeyedWriterError",
    "encode_frames",
    "load_auth_key",
]

_log = logging.getLogger(__name__)

AuthKey = bytes | KeyRing
"""One auth key, or a ring of them (the first signs, every one verifies)."""
_NEW_TUPLE = tuple.__new__
_MAX_REPLACEABLE = 65536  # keys remembered for rewriting; one that falls out is found again


class UnkeyedWriterError(ConfigError):
    """A writer without an auth key opened a tier whose manifest says its frames are keyed."""



def encode_frames(encoder: codec.FrameCodec, keys: list[BlockKey],
                  payloads: list[memoryview]) -> list[StoredFrame]:
    """The frames of a batch, each record encoded by ``encoder``."""
    records = encoder.encode_records(keys, payloads)
    # Each StoredFrame built by tuple.__new__ at C speed (a NamedTuple's own __new__ is a
    # Python call per block).
    return list(map(_NEW_TUPLE, repeat(StoredFrame, len(keys)),
                    zip(keys, records, payloads, strict=True)))


class ReplaceableKeys:
    """The keys whose stored frame the next store rewrites (a load served it under an older
    key or format, or refused it as foreign), at most ``bound``: the oldest is forgotten and
    found again by its next load. Thread-safe (its own lock)."""

    __slots__ = ("_keys", "_lock")

    def __init__(self, bound: int) -> None:
        self._keys: BoundedLRU[BlockKey, None] = BoundedLRU(bound)
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        # Unlocked: a stale answer costs one locked look, or leaves a rewrite to the next store.
        return bool(self._keys)

    def note(self, keys: list[BlockKey]) -> None:
        with self._lock:
            for key in keys:
                self._keys.put(key, None)

    def take(self, keys: list[BlockKey]) -> list[BlockKey]:
        """Those of ``keys`` (once each) that the next store rewrites, forgotten here."""
        with self._lock:
            doomed = [key for key in dict.fromkeys(keys) if key in self._keys]
            for key in doomed:
                self._keys.pop(key)
        return doomed


class EvictedKeys:
    """Keys a medium evicted itself (its ``max_bytes``), kept until the owning tier takes them
    to correct its lookup manager's verdicts; at most ``bound``, the oldest dropped first (a
    verdict it would have corrected costs one failed load, then a recompute). Thread-safe (its
    own lock)."""

    __slots__ = ("_keys", "_lock")

    def __init__(self, bound: int) -> None:
        self._keys: deque[BlockKey] = deque(maxlen=bound)
        self._lock = threading.Lock()

    def note(self, keys: Iterable[BlockKey]) -> None:
        with self._lock:
            self._keys.extend(keys)

    def take(self) -> list[BlockKey]:
        """Every key noted since the last take, oldest first."""
        if not self._keys:  # unlocked: a stale empty leaves the keys to the next take
            return []
        with self._lock:
            keys = list(self._keys)
            self._keys.clear()
        return keys


class BackendUnavailableError(KvtierError, RuntimeError):
    """:meth:`Backend.probe` could not answer for every key (I/O error, lost connection).

    ``exists`` turns such keys into False; ``probe`` raises instead, so that a lookup manager can
    tell "absent" from "unknown": unknown answers are never cached and feed its circuit breaker.
    """


class OpenMode(enum.Enum):
    """What an opened backend is for."""

    READ_WRITE = "read_write"
    """Storing blocks: the namespace manifest is written next to them (see kvtier.ops.inventory)."""
    READ_ONLY = "read_only"
    """Looking only (``kvtier inspect``): nothing is created or written on the medium at open,
    and a medium that is not there raises :class:`NoTierError` instead of being created."""
    INSPECT = "read_only"  # the old name of READ_ONLY (an alias: the same member)


class NoTierError(KvtierError, LookupError):
    """A read-only open or listing found no tier at the URL (a file tier's root directory is
    missing or not a directory): nothing there was ever stored, and nothing was created."""


class Outcome(enum.Enum):
    """What a medium hook found for one key."""

    OK = "ok"            # present / stored / read
    PRESENT = "present"  # a store found the block already there (never overwritten)
    MISSING = "missing"  # no object under the key
    CORRUPT = "corrupt"  # an object that cannot be a frame (wrong type, not a regular file, ...)
    FAILED = "failed"    # an I/O error (already logged by the medium through ``_fail``)


class Verdict(enum.Enum):
    """What the template's verification made of a fetched frame."""

    VALID = "valid"
    OLDER_KEY = "older_key"      # served; counted in auth_old_key; the next store rewrites it
    OLDER_FORMAT = "older_format"  # served; counted in old_format; the next store rewrites it
    CORRUPT = "corrupt"          # counted in corrupt_objects, removed
    UNAUTHENTIC = "unauthentic"  # counted in auth_failures, removed
    FOREIGN_KEY = "foreign_key"  # another key's frame: counted in auth_failures, left in place
    FOREIGN = "foreign"          # a newer kvtier's frame: counted in corrupt_objects, left
    WRONG_SIZE = "wrong_size"    # a valid frame, not the caller's size: counted in
    #                              size_mismatches, removed (it would lock its key)


_SERVED = frozenset({Verdict.VALID, Verdict.OLDER_KEY, Verdict.OLDER_FORMAT})
_REPLACEABLE = frozenset({Verdict.OLDER_KEY, Verdict.OLDER_FORMAT, Verdict.FOREIGN_KEY,
                          Verdict.FOREIGN})
# A valid frame of another payload length (stored before ``block_bytes`` changed) is removed
# too: it can never be served to this caller, and kept it would lock its key for good, since a
# store never overwrites.
_REMOVED = frozenset({Verdict.CORRUPT, Verdict.UNAUTHENTIC, Verdict.WRONG_SIZE})
_COUNTER_OF = {Verdict.OLDER_KEY: "auth_old_key", Verdict.OLDER_FORMAT: "old_format",
               Verdict.CORRUPT: "corrupt_objects", Verdict.UNAUTHENTIC: "auth_failures",
               Verdict.FOREIGN_KEY: "auth_failures", Verdict.FOREIGN: "corrupt_objects",
               Verdict.WRONG_SIZE: "size_mismatches"}
_PROVENANCE_VERDICT = {Provenance.CURRENT: Verdict.VALID, Provenance.OLDER_KEY: Verdict.OLDER_KEY,
                       Provenance.OLDER_FORMAT: Verdict.OLDER_FORMAT}


class Fetched(NamedTuple):
    """What a medium read for one key.

    With ``outcome`` OK, exactly one of:

    - ``frame``: a whole stored frame (header + payload) in the medium's memory; the template
      verifies it and copies the payload into ``out``;
    - ``header``: the frame's ``HEADER_BYTES`` record (its header, or its format-4 trailer), the
      payload already read into ``out`` (``payload_bytes`` is how many bytes the object carried
      besides the record); the template verifies in place.

    ``token`` identifies the object that was read (an inode, a SHA-1, an ETag) so that a
    conditional delete removes that object and never a good block stored since. It may be a
    zero-argument callable instead (the file tier's ``fstat`` of the descriptor it read): the
    template calls it only for an object it removes, before asking for the next item. ``trusted``
    means the medium guarantees these bytes are a frame this very instance encoded and nobody
    else can have written (the private memory store): the checksum pass is skipped, the header
    is still checked. (A named tuple: one is built per key on the load path, and a tuple is the
    cheapest immutable record to build.)
    """

    outcome: Outcome
    frame: memoryview | None = None
    header: bytes | bytearray | memoryview | None = None
    payload_bytes: int = 0
    token: object = None
    trusted: bool = False


MISSING_FETCH = Fetched(Outcome.MISSING)
COPIED_FETCH = Fetched(Outcome.OK, trusted=True)
"""The payload is in ``out`` and nothing is left to judge: a copy of a frame this very instance
encoded (the private memory store), or a frame the medium already verified exactly as the
codec's current unkeyed format for its key (the file tier's native check,
:func:`~kvtier.backends.file.reads`)."""
FAILED_FETCH = Fetched(Outcome.FAILED)
CORRUPT_FETCH = Fetched(Outcome.CORRUPT)


class StoredFrame(NamedTuple):
    """One frame to store: the encoded record and the caller's payload (not copied).

    ``header`` is the record as the backend's :attr:`Backend.FRAME_LAYOUT` places it: before
    the payload (``HEADER``) or after it (``TRAILER``). (A named tuple, like :class:`Fetched`:
    one is built per key on the store path.)"""

    key: BlockKey
    header: bytes
    payload: memoryview

    @property
    def nbytes(self) -> int:
        return len(self.header) + self.payload.nbytes

    def joined(self) -> bytearray:
        """Header + payload in one buffer (one copy), for media that need a contiguous value
        (a header-layout medium's: every medium but the file tier)."""
        frame = bytearray(self.header)
        frame += self.payload
        return frame


# --------------------------------------------------------------------------- the template


class Backend:
    """A synchronous, thread-safe block store bound to one :class:`Namespace`.

    Subclasses implement the ``_m_*`` hooks (one :class:`Outcome` / :class:`Fetched` per key,
    never raising for I/O: they log through :meth:`_fail` and answer FAILED) and call
    ``super().__init__``. Everything public is implemented here, once.
    """

    EXTRA_COUNTERS: tuple[str, ...] = ()
    """Medium-specific counters reported besides :data:`STANDARD_COUNTERS`."""

    parallel_stores: int | None = None
    """How many stores at once pay off on this medium (None: as many as the caller runs); a
    tier runs at most this many store jobs side by side unless configured otherwise. Set once
    by the subclass's ``__init__``, read-only after."""

    block_lifetime_s: float | None = None
    """The least time a block stays after its store, where the medium expires blocks itself
    (Redis ``ttl_s``); None: until it is evicted or deleted. The lookup manager trusts its own
    stores no longer than this (``stored_verdict_ttl_s``). Set once by the subclass's
    ``__init__``, read-only after."""

    FRAME_LAYOUT: codec.FrameLayout = codec.FrameLayout.HEADER
    """Where this medium's frames carry their record: :attr:`StoredFrame.header` is a header
    (written before the payload) or, for ``TRAILER``, a trailer (written after it)."""

    def __init__(
        self,
        namespace: Namespace,
        *,
        name: str,
        logger: logging.Logger,
        auth_key: AuthKey | None = None,
    ) -> None:
        if not isinstance(namespace, Namespace):
            raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
        self._namespace = namespace
        self._digest = namespace.digest
        self._codec = codec.FrameCodec(namespace.digest, auth_key, self.FRAME_LAYOUT)
        self._replaceable = ReplaceableKeys(_MAX_REPLACEABLE)
        # The keys this backend evicted itself (max_bytes), never those another process
        # removed: the owning tier takes them to stop vouching for them (note_removed).
        self.evicted = EvictedKeys(_MAX_REPLACEABLE)
        self._stats = BackendStats(extra=self.EXTRA_COUNTERS)
        self._error_log = RateLimitedLog(logger)
        self._lifecycle = Lifecycle(name)

    # ------------------------------------------------------------------ identity

    @property
    def namespace(self) -> Namespace:
        return self._namespace

    @property
    def url(self) -> str:
        """The backend's URL with credentials redacted."""
        raise NotImplementedError

    @property
    def authenticated(self) -> bool:
        """Whether frames carry (and must carry) a keyed MAC."""
        return self._codec.keyed

    # ------------------------------------------------------------------ public API

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """True where the block is stored; False where absent or where the check failed."""
        return [outcome is Outcome.OK for outcome in self._check_exists(keys)]

    def probe(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Like :meth:`exists`, but raises :class:`BackendUnavailableError` if any check failed."""
        outcomes = self._check_exists(keys)
        failed = sum(outcome is Outcome.FAILED for outcome in outcomes)
        if failed:
            raise BackendUnavailableError(
                f"{self.url}: {failed} of {len(outcomes)} existence check(s) failed"
            )
        return [outcome is Outcome.OK for outcome in outcomes]

    def put_many(self, keys: Sequence[BlockKey], payloads: Sequence[Buffer]) -> list[bool]:
        """True where stored or already present; False where it failed. A present block is
        never overwritten, unless this backend's load found it replaceable (older key or
        format, or foreign): then it is replaced."""
        key_list, views = check_put_args(keys, payloads)
        self._lifecycle.check_open()
        count = len(key_list)
        if not count:
            return []
        if self._replaceable and (doomed := self._replaceable.take(key_list)):
            # Unconditional: whatever is stored under such a key now, this store writes a frame
            # every holder of the current key serves, so nothing is lost by replacing it.
            self._m_delete(doomed)
        outcomes = self._checked(self._m_store_blocks(key_list, views), count, "store")
        if outcomes.count(Outcome.OK) == count:
            # Every block written (the common case): one counter update, no per-block pass.
            # (``count`` compares by identity first; a flat byte view's len is its nbytes.)
            self._stats.add_many({"puts": count, "bytes_written": sum(map(len, views))})
            return [True] * count
        written = sum(view.nbytes for view, outcome in zip(views, outcomes, strict=True)
                      if outcome is Outcome.OK)
        existing = sum(outcome is Outcome.PRESENT for outcome in outcomes)
        self._stats.add_many({"puts": len(key_list), "puts_existing": existing,
                              "bytes_written": written})
        return [outcome in (Outcome.OK, Outcome.PRESENT) for outcome in outcomes]

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[memoryview]) -> list[bool]:
        """True where ``out`` now holds the verified block; where False, ``out`` is unspecified."""
        key_list, views = check_get_args(keys, outs)
        self._lifecycle.check_open()
        count = len(key_list)
        if not count:
            return []
        fetched = self._m_fetch(key_list, views)
        if type(fetched) is list and len(fetched) == count and \
                fetched.count(COPIED_FETCH) == count:
            # Every block copied from frames this instance encoded (the private memory store):
            # nothing to judge, one counter update. (``count`` compares by identity first.)
            self._stats.add_many({"gets": count, "hits": count,
                                  "bytes_read": sum(map(len, views))})
            return [True] * count
        # Else each item judged, bad objects removed, stale ones remembered for rewriting, the
        # counters updated once.
        results: list[bool] = []
        append = results.append
        doomed: list[tuple[BlockKey, Fetched]] = []
        stale: list[BlockKey] = []
        counts = dict.fromkeys(("corrupt_objects", "auth_failures", "auth_old_key",
                                "old_format", "size_mismatches"), 0)
        bytes_read = 0
        current = self._codec.is_current
        # One item at a time: a medium may reuse a scratch buffer for the next key.
        for key, out, item in zip(key_list, views, fetched, strict=False):
            if item is COPIED_FETCH or (item.header is not None and current(
                    item.header, key, out, item.payload_bytes)):
                # The common cases, without a call to _judge and a set lookup (an enum's hash
                # is slow): a private copy, or a current unkeyed record that verified.
                append(True)
                bytes_read += out.nbytes
                continue
            verdict = self._judge(key, out, item)
            append(verdict in _SERVED)
            if verdict is None:
                continue
            if verdict in _SERVED:
                bytes_read += out.nbytes
            if verdict is not Verdict.VALID:
                counts[_COUNTER_OF[verdict]] += 1
            if verdict in _REMOVED:
                if callable(item.token):  # resolved now: the medium still holds what it read
                    item = item._replace(token=item.token())
                doomed.append((key, item))
            elif verdict in _REPLACEABLE:
                stale.append(key)
        if len(results) != len(key_list):
            self._fail("fetch", len(key_list),
                       RuntimeError(f"{len(results)} answers for {len(key_list)} keys"))
            results += [False] * (len(key_list) - len(results))
        if doomed:
            self._m_remove_bad(doomed)
        if stale:
            self._replaceable.note(stale)
        hits = sum(results)
        self._stats.add_many({"gets": len(key_list), "hits": hits,
                              "misses": len(key_list) - hits, "bytes_read": bytes_read,
                              **counts})
        return results

    def delete(self, keys: Sequence[BlockKey]) -> None:
        """Remove the blocks (absent keys are fine)."""
        key_list = check_keys(keys)
        self._lifecycle.check_open()
        self._stats.add("deletes", len(key_list))
        if key_list:
            self._m_delete(list(dict.fromkeys(key_list)))

    def open_for_writing(self) -> None:
        """Check the tier's manifest against this writer's key, then store this namespace's
        manifest (saying whether its frames are keyed). Called once at open for writing.

        A writer without a key on a tier whose manifest says keyed raises
        :class:`UnkeyedWriterError` and writes nothing: its frames would be refused by every
        keyed reader, and it would refuse theirs. A keyed writer on a tier whose manifest says
        unkeyed turns the tier keyed (that is how authentication is turned on); from then on
        writers without a key are refused at open. I/O errors propagate (the caller logs them).
        """
        self._lifecycle.check_open()
        self._m_update_manifest(self._manifest_for)

    def _manifest_for(self, stored: bytes | None) -> bytes:
        """The manifest this writer stores over ``stored`` (or :class:`UnkeyedWriterError`)."""
        found = manifest_auth(stored, self._namespace.digest_hex)
        mine = TierAuth.KEYED if self.authenticated else TierAuth.UNKEYED
        if found is TierAuth.KEYED and mine is TierAuth.UNKEYED:
            raise UnkeyedWriterError(
                f"{self.url}: the tier's manifest for namespace {self._namespace.digest_hex} says "
                "its frames are keyed, but this writer has no auth_key; give it the tier's "
                "auth_key or auth_key_file")
        if found is TierAuth.UNKEYED and mine is TierAuth.KEYED:
            _log.warning("%s: turning on authentication for namespace %s (its manifest said "
                         "unkeyed): unkeyed frames are refused from now on, and writers without "
                         "a key are refused at open", self.url, self._namespace.digest_hex)
        return manifest_document(self._namespace, mine)

    def write_manifest(self, document: bytes) -> None:
        """Store ``document`` as the namespace manifest next to the blocks, where the medium is
        shared (the default: nowhere, for a private medium); may raise."""
        self._lifecycle.check_open()
        self._m_update_manifest(lambda _stored: document)

    def _m_update_manifest(self, decide: Callable[[bytes | None], bytes]) -> None:
        """Hook: read this namespace's manifest as stored (None: absent, or not a manifest: a
        FIFO, another type, too large), and store ``decide(stored)`` unless it is what is
        stored; when ``decide`` raises, store nothing. Default: a private medium keeps none."""

    def close(self) -> None:
        """Release the medium's resources; later calls raise :class:`BackendClosedError`."""
        if self._lifecycle.close():
            self._m_close()

    def stats(self) -> dict[str, int]:
        snapshot = self._stats.snapshot()
        snapshot.update(self._m_extra_stats())
        return snapshot

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url}, namespace={self._namespace.digest_hex})"

    # ------------------------------------------------------------------ shared helpers

    def _fail(self, operation: str, what: object, exc: BaseException) -> Outcome:
        """Count and log (rate-limited) one failure; answers FAILED for the hooks' convenience."""
        self._stats.add("errors")
        detail = what.hex() if isinstance(what, bytes) else str(what)
        self._error_log.warning("%s: %s of %s failed: %s: %s", self.url, operation, detail,
                                type(exc).__name__, first_line(exc))
        return Outcome.FAILED

    def _check_exists(self, keys: Sequence[BlockKey]) -> list[Outcome]:
        key_list = check_keys(keys)
        self._lifecycle.check_open()
        self._stats.add("exists_calls")
        if not key_list:
            return []
        return self._checked(self._m_exists(key_list), len(key_list), "exists")

    def _checked(self, outcomes: list[Outcome], expected: int, operation: str) -> list[Outcome]:
        if len(outcomes) != expected:
            self._fail(operation, expected,
                       RuntimeError(f"{len(outcomes)} answers for {expected} keys"))
            return [Outcome.FAILED] * expected
        return outcomes

    def _judge(self, key: BlockKey, out: memoryview, item: Fetched) -> Verdict | None:
        """The verdict on one fetched object; None where nothing was read (missing / failed)."""
        if item is COPIED_FETCH:
            return Verdict.VALID
        if item.outcome is Outcome.CORRUPT:
            return Verdict.CORRUPT
        if item.outcome is not Outcome.OK:
            return None
        try:
            if item.frame is not None:
                provenance = self._codec.decode(item.frame, key, out, trusted=item.trusted)
            elif item.header is not None:
                provenance = self._codec.verify_in_place(item.header, key, out,
                                                         item.payload_bytes)
            else:
                raise codec.TruncatedFrame("the medium returned neither a frame nor a header")
        except codec.OutputSizeMismatch:
            return Verdict.WRONG_SIZE
        except codec.ForeignFrame as exc:
            self._error_log.warning("%s: refusing block %s (left for its writer; the next store "
                                    "replaces it): %s", self.url, key.hex(), exc)
            return (Verdict.FOREIGN_KEY if isinstance(exc, codec.AuthenticationError)
                    else Verdict.FOREIGN)
        except codec.AuthenticationError as exc:
            self._error_log.warning("%s: removing unauthenticated block %s: %s",
                                    self.url, key.hex(), exc)
            return Verdict.UNAUTHENTIC
        except codec.FrameError as exc:
            self._error_log.warning("%s: removing corrupt block %s: %s", self.url, key.hex(), exc)
            return Verdict.CORRUPT
        return _PROVENANCE_VERDICT[provenance]

    # ------------------------------------------------------------------ medium hooks

    def _m_exists(self, keys: list[BlockKey]) -> list[Outcome]:
        """OK / MISSING / FAILED per key."""
        raise NotImplementedError

    def _m_store(self, frames: list[StoredFrame]) -> list[Outcome]:
        """Store each frame unless its key is present: OK (written) / PRESENT / FAILED."""
        raise NotImplementedError

    def _m_store_blocks(self, keys: list[BlockKey], payloads: list[memoryview]) -> list[Outcome]:
        """Hook: :meth:`_m_store` of the batch's frames, encoded here. A medium that seals its
        records itself (the file tier's native store) overrides it and hands what it does not
        take to :func:`encode_frames`."""
        return self._m_store(encode_frames(self._codec, keys, payloads))

    def _m_fetch(self, keys: list[BlockKey], outs: list[memoryview]) -> Iterable[Fetched]:
        """One :class:`Fetched` per key, in order; may read payloads straight into ``outs``.

        The template verifies each item before asking for the next, so a generator may reuse
        one scratch buffer. ``frame`` / ``header`` must stay valid only until then.
        """
        raise NotImplementedError

    def _m_remove_bad(self, bad: list[tuple[BlockKey, Fetched]]) -> None:
        """Remove each bad object only if it is still the one read (``Fetched.token``)."""
        raise NotImplementedError

    def _m_delete(self, keys: list[BlockKey]) -> None:
        raise NotImplementedError

    def _m_close(self) -> None:
        """Release resources (called once)."""

    def _m_extra_stats(self) -> dict[str, int]:
        """Gauges computed at ``stats()`` time (blocks held, bytes used, ...)."""
        return {}
