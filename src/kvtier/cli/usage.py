"""``kvtier usage``: what a tier stores, per namespace, read from the medium itself.

Also the table ``kvtier purge`` shows. No state: runs on the command's main thread.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from kvtier.cli.common import EXIT_FAILED, EXIT_OK, UsageError, redact
from kvtier.cli.output import Output, add_format_option, add_json_alias
from kvtier.text import Sheet

_log = logging.getLogger("kvtier.cli")


def register(commands: Any) -> None:
    """Add the ``usage`` sub-parser."""
    usage = commands.add_parser(
        "usage", help="what a tier stores, per namespace (digest, model, blocks, bytes, age)",
        description="List every kvtier namespace stored at URL, read from the medium itself "
                    "(SCAN on Redis and every Cluster primary, LIST on S3, the directory tree "
                    "of a file tier): digest, model, blocks, bytes, oldest and newest block.",
    )
    usage.add_argument("url", metavar="URL", help="the backend URL (file://, redis://, "
                       "rediss://, redis+cluster://, s3://, memory://)")
    add_format_option(usage)
    add_json_alias(usage)
    usage.set_defaults(run=run)


def list_usage(url: str) -> list[Any]:
    from kvtier.ops.inventory import MediumError, usage
    from kvtier.ops.inventory import UsageError as InventoryError

    try:
        return usage(url)
    except InventoryError as exc:
        raise UsageError(str(exc)) from None
    except MediumError as exc:
        raise MediumFailed(str(exc)) from None


class MediumFailed(Exception):
    """The medium could not be listed or purged (exit 1)."""


def _ago(now: float, when: float) -> str:
    seconds = max(0.0, now - when)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _age(now: float, oldest: float | None, newest: float | None) -> str:
    """The ages of the oldest and the newest block in one short cell: ``3d-2m ago``."""
    if oldest is None or newest is None:
        return "-"
    first, last = _ago(now, oldest), _ago(now, newest)
    return f"{first} ago" if first == last else f"{first}-{last} ago"


def _disk(value: int | None) -> str:
    from kvtier.replay.report import format_bytes

    return "-" if value is None else format_bytes(value)


def usage_table(url: str, found: Sequence[Any], title: str) -> Any:
    import time

    from rich.table import Table
    from rich.text import Text

    from kvtier.replay.report import format_bytes
    from kvtier.text import printable

    now = time.time()
    table = Table(title=Text(printable(title)), title_justify="left", caption_justify="left")
    table.add_column("digest", no_wrap=True)
    table.add_column("namespace", overflow="fold")
    for header in ("blocks", "bytes", "on disk", "age"):
        table.add_column(header, justify="right", no_wrap=True)
    for item in found:
        # Text, not a markup string: a model name such as '[/]' or '[link=...]' from a shared
        # tier is shown as written, never parsed (nor crashes the table); control characters
        # are shown escaped (printable).
        table.add_row(item.digest[:12], Text(printable(_namespace_label(item))), f"{item.blocks:,}",
                      format_bytes(item.bytes), _disk(item.disk_bytes),
                      _age(now, item.oldest, item.newest))
    total = sum(item.bytes for item in found)
    table.caption = (f"{len(found):,} namespace(s), {sum(i.blocks for i in found):,} blocks, "
                     f"{format_bytes(total)} of frames")
    disk = [item.disk_bytes for item in found if item.disk_bytes is not None]
    if disk:
        table.caption += (f", {format_bytes(sum(disk))} on disk (with file-system blocks and "
                          f"directories)")
    table.caption += "; age: of the oldest and the newest block"
    if url.startswith("redis"):
        table.caption += " (redis keeps no write time: the last access times)"
    return table


USAGE_COLUMNS = ("digest", "model", "namespace", "blocks", "bytes", "disk_bytes", "oldest",
                 "newest")


def usage_sheet(found: Sequence[Any]) -> Sheet:
    """The ``plain`` table of :func:`usage_table`: full digests, raw numbers, Unix times."""
    return Sheet(USAGE_COLUMNS, tuple(
        (item.digest, item.model, _namespace_label(item), item.blocks, item.bytes,
         item.disk_bytes, item.oldest, item.newest) for item in found))


def _namespace_label(item: Any) -> str:
    """The model, then the fields that differ from their defaults (never the long layout)."""
    if item.fields is None:
        return "? (no manifest)"
    defaults = {"revision": "", "dtype": "", "block_size": 0, "world_size": 1, "rank": 0,
                "tenant": ""}
    extra = [f"{name}={item.fields[name]}" for name, default in defaults.items()
             if item.fields.get(name, default) != default]
    return " ".join([str(item.fields["model"]), *extra])


def run(args: argparse.Namespace) -> int:
    try:
        found = list_usage(args.url)
    except MediumFailed as exc:
        print(f"kvtier usage: failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    _log.info("listed %d namespace(s) at %s", len(found), redact(args.url))
    Output.for_args(args).emit(
        tables=lambda: [usage_table(args.url, found, f"kvtier usage: {redact(args.url)}")],
        sheets=lambda: [usage_sheet(found)],
        document=lambda: [item.to_json() for item in found],
    )
    return EXIT_OK
