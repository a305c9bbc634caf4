"""server.fetching, the step before rendering: where no sample is in an object store, a chunk's
rendering starts at once from its shards' own places (the object-store path, with its fetches,
pins and fetch failures, is tested end to end in test_object_store.py and test_azure_and_gcs.py)."""

from __future__ import annotations

import asyncio

import numpy as np

from remoteloader.server.catalog import Catalog, SyntheticShard
from remoteloader.server.fetching import Fetcher
from remoteloader.server.order_samples import Samples
from remoteloader.server.pipelines import PipelineSpec
from remoteloader.server.worker_pool import Rendered

SPEC = PipelineSpec("eval", 32, 32)


def test_a_chunk_with_nothing_in_a_store_renders_at_once_from_its_shards_places():
    catalog = Catalog([SyntheticShard(100)])
    samples = Samples.of_shard(catalog, catalog.shards[0], np.arange(8))
    fetcher = Fetcher(catalog, None)
    fetcher.prefetch(SPEC, samples)  # (nothing to fetch: nothing starts)

    async def main():
        calls = []
        mine: asyncio.Future[Rendered] = asyncio.get_running_loop().create_future()

        def render(located, failures):
            calls.append((located, failures))
            return mine

        future = fetcher.then_render(SPEC, samples, render)
        assert calls == [(None, None)], "the rendering starts in the same turn of the loop, from the shards"
        assert future is mine

    asyncio.run(main())
