"""Object-store samples on local disk, fetched ahead of the decode workers.

A server reads a sample from an object store in the main process, never in a decode worker:
when an order arrives (the client sends them ahead, up to its credits), ``prefetch`` starts
fetching the byte ranges of its samples; when the order's chunk is rendered, ``fetch``
awaits what is still missing (in steady state nothing), and the workers read the bytes
from local files as they read a local disk.

Each object is mirrored by a sparse file in ``folder/objects``: a fetched range is written at
the object's own offsets, so a sample's ``Location`` keeps its offset and length and only its
path changes (a tar's mask member is read the same way). A mirror knows which ranges it holds
(merged intervals). A range missing is planned once (none twice at once) and waits its turn:
ranges are sent in the order they were asked for, while fewer than ``fetch_concurrency``
requests and, past the first, fewer than ``INFLIGHT_BYTES`` are in flight and not yet written.
When a range's turn comes, the ranges planned beside it in its object, whichever order asked
for them, less than ``COALESCE`` bytes apart, become one range with it; and the ranges of the
same object planned next (up to ``CALL_RANGES`` and ``CALL_BYTES``) go in the same call to the
store client, a request each (obstore's ``get_ranges``): the server's CPU per sample fetched is
mostly the client's per call, not per byte or per request (docs/performance.md, "Object
stores"). Only the samples' own bytes are fetched, in the order their orders came: a cold
epoch over a slow link gets the bytes its next chunks need first. (Fetching whole 1 MiB blocks
around them instead, as this cache once did, made a cold epoch wait: the first chunk alone
needed half the blocks of a small dataset; whole objects' other bytes fetched one large
request at a time beside the orders' came as small gaps between the ranges asked for, and
saved nothing.)

The mirrors carry modification time 0: their bytes were checked against the object's ETag
and size as they arrived, so a worker treats them as unchanged since indexing (and may decode
a crop's region only). A request alone carries the indexed ETag (``If-Match``); a call of
several ranges is followed by the object's version (a HEAD), and its ranges count as the
indexed version's only if the object still has its ETag then (an object changed and changed
back to the very same bytes within the call is the one case this misses).

Faults become the failure of the samples they touch, with the reason: an object missing,
changed (another ETag, or a whole-object read of another size) or truncated since indexing,
or a store that still fails after the storage's retries. A call of several ranges that fails
is repeated range by range, for each range's own reason; nothing else is retried here.

Memory and disk: the intervals are two int64 per disjoint range held; fetched bytes wait in
memory only until written (at most ``INFLIGHT_BYTES`` and one call: ``CALL_BYTES`` and one
range of up to ``MAX_REQUEST``); the mirrors hold at most ``limit`` bytes on disk, the least
recently used objects going first; an object whose bytes a render still reads is never evicted
(the limit is then exceeded until it is done).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import concurrent.futures
import fcntl
import functools
import hashlib
import itertools
import logging
import os
import shutil
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from remoteloader.server.catalog import Location
from remoteloader.server.storage import ObjectStorage, StorageError

log = logging.getLogger(__name__)

COALESCE = 64 << 10  # missing ranges of one object closer than this are fetched as one request
MAX_REQUEST = 16 << 20  # but a request stops growing at this many bytes
CALL_RANGES = 32  # ranges of one object fetched in one call at most (obstore's get_ranges) ...
CALL_BYTES = 4 << 20  # ... while they come to fewer bytes than this
CALL_PARALLEL = 10  # requests of one call in flight at once (obstore's get_ranges: object_store's default)
INFLIGHT_BYTES = 64 << 20  # requests start while fewer bytes than this are asked for and not yet written


class _Mirror:
    """One object's fetched ranges, in a sparse file at the object's own offsets."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.starts: array[int] = array("q")
        self.ends: array[int] = array("q")
        self.bytes = 0
        self.pins = 0
        self.coming: list[tuple[int, int]] = []  # the ranges of its requests on their way, sorted
        self.requests: list[asyncio.Future[str]] = []  # those requests, in the same order

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

    def untouched(self, start: int, end: int) -> bool:
        """Whether no byte of [start, end) is held or on its way."""
        k = bisect.bisect_left(self.coming, (end,))  # (the ranges coming are disjoint)
        if k and self.coming[k - 1][1] > start:
            return False
        return self.missing(start, end) == [(start, end)]

    def on_its_way(self, start: int, end: int, request: asyncio.Future[str]) -> None:
        k = bisect.bisect_left(self.coming, (start, end))
        self.coming.insert(k, (start, end))
        self.requests.insert(k, request)

    def arrived(self, request: asyncio.Future[str], start: int, end: int) -> None:
        k = bisect.bisect_left(self.coming, (start, end))
        while self.requests[k] is not request:  # (the same range twice: another request's)
            k += 1
        del self.coming[k], self.requests[k]

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

    requests: int = 0  # ranged GETs that answered
    calls: int = 0  # calls to the store client that made them (several ranges of one object in one)
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
    """

    def __init__(
        self,
        folder: str,
        limit: int,
        storages: list[ObjectStorage],
        concurrency: int = 64,
    ):
        os.makedirs(folder, exist_ok=True)
        self.folder, self._lock = _claim(folder)
        shutil.rmtree(self.folder, ignore_errors=True)  # ranges of an earlier run are not known to be current
        os.makedirs(self.folder)
        self.limit = limit
        self._storages = {s.url: s for s in storages}
        self._gate = _Gate(concurrency, INFLIGHT_BYTES)
        self._mirrors: collections.OrderedDict[str, _Mirror] = collections.OrderedDict()  # LRU first
        self.held = 0  # bytes the mirrors hold
        self.stats = CacheStats()
        self._tasks: set[asyncio.Future] = set()
        self._planned: collections.deque[_Planned] = collections.deque()  # ranges to request, in turn
        self._unsent: dict[asyncio.Future[str], _Planned] = {}  # those not sent yet, by their future
        self._sending: set[asyncio.Future[None]] = set()  # the requests sent, not yet done
        self._dispatching = False  # a _dispatch is due this turn of the loop
        self._writer = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="object-cache-write")

    # ---- what fetching calls ---------------------------------------------------------
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
        for task in [*self._tasks, *self._sending]:
            task.cancel()
        for plan in self._unsent.values():
            plan.future.cancel()
        self._unsent.clear()
        self._planned.clear()
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
        mirrors, waits = [], []
        for path, positions in by_object.items():  # (no await: nothing is evicted while this plans)
            mirror = self._mirror(path)
            mirror.pins += 1  # never evicted while its bytes are on their way here (with ``pin``: until release)
            mirrors.append(mirror)
            wanted = [locations[i] for i in positions]
            waits.append(self._wait(mirror, wanted, self._ask(path, mirror, wanted)))
        try:
            results = await asyncio.gather(*waits)
        finally:
            if not pin:
                for mirror in mirrors:
                    mirror.pins -= 1
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

    def _ask(
        self, path: str, mirror: _Mirror, locations: list[Location]
    ) -> list[tuple[tuple[int, int], asyncio.Future[str]]]:
        """Starts requests for what of one object's ``locations`` is neither held nor on its way;
        returns every request they wait for, with its range."""
        gaps = sorted(g for loc in locations for g in mirror.missing(loc.offset, loc.offset + loc.length))
        if not gaps:
            self.stats.hits += len(locations)
            return []
        waits = [(mirror.coming[k], mirror.requests[k]) for k in _overlapping(gaps, mirror.coming)]
        # What is held or on its way is not asked for twice (so the ranges coming never overlap).
        requests = _coalesce(_subtract(gaps, mirror.coming), mirror.untouched)
        etag = next((loc.etag for loc in locations if loc.etag), "")
        ends = {loc.length for loc in locations if loc.offset == 0}  # of whole objects (a sample each)
        return waits + [
            ((start, end), self._start(path, mirror, start, end, etag, end in ends)) for start, end in requests
        ]

    async def _wait(
        self, mirror: _Mirror, locations: list[Location], asked: list[tuple[tuple[int, int], asyncio.Future[str]]]
    ) -> list[str]:
        """Per location "" once its bytes are held, or why not: the failure of a request over it."""
        # Shielded: a caller that gives up does not cancel requests that others wait for too.
        outcomes = await asyncio.gather(*(asyncio.shield(request) for _, request in asked), return_exceptions=True)
        failed = [
            (where, why if isinstance(why, str) else str(why) or type(why).__name__)
            for (where, _), why in zip(asked, outcomes)
            if why
        ]
        reasons = []
        for loc in locations:
            start, end = loc.offset, loc.offset + loc.length
            reason = ""
            if not mirror.covers(start, end):
                reason = next((why for (s, e), why in failed if s < end and start < e), "not fetched")
                self.stats.failures += 1
            reasons.append(reason)
        return reasons

    def _start(self, path: str, mirror: _Mirror, start: int, end: int, etag: str, whole: bool) -> asyncio.Future[str]:
        """Plans one range's request: it waits its turn (``_dispatch``); it is on its way until
        done. ``whole``: it ends where a whole object as indexed ends, so the object's size is checked."""
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        mirror.on_its_way(start, end, future)
        future.add_done_callback(functools.partial(mirror.arrived, start=start, end=end))
        self._planned.append(_Planned(path, mirror, start, end, etag, whole, future))
        self._unsent[future] = self._planned[-1]
        if not self._dispatching:  # (once the ranges asked for in this turn of the loop are all planned)
            self._dispatching = True
            asyncio.get_running_loop().call_soon(self._dispatch)
        return future

    def _dispatch(self) -> None:
        """Sends planned ranges in the order they were asked for while the gate has room: each with
        the ranges planned beside it in its object (``_beside``) as one range, and the ranges of
        the same object planned next (up to ``CALL_RANGES`` and ``CALL_BYTES``) in the same call."""
        self._dispatching = False
        while self._planned and self._gate.room():
            first = self._planned.popleft()
            if self._unsent.pop(first.future, None) is None:
                continue  # (sent with a neighbour, or given up)
            groups = [self._beside(first)]
            nbytes = groups[0][-1].end - groups[0][0].start
            free = self._gate.most - self._gate.count  # (a call has up to CALL_PARALLEL requests in flight)
            most = CALL_RANGES if free >= CALL_PARALLEL else max(free, 1)
            for plan in itertools.islice(self._planned, 4 * CALL_RANGES):
                if len(groups) >= most or nbytes >= CALL_BYTES:
                    break
                if plan.mirror is first.mirror and self._unsent.pop(plan.future, None) is not None:
                    groups.append(self._beside(plan))
                    nbytes += groups[-1][-1].end - groups[-1][0].start
            self._gate.take(nbytes, min(len(groups), CALL_PARALLEL))
            task = asyncio.ensure_future(self._request(first.path, first.mirror, first.etag, groups, nbytes))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    def _beside(self, first: _Planned) -> list[_Planned]:
        """``first`` and the planned ranges of its object on either side of it, in offset order,
        while each is less than ``COALESCE`` bytes from the last and the bytes between are neither
        held nor coming, up to ``MAX_REQUEST`` in all; all taken off the plan."""
        mirror = first.mirror
        k = bisect.bisect_left(mirror.coming, (first.start, first.end))
        while mirror.requests[k] is not first.future:  # (the same range twice: another request's)
            k += 1
        group, start, end = [first], first.start, first.end
        for step in (1, -1):
            j = k + step
            while 0 <= j < len(mirror.coming):
                plan = self._unsent.get(mirror.requests[j])
                if plan is None:
                    break
                gap = (end, plan.start) if step == 1 else (plan.end, start)  # (the ranges coming are disjoint)
                if (
                    gap[1] - gap[0] > COALESCE
                    or max(end, plan.end) - min(start, plan.start) > MAX_REQUEST
                    or (gap[1] > gap[0] and not mirror.untouched(*gap))
                ):
                    break
                del self._unsent[plan.future]
                group.append(plan)
                start, end = min(start, plan.start), max(end, plan.end)
                j += step
        group.sort(key=lambda plan: plan.start)
        return group

    async def _request(self, path: str, mirror: _Mirror, etag: str, groups: list[list[_Planned]], nbytes: int) -> None:
        """Fetches one range per group of planned ranges of one object into its mirror (one call);
        each planned range gets "" or why it failed. The call holds ``nbytes`` at the gate (in
        memory until written) until done."""
        storage, name = self._storage_of(path)
        ranges = [(group[0].start, group[-1].end, group[-1].whole) for group in groups]
        reasons = ["cancelled"] * len(ranges)
        try:
            if len(ranges) == 1:
                reasons = [await self._get(storage, name, path, mirror, *ranges[0][:2], etag, ranges[0][2])]
            else:
                reasons = await self._get_many(storage, name, path, mirror, ranges, etag)
        finally:
            self._gate.leave(nbytes, min(len(groups), CALL_PARALLEL))
            for group, reason in zip(groups, reasons):
                for plan in group:
                    if not plan.future.done():
                        plan.future.set_result(reason)
            self._dispatch()

    async def _get_many(
        self,
        storage: ObjectStorage,
        name: str,
        path: str,
        mirror: _Mirror,
        ranges: list[tuple[int, int, bool]],
        etag: str,
    ) -> list[str]:
        """Fetches several ranges of one object in one call (separate requests: obstore's
        ``get_ranges``, about half the CPU per range of a call each), then the object's version:
        what came is its indexed version's if it still has it. A call that fails is repeated range
        by range (``_get``), so that each range fails with its own reason, or not at all."""
        try:
            datas = await storage.fetch_ranges(name, [(start, end) for start, end, _ in ranges])
            size, got_etag = await storage.version(name)
        except Exception:
            return list(
                await asyncio.gather(*(self._get(storage, name, path, mirror, s, e, etag, w) for s, e, w in ranges))
            )
        self.stats.requests += len(ranges)
        self.stats.calls += 1
        self.stats.fetched_bytes += sum(len(data) for data in datas)
        if etag and got_etag and got_etag != etag:
            return [f"{path} changed since the server indexed it (ETag {got_etag}, indexed {etag})"] * len(ranges)
        reasons = [
            f"{path} changed since the server indexed it: {size} bytes, indexed {end}"
            if whole and size != end
            else f"{path} is truncated: it ends at byte {size}, the sample at {end}"
            if len(data) < end - start
            else ""
            for (start, end, whole), data in zip(ranges, datas)
        ]
        writes = [(data, start) for (start, _, _), data, reason in zip(ranges, datas, reasons) if not reason]
        await asyncio.get_running_loop().run_in_executor(self._writer, _write_all, mirror.fd, writes)
        for (start, end, _), reason in zip(ranges, reasons):
            if not reason:
                self.held += mirror.add(start, end)
        return reasons

    async def _get(
        self,
        storage: ObjectStorage,
        name: str,
        path: str,
        mirror: _Mirror,
        start: int,
        end: int,
        etag: str,
        whole: bool,
    ) -> str:
        """Fetches [start, end) of one object into its mirror; returns "" or why it failed."""
        try:
            data, size, got_etag = await storage.fetch(name, start, end, etag)
            self.stats.requests += 1
            self.stats.calls += 1
            self.stats.fetched_bytes += len(data)
            if whole and size != end:
                return f"{path} changed since the server indexed it: {size} bytes, indexed {end}"
            if etag and got_etag and got_etag != etag:
                return f"{path} changed since the server indexed it (ETag {got_etag}, indexed {etag})"
            if len(data) < end - start:
                return f"{path} is truncated: it ends at byte {size}, the sample at {end}"
            # In a thread: a write that the kernel throttles (dirty pages) must not stall the
            # loop that feeds the decode workers.
            await asyncio.get_running_loop().run_in_executor(self._writer, _write, mirror.fd, data, start)
            self.held += mirror.add(start, end)
            return ""
        except FileNotFoundError:
            return f"{path}: no such object (deleted since the server indexed it?)"
        except Exception as exc:
            return _failure(exc, path, storage)

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
            if mirror.pins or mirror.coming:
                continue
            del self._mirrors[path]
            self.held -= mirror.bytes
            self.stats.evicted_bytes += mirror.bytes
            mirror.close()


@dataclass
class _Planned:
    """A range asked for and not held: its request waits its turn (``ObjectCache._dispatch``)."""

    path: str
    mirror: _Mirror
    start: int
    end: int
    etag: str
    whole: bool  # it ends where the whole object as indexed ends: the object's size is checked
    future: asyncio.Future[str]  # "" once held, or why not


class _Gate:
    """The requests in flight and the bytes they hold: there is ``room`` while fewer than
    ``most`` are in and, past the first, they hold fewer than ``most_bytes``, so a request of any
    size gets in and those in never hold more than ``most_bytes`` and one call."""

    def __init__(self, most: int, most_bytes: int):
        self.most, self.most_bytes = most, most_bytes
        self.count = self.bytes = 0  # of the requests in

    def room(self) -> bool:
        """Whether another request may go now."""
        return self.count < self.most and (self.count == 0 or self.bytes < self.most_bytes)

    def take(self, nbytes: int, requests: int = 1) -> None:
        """Lets ``requests`` of ``nbytes`` in all in now (``room`` said so); ``leave`` when done."""
        self.count += requests
        self.bytes += nbytes

    def leave(self, nbytes: int, requests: int = 1) -> None:
        self.count -= requests
        self.bytes -= nbytes


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


def _write_all(fd: int, writes: list[tuple[Any, int]]) -> None:
    """``_write`` for each (bytes, offset) of one mirror."""
    for data, offset in writes:
        _write(fd, data, offset)


def _write(fd: int, data: Any, offset: int) -> None:
    """Writes fetched bytes into a mirror, which then counts as unchanged since indexing (mtime 0)."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
    os.utime(fd, ns=(0, 0))


def _subtract(ranges: list[tuple[int, int]], minus: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``ranges`` outside every range of ``minus`` (both sorted by start), in one
    pass over both: an object may have thousands of requests on their way."""
    out = []
    first = 0  # ranges of minus before it end before the range at hand, and so before every later one
    for start, end in ranges:
        while first < len(minus) and minus[first][1] <= start:
            first += 1
        k = first
        while k < len(minus) and minus[k][0] < end and start < end:
            s, e = minus[k]
            if e > start:
                if s > start:
                    out.append((start, s))
                start = e
            k += 1
        if start < end:
            out.append((start, end))
    return out


def _overlapping(ranges: list[tuple[int, int]], others: list[tuple[int, int]]) -> list[int]:
    """The positions of the ranges of ``others`` that overlap some range of ``ranges`` (both
    sorted by start), in one pass over both."""
    out: list[int] = []
    first = 0
    for start, end in ranges:
        while first < len(others) and others[first][1] <= start:
            first += 1
        k = first
        while k < len(others) and others[k][0] < end:
            if others[k][1] > start and (not out or out[-1] < k):
                out.append(k)
            k += 1
    return out


def _coalesce(
    ranges: list[tuple[int, int]], fetchable: Callable[[int, int], bool] = lambda start, end: True
) -> list[tuple[int, int]]:
    """Sorted, disjoint requests for ``ranges``: overlapping or near (``COALESCE``) ones merged,
    up to ``MAX_REQUEST`` each (an overlap past it goes to the next request, never to two), near
    ones only where the bytes between them are ``fetchable`` (none held or coming)."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and end <= out[-1][1]:
            continue  # (within the last)
        if out and start < out[-1][1]:
            start = out[-1][1]  # its rest
        if (
            out
            and start - out[-1][1] <= COALESCE
            and end - out[-1][0] <= MAX_REQUEST
            and (start == out[-1][1] or fetchable(out[-1][1], start))
        ):
            out[-1] = (out[-1][0], end)
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
