"""``kvtier purge``: remove the blocks and manifests of chosen namespaces from a tier.

Asks before deleting on a terminal (declining exits 0: nothing removed); elsewhere it needs
``--yes`` (exit 2 without it). No state: runs on the
command's main thread.
"""

from __future__ import annotations

import argparse
import enum
import sys
from typing import Any

from kvtier.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError, namespace_field, redact
from kvtier.cli.output import Output, add_format_option
from kvtier.cli.usage import MediumFailed, list_usage, usage_sheet, usage_table
from kvtier.text import Sheet


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
    add_format_option(purge)
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
    out = Output.for_args(args)
    if not chosen:
        out.note("nothing to purge: no stored namespace matches")
        _emit(out, args, chosen, None)
        return EXIT_OK
    what = (f"{sum(i.blocks for i in chosen):,} blocks "
            f"({format_bytes(sum(i.bytes for i in chosen))}) in {len(chosen)} namespace(s)")
    if out.for_people:  # the table before the question; scripts get it with the outcome
        out.console.print(usage_table(args.url, chosen, f"kvtier purge: {redact(args.url)}"))
    if args.dry_run:
        _emit(out, args, chosen, None)
        out.note(f"dry run: would remove {what}; nothing removed")
        return EXIT_OK
    if not args.yes:
        answer = _confirm(f"remove {what}?")
        if answer is not Answer.YES:
            # Declining is the user's choice, not a failure (exit 0); no terminal to ask on is
            # a missing --yes (exit 2). docs/operations.md documents both.
            return EXIT_OK if answer is Answer.DECLINED else EXIT_USAGE
    try:
        result = delete(args.url, chosen)
    except MediumError as exc:
        print(f"kvtier purge: failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    _emit(out, args, chosen, result.objects_deleted)
    out.note(f"removed {what} ({result.objects_deleted:,} objects)")
    return EXIT_OK


def _emit(out: Output, args: argparse.Namespace, chosen: list[Any], deleted: int | None) -> None:
    """The outcome for scripts (``plain``: the namespaces, then one row of totals; ``json``: one
    object); people saw the table before the question and read the note that follows."""
    action = ("nothing" if not chosen else "would_remove" if deleted is None else "removed")
    blocks, size = sum(i.blocks for i in chosen), sum(i.bytes for i in chosen)
    out.emit(
        tables=lambda: [],
        sheets=lambda: [usage_sheet(chosen), Sheet(
            ("action", "namespaces", "blocks", "bytes", "objects_deleted"),
            ((action, len(chosen), blocks, size, deleted),))],
        document=lambda: {"url": redact(args.url), "action": action, "dry_run": args.dry_run,
                          "namespaces": [item.to_json() for item in chosen], "blocks": blocks,
                          "bytes": size, "objects_deleted": deleted},
    )


class Answer(enum.Enum):
    YES = "yes"
    DECLINED = "declined"
    NO_TERMINAL = "no terminal"


def _confirm(question: str) -> Answer:
    """Ask on a terminal; refuse (with the reason) when stdin is not one."""
    if not sys.stdin.isatty():
        print(f"kvtier purge: refusing to {question.rstrip('?')} without --yes: stdin is not a "
              f"terminal, so nobody can confirm (see what would go with --dry-run)",
              file=sys.stderr)
        return Answer.NO_TERMINAL
    # The question on stderr, like every message for people: stdout may be a --format pipe.
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
    try:
        answer = input().strip().lower()
    except EOFError:  # Ctrl-D: no answer is a no
        answer = ""
    if answer not in ("y", "yes"):
        print("kvtier purge: declined; nothing removed", file=sys.stderr)
        return Answer.DECLINED
    return Answer.YES


