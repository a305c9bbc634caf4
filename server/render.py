"""Rendering one chunk into its slot: worker tasks, region-decode bookkeeping and cache fills.

A task carries its samples' stored targets (when the stream asked for targets): tasks are
cut so that those stay under TASK_TARGET_BYTES, and a task message under what a worker's
task pipe holds.

A chunk's samples are split into tasks for the worker pool so that all workers share it;
the chunk's future completes only when every task has, so its slot is never given back
while a worker may still write into it. Invariants kept here:
* Only a sample that has decoded whole without error may have just its crop's region
  decoded next time (decode.decode_crop cannot see damage outside the region); a sample
  that fails is decoded whole again next time.
* A cache fill stands only if its sample rendered without error; a failed fill keeps its
  space for the next try (shared_memory.SampleCache).
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import numpy as np

from remoteloader.protos import limits, loader_pb2
from remoteloader.protos.wire import RAW
from remoteloader.server.catalog import Catalog, Location
from remoteloader.server.fair_queue import Job
from remoteloader.server.object_cache import ObjectCache
from remoteloader.server.order_samples import Samples
from remoteloader.server.pipelines import PipelineSpec
from remoteloader.server.shared_memory import CACHE_FILL, PLAIN_READ, Arena, SampleCache
from remoteloader.server.targets import MASK
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
        objects: The local copies of object-store samples, where shards are in a store.
    """

    def __init__(
        self, catalog: Catalog, pool: WorkerPool, cache: SampleCache | None, objects: ObjectCache | None = None
    ):
        self.catalog = catalog
        self.pool = pool
        self.cache = cache
        self.objects = objects
        # Samples that have decoded whole without error, a byte per sample (by server-wide id): at
        # first those the shard's index knows (Shard.verified), then as samples decode.
        self._decoded = catalog.verified()

    def prefetch(self, spec: PipelineSpec, samples: Samples) -> None:
        """An order arrived: starts fetching its samples' bytes from their object store (those
        that are in one), so that they are on this machine when its chunks are rendered."""
        if self.objects is not None and samples.remote:
            located = self.catalog.locate(samples.which, samples.indices)
            self.objects.prefetch(_fetches(spec, samples, located).ranges)

    def render(
        self, spec: PipelineSpec, samples: Samples, seeds: list[int], slot: int, job: Job
    ) -> asyncio.Future[Rendered]:
        """Starts rendering samples into a slot, as ``job``'s work; the future gives their Rendered
        once all are done."""
        if samples.synthetic:  # transport benchmark: the slot already holds pixels
            future: asyncio.Future[Rendered] = asyncio.get_running_loop().create_future()
            future.set_result(Rendered([], [b""] * len(samples) if spec.fields else []))
            return future
        located = self.catalog.locate(samples.which, samples.indices)
        failures = self.catalog.failures(samples.which, samples.indices)
        if self.objects is None or not samples.remote:
            return self._render(spec, samples, seeds, slot, job, located, failures)
        fetches = _fetches(spec, samples, located)
        held = self.objects.held_locally(fetches.ranges)
        if held is None:  # some bytes are still to come: the chunk starts when they are here
            fetched = self._render_fetched(spec, samples, seeds, slot, job, located, failures, fetches)
            return asyncio.ensure_future(fetched)
        # All here already (a later epoch): the tasks start now, not a few loop turns from now.
        for pos, location in zip(fetches.owners[: fetches.own], held):
            located[pos] = location
        future = self._render(spec, samples, seeds, slot, job, located, failures)
        ranges = fetches.ranges
        objects = self.objects

        def release(_done: asyncio.Future[Rendered]) -> None:
            objects.release(ranges)

        future.add_done_callback(release)
        return future

    async def _render_fetched(
        self,
        spec: PipelineSpec,
        samples: Samples,
        seeds: list[int],
        slot: int,
        job: Job,
        located: list[Location],
        failures: list[str],
        fetches: _Fetches,
    ) -> Rendered:
        """Renders samples once the byte ranges of those in an object store (``fetches``) are
        local; a fetch that failed fails its sample with the reason."""
        objects = self.objects
        assert objects is not None
        ranges = fetches.ranges
        try:  # (fetch pins the objects before its first await: released even if cancelled)
            reasons = await objects.fetch(ranges)
            for pos, location in zip(fetches.owners[: fetches.own], ranges):
                located[pos] = objects.local(location)
            for owner, reason in zip(fetches.owners, reasons):  # its image's, or its mask member's
                failures[owner] = failures[owner] or reason
            return await asyncio.shield(self._render(spec, samples, seeds, slot, job, located, failures))
        finally:
            objects.release(ranges)

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
            # What decoded cleanly may be region-decoded next time (what failed is decoded whole
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

    def payload(
        self, spec: PipelineSpec, samples: Samples, arena: Arena, slot: int, count: int, errors: list[tuple[int, str]]
    ) -> tuple[memoryview | list[memoryview], list[int]]:
        """A rendered chunk's pixels as they travel, and its ChunkHeader.encoded_sizes: the slot's
        raw pixels (and masks), or with a wire encoding each sample's encoded image (then mask)
        as its worker wrote it, of the sizes in the slot's size table (protos.limits)."""
        image = limits.sample_bytes(spec.height, spec.width)
        mask = spec.height * spec.width if MASK in spec.fields else 0
        if spec.wire == RAW:
            return arena.view(slot, count * (image + mask)), []
        generated = samples.generated()
        if generated.all():  # its pixels were never rendered, so never encoded: raw
            sizes = [image] * count + [mask] * (count if mask else 0)
        else:
            table = np.frombuffer(
                arena.view(slot, arena.slot_bytes),
                "<u4",
                2 * limits.MAX_CHUNK_SAMPLES,
                limits.pixel_bytes(arena.slot_bytes),
            )
            sizes = table[:count].tolist() + (
                table[limits.MAX_CHUNK_SAMPLES : limits.MAX_CHUNK_SAMPLES + count].tolist() if mask else []
            )
            for pos, _ in errors:  # (a task that failed whole left its entries as they were)
                sizes[pos] = 0
                if mask:
                    sizes[count + pos] = 0
            for pos in np.flatnonzero(generated).tolist():  # (no task wrote theirs: raw)
                sizes[pos] = image
                if mask:
                    sizes[count + pos] = mask
        assert all(size <= image for size in sizes[:count]) and all(size <= mask for size in sizes[count:]), (
            "a worker wrote an encoded size over its raw size"
        )
        view = arena.view(slot, count * (image + mask))
        pieces = [view[i * image : i * image + size] for i, size in enumerate(sizes[:count])]
        pieces += [
            view[count * image + i * mask : count * image + i * mask + size] for i, size in enumerate(sizes[count:])
        ]
        return pieces, sizes


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


class _Fetches(NamedTuple):
    """The byte ranges to fetch from object stores for a chunk's samples that are in one: first
    the samples' own (``own`` of them), then (when the stream asks for masks) the mask members of
    those that have one; ``owners``: the chunk position of the sample each range is for."""

    ranges: list[Location]
    owners: list[int]
    own: int


def _fetches(spec: PipelineSpec, samples: Samples, located: list[Location]) -> _Fetches:
    """What to fetch for ``samples``, whose bytes are at ``located`` (their shards' own places)."""
    remote = [pos for pos, (shard, _) in enumerate(samples.pairs()) if shard.remote]
    ranges = [located[pos] for pos in remote]
    owners = list(remote)
    if MASK in spec.fields:
        pairs = list(samples.pairs())
        for pos in remote:
            shard, index = pairs[pos]
            record = shard.targets(index)
            if record:
                stored = loader_pb2.Targets.FromString(record)
                if stored.mask_length:
                    ranges.append(located[pos]._replace(offset=stored.mask_offset, length=stored.mask_length))
                    owners.append(pos)
    return _Fetches(ranges, owners, len(remote))
