"""A backend kind registered from outside gets YAML config, ``open_manager``, usage and purge
with no edit to kvtier: the registry is the one place every one of them looks.

The test kind is what a third party would write: its own URL scheme (``vault://``) and
settings table, storing real files through kvtier's own file backend, with its own inventory.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

import kvtier
from kvtier.backends import (
    Backend,
    BackendKind,
    InventoryUnsupportedError,
    kind_for,
    open_backend,
    register_kind,
    register_scheme,
    registered_schemes,
)
from kvtier.backends.file import FileBackend
from kvtier.backends.file.kind import KIND as FILE_KIND
from kvtier.config import ConfigError, KvtierConfig, load_config
from kvtier.keys import Namespace, chain_keys
from kvtier.ops.inventory import UsageError
from kvtier.settings import Kind, Setting, SettingsTable

_COUNTER = itertools.count()
VAULT_SETTINGS = SettingsTable("vault backend", (
    Setting("fsync", Kind.BOOL, False, help="fsync every block"),
))


class VaultKind(BackendKind):
    """``vault:///dir``: a file tier under another name, with an inventory of its own."""

    remote = False

    def __init__(self, scheme: str) -> None:
        self.schemes = (scheme,)

    @property
    def settings(self) -> SettingsTable:
        return VAULT_SETTINGS

    def _file_url(self, url: str) -> str:
        return "file://" + url.partition("://")[2]

    def open(self, url: str, namespace: Namespace, options: dict[str, Any]) -> Backend:
        parsed = self.parse_url(url, options)
        return FileBackend(url.partition("://")[2], namespace, fsync=parsed["fsync"])

    def list_namespaces(self, url: str, options: dict[str, Any]) -> list[Any]:
        return FILE_KIND.list_namespaces(self._file_url(url), dict(self.parse_url(url, options)))

    def delete_namespaces(self, url: str, options: dict[str, Any], digests: Sequence[str]) -> int:
        return FILE_KIND.delete_namespaces(self._file_url(url), {}, digests)


def _vault() -> VaultKind:
    return VaultKind(f"vault{next(_COUNTER)}")


def _config(url: str, **tier: Any) -> dict[str, Any]:
    return {"block_bytes": 4096, "primary_bytes": 64 * 4096,
            "namespace": {"model": "registry-test"},
            "secondary_tiers": [{"url": url, **tier}]}


def test_yaml_config_accepts_and_validates_a_registered_kind(tmp_path: Path) -> None:
    kind = register_kind(_vault())
    scheme = kind.schemes[0]
    assert scheme in registered_schemes() and kind_for(scheme + "://") is kind
    yaml_file = tmp_path / "kvtier.yaml"
    yaml_file.write_text(f"block_bytes: 4096\nprimary_bytes: 256KiB\nnamespace: {{model: m}}\n"
                         f"secondary_tiers:\n"
                         f"  - url: {scheme}://{tmp_path}/tier\n    fsync: true\n")
    cfg = KvtierConfig.from_yaml(str(yaml_file))
    assert cfg.secondary_tiers[0].options["fsync"] is True
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].*fsink"):
        load_config(_config(f"{scheme}://{tmp_path}/tier", fsink=True))


def test_usage_and_purge_list_and_delete_a_registered_kind(tmp_path: Path) -> None:
    kind = register_kind(_vault())
    url = f"{kind.schemes[0]}://{tmp_path}/tier"
    manager = kvtier.open_manager(_config(url))  # open_manager goes through the registry too
    namespace = manager.namespace
    manager.shutdown()
    keys = chain_keys(list(range(5 * 16)), 16, namespace)
    backend = open_backend(url, namespace)
    assert backend.put_many(keys, [bytes([i]) * 4096 for i in range(len(keys))]) == [True] * 5
    backend.close()
    [found] = kvtier.usage(url)
    assert found.digest == namespace.digest_hex
    assert found.blocks == len(keys) and found.fields is not None
    assert found.fields["model"] == "registry-test"
    result = kvtier.purge(url, digest=found.digest)
    assert result.objects_deleted == len(keys) + 1  # the blocks and the manifest
    assert kvtier.usage(url) == []


def test_a_bare_factory_scheme_opens_but_says_it_keeps_no_inventory(tmp_path: Path) -> None:
    scheme = f"bare{next(_COUNTER)}"

    def factory(url: str, namespace: Namespace, options: Mapping[str, Any]) -> Backend:
        return FileBackend(url.partition("://")[2], namespace)

    register_scheme(scheme, factory)
    cfg = load_config(_config(f"{scheme}://{tmp_path}/bare"))
    assert cfg.secondary_tiers[0].url.startswith(scheme)
    with pytest.raises(UsageError, match="keeps no inventory"):
        kvtier.usage(f"{scheme}://{tmp_path}/bare")
    with pytest.raises(InventoryUnsupportedError):
        kind_for(scheme).delete_namespaces(f"{scheme}://x", {}, ["00"])


def test_registration_refuses_built_ins_duplicates_and_bad_names() -> None:
    class Fake(VaultKind):
        pass

    with pytest.raises(ValueError, match="built in"):
        register_kind(VaultKind("file"))
    kind = register_kind(_vault())
    assert register_kind(kind) is kind  # the same object again is fine
    with pytest.raises(ValueError, match="already registered"):
        register_kind(Fake(kind.schemes[0]))
    with pytest.raises(ValueError, match="expected letters"):
        register_kind(VaultKind("9lives"))
    with pytest.raises(TypeError, match="BackendKind"):
        register_kind(object())  # type: ignore[arg-type]
