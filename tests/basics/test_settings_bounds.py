"""Absurd values get a clear ConfigError naming the setting, never a raw traceback.

Each case raised OverflowError / ValueError from deep inside (or was accepted) before.
"""

from __future__ import annotations

import pytest

from kvtier.backends import open_backend
from kvtier.config import ConfigError, load_config
from kvtier.keys import Namespace
from kvtier.settings import shown_value


def _config(**top: object) -> dict[str, object]:
    return {"block_bytes": "4KiB", "primary_bytes": "1MiB", "namespace": {"model": "m"}, **top}


@pytest.mark.parametrize("url, name", [
    ("redis://127.0.0.1:1/0?ttl_s=1e308", "ttl_s"),
    ("redis://127.0.0.1:1/0?socket_timeout_s=1e308", "socket_timeout_s"),
    ("redis://127.0.0.1:1/0?connect_timeout_s=1e300", "connect_timeout_s"),
    ("s3://bucket/prefix?timeout_s=1e308", "timeout_s"),
])
def test_huge_seconds_in_a_url_are_refused_by_name(url: str, name: str) -> None:
    with pytest.raises(ConfigError, match=rf"{name}: expected a finite number .*<= "):
        open_backend(url, Namespace(model="m"))


def test_a_five_thousand_digit_size_is_named_not_printed() -> None:
    with pytest.raises(ConfigError, match=r"block_bytes: .*an integer of about 5001 digits"):
        load_config(_config(block_bytes=10**5000))
    with pytest.raises(ConfigError, match=r"expected a finite number"):
        load_config(_config(secondary_tiers=[{"url": "file:///tmp/x",
                                              "load_timeout_s": 10**5000}]))


def test_unicode_digits_are_not_a_size() -> None:
    with pytest.raises(ConfigError, match="block_bytes: expected a byte count"):
        load_config(_config(block_bytes="\u0664\u0660\u0669\u0666"))  # Arabic-Indic 4096
    assert load_config(_config(block_bytes="4096")).block_bytes == 4096


def test_shown_value_bounds_long_text() -> None:
    assert shown_value("x" * 10_000).endswith("(10002 chars)")
    assert shown_value(12) == "12"


@pytest.mark.parametrize("tier, message", [
    ({"io_threads": 1_000_000}, r"io_threads: expected an integer >= 1 and <= 256"),
    ({"load_timeout_s": 1e-300}, r"load_timeout_s: expected a finite number >= 0.001"),
])
def test_tier_settings_that_could_only_be_typos_are_refused(tier: dict[str, object],
                                                            message: str) -> None:
    """Before: a million I/O threads, and a deadline every load misses, were accepted."""
    with pytest.raises(ConfigError, match=message):
        load_config(_config(secondary_tiers=[{"url": "memory://", **tier}]))


def test_the_file_system_root_is_not_a_tier_root() -> None:
    with pytest.raises(ValueError, match="file system's root"):
        open_backend("file:///", Namespace(model="m"))
