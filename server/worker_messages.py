"""What the server's main process and its decode workers say to each other, one class a message.

A worker (worker_process.main) starts with the arena's and the sample cache's descriptors and
a ``WorkerSettings``. Then, on its task pipe, the pool (worker_pool.WorkerPool) sends:

* ``DefinePipeline``: a pipeline spec and the id later tasks name it by, once per worker
  before the first task that uses it (a spec holds up to 64 KiB of JSON; a task holds its id);
* ``RenderTask``: samples (each a ``TaskSample``) to render into a slot;
* ``ForgetPipelines``: drop every spec defined so far (the pool sends it before it would
  define more than a worker keeps);
* ``Stop``: end (so does the pipe's closing).

On its result pipe the worker answers each ``RenderTask`` with one ``TaskDone``, once every
sample of the task is written into the slot. Pixels never travel in a message: the worker
writes them into the shared arena (shared_memory.Arena).

The messages of the task and result pipes are NamedTuples. The dispatch is by type
(``match``), never by position or a string tag; an empty NamedTuple equals any other, so
``ForgetPipelines() == Stop()``: compare types. Pickling a NamedTuple costs a Python call
(about 1 µs a sample, in the event loop that sends tasks), so a RenderTask sends its samples as
plain tuples and the worker makes TaskSamples of them again: a task of 32 samples pickles in
about 13 µs this way, 37 µs as NamedTuples (7 µs as the positional tuples these replaced).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # (the main process imports the pipelines anyway; this module stays light)
    from remoteloader.server.pipelines import PipelineSpec


@dataclass(frozen=True)
class WorkerSettings:
    """How every worker of a pool works: its start argument, made by WorkerPool.

    Args:
        slots: Slots in the arena.
        slot_bytes: Bytes per slot (the worker maps ``slots * slot_bytes``).
        allow_custom: Whether client-sent albumentations pipelines may be built.
        max_pixels: Decode size cap passed to the pipelines.
        cache_bytes: Size of the sample cache (0: none).
        region_decode: Whether the pipelines decode only a crop's region (decode.decode_crop).
        indexed_ns: When the server started indexing its data (time.time_ns()): files written
            later are always read whole (never region-decoded alone).
        sources: The server's ``--source`` (spec, JSON arguments), which each worker loads.
    """

    slots: int
    slot_bytes: int
    allow_custom: bool
    max_pixels: int
    cache_bytes: int
    region_decode: bool
    indexed_ns: int
    sources: tuple[tuple[str, str], ...]


class TaskSample(NamedTuple):
    """One sample of a RenderTask: where its encoded bytes are, and what the main process knows of it."""

    path: str  # its file (or the local copy of its object-store range)
    offset: int  # its bytes' offset in the file; for a --source sample, its index in the source
    length: int  # its bytes' length
    cache_mode: int  # shared_memory.PLAIN_READ, CACHE_READ (from cache_offset) or CACHE_FILL (at cache_offset)
    cache_offset: int
    verified: bool  # it has decoded without error before: its crop's region alone may be decoded
    targets: bytes  # its stored targets (a serialized loader_pb2.Targets); b"" when the stream asked for none
    source: int  # the index of the server's --source object it comes from; -1 for a file
    failure: str  # why its bytes could not be fetched (an object store); "" when they were


class DefinePipeline(NamedTuple):
    """From now on, ``spec_id`` in a RenderTask names ``spec``."""

    spec_id: int
    spec: PipelineSpec


class RenderTask(NamedTuple):
    """Render ``samples`` with the pipeline ``spec_id``, sample ``i`` with ``seeds[i]``, into
    ``slot`` from the slot's sample ``first`` on; the slot's chunk has ``chunk`` samples (its
    masks follow all of its pixels)."""

    task_id: int
    slot: int
    first: int
    spec_id: int
    samples: list[TaskSample]
    seeds: list[int]
    chunk: int

    def __reduce__(self):
        """Pickles with its samples as plain tuples (see the module's docstring)."""
        return _render_task, tuple(self._replace(samples=[tuple(sample) for sample in self.samples]))


class ForgetPipelines(NamedTuple):
    """Every spec_id defined so far is free again."""


class Stop(NamedTuple):
    """The worker ends (the pool is closing)."""


class TaskDone(NamedTuple):
    """The answer to RenderTask ``task_id``, once all its samples are written: those that failed
    as [(position in the task, reason)] (their pixels are zeros) and, when the stream asked for
    targets, each sample's transformed targets (serialized loader_pb2.Targets; b"" for a failed
    one), else []."""

    task_id: int
    errors: list[tuple[int, str]]
    targets: list[bytes]


def _render_task(*fields) -> RenderTask:
    """A RenderTask from its pickled fields (RenderTask.__reduce__)."""
    task = RenderTask._make(fields)
    return task._replace(samples=list(map(TaskSample._make, task.samples)))
