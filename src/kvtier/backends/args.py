"""Argument checks of the backend API: keys, payloads and output buffers, validated before any
I/O (``TypeError`` / ``ValueError``).

This module owns no state.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from kvtier.codec import Buffer, as_byte_view
from kvtier.keys import MAX_KEY_BYTES, BlockKey, check_key


def _is_flat_sequence(value: object) -> bool:
    if type(value) is list or type(value) is tuple:  # the common case, without an ABC check
        return True
    return isinstance(value, Sequence) and not isinstance(
        value, (bytes, bytearray, memoryview, str)
    )


def _all_keys(keys: Sequence[object]) -> bool:
    """Whether every item is a valid block key (the fast path of :func:`check_keys`), checked
    for the whole batch at C speed (types first: ``len`` of a non-bytes item is not asked)."""
    if set(map(type, keys)) != {bytes}:
        return False
    lengths = list(map(len, keys))  # type: ignore[arg-type]  # every item is bytes
    return min(lengths) > 0 and max(lengths) <= MAX_KEY_BYTES


def check_keys(keys: Sequence[BlockKey], argument: str = "keys") -> list[BlockKey]:
    """``keys`` as a list, raising naming the first key that is not 1..255 bytes."""
    if not _is_flat_sequence(keys):
        raise TypeError(
            f"{argument} must be a sequence of BlockKey (bytes), got {type(keys).__name__}"
        )
    if _all_keys(keys):
        return list(keys)
    return [check_key(key, f"{argument}[{index}]") for index, key in enumerate(keys)]


def _check_same_length(name: str, values: Sequence[object], keys: list[BlockKey]) -> None:
    if len(values) != len(keys):
        raise ValueError(
            f"len({name}) must equal len(keys): got {len(values)} {name} for {len(keys)} keys"
        )


_FLAT_SHAPE = operator.attrgetter("format", "ndim", "c_contiguous")
_FLAT = {("B", 1, True)}  # what _FLAT_SHAPE answers for a flat byte view


def check_put_args(
    keys: Sequence[BlockKey], payloads: Sequence[Buffer]
) -> tuple[list[BlockKey], list[memoryview]]:
    """Validated keys and flat byte views of the payloads (no copy)."""
    key_list = check_keys(keys)
    if not _is_flat_sequence(payloads):
        raise TypeError(f"payloads must be a sequence of buffers, got {type(payloads).__name__}")
    _check_same_length("payloads", payloads, key_list)
    # The common case, checked for the whole batch at C speed: flat byte views.
    if set(map(type, payloads)) == {memoryview} and \
            set(map(_FLAT_SHAPE, payloads)) == _FLAT:
        return key_list, list(payloads)  # type: ignore[arg-type]  # every item is a memoryview
    views = [payload if type(payload) is memoryview and _FLAT_SHAPE(payload) in _FLAT
             else as_byte_view(payload, f"payloads[{index}]")
             for index, payload in enumerate(payloads)]
    return key_list, views


_VIEW_SHAPE = operator.attrgetter("format", "ndim", "c_contiguous", "readonly")
_FLAT_WRITABLE = {("B", 1, True, False)}  # what _VIEW_SHAPE answers for a flat writable view


def check_get_args(
    keys: Sequence[BlockKey], outs: Sequence[memoryview]
) -> tuple[list[BlockKey], list[memoryview]]:
    """Validated keys and flat, writable byte views of the output buffers."""
    key_list = check_keys(keys)
    if not _is_flat_sequence(outs):
        raise TypeError(f"outs must be a sequence of memoryview, got {type(outs).__name__}")
    _check_same_length("outs", outs, key_list)
    # The common case, checked for the whole batch at C speed: flat, writable byte views.
    if set(map(type, outs)) == {memoryview} and set(map(_VIEW_SHAPE, outs)) == _FLAT_WRITABLE:
        return key_list, list(outs)
    views: list[memoryview] = []
    for index, out in enumerate(outs):
        if type(out) is memoryview and out.format == "B" and out.ndim == 1 and \
                out.c_contiguous and not out.readonly:  # the common case, checked at once
            views.append(out)
            continue
        if not isinstance(out, memoryview):
            raise TypeError(f"outs[{index}] must be a memoryview, got {type(out).__name__}")
        view = as_byte_view(out, f"outs[{index}]")
        if view.readonly:
            raise TypeError(f"outs[{index}] must be a writable memoryview")
        views.append(view)
    return key_list, views
