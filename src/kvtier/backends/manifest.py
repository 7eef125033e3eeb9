"""The namespace manifest and the per-namespace usage record every backend kind reports.

Stateless. The manifest is one small JSON object per namespace, written next to the blocks
when a backend is opened for writing; its name can never be a block's name. A manifest whose
fields do not hash to its digest is ignored (the namespace shows as unknown). Listing and
deleting per medium is each :class:`~kvtier.backends.registry.BackendKind`'s job;
:mod:`kvtier.ops.inventory` selects, sums and presents.

The manifest also says whether the tier's frames are keyed (``"auth": "keyed"``), so that a
writer without a key is refused at open instead of fighting the keyed writers block by block
(:meth:`kvtier.backends.Backend.open_for_writing`). Manifests written before that field existed
read as "not known".
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import struct
from dataclasses import dataclass
from typing import Any

from kvtier.files import read_regular_file
from kvtier.keys import NAMESPACE_DIGEST_BYTES, Namespace
from kvtier.settings import ConfigError

__all__ = [
    "DIGEST_HEX_CHARS",
    "MANIFEST_FORMAT",
    "NamespaceUsage",
    "TierAuth",
    "is_block_name",
    "is_digest",
    "manifest_auth",
    "manifest_document",
    "namespace_fields",
    "parse_manifest",
    "read_manifest_file",
]

MANIFEST_FORMAT = 1
DIGEST_HEX_CHARS = 2 * NAMESPACE_DIGEST_BYTES
MAX_MANIFEST_BYTES = 1 << 16
"""A manifest is a few hundred bytes; a larger object under the manifest's name is not one."""
_DIGEST_RE = re.compile(rf"[0-9a-f]{{{DIGEST_HEX_CHARS}}}")


class TierAuth(enum.Enum):
    """Whether a tier's frames carry a keyed MAC; the value is the manifest's spelling."""

    KEYED = "keyed"
    UNKEYED = "unkeyed"


@dataclass(slots=True)
class NamespaceUsage:
    """One namespace found on a medium.

    ``oldest`` / ``newest`` are Unix times of the least and most recently written block (file:
    modification time; S3: ``LastModified``). Redis keeps no write time, so there they are the
    least and most recent *access* times (``OBJECT IDLETIME``), or None where the server's
    eviction policy does not track idle time.

    ``bytes`` are the stored frames (payload and frame header: what the backend reads back).
    ``disk_bytes`` is what the medium allocates for the namespace where its kind can tell (file:
    the allocated blocks of every file and directory under the namespace directory, as ``du``
    counts them), None where it cannot (Redis, S3).
    """

    digest: str
    fields: dict[str, Any] | None = None
    blocks: int = 0
    bytes: int = 0
    oldest: float | None = None
    newest: float | None = None
    disk_bytes: int | None = None

    @property
    def model(self) -> str:
        """The model name from the manifest, or ``"?"`` where no valid manifest was found."""
        return str(self.fields["model"]) if self.fields else "?"

    def add_block(self, size: int, when: float | None) -> None:
        self.blocks += 1
        self.bytes += size
        if when is not None:
            self.oldest = when if self.oldest is None else min(self.oldest, when)
            self.newest = when if self.newest is None else max(self.newest, when)

    def add_disk(self, allocated: int) -> None:
        """Count ``allocated`` bytes of the medium (a file's or directory's blocks)."""
        self.disk_bytes = (self.disk_bytes or 0) + allocated

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "model": self.model}


def namespace_fields(namespace: Namespace) -> dict[str, Any]:
    """The fields of ``namespace`` as a plain mapping (the inverse of ``from_mapping``)."""
    return {f.name: getattr(namespace, f.name) for f in dataclasses.fields(namespace) if f.init}


def manifest_document(namespace: Namespace, auth: TierAuth | None = None) -> bytes:
    """The manifest of ``namespace`` (with ``auth``, whether its frames are keyed):
    deterministic JSON, so rewriting it changes nothing."""
    document: dict[str, Any] = {
        "kvtier_namespace_manifest": MANIFEST_FORMAT,
        "digest": namespace.digest_hex,
        "namespace": namespace_fields(namespace),
    }
    if auth is not None:
        document["auth"] = auth.value
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def parse_manifest(data: bytes | None, digest: str) -> dict[str, Any] | None:
    """The namespace fields of a manifest stored under ``digest``, or None if it is missing,
    malformed, or its fields do not hash to ``digest`` (a manifest cannot lie about a name)."""
    document = _valid_document(data, digest)
    return None if document is None else dict(document["namespace"])


def manifest_auth(data: bytes | None, digest: str) -> TierAuth | None:
    """What a valid manifest says about keyed frames; None where it is missing, invalid, or
    written before the field existed."""
    document = _valid_document(data, digest)
    value = None if document is None else document.get("auth")
    return next((auth for auth in TierAuth if auth.value == value), None)


def read_manifest_file(path: str, dir_fd: int | None = None) -> bytes | None:
    """The bytes of a manifest file (``path`` relative to ``dir_fd`` when given); None where
    absent or not one (a FIFO, a symlink, a directory, larger than :data:`MAX_MANIFEST_BYTES`):
    never blocks, never follows a link."""
    try:
        return read_regular_file(path, "manifest", max_bytes=MAX_MANIFEST_BYTES,
                                 follow_symlinks=False, dir_fd=dir_fd)[0]
    except ConfigError:
        return None


def _valid_document(data: bytes | None, digest: str) -> dict[str, Any] | None:
    if not data or len(data) > MAX_MANIFEST_BYTES:
        return None
    try:
        document = json.loads(data)
        fields = document["namespace"] if isinstance(document, dict) else None
        if not isinstance(fields, dict) or not all(
                isinstance(value, str | int) and not isinstance(value, bool)
                for value in fields.values()):
            return None
        if Namespace.from_mapping(fields).digest_hex != digest:
            return None
    # Anyone who can write the medium writes manifests: a deep nest, a huge number or a wrong
    # type makes this one namespace unknown, never fails the listing.
    except (ValueError, TypeError, KeyError, RecursionError, OverflowError, AttributeError,
            struct.error):
        return None
    return dict(document)


def is_block_name(suffix: bytes | str) -> bool:
    """Whether a stored object's last name component is a block key's hex (1..255 bytes)."""
    text = suffix.decode("ascii", "replace") if isinstance(suffix, bytes) else suffix
    return (0 < len(text) <= 510 and len(text) % 2 == 0
            and all(char in "0123456789abcdef" for char in text))


def is_digest(text: str) -> bool:
    """Whether ``text`` is a namespace digest as it appears in object names."""
    return _DIGEST_RE.fullmatch(text) is not None
