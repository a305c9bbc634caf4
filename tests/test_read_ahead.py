"""server.read_ahead: an order's samples on this machine's disk asked into the page cache as the
order arrives, so that a cold epoch's reads overlap the decode of earlier chunks (their effect on
a cold epoch's speed: docs/performance.md). Residency is read with mincore(2)."""

from __future__ import annotations

import ctypes
import mmap
import os
import time

import numpy as np
import pytest

from remoteloader.server.catalog import Catalog, KeyTable, Location, Shard
from remoteloader.server.fetching import Fetcher
from remoteloader.server.order_samples import Samples
from remoteloader.server.pipelines import PipelineSpec
from remoteloader.server.read_ahead import ReadAhead, available
from remoteloader.tools.page_cache import evict

pytestmark = pytest.mark.skipif(not available(), reason="no posix_fadvise on this system")

PAGE = mmap.PAGESIZE


def resident(path, offset: int, length: int) -> float:
    """The share of ``path``'s pages in [offset, offset + length) that are in the page cache."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = offset // PAGE * PAGE
    size = offset + length - start
    pages = (size + PAGE - 1) // PAGE
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            flags = ctypes.create_string_buffer(pages)
            assert libc.mincore(address, size, flags) == 0, os.strerror(ctypes.get_errno())
            return sum(b & 1 for b in flags.raw) / pages
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


def evicted(path) -> bool:
    """Drops the file's pages from the page cache; whether that worked (not on tmpfs, say)."""
    evict([path])
    return resident(path, 0, os.path.getsize(path)) < 0.05


def becomes_resident(path, offset: int, length: int, timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    share = resident(path, offset, length)
    while share < 0.95 and time.monotonic() < deadline:
        time.sleep(0.01)
        share = resident(path, offset, length)
    return share


class _Ranges(Shard):
    """A file of fixed-size samples, one after another (as a tar's members are)."""

    def __init__(self, path: str, count: int, size: int):
        table = KeyTable()
        for i in range(count):
            table.add(f"{i:04d}.jpg", 0, i * size, size)
        self.path = path
        super().__init__("ranges", table, ["a"], "ranges-" + os.path.basename(path))


def test_an_orders_samples_are_read_into_the_page_cache_when_it_arrives_and_only_they(tmp_path):
    size, count = 256 * 1024, 32
    path = tmp_path / "shard.tar"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, size * count, dtype=np.uint8).tobytes())
    if not evicted(path):
        pytest.skip(f"{tmp_path}'s file system keeps files in memory (tmpfs?): nothing to read ahead")
    catalog = Catalog([_Ranges(str(path), count, size)])
    read_ahead = ReadAhead()
    try:
        order = Samples.of_shard(catalog, catalog.shards[0], np.array([3, 17, 4]))
        Fetcher(catalog, None, read_ahead).prefetch(PipelineSpec("train", 32, 32), order)
        for index in (3, 17, 4):
            assert becomes_resident(path, index * size, size) >= 0.95, f"sample {index} was not read ahead"
        assert resident(path, 10 * size, 5 * size) < 0.5, "samples the order does not name were read too"
        gone = Location(str(tmp_path / "gone.jpg"), 0, 100)  # a file deleted since indexing: passed over
        read_ahead.ask([gone, Location(str(path), 30 * size, size)]).result(timeout=20)
        assert becomes_resident(path, 30 * size, size) >= 0.95
        held = len(os.listdir("/proc/self/fd"))
    finally:
        read_ahead.close()
    assert len(os.listdir("/proc/self/fd")) == held - 1, "the shard's file was left open"
