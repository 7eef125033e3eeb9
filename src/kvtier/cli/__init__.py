"""The ``kvtier`` command: ``replay``, ``inspect``, ``usage``, ``purge`` and ``bench``.

One module per command (:mod:`~kvtier.cli.replay`, :mod:`~kvtier.cli.inspect`,
:mod:`~kvtier.cli.usage`, :mod:`~kvtier.cli.purge`, :mod:`~kvtier.cli.bench`), each with a
``register(commands)`` that adds its sub-parser (and sets ``run``); :mod:`~kvtier.cli.common`
holds what they share.

Exit codes: 0 success (a purge declined at its prompt too: nothing removed); 1 the run failed (a
byte mismatch, a stuck request, a backend or validation failure, a tier that failed for most of
the run, an ``inspect`` check that could not be answered, no tier at the URL given to
``inspect``, ``usage`` or ``purge``); 2 bad arguments or bad input (one line naming the bad
value, then where the usage is); 128 + N when signal N (SIGINT 130, SIGTERM 143, SIGHUP 129)
stopped the command after cleaning up, or after a second signal stopped the cleanup, which then
says what it left and how to remove it (see
:mod:`kvtier.cli.signals`). No message ever shows a password or key given in a URL
(:mod:`kvtier.cli.scrub`).

This module owns no long-lived state; each command runs on the calling thread.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from kvtier.cli import bench, inspect, purge, replay, usage
from kvtier.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, Parser, UsageError

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "main"]


def _build_parser() -> argparse.ArgumentParser:
    from kvtier import __version__
    from kvtier.ops.logs import LOG_LEVELS

    parser = Parser(
        prog="kvtier",
        description="kvtier: a tiered KV cache for LLM inference engines.",
    )
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}",
                        help="print kvtier's version and exit")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="warning",
                        help="log records at this level and above go to stderr, with time and "
                             "level (default warning)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=Parser, help="what to do")
    for command in (replay, inspect, bench, usage, purge):  # the order of --help
        command.register(commands)
    return parser


def run_command() -> NoReturn:
    """The ``kvtier`` executable: :func:`main`, then exit with its code.

    When the S3 client was used, the process ends without the interpreter's finalization
    (``os._exit`` after flushing the streams and the logs): obstore's native runtime threads may
    still be calling back into asyncio then, and a thread that re-takes the interpreter lock
    during finalization aborts the whole process (SIGABRT, exit 134 instead of the real code)
    because it cannot unwind through Rust frames. Everything kvtier writes is flushed or
    closed by then (the backends are closed by the commands themselves)."""
    code = main()
    if "obstore" in sys.modules:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        logging.shutdown()
        os._exit(code)
    sys.exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    from kvtier.cli.scrub import ScrubbedStream, Scrubber
    from kvtier.cli.signals import SignalGuard, Terminated
    from kvtier.ops.logs import configure_cli_logging

    raw = list(sys.argv[1:] if argv is None else argv)
    scrub = Scrubber.for_run(raw)
    parser = _build_parser()
    with contextlib.redirect_stderr(ScrubbedStream(sys.stderr, scrub)):
        args = parser.parse_args(raw)
    configure_cli_logging(args.log_level)
    args.scrub = scrub
    guard = SignalGuard()
    try:
        with scrub.in_logs(), guard:
            code: int = args.run(args)
            return code
    except UsageError as exc:
        print(scrub(f"kvtier {args.command}: error: {exc}"), file=sys.stderr)
        return EXIT_USAGE
    except Terminated as stop:
        done = ("cleanup stopped, blocks left (see above)" if guard.incomplete
                else "cleaned up")
        print(f"kvtier {args.command}: stopped by {stop.name}; {done}", file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:
        print(f"kvtier {args.command}: interrupted", file=sys.stderr)
        return 130
    except RecursionError:
        print(f"kvtier {args.command}: error: input nested too deeply", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:
        if os.environ.get("KVTIER_DEBUG"):
            raise
        print(scrub(f"kvtier {args.command}: failed: {type(exc).__name__}: {exc} "
                    f"(set KVTIER_DEBUG=1 for the traceback)"), file=sys.stderr)
        return EXIT_FAILED
