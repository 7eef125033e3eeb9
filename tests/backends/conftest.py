"""Backend factory for the shared contract suite.

``backend_kind`` is parametrized over every backend. For the server-backed kinds the factory
asks pytest for the server fixture by name, so a missing server plugin or backend module makes
the test *fail* (fixture lookup error / import error); nothing is ever skipped.

Fault injection goes through :class:`RawAccess`, which reads and writes the stored object of a
key verbatim, bypassing the backend:

- memory, redis, redis_cluster: the backend's private ``_raw_read`` / ``_raw_write`` hooks;
- file: the block's file, written through a temp file + ``os.replace``;
- s3: ``get_object`` / ``put_object`` on the server's raw boto3 client, at
  ``backend.object_name(key)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from uuid import uuid4

import pytest

from kvtier.backends import Backend, open_backend
from kvtier.keys import BlockKey, Namespace

# "file-python": the file backend with native_io=false, the path of an install without the
# compiled batch reader (the whole contract holds on both read paths).
BACKEND_KINDS = ["memory", "file", "file-python", "redis", "redis_cluster", "s3"]
PERSISTENT_KINDS = ["file", "file-python", "redis", "redis_cluster", "s3"]
FILE_KINDS = ("file", "file-python")
_SERVER_FIXTURES = {"redis": "redis_server", "redis_cluster": "redis_cluster", "s3": "s3_server"}


class RawAccess(Protocol):
    """Verbatim access to the stored object of a key (fault injection only)."""

    def read(self, key: BlockKey) -> bytes | None: ...

    def write(self, key: BlockKey, frame: bytes) -> None: ...


class _HookRawAccess:
    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def read(self, key: BlockKey) -> bytes | None:
        value: bytes | None = self._backend._raw_read(key)
        return value

    def write(self, key: BlockKey, frame: bytes) -> None:
        self._backend._raw_write(key, frame)


class _FileRawAccess:
    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def read(self, key: BlockKey) -> bytes | None:
        path: Path = self._backend.path_for(key)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None

    def write(self, key: BlockKey, frame: bytes) -> None:
        path: Path = self._backend.path_for(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(path.name + ".inject")
        temp.write_bytes(frame)
        os.replace(temp, path)


class _S3RawAccess:
    def __init__(self, backend: Any, server: Any) -> None:
        self._backend = backend
        self._server = server
        self._client = server.raw_client()

    def read(self, key: BlockKey) -> bytes | None:
        try:
            response = self._client.get_object(
                Bucket=self._server.bucket, Key=self._backend.object_name(key)
            )
        except self._client.exceptions.NoSuchKey:
            return None
        body: bytes = response["Body"].read()
        return body

    def write(self, key: BlockKey, frame: bytes) -> None:
        self._client.put_object(
            Bucket=self._server.bucket, Key=self._backend.object_name(key), Body=frame
        )


@dataclass(slots=True)
class BackendHarness:
    """Opens backends of one kind; everything it opened is closed at teardown."""

    kind: str
    _open_url: Callable[[Namespace, dict[str, Any]], Backend]
    _server: Any = None
    namespace: Namespace = field(default_factory=lambda: fresh_namespace())
    _opened: list[Backend] = field(default_factory=list)

    def open(self, namespace: Namespace | None = None, **options: Any) -> Backend:
        """A new backend instance (same medium; ``namespace`` defaults to the harness's)."""
        backend = self._open_url(namespace or self.namespace, options)
        self._opened.append(backend)
        return backend

    def raw(self, backend: Backend) -> RawAccess:
        if self.kind in FILE_KINDS:
            return _FileRawAccess(backend)
        if self.kind == "s3":
            return _S3RawAccess(backend, self._server)
        return _HookRawAccess(backend)

    def close_all(self) -> None:
        for backend in self._opened:
            backend.close()


def fresh_namespace(**fields: Any) -> Namespace:
    return Namespace(model=f"test-{uuid4().hex}", **fields)


@pytest.fixture(params=BACKEND_KINDS)
def backend_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


@pytest.fixture
def harness(
    request: pytest.FixtureRequest, backend_kind: str, tmp_path: Path
) -> Iterator[BackendHarness]:
    server: Any = None
    if backend_kind in _SERVER_FIXTURES:
        server = request.getfixturevalue(_SERVER_FIXTURES[backend_kind])
    if backend_kind == "memory":

        def open_url(namespace: Namespace, options: dict[str, Any]) -> Backend:
            # memory:// is private to the instance: every open is a new, empty store.
            return open_backend("memory://", namespace, **options)

    elif backend_kind in FILE_KINDS:
        root = tmp_path / "tier"
        native = {"native_io": backend_kind == "file"}

        def open_url(namespace: Namespace, options: dict[str, Any]) -> Backend:
            return open_backend(f"file://{root}", namespace, **{**native, **options})

    elif backend_kind in ("redis", "redis_cluster"):

        def open_url(namespace: Namespace, options: dict[str, Any]) -> Backend:
            return open_backend(server.url, namespace, **options)

    elif backend_kind == "s3":
        prefix = f"contract-{uuid4().hex[:12]}"

        def open_url(namespace: Namespace, options: dict[str, Any]) -> Backend:
            return open_backend(server.url(prefix), namespace, **options)

    else:
        raise ValueError(f"unknown backend kind {backend_kind!r}")
    built = BackendHarness(kind=backend_kind, _open_url=open_url, _server=server)
    try:
        yield built
    finally:
        built.close_all()


@pytest.fixture
def backend(harness: BackendHarness) -> Backend:
    return harness.open()
