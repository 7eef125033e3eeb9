"""S3-compatible backend: one object per block, named ``<prefix>/<namespace digest>/<key hex>``.

Any S3-compatible store (AWS S3, SeaweedFS, MinIO, Ceph RGW, ...) through ``obstore``'s async
API. Each object is exactly one codec frame, written in a single atomic PUT, so an object can
never tear into a header without its payload.

Threads and the state they own:

- Caller threads (any number, concurrently) validate arguments, submit one coroutine per batch
  call to the backend's private event loop and wait for it with a deadline. A caller that gives
  up (deadline passed, backend closing) marks its ``_Batch`` abandoned under the batch's lock.
- The event-loop thread (``kvtier-s3-<bucket>``, one per backend) owns the ``S3Store`` client,
  the request semaphore and ``_in_flight``/``_peak_in_flight``; it runs every request. It
  writes into a caller's buffers and batch results only under that batch's lock and only while
  the batch is not abandoned, so a caller that returned early never sees its buffers touched.
- ``_stats`` (:class:`BackendStats`), ``_warn`` (:class:`RateLimitedLog`) and ``_lifecycle``
  carry their own locks and are shared by both.

Put-if-absent: by default every PUT carries ``If-None-Match: *`` (``put_mode=if_none_match``);
the store answers 412 when the object exists, so an existing block is never overwritten, even
by two writers racing. For stores without conditional writes, ``put_mode=head_then_put`` does a
HEAD and PUTs only on 404. That leaves a window in which two writers can both see 404 and both
PUT; the later PUT replaces the earlier one. Keys are content hashes, so both carry the same
block and a reader sees one whole frame or the other (S3 PUTs are atomic); nothing corrupt can
be served, the cost is a redundant upload.

Failures: a request that fails for any reason other than "not found" / "already exists" answers
False for its key, is counted in ``errors`` and logged (rate-limited). The first such failure in
a batch makes the requests of that batch not yet started answer False without being sent
(``skipped``), so a dead server costs one timeout per batch, not one per key. The next call
tries again, so the backend recovers by itself once the server is back.

Corrupt objects (any codec frame error, including a frame of another namespace) are deleted
with one bulk DELETE per ``get_many``, but only those whose ETag, checked by a HEAD just before,
is still the one our GET saw: if another reader removed the bad object and a writer stored the
good block under that name meanwhile, the good block is kept. S3 has no portable conditional
DELETE, so a replacement landing between that HEAD and the DELETE (microseconds, against the
whole GET + verify before it) can still be lost: a cache miss, never wrong data.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import functools
import logging
import math
import re
import threading
import urllib.parse
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Generic, TypeVar

try:
    import obstore
    from obstore.exceptions import AlreadyExistsError, NotFoundError, PreconditionError
    from obstore.store import S3Store
except ImportError as _missing:  # pragma: no cover - depends on the install
    raise ImportError(
        "the s3:// backend needs the 'obstore' package (pip install 'obstore>=0.12')"
    ) from _missing

from kvtier.backends import redact_url, split_url_options
from kvtier.backends.base import (
    COMMON_SETTINGS,
    FAILED_FETCH,
    MISSING_FETCH,
    Backend,
    Fetched,
    Outcome,
    StoredFrame,
    load_auth_key,
)
from kvtier.keys import BlockKey, Namespace, check_key
from kvtier.settings import MAX_TIMEOUT_S, Kind, Setting, SettingsTable

__all__ = ["SETTINGS", "PutMode", "S3Backend", "S3Settings", "from_url", "parse_s3_url"]

MANIFEST_NAME = "namespace.json"
"""``<prefix>/<digest>/namespace.json`` holds the namespace manifest; a block's name is hex."""
_MANIFEST_WAIT_S = 2.0

_log = logging.getLogger(__name__)

_T = TypeVar("_T")
_R = TypeVar("_R")

_DEFAULT_MAX_CONCURRENCY = 32
_MAX_CONCURRENCY_LIMIT = 1024
_DEFAULT_TIMEOUT_S = 5.0
_MAX_DELETE_BATCH = 1000  # S3 DeleteObjects accepts at most 1000 keys per request
_CLOSE_JOIN_S = 5.0
# Bucket names per the S3 rules (lowercase, digits, dots, hyphens; underscore for old buckets).
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
_REGION_RE = re.compile(r"^[A-Za-z0-9-]{1,64}$")
_NOT_FOUND = (NotFoundError, FileNotFoundError)
_ALREADY_EXISTS = (AlreadyExistsError, PreconditionError)


class PutMode(enum.Enum):
    """How ``put_many`` keeps an existing object from being overwritten."""

    IF_NONE_MATCH = "if_none_match"
    """One conditional PUT (``If-None-Match: *``); race-free. Needs store support."""

    HEAD_THEN_PUT = "head_then_put"
    """HEAD, then a plain PUT on 404; a racing writer may replace an identical block."""


SETTINGS = SettingsTable("s3 backend", (
    Setting("endpoint_url", Kind.STR, None, nullable=True,
            help="http(s)://host[:port] of an S3-compatible store (default: AWS)"),
    Setting("region", Kind.STR, None, nullable=True, help="region name such as 'us-east-1'"),
    Setting("max_concurrency", Kind.INT, _DEFAULT_MAX_CONCURRENCY, minimum=1,
            maximum=_MAX_CONCURRENCY_LIMIT, help="requests in flight per backend"),
    Setting("timeout_s", Kind.FLOAT, _DEFAULT_TIMEOUT_S, minimum=0, strict_min=True, unit="s",
            maximum=MAX_TIMEOUT_S, help="per request, retries included"),
    Setting("put_mode", Kind.CHOICE, PutMode.IF_NONE_MATCH.value,
            choices=tuple(mode.value for mode in PutMode),
            help="if_none_match (conditional PUT, race-free) or head_then_put"),
    *COMMON_SETTINGS,
))


@dataclass(frozen=True, slots=True)
class S3Settings:
    """Where the blocks live and how the client behaves (parsed from the URL and options)."""

    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    max_concurrency: int = _DEFAULT_MAX_CONCURRENCY
    timeout_s: float = _DEFAULT_TIMEOUT_S
    put_mode: PutMode = PutMode.IF_NONE_MATCH
    auth_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.bucket, str) or not _BUCKET_RE.match(self.bucket):
            raise ValueError(
                f"s3 bucket {self.bucket!r} is not a valid bucket name; expected 3-63 "
                "characters of lowercase letters, digits, '.', '-' or '_'"
            )
        object.__setattr__(self, "prefix", _check_prefix(self.prefix))
        if self.endpoint_url is not None:
            object.__setattr__(self, "endpoint_url", _check_endpoint(self.endpoint_url))
        if self.region is not None and (
            not isinstance(self.region, str) or not _REGION_RE.match(self.region)
        ):
            raise ValueError(
                f"option region={self.region!r}: expected a region name such as 'us-east-1'"
            )
        for name in ("max_concurrency", "timeout_s"):
            object.__setattr__(self, name, SETTINGS[name].parse(getattr(self, name),
                                                                f"s3.{name}"))
        mode: object = self.put_mode  # strings arrive from URLs and config files
        if not isinstance(mode, PutMode):
            parsed = SETTINGS["put_mode"].parse(mode, "s3.put_mode")
            object.__setattr__(self, "put_mode", PutMode(parsed))

    @property
    def url(self) -> str:
        """The canonical ``s3://`` URL; it never carries credentials."""
        path = "/" + urllib.parse.quote(self.prefix) if self.prefix else ""
        query: list[tuple[str, str]] = []
        if self.endpoint_url is not None:
            query.append(("endpoint_url", self.endpoint_url))
        if self.region is not None:
            query.append(("region", self.region))
        suffix = "?" + urllib.parse.urlencode(query) if query else ""
        return f"s3://{self.bucket}{path}{suffix}"


def _check_prefix(prefix: object) -> str:
    if not isinstance(prefix, str):
        raise TypeError(f"s3 prefix must be a str, got {type(prefix).__name__}")
    stripped = prefix.strip("/")
    if not stripped:
        return ""
    for segment in stripped.split("/"):
        if segment in ("", ".", ".."):
            raise ValueError(
                f"s3 prefix {prefix!r} has an empty, '.' or '..' path segment; expected "
                "'name' or 'name/name/...'"
            )
        if any(ord(char) < 0x20 or char in "\\\x7f" for char in segment):
            raise ValueError(f"s3 prefix {prefix!r} contains a control character or backslash")
    return stripped


def _check_endpoint(endpoint_url: object) -> str:
    if not isinstance(endpoint_url, str):
        raise TypeError(f"option endpoint_url must be a str, got {type(endpoint_url).__name__}")
    try:
        parts = urllib.parse.urlsplit(endpoint_url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(
            f"option endpoint_url: bad URL ({exc}); expected http(s)://host[:port]"
        ) from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(
            f"option endpoint_url: scheme {parts.scheme!r} is not supported; "
            "expected http://host[:port] or https://host[:port]"
        )
    if "@" in parts.netloc:
        raise ValueError(
            "option endpoint_url must not carry credentials; set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY in the environment instead"
        )
    if not parts.hostname:
        raise ValueError(f"option endpoint_url {endpoint_url!r} has no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(
            f"option endpoint_url {endpoint_url!r} must not have a path, query or fragment; "
            "expected http(s)://host[:port]"
        )
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


# --------------------------------------------------------------------------- batches


class _BatchState(enum.Enum):
    ACTIVE = "active"
    FAILING = "failing"  # a request failed: the ones not yet sent are skipped
    ABANDONED = "abandoned"  # the caller returned: nothing more is sent or read


@dataclass(slots=True)
class _Batch(Generic[_R]):
    """One batch call: answers filled in by the loop thread, read by the caller."""

    results: list[_R]
    state: _BatchState = _BatchState.ACTIVE
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def accepting(self) -> bool:
        return self.state is _BatchState.ACTIVE

    def answer(self, index: int, result: _R) -> None:
        with self.lock:
            if self.state is not _BatchState.ABANDONED:
                self.results[index] = result

    def abandon(self) -> list[_R]:
        """Called by the caller when it stops waiting: freeze and return the answers so far."""
        with self.lock:
            self.state = _BatchState.ABANDONED
            return list(self.results)


# --------------------------------------------------------------------------- event loop


class _LoopThread:
    """A private asyncio event loop on a daemon thread."""

    __slots__ = ("_loop", "_thread")

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            if pending:
                self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.close()

    def submit(self, coroutine: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def stop(self, join_timeout_s: float) -> None:
        """Cancel what runs, stop the loop and join the thread (idempotent)."""
        if self._loop.is_closed():
            return

        def _cancel_all_and_stop() -> None:
            for task in asyncio.all_tasks(self._loop):
                task.cancel()
            self._loop.stop()

        try:
            self._loop.call_soon_threadsafe(_cancel_all_and_stop)
        except RuntimeError:  # the loop closed in between
            return
        if threading.current_thread() is not self._thread:
            self._thread.join(join_timeout_s)


# --------------------------------------------------------------------------- backend


class S3Backend(Backend):
    """A thread-safe block store on an S3-compatible object store (see module docstring).

    Credentials come from the standard environment (``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, web identity, container or instance
    credentials), never from the URL.
    """

    EXTRA_COUNTERS = ("timeouts", "skipped", "peak_in_flight")

    def __init__(self, namespace: Namespace, settings: S3Settings) -> None:
        if not isinstance(settings, S3Settings):
            raise TypeError(f"settings must be S3Settings, got {type(settings).__name__}")
        self._settings = settings
        super().__init__(namespace, name=f"s3 backend {settings.url}", logger=_log,
                         auth_key=settings.auth_key)
        base = f"{settings.prefix}/" if settings.prefix else ""
        self._object_prefix = f"{base}{namespace.digest_hex}/"
        self._store = _make_store(settings)
        timeout = settings.timeout_s
        # Only a safety net: requests time out on their own and a failing batch stops sending.
        # A head-then-put slot makes two requests.
        self._wave_timeout_s = 2 * timeout + 1.0
        # Bounds the requests in flight across all concurrent batch calls of this backend.
        self._slots = asyncio.Semaphore(settings.max_concurrency)
        self._in_flight = 0
        self._peak_in_flight = 0
        self._loop = _LoopThread(f"kvtier-s3-{settings.bucket}")
        # A backend dropped without close() must not leave its loop thread running forever.
        self._finalizer = weakref.finalize(self, self._loop.stop, 0.0)

    # -- identity -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self._settings.url

    @property
    def settings(self) -> S3Settings:
        return self._settings

    def object_name(self, key: BlockKey) -> str:
        """The object key (inside the bucket) that holds ``key``'s block."""
        return self._object_prefix + check_key(key).hex()

    # -- medium hooks (caller side) -----------------------------------------------------------

    def _m_exists(self, keys: list[BlockKey]) -> list[Outcome]:
        names = [self._object_prefix + key.hex() for key in keys]
        return self._run(_Batch([Outcome.FAILED] * len(names)),
                         lambda batch: self._exists_batch(batch, names))

    def _m_store(self, frames: list[StoredFrame]) -> list[Outcome]:
        return self._run(_Batch([Outcome.FAILED] * len(frames)),
                         lambda batch: self._put_batch(batch, frames))

    def _m_fetch(self, keys: list[BlockKey], outs: list[memoryview]) -> list[Fetched]:
        # The loop thread only downloads; the template verifies and copies on this thread, so
        # a caller's buffer is never touched by another thread.
        return self._run(_Batch([FAILED_FETCH] * len(keys)),
                         lambda batch: self._get_batch(batch, keys))

    def _m_remove_bad(self, bad: list[tuple[BlockKey, Fetched]]) -> None:
        targets = [(self._object_prefix + key.hex(),
                    item.token if isinstance(item.token, str) else None) for key, item in bad]
        self._run(_Batch([Outcome.FAILED] * len(targets)),
                  lambda batch: self._delete_unchanged(batch, targets))

    def _m_delete(self, keys: list[BlockKey]) -> None:
        names = [self._object_prefix + key.hex() for key in keys]
        self._run(_Batch([Outcome.FAILED] * len(names)),
                  lambda batch: self._delete_names(batch, names))

    def _m_write_manifest(self, document: bytes) -> None:
        """PUT ``<prefix>/<digest>/namespace.json`` on this backend's loop thread (S3 has no
        TTL: the manifest stays until purged). The open waits at most :data:`_MANIFEST_WAIT_S`
        for it, so a slow or hung server barely delays it; a PUT still running goes on, and a
        failure is logged."""
        name = self._object_prefix + MANIFEST_NAME

        async def put() -> None:
            await obstore.put_async(self._store, name, document)

        def report(done: concurrent.futures.Future[None]) -> None:
            error = None if done.cancelled() else done.exception()
            if error is not None:
                _log.warning("%s: could not write the namespace manifest %s: %s",
                             self.url, name, _short_error(error))

        pending = self._loop.submit(put())
        pending.add_done_callback(report)
        concurrent.futures.wait([pending], timeout=min(_MANIFEST_WAIT_S, self.settings.timeout_s))

    def _m_close(self) -> None:
        self._finalizer.detach()
        self._loop.stop(_CLOSE_JOIN_S)

    def _run(self, batch: _Batch[_R], make: Callable[[_Batch[_R]], Coroutine[Any, Any, None]]
             ) -> list[_R]:
        """Run one batch on the loop thread; never raises for I/O, never waits forever."""
        waves = math.ceil(max(len(batch.results), 1) / self._settings.max_concurrency)
        deadline_s = self._wave_timeout_s * (waves + 1)
        try:
            future = self._loop.submit(make(batch))
        except RuntimeError:  # the loop is gone: close() won the race with this call
            return batch.abandon()
        try:
            future.result(timeout=deadline_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            self._stats.add("timeouts")
            self._fail("batch", f"{len(batch.results)} keys",
                       TimeoutError(f"did not finish within {deadline_s:.1f}s"))
        except concurrent.futures.CancelledError:
            pass  # close() cancelled it; whatever finished before is still reported
        except Exception as exc:  # a bug in a batch coroutine must not reach the engine
            self._fail("batch", f"{len(batch.results)} keys", exc)
        return batch.abandon()

    # -- loop side ----------------------------------------------------------------------------

    async def _request(self, call: Awaitable[_T]) -> _T:
        """Await one request with the request timeout; counts the round trip."""
        self._stats.add("round_trips")
        async with asyncio.timeout(self._settings.timeout_s):
            return await call

    def _failed(self, batch: _Batch[Any], what: str, name: str, exc: BaseException) -> Outcome:
        with batch.lock:
            if batch.state is _BatchState.ACTIVE:
                batch.state = _BatchState.FAILING
        if isinstance(exc, TimeoutError):
            self._stats.add("timeouts")
        return self._fail(what, name, exc)

    def _enter(self) -> None:
        self._in_flight += 1
        if self._in_flight > self._peak_in_flight:
            self._peak_in_flight = self._in_flight
            self._stats.set("peak_in_flight", self._peak_in_flight)

    def _leave(self) -> None:
        self._in_flight -= 1

    async def _slot(self, batch: _Batch[Any], index: int,
                    request: Callable[[], Awaitable[_R]]) -> None:
        """Run one request in a concurrency slot unless the batch stopped accepting."""
        async with self._slots:
            if not batch.accepting:
                self._stats.add("skipped")
                return
            self._enter()
            try:
                result = await request()
            finally:
                self._leave()
        batch.answer(index, result)

    async def _head(self, batch: _Batch[Any], name: str) -> Outcome:
        try:
            await self._request(obstore.head_async(self._store, name))
        except _NOT_FOUND:
            return Outcome.MISSING
        except Exception as exc:
            return self._failed(batch, "HEAD", name, exc)
        return Outcome.OK

    async def _exists_batch(self, batch: _Batch[Outcome], names: list[str]) -> None:
        await asyncio.gather(*(
            self._slot(batch, index, functools.partial(self._head, batch, name))
            for index, name in enumerate(names)
        ))

    async def _put_batch(self, batch: _Batch[Outcome], frames: list[StoredFrame]) -> None:
        mode = self._settings.put_mode

        async def one(frame: StoredFrame) -> Outcome:
            name = self._object_prefix + frame.key.hex()
            # The caller's buffer may only be read while the caller still waits.
            with batch.lock:
                if batch.state is not _BatchState.ACTIVE:
                    self._stats.add("skipped")
                    return Outcome.FAILED
                value = frame.joined()
            return await self._put_one(batch, name, value, mode)

        await asyncio.gather(*(
            self._slot(batch, index, functools.partial(one, frame))
            for index, frame in enumerate(frames)
        ))

    async def _put_one(self, batch: _Batch[Outcome], name: str, frame: bytearray,
                       mode: PutMode) -> Outcome:
        if mode is PutMode.HEAD_THEN_PUT:
            present = await self._head(batch, name)
            if present is Outcome.OK:
                return Outcome.PRESENT
            if present is Outcome.FAILED:
                return present
        try:
            await self._request(
                obstore.put_async(
                    self._store,
                    name,
                    frame,
                    mode="create" if mode is PutMode.IF_NONE_MATCH else "overwrite",
                    use_multipart=False,
                ),
            )
        except _ALREADY_EXISTS:
            return Outcome.PRESENT
        except Exception as exc:
            return self._failed(batch, "PUT", name, exc)
        return Outcome.OK

    async def _download(self, name: str) -> tuple[obstore.Bytes, str | None]:
        """The object's bytes and the ETag of that version (None if the store sent none)."""
        result = await obstore.get_async(self._store, name)
        return await result.bytes_async(), result.meta.get("e_tag")

    async def _fetch(self, batch: _Batch[Fetched], name: str) -> Fetched:
        try:
            data, e_tag = await self._request(self._download(name))
        except _NOT_FOUND:
            return MISSING_FETCH
        except Exception as exc:
            self._failed(batch, "GET", name, exc)
            return FAILED_FETCH
        # obstore's Bytes exports a read-only buffer: verified and copied into out once.
        return Fetched(Outcome.OK, frame=memoryview(data), token=e_tag)

    async def _get_batch(self, batch: _Batch[Fetched], keys: list[BlockKey]) -> None:
        await asyncio.gather(*(
            self._slot(batch, index,
                       functools.partial(self._fetch, batch, self._object_prefix + key.hex()))
            for index, key in enumerate(keys)
        ))

    async def _delete_unchanged(self, batch: _Batch[Outcome],
                                corrupt: list[tuple[str, str | None]]) -> None:
        """Delete the bad objects that still carry the ETag we read (see module docstring)."""
        doomed: list[str] = []

        async def check(name: str, e_tag: str | None) -> Outcome:
            if e_tag is None:  # no ETag to compare: the old unconditional delete
                doomed.append(name)
                return Outcome.OK
            try:
                meta = await self._request(obstore.head_async(self._store, name))
            except _NOT_FOUND:
                return Outcome.MISSING  # already gone
            except Exception as exc:
                return self._failed(batch, "HEAD", name, exc)
            if meta.get("e_tag") == e_tag:
                doomed.append(name)
            return Outcome.OK

        await asyncio.gather(*(
            self._slot(batch, index, functools.partial(check, name, e_tag))
            for index, (name, e_tag) in enumerate(corrupt)
        ))
        if doomed:
            await self._delete_names(batch, doomed)

    async def _delete_names(self, batch: _Batch[Outcome], names: list[str]) -> None:
        for start in range(0, len(names), _MAX_DELETE_BATCH):
            chunk = names[start : start + _MAX_DELETE_BATCH]
            async with self._slots:
                self._enter()
                try:
                    await self._request(obstore.delete_async(self._store, chunk))
                except _NOT_FOUND:
                    pass
                except Exception as exc:
                    self._failed(batch, "DELETE", chunk[0], exc)
                    return
                finally:
                    self._leave()


def _short_error(exc: BaseException) -> str:
    """The first line of an error: obstore messages carry a multi-line debug dump."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _make_store(settings: S3Settings) -> S3Store:
    client_options: dict[str, Any] = {
        "timeout": timedelta(seconds=settings.timeout_s),
        "connect_timeout": timedelta(seconds=settings.timeout_s),
        "pool_max_idle_per_host": str(settings.max_concurrency),
    }
    config: dict[str, Any] = {}
    if settings.endpoint_url is not None:
        config["endpoint"] = settings.endpoint_url
        # Custom endpoints (SeaweedFS, MinIO, Ceph) address buckets by path, not by host name.
        config["virtual_hosted_style_request"] = False
        if settings.endpoint_url.startswith("http://"):
            client_options["allow_http"] = True
    if settings.region is not None:
        config["region"] = settings.region
    retry_config: dict[str, Any] = {
        "max_retries": 2,
        "retry_timeout": timedelta(seconds=settings.timeout_s),
        "backoff": {
            "init_backoff": timedelta(milliseconds=20),
            "max_backoff": timedelta(milliseconds=200),
            "base": 2,
        },
    }
    try:
        return S3Store(
            settings.bucket,
            config=config,  # type: ignore[arg-type]
            client_options=client_options,  # type: ignore[arg-type]
            retry_config=retry_config,  # type: ignore[arg-type]
        )
    except Exception as exc:
        raise ValueError(f"cannot configure the s3 client for {settings.url}: {exc}") from exc


def from_url(url: str, namespace: Namespace, options: dict[str, Any]) -> S3Backend:
    """Build an :class:`S3Backend` from ``s3://bucket[/prefix][?option=value&...]`` (see
    :func:`parse_s3_url`)."""
    return S3Backend(namespace, parse_s3_url(url, options))


def parse_s3_url(url: str, options: dict[str, Any]) -> S3Settings:
    """The validated settings of ``s3://bucket[/prefix][?option=value&...]``, touching nothing.

    Options (query string or keyword, not both): ``endpoint_url`` (``http(s)://host[:port]``,
    default AWS), ``region``, ``max_concurrency`` (requests in flight, default 32),
    ``timeout_s`` (per request, retries included, default 5), ``put_mode``
    (``if_none_match`` or ``head_then_put``; the older ``if-none-match`` spellings work too).
    """
    try:
        parts, merged = split_url_options(url, options)
    except ValueError as exc:
        raise ValueError(f"bad s3 URL {redact_url(url)!r}: {exc}") from exc
    if parts.scheme != "s3":
        raise ValueError(f"s3 backend URL must start with s3://, got {redact_url(url)!r}")
    if "@" in parts.netloc:
        raise ValueError(
            "s3 URL must not carry credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "in the environment instead"
        )
    if not parts.netloc:
        raise ValueError(f"s3 URL {redact_url(url)!r} has no bucket; expected s3://bucket[/prefix]")
    if ":" in parts.netloc:
        raise ValueError(
            f"s3 URL bucket {parts.netloc!r} has a port; put the server in "
            "?endpoint_url=http(s)://host:port"
        )
    if parts.fragment:
        raise ValueError(f"s3 URL {redact_url(url)!r} must not have a #fragment")
    parsed = SETTINGS.parse(merged, "s3")
    settings = S3Settings(
        bucket=parts.netloc,
        prefix=urllib.parse.unquote(parts.path),
        endpoint_url=parsed["endpoint_url"],
        region=parsed["region"],
        max_concurrency=parsed["max_concurrency"],
        timeout_s=parsed["timeout_s"],
        put_mode=PutMode(parsed["put_mode"]),
        auth_key=load_auth_key(parsed, "s3"),
    )
    return settings
