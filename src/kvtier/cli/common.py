"""What every ``kvtier`` command shares: exit codes, argument types, the usage error, the
console, the options of a replayed stack, and the namespace fields given on the command line.

No state: constants and functions, called on the command's main thread.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from kvtier.errors import KvtierError
from kvtier.settings import MAX_TTL_S, ConfigError, Kind, Setting, choice_spelling

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
    """A tier URL, checked without touching the medium (scheme, form, options), so a bad one
    fails before a run starts rather than after it."""
    from kvtier.backends import kind_of, path_hint, redact_url, registered_schemes

    schemes = registered_schemes()
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    if scheme not in schemes:
        raise argparse.ArgumentTypeError(
            f"expected a tier URL with a scheme in {', '.join(s + '://' for s in schemes)}, "
            f"got {redact_url(text)!r}{path_hint(text)}"
        )
    try:
        kind_of(text).parse_url(text, {})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def choice(text: str) -> str:
    """An argparse ``type`` for choice values: one spelling (``write_through``, ``round_robin``),
    the dashed one accepted too (:func:`kvtier.settings.choice_spelling`)."""
    return choice_spelling(text)


def namespace_field(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE, got {text!r}")
    return name.strip(), value


_DASHED_VALUE = re.compile(r"^-\d")
"""What argparse takes for an option unless it is a plain negative number: '-16KiB' too."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (the message, then where to read the usage) and values
    such as ``-16KiB`` read as values, so that their own check names them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # argparse reads '-16KiB' as an unknown option ("expected one argument"); kvtier has no
        # option that starts with a dash and a digit, so such a word is always a value.
        self._negative_number_matcher = _DASHED_VALUE
        self._words: list[str] = []

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._words = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        if message.endswith("expected one argument"):
            message = self._dashed_value(message)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def _dashed_value(self, message: str) -> str:
        """Name the value argparse took for an option (``--namespace-tag -x``)."""
        options = message.removeprefix("argument ").partition(":")[0].split("/")
        for index, word in enumerate(self._words[:-1]):
            value = self._words[index + 1]
            if word in options and value.startswith("-"):
                return (f"argument {word}: got {value!r}, which reads as an option; a value that "
                        f"starts with '-' is written {word}={value}")
        return message


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


PURGE_URL_VARIABLE = "TIER_URL"


def purge_commands(url: str, revisions: Sequence[str]) -> list[str]:
    """The ``kvtier purge`` command lines, ready to paste, that remove the replay namespaces
    ``revisions`` from the tier at ``url``. A URL with a secret is never printed: the commands
    read it from ``$TIER_URL`` and the last line says how to set it."""
    import shlex

    shown = redact(url)
    target = f'"${PURGE_URL_VARIABLE}"' if shown != url else shlex.quote(url)
    lines = [f"kvtier purge {target} --namespace model={REPLAY_MODEL} "
             f"--namespace revision={shlex.quote(revision)}" for revision in revisions]
    if shown != url:
        lines.append(f"(first export {PURGE_URL_VARIABLE}={shlex.quote(shown)} with each *** "
                     f"replaced by the secret of the --tier URL, which is not shown)")
    return lines


def check_memory(args: argparse.Namespace) -> None:
    """Refuse up front a primary pool the machine cannot hold (instead of a MemoryError)."""
    from kvtier.primary import ArenaError, check_arena_fits

    total = args.cpu_blocks * args.block_bytes * getattr(args, "instances", 1)
    try:
        check_arena_fits(total, "heap")
    except ArenaError as exc:
        raise UsageError(f"--cpu-blocks {args.cpu_blocks:,} x --block-bytes "
                          f"{args.block_bytes:,}: {exc}") from None


def check_output_file(option: str, path: os.PathLike[str] | None) -> None:
    """Refuse now (:class:`UsageError`) an output file the command could not write when it
    ends: a missing or unwritable directory, a directory, FIFO, socket or device in its place.
    The replay runs for minutes; its report must not be lost to a typo found at the end."""
    import stat

    if path is None:
        return
    shown = os.fspath(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(shown))
        if not os.path.isdir(parent):
            raise UsageError(f"{option} {shown}: directory {parent!r} does not exist; expected "
                             f"a file path in an existing directory") from None
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UsageError(f"{option} {shown}: directory {parent!r} is not writable by this "
                             f"user") from None
        return
    except OSError as exc:
        raise UsageError(f"{option} {shown}: {exc.strerror}; expected a writable file "
                         f"path") from None
    if not stat.S_ISREG(info.st_mode):
        what = "a directory" if stat.S_ISDIR(info.st_mode) else (
            "a FIFO" if stat.S_ISFIFO(info.st_mode) else "a socket or device")
        raise UsageError(f"{option} {shown}: is {what}, not a regular file; expected a file path")
    if not os.access(path, os.W_OK):
        raise UsageError(f"{option} {shown}: the file is not writable by this user")


_INT_FIELDS = frozenset({"block_size", "world_size", "rank"})


def _field_value(name: str, value: str) -> Any:
    return int(value) if name in _INT_FIELDS and value.lstrip("-").isdigit() else value


def namespace_from_args(pairs: Sequence[tuple[str, str]]) -> Any:
    from kvtier.keys import Namespace

    fields: dict[str, Any] = {"model": REPLAY_MODEL}
    fields.update((name, _field_value(name, value)) for name, value in pairs)
    return Namespace.from_mapping(fields)


