"""Block keys, namespaces and request contexts.

This module owns no mutable state: every object it defines is immutable and can be shared
freely between the scheduler thread and background threads.

A ``BlockKey`` is an opaque byte string. Keys produced by :func:`chain_keys` are content hashes
chained over token blocks: key *i* covers block *i* and every block before it, and every key is
salted with its :class:`Namespace` digest, so two models (or dtypes, KV layouts, ranks, tenants)
never produce the same key for the same tokens.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

BlockKey: TypeAlias = bytes
"""An opaque block key. Keys made by :func:`chain_keys` are :data:`KEY_BYTES` long."""

KEY_BYTES = 16
"""Length of the keys made by :func:`chain_keys` (BLAKE2b-128)."""

NAMESPACE_DIGEST_BYTES = 16

_NAMESPACE_SCHEMA = b"kvtier.namespace.v1"
_CHAIN_SCHEMA = b"kvtier.chain.v1"
_ROOT_PARENT = bytes(KEY_BYTES)
_MAX_TOKEN_ID = 2**63 - 1


def _encode_field(value: str | int) -> bytes:
    """Length-prefixed, type-tagged encoding: no two field tuples encode alike."""
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return b"s" + struct.pack("<Q", len(raw)) + raw
    return b"i" + struct.pack("<q", value)


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that makes two KV blocks for the same tokens incompatible.

    ``digest`` is stable across processes, machines and Python versions: it is a BLAKE2b hash of
    a versioned, length-prefixed encoding of the fields, never Python's ``hash()``.
    """

    model: str
    revision: str = ""
    dtype: str = ""
    kv_layout: str = ""
    block_size: int = 0
    world_size: int = 1
    rank: int = 0
    tenant: str = ""
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("model", "revision", "dtype", "kv_layout", "tenant"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(
                    f"Namespace.{name} must be a str, got {type(value).__name__} {value!r}"
                )
        if not self.model:
            raise ValueError("Namespace.model must be a non-empty string naming the model")
        for name in ("block_size", "world_size", "rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(
                    f"Namespace.{name} must be an int, got {type(value).__name__} {value!r}"
                )
        for name in ("block_size", "world_size", "rank"):
            if getattr(self, name) >= _MAX_NAMESPACE_INT:
                raise ValueError(f"Namespace.{name} must be < 2**63, got a larger integer")
        if self.block_size < 0:
            raise ValueError(f"Namespace.block_size must be >= 0, got {self.block_size}")
        if self.world_size < 1:
            raise ValueError(f"Namespace.world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"Namespace.rank must be in [0, world_size={self.world_size}), got {self.rank}"
            )
        hasher = hashlib.blake2b(digest_size=NAMESPACE_DIGEST_BYTES, person=b"kvtier-ns")
        hasher.update(_NAMESPACE_SCHEMA)
        for value in (
            self.model,
            self.revision,
            self.dtype,
            self.kv_layout,
            self.block_size,
            self.world_size,
            self.rank,
            self.tenant,
        ):
            hasher.update(_encode_field(value))
        object.__setattr__(self, "digest", hasher.digest())

    @property
    def digest_hex(self) -> str:
        """The digest as 32 lowercase hex characters (used in object names)."""
        return self.digest.hex()

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> Namespace:
        """Build a namespace from a config mapping, rejecting unknown fields by name."""
        known = {"model", "revision", "dtype", "kv_layout", "block_size", "world_size", "rank",
                 "tenant"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown namespace field(s) {unknown}; expected some of {sorted(known)}"
            )
        if "model" not in values:
            raise ValueError("namespace needs a 'model' field")
        return cls(**dict(values))


def _tokens_as_int64(token_ids: Sequence[int] | npt.NDArray[Any]) -> npt.NDArray[np.int64]:
    if isinstance(token_ids, (str, bytes, bytearray, memoryview)):
        raise TypeError(
            f"token_ids must be a sequence of ints, got {type(token_ids).__name__}"
        )
    try:
        array = np.asarray(token_ids)
    except (OverflowError, ValueError) as exc:
        raise ValueError(f"token_ids could not be read as integers: {exc}") from exc
    if array.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {array.shape}")
    if array.size == 0:
        return np.empty(0, dtype=np.int64)
    if array.dtype.kind not in "iu":
        items = array.tolist()
        bad = next(
            (t for t in items if not isinstance(t, int) or isinstance(t, bool)),
            None,
        )
        if bad is None:
            # Every item is a Python int, but numpy could not fit them in 64 bits.
            out_of_range = next(t for t in items if not 0 <= t <= _MAX_TOKEN_ID)
            raise ValueError(f"token_ids must be in [0, 2**63), found {out_of_range}")
        raise TypeError(
            f"token_ids must contain only ints, found {type(bad).__name__} {bad!r} "
            f"(array dtype {array.dtype})"
        )
    if array.dtype.kind == "u" and array.dtype.itemsize == 8 and int(array.max()) > _MAX_TOKEN_ID:
        raise ValueError(f"token_ids must be < 2**63, found {int(array.max())}")
    if array.dtype.kind == "i" and int(array.min()) < 0:
        raise ValueError(f"token_ids must be >= 0, found {int(array.min())}")
    return np.ascontiguousarray(array, dtype="<i8")


def chain_keys(
    token_ids: Sequence[int] | npt.NDArray[Any],
    block_size: int,
    namespace: Namespace,
    parent: BlockKey | None = None,
) -> list[BlockKey]:
    """One key per *full* block of ``token_ids``; a trailing partial block gets no key.

    Key *i* is ``BLAKE2b-128(schema, namespace.digest, key[i-1], tokens of block i)``, with the
    all-zero key standing in for the block before the first. ``parent`` continues an existing
    chain: pass the last key of the blocks that precede ``token_ids``.
    """
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not isinstance(namespace, Namespace):
        raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
    if parent is not None and not isinstance(parent, bytes):
        raise TypeError(f"parent must be a BlockKey (bytes) or None, got {type(parent).__name__}")
    if parent is not None and len(parent) == 0:
        raise ValueError("parent must be a non-empty BlockKey")
    tokens = _tokens_as_int64(token_ids)
    full_blocks = tokens.size // block_size
    raw = tokens[: full_blocks * block_size].tobytes()
    stride = block_size * 8
    previous = _ROOT_PARENT if parent is None else parent
    salt = _CHAIN_SCHEMA + namespace.digest
    keys: list[BlockKey] = []
    for index in range(full_blocks):
        hasher = hashlib.blake2b(salt, digest_size=KEY_BYTES)
        hasher.update(previous)
        hasher.update(raw[index * stride : (index + 1) * stride])
        previous = hasher.digest()
        keys.append(previous)
    return keys


@dataclass(frozen=True, slots=True)
class RequestContext:
    """Identifies the engine request a lookup or transfer is made for.

    ``params`` is copied into a read-only mapping; it carries per-request hints (for example a
    lookup scope) that subclasses of the lookup manager may read. ``session_id`` names the
    agent session or conversation the request belongs to, where the engine knows one (the
    manager's prefetch keeps a session's chain warm between its turns); None: unknown.
    """

    req_id: str
    params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    session_id: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.req_id, str):
            raise TypeError(
                f"RequestContext.req_id must be a str, got {type(self.req_id).__name__}"
            )
        if not self.req_id:
            raise ValueError("RequestContext.req_id must be a non-empty string")
        if not isinstance(self.params, Mapping):
            raise TypeError(
                f"RequestContext.params must be a Mapping, got {type(self.params).__name__}"
            )
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        if self.session_id is not None and (not isinstance(self.session_id, str)
                                            or not self.session_id):
            raise ValueError(f"RequestContext.session_id must be a non-empty str or None, got "
                             f"{self.session_id!r}")

    def __hash__(self) -> int:
        return hash(self.req_id)


MAX_KEY_BYTES = 255
_MAX_NAMESPACE_INT = 1 << 63  # the digest packs each integer field as a signed 64-bit
"""The longest block key (its hex must fit one file name of the file tier)."""


def check_key(key: object, argument: str = "key") -> bytes:
    """Return ``key`` if it is a block key (1..255 bytes), else raise naming what was expected.

    The one key rule: every API that takes keys (lookups, the manager, backends) checks it here.
    """
    if not isinstance(key, bytes):
        raise TypeError(f"{argument} must be a BlockKey (bytes), got {type(key).__name__}")
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"{argument} must be 1..{MAX_KEY_BYTES} bytes long, got {len(key)} bytes")
    return key


def validate_keys(keys: Iterable[object], argument: str = "keys") -> list[BlockKey]:
    """Return ``keys`` as a list, raising (see :func:`check_key`) naming the first bad key."""
    return [check_key(key, f"{argument}[{index}]") for index, key in enumerate(keys)]
