"""Object-store samples on local disk, fetched ahead of the decode workers.

A server reads a sample from an object store in the main process, never in a decode worker:
when an order arrives (the client sends them ahead, up to its credits), ``prefetch`` starts
fetching the byte ranges of its samples; when the order's chunk is rendered, ``fetch``
awaits what is still missing (in steady state nothing), and the workers read the bytes
from local files as they read a local disk.

Each object is mirrored by a sparse file in ``folder/objects``: a fetched range is written at
the object's own offsets, so a sample's ``Location`` keeps its offset and length and only its
path changes (a tar's mask member is read the same way). A mirror knows which ranges it holds
(merged intervals); ranges missing in one object are fetched as few requests, neighbours
less than ``COALESCE`` bytes apart in one, at most ``fetch_concurrency`` requests at a time,
none twice at once. Where the objects fit in the cache (``blocks``: the tars whose sizes are
given), a missing range is fetched with the rest of its ``BLOCK``-aligned block: the other
samples there are read by the same epoch, each byte still comes once, and a request carries
many samples instead of one (less CPU, larger transfers).

The mirrors carry modification time 0: their bytes were checked against the object's ETag
and size as they arrived, so a worker treats them as unchanged since
indexing (and may decode a crop's region only).

Faults become the failure of the samples they touch, with the reason: an object missing,
changed (another ETag, or a whole-object read of another size) or truncated since indexing,
or a store that still fails after the storage's retries. Nothing is retried here.

Memory and disk: the intervals are two int64 per disjoint range held; the mirrors hold at
most ``limit`` bytes on disk, the least recently used objects going first; an object whose
bytes a render still reads is never evicted (the limit is then exceeded until it is done).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import concurrent.futures
import fcntl
import hashlib
import logging
import os
import shutil
from array import array
from dataclasses import dataclass
from typing import Any

from remoteloader.server.catalog import Location
from remoteloader.server.storage import ObjectStorage, StorageError

log = logging.getLogger(__name__)

COALESCE = 64 << 10  # missing ranges of one object closer than this are fetched as one request
MAX_REQUEST = 16 << 20  # but a request stops growing at this many bytes
BLOCK = 1 << 20  # what is fetched around a missing range, where the objects fit in the cache


class _Mirror:
    """One object's fetched ranges, in a sparse file at the object's own offsets."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.starts: array[int] = array("q")
        self.ends: array[int] = array("q")
        self.bytes = 0
        self.pins = 0
        self.inflight: list[tuple[int, int, asyncio.Future]] = []  # requests on their way

    def covers(self, start: int, end: int) -> bool:
        k = bisect.bisect_right(self.starts, start) - 1
        return k >= 0 and self.ends[k] >= end

    def missing(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of [start, end) not held."""
        out = []
        k = max(0, bisect.bisect_right(self.starts, start) - 1)
        at = start
        while at < end and k < len(self.starts):
            if self.ends[k] <= at:
                k += 1
                continue
            if self.starts[k] >= end:
                break
            if self.starts[k] > at:
                out.append((at, self.starts[k]))
            at = max(at, self.ends[k])
            k += 1
        if at < end:
            out.append((at, end))
        return out

    def add(self, start: int, end: int) -> int:
        """Marks [start, end) held; returns the bytes newly held."""
        k = bisect.bisect_left(self.ends, start)  # the first range that ends at or after start
        j, merged = k, 0
        while j < len(self.starts) and self.starts[j] <= end:
            merged += self.ends[j] - self.starts[j]
            start, end = min(start, self.starts[j]), max(end, self.ends[j])
            j += 1
        self.starts[k:j] = array("q", [start])
        self.ends[k:j] = array("q", [end])
        added = end - start - merged
        self.bytes += added
        return added

    def close(self) -> None:
        os.close(self.fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


@dataclass
class CacheStats:
    """What the cache did so far (Prometheus and ``remoteloader bench``-style figures)."""

    requests: int = 0
    fetched_bytes: int = 0
    hits: int = 0  # ranges found held
    failures: int = 0
    evicted_bytes: int = 0


class ObjectCache:
    """Fetched object-store byte ranges on local disk, for the decode workers to read.

    Args:
        folder: Where the mirrors live: ``folder/objects``, or ``objects-1``, ``objects-2``...
            when another server on this machine holds it; emptied at start.
        limit: Bytes of mirrors kept (least recently used objects evicted first).
        storages: The object stores the server's shards are in.
        concurrency: Requests in flight at once.
        blocks: Objects fetched in whole ``BLOCK``s, by location: their sizes (the caller gives
            them where the objects fit in ``limit``).
    """

    def __init__(
        self,
        folder: str,
        limit: int,
        storages: list[ObjectStorage],
        concurrency: int = 64,
        blocks: dict[str, int] | None = None,
    ):
        os.makedirs(folder, exist_ok=True)
        self.folder, self._lock = _claim(folder)
        shutil.rmtree(self.folder, ignore_errors=True)  # ranges of an earlier run are not known to be current
        os.makedirs(self.folder)
        self.limit = limit
        self._storages = {s.url: s for s in storages}
        self._gate = asyncio.Semaphore(concurrency)
        self._mirrors: collections.OrderedDict[str, _Mirror] = collections.OrderedDict()  # LRU first
        self.held = 0  # bytes the mirrors hold
        self._blocks = blocks or {}
        self.stats = CacheStats()
        self._tasks: set[asyncio.Future] = set()
        self._writer = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="object-cache-write")

    # ---- what the renderer calls ------------------------------------------------------
    def prefetch(self, locations: list[Location]) -> None:
        """Starts fetching what of ``locations`` is missing (an order just arrived)."""
        task = asyncio.ensure_future(self._fetch(locations, pin=False))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def fetch(self, locations: list[Location]) -> list[str]:
        """Makes ``locations`` local; returns per location "" or why it could not be fetched.
        Their objects stay pinned (never evicted) until ``release``."""
        return await self._fetch(locations, pin=True)

    def held_locally(self, locations: list[Location]) -> list[Location] | None:
        """Where ``locations`` are on this machine, pinned as ``fetch`` pins them, if every one
        of them is held already (an epoch after the first); else None."""
        mirrors = []
        for loc in locations:
            mirror = self._mirrors.get(loc.path)
            if mirror is None or not mirror.covers(loc.offset, loc.offset + loc.length):
                return None
            mirrors.append(mirror)
        for path in {loc.path for loc in locations}:
            self._mirrors[path].pins += 1
            self._mirrors.move_to_end(path)
        self.stats.hits += len(locations)
        return [Location(m.path, loc.offset, loc.length) for m, loc in zip(mirrors, locations)]

    def local(self, location: Location) -> Location:
        """Where a fetched location's bytes are on this machine."""
        mirror = self._mirrors.get(location.path)
        path = mirror.path if mirror is not None else ""
        return Location(path, location.offset, location.length)

    def release(self, locations: list[Location]) -> None:
        """The workers are done reading ``locations`` (fetched with ``fetch``)."""
        for path in {loc.path for loc in locations}:
            mirror = self._mirrors.get(path)
            if mirror is not None:
                mirror.pins -= 1
        self._evict()

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        self._writer.shutdown(wait=True)
        for mirror in self._mirrors.values():
            mirror.close()
        self._mirrors.clear()
        os.close(self._lock)

    # ---- fetching ---------------------------------------------------------------------
    async def _fetch(self, locations: list[Location], pin: bool) -> list[str]:
        reasons = [""] * len(locations)
        by_object: dict[str, list[int]] = collections.defaultdict(list)
        for i, loc in enumerate(locations):
            by_object[loc.path].append(i)
        jobs = []
        for path, positions in by_object.items():
            mirror = self._mirror(path)
            if pin:
                mirror.pins += 1
            jobs.append(self._fetch_object(path, mirror, [locations[i] for i in positions]))
        results = await asyncio.gather(*jobs)
        for (_path, positions), object_reasons in zip(by_object.items(), results):
            for i, reason in zip(positions, object_reasons):
                reasons[i] = reason
        self._evict()
        return reasons

    def _mirror(self, path: str) -> _Mirror:
        mirror = self._mirrors.get(path)
        if mirror is None:
            name = hashlib.sha256(path.encode()).hexdigest()[:32]
            mirror = self._mirrors[path] = _Mirror(os.path.join(self.folder, name))
        self._mirrors.move_to_end(path)
        return mirror

    async def _fetch_object(self, path: str, mirror: _Mirror, locations: list[Location]) -> list[str]:
        """Fetches the missing parts of one object's locations; returns per location "" or why not."""
        gaps = [g for loc in locations for g in mirror.missing(loc.offset, loc.offset + loc.length)]
        if not gaps:
            self.stats.hits += len(locations)
        coming = sorted((s, e) for s, e, _ in mirror.inflight)
        waits = [f for s, e, f in mirror.inflight if any(s < b and a < e for a, b in gaps)]
        size = self._blocks.get(path)
        if size:  # the whole block of each: later samples of this epoch are there too
            gaps = [g for a, b in gaps for g in mirror.missing(a // BLOCK * BLOCK, min(size, -(-b // BLOCK) * BLOCK))]
        requests = _coalesce(_subtract(gaps, coming))  # (what is on its way is not asked for twice)
        storage, name = self._storage_of(path)
        etag = next((loc.etag for loc in locations if loc.etag), "")
        whole = {(loc.offset, loc.offset + loc.length) for loc in locations if loc.offset == 0}
        futures = []
        for start, end in requests:
            future = asyncio.ensure_future(self._request(storage, name, path, mirror, start, end, etag, whole))
            mirror.inflight.append((start, end, future))
            futures.append(future)
        outcomes = await asyncio.gather(*futures, *waits, return_exceptions=True)
        failed = [str(outcome) for outcome in outcomes if outcome]
        reasons = []
        for loc in locations:
            reason = ""
            if not mirror.covers(loc.offset, loc.offset + loc.length):
                reason = failed[0] if failed else "not fetched"
                self.stats.failures += 1
            reasons.append(reason)
        return reasons

    async def _request(
        self,
        storage: ObjectStorage,
        name: str,
        path: str,
        mirror: _Mirror,
        start: int,
        end: int,
        etag: str,
        whole: set[tuple[int, int]],
    ) -> str:
        """One ranged GET into the mirror; returns "" or why it failed."""
        try:
            async with self._gate:
                data, size, got_etag = await storage.fetch(name, start, end, etag)
            self.stats.requests += 1
            self.stats.fetched_bytes += len(data)
            if (0, end) in whole and size != end:
                return f"{path} changed since the server indexed it: {size} bytes, indexed {end}"
            if etag and got_etag and got_etag != etag:
                return f"{path} changed since the server indexed it (ETag {got_etag}, indexed {etag})"
            if len(data) < end - start:
                return f"{path} is truncated: it ends at byte {size}, the sample at {end}"
            # In a thread: a write that the kernel throttles (dirty pages) must not stall the loop
            # that feeds the decode workers.
            await asyncio.get_running_loop().run_in_executor(self._writer, _write, mirror.fd, data, start)
            self.held += mirror.add(start, end)
            return ""
        except FileNotFoundError:
            return f"{path}: no such object (deleted since the server indexed it?)"
        except Exception as exc:
            return _failure(exc, path, storage)
        finally:
            mirror.inflight = [r for r in mirror.inflight if r[0] != start or r[1] != end]

    def _storage_of(self, path: str) -> tuple[ObjectStorage, str]:
        scheme_end = path.index("://") + 3
        slash = path.index("/", scheme_end)
        return self._storages[path[:slash]], path[slash + 1 :]

    def _evict(self) -> None:
        """Drops the least recently used unpinned objects while the mirrors hold over ``limit``."""
        if self.held <= self.limit:
            return
        for path in list(self._mirrors):
            if self.held <= self.limit:
                return
            mirror = self._mirrors[path]
            if mirror.pins or mirror.inflight:
                continue
            del self._mirrors[path]
            self.held -= mirror.bytes
            self.stats.evicted_bytes += mirror.bytes
            mirror.close()


def _claim(folder: str, most: int = 256) -> tuple[str, int]:
    """A subfolder of ``folder`` no other server on this machine uses, and the lock that holds it."""
    for k in range(most):
        name = "objects" if k == 0 else f"objects-{k}"
        lock = os.open(os.path.join(folder, f".{name}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)
            continue
        return os.path.join(folder, name), lock
    raise StorageError(f"--cache-dir {folder}: {most} loader servers on this machine use it already")


def _write(fd: int, data: Any, offset: int) -> None:
    """Writes fetched bytes into a mirror, which then counts as unchanged since indexing (mtime 0)."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
    os.utime(fd, ns=(0, 0))


def _subtract(ranges: list[tuple[int, int]], minus: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``ranges`` outside every range of ``minus`` (sorted by start)."""
    out = []
    for start, end in ranges:
        for s, e in minus:
            if e <= start or s >= end:
                continue
            if s > start:
                out.append((start, s))
            start = max(start, e)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


def _coalesce(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, overlapping or near (``COALESCE``) ranges merged, up to ``MAX_REQUEST`` each."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start - out[-1][1] <= COALESCE and max(end, out[-1][1]) - out[-1][0] <= MAX_REQUEST:
            out[-1] = (out[-1][0], max(end, out[-1][1]))
        else:
            out.append((start, end))
    return out


def _failure(exc: BaseException, path: str, storage: ObjectStorage) -> str:
    """Why a request failed, for the samples it held."""
    from obstore import exceptions

    if isinstance(exc, exceptions.PreconditionError):
        return f"{path} changed since the server indexed it (its ETag is another)"
    error = storage.error(exc, path.partition(storage.url + "/")[2])
    if isinstance(error, FileNotFoundError):
        return f"{path}: no such object (deleted since the server indexed it?)"
    return f"{path}: the store failed for {storage.retry_seconds:g}s of retries: {error}"
