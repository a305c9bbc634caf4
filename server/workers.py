"""A pool of persistent decode/augment processes writing into a shared buffer arena.

The arena is one shared memory file cut into fixed-size slots; a task names a slot and
the samples to render into it, a worker writes each sample's pixels straight into its
place and answers with the per-sample errors only. Pixels never pass through pickling.
Tasks go to the worker with the fewest outstanding ones over its own pipe, so when a
worker dies the pool knows exactly which tasks to fail, and starts a new worker.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import mmap
import multiprocessing as mp
import os
import tempfile
from multiprocessing import reduction
from collections import deque
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Task:
    """Render ``len(locations)`` samples into ``slot``, from sample ``first`` of the slot on."""

    slot: int
    first: int
    pipeline: tuple  # (name, height, width, albumentations_json)
    locations: list  # [(path, offset, length, cache_mode, cache_offset, verified)]
    seeds: list  # [int], one per sample


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
            raise OSError(f"cannot reserve {size / 2**20:.0f} MiB of shared memory in {directory or 'the temp dir'}: "
                          f"{exc} (slots x max(--chunk-bytes, --max-image-size^2 x 3), plus --cache-bytes; lower "
                          f"those, or give a container more shm_size)") from None
        except AttributeError:  # not on this platform
            os.ftruncate(self.fd, size)
        self._mmap = mmap.mmap(self.fd, size)
        self.buffer = memoryview(self._mmap)

    def for_child(self) -> "InheritedFd":
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
    """Shared memory cut into ``count`` slots of ``slot_bytes`` for decoded chunks."""

    def __init__(self, count: int, slot_bytes: int):
        super().__init__(count * slot_bytes, "remoteloader-slots-")
        self.count = count
        self.slot_bytes = slot_bytes
        self._free = asyncio.Queue()
        for slot in range(count):
            self._free.put_nowait(slot)

    async def acquire(self) -> int:
        return await self._free.get()

    def release(self, slot: int) -> None:
        self._free.put_nowait(slot)

    def view(self, slot: int, nbytes: int) -> memoryview:
        start = slot * self.slot_bytes
        return self.buffer[start:start + nbytes]


_MAX_SPECS = 64  # pipeline specs a worker remembers before it is told to forget them
# A task pipe holds at most AHEAD tasks and, for each, a pipeline spec (under 64 KiB of JSON,
# pipelines.MAX_PIPELINE_JSON): less than this, so a write to it never blocks the loop. (Not
# more: a user's pipes share a budget, by default 64 MiB, past which new ones get 4-8 KiB.)
_TASK_PIPE_BYTES = 256 << 10
_RESERVED = -3  # cache index values <= this: reserved at offset (_RESERVED - value), not filled


class SampleCache(SharedFile):
    """Encoded samples kept in shared memory after their first read; filled, never evicted.

    Per shard, one int64 per sample says where its bytes are (-1: not cached, -2: being
    filled), so the index costs 8 bytes per sample whatever the cache holds.
    """

    NONE, FILLING = -1, -2

    def __init__(self, capacity: int, shard_sizes: dict[str, int]):
        super().__init__(capacity, "remoteloader-cache-")
        self.used = 0
        self.hits = 0
        self._where = {shard: np.full(n, self.NONE, dtype=np.int64) for shard, n in shard_sizes.items()}

    def plan(self, shard: str, index: int, length: int) -> tuple[int, int]:
        """(mode, offset) for a read: 2 = read from cache, 1 = fill at offset, 0 = plain read."""
        where = self._where[shard]
        state = int(where[index])
        if state >= 0:
            self.hits += 1
            return 2, state
        if state <= _RESERVED:  # space kept from a fill that failed: try again there
            where[index] = self.FILLING
            return 1, _RESERVED - state
        if state == self.NONE and 0 < length <= self.size - self.used:
            where[index] = self.FILLING
            offset = self.used
            self.used += length
            return 1, offset
        return 0, 0

    def filled(self, shard: str, index: int, offset: int, ok: bool) -> None:
        # A failed fill keeps its space for the next try, so failures never use up the cache.
        self._where[shard][index] = offset if ok else _RESERVED - offset


class WorkerPool:
    """Persistent worker processes fed over pipes, driven from the asyncio loop.

    Tasks wait in one queue and go to a worker only while it holds fewer than
    ``AHEAD`` of them: every worker stays busy, a slow worker gets less, and the task pipe
    (enlarged to _TASK_PIPE_BYTES) never fills, so writing to it never blocks the event
    loop. Results come back on a second pipe that the loop watches.

    Args:
        arena: The shared slots the workers write into.
        workers: Number of processes.
        allow_custom: Whether workers may build client-sent albumentations pipelines.
        max_pixels: Decode size cap passed to the pipelines.
        region_decode: Whether the pipelines decode only a crop's region (decode.decode_crop).
        indexed_ns: When the server started indexing its data (time.time_ns()): files written
            later are always decoded whole.
        cache: Shared cache of encoded samples, if any.
    """

    AHEAD = 2

    def __init__(self, arena: Arena, workers: int, allow_custom: bool, max_pixels: int,
                 cache: "SampleCache | None" = None, region_decode: bool = True, indexed_ns: int = 0):
        self.size = workers
        self._arena = arena
        self._cache = cache
        self._settings = (arena.count, arena.slot_bytes, allow_custom, max_pixels, cache.size if cache else 0,
                          region_decode, indexed_ns)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["remoteloader.server.worker"])
        self._ctx = ctx
        self._loop: asyncio.AbstractEventLoop | None = None
        self._workers: list[_Worker] = []
        self._queue: deque[tuple[int, tuple, asyncio.Future, int]] = deque()
        self._next_id = 0
        self._closed = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._workers = [self._spawn() for _ in range(self.size)]

    def _spawn(self) -> "_Worker":
        from remoteloader.server import worker as worker_module

        task_read, task_write = self._ctx.Pipe(duplex=False)
        if hasattr(fcntl, "F_SETPIPE_SZ"):  # Linux only
            try:
                fcntl.fcntl(task_write.fileno(), fcntl.F_SETPIPE_SZ, _TASK_PIPE_BYTES)
            except OSError as exc:  # over pipe-max-size or the user's pipe budget: the pipe keeps its size
                log.warning("cannot enlarge a worker's task pipe to %d bytes (%s)", _TASK_PIPE_BYTES, exc)
        result_read, result_write = self._ctx.Pipe(duplex=False)
        fds = (self._arena.for_child(), self._cache.for_child() if self._cache else None)
        process = self._ctx.Process(target=worker_module.main, args=(task_read, result_write, *fds, *self._settings),
                                    name="remoteloader-worker", daemon=True)
        process.start()
        task_read.close()
        result_write.close()
        worker = _Worker(process, task_write, result_read)
        self._loop.add_reader(result_read.fileno(), self._on_readable, worker)
        return worker

    @property
    def outstanding(self) -> int:
        """Tasks queued or in a worker."""
        return len(self._queue) + sum(len(w.pending) for w in self._workers)

    def submit(self, task: Task) -> asyncio.Future:
        """Queues a task; the future gives [(position, reason)] once a worker has done it."""
        if self._closed:
            raise RuntimeError("worker pool is closed")
        self._next_id += 1
        future = self._loop.create_future()
        message = (self._next_id, task.slot, task.first, task.pipeline, task.locations, task.seeds)
        self._queue.append((self._next_id, message, future, len(task.locations)))
        self._feed()
        return future

    def _feed(self) -> None:
        while self._queue and self._workers:
            worker = min(self._workers, key=lambda w: len(w.pending))
            if len(worker.pending) >= self.AHEAD:
                return
            task_id, message, future, count = self._queue.popleft()
            worker.pending[task_id] = (future, count)
            try:
                # The pipeline spec (under 64 KiB of JSON) goes to each worker once; tasks name it.
                spec = message[3]
                if spec not in worker.specs and len(worker.specs) >= _MAX_SPECS:
                    worker.tasks.send(("forget",))
                    worker.specs.clear()
                if spec not in worker.specs:
                    worker.tasks.send(("spec", len(worker.specs), spec))
                    worker.specs[spec] = len(worker.specs)
                worker.tasks.send((*message[:3], worker.specs[spec], *message[4:]))
            except OSError:  # died before the loop saw it: fail its tasks, start another, go on
                self._on_death(worker)

    def _on_readable(self, worker: "_Worker") -> None:
        try:
            task_id, errors = worker.results.recv()
        except (EOFError, OSError):
            self._on_death(worker)
            return
        entry = worker.pending.pop(task_id, None)
        if entry is not None and not entry[0].done():
            entry[0].set_result(errors)
        self._feed()

    def _on_death(self, worker: "_Worker") -> None:
        if worker not in self._workers:  # already handled
            return
        self._loop.remove_reader(worker.results.fileno())
        worker.results.close()
        worker.tasks.close()
        worker.process.join(timeout=1)
        code = worker.process.exitcode
        worker.fail(f"decode worker died (exit code {code})")
        if self._closed:
            return
        log.error("decode worker pid %s died with exit code %s; starting a new one", worker.process.pid, code)
        index = self._workers.index(worker)
        try:
            self._workers[index] = self._spawn()
        except Exception:  # cannot start one now (fork failed, out of file descriptors...)
            log.exception("could not start a decode worker; %d left", len(self._workers) - 1)
            del self._workers[index]
            if not self._workers:
                while self._queue:
                    _, _, future, count = self._queue.popleft()
                    if not future.done():
                        future.set_result([(i, "no decode worker could be started") for i in range(count)])
                return
        self._feed()

    def close(self) -> None:
        """Stops the workers (idempotent); queued and outstanding tasks are failed."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            try:
                self._loop.remove_reader(worker.results.fileno())
                worker.tasks.send(None)
            except (OSError, ValueError):
                pass
        for worker in self._workers:
            worker.process.join(timeout=5)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=5)
            worker.fail("server shutting down")
            worker.tasks.close()
            worker.results.close()
        while self._queue:
            _, _, future, count = self._queue.popleft()
            if not future.done():
                future.set_result([(i, "server shutting down") for i in range(count)])


class _Worker:
    def __init__(self, process: mp.Process, tasks, results):
        self.process = process
        self.tasks = tasks  # write end of the task pipe
        self.results = results  # read end of the result pipe
        self.pending: dict[int, tuple[asyncio.Future, int]] = {}
        self.specs: dict[tuple, int] = {}  # pipeline specs this worker has been sent, by id

    def fail(self, reason: str) -> None:
        for future, count in self.pending.values():
            if not future.done():
                future.set_result([(i, reason) for i in range(count)])
        self.pending.clear()
