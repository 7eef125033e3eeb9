"""Authenticated frames: a writer without the tier's key never gets its bytes served, and
keys rotate without destroying anyone's blocks.

Every scenario uses a real second writer: another backend instance with a different key, or
with none, writing into the same real directory, Valkey (standalone and cluster) or SeaweedFS
bucket. The owner's read must refuse the foreign frame and count it in ``auth_failures``; a
frame it can judge as bad (forged under its key, unkeyed) is removed, a frame signed by a key
it does not hold is left for its writer; either way the owner's next store replaces it.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest

from backends.conftest import PERSISTENT_KINDS, BackendHarness
from backends.test_contract import keys_for, payload_for, sentinel_buffer
from kvtier import codec
from kvtier.backends import Backend, open_backend
from kvtier.keys import Namespace
from kvtier.settings import ConfigError

OWNER_KEY = "owner-secret-key-0123456789abcdef"
OTHER_KEY = "tenant-b-secret-key-fedcba987654"
SIZE = 8192


def _refused_then_replaced(harness: BackendHarness, owner: Backend, intruder: Backend,
                           tag: str, removed: bool) -> None:
    """The intruder stores first: a valid frame by its own rules, in our namespace. The owner's
    read refuses it (never served, counted in ``auth_failures``); ``removed``: at once (a frame
    the owner can judge as bad), else it is left for its writer (another key's frame: a
    rotation in progress must not destroy it) and the owner's next store replaces it."""
    [key] = keys_for(1, f"auth-{tag}-{harness.kind}")
    forged = payload_for(key, SIZE, b"forged")
    real = payload_for(key, SIZE)
    assert intruder.put_many([key], [forged]) == [True]
    planted = harness.raw(owner).read(key)
    before = owner.stats()
    out = sentinel_buffer(SIZE)
    assert owner.get_many([key], [memoryview(out)]) == [False]  # never served
    after = owner.stats()
    assert after["auth_failures"] == before["auth_failures"] + 1
    assert after["hits"] == before["hits"] and after["bytes_read"] == before["bytes_read"]
    assert after["corrupt_objects"] == before["corrupt_objects"]
    if removed:
        assert harness.raw(owner).read(key) is None
        assert owner.exists([key]) == [False]
    else:
        assert harness.raw(owner).read(key) == planted
    # Either way the owner's next store writes its block ("put never overwrites" cannot lock
    # it out).
    assert owner.put_many([key], [real]) == [True]
    assert owner.get_many([key], [memoryview(out)]) == [True] and bytes(out) == real
    # And the intruder, in turn, cannot read the owner's block as its own.
    assert intruder.get_many([key], [memoryview(out)]) == [False]
    assert intruder.stats()["auth_failures"] == 1


@pytest.mark.parametrize("backend_kind", PERSISTENT_KINDS, indirect=True)
def test_a_writer_with_another_key_is_never_served_and_not_destroyed(
        harness: BackendHarness) -> None:
    """Before: the owner removed the other key's frame at once (two honest writers with
    different keys destroyed each other's blocks)."""
    owner = harness.open(auth_key=OWNER_KEY)
    intruder = harness.open(auth_key=OTHER_KEY)
    _refused_then_replaced(harness, owner, intruder, "other-key", removed=False)


@pytest.mark.parametrize("backend_kind", PERSISTENT_KINDS, indirect=True)
def test_a_writer_without_a_key_is_never_served(harness: BackendHarness) -> None:
    """The unkeyed writer opened before the tier became keyed (once it is, an unkeyed open is
    refused: see below); its frames are removed by the keyed owner."""
    intruder = harness.open()
    owner = harness.open(auth_key=OWNER_KEY)
    _refused_then_replaced(harness, owner, intruder, "no-key", removed=True)


@pytest.mark.parametrize("backend_kind", PERSISTENT_KINDS, indirect=True)
def test_a_keyed_frame_is_refused_by_an_unkeyed_tier(harness: BackendHarness) -> None:
    owner = harness.open()
    intruder = harness.open(auth_key=OTHER_KEY)
    _refused_then_replaced(harness, owner, intruder, "keyed-into-unkeyed", removed=True)


@pytest.mark.parametrize("backend_kind", PERSISTENT_KINDS, indirect=True)
def test_a_forged_tag_or_any_flipped_byte_fails_authentication(harness: BackendHarness) -> None:
    """Bytes copied from the owner's valid frame, with any one byte changed (header field, tag,
    payload), never verify: the MAC covers the header and the payload. A forgery under the
    owner's own key id is removed; one that names another key id is refused and left."""
    owner = harness.open(auth_key=OWNER_KEY)
    keys = keys_for(5, f"auth-flip-{harness.kind}")
    payloads = [payload_for(key, SIZE) for key in keys]
    assert owner.put_many(keys, payloads) == [True] * 5
    raw = harness.raw(owner)
    # The length field, the tag, two payload bytes, and the key id (of a header or a trailer).
    for index, key in enumerate(keys):
        frame = bytearray(raw.read(key) or b"")
        record = codec.record_offset(frame)
        payload = codec.HEADER_BYTES if record == 0 else 0
        offset = [record + 8, record + 310, payload + 100, payload + SIZE - 1, record + 290][index]
        assert frame[record + 287] == codec.Algorithm.BLAKE3, "a keyed tier writes keyed BLAKE3"
        frame[offset] ^= 0x01
        raw.write(key, bytes(frame))
    outs = [sentinel_buffer(SIZE) for _ in keys]
    assert owner.get_many(keys, [memoryview(out) for out in outs]) == [False] * 5
    stats = owner.stats()
    assert stats["auth_failures"] + stats["corrupt_objects"] == 5
    assert stats["auth_failures"] >= 4  # the length flip may be caught as a size error first
    assert owner.exists(keys) == [False] * 4 + [True]  # the foreign key id is left in place
    assert owner.put_many(keys, payloads) == [True] * 5
    assert owner.get_many(keys, [memoryview(out) for out in outs]) == [True] * 5
    assert [bytes(out) for out in outs] == payloads


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


# --------------------------------------------------------------------------- key rotation

OLD_KEY = "old-rotation-key-0123456789abcdef"
NEW_KEY = "new-rotation-key-fedcba9876543210"
ROTATION_KINDS = ["file", "redis"]


def _key_file_of(path: Path, *keys: str, ending: str = "\n") -> str:
    path.write_bytes("".join(key + ending for key in keys).encode())
    os.chmod(path, 0o600)
    return str(path)


def _get(backend: Backend, keys: list[bytes], size: int = SIZE) -> tuple[list[bool], list[bytes]]:
    outs = [sentinel_buffer(size) for _ in keys]
    answers = backend.get_many(keys, [memoryview(out) for out in outs])
    return answers, [bytes(out) for out in outs]


@pytest.mark.parametrize("backend_kind", ROTATION_KINDS, indirect=True)
def test_two_writers_during_a_rotation_destroy_nothing_and_old_frames_are_rewritten(
        harness: BackendHarness, tmp_path: Path) -> None:
    """Writer A has the key file [old], writer B [new, old], on one real tier. Before: B
    refused (and removed) every frame of A and A every frame of B (hits 0.27-0.42)."""
    old_file = _key_file_of(tmp_path / "old.key", OLD_KEY)
    new_file = _key_file_of(tmp_path / "new.key", NEW_KEY, OLD_KEY)
    a = harness.open(auth_key_file=old_file)
    b = harness.open(auth_key_file=new_file)
    old_id, new_id = codec.KeyRing([OLD_KEY.encode()]).key_ids[0], codec.KeyRing(
        [NEW_KEY.encode()]).key_ids[0]
    keys_a = keys_for(24, f"rot-a-{harness.kind}")
    keys_b = keys_for(8, f"rot-b-{harness.kind}")
    payloads = {key: payload_for(key, SIZE) for key in keys_a + keys_b}
    assert a.put_many(keys_a, [payloads[key] for key in keys_a]) == [True] * 24
    assert b.put_many(keys_b, [payloads[key] for key in keys_b]) == [True] * 8
    raw = harness.raw(b)
    # B serves every block, A's (older key, counted) and its own: hits stay 1.0.
    answers, data = _get(b, keys_a + keys_b)
    assert answers == [True] * 32 and data == [payloads[key] for key in keys_a + keys_b]
    stats = b.stats()
    assert (stats["auth_old_key"], stats["auth_failures"], stats["hits"]) == (24, 0, 32)
    # A serves its own blocks and refuses B's without destroying them.
    answers, data = _get(a, keys_a)
    assert answers == [True] * 24 and data == [payloads[key] for key in keys_a]
    assert _get(a, keys_b)[0] == [False] * 8
    assert a.stats()["auth_failures"] == 8 and a.stats()["bytes_read"] == 24 * SIZE
    assert all(raw.read(key) is not None for key in keys_a + keys_b)
    assert _get(b, keys_b)[0] == [True] * 8
    # B's next store of A's keys rewrites them under the new key.
    assert {codec.frame_info(raw.read(key) or b"").key_id for key in keys_a} == {old_id}
    assert b.put_many(keys_a, [payloads[key] for key in keys_a]) == [True] * 24
    assert {codec.frame_info(raw.read(key) or b"").key_id for key in keys_a} == {new_id}
    assert b.stats()["puts_existing"] == 0
    answers, data = _get(b, keys_a)
    assert answers == [True] * 24 and data == [payloads[key] for key in keys_a]
    assert b.stats()["auth_old_key"] == 24  # nothing older was read since
    # A reader with only [old] now refuses the rewritten frames: counted, never served.
    reader = harness.open(auth_key_file=old_file)
    answers, data = _get(reader, keys_a)
    assert answers == [False] * 24 and reader.stats()["hits"] == 0
    assert reader.stats()["auth_failures"] == 24 and reader.stats()["bytes_read"] == 0
    assert _get(b, keys_a)[0] == [True] * 24  # and left them in place


@pytest.mark.parametrize("backend_kind", ROTATION_KINDS, indirect=True)
def test_the_next_store_rewrites_a_format_2_frame_and_a_newer_kvtiers_frame(
        harness: BackendHarness) -> None:
    """Frames of the previous kvtier (HMAC-SHA256, format 2) are served and counted in
    ``old_format``; a frame with an unknown algorithm id is refused, never served, left in
    place; the next store writes both in the medium's format (3, the file tier's 4)."""
    from basics.test_codec import format_2_frame

    owner = harness.open(auth_key=OWNER_KEY)
    old, unknown = keys_for(2, f"fmt-{harness.kind}")
    raw = harness.raw(owner)
    raw.write(old, format_2_frame(harness.namespace.digest, old, payload_for(old, SIZE),
                                  auth_key=OWNER_KEY.encode()))
    assert owner.put_many([unknown], [payload_for(unknown, SIZE)]) == [True]
    frame = bytearray(raw.read(unknown) or b"")
    frame[codec.record_offset(frame) + 287] = 9
    raw.write(unknown, bytes(frame))
    answers, data = _get(owner, [old, unknown])
    assert answers == [True, False] and data[0] == payload_for(old, SIZE)
    stats = owner.stats()
    assert (stats["old_format"], stats["corrupt_objects"], stats["hits"]) == (1, 1, 1)
    assert raw.read(unknown) == bytes(frame)
    assert owner.put_many([old, unknown], [payload_for(old, SIZE),
                                           payload_for(unknown, SIZE)]) == [True, True]
    assert [codec.frame_info(raw.read(key) or b"").version for key in (old, unknown)] == \
        [owner.FRAME_LAYOUT.version] * 2
    answers, data = _get(owner, [old, unknown])
    assert answers == [True, True] and data == [payload_for(old, SIZE), payload_for(unknown, SIZE)]
    assert owner.stats()["old_format"] == 1


# --------------------------------------------------------------------------- the manifest


class _Peeked(Exception):
    pass


def _stored_manifest(backend: Backend) -> bytes | None:
    """The manifest as the medium holds it (read through the backend's own hook, which stores
    nothing when its ``decide`` raises)."""
    seen: list[bytes | None] = []

    def peek(stored: bytes | None) -> bytes:
        seen.append(stored)
        raise _Peeked

    with pytest.raises(_Peeked):
        backend._m_update_manifest(peek)
    return seen[0]


@pytest.mark.parametrize("backend_kind", ROTATION_KINDS, indirect=True)
def test_a_writer_without_a_key_is_refused_at_open_on_a_keyed_tier(
        harness: BackendHarness) -> None:
    """Before: it opened, and it and the keyed writers removed each other's blocks."""
    from kvtier.backends import OpenMode, UnkeyedWriterError

    harness.open(auth_key=OWNER_KEY)
    with pytest.raises(UnkeyedWriterError, match=r"manifest .* says its frames are keyed, but "
                       r"this writer has no auth_key") as caught:
        harness.open()
    assert OWNER_KEY not in str(caught.value)
    assert isinstance(caught.value, ConfigError)
    harness.open(mode=OpenMode.READ_ONLY)  # looking only is fine
    harness.open(auth_key=OTHER_KEY)  # keyed writers are never refused at open


@pytest.mark.parametrize("backend_kind", ROTATION_KINDS, indirect=True)
def test_a_keyed_writer_turns_an_unkeyed_tier_keyed_and_old_manifests_still_read(
        harness: BackendHarness) -> None:
    from kvtier.backends import UnkeyedWriterError
    from kvtier.backends.manifest import (
        TierAuth,
        manifest_auth,
        manifest_document,
        parse_manifest,
    )

    digest = harness.namespace.digest_hex
    first = harness.open()
    first.write_manifest(manifest_document(harness.namespace))  # as an older kvtier wrote it
    assert manifest_auth(_stored_manifest(first), digest) is None
    assert parse_manifest(_stored_manifest(first), digest) is not None
    harness.open()  # an old manifest says nothing about keys: an unkeyed writer opens
    assert manifest_auth(_stored_manifest(first), digest) is TierAuth.UNKEYED
    harness.open(auth_key=OWNER_KEY)
    assert manifest_auth(_stored_manifest(first), digest) is TierAuth.KEYED
    assert parse_manifest(_stored_manifest(first), digest) is not None  # usage still reads it
    with pytest.raises(UnkeyedWriterError):
        harness.open()


@pytest.mark.parametrize("ending", ["\n", "\r\n"])
@pytest.mark.parametrize("shape", ["plain", "no-final-newline", "blank-lines"])
def test_a_key_file_holds_one_key_per_line_and_the_first_signs(
        tmp_path: Path, ending: str, shape: str) -> None:
    """Before: the whole file (one line ending removed) was one key."""
    lines = [NEW_KEY, OLD_KEY]
    text = ending.join(lines) + ending
    if shape == "no-final-newline":
        text = text.removesuffix(ending)
    elif shape == "blank-lines":
        text = ending + NEW_KEY + ending + ending + "   " + ending + OLD_KEY + ending + ending
    path = tmp_path / "ring.key"
    path.write_bytes(text.encode())
    os.chmod(path, 0o600)
    namespace = Namespace(model=f"key-lines-{shape}")
    rotated = open_backend(f"file://{tmp_path}/tier", namespace, auth_key_file=str(path))
    old_only = open_backend(f"file://{tmp_path}/tier", namespace, auth_key=OLD_KEY)
    new_only = open_backend(f"file://{tmp_path}/tier", namespace, auth_key=NEW_KEY)
    [key] = keys_for(1, f"lines-{shape}-{len(ending)}")
    assert rotated.put_many([key], [b"r" * 64]) == [True]
    assert _get(new_only, [key], 64) == ([True], [b"r" * 64])  # signed by the first line
    assert _get(old_only, [key], 64)[0] == [False]  # a reader without the first key refuses
    [other] = keys_for(1, f"lines-old-{shape}-{len(ending)}")
    assert old_only.put_many([other], [b"o" * 64]) == [True]
    assert _get(rotated, [other], 64) == ([True], [b"o" * 64])  # the second line verifies
    assert rotated.stats()["auth_old_key"] == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "holds no key"),
        (b"\n\r\n  \n", "holds no key"),
        (f"{OWNER_KEY}\nshort\n".encode(), r"line 2 is 5 bytes; expected at least 16"),
        (f"{OWNER_KEY}\n{OTHER_KEY}\n{OWNER_KEY}\r\n".encode(), r"line 3 repeats .*line 1"),
    ],
)
def test_a_bad_key_file_names_the_line_never_the_key(
        tmp_path: Path, content: bytes, message: str) -> None:
    path = _key_file(tmp_path, content)
    with pytest.raises(ConfigError, match=message) as caught:
        open_backend("memory://", Namespace(model="m"), auth_key_file=str(path))
    assert OWNER_KEY not in str(caught.value) and OTHER_KEY not in str(caught.value)
    assert "short" not in str(caught.value)


def test_auth_key_as_a_list_in_a_config_rotates_like_a_key_file(tmp_path: Path) -> None:
    """A YAML / dict config takes ``auth_key`` as a list (the first signs); the environment's
    KVTIER_SECONDARY_TIERS takes the same list in its JSON form."""
    from kvtier.config import KvtierConfig, load_config

    yaml_path = tmp_path / "kvtier.yaml"
    yaml_path.write_text(
        "block_bytes: 64\nprimary_bytes: 256\nnamespace: {model: rotate}\nsecondary_tiers:\n"
        f"  - url: file://{tmp_path}/tier\n    auth_key:\n      - {NEW_KEY}\n      - {OLD_KEY}\n")
    from_yaml = KvtierConfig.from_yaml(yaml_path)
    environ = {"KVTIER_BLOCK_BYTES": "64", "KVTIER_PRIMARY_BYTES": "256",
               "KVTIER_NAMESPACE_MODEL": "rotate",
               "KVTIER_SECONDARY_TIERS": json.dumps(
                   [{"url": f"file://{tmp_path}/tier", "auth_key": [NEW_KEY, OLD_KEY]}])}
    from_env = KvtierConfig.from_env(environ)
    for config in (from_yaml, from_env, load_config(from_yaml.to_dict())):
        [tier] = config.secondary_tiers
        assert NEW_KEY not in repr(config) and OLD_KEY not in repr(config)
        backend = open_backend(tier.url, config.namespace, **dict(tier.options))
        assert backend.authenticated
        [key] = keys_for(1, "yaml-list")
        assert backend.put_many([key], [b"y" * 64]) == [True]
        new_only = open_backend(tier.url, config.namespace, auth_key=NEW_KEY)
        assert _get(new_only, [key], 64) == ([True], [b"y" * 64])
        backend.close()
        new_only.close()
    with pytest.raises(ConfigError, match=r"auth_key\[1\]: expected a string"):
        load_config({"block_bytes": 64, "primary_bytes": 256, "namespace": {"model": "m"},
                     "secondary_tiers": [{"url": "memory://", "auth_key": [NEW_KEY, 5]}]})
    with pytest.raises(ConfigError, match="non-empty list"):
        load_config({"block_bytes": 64, "primary_bytes": 256, "namespace": {"model": "m"},
                     "secondary_tiers": [{"url": "memory://", "auth_key": []}]})
