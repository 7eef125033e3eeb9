"""What every ``kvtier`` command shares: exit codes, argument types, the usage error, the
console, the options of a replayed stack, and the namespace fields given on the command line.

No state: constants and functions, called on the command's main thread.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from kvtier.errors import KvtierError
from kvtier.settings import MAX_TTL_S, ConfigError, Kind, Setting

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

DEFAULT_TRACE = "builtin:conversation"
REPLAY_MODEL = "kvtier-replay"
"""The namespace model of replayed blocks (kvtier.replay.engine); the revision starts with the
run's namespace tag."""


class UsageError(KvtierError):
    """Bad input found after argument parsing; reported like an argparse error (exit 2)."""


def _argument(kind: Kind, minimum: float | None = None, *, strict_min: bool = False,
              maximum: float | None = None) -> Callable[[str], Any]:
    """An argparse ``type`` that reads a value by the settings rules (one rule per kind)."""
    setting = Setting("value", kind, None, "", minimum=minimum, strict_min=strict_min,
                      maximum=maximum)

    def parse(text: str) -> Any:
        try:
            return setting.parse(text.replace("_", "") if kind is Kind.INT else text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("value: ")) from None

    return parse


def int_at_least(minimum: int) -> Callable[[str], Any]:
    return _argument(Kind.INT, minimum)


positive_float = _argument(Kind.FLOAT, 0, strict_min=True)
non_negative_float = _argument(Kind.FLOAT, 0)
step_ms = _argument(Kind.FLOAT, 0, maximum=60_000)
"""A modelled step of up to a minute: beyond it a value is a typo (and overflows the sleep)."""
speed_factor = _argument(Kind.FLOAT, 1e-3, maximum=1e6)
"""Replay speed: a thousandth of real time (a trace gap of a second takes 17 minutes) to a
million times; 1e-300 would sleep forever."""
ttl_seconds = _argument(Kind.FLOAT, 0.001, maximum=MAX_TTL_S)
generated_sessions = _argument(Kind.INT, 1, maximum=10_000)
"""Sessions of builtin:agentic (kvtier.replay.agentic.MAX_GENERATED_SESSIONS)."""
_size = _argument(Kind.SIZE)


def block_bytes(text: str) -> int:
    value: int = _size(text)
    if value < 16 or value % 16:
        raise argparse.ArgumentTypeError(
            f"expected a size >= 16 bytes and a multiple of 16, got {text!r} ({value} bytes)"
        )
    return value


def tier_url(text: str) -> str:
    from kvtier.backends import redact_url, registered_schemes

    schemes = registered_schemes()
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    if scheme not in schemes:
        raise argparse.ArgumentTypeError(
            f"expected a tier URL with a scheme in {', '.join(s + '://' for s in schemes)}, "
            f"got {redact_url(text)!r}"
        )
    return text


def namespace_field(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE, got {text!r}")
    return name.strip(), value


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def add_stack_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tier", dest="tiers", action="append", type=tier_url, default=[], metavar="URL",
        help="secondary tier URL, in lookup order (repeatable); default: a file tier in a "
             "temporary directory, removed afterwards",
    )
    parser.add_argument("--block-bytes", type=block_bytes, default=16 * 1024, metavar="SIZE",
                        help="bytes per KV block payload (default 16KiB)")
    parser.add_argument("--cpu-blocks", type=int_at_least(1), default=16_000, metavar="N",
                        help="primary (CPU) pool size in blocks, per instance (default 16000)")
    parser.add_argument("--gpu-blocks", type=int_at_least(0), default=None, metavar="N",
                        help="GPU prefix cache size in blocks, per instance; a request needing "
                             "more is rejected and counted, as vLLM rejects a prompt longer "
                             "than its KV cache (default: max(2000, the trace's largest "
                             "request), so nothing is rejected)")


def console() -> Any:
    """The rich console of a command's tables (the rule is :func:`kvtier.cli.output.console`)."""
    from kvtier.cli.output import console as output_console

    return output_console()


def redact(url: str) -> str:
    from kvtier.backends import redact_url

    return redact_url(url)


def check_memory(args: argparse.Namespace) -> None:
    """Refuse up front a primary pool the machine cannot hold (instead of a MemoryError)."""
    from kvtier.primary import ArenaError, check_arena_fits

    total = args.cpu_blocks * args.block_bytes * getattr(args, "instances", 1)
    try:
        check_arena_fits(total, "heap")
    except ArenaError as exc:
        raise UsageError(f"--cpu-blocks {args.cpu_blocks:,} x --block-bytes "
                          f"{args.block_bytes:,}: {exc}") from None


_INT_FIELDS = frozenset({"block_size", "world_size", "rank"})


def _field_value(name: str, value: str) -> Any:
    return int(value) if name in _INT_FIELDS and value.lstrip("-").isdigit() else value


def namespace_from_args(pairs: Sequence[tuple[str, str]]) -> Any:
    from kvtier.keys import Namespace

    fields: dict[str, Any] = {"model": REPLAY_MODEL}
    fields.update((name, _field_value(name, value)) for name, value in pairs)
    return Namespace.from_mapping(fields)


