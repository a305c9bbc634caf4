"""Shared memory the server and its worker processes both map: the chunk arena and the sample cache.

Each is a file unlinked at birth and passed to workers by descriptor, so nothing is left
in /dev/shm even after SIGKILL. The ``Arena`` holds decoded chunks, one per slot of
``slot_bytes`` (protos.limits.slot_bytes): a worker writes a sample's pixels straight into
its place, and the service sends them from there, never copying or pickling them. The
``SampleCache`` holds encoded samples after their first read, filled until full and never
evicted. Only the event loop's thread allocates in either; workers write where they are told.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import tempfile
from multiprocessing import reduction

import numpy as np


class SharedFile:
    """Shared memory that worker processes map: a file unlinked at birth, passed by descriptor.

    Nothing is left in /dev/shm even when the server is killed with SIGKILL: the memory
    lives exactly as long as the last process holding the descriptor or a mapping.
    """

    def __init__(self, size: int, prefix: str):
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.fd, path = tempfile.mkstemp(prefix=prefix, dir=directory)
        os.unlink(path)
        self.size = size
        try:  # reserve the memory now: a full /dev/shm fails here, not as SIGBUS in a worker
            os.posix_fallocate(self.fd, 0, size)
        except OSError as exc:
            os.close(self.fd)
            raise OSError(
                f"cannot reserve {size / 2**20:.0f} MiB of shared memory in {directory or 'the temp dir'}: "
                f"{exc} (slots x max(--chunk-bytes, --shared-chunk-bytes, --max-image-size^2 x 3), plus "
                f"--cache-bytes; lower those, or give a container more shm_size)"
            ) from None
        except AttributeError:  # not on this platform
            os.ftruncate(self.fd, size)
        self._mmap = mmap.mmap(self.fd, size)
        self.buffer = memoryview(self._mmap)

    def for_child(self) -> InheritedFd:
        return InheritedFd(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class InheritedFd:
    """Pickles as a duplicate of the descriptor for the process being started (SCM_RIGHTS)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


class Arena(SharedFile):
    """Shared memory cut into ``count`` slots of ``slot_bytes`` for decoded chunks, then (8-byte
    aligned, in the same file) a little-endian uint64 generation word per slot.

    A slot's generation changes each time it is given back (``release``), before anything may
    write into it again: a same-host client that maps the file (server.local_socket) and reads
    a slot's generation unchanged after copying out of it knows its copy is whole. Workers map
    only the slots (the first ``count * slot_bytes`` bytes); ``size`` is the whole file.
    """

    def __init__(self, count: int, slot_bytes: int):
        self.count = count
        self.slot_bytes = slot_bytes
        self._generations_at = -(-count * slot_bytes // 8) * 8
        super().__init__(self._generations_at + 8 * count, "remoteloader-slots-")
        self._generations = np.frombuffer(self.buffer, "<u8", count, self._generations_at)
        self._free: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(count):
            self._free.put_nowait(slot)

    @property
    def slots_size(self) -> int:
        """Bytes of the slots, at the start of the file (what the workers map)."""
        return self.count * self.slot_bytes

    @property
    def free(self) -> int:
        """Slots free now."""
        return self._free.qsize()

    async def acquire(self) -> int:
        return await self._free.get()

    def release(self, slot: int) -> None:
        """Gives a slot back, its generation changed first (one aligned 8-byte store)."""
        self._generations[slot : slot + 1] += 1  # (wraps after 2**64 uses)
        self._free.put_nowait(slot)

    def view(self, slot: int, nbytes: int) -> memoryview:
        start = slot * self.slot_bytes
        return self.buffer[start : start + nbytes]

    def offset(self, slot: int) -> int:
        """Byte offset of a slot in the file."""
        return slot * self.slot_bytes

    def generation(self, slot: int) -> int:
        return int(self._generations[slot])

    def generation_offset(self, slot: int) -> int:
        """Byte offset of a slot's generation word in the file."""
        return self._generations_at + 8 * slot


_RESERVED = -3  # cache index values <= this: reserved at offset (_RESERVED - value), not filled
# How a worker reads a sample (SampleCache.plan): from its file, from its file then into the
# cache, or from the cache.
PLAIN_READ, CACHE_FILL, CACHE_READ = 0, 1, 2


class SampleCache(SharedFile):
    """Encoded samples kept in shared memory after their first read; filled, never evicted.

    One int64 per sample (by server-wide id, ``catalog.Catalog``) says where its bytes are (-1:
    not cached, -2: being filled), so the index costs 8 bytes per sample whatever the cache holds.
    """

    NONE, FILLING = -1, -2

    def __init__(self, capacity: int, samples: int):
        super().__init__(capacity, "remoteloader-cache-")
        self.used = 0
        self._where = np.full(samples, self.NONE, dtype=np.int64)

    def plan(self, sample: int, length: int) -> tuple[int, int]:
        """(mode, offset) for a read: CACHE_READ from offset, CACHE_FILL at offset, or PLAIN_READ."""
        where = self._where
        state = int(where[sample])
        if state >= 0:
            return CACHE_READ, state
        if state <= _RESERVED:  # space kept from a fill that failed: try again there
            where[sample] = self.FILLING
            return CACHE_FILL, _RESERVED - state
        if state == self.NONE and 0 < length <= self.size - self.used:
            where[sample] = self.FILLING
            offset = self.used
            self.used += length
            return CACHE_FILL, offset
        return PLAIN_READ, 0

    def filled(self, sample: int, offset: int, ok: bool) -> None:
        """Ends a CACHE_FILL: ``ok`` when the sample read from it rendered without error."""
        # A failed fill keeps its space for the next try, so failures never use up the cache.
        self._where[sample] = offset if ok else _RESERVED - offset
