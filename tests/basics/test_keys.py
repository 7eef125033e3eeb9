"""Tests of block keys, namespaces and request contexts (kvtier/keys.py)."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from kvtier.keys import (
    KEY_BYTES,
    Namespace,
    RequestContext,
    chain_keys,
    validate_keys,
)

FULL = Namespace(
    model="llama-3-8b",
    revision="r1",
    dtype="bfloat16",
    kv_layout="nhd",
    block_size=16,
    world_size=2,
    rank=1,
    tenant="acme",
)


def test_namespace_digest_is_pinned() -> None:
    """Stable across processes, machines and versions: pinned literals catch any change."""
    assert FULL.digest_hex == "b50cfe8829c9e9df76865dcbb2ae63e8"
    assert Namespace(model="m").digest_hex == "7d945e5582ef422eb48e4c9e4da64b63"
    assert len(FULL.digest) == 16 and FULL.digest.hex() == FULL.digest_hex


def test_namespace_digest_is_the_same_in_a_fresh_process() -> None:
    code = "from kvtier.keys import Namespace; print(Namespace(model='m').digest_hex)"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True,
        env={"PYTHONHASHSEED": "12345"}, timeout=60,
    )
    assert out.stdout.strip() == Namespace(model="m").digest_hex


@pytest.mark.parametrize(
    "field", ["model", "revision", "dtype", "kv_layout", "block_size", "world_size", "tenant"]
)
def test_every_namespace_field_changes_the_digest(field: str) -> None:
    values: dict[str, Any] = {
        "model": "llama-3-8b", "revision": "r1", "dtype": "bfloat16", "kv_layout": "nhd",
        "block_size": 16, "world_size": 2, "rank": 1, "tenant": "acme",
    }
    values[field] = values[field] + 1 if isinstance(values[field], int) else values[field] + "x"
    assert Namespace(**values).digest != FULL.digest


def test_namespace_fields_do_not_run_together() -> None:
    assert Namespace(model="ab", revision="c").digest != Namespace(model="a", revision="bc").digest
    assert Namespace(model="m", rank=0, world_size=2).digest != Namespace(
        model="m", rank=1, world_size=2).digest


def test_namespace_is_frozen_and_comparable() -> None:
    assert Namespace(model="m", dtype="fp16") == Namespace(model="m", dtype="fp16")
    with pytest.raises(AttributeError):
        FULL.model = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"model": ""}, ValueError, "Namespace.model must be a non-empty"),
        ({"model": 3}, TypeError, "Namespace.model must be a str"),
        ({"model": "m", "dtype": None}, TypeError, "Namespace.dtype must be a str"),
        ({"model": "m", "block_size": -1}, ValueError, "Namespace.block_size must be >= 0"),
        ({"model": "m", "block_size": 1.5}, TypeError, "Namespace.block_size must be an int"),
        ({"model": "m", "world_size": True}, TypeError, "Namespace.world_size must be an int"),
        ({"model": "m", "world_size": 0}, ValueError, "Namespace.world_size must be >= 1"),
        ({"model": "m", "rank": 2, "world_size": 2}, ValueError, "Namespace.rank must be in"),
    ],
)
def test_namespace_rejects_bad_fields(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        Namespace(**kwargs)


def test_namespace_from_mapping() -> None:
    assert Namespace.from_mapping({"model": "m", "rank": 0}) == Namespace(model="m")
    with pytest.raises(ValueError, match=r"unknown namespace field\(s\) \['colour'\]"):
        Namespace.from_mapping({"model": "m", "colour": "red"})
    with pytest.raises(ValueError, match="needs a 'model' field"):
        Namespace.from_mapping({"dtype": "fp16"})


def _reference_chain(tokens: list[int], block_size: int, ns: Namespace) -> list[bytes]:
    """The documented construction, written out independently of the implementation."""
    previous = bytes(KEY_BYTES)
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = struct.pack(f"<{block_size}q", *tokens[start : start + block_size])
        hasher = hashlib.blake2b(b"kvtier.chain.v1" + ns.digest, digest_size=KEY_BYTES)
        hasher.update(previous + block)
        previous = hasher.digest()
        keys.append(previous)
    return keys


def test_chain_keys_are_pinned_and_match_the_documented_construction() -> None:
    ns = Namespace(model="m")
    keys = chain_keys(list(range(8)), 4, ns)
    assert [k.hex() for k in keys] == [
        "7e7219c3adaaa47cff47a2d56347e2f6",
        "9121797884e9d127f2022aeaccafb5f5",
    ]
    tokens = [7, 3, 99, 2**40, 0, 5, 6, 1, 12, 13]
    assert chain_keys(tokens, 3, ns) == _reference_chain(tokens, 3, ns)


def test_one_key_per_full_block_each_covering_its_prefix() -> None:
    ns = Namespace(model="m")
    tokens = list(range(100, 111))
    keys = chain_keys(tokens, 4, ns)
    assert len(keys) == 2 and all(len(k) == KEY_BYTES for k in keys)
    assert chain_keys(tokens[:8], 4, ns) == keys  # the partial tail block gets no key
    changed_first_block = [999, *tokens[1:]]
    other = chain_keys(changed_first_block, 4, ns)
    assert other[0] != keys[0] and other[1] != keys[1]  # key 1 covers block 0 too
    changed_second_block = [*tokens[:4], 999, *tokens[5:]]
    other = chain_keys(changed_second_block, 4, ns)
    assert other[0] == keys[0] and other[1] != keys[1]
    assert chain_keys([], 4, ns) == [] and chain_keys([1, 2], 4, ns) == []


def test_chain_keys_is_deterministic_and_accepts_numpy() -> None:
    ns = Namespace(model="m")
    tokens = list(range(64))
    assert chain_keys(tokens, 16, ns) == chain_keys(tokens, 16, ns)
    for dtype in (np.int32, np.int64, np.uint16, np.uint64):
        assert chain_keys(np.arange(64, dtype=dtype), 16, ns) == chain_keys(tokens, 16, ns)
    assert chain_keys(tuple(tokens), 16, ns) == chain_keys(tokens, 16, ns)


def test_namespaces_never_share_keys() -> None:
    tokens = list(range(32))
    a = chain_keys(tokens, 8, Namespace(model="m", dtype="fp16"))
    b = chain_keys(tokens, 8, Namespace(model="m", dtype="bf16"))
    c = chain_keys(tokens, 8, Namespace(model="m", dtype="fp16", tenant="t2"))
    assert not set(a) & set(b) and not set(a) & set(c)


def test_parent_continues_a_chain() -> None:
    ns = Namespace(model="m")
    tokens = list(range(40))
    whole = chain_keys(tokens, 8, ns)
    head = chain_keys(tokens[:16], 8, ns)
    tail = chain_keys(tokens[16:], 8, ns, parent=head[-1])
    assert head + tail == whole
    assert chain_keys(tokens[16:], 8, ns) != tail


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (([1, 2], 0), ValueError, "block_size must be >= 1, got 0"),
        (([1, 2], 2.0), TypeError, "block_size must be an int"),
        (([1, 2], True), TypeError, "block_size must be an int"),
        (([1, 2.5], 1), TypeError, "token_ids must contain only ints"),
        ((["a", "b"], 1), TypeError, "token_ids must contain only ints"),
        (("abc", 1), TypeError, "token_ids must be a sequence of ints"),
        ((b"abc", 1), TypeError, "token_ids must be a sequence of ints"),
        (([[1, 2]], 1), ValueError, "token_ids must be one-dimensional"),
        (([1, -2], 1), ValueError, "token_ids must be >= 0"),
        ((np.array([2**63], dtype=np.uint64), 1), ValueError, r"token_ids must be < 2\*\*63"),
        (([True, False], 1), TypeError, "token_ids must contain only ints, found bool"),
    ],
)
def test_chain_keys_rejects_bad_arguments(
    args: tuple[Any, int], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        chain_keys(args[0], args[1], Namespace(model="m"))


def test_chain_keys_rejects_oversized_python_int_as_value_error() -> None:
    expected = r"token_ids must be in \[0, 2\*\*63\), found 18446744073709551616"
    with pytest.raises(ValueError, match=expected):
        chain_keys([2**64], 1, Namespace(model="m"))


def test_chain_keys_rejects_bad_namespace_and_parent() -> None:
    with pytest.raises(TypeError, match="namespace must be a Namespace, got str"):
        chain_keys([1], 1, "m")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="parent must be a BlockKey"):
        chain_keys([1], 1, Namespace(model="m"), parent="ab")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="parent must be a non-empty BlockKey"):
        chain_keys([1], 1, Namespace(model="m"), parent=b"")


def test_request_context() -> None:
    params = {"scope": "a"}
    context = RequestContext("r1", params)
    params["scope"] = "changed"
    assert context.params["scope"] == "a"  # copied
    with pytest.raises(TypeError):
        context.params["scope"] = "x"  # type: ignore[index]
    assert RequestContext("r1").params == {}
    assert hash(RequestContext("r1", {"a": 1})) == hash(RequestContext("r1"))
    with pytest.raises(AttributeError):
        context.req_id = "r2"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("req_id", "params", "error", "message"),
    [
        ("", {}, ValueError, "RequestContext.req_id must be a non-empty string"),
        (7, {}, TypeError, "RequestContext.req_id must be a str, got int"),
        ("r", [("a", 1)], TypeError, "RequestContext.params must be a Mapping, got list"),
    ],
)
def test_request_context_rejects_bad_arguments(
    req_id: Any, params: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        RequestContext(req_id, params)


def test_validate_keys_names_the_bad_item() -> None:
    assert validate_keys((b"a", b"b")) == [b"a", b"b"]
    with pytest.raises(TypeError, match=r"blocks\[1\] must be a BlockKey \(bytes\), got str"):
        validate_keys([b"a", "b"], "blocks")
