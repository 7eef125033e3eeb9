"""The auth keys of a tier: the ``auth_key`` / ``auth_key_file`` options every scheme accepts.

Stateless. A tier has a :class:`~kvtier.codec.KeyRing`: the first key signs every frame it
stores, every key verifies, so a key can rotate without a cold tier (see "Key rotation" in
docs/operations.md). The keys come from:

- ``auth_key``: one string, or a list of strings in a YAML / dict config (the environment's
  ``KVTIER_SECONDARY_TIERS`` takes the same list in its JSON form). A URL query string holds one
  key (a repeated option is an error): use ``auth_key_file`` for several.
- ``auth_key_file``: one key per line, the signing key first; blank lines are ignored, a line
  ends with ``\\n`` or ``\\r\\n`` (so a key cannot hold a line break). The file is read once at
  open: a regular file (never a FIFO: it would block), not a symlink, owned by this user (or
  root), readable by nobody else, at most 64 KiB (a longer one is refused, never cut).

A key never appears in a message: errors name the key by its position or line.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from typing import Any

from kvtier.codec import KeyRing
from kvtier.files import read_regular_file
from kvtier.settings import ConfigError, Kind, Secret, Setting

__all__ = ["COMMON_SETTINGS", "MIN_AUTH_KEY_BYTES", "load_auth_key"]

COMMON_SETTINGS: tuple[Setting, ...] = (
    Setting("auth_key", Kind.SECRETS, None, nullable=True,
            help="secret key, or a list of keys (the first signs, every one verifies: key "
                 "rotation): every frame carries a keyed BLAKE3 tag over header and payload; "
                 "frames without a valid tag are never served"),
    Setting("auth_key_file", Kind.STR, None, nullable=True,
            help="file holding the auth keys, one per line, the signing key first (read once "
                 "at open; blank lines ignored; owned by you, not accessible by group or "
                 "others)"),
)
"""Options every backend scheme accepts (merged into each scheme's table)."""

MIN_AUTH_KEY_BYTES = 16
_MAX_KEY_FILE_BYTES = 1 << 16


def load_auth_key(options: Mapping[str, Any], where: str) -> KeyRing | None:
    """The key ring from the parsed ``auth_key`` / ``auth_key_file`` options, or None."""
    secrets: tuple[Secret, ...] | None = options.get("auth_key")
    path: str | None = options.get("auth_key_file")
    if secrets is not None and path is not None:
        raise ConfigError(f"{where}: give auth_key or auth_key_file, not both")
    if path is not None:
        named = _read_key_file(path, where)
    elif secrets is not None:
        count = len(secrets)
        named = [(secret.reveal().encode(), f"auth_key[{index}]" if count > 1 else "auth_key")
                 for index, secret in enumerate(secrets)]
    else:
        return None
    seen: dict[bytes, str] = {}
    for key, name in named:
        if len(key) < MIN_AUTH_KEY_BYTES:
            raise ConfigError(
                f"{where}: {name} is {len(key)} bytes; expected at least {MIN_AUTH_KEY_BYTES} "
                "(e.g. 32 random bytes, hex-encoded)"
            )
        if key in seen:
            raise ConfigError(f"{where}: {name} repeats {seen[key]}; list each key once")
        seen[key] = name
    return KeyRing([key for key, _name in named])


def _read_key_file(path: str, where: str) -> list[tuple[bytes, str]]:
    """The keys in ``path`` with the names errors give them (``auth_key_file line 2``)."""
    data, info = read_regular_file(path, f"{where}: auth_key_file",
                                   max_bytes=_MAX_KEY_FILE_BYTES, follow_symlinks=False)
    if info.st_uid not in (os.geteuid(), 0):
        raise ConfigError(f"{where}: auth_key_file {path!r} is owned by uid {info.st_uid}; "
                          "expected a file owned by this user (or root)")
    if info.st_mode & 0o077:
        raise ConfigError(
            f"{where}: auth_key_file {path!r} has mode {stat.S_IMODE(info.st_mode):o}; "
            "it must not be accessible by group or others (chmod 600)"
        )
    keys = [(line.removesuffix(b"\r"), f"auth_key_file {path!r} line {number}")
            for number, line in enumerate(data.split(b"\n"), start=1)
            if line.strip()]
    if not keys:
        raise ConfigError(f"{where}: auth_key_file {path!r} holds no key; expected one key per "
                          "line, the signing key first")
    return keys
