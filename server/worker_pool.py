"""The pool of persistent decode/augment processes (worker_process.main) that render into the arena.

The arena (shared_memory.Arena) is one shared memory file cut into fixed-size slots; a task names a slot and
the samples to render into it, a worker writes each sample's pixels straight into its
place and answers with the per-sample errors only (the messages: worker_messages). Pixels
never pass through pickling.
Tasks wait in a FairQueue: the jobs they are for share the workers by weight.
Tasks go to the worker with the fewest outstanding ones over its own pipe, so when a
worker dies the pool knows exactly which tasks to fail, and starts a new worker. A worker
that holds work without answering for ``worker_timeout`` (stopped, or wedged) is killed and
replaced the same way, its tasks given to another worker once (a task that stalls a second
time fails its samples). The pool also measures how busy its workers are (BusyMeter): the
signal for adding or removing servers.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import math
import multiprocessing as mp
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import forkserver
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, NamedTuple

from remoteloader.protos import limits
from remoteloader.server.fair_queue import FairQueue, Job
from remoteloader.server.jobs import Jobs
from remoteloader.server.shared_memory import Arena, SampleCache
from remoteloader.server.worker_messages import (
    DefinePipeline,
    ForgetPipelines,
    RenderTask,
    Stop,
    TaskDone,
    TaskSample,
    WorkerSettings,
)

if TYPE_CHECKING:
    from remoteloader.server.pipelines import PipelineSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Task:
    """Render ``samples`` with ``pipeline`` (sample ``i`` with ``seeds[i]``) into ``slot``, from
    sample ``first`` of the slot on; the slot's chunk has ``chunk`` samples (its masks follow
    all of its pixels). The pool sends it to a worker as a RenderTask, in its ``job``'s turn
    (server.fair_queue: jobs share the workers by weight)."""

    slot: int
    first: int
    pipeline: PipelineSpec
    samples: list[TaskSample]
    seeds: list[int]
    chunk: int
    job: Job


class _Queued(NamedTuple):
    """A task waiting for, or held by, a worker, and its future."""

    task_id: int
    task: Task
    future: asyncio.Future
    tries: int = 0  # workers that stalled on it before


class Rendered(NamedTuple):
    """What rendering samples gives besides their pixels: the samples that failed, as [(position,
    reason)], and each sample's transformed targets (serialized loader_pb2.Targets; b"" for a
    failed one), empty when the stream asked for no targets."""

    errors: list[tuple[int, str]]
    targets: list[bytes]

    @classmethod
    def failed(cls, count: int, reason: str) -> Rendered:
        return cls([(i, reason) for i in range(count)], [])


class BusyMeter:
    """The share of workers busy, time-weighted, over the last ``window`` seconds.

    The owner calls ``set(busy, workers)`` whenever either count changes; between calls both
    are constant, so the integrals of ``busy`` and ``workers`` over time are exact. They are
    remembered at every ``window / steps`` seconds (a ring of ``steps + 1`` marks), so a reading
    covers between ``window`` and ``window + window / steps`` seconds (less only in the pool's
    first ``window`` seconds) and costs O(1) per change. Thread-safe: the event loop sets, the
    metrics thread and the loop read.

    Args:
        window: Seconds a reading covers (default 5).
        steps: Marks per window (default 10): the resolution of the window's start.
        clock: Seconds, monotonic (a test's fake clock).
    """

    def __init__(
        self, window: float = limits.BUSY_WINDOW, steps: int = 10, clock: Callable[[], float] = time.monotonic
    ):
        if window <= 0 or steps < 1:
            raise ValueError(f"BusyMeter(window={window!r}, steps={steps!r}): expected window > 0 and steps >= 1")
        self._clock = clock
        self._step = window / steps
        self._steps = steps
        self._lock = threading.Lock()
        self._since = clock()  # the last change; busy and workers are constant since
        self._busy = self._workers = 0
        self._busy_seconds = self._worker_seconds = 0.0  # integrals up to _since
        # (busy integral, workers integral) at the marks, oldest first: the window starts at the first.
        self._marks: deque[tuple[float, float]] = deque([(0.0, 0.0)], maxlen=steps + 1)

    def set(self, busy: int, workers: int) -> None:
        """From now on ``busy`` of ``workers`` workers have work."""
        with self._lock:
            self._advance(self._clock())
            self._busy, self._workers = busy, workers

    def share(self) -> float:
        """Busy worker-seconds over worker-seconds in the window: 0 (idle, or no workers) to 1."""
        with self._lock:
            self._advance(self._clock())
            busy, workers = self._marks[0]
            capacity = self._worker_seconds - workers
            return min(1.0, (self._busy_seconds - busy) / capacity) if capacity > 0 else 0.0

    def busy_seconds(self) -> float:
        """Busy worker-seconds since the meter was made (a counter: its rate is busy workers)."""
        with self._lock:
            self._advance(self._clock())
            return self._busy_seconds

    def _advance(self, now: float) -> None:
        """Integrates up to ``now``, marking the integrals at the steps passed (the last steps + 1 at most)."""
        since, step = self._since, self._step
        last = math.floor(now / step)
        for k in range(max(math.floor(since / step) + 1, last - self._steps), last + 1):
            elapsed = max(0.0, k * step - since)
            self._marks.append(
                (self._busy_seconds + self._busy * elapsed, self._worker_seconds + self._workers * elapsed)
            )
        elapsed = max(0.0, now - since)
        self._busy_seconds += self._busy * elapsed
        self._worker_seconds += self._workers * elapsed
        self._since = max(since, now)


_MAX_SPECS = 64  # pipeline specs a worker remembers before it is told to forget them
# A task pipe holds at most AHEAD tasks and, for each, a pipeline spec (under 64 KiB of JSON,
# pipelines.MAX_PIPELINE_JSON): less than this, so a write to it never blocks the loop. (Not
# more: a user's pipes share a budget, by default 64 MiB, past which new ones get 4-8 KiB.)
_TASK_PIPE_BYTES = 256 << 10


def _context() -> mp.context.ForkServerContext:
    """Where decode workers come from: a fork server that has imported their code once."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["remoteloader.server.worker_process"])
    return ctx


def start_fork_server() -> None:
    """Starts the fork server the decode workers will come from, and its imports (OpenCV,
    albumentations: seconds of CPU), without waiting for them: a server calls it before indexing
    its data, which then runs beside those imports."""
    _context()
    forkserver.ensure_running()


class WorkerPool:
    """Persistent worker processes fed over pipes, driven from the asyncio loop.

    Tasks wait in a fair queue (jobs by weight) and go to a worker only while it holds fewer than
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
            later are always read whole (never region-decoded alone).
        cache: Shared cache of encoded samples, if any.
        sources: The server's ``--source`` (spec, JSON arguments), which each worker loads.
        busy_window: Seconds over which ``busy_share`` is measured (default 5).
        worker_timeout: Seconds a worker may hold work without answering before it is replaced.
        jobs: What each job weighs, for the fair queue (server.jobs; default: none weighed).
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
        busy_window: float = limits.BUSY_WINDOW,
        worker_timeout: float = 30.0,
        jobs: Jobs | None = None,
    ):
        self.size = workers
        self.worker_timeout = worker_timeout
        self.stalls = 0  # workers replaced for holding work without answering
        self._arena = arena
        self._cache = cache
        self._settings = WorkerSettings(
            slots=arena.count,
            slot_bytes=arena.slot_bytes,
            allow_custom=allow_custom,
            max_pixels=max_pixels,
            cache_bytes=cache.size if cache else 0,
            region_decode=region_decode,
            indexed_ns=indexed_ns,
            sources=sources,
        )
        self._ctx = _context()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._workers: list[_Worker] = []
        self.jobs = jobs if jobs is not None else Jobs()  # (the slots read and open them too: server.jobs)
        self._queue: FairQueue[_Queued] = FairQueue(self.jobs)
        self._next_id = 0
        self._closed = False
        self._meter = BusyMeter(busy_window)
        self._counts = (0, 0)  # (busy workers, workers) as last told to the meter
        self._watcher: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Starts the workers, driven from the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._workers = [self._spawn() for _ in range(self.size)]
        self._measure()
        self._watch()

    def _watch(self) -> None:
        """Replaces the workers that held work for worker_timeout without answering (every
        quarter of it, at most every second)."""
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.pending and now - worker.answered > self.worker_timeout:
                self._replace_stalled(worker, now - worker.answered)
        self._watcher = self._started_loop.call_later(min(1.0, self.worker_timeout / 4), self._watch)

    def silent_for(self) -> float:
        """Seconds the longest-silent worker that holds work has not answered (0: none holds any)."""
        now = time.monotonic()
        return max((now - w.answered for w in self._workers if w.pending), default=0.0)

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
            args=(task_read, result_write, *fds, self._settings),
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

    @property
    def workers(self) -> int:
        """Worker processes running (fewer than ``size`` only when one could not be started again)."""
        return len(self._workers)

    def busy_share(self) -> float:
        """The share of the workers that held a task, time-weighted over the last ``busy_window``
        seconds: near 1, this server's CPUs are what limits it. Safe to call from any thread."""
        return self._meter.share()

    def busy_seconds(self) -> float:
        """Worker-seconds spent holding a task since the pool was made (``busy_share`` without a window)."""
        return self._meter.busy_seconds()

    def _measure(self) -> None:
        """Tells the meter how many workers hold a task, if that changed (after every change)."""
        counts = (sum(1 for w in self._workers if w.pending), len(self._workers))
        if counts != self._counts:
            self._counts = counts
            self._meter.set(*counts)

    def submit(self, task: Task) -> asyncio.Future:
        """Queues a task; the future gives its Rendered once a worker has done it."""
        if self._closed:
            raise RuntimeError("worker pool is closed")
        self._next_id += 1
        future = self._started_loop.create_future()
        self._queue.put(task.job, len(task.samples), _Queued(self._next_id, task, future))
        self._feed()
        return future

    def _feed(self) -> None:
        while self._queue and self._workers:
            worker = min(self._workers, key=lambda w: len(w.pending))
            if len(worker.pending) >= self.AHEAD:
                break
            queued = self._queue.take()
            task = queued.task
            if not worker.pending:  # its silence is counted from now
                worker.answered = time.monotonic()
            worker.pending[queued.task_id] = queued
            try:
                # The pipeline spec (under 64 KiB of JSON) goes to each worker once; tasks name it.
                spec_id = worker.specs.get(task.pipeline)
                if spec_id is None:
                    if len(worker.specs) >= _MAX_SPECS:
                        worker.tasks.send(ForgetPipelines())
                        worker.specs.clear()
                    spec_id = len(worker.specs)
                    worker.tasks.send(DefinePipeline(spec_id, task.pipeline))
                    worker.specs[task.pipeline] = spec_id
                worker.tasks.send(
                    RenderTask(
                        task_id=queued.task_id,
                        slot=task.slot,
                        first=task.first,
                        spec_id=spec_id,
                        samples=task.samples,
                        seeds=task.seeds,
                        chunk=task.chunk,
                    )
                )
            except OSError:  # died before the loop saw it: fail its tasks, start another, go on
                self._on_death(worker)
        self._measure()

    def _on_readable(self, worker: _Worker) -> None:
        try:
            done: TaskDone = worker.results.recv()
        except (EOFError, OSError):
            self._on_death(worker)
            return
        worker.answered = time.monotonic()
        entry = worker.pending.pop(done.task_id, None)
        if entry is not None and not entry.future.done():
            entry.future.set_result(Rendered(done.errors, done.targets))
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
            self._measure()
            return
        log.error("decode worker pid %s died with exit code %s; starting a new one", worker.process.pid, code)
        self._restart(worker)

    def _replace_stalled(self, worker: _Worker, silent: float) -> None:
        """Kills a worker that holds work without answering; its tasks go to the others (once)."""
        self.stalls += 1
        log.error(
            "decode worker pid %s held %d task(s) for %.0fs without answering (worker_timeout=%gs: stopped or "
            "wedged); replacing it",
            worker.process.pid,
            len(worker.pending),
            silent,
            self.worker_timeout,
        )
        self._started_loop.remove_reader(worker.results.fileno())
        worker.process.kill()  # SIGKILL: a stopped process dies of it too
        worker.process.join(timeout=1)
        worker.results.close()
        worker.tasks.close()
        again = [q for q in worker.pending.values() if q.tries == 0 and not q.future.done()]
        for queued in reversed(again):  # first in line, in their order
            self._queue.put_first(queued.task.job, queued._replace(tries=1))
        worker.pending = {q.task_id: q for q in worker.pending.values() if q.tries}
        worker.fail(f"decode stalled: no answer within worker_timeout={self.worker_timeout:g}s, twice")
        self._restart(worker)

    def _restart(self, worker: _Worker) -> None:
        """Starts a worker in place of one that is gone, and feeds the queue."""
        index = self._workers.index(worker)
        try:
            self._workers[index] = self._spawn()
        except Exception:  # cannot start one now (fork failed, out of file descriptors...)
            log.exception("could not start a decode worker; %d left", len(self._workers) - 1)
            del self._workers[index]
            if not self._workers:
                while self._queue:
                    queued = self._queue.take()
                    if not queued.future.done():
                        queued.future.set_result(
                            Rendered.failed(len(queued.task.samples), "no decode worker could be started")
                        )
                self._measure()
                return
        self._feed()

    def close(self) -> None:
        """Stops the workers (idempotent); queued and outstanding tasks are failed."""
        if self._closed:
            return
        self._closed = True
        if self._watcher is not None:
            self._watcher.cancel()
        for worker in self._workers:
            try:
                self._started_loop.remove_reader(worker.results.fileno())
                worker.tasks.send(Stop())
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
        self._meter.set(0, 0)
        while self._queue:
            queued = self._queue.take()
            if not queued.future.done():
                queued.future.set_result(Rendered.failed(len(queued.task.samples), "server shutting down"))


class _Worker:
    """One worker process, its two pipe ends, and the tasks it holds."""

    def __init__(self, process: BaseProcess, tasks: Connection, results: Connection):
        self.process = process
        self.tasks = tasks  # write end of the task pipe
        self.results = results  # read end of the result pipe
        self.pending: dict[int, _Queued] = {}
        self.specs: dict[PipelineSpec, int] = {}  # the pipeline specs this worker was sent (DefinePipeline), their ids
        self.answered = time.monotonic()  # its last answer, or when it was given work while idle

    def fail(self, reason: str) -> None:
        for queued in self.pending.values():
            if not queued.future.done():
                queued.future.set_result(Rendered.failed(len(queued.task.samples), reason))
        self.pending.clear()
