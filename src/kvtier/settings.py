"""Settings tables: the one place where a setting's name, type, default, bounds, unit, env name
and help text are declared.

This module owns no mutable state: tables and settings are frozen, safe to share between threads.

Every component that takes settings (the top-level config, a secondary tier, a lookup manager,
each backend kind, the vLLM tier) declares one :class:`SettingsTable`. The table is the only
source of truth: constructors, the config loader, URL query options, ``KVTIER_*`` environment
variables, the vLLM tier's keyword arguments and the README's settings tables are all derived
from it, so a setting and its validation exist exactly once.

A component's settings reach it as one typed, frozen record: a dataclass whose fields are
declared with :func:`setting_field` (the record is the declaration; :func:`record_table` derives
the table, :func:`parse_record` builds a record from a mapping, and the record's
``__post_init__`` calls :func:`check_record`, so no record holds an unchecked value).

Values arrive as Python objects (dict / YAML / keyword arguments) or as strings (URL query
strings, environment variables); :meth:`Setting.parse` accepts both. A bad value raises
:class:`ConfigError` naming the key path, the value (``'***'`` for secrets) and what was expected.

Sizes follow one rule everywhere: units are binary. ``"64KiB"`` and ``"64K"`` both mean 65,536
bytes; a decimal spelling (``"64KB"``, ``"1.5GB"``) is ambiguous and rejected with a message that
says how to write it. A bare number is a byte count.
"""

from __future__ import annotations

import enum
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

from kvtier.errors import KvtierError

__all__ = [
    "ENV_PREFIX",
    "MAX_TIMEOUT_S",
    "MAX_TTL_S",
    "ConfigError",
    "Kind",
    "Secret",
    "Setting",
    "SettingsTable",
    "check_record",
    "choice_spelling",
    "did_you_mean",
    "env_layer",
    "format_size",
    "mapping_of",
    "parse_record",
    "parse_size",
    "record_table",
    "register_table",
    "registered_tables",
    "setting_field",
    "shown_value",
    "unknown_names_text",
]

_SETTING_KEY = "kvtier_setting"
MAX_TIMEOUT_S = 3600.0
"""The longest timeout a setting accepts: beyond it a value is a typo (and overflows clients)."""
MAX_TTL_S = 10 * 366 * 86400.0
"""The longest expiry (ten years): beyond it the milliseconds a server takes overflow."""
R = TypeVar("R")


class ConfigError(KvtierError, ValueError):
    """A setting is missing, unknown or invalid; the message names its key path."""


class Kind(enum.Enum):
    """How a setting's value is read; the value is the spelling used in generated docs."""

    INT = "int"
    FLOAT = "float"
    SIZE = "size"        # bytes: an int or a binary-unit string ("4GiB", "512M")
    BOOL = "bool"
    STR = "str"
    CHOICE = "choice"    # one of Setting.choices
    SECRET = "secret"    # a str that is never shown (wrapped in Secret)


@dataclass(frozen=True, slots=True)
class Secret:
    """A credential. ``str()``/``repr()`` never show it; read ``.reveal()`` where it is used."""

    _value: str = field(repr=False)

    def reveal(self) -> str:
        return self._value

    def __str__(self) -> str:
        return "***"

    def __repr__(self) -> str:
        return "Secret('***')"

    def __bool__(self) -> bool:
        return bool(self._value)


ENV_PREFIX = "KVTIER_"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
# ASCII digits only: "٤٠٩٦" is not a size a person meant to type into a config.
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE | re.ASCII)
_SIZE_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_INT_RE = re.compile(r"^\s*[+-]?\d{1,30}\s*$", re.ASCII)
_SHOWN_CHARS = 60


def shown_value(value: object) -> str:
    """``repr(value)`` for an error message, bounded: a 5,000-digit integer or a megabyte of
    text is named by its size, never printed (nor allowed to fail the message itself)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"an integer of about {value.bit_length() * 30103 // 100000 + 1} digits"
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}... ({len(text)} chars)"
SIZE_HELP = "a byte count or a binary size such as '64KiB', '512MiB', '4GiB' (K = 1024)"


def parse_size(value: object, path: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    """Bytes from an int or a binary-unit string; :class:`ConfigError` naming ``path`` if bad."""
    result: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        result = value
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match:
            number, prefix, binary, byte_suffix = match.groups()
            if prefix and byte_suffix and not binary:
                raise ConfigError(
                    f"{path}: {value!r} is ambiguous (1000 or 1024?); kvtier sizes are binary: "
                    f"write {number}{prefix.upper()}iB, or a byte count"
                )
            scaled = float(number) * 1024 ** _SIZE_POWERS[prefix.lower()]
            if scaled.is_integer():
                result = int(scaled)
    if result is None:
        raise ConfigError(f"{path}: expected {SIZE_HELP}, got {shown_value(value)}")
    if result < minimum or (maximum is not None and result > maximum):
        bounds = _range_text(minimum, maximum, False).removeprefix("a value ")
        raise ConfigError(f"{path}: expected a size {bounds} bytes, got {shown_value(value)}")
    return result


def format_size(num_bytes: int) -> str:
    """The shortest exact binary spelling of ``num_bytes`` ("64KiB", "1536", "4GiB")."""
    for power, unit in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if num_bytes and num_bytes % 1024**power == 0:
            return f"{num_bytes // 1024 ** power}{unit}"
    return str(num_bytes)


def _range_text(minimum: float | None, maximum: float | None, strict_min: bool) -> str:
    parts = []
    if minimum is not None:
        parts.append(f"{'>' if strict_min else '>='} {minimum}")
    if maximum is not None:
        parts.append(f"<= {maximum}")
    return "a value " + " and ".join(parts) if parts else "a value"


@dataclass(frozen=True, slots=True)
class Setting:
    """One named setting. ``default`` is the parsed value used when the setting is not given;
    ``nullable`` allows an explicit ``None`` (meaning "not set")."""

    name: str
    kind: Kind
    default: Any
    help: str
    minimum: float | None = None
    maximum: float | None = None
    strict_min: bool = False
    unit: str = ""
    choices: tuple[str, ...] = ()
    nullable: bool = False
    env: str | None = None
    required: bool = False  # no default: a config that omits it is an error

    def parse(self, value: object, path: str | None = None) -> Any:
        """The typed value of ``value`` (an object or a string), or :class:`ConfigError`."""
        where = path or self.name
        if value is None:
            if self.nullable:
                return None
            raise ConfigError(f"{where}: expected {self.expected()}, got None")
        parser = _PARSERS[self.kind]
        return parser(self, value, where)

    def expected(self) -> str:
        """What a valid value looks like, for error messages and docs."""
        bounds = (_range_text(self.minimum, self.maximum, self.strict_min)
                  .removeprefix("a value").strip())
        if self.kind is Kind.SIZE:
            return SIZE_HELP + (f", {bounds}" if bounds else "")
        if self.kind is Kind.CHOICE:
            return "one of " + ", ".join(repr(choice) for choice in self.choices)
        if self.kind is Kind.BOOL:
            return "a boolean (true/false, 1/0, yes/no, on/off)"
        if self.kind in (Kind.STR, Kind.SECRET):
            return "a string"
        noun = "an integer" if self.kind is Kind.INT else "a finite number"
        return f"{noun} {bounds}".strip() + (f" ({self.unit})" if self.unit else "")

    def type_text(self) -> str:
        """A short type for generated docs (``"int >= 1"``, ``"size"``, ``"`lru` | `arc`"``)."""
        if self.kind is Kind.CHOICE:
            return " \\| ".join(f"`{choice}`" for choice in self.choices)
        noun = {Kind.INT: "int", Kind.FLOAT: "number", Kind.SIZE: "size", Kind.BOOL: "bool",
                Kind.STR: "string", Kind.SECRET: "secret string"}[self.kind]
        bounds = (_range_text(self.minimum, self.maximum, self.strict_min)
                  .removeprefix("a value").strip())
        unit = f" ({self.unit})" if self.unit else ""
        return f"{noun} {bounds}".strip() + unit

    def shown(self, value: object) -> str:
        """``value`` as it may appear in a message or a report: never a secret."""
        if self.kind is Kind.SECRET and value is not None:
            return "'***'"
        return shown_value(value)

    def default_text(self) -> str:
        if self.required:
            return "required"
        if self.default is None:
            return "unset"
        if self.kind is Kind.SIZE:
            return format_size(self.default)
        if isinstance(self.default, bool):
            return "true" if self.default else "false"
        if self.default == "":
            return '""'
        return str(self.default)


def _in_bounds(setting: Setting, number: float) -> bool:
    low, high = setting.minimum, setting.maximum
    low_ok = low is None or (number > low if setting.strict_min else number >= low)
    return low_ok and (high is None or number <= high)


def _parse_int(setting: Setting, value: object, where: str) -> int:
    result: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        result = value
    elif isinstance(value, str) and _INT_RE.match(value):
        result = int(value)
    if result is None or not _in_bounds(setting, result):
        raise ConfigError(f"{where}: expected {setting.expected()}, got {setting.shown(value)}")
    return result


def _parse_float(setting: Setting, value: object, where: str) -> float:
    result: float | None = None
    try:
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            result = float(value)
    except (ValueError, OverflowError):  # "abc", or an integer too large for a float
        result = None
    if result is None or not math.isfinite(result) or not _in_bounds(setting, result):
        raise ConfigError(f"{where}: expected {setting.expected()}, got {shown_value(value)}")
    return result


def _parse_size(setting: Setting, value: object, where: str) -> int:
    minimum = 0 if setting.minimum is None else int(setting.minimum)
    maximum = None if setting.maximum is None else int(setting.maximum)
    return parse_size(value, where, minimum=minimum, maximum=maximum)


def _parse_bool(setting: Setting, value: object, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
    raise ConfigError(f"{where}: expected {setting.expected()}, got {value!r}")


def _parse_str(setting: Setting, value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {type(value).__name__} "
                          f"{setting.shown(value)}")
    return value


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"; did you mean X?"`` naming the known name closest to a misspelt ``name``, or ``""``
    (the one rule for config keys, table settings and ``KVTIER_*`` variables)."""
    import difflib

    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f"; did you mean {close[0]}?" if close else ""


def unknown_names_text(unknown: Sequence[str], known: Iterable[str]) -> str:
    """The hint for several unknown names: each one's closest known name."""
    names = sorted(known)
    hints = [f"{name} -> {hint.removeprefix('; did you mean ').removesuffix('?')}"
             for name in unknown if (hint := did_you_mean(name, names))]
    if not hints:
        return ""
    return f"; did you mean {hints[0].partition(' -> ')[2]}?" if len(unknown) == 1 else (
        f"; did you mean: {', '.join(hints)}?")


def choice_spelling(text: str) -> str:
    """The one spelling of a choice value: lower case, words joined by ``_`` (``write_through``,
    ``round_robin``). ``Write-Through`` and ``round-robin`` are read as those, so older
    spellings keep working; help, docs and errors show this one."""
    return text.strip().lower().replace("-", "_")


def _parse_choice(setting: Setting, value: object, where: str) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if not isinstance(value, str) or choice_spelling(value) not in setting.choices:
        raise ConfigError(f"{where}: expected {setting.expected()}, got {value!r}")
    return choice_spelling(value)


def _parse_secret(setting: Setting, value: object, where: str) -> Secret:
    if isinstance(value, Secret):
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {type(value).__name__} '***'")
    return Secret(value)


_PARSERS: dict[Kind, Any] = {
    Kind.INT: _parse_int,
    Kind.FLOAT: _parse_float,
    Kind.SIZE: _parse_size,
    Kind.BOOL: _parse_bool,
    Kind.STR: _parse_str,
    Kind.CHOICE: _parse_choice,
    Kind.SECRET: _parse_secret,
}


class SettingsTable:
    """The settings of one component, in declaration order."""

    __slots__ = ("_by_name", "component")

    def __init__(self, component: str, settings: Iterable[Setting]) -> None:
        """``settings`` may reuse another table's :class:`Setting` objects (one declaration,
        several components: the vLLM tier shares ``io_threads`` with the secondary tier)."""
        self.component = component
        self._by_name: dict[str, Setting] = {}
        for setting in settings:
            if setting.name in self._by_name:
                raise ValueError(f"{component}: setting {setting.name!r} declared twice")
            self._by_name[setting.name] = setting

    def __iter__(self) -> Iterator[Setting]:
        return iter(self._by_name.values())

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> Setting:
        return self._by_name[name]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def defaults(self) -> dict[str, Any]:
        return {setting.name: setting.default for setting in self}

    def parse(self, values: Mapping[str, Any], path: str = "", *,
              fill_defaults: bool = True) -> dict[str, Any]:
        """Typed values for ``values``; unknown names are rejected, missing ones defaulted."""
        self.reject_unknown(values, path)
        prefix = f"{path}." if path else ""
        parsed = self.defaults() if fill_defaults else {}
        for name, value in values.items():
            parsed[name] = self._by_name[name].parse(value, prefix + name)
        if fill_defaults:
            for setting in self:
                if setting.required and parsed.get(setting.name) is None:
                    raise ConfigError(f"{prefix}{setting.name}: missing; it is required "
                                      f"({setting.help})")
        return parsed

    def parse_env(self, environ: Mapping[str, str], path: str = "") -> dict[str, Any]:
        """Typed values of the settings ``environ`` sets; errors name the variable."""
        parsed: dict[str, Any] = {}
        for name, raw in self.from_env(environ).items():
            setting = self._by_name[name]
            parsed[name] = setting.parse(raw, f"{setting.env} ({path}{name})")
        return parsed

    def reject_unknown(self, values: Iterable[str], path: str = "", *,
                       nearby: Iterable[str] = ()) -> None:
        """:class:`ConfigError` naming each unknown name and the closest known one (of this
        table, or of ``nearby``: the other settings a mapping at ``path`` may hold)."""
        unknown = sorted(set(values) - set(self._by_name), key=str)
        if unknown:
            where = f"{path}." if path else ""
            raise ConfigError(
                f"unknown {self.component} setting(s) {[where + str(n) for n in unknown]}; "
                f"expected some of {sorted(self._by_name)}"
                f"{unknown_names_text([str(n) for n in unknown], [*self._by_name, *nearby])}"
            )

    def from_env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The raw values of this table's settings that ``environ`` sets (by ``Setting.env``)."""
        return {setting.name: environ[setting.env] for setting in self
                if setting.env is not None and setting.env in environ}

    def env_names(self) -> frozenset[str]:
        return frozenset(setting.env for setting in self if setting.env is not None)

    def default(self, name: str) -> Any:
        """The declared default of ``name`` (constructors take their defaults from here)."""
        return self._by_name[name].default

    def markdown(self, names: Sequence[str] | None = None) -> str:
        """A Markdown table of the settings (the README's tables are generated from this)."""
        rows = ["| setting | type | default | env | meaning |", "|---|---|---|---|---|"]
        for setting in self:
            if names is not None and setting.name not in names:
                continue
            env = f"`{setting.env}`" if setting.env else ""
            rows.append(f"| `{setting.name}` | {setting.type_text()} | {setting.default_text()} "
                        f"| {env} | {setting.help} |".replace("  ", " "))
        return "\n".join(rows)


# ---------------------------------------------------------------------------- records

def setting_field(kind: Kind | Setting, default: Any = None, help: str = "",
                  **options: Any) -> Any:
    """A field of a settings record (a frozen dataclass) declared as a setting, named after the
    field: ``io_threads: int = setting_field(Kind.INT, 4, "threads", minimum=1)``. Pass an
    existing :class:`Setting` to share its declaration with another table."""
    if isinstance(kind, Setting):
        return field(default=kind.default, metadata={_SETTING_KEY: kind})
    declared = Setting("", kind, default, help, **options)
    return field(default=default, metadata={_SETTING_KEY: declared})


def record_table(component: str, record: type) -> SettingsTable:
    """The :class:`SettingsTable` of a settings record class (one setting per field, in order).

    The record is the one declaration; the table (env names, docs, validation) is derived."""
    settings: list[Setting] = []
    for item in fields(record):
        declared = item.metadata.get(_SETTING_KEY)
        if not isinstance(declared, Setting):
            raise TypeError(f"{record.__name__}.{item.name}: not declared with setting_field()")
        settings.append(declared if declared.name == item.name
                        else replace(declared, name=item.name))
    return SettingsTable(component, settings)


def parse_record(record: type[R], table: SettingsTable, values: Mapping[str, Any],
                 path: str = "") -> R:
    """The typed record of ``values`` (objects or strings), defaults filled; unknown or bad
    values raise :class:`ConfigError` naming ``path``."""
    return record(**table.parse(values, path))


def check_record(record: object, table: SettingsTable, path: str = "") -> None:
    """Validate (and normalise: ``"4GiB"`` -> 4294967296) every field of a frozen settings
    record in place; a record's ``__post_init__`` calls this, so no record holds a bad value."""
    prefix = f"{path}." if path else ""
    for setting in table:
        value = setting.parse(getattr(record, setting.name), prefix + setting.name)
        object.__setattr__(record, setting.name, value)


def env_layer(table: SettingsTable, explicit: Mapping[str, Any], path: str = "",
              environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``explicit`` (raw; parse the result) over the values ``environ`` sets for ``table``
    (parsed here, so an error names the variable): the ``KVTIER_*`` variables are defaults, an
    explicit value always wins."""
    env = os.environ if environ is None else environ
    layered: dict[str, Any] = table.parse_env(env, path)
    layered.update(explicit)
    return layered


def mapping_of(value: object, path: str) -> Mapping[str, Any]:
    """``value`` if it is a mapping with string keys, else :class:`ConfigError` naming ``path``."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(f"{path}: keys must be strings, got {key!r}")
    return value


_REGISTERED: dict[str, SettingsTable] = {}


def register_table(table: SettingsTable) -> SettingsTable:
    """Make an outer component's table known to the config loader's docs and ``KVTIER_*`` checks
    (the vLLM tier's table registers itself when its module is imported), so that the loader
    never imports the components above it. Idempotent per component name."""
    _REGISTERED[table.component] = table
    return table


def registered_tables() -> tuple[SettingsTable, ...]:
    return tuple(_REGISTERED.values())
