"""The auth keys of a tier (:class:`KeyRing`): key ids and MAC keys derived with BLAKE3.

This module owns no state: a :class:`KeyRing` is immutable after construction and safe to share
between threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import blake3

from kvtier.codec.record import KEY_ID_BYTES

# BLAKE3 derive-key contexts: the MAC key and the key id are independent one-way functions of
# the configured key, so a key id in a frame tells nothing about the MAC key.
_MAC_KEY_CONTEXT = "kvtier 2026-12-02 frame MAC key"
_KEY_ID_CONTEXT = "kvtier 2026-12-02 frame key id"


def _derive(context: str, secret: bytes, length: int) -> bytes:
    return blake3.blake3(secret, derive_key_context=context).digest(length)


@dataclass(frozen=True, slots=True, repr=False)
class _RingKey:
    secret: bytes   # the configured key (format 2's HMAC key)
    key_id: bytes   # KEY_ID_BYTES, written into the frames it signs
    mac_key: bytes  # BLAKE3's 32-byte key


class KeyRing:
    """The auth keys of a tier: the first signs every new frame, every one verifies.

    Immutable; never shows a key (``repr`` counts them).
    """

    __slots__ = ("_by_id", "_keys")

    def __init__(self, keys: Sequence[bytes]) -> None:
        if not isinstance(keys, (list, tuple)) or not keys:
            raise ValueError("auth keys must be a non-empty list of non-empty bytes")
        ring: list[_RingKey] = []
        by_id: dict[bytes, int] = {}
        for index, secret in enumerate(keys):
            if not isinstance(secret, bytes) or not secret:
                raise ValueError(f"auth key {index + 1} must be non-empty bytes")
            entry = _RingKey(secret, _derive(_KEY_ID_CONTEXT, secret, KEY_ID_BYTES),
                             _derive(_MAC_KEY_CONTEXT, secret, 32))
            if entry.key_id in by_id:
                raise ValueError(f"auth key {index + 1} repeats key {by_id[entry.key_id] + 1}")
            by_id[entry.key_id] = index
            ring.append(entry)
        self._keys = tuple(ring)
        self._by_id = by_id

    @classmethod
    def of(cls, value: bytes | KeyRing | Sequence[bytes]) -> KeyRing:
        """``value`` as a ring: a ring as is, one key, or keys in order (the first signs)."""
        if isinstance(value, KeyRing):
            return value
        if isinstance(value, bytes):
            return cls([value])
        return cls(value)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return f"KeyRing({len(self._keys)} key{'s' if len(self._keys) != 1 else ''})"

    @property
    def key_ids(self) -> tuple[bytes, ...]:
        """The key ids frames carry, in ring order (fingerprints: they reveal no key)."""
        return tuple(entry.key_id for entry in self._keys)

    @property
    def signing(self) -> _RingKey:
        return self._keys[0]

    @property
    def entries(self) -> tuple[_RingKey, ...]:
        return self._keys

    def find(self, key_id: bytes) -> int | None:
        """The position of the key with ``key_id`` (0: the signing key), or None."""
        return self._by_id.get(key_id)
