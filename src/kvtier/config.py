"""One typed kvtier configuration, from a dict, a YAML file or ``KVTIER_*`` environment variables.

This module owns no mutable state: configs are frozen dataclasses, safe to share between threads.

Every validation error is a :class:`ConfigError` (a ``ValueError``) whose message names the key
path (``secondary_tiers[1].lookup.quarantine_s``), the bad value and what was expected; unknown
keys are rejected by name.

Keys (dict / YAML)::

    block_bytes: 256KiB            # required; int or size string ("4GiB", "512MB", "1024")
    primary_bytes: 4GiB            # required; the pool has primary_bytes // block_bytes slots
    eviction_policy: lru           # lru | arc
    write_policy: write_through    # write_through | write_back
    primary_backing: heap          # heap | shared_memory | mmap_file
    primary_path: null             # shared-memory name, or absolute file path for mmap_file
    metrics_registry: private      # private | global | disabled
    max_events: 65536              # events kept until take_events(); older ones are dropped
    namespace: {model: my-model, revision: "", dtype: "", kv_layout: "", block_size: 0,
                world_size: 1, rank: 0, tenant: ""}          # model required
    secondary_tiers:               # lookup order; [] is a CPU-only cache
      - file:///var/cache/kvtier   # shorthand for {url: ...}
      - url: redis://127.0.0.1:6379/0
        name: redis                # default: derived from the scheme, made unique
        io_threads: 4
        max_pending_store_bytes: 256MiB    # backpressure: cascades beyond this are shed
        max_pending_store_jobs: 1024
        lookup: {probe_timeout_s: 2.0, verdict_ttl_s: 5.0, max_cached_verdicts: 65536,
                 quarantine_s: 30.0, max_batch_keys: 1024, breaker_threshold: 5,
                 breaker_cooldown_s: 10.0}   # unset: the lookup manager's defaults
        ttl_s: 3600                # any other key is a backend option (see open_backend)

Environment (:meth:`KvtierConfig.from_env`): ``KVTIER_CONFIG`` names a YAML file read first; then
``KVTIER_BLOCK_BYTES``, ``KVTIER_PRIMARY_BYTES``, ``KVTIER_EVICTION_POLICY``,
``KVTIER_WRITE_POLICY``, ``KVTIER_PRIMARY_BACKING``, ``KVTIER_PRIMARY_PATH``,
``KVTIER_METRICS_REGISTRY``, ``KVTIER_MAX_EVENTS`` override top-level keys;
``KVTIER_SECONDARY_TIERS`` is a JSON list (of URLs or tier objects) or comma-separated URLs;
``KVTIER_NAMESPACE_<FIELD>`` sets a namespace field (``KVTIER_NAMESPACE_MODEL``, ``..._REVISION``,
``..._DTYPE``, ``..._KV_LAYOUT``, ``..._BLOCK_SIZE``, ``..._WORLD_SIZE``, ``..._RANK``,
``..._TENANT``). Any other ``KVTIER_*`` variable is rejected by name.
"""

from __future__ import annotations

import enum
import json
import math
import os
import re
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, TypeVar

import yaml

from kvtier.backends import SCHEMES
from kvtier.backends.base import parse_size_option
from kvtier.deadlines import DEADLINE_SETTINGS
from kvtier.keys import Namespace
from kvtier.policies import PolicyName
from kvtier.primary import PrimaryBacking
from kvtier.settings import ConfigError as ConfigError  # one class for tables and loader


class WritePolicy(enum.Enum):
    """When stored blocks are cascaded to the secondary tiers; the value is the config spelling."""

    WRITE_THROUGH = "write_through"  # at complete_store, to every tier
    WRITE_BACK = "write_back"        # when the primary evicts the block, and at shutdown()


class MetricsRegistry(enum.Enum):
    PRIVATE = "private"    # a CollectorRegistry per manager (several managers never collide)
    GLOBAL = "global"      # prometheus_client.REGISTRY (one manager per process)
    DISABLED = "disabled"  # no metrics


KNOWN_SCHEMES = SCHEMES
_RESERVED_TIER_NAMES = frozenset({"primary"})
_TIER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_MAX_S = 3600.0  # the lookup manager's ceiling for every time setting
_SIZE_OPTIONS = frozenset({"max_bytes"})  # backend options that are byte sizes


def parse_size(value: object, path: str) -> int:
    """An int, or a string like "4GiB" / "512MB" / "1024" -> bytes (see
    :func:`~kvtier.backends.base.parse_size_option`), as a :class:`ConfigError` naming ``path``."""
    try:
        return parse_size_option(path, value)
    except ValueError:
        raise ConfigError(
            f"{path}: expected a size (a whole number of bytes >= 0: an int, or a string like "
            f"'4GiB', '512MB', '1024'), got {value!r}"
        ) from None


def _int(value: object, path: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{path}: expected an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{path}: expected an int >= {minimum}, got {value!r}")
    return value


def _float(value: object, path: str, minimum: float, *, strict: bool = False,
           maximum: float = math.inf) -> float:
    relation = ">" if strict else ">="
    expected = f"a number {relation} {minimum}" + (
        f" and <= {maximum}" if maximum != math.inf else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path}: expected {expected}, got {value!r}")
    number = float(value)
    if (math.isnan(number) or number < minimum or (strict and number == minimum)
            or number > maximum):
        raise ConfigError(f"{path}: expected {expected}, got {value!r}")
    return number


_E = TypeVar("_E", bound=enum.Enum)


def _enum(kind: type[_E], value: object, path: str) -> _E:
    if isinstance(value, kind):
        return value
    choices = [member.value for member in kind]
    if isinstance(value, str):
        for member in kind:
            if member.value == value.strip().lower():
                return member
    raise ConfigError(f"{path}: expected one of {choices}, got {value!r}")


def _mapping(value: object, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(f"{path}: keys must be strings, got {key!r}")
    return value


def _reject_unknown(values: Mapping[str, Any], known: set[str] | frozenset[str],
                    path: str) -> None:
    unknown = sorted(set(values) - set(known))
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(
            f"unknown key(s) {[where + key for key in unknown]}; expected some of {sorted(known)}"
        )


@dataclass(frozen=True, slots=True)
class LookupConfig:
    """Per-tier settings of the tier's AsyncLookupManager; None = the lookup manager's default."""

    probe_timeout_s: float | None = None
    verdict_ttl_s: float | None = None
    max_cached_verdicts: int | None = None
    quarantine_s: float | None = None
    max_batch_keys: int | None = None
    breaker_threshold: int | None = None
    breaker_cooldown_s: float | None = None

    def as_kwargs(self) -> dict[str, float | int]:
        """The settings that are set, as keyword arguments for AsyncLookupManager."""
        result: dict[str, float | int] = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if value is not None:
                result[item.name] = value
        return result

    @classmethod
    def from_dict(cls, values: object, path: str) -> LookupConfig:
        mapping = _mapping(values, path)
        _reject_unknown(mapping, {item.name for item in fields(cls)}, path)
        checks: dict[str, Any] = {
            "probe_timeout_s": lambda v, p: _float(v, p, 0.0, strict=True, maximum=_MAX_S),
            "verdict_ttl_s": lambda v, p: _float(v, p, 0.0, maximum=_MAX_S),
            "max_cached_verdicts": lambda v, p: _int(v, p, 1),
            "quarantine_s": lambda v, p: _float(v, p, 0.0, maximum=_MAX_S),
            "max_batch_keys": lambda v, p: _int(v, p, 1),
            "breaker_threshold": lambda v, p: _int(v, p, 1),
            "breaker_cooldown_s": lambda v, p: _float(v, p, 0.0, strict=True, maximum=_MAX_S),
        }
        parsed = {
            name: (None if value is None else checks[name](value, f"{path}.{name}"))
            for name, value in mapping.items()
        }
        return cls(**parsed)


@dataclass(frozen=True, slots=True)
class TierConfig:
    """One secondary tier: a backend URL, its options, lookup settings and I/O limits."""

    url: str
    name: str
    lookup: LookupConfig = field(default_factory=LookupConfig)
    io_threads: int = 4
    max_pending_store_bytes: int = 256 * 1024**2
    max_pending_store_jobs: int = 1024
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    load_timeout_s: float = DEADLINE_SETTINGS["load_timeout_s"].default

    @property
    def scheme(self) -> str:
        return self.url.split("://", 1)[0].lower()

    def __repr__(self) -> str:  # credentials in the URL or the options are never shown
        from kvtier.backends import redact_url, redacted_options

        return (f"TierConfig(url={redact_url(self.url)!r}, name={self.name!r}, "
                f"lookup={self.lookup!r}, io_threads={self.io_threads}, "
                f"max_pending_store_bytes={self.max_pending_store_bytes}, "
                f"max_pending_store_jobs={self.max_pending_store_jobs}, "
                f"load_timeout_s={self.load_timeout_s}, "
                f"options={redacted_options(self.options)!r})")


_TIER_KEYS = frozenset({"url", "name", "lookup", "io_threads", "max_pending_store_bytes",
                        "max_pending_store_jobs", *DEADLINE_SETTINGS.names})


def _shown_url(url: object) -> object:
    """``url`` as a message may show it: credentials redacted."""
    from kvtier.backends import redact_url

    return redact_url(url) if isinstance(url, str) else url


def _tier_from(value: object, path: str) -> tuple[dict[str, Any], str | None]:
    """Validate one tier entry; returns its fields (name not yet made unique) and given name."""
    entry: Mapping[str, Any]
    entry = {"url": value} if isinstance(value, str) else _mapping(value, path)
    if "url" not in entry:
        raise ConfigError(f"{path}.url: missing; every secondary tier needs a backend URL")
    url = entry["url"]
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(
            f"{path}.url: expected a URL like 'file:///abs/dir', 'redis://host:port/0' or "
            f"'s3://bucket/prefix', got {_shown_url(url)!r}"
        )
    scheme = url.split("://", 1)[0].lower()
    if scheme not in KNOWN_SCHEMES:
        raise ConfigError(
            f"{path}.url: unknown scheme {scheme!r} in {_shown_url(url)!r}; expected one of "
            f"{list(KNOWN_SCHEMES)}"
        )
    fields_: dict[str, Any] = {"url": url}
    name = entry.get("name")
    if name is not None and (not isinstance(name, str) or not _TIER_NAME_RE.match(name)
                             or name in _RESERVED_TIER_NAMES):
        raise ConfigError(
            f"{path}.name: expected 1-64 characters of [A-Za-z0-9_.-] starting with a letter or "
            f"digit, not 'primary', got {name!r}"
        )
    if "lookup" in entry and entry["lookup"] is not None:
        fields_["lookup"] = LookupConfig.from_dict(entry["lookup"], f"{path}.lookup")
    if "io_threads" in entry:
        fields_["io_threads"] = _int(entry["io_threads"], f"{path}.io_threads", 1)
    if "max_pending_store_bytes" in entry:
        fields_["max_pending_store_bytes"] = parse_size(
            entry["max_pending_store_bytes"], f"{path}.max_pending_store_bytes")
    if "max_pending_store_jobs" in entry:
        fields_["max_pending_store_jobs"] = _int(
            entry["max_pending_store_jobs"], f"{path}.max_pending_store_jobs", 1)
    fields_.update(DEADLINE_SETTINGS.parse(
        {name: entry[name] for name in DEADLINE_SETTINGS.names if name in entry}, path,
        fill_defaults=False))
    options: dict[str, Any] = {}
    for key, option in entry.items():
        if key in _TIER_KEYS:
            continue
        option_path = f"{path}.{key}"
        if key in _SIZE_OPTIONS and option is not None:
            option = parse_size(option, option_path)
        elif option is not None and not isinstance(option, (str, int, float, bool)):
            raise ConfigError(
                f"{option_path}: backend options must be scalars (str, int, float, bool), "
                f"got {type(option).__name__} {option!r}"
            )
        options[key] = option
    fields_["options"] = MappingProxyType(options)
    return fields_, name


_TOP_KEYS = frozenset({"block_bytes", "primary_bytes", "eviction_policy", "write_policy",
                       "primary_backing", "primary_path", "metrics_registry", "max_events",
                       "namespace", "secondary_tiers"})


@dataclass(frozen=True, slots=True)
class KvtierConfig:
    """The whole kvtier configuration; build with :meth:`from_dict`, :meth:`from_yaml`,
    :meth:`from_env` or :func:`load_config`."""

    block_bytes: int
    primary_bytes: int
    namespace: Namespace
    eviction_policy: PolicyName = PolicyName.LRU
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    secondary_tiers: tuple[TierConfig, ...] = ()
    primary_backing: PrimaryBacking = PrimaryBacking.HEAP
    primary_path: str | None = None
    metrics_registry: MetricsRegistry = MetricsRegistry.PRIVATE
    max_events: int = 65536

    @property
    def num_slots(self) -> int:
        """Slots in the primary pool: ``primary_bytes // block_bytes``."""
        return self.primary_bytes // self.block_bytes

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> KvtierConfig:
        mapping = _mapping(values, "config")
        _reject_unknown(mapping, _TOP_KEYS, "")
        for required in ("block_bytes", "primary_bytes", "namespace"):
            if mapping.get(required) is None:
                raise ConfigError(f"{required}: missing; it is required")
        block_bytes = parse_size(mapping["block_bytes"], "block_bytes")
        if block_bytes < 1:
            raise ConfigError(f"block_bytes: expected a size >= 1 byte, got "
                              f"{mapping['block_bytes']!r}")
        primary_bytes = parse_size(mapping["primary_bytes"], "primary_bytes")
        if primary_bytes < block_bytes:
            raise ConfigError(
                f"primary_bytes: expected at least block_bytes ({block_bytes}) so the pool has "
                f"a slot, got {mapping['primary_bytes']!r}"
            )
        namespace = _namespace_from(mapping["namespace"])
        kwargs: dict[str, Any] = {}
        if mapping.get("eviction_policy") is not None:
            kwargs["eviction_policy"] = _enum(PolicyName, mapping["eviction_policy"],
                                              "eviction_policy")
        if mapping.get("write_policy") is not None:
            kwargs["write_policy"] = _enum(WritePolicy, mapping["write_policy"], "write_policy")
        if mapping.get("primary_backing") is not None:
            kwargs["primary_backing"] = _enum(PrimaryBacking, mapping["primary_backing"],
                                              "primary_backing")
        if mapping.get("primary_path") is not None:
            path = mapping["primary_path"]
            if not isinstance(path, str) or not path:
                raise ConfigError(f"primary_path: expected a non-empty string, got {path!r}")
            kwargs["primary_path"] = path
        backing = kwargs.get("primary_backing", PrimaryBacking.HEAP)
        path = kwargs.get("primary_path")
        if backing is PrimaryBacking.HEAP and path is not None:
            raise ConfigError(f"primary_path: only valid with primary_backing shared_memory or "
                              f"mmap_file, got {path!r} with heap")
        if backing is PrimaryBacking.MMAP_FILE and (path is None or not os.path.isabs(path)):
            raise ConfigError(f"primary_path: mmap_file backing needs an absolute file path, "
                              f"got {path!r}")
        if mapping.get("metrics_registry") is not None:
            kwargs["metrics_registry"] = _enum(MetricsRegistry, mapping["metrics_registry"],
                                               "metrics_registry")
        if mapping.get("max_events") is not None:
            kwargs["max_events"] = _int(mapping["max_events"], "max_events", 0)
        tiers_value = mapping.get("secondary_tiers")
        if tiers_value is not None:
            kwargs["secondary_tiers"] = _tiers_from(tiers_value)
        return cls(block_bytes=block_bytes, primary_bytes=primary_bytes, namespace=namespace,
                   **kwargs)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> KvtierConfig:
        try:
            with open(path, encoding="utf-8") as handle:
                values = _yaml_load(handle)
        except OSError as exc:
            raise ConfigError(f"config file {os.fspath(path)!r}: cannot read it: {exc}") from None
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
        return cls.from_dict(_dict_from_env(env))

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
            "namespace": {name: getattr(ns, name) for name in _NAMESPACE_FIELDS},
            "secondary_tiers": [
                {"url": tier.url, "name": tier.name, "io_threads": tier.io_threads,
                 "max_pending_store_bytes": tier.max_pending_store_bytes,
                 "max_pending_store_jobs": tier.max_pending_store_jobs,
                 "load_timeout_s": tier.load_timeout_s,
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


_NAMESPACE_FIELDS = ("model", "revision", "dtype", "kv_layout", "block_size", "world_size",
                     "rank", "tenant")
_NAMESPACE_INT_FIELDS = frozenset({"block_size", "world_size", "rank"})


def _namespace_from(value: object) -> Namespace:
    if isinstance(value, Namespace):
        return value
    mapping = _mapping(value, "namespace")
    _reject_unknown(mapping, frozenset(_NAMESPACE_FIELDS), "namespace")
    if not mapping.get("model"):
        raise ConfigError("namespace.model: missing; expected a non-empty model name")
    for name, item in mapping.items():
        expected = int if name in _NAMESPACE_INT_FIELDS else str
        if isinstance(item, bool) or not isinstance(item, expected):
            raise ConfigError(
                f"namespace.{name}: expected {expected.__name__}, got {item!r}"
            )
    try:
        return Namespace(**dict(mapping))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"namespace: {exc}") from None


def _tiers_from(value: object) -> tuple[TierConfig, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"secondary_tiers: expected a list of URLs or tier mappings, got {value!r}"
        )
    parsed = [_tier_from(entry, f"secondary_tiers[{index}]") for index, entry in enumerate(value)]
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


_ENV_PREFIX = "KVTIER_"
_ENV_TOP = {
    "KVTIER_BLOCK_BYTES": "block_bytes",
    "KVTIER_PRIMARY_BYTES": "primary_bytes",
    "KVTIER_EVICTION_POLICY": "eviction_policy",
    "KVTIER_WRITE_POLICY": "write_policy",
    "KVTIER_PRIMARY_BACKING": "primary_backing",
    "KVTIER_PRIMARY_PATH": "primary_path",
    "KVTIER_METRICS_REGISTRY": "metrics_registry",
    "KVTIER_MAX_EVENTS": "max_events",
    "KVTIER_SECONDARY_TIERS": "secondary_tiers",
}
_ENV_NAMESPACE = {f"KVTIER_NAMESPACE_{name.upper()}": name for name in _NAMESPACE_FIELDS}
ENV_VARIABLES = ("KVTIER_CONFIG", *_ENV_TOP, *_ENV_NAMESPACE)


def _dict_from_env(env: Mapping[str, str]) -> dict[str, Any]:
    present = {name: value for name, value in env.items() if name.startswith(_ENV_PREFIX)}
    unknown = sorted(set(present) - set(ENV_VARIABLES))
    if unknown:
        raise ConfigError(
            f"unknown environment variable(s) {unknown}; expected some of {list(ENV_VARIABLES)}"
        )
    values: dict[str, Any] = {}
    if "KVTIER_CONFIG" in present:
        path = present["KVTIER_CONFIG"]
        values = KvtierConfig.from_yaml(path).to_dict()
    for env_name, key in _ENV_TOP.items():
        if env_name not in present:
            continue
        raw = present[env_name]
        try:
            if key == "max_events":
                values[key] = int(raw)
            elif key == "secondary_tiers":
                values[key] = _tiers_from_env(raw)
            else:
                values[key] = raw
        except (ValueError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{env_name}: cannot parse {raw!r}: {exc}") from None
    if any(name in present for name in _ENV_NAMESPACE):
        namespace = dict(values.get("namespace") or {})
        for env_name, name in _ENV_NAMESPACE.items():
            if env_name not in present:
                continue
            raw = present[env_name]
            if name in _NAMESPACE_INT_FIELDS:
                try:
                    namespace[name] = int(raw)
                except ValueError:
                    raise ConfigError(f"{env_name}: expected an int, got {raw!r}") from None
            else:
                namespace[name] = raw
        values["namespace"] = namespace
    return values


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
    if source is None:
        values: dict[str, Any] = _dict_from_env(os.environ)
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
    return KvtierConfig.from_dict(values)
