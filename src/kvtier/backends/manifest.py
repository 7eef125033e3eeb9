"""The namespace manifest and the per-namespace usage record every backend kind reports.

Stateless. The manifest is one small JSON object per namespace, written next to the blocks
when a backend is opened for writing; its name can never be a block's name. A manifest whose
fields do not hash to its digest is ignored (the namespace shows as unknown). Listing and
deleting per medium is each :class:`~kvtier.backends.registry.BackendKind`'s job;
:mod:`kvtier.ops.inventory` selects, sums and presents.
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from dataclasses import dataclass
from typing import Any

from kvtier.keys import NAMESPACE_DIGEST_BYTES, Namespace

__all__ = [
    "DIGEST_HEX_CHARS",
    "MANIFEST_FORMAT",
    "NamespaceUsage",
    "is_block_name",
    "is_digest",
    "manifest_document",
    "namespace_fields",
    "parse_manifest",
]

MANIFEST_FORMAT = 1
DIGEST_HEX_CHARS = 2 * NAMESPACE_DIGEST_BYTES
MAX_MANIFEST_BYTES = 1 << 16
"""A manifest is a few hundred bytes; a larger object under the manifest's name is not one."""
_DIGEST_RE = re.compile(rf"[0-9a-f]{{{DIGEST_HEX_CHARS}}}")


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


def manifest_document(namespace: Namespace) -> bytes:
    """The manifest of ``namespace``: deterministic JSON, so rewriting it changes nothing."""
    document = {
        "kvtier_namespace_manifest": MANIFEST_FORMAT,
        "digest": namespace.digest_hex,
        "namespace": namespace_fields(namespace),
    }
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def parse_manifest(data: bytes | None, digest: str) -> dict[str, Any] | None:
    """The namespace fields of a manifest stored under ``digest``, or None if it is missing,
    malformed, or its fields do not hash to ``digest`` (a manifest cannot lie about a name)."""
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
    return dict(fields)


def is_block_name(suffix: bytes | str) -> bool:
    """Whether a stored object's last name component is a block key's hex (1..255 bytes)."""
    text = suffix.decode("ascii", "replace") if isinstance(suffix, bytes) else suffix
    return (0 < len(text) <= 510 and len(text) % 2 == 0
            and all(char in "0123456789abcdef" for char in text))


def is_digest(text: str) -> bool:
    """Whether ``text`` is a namespace digest as it appears in object names."""
    return _DIGEST_RE.fullmatch(text) is not None
