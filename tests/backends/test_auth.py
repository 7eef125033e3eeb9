"""Authenticated frames: a writer without the tier's key never gets its bytes served.

Every scenario uses a real second writer: another backend instance with a different key, or
with none, writing into the same real directory, Valkey (standalone and cluster) or SeaweedFS
bucket. The owner's read must refuse the foreign frame, count it in ``auth_failures``, remove it
(conditional delete), and then the owner's next store must replace it.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from backends.conftest import PERSISTENT_KINDS, BackendHarness
from backends.test_contract import keys_for, payload_for, sentinel_buffer
from kvtier import codec
from kvtier.backends import open_backend
from kvtier.keys import Namespace
from kvtier.settings import ConfigError

OWNER_KEY = "owner-secret-key-0123456789abcdef"
OTHER_KEY = "tenant-b-secret-key-fedcba987654"
SIZE = 8192


def _owner_then_intruder_check(harness: BackendHarness, intruder_options: dict[str, str],
                               owner_options: dict[str, str], tag: str) -> None:
    owner = harness.open(**owner_options)
    intruder = harness.open(**intruder_options)
    [key] = keys_for(1, f"auth-{tag}-{harness.kind}")
    forged = payload_for(key, SIZE, b"forged")
    real = payload_for(key, SIZE)
    # The intruder writes first: a perfectly valid frame by its own rules, in our namespace.
    assert intruder.put_many([key], [forged]) == [True]
    before = owner.stats()
    out = sentinel_buffer(SIZE)
    assert owner.get_many([key], [memoryview(out)]) == [False]  # never served
    after = owner.stats()
    assert after["auth_failures"] == before["auth_failures"] + 1
    assert after["hits"] == before["hits"] and after["bytes_read"] == before["bytes_read"]
    assert after["corrupt_objects"] == before["corrupt_objects"]
    # Removed, so the owner's next store replaces it ("put never overwrites" cannot lock it out).
    assert harness.raw(owner).read(key) is None
    assert owner.exists([key]) == [False]
    assert owner.put_many([key], [real]) == [True]
    assert owner.get_many([key], [memoryview(out)]) == [True] and bytes(out) == real
    # And the intruder, in turn, cannot read the owner's block as its own.
    assert intruder.get_many([key], [memoryview(out)]) == [False]
    assert intruder.stats()["auth_failures"] == 1


@pytest.mark.parametrize("backend_kind", PERSISTENT_KINDS, indirect=True)
def test_a_writer_with_another_key_is_never_served(harness: BackendHarness) -> None:
    _owner_then_intruder_check(harness, {"auth_key": OTHER_KEY}, {"auth_key": OWNER_KEY},
                               "other-key")


@pytest.mark.parametrize("backend_kind", PERSISTENT_KINDS, indirect=True)
def test_a_writer_without_a_key_is_never_served(harness: BackendHarness) -> None:
    _owner_then_intruder_check(harness, {}, {"auth_key": OWNER_KEY}, "no-key")


@pytest.mark.parametrize("backend_kind", PERSISTENT_KINDS, indirect=True)
def test_a_keyed_frame_is_refused_by_an_unkeyed_tier(harness: BackendHarness) -> None:
    _owner_then_intruder_check(harness, {"auth_key": OTHER_KEY}, {}, "keyed-into-unkeyed")


@pytest.mark.parametrize("backend_kind", PERSISTENT_KINDS, indirect=True)
def test_a_forged_tag_or_any_flipped_byte_fails_authentication(harness: BackendHarness) -> None:
    """Bytes copied from the owner's valid frame, with any one byte changed (header field, tag,
    payload), never verify: the MAC covers the header and the payload."""
    owner = harness.open(auth_key=OWNER_KEY)
    keys = keys_for(4, f"auth-flip-{harness.kind}")
    payloads = [payload_for(key, SIZE) for key in keys]
    assert owner.put_many(keys, payloads) == [True] * 4
    raw = harness.raw(owner)
    # The length field, the tag, and two payload bytes.
    offsets = [8, 290, codec.HEADER_BYTES + 100, codec.HEADER_BYTES + SIZE - 1]
    for key, offset in zip(keys, offsets, strict=True):
        frame = bytearray(raw.read(key) or b"")
        assert frame[287] == 1, "a keyed tier writes mode-1 (MAC) frames"
        frame[offset] ^= 0x01
        raw.write(key, bytes(frame))
    outs = [sentinel_buffer(SIZE) for _ in keys]
    assert owner.get_many(keys, [memoryview(out) for out in outs]) == [False] * 4
    stats = owner.stats()
    assert stats["auth_failures"] + stats["corrupt_objects"] == 4
    assert stats["auth_failures"] >= 3  # the length flip may be caught as a size error first
    assert owner.exists(keys) == [False] * 4


def test_keyed_round_trip_on_every_backend(harness: BackendHarness) -> None:
    backend = harness.open(auth_key=OWNER_KEY)
    assert backend.authenticated
    keys = keys_for(3, f"auth-rt-{harness.kind}")
    payloads = [payload_for(key, size) for key, size in zip(keys, (0, 100, 1 << 16), strict=True)]
    assert backend.put_many(keys, payloads) == [True] * 3
    outs = [bytearray(len(p)) for p in payloads]
    assert backend.get_many(keys, [memoryview(out) for out in outs]) == [True] * 3
    assert [bytes(out) for out in outs] == payloads
    assert backend.stats()["auth_failures"] == 0


# --------------------------------------------------------------------------- key options


def _key_file(tmp_path: Path, content: bytes, mode: int = 0o600) -> Path:
    path = tmp_path / "tier.key"
    path.write_bytes(content)
    os.chmod(path, mode)
    return path


def test_auth_key_file_is_read_once_and_its_newline_stripped(tmp_path: Path) -> None:
    namespace = Namespace(model="auth-file")
    path = _key_file(tmp_path, OWNER_KEY.encode() + b"\n")
    by_file = open_backend(f"file://{tmp_path}/tier", namespace, auth_key_file=str(path))
    path.write_bytes(b"changed-after-open-0123456789")  # read once: no effect on this backend
    by_value = open_backend(f"file://{tmp_path}/tier", namespace, auth_key=OWNER_KEY)
    [key] = keys_for(1, "auth-file")
    assert by_file.put_many([key], [b"x" * 64]) == [True]
    out = bytearray(64)
    assert by_value.get_many([key], [memoryview(out)]) == [True] and out == b"x" * 64
    assert by_file.get_many([key], [memoryview(out)]) == [True]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"auth_key": "short"}, "at least 16"),
        ({"auth_key": OWNER_KEY, "auth_key_file": "/x"}, "not both"),
        ({"auth_key_file": "/no/such/key"}, "No such file"),
        ({"auth_key": 12345}, "expected a string"),
    ],
)
def test_bad_auth_options_are_clear_and_never_show_the_key(
    tmp_path: Path, options: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        open_backend("memory://", Namespace(model="m"), **options)
    assert OWNER_KEY not in str(caught.value) and "short" not in str(caught.value).split(":")[-1]


def test_a_key_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = _key_file(tmp_path, OWNER_KEY.encode(), mode=0o644)
    with pytest.raises(ConfigError, match=r"mode 644.*chmod 600") as caught:
        open_backend("memory://", Namespace(model="m"), auth_key_file=str(path))
    assert OWNER_KEY not in str(caught.value)
    link = tmp_path / "link.key"
    os.chmod(path, 0o600)
    link.symlink_to(path)
    with pytest.raises(ConfigError, match="auth_key_file"):
        open_backend("memory://", Namespace(model="m"), auth_key_file=str(link))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_the_key_never_appears_in_a_repr_or_url(tmp_path: Path) -> None:
    backend = open_backend(f"file://{tmp_path}?auth_key={OWNER_KEY}", Namespace(model="m"))
    assert OWNER_KEY not in repr(backend) and OWNER_KEY not in backend.url
    digest = hashlib.sha256(OWNER_KEY.encode()).hexdigest()
    assert digest not in repr(backend)
