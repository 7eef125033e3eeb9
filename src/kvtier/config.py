"""One typed kvtier configuration, from a dict, a YAML file or ``KVTIER_*`` environment variables.

Owns no mutable state: configs are frozen dataclasses and the tables are frozen.

Every setting is declared once, in the :class:`~kvtier.settings.SettingsTable` beside the
component that takes it: :data:`CONFIG_SETTINGS` (top level, here), the namespace's
(:mod:`kvtier.namespace_settings`), a tier's (:mod:`kvtier.tiering.tier_settings`, whose I/O
settings are the typed record ``TierSettings``; the ``prefetch`` section's record
``PrefetchSettings`` is there too) and its lookup manager's
(:mod:`kvtier.lookup.settings`); outer components (the vLLM ``KvtierTier``) register their
tables (:func:`~kvtier.settings.register_table`). This module is the loader on top of the core
layers: it imports their tables, nothing in the core imports it, and it imports nothing above.

Every error is a :class:`ConfigError` naming the key path
(``secondary_tiers[1].lookup.quarantine_s``), the bad value and what was expected; unknown keys
are rejected by name; sizes are binary (``"64KiB"``; ``"64KB"`` is ambiguous and rejected).
The keys, the environment rules (``KVTIER_CONFIG`` first, then each setting's ``env`` name;
tier and lookup variables are defaults for every tier) and a full YAML example are in
``docs/configuration.md``, whose tables :func:`settings_markdown` generates.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import re
from collections.abc import Hashable, Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any

import yaml

from kvtier.backends import SCHEMES, kind_for, registered_kinds, registered_schemes
from kvtier.files import read_regular_file
from kvtier.keys import Namespace
from kvtier.lookup.manager import LOOKUP_SETTINGS
from kvtier.namespace_settings import NAMESPACE_SETTINGS
from kvtier.ops.metrics import MetricsRegistry
from kvtier.policies import PolicyName
from kvtier.primary import PrimaryBacking
from kvtier.settings import (
    ENV_PREFIX,
    ConfigError,
    Kind,
    Setting,
    SettingsTable,
    did_you_mean,
    env_layer,
    mapping_of,
    parse_size,
    registered_tables,
    shown_value,
    unknown_names_text,
)
from kvtier.tiering.plans import WritePolicy
from kvtier.tiering.tier_settings import (
    PREFETCH_SETTINGS,
    TIER_SETTINGS,
    LookupConfig,
    PrefetchSettings,
    TierSettings,
)

__all__ = [
    "CONFIG_SETTINGS",
    "LOOKUP_SETTINGS",
    "NAMESPACE_SETTINGS",
    "OTHER_ENV_VARIABLES",
    "TIER_SETTINGS",
    "ConfigError",
    "KvtierConfig",
    "LookupConfig",
    "MetricsRegistry",
    "TierConfig",
    "TierSettings",
    "WritePolicy",
    "all_tables",
    "backend_table",
    "env_layer",
    "known_env_names",
    "load_config",
    "parse_size",
    "settings_markdown",
    "warn_unknown_env",
]

_log = logging.getLogger("kvtier.config")
_MAX_CONFIG_BYTES = 1 << 20  # a kvtier config is a page of YAML; anything larger is a mistake


def _choices(kind: type[enum.Enum]) -> tuple[str, ...]:
    return tuple(str(member.value) for member in kind)


# ---------------------------------------------------------------------------- the tables

CONFIG_SETTINGS = SettingsTable("config", [
    Setting("block_bytes", Kind.SIZE, None, "bytes of one KV block (one primary slot)",
            minimum=1, maximum=1 << 32, env="KVTIER_BLOCK_BYTES", required=True),
    Setting("primary_bytes", Kind.SIZE, None,
            "bytes of the CPU primary pool; it has primary_bytes // block_bytes slots",
            minimum=1, maximum=1 << 50, env="KVTIER_PRIMARY_BYTES", required=True),
    Setting("eviction_policy", Kind.CHOICE, PolicyName.LRU.value,
            "which resident block the primary pool evicts first",
            choices=_choices(PolicyName), env="KVTIER_EVICTION_POLICY"),
    Setting("write_policy", Kind.CHOICE, WritePolicy.WRITE_THROUGH.value,
            "write_through: cascade at complete_store; write_back: at eviction and shutdown",
            choices=_choices(WritePolicy), env="KVTIER_WRITE_POLICY"),
    Setting("primary_backing", Kind.CHOICE, PrimaryBacking.HEAP.value,
            "memory of the primary pool (shared_memory / mmap_file: other processes can map it)",
            choices=_choices(PrimaryBacking), env="KVTIER_PRIMARY_BACKING"),
    Setting("primary_path", Kind.STR, None,
            "shared-memory name, or the absolute file path of an mmap_file pool",
            nullable=True, env="KVTIER_PRIMARY_PATH"),
    Setting("metrics_registry", Kind.CHOICE, MetricsRegistry.PRIVATE.value,
            "private: a registry per manager; global: prometheus_client.REGISTRY; disabled",
            choices=_choices(MetricsRegistry), env="KVTIER_METRICS_REGISTRY"),
    Setting("max_events", Kind.INT, 65536,
            "events kept until take_events(); older ones are dropped (and counted)",
            minimum=0, env="KVTIER_MAX_EVENTS"),
])

OTHER_ENV_VARIABLES: Mapping[str, str] = MappingProxyType({
    "KVTIER_CONFIG": "a YAML config file read first by load_config() / from_env()",
    "KVTIER_SECONDARY_TIERS": "the secondary tiers: a JSON list, or comma-separated URLs",
    "KVTIER_DEBUG": "the CLI prints a traceback for unexpected errors",
    "KVTIER_SKIP_VLLM": "scripts/test.sh skips the vLLM test lane",
})
"""``KVTIER_*`` variables that are not a setting of one table."""


def backend_table(scheme: str) -> SettingsTable | None:
    """The option table of a registered backend kind (built in or registered from outside);
    None for an unknown scheme."""
    try:
        return kind_for(scheme).settings
    except ValueError:
        return None


def all_tables() -> tuple[SettingsTable, ...]:
    """Every settings table of kvtier (the backends' too, where declared)."""
    tables = [CONFIG_SETTINGS, NAMESPACE_SETTINGS, TIER_SETTINGS, LOOKUP_SETTINGS,
              PREFETCH_SETTINGS, *registered_tables()]
    for kind in registered_kinds():
        if kind.settings not in tables and set(kind.schemes) <= set(SCHEMES):
            tables.append(kind.settings)  # the built-in kinds (a registered one documents itself)
    return tuple(tables)


def known_env_names() -> frozenset[str]:
    names = set(OTHER_ENV_VARIABLES)
    for table in all_tables():
        names |= table.env_names()
    return frozenset(names)


def warn_unknown_env(environ: Mapping[str, str]) -> list[str]:
    """Log each unknown ``KVTIER_*`` variable once per call, naming the closest known name."""
    known = known_env_names()
    unknown = sorted(name for name in environ if name.startswith(ENV_PREFIX)
                     and name not in known)
    for name in unknown:
        _log.warning("unknown environment variable %s ignored%s", name,
                     did_you_mean(name, known))
    return unknown


def settings_markdown() -> str:
    """The README's settings section body: one Markdown table per component."""
    parts: list[str] = []
    for table in all_tables():
        parts.append(f"**{table.component}**\n\n{table.markdown()}")
    other = ["| variable | meaning |", "|---|---|"]
    other += [f"| `{name}` | {meaning} |" for name, meaning in OTHER_ENV_VARIABLES.items()]
    parts.append("**other variables**\n\n" + "\n".join(other))
    return "\n\n".join(parts) + "\n"


# ---------------------------------------------------------------------------- parsing helpers

_RESERVED_TIER_NAMES = frozenset({"primary"})
_TIER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SIZE_OPTIONS = frozenset({"max_bytes"})  # backend options that are sizes (no backend table)


@dataclass(frozen=True, slots=True)
class TierConfig:
    """One secondary tier: a backend URL, its options, lookup settings and I/O settings.

    ``tier.io_threads`` (any :class:`TierSettings` field) reads ``tier.settings``."""

    url: str
    name: str
    lookup: LookupConfig = field(default_factory=LookupConfig)
    settings: TierSettings = field(default_factory=TierSettings)
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __getattr__(self, name: str) -> Any:
        if name in TIER_IO_NAMES:
            return getattr(self.settings, name)
        raise AttributeError(name)

    @property
    def scheme(self) -> str:
        return self.url.split("://", 1)[0].lower()

    def __repr__(self) -> str:  # credentials in the URL or the options are never shown
        from kvtier.backends import redact_url, redacted_options

        return (f"TierConfig(url={redact_url(self.url)!r}, name={self.name!r}, "
                f"lookup={self.lookup!r}, settings={self.settings!r}, "
                f"options={redacted_options(self.options)!r})")


TIER_IO_NAMES = frozenset(item for item in TIER_SETTINGS.names if item not in ("url", "name"))


def _shown_url(url: object) -> object:
    """``url`` as a message may show it: credentials redacted."""
    from kvtier.backends import redact_url

    return redact_url(url) if isinstance(url, str) else url


def _check_url(url: object, path: str) -> str:
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(
            f"{path}: expected a URL like 'file:///abs/dir', 'redis://host:port/0' or "
            f"'s3://bucket/prefix', got {_shown_url(url)!r}"
        )
    scheme = url.split("://", 1)[0].lower()
    if scheme not in registered_schemes():
        raise ConfigError(
            f"{path}: unknown scheme {scheme!r} in {_shown_url(url)!r}; expected one of "
            f"{list(registered_schemes())}"
        )
    return url


def _backend_options(scheme: str, values: Mapping[str, Any], path: str) -> dict[str, Any]:
    table = backend_table(scheme)
    if table is not None:
        # A misspelt tier setting lands here (every other key is a backend option): the hint
        # looks among the tier's own settings too.
        table.reject_unknown(values, path, nearby=(*TIER_SETTINGS.names, "lookup"))
        return table.parse(values, path, fill_defaults=False)
    options: dict[str, Any] = {}
    for key, option in values.items():
        option_path = f"{path}.{key}"
        if key in _SIZE_OPTIONS and option is not None:
            option = parse_size(option, option_path)
        elif option is not None and not isinstance(option, (str, int, float, bool)):
            raise ConfigError(
                f"{option_path}: backend options must be scalars (str, int, float, bool), "
                f"got {type(option).__name__} {option!r}"
            )
        options[key] = option
    return options


def _tier_from(value: object, path: str, defaults: Mapping[str, Any],
               lookup_defaults: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """Validate one tier entry; returns its fields (name not yet made unique) and given name.

    ``defaults`` / ``lookup_defaults``: raw values (from the environment) under the entry's own.
    """
    entry = {"url": value} if isinstance(value, str) else dict(mapping_of(value, path))
    if entry.get("url") is None:
        raise ConfigError(f"{path}.url: missing; every secondary tier needs a backend URL")
    url = _check_url(entry["url"], f"{path}.url")
    own = {key: entry[key] for key in entry if key in TIER_SETTINGS}
    parsed = TIER_SETTINGS.parse({**defaults, **own}, path)
    name = parsed["name"]
    if name is not None and (not _TIER_NAME_RE.match(name) or name in _RESERVED_TIER_NAMES):
        raise ConfigError(
            f"{path}.name: expected 1-64 characters of [A-Za-z0-9_.-] starting with a letter or "
            f"digit, not 'primary', got {name!r}"
        )
    lookup = entry.get("lookup")
    lookup_values = {**lookup_defaults,
                     **(mapping_of(lookup, f"{path}.lookup") if lookup else {})}
    backend_values = {key: option for key, option in entry.items()
                      if key not in TIER_SETTINGS and key != "lookup"}
    fields_: dict[str, Any] = {
        "url": url,
        "lookup": LookupConfig.from_dict(lookup_values, f"{path}.lookup"),
        "settings": TierSettings(**{key: parsed[key] for key in TIER_IO_NAMES}),
        "options": MappingProxyType(_backend_options(url.split("://", 1)[0].lower(),
                                                     backend_values, path)),
    }
    return fields_, name


_SECTIONS = frozenset({"namespace", "secondary_tiers", "prefetch"})
_DEFAULT_EVICTION_POLICY = PolicyName(CONFIG_SETTINGS.default("eviction_policy"))
_DEFAULT_WRITE_POLICY = WritePolicy(CONFIG_SETTINGS.default("write_policy"))
_DEFAULT_PRIMARY_BACKING = PrimaryBacking(CONFIG_SETTINGS.default("primary_backing"))
_DEFAULT_METRICS_REGISTRY = MetricsRegistry(CONFIG_SETTINGS.default("metrics_registry"))
_TOP_KEYS = frozenset(CONFIG_SETTINGS.names) | _SECTIONS


@dataclass(frozen=True, slots=True)
class KvtierConfig:
    """The whole kvtier configuration; build with :meth:`from_dict`, :meth:`from_yaml`,
    :meth:`from_env` or :func:`load_config`."""

    block_bytes: int
    primary_bytes: int
    namespace: Namespace
    eviction_policy: PolicyName = _DEFAULT_EVICTION_POLICY
    write_policy: WritePolicy = _DEFAULT_WRITE_POLICY
    secondary_tiers: tuple[TierConfig, ...] = ()
    primary_backing: PrimaryBacking = _DEFAULT_PRIMARY_BACKING
    primary_path: str | None = CONFIG_SETTINGS.default("primary_path")
    metrics_registry: MetricsRegistry = _DEFAULT_METRICS_REGISTRY
    max_events: int = CONFIG_SETTINGS.default("max_events")
    prefetch: PrefetchSettings = field(default_factory=PrefetchSettings)

    @property
    def num_slots(self) -> int:
        """Slots in the primary pool: ``primary_bytes // block_bytes``."""
        return self.primary_bytes // self.block_bytes

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> KvtierConfig:
        return cls._from_values(values, {}, {})

    @classmethod
    def _from_values(cls, values: Mapping[str, Any], tier_defaults: Mapping[str, Any],
                     lookup_defaults: Mapping[str, Any]) -> KvtierConfig:
        mapping = mapping_of(values, "config")
        unknown = sorted(set(mapping) - _TOP_KEYS, key=str)
        if unknown:
            raise ConfigError(f"unknown key(s) {unknown}; expected some of {sorted(_TOP_KEYS)}"
                              f"{unknown_names_text([str(n) for n in unknown], _TOP_KEYS)}")
        if mapping.get("namespace") is None:
            raise ConfigError("namespace: missing; it is required (at least {model: ...})")
        scalars = {key: value for key, value in mapping.items()
                   if key not in _SECTIONS and value is not None}
        parsed = CONFIG_SETTINGS.parse(scalars)
        block_bytes, primary_bytes = parsed["block_bytes"], parsed["primary_bytes"]
        if primary_bytes < block_bytes:
            raise ConfigError(
                f"primary_bytes: expected at least block_bytes ({block_bytes}) so the pool has "
                f"a slot, got {shown_value(mapping['primary_bytes'])}"
            )
        backing = PrimaryBacking(parsed["primary_backing"])
        path = parsed["primary_path"]
        if path == "":
            raise ConfigError("primary_path: expected a non-empty string, got ''")
        if backing is PrimaryBacking.HEAP and path is not None:
            raise ConfigError(f"primary_path: only valid with primary_backing shared_memory or "
                              f"mmap_file, got {path!r} with heap")
        if backing is PrimaryBacking.MMAP_FILE and (path is None or not os.path.isabs(path)):
            raise ConfigError(f"primary_path: mmap_file backing needs an absolute file path, "
                              f"got {path!r}")
        tiers_value = mapping.get("secondary_tiers")
        return cls(
            block_bytes=block_bytes, primary_bytes=primary_bytes,
            namespace=_namespace_from(mapping["namespace"]),
            eviction_policy=PolicyName(parsed["eviction_policy"]),
            write_policy=WritePolicy(parsed["write_policy"]),
            secondary_tiers=(() if tiers_value is None
                             else _tiers_from(tiers_value, tier_defaults, lookup_defaults)),
            primary_backing=backing, primary_path=path,
            metrics_registry=MetricsRegistry(parsed["metrics_registry"]),
            max_events=parsed["max_events"],
            prefetch=_prefetch_from(mapping.get("prefetch")),
        )

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> KvtierConfig:
        data, _info = read_regular_file(path, "config file", max_bytes=_MAX_CONFIG_BYTES)
        try:
            values = _yaml_load(data.decode("utf-8"))
        except UnicodeDecodeError:
            raise ConfigError(f"config file {os.fspath(path)!r}: not UTF-8 text") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {os.fspath(path)!r}: not valid YAML: {exc}") from None
        except RecursionError:
            raise ConfigError(f"config file {os.fspath(path)!r}: nested too deeply to be a "
                              f"kvtier config") from None
        if not isinstance(values, Mapping):
            raise ConfigError(
                f"config file {os.fspath(path)!r}: expected a YAML mapping at the top, got "
                f"{type(values).__name__}"
            )
        try:
            return cls.from_dict(values)
        except ConfigError as exc:
            raise ConfigError(f"config file {os.fspath(path)!r}: {exc}") from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KvtierConfig:
        env = os.environ if environ is None else environ
        values, tier_defaults, lookup_defaults = _values_from_env(env)
        return cls._from_values(values, tier_defaults, lookup_defaults)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict that :meth:`from_dict` turns back into an equal config."""
        ns = self.namespace
        return {
            "block_bytes": self.block_bytes,
            "primary_bytes": self.primary_bytes,
            "eviction_policy": self.eviction_policy.value,
            "write_policy": self.write_policy.value,
            "primary_backing": self.primary_backing.value,
            "primary_path": self.primary_path,
            "metrics_registry": self.metrics_registry.value,
            "max_events": self.max_events,
            "prefetch": asdict(self.prefetch),
            "namespace": {name: getattr(ns, name) for name in NAMESPACE_SETTINGS.names},
            "secondary_tiers": [
                {"url": tier.url, "name": tier.name, **asdict(tier.settings),
                 "lookup": tier.lookup.as_kwargs(), **dict(tier.options)}
                for tier in self.secondary_tiers
            ],
        }


class _StrictLoader(yaml.SafeLoader):
    """YAML with two traps closed: a duplicate key is an error (not "last one wins"), and only
    ``true``/``false`` are booleans, so ``model: no`` or ``tenant: on`` stay strings."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _value in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # the base class rejects it with its own message
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"))


def _yaml_load(stream: Any) -> Any:
    """Parse one YAML document with :class:`_StrictLoader`."""
    return yaml.load(stream, Loader=_StrictLoader)  # a SafeLoader subclass: no objects


def _namespace_from(value: object, env_values: Mapping[str, Any] | None = None) -> Namespace:
    if isinstance(value, Namespace) and not env_values:
        return value
    if isinstance(value, Namespace):
        value = {name: getattr(value, name) for name in NAMESPACE_SETTINGS.names}
    mapping = {**(env_values or {}), **mapping_of(value, "namespace")}
    parsed = NAMESPACE_SETTINGS.parse(mapping, "namespace")
    if not parsed["model"]:
        raise ConfigError("namespace.model: missing; expected a non-empty model name")
    try:
        return Namespace(**parsed)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"namespace: {exc}") from None


def _prefetch_from(value: object) -> PrefetchSettings:
    if value is None:
        return PrefetchSettings()
    if isinstance(value, PrefetchSettings):
        return value
    return PrefetchSettings.parse(mapping_of(value, "prefetch"), "prefetch")


def _tiers_from(value: object, tier_defaults: Mapping[str, Any],
                lookup_defaults: Mapping[str, Any]) -> tuple[TierConfig, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"secondary_tiers: expected a list of URLs or tier mappings, got {value!r}"
        )
    parsed = [_tier_from(entry, f"secondary_tiers[{index}]", tier_defaults, lookup_defaults)
              for index, entry in enumerate(value)]
    given = [name for _, name in parsed if name is not None]
    for index, (_, name) in enumerate(parsed):
        if name is not None and given.count(name) > 1:
            raise ConfigError(f"secondary_tiers[{index}].name: duplicate tier name {name!r}")
    used = set(given)
    tiers: list[TierConfig] = []
    for fields_, name in parsed:
        if name is None:
            base = fields_["url"].split("://", 1)[0].lower().replace("+", "_")
            name, suffix = base, 1
            while name in used:
                suffix += 1
                name = f"{base}{suffix}"
        used.add(name)
        tiers.append(TierConfig(name=name, **fields_))
    return tuple(tiers)


def _values_from_env(
    env: Mapping[str, str],
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(config values, tier defaults, lookup defaults) from ``KVTIER_*`` variables (raw strings:
    parsing names the variable); unknown ``KVTIER_*`` variables are logged, never an error."""
    warn_unknown_env(env)
    values: dict[str, Any] = {}
    if "KVTIER_CONFIG" in env:
        values = KvtierConfig.from_yaml(env["KVTIER_CONFIG"]).to_dict()
    values.update(CONFIG_SETTINGS.parse_env(env))
    prefetch_env = PREFETCH_SETTINGS.parse_env(env, "prefetch.")
    if prefetch_env:
        values["prefetch"] = {**(values.get("prefetch") or {}), **prefetch_env}
    namespace_env = NAMESPACE_SETTINGS.parse_env(env, "namespace.")
    if namespace_env:
        values["namespace"] = {**(values.get("namespace") or {}), **namespace_env}
    if "KVTIER_SECONDARY_TIERS" in env:
        raw = env["KVTIER_SECONDARY_TIERS"]
        try:
            values["secondary_tiers"] = _tiers_from_env(raw)
        except ValueError as exc:
            raise ConfigError(f"KVTIER_SECONDARY_TIERS: cannot parse {raw!r}: {exc}") from None
    return (values, TIER_SETTINGS.parse_env(env, "secondary_tiers[*]."),
            LOOKUP_SETTINGS.parse_env(env, "secondary_tiers[*].lookup."))


def _tiers_from_env(raw: str) -> list[Any]:
    text = raw.strip()
    if not text:
        return []
    if text.startswith("["):
        try:
            parsed = json.loads(text)
        except RecursionError:
            raise ValueError("nested too deeply to be a list of tiers") from None
        if not isinstance(parsed, list):
            raise ValueError("expected a JSON list")
        return parsed
    return [part.strip() for part in text.split(",") if part.strip()]


def load_config(
    source: KvtierConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    **overrides: Any,
) -> KvtierConfig:
    """A config from an object, a dict, a YAML file path, or (None) the ``KVTIER_*`` environment.

    ``overrides`` replace top-level keys (``load_config("kv.yaml", primary_bytes="8GiB")``).
    """
    if isinstance(source, KvtierConfig) and not overrides:
        return source
    tier_defaults: dict[str, Any] = {}
    lookup_defaults: dict[str, Any] = {}
    if source is None:
        values, tier_defaults, lookup_defaults = _values_from_env(os.environ)
    elif isinstance(source, KvtierConfig):
        values = source.to_dict()
    elif isinstance(source, (str, os.PathLike)):
        values = KvtierConfig.from_yaml(source).to_dict()
    elif isinstance(source, Mapping):
        values = dict(source)
    else:
        raise ConfigError(
            f"config: expected a KvtierConfig, a mapping, a YAML file path or None (environment), "
            f"got {type(source).__name__}"
        )
    values.update(overrides)
    return KvtierConfig._from_values(values, tier_defaults, lookup_defaults)
