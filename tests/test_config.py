"""The typed configuration: dict, YAML, environment; every error names its key path."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import (
    CONFIG_SETTINGS,
    LOOKUP_SETTINGS,
    OTHER_ENV_VARIABLES,
    TIER_SETTINGS,
    ConfigError,
    KvtierConfig,
    MetricsRegistry,
    TierConfig,
    WritePolicy,
    all_tables,
    known_env_names,
    load_config,
    parse_size,
    settings_markdown,
)
from kvtier.integrations.vllm._settings import VLLM_TIER_SETTINGS  # registers its table
from kvtier.policies import PolicyName
from kvtier.primary import PrimaryBacking
from kvtier.settings import Kind, Setting, SettingsTable

BASE: dict[str, Any] = {"block_bytes": "64KiB", "primary_bytes": "1MiB",
                        "namespace": {"model": "m"}}


def with_(**changes: Any) -> dict[str, Any]:
    return {**BASE, **changes}


def test_minimal_config_and_defaults() -> None:
    cfg = KvtierConfig.from_dict(BASE)
    assert cfg.block_bytes == 65536
    assert cfg.primary_bytes == 1 << 20
    assert cfg.num_slots == 16
    assert cfg.eviction_policy is PolicyName.LRU
    assert cfg.write_policy is WritePolicy.WRITE_THROUGH
    assert cfg.secondary_tiers == ()
    assert cfg.primary_backing is PrimaryBacking.HEAP
    assert cfg.metrics_registry is MetricsRegistry.PRIVATE
    assert cfg.namespace.model == "m"


@pytest.mark.parametrize(("text", "expected"), [
    ("4GiB", 4 << 30), ("512M", 512 << 20), ("1024", 1024), (" 1.5 KiB ", 1536),
    ("2kib", 2048), (7, 7), ("3 B", 3),
])
def test_sizes(text: object, expected: int) -> None:
    assert parse_size(text, "x") == expected


@pytest.mark.parametrize("bad", ["4 gigs", "1.3B", -1, True, 1.5, "", None])
def test_bad_sizes_name_path_and_value(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"^primary_bytes: .*got"):
        KvtierConfig.from_dict(with_(primary_bytes=bad if bad is not None else [1]))


@pytest.mark.parametrize(("changes", "pattern"), [
    ({"block_bytes": 0}, r"block_bytes: expected a size >= 1 and <= 4294967296 bytes, got 0"),
    ({"primary_bytes": "1KiB"}, r"primary_bytes: expected at least block_bytes \(65536\)"),
    ({"eviction_policy": "lfu"}, r"eviction_policy: expected one of 'lru', 'arc', got 'lfu'"),
    ({"write_policy": "sometimes"}, r"write_policy: expected one of 'write_through'"),
    ({"max_events": -1}, r"max_events: expected an integer >= 0, got -1"),
    ({"primary_path": "/x"}, r"primary_path: only valid with"),
    ({"primary_backing": "mmap_file"}, r"primary_path: mmap_file backing needs an absolute"),
    ({"metrics_registry": "nope"}, r"metrics_registry: expected one of"),
    ({"colour": "blue"}, r"unknown key\(s\) \['colour'\]"),
    ({"namespace": {"model": "m", "flavour": 1}}, r"\['namespace.flavour'\]"),
    ({"namespace": {"revision": "x"}}, r"namespace.model: missing"),
    ({"namespace": {"model": "m", "rank": "zero"}},
     r"namespace.rank: expected an integer >= 0, got 'zero'"),
    ({"primary_bytes": "1.5GB"}, r"primary_bytes: '1.5GB' is ambiguous .* write 1.5GiB"),
    ({"block_bytes": "64KB"}, r"block_bytes: '64KB' is ambiguous"),
    ({"namespace": {"model": "m", "rank": 3}}, r"namespace: Namespace.rank must be in"),
    ({"secondary_tiers": "file:///x"}, r"secondary_tiers: expected a list"),
    ({"secondary_tiers": [{"name": "a"}]}, r"secondary_tiers\[0\].url: missing"),
    ({"secondary_tiers": ["ftp://host/x"]}, r"secondary_tiers\[0\].url: unknown scheme 'ftp'"),
    ({"secondary_tiers": ["/just/a/path"]}, r"secondary_tiers\[0\].url: expected a URL"),
    ({"secondary_tiers": ["memory://", {"url": "memory://", "lookup": {"quarantine_s": -1}}]},
     r"secondary_tiers\[1\].lookup.quarantine_s: expected a finite number >= 0.0 and "
     r"<= 3600.0 \(seconds\), got -1"),
    ({"secondary_tiers": [{"url": "memory://", "lookup": {"quarantine": 1}}]},
     r"\['secondary_tiers\[0\].lookup.quarantine'\]"),
    ({"secondary_tiers": [{"url": "memory://", "io_threads": 0}]},
     r"secondary_tiers\[0\].io_threads: expected an integer >= 1 and <= 256, got 0"),
    ({"secondary_tiers": [{"url": "memory://", "max_bytes": "lots"}]},
     r"secondary_tiers\[0\].max_bytes: expected a byte count or a binary size"),
    ({"secondary_tiers": [{"url": "redis://127.0.0.1:1/0", "ttl_s": [1]}]},
     r"secondary_tiers\[0\].ttl_s: expected a finite number"),
    ({"secondary_tiers": [{"url": "memory://", "ttl_s": 5}]},
     r"unknown memory backend setting\(s\) \['secondary_tiers\[0\].ttl_s'\]"),
    ({"secondary_tiers": [{"url": "memory://", "name": "primary"}]},
     r"secondary_tiers\[0\].name: .*got 'primary'"),
    ({"secondary_tiers": [{"url": "memory://", "name": "a"}, {"url": "memory://", "name": "a"}]},
     r"secondary_tiers\[0\].name: duplicate tier name 'a'"),
])
def test_errors_name_the_key_path_the_value_and_the_expectation(
    changes: dict[str, Any], pattern: str
) -> None:
    with pytest.raises(ConfigError, match=pattern):
        KvtierConfig.from_dict(with_(**changes))


def test_missing_required_keys() -> None:
    for key in ("block_bytes", "primary_bytes", "namespace"):
        values = dict(BASE)
        del values[key]
        with pytest.raises(ConfigError, match=f"^{key}: missing"):
            KvtierConfig.from_dict(values)


def test_tiers_shorthand_names_options_and_lookup_settings() -> None:
    cfg = KvtierConfig.from_dict(with_(secondary_tiers=[
        "file:///tmp/a",
        {"url": "file:///tmp/b", "max_bytes": "1GiB", "fsync": True,
         "lookup": {"quarantine_s": 5, "breaker_cooldown_s": 2.5}},
        {"url": "redis+cluster://127.0.0.1:7000", "max_pending_store_bytes": "8MiB"},
        {"url": "redis://h:1/0", "name": "file2"},
    ]))
    names = [tier.name for tier in cfg.secondary_tiers]
    assert names == ["file", "file3", "redis_cluster", "file2"]
    assert len(set(names)) == 4
    second = cfg.secondary_tiers[1]
    assert dict(second.options) == {"max_bytes": 1 << 30, "fsync": True}
    assert second.lookup.as_kwargs() == {"quarantine_s": 5.0, "breaker_cooldown_s": 2.5}
    assert cfg.secondary_tiers[2].max_pending_store_bytes == 8 << 20
    assert cfg.secondary_tiers[2].scheme == "redis+cluster"


def test_to_dict_round_trips() -> None:
    cfg = KvtierConfig.from_dict(with_(
        eviction_policy="arc", write_policy="write_back",
        secondary_tiers=[{"url": "memory://", "lookup": {"verdict_ttl_s": 1}, "max_bytes": 10}],
        namespace={"model": "m", "dtype": "bf16", "world_size": 2, "rank": 1}))
    assert KvtierConfig.from_dict(cfg.to_dict()) == cfg


def test_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text(
        "block_bytes: 256KiB\nprimary_bytes: 4MiB\neviction_policy: arc\n"
        "namespace: {model: llama}\nsecondary_tiers:\n  - file:///var/tmp/kv\n"
        "  - url: redis://127.0.0.1:6379/0\n    lookup: {quarantine_s: 10}\n"
    )
    cfg = KvtierConfig.from_yaml(path)
    assert cfg.num_slots == 16
    assert cfg.eviction_policy is PolicyName.ARC
    assert [t.name for t in cfg.secondary_tiers] == ["file", "redis"]
    assert load_config(str(path)) == cfg
    assert load_config(path, primary_bytes="8MiB").num_slots == 32


def test_yaml_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("block_bytes: [\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*not valid YAML"):
        KvtierConfig.from_yaml(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="expected a YAML mapping"):
        KvtierConfig.from_yaml(scalar)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("block_bytes: 1KiB\nprimary_bytes: 4KiB\nnamespace: {model: m}\nfoo: 1\n")
    with pytest.raises(ConfigError, match=r"wrong.yaml.*\['foo'\]"):
        KvtierConfig.from_yaml(wrong)
    with pytest.raises(ConfigError, match="cannot read"):
        KvtierConfig.from_yaml(tmp_path / "absent.yaml")


def test_environment_mapping(tmp_path: Path) -> None:
    env = {
        "KVTIER_BLOCK_BYTES": "128KiB",
        "KVTIER_PRIMARY_BYTES": "1MiB",
        "KVTIER_EVICTION_POLICY": "arc",
        "KVTIER_WRITE_POLICY": "write_back",
        "KVTIER_MAX_EVENTS": "10",
        "KVTIER_NAMESPACE_MODEL": "llama",
        "KVTIER_NAMESPACE_WORLD_SIZE": "2",
        "KVTIER_NAMESPACE_RANK": "1",
        "KVTIER_SECONDARY_TIERS": "file:///tmp/a, redis://127.0.0.1:1/0",
        "PATH": "/usr/bin",
    }
    cfg = KvtierConfig.from_env(env)
    assert cfg.num_slots == 8
    assert cfg.write_policy is WritePolicy.WRITE_BACK
    assert cfg.max_events == 10
    assert (cfg.namespace.model, cfg.namespace.world_size, cfg.namespace.rank) == ("llama", 2, 1)
    assert [t.url for t in cfg.secondary_tiers] == ["file:///tmp/a", "redis://127.0.0.1:1/0"]
    env["KVTIER_SECONDARY_TIERS"] = json.dumps(
        [{"url": "memory://", "lookup": {"quarantine_s": 3}}, "file:///tmp/b"])
    cfg = KvtierConfig.from_env(env)
    assert cfg.secondary_tiers[0].lookup.quarantine_s == 3
    env["KVTIER_SECONDARY_TIERS"] = ""
    assert KvtierConfig.from_env(env).secondary_tiers == ()


def test_environment_errors_name_the_variable(tmp_path: Path) -> None:
    base = {"KVTIER_BLOCK_BYTES": "1KiB", "KVTIER_PRIMARY_BYTES": "4KiB",
            "KVTIER_NAMESPACE_MODEL": "m"}
    with pytest.raises(ConfigError, match=r"KVTIER_NAMESPACE_RANK \(namespace.rank\): "
                                          r"expected an integer >= 0, got 'x'"):
        KvtierConfig.from_env({**base, "KVTIER_NAMESPACE_RANK": "x"})
    with pytest.raises(ConfigError, match="KVTIER_SECONDARY_TIERS: cannot parse"):
        KvtierConfig.from_env({**base, "KVTIER_SECONDARY_TIERS": "[not json"})
    with pytest.raises(ConfigError, match=r"KVTIER_MAX_EVENTS \(max_events\): expected an "
                                          r"integer >= 0, got 'many'"):
        KvtierConfig.from_env({**base, "KVTIER_MAX_EVENTS": "many"})
    with pytest.raises(ConfigError, match=r"^KVTIER_BLOCK_BYTES \(block_bytes\): expected a "
                                          r"byte count"):
        KvtierConfig.from_env({**base, "KVTIER_BLOCK_BYTES": "big"})
    with pytest.raises(ConfigError, match=r"KVTIER_IO_THREADS \(secondary_tiers\[\*\]"
                                          r"\.io_threads\): expected an integer >= 1"):
        KvtierConfig.from_env({**base, "KVTIER_IO_THREADS": "0"})


def test_unknown_environment_variables_are_logged_not_fatal(
        caplog: pytest.LogCaptureFixture) -> None:
    base = {"KVTIER_BLOCK_BYTES": "1KiB", "KVTIER_PRIMARY_BYTES": "4KiB",
            "KVTIER_NAMESPACE_MODEL": "m", "KVTIER_DEBUG": "1", "KVTIER_SKIP_VLLM": "1"}
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        cfg = KvtierConfig.from_env({**base, "KVTIER_PRIMARY_BYTE": "8KiB"})
    assert cfg.num_slots == 4  # the misspelt variable changed nothing
    messages = [record.getMessage() for record in caplog.records]
    assert messages == ["unknown environment variable KVTIER_PRIMARY_BYTE ignored; did you "
                        "mean KVTIER_PRIMARY_BYTES?"]


def test_environment_tier_and_lookup_defaults_under_explicit_values() -> None:
    env = {"KVTIER_BLOCK_BYTES": "1KiB", "KVTIER_PRIMARY_BYTES": "4KiB",
           "KVTIER_NAMESPACE_MODEL": "m", "KVTIER_IO_THREADS": "2",
           "KVTIER_LOOKUP_QUARANTINE_S": "7",
           "KVTIER_SECONDARY_TIERS": json.dumps(
               ["memory://", {"url": "memory://", "io_threads": 6,
                              "lookup": {"quarantine_s": 1}}])}
    first, second = KvtierConfig.from_env(env).secondary_tiers
    assert (first.io_threads, first.lookup.quarantine_s) == (2, 7.0)
    assert (second.io_threads, second.lookup.quarantine_s) == (6, 1.0)


def test_environment_layers_over_a_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "kv.yaml"
    path.write_text("block_bytes: 1KiB\nprimary_bytes: 4KiB\nnamespace: {model: base}\n")
    cfg = KvtierConfig.from_env({"KVTIER_CONFIG": str(path), "KVTIER_PRIMARY_BYTES": "8KiB",
                                 "KVTIER_NAMESPACE_TENANT": "t1"})
    assert cfg.num_slots == 8
    assert (cfg.namespace.model, cfg.namespace.tenant) == ("base", "t1")


def test_load_config_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = KvtierConfig.from_dict(BASE)
    assert load_config(cfg) is cfg
    assert load_config(cfg, max_events=3).max_events == 3
    assert load_config(BASE) == cfg
    for name in list(__import__("os").environ):
        if name.startswith("KVTIER_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KVTIER_BLOCK_BYTES", "64KiB")
    monkeypatch.setenv("KVTIER_PRIMARY_BYTES", "1MiB")
    monkeypatch.setenv("KVTIER_NAMESPACE_MODEL", "m")
    assert load_config() == cfg
    with pytest.raises(ConfigError, match="expected a KvtierConfig, a mapping"):
        load_config(42)  # type: ignore[arg-type]


# -- the settings tables: one declaration per setting ---------------------------------------


def _generated_block(name: str) -> tuple[str, str]:
    """(README block, its path) for the generated block ``name``."""
    readme = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
    text = readme.read_text(encoding="utf-8")
    begin, end = f"<!-- {name}:begin (generated) -->\n", f"<!-- {name}:end -->"
    assert begin in text and end in text, f"README.md lacks the {name} block"
    return text.split(begin, 1)[1].split(end, 1)[0], str(readme)


def test_readme_settings_tables_are_the_generated_ones() -> None:
    block, _ = _generated_block("settings")
    assert block == settings_markdown(), (
        "README settings tables are stale: run .venv/bin/python scripts/update-readme-tables.py")


def test_every_setting_and_env_variable_is_declared_once() -> None:
    """Two tables may share a setting only by sharing its one declaration (the same object)."""
    by_name: dict[tuple[str, str], Setting] = {}
    by_env: dict[str, Setting] = {}
    for table in all_tables():
        for setting in table:
            if setting.env is not None:
                assert setting.env.startswith("KVTIER_"), setting.env
                other = by_env.setdefault(setting.env, setting)
                assert other is setting, f"{setting.env} is declared twice"
                assert setting.env not in OTHER_ENV_VARIABLES
            by_name[(table.component, setting.name)] = setting
    shared = [setting for setting in by_name.values()
              if sum(candidate is setting for candidate in by_name.values()) > 1]
    assert {setting.name for setting in shared} == {"url", "io_threads", "model", "revision",
                                                    "tenant", "auth_key", "auth_key_file",
                                                    "load_timeout_s", "prefill_tokens_per_s"}
    assert known_env_names() >= {"KVTIER_DEBUG", "KVTIER_SKIP_VLLM", "KVTIER_CONFIG",
                                 "KVTIER_SECONDARY_TIERS", "KVTIER_IO_THREADS"}


def _signature_defaults(function: Any) -> dict[str, Any]:
    return {name: parameter.default
            for name, parameter in inspect.signature(function).parameters.items()
            if parameter.default is not inspect.Parameter.empty}


def test_constructor_defaults_come_from_the_tables() -> None:
    from kvtier.lookup.manager import AsyncLookupManager
    from kvtier.tiering.tier import SecondaryTier
    from kvtier.tiering.tier_settings import TIER_IO_SETTINGS, TierSettings

    assert "settings" in _signature_defaults(SecondaryTier.__init__)  # one record, not kwargs
    record_fields = {item.name: item.default for item in dataclasses.fields(TierSettings)}
    assert tuple(record_fields) == TIER_IO_SETTINGS.names
    for setting in TIER_SETTINGS:
        if setting.name not in ("url", "name"):
            assert record_fields[setting.name] == setting.default, setting.name
            assert TIER_IO_SETTINGS[setting.name] is setting, setting.name
    config_fields = {item.name: item.default for item in dataclasses.fields(KvtierConfig)}
    for setting in CONFIG_SETTINGS:
        if setting.required:
            continue
        default = config_fields[setting.name]
        assert getattr(default, "value", default) == setting.default, setting.name
    lookup_defaults = _signature_defaults(AsyncLookupManager.__init__)
    for setting in LOOKUP_SETTINGS:
        assert setting.name in lookup_defaults, setting.name
        if setting.default is not None:  # unset: the lookup manager's own default
            assert lookup_defaults[setting.name] == setting.default, setting.name


def test_vllm_tier_options_default_to_the_table() -> None:
    """KvtierTier's keyword defaults are None: the KVTIER_* variable, else the table default."""
    pytest.importorskip("vllm")
    from kvtier.integrations.vllm import KvtierTier

    defaults = _signature_defaults(KvtierTier.__init__)
    for setting in VLLM_TIER_SETTINGS:
        assert defaults[setting.name] is None, setting.name


def test_config_error_is_the_settings_error() -> None:
    from kvtier import settings

    assert ConfigError is settings.ConfigError
    assert issubclass(ConfigError, ValueError)


def test_a_table_parses_strings_and_objects_alike() -> None:
    table = SettingsTable("demo", [
        Setting("size", Kind.SIZE, 1024, "a size", minimum=1, env="KVTIER_DEMO_SIZE"),
        Setting("flag", Kind.BOOL, False, "a flag"),
    ])
    assert table.parse({"size": "4KiB", "flag": "yes"}) == {"size": 4096, "flag": True}
    assert table.parse({"size": 8}) == {"size": 8, "flag": False}
    assert table.parse_env({"KVTIER_DEMO_SIZE": "2K"}) == {"size": 2048}
    with pytest.raises(ConfigError, match=r"unknown demo setting\(s\) \['x.sise'\]"):
        table.parse({"sise": 1}, "x")
    with pytest.raises(ConfigError, match=r"KVTIER_DEMO_SIZE \(size\): '2KB' is ambiguous"):
        table.parse_env({"KVTIER_DEMO_SIZE": "2KB"})


def test_tier_settings_record_is_generated_from_one_declaration() -> None:
    from kvtier.settings import ConfigError as SettingsError
    from kvtier.tiering.tier_settings import TIER_IO_SETTINGS, TierSettings

    record = TierSettings.parse({"max_pending_store_bytes": "8MiB", "io_threads": "2"}, "t")
    assert (record.io_threads, record.max_pending_store_bytes) == (2, 8 << 20)
    assert TierSettings(max_pending_store_bytes="1KiB").max_pending_store_bytes == 1024
    with pytest.raises(SettingsError, match=r"tier\.io_threads: expected an integer >= 1"):
        TierSettings(io_threads=0)
    with pytest.raises(SettingsError, match="unknown secondary tier I/O setting"):
        TierSettings.parse({"io_thread": 1})
    assert TIER_IO_SETTINGS["io_threads"].env == "KVTIER_IO_THREADS"
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.io_threads = 3  # type: ignore[misc]


def test_tier_config_holds_one_record_and_reads_through_it() -> None:
    cfg = load_config({"block_bytes": 1024, "primary_bytes": 4096, "namespace": {"model": "m"},
                       "secondary_tiers": [{"url": "redis://u:hunter2@h:1/0",
                                            "io_threads": 3}]})
    tier = cfg.secondary_tiers[0]
    assert isinstance(tier, TierConfig)
    assert tier.settings.io_threads == tier.io_threads == 3
    assert "hunter2" not in repr(tier)
    assert load_config(cfg.to_dict()) == cfg


# ---- typos get "did you mean" (issue 20), as the KVTIER_* variables always did ---------------

@pytest.mark.parametrize(("values", "hint"), [
    (with_(primary_byte="4MiB"), "unknown key(s) ['primary_byte']; expected some of"),
    (with_(namespace={"modle": "m"}), "['namespace.modle']"),
    (with_(secondary_tiers=[{"url": "file:///tmp/x", "io_thread": 2}]),
     "['secondary_tiers[0].io_thread']"),
    (with_(secondary_tiers=[{"url": "file:///tmp/x", "max_byte": "1MiB"}]),
     "['secondary_tiers[0].max_byte']"),
    (with_(secondary_tiers=[{"url": "file:///tmp/x", "lookup": {"quarantine": 1}}]),
     "['secondary_tiers[0].lookup.quarantine']"),
])
def test_a_misspelt_key_names_the_closest_one(values: dict[str, Any], hint: str) -> None:
    expected = {"primary_byte": "primary_bytes", "modle": "model", "io_thread": "io_threads",
                "max_byte": "max_bytes", "quarantine": "quarantine_s"}
    with pytest.raises(ConfigError) as caught:
        KvtierConfig.from_dict(values)
    message = str(caught.value)
    typo = next(name for name in expected if name in message)
    assert hint in message and message.endswith(f"; did you mean {expected[typo]}?"), message


def test_a_yaml_typo_names_the_file_and_the_closest_key(tmp_path: Path) -> None:
    path = tmp_path / "kv.yaml"
    path.write_text("block_bytes: 64KiB\nprimary_bytes: 1MiB\nnamespace: {model: m}\n"
                    "evicton_policy: arc\n")
    with pytest.raises(ConfigError, match=r"kv\.yaml.*\['evicton_policy'\].*did you mean "
                                          r"eviction_policy\?$"):
        KvtierConfig.from_yaml(path)


def test_several_typos_each_get_their_closest_key() -> None:
    with pytest.raises(ConfigError, match=r"did you mean: evicton_policy -> eviction_policy, "
                                          r"primary_byte -> primary_bytes\?$"):
        KvtierConfig.from_dict(with_(evicton_policy="arc", primary_byte=1, zzz=1))


def test_choice_values_take_the_dashed_spelling_too() -> None:
    """One spelling shown (write_through), the dashed one still read."""
    cfg = KvtierConfig.from_dict(with_(write_policy="Write-Back", primary_backing="heap"))
    assert cfg.write_policy is WritePolicy.WRITE_BACK
    with pytest.raises(ConfigError, match="expected one of 'write_through', 'write_back'"):
        KvtierConfig.from_dict(with_(write_policy="sometimes"))
