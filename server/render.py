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

import numpy as np

from remoteloader.protos import limits, loader_pb2
from remoteloader.protos.wire import RAW
from remoteloader.server.catalog import Location, Shard, SyntheticShard
from remoteloader.server.fair_queue import Job
from remoteloader.server.object_cache import ObjectCache
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
        shards: The server's shards.
        pool: The decode workers.
        cache: The shared cache of encoded samples, if any.
        objects: The local copies of object-store samples, where shards are in a store.
    """

    def __init__(
        self, shards: list[Shard], pool: WorkerPool, cache: SampleCache | None, objects: ObjectCache | None = None
    ):
        self.pool = pool
        self.cache = cache
        self.objects = objects
        # Samples that have decoded whole without error, a byte per sample: at first those the
        # shard's index knows (Shard.verified), then as samples decode.
        self._decoded = {
            s.id: s.verified.copy() if s.verified is not None else np.zeros(len(s), np.bool_) for s in shards
        }

    def prefetch(self, spec: PipelineSpec, shard: Shard, indices: np.ndarray) -> None:
        """An order arrived: starts fetching its samples' bytes from their object store (if they
        are in one), so that they are on this machine when its chunks are rendered."""
        if self.objects is not None and shard.remote:
            self.objects.prefetch(_ranges(spec, shard, indices)[0])

    def render(
        self, spec: PipelineSpec, shard: Shard, indices: np.ndarray, seeds: list[int], slot: int, job: Job
    ) -> asyncio.Future[Rendered]:
        """Starts rendering samples into a slot, as ``job``'s work; the future gives their Rendered
        once all are done."""
        if isinstance(shard, SyntheticShard):  # transport benchmark: the slot already holds pixels
            future: asyncio.Future[Rendered] = asyncio.get_running_loop().create_future()
            future.set_result(Rendered([], [b""] * len(indices) if spec.fields else []))
            return future
        if self.objects is None or not shard.remote:
            positions = indices.tolist()
            located = [shard.locate(i) for i in positions]
            return self._render(spec, shard, indices, seeds, slot, job, located, [shard.failure(i) for i in positions])
        ranges, owners = _ranges(spec, shard, indices)
        held = self.objects.held_locally(ranges)
        if held is None:  # some bytes are still to come: the chunk starts when they are here
            return asyncio.ensure_future(self._render_fetched(spec, shard, indices, seeds, slot, job, ranges, owners))
        # All here already (a later epoch): the tasks start now, not a few loop turns from now.
        known = [shard.failure(i) for i in indices.tolist()]
        future = self._render(spec, shard, indices, seeds, slot, job, held[: len(indices)], known)
        objects = self.objects

        def release(_done: asyncio.Future[Rendered]) -> None:
            objects.release(ranges)

        future.add_done_callback(release)
        return future

    async def _render_fetched(
        self,
        spec: PipelineSpec,
        shard: Shard,
        indices: np.ndarray,
        seeds: list[int],
        slot: int,
        job: Job,
        ranges: list[Location],
        owners: list[int],
    ) -> Rendered:
        """Renders samples of an object store once their ``ranges`` (each for the sample in
        ``owners``) are local; a fetch that failed fails its sample with the reason."""
        objects = self.objects
        assert objects is not None
        try:  # (fetch pins the objects before its first await: released even if cancelled)
            reasons = await objects.fetch(ranges)
            located = [objects.local(location) for location in ranges[: len(indices)]]
            failures = [shard.failure(i) for i in indices.tolist()]
            for owner, reason in zip(owners, reasons):  # its image's, or its mask member's
                failures[owner] = failures[owner] or reason
            return await asyncio.shield(self._render(spec, shard, indices, seeds, slot, job, located, failures))
        finally:
            objects.release(ranges)

    def _render(
        self,
        spec: PipelineSpec,
        shard: Shard,
        indices: np.ndarray,
        seeds: list[int],
        slot: int,
        job: Job,
        located: list[Location],
        failures: list[str],
    ) -> asyncio.Future[Rendered]:
        """Starts the worker tasks of a chunk whose samples are at ``located`` (those with a
        ``failures`` reason fail with it)."""
        cache = self.cache
        samples, fills = [], []
        decoded = self._decoded[shard.id]
        for pos, index in enumerate(indices.tolist()):
            path, offset, length, _ = located[pos]
            mode, cache_offset = cache.plan(shard.id, index, length) if cache is not None else (PLAIN_READ, 0)
            if mode == CACHE_FILL:
                fills.append((pos, index, cache_offset))
            stored = shard.targets(index) if spec.fields else b""
            samples.append(
                TaskSample(
                    path=path,
                    offset=offset,
                    length=length,
                    cache_mode=mode,
                    cache_offset=cache_offset,
                    verified=bool(decoded[index]),
                    targets=stored,
                    source=shard.source,
                    failure=failures[pos],
                )
            )
        # Split the chunk so that all workers share it (a task each), in tasks of
        # TASK_SAMPLES..MAX_TASK_SAMPLES samples: small enough to keep task messages small.
        size = min(MAX_TASK_SAMPLES, max(TASK_SAMPLES, -(-len(samples) // self.pool.size)))
        firsts = _cut(samples, size)
        parts = [
            self.pool.submit(Task(slot, first, spec, samples[first:end], seeds[first:end], len(samples), job))
            for first, end in zip(firsts, [*firsts[1:], len(samples)])
        ]
        future = _merge(parts, firsts, len(samples), bool(spec.fields))

        def done(f: asyncio.Future[Rendered]) -> None:
            # What decoded cleanly may be region-decoded next time, and its cache fill stands.
            failed = {pos for pos, _ in f.result().errors} if not f.cancelled() else None
            if failed is not None:
                ok = np.ones(len(indices), np.bool_)
                ok[list(failed)] = False
                decoded[indices[~ok]] = False  # decoded whole again next time
                decoded[indices[ok]] = True
            if cache is not None:
                for pos, index, cache_offset in fills:
                    cache.filled(shard.id, index, cache_offset, failed is not None and pos not in failed)

        future.add_done_callback(done)
        return future

    def payload(
        self, spec: PipelineSpec, shard: Shard, arena: Arena, slot: int, count: int, errors: list[tuple[int, str]]
    ) -> tuple[memoryview | list[memoryview], list[int]]:
        """A rendered chunk's pixels as they travel, and its ChunkHeader.encoded_sizes: the slot's
        raw pixels (and masks), or with a wire encoding each sample's encoded image (then mask)
        as its worker wrote it, of the sizes in the slot's size table (protos.limits)."""
        image = limits.sample_bytes(spec.height, spec.width)
        mask = spec.height * spec.width if MASK in spec.fields else 0
        if spec.wire == RAW:
            return arena.view(slot, count * (image + mask)), []
        if isinstance(shard, SyntheticShard):  # its pixels were never rendered, so never encoded: raw
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
        assert all(size <= image for size in sizes[:count]) and all(size <= mask for size in sizes[count:]), (
            "a worker wrote an encoded size over its raw size"
        )
        view = arena.view(slot, count * (image + mask))
        pieces = [view[i * image : i * image + size] for i, size in enumerate(sizes[:count])]
        pieces += [
            view[count * image + i * mask : count * image + i * mask + size] for i, size in enumerate(sizes[count:])
        ]
        return pieces, sizes


def _cut(samples: list[TaskSample], size: int) -> list[int]:
    """The first sample of each task: every ``size`` samples, and sooner where the samples' stored
    targets would pass TASK_TARGET_BYTES."""
    firsts = [0]
    count = held = 0
    for i, sample in enumerate(samples):
        stored = len(sample.targets)
        if count and (count == size or held + stored > TASK_TARGET_BYTES):
            firsts.append(i)
            count = held = 0
        count += 1
        held += stored
    return firsts if samples else []


def _merge(
    parts: list[asyncio.Future[Rendered]], firsts: list[int], count: int, with_targets: bool
) -> asyncio.Future[Rendered]:
    """One future for a chunk's ``count`` samples from its tasks: their errors, with positions
    relative to the chunk, and (``with_targets``) one record per sample, in order (b"" for the
    samples of a task that failed whole).

    Unlike gather, it completes only when every part has, so the slot is never released
    while a worker may still write into it.
    """
    loop = asyncio.get_running_loop()
    merged: asyncio.Future[Rendered] = loop.create_future()
    remaining = [len(parts)]

    def done(_f: asyncio.Future[Rendered]) -> None:
        remaining[0] -= 1
        if remaining[0] == 0 and not merged.done():
            errors: list[tuple[int, str]] = []
            targets: list[bytes] = []
            for first, end, part in zip(firsts, [*firsts[1:], count], parts):
                rendered = part.result()
                errors.extend((first + pos, reason) for pos, reason in rendered.errors)
                if with_targets:
                    targets.extend(rendered.targets if len(rendered.targets) == end - first else [b""] * (end - first))
            merged.set_result(Rendered(errors, targets))

    for part in parts:
        part.add_done_callback(done)
    return merged


def _ranges(spec: PipelineSpec, shard: Shard, indices: np.ndarray) -> tuple[list[Location], list[int]]:
    """The byte ranges a chunk's samples are read from, and the sample each is for: the samples'
    own, then (when the stream asks for masks) the mask members of those that have one."""
    located = [shard.locate(i) for i in indices.tolist()]
    owners = list(range(len(located)))
    if MASK in spec.fields:
        for pos, (index, location) in enumerate(zip(indices.tolist(), located[:])):
            record = shard.targets(index)
            if record:
                stored = loader_pb2.Targets.FromString(record)
                if stored.mask_length:
                    located.append(location._replace(offset=stored.mask_offset, length=stored.mask_length))
                    owners.append(pos)
    return located, owners
