"""``kvtier purge``: remove the blocks and manifests of chosen namespaces from a tier.

Asks before deleting on a terminal; elsewhere it needs ``--yes``. No state: runs on the
command's main thread.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvtier.cli import common
from kvtier.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError, namespace_field, redact
from kvtier.cli.usage import MediumFailed, list_usage, usage_table


def register(commands: Any) -> None:
    """Add the ``purge`` sub-parser."""
    purge = commands.add_parser(
        "purge", help="remove the blocks of namespaces from a tier",
        description="Remove every block and the manifest of the namespaces selected by "
                    "--digest and/or --namespace FIELD=VALUE. Asks before deleting on a "
                    "terminal; elsewhere it needs --yes.",
    )
    purge.add_argument("url", metavar="URL", help="the backend URL")
    purge.add_argument("--digest", default=None, metavar="HEX",
                       help="the namespace digest, or a unique prefix of it (see `kvtier usage`)")
    purge.add_argument("--namespace", dest="namespace_fields", action="append",
                       type=namespace_field, default=[], metavar="FIELD=VALUE",
                       help="select namespaces whose manifest has FIELD=VALUE (repeatable; all "
                            "must match), e.g. model=llama-3-8b")
    purge.add_argument("--dry-run", action="store_true",
                       help="show what would be removed; remove nothing")
    purge.add_argument("--yes", action="store_true",
                       help="remove without asking (needed when stdin is not a terminal)")
    purge.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.ops.inventory import MediumError, delete, select
    from kvtier.ops.inventory import UsageError as InventoryError
    from kvtier.replay.report import format_bytes

    fields = {name: value for name, value in args.namespace_fields}
    try:
        chosen = select(list_usage(args.url), args.digest, fields)
    except InventoryError as exc:
        raise UsageError(str(exc)) from None
    except MediumFailed as exc:
        print(f"kvtier purge: failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    console = common.console()
    if not chosen:
        console.print("nothing to purge: no stored namespace matches")
        return EXIT_OK
    what = (f"{sum(i.blocks for i in chosen):,} blocks "
            f"({format_bytes(sum(i.bytes for i in chosen))}) in {len(chosen)} namespace(s)")
    console.print(usage_table(args.url, chosen, f"kvtier purge: {redact(args.url)}"))
    if args.dry_run:
        console.print(f"dry run: would remove {what}; nothing removed")
        return EXIT_OK
    if not args.yes and not _confirmed(f"remove {what}?"):
        return EXIT_USAGE
    try:
        result = delete(args.url, chosen)
    except MediumError as exc:
        print(f"kvtier purge: failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    console.print(f"removed {what} ({result.objects_deleted:,} objects)")
    return EXIT_OK


def _confirmed(question: str) -> bool:
    """Ask on a terminal; refuse (with the reason) when stdin is not one."""
    if not sys.stdin.isatty():
        print(f"kvtier purge: refusing to {question.rstrip('?')} without --yes: stdin is not a "
              f"terminal, so nobody can confirm (see what would go with --dry-run)",
              file=sys.stderr)
        return False
    answer = input(f"{question} [y/N] ").strip().lower()
    if answer not in ("y", "yes"):
        print("kvtier purge: nothing removed", file=sys.stderr)
        return False
    return True


