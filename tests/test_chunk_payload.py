"""server.chunk_payload, the one place that lays out a rendered chunk on the wire: raw slot
bytes, or each sample's encoded bytes by the slot's size table (failed: none; never rendered:
raw), as views into the slot."""

from __future__ import annotations

import numpy as np
import pytest

from remoteloader.protos import limits
from remoteloader.protos.wire import RAW, ZSTD
from remoteloader.server.catalog import Catalog, KeyTable, Shard, SyntheticShard
from remoteloader.server.chunk_payload import chunk_payload
from remoteloader.server.order_samples import Samples
from remoteloader.server.pipelines import PipelineSpec
from remoteloader.server.shared_memory import Arena

SIZE = 8
IMAGE = limits.sample_bytes(SIZE, SIZE)


def _catalog() -> Catalog:
    table = KeyTable()
    for i in range(4):
        table.add(f"s{i}", 0, i * 100, 100)
    return Catalog([Shard("real", table, ["a"], "real-id"), SyntheticShard(4)])


@pytest.fixture
def arena():
    arena = Arena(2, limits.MAX_CHUNK_SAMPLES * IMAGE * 2)
    yield arena
    arena.close()


def _write_sizes(arena: Arena, slot: int, sizes: list[int]) -> None:
    table = np.frombuffer(
        arena.view(slot, arena.slot_bytes), "<u4", 2 * limits.MAX_CHUNK_SAMPLES, limits.pixel_bytes(arena.slot_bytes)
    )
    table[: len(sizes)] = sizes


def test_raw_is_the_slots_pixels_as_they_lie_with_no_size_table(arena):
    catalog = _catalog()
    samples = Samples.of_shard(catalog, catalog.shards[0], np.arange(3))
    arena.view(1, 3 * IMAGE)[:] = bytes(range(256)) * (3 * IMAGE // 256) + bytes(3 * IMAGE % 256)
    pixels, sizes = chunk_payload(PipelineSpec("eval", SIZE, SIZE, wire=RAW), samples, arena, 1, 3, [])
    assert sizes == [] and bytes(pixels) == bytes(arena.view(1, 3 * IMAGE))


def test_encoded_pieces_follow_the_size_table_a_failed_sample_sends_nothing(arena):
    catalog = _catalog()
    samples = Samples.of_shard(catalog, catalog.shards[0], np.arange(3))
    view = arena.view(0, 3 * IMAGE)
    for i in range(3):
        view[i * IMAGE : (i + 1) * IMAGE] = bytes([i + 1]) * IMAGE
    _write_sizes(arena, 0, [5, 7, 9])
    spec = PipelineSpec("eval", SIZE, SIZE, wire=ZSTD)
    pieces, sizes = chunk_payload(spec, samples, arena, 0, 3, [(1, "broken")])
    assert sizes == [5, 0, 9]
    assert [bytes(p) for p in pieces] == [b"\x01" * 5, b"", b"\x03" * 9]
    _write_sizes(arena, 0, [IMAGE + 1, 7, 9])  # (a worker bug)
    with pytest.raises(AssertionError, match="over its raw size"):
        chunk_payload(spec, samples, arena, 0, 3, [])


def test_samples_never_rendered_travel_raw(arena):
    catalog = _catalog()
    spec = PipelineSpec("eval", SIZE, SIZE, wire=ZSTD)
    synthetic = Samples.of_shard(catalog, catalog.shards[1], np.arange(2))
    pieces, sizes = chunk_payload(spec, synthetic, arena, 0, 2, [])
    assert sizes == [IMAGE, IMAGE] and [len(p) for p in pieces] == [IMAGE, IMAGE]
    mixed = Samples(catalog, np.array([0, 1]), np.array([0, 0]))  # a real sample, then a synthetic one
    _write_sizes(arena, 0, [11, 0])
    pieces, sizes = chunk_payload(spec, mixed, arena, 0, 2, [])
    assert sizes == [11, IMAGE]
