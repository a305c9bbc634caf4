"""Hand framing of ``Chunk`` messages, so pixels never pass through a protobuf object.

A ``Chunk`` is ``field 1: ChunkHeader`` followed by ``field 2: bytes pixels``. Encoding
writes both length-delimited fields by hand around the raw pixel buffer; decoding parses
the small header with protobuf and returns the pixels as a zero-copy ``memoryview`` into
the received message. The bytes on the wire are an ordinary, valid ``Chunk``.
"""

from __future__ import annotations

from typing import NamedTuple

from remoteloader.protos import loader_pb2

_HEADER_TAG = 0x0A  # field 1, wire type 2 (length-delimited)
_PIXELS_TAG = 0x12  # field 2, wire type 2


class DecodedChunk(NamedTuple):
    header: loader_pb2.ChunkHeader
    pixels: memoryview  # read-only view into the received message


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("malformed Chunk: truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _skip(buf: memoryview, pos: int, field: int, wire_type: int) -> int:
    """Skips the value of an unknown field (groups included); returns the position after it."""
    if wire_type == 0:
        _, pos = _read_varint(buf, pos)
    elif wire_type == 1:
        pos += 8
    elif wire_type == 5:
        pos += 4
    elif wire_type == 2:
        length, pos = _read_varint(buf, pos)
        pos += length
    elif wire_type == 3:  # a group: fields up to the matching end-group key
        while True:
            key, pos = _read_varint(buf, pos)
            if key & 7 == 4:
                if key >> 3 != field:
                    raise ValueError("malformed Chunk: mismatched end of group")
                break
            pos = _skip(buf, pos, key >> 3, key & 7)
    else:
        raise ValueError(f"malformed Chunk: unsupported wire type {wire_type}")
    if pos > len(buf):
        raise ValueError("malformed Chunk: truncated field")
    return pos


def encode_chunk(header: loader_pb2.ChunkHeader, pixels) -> bytes:
    """Serializes a Chunk from its header and a buffer of pixels, or a list of buffers that
    together are its pixels field (each sample's encoded part): one copy of the pixels."""
    head = header.SerializeToString()
    views = [memoryview(p).cast("B") for p in pixels] if isinstance(pixels, list) else [memoryview(pixels).cast("B")]
    nbytes = sum(v.nbytes for v in views)
    return b"".join((bytes((_HEADER_TAG,)), _varint(len(head)), head, bytes((_PIXELS_TAG,)), _varint(nbytes), *views))


def decode_chunk(data: bytes) -> DecodedChunk:
    """Parses a Chunk as sent by any protobuf implementation, without copying the pixels.

    Fields may come in any order, repeat (the last wins, as in protobuf) or be unknown
    (skipped), so messages written by other-language servers decode too.
    """
    buf = memoryview(data)
    header = loader_pb2.ChunkHeader()
    pixels = memoryview(b"")
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 2 and field in (1, 2):
            length, pos = _read_varint(buf, pos)
            end = pos + length
            if end > len(buf):
                raise ValueError("malformed Chunk: field runs past the end of the message")
            if field == 1:
                try:
                    header.MergeFromString(buf[pos:end])
                except Exception as exc:  # protobuf's DecodeError: a malformed header
                    raise ValueError(f"malformed Chunk: bad header: {exc}") from None
            else:
                pixels = buf[pos:end]
            pos = end
        else:
            pos = _skip(buf, pos, field, wire_type)
    if pos != len(buf):
        raise ValueError("malformed Chunk: truncated field")
    return DecodedChunk(header, pixels)
