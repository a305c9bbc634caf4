"""Fetching a chunk's object-store bytes, the step before it is rendered (and asking for the
read-ahead of those on this machine's disk: server.read_ahead).

Where a chunk's samples are in an object store (``Shard.remote``), their byte ranges (and, when
the stream asks for masks, their mask members') are fetched to this machine first; the chunk is
then rendered from the local copies (server.object_cache). Invariants:
* An order's fetches start when it arrives (``prefetch``), so that its bytes come while earlier
  chunks render; each chunk still waits for its own (``then_render``).
* A chunk's ranges are pinned (never evicted) from before its fetch until its rendering is done,
  even if the rendering or the wait for the fetch is cancelled.
* A range that could not be fetched fails its sample with the reason (its image's, or its mask
  member's); the other samples render.
* A chunk whose bytes are all local already (an epoch after the first) starts rendering at
  once, not a few loop turns later; one with no sample in a store is not looked at here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from remoteloader.protos import loader_pb2
from remoteloader.server.catalog import Catalog, Location
from remoteloader.server.object_cache import ObjectCache
from remoteloader.server.order_samples import Samples
from remoteloader.server.pipelines import PipelineSpec
from remoteloader.server.read_ahead import ReadAhead
from remoteloader.server.targets import MASK
from remoteloader.server.worker_pool import Rendered

# Starts a chunk's rendering from where its samples' bytes are (``located``) and the reason
# each fails with ("" for none): render.Renderer.render with the chunk's other arguments bound.
RenderFrom = Callable[[list[Location] | None, list[str] | None], "asyncio.Future[Rendered]"]


class Fetcher:
    """Brings chunks' object-store bytes to this machine before they are rendered.

    Args:
        catalog: The server's shards.
        objects: The local copies of object-store samples; None where no shard is in a store.
        read_ahead: Asks the kernel to read local samples' bytes; None: they are read when rendered.
    """

    def __init__(self, catalog: Catalog, objects: ObjectCache | None, read_ahead: ReadAhead | None = None):
        self.catalog = catalog
        self.objects = objects
        self.read_ahead = read_ahead

    def prefetch(self, spec: PipelineSpec, samples: Samples) -> None:
        """An order arrived: starts fetching its samples' bytes from their object store (those
        that are in one), and the read-ahead of the others, so that they are on this machine
        (in its page cache) when its chunks are rendered."""
        remote = samples.remote
        if (self.objects is None or not remote) and (self.read_ahead is None or samples.synthetic):
            return
        located = self.catalog.locate(samples.which, samples.indices)
        if self.objects is not None and remote:
            self.objects.prefetch(_fetches(spec, samples, located).ranges)
        if self.read_ahead is not None:
            elsewhere = self.catalog.remote[samples.which] | self.catalog.generated[samples.which]
            if not elsewhere.all():
                self.read_ahead.ask([located[pos] for pos in np.flatnonzero(~elsewhere).tolist()])

    def then_render(self, spec: PipelineSpec, samples: Samples, render: RenderFrom) -> asyncio.Future[Rendered]:
        """Starts ``render`` once ``samples``' bytes are on this machine: at once with (None,
        None) where none of them is in a store (the renderer reads their shards' own places),
        else with where the local copies are and the samples' failures, fetch failures included."""
        if self.objects is None or not samples.remote or samples.synthetic:
            return render(None, None)
        located = self.catalog.locate(samples.which, samples.indices)
        failures = self.catalog.failures(samples.which, samples.indices)
        fetches = _fetches(spec, samples, located)
        held = self.objects.held_locally(fetches.ranges)
        if held is None:  # some bytes are still to come: the chunk starts when they are here
            return asyncio.ensure_future(self._render_fetched(render, located, failures, fetches))
        # All here already (a later epoch): the tasks start now, not a few loop turns from now.
        for pos, location in zip(fetches.owners[: fetches.own], held):
            located[pos] = location
        future = render(located, failures)
        ranges = fetches.ranges
        objects = self.objects

        def release(_done: asyncio.Future[Rendered]) -> None:
            objects.release(ranges)

        future.add_done_callback(release)
        return future

    async def _render_fetched(
        self, render: RenderFrom, located: list[Location], failures: list[str], fetches: _Fetches
    ) -> Rendered:
        """Renders once the byte ranges of the samples in an object store (``fetches``) are
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
            return await asyncio.shield(render(located, failures))
        finally:
            objects.release(ranges)


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
