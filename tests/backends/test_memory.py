"""Memory backend specifics: instance privacy and the optional capacity bound."""

from __future__ import annotations

import pytest

from backends.conftest import fresh_namespace
from backends.test_contract import keys_for
from kvtier import codec
from kvtier.backends import open_backend
from kvtier.backends.memory import MemoryBackend


def test_each_instance_is_private() -> None:
    namespace = fresh_namespace()
    first, second = open_backend("memory://", namespace), open_backend("memory://", namespace)
    keys = keys_for(1, "private")
    assert first.put_many(keys, [b"x"]) == [True]
    assert second.exists(keys) == [False]


def test_max_bytes_evicts_least_recently_used() -> None:
    frame = codec.frame_size(100)
    backend = open_backend("memory://?max_bytes=" + str(2 * frame), fresh_namespace())
    k1, k2, k3 = keys_for(3, "lru")
    assert backend.put_many([k1, k2], [b"1" * 100, b"2" * 100]) == [True, True]
    assert backend.get_many([k1], [memoryview(bytearray(100))]) == [True]
    assert backend.put_many([k3], [b"3" * 100]) == [True]
    assert backend.exists([k1, k2, k3]) == [True, False, True]
    stats = backend.stats()
    assert (stats["evictions"], stats["used_bytes"]) == (1, 2 * frame)
    assert (backend.evicted.take(), backend.evicted.take()) == ([k2], [])
    assert backend.put_many(keys_for(1, "big"), [bytes(2 * frame)]) == [False]


def test_close_releases_the_blocks() -> None:
    backend = MemoryBackend(fresh_namespace())
    assert backend.put_many(keys_for(2, "close"), [bytes(1000)] * 2) == [True, True]
    backend.close()
    assert backend.stats()["blocks"] == 0


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("memory://host", "no host or path"),
        ("memory:///path", "no host or path"),
        ("memory://?max_bytes=lots", "max_bytes: expected .*got 'lots'"),
        ("memory://?capacity=1", "unknown memory backend setting.*capacity"),
    ],
)
def test_bad_memory_urls(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        open_backend(url, fresh_namespace())
