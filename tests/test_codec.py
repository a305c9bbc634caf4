"""The hand-framed Chunk codec agrees with protobuf's own Chunk, byte for byte and both ways."""

from __future__ import annotations

import random

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from remoteloader.protos import loader_pb2
from remoteloader.protos.codec import decode_chunk, encode_chunk


def make_header(count: int = 3, errors: int = 1, order_id: int = 123456789012) -> loader_pb2.ChunkHeader:
    return loader_pb2.ChunkHeader(
        order_id=order_id, start=5, count=count, order_size=count + 5, height=7, width=9, channels=3,
        labels=[(-1 if i % 4 == 3 else i * 37) for i in range(count)],
        errors=[loader_pb2.SampleError(position=5 + i, index=1000 + i, key=f"cat/bad_{i}.jpg",
                                       reason="corrupt JPEG: premature end of data")
                for i in range(errors)])


def pixel_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def reference(header, pixels: bytes) -> bytes:
    return loader_pb2.Chunk(header=header, pixels=pixels).SerializeToString()


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, wire_type: int, payload: bytes) -> bytes:
    return varint(number << 3 | wire_type) + payload


def length_delimited(number: int, payload: bytes) -> bytes:
    return field(number, 2, varint(len(payload)) + payload)


def assert_same_chunk(data: bytes) -> None:
    """decode_chunk and protobuf read the same header and pixels from ``data``."""
    decoded = decode_chunk(data)
    parsed = loader_pb2.Chunk.FromString(data)
    assert decoded.header == parsed.header
    assert bytes(decoded.pixels) == parsed.pixels


# ---- round trips --------------------------------------------------------------------------
def test_encode_matches_protobuf_serialization_and_parses_back():
    header, pixels = make_header(), pixel_bytes(3 * 7 * 9 * 3)
    data = encode_chunk(header, pixels)
    assert data == reference(header, pixels)  # the documented layout: header first, then pixels
    parsed = loader_pb2.Chunk.FromString(data)
    assert parsed.header == header
    assert parsed.pixels == pixels


def test_decode_reads_what_protobuf_serializes():
    header, pixels = make_header(count=4, errors=2), pixel_bytes(4 * 7 * 9 * 3, seed=1)
    data = reference(header, pixels)
    decoded = decode_chunk(data)
    assert decoded.header == header
    assert isinstance(decoded.pixels, memoryview)
    assert bytes(decoded.pixels) == pixels
    again = decode_chunk(encode_chunk(decoded.header, decoded.pixels))
    assert again.header == header and bytes(again.pixels) == pixels


def test_decoded_pixels_are_a_view_into_the_message():
    header, pixels = make_header(), pixel_bytes(4096)
    data = encode_chunk(header, pixels)
    view = decode_chunk(data).pixels
    assert view.readonly
    assert view.obj is data, "decode_chunk copied the pixels"
    assert np.shares_memory(np.frombuffer(view, np.uint8), np.frombuffer(data, np.uint8))


def test_encode_accepts_numpy_and_memoryview_pixels():
    header = make_header(count=2)
    image = np.random.default_rng(2).integers(0, 256, (2, 7, 9, 3), dtype=np.uint8)
    expected = reference(header, image.tobytes())
    assert encode_chunk(header, image) == expected
    assert encode_chunk(header, memoryview(image.tobytes())) == expected
    assert encode_chunk(header, bytearray(image.tobytes())) == expected


@pytest.mark.parametrize("size", [1, 127, 128, 300, 16383, 16384, 2**21 - 1, 2**21, 6 * 2**20 + 11])
def test_pixel_payload_sizes_across_varint_lengths(size):
    header = make_header(count=1)
    pixels = pixel_bytes(size, seed=size)
    data = encode_chunk(header, pixels)
    expected_prefix_len = len(varint(size))
    assert data == reference(header, pixels)
    assert len(data) == 1 + len(varint(header.ByteSize())) + header.ByteSize() + 1 + expected_prefix_len + size
    decoded = decode_chunk(data)
    assert decoded.header == header
    assert decoded.pixels.nbytes == size
    assert decoded.pixels == memoryview(pixels)


def test_large_header_with_multibyte_length():
    header = make_header(count=500, errors=40)  # a header of several KB: 2-byte length varint
    assert header.ByteSize() > 2**7
    pixels = pixel_bytes(500 * 7 * 9 * 3, seed=3)
    data = encode_chunk(header, pixels)
    assert data == reference(header, pixels)
    assert decode_chunk(data).header == header


def test_empty_header_and_empty_pixels():
    header = loader_pb2.ChunkHeader()
    data = encode_chunk(header, b"")
    parsed = loader_pb2.Chunk.FromString(data)
    assert parsed.header == header and parsed.pixels == b""
    decoded = decode_chunk(data)
    assert decoded.header == header and decoded.pixels.nbytes == 0
    assert decode_chunk(b"").pixels.nbytes == 0  # the empty message is a valid, empty Chunk


# ---- what other protobuf writers may send -------------------------------------------------
def test_unknown_fields_of_every_wire_type_are_skipped():
    header, pixels = make_header(), pixel_bytes(3 * 7 * 9 * 3, seed=4)
    head = header.SerializeToString()
    unknown = [
        field(3, 0, varint(2**63 + 5)),  # varint (10 bytes)
        field(4, 1, (1234).to_bytes(8, "little")),  # fixed64
        length_delimited(5, b"some other message" * 20),  # length-delimited, 2-byte length
        field(6, 5, (99).to_bytes(4, "little")),  # fixed32
        field(2000, 0, varint(1)),  # a field number with a 2-byte tag
        length_delimited(19, b""),
    ]
    data = (unknown[0] + length_delimited(1, head) + unknown[1] + unknown[2]
            + length_delimited(2, pixels) + unknown[3] + unknown[4] + unknown[5])
    assert_same_chunk(data)
    decoded = decode_chunk(data)
    assert decoded.header == header and bytes(decoded.pixels) == pixels


def test_fields_in_any_order_and_repeated_like_protobuf():
    header, pixels = make_header(), pixel_bytes(567, seed=5)
    head = header.SerializeToString()
    # pixels before the header
    swapped = length_delimited(2, pixels) + length_delimited(1, head)
    assert_same_chunk(swapped)
    assert decode_chunk(swapped).header == header
    # a repeated bytes field: the last one wins
    twice = length_delimited(1, head) + length_delimited(2, b"stale") + length_delimited(2, pixels)
    assert_same_chunk(twice)
    assert bytes(decode_chunk(twice).pixels) == pixels
    # a repeated message field: the parts merge
    first = loader_pb2.ChunkHeader(order_id=9, labels=[1, 2]).SerializeToString()
    second = loader_pb2.ChunkHeader(count=2, labels=[3]).SerializeToString()
    split = length_delimited(1, first) + length_delimited(2, pixels) + length_delimited(1, second)
    assert_same_chunk(split)
    merged = decode_chunk(split).header
    assert merged.order_id == 9 and merged.count == 2 and list(merged.labels) == [1, 2, 3]


def test_random_messages_agree_with_protobuf():
    rng = random.Random(1234)
    for _ in range(200):
        header = make_header(count=rng.randrange(0, 40), errors=rng.randrange(0, 4),
                             order_id=rng.randrange(0, 2**64))
        pixels = rng.randbytes(rng.choice([0, 1, rng.randrange(0, 300), rng.randrange(0, 70000)]))
        parts = [length_delimited(1, header.SerializeToString()), length_delimited(2, pixels)]
        for _ in range(rng.randrange(0, 4)):
            number = rng.choice([3, 4, 7, 15, 16, 300])
            kind = rng.choice([0, 1, 2, 5])
            payload = {0: varint(rng.randrange(0, 2**64)), 1: rng.randbytes(8), 5: rng.randbytes(4),
                       2: varint(n := rng.randrange(0, 200)) + rng.randbytes(n)}[kind]
            parts.insert(rng.randrange(0, len(parts) + 1), field(number, kind, payload))
        assert_same_chunk(b"".join(parts))
        if pixels:
            assert encode_chunk(header, pixels) == reference(header, pixels)


# ---- malformed input ------------------------------------------------------------------------
def test_every_truncation_inside_a_field_raises_value_error():
    header, pixels = make_header(count=2, errors=1), pixel_bytes(300, seed=6)
    data = encode_chunk(header, pixels)
    head_len = header.ByteSize()
    boundaries = {0, 1 + len(varint(head_len)) + head_len, len(data)}  # cuts there leave whole fields
    for cut in range(len(data)):
        if cut in boundaries:
            continue
        prefix = data[:cut]
        with pytest.raises(ValueError):
            decode_chunk(prefix)
        with pytest.raises(DecodeError):  # protobuf agrees the prefix is not a message
            loader_pb2.Chunk.FromString(prefix)


def test_truncated_large_message_raises_value_error():
    header, pixels = make_header(), pixel_bytes(5 * 2**20, seed=7)
    data = encode_chunk(header, pixels)
    for cut in (len(data) - 1, len(data) - 2**20, len(data) - len(pixels) - 1):
        with pytest.raises(ValueError):
            decode_chunk(data[:cut])


@pytest.mark.parametrize("data", [
    b"\x0a",  # a tag and nothing else
    b"\x0a\x80",  # an unfinished length varint
    b"\x12\xff\xff\xff\xff\x0f" + b"x" * 10,  # a length far past the end
    b"\x80",  # an unfinished tag varint
    b"\x12" + b"\xff" * 11 + b"\x01",  # an overlong varint
    b"\x08" + b"\xff" * 10,  # an unknown varint field that never ends
    b"\x19" + b"\x00" * 7,  # an unknown fixed64 field cut short
    b"\x1d" + b"\x00" * 3,  # an unknown fixed32 field cut short
    b"\x0e",  # wire type 6 does not exist
], ids=["tag-only", "open-length", "length-past-end", "open-tag", "overlong", "open-unknown-varint",
        "short-fixed64", "short-fixed32", "bad-wire-type"])
def test_malformed_messages_raise_value_error(data):
    with pytest.raises(ValueError):
        decode_chunk(data)


def test_a_corrupt_header_raises():
    bad_header = length_delimited(1, b"\x0a\x05ab")  # the header's own field runs past its end
    with pytest.raises((ValueError, DecodeError)):
        decode_chunk(bad_header + length_delimited(2, b"xyz"))
