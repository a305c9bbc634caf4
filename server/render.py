"""Rendering one chunk into its slot: worker tasks, region-decode bookkeeping and cache fills.

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

from remoteloader.server.catalog import Shard, SyntheticShard
from remoteloader.server.pipelines import PipelineSpec
from remoteloader.server.shared_memory import CACHE_FILL, PLAIN_READ, SampleCache
from remoteloader.server.worker_pool import Task, WorkerPool

TASK_SAMPLES = 8  # fewest samples per worker task
MAX_TASK_SAMPLES = 32  # most: a task message (paths included) stays well under the 64 KiB a pipe holds

SampleErrors = list[tuple[int, str]]  # [(position in the chunk, reason)]


class Renderer:
    """Starts rendering chunks of samples into slots through the worker pool.

    Args:
        shards: The server's shards.
        pool: The decode workers.
        cache: The shared cache of encoded samples, if any.
    """

    def __init__(self, shards: list[Shard], pool: WorkerPool, cache: SampleCache | None):
        self.pool = pool
        self.cache = cache
        # Samples that have decoded whole without error, a byte per sample, in pages touched
        # only as samples are marked.
        self._decoded = {s.id: np.zeros(len(s), np.bool_) for s in shards}

    def render(
        self, spec: PipelineSpec, shard: Shard, indices: np.ndarray, seeds: list[int], slot: int
    ) -> asyncio.Future[SampleErrors]:
        """Starts rendering samples into a slot; the future gives [(position, reason)] once all are done."""
        if isinstance(shard, SyntheticShard):  # transport benchmark: the slot already holds pixels
            future: asyncio.Future[SampleErrors] = asyncio.get_running_loop().create_future()
            future.set_result([])
            return future
        cache = self.cache
        locations, fills = [], []
        decoded = self._decoded[shard.id]
        for pos, index in enumerate(indices.tolist()):
            path, offset, length = shard.locate(index)
            mode, cache_offset = cache.plan(shard.id, index, length) if cache is not None else (PLAIN_READ, 0)
            if mode == CACHE_FILL:
                fills.append((pos, index, cache_offset))
            locations.append((path, offset, length, mode, cache_offset, bool(decoded[index])))
        # Split the chunk so that all workers share it (two tasks each), in tasks of
        # TASK_SAMPLES..MAX_TASK_SAMPLES samples: small enough to keep task messages small.
        size = min(MAX_TASK_SAMPLES, max(TASK_SAMPLES, -(-len(locations) // (2 * self.pool.size))))
        spec_tuple = (spec.name, spec.height, spec.width, spec.albumentations_json)
        firsts = range(0, len(locations), size)
        parts = [
            self.pool.submit(
                Task(slot, first, spec_tuple, locations[first : first + size], seeds[first : first + size])
            )
            for first in firsts
        ]
        future = _merge(parts, list(firsts))

        def done(f: asyncio.Future[SampleErrors]) -> None:
            # What decoded cleanly may be region-decoded next time, and its cache fill stands.
            failed = {pos for pos, _ in f.result()} if not f.cancelled() else None
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


def _merge(parts: list[asyncio.Future[SampleErrors]], firsts: list[int]) -> asyncio.Future[SampleErrors]:
    """One future for a chunk's tasks: their errors, with positions relative to the chunk.

    Unlike gather, it completes only when every part has, so the slot is never released
    while a worker may still write into it.
    """
    loop = asyncio.get_running_loop()
    merged: asyncio.Future[SampleErrors] = loop.create_future()
    remaining = [len(parts)]

    def done(_f: asyncio.Future[SampleErrors]) -> None:
        remaining[0] -= 1
        if remaining[0] == 0 and not merged.done():
            errors: SampleErrors = []
            for first, part in zip(firsts, parts):
                errors.extend((first + pos, reason) for pos, reason in part.result())
            merged.set_result(errors)

    for part in parts:
        part.add_done_callback(done)
    return merged
