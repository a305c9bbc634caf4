"""The protobuf wire format, read by hand where a format stores protobuf messages (a TFRecord's
``tf.train.Example``, an LMDB's Caffe ``Datum``) and a server needs where a field's bytes lie
in the file, not a copy of them: so that decode workers read an image's bytes by offset.

No code runs here but reading: lengths are checked against the buffer, and a malformed message
raises ``WireError``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5


class WireError(ValueError):
    """Bytes that are not a well-formed protobuf message."""


def varint(buf: bytes | memoryview, at: int) -> tuple[int, int]:
    """(value, position after it) of the varint at ``at``."""
    value = shift = 0
    while True:
        if at >= len(buf):
            raise WireError("a varint runs past the end of the message")
        byte = buf[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise WireError("a varint longer than 10 bytes")


def fields(buf: bytes | memoryview, start: int = 0, end: int | None = None) -> Iterator[tuple[int, int, int, int]]:
    """The fields of the message in ``buf[start:end]``: (number, wire type, a, b), where for a
    varint ``a`` is its value, and otherwise ``buf[a:b]`` holds the field's bytes."""
    end = len(buf) if end is None else end
    at = start
    while at < end:
        key, at = varint(buf, at)
        number, kind = key >> 3, key & 7
        if kind == VARINT:
            value, at = varint(buf, at)
            yield number, kind, value, 0
            continue
        if kind == LENGTH:
            size, at = varint(buf, at)
            first, at = at, at + size
        elif kind == FIXED64:
            first, at = at, at + 8
        elif kind == FIXED32:
            first, at = at, at + 4
        else:
            raise WireError(f"wire type {kind} (field {number}) is not one a message holds")
        if at > end:
            raise WireError(f"field {number} runs past the end of its message")
        yield number, kind, first, at


def packed_varints(buf: bytes | memoryview, start: int, end: int) -> list[int]:
    """The varints of a packed repeated field ``buf[start:end]``."""
    out = []
    at = start
    while at < end:
        value, at = varint(buf, at)
        out.append(value)
    if at != end:
        raise WireError("a packed field's varints run past its end")
    return out


def packed_floats(buf: bytes | memoryview, start: int, end: int) -> list[float]:
    """The little-endian floats of a packed repeated field ``buf[start:end]``."""
    if (end - start) % 4:
        raise WireError("a packed float field's length is not a multiple of 4")
    return list(struct.unpack_from(f"<{(end - start) // 4}f", buf, start))


def signed(value: int, bits: int = 64) -> int:
    """An int64/int32 varint's value (two's complement)."""
    return value - (1 << 64) if value >= 1 << (bits - 1) else value
