"""Rendering one chunk into its slot: worker tasks, region-decode bookkeeping and cache fills.

A task carries its samples' stored targets (when the stream asked for targets): tasks are
cut so that those stay under TASK_TARGET_BYTES, and a task message under what a worker's
task pipe holds.

A chunk's samples are split into tasks for the worker pool so that all workers share it;
the chunk's future completes only when every task has, so its slot is never given back
while a worker may still write into it. Invariants kept here:
* Only a sample that has decoded without error may have just its crop's region decoded
  next time (a region alone cannot see damage outside it); until then, and again after
  it fails, the rest of the file is read with the region (decode.decode_crop(whole=True)),
  which refuses what a whole decode refuses.
* A cache fill stands only if its sample rendered without error; a failed fill keeps its
  space for the next try (shared_memory.SampleCache).
"""

from __future__ import annotations

import asyncio

import numpy as np

from remoteloader.server.catalog import Catalog, Location
from remoteloader.server.fair_queue import Job
from remoteloader.server.order_samples import Samples
from remoteloader.server.pipelines import PipelineSpec
from remoteloader.server.shared_memory import CACHE_FILL, PLAIN_READ, SampleCache
from remoteloader.server.worker_messages import TaskSample
from remoteloader.server.worker_pool import Rendered, Task, WorkerPool

TASK_SAMPLES = 8  # fewest samples per worker task
MAX_TASK_SAMPLES = 32  # most: a task message (paths included) stays well under the 64 KiB a pipe holds
TASK_TARGET_BYTES = 48 << 10  # most stored targets in one task, unless one sample alone has more


class Renderer:
    """Starts rendering chunks of samples into slots through the worker pool.

    Args:
        catalog: The server's shards.
        pool: The decode workers.
        cache: The shared cache of encoded samples, if any.
    """

    def __init__(self, catalog: Catalog, pool: WorkerPool, cache: SampleCache | None):
        self.catalog = catalog
        self.pool = pool
        self.cache = cache
        # Samples that have decoded without error, a byte per sample (by server-wide id): at
        # first those the shard's index knows (Shard.verified), then as samples decode.
        self._decoded = catalog.verified()

    def render(
        self,
        spec: PipelineSpec,
        samples: Samples,
        seeds: list[int],
        slot: int,
        job: Job,
        located: list[Location] | None = None,
        failures: list[str] | None = None,
    ) -> asyncio.Future[Rendered]:
        """Starts rendering samples into a slot, as ``job``'s work; the future gives their Rendered
        once all are done. ``located``: where their bytes are, ``failures``: the reason each fails
        with ("" for none), when the fetching step (server.fetching) has brought them to this
        machine; None: at their shards' own places, with the catalog's failures."""
        if samples.synthetic:  # transport benchmark: the slot already holds pixels
            future: asyncio.Future[Rendered] = asyncio.get_running_loop().create_future()
            future.set_result(Rendered([], [b""] * len(samples) if spec.fields else []))
            return future
        if located is None:
            located = self.catalog.locate(samples.which, samples.indices)
        if failures is None:
            failures = self.catalog.failures(samples.which, samples.indices)
        return self._render(spec, samples, seeds, slot, job, located, failures)

    def _render(
        self,
        spec: PipelineSpec,
        samples: Samples,
        seeds: list[int],
        slot: int,
        job: Job,
        located: list[Location],
        failures: list[str],
    ) -> asyncio.Future[Rendered]:
        """Starts the worker tasks of a chunk whose samples are at ``located`` (those with a
        ``failures`` reason fail with it)."""
        cache = self.cache
        tasks: list[TaskSample | None] = []  # None: a --synthetic sample, never decoded
        fills = []
        ids = samples.ids()
        verified = self._decoded[ids].tolist()
        generated = samples.generated().tolist()
        sources = self.catalog.sources
        shards = self.catalog.shards
        for pos, (sample, w, index) in enumerate(zip(ids.tolist(), samples.which.tolist(), samples.indices.tolist())):
            if generated[pos]:
                tasks.append(None)
                continue
            path, offset, length, _ = located[pos]
            mode, cache_offset = cache.plan(sample, length) if cache is not None else (PLAIN_READ, 0)
            if mode == CACHE_FILL:
                fills.append((pos, sample, cache_offset))
            tasks.append(
                TaskSample(
                    path=path,
                    offset=offset,
                    length=length,
                    cache_mode=mode,
                    cache_offset=cache_offset,
                    verified=verified[pos],
                    targets=shards[w].targets(index) if spec.fields else b"",
                    source=sources[w],
                    failure=failures[pos],
                )
            )
        # Split the chunk so that all workers share it (a task each), in tasks of
        # TASK_SAMPLES..MAX_TASK_SAMPLES samples: small enough to keep task messages small. A clip
        # of T frames costs as much as T images or more: its fewest are TASK_SAMPLES / T, at least 1.
        fewest = max(1, TASK_SAMPLES // max(1, spec.clip_frames * spec.clips_per_video))
        size = min(MAX_TASK_SAMPLES, max(fewest, -(-len(tasks) // self.pool.size)))
        spans = _cut(tasks, size)
        parts = [
            self.pool.submit(Task(slot, first, spec, tasks[first:end], seeds[first:end], len(tasks), job))  # type: ignore[arg-type]
            for first, end in spans
        ]
        future = _merge(parts, spans, len(tasks), bool(spec.fields))

        def done(f: asyncio.Future[Rendered]) -> None:
            # What decoded cleanly may be region-decoded alone next time (what failed is read whole
            # again), and its cache fill stands.
            failed = {pos for pos, _ in f.result().errors} if not f.cancelled() else None
            if failed is not None:
                clean = np.ones(len(ids), np.bool_)
                clean[list(failed)] = False
                self._decoded[ids] = clean
            if cache is not None:
                for pos, sample, cache_offset in fills:
                    cache.filled(sample, cache_offset, failed is not None and pos not in failed)

        future.add_done_callback(done)
        return future


def _cut(samples: list[TaskSample | None], size: int) -> list[tuple[int, int]]:
    """The span (first, end) of each task: every ``size`` samples, and sooner where the samples'
    stored targets would pass TASK_TARGET_BYTES; no task holds a None (a sample not decoded)."""
    spans = []
    first = count = held = 0
    for i, sample in enumerate(samples):
        stored = len(sample.targets) if sample is not None else 0
        if count and (sample is None or count == size or held + stored > TASK_TARGET_BYTES):
            spans.append((first, i))
            count = held = 0
        if sample is None:
            continue
        if not count:
            first = i
        count += 1
        held += stored
    if count:
        spans.append((first, len(samples)))
    return spans


def _merge(
    parts: list[asyncio.Future[Rendered]], spans: list[tuple[int, int]], count: int, with_targets: bool
) -> asyncio.Future[Rendered]:
    """One future for a chunk's ``count`` samples from its tasks (each over its span of them):
    their errors, with positions relative to the chunk, and (``with_targets``) one record per
    sample, in order (b"" for the samples of a task that failed whole, and of none).

    Unlike gather, it completes only when every part has, so the slot is never released
    while a worker may still write into it.
    """
    loop = asyncio.get_running_loop()
    merged: asyncio.Future[Rendered] = loop.create_future()
    remaining = [len(parts)]

    def done(_f: asyncio.Future[Rendered] | None = None) -> None:
        remaining[0] -= 1
        if remaining[0] <= 0 and not merged.done():
            errors: list[tuple[int, str]] = []
            targets: list[bytes] = [b""] * count if with_targets else []
            for (first, end), part in zip(spans, parts):
                rendered = part.result()
                errors.extend((first + pos, reason) for pos, reason in rendered.errors)
                if with_targets and len(rendered.targets) == end - first:
                    targets[first:end] = rendered.targets
            merged.set_result(Rendered(errors, targets))

    for part in parts:
        part.add_done_callback(done)
    if not parts:  # (none of its samples is decoded)
        done()
    return merged
