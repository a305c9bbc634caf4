"""The pool of persistent decode/augment processes (worker_process.main) that render into the arena.

The arena (shared_memory.Arena) is one shared memory file cut into fixed-size slots; a task names a slot and
the samples to render into it, a worker writes each sample's pixels straight into its
place and answers with the per-sample errors only. Pixels never pass through pickling.
Tasks go to the worker with the fewest outstanding ones over its own pipe, so when a
worker dies the pool knows exactly which tasks to fail, and starts a new worker.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import multiprocessing as mp
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import NamedTuple

from remoteloader.server.shared_memory import Arena, SampleCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Task:
    """Render ``len(locations)`` samples into ``slot``, from sample ``first`` of the slot on."""

    slot: int
    first: int
    pipeline: tuple  # (name, height, width, albumentations_json)
    locations: list  # [(path, offset, length, cache_mode, cache_offset, verified, targets, source)]
    seeds: list  # [int], one per sample
    chunk: int  # samples in the slot's chunk (its masks follow all of its pixels)


class Rendered(NamedTuple):
    """What rendering samples gives besides their pixels: the samples that failed, as [(position,
    reason)], and each sample's transformed targets (serialized loader_pb2.Targets; b"" for a
    failed one), empty when the stream asked for no targets."""

    errors: list[tuple[int, str]]
    targets: list[bytes]

    @classmethod
    def failed(cls, count: int, reason: str) -> Rendered:
        return cls([(i, reason) for i in range(count)], [])


_MAX_SPECS = 64  # pipeline specs a worker remembers before it is told to forget them
# A task pipe holds at most AHEAD tasks and, for each, a pipeline spec (under 64 KiB of JSON,
# pipelines.MAX_PIPELINE_JSON): less than this, so a write to it never blocks the loop. (Not
# more: a user's pipes share a budget, by default 64 MiB, past which new ones get 4-8 KiB.)
_TASK_PIPE_BYTES = 256 << 10


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
        sources: The server's ``--source`` (spec, JSON arguments), which each worker loads.
    """

    AHEAD = 2

    def __init__(
        self,
        arena: Arena,
        workers: int,
        allow_custom: bool,
        max_pixels: int,
        cache: SampleCache | None = None,
        region_decode: bool = True,
        indexed_ns: int = 0,
        sources: tuple[tuple[str, str], ...] = (),
    ):
        self.size = workers
        self._arena = arena
        self._cache = cache
        self._settings = (
            arena.count,
            arena.slot_bytes,
            allow_custom,
            max_pixels,
            cache.size if cache else 0,
            region_decode,
            indexed_ns,
            sources,
        )
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["remoteloader.server.worker_process"])
        self._ctx = ctx
        self._loop: asyncio.AbstractEventLoop | None = None
        self._workers: list[_Worker] = []
        self._queue: deque[tuple[int, tuple, asyncio.Future, int]] = deque()
        self._next_id = 0
        self._closed = False

    def start(self) -> None:
        """Starts the workers, driven from the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._workers = [self._spawn() for _ in range(self.size)]

    def _spawn(self) -> _Worker:
        from remoteloader.server import worker_process

        task_read, task_write = self._ctx.Pipe(duplex=False)
        if hasattr(fcntl, "F_SETPIPE_SZ"):  # Linux only
            try:
                fcntl.fcntl(task_write.fileno(), fcntl.F_SETPIPE_SZ, _TASK_PIPE_BYTES)
            except OSError as exc:  # over pipe-max-size or the user's pipe budget: the pipe keeps its size
                log.warning("cannot enlarge a worker's task pipe to %d bytes (%s)", _TASK_PIPE_BYTES, exc)
        result_read, result_write = self._ctx.Pipe(duplex=False)
        fds = (self._arena.for_child(), self._cache.for_child() if self._cache else None)
        process = self._ctx.Process(
            target=worker_process.main,
            args=(task_read, result_write, *fds, *self._settings),
            name="remoteloader-worker",
            daemon=True,
        )
        process.start()
        task_read.close()
        result_write.close()
        worker = _Worker(process, task_write, result_read)
        self._started_loop.add_reader(result_read.fileno(), self._on_readable, worker)
        return worker

    @property
    def _started_loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "WorkerPool.start() comes first"
        return self._loop

    @property
    def outstanding(self) -> int:
        """Tasks queued or in a worker."""
        return len(self._queue) + sum(len(w.pending) for w in self._workers)

    def submit(self, task: Task) -> asyncio.Future:
        """Queues a task; the future gives its Rendered once a worker has done it."""
        if self._closed:
            raise RuntimeError("worker pool is closed")
        self._next_id += 1
        future = self._started_loop.create_future()
        message = (self._next_id, task.slot, task.first, task.pipeline, task.locations, task.seeds, task.chunk)
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

    def _on_readable(self, worker: _Worker) -> None:
        try:
            task_id, errors, targets = worker.results.recv()
        except (EOFError, OSError):
            self._on_death(worker)
            return
        entry = worker.pending.pop(task_id, None)
        if entry is not None and not entry[0].done():
            entry[0].set_result(Rendered(errors, targets))
        self._feed()

    def _on_death(self, worker: _Worker) -> None:
        if worker not in self._workers:  # already handled
            return
        self._started_loop.remove_reader(worker.results.fileno())
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
                        future.set_result(Rendered.failed(count, "no decode worker could be started"))
                return
        self._feed()

    def close(self) -> None:
        """Stops the workers (idempotent); queued and outstanding tasks are failed."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            try:
                self._started_loop.remove_reader(worker.results.fileno())
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
                future.set_result(Rendered.failed(count, "server shutting down"))


class _Worker:
    """One worker process, its two pipe ends, and the tasks it holds."""

    def __init__(self, process: BaseProcess, tasks: Connection, results: Connection):
        self.process = process
        self.tasks = tasks  # write end of the task pipe
        self.results = results  # read end of the result pipe
        self.pending: dict[int, tuple[asyncio.Future, int]] = {}
        self.specs: dict[tuple, int] = {}  # pipeline specs this worker has been sent, by id

    def fail(self, reason: str) -> None:
        for future, count in self.pending.values():
            if not future.done():
                future.set_result(Rendered.failed(count, reason))
        self.pending.clear()
