"""What a tier stores, per namespace, read from the medium itself; and removing it.

``usage(url)`` lists every kvtier namespace found on a backend medium (SCAN on Redis and on
every Redis Cluster primary, LIST on S3, the directory tree of a file tier): its digest, the
namespace fields (from the namespace manifest written next to the blocks), blocks, bytes and the
oldest / newest block. ``purge(url, digest=..., fields=..., dry_run=...)`` removes the blocks and
the manifest of the selected namespaces.

The namespace manifest is one small JSON object per namespace, written when a backend is opened
for writing (:func:`kvtier.backends.open_backend`): ``<root>/<digest>/namespace.json`` (file),
``kvtier:<digest>:namespace`` (Redis), ``<prefix>/<digest>/namespace.json`` (S3). Its name can
never be a block's name, so it is never counted or served as a block. A manifest whose fields do
not hash to its digest is ignored (the namespace shows as unknown).

The per-medium listing is each backend kind's (:class:`kvtier.backends.BackendKind`:
``list_namespaces`` and ``delete_namespaces``, found by the URL's scheme in the registry, so a
kind registered from outside is listed and purged too); this module selects, sums and
presents. It owns no state: every call opens its own connection and closes it before returning.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.backends.manifest import (
    DIGEST_HEX_CHARS,
    MANIFEST_FORMAT,
    NamespaceUsage,
    manifest_document,
    namespace_fields,
    parse_manifest,
)
from kvtier.backends.registry import BackendKind
from kvtier.errors import KvtierError
from kvtier.keys import Namespace
from kvtier.text import first_line

__all__ = [
    "MANIFEST_FORMAT",
    "MediumError",
    "NamespaceUsage",
    "PurgeResult",
    "UsageError",
    "delete",
    "manifest_document",
    "namespace_fields",
    "parse_manifest",
    "purge",
    "resolve_digest",
    "select",
    "usage",
]

MIN_DIGEST_PREFIX = 6
"""The shortest digest prefix accepted where a digest is asked for."""


class UsageError(KvtierError, ValueError):
    """A bad URL or selector (unknown or ambiguous digest, unknown field)."""


class MediumError(KvtierError, RuntimeError):
    """The medium could not be listed or purged (unreachable server, I/O error)."""


@dataclass(slots=True)
class PurgeResult:
    """What :func:`purge` removed (or, with ``dry_run``, would remove)."""

    url: str
    dry_run: bool
    namespaces: list[NamespaceUsage] = field(default_factory=list)
    objects_deleted: int = 0
    """Objects actually deleted (blocks and manifests); 0 for a dry run."""

    @property
    def blocks(self) -> int:
        return sum(item.blocks for item in self.namespaces)

    @property
    def bytes(self) -> int:
        return sum(item.bytes for item in self.namespaces)


# --------------------------------------------------------------------------- the API


def _medium(url: str) -> BackendKind:
    """The backend kind of ``url``'s scheme (it holds the per-medium listing)."""
    from kvtier.backends import kind_of

    try:
        return kind_of(url)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def usage(url: str, **options: Any) -> list[NamespaceUsage]:
    """Every kvtier namespace stored at ``url``, largest first.

    ``options`` are the backend's own (credentials, timeouts; unknown ones raise). Raises
    :class:`UsageError` for a bad URL or option, :class:`MediumError` when the medium cannot be
    listed.
    """
    from kvtier.backends import NoTierError, redact_url

    module = _medium(url)
    try:
        found: list[NamespaceUsage] = module.list_namespaces(url, dict(options))
    except UsageError:
        raise
    except NoTierError as exc:  # nothing there to list: the medium failed, not the arguments
        raise MediumError(str(exc)) from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except Exception as exc:
        raise MediumError(
            f"could not list {redact_url(url)}: {type(exc).__name__}: {first_line(exc)}"
        ) from exc
    return sorted(found, key=lambda item: (-item.bytes, item.digest))


def resolve_digest(found: Sequence[NamespaceUsage], digest: str) -> NamespaceUsage:
    """The namespace whose digest is ``digest`` or starts with it (at least
    :data:`MIN_DIGEST_PREFIX` hex digits). Raises :class:`UsageError` naming the candidates."""
    text = digest.strip().lower()
    if len(text) < MIN_DIGEST_PREFIX or not re.fullmatch(r"[0-9a-f]+", text):
        raise UsageError(
            f"digest {digest!r}: expected {MIN_DIGEST_PREFIX} to {DIGEST_HEX_CHARS} hex digits "
            f"(see `kvtier usage URL`)"
        )
    matches = [item for item in found if item.digest.startswith(text)]
    if not matches:
        raise UsageError(f"no namespace with digest {digest!r} is stored there")
    if len(matches) > 1:
        shown = ", ".join(item.digest for item in matches[:5])
        raise UsageError(f"digest prefix {digest!r} is ambiguous: {shown}")
    return matches[0]


def select(
    found: Sequence[NamespaceUsage],
    digest: str | None = None,
    fields: Mapping[str, Any] | None = None,
) -> list[NamespaceUsage]:
    """The namespaces matching ``digest`` (full or prefix) and every ``fields`` item.

    Field values compare as text, so ``{"block_size": "16"}`` matches 16. A namespace without a
    valid manifest matches only by digest.
    """
    if digest is None and not fields:
        raise UsageError("select namespaces with a digest or namespace fields (none given)")
    chosen = list(found) if digest is None else [resolve_digest(found, digest)]
    if fields:
        known = set(namespace_fields(Namespace(model="x")))
        unknown = sorted(set(fields) - known)
        if unknown:
            raise UsageError(f"unknown namespace field(s) {unknown}; expected some of "
                             f"{sorted(known)}")
        chosen = [
            item for item in chosen
            if item.fields is not None
            and all(str(item.fields.get(name)) == str(value) for name, value in fields.items())
        ]
    return chosen


def purge(
    url: str,
    *,
    digest: str | None = None,
    fields: Mapping[str, Any] | None = None,
    dry_run: bool = False,
    **options: Any,
) -> PurgeResult:
    """Remove every block and the manifest of the namespaces selected by ``digest`` (full or a
    unique prefix) and/or ``fields`` (all must match the manifest). With ``dry_run`` nothing is
    deleted and the result says what would be.

    Blocks written while the purge runs may survive it. Raises :class:`UsageError` for a bad
    URL or selector, :class:`MediumError` when the medium cannot be listed or purged.
    """
    chosen = select(usage(url, **options), digest, fields)
    if dry_run:
        from kvtier.backends import redact_url

        return PurgeResult(url=redact_url(url), dry_run=True, namespaces=chosen)
    return delete(url, chosen, **options)


def delete(url: str, namespaces: Sequence[NamespaceUsage], **options: Any) -> PurgeResult:
    """Delete the blocks and manifests of ``namespaces`` (as listed by :func:`usage`).
    Raises :class:`MediumError` when the medium refuses."""
    from kvtier.backends import redact_url

    result = PurgeResult(url=redact_url(url), dry_run=False, namespaces=list(namespaces))
    if not namespaces:
        return result
    module = _medium(url)
    try:
        result.objects_deleted = module.delete_namespaces(
            url, dict(options), [item.digest for item in namespaces]
        )
    except Exception as exc:
        raise MediumError(
            f"could not purge {redact_url(url)}: {type(exc).__name__}: {first_line(exc)}"
        ) from exc
    return result

