"""``kvtier inspect``: a backend's stats in a namespace, and whether given keys are present.

No state: runs on the command's main thread; the backend it opens is closed before it returns.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

from kvtier.cli import common
from kvtier.cli.common import EXIT_FAILED, EXIT_OK, UsageError, namespace_field, redact
from kvtier.cli.output import Output, add_format_option
from kvtier.cli.usage import MediumFailed, list_usage
from kvtier.text import Sheet, printable


def register(commands: Any) -> None:
    """Add the ``inspect`` sub-parser."""
    inspect = commands.add_parser(
        "inspect", help="show a backend's stats, or check whether keys are present",
        description="Open a backend URL (memory://, file:///abs/path, redis://, rediss://, "
                    "redis+cluster://, s3://) in a namespace, show its stats, and optionally "
                    "check keys.",
    )
    inspect.add_argument("url", metavar="URL", help="the backend URL")
    inspect.add_argument("--namespace", dest="namespace_fields", action="append",
                         type=namespace_field, default=[], metavar="FIELD=VALUE",
                         help="namespace field (repeatable), e.g. model=llama-3-8b; default "
                              "model=kvtier-replay")
    inspect.add_argument("--digest", default=None, metavar="HEX",
                         help="the namespace by its digest or a unique prefix of it, as "
                              "`kvtier usage URL` shows it (instead of --namespace)")
    inspect.add_argument("--key", dest="keys", action="append", default=[], metavar="HEX",
                         help="a block key in hex to check (repeatable)")
    add_format_option(inspect)
    inspect.set_defaults(run=run)


_REACHABILITY_KEY = b"kvtier-inspect-reachability-probe"


def run(args: argparse.Namespace) -> int:
    from kvtier.backends import NoTierError, OpenMode, open_backend, redact_url
    from kvtier.keys import Namespace, check_key

    try:
        stored = _stored_namespace(args.url, args.digest) if args.digest else None
    except MediumFailed as exc:
        print(args.scrub(f"kvtier inspect: failed: {exc}"), file=sys.stderr)
        return EXIT_FAILED
    if stored is not None and args.namespace_fields:
        raise UsageError("give the namespace by --digest or by --namespace, not both")
    try:
        namespace = (Namespace.from_mapping(stored.fields) if stored is not None and stored.fields
                     else common.namespace_from_args(args.namespace_fields))
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--namespace: {exc}") from None
    keys: list[bytes] = []
    for text in args.keys:
        try:
            key = bytes.fromhex(text)
        except ValueError:
            raise UsageError(f"--key: expected hexadecimal bytes, got {text[:80]!r}") from None
        try:
            keys.append(check_key(key, "--key"))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    shown = redact_url(args.url)
    try:
        backend = open_backend(args.url, namespace, mode=OpenMode.READ_ONLY)
    except NoTierError as exc:
        print(args.scrub(f"kvtier inspect: {exc}"), file=sys.stderr)
        return EXIT_FAILED
    except ValueError as exc:
        raise UsageError(f"URL {shown!r}: {exc}") from None
    except Exception as exc:
        print(args.scrub(f"kvtier inspect: could not open {shown!r}: {exc}"), file=sys.stderr)
        return EXIT_FAILED
    out = Output.for_args(args)
    failed = False
    present: list[bool] | None = []
    try:
        try:
            stats = backend.stats()
        except Exception as exc:
            stats = {}
            failed = True
            print(args.scrub(f"kvtier inspect: FAILED: stats of {shown}: {exc}"),
                  file=sys.stderr)
        if not keys:
            # The counters are this process's own: only a call to the medium says whether
            # it can be read at all (the key is one no block can have: its answer is ignored).
            try:
                backend.probe([_REACHABILITY_KEY])
            except Exception as exc:
                failed = True
                print(args.scrub(f"kvtier inspect: FAILED: could not read {shown}: {exc}"),
                      file=sys.stderr)
        if keys:
            try:
                present = list(backend.probe(keys))
            except Exception as exc:  # probe raises when the medium fails: unknown, not absent
                present = None
                failed = True
                print(args.scrub(f"kvtier inspect: FAILED: could not check keys on {shown}: "
                                 f"{exc}"), file=sys.stderr)
        found = _Found(backend.url, namespace.digest_hex, stats, stored, keys, present)
    finally:
        backend.close()
    out.emit(tables=found.tables, sheets=found.sheets, document=found.document)
    return EXIT_FAILED if failed else EXIT_OK


@dataclass(slots=True)
class _Found:
    """What ``inspect`` read, in each output format. ``present`` is None when the key check
    failed (every key unknown)."""

    url: str
    digest: str
    stats: dict[str, Any]
    stored: Any
    keys: list[bytes]
    present: list[bool] | None

    def _verdicts(self) -> list[bool | None]:
        return [None if self.present is None else self.present[index]
                for index in range(len(self.keys))]

    def tables(self) -> list[Any]:
        from rich.table import Table

        from kvtier.replay.report import format_bytes

        shown: list[Any] = [f"{printable(self.url)} (namespace {self.digest})"]
        table = Table()
        table.add_column("counter")
        table.add_column("value", justify="right")
        for name, value in sorted(self.stats.items()):
            table.add_row(name, f"{value:,}" if isinstance(value, int) else str(value))
        shown.append(table)
        if self.stored is not None:
            disk = self.stored.disk_bytes
            shown.append(f"stored: {self.stored.blocks:,} blocks, "
                         f"{format_bytes(self.stored.bytes)}"
                         + ("" if disk is None else f" ({format_bytes(disk)} on disk)"))
        for key, present in zip(self.keys, self._verdicts(), strict=True):
            verdict = ("unknown (check failed)" if present is None
                       else "present" if present else "absent")
            shown.append(f"key {key.hex()}: {verdict}")
        return shown

    def sheets(self) -> list[Sheet]:
        """The counters; the stored blocks (with ``--digest``); the keys (with ``--key``)."""
        sheets = [Sheet(("counter", "value"), tuple(sorted(self.stats.items())))]
        if self.stored is not None:
            sheets.append(Sheet(("blocks", "bytes", "disk_bytes"), (
                (self.stored.blocks, self.stored.bytes, self.stored.disk_bytes),)))
        if self.keys:
            sheets.append(Sheet(("key", "present"), tuple(
                (key.hex(), "unknown" if present is None else "present" if present
                 else "absent") for key, present in zip(self.keys, self._verdicts(),
                                                        strict=True))))
        return sheets

    def document(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "namespace": self.digest,
            "stats": self.stats,
            "stored": None if self.stored is None else {
                "blocks": self.stored.blocks, "bytes": self.stored.bytes,
                "disk_bytes": self.stored.disk_bytes},
            "keys": [{"key": key.hex(), "present": present}
                     for key, present in zip(self.keys, self._verdicts(), strict=True)],
        }


def _stored_namespace(url: str, digest: str) -> Any:
    """The namespace stored at ``url`` under ``digest`` (a unique prefix will do)."""
    from kvtier.ops.inventory import UsageError as InventoryError
    from kvtier.ops.inventory import resolve_digest

    try:
        stored = resolve_digest(list_usage(url), digest)
    except InventoryError as exc:
        raise UsageError(str(exc)) from None
    if stored.fields is None:
        raise UsageError(
            f"namespace {stored.digest} has no valid manifest at {redact(url)} (written by an "
            f"older kvtier?); name its fields with --namespace FIELD=VALUE instead"
        )
    return stored


