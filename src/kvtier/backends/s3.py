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

Put-if-absent: by default every PUT carries ``If-None-Match: *`` (``put_mode=if-none-match``);
the store answers 412 when the object exists, so an existing block is never overwritten, even
by two writers racing. For stores without conditional writes, ``put_mode=head-then-put`` does a
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
import logging
import math
import re
import threading
import urllib.parse
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

try:
    import obstore
    from obstore.exceptions import AlreadyExistsError, NotFoundError, PreconditionError
    from obstore.store import S3Store
except ImportError as _missing:  # pragma: no cover - depends on the install
    raise ImportError(
        "the s3:// backend needs the 'obstore' package (pip install 'obstore>=0.12')"
    ) from _missing

from kvtier import codec
from kvtier.backends import redact_url, split_url_options
from kvtier.backends.base import (
    BackendStats,
    Buffer,
    ExistenceChecks,
    Lifecycle,
    RateLimitedLog,
    check_get_args,
    check_keys,
    check_put_args,
    parse_float_option,
    parse_int_option,
    reject_unknown_options,
)
from kvtier.keys import BlockKey, Namespace

__all__ = ["PutMode", "S3Backend", "S3Settings", "from_url"]

_log = logging.getLogger(__name__)

_T = TypeVar("_T")

_OPTIONS = ("endpoint_url", "region", "max_concurrency", "timeout_s", "put_mode")
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
_EXTRA_COUNTERS = (
    "timeouts",
    "skipped",
    "already_present",
    "size_mismatches",
    "peak_in_flight",
)


class PutMode(enum.Enum):
    """How ``put_many`` keeps an existing object from being overwritten."""

    IF_NONE_MATCH = "if-none-match"
    """One conditional PUT (``If-None-Match: *``); race-free. Needs store support."""

    HEAD_THEN_PUT = "head-then-put"
    """HEAD, then a plain PUT on 404; a racing writer may replace an identical block."""


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
        object.__setattr__(
            self,
            "max_concurrency",
            parse_int_option(
                "max_concurrency",
                self.max_concurrency,
                minimum=1,
                maximum=_MAX_CONCURRENCY_LIMIT,
            ),
        )
        timeout_s = parse_float_option("timeout_s", self.timeout_s)
        if timeout_s <= 0:
            raise ValueError(f"option timeout_s={self.timeout_s!r}: must be > 0 seconds")
        object.__setattr__(self, "timeout_s", timeout_s)
        mode: object = self.put_mode  # strings arrive from URLs and config files
        if not isinstance(mode, PutMode):
            object.__setattr__(self, "put_mode", _parse_put_mode(mode))

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


def _parse_put_mode(value: object) -> PutMode:
    for mode in PutMode:
        if value == mode.value:
            return mode
    raise ValueError(
        f"option put_mode={value!r}: expected one of {[mode.value for mode in PutMode]}"
    )


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
    ABANDONED = "abandoned"  # the caller returned: nothing more is sent or written


@dataclass(slots=True)
class _Batch:
    """One batch call: results filled in by the loop thread, read by the caller."""

    size: int
    results: list[bool] = field(init=False)
    state: _BatchState = _BatchState.ACTIVE
    answered: int = 0  # requests that got a definite answer (found or not found)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.results = [False] * self.size

    @property
    def accepting(self) -> bool:
        return self.state is _BatchState.ACTIVE

    def abandon(self) -> list[bool]:
        """Called by the caller when it stops waiting: freeze and return the results so far."""
        return self.abandon_counted()[0]

    def abandon_counted(self) -> tuple[list[bool], int]:
        """Like :meth:`abandon`, also returning how many requests got a definite answer."""
        with self.lock:
            self.state = _BatchState.ABANDONED
            return list(self.results), self.answered


class _Outcome(enum.Enum):
    """What one request found, before it is turned into a bool."""

    OK = "ok"
    MISSING = "missing"
    FAILED = "failed"


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


class S3Backend(ExistenceChecks):
    """A thread-safe block store on an S3-compatible object store (see module docstring).

    Credentials come from the standard environment (``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, web identity, container or instance
    credentials), never from the URL.
    """

    def __init__(self, namespace: Namespace, settings: S3Settings) -> None:
        if not isinstance(namespace, Namespace):
            raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
        if not isinstance(settings, S3Settings):
            raise TypeError(f"settings must be S3Settings, got {type(settings).__name__}")
        self._namespace = namespace
        self._digest = namespace.digest
        self._settings = settings
        base = f"{settings.prefix}/" if settings.prefix else ""
        self._object_prefix = f"{base}{namespace.digest_hex}/"
        self._store = _make_store(settings)
        self._stats = BackendStats(extra=_EXTRA_COUNTERS)
        self._warn = RateLimitedLog(_log)
        self._lifecycle = Lifecycle(f"s3 backend {settings.url}")
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

    # -- public API ---------------------------------------------------------------------------

    @property
    def namespace(self) -> Namespace:
        return self._namespace

    @property
    def url(self) -> str:
        return self._settings.url

    @property
    def settings(self) -> S3Settings:
        return self._settings

    def object_name(self, key: BlockKey) -> str:
        """The object key (inside the bucket) that holds ``key``'s block."""
        return self._object_prefix + codec.check_key(key).hex()

    def _exists(self, keys: Sequence[BlockKey]) -> tuple[list[bool], int]:
        key_list = check_keys(keys)
        self._lifecycle.check_open()
        self._stats.add("exists_calls")
        if not key_list:
            return [], 0
        names = [self._object_prefix + key.hex() for key in key_list]
        batch = self._run_batch(len(names), lambda batch: self._exists_batch(batch, names))
        results, answered = batch.abandon_counted()
        return results, len(results) - answered

    def put_many(self, keys: Sequence[BlockKey], payloads: Sequence[Buffer]) -> list[bool]:
        key_list, views = check_put_args(keys, payloads)
        self._lifecycle.check_open()
        self._stats.add("puts", len(key_list))
        if not key_list:
            return []
        return self._run(len(key_list), lambda batch: self._put_batch(batch, key_list, views))

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[memoryview]) -> list[bool]:
        key_list, views = check_get_args(keys, outs)
        self._lifecycle.check_open()
        if not key_list:
            return []
        results = self._run(len(key_list), lambda batch: self._get_batch(batch, key_list, views))
        hits = sum(results)
        self._stats.add_many({"gets": len(key_list), "hits": hits, "misses": len(results) - hits})
        return results

    def delete(self, keys: Sequence[BlockKey]) -> None:
        key_list = check_keys(keys)
        self._lifecycle.check_open()
        if not key_list:
            return
        names = list(dict.fromkeys(self._object_prefix + key.hex() for key in key_list))
        self._run(len(names), lambda batch: self._delete_names(batch, names))
        self._stats.add("deletes", len(key_list))

    def close(self) -> None:
        if self._lifecycle.close():
            self._finalizer.detach()
            self._loop.stop(_CLOSE_JOIN_S)

    def stats(self) -> dict[str, int]:
        return self._stats.snapshot()

    def __enter__(self) -> S3Backend:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- caller side --------------------------------------------------------------------------

    def _run(self, size: int, make: Callable[[_Batch], Coroutine[Any, Any, None]]) -> list[bool]:
        """Run one batch on the loop thread; never raises for I/O, never waits forever."""
        return self._run_batch(size, make).abandon()

    def _run_batch(
        self, size: int, make: Callable[[_Batch], Coroutine[Any, Any, None]]
    ) -> _Batch:
        """Run one batch; the caller reads it with ``abandon`` (it may still be settling)."""
        batch = _Batch(size)
        waves = math.ceil(size / self._settings.max_concurrency)
        deadline_s = self._wave_timeout_s * (waves + 1)
        try:
            future = self._loop.submit(make(batch))
        except RuntimeError:  # the loop is gone: close() won the race with this call
            return batch
        try:
            future.result(timeout=deadline_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            self._stats.add_many({"timeouts": 1, "errors": 1})
            self._warn.warning(
                "s3 backend %s: a batch of %d keys did not finish within %.1fs",
                self.url,
                size,
                deadline_s,
            )
        except concurrent.futures.CancelledError:
            pass  # close() cancelled it; whatever finished before is still reported
        except Exception as exc:  # a bug in a batch coroutine must not reach the engine
            self._stats.add("errors")
            self._warn.warning("s3 backend %s: batch failed: %r", self.url, exc)
        return batch

    # -- loop side ----------------------------------------------------------------------------

    async def _request(self, call: Awaitable[_T]) -> _T:
        """Await one request with the request timeout; counts the round trip."""
        self._stats.add("round_trips")
        async with asyncio.timeout(self._settings.timeout_s):
            return await call

    def _failed(self, batch: _Batch, what: str, name: str, exc: BaseException) -> _Outcome:
        with batch.lock:
            if batch.state is _BatchState.ACTIVE:
                batch.state = _BatchState.FAILING
        timed_out = isinstance(exc, TimeoutError)
        self._stats.add_many({"errors": 1, "timeouts": int(timed_out)})
        self._warn.warning(
            "s3 backend %s: %s %s failed: %s",
            self.url,
            what,
            name,
            "timed out" if timed_out else _short_error(exc),
        )
        return _Outcome.FAILED

    def _enter(self) -> None:
        self._in_flight += 1
        if self._in_flight > self._peak_in_flight:
            self._peak_in_flight = self._in_flight
            self._stats.set("peak_in_flight", self._peak_in_flight)

    def _leave(self) -> None:
        self._in_flight -= 1

    async def _head(self, batch: _Batch, name: str) -> _Outcome:
        try:
            await self._request(obstore.head_async(self._store, name))
        except _NOT_FOUND:
            return _Outcome.MISSING
        except Exception as exc:
            return self._failed(batch, "HEAD", name, exc)
        return _Outcome.OK

    async def _exists_batch(self, batch: _Batch, names: list[str]) -> None:
        slots = self._slots

        async def one(index: int, name: str) -> None:
            async with slots:
                if not batch.accepting:
                    self._stats.add("skipped")
                    return
                self._enter()
                try:
                    outcome = await self._head(batch, name)
                finally:
                    self._leave()
            if outcome is not _Outcome.FAILED:
                with batch.lock:
                    batch.results[index] = outcome is _Outcome.OK
                    batch.answered += 1

        await asyncio.gather(*(one(index, name) for index, name in enumerate(names)))

    async def _put_batch(
        self, batch: _Batch, keys: list[BlockKey], payloads: list[memoryview]
    ) -> None:
        slots = self._slots
        mode = self._settings.put_mode

        async def one(index: int, key: BlockKey) -> None:
            name = self._object_prefix + key.hex()
            async with slots:
                # The caller's buffer may only be read while the caller still waits.
                with batch.lock:
                    if batch.state is not _BatchState.ACTIVE:
                        self._stats.add("skipped")
                        return
                    frame = codec.encode(self._digest, key, payloads[index])
                self._enter()
                try:
                    outcome = await self._put_one(batch, name, frame, mode)
                finally:
                    self._leave()
            if outcome is _Outcome.OK:
                with batch.lock:
                    batch.results[index] = True

        await asyncio.gather(*(one(index, key) for index, key in enumerate(keys)))

    async def _put_one(self, batch: _Batch, name: str, frame: bytearray, mode: PutMode) -> _Outcome:
        if mode is PutMode.HEAD_THEN_PUT:
            present = await self._head(batch, name)
            if present is _Outcome.OK:
                self._stats.add("already_present")
                return _Outcome.OK
            if present is _Outcome.FAILED:
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
            self._stats.add("already_present")
            return _Outcome.OK
        except Exception as exc:
            return self._failed(batch, "PUT", name, exc)
        self._stats.add("bytes_written", len(frame))
        return _Outcome.OK

    async def _fetch(self, name: str) -> tuple[obstore.Bytes, str | None]:
        """The object's bytes and the ETag of that version (None if the store sent none)."""
        result = await obstore.get_async(self._store, name)
        return await result.bytes_async(), result.meta.get("e_tag")

    async def _get_batch(self, batch: _Batch, keys: list[BlockKey], outs: list[memoryview]) -> None:
        slots = self._slots
        corrupt: list[tuple[str, str | None]] = []  # (object name, ETag we read)

        async def one(index: int, key: BlockKey) -> None:
            name = self._object_prefix + key.hex()
            async with slots:
                if not batch.accepting:
                    self._stats.add("skipped")
                    return
                self._enter()
                try:
                    data, e_tag = await self._request(self._fetch(name))
                    frame = memoryview(data)
                except _NOT_FOUND:
                    return
                except Exception as exc:
                    self._failed(batch, "GET", name, exc)
                    return
                finally:
                    self._leave()
            self._stats.add("bytes_read", len(frame))
            try:
                with batch.lock:
                    if batch.state is _BatchState.ABANDONED:
                        return
                    codec.decode_into(frame, self._digest, key, outs[index])
                    batch.results[index] = True
            except codec.OutputSizeMismatch:
                self._stats.add("size_mismatches")
            except codec.FrameError as exc:
                self._stats.add("corrupt_objects")
                self._warn.warning(
                    "s3 backend %s: deleting corrupt object %s: %s", self.url, name, exc
                )
                corrupt.append((name, e_tag))

        await asyncio.gather(*(one(index, key) for index, key in enumerate(keys)))
        if corrupt:
            await self._delete_unchanged(corrupt)

    async def _delete_unchanged(self, corrupt: list[tuple[str, str | None]]) -> None:
        """Delete the bad objects that still carry the ETag we read (see module docstring)."""
        slots = self._slots
        batch = _Batch(len(corrupt))
        doomed: list[str] = []

        async def check(name: str, e_tag: str | None) -> None:
            if e_tag is None:  # no ETag to compare: the old unconditional delete
                doomed.append(name)
                return
            async with slots:
                self._enter()
                try:
                    meta = await self._request(obstore.head_async(self._store, name))
                except _NOT_FOUND:
                    return  # already gone
                except Exception as exc:
                    self._failed(batch, "HEAD", name, exc)
                    return
                finally:
                    self._leave()
            if meta.get("e_tag") == e_tag:
                doomed.append(name)

        await asyncio.gather(*(check(name, e_tag) for name, e_tag in corrupt))
        if doomed:
            await self._delete_names(batch, doomed)

    async def _delete_names(self, batch: _Batch, names: list[str]) -> None:
        slots = self._slots
        for start in range(0, len(names), _MAX_DELETE_BATCH):
            chunk = names[start : start + _MAX_DELETE_BATCH]
            async with slots:
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
    """Build an :class:`S3Backend` from ``s3://bucket[/prefix][?option=value&...]``.

    Options (query string or keyword, not both): ``endpoint_url`` (``http(s)://host[:port]``,
    default AWS), ``region``, ``max_concurrency`` (requests in flight, default 32),
    ``timeout_s`` (per request, retries included, default 5), ``put_mode``
    (``if-none-match`` or ``head-then-put``).
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
    reject_unknown_options("s3", merged, _OPTIONS)
    settings = S3Settings(
        bucket=parts.netloc,
        prefix=urllib.parse.unquote(parts.path),
        endpoint_url=merged.get("endpoint_url"),
        region=merged.get("region"),
        max_concurrency=merged.get("max_concurrency", _DEFAULT_MAX_CONCURRENCY),
        timeout_s=merged.get("timeout_s", _DEFAULT_TIMEOUT_S),
        put_mode=merged.get("put_mode", PutMode.IF_NONE_MATCH),
    )
    return S3Backend(namespace, settings)


# ------------------------------------------------------------------ usage (kvtier.inventory)

MANIFEST_NAME = "namespace.json"
"""``<prefix>/<digest>/namespace.json`` holds the namespace manifest; a block's name is hex."""
_DELETE_CHUNK = 1000  # the most keys one S3 DeleteObjects request takes
_MANIFEST_WAIT_S = 2.0


def write_manifest(backend: S3Backend, document: bytes) -> None:
    """PUT ``<prefix>/<digest>/namespace.json`` on the backend's own loop thread (S3 has no
    TTL: the manifest stays until purged). The open waits at most :data:`_MANIFEST_WAIT_S` for
    it, so a slow or hung server barely delays it; a PUT still running goes on, and a failure
    is logged."""
    name = backend._object_prefix + MANIFEST_NAME

    async def put() -> None:
        await obstore.put_async(backend._store, name, document)

    def report(done: concurrent.futures.Future[None]) -> None:
        error = None if done.cancelled() else done.exception()
        if error is not None:
            backend._warn.warning("%s: could not write the namespace manifest %s: %s",
                                  backend.url, name, _short_error(error))

    pending = backend._loop.submit(put())
    pending.add_done_callback(report)
    concurrent.futures.wait([pending], timeout=min(_MANIFEST_WAIT_S, backend.settings.timeout_s))


def _usage_store(url: str, options: dict[str, Any]) -> tuple[S3Store, str]:
    """A client for the bucket of ``url`` and the object prefix above the namespaces."""
    backend = from_url(url, Namespace(model="kvtier-usage"), options)
    backend.close()  # only its validated settings are used
    settings = backend.settings
    return _make_store(settings), f"{settings.prefix}/" if settings.prefix else ""


def list_namespaces(url: str, options: dict[str, Any]) -> list[Any]:
    """LIST the prefix; one entry per ``<digest>/`` with its blocks' sizes and LastModified."""
    from kvtier.inventory import NamespaceUsage, is_digest, parse_manifest

    store, base = _usage_store(url, options)
    found: dict[str, NamespaceUsage] = {}
    manifests: list[str] = []
    for chunk in obstore.list(store, prefix=base or None, chunk_size=1000):
        for meta in chunk:
            digest, _, name = meta["path"][len(base):].partition("/")
            if not is_digest(digest) or not name or "/" in name:
                continue
            item = found.setdefault(digest, NamespaceUsage(digest=digest))
            if name == MANIFEST_NAME:
                manifests.append(digest)
            else:
                item.add_block(int(meta["size"]), meta["last_modified"].timestamp())
    for digest in manifests:
        try:
            data = bytes(obstore.get(store, f"{base}{digest}/{MANIFEST_NAME}").bytes())
        except (NotFoundError, FileNotFoundError):
            data = None  # purged meanwhile
        found[digest].fields = parse_manifest(data, digest)
    return list(found.values())


def delete_namespaces(url: str, options: dict[str, Any], digests: Sequence[str]) -> int:
    """LIST each ``<prefix>/<digest>/`` and delete what it holds, 1,000 keys per request."""
    store, base = _usage_store(url, options)
    deleted = 0
    for digest in digests:
        names = [meta["path"] for chunk in obstore.list(store, prefix=f"{base}{digest}/")
                 for meta in chunk]
        for start in range(0, len(names), _DELETE_CHUNK):
            part = names[start : start + _DELETE_CHUNK]
            obstore.delete(store, part)
            deleted += len(part)
    return deleted
